"""No client holds a connection the server did not mean to give: idle gRPC connections are closed,
a keepalive ping flood is sent away, calls on one gRPC connection are bounded (the rest wait their
turn in the client), gRPC sockets that never send the HTTP/2 preface are closed, idle REST
keep-alive connections are closed, a slowloris is cut off while others are answered, and at the
connection limit a newcomer takes the place of the oldest connection without a request or call (a
slowloris larger than the limit keeps nobody out), or is refused when all are busy; a gRPC call
whose request stalls is ended at --grpc-request-timeout-s. Each loop is bounded, and each test
checks an order of events, not a speed."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time

import grpc
import hpack
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gpt2serve_client import AsyncClient, Client, Gpt2ServeError
from support.h2_attacks import split_frames
from support.servers import launch_server, metric_value


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    srv = launch_server(tmp_path_factory.mktemp("connections"), "--model", "random:tiny",
                        "--grpc-max-connection-idle-s", "1", "--grpc-max-concurrent-streams", "2",
                        "--grpc-min-ping-interval-s", "5", "--http-keep-alive-s", "1", "--http-request-timeout-s", "2")
    yield srv
    srv.stop()


def wait_for_state(channel: grpc.Channel, wanted: set, timeout: float) -> bool:
    """Whether the channel reached one of `wanted` within `timeout` (watched, not polled)."""
    reached = threading.Event()

    def seen(state):
        if state in wanted:
            reached.set()

    channel.subscribe(seen)
    try:
        return reached.wait(timeout)
    finally:
        channel.unsubscribe(seen)


def health(channel: grpc.Channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def test_an_idle_grpc_connection_is_closed_and_the_client_reconnects(limited):
    with grpc.insecure_channel(limited.grpc_target) as channel:
        assert health(channel) == health_pb2.HealthCheckResponse.SERVING
        # --grpc-max-connection-idle-s 1: the server sends GOAWAY and the channel falls back to IDLE.
        assert wait_for_state(channel, {grpc.ChannelConnectivity.IDLE}, timeout=15)
        assert health(channel) == health_pb2.HealthCheckResponse.SERVING  # a new connection, at the next call


def test_a_connection_with_calls_under_the_idle_limit_apart_is_kept(limited):
    """The idle clock restarts at each call's end: calls 0.3 s apart for 3 s (3x the idle limit)
    keep one connection; once they stop, it is closed."""
    with grpc.insecure_channel(limited.grpc_target) as channel:
        states: list = []
        channel.subscribe(states.append, try_to_connect=True)
        try:
            for _ in range(10):
                assert health(channel) == health_pb2.HealthCheckResponse.SERVING
                time.sleep(0.3)
            assert grpc.ChannelConnectivity.IDLE not in states[states.index(grpc.ChannelConnectivity.READY):]
            assert wait_for_state(channel, {grpc.ChannelConnectivity.IDLE}, timeout=15)
        finally:
            channel.unsubscribe(states.append)


@pytest.fixture(scope="module")
def ping_limited(tmp_path_factory):
    """Pings enforced, idle connections kept: only a ping flood can close a connection here."""
    srv = launch_server(tmp_path_factory.mktemp("pings"), "--model", "random:tiny", "--grpc-max-connection-idle-s", "0",
                        "--grpc-min-ping-interval-s", "5")
    yield srv
    srv.stop()


def test_a_keepalive_ping_flood_is_sent_away(ping_limited):
    pinging = [("grpc.keepalive_time_ms", 100), ("grpc.keepalive_timeout_ms", 1000),
               ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]
    with grpc.insecure_channel(ping_limited.grpc_target, options=pinging) as flooding, \
            grpc.insecure_channel(ping_limited.grpc_target) as quiet:
        assert health(flooding) == health(quiet) == health_pb2.HealthCheckResponse.SERVING
        # Pings every 100 ms against a minimum of 5 s: GOAWAY (too_many_pings) after 2 strikes.
        assert wait_for_state(flooding, {grpc.ChannelConnectivity.IDLE, grpc.ChannelConnectivity.TRANSIENT_FAILURE},
                              timeout=15)
        # The quiet channel, idle as long, keeps its connection: the pings were the reason.
        assert not wait_for_state(quiet, {grpc.ChannelConnectivity.IDLE, grpc.ChannelConnectivity.TRANSIENT_FAILURE},
                                  timeout=3)


def test_calls_on_one_connection_are_bounded_and_the_rest_wait(limited):
    """--grpc-max-concurrent-streams 2: of three streams on one channel, the third starts only
    once one of the first two has ended (it waits in the client, it is not refused)."""
    events: dict[int, dict[str, float]] = {}
    with Client(limited.grpc_target, timeout=120) as client:
        def stream(index: int) -> None:
            for chunk in client.generate_stream([464, 3139, 286 + index], max_tokens=120, temperature=0,
                                                ignore_eos=True):
                events.setdefault(index, {}).setdefault("first", time.monotonic())
                if chunk.finish_reason:
                    events[index]["end"] = time.monotonic()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
            time.sleep(0.05)  # the order they open in
        for thread in threads:
            thread.join(timeout=120)
    assert sorted(events) == [0, 1, 2] and all("end" in e for e in events.values())
    by_start = sorted(events.values(), key=lambda e: e["first"])
    assert by_start[2]["first"] >= min(by_start[0]["end"], by_start[1]["end"])


def test_an_idle_rest_keep_alive_connection_is_closed(limited):
    host, port = limited.http_url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=15) as sock:
        sock.sendall(f"GET /healthz HTTP/1.1\r\nHost: {host}\r\nConnection: keep-alive\r\n\r\n".encode())
        answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200")
        start = time.monotonic()
        rest = b""
        while chunk := sock.recv(65536):  # the server closes it: recv returns b"" (bounded by the timeout)
            rest += chunk
        assert time.monotonic() - start < 15


def host_port(server) -> tuple[str, int]:
    host, port = server.http_url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def test_a_slowloris_is_cut_off_while_others_are_answered(limited):
    """A header line every half second never finishes a request: --http-request-timeout-s 2 closes
    it, and a well-behaved client is answered all along."""
    with socket.create_connection(host_port(limited), timeout=15) as slow, httpx.Client(timeout=10) as http:
        slow.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        slow.settimeout(0.5)
        closed = False
        for line in range(40):  # 20 s of drip at most
            assert http.get(f"{limited.http_url}/healthz").status_code == 200
            try:
                slow.sendall(f"X-Drip-{line}: 1\r\n".encode())
                closed = slow.recv(1024) == b""
            except socket.timeout:
                continue
            except OSError:  # reset by the server
                closed = True
            if closed:
                break
        assert closed, "the dripping connection was never closed"


@pytest.fixture(scope="module")
def few_connections(tmp_path_factory):
    srv = launch_server(tmp_path_factory.mktemp("few-connections"), "--model", "random:tiny",
                        "--http-max-connections", "20", "--grpc-max-connections", "20", "--grpc-request-timeout-s", "2")
    yield srv
    srv.stop()


def open_descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def closed_by_server(sock: socket.socket, wait_s: float) -> bool:
    """Whether the server closes this connection within `wait_s` (reading whatever it sent first)."""
    sock.settimeout(wait_s)
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_a_connection_flood_takes_the_limit_and_no_more_oldest_out_first(few_connections):
    """--http-max-connections 20: 60 connections that send nothing. Each one past the limit takes
    the place of the oldest still without a request's headers, so the first 40 are closed (and
    counted as evicted, none refused), the last 20 held, and everything is released after."""
    url, pid = few_connections.http_url, few_connections.proc.pid
    evicted_before = metric_value(url, "gpt2serve_connections_evicted_total", {"api": "rest"})
    refused_before = metric_value(url, "gpt2serve_connections_refused_total", {"api": "rest"})
    baseline = open_descriptors(pid)
    flood = [socket.create_connection(host_port(few_connections), timeout=10) for _ in range(60)]
    try:
        assert all(closed_by_server(sock, 10) for sock in flood[:40])
        assert not any(closed_by_server(sock, 0.2) for sock in flood[40:])
        assert open_descriptors(pid) <= baseline + 20 + 2  # the 20 it holds, and no more
    finally:
        for sock in flood:
            sock.close()
    assert metric_value(url, "gpt2serve_connections_evicted_total", {"api": "rest"}) == evicted_before + 40
    assert metric_value(url, "gpt2serve_connections_refused_total", {"api": "rest"}) == refused_before
    with Client(few_connections.grpc_target) as client:  # gRPC untouched, REST answering again
        assert client.health() and httpx.get(f"{url}/healthz", timeout=10).status_code == 200
    deadline = time.monotonic() + 10  # the 20 held ones are released too
    while open_descriptors(pid) > baseline + 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert open_descriptors(pid) <= baseline + 2


@pytest.fixture(scope="module")
def two_front_ends(tmp_path_factory):
    """--workers 2: each front end has its own limits (the kernel spreads connections over them)."""
    srv = launch_server(tmp_path_factory.mktemp("two-front-ends"), "--model", "random:tiny", "--workers", "2",
                        "--http-max-connections", "20", "--grpc-max-connections", "20",
                        "--grpc-handshake-timeout-s", "1")
    yield srv
    srv.stop()


@pytest.mark.parametrize("server_name", ["few_connections", "two_front_ends"])
def test_a_slowloris_over_the_limit_cannot_keep_a_client_out(request, server_name):
    """60 connections dripping header lines against a limit of 20 a front end: a well-behaved
    client that comes during the attack is answered (it takes the place of the oldest drip),
    every time, with one front end or two."""
    server = request.getfixturevalue(server_name)
    url = server.http_url
    evicted_before = metric_value(url, "gpt2serve_connections_evicted_total", {"api": "rest"})
    slow = [socket.create_connection(host_port(server), timeout=10) for _ in range(60)]
    try:
        for sock in slow:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        for i in range(5):
            for sock in slow:
                try:
                    sock.sendall(f"X-Drip-{i}: 1\r\n".encode())
                except OSError:  # evicted earlier
                    pass
            with httpx.Client(timeout=10) as http:
                assert http.get(f"{url}/healthz").status_code == 200
    finally:
        for sock in slow:
            sock.close()
    # 60 over 40 places at most (20 a front end): at least 20 made room for others
    assert metric_value(url, "gpt2serve_connections_evicted_total", {"api": "rest"}) >= evicted_before + 20


def test_connections_busy_with_requests_stay_and_a_newcomer_is_refused(few_connections):
    """20 connections whose requests' headers are in (their bodies never come) are requests
    under way, not evicted: a 21st connection is closed at once and counted as refused."""
    url = few_connections.http_url
    refused_before = metric_value(url, "gpt2serve_connections_refused_total", {"api": "rest"})
    busy = [socket.create_connection(host_port(few_connections), timeout=10) for _ in range(20)]
    try:
        for sock in busy:
            sock.sendall(b"POST /v1/next-token HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{")
        time.sleep(2)  # their headers read (a few ms on an idle front end; room for a loaded machine)
        with socket.create_connection(host_port(few_connections), timeout=10) as late:
            assert closed_by_server(late, 10)
        assert not any(closed_by_server(sock, 0.1) for sock in busy)
    finally:
        for sock in busy:
            sock.close()
    assert metric_value(url, "gpt2serve_connections_refused_total", {"api": "rest"}) == refused_before + 1


def test_a_grpc_connection_flood_takes_the_limit_and_no_more_oldest_out_first(few_connections):
    """--grpc-max-connections 20: a client's connection (idle between its calls) and 60 sockets that
    send nothing. Each one past the limit takes the place of the oldest connection that has opened no
    call, which is sent GOAWAY and closed: the flood's first 41 (41 evicted and counted, none
    refused); the client's connection, which has made calls, stays, and its next call is answered
    on it. All is released after."""
    target, url, pid = few_connections.grpc_target, few_connections.http_url, few_connections.proc.pid
    host, port = target.rsplit(":", 1)
    evicted_before = metric_value(url, "gpt2serve_connections_evicted_total", {"api": "grpc"})
    refused_before = metric_value(url, "gpt2serve_connections_refused_total", {"api": "grpc"})
    with Client(target, retries=0, timeout=30) as client:
        assert client.health()
        baseline = open_descriptors(pid)
        flood = [socket.create_connection((host, int(port)), timeout=10) for _ in range(60)]
        try:
            assert all(closed_by_server(sock, 10) for sock in flood[:41])
            assert not any(closed_by_server(sock, 0.2) for sock in flood[41:])
            assert metric_value(url, "gpt2serve_connections_evicted_total", {"api": "grpc"}) == evicted_before + 41
            assert metric_value(url, "gpt2serve_connections_refused_total", {"api": "grpc"}) == refused_before
            assert open_descriptors(pid) <= baseline + 19 + 2  # the client's is one of the 20
            assert client.next_token("still answered", top_k=1).top[0].token_id >= 0  # on its connection
        finally:
            for sock in flood:
                sock.close()
        deadline = time.monotonic() + 10
        while open_descriptors(pid) > baseline + 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert open_descriptors(pid) <= baseline + 2
    with Client(target, retries=0, timeout=30) as late:  # room again for new clients
        assert late.health()


def stalled_call(sock: socket.socket, authority: str) -> None:
    """The HTTP/2 preface, then a NextToken call's headers and never its message."""
    headers = hpack.Encoder().encode([
        (":method", "POST"), (":scheme", "http"), (":path", "/gpt2serve.v1.Gpt2Serve/NextToken"),
        (":authority", authority), ("content-type", "application/grpc"), ("te", "trailers")])
    sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\0\0\0\x04\0\0\0\0\0"  # an empty SETTINGS
                 + len(headers).to_bytes(3, "big") + b"\x01\x04\0\0\0\x01" + headers)  # HEADERS, stream 1


def call_status(sock: socket.socket) -> tuple[bytes, bytes]:
    """grpc-status and grpc-message of the first answer that carries them, read with HPACK."""
    sock.settimeout(10)
    decoder, data = hpack.Decoder(), b""
    while True:
        chunk = sock.recv(4096)
        assert chunk, "closed without the call's status"
        frames, data = split_frames(data + chunk)
        for ftype, _, _, payload in frames:
            if ftype == 1:
                headers = dict(decoder.decode(payload, raw=True))
                if b"grpc-status" in headers:
                    return headers[b"grpc-status"], headers.get(b"grpc-message", b"")


def test_grpc_connections_with_calls_stay_and_stalled_calls_end_at_the_request_timeout(few_connections):
    """20 connections, each with a call whose message never comes, fill --grpc-max-connections 20:
    they are busy, not evicted, so a newcomer is closed at once and counted as refused. Within
    --grpc-request-timeout-s (2 s) and a sweep, each stalled call is answered CANCELLED, its
    connection is idle again, and a new client takes the place of one of them."""
    target, url = few_connections.grpc_target, few_connections.http_url
    host, port = target.rsplit(":", 1)
    refused_before = metric_value(url, "gpt2serve_connections_refused_total", {"api": "grpc"})
    busy = [socket.create_connection((host, int(port)), timeout=10) for _ in range(20)]
    try:
        for sock in busy:
            stalled_call(sock, target)
        time.sleep(0.5)  # their headers read (a few ms on an idle front end)
        with socket.create_connection((host, int(port)), timeout=10) as late:
            assert closed_by_server(late, 5)
        assert metric_value(url, "gpt2serve_connections_refused_total", {"api": "grpc"}) == refused_before + 1
        started = time.monotonic()
        answers = []
        for sock in busy:
            answers.append(call_status(sock))
        assert time.monotonic() - started < 10
        assert all(status == b"1" and b"--grpc-request-timeout-s" in message  # CANCELLED
                   for status, message in answers)
        with Client(target, retries=0, timeout=30) as client:
            assert client.health()
    finally:
        for sock in busy:
            sock.close()


@pytest.mark.parametrize("server_name", ["few_connections", "two_front_ends"])
def test_idle_grpc_connections_over_the_limit_cannot_keep_a_client_out(request, server_name):
    """60 gRPC connections that finish the handshake and sit, against --grpc-max-connections 20 a
    front end, beside 5 with a call that never sends its message: a new client is answered every
    time it comes, with one front end or two (it takes the place of the oldest idle connection)."""
    server = request.getfixturevalue(server_name)
    host, port = server.grpc_target.rsplit(":", 1)
    evicted_before = metric_value(server.http_url, "gpt2serve_connections_evicted_total", {"api": "grpc"})
    held = [socket.create_connection((host, int(port)), timeout=10) for _ in range(65)]
    try:
        for sock in held[:60]:
            sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\0\0\0\x04\0\0\0\0\0")  # an empty SETTINGS
        for sock in held[60:]:
            stalled_call(sock, server.grpc_target)
        for _ in range(3):
            with Client(server.grpc_target, retries=0, timeout=30) as client:
                assert client.next_token("during the flood", top_k=1).top[0].token_id >= 0
    finally:
        for sock in held:
            sock.close()
    # 65 held over 40 places at most (20 a front end): at least 25 made room for others
    assert metric_value(server.http_url, "gpt2serve_connections_evicted_total", {"api": "grpc"}) >= evicted_before + 25


@pytest.fixture(scope="module")
def short_handshake(tmp_path_factory):
    srv = launch_server(tmp_path_factory.mktemp("handshake"), "--model", "random:tiny",
                        "--grpc-handshake-timeout-s", "1", "--max-queue", "16", "--max-running-sequences", "1000",
                        "--max-batch-size", "512")
    yield srv
    srv.stop()


def at_once(target: str, n: int, call) -> list:
    """n calls at once on one new AsyncClient channel (retries=0): each one's answer, or its
    error's code."""
    async def main():
        async with AsyncClient(target, retries=0, timeout=60) as client:
            async def one(i: int):
                try:
                    return await call(client, i)
                except Gpt2ServeError as exc:
                    return exc.code
            return await asyncio.gather(*(one(i) for i in range(n)))

    return asyncio.run(main())


def test_calls_past_the_stream_limit_on_a_fresh_channel_wait_and_are_never_unavailable(short_handshake):
    """300 calls at once on one new channel, past the server's 256 streams a connection, with
    retries=0 (no retry policy): the streams it refuses unopened are retried by gRPC itself, so
    every call gets an answer or RESOURCE_EXHAUSTED (--max-queue 16), never UNAVAILABLE."""
    outcomes = at_once(short_handshake.grpc_target, 300, lambda client, i: client.next_token(f"call {i}", top_k=1))
    codes = {o for o in outcomes if isinstance(o, str)}
    assert codes <= {"RESOURCE_EXHAUSTED"}, codes
    assert sum(not isinstance(o, str) for o in outcomes) >= 16


def test_streams_past_the_stream_limit_on_a_fresh_channel_are_never_unavailable(short_handshake):
    """As for unary calls: 600 generations at once on one new channel, past the server's 256
    streams a connection, retries=0; a stream the server refused unopened is sent again, so each
    one ends in its tokens or RESOURCE_EXHAUSTED (--max-queue 16 waiting for a slot)."""
    outcomes = at_once(short_handshake.grpc_target, 600,
                       lambda client, i: client.generate(f"stream {i}", max_tokens=8, temperature=0))
    codes = {o for o in outcomes if isinstance(o, str)}
    assert codes <= {"RESOURCE_EXHAUSTED"}, codes
    assert all(len(o.tokens) == 8 for o in outcomes if not isinstance(o, str))


@pytest.mark.parametrize("server_name", ["short_handshake", "two_front_ends"])
def test_grpc_sockets_that_never_send_the_http2_preface_are_closed(request, server_name):
    """--grpc-handshake-timeout-s 1: sockets that connect and say nothing are closed within a few
    seconds (gRPC's own default waits 120 s), and a real client is answered meanwhile."""
    server = request.getfixturevalue(server_name)
    host, port = server.grpc_target.rsplit(":", 1)
    idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(10)]
    try:
        with Client(server.grpc_target, retries=0, timeout=30) as client:
            assert client.health()
        started = time.monotonic()
        assert all(closed_by_server(sock, 10) for sock in idle)
        assert time.monotonic() - started < 10
    finally:
        for sock in idle:
            sock.close()


def server_side_timer(port: int, peer_port: int) -> str | None:
    """The kernel's timer on the server's end of a loopback connection (/proc/net/tcp's `tr`:
    0 none, 1 retransmit, 2 keepalive)."""
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and int(fields[2].split(":")[1], 16) == peer_port:
            return fields[5].split(":")[0]
    return None


def test_accepted_connections_carry_the_kernels_keepalive(limited):
    """A peer that vanishes without a FIN is found by the kernel's keepalive probes, as gRPC's own
    server finds it by its pings: both ports' accepted connections have the keepalive timer armed."""
    for target in (limited.grpc_target, limited.http_url.removeprefix("http://")):
        host, port = target.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            deadline = time.monotonic() + 5
            peer_port = sock.getsockname()[1]
            while (timer := server_side_timer(int(port), peer_port)) is None and time.monotonic() < deadline:
                time.sleep(0.05)  # until the server has accepted it
            assert timer == "02", (target, timer)
