"""No request can hurt another in the engine: every valid sampling setting gives a valid token,
and a row whose logits are not finite fails alone while its batch and the running streams go on.

Before, a temperature near float32's limits made logits / temperature overflow (inf - inf = NaN
in softmax): a tiny one without top_k silently picked the last vocabulary entry (end-of-text),
and with top_k / top_p it raised in the step and failed every row of the batch.
"""

from __future__ import annotations

import asyncio
from contextlib import contextmanager

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.generation import GREEDY, LIVELY, PROMPTS, generation_core, run_joining

from gpt2serve.engine.engine import Engine
from gpt2serve.engine.steps import StepPlan, plain_asks
from gpt2serve.engine.generator import Generator, NewSequence
from gpt2serve.engine.loading import load_model
from gpt2serve.engine import native, sampling
from gpt2serve.engine.step_forward import PromptRow, StepLayout
from gpt2serve.engine.sampling import FINITE, LOGPROB, TOKEN, choose
from gpt2serve.protocol import GREEDY_TEMPERATURE, SamplingParams
from gpt2serve.errors import NonFiniteOutput
from gpt2serve.service.validation import MAX_TEMPERATURE
from gpt2serve.protocol import GenerateRequest
from support.scheduler_events import events
from support.reference import transformers_random_model

VOCAB = 512
# The edges of float32 and of the documented range, and anything in between.
TEMPERATURES = st.one_of(st.sampled_from([0.0, 1e-45, 1e-38, 1e-30, 1e-7, GREEDY_TEMPERATURE, 1e-4, 1.0,
                                          MAX_TEMPERATURE]),
                         st.floats(0.0, MAX_TEMPERATURE, allow_nan=False))
PARAMS = st.builds(SamplingParams, temperature=TEMPERATURES, top_k=st.integers(0, VOCAB),
                   top_p=st.one_of(st.sampled_from([1e-30, 1e-6, 0.5, 1.0]),
                                   st.floats(0.0, 1.0, exclude_min=True)),
                   logprobs=st.integers(0, 5))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(st.tuples(PARAMS, st.floats(0.0, 1.0, exclude_max=True)), min_size=1, max_size=6),
       scale=st.sampled_from([1.0, 30.0, 1e4, 3e38]), seed=st.integers(0, 2**16))
def test_every_valid_setting_gives_a_valid_token(rows, scale, seed):
    """Any temperature in 0..MAX, any top_k, any top_p in (0, 1], any draw, logits of any finite size."""
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(seed)).clamp(-1, 1) * scale
    params, uniform = [p for p, _ in rows], [u for _, u in rows]
    out = choose(logits, params, uniform)
    for row, p in enumerate(params):
        token = int(out[row, TOKEN])
        assert out[row, FINITE] == 1.0 and torch.isfinite(out[row, LOGPROB])
        assert 0 <= token < VOCAB
        ranked = torch.argsort(logits[row], descending=True, stable=True)
        if p.greedy or p.top_k == 1:
            assert logits[row, token] == logits[row].max()
        elif p.top_k:
            assert logits[row, token] >= logits[row, ranked[p.top_k - 1]]
    assert torch.isfinite(out).all()


def test_a_draw_near_one_never_lands_on_a_token_of_probability_zero():
    """Found by the test above: temperature 1e-5 over logits of 3e38 and a draw of 1 - 2e-16 fell
    past the end of the CDF onto the vocabulary's last token, whose probability is 0."""
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0)).clamp(-1, 1) * 3e38
    for params in (SamplingParams(temperature=GREEDY_TEMPERATURE), SamplingParams(temperature=1.0, top_k=5)):
        out = choose(logits, [params], [0.9999999999999998])
        assert torch.isfinite(out[0, LOGPROB]) and logits[0, int(out[0, TOKEN])] == logits[0].max()


def test_a_tiny_temperature_is_greedy_not_end_of_text():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(5)) * 8
    for temperature in (1e-45, 1e-38, 1e-20, GREEDY_TEMPERATURE / 2, GREEDY_TEMPERATURE * 1.01):
        for extra in ({}, {"top_k": 40}, {"top_p": 0.9}):
            out = choose(logits, [SamplingParams(temperature=temperature, **extra)] * 3, [0.999, 0.5, 0.0])
            assert out[:, TOKEN].long().tolist() == logits.argmax(-1).tolist(), (temperature, extra)


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_row_is_flagged_and_the_others_are_untouched(poison):
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.7, top_p=0.9, logprobs=3), SamplingParams(top_k=5),
              SamplingParams(temperature=0.0, logprobs=2), SamplingParams()]
    uniform = [0.1, 0.6, 0.3, 0.9]
    clean = choose(logits, params, uniform)
    if poison == float("-inf"):
        logits[2, :] = poison  # one -inf alone is a valid logit (weight 0); all of them is not
    else:
        logits[2, 7] = poison
    out = choose(logits, params, uniform)
    assert out[2, FINITE] == 0.0
    keep = [0, 1, 3]
    assert torch.equal(out[keep], clean[keep])
    assert torch.isfinite(out).all()


# Through the Generator and the scheduler --------------------------------------------------------

@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    hf = transformers_random_model(seed=3, **LIVELY)
    path = tmp_path_factory.mktemp("isolation") / "ckpt"
    hf.save_pretrained(path)
    return Engine(load_model(str(path), "cpu", "float32"))


EXTREME = [SamplingParams(temperature=1e-38, top_k=3), SamplingParams(temperature=1e-30, top_p=0.5),
           SamplingParams(temperature=1e-40), SamplingParams(temperature=MAX_TEMPERATURE, top_p=1e-9, top_k=50257),
           SamplingParams(temperature=3e-6, top_k=50257, top_p=0.999)]


def test_extreme_settings_in_a_prefill_do_not_touch_their_neighbours(engine):
    def neighbours(extra: list[SamplingParams]) -> list[list[int]]:
        generator = Generator(engine, slots=8)
        sequences = [NewSequence(i, PROMPTS[i], GREEDY, 0) for i in range(3)]
        sequences += [NewSequence(10 + j, PROMPTS[3 + j], p, j) for j, p in enumerate(extra)]
        first = generator.prefill(sequences)
        assert not first.failed
        tokens = [[first.tokens[i].token_id] for i in range(3)]
        for _ in range(6):
            step = generator.decode()
            assert not step.failed and len(step.tokens) == len(sequences)
            for i in range(3):
                tokens[i].append(step.tokens[i].token_id)
        return tokens

    assert neighbours(EXTREME) == neighbours([])


class PoisonedGenerator(Generator):
    """Decode logits of the row at one position turn NaN: a stand-in for an fp16 overflow."""

    poison_position = -1

    def _decode_logits(self, last, positions, span, adapters=None):
        logits = self._real_decode_logits(last, positions, span, adapters)
        return torch.where((positions == self.poison_position)[:, None], float("nan"), logits)

    _real_decode_logits = Generator._decode_logits


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_a_non_finite_stream_fails_alone_and_the_running_streams_go_on(engine, overlap):
    """The poisoned sequence (the only one 50 tokens long, poisoned at its 5th decode step) gets
    NonFiniteOutput; 8 greedy streams beside it give exactly what they give without it (also
    overlapped, where the failure is read after the next step, with it, was launched)."""
    bad_prompt = [(7 * j) % 50257 for j in range(50)]
    requests = [(0.0, GenerateRequest(PROMPTS[i], GREEDY, 12)) for i in range(8)]

    def generator() -> PoisonedGenerator:
        g = PoisonedGenerator(engine, slots=9, graphs=False)
        g.poison_position = 50 + 4
        return g

    clean = asyncio.run(run_joining(generator(), requests))
    good, bad_error, bad_tokens = asyncio.run(run_with_failure(generator(), requests,
                                                               GenerateRequest(bad_prompt, GREEDY, 12), overlap))
    assert good == clean
    assert isinstance(bad_error, NonFiniteOutput) and len(bad_tokens) == 5  # prefill + 4 decodes, then it fails


async def run_with_failure(generator, requests, bad_request, overlap=False):
    scheduler = generation_core(generator, overlap=overlap)
    scheduler.start()

    async def one(request):
        return [step.token.token_id async for step in events(scheduler, request)]

    bad_tokens: list[int] = []

    async def bad():
        try:
            async for step in events(scheduler, bad_request):
                bad_tokens.append(step.token.token_id)
        except NonFiniteOutput as exc:
            return exc
        return None

    try:
        *good, error = await asyncio.gather(*(one(r) for _, r in requests), bad())
        for _ in range(100):
            if not generator.running:
                break
            await asyncio.sleep(0.01)
        assert not generator.running  # every slot came back, the failed one's too
        return good, error, bad_tokens
    finally:
        await scheduler.stop()


NAN_TOKEN = 40002


@contextmanager
def embeds_as_nan(model, token: int):
    """`token` embeds as NaN, as an fp16 overflow would leave a position of the residual stream;
    the real forward carries it on from there."""
    def poison(module, args, vectors):  # (B, T) ids -> (B, T, C) vectors
        return torch.where((args[0] == token)[..., None], float("nan"), vectors)

    handle = model.wte.register_forward_hook(poison)
    try:
        yield
    finally:
        handle.remove()


def greedy_tokens(generator: Generator, seq_id: int, prompt: list[int], n: int) -> list[int]:
    steps = [generator.prefill([NewSequence(seq_id, prompt, GREEDY, 0)])]
    while len(steps) < n:
        steps.append(generator.decode())
    assert not any(step.failed for step in steps)
    return [step.tokens[seq_id].token_id for step in steps]


def test_a_non_finite_prompt_packed_beside_another_fails_alone(engine):
    """Two short prompts share one packed row (engine.step_forward's shared layout), where a NaN of one reaches
    the other through attention at weight 0: the prefill runs again in rows, and only the NaN
    prompt fails. The other generates what it generates alone."""
    bad, good = [NAN_TOKEN, 5], PROMPTS[1]
    assert StepLayout.of(0, [PromptRow(bad), PromptRow(good)], torch.device("cpu"), pack=True).shared is not None
    alone = greedy_tokens(Generator(engine, slots=2, graphs=False), 1, good, 6)
    generator = Generator(engine, slots=2, graphs=False)
    with embeds_as_nan(engine.model, NAN_TOKEN):
        first = generator.prefill([NewSequence(0, bad, GREEDY, 0), NewSequence(1, good, GREEDY, 0)])
        assert first.failed == {0} and 0 not in first.tokens
        generator.remove({0})
        tokens = [first.tokens[1].token_id] + [generator.decode().tokens[1].token_id for _ in range(5)]
    assert tokens == alone


def test_a_non_finite_prompt_packed_after_a_cached_prefix_fails_alone(engine, caplog):
    """The same for next-token prompts behind a cached prefix (Engine.next_token's packed layout)."""
    cached = Engine(engine.loaded)
    cached.attach_prefix_cache(64, doorkeeper=False)
    prefix = PROMPTS[15][:32]
    cached.next_token(plain_asks([prefix + [7]], [1]))  # its two blocks into the cache
    prompts = [prefix + [NAN_TOKEN, 5], prefix + PROMPTS[1]]
    alone = cached.next_token(plain_asks([prompts[1]], [3]))
    with embeds_as_nan(cached.model, NAN_TOKEN):
        both = cached.next_token(plain_asks(prompts, [3, 3]))
    assert both.failed_rows == {0} and both.cached_tokens == [32, 32]
    assert [t.token_id for t in both.top[1]] == [t.token_id for t in alone.top[0]]
    assert [t.logprob for t in both.top[1]] == pytest.approx([t.logprob for t in alone.top[0]], abs=1e-4)
    assert "packed prompts came out non-finite; running them again in rows" in caplog.text  # it was packed


def test_a_non_finite_row_of_a_batch_in_parts_fails_in_its_own_place(engine):
    """A next-token batch over the CPU token budget runs in parts (engine.padding): the failed
    row is named by its place in the batch, and the others answer as in one forward."""
    prompts = [PROMPTS[1], PROMPTS[2], [NAN_TOKEN] + PROMPTS[1], PROMPTS[3]]
    parted = Engine(engine.loaded)
    whole = parted.next_token(plain_asks(prompts[:2] + prompts[3:], [2] * 3))
    parted.forward_tokens = 8  # every prompt in a forward of its own
    with embeds_as_nan(parted.model, NAN_TOKEN):
        out = parted.next_token(plain_asks(prompts, [2] * 4))
    assert out.failed_rows == {2}
    for got, want in zip(out.top[:2] + out.top[3:], whole.top):
        assert [t.token_id for t in got] == [t.token_id for t in want]
        assert [t.logprob for t in got] == pytest.approx([t.logprob for t in want], abs=1e-4)


def test_a_non_finite_sequence_leaves_no_nan_in_its_slot(engine, monkeypatch):
    """Decode attention over a slot's whole span (torch's, as on a GPU) reads the positions past a
    sequence's own length at weight 0, and 0 x NaN is NaN: a shorter sequence taking the slot of
    one that failed must not inherit its NaNs."""
    monkeypatch.setattr(native, "available", lambda: False)
    good, bad = PROMPTS[2], [NAN_TOKEN] + PROMPTS[5]
    assert len(bad) > len(good) + 6
    alone = greedy_tokens(Generator(engine, slots=1, graphs=False), 0, good, 6)
    generator = Generator(engine, slots=1, graphs=False)
    with embeds_as_nan(engine.model, NAN_TOKEN):
        assert generator.prefill([NewSequence(9, bad, GREEDY, 0)]).failed == {9}
        generator.remove({9})
        assert greedy_tokens(generator, 0, good, 6) == alone


def test_a_sequence_that_leaves_with_a_step_unread_leaves_no_nan_in_its_slot(engine, monkeypatch):
    """Overlapped, a caller may leave while its last step is still unread: nobody knows yet
    whether that step wrote NaNs into its slot, so the slot is cleared as it leaves. Here the
    step did (its fed token embeds as NaN, at position 10), and a shorter sequence that takes
    the slot next attends over that position at weight 0."""
    monkeypatch.setattr(native, "available", lambda: False)
    good, left = PROMPTS[2], PROMPTS[3]  # 7 and 10 tokens: a span of 16 covers position 10
    alone = greedy_tokens(Generator(engine, slots=1, graphs=False), 0, good, 6)
    generator = Generator(engine, slots=1, graphs=False)
    generator.prefill([NewSequence(9, left, GREEDY, 0)])
    with torch.inference_mode():
        generator.last_ids[0] = NAN_TOKEN  # as if sampled: fed at the next step
    with embeds_as_nan(engine.model, NAN_TOKEN):
        generator.launch(StepPlan())  # writes NaN keys at position 10; never read
    generator.remove({9})
    assert greedy_tokens(generator, 0, good, 6) == alone


def test_top_p_from_the_best_candidates_picks_what_the_whole_sorted_vocabulary_picks(monkeypatch):
    """engine.sampling looks for a top-p nucleus among the best TOP_P_CANDIDATES first: the token
    must be the one the full sort gives, for rows whose nucleus lies inside them and rows whose
    nucleus does not (those sort their whole vocabulary), both in one batch."""
    generator = torch.Generator().manual_seed(11)
    peaked = torch.randn(6, 50257, generator=generator) * 4  # a nucleus of tens of tokens
    flat = torch.randn(3, 50257, generator=generator) * 0.2  # a nucleus of thousands
    logits = torch.cat((peaked, flat))
    params = [SamplingParams(temperature=t, top_p=p) for t, p in
              [(1.0, 0.9), (0.7, 0.5), (1.3, 0.95), (1.0, 1e-6), (2.0, 0.999), (1.0, 0.8),
               (1.0, 0.9), (1.0, 0.99), (0.5, 0.3)]]
    draws = [i / 9 + 0.05 for i in range(9)]
    fast = choose(logits, params, draws)
    candidates = sampling.TOP_P_CANDIDATES
    monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", 50257)  # every row sorts its whole vocabulary
    full = choose(logits, params, draws)
    assert torch.equal(fast[:, TOKEN], full[:, TOKEN])
    widths = (torch.softmax(logits / torch.tensor([p.temperature for p in params])[:, None], -1)
              .sort(-1, descending=True).values.cumsum(-1) < torch.tensor([p.top_p for p in params])[:, None]).sum(-1)
    assert (widths < candidates).sum() >= 4 and (widths >= candidates).sum() >= 3  # both paths ran, in one batch
    for row in range(len(params)):  # a row alone picks what it picked beside the others
        assert torch.equal(choose(logits[row:row + 1], params[row:row + 1], draws[row:row + 1])[0, TOKEN],
                           fast[row, TOKEN])
