"""Prefix caching: the block index alone (chains, LRU eviction of leaves, pins, failed forwards),
then next tokens, scores and generations served from cached blocks against transformers across
hits, partial hits, evictions, mixed batches and a growing cache, and a forward that fails
half-way leaving nothing a later prompt could hit."""

from __future__ import annotations

import random

import pytest
import torch
from support.reference import TOLERANCE, assert_prompt_scores_match, reference_logprobs, transformers_random_model

from gpt2serve.engine.convert import from_transformers
from gpt2serve.engine.engine import Engine
from gpt2serve.engine.steps import Ask, plain_asks
from support.asks import traced_asks
from gpt2serve.engine.generator import Generator, NewSequence
from gpt2serve.engine.gpt2 import GPT2Config
from gpt2serve.engine.loading import LoadedModel
from gpt2serve.engine.model_info import parameter_breakdown
from gpt2serve.engine.prefix_cache import BLOCK, PrefixCache
from gpt2serve.engine.sampling import SamplingParams
from gpt2serve.engine.tokenizer import bundled_gpt2_tokenizer

TINY = GPT2Config(n_layer=1, n_head=1, d_model=4, d_mlp=4, n_ctx=1024, vocab_size=100)


def tokens(n: int, seed: int) -> list[int]:
    return random.Random(seed).choices(range(50257), k=n)


# The block index alone ---------------------------------------------------------------------------

def fill(cache: PrefixCache, prompts, failed=()):
    plans = cache.plan(prompts)
    cache.commit(plans, failed)
    return plans


def test_a_prompt_hits_the_blocks_an_earlier_one_filled_and_leaves_its_last_token():
    cache = PrefixCache(TINY, 100, torch.device("cpu"), torch.float32, doorkeeper=False)
    first = tokens(3 * BLOCK, 1)
    (plan,) = fill(cache, [first])
    assert plan.hit == [] and len(plan.new) == 3 and cache.cached_blocks == 3
    assert len(cache.match(first)) == 2  # all three cached, but the last token must be computed
    assert len(cache.match(first + [7])) == 3
    diverged = first[:BLOCK + 5] + [first[BLOCK + 5] + 1] + first[BLOCK + 6:] + [7]
    assert cache.match(diverged) == cache.match(first)[:1]  # partial hit: up to the block that differs
    assert cache.match(first[:BLOCK]) == []  # a block of the prompt's own last token is never hit
    assert cache.match([first[0] + 1] + first[1:]) == []  # the same later blocks after another first one


def test_blocks_are_keyed_by_their_tokens_and_the_whole_prefix_before_them():
    cache = PrefixCache(TINY, 100, torch.device("cpu"), torch.float32, doorkeeper=False)
    a, b, tail = tokens(BLOCK, 1), tokens(BLOCK, 2), tokens(BLOCK, 3)
    fill(cache, [a + tail, b + tail])
    assert cache.cached_blocks == 4  # `tail` after `a` is not `tail` after `b`
    assert len(cache.match(a + tail + [1])) == 2 and len(cache.match(b + tail + [1])) == 2
    assert cache.match(tail + [1]) == []


def test_the_same_new_block_twice_in_one_batch_is_kept_once():
    cache = PrefixCache(TINY, 100, torch.device("cpu"), torch.float32, doorkeeper=False)
    prompt = tokens(2 * BLOCK + 3, 4)
    fill(cache, [prompt, prompt, prompt[:BLOCK + 1]])
    assert cache.cached_blocks == 2
    assert len(cache._free) == 100 - 2  # the duplicates went back


def test_least_recently_used_leaves_go_first_and_the_capacity_holds():
    cache = PrefixCache(TINY, 4, torch.device("cpu"), torch.float32, doorkeeper=False)
    shared = tokens(BLOCK, 5)
    a, b = shared + tokens(BLOCK, 6), shared + tokens(BLOCK, 7)
    fill(cache, [a, b])  # shared, a's block, b's block
    assert cache.cached_blocks == 3
    cache.match(a + [1])  # a is now more recent than b
    fill(cache, [tokens(2 * BLOCK, 8)])  # needs 2: one free, then b's leaf (never `shared`, a's parent)
    assert cache.cached_blocks == 4
    assert len(cache.match(a + [1])) == 2
    assert len(cache.match(b + [1])) == 1  # only the shared block is left of b


def test_blocks_pinned_by_the_forward_under_way_are_not_evicted():
    cache = PrefixCache(TINY, 2, torch.device("cpu"), torch.float32, doorkeeper=False)
    held = tokens(2 * BLOCK, 9)
    fill(cache, [held])
    plans = cache.plan([held + [1], tokens(2 * BLOCK, 10)])  # the second finds no room: the first's blocks are in use
    assert len(plans[0].hit) == 2 and plans[1].new == []
    cache.commit(plans)
    assert len(cache.match(held + [1])) == 2


def test_a_failed_or_non_finite_forward_indexes_nothing():
    cache = PrefixCache(TINY, 10, torch.device("cpu"), torch.float32, doorkeeper=False)
    prompt = tokens(2 * BLOCK + 1, 11)
    plans = cache.plan([prompt])
    cache.release(plans[0].new)  # the forward raised
    assert cache.cached_blocks == 0 and cache.match(prompt) == [] and len(cache._free) == 10
    fill(cache, [prompt], failed={0})  # its numbers were not finite
    assert cache.cached_blocks == 0 and len(cache._free) == 10


def test_random_traffic_keeps_the_tree_whole_and_within_capacity():
    """Prompts from a few shared prefixes, against a capacity that forces eviction: every cached
    block's parent is cached, only leaves were evicted, and every hit is a true prefix."""
    cache = PrefixCache(TINY, 12, torch.device("cpu"), torch.float32, doorkeeper=False)
    rng = random.Random(12)
    stems = [tokens(rng.randint(1, 4) * BLOCK, s) for s in range(5)]
    for _ in range(300):
        batch = [rng.choice(stems)[:rng.randint(1, 4) * BLOCK] + tokens(rng.randint(1, 40), rng.random())
                 for _ in range(rng.randint(1, 4))]
        plans = cache.plan(batch)
        for prompt, plan in zip(batch, plans):
            for i, block in enumerate(plan.hit):
                assert cache._entries[block].tokens == tuple(prompt[i * BLOCK:(i + 1) * BLOCK])
        cache.commit(plans, failed={0} if rng.random() < 0.1 else ())
        assert cache.cached_blocks + len(cache._free) == 12
        for block, entry in cache._entries.items():
            assert entry.parent == -1 or entry.parent in cache._entries
            assert entry.children == sum(e.parent == block for e in cache._entries.values())


def test_the_doorkeeper_keeps_a_block_the_second_time_its_prefix_is_seen():
    cache = PrefixCache(TINY, 100, torch.device("cpu"), torch.float32)
    shared, other = tokens(2 * BLOCK, 13), tokens(3 * BLOCK, 14)
    fill(cache, [shared + [1]])
    assert cache.cached_blocks == 0  # seen once: nothing written
    fill(cache, [shared + [2]])
    assert cache.cached_blocks == 2 and len(cache.match(shared + [3])) == 2  # seen twice: kept
    fill(cache, [other + [1]])
    assert cache.cached_blocks == 2
    fill(cache, [other[:BLOCK] + tokens(2 * BLOCK, 15)])  # `other`'s first block again, then unseen ones
    assert cache.cached_blocks == 3
    (plan,) = cache.plan([other + [2]])  # its first block hit, the next two seen once before: kept
    assert len(plan.hit) == 1 and len(plan.new) == 2
    cache.commit([plan])
    twice = tokens(BLOCK, 17) * 2 + [1]
    assert [len(p.new) for p in cache.plan([twice, twice])] == [0, 2]  # the second row sees the first's


# Served from the cache, against transformers -------------------------------------------------------

@pytest.fixture(scope="module")
def hf():
    return transformers_random_model(seed=21, n_positions=1024)


def engine_for(hf, capacity_blocks: int, doorkeeper: bool = False) -> Engine:
    """Without the doorkeeper unless asked: a prompt's blocks are kept the first time it is seen."""
    model = from_transformers(hf)
    loaded = LoadedModel(model, bundled_gpt2_tokenizer(), "test", "random", "test", torch.device("cpu"),
                         torch.float32, parameter_breakdown(model))
    engine = Engine(loaded)
    engine.attach_prefix_cache(capacity_blocks, doorkeeper)
    return engine


def assert_next_tokens_match(hf, prompts, out, k=5):
    for prompt, top in zip(prompts, out.top):
        ref = reference_logprobs(hf, prompt)
        assert top[0].token_id == int(ref.argmax())
        want = torch.topk(ref, k).values.tolist()
        for got, expected in zip(top, want):
            assert abs(got.logprob - expected) <= TOLERANCE
            assert abs(ref[got.token_id].item() - got.logprob) <= TOLERANCE


def test_next_tokens_from_cached_prefixes_match_transformers(hf):
    """Hits, partial hits, misses and prompts shorter than a block share batches; then a prompt
    that extends a cached one grows the cache, and the longer one hits all of it."""
    engine = engine_for(hf, 200)
    shared = tokens(100, 20)
    batch = [shared + tokens(n, 30 + n) for n in (1, 7, 30)] + [tokens(40, 40), tokens(5, 41)]
    first = engine.next_token(plain_asks(batch, [5] * 5))
    assert first.cached_tokens == [0] * 5  # an empty cache
    assert_next_tokens_match(hf, batch, first)
    diverged = shared[:50] + tokens(60, 50)  # shares 3 blocks and a bit of the 4th
    second_batch = batch[:3] + [diverged, tokens(5, 41), tokens(33, 60)]
    second = engine.next_token(plain_asks(second_batch, [5] * 6))
    assert second.cached_tokens == [96, 96, 128, 48, 0, 0]
    assert_next_tokens_match(hf, second_batch, second)
    grown = batch[2] + tokens(300, 70)
    assert engine.next_token(plain_asks([grown], [5])).cached_tokens == [128]
    longer = grown + tokens(20, 71)
    out = engine.next_token(plain_asks([longer], [5]))
    assert out.cached_tokens == [len(grown) // BLOCK * BLOCK]
    assert_next_tokens_match(hf, [longer], out)


def test_with_the_doorkeeper_unique_prompts_write_nothing_and_a_third_sighting_hits(hf):
    engine = engine_for(hf, 200, doorkeeper=True)
    for seed in range(4):
        engine.next_token(plain_asks([tokens(70, 150 + seed)], [1]))
    assert engine.prefix_cache.cached_blocks == 0
    shared = tokens(70, 160)
    outs = [engine.next_token(plain_asks([shared + [i]], [5])) for i in range(3)]
    assert [o.cached_tokens for o in outs] == [[0], [0], [64]]
    assert_next_tokens_match(hf, [shared + [2]], outs[2])


def test_evictions_keep_answers_exact(hf):
    """A cache of 6 blocks under prompts that need more: blocks come and go, answers never change."""
    engine = engine_for(hf, 6)
    stems = [tokens(32, 80 + s) for s in range(4)]  # 2 blocks each: 8 for room for 6
    hits = 0
    for i, stem in enumerate([0, 1, 0, 2, 0, 3, 1, 0, 2, 2, 3, 0]):
        prompt = stems[stem] + tokens(5, 90 + i)
        out = engine.next_token(plain_asks([prompt], [5]))
        hits += out.cached_tokens[0]
        assert_next_tokens_match(hf, [prompt], out)
        assert engine.prefix_cache.cached_blocks <= 6
    assert hits > 0


def test_a_batch_over_the_token_budget_runs_in_parts_and_each_row_is_its_own(hf):
    """On a CPU a next-token batch runs in forwards of at most `forward_tokens` padded tokens,
    counted after the prefix cache (engine.padding): each row keeps its answer, scores and
    cached count, in its own place."""
    engine = engine_for(hf, 200)
    engine.forward_tokens = 48  # 512 by default; small here so that four prompts make parts
    shared = tokens(80, 100)
    engine.next_token(plain_asks([shared + [1]], [1]))
    prompts = [shared + tokens(9, 101), shared + tokens(3, 102), tokens(20, 103), tokens(30, 104)]
    forwards, run = [], engine._untraced
    engine._untraced = lambda part, *rest: forwards.append(len(part)) or run(part, *rest)
    out = engine.next_token([Ask(p, 5, prompt_logprobs=k) for p, k in zip(prompts, [4, None, 2, 1])])
    assert forwards == [2, 1, 1]  # 2 x 9 new tokens, then 20 and 30 alone
    assert out.cached_tokens == [80, 80, 0, 0] and out.padded_len == 30
    assert_next_tokens_match(hf, prompts, out)
    assert sorted(out.prompt_scores) == [0, 2, 3]
    for row, s in out.prompt_scores.items():
        assert_prompt_scores_match(hf, prompts[row], s.token_logprobs, s.ranks, s.top_ids, s.top_logprobs)


def test_scores_of_cached_positions_match_transformers(hf):
    engine = engine_for(hf, 200)
    shared = tokens(80, 100)
    prompts = [shared + tokens(9, 101), shared + tokens(3, 102), tokens(20, 103)]
    engine.next_token(plain_asks([shared + [1]], [1]))
    out = engine.next_token([Ask(p, 3, prompt_logprobs=k) for p, k in zip(prompts, [4, 0, 2])])
    assert out.cached_tokens == [80, 80, 0]
    for row, prompt in enumerate(prompts):
        s = out.prompt_scores[row]
        assert_prompt_scores_match(hf, prompt, s.token_logprobs, s.ranks, s.top_ids, s.top_logprobs)


def test_a_traced_batch_computes_every_prompt_whole_and_still_fills_the_cache(hf):
    """A traced batch reads no hit (its reports cover every position), and its rows, right-padded
    to the longest, still leave their full blocks, which later prompts read as transformers would."""
    engine = engine_for(hf, 200)
    prompt, longer = tokens(2 * BLOCK + 8, 110), tokens(4 * BLOCK + 5, 111)
    engine.next_token(plain_asks([prompt], [3]))  # its two full blocks
    traced = [prompt + tokens(10, 112), longer]  # a third block for the shorter row
    out = engine.layer_reports(engine.next_token(traced_asks(traced, 3, [0, 1])))
    assert out.cached_tokens == [0, 0] and len(out.layers[0]) == len(out.layers[1]) == hf.config.n_layer
    assert_next_tokens_match(hf, traced, out, k=3)
    later = [traced[0] + [6], longer + [7]]
    out = engine.next_token(plain_asks(later, 5))
    assert out.cached_tokens == [3 * BLOCK, 4 * BLOCK]
    assert_next_tokens_match(hf, later, out)


def greedy(hf, prompt, n):
    return hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()


def test_generations_from_cached_prefixes_match_transformers(hf):
    """Prefills with different cached lengths side by side (and one with none) give transformers'
    greedy tokens, and the same log-probabilities as the same engine without the cache."""
    engine, plain = engine_for(hf, 200), engine_for(hf, 0)
    shared = tokens(70, 120)
    engine.next_token(plain_asks([shared + [1], shared[:40] + [2]], [1]))  # next-token calls fill what generation hits
    prompts = [shared + tokens(4, 121), shared[:40] + tokens(20, 122), tokens(10, 123), shared + tokens(1, 124)]
    runs = {}
    for name, e in (("cached", engine), ("plain", plain)):
        gen = Generator(e, 4)
        gen.allocate()
        first = gen.prefill([NewSequence(i, p, SamplingParams(temperature=0.0, logprobs=3), 0, 2)
                             for i, p in enumerate(prompts)])
        steps = [first] + [gen.decode() for _ in range(7)]
        runs[name] = (first, [[s.tokens[i] for s in steps] for i in range(len(prompts))])
    first, cached = runs["cached"]
    assert first.cached_tokens == {0: 64, 1: 32, 2: 0, 3: 64}
    for i, prompt in enumerate(prompts):
        assert [t.token_id for t in cached[i]] == greedy(hf, prompt, 8)
        for got, want in zip(cached[i], runs["plain"][1][i]):
            assert abs(got.logprob - want.logprob) <= TOLERANCE
        s = first.prompt_scores[i]
        assert_prompt_scores_match(hf, prompt, s.token_logprobs, s.ranks, s.top_ids, s.top_logprobs)


class Boom(Exception):
    pass


def fail_second_block_once(engine, monkeypatch):
    block = engine.model.blocks[1]
    real = block.forward
    calls = []

    def forward(*args, **kwargs):
        if not calls:
            calls.append(1)
            raise Boom("the forward stopped half-way")
        return real(*args, **kwargs)

    monkeypatch.setattr(block, "forward", forward)


def test_a_forward_that_stops_half_way_leaves_no_block_to_hit(hf, monkeypatch):
    """Layer 0 has written its keys into the new blocks when layer 1 raises: none of them is
    indexed, so the same prompt again computes everything and gets transformers' answer."""
    engine = engine_for(hf, 50)
    prompt = tokens(50, 130)
    fail_second_block_once(engine, monkeypatch)
    with pytest.raises(Boom):
        engine.next_token(plain_asks([prompt], [5]))
    assert engine.prefix_cache.cached_blocks == 0 and len(engine.prefix_cache._free) == 50
    out = engine.next_token(plain_asks([prompt + [1]], [5]))
    assert out.cached_tokens == [0]
    assert_next_tokens_match(hf, [prompt + [1]], out)


def test_a_prefill_that_stops_half_way_leaves_no_block_to_hit(hf, monkeypatch):
    engine = engine_for(hf, 50)
    shared = tokens(40, 140)
    engine.next_token(plain_asks([shared[:20]], [1]))  # one cached block the prefill will hit
    gen = Generator(engine, 2)
    gen.allocate()
    fail_second_block_once(engine, monkeypatch)
    with pytest.raises(Boom):
        gen.prefill([NewSequence(0, shared + [1], SamplingParams(temperature=0.0), 0)])
    assert engine.prefix_cache.cached_blocks == 1
    out = engine.next_token(plain_asks([shared + [1]], [5]))
    assert out.cached_tokens == [16]
    assert_next_tokens_match(hf, [shared + [1]], out)
