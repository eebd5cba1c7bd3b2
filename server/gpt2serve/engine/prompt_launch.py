"""Next-token batches launched without waiting for them: the engine core's overlap for prompts
(scheduling.runner), as decode steps have it (engine.generator.launch_decode).

Under load the core used to run a batch of prompts start to end: stage it, replay its graph,
wait for its top-k, then build every prompt's answer, and only then stage the next batch. On an
H100 (fcf3306) NextTokenBatch served 0.52 of the engine's in-process rate at batch 256: the
host's share of a batch (its answers) came on top of the device's instead of beside it. A
launched batch replays its graph, takes its top-k on the device and copies it into pinned host
memory behind a recorded event; the core launches the next batch before reading this one.

Only plain batches launch this way: untraced, unscored, uncontrolled (the runner checks), from a
graph, and with prompts too short to hold a block of the prefix cache (a longer one may read or
keep blocks, which the synchronous path does). On a CPU (tests: the bucketed path without
capture) a launch computes the whole batch, and finishing it only reads it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from ..protocol import TopTable
from .cuda_graphs import BucketedForward
from .head import read_top_k, top_k_table
from .prefix_cache import BLOCK as PREFIX_BLOCK, PrefixCache
from .sampling import to_host


@dataclass(slots=True)
class PromptLaunch:
    """A batch on its way: its top-k values and ids are in `both` once `done` has fired."""

    both: torch.Tensor  # (2, B, k_max) on the host (pinned on cuda)
    done: "torch.cuda.Event | None"  # cuda: fires when the copy into `both` has landed; None: there
    device_started: "torch.cuda.Event | None"
    top_ks: Sequence[int]
    padded_len: int  # the bucket's length
    started: float
    started_ns: int
    looked_up: bool  # the prefix cache is on: each prompt reports 0 tokens read from it


def launch_prompts(graphs: BucketedForward | None, pool: PrefixCache | None, prompts: Sequence[Sequence[int]],
                   top_ks: Sequence[int]) -> PromptLaunch | None:
    """Queue a plain batch on the graphs (see the module doc); None where it does not apply (no
    graphs, a prompt the prefix cache `pool` could hold a block of, no bucket): run it whole."""
    if graphs is None or (pool is not None and any(len(p) >= PREFIX_BLOCK for p in prompts)):
        return None
    started, started_ns = time.perf_counter(), time.time_ns()
    on_cuda = graphs.device.type == "cuda"
    device_started = done = None
    if on_cuda:
        device_started, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        device_started.record()
    replayed = graphs.run(prompts)
    if replayed is None:
        return None
    logprobs, (_, length) = replayed  # (P, V), a view of the graphs' shared output
    both = top_k_table(logprobs, top_ks)  # (2, P, k_max)
    if on_cuda:
        both = to_host(both, done)
    return PromptLaunch(both, done, device_started, list(top_ks), length, started, started_ns, pool is not None)


def read_launch(launch: PromptLaunch) -> tuple[TopTable, frozenset[int], float]:
    """Wait for a launched batch's top-k (cuda; on a CPU it is there) and read it: each row's
    top-k, the rows not finite, and the batch's device seconds (on a CPU, since its launch)."""
    forward_s = time.perf_counter() - launch.started
    if launch.done is not None:
        launch.done.synchronize()  # lets go of the GIL while it waits
        forward_s = launch.device_started.elapsed_time(launch.done) / 1000
    top, failed = read_top_k(launch.both, launch.top_ks)
    return top, failed, forward_s
