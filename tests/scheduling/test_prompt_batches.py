"""The engine core's next-token batches in process, over a fake engine: batch formation, the wait
after a pause, and the out-of-memory split, in milliseconds (the wire-level behaviour is tested
on real servers)."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from support.fake_generator import FakeGenerator

from gpt2serve.errors import ResourceExhausted, ShuttingDown
from gpt2serve.protocol import SamplingParams, StepControls, TraceContext
from gpt2serve.scheduling.core import EngineCore
from gpt2serve.scheduling.scheduler import EngineRequest, next_token_request

DELAY_S = 0.1  # --max-batch-delay-ms 100: long enough to see on a busy machine


def batcher_for(engine: FakeGenerator, **limits) -> EngineCore:
    return EngineCore(engine, **{"max_batch_size": 64, "max_batch_delay_s": DELAY_S, "max_queue": 1024,
                                       "max_batch_tokens": 10**6, **limits})


def test_a_burst_forms_one_batch_and_every_caller_gets_its_own_answer():
    engine = FakeGenerator()

    async def main():
        batcher = batcher_for(engine)
        batcher.start()
        try:
            return await asyncio.gather(*(batcher.submit([[i, 1]], top_k=2) for i in range(16)))
        finally:
            await batcher.stop()

    answers = asyncio.run(main())
    assert engine.batch_sizes == [16]  # all queued before the batcher looked: one batch
    for i, (out,) in enumerate(answers):
        assert [s.token_id for s in out.top] == [i + 1, i + 2]


def test_a_lone_request_after_a_burst_and_a_pause_does_not_wait_for_the_burst():
    """Closed-loop callers come back within the return window; after a pause they are gone,
    and a lone request must not wait --max-batch-delay-ms for them."""
    engine = FakeGenerator(forward_s=0.005)
    delay_s = 0.5  # long beside a busy machine's stalls: waiting for it could not pass unseen

    async def main():
        batcher = batcher_for(engine, max_batch_delay_s=delay_s)
        batcher.start()
        try:
            for _ in range(3):  # a burst of 32 callers, each coming straight back
                await asyncio.gather(*(batcher.submit([[i]], top_k=1) for i in range(32)))
            await asyncio.sleep(4 * delay_s)  # the callers are gone (past the return window of 3 delays)
            started = time.perf_counter()
            (lone,) = await batcher.submit([[7]], top_k=1)
            return lone, time.perf_counter() - started
        finally:
            await batcher.stop()

    lone, took = asyncio.run(main())
    assert lone.batch_size == 1
    assert lone.queue_s < delay_s / 2 and took < delay_s, (lone.queue_s, took)


def test_closed_loop_callers_keep_full_batches():
    engine = FakeGenerator(forward_s=0.02)

    async def main():
        batcher = batcher_for(engine)
        batcher.start()

        async def caller(i: int) -> None:
            for _ in range(6):
                await batcher.submit([[i]], top_k=1)

        try:
            await asyncio.gather(*(caller(i) for i in range(24)))
        finally:
            await batcher.stop()

    asyncio.run(main())
    assert engine.batch_sizes[-4:] == [24] * 4, engine.batch_sizes


def test_out_of_memory_splits_until_the_halves_fit():
    engine = FakeGenerator(oom_above=5)

    async def main():
        batcher = batcher_for(engine)
        batcher.start()
        try:
            return await batcher.submit([[i] for i in range(20)], top_k=1)
        finally:
            await batcher.stop()

    answers = asyncio.run(main())
    assert engine.batch_sizes == [5, 5, 5, 5]
    assert [out.top[0].token_id for out in answers] == list(range(20))


def test_prompts_count_as_waiting_then_running():
    """What the router gauges read: ten prompts and batches of four, so while the first forward
    runs, four are running and six wait; nothing is counted once all are answered."""
    engine = FakeGenerator(forward_s=0.3)

    async def main():
        batcher = batcher_for(engine, max_batch_size=4)
        batcher.start()
        try:
            answers = asyncio.gather(*(batcher.submit([[i, 1]], top_k=1) for i in range(10)))
            await asyncio.sleep(0.1)  # inside the first forward
            during = (batcher.prompts_running, batcher.queue_depth)
            await answers
            return during, (batcher.prompts_running, batcher.queue_depth)
        finally:
            await batcher.stop()

    during, after = asyncio.run(main())
    assert during == (4, 6)
    assert after == (0, 0)


class ColumnCalls:
    """One-prompt calls answered from their top tokens alone, all through this one output (as a
    front end's ipc.engine_answers.PlainCalls): each call's answer or error lands in its future."""

    answers_top, finished = True, False

    def __init__(self, loop: asyncio.AbstractEventLoop, core: EngineCore, n: int):
        self.core, self.answered = core, [loop.create_future() for _ in range(n)]

    @staticmethod
    def answer_tops(requests, rows, tops, started, cached_tokens, forward_s, batch_size, batch_started_ns):
        for request, row in zip(requests, rows):
            request.output.answered[request.request_id].set_result((tops[row], batch_size))

    def fail(self, error, request):
        self.core.cancel_requests([request])
        self.answered[request.request_id].set_exception(error)


def test_a_next_token_request_is_the_one_the_dataclass_would_make():
    """next_token_request sets every slot EngineRequest's own __init__ would, to the same values,
    for a plain call and for a traced, scored prompt of a group: a field added to the dataclass
    and not to next_token_request is an unset slot here."""
    output, trace, controls = object(), TraceContext("00-" + "1" * 32 + "-" + "2" * 16 + "-01", True), \
        StepControls(SamplingParams(temperature=0.5), 3)
    made = [next_token_request([5, 6], 3, output, 0, 41, 1.5, 7),
            next_token_request([5], 2, output, 4, -1, 2.5, 9, trace, 6, controls)]
    expected = [EngineRequest([5, 6], 0, 3, output=output, request_id=41, arrived=1.5, arrived_ns=7),
                EngineRequest([5], 0, 2, output=output, row=4, arrived=2.5, arrived_ns=9, trace=trace,
                              prompt_logprobs=6, controls=controls)]
    for request, reference in zip(made, expected):
        for f in dataclasses.fields(EngineRequest):
            assert getattr(request, f.name) == getattr(reference, f.name), f.name


def test_calls_queued_together_are_answered_one_by_one_and_refused_past_the_queue():
    """queue_calls (the IPC door's Prompts message): the calls the queue has room for are queued
    under one lock and answered each from its top tokens; the rest get queue full, and none of
    them counts as waiting once answered."""
    engine = FakeGenerator(forward_s=0.05)

    async def main():
        core = batcher_for(engine, max_queue=6)
        core.start()
        try:
            calls = ColumnCalls(asyncio.get_running_loop(), core, 8)
            requests, refusal = core.queue_calls([[i, 1] for i in range(8)], [2] * 8, range(8), calls)
            waiting = core.queue_depth
            core.wake()
            answers = await asyncio.gather(*calls.answered[:len(requests)])
            for refused in calls.answered[len(requests):]:
                refused.cancel()  # the IPC door tells these callers queue full instead
            return len(requests), refusal, waiting, answers, core.queue_depth
        finally:
            await core.stop()

    queued, refusal, waiting, answers, after = asyncio.run(main())
    assert (queued, waiting, after) == (6, 6, 0)
    assert isinstance(refusal, ResourceExhausted) and "queue full" in refusal.message
    assert [[s.token_id for s in top] for top, _ in answers] == [[i + 1, i + 2] for i in range(6)]
    assert {size for _, size in answers} == {6}  # one batch


def test_a_call_that_fails_stops_counting_as_waiting():
    """A queued call told an error (the core stopping) leaves the waiting count as a group would."""
    engine = FakeGenerator(forward_s=0.3)

    async def main():
        core = batcher_for(engine, max_batch_size=1)
        core.start()
        calls = ColumnCalls(asyncio.get_running_loop(), core, 3)
        core.queue_calls([[i] for i in range(3)], [1] * 3, range(3), calls)
        core.wake()
        await asyncio.sleep(0.1)  # the first in its forward, two waiting
        waiting = core.queue_depth
        await core.stop()
        results = await asyncio.gather(*calls.answered, return_exceptions=True)
        return waiting, results, core.queue_depth

    waiting, results, after = asyncio.run(main())
    assert waiting == 2 and after == 0
    assert any(isinstance(r, ShuttingDown) for r in results), results
