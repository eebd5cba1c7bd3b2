"""`gpt2serve bench`: closed-loop load against a running server, and in the same run the
in-process limit (the model alone on this machine, same prompts, batch sizes and dtype).

The ratio of the two is the number to watch: these machines are shared and noisy, so absolute
req/s move from run to run while a ratio measured in one run holds. `--api grpc-batch` sends
`NextTokenBatch` calls of `--batch-prompts` prompts each, and counts prompts, not calls.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlparse

from gpt2serve_client import AsyncClient, Gpt2ServeError, ModelInfo
from gpt2serve_client.types import NextTokenResult

from ..config import parse_bool
from .native_load import CpuMeter, LoadGeneratorCpu, percentile, run_native

MAX_REFERENCE_BATCH = 64  # in-process reference batch size, also measured when the server's is smaller


@dataclass
class LoadResult:
    api: str
    concurrency: int
    duration_s: float
    requests: int
    errors: int
    req_per_s: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_batch_size: float
    # Medians of the server's own timings: where the client-observed latency went.
    server_queue_p50_ms: float
    server_forward_p50_ms: float
    server_total_p50_ms: float
    error_codes: dict[str, int] = field(default_factory=dict)


@dataclass
class InProcessResult:
    batch_size: int
    prompts_per_s: float
    forward_p50_ms: float


def make_prompts(count: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(count)]


@dataclass
class LoadSamples:
    """What closed-loop clients saw (one process's worth; `merge` joins several)."""

    latencies: list[float] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)
    timings: list = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    cpu_s: float = 0.0  # the client process's CPU over its load, to tell whether it was the limit
    wall_s: float = 0.0

    def merge(self, other: LoadSamples) -> LoadSamples:
        errors = dict(self.errors)
        for code, count in other.errors.items():
            errors[code] = errors.get(code, 0) + count
        return LoadSamples(self.latencies + other.latencies, self.batch_sizes + other.batch_sizes,
                           self.timings + other.timings, errors, self.cpu_s + other.cpu_s,
                           max(self.wall_s, other.wall_s))

    def summary(self, api: str, concurrency: int, duration_s: float, interleaved: bool = False,
                prompts_per_call: int = 1) -> LoadResult:
        latencies = sorted(self.latencies)
        n = len(latencies)
        # Each request reports the size of the batch it ran in; a batch of b is seen b times.
        batches = sum(1 / b for b in self.batch_sizes) if self.batch_sizes else 0
        return LoadResult(
            api=api, concurrency=concurrency, duration_s=duration_s, requests=n, errors=sum(self.errors.values()),
            # Prompts a second; interleaved (one client): request time only.
            req_per_s=n * prompts_per_call / (sum(latencies) if interleaved and latencies else duration_s),
            p50_ms=percentile(latencies, 0.5) * 1000, p90_ms=percentile(latencies, 0.9) * 1000,
            p99_ms=percentile(latencies, 0.99) * 1000, mean_batch_size=n / batches if batches else 0.0,
            server_queue_p50_ms=median_of(t.queue_ms for t in self.timings),
            server_forward_p50_ms=median_of(t.forward_ms for t in self.timings),
            server_total_p50_ms=median_of(t.total_ms for t in self.timings),
            error_codes=self.errors,
        )


async def run_load(call, prompts: list[list[int]], concurrency: int, duration_s: float, warmup_s: float,
                   between=None) -> LoadSamples:
    """`concurrency` workers, each sending its next request as soon as the last one answers.
    `between(prompt)`, if given, runs after each measured request (the interleaved in-process forward)."""
    samples = LoadSamples()
    loop = asyncio.get_running_loop()
    start = loop.time()
    measure_from, stop_at = start + warmup_s, start + warmup_s + duration_s

    async def worker(index: int) -> None:
        i = index
        while (now := loop.time()) < stop_at:
            sent = time.perf_counter()
            try:
                result = await call(prompts[i % len(prompts)])
            except Gpt2ServeError as exc:
                if now >= measure_from:
                    samples.errors[exc.code] = samples.errors.get(exc.code, 0) + 1
                continue
            finally:
                i += concurrency
            if now >= measure_from and loop.time() <= stop_at:
                samples.latencies.append(time.perf_counter() - sent)
                samples.batch_sizes.append(result.batch_size)
                samples.timings.append(result.timings)
                if between is not None:
                    between(prompts[(i - concurrency) % len(prompts)])

    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return samples


def load_in_process(api: str, target: str, prompts, concurrency: int, duration_s: float,
                    warmup_s: float, between=None) -> LoadSamples:
    """One client process's share of the load (a top-level function, for --processes), with the
    CPU that process spent on it."""
    with CpuMeter() as meter:
        samples = asyncio.run(LOADS[api](target, prompts, concurrency, duration_s, warmup_s, between))
    samples.cpu_s, samples.wall_s = meter.cpu_s, meter.wall_s
    return samples


def load_from_processes(api: str, target: str, prompts, concurrency: int, duration_s: float, warmup_s: float,
                        processes: int) -> LoadSamples:
    """The clients spread over `processes` client processes, so one client's event loop is not
    what is measured (a front end per core on a GPU machine outruns a single client process)."""
    shares = [concurrency // processes + (i < concurrency % processes) for i in range(processes)]
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        parts = pool.starmap(load_in_process, [(api, target, prompts[i::processes] or prompts, share, duration_s,
                                                warmup_s) for i, share in enumerate(shares) if share])
    merged = LoadSamples()
    for part in parts:
        merged = merged.merge(part)
    return merged


def median_of(values) -> float:
    return statistics.median(values) if (values := list(values)) else float("nan")


async def load_grpc(target: str, prompts, concurrency: int, duration_s: float, warmup_s: float,
                    between=None) -> LoadSamples:
    async with AsyncClient(target) as client:
        return await run_load(lambda p: client.next_token(p, top_k=5), prompts, concurrency, duration_s, warmup_s,
                              between)


async def load_grpc_batch(target: str, groups, concurrency: int, duration_s: float, warmup_s: float,
                          between=None) -> LoadSamples:
    """NextTokenBatch: each "prompt" is a group of prompts sent in one call."""
    async with AsyncClient(target) as client:
        async def call(group):
            return (await client.next_token_batch(group, top_k=5))[-1]  # one sample per call
        return await run_load(call, groups, concurrency, duration_s, warmup_s, between)


class KeepAliveHttp:
    """A lean HTTP/1.1 keep-alive connection for load generation.

    httpx spends more CPU per request than the server does; on a 2-core machine shared with
    the server that measured the client, not the server. This does only what the load needs.
    """

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post_json(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        self.writer.write(head + body)
        status_line = await self.reader.readline()
        if not status_line:
            self.writer = None  # Reconnect next time.
            raise Gpt2ServeError("UNAVAILABLE", "the server closed the connection")
        length = 0
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return int(status_line.split()[1]), await self.reader.readexactly(length)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def load_rest(base_url: str, prompts, concurrency: int, duration_s: float, warmup_s: float,
                    between=None) -> LoadSamples:
    url = urlparse(base_url)
    pool = [KeepAliveHttp(url.hostname, url.port or 80) for _ in range(concurrency)]
    free = list(pool)

    async def call(prompt):
        conn = free.pop()
        try:
            status, body = await conn.post_json("/v1/next-token", json.dumps({"prompt_token_ids": prompt}).encode())
        finally:
            free.append(conn)
        data = json.loads(body)
        if status != 200:
            raise Gpt2ServeError(data["error"]["code"], data["error"]["message"], http_status=status)
        return NextTokenResult.from_dict(data)

    try:
        return await run_load(call, prompts, concurrency, duration_s, warmup_s, between)
    finally:
        for conn in pool:
            conn.close()


LOADS = {"grpc": load_grpc, "rest": load_rest, "grpc-batch": load_grpc_batch}  # api -> load generator


class InProcessModel:
    """The same architecture and dtype on this machine, no server: the most it can do."""

    def __init__(self, info: ModelInfo):
        from ..engine.engine import Engine, EngineOptions  # lazy: the load client itself needs no torch
        from ..engine.steps import plain_asks
        from ..engine.loading import build_model_like

        # The server's batch buckets (CUDA graphs on cuda), and the reference size beside them.
        options = EngineOptions(max_batch_size=max(info.max_batch_size, MAX_REFERENCE_BATCH))
        self.engine, self.asks = Engine(build_model_like(info), options), plain_asks
        self.engine.warm_up()

    def forward_s(self, batch: list[list[int]]) -> float:
        return self.engine.next_token(self.asks(batch, 5)).forward_s

    def measure(self, prompts: list[list[int]], batch_size: int, duration_s: float) -> list[float]:
        """Forward times (s) of batches of `batch_size` prompts, for about `duration_s`."""
        asks = self.asks([prompts[i % len(prompts)] for i in range(batch_size)], 5)
        for _ in range(2):  # Warm up allocator and kernels.
            self.engine.next_token(asks)
        times = []
        stop_at = time.perf_counter() + duration_s
        while time.perf_counter() < stop_at or len(times) < 3:
            times.append(self.engine.next_token(asks).forward_s)
        return times


def best_batched(limit: list[InProcessResult]) -> InProcessResult:  # batched sizes preferred; 1 for one client
    return max(limit[1:] or limit, key=lambda r: r.prompts_per_s)


def summarize(batch_size: int, times: list[float]) -> InProcessResult:
    return InProcessResult(batch_size, batch_size * len(times) / sum(times), statistics.median(times) * 1000)


def format_report(info: ModelInfo, load: LoadResult, limit: list[InProcessResult]) -> str:
    best = best_batched(limit)
    single = limit[0]
    lines = [
        f"model {info.model} ({info.weights} weights), {info.dtype} on {info.device}",
        f"server ({load.api}, {load.concurrency} clients, {load.duration_s:.0f} s): {load.req_per_s:.1f} "
        f"{'prompts' if load.api == 'grpc-batch' else 'req'}/s, "
        f"p50 {load.p50_ms:.1f} ms, p90 {load.p90_ms:.1f} ms, p99 {load.p99_ms:.1f} ms, "
        f"mean batch {load.mean_batch_size:.1f}, errors {load.errors} {load.error_codes or ''}".rstrip(),
        f"server-side p50: queue {load.server_queue_p50_ms:.1f} ms, forward {load.server_forward_p50_ms:.1f} ms, "
        f"total {load.server_total_p50_ms:.1f} ms" if load.server_total_p50_ms == load.server_total_p50_ms
        else "server-side timings: not read (native load generator)",
        "in-process limit: " + ", ".join(
            f"batch {r.batch_size}: {r.prompts_per_s:.1f} prompts/s (forward p50 {r.forward_p50_ms:.1f} ms)"
            for r in limit),
        f"ratio server / in-process (batch {best.batch_size}): {load.req_per_s / best.prompts_per_s:.3f}",
        f"latency over single forward: p50 {load.p50_ms - single.forward_p50_ms:+.1f} ms",
    ]
    return "\n".join(lines)


async def fetch_info(target: str, ready_timeout_s: float) -> ModelInfo:  # a starting server waited for
    async with AsyncClient(target, timeout=ready_timeout_s) as client:
        return await client.model_info()


def native_load(args, target: str, prompts, per_call: int) -> tuple[LoadResult, LoadGeneratorCpu]:
    """The load from h2load or wrk (benchmarks.native_load); errors and batches as the server counted them.
    The server's own timings travel in answers these tools do not read: NaN."""
    run, statuses, mean_batch, generator = run_native(args.api, target, args.http_target, prompts, per_call,
                                                      args.concurrency, args.processes, args.duration, args.warmup)
    errors = {status: n for status, n in statuses.items() if status != "OK" and n} | (
        {"TRANSPORT": run.transport_errors} if run.transport_errors else {})
    return LoadResult(args.api, run.concurrency, run.duration_s, run.requests, sum(errors.values()),
                      run.requests * per_call / run.duration_s, run.p50_s * 1000, run.p90_s * 1000, run.p99_s * 1000,
                      mean_batch, *[float("nan")] * 3, errors), generator


def run_bench(args) -> int:
    info = asyncio.run(fetch_info(args.target, args.ready_timeout))
    prompts = make_prompts(256, args.prompt_tokens, info.architecture.vocab_size, args.seed)
    # The server's batch size, and the largest the clients could fill, whichever is faster alone:
    # the ratio is against the best the model does here, not just the size the server was given.
    per_call = args.batch_prompts if args.api == "grpc-batch" else 1
    in_flight = args.concurrency * per_call
    sizes = sorted({1, min(in_flight, info.max_batch_size), min(in_flight, MAX_REFERENCE_BATCH)})
    model = InProcessModel(info)
    # Half the in-process measurement before the load and half after, so drift in a noisy
    # machine's speed during the run hits both sides of the ratio alike.
    times = {size: model.measure(prompts, size, args.limit_duration / 2) for size in sizes}
    # One client: time the model alone between the server's requests too, so both latencies come
    # from the same seconds of this noisy machine (the single-forward p50 uses these samples).
    interleaved: list[float] = []
    between = (lambda p: interleaved.append(model.forward_s([p]))) if args.concurrency == 1 and per_call == 1 else None
    target = args.http_target if args.api == "rest" else args.target
    # grpc-batch: groups of `per_call` prompts, each starting somewhere else in the list.
    sent = prompts if per_call == 1 else [[prompts[(start + j) % len(prompts)] for j in range(per_call)]
                                          for start in range(0, len(prompts), 7)]
    if args.native:
        load, generator = native_load(args, target, prompts, per_call)
    else:
        if args.processes > 1:
            samples = load_from_processes(args.api, target, sent, args.concurrency, args.duration, args.warmup,
                                          args.processes)
        else:
            samples = load_in_process(args.api, target, sent, args.concurrency, args.duration, args.warmup, between)
        load = samples.summary(args.api, args.concurrency, args.duration, interleaved=between is not None,
                               prompts_per_call=per_call)
        # Each client process's CPU over its own load. One interleaved client waits on every answer
        # and runs the in-process forward between them: no headroom rule applies to it.
        generator = None if between is not None else LoadGeneratorCpu(
            f"python clients in {args.processes} process(es)", args.processes, samples.cpu_s, samples.wall_s)
    for size in sizes:
        times[size] += model.measure(prompts, size, args.limit_duration / 2)
    if interleaved:
        times[1] = interleaved
    limit = [summarize(size, times[size]) for size in sizes]
    report = {
        "model": asdict(info), "prompt_tokens": args.prompt_tokens, "load": asdict(load),
        "in_process": [asdict(r) for r in limit],
        "ratio": load.req_per_s / best_batched(limit).prompts_per_s,
        "p50_over_single_forward_ms": load.p50_ms - limit[0].forward_p50_ms,
        "load_generator": generator.as_dict() if generator else None,
        "rejected": generator.rejected if generator else "",
    }
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
    else:
        print(format_report(info, load, limit))
        if generator:
            print(generator.describe())
    return 0 if load.requests else 1


def add_bench_arguments(parser) -> None:
    parser.add_argument("--target", default="localhost:50051", help="gRPC server host:port")
    parser.add_argument("--http-target", default="http://localhost:8000", help="REST base URL (--api rest)")
    parser.add_argument("--ready-timeout", type=float, default=120.0, help="seconds to wait for a starting server")
    parser.add_argument("--api", choices=("grpc", "rest", "grpc-batch"), default="grpc",
                        help="grpc-batch: NextTokenBatch calls of --batch-prompts prompts")
    parser.add_argument("--batch-prompts", type=int, default=64, help="--api grpc-batch: prompts per call")
    parser.add_argument("--concurrency", "-c", type=int, default=64, help="closed-loop clients")
    parser.add_argument("--processes", "-p", type=int, default=1,
                        help="client processes the clients are spread over (one client process can be the limit); "
                             "with --native, the load generator's threads")
    parser.add_argument("--native", action="store_true",
                        help="load from h2load (gRPC; Debian nghttp2-client) or wrk (REST) instead of Python clients")
    parser.add_argument("--duration", "-d", type=float, default=10.0, help="measured seconds of load")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of load before measuring")
    parser.add_argument("--limit-duration", type=float, default=8.0, help="seconds per in-process batch size (half before the load, half after)")
    parser.add_argument("--prompt-tokens", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON report")


def add_engine_bench_arguments(parser) -> None:
    """Flags of `bench --in-process` (benchmarks.engine_limit; the server-load flags are ignored there)."""
    parser.add_argument("--in-process", action="store_true",
                        help="time the engine against transformers' forward in this process (no server)")
    parser.add_argument("--model", default="random:gpt2", help="--in-process: model to load")
    parser.add_argument("--device", default="auto", help="--in-process: device")
    parser.add_argument("--dtype", default="auto", help="--in-process: dtype")
    parser.add_argument("--batch-sizes", default="1,8,64,256", help="--in-process: comma-separated batch sizes")
    parser.add_argument("--rounds", type=int, default=None,
                        help="alternating rounds: per batch size with --in-process (default 5), "
                             "per stream count with --generate (default 3), per workload with --shared-prefix (default 3)")
    parser.add_argument("--per-round", type=int, default=10, help="--in-process: batches per side and round")
    parser.add_argument("--cuda-graphs", type=parse_bool, default=True, help="--in-process: on cuda")
