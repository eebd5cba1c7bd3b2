"""Long prompts read in chunks, one a step (engine.chunked_prefill): the tokens are the model's
own, running streams take tokens between the chunks, the prefix cache is read and filled, and a
caller that leaves mid-prompt frees everything."""

from __future__ import annotations

import asyncio

import pytest

from support.generation import GREEDY, PROMPTS, generation_core, lively_engine, transformers_greedy
from support.scheduler_events import QueueSink, StepRecorder, events

from gpt2serve.engine.generator import Generator
from gpt2serve.protocol import GenerateRequest

CHUNK = 16
LONG = [(7 * j + 3) % 50257 for j in range(90)]  # 6 chunks of 16 (the last of 10)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return lively_engine(tmp_path_factory.mktemp("chunked"))


async def drain(stream) -> list:
    return [e async for e in stream]


async def settled(generator: Generator) -> None:
    """The last leavers' slots are freed at the next step boundary: wait for it (bounded)."""
    for _ in range(200):
        if not generator.running and not generator.chunked:
            return
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_running_streams_take_tokens_while_a_long_prompt_is_read_in_chunks(saved, overlap):
    """A stream is running when a 90-token prompt arrives: the prompt is read in 6 chunks, each
    in the same forward as a decode step of the stream (engine.step_forward); both streams'
    tokens are what transformers gives each alone."""
    hf, engine = saved
    generator = Generator(engine, slots=4, chunk_tokens=CHUNK)
    recorder = StepRecorder()

    async def main():
        core = generation_core(generator, observer=recorder, overlap=overlap)
        core.start()
        try:
            running = events(core, GenerateRequest(PROMPTS[5], GREEDY, 30))
            first = await anext(running)
            long_one = asyncio.ensure_future(drain(events(core, GenerateRequest(LONG, GREEDY, 8))))
            rest = await drain(running)
            done = [first] + rest, await long_one
            await settled(generator)
            return done
        finally:
            await core.stop()

    running, long_one = asyncio.run(main())
    assert [e.token.token_id for e in running] == transformers_greedy(hf, PROMPTS[5], 30)
    assert [e.token.token_id for e in long_one] == transformers_greedy(hf, LONG, 8)
    mixed = [s for s in recorder.steps if s.kind == "decode" and s.tokens_in > s.rows]  # a chunk rode
    assert [s.tokens_in - (s.rows - 1) for s in mixed] == [16, 16, 16, 16, 16, 10]
    assert all(s.rows == 2 for s in mixed)  # the stream's token and the chunk, in one forward
    assert not [s for s in recorder.steps if s.kind == "prefill" and s.tokens_in <= CHUNK and s.rows == 1
                and s is not recorder.steps[0]]  # no chunk took a step of its own
    assert not generator.chunked and not generator.running


def test_a_prompt_read_in_chunks_finds_and_fills_the_prefix_cache(tmp_path):
    """The first long prompt's full blocks go into the prefix cache when its last chunk is read;
    a second one with the same 64-token start takes those blocks and reads only the rest in
    chunks; both give transformers' tokens."""
    hf, engine = lively_engine(tmp_path)
    engine.attach_prefix_cache(64, doorkeeper=False)
    shared = LONG[:64]
    first, second = shared + PROMPTS[14][:30], shared + PROMPTS[15][:40]

    async def main():
        core = generation_core(Generator(engine, slots=4, chunk_tokens=CHUNK))
        core.start()
        try:
            a = await drain(events(core, GenerateRequest(first, GREEDY, 6)))
            b = await drain(events(core, GenerateRequest(second, GREEDY, 6)))
            return a, b
        finally:
            await core.stop()

    a, b = asyncio.run(main())
    assert [e.token.token_id for e in a] == transformers_greedy(hf, first, 6)
    assert [e.token.token_id for e in b] == transformers_greedy(hf, second, 6)
    assert a[0].cached_tokens == 0 and b[0].cached_tokens == 64


def test_a_caller_that_leaves_while_its_prompt_is_read_frees_it(saved):
    """Aborted between chunks: the prompt leaves the chunk queue, nothing reaches its sink, and
    the next generation runs in the one slot."""
    hf, engine = saved
    generator = Generator(engine, slots=1, chunk_tokens=CHUNK)

    async def main():
        core = generation_core(generator)
        core.start()
        try:
            sink = QueueSink()
            seq_id = core.add(GenerateRequest(LONG, GREEDY, 8), sink)
            for _ in range(500):  # until its first chunk is read
                if generator.chunked and generator.chunked.oldest.done:
                    break
                await asyncio.sleep(0.001)
            core.abort(seq_id)
            after = await drain(events(core, GenerateRequest(PROMPTS[3], GREEDY, 5)))
            await settled(generator)
            return sink, after
        finally:
            await core.stop()

    sink, after = asyncio.run(main())
    assert sink.queue.empty()
    assert [e.token.token_id for e in after] == transformers_greedy(hf, PROMPTS[3], 5)
    assert not generator.chunked and not generator.running


def test_prompts_with_scores_or_within_a_chunk_are_read_whole(saved):
    _, engine = saved
    generator = Generator(engine, slots=2, chunk_tokens=CHUNK)
    from gpt2serve.engine.generator import NewSequence

    assert not generator.chunk_if_long(NewSequence(1, LONG, GREEDY, 0, prompt_logprobs=1))
    assert not generator.chunk_if_long(NewSequence(2, LONG[:CHUNK], GREEDY, 0))
    assert not Generator(engine, slots=2).chunk_if_long(NewSequence(3, LONG, GREEDY, 0))
    assert generator.next_chunk is None  # none of them was queued
    assert generator.chunk_if_long(NewSequence(4, LONG, GREEDY, 0))
    assert generator.next_chunk == (4, CHUNK)  # its first chunk reads at most CHUNK tokens
