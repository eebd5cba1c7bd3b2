"""The host-path bench (bench/host_path/host_path.py) for a few seconds: the real server in front of the
stand-in device answers every kind of load it sends, the server's own counters see the work,
the stand-in really waits (no load beats the device's ideal), and each process's CPU is read."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "bench/host_path/host_path.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=400)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_served_stand_in_answers_each_load_within_the_device_ideal():
    run = run_bench("--streams", "8", "--clients", "8", "--batch-clients", "1", "--batch-prompts", "8",
                    "--duration", "1.5", "--processes", "1", "--json")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = {r["name"]: r for r in json.loads(run.stdout[run.stdout.index("["):])}
    assert set(results) == {"generation", "next-token", "next-token batch"}
    for name, r in results.items():
        assert r["served_per_s"] > 0 and r["work"] > 0 and r["requests"] > 0, (name, r)
        assert 0 < r["ratio"] <= 1.05, (name, r)  # the stand-in sleeps: nothing beats the card
        assert r["us_per_unit"]["engine"] > 0 and "front end 1" in r["us_per_unit"], (name, r)
    # The server counted what the client sent: generations of 64 tokens, each token a
    # sequence-step, after one warm-up call of 2.
    assert results["generation"]["work"] == 64 * (results["generation"]["requests"] - 1) + 2
    assert results["next-token batch"]["work"] == 8 * results["next-token batch"]["requests"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_core_alone_runs_streams_and_callers_over_the_stand_in():
    run = run_bench("--core-only", "--streams", "16", "--clients", "8", "--duration", "1")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith("| 16 streams") or line.startswith("| 8 next")]
    assert len(rows) == 2, run.stdout
    for row in rows:
        served, ideal, ratio = (float(cell) for cell in row.split("|")[2:5])
        assert served > 0 and 0 < ratio <= 1.05, row


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_engine_process_alone_serves_streams_and_callers_over_its_ipc_door():
    run = run_bench("--ipc", "--streams", "16", "--clients", "8", "--batch-clients", "2", "--batch-prompts", "8",
                    "--duration", "1.5", "--processes", "2", "--json")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = {r["name"]: r for r in json.loads(run.stdout[run.stdout.index("["):])}
    assert set(results) == {"generation (IPC)", "next-token (IPC)", "next-token batch (IPC)"}
    assert results["next-token batch (IPC)"]["work"] == 8 * results["next-token batch (IPC)"]["requests"]
    for name, r in results.items():
        assert r["work"] > 0 and 0 < r["ratio"] <= 1.05, (name, r)
        assert list(r["us_per_unit"]) == ["engine"] and r["us_per_unit"]["engine"] > 0, (name, r)
    # The forwards that answered the callers, counted from each answer's batch size: at least a
    # row each, and no more rows than the callers had prompts in flight (8, and 2 x 8).
    for name, in_flight in (("next-token (IPC)", 8), ("next-token batch (IPC)", 16)):
        assert 1 <= float(results[name]["rows_a_forward"]) <= in_flight, (name, results[name])
    # Each stream's first token was timed from its request: p50 <= p90, both above nothing.
    p50, p90 = (float(x) for x in results["generation (IPC)"]["first_token_ms"].split(" / "))
    assert 0 < p50 <= p90, results["generation (IPC)"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_engine_reports_its_cpu_by_phase_for_each_next_token_load():
    """--phases: the engine process times its own phases (bench/host_path/engine_phases.py) over each
    next-token load, and the report counts the prompts and forwards it answered in that load."""
    run = run_bench("--ipc", "--streams", "", "--clients", "8", "--batch-clients", "2", "--batch-prompts", "8",
                    "--duration", "1.5", "--processes", "2", "--phases")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    reports = run.stdout.split("engine process by phase: ")[1:]
    assert len(reports) == 2, run.stdout
    for report, queued in zip(reports, ("one-prompt calls queued (Prompts)", "a request's prompts queued (Submit)")):
        prompts, forwards = (int(n) for n in re.match(r"(\d+) prompts in (\d+) forwards", report).groups())
        assert prompts > 0 and 1 <= prompts / forwards <= 16, report
        rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:] for line in report.splitlines()
                if line.startswith("| ") and "---" not in line and not line.startswith("| phase")}
        for phase in (queued, "a batch's answers made"):
            assert float(rows["IPC thread: ↳ " + phase][1]) > 0, (phase, report)  # µs a prompt
        assert float(rows["core thread: ↳ scheduling"][1]) > 0, report
