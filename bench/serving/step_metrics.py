"""A running server's generation steps, from its /metrics: per kind (prefill, decode), how many
steps, their mean time and mean sequences. With --since FILE, only what happened after FILE was
written by an earlier `--save FILE` run (the difference of two scrapes).

    .venv/bin/python bench/serving/step_metrics.py http://127.0.0.1:8000 --save /tmp/before.json
    ... load ...
    .venv/bin/python bench/serving/step_metrics.py http://127.0.0.1:8000 --since /tmp/before.json
"""

from __future__ import annotations

import argparse
import json

from gpt2serve.benchmarks.native_load import scrape

SERIES = ("gpt2serve_step_duration_seconds_count", "gpt2serve_step_duration_seconds_sum",
          "gpt2serve_step_sequences_sum")


def step_samples(url: str) -> dict[str, float]:
    """'name|kind' -> value, for the step histograms' counts and sums (a form --save can write)."""
    return {f"{name}|{dict(labels)['kind']}": value for (name, labels), value in scrape(url).items() if name in SERIES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url", help="the server's HTTP base URL")
    parser.add_argument("--save", help="write this scrape here (for a later --since)")
    parser.add_argument("--since", help="report only what came after this saved scrape")
    args = parser.parse_args()
    now = step_samples(args.url)
    if args.save:
        with open(args.save, "w") as f:
            json.dump(now, f)
        return
    before = json.load(open(args.since)) if args.since else {}
    delta = {k: v - before.get(k, 0.0) for k, v in now.items()}
    print("| step | steps | mean ms | mean sequences |")
    print("|---|---|---|---|")
    for kind in ("prefill", "decode"):
        steps = delta.get(f"gpt2serve_step_duration_seconds_count|{kind}", 0.0)
        if steps:
            print(f"| {kind} | {steps:,.0f} | {1000 * delta[f'gpt2serve_step_duration_seconds_sum|{kind}'] / steps:.2f} "
                  f"| {delta[f'gpt2serve_step_sequences_sum|{kind}'] / steps:.1f} |")
        else:
            print(f"| {kind} | 0 | | |")


if __name__ == "__main__":
    main()
