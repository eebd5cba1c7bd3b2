"""One token budget a step (scheduling.scheduler), where prompts share the decode step's forward:
decode rows first, then a long prompt's chunk, then admitted prompts while they fit. A wave of
prompts arriving while a stream runs is read over several steps of at most the budget, never in
a prefill of its own that would stall the stream; a chunk shrinks to what the decode rows leave.
Every token is still the one transformers gives each prompt alone."""

from __future__ import annotations

import asyncio

import pytest

from support.generation import GREEDY, PROMPTS, lively_engine, transformers_greedy
from support.reference import as_result, assert_matches_reference
from support.scheduler_events import StepRecorder, events

from gpt2serve.engine.generator import Generator
from gpt2serve.engine.steps import Ask
from gpt2serve.protocol import GenerateRequest
from gpt2serve.scheduling.core import EngineCore, new_engine_thread
from gpt2serve.scheduling.scheduler import EngineRequest, Scheduler

WAVE = [[(13 * w + 7 * j + 5) % 50257 for j in range(100)] for w in range(8)]  # 800 tokens together
LONG = [(7 * j + 3) % 50257 for j in range(90)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return lively_engine(tmp_path_factory.mktemp("budget"))


async def drain(stream) -> list[int]:
    return [e.token.token_id async for e in stream]


def run_beside_streams(generator: Generator, streams: list[list[int]], arriving: list[list[int]],
                       max_batch_tokens: int, overlap: bool = False
                       ) -> tuple[list[list[int]], list[list[int]], StepRecorder]:
    """Greedy streams of 30 tokens run; once each has its first token, `arriving` prompts (4 new
    tokens each) come together. -> (the streams' tokens, the arrivals', every step)."""
    recorder = StepRecorder()

    async def main():
        core = EngineCore(generator, max_batch_size=64, max_batch_delay_s=0.001, max_queue=64,
                          max_batch_tokens=max_batch_tokens, engine_thread=new_engine_thread(), observer=recorder,
                          overlap=overlap)
        core.start()
        try:
            running = [events(core, GenerateRequest(p, GREEDY, 30)) for p in streams]
            firsts = [(await anext(r)).token.token_id for r in running]
            late = [asyncio.ensure_future(drain(events(core, GenerateRequest(p, GREEDY, 4)))) for p in arriving]
            rests = await asyncio.gather(*(drain(r) for r in running))
            return [[f, *rest] for f, rest in zip(firsts, rests)], list(await asyncio.gather(*late))
        finally:
            await core.stop()

    streamed, arrived = asyncio.run(main())
    return streamed, arrived, recorder


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_a_wave_arriving_beside_a_stream_is_read_over_steps_within_the_budget(saved, overlap):
    """800 prompt tokens arrive while one stream runs; the budget (512: --max-batch-tokens above
    the CPU's 512-token forward) takes what fits each step, so the wave joins the stream's decode
    steps over two of them and no step reads more than 512 tokens. Before the budget, the prompts
    that did not fit were read in a prefill of their own, with the stream waiting."""
    hf, engine = saved
    generator = Generator(engine, slots=10)
    streamed, arrived, recorder = run_beside_streams(generator, [PROMPTS[5]], WAVE, 4096, overlap)

    assert streamed == [transformers_greedy(hf, PROMPTS[5], 30)]
    assert arrived == [transformers_greedy(hf, p, 4) for p in WAVE]
    steps = recorder.steps[1:]  # after the stream's own prefill
    assert all(s.tokens_in <= 512 for s in steps), [s.tokens_in for s in steps]
    assert not [s for s in steps if s.kind == "prefill"], "a prompt of the wave was read in a step of its own"
    joined = [s for s in steps if s.tokens_in > s.rows]  # steps that read prompt tokens
    assert len(joined) >= 2 and sum(s.tokens_in - s.rows for s in joined) == sum(len(p) - 1 for p in WAVE)


def test_a_chunk_shrinks_to_what_the_decode_rows_leave(saved):
    """A step budget of 40 tokens (--max-batch-tokens 40) and chunks of up to 64: beside three
    streams, a 90-token prompt is read in chunks that leave room for the decode rows, so every
    step stays within 40 tokens; the chunks still cover the whole prompt."""
    hf, engine = saved
    generator = Generator(engine, slots=4, chunk_tokens=64)
    streams = PROMPTS[1:4]
    streamed, arrived, recorder = run_beside_streams(generator, streams, [LONG], 40)

    assert streamed == [transformers_greedy(hf, p, 30) for p in streams]
    assert arrived == [transformers_greedy(hf, LONG, 4)]
    chunked = [s for s in recorder.steps if s.kind == "decode" and s.rows == 4 and s.tokens_in > s.rows]  # 3 + chunk
    chunks = [s.tokens_in - (s.rows - 1) for s in chunked]  # the chunk's tokens: a row of its own
    assert sum(chunks) == len(LONG) and len(chunks) == 3, chunks  # 64 + 26 without the budget
    assert all(s.tokens_in <= 40 for s in recorder.steps[1:]), [s.tokens_in for s in recorder.steps]


def test_prompts_count_what_they_compute_past_the_prefix_cache(saved):
    """Eight 100-token prompts behind a 96-token prefix the prefix cache holds compute 4 tokens
    each: all of them join one decode step of the stream, where their whole lengths (800 tokens)
    would not fit its budget of 512."""
    hf, engine = saved
    shared = [(11 * j + 2) % 50257 for j in range(96)]
    engine.attach_prefix_cache(64, doorkeeper=False)
    try:
        engine.next_token([Ask(shared + [9])])  # the shared blocks into the prefix cache
        wave = [shared + [100 + w, 200 + w, 300 + w, 400 + w] for w in range(8)]
        streamed, arrived, recorder = run_beside_streams(Generator(engine, slots=10), [PROMPTS[5]], wave, 4096)
    finally:
        engine.prefix_cache = None
    assert streamed == [transformers_greedy(hf, PROMPTS[5], 30)]
    assert arrived == [transformers_greedy(hf, p, 4) for p in wave]
    joined = [s for s in recorder.steps[1:] if s.tokens_in > s.rows]
    assert [s.tokens_in - s.rows for s in joined] == [8 * 3], [(s.rows, s.tokens_in) for s in joined]
    assert joined[0].prefix_cache.hit_tokens == 8 * 96


def test_riders_count_what_they_compute_past_the_prefix_cache(saved):
    """Eight next-token prompts of 100 tokens behind a cached 96-token prefix all ride one decode
    step of the stream (4 tokens each to compute); counted whole (800 tokens), three of them took
    a forward of their own. Every answer is transformers'."""
    hf, engine = saved
    shared = [(11 * j + 2) % 50257 for j in range(96)]
    prompts = [shared + [500 + w, 600 + w, 700 + w, 800 + w] for w in range(8)]
    recorder = StepRecorder()

    async def main():
        core = EngineCore(Generator(engine, slots=4), max_batch_size=64, max_batch_delay_s=0.001, max_queue=64,
                          max_batch_tokens=4096, engine_thread=new_engine_thread(), observer=recorder)
        core.start()
        try:
            stream = events(core, GenerateRequest(PROMPTS[5], GREEDY, 30))
            await anext(stream)
            answers = await core.submit(prompts, top_k=5)
            await drain(stream)
            return answers
        finally:
            await core.stop()

    engine.attach_prefix_cache(64, doorkeeper=False)
    try:
        engine.next_token([Ask(shared + [9])])  # the shared blocks into the prefix cache
        answers = asyncio.run(main())
    finally:
        engine.prefix_cache = None
    assert [len(b.traces) for b in recorder.batches] == [8]  # one batch: none took a forward of its own
    (step,) = [s for s in recorder.steps if s.kind == "decode" and s.started_ns == answers[0].batch_started_ns]
    assert step.tokens_in == 1 + 8 * 4  # the stream's row and what the riders computed past the prefix cache
    for prompt, answer in zip(prompts, answers):
        assert_matches_reference(hf, as_result(prompt, answer.top), prompt, top_k=5)


def scheduler(step_tokens: int | None, max_batch_tokens: int = 4096, uncached=lambda prompt, adapter: len(prompt)) -> Scheduler:
    return Scheduler(slots=32, capacity_blocks=10_000, n_ctx=1024, max_batch_size=64, max_batch_tokens=max_batch_tokens,
                     max_batch_delay_s=0.001, fixed_cost_tokens=0, step_tokens=step_tokens, uncached=uncached)


def generations(n: int, tokens: int, first_id: int) -> list[EngineRequest]:
    return [EngineRequest([1] * tokens, new_tokens=8, request_id=first_id + i) for i in range(n)]


def test_the_scheduler_fills_one_budget_decode_rows_then_the_chunk_then_admitted_prompts():
    budgeted = scheduler(512)
    budgeted.add(generations(4, 10, 0))
    assert len(budgeted.schedule(0.0).admitted) == 4  # nothing runs: a prefill of their own
    budgeted.add(generations(16, 200, 100))
    step = budgeted.schedule(0.0)
    assert step.chunk == 0 and [r.request_id for r in step.admitted] == [100, 101]  # 4 decode rows + 400 <= 512
    step = budgeted.schedule(0.0, chunk_waiting=300)  # 6 decode rows, the chunk, then a prompt in the 206 left
    assert step.chunk == 300 and [r.request_id for r in step.admitted] == [102]
    step = budgeted.schedule(0.0, chunk_waiting=600)  # the chunk takes what the 7 decode rows leave
    assert step.chunk == 512 - 7 and step.admitted == []

    crowded = scheduler(512)
    crowded.running = {r.request_id: r for r in generations(510, 1, 0)}
    for r in crowded.running.values():
        r.state = "running"
    assert crowded.schedule(0.0, chunk_waiting=100).chunk == 16  # never less than SMALLEST_CHUNK

    unbudgeted = scheduler(None)  # steps that replay CUDA graphs take no prompts beside decode rows
    unbudgeted.add(generations(4, 10, 0))
    unbudgeted.schedule(0.0)
    unbudgeted.add(generations(16, 200, 100))
    step = unbudgeted.schedule(0.0, chunk_waiting=300)
    assert step.chunk == 300 and len(step.admitted) == 16  # 3,200 tokens within --max-batch-tokens

    first_alone = scheduler(512)
    first_alone.add(generations(4, 10, 0))
    first_alone.schedule(0.0)
    first_alone.add(generations(2, 700, 100))
    assert [r.request_id for r in first_alone.schedule(0.0).admitted] == [100]  # over the budget, but never stuck

    cached = scheduler(512, uncached=lambda prompt, adapter: len(prompt) - 640)  # the prefix cache holds 640 of each
    cached.add(generations(4, 10, 0))
    cached.schedule(0.0)
    cached.add(generations(8, 700, 100))
    assert len(cached.schedule(0.0).admitted) == 8  # 60 tokens to compute each


def test_a_step_holds_at_most_max_loras_adapters_and_passed_over_requests_keep_their_place():
    """vLLM's --max-loras: a generation or prompt under an adapter the step has no room for is
    passed over (others behind it may go), and goes first when room comes free."""
    a, b, c = object(), object(), object()  # three adapters (the scheduler only compares them)
    limited = Scheduler(slots=32, capacity_blocks=10_000, n_ctx=1024, max_batch_size=64, max_batch_tokens=4096,
                        max_batch_delay_s=0.0, fixed_cost_tokens=0, step_tokens=512, max_loras=2)
    waiting = generations(6, 4, 0)
    for request, adapter in zip(waiting, [a, b, c, None, a, c]):
        request.adapter = adapter
    limited.add(waiting)
    step = limited.schedule(0.0)
    assert [r.request_id for r in step.admitted] == [0, 1, 3, 4]  # c's two passed over: a and b fill the step
    assert [r.request_id for r in limited.waiting] == [2, 5]  # in their order, first in line
    prompts = [EngineRequest([1, 2], request_id=10 + i) for i in range(3)]
    for request, adapter in zip(prompts, [c, a, None]):
        request.adapter = adapter
    limited.add(prompts)
    step = limited.schedule(1.0)  # the running a and b hold the step's two: c's prompt waits too
    assert step.admitted == [] and [r.request_id for r in step.prompts] == [11, 12]
    assert [r.request_id for r in limited.prompts] == [10]
    for request in limited.running.values():
        request.state = "done"  # a and b finish: c's generations and prompt go next, in one step
    step = limited.schedule(2.0)
    assert [r.request_id for r in step.admitted] == [2, 5] and [r.request_id for r in step.prompts] == [10]

    unlimited = scheduler(512)  # the default: any number of adapters a step
    more = generations(3, 4, 20)
    for request, adapter in zip(more, [a, b, c]):
        request.adapter = adapter
    unlimited.add(more)
    assert len(unlimited.schedule(0.0).admitted) == 3
