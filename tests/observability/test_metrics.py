"""Prometheus metrics on /metrics: counters move by exactly what the test sent, by API, method
and status; histograms, gauges and model info are there; OpenMetrics carries trace-id exemplars."""

from __future__ import annotations

import httpx
import pytest
from support.servers import launch_server
from support.otlp_receiver import OtlpReceiver
from prometheus_client.parser import text_string_to_metric_families

from gpt2serve_client import Client, Gpt2ServeError, RestClient


@pytest.fixture(scope="module")
def metered_server(tmp_path_factory):
    receiver = OtlpReceiver().start()
    env = receiver.exporter_env()
    srv = launch_server(tmp_path_factory.mktemp("metrics"), "--model", "random:tiny", "--trace-sample-ratio", "0",
                        env=env)
    yield srv
    srv.stop()
    receiver.stop()


def scrape(srv) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{srv.http_url}/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_counters_move_by_what_was_sent(metered_server):
    srv = metered_server
    before = scrape(srv)
    with Client(srv.grpc_target) as grpc_client, RestClient(srv.http_url) as rest:
        for prompt in ([464, 3139], [1, 2, 3], [7]):
            grpc_client.next_token(prompt)
        rest.next_token([5, 6, 7, 8])
        rest.next_token([9])
        rest.next_token_batch([[1, 2], [3, 4, 5]])
        for call in (lambda: grpc_client.next_token(""), lambda: rest.next_token("")):
            with pytest.raises(Gpt2ServeError):
                call()
    malformed = httpx.post(f"{srv.http_url}/v1/next-token", json={"prompt": 5}, timeout=10)  # wrong type: 422
    assert malformed.status_code == 422
    after = scrape(srv)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("gpt2serve_requests_total", api="grpc", method="NextToken", status="OK") == 3
    assert delta("gpt2serve_requests_total", api="grpc", method="NextToken", status="INVALID_ARGUMENT") == 1
    assert delta("gpt2serve_requests_total", api="rest", method="NextToken", status="OK") == 2
    assert delta("gpt2serve_requests_total", api="rest", method="NextTokenBatch", status="OK") == 1
    assert delta("gpt2serve_requests_total", api="rest", method="NextToken", status="INVALID_ARGUMENT") == 2
    assert delta("gpt2serve_prompt_tokens_total", api="grpc") == 6
    assert delta("gpt2serve_prompt_tokens_total", api="rest") == 10
    assert delta("gpt2serve_generated_tokens_total", api="grpc") == 3
    assert delta("gpt2serve_generated_tokens_total", api="rest") == 4
    assert delta("gpt2serve_request_duration_seconds_count", api="grpc", method="NextToken") == 3
    assert delta("gpt2serve_queue_duration_seconds_count") == 7  # one per prompt answered
    forwards = delta("gpt2serve_forward_duration_seconds_count")
    assert 1 <= forwards <= 7 and delta("gpt2serve_batch_size_count") == forwards
    assert delta("gpt2serve_batch_size_sum") == 7
    assert value(after, "gpt2serve_model_info", model="random:tiny", dtype="float32", device="cpu",
                 weights="random") == 1
    assert value(after, "gpt2serve_device_memory_bytes", device="cpu") > 50e6
    assert value(after, "gpt2serve_queue_depth") == 0
    assert value(after, "gpt2serve_in_flight_requests") == 0


def test_generation_steps_are_timed_by_kind(metered_server):
    """A generation of 6 tokens alone: one prefill of one sequence (its first token, its 3 prompt
    tokens), then five decode steps of one sequence (one token) each."""
    srv = metered_server
    before = scrape(srv)
    with Client(srv.grpc_target) as client:
        result = client.generate([464, 3139, 286], max_tokens=6, temperature=0, ignore_eos=True)
    assert result.usage.completion_tokens == 6
    after = scrape(srv)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    for kind, steps in (("prefill", 1), ("decode", 5)):
        assert delta("gpt2serve_step_duration_seconds_count", kind=kind) == steps
        assert delta("gpt2serve_step_sequences_count", kind=kind) == steps
        assert delta("gpt2serve_step_sequences_sum", kind=kind) == steps  # one sequence in each
        assert delta("gpt2serve_step_duration_seconds_sum", kind=kind) > 0
        assert delta("gpt2serve_step_tokens_count", kind=kind) == steps
    assert delta("gpt2serve_step_tokens_sum", kind="prefill") == 3
    assert delta("gpt2serve_step_tokens_sum", kind="decode") == 5
    assert delta("gpt2serve_step_duration_seconds_bucket", kind="decode", le="+Inf") == 5


def test_openmetrics_exemplars_carry_the_trace_id(metered_server):
    with Client(metered_server.grpc_target) as client:
        traced = client.next_token([464, 3139, 286], trace_layers=True)
    assert traced.trace_id
    response = httpx.get(f"{metered_server.http_url}/metrics",
                         headers={"accept": "application/openmetrics-text; version=1.0.0"}, timeout=10)
    assert response.headers["content-type"].startswith("application/openmetrics-text")
    lines = [line for line in response.text.splitlines() if f'trace_id="{traced.trace_id}"' in line]
    names = {line.split("{")[0] for line in lines}
    assert {"gpt2serve_request_duration_seconds_bucket", "gpt2serve_queue_duration_seconds_bucket"} <= names
    # Plain Prometheus text has no exemplars.
    assert traced.trace_id not in httpx.get(f"{metered_server.http_url}/metrics", timeout=10).text
