"""How close int8 generation's next-token distribution stays to fp32's: ours (`--quantize int8`,
in process) against llama.cpp's q8_0 (llama-server's `n_probs`), at the same positions of the same
checkpoint (bench/peers/llamacpp_build.sh makes it).

    .venv/bin/python bench/peers/llamacpp_accuracy.py [--prompts 64] [--tokens 48] [--top 10]

For each prompt (random token ids, seeded), at its last position: fp32's distribution from our
fp32 model (exact against transformers, see tests/engine/test_forward.py) is the reference.
Reported per quantized model: top-1 agreement with fp32, and the mean absolute error of the
log-probabilities of fp32's top `--top` tokens (llama-server gives log-probabilities of its own top
4 x `--top`, not logits; a token outside them is not compared).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

import httpx
import torch

from gpt2serve.engine.loading import load_model
from llamacpp_side_by_side import ROOT, start


def next_token_logprobs(model, prompt: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        logits = model(ids, torch.arange(len(prompt))[None], torch.ones_like(ids, dtype=torch.bool))  # (1, V)
    return torch.log_softmax(logits[0].float(), dim=-1)  # (V,)


def llama_logprobs(url: str, prompt: list[int], top: int) -> dict[int, float] | None:
    """llama-server's log-probabilities of its top tokens for the next position (before sampling)."""
    body = {"prompt": prompt, "n_predict": 1, "n_probs": top, "temperature": 0, "cache_prompt": False}
    answer = httpx.post(f"{url}/completion", json=body, timeout=120).json()
    if "completion_probabilities" not in answer:  # it sampled part of a character and holds it back
        return None
    return {entry["id"]: entry["logprob"] for entry in answer["completion_probabilities"][0]["top_logprobs"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=str(ROOT / ".llamacpp"))
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--top", type=int, default=10)
    args = parser.parse_args()
    workdir = Path(args.workdir)
    rng = random.Random(0)
    prompts = [[rng.randrange(50000) for _ in range(args.tokens)] for _ in range(args.prompts)]
    fp32 = load_model(str(workdir / "ckpt"), "cpu", "float32").model
    int8 = load_model(str(workdir / "ckpt"), "cpu", "float32", quantize="int8").model
    proc, url = start("llama:q8_0", workdir, workdir)
    agree = {"ours int8": 0, "llama q8_0": 0}
    errors: dict[str, list[float]] = {name: [] for name in agree}
    compared = skipped = 0
    try:
        for prompt in prompts:
            reference = next_token_logprobs(fp32, prompt)
            top_ids = reference.topk(args.top).indices.tolist()
            ours = next_token_logprobs(int8, prompt)
            theirs = llama_logprobs(url, prompt, 4 * args.top)
            if theirs is None:
                skipped += 1
                continue
            compared += 1
            agree["ours int8"] += int(ours.argmax()) == top_ids[0]
            agree["llama q8_0"] += max(theirs, key=theirs.get) == top_ids[0]
            for token in top_ids:
                errors["ours int8"].append(abs(float(ours[token]) - float(reference[token])))
                if token in theirs:  # outside llama's own top list: not comparable
                    errors["llama q8_0"].append(abs(theirs[token] - float(reference[token])))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print(f"| model | top-1 agreement with fp32 | mean abs error of the log-probabilities of fp32's top {args.top} |")
    print("|---|---|---|")
    for name in agree:
        print(f"| {name} | {agree[name]}/{compared} | {statistics.mean(errors[name]):.2e} "
              f"(n={len(errors[name])}) |")
    print(f"{skipped} prompt(s) skipped: llama-server's next token there was part of a character, which it "
          "holds back without log-probabilities")
    return 0


if __name__ == "__main__":
    sys.exit(main())
