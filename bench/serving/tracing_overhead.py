"""What tracing costs, measured in one run (the issue 4 targets in docs/benchmarks.md).

1. Tracing configured but requests not traced: two servers on this machine, one exporting over
   OTLP (sample ratio 0, so nothing is traced) and one without tracing, loaded in alternating
   rounds at 64 gRPC clients; the throughput cost is 1 - traced-config / plain.
2. A fully traced request (trace_layers: every layer's summaries, logit lens, spans exported):
   one client alternates traced and untraced requests on the tracing server, idle 100 ms
   between requests; the extra latency is p50 traced / p50 untraced - 1. The layer reports are
   finished in the engine thread after the answer (logit lens included), so this measures what
   the caller waits for; a third kind, with include_layers, waits for the reports too.

Spans go to an OTLP/gRPC sink in this process that counts and discards them.

    .venv/bin/python bench/serving/tracing_overhead.py [--model random:gpt2] [--rounds 3] [--round-s 6]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from gpt2serve.benchmarks.serving_load import load_grpc, make_prompts
from gpt2serve_client import AsyncClient
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: local_server
from local_server import launch  # noqa: E402


class CountingSink(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self.spans = 0
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def Export(self, request, context):
        self.spans += sum(len(s.spans) for rs in request.resource_spans for s in rs.scope_spans)
        return trace_service_pb2.ExportTraceServiceResponse()


KINDS = {"untraced": {}, "trace_layers": {"trace_layers": True},
         "trace_layers+include_layers": {"trace_layers": True, "include_layers": True}}


async def alternate_latency(target: str, prompts, rounds: int) -> dict[str, list[float]]:
    """One client, the kinds in turn; idle 100 ms before each request, since a traced request's
    layer reports are built after its answer and the next request would otherwise wait for them."""
    latencies = {kind: [] for kind in KINDS}
    async with AsyncClient(target) as client:
        for i in range(5):
            await client.next_token(prompts[i], trace_layers=True, include_layers=True)
        for i in range(rounds):
            kinds = list(KINDS)[i % 3:] + list(KINDS)[:i % 3]
            for kind in kinds:
                await asyncio.sleep(0.1)
                started = time.perf_counter()
                await client.next_token(prompts[i % len(prompts)], **KINDS[kind])
                latencies[kind].append(time.perf_counter() - started)
    return latencies


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:gpt2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--round-s", type=float, default=6.0)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--latency-rounds", type=int, default=120, help="requests of each kind at 1 client")
    args = parser.parse_args()

    sink = CountingSink()
    plain_env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    traced_env = {**plain_env, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink.port}",
                  "OTEL_EXPORTER_OTLP_INSECURE": "true"}
    sample_none = ("--trace-sample-ratio", "0")
    servers = {"tracing configured": launch(args.model, traced_env, *sample_none),
               "tracing off": launch(args.model, plain_env, *sample_none)}
    try:
        prompts = make_prompts(256, 5, 50257)
        totals = {name: 0 for name in servers}
        for round_index in range(args.rounds):
            order = list(servers) if round_index % 2 == 0 else list(servers)[::-1]
            for name in order:
                load = asyncio.run(load_grpc(servers[name][1], prompts, args.clients, args.round_s, 1.0)).summary(
                    "grpc", args.clients, args.round_s)
                totals[name] += load.requests
                print(f"round {round_index}: {name}: {load.req_per_s:.1f} req/s, mean batch {load.mean_batch_size:.1f}",
                      flush=True)
        untraced_cost = 1 - totals["tracing configured"] / totals["tracing off"]
        spans_before = sink.spans
        latencies = asyncio.run(alternate_latency(servers["tracing configured"][1], prompts, args.latency_rounds))
        p50 = {kind: statistics.median(values) * 1000 for kind, values in latencies.items()}
        time.sleep(1.0)  # let the batch span processor flush
        report = {
            "model": args.model, "clients": args.clients, "rounds": args.rounds, "round_s": args.round_s,
            "untraced_throughput_cost": untraced_cost,
            "req_per_s": {name: n / (args.rounds * args.round_s) for name, n in totals.items()},
            "one_client_p50_ms": p50,
            "traced_extra_latency": p50["trace_layers"] / p50["untraced"] - 1,
            "include_layers_extra_latency": p50["trace_layers+include_layers"] / p50["untraced"] - 1,
            "spans_exported_during_latency_test": sink.spans - spans_before,
        }
        print(json.dumps(report, indent=2))
    finally:
        for proc, *_ in servers.values():
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
        sink.server.stop(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
