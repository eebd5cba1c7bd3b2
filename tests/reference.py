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
