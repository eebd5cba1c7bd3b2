"""Per-layer reports against an independent computation: HF eager attention with
output_attentions=True on each prompt alone, fp32."""

from __future__ import annotations

import math

import pytest
import torch

from gpt2serve.engine.engine import Engine

PROMPTS = [[464, 3139, 286, 4881, 318], [40, 588], [1212, 318, 257, 1332, 286, 262, 1080, 13, 632], [50256]]


@pytest.fixture(scope="module")
def engine(tiny_model):
    return Engine(tiny_model)


def reference(model, prompt):
    eager = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    try:
        with torch.no_grad():
            out = model(torch.tensor([prompt]), output_attentions=True, output_hidden_states=True)
    finally:
        model.config._attn_implementation = eager
    return out


def expected_heads(attn):  # attn: (H, L, L) for one prompt alone
    last = attn[:, -1, :]
    entropy = -(last * last.clamp_min(1e-30).log()).sum(-1)
    max_weight, top_position = last.max(-1)
    if attn.shape[-1] > 1:
        previous = torch.stack([attn[:, i, i - 1] for i in range(1, attn.shape[-1])], -1).mean(-1)
    else:
        previous = torch.zeros(attn.shape[0])
    return entropy, max_weight, top_position, last[:, 0], previous


@pytest.mark.parametrize("traced", [[0], [2], [1, 3], [0, 1, 2, 3]])
def test_reports_match_eager_attention_alone(engine, tiny_model, traced):
    """Traced rows share a left-padded batch with untraced rows of other lengths."""
    out = engine.next_token(PROMPTS, [5] * len(PROMPTS), traced_rows=traced)
    assert sorted(out.layers) == sorted(traced)
    model = tiny_model.model
    cfg = model.config
    for row in traced:
        prompt, reports = PROMPTS[row], out.layers[row]
        ref = reference(model, prompt)
        assert len(reports) == cfg.n_layer
        length, padded = len(prompt), max(map(len, PROMPTS))
        for layer, report in enumerate(reports):
            assert report.index == layer
            assert report.batch_hidden_shape == [len(PROMPTS), padded, cfg.n_embd]
            assert report.batch_qkv_shape == [len(PROMPTS), cfg.n_head, padded, cfg.n_embd // cfg.n_head]
            assert report.batch_attn_shape == [len(PROMPTS), cfg.n_head, padded, padded]
            assert report.batch_mlp_shape == [len(PROMPTS), padded, 4 * cfg.n_embd]
            assert report.hidden_shape == [length, cfg.n_embd]
            assert report.attn_shape == [cfg.n_head, length, length]
            entropy, max_weight, top_position, first, previous = expected_heads(ref.attentions[layer][0])
            assert len(report.heads) == cfg.n_head
            for h, head in enumerate(report.heads):
                assert head.entropy == pytest.approx(entropy[h].item(), abs=1e-4)
                assert head.max_weight == pytest.approx(max_weight[h].item(), abs=1e-4)
                assert head.top_position == top_position[h].item()
                assert head.top_token_id == prompt[head.top_position]
                assert head.first_token_weight == pytest.approx(first[h].item(), abs=1e-4)
                assert head.previous_token_score == pytest.approx(previous[h].item(), abs=1e-4)
            # hidden_states[layer + 1] is the residual stream after this block (the last one has
            # ln_f applied by HF, so compare the norm before it for the earlier blocks only).
            if layer < cfg.n_layer - 1:
                expected_norm = ref.hidden_states[layer + 1][0, -1].norm().item()
                assert report.residual_norm == pytest.approx(expected_norm, rel=1e-4)
            assert math.isfinite(report.attn_output_norm) and report.attn_output_norm > 0
            assert math.isfinite(report.mlp_output_norm) and report.mlp_output_norm > 0
            assert report.duration_ms > 0
        # Logit lens after the last block is the model's real next-token distribution.
        probs = ref.logits[0, -1].softmax(-1)
        top_probs, top_ids = probs.topk(5)
        lens = reports[-1].logit_lens
        assert [t.token_id for t in lens] == top_ids.tolist()
        assert [t.prob for t in lens] == pytest.approx(top_probs.tolist(), abs=1e-5)
        assert out.top[row][0].token_id == lens[0].token_id


def test_untraced_batches_carry_no_reports_and_answers_do_not_change(engine):
    plain = engine.next_token(PROMPTS, [5] * 4)
    traced = engine.next_token(PROMPTS, [5] * 4, traced_rows=[1])
    assert plain.layers == {} and plain.timeline is None
    for a, b in zip(plain.top, traced.top):
        assert [s.token_id for s in a] == [s.token_id for s in b]
        assert [s.logprob for s in a] == pytest.approx([s.logprob for s in b], abs=1e-5)
    timeline = traced.timeline
    stages = [timeline.embed, *timeline.blocks, timeline.unembed]
    assert all(start <= end for start, end in stages)
    assert all(a[1] == b[0] for a, b in zip(stages, stages[1:])), "stages tile the forward"
    assert traced.started_ns <= timeline.embed[0] and timeline.unembed[1] <= traced.ended_ns
