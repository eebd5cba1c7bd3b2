"""lm-evaluation-harness' wall time on our local tasks (tests/support/lm_eval_tasks), two ways on one
checkpoint, in one run: `local-completions` against a gpt2serve server, and its own `hf` model
in process. The checkpoint is GPT-2 small's shape with transformers' random initialisation,
saved here with the GPT-2 tokenizer (no hub). Windows are the same both ways (see
tests/openai/test_lm_eval.py). Prints the two wall times and their ratio, and the two results tables.

    .venv/bin/python bench/peers/lm_eval_wall.py [--concurrent 4] [--batch-size 16]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: local_server
from local_server import launch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TASKS_DIR = ROOT / "tests" / "support" / "lm_eval_tasks"
TASKS = "gpt2serve_cloze,gpt2serve_choice,gpt2serve_rolling"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def save_checkpoint(path: Path) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from gpt2serve.engine.tokenizer import bundled_gpt2_tokenizer

    torch.manual_seed(7)
    GPT2LMHeadModel(GPT2Config()).eval().save_pretrained(path)  # GPT-2 small's shape, random weights
    bundled_gpt2_tokenizer()._tok.save_pretrained(path)


def lm_eval(out: Path, batch_size: int, *args: str) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run([str(Path(sys.executable).parent / "lm_eval"), "run", *args, "--tasks", TASKS,
                           "--include_path", str(TASKS_DIR), "--output_path", str(out), "--batch_size", str(batch_size)],
                          cwd=TASKS_DIR, env={**os.environ, **OFFLINE}, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    table = "\n".join(line for line in done.stdout.splitlines() if line.startswith("|"))
    return time.perf_counter() - started, table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrent", type=int, default=4, help="local-completions' num_concurrent")
    parser.add_argument("--batch-size", type=int, default=16, help="prompts per request / per hf batch")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "ckpt"
        save_checkpoint(checkpoint)
        proc, _, http = launch(str(checkpoint), None, "--device", "cpu", "--dtype", "float32")
        try:
            served_s, served = lm_eval(Path(tmp) / "served", args.batch_size, "--model", "local-completions",
                                       "--model_args", f"model={checkpoint},base_url={http}/v1/completions,"
                                       f"tokenizer_backend=huggingface,tokenizer={checkpoint},max_length=1024,"
                                       f"num_concurrent={args.concurrent},max_retries=1")
        finally:
            proc.terminate()
            proc.wait()
        local_s, local = lm_eval(Path(tmp) / "local", args.batch_size, "--model", "hf", "--device", "cpu",
                                 "--model_args", f"pretrained={checkpoint},dtype=float32,max_length=1022")
    print(f"local-completions against the server: {served_s:.1f} s\n{served}\n")
    print(f"hf in process: {local_s:.1f} s\n{local}\n")
    print(f"server / in process wall time: {served_s / local_s:.2f}")


if __name__ == "__main__":
    main()
