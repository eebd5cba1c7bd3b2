"""gpt2serve against llama.cpp's llama-server, side by side in one run, on one GPT-2 124M
checkpoint (bench/peers/llamacpp_build.sh makes it, as a transformers directory and as GGUF).

    bench/peers/llamacpp_build.sh                       # once: .llamacpp/
    .venv/bin/python bench/peers/llamacpp_side_by_side.py [--servers ours:int8,llama:q8_0,ours:fp16,llama:f16]
        [--streams 1,4,16] [--rounds 3] [--duration 8] [--ttft-streams 1,8 --ttft-prompt-tokens 512]

Every server is started first (ours: `--model .llamacpp/ckpt --quantize MODE --workers 1`;
llama-server: 16 slots, continuous batching, 2 threads), then for each stream count the rounds
alternate between them: S closed-loop callers streaming `/v1/completions` (a 16-token prompt,
64 new tokens, ignore_eos, temperature 0). Printed per server: the medians over rounds of
tokens/s and of time per output token (p50 within a round, from the arrival of the chunks), the
RSS of its process tree after the last stream count, and how many distinct greedy texts it gave
(1: its answers do not depend on what shares their batch).

With --ttft-streams, first (same alternation): S closed-loop callers each sending a new prompt of
random token ids (nothing of it cached by either server) for one streamed token; printed: the
median time to first token over rounds (each round's median).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "The capital of France is a city that has been the home of many famous people, and"  # 16 GPT-2 tokens


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(server: str, workdir: Path, log_dir: Path) -> tuple[subprocess.Popen, str]:
    kind, mode = server.split(":")
    port = free_port()
    log = open(log_dir / f"{kind}-{mode}.log", "w")
    if kind == "ours":
        command = [sys.executable, "-m", "gpt2serve.cli", "serve", "--model", str(workdir / "ckpt"), "--quantize", mode,
                   "--workers", "1", "--host", "127.0.0.1", "--http-port", str(port), "--grpc-port", str(free_port())]
        env = None
    else:
        command = [str(workdir / "build/bin/llama-server"), "-m", str(workdir / f"gpt2-{mode}.gguf"), "-np", "16",
                   "-cb", "-c", "16384", "-t", str(os.cpu_count()), "--host", "127.0.0.1", "--port", str(port)]
        env = {**os.environ, "LD_LIBRARY_PATH": str(workdir / "build/bin")}
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    raise RuntimeError(f"{server} did not start: see {log.name}")


async def stream_once(http: httpx.AsyncClient, url: str, model: str) -> tuple[list[float], str]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 64, "temperature": 0, "stream": True, "ignore_eos": True}
    arrivals, text = [], []
    async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            for choice in json.loads(line[5:]).get("choices", []):
                if choice.get("text"):
                    arrivals.append(time.perf_counter())
                    text.append(choice["text"])
    return arrivals, "".join(text)


async def one_round(url: str, model: str, streams: int, duration_s: float) -> tuple[float, float, set[str]]:
    tokens, tpots, texts = 0, [], set()
    end = time.perf_counter() + duration_s
    # A connection per request: llama-server closes idle keep-alive connections.
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        async def caller() -> None:
            nonlocal tokens
            while time.perf_counter() < end:
                arrivals, text = await stream_once(http, url, model)
                tokens += len(arrivals)
                texts.add(text)
                if len(arrivals) > 1:
                    tpots.append((arrivals[-1] - arrivals[0]) / (len(arrivals) - 1))

        started = time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(streams)))
        wall = time.perf_counter() - started
    return tokens / wall, 1e3 * statistics.median(tpots) if tpots else float("nan"), texts


async def first_token_s(http: httpx.AsyncClient, url: str, model: str, prompt: list[int]) -> float:
    """Seconds from sending a streamed one-token completion of `prompt` (token ids) to its text."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True}
    started = time.perf_counter()
    async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data:") and line.strip() != "data: [DONE]":
                if any(c.get("text") is not None for c in json.loads(line[5:]).get("choices", [])):
                    return time.perf_counter() - started
    raise AssertionError("no token came back")


async def ttft_round(url: str, model: str, streams: int, duration_s: float, prompt_tokens: int,
                     prompts: random.Random) -> float:
    """Median time to first token of S closed-loop callers, each prompt new (random ids: no
    prefix of it is cached, by either server)."""
    times: list[float] = []
    end = time.perf_counter() + duration_s
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_keepalive_connections=0)) as http:
        async def caller() -> None:
            while time.perf_counter() < end or not times:
                prompt = [prompts.randrange(256, 50000) for _ in range(prompt_tokens)]
                times.append(await first_token_s(http, url, model, prompt))

        await asyncio.gather(*(caller() for _ in range(streams)))
    return 1e3 * statistics.median(times)


def rss_tree_mib(pid: int) -> float:
    """RSS of a process and all its descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError):
                continue
            children.setdefault(parent, []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        todo += children.get(current, [])
        try:
            total += next(int(line.split()[1]) for line in open(f"/proc/{current}/status") if line.startswith("VmRSS:"))
        except (FileNotFoundError, StopIteration):
            pass
    return total / 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", default="ours:int8,llama:q8_0,ours:fp16,llama:f16")
    parser.add_argument("--workdir", default=str(ROOT / ".llamacpp"))
    parser.add_argument("--streams", default="1,4,16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--ttft-streams", default="",
                        help="also time to first token of new prompts at these concurrencies (e.g. 1,8)")
    parser.add_argument("--ttft-prompt-tokens", type=int, default=512)
    parser.add_argument("--json", help="write every round's numbers here too")
    args = parser.parse_args()
    workdir = Path(args.workdir)
    names, stream_counts = args.servers.split(","), [int(s) for s in args.streams.split(",") if s]
    running = {}
    try:
        for name in names:
            running[name] = start(name, workdir, workdir)
        models = {name: httpx.get(f"{url}/v1/models").json()["data"][0]["id"] for name, (_, url) in running.items()}
        rounds: dict[str, dict[int, list[tuple[float, float]]]] = {name: {s: [] for s in stream_counts} for name in names}
        texts: dict[str, set[str]] = {name: set() for name in names}
        rss: dict[str, float] = {}
        ttft_counts = [int(s) for s in args.ttft_streams.split(",") if s]
        ttft: dict[str, dict[int, list[float]]] = {name: {s: [] for s in ttft_counts} for name in names}
        prompts = random.Random(0)
        for streams in ttft_counts:
            for _ in range(args.rounds):
                for name in names:
                    _, url = running[name]
                    ttft[name][streams].append(asyncio.run(ttft_round(
                        url, models[name], streams, args.duration, args.ttft_prompt_tokens, prompts)))
        for streams in stream_counts:
            for _ in range(args.rounds):
                for name in names:  # alternating: each server's rounds see the same machine
                    proc, url = running[name]
                    tokens_s, tpot_ms, seen = asyncio.run(one_round(url, models[name], streams, args.duration))
                    rounds[name][streams].append((tokens_s, tpot_ms))
                    texts[name] |= seen
                    if streams == stream_counts[-1]:
                        rss[name] = max(rss.get(name, 0.0), rss_tree_mib(proc.pid))
    finally:
        for proc, _ in running.values():
            proc.terminate()
        for proc, _ in running.values():
            proc.wait(timeout=60)
    if ttft_counts:
        print(f"| server | " + " | ".join(f"TTFT p50, {args.ttft_prompt_tokens}-token prompts, {s} at once"
                                         for s in ttft_counts) + " |")
        print("|" + "---|" * (len(ttft_counts) + 1))
        for name in names:
            print(f"| {name} | " + " | ".join(f"{statistics.median(ttft[name][s]):.0f} ms" for s in ttft_counts) + " |")
    if not stream_counts:
        return 0
    header = "| server | " + " | ".join(f"tok/s at {s}" for s in stream_counts) + " | " + \
        " | ".join(f"TPOT p50 at {s}" for s in stream_counts) + f" | RSS at {stream_counts[-1]} | greedy texts |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for name in names:
        per = rounds[name]
        print(f"| {name} | " + " | ".join(f"{statistics.median(t for t, _ in per[s]):.1f}" for s in stream_counts) +
              " | " + " | ".join(f"{statistics.median(p for _, p in per[s]):.1f} ms" for s in stream_counts) +
              f" | {rss[name]:,.0f} MiB | {len(texts[name])} |")
    if args.json:
        Path(args.json).write_text(json.dumps({n: {str(s): v for s, v in r.items()} for n, r in rounds.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
