"""What tracing a generation's steps costs (trace_steps), measured in one run on one server.

One client generates `--tokens` tokens greedily from a 5-token prompt, alternating untraced and
traced requests (gRPC streaming, ignore_eos, idle between requests), and reports per kind the
median time to the last token, the time per output token after the first, and the response's
size; the cost is traced / untraced. Off by default means the untraced request is the plain
generation: no step tracer exists for it (service.step_trace).

A traced step is a next-token forward over the sequence so far with the layer probe and full
attention maps, beside the generation, so its cost grows with the sequence (the attention maps
are [n_layer, n_head, L, L] each step) and the steps stream as they are traced.

    .venv/bin/python bench/serving/step_traces.py [--model random:gpt2] [--tokens 32] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from gpt2serve_client import Client
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: local_server
from local_server import launch  # noqa: E402

PROMPT = [464, 3139, 286, 4881, 318]  # "The capital of France is"


def one(client: Client, tokens: int, traced: bool) -> dict:
    started = time.perf_counter()
    arrivals, size = [], 0
    for chunk in client.generate_stream(PROMPT, max_tokens=tokens, temperature=0, ignore_eos=True,
                                        trace_steps=traced, timeout=600):
        if chunk.token is not None:
            arrivals.append(time.perf_counter())
            size += chunk.to_proto().ByteSize()
    total = arrivals[-1] - started
    tpot = (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1)
    return {"last_token_s": total, "tpot_ms": tpot * 1000, "bytes": size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:gpt2")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    proc, grpc_target, _ = launch(args.model, None, "--device", "cpu", "--kv-cache-mb", "512")
    try:
        runs: dict[str, list[dict]] = {"untraced": [], "traced": []}
        with Client(grpc_target) as client:
            one(client, 4, False), one(client, 4, True)  # warm both paths
            for _ in range(args.rounds):
                for kind in ("untraced", "traced"):
                    runs[kind].append(one(client, args.tokens, kind == "traced"))
                    time.sleep(0.2)
        summary = {kind: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for kind, rs in runs.items()}
        summary["traced / untraced"] = {key: summary["traced"][key] / summary["untraced"][key]
                                        for key in summary["traced"]}
        print(json.dumps({"model": args.model, "tokens": args.tokens, "rounds": args.rounds, **summary}, indent=1))
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
