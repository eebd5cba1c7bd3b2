"""The floor under the gRPC front end's host cost: a bare servicer with nothing else in its
process, answering with prebuilt messages.

- streaming (the default): grpc.aio streams a prebuilt token message; prints the event-loop
  thread's CPU per message while a client process runs 64 streams x 5 calls x 64 messages (the
  same shape as generate_host_cost.py's load).
- `--unary`: NextToken answered with a prebuilt NextTokenResponse (top 5), by grpc.aio, by
  grpc's sync server on a thread pool and by the built-in server (`--grpc-server builtin`),
  under h2load (64 calls in flight over 16 connections, one thread: the load generator takes a
  few percent of a core). Prints the server process's whole
  CPU per call, its threads included, against which a front end's CPU per unary call
  (bench/host_path/front_end_profile.py) compares.
- `--unary --against TREE`: the built-in server of this checkout and of another one (e.g. a
  `git worktree` of an older commit), both started once and driven in turn, a short window
  each, many rounds. Alternating windows of seconds, not whole runs, keep a shared machine's
  drift out of the ratio; prints each round, the medians and their ratio.

    .venv/bin/python bench/host_path/grpc_stream_floor.py [--unary [--seconds 6] [--rounds 2] [--servers aio,builtin]]
    .venv/bin/python bench/host_path/grpc_stream_floor.py --unary --against /tmp/old [--seconds 3] [--rounds 12]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc

from gpt2serve_client._proto import gpt2serve_pb2 as pb, gpt2serve_pb2_grpc as pb_grpc
from gpt2serve_client.generation import GeneratedToken, GenerateChunk
from servers import alternating  # bench/host_path, this script's folder

MESSAGES, STREAMS, CALLS = 64, 64, 5
TOKEN = GenerateChunk(" the", GeneratedToken(262, " the", -0.5)).to_proto()
CLIENT = """
import asyncio, grpc, sys
from gpt2serve_client._proto import gpt2serve_pb2 as pb, gpt2serve_pb2_grpc as pb_grpc
async def main():
    async with grpc.aio.insecure_channel(sys.argv[1]) as channel:
        stub = pb_grpc.Gpt2ServeStub(channel)
        async def calls():
            for _ in range({calls}):
                async for _ in stub.Generate(pb.GenerateRequest()):
                    pass
        await asyncio.gather(*(calls() for _ in range({streams})))
asyncio.run(main())
""".format(calls=CALLS, streams=STREAMS)
ANSWER = pb.NextTokenResponse(token_id=262, token=" the", logprob=-0.5, batch_size=64,
                              prompt_token_ids=[464, 3139, 286, 4881, 318],
                              top=[pb.TokenLogprob(token_id=262 + i, token=" the", logprob=-0.5 - i) for i in range(5)])


class Streamer(pb_grpc.Gpt2ServeServicer):
    async def Generate(self, request, context):
        for _ in range(MESSAGES):
            yield TOKEN


async def streaming() -> None:
    server = grpc.aio.server()
    pb_grpc.add_Gpt2ServeServicer_to_server(Streamer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = subprocess.Popen([sys.executable, "-c", CLIENT, f"127.0.0.1:{port}"])
    started = time.thread_time()
    while client.poll() is None:
        await asyncio.sleep(0.05)
    spent = time.thread_time() - started
    print(f"grpc.aio streaming: {spent / (MESSAGES * STREAMS * CALLS) * 1e6:.0f} us of event-loop CPU per message")
    await server.stop(0)


# Unary --------------------------------------------------------------------------------------------

class AsyncAnswerer(pb_grpc.Gpt2ServeServicer):
    async def NextToken(self, request, context):
        return ANSWER


class SyncAnswerer(pb_grpc.Gpt2ServeServicer):
    def NextToken(self, request, context):
        return ANSWER


def serve_builtin() -> None:
    """The built-in server alone, as a front end runs it (uvloop, the server's default idle
    limit), printing its port. Runs against whichever gpt2serve PYTHONPATH names, so the
    policy's module is found where that tree keeps it."""
    import uvloop

    from gpt2serve.config import ServeConfig
    from gpt2serve.transport.grpc_builtin import BuiltinGrpcServer
    from gpt2serve.transport.grpc_calls import UNARY, GrpcApp, GrpcMethod
    try:
        from gpt2serve.transport.h2_stream import ConnectionPolicy
    except ImportError:  # the hand-written stack (before the move to libnghttp2)
        from gpt2serve.transport.h2_frames import ConnectionPolicy

    async def run() -> None:
        method = GrpcMethod(UNARY, AsyncAnswerer().NextToken, pb.NextTokenRequest.FromString,
                            pb.NextTokenResponse.SerializeToString)
        app = GrpcApp({"/gpt2serve.v1.Gpt2Serve/NextToken": method}, 4 << 20)
        policy = ConnectionPolicy(idle_timeout_s=ServeConfig().grpc_max_connection_idle_s)
        server = BuiltinGrpcServer(app, policy, 1024, lambda: None)
        print(await server.listen("127.0.0.1", 0), flush=True)
        await asyncio.Event().wait()
    uvloop.run(run())


def serve(kind: str, port, ready) -> None:
    """A server process (spawned): grpc.aio or the sync server on 8 threads."""
    if kind == "aio":
        async def run() -> None:
            server = grpc.aio.server()
            pb_grpc.add_Gpt2ServeServicer_to_server(AsyncAnswerer(), server)
            port.value = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            ready.set()
            await server.wait_for_termination()
        asyncio.run(run())
    else:
        server = grpc.server(futures.ThreadPoolExecutor(8))
        pb_grpc.add_Gpt2ServeServicer_to_server(SyncAnswerer(), server)
        port.value = server.add_insecure_port("127.0.0.1:0")
        server.start()
        ready.set()
        server.wait_for_termination()


def process_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


PROMPT = [464, 3139, 286, 4881, 318]


def cpu_a_call(pid: int, port: int, seconds: float) -> tuple[float, float]:
    """(calls a second, the server process's CPU µs a call) over `seconds` of h2load."""
    from gpt2serve.benchmarks.native_load import grpc_request_body, run_h2load

    before = process_cpu_s(pid)
    run = run_h2load(f"127.0.0.1:{port}", *grpc_request_body("grpc", PROMPT, 1), 64, 1, seconds, 0.1)
    return run.requests / run.duration_s, (process_cpu_s(pid) - before) / run.requests * 1e6


def unary(kind: str, seconds: float) -> tuple[float, float]:
    """(calls a second, server CPU µs a call) under h2load."""
    if kind == "builtin":
        server, port = start_builtin(None)
    else:
        spawn = multiprocessing.get_context("spawn")
        shared_port, ready = spawn.Value("i", 0), spawn.Event()
        server = spawn.Process(target=serve, args=(kind, shared_port, ready), daemon=True)
        server.start()
        ready.wait(30)
        port = shared_port.value
    try:
        cpu_a_call(server.pid, port, 1.0)  # warm-up
        return cpu_a_call(server.pid, port, seconds)
    finally:
        server.kill()


def start_builtin(tree: Path | None) -> tuple[subprocess.Popen, int]:
    """The built-in server of `tree` (None: this checkout) in its own process, and its port."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = f"{tree / 'server'}:{tree / 'client'}"
    process = subprocess.Popen([sys.executable, __file__, "--serve-builtin"], stdout=subprocess.PIPE, env=env,
                               text=True)
    return process, int(process.stdout.readline())


def against(tree: Path, seconds: float, rounds: int) -> None:
    """This checkout's built-in server and `tree`'s, in turn, a window of `seconds` each."""
    servers = {"now": start_builtin(None), str(tree): start_builtin(tree)}
    try:
        for process, port in servers.values():
            cpu_a_call(process.pid, port, 2.0)  # warm-up
        alternating(list(servers), rounds, lambda name: cpu_a_call(servers[name][0].pid, servers[name][1], seconds)[1],
                    "server CPU a call")
    finally:
        for process, _ in servers.values():
            process.kill()


SERVER_NAMES = {"aio": "grpc.aio", "sync": "grpc sync server, 8 threads", "builtin": "gpt2serve's built-in server"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unary", action="store_true", help="NextToken under h2load, grpc.aio and the sync server")
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--rounds", type=int, default=2, help="--unary: alternating rounds")
    parser.add_argument("--servers", default="aio,sync,builtin", help="--unary: which servers, in turn")
    parser.add_argument("--against", type=Path, help="--unary: compare the built-in server with this checkout's")
    parser.add_argument("--serve-builtin", action="store_true", help=argparse.SUPPRESS)  # start_builtin's child
    args = parser.parse_args()
    if args.serve_builtin:
        serve_builtin()
        return
    if args.against:
        against(args.against, args.seconds, args.rounds)
        return
    if not args.unary:
        asyncio.run(streaming())
        return
    for round_ in range(1, args.rounds + 1):
        for kind in args.servers.split(","):
            rate, us = unary(kind, args.seconds)
            print(f"round {round_}, {SERVER_NAMES[kind]}: {rate:,.0f} calls/s, {us:.0f} us of server CPU a call",
                  flush=True)


if __name__ == "__main__":
    main()
