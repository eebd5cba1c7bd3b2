"""The lone-call timeline (bench/host_path/call_timeline.py) for a second: every hop it names is
still a function the server runs (a rename would leave a call without its marks, or stop the
server from starting), each call's marks come in order across the processes, and the step the
stand-in takes sits inside the handler's time."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_hop_of_a_lone_call_is_marked_in_order():
    run = subprocess.run([sys.executable, "bench/host_path/call_timeline.py", "--seconds", "1"], cwd=ROOT,
                         capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stdout + run.stderr
    calls = int(re.search(r"^(\d+) calls$", run.stdout, re.M).group(1))
    assert calls >= 50, run.stdout  # a second of closed-loop calls, each well under 20 ms
    rows = dict(re.findall(r"^\| (.+?) \| ([\d.]+) \| [\d.]+ \|", run.stdout, re.M))
    sys.path.insert(0, str(ROOT / "bench" / "host_path"))
    from call_timeline import ORDER

    hops = [f"{a} -> {b}" for a, b in zip(ORDER, ORDER[1:])]
    assert [h for h in hops if h not in rows] == [], run.stdout
    whole, step = float(rows["**handler start -> handler end**"]), float(rows["of which the step (its start -> end)"])
    assert 0.5 * 1000 <= step < whole, run.stdout  # the stand-in's one-prompt step is the H200's 0.62 ms
