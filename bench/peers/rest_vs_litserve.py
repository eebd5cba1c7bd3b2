"""gpt2serve's REST against LitServe serving the same GPT-2 next token, in alternating rounds.

LitServe is what many hand-rolled model servers are built on; `bench/peers/litserve_gpt2.py` serves
GPT-2 small's shape (random weights) with transformers and LitServe's dynamic batching (64
prompts, 25 ms, as gpt2serve's defaults), answering the same route with the same result shape.
Both servers are up at once and loaded in turn (ABBA order) by the REST load generator
`gpt2serve bench` uses, 64 keep-alive clients sending 5-token prompts; the report gives each
round's req/s and mean batch, and the ratio of the totals.

    pip install --no-deps --target .bench-deps litserve==0.2.19     # once (its dependencies are ours)
    .venv/bin/python bench/peers/rest_vs_litserve.py [--rounds 4] [--round-s 8] [--clients 64] [-- serve flags]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from gpt2serve.benchmarks.serving_load import load_rest, make_prompts
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: local_server
from local_server import launch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def start_litserve(port: int, deps: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(deps)}
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "peers" / "litserve_gpt2.py"), "--port", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"LitServe exited with {proc.returncode}")
        time.sleep(0.5)
    raise TimeoutError("LitServe did not come up")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="each round is one gpt2serve and one LitServe run")
    parser.add_argument("--round-s", type=float, default=8.0)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--litserve-port", type=int, default=8090)
    parser.add_argument("--deps", default=str(ROOT / ".bench-deps"), help="where litserve is installed (PYTHONPATH)")
    parser.add_argument("serve_flags", nargs="*", help="extra flags for gpt2serve serve (after --)")
    args = parser.parse_args()

    ours, _, ours_url = launch("random:gpt2", None, "--dtype", "float32", *args.serve_flags)
    try:
        theirs = start_litserve(args.litserve_port, Path(args.deps))
    except BaseException:  # e.g. LitServe not installed: ours must not outlive the bench
        os.killpg(ours.pid, signal.SIGTERM)
        ours.wait(timeout=60)
        raise
    urls = {"gpt2serve": ours_url, "litserve": f"http://127.0.0.1:{args.litserve_port}"}
    prompts = make_prompts(256, 5, 50257)
    rates: dict[str, list[float]] = {"gpt2serve": [], "litserve": []}
    batches: dict[str, list[float]] = {"gpt2serve": [], "litserve": []}
    try:
        for round_index in range(args.rounds):
            for name in (("gpt2serve", "litserve") if round_index % 2 == 0 else ("litserve", "gpt2serve")):
                samples = asyncio.run(load_rest(urls[name], prompts, args.clients, args.round_s, 1.0))
                load = samples.summary("rest", args.clients, args.round_s)
                rates[name].append(load.req_per_s)
                batches[name].append(load.mean_batch_size)
                print(f"round {round_index}: {name}: {load.req_per_s:.1f} req/s, mean batch {load.mean_batch_size:.1f},"
                      f" p50 {load.p50_ms:.0f} ms, errors {load.errors}", flush=True)
    finally:
        for proc in (ours, theirs):
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
    report = {"serve_flags": args.serve_flags, "clients": args.clients, "rounds": args.rounds, "round_s": args.round_s, "req_per_s": rates,
              "mean_batch": batches, "gpt2serve_over_litserve_total": sum(rates["gpt2serve"]) / sum(rates["litserve"]),
              "pair_ratios": [o / t for o, t in zip(rates["gpt2serve"], rates["litserve"])]}
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
