"""The ground truth answers are checked against: a plain transformers forward of one prompt.

The server runs its own GPT-2 (gpt2serve.engine.gpt2); the judge is transformers'
GPT2LMHeadModel holding the same weights, fp32 on the CPU.
"""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from gpt2serve.engine.convert import to_transformers
from gpt2serve.engine.gpt2 import GPT2
from gpt2serve_client.types import NextTokenResult, TokenLogprob

TOLERANCE = 1e-4
_converted: dict[int, tuple[GPT2, GPT2LMHeadModel]] = {}


def as_transformers(model) -> GPT2LMHeadModel:
    """transformers' model for `model`: itself, or ours converted (once per model object)."""
    if not isinstance(model, GPT2):
        return model
    if id(model) not in _converted:
        _converted[id(model)] = (model, to_transformers(model))  # holds `model`, so its id stays unique
    return _converted[id(model)][1]


def transformers_random_model(seed: int = 5, **config) -> GPT2LMHeadModel:
    """A checkpoint as transformers itself initialises and saves it (tiny by default)."""
    config = {"n_layer": 2, "n_head": 4, "n_embd": 64, "n_positions": 256, **config}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT2LMHeadModel(GPT2Config(**config)).eval()


@torch.no_grad()  # not inference_mode: a caller may change the answer in place
def reference_logits(model, token_ids: list[int]) -> torch.Tensor:
    """The next token's logits for one prompt, alone, no padding. (vocab,) fp32"""
    model = as_transformers(model)
    return model(input_ids=torch.tensor([token_ids])).logits[0, -1].float()  # (1, T, vocab) -> (vocab,)


def reference_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """Log-probabilities of the next token for one prompt, alone, no padding. (vocab,)"""
    return torch.log_softmax(reference_logits(model, token_ids), dim=-1)


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


def eager_forward(model, token_ids: list[int]):
    """transformers' model and its forward of one prompt with eager attention, returning the
    attention probabilities and every hidden state."""
    model = as_transformers(model)
    implementation = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    try:
        return model, model(torch.tensor([token_ids]), output_attentions=True, output_hidden_states=True)
    finally:
        model.config._attn_implementation = implementation


@torch.inference_mode()
def reference_layers(model, token_ids: list[int], lens_k: int = 5) -> list[dict]:
    """Per block, computed independently of the server: HF eager attention with
    output_attentions=True on the prompt alone. Keys mirror LayerReport / the block span."""
    model, out = eager_forward(model, token_ids)
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


def assert_layer_matches(got: dict, want: dict, tolerance: float = TOLERANCE) -> None:
    """`got` has the keys of `want` (per-head lists, norms, logit lens), within `tolerance`."""
    for key, expected in want.items():
        value = got[key]
        if key in ("top_position", "top_token_id", "logit_lens_ids"):
            assert list(value) == expected, (key, value, expected)
        elif isinstance(expected, list):
            assert len(value) == len(expected), key
            for a, b in zip(value, expected):
                assert abs(a - b) <= tolerance, (key, value, expected)
        else:
            assert abs(value - expected) <= tolerance * max(1.0, abs(expected)), (key, value, expected)


@torch.inference_mode()
def reference_maps(model, token_ids: list[int]) -> list[dict]:
    """Per block, independently of the server: HF eager attention probabilities [H, L, L] and the
    logit lens at every position (top-1 id and probability after the block)."""
    model, out = eager_forward(model, token_ids)
    n_layer = len(out.attentions)
    maps = []
    for index, attn in enumerate(out.attentions):
        if index < n_layer - 1:  # HF applies ln_f to the last hidden state it returns
            logits = model.lm_head(model.transformer.ln_f(out.hidden_states[index + 1][0]))
        else:
            logits = out.logits[0]
        probs, ids = logits.float().softmax(-1).max(-1)  # (L,)
        maps.append({"attention": attn[0].float(), "lens_ids": ids.tolist(), "lens_probs": probs.tolist()})
    return maps


@torch.inference_mode()
def reference_prompt_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """Every position's log-probabilities, the prompt alone: (T, vocab); row i predicts token i+1."""
    logits = as_transformers(model)(input_ids=torch.tensor([token_ids])).logits  # (1, T, vocab)
    return torch.log_softmax(logits[0].float(), dim=-1)


def assert_prompt_scores_match(model, token_ids: list[int], token_logprobs, ranks, top_ids, top_logprobs) -> None:
    """Scores of positions 1..T-1 (token logprob, rank, top-k) against transformers' forward."""
    ref = reference_prompt_logprobs(model, token_ids)[:-1]  # (T-1, vocab): the last row predicts no prompt token
    targets = torch.tensor(token_ids[1:])
    want = ref.gather(1, targets[:, None])[:, 0]  # (T-1,)
    assert len(token_logprobs) == len(token_ids) - 1
    got = torch.tensor(token_logprobs, dtype=torch.float64)
    assert torch.allclose(got, want.double(), atol=TOLERANCE, rtol=0), (got - want).abs().max()
    for i, (rank, ids, values) in enumerate(zip(ranks, top_ids, top_logprobs)):
        row = ref[i]
        # Ranks are counts of strictly better tokens: exact unless a near-tie sits within tolerance.
        lo = int((row > want[i] + TOLERANCE).sum()) + 1
        hi = int((row > want[i] - TOLERANCE).sum()) + 1
        assert lo <= rank <= hi, (i, rank, lo, hi)
        best = torch.topk(row, len(ids)).values.tolist()
        for got_value, want_value, token in zip(values, best, ids):
            assert abs(got_value - want_value) <= TOLERANCE
            assert abs(row[token].item() - got_value) <= TOLERANCE


def as_result(prompt: list[int], top) -> NextTokenResult:
    tops = [TokenLogprob(s.token_id, "", s.logprob) for s in top]
    return NextTokenResult(tops[0].token_id, "", tops[0].logprob, tops, prompt)


def report_as_dict(report) -> dict:
    """A LayerReport in the key space of reference_layers()."""
    got = {key: [getattr(h, key) for h in report.heads] for key in (
        "entropy", "max_weight", "top_position", "top_token_id", "first_token_weight", "previous_token_score")}
    got["residual_norm"] = report.residual_norm
    got["logit_lens_ids"] = [t.token_id for t in report.logit_lens]
    got["logit_lens_probs"] = [t.prob for t in report.logit_lens]
    return got
