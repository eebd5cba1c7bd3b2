"""The clients' retry policy and deadlines, against scripted servers on real ports.

The scripted servers answer the first calls with the statuses a busy or draining gpt2serve
sends (RESOURCE_EXHAUSTED with grpc-retry-pushback-ms, 503 with Retry-After), then succeed; the
gpt2serve side of those statuses is tested in test_overload.py.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest

from gpt2serve_client import Client, Gpt2ServeError, RestClient
from gpt2serve_client._proto import gpt2serve_pb2 as pb

ANSWER = pb.NextTokenResponse(token_id=11, token=",", logprob=-0.5,
                              top=[pb.TokenLogprob(token_id=11, token=",", logprob=-0.5)])


class ScriptedGrpc:
    """NextToken fails with each status in `script`, in turn, then answers."""

    def __init__(self, script: list[grpc.StatusCode], delay_s: float = 0.0, pushback_ms: str = "50"):
        self.script, self.calls, self.delay_s, self.pushback_ms = list(script), 0, delay_s, pushback_ms
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        handler = grpc.unary_unary_rpc_method_handler(
            self.next_token, request_deserializer=pb.NextTokenRequest.FromString,
            response_serializer=pb.NextTokenResponse.SerializeToString)
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("gpt2serve.v1.Gpt2Serve", {"NextToken": handler}),))
        self.target = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def next_token(self, request, context):
        self.calls += 1
        time.sleep(self.delay_s)
        if self.script:
            context.set_trailing_metadata((("grpc-retry-pushback-ms", self.pushback_ms),))
            context.abort(self.script.pop(0), "scripted failure")
        return ANSWER


@pytest.mark.parametrize("script, retries, calls, outcome, pushback", [
    ([grpc.StatusCode.RESOURCE_EXHAUSTED] * 2, 3, 3, "OK", "50"),
    ([grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED], 3, 3, "OK", "50"),
    ([grpc.StatusCode.RESOURCE_EXHAUSTED] * 2, 0, 1, "RESOURCE_EXHAUSTED", "50"),
    ([grpc.StatusCode.UNAVAILABLE] * 5, 2, 3, "UNAVAILABLE", "50"),
    ([grpc.StatusCode.INVALID_ARGUMENT], 3, 1, "INVALID_ARGUMENT", "50"),  # a client error is not retried
    # A draining gpt2serve says "do not retry me" (pushback -1): the caller gets UNAVAILABLE at once.
    ([grpc.StatusCode.UNAVAILABLE] * 5, 3, 1, "UNAVAILABLE", "-1"),
    # A call the server side cancelled (a retry that met a closing server) is UNAVAILABLE to the
    # caller, who did not cancel anything and should fail over.
    ([grpc.StatusCode.CANCELLED], 3, 1, "UNAVAILABLE", "50"),
])
def test_grpc_client_retries(script, retries, calls, outcome, pushback):
    scripted = ScriptedGrpc(script, pushback_ms=pushback)
    try:
        with Client(scripted.target, retries=retries, timeout=10) as client:
            try:
                result = client.next_token("hi")
                got = "OK"
                assert result.token_id == 11
            except Gpt2ServeError as exc:
                got = exc.code
        assert (got, scripted.calls) == (outcome, calls)
    finally:
        scripted.server.stop(0)


def test_grpc_client_default_deadline():
    scripted = ScriptedGrpc([], delay_s=3)  # answers too late
    try:
        started = time.monotonic()
        with Client(scripted.target, timeout=0.5) as client, pytest.raises(Gpt2ServeError) as error:
            client.next_token("hi")
        assert error.value.code == "DEADLINE_EXCEEDED" and time.monotonic() - started < 3
    finally:
        scripted.server.stop(0)


class ScriptedHttp:
    """POST /v1/next-token answers each (status, retry-after) in `script`, then 200."""

    def __init__(self, script: list[tuple[int, str | None]]):
        scripted = self
        self.script, self.calls, self.times = list(script), 0, []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers["content-length"]))
                scripted.calls += 1
                scripted.times.append(time.monotonic())
                status, retry_after = scripted.script.pop(0) if scripted.script else (200, None)
                body = json.dumps({"token_id": 11, "token": ",", "logprob": -0.5, "top": [], "prompt_token_ids": [5]}
                                  if status == 200 else
                                  {"error": {"code": "X", "message": "scripted"}}).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                if retry_after:
                    self.send_header("retry-after", retry_after)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.mark.parametrize("script, retries, calls, outcome", [
    ([(503, "0"), (429, "0")], 3, 3, 200),
    ([(429, "0")] * 3, 1, 2, 429),
    ([(400, None)], 3, 1, 400),
])
def test_rest_client_retries(script, retries, calls, outcome):
    scripted = ScriptedHttp(script)
    try:
        with RestClient(scripted.url, retries=retries, timeout=10) as client:
            try:
                assert client.next_token("hi").token_id == 11
                got = 200
            except Gpt2ServeError as exc:
                got = exc.http_status
        assert (got, scripted.calls) == (outcome, calls)
    finally:
        scripted.server.shutdown()


def test_rest_client_waits_retry_after_but_not_past_its_deadline():
    scripted = ScriptedHttp([(503, "1")])
    try:
        with RestClient(scripted.url, timeout=10) as client:
            assert client.next_token("hi").token_id == 11
        assert scripted.calls == 2 and scripted.times[1] - scripted.times[0] >= 0.95
    finally:
        scripted.server.shutdown()
    scripted = ScriptedHttp([(503, "1")] * 5)
    try:
        started = time.monotonic()
        with RestClient(scripted.url, timeout=0.5) as client, pytest.raises(Gpt2ServeError) as error:
            client.next_token("hi")
        assert error.value.http_status == 503 and scripted.calls == 1 and time.monotonic() - started < 0.5
    finally:
        scripted.server.shutdown()
