"""The ground truth answers are checked against: a plain transformers forward of one prompt."""

from __future__ import annotations

import torch

TOLERANCE = 1e-4


@torch.inference_mode()
def reference_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """Log-probabilities of the next token for one prompt, alone, no padding. (vocab,)"""
    logits = model(input_ids=torch.tensor([token_ids])).logits  # (1, T, vocab)
    return torch.log_softmax(logits[0, -1].float(), dim=-1)


def assert_matches_reference(model, result, token_ids: list[int], top_k: int) -> None:
    """`result` (a typed NextTokenResult) agrees with the reference within TOLERANCE.

    Compared by value rather than by id order, so near-ties in random weights cannot flip it.
    """
    ref = reference_logprobs(model, token_ids)
    ref_top = torch.topk(ref, top_k).values.tolist()
    assert list(result.prompt_token_ids) == list(token_ids)
    assert len(result.top) == top_k
    assert [t.token_id for t in result.top][0] == result.token_id
    for got, want in zip([t.logprob for t in result.top], ref_top):
        assert abs(got - want) <= TOLERANCE, (got, want)
    for t in result.top:
        assert abs(ref[t.token_id].item() - t.logprob) <= TOLERANCE, (t, ref[t.token_id].item())
    assert abs(result.logprob - ref_top[0]) <= TOLERANCE


@torch.inference_mode()
def reference_layers(model, token_ids: list[int], lens_k: int = 5) -> list[dict]:
    """Per block, computed independently of the server: HF eager attention with
    output_attentions=True on the prompt alone. Keys mirror LayerReport / the block span."""
    implementation = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    try:
        out = model(torch.tensor([token_ids]), output_attentions=True, output_hidden_states=True)
    finally:
        model.config._attn_implementation = implementation
    layers = []
    for index, attn in enumerate(out.attentions):
        attn = attn[0].float()  # (H, L, L), this prompt alone
        last = attn[:, -1, :]  # (H, L)
        max_weight, top_position = last.max(-1)
        length = attn.shape[-1]
        previous = (torch.stack([attn[:, i, i - 1] for i in range(1, length)], -1).mean(-1)
                    if length > 1 else torch.zeros(attn.shape[0]))
        layer = {
            "entropy": (-(last * last.clamp_min(1e-30).log()).sum(-1)).tolist(),
            "max_weight": max_weight.tolist(), "top_position": top_position.tolist(),
            "top_token_id": [token_ids[p] for p in top_position.tolist()],
            "first_token_weight": last[:, 0].tolist(), "previous_token_score": previous.tolist(),
        }
        if index < len(out.attentions) - 1:  # HF applies ln_f to the last hidden state it returns
            layer["residual_norm"] = out.hidden_states[index + 1][0, -1].float().norm().item()
        layers.append(layer)
    probs, ids = out.logits[0, -1].float().softmax(-1).topk(lens_k)
    layers[-1]["logit_lens_ids"], layers[-1]["logit_lens_probs"] = ids.tolist(), probs.tolist()
    return layers


def assert_layer_matches(got: dict, want: dict) -> None:
    """`got` has the keys of `want` (per-head lists, norms, logit lens), within TOLERANCE."""
    for key, expected in want.items():
        value = got[key]
        if key in ("top_position", "top_token_id", "logit_lens_ids"):
            assert list(value) == expected, (key, value, expected)
        elif isinstance(expected, list):
            assert len(value) == len(expected), key
            for a, b in zip(value, expected):
                assert abs(a - b) <= TOLERANCE, (key, value, expected)
        else:
            assert abs(value - expected) <= TOLERANCE * max(1.0, abs(expected)), (key, value, expected)
