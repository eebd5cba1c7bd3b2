"""Deferred multiprocess metric writes (telemetry.deferred_writes): updates on the loop's thread
reach the process's file once per loop turn, with every update counted; other threads' updates
are written at once; a process outside multiprocess mode is left as it was. Each case runs in a
fresh interpreter, since prometheus_client picks its value class at import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import asyncio, json, sys, threading
    from gpt2serve.telemetry.deferred_writes import defer_metric_writes
    from prometheus_client import CollectorRegistry, Counter, Histogram
    from prometheus_client.multiprocess import MultiProcessCollector

    def on_file(name):
        registry = CollectorRegistry()
        MultiProcessCollector(registry, sys.argv[1])
        return sum(s.value for f in registry.collect() for s in f.samples if s.name == name)

    async def main():
        seen = {"deferred": defer_metric_writes(asyncio.get_running_loop())}
        counter = Counter("calls", "calls", ["status"], registry=None)
        hist = Histogram("seconds", "seconds", buckets=(0.1, 1.0), registry=None)
        for i in range(100):
            counter.labels(status="OK").inc()
            hist.observe(0.05 if i % 2 else 0.5)
        seen["in_memory"] = counter.labels(status="OK")._value.get()
        seen["file_same_turn"] = on_file("calls_total")
        await asyncio.sleep(0)  # the flush runs on the loop's next turn
        await asyncio.sleep(0)
        seen["file_next_turn"] = on_file("calls_total")
        seen["hist_count"] = on_file("seconds_count")
        seen["hist_sum"] = on_file("seconds_sum")
        thread = threading.Thread(target=lambda: counter.labels(status="OK").inc(5))
        thread.start(); thread.join()
        seen["file_after_thread"] = on_file("calls_total")
        counter.labels(status="OK").inc(7)  # marked at the loop's last turn: written at exit
        return seen

    print(json.dumps(asyncio.run(main())))
""")


def run(tmp_path, multiprocess: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    if multiprocess:
        env["PROMETHEUS_MULTIPROC_DIR"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout)


def file_total(directory, name: str) -> float:
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector
    registry = CollectorRegistry()
    MultiProcessCollector(registry, str(directory))
    return sum(s.value for f in registry.collect() for s in f.samples if s.name == name)


def test_loop_updates_are_written_once_a_turn_and_all_counted(tmp_path):
    seen = run(tmp_path, multiprocess=True)
    assert seen["deferred"] is True
    assert seen["in_memory"] == 100  # the value itself moves at once
    assert seen["file_same_turn"] == 0  # not yet written: the turn is not over
    assert seen["file_next_turn"] == 100
    assert seen["hist_count"] == 100
    assert abs(seen["hist_sum"] - (50 * 0.05 + 50 * 0.5)) < 1e-9
    assert seen["file_after_thread"] == 105  # another thread's update is written at once
    assert file_total(tmp_path, "calls_total") == 112  # the last turn's update, written at exit


def test_single_process_mode_is_left_alone(tmp_path):
    seen = run(tmp_path, multiprocess=False)
    assert seen["deferred"] is False
    assert seen["in_memory"] == 100
