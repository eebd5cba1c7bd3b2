"""Soak: minutes of mixed load on `--workers 2`, one front end killed -9 halfway, and what the
server says of it held against what the clients saw.

Load (closed loops, `--clients` of them): gRPC NextToken, NextTokenBatch and Generate streams;
REST next-token and generate streams; OpenAI completions (streamed and whole), scoring (echo with
logprobs, no new token) and chat, streamed; a share of streams hung up early, and a share of
requests the server must refuse. Every `--sample-s` each server process's RSS is read from /proc.
Before the clock starts, every block of the prefix cache's pool is written once (its pages become
resident as blocks are first written, up to --prefix-cache-mb: bounded, not growth).

Pass, as printed at the end ("pass": true):
- RSS: each process grows at most 5%, the median of its last minute against that of the minute
  after `--settle-s` (a restarted front end from its own start; shorter runs use shorter windows;
  one without two windows of samples is reported only);
- nothing accepted is left unanswered: every failure is a refusal with its status, a hang-up of
  the client's own, or a broken connection within 10 s of the kill (counted apart: the killed
  front end's calls);
- at the end no request is in flight and no sequence running or waiting, the KV cache is empty;
- the server's gpt2serve_requests_total equals the clients' counts per API, method and status,
  up to the killed front end's calls (each may or may not have been counted before it died) and
  hang-ups that crossed a stream's end (the client's CANCELLED, the server's OK: it finished the
  stream before it saw the hang-up; `counter_mismatches`).

    .venv/bin/python bench/soak/soak.py [--seconds 900] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable

import grpc
import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from gpt2serve_client import AsyncClient, Gpt2ServeError
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: local_server
from local_server import launch  # noqa: E402

MODEL = "random:gpt2"
CHAT_TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
PREFIX_CACHE_MB = 64
KILL_WINDOW_S = 10.0  # broken connections this soon after the kill are the killed front end's
STATUS_CODES = {400: "INVALID_ARGUMENT", 429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED",
                500: "INTERNAL"}


class Lost(Exception):
    """The connection broke under a call: no answer, no status."""


class Tally:
    def __init__(self):
        self.outcomes: Counter[tuple[str, str, str]] = Counter()  # (api, method, code) -> calls
        self.lost: Counter[tuple[str, str]] = Counter()  # (api, method): broken near the kill
        self.unanswered: list[str] = []  # broken away from the kill, or failed after it began
        self.killed_at: float | None = None

    def broke(self, api: str, method: str, error: BaseException) -> None:
        if self.killed_at is not None and 0 <= time.monotonic() - self.killed_at <= KILL_WINDOW_S:
            self.lost[(api, method)] += 1
        else:
            self.unanswered.append(f"{api} {method}: {error!r}"[:300])


def prompt(rng: random.Random, longest: int = 48) -> list[int]:
    return [rng.randrange(50000) for _ in range(rng.randint(1, longest))]


async def read_stream(chunks: AsyncIterator, hang_up_after: int | None, close: Callable[[], Awaitable]) -> str:
    """A stream read to its end ("OK"), or hung up on (`close`) after `hang_up_after` items ("CANCELLED")."""
    got = 0
    try:
        async for _ in chunks:
            got += 1
            if got == hang_up_after:
                return "CANCELLED"
        return "OK"
    finally:
        await close()  # a no-op once the stream has ended


async def one_call(rng: random.Random, grpc_client: AsyncClient, http: httpx.AsyncClient, oa: openai.AsyncOpenAI,
                   tally: Tally) -> None:
    """One call of a kind drawn at random; its outcome counted as the server should count it."""
    kind = rng.random()
    hang_up_after = rng.randint(1, 6) if rng.random() < 0.3 else None  # chunks, then close
    steps = rng.randint(8, 24)
    api, method, code = "grpc", "NextToken", "OK"
    try:
        if kind < 0.14:
            await grpc_client.next_token(prompt(rng), top_k=rng.choice([3, 3, 3, 0]))  # 0: refused
        elif kind < 0.22:
            method = "NextTokenBatch"
            await grpc_client.next_token_batch([prompt(rng) for _ in range(rng.randint(2, 6))])
        elif kind < 0.36:
            method = "Generate"
            chunks = grpc_client.generate_stream(prompt(rng), max_tokens=steps, temperature=0.8,
                                                 seed=rng.randrange(1000), ignore_eos=True)
            code = await read_stream(chunks, hang_up_after, chunks.aclose)  # closing it hangs up
        elif kind < 0.46:
            api = "rest"
            body = {"prompt_token_ids": prompt(rng), "top_k": 3} if rng.random() > 0.1 else {"prompt": "x", "top_k": 0}
            response = await http.post("/v1/next-token", json=body)
            code = "OK" if response.status_code == 200 else response.json()["error"]["code"]
        elif kind < 0.56:
            api, method = "rest", "Generate"
            body = {"prompt_token_ids": prompt(rng), "max_tokens": steps, "stream": True, "ignore_eos": True}
            async with http.stream("POST", "/v1/generate", json=body) as response:
                got = 0
                async for line in response.aiter_lines():
                    got += line.startswith("data:")
                    if line.startswith("event: error"):
                        return tally.unanswered.append("rest Generate: an error event mid-stream")
                    if hang_up_after is not None and got == hang_up_after:
                        code = "CANCELLED"
                        break
        elif kind < 0.78:
            api, method = "openai", "Completions"
            if kind < 0.64:  # scoring: the prompt's logprobs, no new token
                await oa.completions.create(model=MODEL, prompt=prompt(rng, 96), max_tokens=0, echo=True, logprobs=1)
            elif kind < 0.66:
                await oa.completions.create(model=MODEL, prompt="x", max_tokens=5000)  # refused: past the context
            elif kind < 0.70:
                await oa.completions.create(model=MODEL, prompt=prompt(rng), max_tokens=steps, temperature=0)
            else:
                stream = await oa.completions.create(model=MODEL, prompt=prompt(rng), max_tokens=steps, stream=True,
                                                     extra_body={"ignore_eos": True})
                code = await read_stream(stream, hang_up_after, stream.close)
        else:
            api, method = "openai", "ChatCompletions"
            stream = await oa.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Say {rng.randrange(1000)} things."}],
                max_tokens=steps, stream=True, extra_body={"ignore_eos": True})
            code = await read_stream(stream, hang_up_after, stream.close)
    except Gpt2ServeError as exc:
        if exc.code == "UNAVAILABLE" and "shutting down" not in exc.message and "loading" not in exc.message:
            return tally.broke(api, method, exc)  # the connection broke (grpc's own UNAVAILABLE)
        code = exc.code
    except openai.APIStatusError as exc:
        code = STATUS_CODES.get(exc.status_code, str(exc.status_code))
    except (openai.APIConnectionError, httpx.TransportError, grpc.aio.AioRpcError) as exc:
        return tally.broke(api, method, exc)
    tally.outcomes[(api, method, code)] += 1


def fill_prefix_cache(http_url: str, tally: Tally) -> None:
    """Write every block of the prefix cache's pool before the clock starts. The pool is claimed at
    start, but a CPU's pages become resident only as blocks are first written: without this a
    minute's run judges the pool filling (bounded by --prefix-cache-mb, by design) as growth.
    Distinct 6-block prompts, each sent twice (the doorkeeper keeps a block the second time)."""
    from gpt2serve.engine.gpt2 import GPT2Config  # random:gpt2's shape, fp32
    from gpt2serve.engine.prefix_cache import BLOCK, PrefixCache
    import torch
    capacity = PREFIX_CACHE_MB * 2**20 // PrefixCache.bytes_per_block(GPT2Config(), torch.float32)
    rng, blocks_per_prompt = random.Random(-1), 6
    with httpx.Client(base_url=http_url, timeout=120) as http:
        for _ in range(-(-capacity // blocks_per_prompt) + 1):
            tokens = [rng.randrange(50000) for _ in range(blocks_per_prompt * BLOCK)]
            for _ in range(2):
                http.post("/v1/next-token", json={"prompt_token_ids": tokens}).raise_for_status()
                tally.outcomes[("rest", "NextToken", "OK")] += 1  # the server counts these too


def processes(server_pid: int) -> dict[str, int]:
    """The server's processes by title (setproctitle): supervisor, engine, front end N."""
    found = {}
    for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
        try:
            title = open(f"/proc/{pid}/cmdline").read().replace("\0", " ").strip()
            parent = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(pid) == server_pid or (parent == server_pid and title.startswith("gpt2serve: ")):
            found["supervisor" if int(pid) == server_pid else title.removeprefix("gpt2serve: ")] = int(pid)
    return found


def rss_mib(pid: int) -> float | None:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except FileNotFoundError:
        return None
    return None


def scrape(http_url: str) -> dict:
    """requests_total by (api, method, code), and the gauges the end is judged on."""
    text = httpx.get(f"{http_url}/metrics", timeout=30).text
    requests, gauges = Counter(), {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "gpt2serve_requests_total":
                labels = sample.labels
                requests[(labels["api"], labels["method"], labels["status"])] += int(sample.value)
            elif sample.name in ("gpt2serve_in_flight_requests", "gpt2serve_running_sequences",
                                 "gpt2serve_waiting_sequences", "gpt2serve_kv_cache_usage_ratio",
                                 "gpt2serve_front_ends_up"):
                gauges[sample.name.removeprefix("gpt2serve_")] = sample.value
    return {"requests": requests, "gauges": gauges}


async def soak(grpc_target: str, http_url: str, server_pid: int, tally: Tally, args) -> dict:
    started = time.monotonic()
    stop_at = started + args.seconds
    samples: list[dict] = []  # {"t_s", "process", "pid", "rss_mib"}

    async def client_loop(index: int) -> None:
        rng = random.Random(index)
        async with AsyncClient(grpc_target, retries=0, timeout=120) as grpc_client, \
                httpx.AsyncClient(base_url=http_url, timeout=120) as http, \
                openai.AsyncOpenAI(base_url=f"{http_url}/v1", api_key="unused", max_retries=0, timeout=120) as oa:
            while time.monotonic() < stop_at:
                await one_call(rng, grpc_client, http, oa, tally)

    async def sampler() -> None:
        while time.monotonic() < stop_at:
            now = round(time.monotonic() - started, 1)
            for name, pid in processes(server_pid).items():
                rss = rss_mib(pid)
                if rss is not None:
                    samples.append({"t_s": now, "process": name, "pid": pid, "rss_mib": round(rss, 1)})
            print(json.dumps({"t_s": now, "calls": sum(tally.outcomes.values()),
                              "rss_mib": {s["process"]: s["rss_mib"] for s in samples if s["t_s"] == now}}),
                  flush=True)
            await asyncio.sleep(min(args.sample_s, max(stop_at - time.monotonic(), 0.01)))

    async def killer() -> None:
        await asyncio.sleep(args.seconds * args.kill_at)
        victim = processes(server_pid)["front end 1"]
        tally.killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        print(json.dumps({"t_s": round(tally.killed_at - started, 1), "killed": "front end 1", "pid": victim}),
              flush=True)

    await asyncio.gather(sampler(), killer(), *(client_loop(i) for i in range(args.clients)))
    return {"samples": samples, "tally": tally, "killed_at_s": round(tally.killed_at - started, 1)}


def settled_end(http_url: str, timeout_s: float = 30.0) -> dict:
    """The metrics once the last hang-ups have reached the engine (a step boundary)."""
    deadline = time.monotonic() + timeout_s
    while True:
        seen = scrape(http_url)
        gauges = seen["gauges"]
        if (all(gauges.get(name, 0) == 0 for name in ("in_flight_requests", "running_sequences",
                                                      "waiting_sequences", "kv_cache_usage_ratio"))
                and gauges.get("front_ends_up") == 2) or time.monotonic() > deadline:
            return seen
        time.sleep(0.5)


def rss_growth(samples: list[dict], settle_s: float, seconds: float) -> dict:
    """Per process: the median RSS of a window just after its settle point against that of the
    last window (a batch of long prompts swings RSS by 10%+ and back: single samples would judge
    the swing, not a trend). A process with fewer than two windows' samples is reported only."""
    growth = {}
    by_pid: dict[int, list[dict]] = {}
    for sample in samples:
        by_pid.setdefault(sample["pid"], []).append(sample)
    window_s = min(60.0, max(seconds - settle_s, 0.0) / 3)
    for pid, series in by_pid.items():
        born = series[0]["t_s"] if series[0]["t_s"] > 0 else 0.0  # a restarted front end: its own start
        after = [s for s in series if s["t_s"] >= born + settle_s]
        name = f"{series[0]['process']} (pid {pid})"
        first = [s["rss_mib"] for s in after if s["t_s"] < after[0]["t_s"] + window_s] if after else []
        last = [s["rss_mib"] for s in after if s["t_s"] > after[-1]["t_s"] - window_s] if after else []
        if not after or len(after) < 2 or after[-1]["t_s"] - after[0]["t_s"] < 2 * window_s:
            growth[name] = {"rss_mib_last": series[-1]["rss_mib"], "judged": False}
            continue
        settled, end = statistics.median(first), statistics.median(last)
        growth[name] = {"rss_mib_settled": settled, "rss_mib_end": end,
                        "rss_mib_min_max": [min(s["rss_mib"] for s in after), max(s["rss_mib"] for s in after)],
                        "growth": round(end / settled - 1, 4), "judged": True}
    return growth


def counter_mismatches(counted: Counter, outcomes: Counter, lost: Counter) -> dict[str, dict[str, int]]:
    """(api, method, code) counts where the server's differ from the clients' beyond two races:
    - a call broken near the kill (`lost`) may have been counted by the server, under any code;
    - a hang-up that crosses a stream's end: the client hung up after its last event, or after
      one of the last, and the server had finished the stream (OK) before it saw the hang-up, so
      a call the client counts CANCELLED the server may count OK. Each such call moves one count
      from CANCELLED to OK, never away from both."""
    mismatches = {}
    for key in sorted(set(counted) | set(outcomes)):
        api, method, code = key
        client, server = outcomes.get(key, 0), counted.get(key, 0)
        allowed = lost.get((api, method), 0)
        ok_surplus = counted.get((api, method, "OK"), 0) - outcomes.get((api, method, "OK"), 0)
        cancelled_deficit = outcomes.get((api, method, "CANCELLED"), 0) - counted.get((api, method, "CANCELLED"), 0)
        raced = max(0, min(ok_surplus, cancelled_deficit))  # this method's hang-ups the server counted OK
        low, high = 0, allowed
        if code == "CANCELLED":
            low = -raced
        elif code == "OK":
            high += raced
        if client != server and not low <= server - client <= high:
            mismatches[" ".join(key)] = {"client": client, "server": server, "lost_near_kill": allowed,
                                         "hang_ups_counted_ok": raced}
    return mismatches


def judge(run: dict, end: dict, args) -> dict:
    tally: Tally = run["tally"]
    growth = rss_growth(run["samples"], args.settle_s, args.seconds)
    mismatches = counter_mismatches(end["requests"], tally.outcomes, tally.lost)
    gauges = end["gauges"]
    verdict = {
        "rss_within_5_percent": all(g["growth"] <= 0.05 for g in growth.values() if g["judged"]),
        "no_accepted_call_lost": not tally.unanswered,
        "slots_and_blocks_free": all(gauges.get(n, 0) == 0 for n in ("in_flight_requests", "running_sequences",
                                                                     "waiting_sequences", "kv_cache_usage_ratio")),
        "counters_equal_clients": not mismatches,
    }
    return {
        "seconds": args.seconds, "clients": args.clients, "killed_at_s": run["killed_at_s"],
        "calls": sum(tally.outcomes.values()), "lost_with_killed_front_end": sum(tally.lost.values()),
        "by_status": Counter(code for (_, _, code) in tally.outcomes.elements()),
        "by_call": {" ".join(k): v for k, v in sorted(tally.outcomes.items())},
        "rss": growth, "end_gauges": gauges, "counter_mismatches": mismatches,
        "unanswered": tally.unanswered[:20], "verdict": verdict, "pass": all(verdict.values()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=900)
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--sample-s", type=float, default=15)
    parser.add_argument("--settle-s", type=float, default=180, help="RSS growth is judged from this far into "
                                                                    "each process's life")
    parser.add_argument("--kill-at", type=float, default=0.5, help="share of the run after which front end 1 "
                                                                   "is killed -9")
    parser.add_argument("--json", help="write the report (and every RSS sample) here too")
    args = parser.parse_args()
    proc, grpc_target, http_url = launch(MODEL, None, "--workers", "2", "--chat-template", CHAT_TEMPLATE,
                                         "--kv-cache-mb", "256", "--prefix-cache-mb", str(PREFIX_CACHE_MB))
    try:
        tally = Tally()
        fill_prefix_cache(http_url, tally)
        run = asyncio.run(soak(grpc_target, http_url, proc.pid, tally, args))
        report = judge(run, settled_end(http_url), args)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({**report, "samples": run["samples"]}, out, indent=2)
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
