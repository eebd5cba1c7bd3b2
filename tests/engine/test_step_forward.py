"""One forward for every row of a step (engine.step_forward): decode rows, a long prompt's
chunk, a next-token prompt that hits the prefix cache (scored too) and one that does not, a new
generation's prompt, each answered as transformers answers it alone; and riders leave the decode step's tokens as they were, fp32 and
int8 (its fp16 KV cache and the compiled decode attention) alike."""

from __future__ import annotations

import pytest
import torch

from support.generation import PROMPTS, lively_engine, transformers_greedy
from support.reference import assert_prompt_scores_match

from gpt2serve.engine.engine import Engine
from gpt2serve.engine.generator import Generator, NewSequence
from gpt2serve.engine.steps import Ask, StepPlan, plain_asks
from gpt2serve.engine.loading import load_model
from gpt2serve.protocol import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
RIDERS = [[11, 12, 13], [14], [15, 16, 17, 18, 19, 20, 21]]


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_riders_leave_the_decode_step_as_it_was_and_get_their_own_answers(quantize):
    engine = Engine(load_model("random:tiny", "cpu", "float32", quantize=quantize))
    plain, mixed = Generator(engine, 4), Generator(engine, 4)
    for generator in (plain, mixed):
        generator.prefill([NewSequence(0, [5, 6, 7, 8], GREEDY, 0), NewSequence(1, [9, 10], GREEDY, 1)])
    for step in range(6):
        want = plain.decode()
        got = mixed.decode([Ask(r, k) for r, k in zip(RIDERS, [5, 1, 3])])
        assert {i: t.token_id for i, t in got.tokens.items()} == {i: t.token_id for i, t in want.tokens.items()}
        for i, token in want.tokens.items():  # another kernel for the decode rows: an ulp or so apart
            assert got.tokens[i].logprob == pytest.approx(token.logprob, abs=1e-5), (step, i)
        assert got.tokens_in == 2 + sum(map(len, RIDERS)) and not got.riders.failed_rows
        for rider, k, top in zip(RIDERS, [5, 1, 3], got.riders.top):
            alone = engine.next_token(plain_asks([rider], [k])).top[0]
            assert [t.token_id for t in top] == [t.token_id for t in alone]
            assert [t.logprob for t in top] == pytest.approx([t.logprob for t in alone], abs=1e-5)
    assert mixed.running[0].length == plain.running[0].length == 4 + 6  # the riders took no cache positions


SHARED = [(5 * j + 1) % 50257 for j in range(32)]  # two prefix-cache blocks
LONG = [(7 * j + 3) % 50257 for j in range(60)]  # read in chunks of 16: 16, 16, 16, 12


def test_one_plan_of_decode_rows_a_chunk_prompts_and_a_joining_generation_is_one_forward_as_transformers_answers(tmp_path):
    hf, engine = lively_engine(tmp_path)
    engine.attach_prefix_cache(64, doorkeeper=False)
    engine.next_token(plain_asks([SHARED + [9]], [1]))  # the shared blocks into the prefix cache
    generator = Generator(engine, slots=4, chunk_tokens=16)
    decoding = {0: PROMPTS[3], 1: PROMPTS[6]}
    prefilled = generator.prefill([NewSequence(i, p, GREEDY, i) for i, p in decoding.items()])
    generator.chunk_if_long(NewSequence(2, LONG, GREEDY, 2))
    cached_prompt, plain_prompt, joining = SHARED + [40, 41, 42], PROMPTS[2], SHARED + [50, 51]

    forwards = []
    hidden_states = generator.model.hidden_states

    def counted(*args, **kwargs):
        forwards.append(args[0].shape)  # (1, N): every row packed in one
        return hidden_states(*args, **kwargs)

    generator.model.hidden_states = counted
    try:
        plan = StepPlan(riders=[Ask(cached_prompt, 5, prompt_logprobs=2), Ask(plain_prompt, 3)],
                        joining=[NewSequence(3, joining, GREEDY, 3, prompt_logprobs=1)], chunk=16)
        first = generator.finish(generator.launch(plan))
    finally:
        del generator.model.hidden_states
    # two decode tokens, the cached prompt's 3 new ones, the plain prompt, a new generation's 2
    # past its cached blocks, the chunk: one forward
    assert forwards == [torch.Size([1, 2 + 3 + len(plain_prompt) + 2 + 16])]
    assert first.rows == 4 and first.riders.cached_tokens == [32, 0] and first.cached_tokens == {3: 32}
    assert first.first(3) and not first.first(0)
    for prompt, k, top in zip([cached_prompt, plain_prompt], [5, 3], first.riders.top):
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0, -1].log_softmax(-1).topk(k)
        assert [t.token_id for t in top] == want.indices.tolist()
        assert [t.logprob for t in top] == pytest.approx(want.values.tolist(), abs=1e-4)
    # every position of the scored rider and of the scored new generation, its cached ones too
    assert list(first.riders.prompt_scores) == [0] and list(first.prompt_scores) == [3]
    for prompt, s in ((cached_prompt, first.riders.prompt_scores[0]), (joining, first.prompt_scores[3])):
        assert_prompt_scores_match(hf, prompt, s.token_logprobs, s.ranks, s.top_ids, s.top_logprobs)

    tokens = {i: [t.token_id] for i, t in prefilled.tokens.items()}
    for i, t in first.tokens.items():
        tokens.setdefault(i, []).append(t.token_id)
    for _ in range(8):
        step = generator.decode(chunk=generator.next_chunk is not None)
        for i, t in step.tokens.items():
            tokens.setdefault(i, []).append(t.token_id)
    assert step.cached_tokens == {} and not generator.chunked
    for i, prompt in decoding.items():
        assert tokens[i] == transformers_greedy(hf, prompt, 10)
    assert tokens[2] == transformers_greedy(hf, LONG, len(tokens[2])) and len(tokens[2]) == 9 - 3
    assert tokens[3] == transformers_greedy(hf, joining, 9)  # its slot: the cached blocks, then its own


def test_a_chunk_read_in_a_step_of_its_own_joins_after_the_running_sequences(tmp_path):
    """Where no decode step takes a chunk along (on cuda with graphs), it is read in a step of its
    own (a plan with no decode rows) while other sequences hold slots: its last chunk's sequence takes the next
    free slot, and nobody's keys are overwritten."""
    hf, engine = lively_engine(tmp_path)
    generator = Generator(engine, slots=3, chunk_tokens=16)
    decoding = {0: PROMPTS[3], 1: PROMPTS[6]}
    tokens = {i: [t.token_id] for i, t in generator.prefill([NewSequence(i, p, GREEDY, i)
                                                             for i, p in decoding.items()]).tokens.items()}
    generator.chunk_if_long(NewSequence(2, LONG, GREEDY, 2))
    while generator.next_chunk is not None:
        step = generator.finish(generator.launch(StepPlan(decode=False, chunk=16)))
        assert set(step.tokens) <= {2}
    tokens[2] = [step.tokens[2].token_id]
    assert [r.seq_id for r in generator.running] == [0, 1, 2]
    for _ in range(5):
        for i, t in generator.decode().tokens.items():
            tokens[i].append(t.token_id)
    for i, prompt in decoding.items():
        assert tokens[i] == transformers_greedy(hf, prompt, 6)
    assert tokens[2] == transformers_greedy(hf, LONG, 6)
