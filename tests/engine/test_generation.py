"""Generation in-process: KV cache, sampling, continuous batching, against transformers' generate.

The reference is a transformers checkpoint saved here and loaded through the real path. Its
weights are drawn wider than GPT-2's init (initializer_range 0.5), so greedy text varies from
token to token instead of repeating one token, and a wrong position or cache slot shows.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from support.generation import GREEDY, PROMPTS, generation_core, lively_engine, run_joining, transformers_greedy

from gpt2serve.engine.generator import Generator, NewSequence
from gpt2serve.engine.padding import forward_parts
from gpt2serve.engine.sampling import TOP, choose
from gpt2serve.protocol import SamplingParams
from gpt2serve.engine.tokenizer import bundled_gpt2_tokenizer
from gpt2serve.errors import InvalidArgument, ResourceExhausted
from gpt2serve.protocol import GenerateRequest
from gpt2serve.engine import kv_cache
from gpt2serve.engine.kv_cache import blocks_for
from gpt2serve.engine.traced_decode import TracedDecode
from support.scheduler_events import events
from gpt2serve.service.detokenizer import Detokenizer

# 16 prompts of 1..46 tokens


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(transformers model, our engine over the same checkpoint, loaded from disk)."""
    return lively_engine(tmp_path_factory.mktemp("generation"))


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "bucketed"])
def test_greedy_alone_matches_transformers(saved, graphs):
    """`bucketed`: the decode-graph buffers and padding, run eagerly (captured on cuda: test_gpu)."""
    hf, engine = saved
    generator = Generator(engine, slots=3, graphs=graphs)
    prompt, n = PROMPTS[5], 30
    tokens = [generator.prefill([NewSequence(0, prompt, GREEDY, 0)]).tokens[0].token_id]
    while len(tokens) < n:
        tokens.append(generator.decode().tokens[0].token_id)
    assert tokens == transformers_greedy(hf, prompt, n)
    assert len(set(tokens)) > 5  # the reference is lively enough to catch a misplaced position


@pytest.mark.parametrize("graphs, overlap", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["eager", "bucketed", "eager-overlapped", "bucketed-overlapped"])
def test_sixteen_sequences_joining_midway_match_transformers_alone(saved, graphs, overlap):
    """Different lengths, different max_tokens, staggered arrivals, fewer slots than sequences:
    sequences join a running batch and leave it, and each one's tokens are its tokens alone.
    `overlapped`: each decode step launched before the last one is read, as on cuda, so
    sequences join and leave while a step's answers are still unread."""
    hf, engine = saved
    generator = Generator(engine, slots=6, graphs=graphs)
    running_at_prefill = []
    joined = []  # prompts read in a running batch's decode step (engine.step_forward)
    launch = generator.launch

    def counting_launch(plan):
        if plan.decode:
            joined.append(len(plan.joining))
        else:  # a prefill of its own
            running_at_prefill.append(len(generator.running))
        return launch(plan)

    generator.launch = counting_launch
    lengths = [6 + 5 * (i % 4) for i in range(16)]
    requests = [(0.004 * i, GenerateRequest(p, GREEDY, n)) for i, (p, n) in enumerate(zip(PROMPTS, lengths))]
    got = asyncio.run(run_joining(generator, requests, overlap))
    for prompt, n, tokens in zip(PROMPTS, lengths, got):
        assert tokens == transformers_greedy(hf, prompt, n), prompt
    assert max(running_at_prefill) > 0 or sum(joined) > 0, "no sequence joined a running batch"
    assert not generator.running  # every slot was given back


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_prefills_from_buckets_match_transformers_alone(saved, overlap):
    """The prefill graphs' path (engine.prefill_graphs: right-padded buckets, each row's keys and
    values written into its slot, padding rows writing back what one slot holds), run eagerly
    from the same buffers as a CPU runs it: sequences arriving three at a time join a running
    batch and each one's tokens are its own alone, the cache full after some prefills (their
    padding rows then target a running sequence's slot). A padding row or column that changed a
    running sequence's slot would change that sequence's next tokens."""
    hf, engine = saved
    generator = Generator(engine, slots=8)
    generator.allocate()
    generator.prefill_graphs = buckets = generator.prefill_buckets(capture=False)
    ran = []
    run_prefill = buckets.run_prefill

    def counting(prompts, first_slot, shape):
        ran.append((len(prompts), first_slot, shape))
        return run_prefill(prompts, first_slot, shape)

    buckets.run_prefill = counting
    lengths = [6 + 5 * (i % 4) for i in range(16)]
    requests = [(0.004 * (i // 3), GenerateRequest(p, GREEDY, n)) for i, (p, n) in enumerate(zip(PROMPTS, lengths))]
    got = asyncio.run(run_joining(generator, requests, overlap))
    for prompt, n, tokens in zip(PROMPTS, lengths, got):
        assert tokens == transformers_greedy(hf, prompt, n), prompt
    assert any(first > 0 for _, first, _ in ran), "no bucketed prefill joined a running batch"
    assert any(shape[0] > rows for rows, _, shape in ran), ("no bucket had padding rows", ran)
    assert any(shape[0] > rows and first + rows == 8 for rows, first, shape in ran), ("never full with padding", ran)
    assert any(shape[1] > 8 for _, _, shape in ran), ("every prompt fit the smallest column bucket", ran)
    assert not generator.running


def test_forward_parts_keep_each_forward_within_the_budget():
    assert forward_parts([200, 200, 200], 512) == [(0, 2), (2, 3)]  # rows x the longest new part
    assert forward_parts([100] * 5, 512) == [(0, 5)]
    assert forward_parts([100] * 6, 512) == [(0, 5), (5, 6)]
    assert forward_parts([10, 600, 10], 512) == [(0, 1), (1, 2), (2, 3)]  # a long one runs alone
    assert forward_parts([200] * 3, None) == [(0, 3)]
    assert forward_parts([], 512) == []


def test_a_long_prefill_runs_in_parts_on_a_cpu_and_each_row_is_its_own(saved):
    """Three 200-token prompts: two forwards (2 x 200 tokens, then 1 x 200), one step for the
    scheduler, and each sequence's greedy tokens are transformers' for it alone."""
    hf, engine = saved
    generator = Generator(engine, slots=4)
    forwards, run_part = [], generator._read_rows  # (decode, last, lengths, riders, joined, ...)
    generator._read_rows = lambda *args, **kwargs: forwards.append(len(args[4])) or run_part(*args, **kwargs)
    prompts = [[(31 * i + 7 * j) % 1000 + 1 for j in range(200)] for i in range(3)]
    step = generator.prefill([NewSequence(i, p, GREEDY, 0) for i, p in enumerate(prompts)])
    assert forwards == [2, 1] and step.rows == 3 and step.tokens_in == 600 and step.kind == "prefill"
    tokens = {i: [step.tokens[i].token_id] for i in range(3)}
    for _ in range(9):
        step = generator.decode()
        for i in range(3):
            tokens[i].append(step.tokens[i].token_id)
    for i, prompt in enumerate(prompts):
        assert tokens[i] == transformers_greedy(hf, prompt, 10), i


def test_the_cache_grows_with_the_tokens_held_and_gives_them_back(saved):
    """Two long sequences cross the cache's growth points (64 and 128 positions; more slots as
    short ones join) while short ones join and leave: each one's tokens stay transformers' own,
    the tensors stay within a few times what is held, and they shrink back once everyone has left."""
    hf, engine = saved
    generator = Generator(engine, slots=8)
    shapes = []  # (running, slots allocated, positions allocated) after each decode step
    launch = generator.launch

    def recording_launch(plan):
        output = launch(plan)
        shapes.append((len(generator.running), generator.cache.slots, generator.cache.length,
                       max(r.length for r in generator.running)))
        return output

    generator.launch = recording_launch
    requests = [(0.0, GenerateRequest(PROMPTS[0], GREEDY, 150)), (0.0, GenerateRequest(PROMPTS[15], GREEDY, 100))]
    requests += [(0.02 * i, GenerateRequest(PROMPTS[i], GREEDY, 8)) for i in range(1, 7)]
    got = asyncio.run(run_joining(generator, requests))
    for (_, request), tokens in zip(requests, got):
        assert tokens == transformers_greedy(hf, request.prompt, request.max_tokens), request.prompt
    assert {length for _, _, length, _ in shapes} == {64, 128, 256}  # grown twice, by doubling
    assert max(slots for _, slots, _, _ in shapes) > 2  # short ones joined: more slots
    for running, slots, length, longest in shapes:
        # a power of two at least what is held, kept until it is twice that: under 4x either way
        assert running <= slots < 4 * running
        assert longest <= length and (length == 64 or length < 4 * (longest + 1))
    assert (generator.cache.slots, generator.cache.length) == (1, 64)  # everyone left: shrunk back


def test_admission_counts_the_cache_blocks_each_sequence_may_grow_to(saved):
    """A cache of 4 blocks (256 positions): sequences that may grow to 2 blocks run two at a time,
    the others wait (and are then served exactly); one that could never fit is refused at once."""
    hf, engine = saved
    generator = Generator(engine, slots=4, capacity_blocks=4)
    most_running = []
    launch = generator.launch

    def counting_launch(plan):
        output = launch(plan)
        most_running.append(len(generator.running))
        return output

    generator.launch = counting_launch
    requests = [(0.0, GenerateRequest(PROMPTS[i], GREEDY, 70)) for i in range(1, 5)]  # <= 128 positions each
    got = asyncio.run(run_joining(generator, requests))
    for (_, request), tokens in zip(requests, got):
        assert tokens == transformers_greedy(hf, request.prompt, request.max_tokens)
    assert max(most_running) == 2  # four slots, but blocks for two

    async def too_long():
        scheduler = generation_core(Generator(engine, slots=4, capacity_blocks=3), max_queue=4, max_queue_wait_s=5)
        scheduler.start()
        try:
            with pytest.raises(InvalidArgument, match="needs 210 tokens of KV cache, and it holds 192"):
                scheduler.add(GenerateRequest(PROMPTS[3], GREEDY, 200), sink=None)
        finally:
            await scheduler.stop()

    asyncio.run(too_long())


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled attention", "torch attention"])
def test_a_decode_trace_serves_any_number_of_rows_exactly(saved, compiled, monkeypatch):
    """engine.traced_decode: a step traced at one size (here 2 rows; one row is traced beside a
    dummy row) gives eager's logits and writes eager's keys and values for 1, 3 and 7 rows; with
    engine.native's decode attention, and with torch's (a machine without a compiler, as the
    server image is), where the trace also holds the mask."""
    if not compiled:
        monkeypatch.setattr(kv_cache.native, "available", lambda: False)
    _, engine = saved
    generator = Generator(engine, slots=8, graphs=False)
    generator.prefill([NewSequence(i, PROMPTS[i + 2], GREEDY, i) for i in range(7)])
    traces = TracedDecode(generator._decode_logits, generator.model, generator.cache)

    def step_inputs(rows: int) -> tuple[torch.Tensor, torch.Tensor]:  # other tokens for each row count, so each
        return torch.arange(rows) + 500 + 10 * rows, torch.tensor([len(PROMPTS[i + 2]) for i in range(rows)])  # writes anew

    with torch.inference_mode():
        traces.run(*step_inputs(2), 64)  # traced here
        for rows in (1, 3, 7, 2):
            before = generator.cache.keys.clone(), generator.cache.values.clone()
            eager = generator._decode_logits(*step_inputs(rows), 64)
            after_eager = generator.cache.keys.clone(), generator.cache.values.clone()
            generator.cache.keys.copy_(before[0])
            generator.cache.values.copy_(before[1])
            traced = traces.run(*step_inputs(rows), 64)
            assert torch.equal(traced, eager), rows
            assert torch.equal(generator.cache.keys, after_eager[0]) and torch.equal(generator.cache.values, after_eager[1])
            assert not torch.equal(after_eager[0], before[0])  # the step did write its keys
    assert list(traces.traces) == [64]  # one trace for every row count


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_seeded_sampling_is_the_same_alone_and_batched(saved, overlap):
    _, engine = saved
    sampled = SamplingParams(temperature=0.9, top_k=50, top_p=0.95)
    seeded = GenerateRequest(PROMPTS[3], sampled, 20, seed=1234)
    alone = asyncio.run(run_joining(Generator(engine, slots=4), [(0, seeded)]))[0]
    others = [(0.0, GenerateRequest(p, SamplingParams(temperature=t, top_p=tp), 20, seed=s))
              for p, t, tp, s in zip(PROMPTS[6:12], (0.5, 1.0, 1.3, 0.0, 0.7, 1.0), (1.0, 0.9, 0.5, 1, 1, 0.8),
                                     range(6))]
    batched = asyncio.run(run_joining(Generator(engine, slots=8), [*others[:3], (0.01, seeded), *others[3:]],
                                      overlap))[3]
    assert batched == alone
    other_seed = asyncio.run(run_joining(Generator(engine, slots=4), [(0, GenerateRequest(
        PROMPTS[3], sampled, 20, seed=4321))]))[0]
    assert other_seed != alone


def test_a_sequence_that_finds_no_slot_waits_then_is_refused(saved):
    _, engine = saved

    async def main():
        scheduler = generation_core(Generator(engine, slots=1), max_queue=4, max_queue_wait_s=0.2)
        scheduler.start()
        holder = events(scheduler, GenerateRequest(PROMPTS[1], GREEDY, 200))
        await anext(holder)  # holds the one slot, and is not read further for now
        # its blocks at the longest it may grow, of a cache of one full-context sequence
        assert scheduler.cache_usage == blocks_for(len(PROMPTS[1]) + 200) / blocks_for(engine.model.config.n_ctx)
        with pytest.raises(ResourceExhausted, match="no room in the KV cache"):
            [s async for s in events(scheduler, GenerateRequest(PROMPTS[2], GREEDY, 3))]
        rest = [s async for s in holder]  # the accepted one still finishes
        assert len(rest) == 199 and rest[-1].finish_reason == "length"
        assert scheduler.waiting == 0
        await scheduler.stop()

    asyncio.run(main())


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_leaving_early_frees_the_slot_at_once(saved, overlap):
    _, engine = saved

    async def main():
        generator = Generator(engine, slots=1)
        scheduler = generation_core(generator, max_queue=4, max_queue_wait_s=5, overlap=overlap)
        scheduler.start()
        stream = events(scheduler, GenerateRequest(PROMPTS[1], GREEDY, 200))
        await anext(stream)
        await stream.aclose()  # the caller hung up
        assert scheduler.cache_usage == 0.0 and scheduler.running == 0
        second = [s.token.token_id async for s in events(scheduler, GenerateRequest(PROMPTS[2], GREEDY, 3))]
        assert len(second) == 3  # it ran in the one slot, so that slot had been freed
        await scheduler.stop()

    asyncio.run(main())


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_stop_token_and_eos_end_the_sequence(saved, overlap):
    """Overlapped, the stop token is read a step late, after the next step was launched: that
    step's token for it must not reach its caller, and its neighbour goes on untouched."""
    hf, engine = saved
    expected = transformers_greedy(hf, PROMPTS[4], 10)
    stop_at = expected[4]
    got, beside = asyncio.run(run_joining(Generator(engine, slots=2), [
        (0, GenerateRequest(PROMPTS[4], GREEDY, 10, stop_token_ids=frozenset({stop_at}))),
        (0, GenerateRequest(PROMPTS[6], GREEDY, 12))], overlap))
    assert got == expected[:expected.index(stop_at) + 1]  # the stop token is the last step (not output)
    assert beside == transformers_greedy(hf, PROMPTS[6], 12)


# Sampling ---------------------------------------------------------------------------------------

def test_top_k_1_and_a_tiny_top_p_are_greedy():
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0))
    greedy = logits.argmax(-1).tolist()
    for params in (SamplingParams(temperature=1.5, top_k=1), SamplingParams(temperature=1.5, top_p=1e-6)):
        rows = choose(logits, [params] * 4, [random.random() for _ in range(4)])
        assert rows[:, 0].long().tolist() == greedy


def test_a_rows_token_depends_on_its_own_settings_only():
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(1))
    mine = SamplingParams(temperature=0.8, top_p=0.9, logprobs=3)
    alone = choose(logits[:1], [mine], [0.37])
    mixed = choose(logits, [mine, SamplingParams(temperature=0.0, logprobs=5), SamplingParams(top_k=7)],
                   [0.37, 0.5, 0.9])
    assert mixed[0, 0] == alone[0, 0] and mixed[0, 1] == alone[0, 1]
    assert mixed[1, 0] == logits[1].argmax()
    logprobs = torch.log_softmax(logits, -1)
    assert torch.allclose(mixed[1, TOP:TOP + 5], logprobs[1].topk(5).values)  # top alternatives, most likely first


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 0.0]]))
    draws = [int(choose(logits, [SamplingParams()], [u / 1000])[0, 0]) for u in range(1000)]
    counts = [draws.count(i) for i in range(4)]
    assert counts[3] == 0 and abs(counts[0] - 500) <= 2 and abs(counts[1] - 300) <= 2 and abs(counts[2] - 200) <= 2


# Text: stop strings and split characters ----------------------------------------------------------

@pytest.fixture(scope="module")
def tok():
    return bundled_gpt2_tokenizer()


def stream_text(tok, text: str, stop=()) -> tuple[list[str], Detokenizer]:
    stream = Detokenizer(tok, stop)
    pieces = []
    for token in tok.encode(text):
        pieces.append(stream.add(token))
        if stream.stopped:
            break
    pieces.append(stream.finish())
    return pieces, stream


def test_stop_string_across_tokens_is_cut_and_never_streamed(tok):
    pieces, stream = stream_text(tok, "Hello world. The end is near", stop=["end is"])
    assert "".join(pieces) == "Hello world. The " and stream.stopped
    assert all("end" not in p for p in pieces)


def test_text_that_only_looks_like_a_stop_string_is_released(tok):
    pieces, stream = stream_text(tok, "an ending, then more", stop=["end is"])
    assert "".join(pieces) == "an ending, then more" and not stream.stopped


def test_a_character_split_across_tokens_comes_out_whole(tok):
    text = "café 東京 🙂"
    pieces, _ = stream_text(tok, text)
    assert "".join(pieces) == text and "\ufffd" not in "".join(pieces)
