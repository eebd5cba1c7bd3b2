"""A real gpt2serve process on ephemeral ports for a test, and reading its /metrics."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

STARTUP_TIMEOUT_S = 120


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    log_path: Path
    grpc_target: str = ""
    http_url: str = ""

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_line(self, pattern: str, timeout: float = STARTUP_TIMEOUT_S) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = re.search(pattern, self.log())
            if match:
                return match
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.02)
        raise TimeoutError(f"no {pattern!r} within {timeout}s:\n{self.log()}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def pinned_device(args) -> list[str]:
    """Servers under test run fp32 on the CPU unless a test says otherwise: their answers are
    compared with the fp32 CPU reference at 1e-4, and on a GPU machine `auto` would mean cuda
    and bf16. The GPU tests (test_gpu.py) ask for cuda explicitly. Their KV cache is 512 MiB
    (about 7 GPT-2 small sequences of full context) unless a test sets it."""
    pinned = []
    if "--device" not in args:
        pinned += ["--device", "cpu"]
    if "--dtype" not in args:
        pinned += ["--dtype", "float32"]
    if "--kv-cache-mb" not in args:  # claimed before ready: tests need a little, not 25% of RAM each
        pinned += ["--kv-cache-mb", "512"]
    return pinned


def launch_server(tmp_dir: Path, *args: str, env: dict[str, str] | None = None, wait_ready: bool = True,
                  entry: tuple[str, ...] = ("-m", "gpt2serve.cli")) -> ServerProcess:
    """Start `gpt2serve serve` on loopback with ephemeral ports; returns once it listens (or is ready).
    `entry`: what python runs instead of the CLI module (a script that wraps it, e.g. fault injection)."""
    log_path = tmp_dir / f"server-{time.monotonic_ns()}.log"
    command = [sys.executable, *entry, "serve", "--host", "127.0.0.1",
               "--grpc-port", "0", "--http-port", "0", *pinned_device(args), *args]
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    server = ServerProcess(proc, log_path)
    match = server.wait_for_line(r"gpt2serve listening: grpc=([^\s\"]+) http=([^\s\"]+)")  # text or JSON logs
    server.grpc_target, server.http_url = match.group(1), match.group(2)
    if wait_ready:
        server.wait_for_line(r"gpt2serve ready:")
    return server


def pids(server: ServerProcess, role: str) -> list[int]:
    """Process ids from the children's log lines ("front-end[123] ..." / "engine[123] ...")."""
    return sorted({int(p) for p in re.findall(rf"\b{role}\[(\d+)\]", server.log())})


def free_ports(count: int = 1, host: str = "127.0.0.1") -> list[int]:
    """Ports free on `host` now, all different (held open together while they are picked)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def wait_for(predicate, timeout: float = 30.0, what: str = "", interval: float = 0.25):
    """The predicate's first truthy value, polled every `interval` seconds; TimeoutError after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(what)


async def until(predicate, timeout: float = 60.0, what: str = "", interval: float = 0.02):
    """wait_for inside an event loop: the loop runs (the caller's requests go out) while it polls."""
    import asyncio

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        await asyncio.sleep(interval)
    raise TimeoutError(what)


def metric_value(http_url: str, name: str, labels: dict[str, str] | None = None, **get_kwargs) -> float:
    """One sample from the server's /metrics, 0.0 when absent (a counter not yet touched)."""
    text = httpx.get(f"{http_url}/metrics", timeout=10, **get_kwargs).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == (labels or {}):
                return sample.value
    return 0.0


def requests_total(http_url: str, api: str, method: str, status: str, **get_kwargs) -> float:
    return metric_value(http_url, "gpt2serve_requests_total", {"api": api, "method": method, "status": status},
                        **get_kwargs)


def mapped_files(pid: int) -> set[str]:
    with open(f"/proc/{pid}/maps") as maps:
        return {line.split()[-1] for line in maps if "/" in line}


def openai_client(http_url: str):
    """The official `openai` SDK's client for a server's REST base URL: no key needed, and no
    retries, so a test sees each answer the server gave."""
    import openai  # here: most users of this module never need the SDK, slow to import

    return openai.OpenAI(base_url=f"{http_url}/v1", api_key="unused", max_retries=0)
