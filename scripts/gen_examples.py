"""Write the command-line examples in README.md and docs/ from real runs, so they cannot go stale.

An example is a marker line, then a fenced block:

    <!-- example: gpt2serve next "The capital of France is" -->
    ```sh
    $ .venv/bin/gpt2serve next "The capital of France is"
    ...what the command printed...
    ```

This starts `gpt2serve serve --model random:gpt2` (seed 0: the same weights everywhere, no hub
needed), runs each marked command against it (GPT2SERVE_TARGET), and writes its output (stdout,
then stderr) into the block. Timings differ from run to run: `--check` compares with every
"<number> ms" masked and other numbers within a relative 1e-6, rewrites nothing, and exits 1
naming each stale example (the suite runs it: tests/project/test_doc_examples.py).

    .venv/bin/python scripts/gen_examples.py [--check] [FILE ...]
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLE = re.compile(r"^<!-- example: (?P<command>gpt2serve .+?) -->\n```sh\n(?P<body>.*?)^```\n", re.M | re.S)
TIMING = re.compile(r"\d+(?:\.\d+)? ms")
NUMBER = re.compile(r"(-?\d+\.\d+|-?\d+)")  # split() keeps them at the odd places
SERVER_ARGS = ["--model", "random:gpt2", "--seed", "0", "--host", "127.0.0.1", "--grpc-port", "0", "--http-port", "0",
               "--disable-log-requests", "--log-stats-interval-s", "0"]


def start_server() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "gpt2serve.cli", "serve", *SERVER_ARGS], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    target, deadline = None, time.monotonic() + 300
    for line in proc.stdout:
        if match := re.search(r"gpt2serve listening: grpc=(\S+)", line):
            target = match.group(1)
        if line.startswith("gpt2serve ready:"):
            return proc, target
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise SystemExit("gen_examples: the server did not become ready")


def run(command: str, target: str) -> str:
    """The command's output, from its second run: the first warms the server's paths for it."""
    argv = shlex.split(command)
    for _ in range(2):
        done = subprocess.run([sys.executable, "-m", "gpt2serve.cli", *argv[1:]], capture_output=True, text=True,
                              timeout=300, env={**os.environ, "GPT2SERVE_TARGET": target})
    if done.returncode != 0:
        raise SystemExit(f"gen_examples: `{command}` failed: {done.stderr.strip()}")
    return f"$ .venv/bin/{command}\n{done.stdout}{done.stderr}".rstrip("\n") + "\n"


def masked(text: str) -> str:
    return TIMING.sub("N ms", text)


def same(example: str, output: str) -> bool:
    """Equal once timings are masked, every other number within a relative 1e-6: a sum over a
    forward's fp32 numbers moves in its last digits from one CPU's kernels to another's (AVX2
    against AVX-512), which is not a stale example."""
    parts = [NUMBER.split(masked(text)) for text in (example, output)]
    if len(parts[0]) != len(parts[1]):
        return False
    return all(a == b if i % 2 == 0 else math.isclose(float(a), float(b), rel_tol=1e-6)
               for i, (a, b) in enumerate(zip(*parts)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 naming the stale examples")
    parser.add_argument("files", nargs="*", type=Path, help="default: README.md and docs/*.md")
    args = parser.parse_args()
    files = args.files or FILES
    proc, target = start_server()
    stale = []
    try:
        for path in files:
            text = path.read_text()
            outputs = {m["command"]: run(m["command"], target) for m in EXAMPLE.finditer(text)}
            for m in EXAMPLE.finditer(text):
                if not same(m["body"], outputs[m["command"]]):
                    stale.append(f"{path.name}: {m['command']}")
            if not args.check and outputs:
                path.write_text(EXAMPLE.sub(lambda m: f"<!-- example: {m['command']} -->\n```sh\n"
                                                      f"{outputs[m['command']]}```\n", text))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    for line in stale:
        print(f"{'stale' if args.check else 'refreshed'}: {line}")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    raise SystemExit(main())
