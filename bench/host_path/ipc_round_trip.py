"""One message there and back at a time between two processes, as a lone caller's request and
answer cross the IPC door: over zmq (a DEALER on the caller's uvloop, read from the loop's own
reader; a ROUTER on a thread with zmq's poller, as the door was before) against a plain Unix
socket (an asyncio protocol on uvloop; a thread with epoll, as ipc.engine_server is now, both with ipc.framing's frames).
Prints each side's CPU a round trip and the round trip's latency.

    .venv/bin/python bench/host_path/ipc_round_trip.py [--rounds 3] [--trips 3000]

zmq is LitServe's dependency (the dev extra), not the server's: it is here as the reference.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import select
import socket
import tempfile
import time

import uvloop
import zmq

from gpt2serve.ipc.framing import LENGTH, FrameReader

PAYLOAD = b"x" * 120  # about a plain Prompts message of one call


def zmq_server(path: str, report) -> None:
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.bind("ipc://" + path)
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    report.put("listening")
    started = time.process_time()
    while True:
        poller.poll()
        while router.get(zmq.EVENTS) & zmq.POLLIN:
            peer, frame = router.recv_multipart(zmq.NOBLOCK)
            if frame == b"stop":
                return report.put(time.process_time() - started)
            router.send_multipart([peer, frame])


def socket_server(path: str, report) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()
    report.put("listening")
    conn, _ = listener.accept()
    conn.setblocking(False)
    epoll = select.epoll()
    epoll.register(conn.fileno(), select.EPOLLIN)
    reader = FrameReader()
    started = time.process_time()
    while True:
        epoll.poll()
        for frame in reader.feed(conn.recv(1 << 18)):
            if frame == b"stop":
                return report.put(time.process_time() - started)
            conn.sendmsg((LENGTH.pack(len(frame)), frame))


async def zmq_caller(path: str, trips: int) -> tuple[float, list[float]]:
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect("ipc://" + path)
    loop = asyncio.get_running_loop()
    waiting: list[asyncio.Future] = []

    def receive() -> None:  # the descriptor is edge-triggered: read all, after every send too
        while dealer.get(zmq.EVENTS) & zmq.POLLIN:
            dealer.recv(zmq.NOBLOCK)
            waiting.pop().set_result(None)

    loop.add_reader(dealer.getsockopt(zmq.FD), receive)
    latencies = []
    started = time.process_time()
    for _ in range(trips):
        answered = loop.create_future()
        waiting.append(answered)
        sent = time.perf_counter()
        dealer.send(PAYLOAD, zmq.NOBLOCK)
        receive()
        await answered
        latencies.append(time.perf_counter() - sent)
    cpu = time.process_time() - started
    loop.remove_reader(dealer.getsockopt(zmq.FD))
    dealer.send(b"stop")
    dealer.close(1000)
    context.term()
    return cpu, latencies


class _Caller(asyncio.Protocol):
    def __init__(self):
        self.reader, self.waiting = FrameReader(), None

    def data_received(self, data: bytes) -> None:
        for _ in self.reader.feed(data):
            self.waiting.set_result(None)


async def socket_caller(path: str, trips: int) -> tuple[float, list[float]]:
    loop = asyncio.get_running_loop()
    transport, caller = await loop.create_unix_connection(_Caller, path)
    latencies = []
    started = time.process_time()
    for _ in range(trips):
        caller.waiting = loop.create_future()
        sent = time.perf_counter()
        transport.writelines((LENGTH.pack(len(PAYLOAD)), PAYLOAD))
        await caller.waiting
        latencies.append(time.perf_counter() - sent)
    cpu = time.process_time() - started
    transport.writelines((LENGTH.pack(4), b"stop"))
    await asyncio.sleep(0.05)
    transport.close()
    return cpu, latencies


def one_run(kind: str, trips: int) -> dict:
    path = os.path.join(tempfile.mkdtemp(prefix="ipc-trip-"), "door.sock")
    report = mp.Queue()
    server = mp.Process(target=zmq_server if kind == "zmq" else socket_server, args=(path, report))
    server.start()
    report.get()
    caller_cpu, latencies = uvloop.run((zmq_caller if kind == "zmq" else socket_caller)(path, trips))
    server_cpu = report.get(timeout=30)
    server.join()
    latencies.sort()
    return {"kind": kind, "caller_us": caller_cpu / trips * 1e6, "server_us": server_cpu / trips * 1e6,
            "p50_us": latencies[len(latencies) // 2] * 1e6, "p90_us": latencies[len(latencies) * 9 // 10] * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trips", type=int, default=3000)
    args = parser.parse_args()
    for _ in range(args.rounds):  # alternating, so a noisy machine's drift hits both
        for kind in ("zmq", "socket"):
            r = one_run(kind, args.trips)
            print(f"{kind:6s}: caller {r['caller_us']:5.1f} us CPU, door {r['server_us']:5.1f} us CPU a round trip; "
                  f"latency p50 {r['p50_us']:.0f} us, p90 {r['p90_us']:.0f} us", flush=True)


if __name__ == "__main__":
    main()
