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


def test_a_top_table_gives_the_bytes_of_chosen_rows_and_their_k():
    """What the IPC door sends a front end (TopTable.packed): its rows' values and ids as they
    were copied back, in the order asked, and each row's k only when some row wants fewer."""
    both = torch.tensor([[[-0.1, -2.0], [-0.5, -0.9], [float("inf"), -1.0]],  # values (B=3, k=2)
                         [[7.0, 3.0], [50256.0, 11.0], [0.0, 1.0]]])  # ids, as float32
    table, failed = read_top_k(both, [2, 1, 2])
    assert failed == frozenset({2})  # +inf is not finite either
    blob, top_ks = table.packed([1, 0])
    assert torch.frombuffer(bytearray(blob), dtype=torch.float32).view(2, 2, 2).tolist() == both[:, [1, 0]].tolist()
    assert top_ks == [1, 2]
    assert table.packed([0, 2])[1] == []  # both want k_max
    assert table[1].ids == [50256] and list(table)[0].ids == [7, 3]
