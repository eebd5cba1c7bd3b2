"""`gpt2serve bench --native`: the load from h2load (gRPC) and wrk (REST) against a real server,
errors as the server counted them, and every load generator's CPU with the headroom rule."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support.servers import requests_total

from gpt2serve.benchmarks.native_load import LoadGeneratorCpu, run_native


def bench(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "gpt2serve.cli", "bench", *args, "--json"], capture_output=True,
                         text=True, timeout=120, env=os.environ)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("api,method,tool", [("grpc", "NextToken", "h2load"), ("rest", "NextToken", "wrk"),
                                             ("grpc-batch", "NextTokenBatch", "h2load")])
def test_native_load_is_answered_and_counted_by_the_server(server, api, method, tool):
    label = "rest" if api == "rest" else "grpc"
    before = requests_total(server.http_url, label, method, "OK")
    report = bench("--native", "--api", api, "--target", server.grpc_target, "--http-target", server.http_url,
                   "-c", "8", "--batch-prompts", "4", "-d", "1.5", "--warmup", "0.5", "--limit-duration", "0.4")
    load, generator = report["load"], report["load_generator"]
    assert load["requests"] > 0 and load["errors"] == 0, load["error_codes"]
    assert load["concurrency"] == 8 and load["p50_ms"] <= load["p90_ms"] <= load["p99_ms"]
    per_call = 4 if api == "grpc-batch" else 1
    assert load["req_per_s"] == pytest.approx(load["requests"] * per_call / load["duration_s"])
    # The server answered at least every call the tool measured (its warm-up's too), OK.
    assert requests_total(server.http_url, label, method, "OK") - before >= load["requests"]
    assert 1 <= load["mean_batch_size"] <= 8 * per_call
    assert generator["name"] == tool and generator["cpu_s"] > 0 and generator["wall_s"] >= 1.5
    assert report["rejected"] == generator["rejected"]


@pytest.mark.slow
@pytest.mark.parametrize("api", ["grpc", "rest"])
def test_native_load_counts_errors_the_tool_sees_as_success(server, api):
    """gRPC errors come as HTTP 200 with a status in the trailers, which h2load counts as a
    success; the bench takes errors from the server's own count instead. An id past the
    vocabulary is refused INVALID_ARGUMENT on every call."""
    target = server.http_url if api == "rest" else server.grpc_target
    run, statuses, _, _ = run_native(api, target, server.http_url, [[1, 2, 10**6]], 1, concurrency=4, threads=1,
                                     duration_s=1, warmup_s=0.3)
    assert statuses.get("INVALID_ARGUMENT", 0) >= 4 and statuses.get("OK", 0) == 0
    if api == "grpc":
        assert run.requests > 0  # what h2load alone would have reported as served
    else:
        assert run.transport_errors > 0 and run.requests == 0  # wrk sees the 400s


def test_headroom_rule():
    assert LoadGeneratorCpu("h2load", threads=2, cpu_s=1.0, wall_s=10.0).rejected == ""
    busy = LoadGeneratorCpu("python clients in 2 process(es)", threads=2, cpu_s=18.5, wall_s=10.0)
    assert busy.busy == pytest.approx(0.925) and "may be the limit" in busy.rejected
    assert "REJECTED" in busy.describe()


@pytest.mark.slow
def test_python_load_reports_its_own_cpu(server):
    report = bench("--target", server.grpc_target, "-c", "6", "-p", "2", "-d", "1.5", "--warmup", "0.3",
                   "--limit-duration", "0.4")
    generator = report["load_generator"]
    assert generator["threads"] == 2 and 0 < generator["busy"] <= 1.0 and generator["wall_s"] >= 1.8
