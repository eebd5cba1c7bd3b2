"""Where a lone next-token call's time goes, hop by hop, over the stand-in device (issue 45's
one-client item: the server's overhead over the forward).

It starts the stand-in server (`standin_server.py`, `--workers N`) with STANDIN_TIMELINE set:
every server process then writes a wall-clock mark (time.monotonic_ns, one clock for all
processes) at each hop of a unary `NextToken`: the gRPC handler's start, the prompt checked, the
engine client called, the IPC frame written; in the engine, the frame read, the calls queued,
the core's loop awake, the step's start and end, the answers handed to the IPC thread and
written; back in the front end, the frame read and dispatched, the engine client's return, the
request's telemetry finished, the result and its protobuf built, the handler's end. One gRPC
client then calls NextToken in a closed loop (a 5-token prompt, top 5), and the table gives each
hop's median and 90th percentile over the calls, and the time from one call's end in the
handler to the next one's start (gRPC's answer path, the client, gRPC's request path).

Each mark is two clock reads and a line into a 64 KiB buffer, written out once it fills (every
few hundred calls: in one call's hop, which moves the 90th percentile, not the median); the
last buffer of each process is lost when the server stops. Beside each hop's wall time, its
thread's CPU time where both marks came from one thread: near the wall time, the hop is work;
far below it, the thread waited (for a core, the GIL or another thread).

    .venv/bin/python bench/host_path/call_timeline.py [--seconds 6] [--workers 2]
"""

from __future__ import annotations

import argparse
import functools
import inspect
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

HOPS = [  # (owner module, class or None, function, mark at entry, mark at return), in a call's order
    ("gpt2serve.transport.grpc_server", "Gpt2ServeServicer", "NextToken", "handler start", "handler end"),
    ("gpt2serve.service.validation", "Validator", "prompt", None, "prompt checked"),
    ("gpt2serve.ipc.socket_client", "SocketEngineClient", "next_token", "engine client called", "engine client back"),
    ("gpt2serve.ipc.socket_client", "SocketEngineClient", "_send", "frame written", None),
    ("gpt2serve.ipc.engine_server", "EngineServer", "_receive", "engine: frame read", None),
    ("gpt2serve.scheduling.core", "EngineCore", "queue_calls", None, "engine: calls queued"),
    ("gpt2serve.scheduling.core", "EngineCore", "_iteration", "engine: core loop awake", None),
    # the model runner the engine host builds: the stand-in's (standin_server sets it first); a
    # lone call's batch is a step of its own, launched and read at once
    ("gpt2serve.launch.engine_host", "Generator", "launch", "engine: step start", None),
    ("gpt2serve.launch.engine_host", "Generator", "finish", None, "engine: step end"),
    ("gpt2serve.ipc.engine_server", "EngineServer", "call_soon_threadsafe", "engine: answers handed over", None),
    ("gpt2serve.ipc.engine_server", "EngineServer", "_write", "engine: frame written", None),
    ("gpt2serve.ipc.socket_client", "SocketEngineClient", "data_received", "frame read", "frame dispatched"),
    ("gpt2serve.telemetry.spans", "RequestTelemetry", "finish", None, "telemetry finished"),
    ("gpt2serve.service.next_token", None, "build_result", None, "result built"),
    ("gpt2serve_client.types", "NextTokenResult", "to_proto", None, "protobuf built"),
]
ORDER = ["handler start", "prompt checked", "engine client called", "frame written", "engine: frame read",
         "engine: calls queued", "engine: core loop awake", "engine: step start", "engine: step end",
         "engine: answers handed over", "engine: frame written", "frame read", "frame dispatched",
         "engine client back", "telemetry finished", "result built", "protobuf built", "handler end"]


def install(directory: str) -> None:
    """Wrap every hop in this server process (standin_server.py calls this under STANDIN_TIMELINE)."""
    import importlib

    out = open(Path(directory) / f"marks.{os.getpid()}", "a", buffering=1 << 16)  # written a few times a second

    def mark(name: str) -> None:
        out.write(f"{time.monotonic_ns()} {time.thread_time_ns()} {threading.get_ident()} {name}\n")

    for module_name, class_name, function, at_entry, at_return in HOPS:
        module = importlib.import_module(module_name)
        owner = getattr(module, class_name) if class_name else module
        real = getattr(owner, function)
        if inspect.iscoroutinefunction(real):
            async def wrapped(*args, _real=real, _entry=at_entry, _return=at_return, **kwargs):
                if _entry:
                    mark(_entry)
                result = await _real(*args, **kwargs)
                if _return:
                    mark(_return)
                return result
        else:
            def wrapped(*args, _real=real, _entry=at_entry, _return=at_return, **kwargs):
                if _entry:
                    mark(_entry)
                result = _real(*args, **kwargs)
                if _return:
                    mark(_return)
                return result
        setattr(owner, function, functools.wraps(real)(wrapped))


Mark = tuple[int, int, str]  # (wall ns, the thread's CPU ns, the thread: process file and thread id)


def calls(directory: Path) -> list[dict[str, Mark]]:
    """Each call's marks: from one `handler start` to the next, the first of each mark in ORDER
    at or after the one before it (the core's loop wakes for other reasons too)."""
    lines = [(f.name, line.split(" ", 3)) for f in directory.glob("marks.*") for line in f.read_text().splitlines()]
    marks = sorted((int(fields[0]), int(fields[1]), f"{name}/{fields[2]}", fields[3]) for name, fields in lines
                   if len(fields) == 4 and fields[3] in ORDER)  # a process's last line may be cut short at exit
    found, current = [], None
    for wall, cpu, thread, name in marks:
        if name == ORDER[0]:
            current = []
            found.append(current)
        if current is not None:
            current.append((wall, cpu, thread, name))
    timelines = []
    for events in found:
        timeline, last = {}, events[0][0]
        for name in ORDER:
            mark = next(((w, c, th) for w, c, th, n in events if n == name and w >= last), None)
            if mark is None:
                break
            timeline[name] = mark
            last = mark[0]
        else:
            timelines.append(timeline)
    return timelines


def table(timelines: list[dict[str, Mark]]) -> str:
    """A hop's wall time, and where both its marks came from one thread, that thread's CPU time
    over it (much less CPU than wall: the thread waited for a core, the GIL or another thread)."""
    def p50_p90(values: list[float]) -> str:
        values = sorted(values)
        return f"{statistics.median(values):.0f} | {values[int(0.9 * (len(values) - 1))]:.0f}"

    def row(label: str, before: str, after: str) -> str:
        wall = [(t[after][0] - t[before][0]) / 1e3 for t in timelines]
        one_thread = [t for t in timelines if t[after][2] == t[before][2]]
        cpu = (f"{statistics.median((t[after][1] - t[before][1]) / 1e3 for t in one_thread):.0f}"
               if len(one_thread) > len(timelines) / 2 else "")
        return f"| {label} | {p50_p90(wall)} | {cpu} |"

    lines = [f"{len(timelines)} calls", "| hop | p50 µs | p90 µs | the thread's CPU, p50 µs |", "|---|---|---|---|"]
    for before, after in zip(ORDER, ORDER[1:]):
        lines.append(row(f"{before} -> {after}", before, after))
    lines.append(row("**handler start -> handler end**", ORDER[0], ORDER[-1]))
    lines.append(row("of which the step (its start -> end)", "engine: step start", "engine: step end"))
    gaps = [(b[ORDER[0]][0] - a[ORDER[-1]][0]) / 1e3 for a, b in zip(timelines, timelines[1:])]
    lines.append(f"| handler end -> the next call's handler start (gRPC both ways, the client) | {p50_p90(gaps)} | |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from gpt2serve_client import Client
    from servers import StandinServer

    with tempfile.TemporaryDirectory() as directory:
        server = StandinServer(args.workers, 256, extra_env={"STANDIN_TIMELINE": directory})
        try:
            with Client(server.grpc) as client:
                for _ in range(20):  # warm: the first calls of a connection are not a lone call's steady cost
                    client.next_token([464, 2068, 7586, 21831, 18045], top_k=5)
                for f in Path(directory).glob("marks.*"):
                    f.write_text("")  # the warm-up's marks go; the files stay open in the server
                stop_at = time.monotonic() + args.seconds
                while time.monotonic() < stop_at:
                    client.next_token([464, 2068, 7586, 21831, 18045], top_k=5)
        finally:
            server.stop()
        timelines = calls(Path(directory))
    if not timelines:
        print("no call left every mark", file=sys.stderr)
        return 1
    print(f"a lone NextToken over the stand-in device (--workers {args.workers}), {args.seconds:.0f} s")
    print(table(timelines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
