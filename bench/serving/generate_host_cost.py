"""Host CPU per generated token, per server process: what bounds streaming when the forward is
cheap (a GPU). Runs S concurrent Generate streams over one gRPC connection and reads, from
/proc, the CPU seconds each thread of the server and of its child processes spent meanwhile.

    gpt2serve serve --model random:tiny --device cpu --grpc-port 50061 [--workers 2] &
    .venv/bin/python bench/serving/generate_host_cost.py --pid $! --target 127.0.0.1:50061
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

from gpt2serve_client import AsyncClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: local_server
from local_server import family  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of the process."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / TICKS
    return out


def command(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:80]


async def load(target: str, streams: int, requests: int, new_tokens: int) -> tuple[int, float]:
    async with AsyncClient(target, timeout=600) as client:
        await client.generate([1, 2, 3], max_tokens=2, temperature=0)
        tokens, started = 0, time.perf_counter()

        async def stream(index: int) -> None:
            nonlocal tokens
            for _ in range(requests):
                result = await client.generate([100 + index, 200, 300, 400, 500], max_tokens=new_tokens,
                                               temperature=0, ignore_eos=True)
                tokens += result.usage.completion_tokens

        await asyncio.gather(*(stream(i) for i in range(streams)))
        return tokens, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pid", type=int, required=True, help="the server's process id")
    parser.add_argument("--target", default="127.0.0.1:50051")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--requests", type=int, default=3, help="per stream")
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()

    processes = family(args.pid)
    before = {p: thread_cpu(p) for p in processes}
    tokens, seconds = asyncio.run(load(args.target, args.streams, args.requests, args.new_tokens))
    after = {p: thread_cpu(p) for p in processes}
    print(f"{tokens} tokens in {seconds:.1f} s ({tokens / seconds:.0f} tokens/s), {args.streams} streams")
    print("| process | main thread us/token | all threads us/token |")
    print("|---|---|---|")
    for p in processes:
        spent = {t: after[p][t] - before[p].get(t, 0.0) for t in after[p]}
        main_us, all_us = 1e6 * spent.get(p, 0.0) / tokens, 1e6 * sum(spent.values()) / tokens
        if all_us >= 1:
            print(f"| {p} `{command(p)}` | {main_us:.0f} | {all_us:.0f} |")


if __name__ == "__main__":
    main()
