"""Soak: minutes of mixed load on one server, sampling its memory, open files and threads.

Load: gRPC and REST clients in closed loops, with some bad requests (refused), some with
include_layers (the per-layer path), and some batch calls. Every `--sample-s` seconds the
server's RSS, open file descriptors and threads are read from /proc. Growth is judged from the
first sample after `--settle-s` (allocator and caches warmed up) to the last.

    .venv/bin/python bench/soak.py [--minutes 10] [--model random:gpt2] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time

import httpx

from gpt2serve_client import AsyncClient, Gpt2ServeError
from local_server import launch


def sample(pid: int) -> dict:
    status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":" in line)
    return {"rss_mib": int(status["VmRSS"].split()[0]) / 1024, "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "threads": int(status["Threads"])}


async def soak(grpc_target: str, http_url: str, pid: int, args) -> dict:
    stop_at = time.monotonic() + args.minutes * 60
    counts = {"ok": 0, "refused": 0, "errors": 0}
    samples: list[dict] = []
    rng = random.Random(0)

    def prompt() -> list[int]:
        return [rng.randrange(50257) for _ in range(rng.randint(1, 64))]

    async def grpc_worker(client: AsyncClient) -> None:
        while time.monotonic() < stop_at:
            kind = rng.random()
            try:
                if kind < 0.1:
                    await client.next_token(prompt(), top_k=0)  # refused: top_k out of range
                elif kind < 0.15:
                    await client.next_token(prompt(), include_layers=True)
                elif kind < 0.25:
                    await client.next_token_batch([prompt() for _ in range(4)])
                else:
                    await client.next_token(prompt())
                counts["ok"] += 1
            except Gpt2ServeError as exc:
                counts["refused" if exc.code in ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED") else "errors"] += 1

    async def rest_worker(http: httpx.AsyncClient) -> None:
        while time.monotonic() < stop_at:
            body = {"prompt_token_ids": prompt()} if rng.random() > 0.1 else {"prompt": 5}
            response = await http.post("/v1/next-token", json=body)
            counts["ok" if response.status_code == 200 else "refused" if response.status_code < 500 else "errors"] += 1

    async def sampler() -> None:
        started = time.monotonic()
        while time.monotonic() < stop_at:
            samples.append({"t_s": round(time.monotonic() - started), **sample(pid), "requests": sum(counts.values())})
            print(json.dumps(samples[-1]), flush=True)
            await asyncio.sleep(args.sample_s)

    async with AsyncClient(grpc_target, timeout=120) as client, \
            httpx.AsyncClient(base_url=http_url, timeout=120, limits=httpx.Limits(max_connections=64)) as http:
        await asyncio.gather(sampler(), *(grpc_worker(client) for _ in range(args.grpc_clients)),
                             *(rest_worker(http) for _ in range(args.rest_clients)))
    samples.append({"t_s": round(args.minutes * 60), **sample(pid), "requests": sum(counts.values())})
    settled = next(s for s in samples if s["t_s"] >= args.settle_s)
    last = samples[-1]
    return {
        "minutes": args.minutes, "grpc_clients": args.grpc_clients, "rest_clients": args.rest_clients,
        "counts": counts, "req_per_s": sum(counts.values()) / (args.minutes * 60),
        "settled": settled, "last": last,
        "max": {k: max(s[k] for s in samples) for k in ("rss_mib", "fds", "threads")},
        "growth_after_settle": {k: last[k] - settled[k] for k in ("rss_mib", "fds", "threads")},
        "samples": samples,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:gpt2")
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--sample-s", type=float, default=15)
    parser.add_argument("--settle-s", type=float, default=60)
    parser.add_argument("--grpc-clients", type=int, default=32)
    parser.add_argument("--rest-clients", type=int, default=16)
    parser.add_argument("--json", help="write the report here too")
    args = parser.parse_args()
    proc, grpc_target, http_url = launch(args.model, None, "--max-queue", "64")
    try:
        report = asyncio.run(soak(grpc_target, http_url, proc.pid, args))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    summary = {k: v for k, v in report.items() if k != "samples"}
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)
    return 0 if report["counts"]["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
