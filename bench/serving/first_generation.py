"""Ready means warm: the first generation after `gpt2serve ready` against a steady one.

Starts `gpt2serve serve` (the `gpt2serve` on PATH, or --python's module), waits for its ready
line, then times one generation at once and --steady more after it, all greedy and alike, and
reads the server's resident memory before and after the first. Prints one line per run.

    .venv/bin/python bench/serving/first_generation.py --model random:gpt2 --max-tokens 16 --steady 5
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpt2serve_client import Client

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: local_server
from local_server import rss_mib  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:gpt2")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--steady", type=int, default=5)
    parser.add_argument("--python", default=sys.executable, help="the interpreter whose gpt2serve to start")
    parser.add_argument("serve_args", nargs="*", help="more `serve` flags (after --)")
    args = parser.parse_args()
    log = tempfile.NamedTemporaryFile("w+", suffix=".log")
    started = time.perf_counter()
    server = subprocess.Popen([args.python, "-m", "gpt2serve.cli", "serve", "--model", args.model, "--host",
                               "127.0.0.1", "--grpc-port", "0", "--http-port", "0", "--device", "cpu",
                               *args.serve_args], stdout=log, stderr=subprocess.STDOUT)
    try:
        while not re.search(r"gpt2serve ready", open(log.name).read()):
            if server.poll() is not None:
                print(open(log.name).read(), file=sys.stderr)
                return 1
            time.sleep(0.05)
        ready_s = time.perf_counter() - started
        target = re.search(r"grpc=(\S+)", open(log.name).read()).group(1)
        with Client(target, timeout=300) as client:
            client.health()  # the channel is connected: what follows times the server, not the dial
            before = rss_mib(server.pid)

            def one() -> float:
                t0 = time.perf_counter()
                client.generate("The first generation after ready", max_tokens=args.max_tokens, temperature=0,
                                ignore_eos=True)
                return time.perf_counter() - t0

            first = one()
            after = rss_mib(server.pid)
            steady = statistics.median(one() for _ in range(args.steady))
        print(f"{args.model}: ready after {ready_s:.1f} s; first generation {first * 1000:.0f} ms, steady "
              f"(median of {args.steady}) {steady * 1000:.0f} ms, ratio {first / steady:.2f}; "
              f"RSS {before:.0f} -> {after:.0f} MiB across the first")
    finally:
        server.terminate()
        server.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
