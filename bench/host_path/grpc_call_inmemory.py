"""The built-in gRPC server's own CPU per unary call with no sockets and no event-loop I/O: an
`Http2Connection` and its `GrpcApp` fed a client's bytes in memory (an ngh2 client writes the
requests and reads the answers, outside the timer), so the figure is the HTTP/2 and gRPC layers'
work alone and varies far less than a loaded server's.

    .venv/bin/python bench/host_path/grpc_call_inmemory.py [--per-read 1] [--stream] [--reps 5]

`--per-read`: calls whose bytes arrive in one read (1: one call a read, as 64 connections with a
call each; 16: a busy multiplexed connection). Prints the best of `--reps` runs of 4,800 calls.
`--stream`: a streamed token instead: 64 Generate streams on one connection, each answered 64
token messages, one token a stream a step (as the engine's steps release them); the client's
window updates are fed back as it sends them.
To compare against another commit, run this file with that checkout's `server/` and `client/`
first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import ngh2
import uvloop

from gpt2serve.config import ServeConfig
from gpt2serve.transport.grpc_calls import SERVER_STREAM, UNARY, GrpcApp, GrpcMethod
from gpt2serve.transport.h2_connection import Http2Connection
from gpt2serve_client._proto import gpt2serve_pb2 as pb
from gpt2serve_client.generation import GeneratedToken, GenerateChunk

try:
    from gpt2serve.transport.h2_stream import ConnectionPolicy
except ImportError:  # the hand-written stack (139f00f and before)
    from gpt2serve.transport.h2_frames import ConnectionPolicy

ANSWER = pb.NextTokenResponse(token_id=262, token=" the", logprob=-0.5,
                              top=[pb.TokenLogprob(token_id=262 + i, token=" the", logprob=-0.5 - i) for i in range(5)])
TOKEN = GenerateChunk(" the", GeneratedToken(262, " the", -0.5)).to_proto()
STREAMS = TOKENS = 64
REQUEST_HEADERS = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/gpt2serve.v1.Gpt2Serve/NextToken"),
                   (b":authority", b"x"), (b"content-type", b"application/grpc"), (b"te", b"trailers")]


class MemoryTransport:
    def __init__(self):
        self.written: list[bytes] = []

    def write(self, data) -> None:
        self.written.append(bytes(data))

    def take(self) -> bytes:
        data, self.written = b"".join(self.written), []
        return data

    def get_extra_info(self, name):
        return ("127.0.0.1", 1) if name == "peername" else None

    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...
    def close(self) -> None: ...
    def abort(self) -> None: ...

    def is_closing(self) -> bool:
        return False


async def next_token(request, context):
    return ANSWER


class Steps:
    """The engine's steps, stood in for: each releases one token to every stream."""

    def __init__(self):
        self.next = asyncio.get_running_loop().create_future()

    def step(self) -> None:
        done, self.next = self.next, asyncio.get_running_loop().create_future()
        done.set_result(None)

    async def generate(self, request, context):
        for _ in range(TOKENS):
            await self.next
            yield TOKEN


async def turns(count: int) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


def connect(methods: dict) -> tuple[Http2Connection, MemoryTransport]:
    # The server's default idle limit (--grpc-max-connection-idle-s): its timer is part of a call's upkeep.
    policy = ConnectionPolicy(idle_timeout_s=ServeConfig().grpc_max_connection_idle_s)
    connection = Http2Connection(GrpcApp(methods, 4 << 20), policy)
    transport = MemoryTransport()
    connection.connection_made(transport)
    return connection, transport


async def handshake(connection: Http2Connection, transport: MemoryTransport) -> ngh2.Connection:
    client = ngh2.Connection(ngh2.Role.CLIENT)
    client.initiate_connection()
    for _ in range(2):  # the handshake both ways
        connection.data_received(client.data_to_send())
        await turns(4)
        client.receive_data(transport.take())
        client.events()
    return client


def request_body(request) -> bytes:
    payload = request.SerializeToString()
    return b"\0" + len(payload).to_bytes(4, "big") + payload


async def server_us_a_call(calls: int, per_read: int) -> float:
    method = GrpcMethod(UNARY, next_token, pb.NextTokenRequest.FromString, pb.NextTokenResponse.SerializeToString)
    connection, transport = connect({"/gpt2serve.v1.Gpt2Serve/NextToken": method})
    client = await handshake(connection, transport)
    body = request_body(pb.NextTokenRequest(prompt_token_ids=[464, 3139, 286, 4881, 318]))
    spent = 0.0
    for _ in range(calls // per_read):
        for _ in range(per_read):
            stream_id = client.send_request(REQUEST_HEADERS)
            client.send_data(stream_id, body, end_stream=True)
        reply = client.data_to_send()
        while reply:  # the requests; then the client's reply to the answers, if it has one
            started = time.process_time()
            connection.data_received(reply)
            await turns(4)
            spent += time.process_time() - started
            client.receive_data(transport.take())
            client.events()
            reply = client.data_to_send()
    return spent / calls * 1e6


async def server_us_a_token() -> float:
    steps = Steps()
    method = GrpcMethod(SERVER_STREAM, steps.generate, pb.GenerateRequest.FromString, pb.GenerateResponse.SerializeToString)
    path = b"/gpt2serve.v1.Gpt2Serve/Generate"
    connection, transport = connect({path.decode(): method})
    client = await handshake(connection, transport)
    body = request_body(pb.GenerateRequest(prompt="The", max_tokens=TOKENS))
    headers = [(name, path if name == b":path" else value) for name, value in REQUEST_HEADERS]
    for _ in range(STREAMS):
        client.send_data(client.send_request(headers), body, end_stream=True)
    connection.data_received(client.data_to_send())  # the streams open (not timed)
    await turns(4)
    spent, received = 0.0, 0
    for _ in range(TOKENS + 1):  # a token a stream each step; then the streams' ends
        started = time.process_time()
        steps.step()
        await turns(4)
        spent += time.process_time() - started
        client.receive_data(transport.take())
        received += sum(len(e.data) for e in client.events() if isinstance(e, ngh2.DataReceived))
        if reply := client.data_to_send():
            started = time.process_time()
            connection.data_received(reply)
            await turns(4)
            spent += time.process_time() - started
    if received != STREAMS * TOKENS * (5 + TOKEN.ByteSize()):
        raise RuntimeError(f"the client received {received} bytes of answers, not every token")
    return spent / (STREAMS * TOKENS) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-read", type=int, default=1)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    if args.stream:
        best = min(uvloop.run(server_us_a_token()) for _ in range(args.reps))
        print(f"{best:.1f} us of the server's CPU a streamed token ({STREAMS} streams on a connection)")
        return
    best = min(uvloop.run(server_us_a_call(4800, args.per_read)) for _ in range(args.reps))
    print(f"{best:.1f} us of the server's CPU a unary call ({args.per_read} a read)")


if __name__ == "__main__":
    main()
