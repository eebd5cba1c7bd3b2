"""Where a running server's engine process spends its CPU: py-spy samples it (every thread) for a
few seconds while a load the caller started runs, and the samples are summed by thread and by
innermost frame, with the process's CPU over the same window from /proc.

For a card, where the engine's host work is what a served generation at 256 streams waits on
(docs/benchmarks.md); scripts/gpu_check.sh runs it under a 256-stream load when py-spy is there.

    .venv/bin/python bench/host_path/engine_profile.py [--pid PID] [--seconds 5] [--top 25]

Without --pid, the process titled "gpt2serve: engine" (--workers N) or else "gpt2serve:
supervisor" (one process). Needs py-spy and the permission to read another process's memory.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SPY = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
TICKS = os.sysconf("SC_CLK_TCK")


def titled(title: str) -> int | None:
    """The pid of the process whose command line is this title (setproctitle's)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "cmdline").read_bytes().rstrip(b"\0").decode(errors="replace") == title:
                    return int(entry.name)
            except OSError:
                continue
    return None


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def frame(text: str) -> str:
    """'fn (path/to/module.py:12)' -> 'fn (module.py:12)'."""
    name, _, where = text.partition(" (")
    return f"{name} ({where.rsplit('/', 1)[-1]}" if where else name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pid", type=int)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rate", type=int, default=250)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    pid = args.pid or titled("gpt2serve: engine") or titled("gpt2serve: supervisor")
    if pid is None:
        sys.exit("no gpt2serve engine process found: pass --pid")
    with tempfile.TemporaryDirectory() as tmp:
        before, started = cpu_seconds(pid), time.perf_counter()
        subprocess.run([SPY, "record", "--pid", str(pid), "--duration", str(max(int(args.seconds), 1)),
                        "--rate", str(args.rate), "--threads", "--nonblocking", "--format", "raw",
                        "-o", f"{tmp}/raw.txt"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        cpu, wall = cpu_seconds(pid) - before, time.perf_counter() - started
        lines = Path(f"{tmp}/raw.txt").read_text().splitlines()
    threads, leaves = collections.Counter(), collections.Counter()
    for line in lines:
        stack, count = line.rsplit(" ", 1)  # thread;outermost;...;innermost count
        frames = stack.split(";")
        thread = frames[0].split(": ", 1)[-1]  # 'thread (787): engine_0' -> 'engine_0'
        threads[thread] += int(count)
        leaves[(thread, frame(frames[-1]))] += int(count)
    total = sum(threads.values()) or 1
    print(f"engine process {pid}: {cpu / wall:.2f} cores over {wall:.1f} s; {total} samples at {args.rate} Hz "
          f"(py-spy counts a thread blocked in C, a poll or a lock, as busy unless it can tell)")
    print("\n| thread | share of samples |\n|---|---|")
    for thread, n in threads.most_common():
        print(f"| {thread} | {n / total:.1%} |")
    print("\n| thread | innermost frame | share |\n|---|---|---|")
    for (thread, where), n in leaves.most_common(args.top):
        print(f"| {thread} | `{where}` | {n / total:.1%} |")


if __name__ == "__main__":
    main()
