"""bench/host_path/rest_route_cost.py: the REST route it times in process is the real one (its answer is
the canned engine's top 5 through the service and the JSON encoder), and it reports a CPU cost a
call for each round."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_route_bench_times_real_answers():
    run = subprocess.run([sys.executable, "bench/host_path/rest_route_cost.py", "--calls", "300", "--rounds", "2",
                          "--json"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert len(report["us_per_call"]) == 2 and all(us > 0 for us in report["us_per_call"])
    answer = report["answer"]
    assert answer["prompt_token_ids"] == [464, 3139, 286, 4881, 318]
    assert [t["token_id"] for t in answer["top"]] == [13, 14, 15, 16, 17]
    assert answer["top"][0]["token"] == "."  # GPT-2's token 13, through the real tokenizer
    assert answer["timings"]["queue_ms"] == 1.0 and answer["batch_size"] == 64
