"""Scheduling on the engine side: which work runs in the engine thread next.

    batcher.py             next-token prompts: a bounded queue, dynamic batches, length grouping
    continuous_batcher.py  generations: sequences join and leave the running batch at each step
    grouping.py            the length-grouping policy (pure, brute-force tested)
"""
