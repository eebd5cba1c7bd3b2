"""Our forward's parts, in process on the CPU: left padding by tensor ops, the attention mask,
shape buckets, and the bucketed path CUDA graphs replay (run here without capture)."""

from __future__ import annotations

import random

import pytest
import torch
from support.reference import assert_matches_reference, reference_logprobs
from support.reference import as_result

from gpt2serve.engine.engine import Engine, EngineOptions
from gpt2serve.engine.steps import plain_asks
from support.asks import traced_asks
from gpt2serve.engine.gpt2 import attention_mask
from gpt2serve.engine.padding import IDS, POSITIONS, VALID, Buckets, batch_buckets, left_pad, length_buckets

PAD = 50256


def test_left_padding_ids_positions_and_mask():
    batch = left_pad([[7, 8, 9], [5]], PAD)
    assert batch[IDS].tolist() == [[7, 8, 9], [PAD, PAD, 5]]
    assert batch[POSITIONS].tolist() == [[0, 1, 2], [0, 0, 0]]
    assert batch[VALID].tolist() == [[1, 1, 1], [0, 0, 1]]


def test_left_padding_into_a_larger_bucket_adds_padding_rows_and_columns():
    batch = left_pad([[7, 8], [5]], PAD, batch=3, length=4)
    assert batch[IDS].tolist() == [[PAD, PAD, 7, 8], [PAD, PAD, PAD, 5], [PAD] * 4]
    assert batch[POSITIONS].tolist() == [[0, 0, 0, 1], [0, 0, 0, 0], [0] * 4]
    assert batch[VALID].tolist() == [[0, 0, 1, 1], [0, 0, 0, 1], [0] * 4]


def test_left_padding_matches_a_plain_loop_on_random_batches():
    rng = random.Random(0)
    for i in range(100):
        one_length = rng.randint(1, 20)  # every other batch of one length: left_pad_into's path of plain slices
        prompts = [[rng.randrange(50000) for _ in range(one_length if i % 2 else rng.randint(1, 20))]
                   for _ in range(rng.randint(1, 30))]
        B, T = len(prompts) + rng.randint(0, 3), max(map(len, prompts)) + rng.randint(0, 5)
        got = left_pad(prompts, PAD, B, T)
        want = torch.zeros(3, B, T, dtype=torch.long)
        want[IDS] = PAD
        for row, prompt in enumerate(prompts):
            want[IDS, row, T - len(prompt):] = torch.tensor(prompt)
            want[POSITIONS, row, T - len(prompt):] = torch.arange(len(prompt))
            want[VALID, row, T - len(prompt):] = 1
        assert torch.equal(got, want)


def test_mask_hides_padding_from_real_tokens_and_leaves_no_row_empty():
    valid = torch.tensor([[False, False, True, True], [False, False, False, False]])
    mask = attention_mask(valid)  # (B, 1, T, T)
    assert mask.shape == (2, 1, 4, 4)
    assert mask[0, 0].tolist() == [[True, False, False, False], [False, True, False, False],
                                   [False, False, True, False], [False, False, True, True]]
    assert mask.any(dim=-1).all(), "every query attends to something (no NaN rows)"


def test_buckets_are_the_smallest_that_fit_and_waste_at_most_a_third():
    sizes = batch_buckets(256)
    assert sizes[:6] == [1, 2, 4, 8, 12, 16] and sizes[-1] == 256
    assert batch_buckets(64)[-1] == 64 and batch_buckets(100)[-1] == 100 and batch_buckets(1) == [1]
    assert length_buckets(256) == [8, 16, 32, 64, 128, 256] and length_buckets(1000)[-1] == 1000
    buckets = Buckets.for_model(256, 256)
    for batch in range(1, 257):
        for length in (1, 5, 8, 9, 100, 256):
            b, t = buckets.shape_for(batch, length)
            assert b >= batch and t >= length
            assert all(s < batch for s in buckets.batch if s < b), "the smallest batch bucket"
            assert all(s < length for s in buckets.length if s < t), "the smallest length bucket"
            if batch > 8:
                assert b - batch <= b / 3, "at most a third of the rows are padding"
    assert buckets.shape_for(257, 5) is None and buckets.shape_for(1, 257) is None


@pytest.fixture(scope="module")
def bucketed_engine(tiny_model):
    """The engine with the bucketed path the CUDA graphs use, here without capture."""
    engine = Engine(tiny_model, EngineOptions(max_batch_size=16))
    engine.graphs = engine.bucketed(capture=False)
    engine.forward_tokens = None  # as on cuda: a batch in one forward
    return engine


def test_bucketed_path_gives_each_prompt_its_answer_alone(bucketed_engine, tiny_model):
    """5 prompts of lengths 1..13 run as a bucket of 8 rows x 16 columns."""
    prompts = [[464, 3139, 286, 4881, 318], [15496], [40, 588, 257, 3797, 290, 262, 1266, 286, 428, 318, 257, 1332, 6152],
               [50256, 0, 50255], [7] * 9]
    out = bucketed_engine.next_token(plain_asks(prompts, [5, 1, 8, 3, 2]))
    assert out.cuda_graph and out.padded_len == 16
    assert (8, 16) in bucketed_engine.graphs.ready
    for prompt, top, k in zip(prompts, out.top, [5, 1, 8, 3, 2]):
        assert_matches_reference(tiny_model.model, as_result(prompt, top), prompt, k)


def test_a_bucket_is_captured_from_its_first_launchs_own_inputs(tiny_model):
    """A capture executes the step (its warm-up runs), so it runs from the launch's real inputs:
    a decode or prefill bucket first met mid-generation then writes only its own rows' keys and
    values, where placeholder inputs would write over running sequences' slots. The capture
    here stands in for torch.cuda.graph (no GPU on this machine); test_gpu captures for real."""
    engine = Engine(tiny_model, EngineOptions(max_batch_size=16))
    bucketed = engine.bucketed(capture=False)
    bucketed.capture = True  # as on cuda
    captured_from = []

    def capture(bucket):
        captured_from.append(bucket.inputs.clone())
        bucketed._step(bucket)
        return None  # no graph: the launch then runs the step itself

    bucketed._capture = capture
    prompts = [[464, 3139, 286], [15496]]
    first, _ = bucketed.run(prompts)
    first = first.clone()
    again, shape = bucketed.run(prompts)
    assert len(captured_from) == 1 and shape == (2, 8)  # one try per shape
    assert captured_from[0][IDS, 0, -3:].tolist() == [464, 3139, 286] and captured_from[0][IDS, 1, -1] == 15496
    assert torch.equal(first, again)


def test_bucketed_path_equals_the_eager_path(bucketed_engine, tiny_model):
    rng = random.Random(1)
    eager = Engine(tiny_model, EngineOptions(max_batch_size=16))
    for batch in (1, 3, 9, 16):
        prompts = [[rng.randrange(50257) for _ in range(rng.randint(1, 40))] for _ in range(batch)]
        bucketed, plain = bucketed_engine.next_token(plain_asks(prompts, [4] * batch)), eager.next_token(plain_asks(prompts, [4] * batch))
        assert bucketed.cuda_graph and not plain.cuda_graph
        for a, b in zip(bucketed.top, plain.top):
            assert [s.token_id for s in a] == [s.token_id for s in b]
            assert [s.logprob for s in a] == pytest.approx([s.logprob for s in b], abs=1e-5)


def test_shapes_past_the_buckets_and_traced_batches_run_eagerly(bucketed_engine, tiny_model):
    long_prompt = list(range(100, 300))  # 200 tokens: bucket (1, 256), tiny's whole context
    assert bucketed_engine.next_token(plain_asks([long_prompt], [2])).cuda_graph
    too_many = [[464, 3139]] * 17  # past max_batch_size 16
    out = bucketed_engine.next_token(plain_asks(too_many, [2] * 17))
    assert not out.cuda_graph and out.padded_len == 2
    traced = bucketed_engine.next_token(traced_asks([[464, 3139]], 2, [0]))
    assert not traced.cuda_graph and traced.probe is not None
    want = reference_logprobs(tiny_model.model, [464, 3139]).max().item()
    assert traced.top[0][0].logprob == pytest.approx(want, abs=1e-4)
