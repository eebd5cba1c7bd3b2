"""The built-in gRPC server (--grpc-server builtin) on the wire, with grpcio's own client: what our
HTTP/2 and gRPC layers do that grpc.aio's core did for us.

- Flow control both ways: an answer larger than the client's window, a request larger than the
  window we give, and a message past --max-message-bytes refused with RESOURCE_EXHAUSTED.
- Compressed requests (gzip, deflate), deadlines and a client's cancel (the connection limit, its
  evictions and refusals, and stalled calls: tests/serving/test_connections.py).
- The services a user reaches with tools: health (Check and Watch) and reflection.
- A client that never reads cannot make the server buffer what it owes it without bound.
"""

from __future__ import annotations

import socket

import grpc
import hpack
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from gpt2serve_client._proto import gpt2serve_pb2 as pb, gpt2serve_pb2_grpc as pb_grpc
from support.h2_attacks import PREFACE, SETTINGS_ACK, frame, read_frames  # (a conformant client acks SETTINGS)
from support.servers import launch_server

MAX_MESSAGE = 8 << 20


@pytest.fixture(scope="module")
def builtin(tmp_path_factory):
    srv = launch_server(tmp_path_factory.mktemp("builtin"), "--model", "random:tiny", "--grpc-server", "builtin",
                        "--max-message-bytes", str(MAX_MESSAGE))
    yield srv
    srv.stop()


def stub(channel: grpc.Channel) -> pb_grpc.Gpt2ServeStub:
    return pb_grpc.Gpt2ServeStub(channel)


def test_an_answer_larger_than_the_clients_window_arrives_whole(builtin):
    """A client whose window stays at 64 KiB (no BDP probing) reads a ~1 MiB answer: the server
    sends what the window allows and the rest as the client's WINDOW_UPDATEs come."""
    prompts = [pb.Prompt(prompt_token_ids=[(i * 7 + j) % 50000 for j in range(200)]) for i in range(48)]
    request = pb.NextTokenBatchRequest(prompts=prompts, top_k=5, prompt_logprobs=5)
    with grpc.insecure_channel(builtin.grpc_target, options=[("grpc.http2.bdp_probe", 0)]) as channel:
        answer = stub(channel).NextTokenBatch(request, timeout=120)
        assert answer.ByteSize() > 512 << 10
        assert len(answer.results) == 48
        assert all(len(result.prompt_logprobs) == 200 for result in answer.results)  # the first without one
        # The same prompt alone is answered the same (a small answer, one frame).
        alone = stub(channel).NextToken(pb.NextTokenRequest(prompt_token_ids=prompts[3].prompt_token_ids, top_k=5),
                                        timeout=60)
        assert alone.token_id == answer.results[3].token_id


def test_a_request_larger_than_the_window_given_is_read_and_one_past_the_limit_refused(builtin):
    """A 6 MiB request is more than the 4 MiB a stream may send before the server reads it, so it
    arrives only if the server tops up the window as it reads; one past --max-message-bytes is
    RESOURCE_EXHAUSTED, and the connection still serves."""
    big = pb.NextTokenRequest(prompt_token_ids=[50000] * (2 << 20))  # 3 bytes an id: 6 MiB
    too_big = pb.NextTokenRequest(prompt_token_ids=[50000] * (MAX_MESSAGE // 3 + 100))
    assert big.ByteSize() > 6 << 20 and too_big.ByteSize() > MAX_MESSAGE
    with grpc.insecure_channel(builtin.grpc_target, options=[("grpc.max_send_message_length", -1)]) as channel:
        with pytest.raises(grpc.RpcError) as read:
            stub(channel).NextToken(big, timeout=60)
        assert read.value.code() == grpc.StatusCode.INVALID_ARGUMENT, read.value.details()  # read, then judged
        assert "token" in read.value.details()
        with pytest.raises(grpc.RpcError) as refused:
            stub(channel).NextToken(too_big, timeout=60)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert str(MAX_MESSAGE) in refused.value.details()
        assert stub(channel).NextToken(pb.NextTokenRequest(prompt="still served"), timeout=30).token


@pytest.mark.parametrize("compression", [grpc.Compression.Gzip, grpc.Compression.Deflate])
def test_compressed_requests_are_answered(builtin, compression):
    with grpc.insecure_channel(builtin.grpc_target, compression=compression) as channel:
        plain = stub(channel).NextToken(pb.NextTokenRequest(prompt="Hello world " * 50, top_k=3), timeout=30)
    with grpc.insecure_channel(builtin.grpc_target) as channel:
        again = stub(channel).NextToken(pb.NextTokenRequest(prompt="Hello world " * 50, top_k=3), timeout=30)
    assert plain.prompt_token_ids == again.prompt_token_ids
    assert [t.token_id for t in plain.top] == [t.token_id for t in again.top]


def test_a_deadline_ends_a_generation_and_a_cancel_frees_its_stream(builtin):
    with grpc.insecure_channel(builtin.grpc_target) as channel:
        with pytest.raises(grpc.RpcError) as late:
            for _ in stub(channel).Generate(pb.GenerateRequest(prompt="on and on", max_tokens=250, ignore_eos=True),
                                            timeout=0.05):  # 250 steps of random:tiny take longer
                pass
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        stream = stub(channel).Generate(pb.GenerateRequest(prompt="on and on", max_tokens=250, ignore_eos=True),
                                        timeout=60)
        next(stream)
        stream.cancel()
        with pytest.raises(grpc.RpcError) as cancelled:
            next(stream)
        assert cancelled.value.code() == grpc.StatusCode.CANCELLED
        assert stub(channel).NextToken(pb.NextTokenRequest(prompt="after"), timeout=30).token


def test_health_check_watch_and_reflection(builtin):
    with grpc.insecure_channel(builtin.grpc_target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest(service="gpt2serve.v1.Gpt2Serve"), timeout=10).status == \
            health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as unknown:
            health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = list(reflect.ServerReflectionInfo(iter([
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="gpt2serve.v1.Gpt2Serve")]), timeout=10))
        names = {service.name for service in answers[0].list_services_response.service}
        assert {"gpt2serve.v1.Gpt2Serve", "grpc.health.v1.Health"} <= names
        assert answers[1].file_descriptor_response.file_descriptor_proto


def test_an_unknown_method_and_a_wrong_content_type_are_refused(builtin):
    with grpc.insecure_channel(builtin.grpc_target) as channel:
        unknown = channel.unary_unary("/gpt2serve.v1.Gpt2Serve/NoSuchMethod")
        with pytest.raises(grpc.RpcError) as refused:
            unknown(b"", timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "NoSuchMethod" in refused.value.details()


@pytest.fixture(scope="module")
def grpcio_server(tmp_path_factory):
    srv = launch_server(tmp_path_factory.mktemp("grpcio"), "--model", "random:tiny", "--grpc-server", "grpcio")
    yield srv
    srv.stop()


def every_kind_of_call(target: str) -> list:
    """One call of each method and service, and two refusals, as (what, answer or status)."""
    outcomes = []
    with grpc.insecure_channel(target) as channel:
        service = stub(channel)
        outcomes.append(("next token", service.NextToken(pb.NextTokenRequest(prompt="The sky is", top_k=3),
                                                         timeout=30).top))
        batch = service.NextTokenBatch(pb.NextTokenBatchRequest(prompts=[pb.Prompt(prompt="a b"), pb.Prompt(
            prompt="c")], prompt_logprobs=2), timeout=30)
        outcomes.append(("batch", [(r.token_id, list(r.prompt_logprobs)) for r in batch.results]))
        # Joined: how many tokens share a message depends on when the client reads (coalescing).
        outcomes.append(("generate", "".join(m.text for m in service.Generate(
            pb.GenerateRequest(prompt="Once", max_tokens=6, temperature=0, ignore_eos=True), timeout=30))))
        outcomes.append(("model", service.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).architecture))
        for what, call in (("empty prompt", lambda: service.NextToken(pb.NextTokenRequest(), timeout=30)),
                           ("bad top_k", lambda: service.NextToken(pb.NextTokenRequest(prompt="a", top_k=10**6),
                                                                    timeout=30))):
            with pytest.raises(grpc.RpcError) as refused:
                call()
            outcomes.append((what, refused.value.code(), refused.value.details()))
        outcomes.append(("health", health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                                             timeout=10).status))
        listed = next(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
        outcomes.append(("services", sorted(s.name for s in listed.list_services_response.service)))
    return outcomes


def test_both_grpc_servers_answer_alike(builtin, grpcio_server):
    """--grpc-server grpcio stays a working choice: the same calls get the same answers and
    statuses from grpc.aio as from the built-in server (same weights: the same random seed)."""
    ours, theirs = every_kind_of_call(builtin.grpc_target), every_kind_of_call(grpcio_server.grpc_target)
    assert [o[0] for o in ours] == [o[0] for o in theirs]
    for mine, reference in zip(ours, theirs):
        assert mine == reference, mine[0]


def connection_window_given(frames) -> int:
    return sum(int.from_bytes(payload, "big")
               for ftype, _, stream_id, payload in frames if ftype == 8 and not stream_id)  # WINDOW_UPDATE on 0


def test_partial_messages_hold_the_connection_window_until_released(builtin):
    """A raw HTTP/2 client opens four calls and sends 3 MiB of a 4 MiB message on each: 12 MiB
    the server must keep. It gives the connection's window back only for bytes a call has taken,
    so those 12 MiB are not returned while held (a client cannot make it buffer more than the
    window), and are returned once the client resets the streams."""
    host, port = builtin.grpc_target.rsplit(":", 1)
    encoder = hpack.Encoder()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(PREFACE + frame(4, 0, 0) + SETTINGS_ACK)
        opening = read_frames(sock, 1.0)
        assert connection_window_given(opening) == (16 << 20) - 65535  # 2 x --max-message-bytes (8 MiB)
        chunk = b"\0" * 16384
        for stream_id in (1, 3, 5, 7):
            sock.sendall(frame(1, 0x4, stream_id, encoder.encode([
                (":method", "POST"), (":scheme", "http"), (":path", "/gpt2serve.v1.Gpt2Serve/NextToken"),
                (":authority", builtin.grpc_target), ("content-type", "application/grpc"), ("te", "trailers")])))
            sock.sendall(frame(0, 0, stream_id, b"\0" + (4 << 20).to_bytes(4, "big") + chunk[:16379]))
            sock.sendall(b"".join(frame(0, 0, stream_id, chunk) for _ in range((3 << 20) // 16384 - 1)))
        assert connection_window_given(read_frames(sock, 1.0)) == 0  # all 12 MiB held by the calls
        sock.sendall(b"".join(frame(3, 0, stream_id, (8).to_bytes(4, "big")) for stream_id in (1, 3, 5, 7)))
        # Given back once released, in updates of at least half the window: 9 MiB after the third reset.
        assert connection_window_given(read_frames(sock, 1.0)) >= 8 << 20


@pytest.mark.parametrize("flood", ["settings", "refused streams"])
def test_a_client_that_never_reads_cannot_make_the_server_buffer_without_bound(builtin, flood):
    """SETTINGS acks and the RST_STREAMs that refuse streams past the limit are not flow-controlled:
    a client that asks for them and never reads would have them pile up in the server. The server
    stops reading such a client once its answers back up, so the client's sends stall within the
    sockets' buffers, or ends the connection as a flood (the server took 100 MiB of SETTINGS in 9 s
    before), and others are served."""
    host, port = builtin.grpc_target.rsplit(":", 1)
    encoder = hpack.Encoder()
    request = [(":method", "POST"), (":scheme", "http"), (":path", "/gpt2serve.v1.Gpt2Serve/Generate"),
               (":authority", builtin.grpc_target), ("content-type", "application/grpc"), ("te", "trailers")]
    sent, stream_id, stalled = 0, 1, False
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(PREFACE + frame(4, 0, 0) + SETTINGS_ACK)
        sock.settimeout(3.0)
        while sent < 64 << 20 and not stalled:
            if flood == "settings":
                chunk = frame(4, 0, 0, (4).to_bytes(2, "big") + (1 << 16).to_bytes(4, "big")) * 10_000
            else:  # past the 256 streams a connection may open, each HEADERS is answered by a refusal
                chunk = b"".join(frame(1, 0x4, stream_id + 2 * i, encoder.encode(request)) for i in range(2000))
                stream_id += 4000
            try:
                sock.sendall(chunk)
                sent += len(chunk)
            except socket.timeout:
                stalled = True
            except (BrokenPipeError, ConnectionResetError):  # sent GOAWAY (ENHANCE_YOUR_CALM) and cut off
                stalled = True
        assert stalled and sent < 32 << 20, sent
        with grpc.insecure_channel(builtin.grpc_target) as channel:
            assert stub(channel).NextToken(pb.NextTokenRequest(prompt="still served"), timeout=30).token


def open_call(sock: socket.socket, encoder: hpack.Encoder, stream_id: int, path: str, authority: str) -> None:
    sock.sendall(frame(1, 0x4, stream_id, encoder.encode([
        (":method", "POST"), (":scheme", "http"), (":path", path), (":authority", authority),
        ("content-type", "application/grpc"), ("te", "trailers")])))


def grpc_status(frames, stream_id: int) -> bytes | None:
    """The grpc-status a stream's trailers carry (decoded with the server's literal encoding)."""
    decoder = hpack.Decoder()
    for ftype, _, sid, payload in frames:
        if ftype == 1:
            headers = dict(decoder.decode(payload, raw=True))
            if sid == stream_id and b"grpc-status" in headers:
                return headers[b"grpc-status"]
    return None


def test_a_second_request_message_on_a_unary_call_is_refused_at_once(builtin):
    """A client that sends NextToken message after message without ending its request gets
    UNIMPLEMENTED at the second, not a call that holds every message until it ends."""
    host, port = builtin.grpc_target.rsplit(":", 1)
    request = pb.NextTokenRequest(prompt="one of many").SerializeToString()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(PREFACE + frame(4, 0, 0) + SETTINGS_ACK)
        open_call(sock, hpack.Encoder(), 1, "/gpt2serve.v1.Gpt2Serve/NextToken", builtin.grpc_target)
        sock.sendall(frame(0, 0, 1, (b"\0" + len(request).to_bytes(4, "big") + request) * 2))
        frames = read_frames(sock, 2.0)
    assert grpc_status(frames, 1) == b"12"  # UNIMPLEMENTED
    assert any(ftype == 3 and sid == 1 for ftype, _, sid, _ in frames)  # and the stream reset: nothing more is read


def test_a_bidirectional_call_that_is_never_read_holds_a_bounded_queue(builtin):
    """Reflection requests from a client that gives no window for the answers: the handler waits on
    its first answer and the requests queue. Past 64 waiting, the call is ended (its stream reset),
    so a client that writes and never reads holds neither the handler's queue nor the window."""
    host, port = builtin.grpc_target.rsplit(":", 1)
    request = reflection_pb2.ServerReflectionRequest(list_services="").SerializeToString()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        no_window = (4).to_bytes(2, "big") + (0).to_bytes(4, "big")  # SETTINGS_INITIAL_WINDOW_SIZE 0
        sock.sendall(PREFACE + frame(4, 0, 0, no_window) + SETTINGS_ACK)
        open_call(sock, hpack.Encoder(), 1, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                  builtin.grpc_target)
        sock.sendall(frame(0, 0, 1, (b"\0" + len(request).to_bytes(4, "big") + request) * 200))
        frames = read_frames(sock, 2.0)
    assert any(ftype == 3 and sid == 1 for ftype, _, sid, _ in frames), frames
    assert not any(ftype == 7 for ftype, _, _, _ in frames)  # the connection itself goes on


def test_data_past_the_connection_window_ends_the_connection(builtin):
    """A client that ignores flow control: 16 MiB of partial messages fill the window the server
    gave (held by their calls, so none of it comes back), then one byte more is sent GOAWAY
    FLOW_CONTROL_ERROR. The window bounds what any client can make the server hold."""
    host, port = builtin.grpc_target.rsplit(":", 1)
    encoder, chunk = hpack.Encoder(), b"\0" * 16384
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(PREFACE + frame(4, 0, 0) + SETTINGS_ACK)
        for stream_id in (1, 3, 5, 7):  # 4 MiB each of an 8 MiB message: 16 MiB, the whole window
            open_call(sock, encoder, stream_id, "/gpt2serve.v1.Gpt2Serve/NextToken", builtin.grpc_target)
            sock.sendall(frame(0, 0, stream_id, b"\0" + (8 << 20).to_bytes(4, "big") + chunk[:16379]))
            sock.sendall(b"".join(frame(0, 0, stream_id, chunk) for _ in range((4 << 20) // 16384 - 1)))
        opened = read_frames(sock, 1.0)  # all of it read by the server before the last byte comes
        assert not any(ftype == 7 for ftype, _, _, _ in opened)
        sock.sendall(frame(0, 0, 1, b"\0"))
        frames = read_frames(sock, 2.0)
    goaway = [payload for ftype, _, _, payload in frames if ftype == 7]
    assert goaway and int.from_bytes(goaway[0][4:8], "big") == 3, frames[-3:]  # FLOW_CONTROL_ERROR


def test_refused_messages_give_their_window_back(builtin):
    """Six calls of one connection each send a whole 3 MiB message flagged compressed with no
    grpc-encoding: 18 MiB against the 16 MiB window. Each is refused (UNIMPLEMENTED), and each
    refused message's bytes come back to the connection's window, so the connection goes on;
    were they kept, the sixth would pass the window and end the connection."""
    host, port = builtin.grpc_target.rsplit(":", 1)
    encoder, chunk = hpack.Encoder(), b"\0" * 16384
    frames = []
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(PREFACE + frame(4, 0, 0) + SETTINGS_ACK)
        for stream_id in (1, 3, 5, 7, 9, 11):
            open_call(sock, encoder, stream_id, "/gpt2serve.v1.Gpt2Serve/NextToken", builtin.grpc_target)
            sock.sendall(frame(0, 0, stream_id, b"\1" + (3 << 20).to_bytes(4, "big") + chunk[:16379]))
            sock.sendall(b"".join(frame(0, 0, stream_id, chunk) for _ in range((3 << 20) // 16384 - 1)))
            sock.sendall(frame(0, 1, stream_id, b"\0" * 5))  # the rest, and END_STREAM
            frames += read_frames(sock, 0.5)
    assert [grpc_status(frames, stream_id) for stream_id in (1, 3, 5, 7, 9, 11)] == [b"12"] * 6
    assert not any(ftype == 7 for ftype, _, _, _ in frames)  # no GOAWAY


def test_a_busy_client_is_not_taken_for_a_flood(builtin):
    """grpcio sends a WINDOW_UPDATE or two after reading each answer, with nothing of ours waiting
    on them: thousands of calls back to back on one connection are frames that do no work one by
    one, yet each came with a call. None may be refused as a flood (GOAWAY ENHANCE_YOUR_CALM)."""
    request = pb.NextTokenRequest(prompt_token_ids=[464, 3139], top_k=1)
    floods_before = builtin.log().count("ENHANCE_YOUR_CALM")  # (the flood tests above send some)
    with grpc.insecure_channel(builtin.grpc_target, options=[("grpc.enable_retries", 0)]) as channel:
        calls = [stub(channel).NextToken.future(request, timeout=60) for _ in range(3000)]
        codes = [call.code() for call in calls]
    assert codes.count(grpc.StatusCode.OK) == 3000, {code: codes.count(code) for code in set(codes)}
    assert builtin.log().count("ENHANCE_YOUR_CALM") == floods_before
