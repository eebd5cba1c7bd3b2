"""The flood tier: every known HTTP/2 attack (tests/support/h2_attacks.py) against the default
gRPC server, under --workers 1 and --workers 2, while a normal client makes calls.

For each attack, run from one or two raw connections for a few seconds:
- the normal client's calls are all answered, with a p50 under 1 s;
- the attacker is sent GOAWAY (or closed) — no attacking connection is served forever;
- the front ends' memory grows by a bounded amount;
- the server is healthy afterwards.

On the hand-written HTTP/2 stack (139f00f) 12 of these denied every other client (docs/deploy.md).
"""

from __future__ import annotations

import os
import statistics
import threading
import time

import grpc
import pytest

from gpt2serve_client._proto import gpt2serve_pb2 as pb, gpt2serve_pb2_grpc as pb_grpc
from support.h2_attacks import ATTACKS, flood, unread_answers
from support.servers import launch_server

pytestmark = [pytest.mark.flood, pytest.mark.timeout(600)]

SECONDS = 2.0  # each attack's length: long enough for every limit to act, short enough for 30 rounds
RSS_GROWTH_LIMIT = 200 << 20  # the old server grew 500-680 MiB under the worst of these in 10 s


@pytest.fixture(scope="module", params=[1, 2], ids=["workers-1", "workers-2"])
def server(request, tmp_path_factory):
    srv = launch_server(tmp_path_factory.mktemp(f"floods{request.param}"), "--model", "random:tiny",
                        "--workers", str(request.param), "--grpc-max-connections", "48",
                        "--grpc-send-timeout-s", "3")
    yield srv
    srv.stop()


def tree_rss(pid: int) -> int:
    """Resident memory of a process and its children, in bytes."""
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        try:
            with open(f"/proc/{current}/status") as status:
                total += next(int(line.split()[1]) << 10 for line in status if line.startswith("VmRSS:"))
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as children:
                    todo += [int(child) for child in children.read().split()]
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            continue
    return total


class NormalClient:
    """grpcio's client making NextToken calls back to back (5 s deadline, no retries) in a thread."""

    def __init__(self, target: str):
        self.target, self.latencies, self.failures = target, [], []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        with grpc.insecure_channel(self.target, options=[("grpc.enable_retries", 0)]) as channel:
            stub = pb_grpc.Gpt2ServeStub(channel)
            while not self.stop.is_set():
                started = time.monotonic()
                try:
                    stub.NextToken(pb.NextTokenRequest(prompt="a normal call", top_k=1), timeout=5)
                    self.latencies.append(time.monotonic() - started)
                except grpc.RpcError as exc:
                    self.failures.append(exc.code().name)
                time.sleep(0.05)

    def __enter__(self) -> NormalClient:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(15)


def server_workers(server) -> int:
    return int(server.proc.args[server.proc.args.index("--workers") + 1])


def healthy(target: str) -> bool:
    with grpc.insecure_channel(target) as channel:
        answer = pb_grpc.Gpt2ServeStub(channel).NextToken(pb.NextTokenRequest(prompt="after"), timeout=10)
    return bool(answer.token)


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_a_flood_denies_no_other_client_and_its_attacker_is_sent_away(server, attack):
    host, port = server.grpc_target.rsplit(":", 1)
    rss_before = tree_rss(server.proc.pid)
    with NormalClient(server.grpc_target) as normal:
        time.sleep(0.2)
        outcome = flood(host, int(port), attack, SECONDS)
    growth = tree_rss(server.proc.pid) - rss_before
    assert not normal.failures, f"{attack}: normal calls failed: {normal.failures}"
    assert len(normal.latencies) >= 5, f"{attack}: only {len(normal.latencies)} normal calls answered"
    assert statistics.median(normal.latencies) < 1.0, f"{attack}: p50 {statistics.median(normal.latencies):.2f} s"
    assert outcome.sent_away, f"{attack}: the attacker was never sent away ({outcome})"
    assert growth < RSS_GROWTH_LIMIT, f"{attack}: the server grew {growth >> 20} MiB"
    assert healthy(server.grpc_target)


def test_connections_whose_answers_are_never_read_keep_no_client_out(server):
    """More connections than --grpc-max-connections (48), each with one call whose answer it gives
    no window: each newcomer takes the place of one whose calls all wait on a client that does not
    read (sent GOAWAY ENHANCE_YOUR_CALM), or of one with no call yet, and the answers left waiting are reset after
    --grpc-send-timeout-s. A normal client's calls are answered throughout."""
    host, port = server.grpc_target.rsplit(":", 1)
    with NormalClient(server.grpc_target) as normal:
        time.sleep(0.2)  # (two front ends share the port: 60 connections past each one's 48)
        outcome = unread_answers(host, int(port), 60 * server_workers(server), SECONDS + 4)
    assert not normal.failures, normal.failures
    assert len(normal.latencies) >= 5 and statistics.median(normal.latencies) < 1.0, normal.latencies
    assert outcome.goaways, outcome  # newcomers took their places
    assert outcome.resets > 0, outcome  # answers left waiting past --grpc-send-timeout-s
    assert healthy(server.grpc_target)
