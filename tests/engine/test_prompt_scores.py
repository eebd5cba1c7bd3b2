"""Scoring whole prompts (prompt_logprobs) in the engine: the chunked head against transformers
at 1, 5, 100 and 1,000 tokens in mixed batches, and the generation prefill. Over the wire:
tests/serving/test_scoring.py."""

from __future__ import annotations

import pytest
import torch
from support.reference import (assert_matches_reference, assert_prompt_scores_match, transformers_random_model)

from gpt2serve.engine.convert import from_transformers
from gpt2serve.engine.engine import Engine
from gpt2serve.engine.generator import Generator, NewSequence
from gpt2serve.engine.head import HEAD_CHUNK_BYTES, LIVE_VOCAB_TENSORS, ScoredSpan, chunk_rows, score_prompts
from gpt2serve.engine.loading import LoadedModel
from gpt2serve.engine.model_info import parameter_breakdown
from gpt2serve.engine.padding import IDS, POSITIONS, VALID, left_pad
from gpt2serve.engine.sampling import SamplingParams
from gpt2serve.engine.steps import Ask
from gpt2serve.engine.tokenizer import bundled_gpt2_tokenizer
from gpt2serve_client.types import NextTokenResult, TokenLogprob


@pytest.fixture(scope="module")
def long_context():
    """transformers' own small GPT-2 with the full 1,024-token context, and our engine on it."""
    hf = transformers_random_model(seed=11, n_positions=1024)
    model = from_transformers(hf)
    loaded = LoadedModel(model, bundled_gpt2_tokenizer(), "test", "random", "test", torch.device("cpu"),
                         torch.float32, parameter_breakdown(model))
    return hf, Engine(loaded)


def random_prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 50257, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def check(hf, prompt: list[int], scores) -> None:
    assert_prompt_scores_match(hf, prompt, scores.token_logprobs, scores.ranks, scores.top_ids, scores.top_logprobs)


def test_each_scored_prompt_of_a_mixed_batch_matches_transformers(long_context):
    """1, 5, 100 and 1,000 tokens in one batch, with a row that is not scored and
    rows asking for different k: every position equals transformers' log_softmax within 1e-4."""
    hf, engine = long_context
    prompts = [random_prompt(n, seed) for seed, n in enumerate([1, 5, 100, 1000, 7])]
    scored = {0: 2, 1: 5, 2: 0, 3: 3}  # row 4 only wants its next token
    out = engine.next_token([Ask(p, 3, prompt_logprobs=scored.get(row)) for row, p in enumerate(prompts)])
    assert set(out.prompt_scores) == set(scored)
    for row, k in scored.items():
        scores = out.prompt_scores[row]
        assert len(scores) == len(prompts[row]) - 1
        assert all(len(ids) == k for ids in scores.top_ids)
        check(hf, prompts[row], scores)
    for prompt, top in zip(prompts, out.top):  # the next token is unchanged by scoring beside it
        tops = [TokenLogprob(s.token_id, "", s.logprob) for s in top]
        assert_matches_reference(hf, NextTokenResult(tops[0].token_id, "", tops[0].logprob, tops, prompt), prompt, 3)


def test_the_head_in_small_chunks_gives_the_same_numbers(long_context):
    _, engine = long_context
    prompts = [random_prompt(40, 1), random_prompt(17, 2)]
    batch = left_pad(prompts, 0)
    hidden = engine.model.hidden_states(batch[IDS], batch[POSITIONS], batch[VALID].bool())
    spans = [ScoredSpan(0, 0, 40, 4), ScoredSpan(1, 40 - 17, 17, 2)]
    whole = score_prompts(hidden, batch[IDS], spans, engine.model.head, 50257, chunk=10_000)
    for chunk in (1, 7, 39):  # GEMMs of other row counts round differently: equal within 1e-5, not bitwise
        for got, want in zip(score_prompts(hidden, batch[IDS], spans, engine.model.head, 50257, chunk=chunk), whole):
            assert torch.allclose(torch.tensor(got.token_logprobs), torch.tensor(want.token_logprobs), atol=1e-5)
            assert torch.allclose(torch.tensor(got.top_logprobs), torch.tensor(want.top_logprobs), atol=1e-5)
            assert len(got) == len(want) and [len(t) for t in got.top_ids] == [len(t) for t in want.top_ids]


def test_a_head_chunk_stays_within_its_memory_budget():
    rows = chunk_rows(50257)
    assert rows * 50257 * 4 * LIVE_VOCAB_TENSORS <= HEAD_CHUNK_BYTES < (rows + 1) * 50257 * 4 * LIVE_VOCAB_TENSORS
    assert chunk_rows(10**9) == 1  # always progress


def test_the_generation_prefill_scores_its_prompts_as_the_next_token_path_does(long_context):
    hf, engine = long_context
    generator = Generator(engine, slots=4)
    prompts = [random_prompt(n, 10 + n) for n in (3, 64, 9)]
    greedy = SamplingParams(temperature=0)
    out = generator.prefill([NewSequence(i, p, greedy, 0, k) for i, (p, k) in enumerate(zip(prompts, [1, None, 4]))])
    assert set(out.prompt_scores) == {0, 2}
    for i in (0, 2):
        check(hf, prompts[i], out.prompt_scores[i])
    generator.remove({0, 1, 2})
