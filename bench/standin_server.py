"""`gpt2serve serve` in front of a stand-in for the device: the host path alone, on any machine.

Everything the server does on the host runs for real: front ends, IPC, the schedulers, the
engine's own host work (staging inputs, reading the one copy back, building each row's answer).
Only the device's work is replaced: each step sleeps for the time a card measured for a step of
that many rows (bench/h200_steps.json, by default; linear between the measured row counts), and
a sleep holds no CPU and releases the GIL, as a wait on a GPU does. The answers are made up:
every generated token is STANDIN_TOKEN, and next-token rows get fixed log-probabilities.

Run like `gpt2serve serve` (this file patches the engine at import, so the engine process of
`--workers N`, started with multiprocessing's spawn, is patched too):

    .venv/bin/python bench/standin_server.py serve --model random:gpt2 --device cpu --workers 2 \
        --max-batch-size 256 --max-running-sequences 256 --prefix-cache-mb 0

Traced, scored and prefix-cached requests are not stood in for (they are refused); the bench
(bench/host_path.py) sends none. STANDIN_STEPS names another step-time file.
"""

from __future__ import annotations

import bisect
import functools
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

from gpt2serve.cli import main
from gpt2serve.engine import engine as engine_module
from gpt2serve.engine import generator as generator_module
from gpt2serve.engine.padding import left_pad
from gpt2serve.launch import engine_host
from gpt2serve.engine.sampling import TOP

STEPS_FILE = Path(os.environ.get("STANDIN_STEPS", Path(__file__).with_name("h200_steps.json")))
STANDIN_TOKEN = 11  # ","
FAKE_VOCAB = 64  # columns of the made-up log-probabilities (top-k reads them like a real row)


class StepTimes:
    """Device milliseconds of a step of `rows` rows, linear between the measured points."""

    def __init__(self, points: dict[str, float]):
        self.rows = sorted(int(r) for r in points)
        self.ms = [points[str(r)] for r in self.rows]

    def seconds(self, rows: int) -> float:
        i = bisect.bisect_left(self.rows, rows)
        if i == 0:
            return self.ms[0] / 1000
        if i == len(self.rows):
            i -= 1  # past the last point: the last segment's slope
        r0, r1, m0, m1 = self.rows[i - 1], self.rows[i], self.ms[i - 1], self.ms[i]
        return (m0 + (m1 - m0) * (rows - r0) / (r1 - r0)) / 1000


_table = json.loads(STEPS_FILE.read_text())
NEXT_TOKEN = StepTimes(_table["device_ms"]["next_token"])  # also a prefill of that many short prompts
DECODE = StepTimes(_table["device_ms"]["decode"])
_logprobs = torch.log_softmax(torch.randn(1024, FAKE_VOCAB, generator=torch.Generator().manual_seed(0)), dim=-1)


def device_wait(seconds: float) -> None:
    time.sleep(seconds)  # no CPU, no GIL: what a host thread waiting on a GPU costs


def next_token(self, prompts, top_ks, traced_rows=(), mapped_rows=(), last_row_rows=(), scored_rows=None):
    if traced_rows or scored_rows:
        raise ValueError("the stand-in device runs plain next-token batches only")
    started, started_ns = time.perf_counter(), time.time_ns()
    batch = left_pad(prompts, self.pad_token_id)  # (3, B, T): the inputs staged as for a graph replay
    device_wait(NEXT_TOKEN.seconds(len(prompts)))
    top, failed = self._top(_logprobs[:len(prompts)], top_ks)  # the one copy back, read as the engine reads it
    return engine_module.BatchOutput(top, time.perf_counter() - started, batch.shape[2], started_ns, time.time_ns(),
                                     cuda_graph=True, failed_rows=failed)


def _chosen(rows) -> list[list[float]]:
    """What choose() copies back for these rows: [token, logprob, finite, n top, n ids]."""
    n = max(r.params.logprobs for r in rows)
    values = _logprobs[:len(rows), :n].tolist()
    return [[float(STANDIN_TOKEN), -1.0, 1.0, *v, *range(n)] for v in values]


def prefill(self, sequences):
    started, started_ns = time.perf_counter(), time.time_ns()
    if len(self.running) + len(sequences) > self.slots:
        raise ValueError(f"{len(self.running) + len(sequences)} sequences for {self.slots} cache slots")
    if any(s.prompt_logprobs is not None for s in sequences):
        raise ValueError("the stand-in device does not score prompts")
    batch = left_pad([s.prompt for s in sequences], self.engine.pad_token_id)  # (3, B, T)
    device_wait(NEXT_TOKEN.seconds(len(sequences)))
    added = [generator_module._Running(s.seq_id, s.params, random.Random(s.seed), len(s.prompt), -1, len(s.prompt))
             for s in sequences]
    for r in added:
        r.rng.random()  # the draw choose() takes
    tokens, failed = self._record(_chosen(added), added)
    self.running.extend(added)
    return generator_module.StepOutput(tokens, "prefill", len(sequences), sum(len(s.prompt) for s in sequences),
                                       time.perf_counter() - started, started_ns, time.time_ns(), failed,
                                       {}, {s.seq_id: 0 for s in sequences})


def decode(self):
    started, started_ns = time.perf_counter(), time.time_ns()
    rows = self.running
    lengths, last = [r.length for r in rows], [r.last_token for r in rows]
    staged = torch.tensor([last, lengths])  # (2, B): the inputs staged as for a graph replay
    for r in rows:
        r.rng.random()
    device_wait(DECODE.seconds(len(rows)))
    tokens, failed = self._record(_chosen(rows), rows)
    for r in rows:
        r.length += 1
    return generator_module.StepOutput(tokens, "decode", len(rows), staged.shape[1], time.perf_counter() - started,
                                       started_ns, time.time_ns(), failed)


def remove(self, seq_ids):
    self.running = [r for r in self.running if r.seq_id not in seq_ids]  # slots compact; no cache to move


def engine_warm_up(self):
    self.fixed_cost_tokens = engine_module.MAX_FIXED_COST_TOKENS  # as a GPU measures it: padding is nearly free


engine_module.Engine.next_token = next_token
engine_module.Engine.warm_up = engine_warm_up
generator_module.Generator.prefill = prefill
generator_module.Generator.decode = decode
generator_module.Generator.remove = remove
generator_module.Generator.warm_up = lambda self: None
generator_module.Generator.allocate = lambda self: None
generator_module.Generator.can_ride = lambda self, prompt: False  # as on cuda: decode steps are graphs

if "STANDIN_SWITCH_INTERVAL_S" in os.environ:  # an A/B of Python's GIL switch interval in the engine process
    _real_start = engine_host.EngineHost.start

    @functools.wraps(_real_start)
    async def _start(self):
        await _real_start(self)
        sys.setswitchinterval(float(os.environ["STANDIN_SWITCH_INTERVAL_S"]))

    engine_host.EngineHost.start = _start

if __name__ == "__main__":
    sys.exit(main())
