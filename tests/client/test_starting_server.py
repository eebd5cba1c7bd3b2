"""Every client waits for a server that is starting, within its deadline: a script that starts
`serve` and calls it at once works. The server here refuses connections for 2 s, then answers
"still loading" for 2 s more (tests/support/slow_start_server.py)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import pytest
from support.servers import ServerProcess, free_ports, metric_value

from gpt2serve.benchmarks.serving_load import fetch_info
from gpt2serve_client import AsyncClient, Client, Gpt2ServeError, RestClient

SLOW_START = str(Path(__file__).parents[1] / "support" / "slow_start_server.py")
LISTEN_DELAY_S, LOAD_DELAY_S = 2.0, 2.0


def start_slowly(tmp_path: Path) -> tuple[ServerProcess, str, str]:
    grpc_port, http_port = free_ports(2)
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen([sys.executable, SLOW_START, str(LISTEN_DELAY_S), str(LOAD_DELAY_S), "serve",
                                 "--host", "127.0.0.1", "--grpc-port", str(grpc_port), "--http-port", str(http_port),
                                 "--model", "random:tiny", "--device", "cpu"],
                                stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return ServerProcess(proc, log_path), f"127.0.0.1:{grpc_port}", f"127.0.0.1:{http_port}"


def cli(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "gpt2serve.cli", *args], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    return out.stdout


async def async_next_token(target: str) -> str:
    async with AsyncClient(target, timeout=60) as client:
        return (await client.next_token("The")).token


def test_every_client_called_at_once_waits_for_the_server(tmp_path):
    server, grpc_target, http_target = start_slowly(tmp_path)
    try:
        calls = {
            "grpc": lambda: Client(grpc_target, timeout=60).next_token("The").token,
            "grpc stream": lambda: Client(grpc_target, timeout=60).generate("The", max_tokens=3).text,
            "grpc async": lambda: asyncio.run(async_next_token(grpc_target)),
            "rest (host:port)": lambda: RestClient(http_target, timeout=60).next_token("The").token,
            "rest stream": lambda: "".join(c.text for c in RestClient(http_target, timeout=60)
                                           .generate_stream("The", max_tokens=3)),
            "cli next": lambda: cli("next", "The", "--target", grpc_target, "--timeout", "60"),
            "bench's model query": lambda: asyncio.run(fetch_info(grpc_target, 60)).model,
        }
        started = time.monotonic()
        with futures.ThreadPoolExecutor(len(calls)) as pool:
            running = {name: pool.submit(call) for name, call in calls.items()}
            answers = {name: f.result(timeout=120) for name, f in running.items()}
        assert all(answers.values()), answers
        assert time.monotonic() - started >= LISTEN_DELAY_S + LOAD_DELAY_S  # they did wait, for both phases
        # While the model loaded, calls were answered UNAVAILABLE ("still loading") and tried again.
        refused = sum(metric_value(f"http://{http_target}", "gpt2serve_requests_total",
                                   {"api": api, "method": method, "status": "UNAVAILABLE"})
                      for api, method in (("grpc", "NextToken"), ("rest", "next_token")))
        assert refused >= 1
    finally:
        server.stop()


@pytest.mark.parametrize("listening, last", [(False, "could not connect"), (True, "still loading")])
def test_a_deadline_the_start_cannot_meet_says_so(tmp_path, listening, last):
    server, grpc_target, http_target = start_slowly(tmp_path)
    try:
        if listening:  # the ports open; the model has LOAD_DELAY_S to go
            server.wait_for_line(r"gpt2serve listening:")
        for client in (Client(grpc_target, timeout=1.0), RestClient(http_target, timeout=1.0)):
            with pytest.raises(Gpt2ServeError) as caught:
                client.next_token("The")
            assert caught.value.code == "UNAVAILABLE"
            assert "did not become ready within 1 s" in caught.value.message
            assert last in caught.value.message
        # A health check reports, it does not wait; nor does a client asked not to.
        began = time.monotonic()
        if listening:
            assert Client(grpc_target, timeout=5.0).health().status == "NOT_SERVING"
        else:
            with pytest.raises(Gpt2ServeError) as refused:
                Client(grpc_target, timeout=5.0, retries=0).health()
            assert refused.value.code == "UNAVAILABLE" and "did not become ready" not in refused.value.message
        assert time.monotonic() - began < 2.0
        began = time.monotonic()
        with pytest.raises(Gpt2ServeError):
            Client(grpc_target, timeout=5.0, wait_for_ready=False, retries=0).next_token("The")
        assert time.monotonic() - began < 1.0
    finally:
        server.stop()
