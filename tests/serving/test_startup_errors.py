"""A server that cannot start says why in one line that names the cause and the flag (or the
files a checkpoint needs); `--log-level debug` brings the traceback back. And a checkpoint that
a test saves itself, without tokenizer files, is served with a warning naming the tokenizer."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
from support.reference import transformers_random_model
from support.servers import free_ports, launch_server

from gpt2serve_client import Client


def serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpt2serve.cli", "serve", "--host", "127.0.0.1", *args],
                          capture_output=True, text=True, timeout=120)


def error_lines(done: subprocess.CompletedProcess) -> list[str]:
    """What a person reads: the lines that are not the server's INFO log or its listening line."""
    return [line for line in (done.stdout + done.stderr).splitlines()
            if line.strip() and " INFO " not in line and not line.startswith("gpt2serve listening:")]


@pytest.mark.parametrize("flag, workers", [("--http-port", "1"), ("--grpc-port", "1"), ("--grpc-port", "2")])
def test_a_port_in_use_is_one_line_naming_the_port_and_the_flag(flag, workers):
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    other = "--grpc-port" if flag == "--http-port" else "--http-port"
    try:
        done = serve("--model", "random:tiny", flag, str(port), other, "0", "--workers", workers)
        assert done.returncode == 1
        assert error_lines(done) == [f"gpt2serve serve: cannot start: port {port} on 127.0.0.1 is in use by another "
                                     f"process: choose another with {flag} (0 picks a free one)"]
        debug = serve("--model", "random:tiny", flag, str(port), other, "0", "--workers", "1", "--log-level", "debug")
        assert debug.returncode == 1 and "Traceback" in debug.stderr and "Address already in use" in debug.stderr
    finally:
        held.close()


def test_a_second_server_on_a_taken_grpc_port_fails_rather_than_share_it(tmp_path):
    first = launch_server(tmp_path, "--model", "random:tiny")
    try:
        port = int(first.grpc_target.rsplit(":", 1)[1])
        for server in ("builtin", "grpcio"):
            done = serve("--model", "random:tiny", "--grpc-port", str(port), "--http-port", "0",
                         "--grpc-server", server)
            assert done.returncode == 1 and "--grpc-port" in error_lines(done)[-1], (server, done.stderr)
    finally:
        first.stop()


def test_a_checkpoint_missing_files_names_them(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    done = serve("--model", str(empty), *ports())
    assert done.returncode == 1
    (line,) = error_lines(done)
    assert line.startswith(f"gpt2serve serve: cannot load model: {empty}: no config.json; a checkpoint directory "
                           "holds what `model.save_pretrained(dir)` writes: config.json and model.safetensors")
    transformers_random_model(seed=1).config.save_pretrained(tmp_path / "config-only")
    done = serve("--model", str(tmp_path / "config-only"), *ports())
    (line,) = error_lines(done)
    assert done.returncode == 1 and "no weights (no *.safetensors file)" in line and "save_pretrained" in line


def test_a_bad_chat_template_is_one_line(tmp_path):
    done = serve("--model", "random:tiny", "--chat-template", "{% if %}", *ports())
    assert done.returncode == 2
    assert error_lines(done) == ["gpt2serve serve: --chat-template (inline): the chat template does not parse: "
                                 "line 1: Expected an expression, got 'end of statement block'"]


def test_a_fine_tuned_checkpoint_without_tokenizer_files_is_served_with_a_warning(tmp_path, tokenizer):
    transformers_random_model(seed=3).save_pretrained(tmp_path / "fine-tuned")  # weights and config only
    srv = launch_server(tmp_path, "--model", str(tmp_path / "fine-tuned"), "--served-model-name", "my-fine-tune")
    try:
        warning = [line for line in srv.log().splitlines() if "WARNING" in line and "tokenizer" in line]
        assert len(warning) == 1 and "has no tokenizer files" in warning[0] and "GPT-2's own tokenizer" in warning[0]
        with Client(srv.grpc_target) as client:
            assert client.model_info().model == "my-fine-tune"
            assert client.tokenize("Hello world").tokens == tokenizer.encode("Hello world")
    finally:
        srv.stop()


def ports() -> tuple[str, ...]:
    grpc_port, http_port = free_ports(2)
    return "--grpc-port", str(grpc_port), "--http-port", str(http_port)
