"""Shared fixtures: a real gpt2serve process on ephemeral ports, an OTLP receiver, and the
models and tokenizer the answers are judged with. Helpers that are not fixtures live in support/."""

from __future__ import annotations

import os
import time

import pytest

from support.servers import ServerProcess, launch_server


# A time budget for the whole run, for scripts/gpu_check.sh on a card whose time is short: once it
# is spent, each test left is skipped with this reason (counted in the check's summary, never
# as passed). Unset (the default, `make test`, CI): no budget.
SUITE_BUDGET_S = float(os.environ.get("GPT2SERVE_SUITE_BUDGET_S") or 0)
SUITE_STARTED = time.monotonic()


def pytest_runtest_setup(item):
    if SUITE_BUDGET_S and time.monotonic() - SUITE_STARTED > SUITE_BUDGET_S:
        pytest.skip(f"the run's time budget is spent (GPT2SERVE_SUITE_BUDGET_S={SUITE_BUDGET_S:g})")


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> ServerProcess:
    """One random:tiny server (seed 0) shared by the transport tests. Its length-grouping cost is
    pinned high, so the prompts of one call share a forward whatever this machine's load made a
    measured cost come out as (test_serving checks answers of a padded batch)."""
    srv = launch_server(tmp_path_factory.mktemp("server"), "--model", "random:tiny", "--max-batch-delay-ms", "20",
                        "--fixed-cost-tokens", "4096")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def receiver():
    """An OTLP/gRPC receiver in this process (support/otlp_receiver.py)."""
    from support.otlp_receiver import OtlpReceiver

    rx = OtlpReceiver().start()
    yield rx
    rx.stop()


@pytest.fixture(scope="session")
def tiny_model():
    """The same weights the server serves (random:tiny, seed 0), in this process."""
    from gpt2serve.engine.loading import load_model

    return load_model("random:tiny", "cpu", "float32", seed=0)


@pytest.fixture(scope="session")
def tokenizer():
    from gpt2serve.engine.tokenizer import bundled_gpt2_tokenizer

    return bundled_gpt2_tokenizer()
