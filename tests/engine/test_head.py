"""engine.head's last-position top-k alone: every row's best k, each row with its own k, and the
rows whose log-probs are not finite, from one tensor copied back."""

from __future__ import annotations

import math

import torch

from gpt2serve.engine.head import read_top_k, top_k_rows


def test_each_row_gets_its_own_k_best_in_order_and_non_finite_rows_are_named():
    torch.manual_seed(0)
    logprobs = torch.log_softmax(torch.randn(4, 50), dim=-1)  # (B, V)
    logprobs[2] = float("nan")  # a NaN logit makes log_softmax NaN across the row
    top, failed = top_k_rows(logprobs, [1, 3, 2, 5])
    assert failed == frozenset({2})
    assert [len(t.ids) for t in top] == [1, 3, 2, 5]
    for row in (0, 1, 3):
        values, ids = torch.sort(logprobs[row], descending=True)
        k = len(top[row].ids)
        assert top[row].ids == ids[:k].tolist()
        assert top[row].logprobs == values[:k].tolist()
    assert math.isnan(top[2].logprobs[0])


def test_rows_that_all_want_the_same_k_are_read_whole():
    both = torch.tensor([[[-0.1, -2.0], [-0.5, -0.9]],  # values (B=2, k=2)
                         [[7.0, 3.0], [50256.0, 11.0]]])  # ids, as float32
    top, failed = read_top_k(both, [2, 2])
    assert failed == frozenset()
    assert [t.ids for t in top] == [[7, 3], [50256, 11]]
    assert [t.logprobs for t in top] == both[0].tolist()  # float32 values, as copied back
    assert all(type(i) is int for t in top for i in t.ids)
