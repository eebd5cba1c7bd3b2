"""`--workers auto`: how many front-end processes, from the cores and the measured costs.

A front end is one event loop: it serves at most 1 / (its CPU per call) calls a second. The
engine answers at most its measured rate (prompts a second at its largest batch, timed once it
is warm). Enough front ends keep up with the engine, and no more than the cores left once the
engine has its own:
- on a GPU, the engine process needs about 2 cores: the core's loop and its IPC threads (the
  forward runs on the card);
- on a CPU, the forward itself spreads over every core (torch's threads), so front ends could
  only take cores from it: one process serves.

    front ends = clamp(ceil(engine rate x CPU per call), 1, cores - engine cores)

The CPU per call is the project's measurement of a unary gRPC `NextToken` in a front end
(bench/host_path/front_end_profile.py, docs/benchmarks.md), the costliest common call, with the
gRPC server the front ends run: erring high costs an idle process, erring low caps the server.
grpc.aio's core measured 381-490 µs a call on a 2-core EPYC, taken as 600; the built-in server
91-101 µs on the same machine, taken as 150 (the same margin).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

from ..config import ServeConfig
from .resources import available_cpus

log = logging.getLogger("gpt2serve")
# CPU a unary gRPC call costs a front end, by --grpc-server (bench/host_path/front_end_profile.py)
FRONT_END_CALL_US = {"builtin": 150.0, "grpcio": 600.0}
ENGINE_CORES_ON_GPU = 2  # the engine core's loop and its IPC input and output threads


@dataclass(frozen=True)
class WorkersPlan:
    workers: int  # front-end processes; 1 is the single-process server
    auto: bool  # chosen by --workers auto
    cores: int
    engine_cores: int
    gpu: bool
    call_us: float = FRONT_END_CALL_US["builtin"]  # a front end's CPU a call

    @property
    def most(self) -> int:
        """Front ends the cores allow beside the engine."""
        return max(1, self.cores - self.engine_cores)

    def with_engine_rate(self, prompts_per_s: float) -> tuple[int, str]:
        """The count for an engine measured at `prompts_per_s`, and the line that says why."""
        needed = max(1, math.ceil(prompts_per_s * self.call_us / 1e6))
        chosen = min(needed, self.most)
        return chosen, (f"--workers auto: {chosen} front ends: the engine answers {prompts_per_s:,.0f} prompts/s "
                        f"(measured at its largest batch) and a front end spends about {self.call_us:.0f} us of CPU a "
                        f"call, so {needed} would keep up; {self.cores} cores, {self.engine_cores} left to the "
                        f"engine, allow {self.most}")

    def reason(self) -> str:
        """Why a plan with no engine measured is what it is."""
        if not self.auto:
            return f"--workers {self.workers}"
        if not self.gpu:
            return ("--workers auto: 1 process: on a CPU the forward runs on every core, and front ends would take "
                    "cores from it")
        if self.most <= 1:
            return (f"--workers auto: 1 process: {self.cores} cores leave none for front ends beside the engine's "
                    f"{self.engine_cores}")
        return f"--workers auto: up to {self.most} front ends, the count once the engine has measured its rate"


def plan_workers(config: ServeConfig, cores: int | None = None) -> WorkersPlan:
    """The plan before the engine has started: --workers N as given; auto on a CPU, 1; auto on a
    GPU, at most the cores beside the engine (WorkersPlan.with_engine_rate sets the count)."""
    cores = available_cpus() if cores is None else cores  # the container's CPU quota, where there is one
    gpu = config.device.startswith("cuda")
    if config.device == "auto":
        import torch  # lazy: only to ask whether there is a GPU

        gpu = torch.cuda.is_available()
    engine_cores = ENGINE_CORES_ON_GPU if gpu else cores
    call_us = FRONT_END_CALL_US[config.grpc_server]
    if config.workers is not None:
        return WorkersPlan(config.workers, False, cores, engine_cores, gpu, call_us)
    plan = WorkersPlan(1, True, cores, engine_cores, gpu, call_us)
    return replace(plan, workers=plan.most)  # an upper bound until the engine has measured its rate
