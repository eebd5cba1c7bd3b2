"""The inference routes over HTTP/1.1 as clients write it on the wire: the front end answers
them from its own protocol (transport.http_direct), not through uvicorn's ASGI cycle, so what
uvicorn did for them is held here: pipelined requests answered in order (mixed with routes that
go through ASGI), `Expect: 100-continue`, a body that arrives in pieces, HTTP/1.0 and
`Connection: close`, a refusal before the body, a request the parser rejects, and streams of
server-sent events (chunked, then the connection kept for the next request)."""

from __future__ import annotations

import json
import select
import socket
import subprocess
import time

import pytest

from gpt2serve_client.status import BY_KIND

PROMPTS = [[464, 3139, 286], [40, 1101, 257, 3290], [15496, 11]]


def post(path: str, body: bytes, *headers: bytes, version: bytes = b"1.1") -> bytes:
    return (b"POST %s HTTP/%s\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s"
            % (path.encode(), version, len(body), b"".join(h + b"\r\n" for h in headers), body))


def prompt_body(ids: list[int]) -> bytes:
    return json.dumps({"prompt_token_ids": ids, "top_k": 2}).encode()


class Wire:
    """A raw connection that reads answers one at a time (status, lower-case headers, body)."""

    def __init__(self, url: str):
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=60)
        self.buffer = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self) -> bool:
        data = self.sock.recv(65536)
        self.buffer += data
        return bool(data)

    def answer(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buffer:
            assert self._fill(), f"closed before an answer's head: {self.buffer!r}"
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {name.lower(): value.strip() for name, value in (line.split(":", 1) for line in lines)}
        length = int(headers.get("content-length", "0"))
        while len(self.buffer) < length:
            assert self._fill(), "closed inside an answer's body"
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return int(status_line.split()[1]), headers, body

    def chunked_answer(self) -> tuple[int, dict[str, str], list[bytes]]:
        """An answer whose body is chunked: its chunks, as the server wrote them."""
        while b"\r\n\r\n" not in self.buffer:
            assert self._fill(), f"closed before an answer's head: {self.buffer!r}"
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {name.lower(): value.strip() for name, value in (line.split(":", 1) for line in lines)}
        assert headers.get("transfer-encoding") == "chunked" and "content-length" not in headers, headers
        chunks = []
        while True:
            while b"\r\n" not in self.buffer:
                assert self._fill(), "closed inside a chunked body"
            size_line, self.buffer = self.buffer.split(b"\r\n", 1)
            size = int(size_line, 16)
            while len(self.buffer) < size + 2:
                assert self._fill(), "closed inside a chunk"
            chunk, end, self.buffer = self.buffer[:size], self.buffer[size:size + 2], self.buffer[size + 2:]
            assert end == b"\r\n"
            if size == 0:
                return int(status_line.split()[1]), headers, chunks
            chunks.append(chunk)

    def closed_by_server(self) -> bool:
        self.sock.settimeout(30)
        return not self.buffer and not self._fill()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def wire(server):
    connection = Wire(server.http_url)
    yield connection
    connection.close()


def test_pipelined_requests_are_answered_in_order_with_asgi_routes_between(wire):
    wire.send(post("/v1/next-token", prompt_body(PROMPTS[0])) + b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
              + post("/v1/next-token", prompt_body(PROMPTS[1]))
              + post("/v1/next-token/batch", json.dumps({"prompts": PROMPTS}).encode()))
    first, models, second, batch = (wire.answer() for _ in range(4))
    assert [first[0], models[0], second[0], batch[0]] == [200, 200, 200, 200]
    assert json.loads(first[2])["prompt_token_ids"] == PROMPTS[0]
    assert "data" in json.loads(models[2])
    assert json.loads(second[2])["prompt_token_ids"] == PROMPTS[1]
    assert [r["prompt_token_ids"] for r in json.loads(batch[2])["results"]] == PROMPTS
    assert first[1]["content-type"] == "application/json" and "date" in first[1]
    wire.send(post("/v1/next-token", prompt_body(PROMPTS[2])))  # the connection is still kept alive
    assert json.loads(wire.answer()[2])["prompt_token_ids"] == PROMPTS[2]


def test_pipelined_requests_are_read_ahead_at_most_the_depth_and_the_rest_left_for_the_client(server):
    """A client may pipeline PIPELINE_DEPTH (64) requests past the one being answered: all are
    answered in order and the connection is kept. Past the depth, the server reads no more: it
    answers those it queued, then closes (RFC 9112 9.3.2: the client retries the rest). So a
    client that writes requests and never reads cannot make the server queue them without bound
    (it queued 700 MiB for 13 MiB of GET /healthz before)."""
    from gpt2serve.transport.http_connections import PIPELINE_DEPTH

    health = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    kept = Wire(server.http_url)
    try:
        kept.send(post("/v1/next-token", prompt_body(PROMPTS[0])) + health * PIPELINE_DEPTH)
        answers = [kept.answer() for _ in range(PIPELINE_DEPTH + 1)]
        assert [status for status, _, _ in answers] == [200] * (PIPELINE_DEPTH + 1)
        assert json.loads(answers[0][2])["prompt_token_ids"] == PROMPTS[0]
        kept.send(post("/v1/next-token", prompt_body(PROMPTS[1])))  # still kept alive
        assert json.loads(kept.answer()[2])["prompt_token_ids"] == PROMPTS[1]
    finally:
        kept.close()
    flood = Wire(server.http_url)
    try:
        flood.send(post("/v1/next-token", prompt_body(PROMPTS[2])) + health * 1000)
        answered = 0
        try:
            while True:
                status, _, _ = flood.answer()
                assert status == 200
                answered += 1
        except AssertionError as closed:
            assert "closed before an answer's head" in str(closed) and not flood.buffer
        # the one being answered and the depth behind it (more only if the kernel split the write)
        assert PIPELINE_DEPTH + 1 <= answered < 1001
    finally:
        flood.close()


def test_expect_100_continue_is_answered_before_the_body_is_sent(wire):
    body = prompt_body(PROMPTS[0])
    wire.send(post("/v1/next-token", b"", b"Expect: 100-continue").replace(b"Content-Length: 0",
                                                                          b"Content-Length: %d" % len(body)))
    status, _, _ = wire.answer()
    assert status == 100
    wire.send(body)
    status, _, answer = wire.answer()
    assert status == 200 and json.loads(answer)["prompt_token_ids"] == PROMPTS[0]


def test_a_body_in_pieces_is_read_whole(wire):
    request = post("/v1/next-token", prompt_body(PROMPTS[1]))
    head_end = request.index(b"\r\n\r\n") + 4
    for piece in (request[:10], request[10:head_end], request[head_end:head_end + 7], request[head_end + 7:]):
        wire.send(piece)
        time.sleep(0.05)
    status, _, answer = wire.answer()
    assert status == 200 and json.loads(answer)["prompt_token_ids"] == PROMPTS[1]


@pytest.mark.parametrize("how", ["HTTP/1.0", "Connection: close"])
def test_a_request_that_does_not_keep_alive_is_answered_then_closed(wire, how):
    if how == "HTTP/1.0":
        wire.send(post("/v1/next-token", prompt_body(PROMPTS[0]), version=b"1.0"))
    else:
        wire.send(post("/v1/next-token", prompt_body(PROMPTS[0]), b"Connection: close"))
    status, headers, answer = wire.answer()
    assert status == 200 and json.loads(answer)["prompt_token_ids"] == PROMPTS[0]
    assert wire.closed_by_server()


def test_a_body_past_the_limit_is_refused_before_it_is_read_and_the_connection_closed(server, wire):
    wire.send(b"POST /v1/next-token HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100000000\r\n\r\n{\"prompt\": \"")  # 100 MB declared, a few bytes sent
    status, headers, answer = wire.answer()
    assert status == 413 and json.loads(answer)["error"]["code"] == "RESOURCE_EXHAUSTED"
    assert headers.get("connection") == "close" and wire.closed_by_server()


def test_a_bad_body_leaves_the_connection_usable(wire):
    wire.send(post("/v1/next-token", b'{"prompt": ') + post("/v1/next-token", prompt_body(PROMPTS[2])))
    bad, good = wire.answer(), wire.answer()
    malformed = BY_KIND["malformed"]
    assert bad[0] == malformed.http and json.loads(bad[2])["error"]["code"] == malformed.code
    assert good[0] == 200 and json.loads(good[2])["prompt_token_ids"] == PROMPTS[2]


def test_a_query_string_on_a_next_token_path_is_still_served(wire):
    wire.send(post("/v1/next-token?note=1", prompt_body(PROMPTS[0])))
    status, _, answer = wire.answer()
    assert status == 200 and json.loads(answer)["prompt_token_ids"] == PROMPTS[0]


def assert_a_new_connection_is_served(server) -> None:
    other = Wire(server.http_url)
    try:
        other.send(post("/v1/next-token", prompt_body(PROMPTS[1])))
        assert other.answer()[0] == 200
    finally:
        other.close()


def test_a_request_the_parser_rejects_gets_400_and_the_server_goes_on(server, wire):
    wire.send(b"POST /v1/next-token HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\nhello")
    status, _, _ = wire.answer()
    assert status == 400
    assert_a_new_connection_is_served(server)


def stream_body(max_tokens: int) -> bytes:
    return json.dumps({"model": "random:tiny", "prompt": PROMPTS[0], "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True, "temperature": 0}).encode()


def events_of(chunks: list[bytes]) -> list[str]:
    """The `data:` of each event; every chunk holds whole events."""
    assert all(chunk.endswith(b"\n\n") for chunk in chunks), chunks
    return [line[len("data: "):] for line in b"".join(chunks).decode().split("\n\n") if line]


def test_a_stream_is_chunked_events_and_the_connection_then_serves_the_next_request(wire):
    whole = json.loads(stream_body(6))
    wire.send(post("/v1/completions", json.dumps({**whole, "stream": False}).encode()))
    want = json.loads(wire.answer()[2])["choices"][0]["text"]
    wire.send(post("/v1/completions", stream_body(6)))
    status, headers, chunks = wire.chunked_answer()
    assert status == 200
    assert headers["content-type"] == "text/event-stream; charset=utf-8" and headers["cache-control"] == "no-cache"
    data = events_of(chunks)
    assert data[-1] == "[DONE]"
    choices = [json.loads(d)["choices"][0] for d in data[:-1]]
    assert choices[-1]["finish_reason"] == "length" and "".join(c["text"] for c in choices) == want
    wire.send(post("/v1/next-token", prompt_body(PROMPTS[1])))  # kept alive after the stream's last chunk
    status, _, answer = wire.answer()
    assert status == 200 and json.loads(answer)["prompt_token_ids"] == PROMPTS[1]


def test_streams_and_calls_pipelined_are_answered_in_order(wire):
    wire.send(post("/v1/next-token", prompt_body(PROMPTS[0])) + post("/v1/completions", stream_body(4))
              + post("/v1/next-token", prompt_body(PROMPTS[2])))
    first = wire.answer()
    _, _, chunks = wire.chunked_answer()
    last = wire.answer()
    assert json.loads(first[2])["prompt_token_ids"] == PROMPTS[0]
    assert events_of(chunks)[-1] == "[DONE]"
    assert json.loads(last[2])["prompt_token_ids"] == PROMPTS[2]


def test_a_stream_to_an_http_1_0_client_ends_with_the_connection(wire):
    wire.send(post("/v1/completions", stream_body(3), version=b"1.0"))
    status, headers, chunks = wire.chunked_answer()
    assert status == 200 and headers.get("connection") == "close" and events_of(chunks)[-1] == "[DONE]"
    assert wire.closed_by_server()


def test_a_refused_stream_is_a_json_error_not_a_stream(wire):
    body = json.dumps({"model": "no-such-model", "prompt": "x", "stream": True}).encode()
    wire.send(post("/v1/completions", body))
    status, headers, answer = wire.answer()
    assert status == 404 and headers["content-type"] == "application/json"
    assert json.loads(answer)["error"]["param"] == "model"


# A request asking to upgrade (curl --http2 sends `Upgrade: h2c` with every request to an http://
# URL) is answered in HTTP/1.1 with its body: llhttp takes such a request to end at its headers.
H2C = (b"Connection: Upgrade, HTTP2-Settings", b"Upgrade: h2c", b"HTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA")


def test_an_h2c_upgrade_is_ignored_and_the_body_read_in_pieces_then_the_next_request_served(wire):
    request = post("/v1/next-token", prompt_body(PROMPTS[0]), *H2C)
    head_end = request.index(b"\r\n\r\n") + 4
    wire.send(request[:head_end + 5])  # the body in two pieces, the second with a pipelined request
    time.sleep(0.05)
    wire.send(request[head_end + 5:] + post("/v1/next-token", prompt_body(PROMPTS[1])))
    status, headers, answer = wire.answer()
    assert status == 200 and json.loads(answer)["prompt_token_ids"] == PROMPTS[0]
    assert "upgrade" not in headers  # no switch of protocols: HTTP/1.1 throughout
    status, _, answer = wire.answer()
    assert status == 200 and json.loads(answer)["prompt_token_ids"] == PROMPTS[1]


@pytest.mark.parametrize("upgrade", [H2C, (b"Connection: Upgrade", b"Upgrade: websocket")])
def test_an_upgrade_on_asgi_routes_is_ignored(wire, upgrade):
    body = json.dumps({"model": "random:tiny", "prompt": [PROMPTS[2]], "max_tokens": 1, "temperature": 0}).encode()
    wire.send(post("/v1/completions", body, *upgrade) + b"GET /healthz HTTP/1.1\r\nHost: x\r\n%s\r\n\r\n"
              % b"\r\n".join(upgrade))
    status, _, answer = wire.answer()
    assert status == 200 and json.loads(answer)["usage"]["prompt_tokens"] == len(PROMPTS[2])
    status, _, answer = wire.answer()
    assert status == 200 and json.loads(answer)["status"] == "ok"


def test_an_upgrade_with_a_chunked_body_is_refused_clearly(server, wire):
    wire.send(b"POST /v1/next-token HTTP/1.1\r\nHost: x\r\n%s\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
              % b"\r\n".join(H2C))
    status, _, answer = wire.answer()
    assert status == 400 and b"Content-Length" in answer
    assert_a_new_connection_is_served(server)


def test_curl_http2_posts_are_answered_in_http_1_1(server):
    """The real client: curl --http2 to an http:// URL (h2c upgrade headers on a POST)."""
    for path, body, key in [("/v1/next-token", prompt_body(PROMPTS[0]), "prompt_token_ids"),
                            ("/v1/generate", json.dumps({"prompt_token_ids": PROMPTS[0], "max_tokens": 2}).encode(),
                             "tokens")]:
        run = subprocess.run(["curl", "-sS", "--http2", "-v", "-H", "Content-Type: application/json",
                              "--data-binary", "@-", server.http_url + path],
                             input=body, capture_output=True, timeout=60)
        assert run.returncode == 0 and b"Upgrade: h2c" in run.stderr, run.stderr[-2000:]
        assert b"< HTTP/1.1 200" in run.stderr, run.stderr[-2000:]
        answer = json.loads(run.stdout)
        assert key in answer, answer


# A request's head is bounded: the request line (414), the header section (431), Host (400) -------------

def test_a_request_line_past_the_limit_is_414_and_the_connection_closed(server, wire):
    wire.send(b"GET /healthz?" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    status, headers, body = wire.answer()
    assert status == 414 and b"--http-max-request-line-bytes" in body
    assert headers["connection"] == "close" and wire.closed_by_server()
    assert_a_new_connection_is_served(server)


def test_a_header_section_past_the_limit_is_431_whole_or_in_pieces(server):
    """Sent whole (one 20 KiB header), or as one header line that never ends: either is answered
    431 once the limit is passed, so a client cannot make the front end hold an endless head."""
    whole = Wire(server.http_url)
    try:
        whole.send(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 20000 + b"\r\n\r\n")
        status, _, body = whole.answer()
        assert status == 431 and b"--http-max-header-bytes" in body
        assert whole.closed_by_server()
    finally:
        whole.close()
    endless = Wire(server.http_url)
    try:
        endless.send(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Endless: ")
        sent = 0
        try:  # far past the 16 KiB limit: the answer comes within the first reads, and sending stops at it
            while sent < 4 << 20 and not select.select([endless.sock], [], [], 0.01)[0]:
                endless.send(b"e" * 8192)
                sent += 8192
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert sent < 1 << 20, "no answer before a megabyte of one header line"
        status, _, _ = endless.answer()
        assert status == 431
    finally:
        endless.close()
    assert_a_new_connection_is_served(server)


@pytest.mark.parametrize("hosts", [b"", b"Host: a\r\nHost: b\r\n"], ids=["no Host", "two Hosts"])
def test_an_http_1_1_request_without_exactly_one_host_is_400(server, wire, hosts):
    wire.send(b"GET /healthz HTTP/1.1\r\n" + hosts + b"\r\n")
    status, _, body = wire.answer()
    assert status == 400 and b"Host" in body
    assert_a_new_connection_is_served(server)


def test_an_http_1_0_request_without_host_is_served(wire):
    wire.send(b"GET /healthz HTTP/1.0\r\n\r\n")
    assert wire.answer()[0] == 200


def test_uvicorns_protocol_is_the_one_http_connections_subclasses():
    """transport/http_connections.py overrides uvicorn's private httptools protocol method by
    method: this fails when uvicorn renames or drops one of them, before a user meets it."""
    from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

    for name in ("connection_made", "connection_lost", "data_received", "on_message_begin", "on_url",
                 "on_header", "on_headers_complete", "on_body", "on_message_complete", "on_response_complete",
                 "send_400_response", "_unset_keepalive_if_required", "_should_upgrade",
                 "handle_websocket_upgrade", "_start_asgi_task"):
        assert callable(getattr(HttpToolsProtocol, name, None)), name
    assert {400, 414, 431} <= set(STATUS_LINE)
