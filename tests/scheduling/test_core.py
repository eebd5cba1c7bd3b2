"""The engine core with a real engine: one scheduler for next-token prompts and generations.

A next-token prompt that arrives while generations run rides their next decode step (one
forward for both, engine.step_forward): its answer and theirs must each be what they would be alone.
"""

from __future__ import annotations

import asyncio

import torch

import pytest

from support.generation import GREEDY, PROMPTS, generation_core, lively_engine, transformers_greedy
from support.reference import as_result, assert_matches_reference, assert_prompt_scores_match
from support.scheduler_events import StepRecorder, events

from gpt2serve.engine.generator import Generator
from gpt2serve.engine.steps import PromptLaunch
from gpt2serve.protocol import GenerateRequest, TraceContext


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return lively_engine(tmp_path_factory.mktemp("core"))


async def drain(stream) -> list:
    return [e async for e in stream]


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_a_next_token_prompt_rides_the_next_decode_step_of_running_streams(saved, overlap):
    hf, engine = saved
    generator = Generator(engine, slots=4)
    calls = {"next_token": 0}
    real_next_token = engine.next_token

    def counting_next_token(*args, **kwargs):
        calls["next_token"] += 1
        return real_next_token(*args, **kwargs)

    engine.next_token = counting_next_token
    recorder = StepRecorder()
    riders = [PROMPTS[7], PROMPTS[2], PROMPTS[11]]  # 22, 7 and 34 tokens: rows of three lengths

    async def main():
        core = generation_core(generator, observer=recorder, overlap=overlap)
        core.start()
        try:
            streams = [events(core, GenerateRequest(PROMPTS[i], GREEDY, 24)) for i in (3, 5)]
            firsts = [await anext(s) for s in streams]  # both running now
            answers = await asyncio.gather(*(core.submit([p], top_k=5) for p in riders))
            rest = await asyncio.gather(*(drain(s) for s in streams))
            return [[f.token.token_id] + [e.token.token_id for e in r] for f, r in zip(firsts, rest)], answers
        finally:
            await core.stop()

    try:
        streamed, answers = asyncio.run(main())
    finally:
        del engine.next_token
    assert calls["next_token"] == 0  # no forward of their own
    decodes = {s.started_ns: s for s in recorder.steps if s.kind == "decode"}
    for prompt, (answer,) in zip(riders, answers):
        assert answer.batch_started_ns in decodes  # the forward of a decode step
        assert decodes[answer.batch_started_ns].rows == 2  # beside both streams
        assert_matches_reference(hf, as_result(prompt, answer.top), prompt, top_k=5)
    for i, tokens in zip((3, 5), streamed):  # the streams they rode are untouched
        assert tokens == transformers_greedy(hf, PROMPTS[i], 24)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_each_decode_step_is_launched_before_the_last_one_is_read_where_the_core_overlaps(saved, overlap):
    """Overlapped (as on cuda), step N+1 is queued while step N may still run: two steps are
    unread at once, the tokens are what they are alone, and the last step of streams that all
    end by length is not followed by a step of wasted rows."""
    hf, engine = saved
    generator = Generator(engine, slots=4)
    unread, most_unread, launches = [0], [0], [0]
    launch, finish = generator.launch, generator.finish

    def counting_launch(plan):
        step = launch(plan)
        launches[0] += plan.decode  # a prefill's plan has no decode rows
        unread[0] += 1
        most_unread[0] = max(most_unread[0], unread[0])
        return step

    def counting_finish(step):
        unread[0] -= 1
        return finish(step)

    generator.launch, generator.finish = counting_launch, counting_finish

    async def main():
        core = generation_core(generator, overlap=overlap)
        core.start()
        try:
            # both in one prefill: arrive before the core's first step
            return await asyncio.gather(*(drain(events(core, GenerateRequest(PROMPTS[i], GREEDY, 12)))
                                          for i in (3, 5)))
        finally:
            await core.stop()

    streamed = asyncio.run(main())
    for i, stream in zip((3, 5), streamed):
        assert [e.token.token_id for e in stream] == transformers_greedy(hf, PROMPTS[i], 12)
        assert stream[-1].finish_reason == "length"
    assert most_unread[0] == (2 if overlap else 1)
    assert launches[0] == 11  # 12 tokens: the prefill's and 11 decode steps'
    assert unread[0] == 0


def run_beside_a_stream(generator, submit):
    """A 12-token stream, and once it runs `submit(core)`'s answers -> (answers, the stream's events)."""
    async def main():
        core = generation_core(generator, observer=recorder)
        core.start()
        try:
            stream = events(core, GenerateRequest(PROMPTS[4], GREEDY, 12))
            await anext(stream)
            answers = await submit(core)
            return answers, [e async for e in stream]
        finally:
            await core.stop()

    recorder = StepRecorder()
    answers, rest = asyncio.run(main())
    return answers, rest, recorder


def test_a_scored_prompt_rides_the_decode_step_with_every_position_scored(saved):
    """prompt_logprobs is a field of the row (engine.step_forward), not a route of its own."""
    hf, engine = saved
    generator = Generator(engine, slots=2)
    (answer,), rest, recorder = run_beside_a_stream(
        generator, lambda core: core.submit([PROMPTS[6]], top_k=3, prompt_logprobs=2))
    decodes = {s.started_ns: s for s in recorder.steps if s.kind == "decode"}
    assert answer.batch_started_ns in decodes and decodes[answer.batch_started_ns].rows == 1
    s = answer.prompt_logprobs
    assert_prompt_scores_match(hf, PROMPTS[6], s.token_logprobs, s.ranks, s.top_ids, s.top_logprobs)
    assert_matches_reference(hf, as_result(PROMPTS[6], answer.top), PROMPTS[6], top_k=3)
    assert [e.token.token_id for e in rest] == transformers_greedy(hf, PROMPTS[4], 12)[1:]


def test_a_prompt_that_cannot_ride_takes_its_own_forward_in_the_same_step(saved):
    """A layer trace needs the whole forward's taps: not a rider; answered all the same."""
    hf, engine = saved
    generator = Generator(engine, slots=2)
    traced = TraceContext(layers_wanted=True, layers_in_response=True)
    (answer,), rest, recorder = run_beside_a_stream(generator, lambda core: core.submit([PROMPTS[6]], 3, traced))
    assert answer.batch_started_ns not in {s.started_ns for s in recorder.steps}
    assert answer.layers and len(answer.layers) == engine.model.config.n_layer
    assert_matches_reference(hf, as_result(PROMPTS[6], answer.top), PROMPTS[6], top_k=3)
    assert len(rest) == 11 and rest[-1].finish_reason == "length"


def test_answered_and_cancelled_next_token_requests_leave_no_cyclic_garbage(saved):
    """At thousands of requests a second, each one left in a reference cycle made the garbage
    collector's full passes a third of the engine process's CPU (PromptGroup releases itself)."""
    _, engine = saved
    import gc

    async def main() -> tuple[list, int]:
        core = generation_core(Generator(engine, slots=2))
        core.start()
        answers, done = [], asyncio.Event()

        def answered(result) -> None:
            answers.append(result)
            if len(answers) == 20:
                done.set()

        try:
            gc.collect()
            gc.disable()
            for i in range(20):
                core.queue_prompts([PROMPTS[i % 8], PROMPTS[(i + 1) % 8]], 3, None, None, answered)
            left = [core.queue_prompts([PROMPTS[1]], 3, None, None, answered) for _ in range(5)]
            for group in left:
                core.cancel_prompts(group)  # callers that left before their answer
            await asyncio.wait_for(done.wait(), 60)
            await asyncio.sleep(0.05)  # the step's telemetry and the cancelled prompts' turn
            garbage = gc.collect()
        finally:
            gc.enable()
            await core.stop()
        return answers, garbage

    answers, garbage = asyncio.run(main())
    assert all(isinstance(a, list) and len(a) == 2 and len(a[0].top) == 3 for a in answers)
    assert garbage == 0


def test_a_prefill_out_of_device_memory_runs_again_as_halves_and_every_stream_gets_its_tokens(saved, caplog):
    """As a CUDA out-of-memory does on a card (there is none here), a prefill of more than two
    prompts raises after its rows went into the cache: the generator takes them out again (all
    or none), and the core runs each half on its own; no stream fails or sees another's tokens."""
    hf, engine = saved
    generator = Generator(engine, slots=8)
    real_part = generator._read_rows
    calls: list[int] = []

    running_ids: list[list[int]] = []

    def launch(plan):
        if plan.decode:
            return real_launch(plan)
        calls.append(len(plan.joining))  # a prefill
        try:
            return real_launch(plan)
        finally:
            running_ids.append([r.seq_id for r in generator.running])

    def part(decode, last, lengths, riders, sequences, chunk_rows, plans, first, **kwargs):
        output = real_part(decode, last, lengths, riders, sequences, chunk_rows, plans, first, **kwargs)
        if calls[-1] > 2 and first + len(sequences) == len(generator.running):  # its rows joined the running
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
        return output

    real_launch = generator.launch
    generator.launch, generator._read_rows = launch, part
    wanted = (3, 5, 7, 9)

    async def main():
        core = generation_core(generator)
        core.start()
        try:
            streams = [events(core, GenerateRequest(PROMPTS[i], GREEDY, 8)) for i in wanted]
            return await asyncio.gather(*(drain(s) for s in streams))
        finally:
            await core.stop()

    with caplog.at_level("WARNING", logger="gpt2serve.scheduling.runner"):
        streamed = asyncio.run(main())
    assert calls[0] == 4 and calls[1:3] == [2, 2], calls  # all four at once, then two halves
    assert "retrying it as two halves" in caplog.text
    for i, got in zip(wanted, streamed):
        assert [e.token.token_id for e in got] == transformers_greedy(hf, PROMPTS[i], 8)
    assert running_ids[0] == []  # the failed prefill left no row behind
    assert len(running_ids[2]) == len(set(running_ids[2])) == 4  # each sequence in one slot


def test_next_token_batches_launch_before_the_last_is_read_and_answer_as_alone(saved):
    """On cuda the core launches a plain next-token batch (engine.cuda_graphs.BucketedForward.launch) and reads the one
    before it while it runs. Here the bucketed path without capture, overlap forced as on cuda:
    callers arriving in waves over one another's batches each get their prompt's own answer; with
    a backlog (more callers than a batch holds) a batch was launched while another was in
    flight; a launched batch with nothing after it is read once the core is idle; and a lone
    caller's batch, with no backlog, is read at once, not held for the next step."""
    hf, engine = saved
    engine.graphs = engine.bucketed(capture=False)
    log: list[tuple[str, int]] = []
    launch, finish = engine.graphs.launch, engine.finish_prompts

    def logged_launch(prompts, top_ks, looked_up):
        launched = launch(prompts, top_ks, looked_up)
        if launched is not None:  # queued, not run whole
            log.append(("launch", len(prompts)))
        return launched

    def logged_finish(step):
        if isinstance(step.prompts, PromptLaunch):
            log.append(("read", len(step.prompts.top_ks)))
        return finish(step)

    engine.graphs.launch, engine.finish_prompts = logged_launch, logged_finish
    prompts = [PROMPTS[i % len(PROMPTS)][:12] for i in range(200)]  # batches of 64 (generation_core)

    async def main():
        core = generation_core(Generator(engine, slots=2), overlap=True, max_queue=512)
        read_held = core.runner.finish_prompts_in_flight

        def held():  # the runner reads a batch it held in flight
            if core.runner.prompts_in_flight is not None:
                log.append(("held", len(core.runner.prompts_in_flight[1])))
            read_held()

        core.runner.finish_prompts_in_flight = held
        core.start()
        try:
            async def caller(i: int):
                await asyncio.sleep(0.002 * (i % 6) if i >= 150 else 0)
                (answer,) = await core.submit([prompts[i]], top_k=3)
                return answer
            answers = await asyncio.wait_for(asyncio.gather(*(caller(i) for i in range(len(prompts)))), 60)
            # Two full batches and nothing after: the second, launched, is read once the core is idle.
            last = await asyncio.wait_for(core.submit(prompts[:128], top_k=3), 30)  # queued at once
            (alone,) = await asyncio.wait_for(core.submit([PROMPTS[3]], top_k=2), 10)
            return answers + list(last), alone
        finally:
            await core.stop()

    try:
        answers, alone = asyncio.run(main())
    finally:
        del engine.finish_prompts
        engine.graphs = None
    for prompt, answer in zip(prompts + prompts[:128], answers):
        assert_matches_reference(hf, as_result(prompt, answer.top), prompt, top_k=3)
    assert_matches_reference(hf, as_result(PROMPTS[3], alone.top), PROMPTS[3], top_k=2)
    in_flight, most = 0, 0
    for kind, _ in log:
        in_flight += {"launch": 1, "read": -1, "held": 0}[kind]
        most = max(most, in_flight)
    assert most == 2, ("no batch was launched while another was in flight", log)
    assert in_flight == 0, "a launched batch was never read"
    assert ("held", 64) in log, "a full batch was not held in flight"
    assert log[-2:] == [("launch", 1), ("read", 1)], ("the lone caller's batch was held", log[-4:])
