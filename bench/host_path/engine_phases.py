"""The engine process's CPU by phase, for bench/host_path/host_path.py --ipc --phases: each phase of the
next-token path (the IPC thread's receive, decode and queueing; the core thread's scheduling,
launch and reading back; the answers and their encoding) timed with its own thread's CPU clock,
reported a prompt and a forward.

py-spy's wall-clock samples mislead on a machine whose cores are all busy (a thread preempted
counts in whatever frame it was in; `--gil` saw a fifth of the CPU the engine used), and a
deterministic profiler's cost a call swamps the per-prompt work it measures. This wraps a
few functions a forward instead: two reads of the thread's CPU clock a call. Phases nest (a
phase's figure includes the phases under it); per-prompt functions are not wrapped, so the
clock reads stay a few a forward.

The stand-in server installs it when STANDIN_PHASES names a directory; the bench writes
`start` there, then `stop`, and reads `report.txt` back.
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from pathlib import Path

from gpt2serve.ipc import codec
from gpt2serve.ipc import engine_server
from gpt2serve.launch import engine_host
from gpt2serve.scheduling import core, outputs, runner, scheduler

# (owner, attribute, label): the label's indent shows what it runs under. The model runner is the
# class the engine host builds (the stand-in's, set before this module is imported); a next-token
# batch is a step it launches and reads.
PHASES = [
    (engine_server.EngineServer, "_receive", "IPC thread: a front end's frames received, decoded and queued"),
    (codec, "decode", "IPC thread:   the frame decoded"),
    (engine_server.EngineServer, "_queue_calls", "IPC thread:   one-prompt calls queued (Prompts)"),
    (engine_server.EngineServer, "_queue", "IPC thread:   a request's prompts queued (Submit)"),
    (engine_server, "run_posted", "IPC thread: answers handed over by the core"),
    (outputs.Outputs, "answer_prompts", "IPC thread:   a batch's answers made"),
    (engine_server.Outbox, "flush", "IPC thread: messages encoded and sent"),
    (codec, "encode", "IPC thread:   encoded"),
    (core.EngineCore, "_iteration", "core thread: the loop's passes"),
    (scheduler.Scheduler, "schedule", "core thread:   scheduling"),
    (runner.StepRunner, "_prompt_step", "core thread:   a next-token step"),
    (engine_host.Generator, "launch", "core thread:     inputs staged and launched"),
    (engine_host.Generator, "finish", "core thread:     the launched forward read back"),
]


class Phases:
    def __init__(self):
        self.on = False
        self.spent: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # label -> [calls, thread CPU ns]
        self.prompts = self.forwards = 0

    def wrap(self, owner, name: str, label: str) -> None:
        real, clock = getattr(owner, name), time.thread_time_ns

        def timed(*args, **kwargs):
            if not self.on:
                return real(*args, **kwargs)
            started = clock()
            try:
                return real(*args, **kwargs)
            finally:
                entry = self.spent[label]
                entry[0] += 1
                entry[1] += clock() - started

        setattr(owner, name, timed)

    def count_batches(self) -> None:
        """Prompts and forwards, from the batches answered (once each: with_layers=True)."""
        real = outputs.Outputs.answer_prompts

        def counted(outs, batch, output, started, started_ns, with_layers):
            if self.on and with_layers:
                self.prompts += len(batch)
                self.forwards += 1
            return real(outs, batch, output, started, started_ns, with_layers)

        outputs.Outputs.answer_prompts = counted

    def report(self, cpu_s: float) -> str:
        prompts, forwards = max(self.prompts, 1), max(self.forwards, 1)
        a_forward, a_prompt = self.prompts / forwards, 1e6 * cpu_s / prompts
        lines = [f"engine process by phase: {self.prompts} prompts in {self.forwards} forwards "
                 f"({a_forward:.1f} a forward), the process's CPU {a_prompt:.2f} µs a prompt",
                 "| phase | calls a forward | µs a prompt | µs a call |", "|---|---|---|---|"]
        for _, _, label in PHASES:
            calls, ns = self.spent.get(label, (0, 0))
            if calls:
                thread, what = label.split(": ", 1)
                depth = (len(what) - len(what.lstrip())) // 2  # nested under the phase above
                lines.append(f"| {thread}: {'↳ ' * depth}{what.lstrip()} | {calls / forwards:.2f} | "
                             f"{ns / 1e3 / prompts:.2f} | {ns / 1e3 / calls:.1f} |")
        return "\n".join(lines)

    def watch(self, directory: Path) -> None:
        """Start at `start`, stop and write report.txt at `stop` (files the bench writes)."""
        started_cpu = 0.0
        while True:
            time.sleep(0.1)
            if (directory / "start").exists():
                (directory / "start").unlink()
                self.spent.clear()
                self.prompts = self.forwards = 0
                started_cpu, self.on = sum(os.times()[:2]), True
            if (directory / "stop").exists():
                (directory / "stop").unlink()
                self.on = False
                written = directory / "report.part"
                written.write_text(self.report(sum(os.times()[:2]) - started_cpu))
                written.rename(directory / "report.txt")  # whole when the bench sees it


def install(directory: str, on_start) -> None:
    """Wrap the phases in this process; `on_start(hook)` runs hook() once the engine is up, in
    the engine process only (standin_server.after_engine_start)."""
    phases = Phases()
    for owner, name, label in PHASES:
        phases.wrap(owner, name, label)
    phases.count_batches()
    on_start(lambda: threading.Thread(target=phases.watch, args=(Path(directory),), daemon=True).start())
