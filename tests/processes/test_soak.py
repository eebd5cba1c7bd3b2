"""The mixed soak (bench/soak/soak.py), for 90 s with RSS judged from 60 s on (the engine's heap
climbs to its high-water mark through the first minute): the same code that runs for 15 minutes in
docs/benchmarks.md, with its own pass rule (memory, nothing accepted lost, slots and blocks free,
the server's counters equal to the clients'), under --workers 2 with a front end killed -9."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(900)  # 90 s of load, plus starts and stops a loaded machine may stretch
def test_a_minute_of_mixed_load_with_a_front_end_killed_loses_and_leaks_nothing(tmp_path):
    report_path = tmp_path / "soak.json"
    run = subprocess.run([sys.executable, "bench/soak/soak.py", "--seconds", "90", "--sample-s", "1",
                          "--settle-s", "60", "--clients", "8", "--json", str(report_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert report_path.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(report_path.read_text())
    summary = {k: v for k, v in report.items() if k != "samples"}
    assert report["pass"] and run.returncode == 0, json.dumps(summary, indent=1)
    # It did what it says: calls of every kind, refusals and hang-ups among them, and the kill.
    kinds = {call.rsplit(" ", 1)[0] for call in report["by_call"]}
    assert kinds >= {"grpc NextToken", "grpc NextTokenBatch", "grpc Generate", "rest NextToken", "rest Generate",
                     "openai Completions", "openai ChatCompletions"}, kinds
    assert report["by_status"].get("INVALID_ARGUMENT", 0) > 0 and report["by_status"].get("CANCELLED", 0) > 0
    assert report["killed_at_s"] > 0 and any("front end 1" in name for name in report["rss"])


def test_the_soak_counts_a_hang_up_that_crossed_a_streams_end_but_no_count_that_went_missing():
    """The counter rule alone: a stream the client hung up on after the server had finished it is
    the client's CANCELLED and the server's OK, and passes; a CANCELLED the server never counted,
    with no OK in its place, does not, nor an OK the server counted twice."""
    sys.path.insert(0, str(ROOT / "bench" / "soak"))
    from collections import Counter

    from soak import counter_mismatches

    clients = Counter({("rest", "Generate", "OK"): 45, ("rest", "Generate", "CANCELLED"): 17,
                       ("grpc", "NextToken", "OK"): 60})
    none_lost = Counter()
    crossed = clients + Counter({("rest", "Generate", "OK"): 1}) - Counter({("rest", "Generate", "CANCELLED"): 1})
    assert counter_mismatches(crossed, clients, none_lost) == {}
    missing = clients - Counter({("rest", "Generate", "CANCELLED"): 1})
    assert list(counter_mismatches(missing, clients, none_lost)) == ["rest Generate CANCELLED"]
    counted_twice = clients + Counter({("grpc", "NextToken", "OK"): 1})
    assert list(counter_mismatches(counted_twice, clients, none_lost)) == ["grpc NextToken OK"]
    near_kill = Counter({("grpc", "NextToken"): 1})  # a call broken at the kill may have been counted
    assert counter_mismatches(counted_twice, clients, near_kill) == {}
