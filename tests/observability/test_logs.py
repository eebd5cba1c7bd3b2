"""The server's logs on a real server: a line per request (route, status, latency, tokens,
request id, trace id when traced), every failure with its reason, the engine's stats line,
`--disable-log-requests`, and `--log-format json` (every line of the log an object)."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
from support.otlp_receiver import OtlpReceiver
from support.servers import launch_server, wait_for

from gpt2serve_client import Client, Gpt2ServeError, RestClient

LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (?P<level>[A-Z]+) gpt2serve\.requests: (?P<route>\S+(?: /\S+)?) "
                  r"(?P<status>[A-Z_]+)(?: (?P<http>\d{3}))? (?P<ms>[\d.]+)ms prompt_tokens=(?P<prompt>\d+) "
                  r"output_tokens=(?P<output>\d+) request_id=(?P<id>\S+)(?: adapter=(?P<adapter>\S+))?"
                  r"(?: trace_id=(?P<trace>[0-9a-f]{32}))?"
                  r"(?: reason=(?P<reason>.+))?$")


def request_lines(srv, wanted: int) -> list[re.Match]:
    """The request lines once `wanted` of them are written (they are written in batches)."""
    def found():
        lines = [m for line in srv.log().splitlines() if (m := LINE.match(line))]
        return (lines,) if len(lines) >= wanted else None

    return wait_for(found, timeout=10, what=f"{wanted} request lines")[0]


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    receiver = OtlpReceiver().start()
    srv = launch_server(tmp_path_factory.mktemp("logs"), "--model", "random:tiny", "--log-stats-interval-s", "0.5",
                        env=receiver.exporter_env())
    yield srv, receiver
    srv.stop()
    receiver.stop()


def test_a_line_per_request_and_each_failure_with_its_reason(traced):
    srv, receiver = traced
    before = len(request_lines(srv, 0))
    with Client(srv.grpc_target) as client:
        client.next_token("The capital of France is", top_k=3)
        client.generate("Once", max_tokens=4, temperature=0)
        with pytest.raises(Gpt2ServeError):
            client.next_token("")
    rest = httpx.post(f"{srv.http_url}/v1/next-token", json={"prompt": "hi"}, headers={"x-request-id": "my-id-42"})
    assert rest.status_code == 200
    malformed = httpx.post(f"{srv.http_url}/v1/next-token", content=b"{nope", headers={"content-type": "application/json"})
    assert malformed.status_code == 422
    lines = request_lines(srv, before + 5)[before:]
    by_route = {(m["route"], m["status"]): m for m in lines}
    unary = by_route[("gpt2serve.v1.Gpt2Serve/NextToken", "OK")]
    assert unary["level"] == "INFO" and int(unary["prompt"]) == 5 and int(unary["output"]) == 1 and unary["http"] is None
    assert float(unary["ms"]) > 0
    generated = by_route[("gpt2serve.v1.Gpt2Serve/Generate", "OK")]
    assert int(generated["output"]) == 4
    # Traced (an OTLP exporter is set): the trace id is the exported request span's.
    assert receiver.wait_for(generated["trace"], {"gpt2serve.v1.Gpt2Serve/Generate"})
    empty = by_route[("gpt2serve.v1.Gpt2Serve/NextToken", "INVALID_ARGUMENT")]
    assert empty["level"] == "WARNING" and "the prompt is empty" in empty["reason"]
    rest_ok = by_route[("POST /v1/next-token", "OK")]
    assert rest_ok["id"] == "my-id-42" and rest_ok["http"] == "200"  # the caller's x-request-id
    bad_json = next(m for m in lines if m["http"] == "422")
    assert "Invalid JSON" in bad_json["reason"]
    assert len({m["id"] for m in lines}) == len(lines)  # an id each


def test_the_stats_line_tells_throughput(traced):
    srv, _ = traced
    with Client(srv.grpc_target) as client:
        client.generate("Once upon a time", max_tokens=16, temperature=0, ignore_eos=True)
    stats = re.compile(r"gpt2serve\.stats: running: (\d+) reqs, waiting: (\d+) reqs, prompt throughput: ([\d.]+) "
                       r"tokens/s, generation throughput: ([\d.]+) tokens/s, KV cache usage: ([\d.]+)%, "
                       r"prefix cache hit rate: (\S+)")
    lines = wait_for(lambda: [m for m in stats.finditer(srv.log()) if float(m[4]) > 0], timeout=10,
                     what="a stats line with generated tokens")
    assert all(float(m[3]) >= 0 and 0 <= float(m[5]) <= 100 for m in lines)


def test_disable_log_requests_keeps_the_failures_only(tmp_path):
    srv = launch_server(tmp_path, "--model", "random:tiny", "--disable-log-requests")
    try:
        with Client(srv.grpc_target) as client:
            for _ in range(3):
                client.next_token("hi")
            with pytest.raises(Gpt2ServeError):
                client.next_token([99999999])
        lines = request_lines(srv, 1)
        time.sleep(0.5)  # past a flush: any OK line would be out by now
        lines = request_lines(srv, 1)
        assert [m["status"] for m in lines] == ["INVALID_ARGUMENT"]
    finally:
        srv.stop()


def test_json_logs_are_one_object_a_line(tmp_path):
    srv = launch_server(tmp_path, "--model", "random:tiny", "--log-format", "json", "--log-stats-interval-s", "0.5")
    try:
        with Client(srv.grpc_target) as client, RestClient(srv.http_url) as rest:
            client.next_token("hi")
            rest.generate("hi", max_tokens=3)
            with pytest.raises(Gpt2ServeError):
                rest.next_token("")
        # A path that would end a line or a JSON string early, were it written as it came.
        assert httpx.post(f"{srv.http_url}/v1/nope%0A%22%7D%0A%7B%22level%22", json={},
                          headers={"x-request-id": 'id"\\'}).status_code == 404

        def records():
            return [json.loads(line) for line in srv.log().splitlines() if line.strip()]  # every line parses

        requests = wait_for(lambda: len(found := [r for r in records() if r["logger"] == "gpt2serve.requests"]) >= 4
                            and found, timeout=10, what="four request records")
        assert {r["status"] for r in requests} == {"OK", "INVALID_ARGUMENT", "NOT_FOUND"}
        (odd,) = [r for r in requests if r["status"] == "NOT_FOUND"]
        assert odd["route"].startswith("/v1/nope") and "%22}" in odd["route"] and odd["http_status"] == 404
        failed = next(r for r in requests if r["status"] != "OK")
        assert failed["level"] == "WARNING" and failed["http_status"] == 400 and "empty" in failed["reason"]
        assert all(isinstance(r["latency_ms"], float) and r["request_id"] for r in requests)
        assert any(r["message"].startswith("gpt2serve ready:") for r in records())
        wait_for(lambda: any(r["logger"] == "gpt2serve.stats" and r["generation_tokens_per_s"] > 0 for r in records()),
                 timeout=10, what="a stats record")
    finally:
        srv.stop()
