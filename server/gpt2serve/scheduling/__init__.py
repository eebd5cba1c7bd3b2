"""Scheduling on the engine side: which work the engine runs next, and the loop that runs it.

    core.py       the engine core: one loop in the engine thread, intake from callers, answers back
    scheduler.py  one request type and one scheduler: each step's leaving, admitted, prompts, decode
    outputs.py    the core's answers, on the callers' event loop
    engine_api.py what the core needs of the engine
    grouping.py   the length-grouping policy (pure, brute-force tested)
"""
