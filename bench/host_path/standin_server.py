"""`gpt2serve serve` in front of a stand-in for the device: the host path alone, on any machine.

Everything the server does on the host runs for real: front ends, IPC, the schedulers, the
engine's own host work (staging inputs, reading the one copy back, building each row's answer).
Only the device's work is replaced: each step takes the time a card measured for a step of
that many rows (bench/host_path/h200_steps.json, by default; linear between the measured row counts), on a
device that runs one step after another and on by itself, as a GPU's queue does: a decode step
is launched at once and its answers are ready that long after the device is free, and a wait
for them is a sleep, which holds no CPU and releases the GIL, as a wait on a GPU does. So the
engine core overlaps its host work with the device here as it does on cuda (STANDIN_OVERLAP=0:
it does not, for an A/B). The answers are made up: every generated token is STANDIN_TOKEN, and
next-token rows get fixed log-probabilities.

The stand-in device is one class, `StandinGenerator`, behind the engine core's one interface
(scheduling.engine_api): the real generator with each step's launch replaced by the device's
time. The engine host builds it in place of the real one. Run like `gpt2serve serve` (this file
hands it to the engine host at import, so the engine process of `--workers N`, started with
multiprocessing's spawn, gets it too):

    .venv/bin/python bench/host_path/standin_server.py serve --model random:gpt2 --device cpu --workers 2 \
        --max-batch-size 256 --max-running-sequences 256 --prefix-cache-mb 0

Traced, scored and prefix-cached requests are not stood in for (they are refused); the bench
(bench/host_path/host_path.py) sends none. STANDIN_STEPS names another step-time file.
"""

from __future__ import annotations

import bisect
import functools
import json
import os
import sys
import time
from pathlib import Path

import torch

from gpt2serve.cli import main
from gpt2serve.engine import engine as engine_module
from gpt2serve.engine import generator as generator_module
from gpt2serve.engine.padding import left_pad
from gpt2serve.engine.sampling import read_choices
from gpt2serve.engine.steps import PackedAnswers, PromptLaunch, Running, StepLaunch, traced
from gpt2serve.launch import engine_host

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


class Device:
    """One queue of steps: each starts when the device is free, and takes its measured time."""

    free_at = 0.0  # perf_counter

    @classmethod
    def queue(cls, seconds: float) -> tuple[float, float]:
        """(start, end) of a step queued now."""
        start = max(time.perf_counter(), cls.free_at)
        cls.free_at = start + seconds
        return start, cls.free_at


def device_wait(seconds: float) -> None:
    """A step the host waits for at once (next-token forwards, prefills): behind what is queued."""
    until = Device.queue(seconds)[1]
    time.sleep(max(until - time.perf_counter(), 0.0))  # no CPU, no GIL: a host thread waiting on a GPU


class Moment:
    """What finish() reads of a cuda.Event: when it fires (a sleep until then), and the
    time between two."""

    def __init__(self, at: float):
        self.at = at

    def synchronize(self) -> None:
        time.sleep(max(self.at - time.perf_counter(), 0.0))

    def elapsed_time(self, end: "Moment") -> float:
        return (end.at - self.at) * 1000  # ms, as cuda.Event's


_top_k_cache: dict[int, torch.Tensor] = {}  # k -> (2, 1024, k) values and ids, as top_k_rows copies them back


def _top_k_rows(k: int) -> torch.Tensor:
    """What top_k_rows copies back for up to 1024 rows: on a card its top-k is device work, which
    the stand-in does not charge to the host (torch.topk on the CPU cost 0.6 µs a prompt at top-5)."""
    if k not in _top_k_cache:
        values, ids = torch.topk(_logprobs, k=k, dim=-1)  # (1024, k) each
        _top_k_cache[k] = torch.stack((values, ids.float()))
    return _top_k_cache[k]


_chosen_rows: dict[int, torch.Tensor] = {}  # n alternatives -> choose()'s answer for up to 1024 rows


def _chosen(rows) -> torch.Tensor:
    """What choose() copies back for these rows: [token, logprob, finite, n top, n ids]."""
    n = max(r.params.logprobs for r in rows)
    if n not in _chosen_rows:
        _chosen_rows[n] = torch.tensor([[float(STANDIN_TOKEN), -1.0, 1.0, *v, *range(n)]
                                        for v in _logprobs[:, :n].tolist()])
    return _chosen_rows[n][:len(rows)]


class StandinGenerator(generator_module.Generator):
    """The generator (scheduling.engine_api.ModelRunner, the core's one interface to the
    engine) on the stand-in device: no cache, every step queued for the device's time for its
    rows, as on cuda; staging the inputs and reading the answers back are real. It launches the
    three plans a card's steps are made of (no prompt rides a decode step there: decode steps are
    graphs), and the real finish() waits for each and reads it."""

    def launch(self, plan):
        started, started_ns = time.perf_counter(), time.time_ns()
        if plan.next_token:
            return StepLaunch([], None, None, None, sum(len(a.prompt) for a in plan.riders), started, started_ns,
                              prompts=self._next_token(plan.riders, started, started_ns))
        if plan.joining and not (plan.riders or plan.chunk or (plan.decode and self.running)):
            return StepLaunch([], torch.zeros(0), None, None, 0, started, started_ns, time.perf_counter() - started,
                              self._prefill(plan.joining))
        if not plan.decode_only:
            raise ValueError("the stand-in device takes no riders, as cuda graphs take none")
        rows = list(self.running)
        staged = torch.tensor([r.length for r in rows])  # (B,): the positions, staged as for a graph replay
        for r in rows:
            r.rng.random()  # the draw choose() takes
        start, end = Device.queue(DECODE.seconds(len(rows)))
        for r in rows:
            r.length += 1
            r.unread += 1
        return StepLaunch(rows, _chosen(rows), Moment(end), Moment(start), len(staged), started, started_ns,
                          time.perf_counter() - started)

    def _next_token(self, asks, started, started_ns):
        """A plain next-token batch queued on the device (engine.cuda_graphs.BucketedForward.launch)."""
        if any(traced(a) or a.prompt_logprobs is not None for a in asks):
            raise ValueError("the stand-in device runs plain next-token batches only")
        top_ks = [a.top_k for a in asks]
        batch = left_pad([a.prompt for a in asks], self.engine.pad_token_id)  # (3, B, T): staged as for a graph replay
        start, end = Device.queue(NEXT_TOKEN.seconds(len(asks)))
        both = _top_k_rows(max(top_ks))[:, :len(asks)]  # what the copy back brings
        return PromptLaunch(both, Moment(end), Moment(start), top_ks, batch.shape[2], started, started_ns, False)

    def _prefill(self, sequences):
        """A prefill on the device: its time waited here, as a prefill's answers are read at once."""
        if len(self.running) + len(sequences) > self.slots:
            raise ValueError(f"{len(self.running) + len(sequences)} sequences for {self.slots} cache slots")
        if any(s.prompt_logprobs is not None for s in sequences):
            raise ValueError("the stand-in device does not score prompts")
        left_pad([s.prompt for s in sequences], self.engine.pad_token_id)  # (3, B, T): staged
        device_wait(NEXT_TOKEN.seconds(len(sequences)))
        added = [Running.of(s) for s in sequences]
        for r in added:
            r.rng.random()  # the draw choose() takes
        tokens, failed = read_choices(_chosen(added).tolist(), added)
        self.running.extend(added)
        return PackedAnswers(prompt_tokens=sum(len(s.prompt) for s in sequences), prompt_rows=len(sequences),
                             first_tokens=tokens, first_failed=failed, cached_tokens={s.seq_id: 0 for s in sequences})

    def remove(self, seq_ids):
        self.running = [r for r in self.running if r.seq_id not in seq_ids]  # slots compact; no cache to move

    def warm_up(self):
        pass

    def allocate(self):
        pass

    @property
    def fixed_cost_tokens(self):
        return engine_module.MAX_FIXED_COST_TOKENS  # as a GPU measures it: padding is nearly free

    @property
    def overlaps(self):
        return os.environ.get("STANDIN_OVERLAP", "1") != "0"

    @property
    def takes_riders(self):
        return False  # as on cuda: decode steps are graphs


# What the engine host builds (launch.engine_host.load_engine): the stand-in.
engine_host.Generator = StandinGenerator


def after_engine_start(hook) -> None:
    """hook() once the engine is up, in the engine process only (the front ends import this file too)."""
    real_start = engine_host.EngineHost.start

    @functools.wraps(real_start)
    async def start(self):
        await real_start(self)
        hook()

    engine_host.EngineHost.start = start


if "STANDIN_SWITCH_INTERVAL_S" in os.environ:  # an A/B of Python's GIL switch interval in the engine process
    after_engine_start(lambda: sys.setswitchinterval(float(os.environ["STANDIN_SWITCH_INTERVAL_S"])))

if os.environ.get("STANDIN_PHASES"):  # the engine's CPU by phase (engine_phases.py; host_path.py --ipc --phases)
    import engine_phases

    engine_phases.install(os.environ["STANDIN_PHASES"], after_engine_start)

if os.environ.get("STANDIN_TIMELINE"):  # a lone call's hops, marked in every process (call_timeline.py)
    import call_timeline

    call_timeline.install(os.environ["STANDIN_TIMELINE"])

if __name__ == "__main__":
    sys.exit(main())
