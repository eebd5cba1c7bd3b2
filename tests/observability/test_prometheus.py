"""A real Prometheus (Debian's package, started here on loopback) scrapes a real gpt2serve under
load: the counters it stores equal the requests sent, and it keeps the traced request's exemplar."""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from support.servers import launch_server, wait_for
from support.otlp_receiver import OtlpReceiver
from support.prometheus_server import Prometheus, query, scalar

from gpt2serve_client import AsyncClient, Client, Gpt2ServeError

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """gpt2serve (tracing to a local OTLP receiver) + Prometheus scraping it every 0.5 s."""
    tmp = tmp_path_factory.mktemp("prometheus")
    receiver = OtlpReceiver().start()
    srv = launch_server(tmp, "--model", "random:tiny", "--trace-sample-ratio", "0", env=receiver.exporter_env())
    prometheus = Prometheus(tmp, [srv.http_url.removeprefix("http://")])
    yield srv, prometheus.url
    prometheus.stop()
    srv.stop()
    receiver.stop()


def test_prometheus_stores_what_was_sent(stack):
    srv, url = stack
    sent_ok = 60

    async def load():
        async with AsyncClient(srv.grpc_target) as client:
            await asyncio.gather(*(client.next_token([i % 50000 + 1, 7, 9]) for i in range(sent_ok)))

    asyncio.run(load())
    with Client(srv.grpc_target) as client:
        with pytest.raises(Gpt2ServeError):
            client.next_token("")
        traced = client.next_token([464, 3139, 286], trace_layers=True)
    for _ in range(3):
        httpx.post(f"{srv.http_url}/v1/next-token", json={"prompt_token_ids": [1, 2]}, timeout=10)

    ok_grpc = 'sum(gpt2serve_requests_total{api="grpc",status="OK"})'
    wait_for(lambda: scalar(url, ok_grpc) >= sent_ok + 1, what="Prometheus never saw the gRPC requests")
    time.sleep(1.0)  # one more scrape: nothing else may arrive
    assert scalar(url, ok_grpc) == sent_ok + 1
    assert scalar(url, 'sum(gpt2serve_requests_total{api="grpc",status="INVALID_ARGUMENT"})') == 1
    assert scalar(url, 'sum(gpt2serve_requests_total{api="rest",status="OK"})') == 3
    assert scalar(url, "sum(gpt2serve_prompt_tokens_total)") == sent_ok * 3 + 3 + 3 * 2
    assert scalar(url, "sum(gpt2serve_batch_size_sum)") == sent_ok + 1 + 3
    assert scalar(url, "sum(gpt2serve_batch_size_count)") < sent_ok  # concurrent requests were batched
    assert query(url, 'gpt2serve_model_info{model="random:tiny",dtype="float32"}')
    # Cumulative buckets: the series were born with the load, so a rate() over them would be empty.
    p90 = scalar(url, "histogram_quantile(0.9, sum by (le) (gpt2serve_request_duration_seconds_bucket))")
    assert 0 < p90 < 10

    def exemplar_trace_ids():
        now = time.time()
        body = httpx.get(f"{url}/api/v1/query_exemplars", timeout=10, params={
            "query": "gpt2serve_request_duration_seconds_bucket", "start": now - 300, "end": now + 60}).json()
        return {e["labels"].get("trace_id") for series in body.get("data") or [] for e in series["exemplars"]}

    ids = wait_for(lambda: traced.trace_id in exemplar_trace_ids() and exemplar_trace_ids(),
                   what="the traced request's exemplar never reached Prometheus")
    assert traced.trace_id in ids


def test_shipped_prometheus_config_passes_promtool():
    out = subprocess.run(["promtool", "check", "config", str(ROOT / "deploy/prometheus/prometheus.yml")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout + out.stderr


def dashboard_expressions() -> list[str]:
    import json

    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/gpt2serve.json").read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def test_every_dashboard_query_returns_data(stack):
    """Load for a few seconds (next tokens and generations, with one error in it), then run each
    panel's PromQL as Grafana would, with $__rate_interval = 30s."""
    srv, url = stack
    stop_at = time.monotonic() + 4.0

    async def load():
        async with AsyncClient(srv.grpc_target) as client:
            async def worker(i):
                while time.monotonic() < stop_at:
                    await client.next_token([i + 1, 2, 3])

            async def generator(i):
                while time.monotonic() < stop_at:
                    await client.generate([i + 1, 5], max_tokens=8, temperature=0.7)

            async def shared_prefix(i):  # 48 shared tokens, then its own: the prefix cache's work
                n = 0
                while time.monotonic() < stop_at:
                    n += 1
                    await client.next_token(list(range(100, 148)) + [i + 1, n])
            await asyncio.gather(*(worker(i) for i in range(6)), *(generator(i) for i in range(3)),
                                 *(shared_prefix(i) for i in range(2)))

    with Client(srv.grpc_target) as client:
        client.next_token([1])  # every series exists before the load, so rates see it grow
        client.generate([1], max_tokens=2)
        time.sleep(1.0)
        asyncio.run(load())
        with pytest.raises(Gpt2ServeError):
            client.next_token("")
    time.sleep(1.5)  # a few more scrapes
    expressions = dashboard_expressions()
    assert len(expressions) >= 10
    for metric in ("time_to_first_token", "time_per_output_token", "running_sequences", "waiting_sequences",
                   "kv_cache_usage", "generated_tokens", "prefix_cache_hits", "step_duration", "step_tokens"):
        assert any(metric in expr for expr in expressions), f"no panel shows gpt2serve_{metric}"
    empty = []
    for expr in expressions:
        result = query(url, expr.replace("$__rate_interval", "30s"))
        values = [float(series["value"][1]) for series in result]
        if not any(v == v for v in values):  # no series, or only NaN
            empty.append(expr)
    assert not empty, f"dashboard queries without data: {empty}"
    (hit_rate,) = [expr for expr in expressions if "prefix_cache_hits" in expr]
    rate = float(query(url, hit_rate.replace("$__rate_interval", "30s"))[0]["value"][1])
    assert 0 < rate < 1, f"the prefix cache's hit rate panel shows {rate}"
