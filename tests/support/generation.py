"""Generation references shared by the engine, serving and GPU tests: lively random weights,
prompts of 1..46 tokens, transformers' greedy `generate`, and a scheduler run with staggered arrivals."""

from __future__ import annotations

import asyncio
import collections

import torch

from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from gpt2serve.engine.engine import Engine
from gpt2serve.engine.generator import Generator
from gpt2serve.engine.loading import load_model
from gpt2serve.protocol import GenerateRequest, SamplingParams
from gpt2serve.scheduling.core import EngineCore, new_engine_thread

from .reference import transformers_random_model
from .scheduler_events import events

LIVELY = dict(initializer_range=0.5)


GREEDY = SamplingParams(temperature=0.0)


PROMPTS = [[(100 + 37 * i + 11 * j) % 50257 for j in range(1 + 3 * i)] for i in range(16)]


def lively_engine(directory) -> tuple:
    """(transformers model with LIVELY weights, our engine over the same checkpoint, saved in
    `directory` and loaded from disk through the real path)."""
    hf = transformers_random_model(seed=3, **LIVELY)
    path = directory / "ckpt"
    hf.save_pretrained(path)
    return hf, Engine(load_model(str(path), "cpu", "float32"))


def transformers_greedy(hf, prompt: list[int], n: int) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def generation_core(generator: Generator, *, max_queue: int = 64, max_queue_wait_s: float = 60,
                    eos_token_id: int | None = None, observer=None, overlap: bool | None = None) -> EngineCore:
    """An engine core over this generator (and its engine), as a server builds one. overlap=True
    runs a CPU core as a cuda one runs: each decode step launched before the last one is read."""
    return EngineCore(generator, max_batch_size=64, max_batch_delay_s=0.001, max_queue=max_queue,
                      max_batch_tokens=4096, max_queue_wait_s=max_queue_wait_s, eos_token_id=eos_token_id,
                      engine_thread=new_engine_thread(), observer=observer, overlap=overlap)


async def run_joining(generator: Generator, requests: list[tuple[float, GenerateRequest]],
                      overlap: bool | None = None) -> list[list[int]]:
    """Each request starts after its delay; returns every request's token ids."""
    scheduler = generation_core(generator, overlap=overlap)
    scheduler.start()

    async def one(delay: float, request: GenerateRequest) -> list[int]:
        await asyncio.sleep(delay)
        return [step.token.token_id async for step in events(scheduler, request)]

    try:
        results = await asyncio.gather(*(one(delay, r) for delay, r in requests))
        for _ in range(100):  # the last leavers' slots are freed at the next step boundary
            if not generator.running:
                break
            await asyncio.sleep(0.01)
        return results
    finally:
        await scheduler.stop()


def openai_penalties(logits: torch.Tensor, output: list[int], frequency: float, presence: float) -> torch.Tensor:
    """OpenAI's formula, written out: mu[j] - c[j] * frequency - (c[j] > 0) * presence."""
    out = logits.clone()
    for token, count in collections.Counter(output).items():
        out[token] -= count * frequency + presence
    return out


def reference_greedy(hf, prompt: list[int], n: int, params: SamplingParams) -> list[int]:
    """transformers' forward, the controls written out in vLLM's order (bias, repetition,
    frequency and presence), argmax: token by token."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
            for token, bias in params.logit_bias:
                logits[token] += bias
            logits = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(torch.tensor([ids]), logits[None])[0]
            logits = openai_penalties(logits, out, params.frequency_penalty, params.presence_penalty)
            token = int(logits.argmax())
            ids.append(token)
            out.append(token)
    return out
