"""The engine core alone in this process over the stand-in device, for bench/host_path/host_path.py
--core-only: no IPC, no front ends, no gRPC. Generations whose sinks start the next one as one
ends, and closed-loop next-token callers; CPU per unit of the process and of the core's own
thread."""

from __future__ import annotations

import asyncio
import time

from standin_server import DECODE, NEXT_TOKEN, STEPS_FILE, StandinGenerator


def core_only(streams: list[int], clients: list[int], new_tokens: int, duration: float, max_batch: int) -> str:
    """The engine core in this process over the stand-in device (see the module doc)."""
    from gpt2serve.engine.engine import Engine, EngineOptions
    from gpt2serve.engine.kv_cache import blocks_needed
    from gpt2serve.engine.loading import load_model
    from gpt2serve.protocol import GenerateRequest, SamplingParams
    from gpt2serve.scheduling.core import EngineCore, new_engine_thread

    engine = Engine(load_model("random:tiny", "cpu", "float32"), EngineOptions(max_batch_size=max_batch))
    greedy = SamplingParams(temperature=0.0)
    lines = ["engine core alone, over " + STEPS_FILE.name,
             "| load | served/s | ideal/s | ratio | process us/unit | core thread us/unit |", "|---|---|---|---|---|---|"]

    async def run(load: str, n: int) -> None:
        generator = StandinGenerator(engine, max(streams + [1]), blocks_needed(max(streams + [1]), 1024))
        core = EngineCore(generator, max_batch_size=max_batch, max_batch_delay_s=0.002, max_queue=8192,
                          max_batch_tokens=16384, engine_thread=new_engine_thread())
        thread_cpu, real_run = [0.0], core._run

        def timed_run() -> None:
            started = time.thread_time()
            real_run()
            thread_cpu[0] = time.thread_time() - started

        core._run = timed_run
        core.start()
        done, stop_at = [0], time.perf_counter() + duration

        class Restart:
            def __init__(self, i: int):
                self.i = i

            def put(self, event) -> None:
                done[0] += 1
                if event.finish_reason and time.perf_counter() < stop_at:
                    start(self.i)

            def fail(self, error) -> None:
                pass

        def start(i: int) -> None:
            core.add(GenerateRequest([100 + i, 200, 300, 400, 500], greedy, new_tokens, ignore_eos=True), Restart(i))

        async def caller(i: int) -> None:
            while time.perf_counter() < stop_at:
                await core.submit([[100 + i, 200, 300, 400, 500]], 5)
                done[0] += 1

        started, cpu = time.perf_counter(), time.process_time()
        if load == "streams":
            for i in range(n):
                start(i)
            await asyncio.sleep(duration)
        else:
            await asyncio.gather(*(caller(i) for i in range(n)))
        units, wall, cpu = done[0], time.perf_counter() - started, time.process_time() - cpu
        await core.stop()
        ideal = n / (DECODE if load == "streams" else NEXT_TOKEN).seconds(n)
        what = f"{n} streams" if load == "streams" else f"{n} next-token callers"
        lines.append(f"| {what} | {units / wall:.0f} | {ideal:.0f} | {units / wall / ideal:.3f} | "
                     f"{1e6 * cpu / units:.1f} | {1e6 * thread_cpu[0] / units:.1f} |")

    for n in streams:
        asyncio.run(run("streams", n))
    for n in clients:
        asyncio.run(run("callers", n))
    lines.append("unit: a sequence-step (generated token), or a next-token prompt")
    return "\n".join(lines)
