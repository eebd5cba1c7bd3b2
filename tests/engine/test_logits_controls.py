"""Per-request controls on a row's logits (engine.logits_controls, engine.sampling's min_p):
equal to transformers' logits processors or the OpenAI formula within 1e-5 on the final
distribution, applied to their own row only, and through generation (with and without the
overlap, where a step is launched before the last one is read) equal to a reference loop."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import pytest
import torch
from support.generation import PROMPTS, lively_engine, openai_penalties, reference_greedy, run_joining
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from gpt2serve.engine.generator import Generator, NewSequence
from gpt2serve.engine.logits_controls import TokenHistory, controlled_logits
from gpt2serve.engine.sampling import min_p_filter
from gpt2serve.protocol import GenerateRequest, SamplingParams

V = 300  # a small vocabulary keeps repeats likely
TOLERANCE = 1e-5


@dataclass
class Row:
    params: SamplingParams
    prompt: list[int]
    output: list[int] = field(default_factory=list)
    history_written: bool = False

    @property
    def prompt_length(self) -> int:
        return len(self.prompt)


def controlled(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """Our controls over rows whose prompts and outputs are already in a token history."""
    history = TokenHistory(len(rows), 64, torch.device("cpu"))
    for slot, row in enumerate(rows):
        if row.output:
            history.write_prompt(slot, row.prompt)
            row.history_written = True
            history.record([slot] * len(row.output), [row.prompt_length + j for j in range(len(row.output))],
                           torch.tensor(row.output))
    out = controlled_logits(logits, rows, range(len(rows)), [len(r.output) for r in rows], history)
    return logits if out is None else out


def random_rows(seed: int, count: int) -> list[Row]:
    rng = random.Random(seed)
    return [Row(SamplingParams(), [rng.randrange(V) for _ in range(rng.randint(1, 20))],
                [rng.randrange(V) for _ in range(rng.randint(1, 30))]) for _ in range(count)]


def assert_same_distribution(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.allclose(got.softmax(-1), want.softmax(-1), atol=TOLERANCE), \
        (got.softmax(-1) - want.softmax(-1)).abs().max()


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_is_transformers_over_prompt_and_output(penalty):
    rows = random_rows(1, 6)
    for row in rows:
        row.params = SamplingParams(repetition_penalty=penalty)
    logits = torch.randn(6, V) * 3
    ours = controlled(logits, rows)
    for i, row in enumerate(rows):
        want = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([row.prompt + row.output]), logits[i:i + 1])
        assert_same_distribution(ours[i], want[0])


@pytest.mark.parametrize(("frequency", "presence"), [(0.7, 0.0), (0.0, 1.5), (-0.5, 0.8), (2.0, -2.0)])
def test_frequency_and_presence_penalties_are_openais_formula_over_the_output(frequency, presence):
    rows = random_rows(2, 5)
    for row in rows:
        row.params = SamplingParams(frequency_penalty=frequency, presence_penalty=presence)
    logits = torch.randn(5, V)
    ours = controlled(logits, rows)
    for i, row in enumerate(rows):
        assert_same_distribution(ours[i], openai_penalties(logits[i], row.output, frequency, presence))
        untouched = set(range(V)) - set(row.output)  # the prompt's tokens are not penalized
        assert torch.equal(ours[i, sorted(untouched)], logits[i, sorted(untouched)])


def test_logit_bias_is_transformers_sequence_bias():
    bias = ((3, 5.0), (17, -100.0), (250, 0.25))
    rows = [Row(SamplingParams(logit_bias=bias), [1, 2])]
    logits = torch.randn(1, V)
    want = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias])(torch.tensor([[1, 2]]), logits.clone())
    assert_same_distribution(controlled(logits, rows)[0], want[0])


@pytest.mark.parametrize(("min_p", "temperature"), [(0.05, 1.0), (0.3, 0.7), (0.9, 1.5)])
def test_min_p_is_transformers_min_p_warper_after_the_temperature(min_p, temperature):
    logits = torch.randn(4, V) * 2
    shifted = logits - logits.max(dim=-1, keepdim=True).values
    ours = min_p_filter(shifted / temperature, [min_p] * 4)
    want = MinPLogitsWarper(min_p)(torch.zeros(4, 1, dtype=torch.long), logits / temperature)
    assert torch.equal(torch.isinf(ours), torch.isinf(want))
    assert_same_distribution(ours, want)


def test_min_tokens_holds_back_end_of_text_and_stop_tokens_until_then():
    params = SamplingParams(min_tokens=3, banned_early=(7, 9))
    logits = torch.randn(2, V)
    early = controlled(logits, [Row(params, [1], [4, 5]), Row(params, [1], [4, 5, 6])])
    assert early[0, 7] == float("-inf") and early[0, 9] == float("-inf")
    assert torch.equal(early[1], logits[1])  # three generated: nothing held back


def test_all_together_in_vllms_order_and_each_row_alone():
    """min_tokens, bias, repetition, then frequency and presence, against the reference chain;
    a row without controls, between controlled ones, is left exactly as it was."""
    rows = random_rows(3, 3)
    params = SamplingParams(repetition_penalty=1.4, frequency_penalty=0.3, presence_penalty=0.2,
                            logit_bias=((5, 2.0), (rows[0].output[0], -1.0)), min_tokens=40, banned_early=(11,))
    rows[0].params = rows[2].params = params
    logits = torch.randn(3, V)
    ours = controlled(logits, rows)
    assert torch.equal(ours[1], logits[1])
    for i in (0, 2):
        row = rows[i]
        want = logits[i:i + 1].clone()
        want[0, 11] = float("-inf")
        want = SequenceBiasLogitsProcessor([[[t], b] for t, b in params.logit_bias])(torch.tensor([row.prompt]), want)
        want = RepetitionPenaltyLogitsProcessor(1.4)(torch.tensor([row.prompt + row.output]), want)
        want = openai_penalties(want[0], row.output, 0.3, 0.2)
        assert_same_distribution(ours[i], want)


# Through generation -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lively(tmp_path_factory):
    return lively_engine(tmp_path_factory.mktemp("lively"))


@pytest.mark.parametrize("overlap", [False, True])
def test_penalized_streams_among_plain_ones_match_the_reference(lively, overlap):
    """Greedy streams with penalties and bias, joining while plain ones run: each equals the
    reference loop, and each plain stream equals itself run alone."""
    hf, engine = lively
    controlled_params = [SamplingParams(temperature=0.0, repetition_penalty=1.5),
                         SamplingParams(temperature=0.0, frequency_penalty=1.0, presence_penalty=0.5),
                         SamplingParams(temperature=0.0, repetition_penalty=0.8, presence_penalty=-0.5,
                                        logit_bias=((PROMPTS[5][0], 3.0),))]
    plain = SamplingParams(temperature=0.0)
    requests = [(0.002 * i, GenerateRequest(PROMPTS[i], controlled_params[i % 3] if i % 2 else plain, 12,
                                            ignore_eos=True)) for i in range(8)]
    got = asyncio.run(run_joining(Generator(engine, slots=4), requests, overlap=overlap))
    alone = asyncio.run(run_joining(Generator(engine, slots=4), [(0, r) for _, r in requests if r.params == plain]))
    assert [g for g, (_, r) in zip(got, requests) if r.params == plain] == alone
    for tokens, (_, request) in zip(got, requests):
        if request.params != plain:
            assert tokens == reference_greedy(hf, request.prompt, 12, request.params), request.params


def test_min_tokens_through_generation(lively):
    """End of text made near certain by its bias is held back for min_tokens, then taken."""
    _, engine = lively
    eos = 50256
    generator = Generator(engine, slots=2)
    params = SamplingParams(temperature=0.0, logit_bias=((eos, 100.0),), min_tokens=4, banned_early=(eos,))
    first = generator.prefill([NewSequence(0, PROMPTS[3], params, 0)]).tokens[0].token_id
    tokens = [first] + [generator.decode().tokens[0].token_id for _ in range(5)]
    assert eos not in tokens[:4] and tokens[4:] == [eos, eos]
