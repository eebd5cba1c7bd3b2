"""Length grouping: which waiting prompts share a forward."""

from __future__ import annotations

import itertools

from gpt2serve.scheduling.grouping import plan_batch

CAPS = dict(max_batch_size=64, max_batch_tokens=16384, fixed_cost_tokens=32)


def cost(groups, lengths, fixed):
    return sum(fixed + len(g) * max(lengths[i] for i in g) for g in groups)


def test_equal_lengths_run_together():
    assert plan_batch([5] * 64, 0, **CAPS) == list(range(64))


def test_a_long_prompt_does_not_pad_the_short_ones():
    lengths = [5] * 10 + [200] + [6] * 10
    assert plan_batch(lengths, 0, **CAPS) == [i for i in range(21) if i != 10]
    assert plan_batch(lengths, 10, **CAPS) == [10]


def test_small_differences_are_padded_rather_than_split():
    assert plan_batch([5, 7, 6, 9], 2, **CAPS) == [0, 1, 2, 3]


def test_caps_on_batch_size_and_padded_tokens():
    lengths = [100] * 10
    plan = plan_batch(lengths, 0, max_batch_size=64, max_batch_tokens=450, fixed_cost_tokens=32)
    assert 0 in plan and len(plan) == 4
    assert len(plan_batch([5] * 10, 3, max_batch_size=4, max_batch_tokens=10**6, fixed_cost_tokens=32)) == 4
    # A single prompt longer than the cap still runs, alone.
    assert plan_batch([500, 5], 0, max_batch_size=64, max_batch_tokens=100, fixed_cost_tokens=32) == [0]


def test_the_chosen_group_belongs_to_an_optimal_grouping():
    """Against brute force over all ways of cutting the sorted candidates."""
    lengths = [3, 40, 8, 90, 8, 41, 3, 12]
    fixed = 20
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    best = min(
        cost(groups, lengths, fixed)
        for cuts in itertools.product([0, 1], repeat=len(order) - 1)
        for groups in [split(order, cuts)]
    )
    for first in range(len(lengths)):
        chosen = plan_batch(lengths, first, max_batch_size=64, max_batch_tokens=10**6, fixed_cost_tokens=fixed)
        assert first in chosen
        rest = [i for i in order if i not in chosen]
        rest_best = min(
            cost(groups, lengths, fixed)
            for cuts in itertools.product([0, 1], repeat=max(len(rest) - 1, 0))
            for groups in [split(rest, cuts)]
        ) if rest else 0
        assert cost([chosen], lengths, fixed) + rest_best == best


def split(order, cuts):
    groups, current = [], [order[0]]
    for item, cut in zip(order[1:], cuts):
        if cut:
            groups.append(current)
            current = []
        current.append(item)
    return groups + [current]
