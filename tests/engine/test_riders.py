"""Next-token prompts riding a decode step (engine.riders): the step's tokens are the plain step's,
and each rider's top-k is what the prompt gets alone, fp32 and int8 (its fp16 KV cache and the
compiled decode attention) alike."""

from __future__ import annotations

import pytest

from gpt2serve.engine.engine import Engine
from gpt2serve.engine.generator import Generator, NewSequence
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
        got = mixed.decode(RIDERS, [5, 1, 3])
        assert {i: t.token_id for i, t in got.tokens.items()} == {i: t.token_id for i, t in want.tokens.items()}
        for i, token in want.tokens.items():  # another kernel for the decode rows: an ulp or so apart
            assert got.tokens[i].logprob == pytest.approx(token.logprob, abs=1e-5), (step, i)
        assert got.tokens_in == 2 + sum(map(len, RIDERS)) and not got.rider_failed
        for rider, k, top in zip(RIDERS, [5, 1, 3], got.rider_tops):
            alone = engine.next_token([rider], [k]).top[0]
            assert [t.token_id for t in top] == [t.token_id for t in alone]
            assert [t.logprob for t in top] == pytest.approx([t.logprob for t in alone], abs=1e-5)
    assert mixed.running[0].length == plain.running[0].length == 4 + 6  # the riders took no cache positions
