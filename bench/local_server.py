"""Start a `gpt2serve serve` on loopback for a bench script, on ephemeral ports, and read its
processes' memory. Scripts in bench/'s folders import it with bench/ on their path."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def launch(model: str, env: dict[str, str] | None = None, *extra: str) -> tuple[subprocess.Popen, str, str]:
    """(process, gRPC host:port, REST base URL) once the server says it is ready."""
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpt2serve.cli", "serve", "--model", model, "--host", "127.0.0.1",
         "--grpc-port", "0", "--http-port", "0", *extra],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)  # no signal of the bench's group
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            text = open(log.name).read()
            if "gpt2serve ready" in text:
                return proc, re.search(r"grpc=(\S+)", text).group(1), re.search(r"http=(\S+)", text).group(1)
            if proc.poll() is not None:
                raise RuntimeError(text)
            time.sleep(0.2)
        raise TimeoutError(open(log.name).read())
    finally:
        os.unlink(log.name)  # The server still writes to it; it goes with the server's exit, not left in /tmp.


def rss_mib(pid: int) -> float:
    """Resident memory of one process."""
    with open(f"/proc/{pid}/status") as status:
        return int(re.search(r"VmRSS:\s+(\d+)", status.read()).group(1)) / 1024


def family(pid: int) -> list[int]:
    """The process and all its descendants."""
    found, queue = [], [pid]
    while queue:
        current = queue.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").iterdir():
            queue += [int(c) for c in (task / "children").read_text().split()]
    return found
