"""The servers the host-path benches drive: one started elsewhere (`RunningServer`, --target), or
bench/host_path/standin_server.py started here (`StandinServer`), this checkout's or another's;
and what is read of them: their processes and their /metrics. `alternating` compares two of them."""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Callable


def server_processes(root: int) -> dict[str, int]:
    """Name (its process title) -> pid, for the supervisor and its children."""
    found = {"supervisor": root}
    for child in Path(f"/proc/{root}/task/{root}/children").read_text().split():
        title = Path(f"/proc/{child}/cmdline").read_text().replace("\0", " ").strip()
        name = title.removeprefix("gpt2serve: ") if title.startswith("gpt2serve: ") else None
        if name:
            found[name] = int(child)
    return found


def metric_sum(text: str, name: str, label: str = "") -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


class RunningServer:
    """A server started elsewhere (--target): its rates, and its CPU when its pid is known."""

    phases_dir: str | None = None  # the stand-in's engine reports its phases there (--phases)

    def __init__(self, grpc: str, http: str, pid: int | None):
        self.grpc, self.http = grpc, http
        self.processes = server_processes(pid) if pid else {}

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.http}/metrics", timeout=10) as response:
            return response.read().decode()

    def stop(self) -> None:
        pass


class StandinServer(RunningServer):
    """bench/host_path/standin_server.py started here, on ephemeral ports, stopped by stop()."""

    def __init__(self, workers: int, max_batch: int, extra_args: tuple[str, ...] = (), phases_dir: str | None = None,
                 extra_env: dict[str, str] | None = None, tree: Path | None = None):
        """`tree`: another checkout (e.g. a `git worktree` of an older commit), whose stand-in and
        server run instead of this one's."""
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self.phases_dir = phases_dir
        env = {**os.environ, **(extra_env or {})}
        if phases_dir:
            env["STANDIN_PHASES"] = phases_dir
        script = Path(__file__).with_name("standin_server.py")
        if tree is not None:
            script = tree / "bench" / "host_path" / "standin_server.py"
            env["PYTHONPATH"] = f"{tree / 'server'}:{tree / 'client'}"
        self.proc = subprocess.Popen(
            [sys.executable, str(script), "serve", "--model", "random:gpt2",
             "--device", "cpu", "--workers", str(workers), "--max-batch-size", str(max_batch),
             "--max-running-sequences", str(max_batch), "--max-queue", "4096", "--prefix-cache-mb", "0",
             "--host", "127.0.0.1", "--grpc-port", "0", "--http-port", "0", *extra_args],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
            env=env)
        deadline = time.monotonic() + 300
        try:
            while "gpt2serve ready" not in (text := Path(self.log.name).read_text()):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(text)
                time.sleep(0.2)
        finally:
            os.unlink(self.log.name)  # The server still writes to it; it goes with the server, not left in /tmp.
        self.engine_address = re.search(r"engine ready at (\S+)", text).group(1)
        self.grpc = re.search(r"grpc=(\S+)", text).group(1)
        self.http = re.search(r"http=(\S+)", text).group(1)
        self.processes = server_processes(self.proc.pid)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def alternating(names: list[str], rounds: int, measure: Callable[[str], float], what: str) -> dict[str, float]:
    """`measure(name)` for each of two servers in turn, `rounds` times, the order flipped each
    round so neither always goes first (a shared machine's drift falls on both). Prints each
    round, then `what`'s medians and their ratio (the first over the second); returns the medians."""
    costs: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(1, rounds + 1):
        for name in names if round_ % 2 else list(reversed(names)):
            costs[name].append(measure(name))
        print(f"{what}, round {round_}: " + ", ".join(f"{name} {costs[name][-1]:.1f} us" for name in names), flush=True)
    medians = {name: statistics.median(values) for name, values in costs.items()}
    first, second = names
    print(f"{what}, median of {rounds} rounds: {first} {medians[first]:.1f} us, {second} {medians[second]:.1f} us: "
          f"ratio {medians[first] / medians[second]:.3f}", flush=True)
    return medians
