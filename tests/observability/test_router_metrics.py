"""The gauges a router or autoscaler reads (requests waiting, requests running, KV-cache usage):
one value per engine, right with one process and with `--workers 2`, and under vLLM's names too
with `--metrics-compat vllm`, so routers and dashboards written for vLLM read us unchanged."""

from __future__ import annotations

import time

import httpx
import pytest
from support.servers import launch_server, metric_value
from support.held_streams import HeldGenerations

pytestmark = pytest.mark.slow

VLLM_LABELS = {"model_name": "random:gpt2", "engine": "0"}


def settle(url: str, expected: dict[tuple[str, frozenset], float], timeout: float = 10.0) -> dict:
    """Every gauge at its expected value (the engine refreshes them every 0.5 s with --workers)."""
    deadline = time.monotonic() + timeout
    while True:
        got = {key: metric_value(url, key[0], dict(key[1])) for key in expected}
        if got == expected or time.monotonic() > deadline:
            return got


def gauges(waiting: float, running: float, usage: float) -> dict[tuple[str, frozenset], float]:
    ours = {"gpt2serve_requests_waiting": waiting, "gpt2serve_requests_running": running,
            "gpt2serve_kv_cache_usage_ratio": usage}
    theirs = {"vllm:num_requests_waiting": waiting, "vllm:num_requests_running": running,
              "vllm:kv_cache_usage_perc": usage}
    return {**{(name, frozenset()): value for name, value in ours.items()},
            **{(name, frozenset(VLLM_LABELS.items())): value for name, value in theirs.items()}}


@pytest.mark.parametrize("workers", ["1", "2"])
def test_router_gauges_count_each_request_once(tmp_path, workers):
    """Two KV-cache slots and three long generations: 2 running, 1 waiting, the cache full;
    all zero again once the callers hang up. With two front ends the engine's one value is
    what /metrics shows, not a sum over processes."""
    srv = launch_server(tmp_path, "--model", "random:gpt2", "--workers", workers, "--max-running-sequences", "2",
                        "--max-queue-wait-s", "60", "--metrics-compat", "vllm")
    try:
        if workers == "2":
            srv.wait_for_line(r"front-end\[\d+\].*front end listening(.|\n)*front-end\[\d+\].*front end listening")
        assert settle(srv.http_url, gauges(0, 0, 0)) == gauges(0, 0, 0)
        with HeldGenerations(srv.grpc_target, running=2, waiting=1):
            assert settle(srv.http_url, gauges(1, 2, 1.0)) == gauges(1, 2, 1.0)
        # hung up: slots and the queue empty
        assert settle(srv.http_url, gauges(0, 0, 0)) == gauges(0, 0, 0)
    finally:
        srv.stop()


def test_without_compat_there_are_no_vllm_names(tmp_path):
    srv = launch_server(tmp_path, "--model", "random:tiny")
    try:
        text = httpx.get(f"{srv.http_url}/metrics", timeout=10).text
        assert "gpt2serve_requests_waiting" in text and "gpt2serve_requests_running" in text
        assert "vllm:" not in text
    finally:
        srv.stop()
