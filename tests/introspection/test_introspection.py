"""Per-layer reports against an independent computation: HF eager attention with
output_attentions=True on each prompt alone, fp32."""

from __future__ import annotations

import math

import pytest
import torch
from support.reference import assert_layer_matches, reference_layers
from support.reference import report_as_dict

from gpt2serve.engine.engine import Engine
from gpt2serve.engine.steps import plain_asks
from support.asks import traced_asks

PROMPTS = [[464, 3139, 286, 4881, 318], [40, 588], [1212, 318, 257, 1332, 286, 262, 1080, 13, 632], [50256]]


@pytest.fixture(scope="module")
def engine(tiny_model):
    return Engine(tiny_model)


@pytest.mark.parametrize("traced", [[0], [2], [1, 3], [0, 1, 2, 3]])
def test_reports_match_eager_attention_alone(engine, tiny_model, traced):
    """Traced rows share a left-padded batch with untraced rows of other lengths."""
    out = engine.layer_reports(engine.next_token(traced_asks(PROMPTS, 5, traced)))
    assert sorted(out.layers) == sorted(traced)
    model = tiny_model.model
    cfg = model.config
    for row in traced:
        prompt, reports = PROMPTS[row], out.layers[row]
        want = reference_layers(model, prompt)
        assert len(reports) == cfg.n_layer
        length, padded = len(prompt), max(map(len, PROMPTS))
        for layer, report in enumerate(reports):
            assert report.index == layer
            assert report.batch_hidden_shape == [len(PROMPTS), padded, cfg.d_model]
            assert report.batch_qkv_shape == [len(PROMPTS), cfg.n_head, padded, cfg.d_head]
            assert report.batch_attn_shape == [len(PROMPTS), cfg.n_head, padded, padded]
            assert report.batch_mlp_shape == [len(PROMPTS), padded, cfg.d_mlp]
            assert report.hidden_shape == [length, cfg.d_model]
            assert report.attn_shape == [cfg.n_head, length, length]
            assert len(report.heads) == cfg.n_head
            assert_layer_matches(report_as_dict(report), want[layer])
            assert math.isfinite(report.attn_output_norm) and report.attn_output_norm > 0
            assert math.isfinite(report.mlp_output_norm) and report.mlp_output_norm > 0
            assert report.duration_ms > 0
        lens = reports[-1].logit_lens  # after the last block: the model's real next-token distribution
        assert out.top[row][0].token_id == lens[0].token_id


def test_untraced_batches_carry_no_reports_and_answers_do_not_change(engine):
    plain = engine.next_token(plain_asks(PROMPTS, [5] * 4))
    traced = engine.layer_reports(engine.next_token(traced_asks(PROMPTS, 5, [1])))
    assert plain.layers == {} and plain.timeline is None
    for a, b in zip(plain.top, traced.top):
        assert [s.token_id for s in a] == [s.token_id for s in b]
        assert [s.logprob for s in a] == pytest.approx([s.logprob for s in b], abs=1e-5)
    timeline = traced.timeline
    stages = [timeline.embed, *timeline.blocks, timeline.unembed]
    assert all(start <= end for start, end in stages)
    assert all(a[1] == b[0] for a, b in zip(stages, stages[1:])), "stages tile the forward"
    assert traced.started_ns <= timeline.embed[0] and timeline.unembed[1] <= traced.ended_ns


def test_attention_maps_and_the_all_position_lens_match_eager_attention_alone(engine, tiny_model):
    """Row 2 asks for maps, row 0 only for its summaries, row 1 for nothing."""
    from support.reference import reference_maps

    out = engine.layer_reports(engine.next_token(traced_asks(PROMPTS, 5, [0, 2], [2])))
    assert all(not r.attention and not r.logit_lens_positions for r in out.layers[0])
    prompt = PROMPTS[2]
    length, cfg = len(prompt), tiny_model.model.config
    for report, want in zip(out.layers[2], reference_maps(tiny_model.model, prompt)):
        assert len(report.attention) == cfg.n_head * length * length
        for head in range(cfg.n_head):
            got = torch.tensor(report.attention_map(head))  # (L, L)
            assert torch.allclose(got, want["attention"][head], atol=1e-5), head
            assert torch.allclose(got.sum(-1), torch.ones(length), atol=1e-5)  # each query's weights sum to 1
        assert [t.token_id for t in report.logit_lens_positions] == want["lens_ids"]
        assert [t.prob for t in report.logit_lens_positions] == pytest.approx(want["lens_probs"], abs=1e-5)
    # After the last block, the last position's lens is the answer itself.
    assert out.layers[2][-1].logit_lens_positions[-1].token_id == out.top[2][0].token_id
