"""Which of the waiting prompts run together: group by length so short prompts are not padded
to the longest one, within the batch size and padded-token caps.

A forward over a left-padded batch costs about `fixed + size * longest` (weights are read once
per forward; the rest grows with the padded tokens). Sorting the candidates by length and
cutting them into contiguous groups that minimise the summed cost is a small dynamic program;
equal lengths never split (a second forward only adds its fixed cost), while one 200-token
prompt among 5-token ones gets its own batch instead of padding 63 others to 200.
"""

from __future__ import annotations

from typing import Sequence


def plan_batch(lengths: Sequence[int], first: int, *, max_batch_size: int, max_batch_tokens: int,
               fixed_cost_tokens: float) -> list[int]:
    """Indices (into `lengths`) of the group to run now: the one holding candidate `first`
    (the oldest request, so nothing starves). Every group keeps size <= max_batch_size and
    size * longest <= max_batch_tokens (a single prompt is always allowed)."""
    longest, n = max(lengths), len(lengths)
    if n <= max_batch_size and n * longest <= max_batch_tokens and n * longest - sum(lengths) <= fixed_cost_tokens:
        # Splitting saves at most the padding and costs at least one more fixed cost: one batch.
        return list(range(n))
    order = sorted(range(n), key=lambda i: lengths[i])
    best = [0.0] + [float("inf")] * n  # best[j]: cheapest grouping of order[:j]
    cut = [0] * (n + 1)  # cut[j]: where the last group of that grouping starts
    for j in range(1, n + 1):
        longest = lengths[order[j - 1]]  # sorted, so the group order[i:j] pads to this
        for i in range(j - 1, max(-1, j - 1 - max_batch_size), -1):
            size = j - i
            if size > 1 and size * longest > max_batch_tokens:
                break
            cost = best[i] + fixed_cost_tokens + size * longest
            if cost < best[j]:
                best[j], cut[j] = cost, i
    j = n
    while j > 0:
        group = order[cut[j]:j]
        if first in group:
            return sorted(group)  # in arrival order
        j = cut[j]
    raise AssertionError("every candidate belongs to a group")
