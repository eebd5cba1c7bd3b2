"""The server's host path against a card's step times, on any machine: served rate against the
ideal, and the CPU each server process spends per request and per sequence-step.

It starts `bench/host_path/standin_server.py` (the real server, `--workers N`, in front of a stand-in
device that sleeps for an H200's measured step times, bench/host_path/h200_steps.json) and drives it with
the project's own load generators from client processes:
- generation: S streams of --new-tokens tokens after 5-token prompts, greedy; ideal tokens/s
  = S / (the device's decode step at S rows);
- next-token: C closed-loop gRPC clients of one prompt each; ideal = C / (a forward of C rows);
- next-token batch: K clients of --batch-prompts prompts per NextTokenBatch call; ideal
  = K * prompts / (a forward of that many rows, at most --max-batch-size).
CPU comes from /proc (user + system, all threads) of each server process over the load's
window; work done comes from the server's own /metrics over the same window (generated tokens;
answered requests; prompts = requests x prompts per call). The load generators' own CPU is
reported as a share of the machine: when it is near the whole machine, the served rate says
more about the clients than the server, but the per-step CPU figures still hold.

    .venv/bin/python bench/host_path/host_path.py [--workers 2] [--streams 1,64,256] [--clients 256] [--json]

With --ipc the load goes to the engine process alone, through its IPC door (bench/host_path/ipc_load.py:
client processes speaking the engine's protocol, no front ends or gRPC in the path), so the
engine runs the steps the load asks for even where a few cores cannot also carry front ends and
gRPC clients at that rate; CPU is the engine process's over the load's window.

With --ipc --phases the engine process also reports its CPU by phase for each next-token load
(bench/host_path/engine_phases.py: each phase timed by its own thread's CPU clock), after the table.

With --codec it times the IPC door's codec alone (ipc_load.codec_table): one-prompt next-token
calls as a message each against the same calls in columns.

With --core-only it runs the engine core alone in this process over the same stand-in (no IPC,
no front ends, no gRPC): generations whose sinks start the next one as one ends, and closed-loop
next-token callers; CPU per token of the process and of the core's own thread.

With --target host:port --http-target URL it drives a server already running (a real one on a
card): the same loads and served rates, no stand-in, no ideal, CPU per process of the server
whose supervisor is --pid (when given).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import resource
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import ipc_load  # noqa: E402
from ipc_load import process_cpu  # noqa: E402
from servers import RunningServer, StandinServer, metric_sum  # noqa: E402
from standin_server import DECODE, NEXT_TOKEN, STEPS_FILE  # noqa: E402

from gpt2serve.benchmarks.generate_load import serve_from_processes  # noqa: E402
from gpt2serve.benchmarks.native_load import percentile  # noqa: E402
from gpt2serve.benchmarks.serving_load import load_from_processes, make_prompts  # noqa: E402
from gpt2serve_client import AsyncClient  # noqa: E402

VOCAB = 50257


@dataclass
class Scenario:
    name: str
    load: str  # e.g. "256 streams"
    served_per_s: float  # tokens/s (generation) or prompts/s (next-token)
    ideal_per_s: float
    ratio: float
    work: int  # sequence-steps (generated tokens) or prompts, counted by the server
    requests: int
    us_per_unit: dict[str, float]  # process -> CPU microseconds per sequence-step (or per prompt)
    us_per_request: dict[str, float]
    load_generator_cpu_share: float  # of the machine's cores, over the window
    first_token_ms: str = ""  # generation through the IPC door: p50 / p90 from request sent to first token
    rows_a_forward: str = ""  # next-token through the IPC door: prompts answered / the forwards that answered them


def children_cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def measure(server: RunningServer, run, unit_metric) -> tuple[float, dict[str, float], float, float, float, str]:
    """Run the load; (wall seconds, CPU seconds per server process, work units, requests,
    load generator CPU seconds, the load's own result)."""
    before_text = server.metrics()
    before = {name: process_cpu(pid) for name, pid in server.processes.items()}
    clients_before, started = children_cpu(), time.perf_counter()
    result = run()
    wall, clients = time.perf_counter() - started, children_cpu() - clients_before
    after = {name: process_cpu(pid) for name, pid in server.processes.items()}
    after_text = server.metrics()
    units, requests = unit_metric(before_text, after_text)
    return wall, {name: after[name] - before[name] for name in before}, units, requests, clients, result


def scenario(name: str, load: str, served: float, ideal: float, units: float, requests: float,
             cpu: dict[str, float], clients_cpu: float, wall: float) -> Scenario:
    """`ideal` 0: not known (a real server)."""
    per_unit = {p: round(1e6 * s / max(units, 1), 1) for p, s in cpu.items()}
    per_request = {p: round(1e6 * s / requests, 1) for p, s in cpu.items()} if requests else {}
    return Scenario(name, load, round(served), round(ideal), round(served / ideal, 3) if ideal else 0.0, int(units),
                    int(requests), per_unit, per_request, round(clients_cpu / (wall * os.cpu_count()), 2))


STANDIN = True  # False with --target: no ideal


def generation(server: RunningServer, streams: int, new_tokens: int, duration: float, processes: int) -> Scenario:
    prompts = make_prompts(streams * 4, 5, VOCAB, 0)

    def tokens(before: str, after: str) -> tuple[float, float]:
        made = metric_sum(after, "gpt2serve_generated_tokens_total") - metric_sum(before, "gpt2serve_generated_tokens_total")
        done = (metric_sum(after, "gpt2serve_requests_total", 'method="Generate"')
                - metric_sum(before, "gpt2serve_requests_total", 'method="Generate"'))
        return made, done

    wall, cpu, made, done, clients, result = measure(
        server, lambda: serve_from_processes(server.grpc, prompts, streams, new_tokens, duration, processes), tokens)
    rate = result.tokens_per_s
    return scenario("generation", f"{streams} streams", rate, STANDIN and streams / DECODE.seconds(streams), made,
                    done, cpu, clients, wall)


def next_token(server: RunningServer, clients: int, duration: float, processes: int) -> Scenario:
    prompts = make_prompts(clients * 4, 5, VOCAB, 0)

    def answered(before: str, after: str) -> tuple[float, float]:
        done = (metric_sum(after, "gpt2serve_requests_total", 'method="NextToken"')
                - metric_sum(before, "gpt2serve_requests_total", 'method="NextToken"'))
        return done, done

    wall, cpu, done, _, spent, samples = measure(
        server, lambda: load_from_processes("grpc", server.grpc, prompts, clients, duration, 1.0, processes), answered)
    rate = len(samples.latencies) / duration
    return scenario("next-token", f"{clients} clients", rate, STANDIN and clients / NEXT_TOKEN.seconds(clients),
                    done, done, cpu, spent, wall)


async def _batch_calls(target: str, prompts: list[list[int]], clients: int, per_call: int, duration: float) -> int:
    answered = 0
    async with AsyncClient(target, timeout=60) as client:
        stop_at = time.perf_counter() + duration

        async def worker(index: int) -> None:
            nonlocal answered
            i = index
            while time.perf_counter() < stop_at:
                batch = [prompts[(i + j) % len(prompts)] for j in range(per_call)]
                await client.next_token_batch(batch, top_k=5)
                answered += per_call
                i += per_call * clients

        await asyncio.gather(*(worker(i) for i in range(clients)))
    return answered


def _batch_calls_in_process(target: str, prompts: list[list[int]], clients: int, per_call: int, duration: float) -> int:
    return asyncio.run(_batch_calls(target, prompts, clients, per_call, duration))


def batch_calls_from_processes(target: str, prompts: list[list[int]], clients: int, per_call: int, duration: float,
                               processes: int) -> int:
    """Prompts answered by `clients` NextTokenBatch callers spread over client processes."""
    processes = max(1, min(processes, clients))
    if processes == 1:
        return _batch_calls_in_process(target, prompts, clients, per_call, duration)
    shares = [clients // processes + (i < clients % processes) for i in range(processes)]
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        return sum(pool.starmap(_batch_calls_in_process, [(target, prompts[i::processes], share, per_call, duration)
                                                          for i, share in enumerate(shares)]))


def next_token_batch(server: RunningServer, clients: int, per_call: int, duration: float, max_batch: int,
                     processes: int = 1) -> Scenario:
    prompts = make_prompts(1024, 5, VOCAB, 0)

    def answered(before: str, after: str) -> tuple[float, float]:
        done = (metric_sum(after, "gpt2serve_requests_total", 'method="NextTokenBatch"')
                - metric_sum(before, "gpt2serve_requests_total", 'method="NextTokenBatch"'))
        return done * per_call, done

    wall, cpu, done, calls, spent, answered_prompts = measure(
        server, lambda: batch_calls_from_processes(server.grpc, prompts, clients, per_call, duration, processes),
        answered)
    rows = min(clients * per_call, max_batch)
    return scenario("next-token batch", f"{clients} x {per_call} prompts", answered_prompts / wall,
                    STANDIN and rows / NEXT_TOKEN.seconds(rows), done, calls, cpu, spent, wall)


def over_ipc(server: StandinServer, kind: str, n: int, size: int, duration: float, processes: int,
             max_batch: int) -> Scenario:
    """`kind` "streams" (of `size` tokens) or "callers" (of `size` prompts a request) straight to
    the engine process (see the module doc)."""
    phases = Path(server.phases_dir) if server.phases_dir and kind == "callers" else None
    if phases:
        (phases / "start").touch()
    units, engine_cpu, first_token_s, forwards = ipc_load.from_processes(
        kind, server.engine_address, server.processes["engine"], n, size, duration, processes)
    if phases:
        PHASE_REPORTS.append(f"{n} x {size} prompts: " + _phase_report(phases))
    if kind == "streams":
        result = scenario("generation (IPC)", f"{n} streams", units / duration, n / DECODE.seconds(n), units, 0,
                          {"engine": engine_cpu}, 0.0, duration)
        if first_token_s:
            p50, p90 = (1000 * percentile(first_token_s, q) for q in (0.5, 0.9))
            result.first_token_ms = f"{p50:.1f} / {p90:.1f}"
        return result
    rows = min(n * size, max_batch)
    name, load = ("next-token (IPC)", f"{n} callers") if size == 1 else \
        ("next-token batch (IPC)", f"{n} x {size} prompts")
    result = scenario(name, load, units / duration, rows / NEXT_TOKEN.seconds(rows), units, units // size,
                      {"engine": engine_cpu}, 0.0, duration)
    if forwards:  # callers: each answer says the size of the forward that answered it
        result.rows_a_forward = f"{units / forwards:.1f}"
    return result


PHASE_REPORTS: list[str] = []  # with --phases, one a next-token scenario


def _phase_report(directory: Path) -> str:
    """The engine's report of the phases since `start` (bench/host_path/engine_phases.py)."""
    (directory / "stop").touch()
    report, deadline = directory / "report.txt", time.monotonic() + 10
    while not report.exists():
        if time.monotonic() > deadline:
            raise RuntimeError("the engine wrote no phase report (was it started with STANDIN_PHASES?)")
        time.sleep(0.1)
    text = report.read_text()  # whole: the engine writes it aside, then renames it
    report.unlink()
    return text


def report(results: list[Scenario], workers: int) -> str:
    names = sorted({p for r in results for p in r.us_per_unit}, key=lambda p: (p != "engine", p))
    against = STEPS_FILE.name if STANDIN else "a running server"
    lines = [f"host path against {against}, --workers {workers}, {os.cpu_count()} cores",
             "| scenario | load | served/s | ideal/s | ratio | " + " | ".join(f"{p} us/unit" for p in names)
             + " | engine us/request | clients' CPU share | first token ms p50 / p90 | rows a forward |",
             "|---|---|---|---|---|" + "---|" * len(names) + "---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.name} | {r.load} | {r.served_per_s} | {r.ideal_per_s} | {r.ratio} | "
                     + " | ".join(str(r.us_per_unit.get(p, "")) for p in names)
                     + f" | {r.us_per_request.get('engine', '')} | {r.load_generator_cpu_share} | {r.first_token_ms}"
                     + f" | {r.rows_a_forward} |")
    lines.append("unit: a sequence-step (generated token) for generation, a prompt for next-token; first token: "
                 "from a stream's request sent to its first token, through the IPC door (the engine's share of TTFT); "
                 "rows a forward: next-token prompts answered through the IPC door / the forwards that answered them")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--streams", default="1,64,256")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--clients", default="256", help="next-token clients, comma-separated (empty: none)")
    parser.add_argument("--batch-clients", type=int, default=4, help="NextTokenBatch clients (0: none)")
    parser.add_argument("--batch-prompts", type=int, default=64)
    parser.add_argument("--processes", type=int, default=2, help="client processes")
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--target", help="a running server's gRPC host:port (no stand-in)")
    parser.add_argument("--http-target", help="with --target: its REST base URL (/metrics)")
    parser.add_argument("--pid", type=int, help="with --target: its supervisor's pid, for CPU per process")
    parser.add_argument("--ipc", action="store_true", help="load the engine process alone, through its IPC door")
    parser.add_argument("--core-only", action="store_true", help="the engine core alone in this process")
    parser.add_argument("--codec", action="store_true", help="the IPC codec alone: µs a next-token call")
    parser.add_argument("--phases", action="store_true",
                        help="with --ipc: the engine's CPU by phase for each next-token load (engine_phases.py)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.codec:
        print(ipc_load.codec_table())
        return
    if args.core_only:
        from core_alone import core_only

        print(core_only([int(s) for s in args.streams.split(",") if s], [int(c) for c in args.clients.split(",") if c],
                        args.new_tokens, args.duration, args.max_batch_size))
        return
    global STANDIN
    if args.target:
        STANDIN = False
        server = RunningServer(args.target, args.http_target, args.pid)
    else:
        server = StandinServer(args.workers, args.max_batch_size,
                               phases_dir=tempfile.mkdtemp(prefix="gpt2serve-phases-") if args.phases else None)
    results = []
    try:
        if args.ipc:
            for streams in [int(s) for s in args.streams.split(",") if s]:
                results.append(over_ipc(server, "streams", streams, args.new_tokens, args.duration, args.processes,
                                        args.max_batch_size))
            for clients in [int(c) for c in args.clients.split(",") if c]:
                results.append(over_ipc(server, "callers", clients, 1, args.duration, args.processes,
                                        args.max_batch_size))
            if args.batch_clients:
                results.append(over_ipc(server, "callers", args.batch_clients, args.batch_prompts, args.duration,
                                        args.processes, args.max_batch_size))
        for streams in [int(s) for s in args.streams.split(",") if s and not args.ipc]:
            results.append(generation(server, streams, args.new_tokens, args.duration, args.processes))
        for clients in [int(c) for c in args.clients.split(",") if c and not args.ipc]:
            results.append(next_token(server, clients, args.duration, args.processes))
        if args.batch_clients and not args.ipc:
            results.append(next_token_batch(server, args.batch_clients, args.batch_prompts, args.duration,
                                            args.max_batch_size, args.processes))
    finally:
        server.stop()
        if server.phases_dir:
            shutil.rmtree(server.phases_dir, ignore_errors=True)
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=1))
    else:
        print("\n\n".join([report(results, args.workers), *PHASE_REPORTS]))


if __name__ == "__main__":
    main()
