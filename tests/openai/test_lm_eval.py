"""lm-evaluation-harness as a real client: `lm_eval --model local-completions` against a real
server, and `lm_eval --model hf` in process, on the same checkpoint saved here (alone, and with a
peft LoRA adapter: served by name with --lora-modules, and loaded by hf's `peft=`) and on our own
local tasks (tests/support/lm_eval_tasks: a LAMBADA-style loglikelihood, a multiple choice, and
loglikelihood_rolling over documents, one longer than the context). Every item's log-likelihood
agrees within 1e-4 (plus a few float32 ulps for long documents' sums), every is-greedy flag and
the accuracies exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.lora import make_adapter
from support.reference import transformers_random_model
from support.servers import launch_server

from gpt2serve.engine.tokenizer import bundled_gpt2_tokenizer

pytestmark = pytest.mark.slow

TASKS_DIR = Path(__file__).resolve().parents[1] / "support" / "lm_eval_tasks"
TASKS = ["gpt2serve_cloze", "gpt2serve_choice", "gpt2serve_rolling"]
# local-completions keeps one token of its max_length for the generated one and, when rolling,
# one more: with max_length 1,024 its windows are 1,022 tokens (plus the generated one). The hf
# model gets the same windows with max_length 1022.
WINDOW = 1022
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("lm_eval") / "ckpt"
    transformers_random_model(seed=7, n_positions=1024).save_pretrained(path)
    bundled_gpt2_tokenizer()._tok.save_pretrained(path)  # lm_eval's huggingface tokenizer reads it from here
    return path


def lm_eval(out: Path, *args: str) -> float:
    """Run the harness's CLI on our tasks; its wall time in seconds."""
    started = time.perf_counter()
    command = [str(Path(sys.executable).parent / "lm_eval"), "run", *args, "--tasks", ",".join(TASKS),
               "--include_path", str(TASKS_DIR), "--output_path", str(out), "--log_samples", "--batch_size", "16"]
    done = subprocess.run(command, cwd=TASKS_DIR, env={**os.environ, **OFFLINE}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return time.perf_counter() - started


def samples(out: Path, task: str) -> dict[tuple[int, int], tuple[float, bool]]:
    """(doc, request) -> (log-likelihood, is greedy) as the harness logged them."""
    (path,) = out.rglob(f"samples_{task}_*.jsonl")
    items = {}
    for line in path.read_text().splitlines():
        sample = json.loads(line)
        for index, response in enumerate(sample["resps"]):
            value = response[0]
            logprob, greedy = (value, None) if not isinstance(value, list) else value
            items[(sample["doc_id"], index)] = (float(logprob), None if greedy is None else greedy in (True, "True"))
    return items


def metrics(out: Path) -> dict:
    (path,) = out.rglob("results_*.json")
    return json.loads(path.read_text())["results"]


@pytest.mark.parametrize("adapter", [None, "tuned"])
def test_lm_eval_against_the_server_agrees_with_lm_eval_in_process(checkpoint, tmp_path, adapter):
    lora, model, peft = [], checkpoint, ""
    if adapter is not None:  # rank 8 on every target module, random non-zero weights
        path = make_adapter(checkpoint, tmp_path / adapter, 8, ["c_attn", "c_proj", "c_fc"], 16, False, seed=2)
        lora, model, peft = ["--lora-modules", f"{adapter}={path}"], adapter, f",peft={path}"
    server = launch_server(tmp_path, "--model", str(checkpoint), *lora)
    try:
        served_s = lm_eval(tmp_path / "served", "--model", "local-completions", "--model_args",
                           f"model={model},base_url={server.http_url}/v1/completions,tokenizer_backend=huggingface,"
                           f"tokenizer={checkpoint},max_length={WINDOW + 2},num_concurrent=4,max_retries=1")
    finally:
        server.stop()
    local_s = lm_eval(tmp_path / "local", "--model", "hf", "--device", "cpu", "--model_args",
                      f"pretrained={checkpoint},dtype=float32,max_length={WINDOW}{peft}")
    print(f"lm_eval wall time: local-completions against the server {served_s:.1f} s, hf in process {local_s:.1f} s")
    for task in TASKS:
        served, local = samples(tmp_path / "served", task), samples(tmp_path / "local", task)
        assert served.keys() == local.keys() and served
        for key, (logprob, greedy) in local.items():
            # hf's value is a float32 sum: a few of its ulps (2**-23 relative) at this size, and 1e-4
            assert abs(served[key][0] - logprob) <= 1e-4 + 4 * 2**-23 * abs(logprob), (task, key, served[key], logprob)
            assert served[key][1] == greedy, (task, key)
    served_metrics, local_metrics = metrics(tmp_path / "served"), metrics(tmp_path / "local")
    for task in ("gpt2serve_cloze", "gpt2serve_choice"):
        for name in ("acc,none", "acc_norm,none"):
            assert served_metrics[task].get(name) == local_metrics[task].get(name), (task, name)
    for name in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none", "perplexity,none"):
        for task in TASKS:
            if name in local_metrics[task]:
                assert served_metrics[task][name] == pytest.approx(local_metrics[task][name], rel=1e-4), (task, name)
