"""`--workers auto`: the count of front ends from the cores and the measured costs
(launch.workers_plan), and the supervisor that starts them once the engine has measured its rate."""

from __future__ import annotations

import math
import re

import pytest
from support.servers import launch_server, metric_value

from gpt2serve.cli import build_parser
from gpt2serve.config import config_from_args
from gpt2serve.launch.workers_plan import FRONT_END_CALL_US, plan_workers

from gpt2serve_client import Client


def config(*flags: str):
    return config_from_args(build_parser().parse_args(["serve", *flags]))


def test_auto_on_a_cpu_is_one_process_whatever_the_cores():
    plan = plan_workers(config("--device", "cpu"), cores=64)
    assert (plan.workers, plan.auto, plan.gpu) == (1, True, False)
    assert "on a CPU the forward runs on every core" in plan.reason()


def test_auto_on_a_gpu_leaves_the_engine_its_cores():
    plan = plan_workers(config("--device", "cuda"), cores=16)
    assert (plan.workers, plan.most, plan.engine_cores) == (14, 14, 2)  # an upper bound until the engine measures
    assert plan_workers(config("--device", "cuda"), cores=2).workers == 1  # none left: one process
    assert "leave none for front ends" in plan_workers(config("--device", "cuda"), cores=3).reason()


def test_a_given_count_is_kept():
    plan = plan_workers(config("--device", "cuda", "--workers", "3"), cores=16)
    assert (plan.workers, plan.auto) == (3, False) and plan.reason() == "--workers 3"


@pytest.mark.parametrize("server,rate,cores,expected", [
    ("builtin", 82_086, 16, 13),  # the H200's next-token rate at 150 µs a call: 12.3 front ends' worth
    ("grpcio", 57_070, 16, 14),  # at 600 µs it needs 35; 16 cores allow 14
    ("builtin", 8_000, 16, 2),  # a slower engine: 1.2 front ends' worth
    ("grpcio", 2_000, 16, 2),
    ("builtin", 100, 16, 1),
    ("builtin", 200_000, 64, 30),  # enough cores: what keeps up
    ("grpcio", 57_070, 64, math.ceil(57_070 * FRONT_END_CALL_US["grpcio"] / 1e6)),
])
def test_the_count_keeps_up_with_the_engine_within_the_cores(server, rate, cores, expected):
    plan = plan_workers(config("--device", "cuda", "--grpc-server", server), cores=cores)
    chosen, why = plan.with_engine_rate(rate)
    assert chosen == expected
    assert f"{chosen} front ends" in why and f"{rate:,.0f} prompts/s" in why and f"{cores} cores" in why
    assert f"about {FRONT_END_CALL_US[server]:.0f} us of CPU a call" in why


def test_the_single_process_server_says_why(server):
    assert "--workers auto: 1 process: on a CPU" in server.log()


# The plan a 5-core GPU machine would give (3 front ends at most), run with the real supervisor and
# a real engine on this CPU: the front ends start once the engine has measured its rate.
AUTO_ON_FIVE_CORES = """
import sys
from gpt2serve.cli import build_parser
from gpt2serve.config import config_from_args
from gpt2serve.launch.supervisor import run_workers
from gpt2serve.launch.workers_plan import WorkersPlan
sys.exit(run_workers(config_from_args(build_parser().parse_args(sys.argv[1:])),
                     WorkersPlan(workers=3, auto=True, cores=5, engine_cores=2, gpu=True)))
"""


@pytest.mark.slow
def test_the_supervisor_starts_the_front_ends_the_measured_rate_needs(tmp_path):
    srv = launch_server(tmp_path, "--model", "random:tiny", "--max-batch-size", "64",
                        entry=("-c", AUTO_ON_FIVE_CORES))
    try:
        log = srv.log()
        rate = float(re.search(r"([\d.]+) next-token prompts/s at batch 64 \(--workers auto\)", log).group(1))
        line = re.search(r"--workers auto: (\d+) front ends: the engine answers ([\d,]+) prompts/s.*?so (\d+) would "
                         r"keep up; 5 cores, 2 left to the engine, allow 3", log)
        assert line, log
        chosen, needed = int(line.group(1)), int(line.group(3))
        share = rate * FRONT_END_CALL_US["builtin"] / 1e6  # front ends' worth of calls at the engine's rate
        assert max(1.0, share) <= needed < share + 1.01  # ceil, of the rate as the engine logged it
        assert chosen == min(needed, 3)
        # The rate came before any front end started, and exactly `chosen` of them serve.
        assert log.index("prompts/s at batch 64") < log.index("front end listening")
        assert "gpt2serve ready: model=random:tiny" in log and f"workers={chosen}" in log
        assert len(re.findall(r"front-end\[\d+\].*front end listening", log)) == chosen
        assert metric_value(srv.http_url, "gpt2serve_front_ends_up") == chosen
        with Client(srv.grpc_target) as client:
            assert client.next_token([464, 3139, 286]).batch_size >= 1
    finally:
        assert srv.stop() == 0


def test_the_single_process_server_runs_on_uvloop(server):
    assert "event loop: uvloop" in server.log()
