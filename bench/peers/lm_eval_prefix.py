"""lm-evaluation-harness multiple choice against the server with the prefix cache and without
(`--prefix-cache-mb 0`), in one run, alternating, on one checkpoint (GPT-2 small's shape, random
weights, saved here; see bench/peers/lm_eval_wall.py).

The task is written here: each document is a paragraph of this repository's README (100-400
tokens) and a question, with four one-word answers, so the four requests of a document share
everything but their last token, as reading-comprehension tasks (RACE, SciQ with support) do.
Prints each run's wall time, the ratio, and whether both chose the same answers (log-likelihoods
within what batching moves them).

    .venv/bin/python bench/peers/lm_eval_prefix.py [--docs 40] [--concurrent 2] [--batch-size 32] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lm_eval_wall import OFFLINE, save_checkpoint
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: local_server
from local_server import launch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TASK = """task: gpt2serve_passage
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{passage}}}}\\nQuestion: which word is in the passage above?\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def write_task(folder: Path, docs: int) -> None:
    paragraphs = [p.strip() for p in (ROOT / "README.md").read_text().split("\n\n") if 500 <= len(p.strip()) <= 1600]
    rng = random.Random(0)
    vocabulary = sorted({w for p in paragraphs for w in re.findall(r"[a-z]{5,}", p)})
    rows = []
    for i in range(docs):
        passage = paragraphs[i % len(paragraphs)]
        inside = sorted(set(re.findall(r"[a-z]{5,}", passage)))
        outside = [w for w in rng.sample(vocabulary, 40) if w not in passage][:3]
        choices = [" " + rng.choice(inside)] + [" " + w for w in outside]
        rows.append({"passage": passage, "choices": choices, "label": 0})
    (folder / "passage.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "passage.yaml").write_text(TASK.format(data="passage.jsonl"))


def run(tasks: Path, out: Path, checkpoint: Path, http: str, args) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run(
        [str(Path(sys.executable).parent / "lm_eval"), "run", "--model", "local-completions", "--model_args",
         f"model={checkpoint},base_url={http}/v1/completions,tokenizer_backend=huggingface,tokenizer={checkpoint},"
         f"max_length=1024,num_concurrent={args.concurrent},max_retries=1", "--tasks", "gpt2serve_passage",
         "--include_path", str(tasks), "--output_path", str(out), "--batch_size", str(args.batch_size),
         "--log_samples"],
        cwd=tasks, env={**os.environ, **OFFLINE}, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    chosen = sorted(str(p) for p in out.rglob("samples_*.jsonl"))
    answers = "".join(Path(p).read_text() for p in chosen)
    docs = sorted((json.loads(line) for line in answers.splitlines()), key=lambda d: d["doc_id"])
    return time.perf_counter() - started, [[float(r[0]) for r in d["filtered_resps"]] for d in docs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=40)
    parser.add_argument("--concurrent", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        checkpoint, tasks = tmp / "ckpt", tmp / "tasks"
        tasks.mkdir()
        save_checkpoint(checkpoint)
        write_task(tasks, args.docs)
        # lm-eval sends a batch as one request of `--batch-size` generations (max_tokens 1): on a
        # CPU the last of them can wait longer than the default 30 s for their prefill.
        common = ("--device", "cpu", "--dtype", "float32", "--max-queue-wait-s", "600")
        servers = {name: launch(str(checkpoint), None, *common, *flags)
                   for name, flags in (("cache", ()), ("no cache", ("--prefix-cache-mb", "0")))}
        walls, picks = {name: [] for name in servers}, {}
        try:
            for round_ in range(args.rounds):
                order = list(servers) if round_ % 2 == 0 else list(reversed(servers))
                for name in order:
                    wall, chosen = run(tasks, tmp / f"out-{name}-{round_}".replace(" ", "-"), checkpoint,
                                       servers[name][2], args)
                    walls[name].append(wall)
                    picks[name] = chosen  # the last round's: with the cache, its hits
                    print(f"round {round_ + 1} {name}: {wall:.1f} s", file=sys.stderr, flush=True)
        finally:
            for proc, _, _ in servers.values():
                proc.terminate()
                proc.wait()
    cached, plain = statistics.median(walls["cache"]), statistics.median(walls["no cache"])
    print(f"lm-eval multiple choice, {args.docs} passages x 4 choices, batch {args.batch_size} x "
          f"{args.concurrent} concurrent: with the cache {cached:.1f} s, --prefix-cache-mb 0 {plain:.1f} s, "
          f"ratio {plain / cached:.2f}x (rounds: {walls})")
    with_cache, without = picks["cache"], picks["no cache"]
    same_choice = all(max(range(len(a)), key=a.__getitem__) == max(range(len(b)), key=b.__getitem__)
                      for a, b in zip(with_cache, without))
    worst = max(abs(x - y) for a, b in zip(with_cache, without) for x, y in zip(a, b))
    print(f"same choice for every document both ways: {same_choice}; largest log-likelihood difference {worst:.2e}")


if __name__ == "__main__":
    main()
