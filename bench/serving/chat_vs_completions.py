"""What chat costs over completions: one server, the same prompt as chat messages (through the
chat template) and as the template's token ids on /v1/completions, in alternating rounds.

Both go through the official `openai` client (AsyncOpenAI), non-streamed, greedy, `max_tokens`
new tokens each, `--clients` callers in a loop. Rounds alternate ABBA so a drift of this shared
machine hits both alike; the report gives the ratio of the totals and each pair's. It also times
the template's rendering and tokenizing in this process (the part chat adds to a request).

    .venv/bin/python bench/serving/chat_vs_completions.py [--model random:gpt2] [--clients 1 16] [--rounds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import time
from pathlib import Path

import openai

from gpt2serve.engine.tokenizer import bundled_gpt2_tokenizer
from gpt2serve.service.chat_template import ChatPrompts, template_from_flag
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: local_server
from local_server import launch  # noqa: E402

TEMPLATE = Path(__file__).resolve().parents[2] / "examples" / "chat-templates" / "chatml.jinja"
MESSAGES = [{"role": "system", "content": "You are a terse assistant. Answer in one sentence."},
            {"role": "user", "content": "Name a river in France."},
            {"role": "assistant", "content": "The Loire."},
            {"role": "user", "content": "And one in Germany, with the city it is best known for?"}]


def render_cost_us(repeat: int = 2000) -> tuple[list[int], float]:
    """The prompt ids, and the median time to render and tokenize the conversation (µs)."""
    prompts = ChatPrompts(bundled_gpt2_tokenizer(), template_from_flag(str(TEMPLATE)))

    async def timed() -> tuple[list[int], list[float]]:
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            ids = await prompts.prompt(MESSAGES)
            times.append(time.perf_counter() - start)
        return ids, times

    ids, times = asyncio.run(timed())
    return ids, statistics.median(times) * 1e6


async def load(base_url: str, api: str, model: str, ids: list[int], clients: int, seconds: float,
               max_tokens: int) -> tuple[int, int, float]:
    """(requests, completion tokens, seconds taken) of `clients` callers in a loop for about
    `seconds` (each caller's last request, started before then, is counted to its end)."""
    oai = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    settings = dict(model=model, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
    done = [0, 0]
    start = time.monotonic()
    stop_at = start + seconds

    async def caller() -> None:
        while time.monotonic() < stop_at:
            if api == "chat":
                answer = await oai.chat.completions.create(messages=MESSAGES, **settings)
            else:
                answer = await oai.completions.create(prompt=ids, **settings)
            done[0] += 1
            done[1] += answer.usage.completion_tokens

    await asyncio.gather(*(caller() for _ in range(clients)))
    elapsed = time.monotonic() - start
    await oai.close()
    return done[0], done[1], elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:gpt2")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=4, help="each round is one chat and one completions run")
    parser.add_argument("--round-s", type=float, default=10.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("serve_flags", nargs="*", help="extra flags for gpt2serve serve (after --)")
    args = parser.parse_args()

    ids, render_us = render_cost_us()
    print(f"template render + tokenize: {render_us:.0f} µs for {len(MESSAGES)} messages, {len(ids)} tokens", flush=True)
    proc, _, http_url = launch(args.model, None, "--chat-template", str(TEMPLATE), *args.serve_flags)
    report = {"model": args.model, "prompt_tokens": len(ids), "max_tokens": args.max_tokens, "round_s": args.round_s,
              "render_us": round(render_us, 1), "serve_flags": args.serve_flags, "by_clients": {}}
    try:
        model = openai.OpenAI(base_url=f"{http_url}/v1", api_key="unused").models.list().data[0].id
        for clients in args.clients:
            tokens: dict[str, list[float]] = {"chat": [], "completions": []}
            for round_index in range(args.rounds):
                for api in (("chat", "completions") if round_index % 2 == 0 else ("completions", "chat")):
                    requests, generated, elapsed = asyncio.run(load(http_url, api, model, ids, clients,
                                                                    args.round_s, args.max_tokens))
                    tokens[api].append(generated / elapsed)
                    print(f"{clients} clients, round {round_index}: {api}: {requests} requests, "
                          f"{generated / elapsed:.1f} tok/s", flush=True)
            pairs = [c / p for c, p in zip(tokens["chat"], tokens["completions"])]
            report["by_clients"][clients] = {
                "tok_per_s": tokens, "chat_over_completions_total": sum(tokens["chat"]) / sum(tokens["completions"]),
                "pair_ratios": pairs, "pair_ratio_stdev": statistics.stdev(pairs) if len(pairs) > 1 else 0.0}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
