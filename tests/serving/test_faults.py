"""Engine faults fail only their batch; out of memory splits the batch; checkpoints load safely;
prompt text stays out of the logs."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
import pytest
from support.servers import launch_server
from support.faulty_server import FAIL_TOKEN, NAN_TOKEN, OOM_TOKEN
from support.reference import assert_matches_reference

from gpt2serve_client import AsyncClient, Client, Gpt2ServeError

FAULTY = (str(Path(__file__).resolve().parents[1] / "support" / "faulty_server.py"),)


@pytest.fixture(scope="module")
def faulty_server(tmp_path_factory):
    srv = launch_server(tmp_path_factory.mktemp("faulty"), "--model", "random:tiny", "--max-batch-size", "8",
                        "--max-batch-delay-ms", "50", "--log-level", "debug", entry=FAULTY)
    yield srv
    srv.stop()


def test_a_failing_forward_fails_only_its_batch(faulty_server, tiny_model):
    """Two calls of 8 prompts each are two batches (max batch 8, a call's prompts queue together)."""
    good = [[464 + i, 3139, 286] for i in range(8)]
    doomed = [[464, 3139], [FAIL_TOKEN, 5]] + good[:6]

    async def main():
        async with AsyncClient(faulty_server.grpc_target) as client:
            return await asyncio.gather(client.next_token_batch(doomed, top_k=3),
                                        client.next_token_batch(good, top_k=3), return_exceptions=True)

    failed, answered = asyncio.run(main())
    assert isinstance(failed, Gpt2ServeError) and failed.code == "INTERNAL"
    assert "forward pass failed" in failed.message
    assert "injected fault" not in failed.message and "RuntimeError" not in failed.message  # the log has it
    assert not isinstance(answered, Exception), answered
    for prompt, result in zip(good, answered):
        assert_matches_reference(tiny_model.model, result, prompt, 3)
    with Client(faulty_server.grpc_target) as client:  # and the server keeps serving
        assert_matches_reference(tiny_model.model, client.next_token(good[0], top_k=3), good[0], 3)
    log = faulty_server.log()
    assert "forward pass failed for a batch of 8" in log and "injected fault in the forward pass" in log


def test_a_non_finite_row_fails_alone_and_its_batch_is_answered(faulty_server, tiny_model):
    """NaN logits in one row (an fp16 overflow, say): that prompt gets INTERNAL with a clear
    message; the other prompts of the same forward get their right answers."""
    good = [[464 + i, 3139, 286] for i in range(7)]

    async def main():
        async with AsyncClient(faulty_server.grpc_target) as client:
            return await asyncio.gather(client.next_token([NAN_TOKEN, 5]),
                                        *(client.next_token(p, top_k=3) for p in good), return_exceptions=True)

    failed, *answered = asyncio.run(main())
    assert isinstance(failed, Gpt2ServeError) and failed.code == "INTERNAL", failed
    assert "not finite" in failed.message
    for prompt, result in zip(good, answered):
        assert not isinstance(result, Exception), result
        assert_matches_reference(tiny_model.model, result, prompt, 3)
    assert max(r.batch_size for r in answered) > 1  # they did share forwards with it or each other


def test_a_non_finite_generation_fails_alone_beside_running_streams(faulty_server):
    """A generation whose logits turn NaN fails (500 on REST) while greedy streams started with
    it, in the same prefill, finish with what they give alone."""
    prompts = [[464 + i, 3139, 286] for i in range(4)]
    body = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=faulty_server.http_url, timeout=60) as http:
        alone = [http.post("/v1/generate", json={**body, "prompt_token_ids": p}).json()["text"] for p in prompts]

    async def main():
        async with httpx.AsyncClient(base_url=faulty_server.http_url, timeout=60) as http:
            return await asyncio.gather(http.post("/v1/generate", json={**body, "prompt_token_ids": [NAN_TOKEN, 5]}),
                                        *(http.post("/v1/generate", json={**body, "prompt_token_ids": p})
                                          for p in prompts))

    bad, *good = asyncio.run(main())
    assert bad.status_code == 500 and "not finite" in bad.json()["error"]["message"]
    assert [r.json().get("text", r.text) for r in good] == alone  # an error body shows what failed


def test_out_of_memory_splits_the_batch_until_it_fits(faulty_server, tiny_model):
    prompts = [[464 + i, 3139] for i in range(7)] + [[OOM_TOKEN, 11]]
    with Client(faulty_server.grpc_target) as client:
        results = client.next_token_batch(prompts, top_k=2)
    for prompt, result in zip(prompts, results):
        assert_matches_reference(tiny_model.model, result, prompt, 2)
    # 8 -> 4 + 4 -> the half with the OOM prompt: 2 + 2 -> 1 + 1.
    assert [r.batch_size for r in results] == [4, 4, 4, 4, 2, 2, 1, 1]
    log = faulty_server.log()
    assert [int(n) for n in re.findall(r"injected OOM for a batch of (\d+)", log)][-3:] == [8, 4, 2]
    assert "out of memory for a batch of 8; retrying it as two halves" in log


def test_prompt_text_is_not_logged(faulty_server):
    secret = "my card number is 4111-1111-1111-1111"
    with Client(faulty_server.grpc_target) as client:
        client.next_token(secret)
        with pytest.raises(Gpt2ServeError):
            client.next_token(secret, top_k=0)  # a refusal does not log it either
    log = faulty_server.log()
    assert "batch:" in log  # the debug log is on, and still no prompt text
    assert "4111" not in log and "card number" not in log


@pytest.fixture(scope="module")
def pickle_checkpoint(tmp_path_factory, tiny_model):
    """A checkpoint with only pytorch_model.bin (pickle), saved here (transformers 5 itself
    writes safetensors only)."""
    import torch
    from support.reference import as_transformers

    path = tmp_path_factory.mktemp("pickle") / "ckpt"
    hf_model = as_transformers(tiny_model.model)
    hf_model.config.save_pretrained(path)
    torch.save(hf_model.state_dict(), path / "pytorch_model.bin")
    assert (path / "pytorch_model.bin").exists() and not list(path.glob("*.safetensors"))
    return path


def test_pickle_checkpoints_are_refused_by_default(pickle_checkpoint, tmp_path):
    srv = launch_server(tmp_path, "--model", str(pickle_checkpoint), "--random-fallback", "false", wait_ready=False)
    assert srv.proc.wait(timeout=120) != 0
    assert "only pickle weights" in srv.log() and "--allow-pickle" in srv.log()


def test_pickle_checkpoints_load_with_the_flag(pickle_checkpoint, tmp_path, tiny_model):
    srv = launch_server(tmp_path, "--model", str(pickle_checkpoint), "--allow-pickle")
    try:
        with Client(srv.grpc_target) as client:
            info = client.model_info()
            result = client.next_token([464, 3139], top_k=3)
        assert info.weights == "pretrained"
        assert_matches_reference(tiny_model.model, result, [464, 3139], 3)
    finally:
        srv.stop()
