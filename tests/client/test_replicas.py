"""Several replicas behind one DNS name, on loopback: real server processes on 127.0.0.2-5, a real
DNS server answering for the name (what a Kubernetes headless Service is), and the typed client
with a `dns:` target in its own process (replica_load.py). Round-robin spreads the calls; a
rolling update (a new replica in, an old one drained out) loses none; traffic stays on 127/8."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.servers import free_ports, launch_server, requests_total
from support.dns_server import LoopbackDns
from support.held_streams import HeldGenerations

pytestmark = pytest.mark.slow

NAME = "replicas.gpt2serve.test"
LOAD = Path(__file__).resolve().parents[1] / "support" / "replica_load.py"


def start_replica(tmp_path: Path, address: str, grpc_port: int, *args: str):
    return launch_server(tmp_path, "--model", "random:tiny", "--host", address, "--grpc-port", str(grpc_port),
                         "--http-port", "0", *args)


def served(replica) -> float:
    return requests_total(replica.http_url, "grpc", "NextToken", "OK")


def run_load(target: str, calls: int, interval_s: float, balancing: str | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(LOAD), target, str(calls), str(interval_s), *([balancing] if balancing else [])],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result(load: subprocess.Popen, timeout: float = 120) -> dict:
    out, err = load.communicate(timeout=timeout)
    assert load.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture
def dns():
    with LoopbackDns() as server:
        yield server


def test_round_robin_spreads_calls_over_three_replicas(tmp_path, dns):
    (grpc_port,) = free_ports(1, "127.0.0.2")
    replicas = [start_replica(tmp_path, f"127.0.0.{i}", grpc_port) for i in (2, 3, 4)]
    try:
        dns.set(NAME, ["127.0.0.2", "127.0.0.3", "127.0.0.4"])
        outcome = result(run_load(dns.target(NAME, grpc_port), 90, 0.0))
        assert outcome == {"ok": 90, "errors": []}
        counts = [served(r) for r in replicas]
        assert sum(counts) == 90
        assert all(15 <= c <= 45 for c in counts), counts  # within ±50% of even
        # gRPC's default, pick_first, sends every call to one replica: what round_robin fixes.
        outcome = result(run_load(dns.target(NAME, grpc_port), 30, 0.0, "pick_first"))
        assert outcome == {"ok": 30, "errors": []}
        added = sorted(served(r) - c for r, c in zip(replicas, counts))
        assert added == [0, 0, 30]
    finally:
        for replica in replicas:
            replica.stop()


def test_rolling_update_under_load_loses_nothing(tmp_path, dns):
    """Steady load over A, B, C. Then D starts and turns ready, the name now gives B, C, D, and A
    gets SIGTERM while a long generation keeps it draining for seconds, its connections still
    open. Every call is answered: the clients' health checks see A NOT_SERVING and send it
    nothing new. D takes traffic once clients re-resolve (connections age out after 2 s)."""
    (grpc_port,) = free_ports(1, "127.0.0.2")
    flags = ("--grpc-max-connection-age-s", "2", "--shutdown-grace-s", "6", "--model", "random:gpt2")
    a, b, c = (start_replica(tmp_path, f"127.0.0.{i}", grpc_port, *flags) for i in (2, 3, 4))
    replicas = [a, b, c]
    holder = None
    try:
        dns.set(NAME, ["127.0.0.2", "127.0.0.3", "127.0.0.4"])
        calls = 400
        load = run_load(dns.target(NAME, grpc_port), calls, 0.03)
        d = start_replica(tmp_path, "127.0.0.5", grpc_port, *flags)
        replicas.append(d)
        holder = HeldGenerations(a.grpc_target, running=1)  # A drains until its grace ends
        assert served(a) > 0  # A took its share before it left
        # SIGTERM while the name still gives A (in a cluster, the endpoint update races the
        # signal): for seconds A is connected, draining, and refusing new calls.
        a.proc.send_signal(signal.SIGTERM)
        a.wait_for_line(r"shutting down: [1-9]\d* request\(s\) in flight", timeout=10)
        time.sleep(2)
        dns.set(NAME, ["127.0.0.3", "127.0.0.4", "127.0.0.5"])
        outcome = result(load)
        assert outcome == {"ok": calls, "errors": []}
        assert served(d) > 0, "the new replica never got a call"
        assert a.proc.wait(timeout=30) == 0
    finally:
        if holder is not None:
            holder.close()
        for replica in replicas:
            replica.stop()


def test_connection_age_brings_long_lived_clients_to_a_new_replica(tmp_path, dns):
    """Scale-out with nothing leaving: no connection would ever close, so a client would never
    look the name up again. --grpc-max-connection-age-s closes them on a schedule (GOAWAY),
    the client re-resolves, and the replica added to the name gets calls."""
    (grpc_port,) = free_ports(1, "127.0.0.2")
    age = ("--grpc-max-connection-age-s", "1")
    a, b, c = (start_replica(tmp_path, f"127.0.0.{i}", grpc_port, *age) for i in (2, 3, 4))
    try:
        dns.set(NAME, ["127.0.0.2", "127.0.0.3"])
        load = run_load(dns.target(NAME, grpc_port), 300, 0.03)
        deadline = time.monotonic() + 20
        while served(a) + served(b) < 20 and time.monotonic() < deadline:  # connected to A and B
            time.sleep(0.1)
        dns.set(NAME, ["127.0.0.2", "127.0.0.3", "127.0.0.4"])
        assert result(load) == {"ok": 300, "errors": []}
        assert served(c) > 0, "the added replica never got a call"
        assert served(a) + served(b) + served(c) == 300
    finally:
        for replica in (a, b, c):
            replica.stop()
