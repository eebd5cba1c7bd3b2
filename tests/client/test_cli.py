"""The `gpt2serve` command line and its configuration (flags and GPT2SERVE_* env vars)."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest
from support.servers import requests_total

from gpt2serve.cli import build_parser, visible
from gpt2serve.config import ServeConfig, config_from_args


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpt2serve.cli", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})


def test_next_prints_token_and_top_k_table(server, tiny_model, tokenizer):
    from support.reference import reference_logprobs

    out = run_cli("next", "The capital of France is", "--top-k", "3", "--target", server.grpc_target)
    assert out.returncode == 0, out.stderr
    ref = reference_logprobs(tiny_model.model, [464, 3139, 286, 4881, 318])
    best = int(ref.argmax())
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"next token: {visible(tokenizer.token_text(best))!r} (id {best},")
    assert "[464, 3139, 286, 4881, 318]" in out.stdout
    header = next(i for i, line in enumerate(lines) if line.split()[:5] == ["rank", "token", "prob", "logprob", "id"])
    rows = [line.split() for line in lines[header + 2: header + 5]]
    assert [r[0] for r in rows] == ["1", "2", "3"]
    for row in rows:
        token_id, logprob, prob = int(row[-1]), float(row[-2]), float(row[-3])
        assert abs(logprob - ref[token_id].item()) < 1e-3
        assert abs(prob - math.exp(logprob)) < 1e-4


def test_next_shows_the_leading_space():
    assert visible(" Paris") == "␣Paris"
    assert visible("\n") == "\\n"


def test_next_against_the_target_from_env(server):
    out = run_cli("next", "Hello", env={"GPT2SERVE_TARGET": server.grpc_target, "GPT2SERVE_NEXT_TOP_K": "2"})
    assert out.returncode == 0, out.stderr
    header = out.stdout.splitlines().index(next(line for line in out.stdout.splitlines() if line.startswith("rank")))
    assert len([line for line in out.stdout.splitlines()[header + 2:] if line[:1].isdigit()]) == 2


def test_next_reports_errors_without_a_traceback(server):
    out = run_cli("next", "", "--target", server.grpc_target)
    assert out.returncode == 1
    assert out.stderr.startswith("error: INVALID_ARGUMENT:") and "Traceback" not in out.stderr


def test_serve_flags_and_env():
    args = build_parser({"GPT2SERVE_MAX_BATCH_SIZE": "8", "GPT2SERVE_MODEL": "random:tiny",
                         "GPT2SERVE_RANDOM_FALLBACK": "false"}).parse_args(["serve", "--grpc-port", "6000"])
    config = config_from_args(args)
    assert config == ServeConfig(model="random:tiny", max_batch_size=8, grpc_port=6000, random_fallback=False)
    # An explicit flag wins over the environment.
    args = build_parser({"GPT2SERVE_MAX_BATCH_SIZE": "8"}).parse_args(["serve", "--max-batch-size", "3"])
    assert config_from_args(args).max_batch_size == 3


def test_defaults_follow_the_contract():
    config = config_from_args(build_parser({}).parse_args(["serve"]))
    assert (config.model, config.device, config.dtype, config.grpc_port, config.http_port) == (
        "gpt2", "auto", "auto", 50051, 8000)


@pytest.mark.parametrize("argv", [["serve", "--max-batch-size", "0"], ["serve", "--max-batch-tokens", "0"],
                                  ["serve", "--grpc-port", "70000"], ["serve", "--stream-interval", "0"]])
def test_bad_serve_flags_exit_2(argv):
    out = run_cli(*argv)
    assert out.returncode == 2 and ("must be" in out.stderr or "outside" in out.stderr), out.stderr


def test_bad_env_value_is_reported_by_its_own_command_only():
    out = run_cli("serve", env={"GPT2SERVE_MAX_QUEUE": "lots"})
    assert out.returncode == 2 and "gpt2serve serve" in out.stderr and "GPT2SERVE_MAX_QUEUE='lots'" in out.stderr
    out = run_cli("next", "hi", env={"GPT2SERVE_NEXT_TOP_K": "many", "GPT2SERVE_MAX_QUEUE": "lots"})
    assert out.returncode == 2 and "gpt2serve next:" in out.stderr and "GPT2SERVE_NEXT_TOP_K='many'" in out.stderr
    assert "GPT2SERVE_MAX_QUEUE" not in out.stderr  # serve's variable is no business of next's
    out = run_cli("params", "gpt2", env={"GPT2SERVE_NEXT_TOP_K": "many", "GPT2SERVE_MAX_QUEUE": "lots"})
    assert out.returncode == 0, out.stderr


def env_variables(parser) -> dict[str, set[tuple[str, str]]]:
    """Each env variable the CLI reads -> the (command, flag) pairs that read it."""
    import argparse

    found: dict[str, set[tuple[str, str]]] = {}
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for command, subparser in sub.choices.items():
        for action in subparser._actions:
            match = re.search(r"\[env (GPT2SERVE_\w+)", action.help or "")
            if match:
                found.setdefault(match.group(1), set()).add((command, action.dest))
    return found


def test_env_variable_names_do_not_collide_between_commands():
    """One name, one meaning: only GPT2SERVE_TARGET (the server a client command talks to) is
    shared; serve's --seed (weights) and generate's --seed (sampling) read different variables."""
    variables = env_variables(build_parser({}))
    shared = {name: users for name, users in variables.items() if len({c for c, _ in users}) > 1}
    assert set(shared) == {"GPT2SERVE_TARGET"} and {dest for _, dest in shared["GPT2SERVE_TARGET"]} == {"target"}
    assert variables["GPT2SERVE_SEED"] == {("serve", "seed")}
    assert variables["GPT2SERVE_GENERATE_SEED"] == {("generate", "seed")}
    args = build_parser({"GPT2SERVE_SEED": "7", "GPT2SERVE_GENERATE_SEED": "3"}).parse_args(["generate", "hi"])
    assert args.seed == 3
    args = build_parser({"GPT2SERVE_SEED": "7", "GPT2SERVE_GENERATE_SEED": "3"}).parse_args(["serve"])
    assert args.seed == 7


def test_next_trace_prints_a_per_layer_table(server, tiny_model):
    """Against the plain session server: no exporter there, so the table comes from include_layers."""
    from support.reference import reference_layers

    prompt_ids = [464, 3139, 286, 4881, 318]
    out = run_cli("next", "The capital of France is", "--trace", "--target", server.grpc_target)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("layer"))
    rows = lines[header + 2: header + 2 + tiny_model.model.config.n_layer]
    want = reference_layers(tiny_model.model, prompt_ids)
    for index, row in enumerate(rows):
        assert row.split()[:5] == [str(index), "[5,64]", "[4,5,16]", "[4,5,5]", "[5,256]"]
        # The most focused head's weight and position, as the reference computes them.
        focused = max(range(len(want[index]["max_weight"])), key=lambda h: want[index]["max_weight"][h])
        assert f"h{focused} -> " in row
        assert f"({want[index]['top_position'][focused]}, {want[index]['max_weight'][focused]:.2f})" in row
    assert "(batch shapes: hidden [1,5,64], attn [1,4,5,5])" in out.stdout


def test_layer_reports_refused_when_the_server_says_never(tmp_path):
    from support.servers import launch_server

    from gpt2serve_client import Client, Gpt2ServeError

    srv = launch_server(tmp_path, "--model", "random:tiny", "--trace-layers", "never")
    try:
        with Client(srv.grpc_target) as client:
            assert client.next_token("fine").token
            with pytest.raises(Gpt2ServeError) as refused:
                client.next_token("layers please", include_layers=True)
        assert refused.value.code == "FAILED_PRECONDITION" and "--trace-layers never" in refused.value.message
    finally:
        srv.stop()


@pytest.mark.slow
@pytest.mark.parametrize("api,clients", [("grpc", 4), ("rest", 1)])
def test_bench_reports_load_and_the_in_process_limit(server, api, clients):
    import json

    out = run_cli("bench", "--api", api, "--target", server.grpc_target, "--http-target", server.http_url,
                  "-c", str(clients), "-d", "1.5", "--warmup", "0.3", "--limit-duration", "0.4", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    load = report["load"]
    assert load["api"] == api and load["requests"] > 0 and load["errors"] == 0
    assert load["p50_ms"] <= load["p90_ms"] <= load["p99_ms"]
    assert 1 <= load["mean_batch_size"] <= clients
    assert load["server_forward_p50_ms"] <= load["server_total_p50_ms"]
    sizes = [r["batch_size"] for r in report["in_process"]]
    assert sizes == sorted({1, clients})
    best = max((r["prompts_per_s"] for r in report["in_process"][1:] or report["in_process"]))
    assert report["ratio"] == pytest.approx(load["req_per_s"] / best)
    assert report["model"]["model"] == "random:tiny"


@pytest.mark.slow
def test_bench_spreads_its_clients_over_processes(server):
    import json

    before = requests_total(server.http_url, "grpc", "NextToken", "OK")
    out = run_cli("bench", "--target", server.grpc_target, "-c", "6", "-p", "2", "-d", "1.5", "--warmup", "0.3",
                  "--limit-duration", "0.4", "--json")
    assert out.returncode == 0, out.stderr
    load = json.loads(out.stdout)["load"]
    assert load["concurrency"] == 6 and load["requests"] > 0 and load["errors"] == 0
    # Both client processes sent (warm-up included): the server counted at least what was measured.
    assert requests_total(server.http_url, "grpc", "NextToken", "OK") - before >= load["requests"]


@pytest.mark.slow
@pytest.mark.parametrize("sizes", ["1,4", "1"])  # one size of 1 too: the first-request figures need two prompts
def test_bench_in_process_times_the_engine_against_transformers(sizes):
    import json

    out = run_cli("bench", "--in-process", "--model", "random:tiny", "--device", "cpu", "--dtype", "float32",
                  "--batch-sizes", sizes, "--rounds", "1", "--per-round", "2", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert [r["batch_size"] for r in report["sizes"]] == [int(s) for s in sizes.split(",")]
    for r in report["sizes"]:
        assert r["engine_ms"] > 0 and r["transformers_ms"] > 0 and not r["cuda_graph"]
        assert r["ratio"] == pytest.approx(r["transformers_ms"] / r["engine_ms"])
    assert set(report["first_request"]) == {"untraced", "traced"}
    assert "random:tiny, float32 on cpu" in report["header"]


@pytest.mark.slow
def test_bench_generate_against_transformers_generate(server):
    import json

    # 1 stream from this process, 3 spread over 2 client processes.
    out = run_cli("bench", "--generate", "--target", server.grpc_target, "--streams", "1,3", "--new-tokens", "6",
                  "--rounds", "2", "-d", "0.5", "--limit-duration", "0.1", "-p", "2", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["model"]["model"] == "random:tiny" and report["rounds"] == 2 and report["new_tokens"] == 6
    assert [r["streams"] for r in report["results"]] == [1, 3]
    for r in report["results"]:
        # Every stream ran to its max_tokens (ignore_eos): whole requests of 6 tokens, none failed.
        assert r["errors"] == 0 and r["tokens"] >= r["streams"] * 6 * 2 and r["tokens"] % 6 == 0
        assert 0 < r["time_to_first_token_p50_ms"] and 0 < r["time_per_output_token_p50_ms"]
        assert len(r["round_ratios"]) == 2 and r["transformers_tokens_per_s"] > 0
        assert min(r["round_ratios"]) <= r["ratio"] <= max(r["round_ratios"])
        assert 0 < r["busiest_client"] < 1.5  # one client process's own CPU, in cores


def test_help_is_whole():
    """`gpt2serve --help` says what every command does, in whole sentences (it once stopped mid-sentence)."""
    out = run_cli("--help")
    assert out.returncode == 0
    description = out.stdout.split("\n\n")[1].replace("\n", " ")
    assert description.rstrip().endswith(".")
    for command in ("serve", "next", "score", "generate", "tokenize", "bench", "params"):
        assert f"`{command}`" in description and command in out.stdout.split("\n\n")[0]
