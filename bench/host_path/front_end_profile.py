"""Where a front end's CPU goes, per kind of call: py-spy samples both front ends of a stand-in
server (bench/host_path/standin_server.py, --workers 2: the real front ends, IPC and engine host path, the
device's work replaced by its measured times) while one load runs, and the samples are grouped
by the layer whose code is running (the innermost frame that belongs to a known layer).

Loads, one at a time, each from 2 client processes on the same machine:
- unary: 64 closed-loop gRPC NextToken callers (bench/host_path/host_path.py --clients 64);
- rest: 64 closed-loop REST /v1/next-token callers (gpt2serve.benchmarks.serving_load);
- batch: 4 NextTokenBatch callers of 64 prompts (bench/host_path/host_path.py --batch-clients 4);
- stream: 64 Generate streams of 64 tokens (--stream-tokens) (bench/host_path/host_path.py --streams 64);
- sse: 64 OpenAI completions streams of 64 tokens (--stream-tokens) (`"stream": true`, server-sent events), from
  wrk always (one thread), which reads each answer as it comes.
With `--native`, unary, rest and batch come from h2load and wrk instead (one thread, a few
percent of a core), so the front ends are not sharing the cores with Python clients.

    .venv/bin/python bench/host_path/front_end_profile.py [--loads unary,rest,batch,stream,sse] [--seconds 16] \
        [--native]
        [--stream-interval N] [--stream-tokens 64] [--top N] [--save DIR] [--server-args "FLAGS"]
    .venv/bin/python bench/host_path/front_end_profile.py --against /tmp/old --loads unary,rest,stream [--rounds 4]

Prints, per load, the share of the front ends' samples in each layer, and their CPU per unit
(a call, a prompt or a streamed token) from /proc and the server's /metrics.
`--against TREE [--rounds N]`: no sampling; this checkout's stand-in server and another
checkout's (e.g. a `git worktree` of an older commit) both run, and each load is put on them in
turn, N rounds, so a shared machine's drift falls on both; prints each round, the medians and
their ratio. Needs py-spy
(`.venv/bin/pip install py-spy`) and the permission to read another process's memory.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from servers import StandinServer, alternating, metric_sum  # noqa: E402
from ipc_load import process_cpu_split  # noqa: E402

PYTHON = sys.executable
SPY = shutil.which("py-spy") or str(Path(PYTHON).parent / "py-spy")

# Layer -> path fragments of its code, checked innermost frame first; the first match names the
# sample. Order matters only where fragments overlap.
LAYERS = [
    # grpc/ holds grpc/_server.py and grpc/aio/_server.py; a bare "_server.py" would also take our grpc_server.py.
    ("gRPC library (grpc.aio, C core)", ("grpc/", "grpc_aio", "cygrpc")),
    ("protobuf messages", ("google/protobuf", "_pb2", "to_proto", "from_proto")),
    ("HTTP (uvicorn, h11/httptools, starlette, fastapi)", ("uvicorn/", "h11/", "httptools", "starlette/",
                                                           "fastapi/", "pydantic")),
    ("IPC (zmq, msgpack, the codec)", ("zmq/", "msgpack", "gpt2serve/ipc/")),
    ("telemetry (spans, metrics, OpenTelemetry, prometheus)", ("opentelemetry", "prometheus_client",
                                                              "gpt2serve/telemetry/")),
    ("tokenizer and detokenizer", ("tokenizer", "detokenizer")),
    ("service (validation, answers, streams)", ("gpt2serve/service/",)),
    ("transports' own code (gpt2serve/transport)", ("gpt2serve/transport/",)),
    ("asyncio's own bookkeeping and epoll", ("asyncio/", "selectors.py")),
]


def layer_of(stack: list[str]) -> str:
    # Without --native, compiled code shows as the Python frame that called it: a callback the
    # loop runs (Handle._run's own time) is grpc.aio's Cython or pyzmq's, and a thread whose only
    # frame is Thread.run is a library's own (grpc's poller).
    innermost = stack[-1]
    if innermost.startswith("Handle._run "):
        return "compiled callbacks the loop runs (grpc.aio's Cython, pyzmq)"
    if innermost.startswith("Thread.run "):
        return "a library's own thread (grpc's poller)"
    for frame in reversed(stack):
        for name, fragments in LAYERS:
            if any(f in frame for f in fragments):
                return name
    return "other"


NATIVE = {  # --native: the same loads from h2load and wrk (gpt2serve.benchmarks.native_load)
    "unary": "run_h2load(host_port({grpc!r}), *grpc_request_body('grpc', PROMPT, 1), 64, 1, {seconds}, 1)",
    "batch": "run_h2load(host_port({grpc!r}), *grpc_request_body('grpc-batch', PROMPT, 64), 4, 1, {seconds}, 1)",
    "rest": "run_wrk({http!r}, [PROMPT], 64, 1, {seconds}, 1)",
    "sse": "run_wrk({http!r}, [PROMPT], 64, 1, {seconds}, 1, '/v1/completions', lambda p: dict(model='random:gpt2', "
           "prompt=p, max_tokens={tokens}, stream=True, ignore_eos=True, temperature=0))",
}
NATIVE_ONLY = {"sse"}


def load_command(load: str, server, seconds: float, native: bool = False, tokens: int = 64) -> list[str]:
    """The load's client processes (none of them loads a model, so the load starts at once)."""
    if (native or load in NATIVE_ONLY) and load in NATIVE:
        call = NATIVE[load].format(grpc=server.grpc, http=server.http, seconds=seconds - 1, tokens=tokens)
        return [PYTHON, "-c", "from gpt2serve.benchmarks.native_load import grpc_request_body, host_port, "
                f"run_h2load, run_wrk; PROMPT = [464, 3139, 286, 4881, 318]; {call}"]
    if load == "rest":
        return [PYTHON, "-c", "from gpt2serve.benchmarks.serving_load import load_from_processes, make_prompts; "
                f"load_from_processes('rest', {server.http!r}, make_prompts(256, 5, 50257, 0), 64, {seconds}, 1, 2)"]
    common = [PYTHON, str(HERE / "host_path.py"), "--target", server.grpc, "--http-target", server.http,
              "--duration", str(seconds), "--streams", "", "--clients", "", "--batch-clients", "0",
              "--new-tokens", str(tokens)]
    extra = {"unary": ["--clients", "64"], "batch": ["--batch-clients", "4"], "stream": ["--streams", "64"]}[load]
    return [*common, *extra]  # the later flag wins


# What a unit of work is, per load, counted from the server's /metrics.
UNITS = {
    "unary": ("a call", "gpt2serve_requests_total", 'method="NextToken"', 1),
    "rest": ("a call", "gpt2serve_requests_total", 'method="NextToken"', 1),
    "batch": ("a prompt", "gpt2serve_requests_total", 'method="NextTokenBatch"', 64),
    "stream": ("a token", "gpt2serve_generated_tokens_total", "", 1),
    "sse": ("a token", "gpt2serve_generated_tokens_total", "", 1),
}


def load_started(server, name: str, labels: str, timeout_s: float = 30.0) -> None:
    """Wait until the load's units start to count: its client processes take a few seconds to
    start (a stream load longer than a unary one), and a window opened before them measured
    nothing (a unit count of 0)."""
    first = metric_sum(server.metrics(), name, labels)
    deadline = time.monotonic() + timeout_s
    while metric_sum(server.metrics(), name, labels) == first and time.monotonic() < deadline:
        time.sleep(0.25)


def profile(load: str, server, seconds: float, native: bool,
            spy: bool = True, save: Path | None = None, tokens: int = 64) -> tuple[collections.Counter, collections.Counter, float, str]:
    pids = [pid for title, pid in server.processes.items() if title.startswith("front end")]
    unit, name, labels, per = UNITS[load]
    client = subprocess.Popen(load_command(load, server, seconds, native, tokens), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    load_started(server, name, labels)
    time.sleep(2.0)  # past the load's first calls
    window = max(seconds - 7.0, 2.0)
    before_cpu, before_units = cpu_split(pids), metric_sum(server.metrics(), name, labels)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        spies = [subprocess.Popen([SPY, "record", "--pid", str(p), "--duration", str(int(window)), "--rate", "250",
                                   "--nonblocking", "--format", "raw", "-o", f"{tmp}/{p}.txt"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for p in pids if spy]
        for sampler in spies:
            sampler.wait()
        if not spy:
            time.sleep(window)
        after_cpu, after_units = cpu_split(pids), metric_sum(server.metrics(), name, labels)
        elapsed = time.monotonic() - started
        layers: collections.Counter = collections.Counter()
        functions: collections.Counter = collections.Counter()  # innermost frame: own time
        for p in pids:
            path = Path(f"{tmp}/{p}.txt")
            for line in path.read_text().splitlines() if path.exists() else []:
                stack, count = line.rsplit(" ", 1)  # py-spy leaves out threads that wait (no --idle)
                frames = stack.split(";")
                layers[layer_of(frames)] += int(count)
                functions[frames[-1]] += int(count)
            if save is not None and path.exists():
                save.mkdir(parents=True, exist_ok=True)
                shutil.copy(path, save / f"{load}-{p}.txt")
    client.wait(timeout=seconds + 120)
    units = (after_units - before_units) * per
    user, system = (after - before for after, before in zip(after_cpu, before_cpu))
    per_unit = [seconds / units * 1e6 if units else float("nan") for seconds in (user + system, user, system)]
    cost = Cost(unit, units / elapsed, *per_unit)
    return layers, functions, cost


def cpu_split(pids: list[int]) -> tuple[float, float]:
    """The processes' CPU seconds, (user, system)."""
    splits = [process_cpu_split(p) for p in pids]
    return sum(u for u, _ in splits), sum(s for _, s in splits)


@dataclass
class Cost:
    unit: str
    rate: float  # units a second over the window
    us: float  # front ends' CPU a unit: user + system
    user_us: float
    system_us: float

    def line(self, load: str) -> str:
        return (f"{load}: front ends' CPU {self.us:.0f} us {self.unit} (user {self.user_us:.1f}, kernel "
                f"{self.system_us:.1f}; {self.rate:,.0f} a second; 2 front ends, /proc over /metrics)")


def against(tree: Path, loads: list[str], rounds: int, seconds: float, native: bool, tokens: int,
            extra_args: tuple[str, ...], now_args: tuple[str, ...]) -> None:
    """Front ends' CPU a unit, this checkout's (with `now_args` too) against `tree`'s, in alternating rounds."""
    servers = {"now": StandinServer(workers=2, max_batch=256, extra_args=(*extra_args, *now_args))}
    try:
        servers[str(tree)] = StandinServer(workers=2, max_batch=256, extra_args=extra_args, tree=tree)
        for load in loads:
            alternating(list(servers), rounds, lambda name: profile(load, servers[name], seconds, native, False, None,
                                                                    tokens)[2].us,
                        f"{load}: front ends' CPU {UNITS[load][0]}")
    finally:
        for server in servers.values():
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loads", default="unary,rest,batch,stream,sse")
    parser.add_argument("--seconds", type=float, default=16.0, help="of load; samples over all but the ends")
    parser.add_argument("--native", action="store_true",
                        help="unary, rest and batch from h2load and wrk (one thread each) instead of Python clients")
    parser.add_argument("--no-spy", action="store_true", help="CPU per unit only: no py-spy sampling")
    parser.add_argument("--top", type=int, default=0, help="also print the N functions with most own time")
    parser.add_argument("--save", type=Path, help="keep py-spy's raw samples in this folder")
    parser.add_argument("--stream-tokens", type=int, default=64, help="tokens a stream (stream and sse loads)")
    parser.add_argument("--stream-interval", type=int, default=1, help="the server's --stream-interval")
    parser.add_argument("--server-args", default="", help="more flags for the server, e.g. --disable-log-requests")
    parser.add_argument("--against", type=Path, help="compare with another checkout's stand-in server (no sampling)")
    parser.add_argument("--rounds", type=int, default=4, help="--against: alternating rounds a load")
    parser.add_argument("--now-server-args", default="",
                        help="--against: flags for this checkout's server only (one the other lacks)")
    args = parser.parse_args()
    extra_args = ("--stream-interval", str(args.stream_interval), *args.server_args.split())
    if args.against:
        against(args.against, args.loads.split(","), args.rounds, args.seconds, args.native, args.stream_tokens,
                extra_args, tuple(args.now_server_args.split()))
        return
    server = StandinServer(workers=2, max_batch=256, extra_args=extra_args)
    try:
        for load in args.loads.split(","):
            layers, functions, cost = profile(load, server, args.seconds, args.native, not args.no_spy, args.save,
                                                  args.stream_tokens)
            total = sum(layers.values()) or 1
            print(f"\n{cost.line(load)}")
            print("| layer | share of the front ends' working samples |\n|---|---|")
            for name, count in layers.most_common():
                print(f"| {name} | {100 * count / total:.0f}% |")
            if args.top:
                print("\n| function (own time) | share |\n|---|---|")
                for frame, count in functions.most_common(args.top):
                    print(f"| {frame} | {100 * count / total:.1f}% |")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
