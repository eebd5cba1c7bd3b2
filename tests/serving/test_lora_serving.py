"""LoRA adapters on a running server (`--lora-modules`), against peft's own forward: chosen by the
OpenAI `model` field (the openai SDK), by `adapter` on gRPC and REST (the typed clients, sync and
async), listed by /v1/models with the base as parent, mixed with the base in concurrent calls;
an unknown adapter is 404 / NOT_FOUND naming it, and the server goes on serving. Each test runs on
one process and on --workers 2, where requests cross the IPC door with their adapter."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest
from gpt2serve_client import AsyncClient, Client, Gpt2ServeError, RestClient
from gpt2serve_client.types import NextTokenResult
from support.generation import LIVELY, transformers_greedy
from support.lora import make_adapter, make_adapters, peft_model, peft_shifts
from support.otlp_receiver import OtlpReceiver
from support.reference import (
    assert_matches_reference,
    assert_prompt_scores_match,
    transformers_random_model,
)
from prometheus_client.parser import text_string_to_metric_families
from support.servers import launch_server, metric_value, openai_client, wait_for

PROMPT = [5, 6, 7, 8, 9, 10, 11]
CHATML = (Path(__file__).resolve().parents[2] / "examples" / "chat-templates" / "chatml.jinja").read_text()


@pytest.fixture(scope="module", params=["1", "2"], ids=["one-process", "workers-2"])
def lora(tmp_path_factory, request):
    """(server, checkpoint dir, adapter dirs, peft judges by name, the base judge)."""
    directory = tmp_path_factory.mktemp("lora-serving")
    hf = transformers_random_model(seed=3, **LIVELY)
    hf.save_pretrained(directory / "ckpt")
    dirs = make_adapters(directory / "ckpt", directory)
    modules = [f"{name}={path}" for name, path in dirs.items()]
    receiver = OtlpReceiver().start()
    # Loading while serving allowed by our flag (one process) and by vLLM's variable (--workers 2).
    allowed = ["--allow-runtime-lora-updating"] if request.param == "1" else []
    env = {**receiver.server_env(), **({} if allowed else {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})}
    srv = launch_server(directory, "--model", str(directory / "ckpt"), "--served-model-name", "base-gpt2",
                        "--lora-modules", *modules, "--max-lora-rank", "8", "--workers", request.param,
                        "--chat-template", CHATML, *allowed, env=env)
    srv.receiver = receiver
    judges = {name: peft_model(directory / "ckpt", path) for name, path in dirs.items()}
    yield srv, directory / "ckpt", dirs, judges, hf
    srv.stop()
    receiver.stop()


def test_v1_models_lists_each_adapter_with_the_base_as_parent(lora):
    srv = lora[0]
    models = openai_client(srv.http_url).models.list().data
    by_id = {m.id: m for m in models}
    assert list(by_id) == ["base-gpt2", "poet", "coder", "critic"]
    assert by_id["base-gpt2"].model_extra["parent"] is None
    assert all(by_id[name].model_extra["parent"] == "base-gpt2" for name in ("poet", "coder", "critic"))
    with Client(srv.grpc_target) as client:
        assert client.model_info().adapters == ["poet", "coder", "critic"]


def test_the_openai_sdk_chooses_an_adapter_by_model_and_generates_as_peft_does(lora, tokenizer):
    srv, _, _, judges, hf = lora
    client = openai_client(srv.http_url)
    for name, judge in [("coder", judges["coder"]), ("critic", judges["critic"]), ("base-gpt2", hf)]:
        answer = client.completions.create(model=name, prompt=PROMPT, max_tokens=6, temperature=0)
        assert answer.model == name
        assert answer.choices[0].text == tokenizer.decode(transformers_greedy(judge, PROMPT, 6)), name


def test_langchain_chats_through_an_adapter_by_model(lora, tokenizer):
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    srv, _, _, judges, _ = lora
    messages = [{"role": "user", "content": "Name a river."}]
    with RestClient(srv.http_url) as rest:
        prompt = rest.tokenize(messages=messages).tokens  # the chat template's ids, as chat renders them
    chat = ChatOpenAI(model="critic", base_url=f"{srv.http_url}/v1", api_key="unused", temperature=0, max_tokens=6,
                      max_retries=0, extra_body={"ignore_eos": True})
    reply = chat.invoke([HumanMessage("Name a river.")])
    assert reply.content == tokenizer.decode(transformers_greedy(judges["critic"], prompt, 6))
    assert reply.response_metadata["model_name"] == "critic"


def test_grpc_and_rest_choose_an_adapter_by_its_field_and_answer_as_peft_does(lora):
    srv, _, _, judges, hf = lora
    with Client(srv.grpc_target) as grpc_client, RestClient(srv.http_url) as rest:
        for name in ("poet", "coder"):
            for result in (grpc_client.next_token(PROMPT, top_k=5, adapter=name),
                           rest.next_token(PROMPT, top_k=5, adapter=name)):
                assert_matches_reference(judges[name], result, PROMPT, 5)
        scored = rest.next_token_batch([PROMPT, PROMPT[:4]], top_k=1, prompt_logprobs=2, adapter="critic")
        for prompt, result in zip([PROMPT, PROMPT[:4]], scored):
            entries = result.prompt_logprobs[1:]
            assert_prompt_scores_match(judges["critic"], prompt, [e.logprob for e in entries], [e.rank for e in entries],
                                       [[t.token_id for t in e.top] for e in entries],
                                       [[t.logprob for t in e.top] for e in entries])
        generated = grpc_client.generate(PROMPT, max_tokens=5, temperature=0, adapter="poet")
        assert [t.token_id for t in generated.tokens] == transformers_greedy(judges["poet"], PROMPT, 5)
        streamed = rest.generate(PROMPT, max_tokens=5, temperature=0, adapter="coder")
        assert [t.token_id for t in streamed.tokens] == transformers_greedy(judges["coder"], PROMPT, 5)


def test_compare_base_sets_the_adapter_beside_the_base_on_grpc_rest_and_the_layer_spans(lora):
    srv, _, _, judges, hf = lora
    want = peft_shifts(judges["coder"], PROMPT)
    with Client(srv.grpc_target) as grpc_client, RestClient(srv.http_url) as rest:
        results = [grpc_client.next_token(PROMPT, top_k=4, adapter="coder", compare_base=True, trace_layers=True),
                   rest.next_token(PROMPT, top_k=4, adapter="coder", compare_base=True)]
        for result in results:
            assert_matches_reference(judges["coder"], result, PROMPT, 4)
            best = result.base_top[0]
            base = dataclasses.replace(result, top=result.base_top, token_id=best.token_id, logprob=best.logprob)
            assert_matches_reference(hf, base, PROMPT, 4)  # the base's own top-k, beside the adapter's
            got = [(r.base_residual_shift, r.base_attn_shift, r.base_mlp_shift) for r in result.layers]
            assert got == [pytest.approx(w, rel=1e-3, abs=1e-5) for w in want]
            assert len(result.layers[0].base_logit_lens) == len(result.layers[0].logit_lens) > 0
        traced = results[0]
        plain = grpc_client.next_token(PROMPT, top_k=4, adapter="coder", include_layers=True)
        assert plain.base_top == [] and plain.layers[0].base_residual_shift is None  # only when asked
        with pytest.raises(Gpt2ServeError) as refused:  # nothing to compare: the base is the base
            grpc_client.next_token(PROMPT, compare_base=True)
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT.name and "adapter" in refused.value.message
    blocks = [s for s in srv.receiver.wait_for(traced.trace_id, {"block 0"}) if s.name.startswith("block ")]
    by_index = {s.attributes["gpt2.layer.index"]: s for s in blocks}
    assert by_index[0].attributes["gpt2.adapter.residual_shift"] == pytest.approx(want[0][0], rel=1e-3)
    assert by_index[0].attributes["gpt2.base.logit_lens.token"]
    assert httpx.post(f"{srv.http_url}/v1/next-token", json={"prompt_token_ids": PROMPT, "compare_base": True}
                      ).status_code == 400


def test_concurrent_calls_under_different_adapters_and_the_base_each_get_their_own_answer(lora):
    srv, _, _, judges, hf = lora
    names = [None, "poet", "coder", "critic"] * 4
    prompts = [[(7 * i + j) % 50257 for j in range(3 + i % 5)] for i in range(len(names))]

    async def run():
        async with AsyncClient(srv.grpc_target) as client:
            return await asyncio.gather(*(client.next_token(p, top_k=3, adapter=n) for p, n in zip(prompts, names)))

    for prompt, name, result in zip(prompts, names, asyncio.run(run())):
        assert_matches_reference(judges[name] if name else hf, result, prompt, 3)


def test_spans_carry_the_adapter_and_metrics_count_requests_by_adapter(lora):
    srv = lora[0]
    counted = {"adapter": "critic", "status": "OK"}
    before = metric_value(srv.http_url, "gpt2serve_lora_requests_total", counted)
    with Client(srv.grpc_target) as client:
        traced = client.next_token(PROMPT, adapter="critic")
        base = client.next_token(PROMPT)
        client.generate(PROMPT, max_tokens=2, adapter="critic")
    [span] = [s for s in srv.receiver.wait_for(traced.trace_id, {"gpt2serve.v1.Gpt2Serve/NextToken"})
              if s.name == "gpt2serve.v1.Gpt2Serve/NextToken"]
    assert span.attributes["gpt2serve.adapter"] == "critic"
    [base_span] = [s for s in srv.receiver.wait_for(base.trace_id, {"gpt2serve.v1.Gpt2Serve/NextToken"})
                   if s.name == "gpt2serve.v1.Gpt2Serve/NextToken"]
    assert "gpt2serve.adapter" not in base_span.attributes
    assert metric_value(srv.http_url, "gpt2serve_lora_requests_total", counted) == before + 2
    # The request log names the adapter (the base's lines name none).
    wait_for(lambda: f"adapter=critic trace_id={traced.trace_id}" in srv.log(), timeout=10, what="the request line")
    assert f"trace_id={base.trace_id}" in srv.log() and f"adapter=critic trace_id={base.trace_id}" not in srv.log()


def lora_readings(http_url: str) -> list[tuple[float, dict]]:
    """vllm:lora_requests_info's series: (when read, labels), the latest first."""
    text = httpx.get(f"{http_url}/metrics", timeout=10).text
    return sorted(((sample.value, sample.labels) for family in text_string_to_metric_families(text)
                   for sample in family.samples if sample.name == "vllm:lora_requests_info"),
                  key=lambda reading: -reading[0])


def test_vllm_lora_requests_info_names_the_running_adapters(lora):
    srv = lora[0]
    with Client(srv.grpc_target) as client:
        # Step traces make each step a traced forward too: a long enough generation to be read running.
        stream = client.generate_stream(PROMPT, max_tokens=120, temperature=0, ignore_eos=True, adapter="coder",
                                        trace_steps=True)
        first = next(stream)  # running now
        try:
            # The step's trace ran under the adapter too: its top tokens are peft's.
            assert_matches_reference(lora[3]["coder"], NextTokenResult(
                first.step.top[0].token_id, "", first.step.top[0].logprob, first.step.top, PROMPT), PROMPT, 5)
            seen = wait_for(lambda: lora_readings(srv.http_url)[0][1]["running_lora_adapters"] == "coder",
                            timeout=10, what="coder running in vllm:lora_requests_info")
            assert seen and lora_readings(srv.http_url)[0][1]["max_lora"] == "3"
        finally:
            stream.close()
    wait_for(lambda: lora_readings(srv.http_url)[0][1]["running_lora_adapters"] == "", timeout=10,
             what="no adapter running once the stream is closed")


def test_an_unknown_adapter_is_not_found_by_name_and_the_server_keeps_serving(lora):
    srv, _, _, _, hf = lora
    with Client(srv.grpc_target) as client:
        with pytest.raises(Gpt2ServeError) as refused:
            client.next_token(PROMPT, adapter="pirate")
        assert refused.value.code == grpc.StatusCode.NOT_FOUND.name and "pirate" in refused.value.message
        with pytest.raises(Gpt2ServeError) as refused:
            client.generate(PROMPT, max_tokens=2, adapter="pirate")
        assert refused.value.code == grpc.StatusCode.NOT_FOUND.name and "pirate" in refused.value.message
        assert_matches_reference(hf, client.next_token(PROMPT, top_k=3), PROMPT, 3)
    rest = httpx.post(f"{srv.http_url}/v1/next-token", json={"prompt_token_ids": PROMPT, "adapter": "pirate"})
    assert rest.status_code == 404 and "pirate" in rest.text
    openai = httpx.post(f"{srv.http_url}/v1/completions", json={"model": "pirate", "prompt": "x", "max_tokens": 1})
    assert openai.status_code == 404 and openai.json()["error"]["code"] == "model_not_found"
    assert "coder" in openai.json()["error"]["message"]  # it names what is served


def test_the_cli_generates_through_an_adapter(lora, tokenizer):
    srv, _, _, judges, _ = lora
    text = "The capital of France is"
    done = subprocess.run([sys.executable, "-m", "gpt2serve.cli", "generate", text, "--target", srv.grpc_target,
                           "--adapter", "coder", "--max-tokens", "5", "--temperature", "0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    want = tokenizer.decode(transformers_greedy(judges["coder"], tokenizer.encode(text), 5))
    assert done.stdout == want + "\n"
    beside = subprocess.run([sys.executable, "-m", "gpt2serve.cli", "next", text, "--target", srv.grpc_target,
                             "--adapter", "coder", "--compare-base"], capture_output=True, text=True, timeout=60)
    assert beside.returncode == 0, beside.stderr
    shift_rows = [line.split() for line in beside.stdout.splitlines() if re.match(r"\d+\s+[\d.]+%", line)]
    want = peft_shifts(judges["coder"], tokenizer.encode(text))
    assert [float(row[1].rstrip("%")) for row in shift_rows] == [pytest.approx(100 * w[0], abs=0.06) for w in want]
    refused = subprocess.run([sys.executable, "-m", "gpt2serve.cli", "next", text, "--target", srv.grpc_target,
                              "--adapter", "pirate"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "NOT_FOUND" in refused.stderr and "pirate" in refused.stderr


def test_adapters_load_and_unload_while_serving_and_every_front_end_follows(lora, tmp_path, tokenizer):
    srv, ckpt, _, judges, _ = lora
    extra = make_adapter(ckpt, tmp_path / "extra", 4, ["c_fc", "c_attn"], 12, True, seed=11)
    judge = peft_model(ckpt, extra)
    want = tokenizer.decode(transformers_greedy(judge, PROMPT, 4))
    with Client(srv.grpc_target) as client:
        # A generation under an adapter runs on while another is loaded, then while its own is unloaded.
        stream = client.generate_stream(PROMPT, max_tokens=40, temperature=0, ignore_eos=True, adapter="poet",
                                        trace_steps=True)
        first = next(stream)
        loaded = httpx.post(f"{srv.http_url}/v1/load_lora_adapter", json={"lora_name": "extra", "lora_path": str(extra)})
        assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'extra' added successfully."
        # Each call on a new connection: under --workers 2 the kernel spreads them over both front ends.
        for _ in range(6):
            assert "extra" in [m["id"] for m in httpx.get(f"{srv.http_url}/v1/models").json()["data"]]
            answer = httpx.post(f"{srv.http_url}/v1/completions", json={
                "model": "extra", "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
            assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == want
        assert client.list_adapters() == ["poet", "coder", "critic", "extra"]
        assert_matches_reference(judge, client.next_token(PROMPT, top_k=3, adapter="extra"), PROMPT, 3)
        again = httpx.post(f"{srv.http_url}/v1/load_lora_adapter", json={"lora_name": "extra", "lora_path": str(extra)})
        assert again.status_code == 400 and "loaded already" in again.json()["error"]["message"]
        missing = httpx.post(f"{srv.http_url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nowhere"})
        assert missing.status_code == 400 and "/nowhere" in missing.json()["error"]["message"]
        assert client.unload_adapter("poet") == ["coder", "critic", "extra"]
        tokens = [first.token.token_id, *(chunk.token.token_id for chunk in stream if chunk.token is not None)]
        assert tokens == transformers_greedy(judges["poet"], PROMPT, 40)  # finished under the unloaded adapter
        with pytest.raises(Gpt2ServeError) as gone:
            client.next_token(PROMPT, adapter="poet")
        assert gone.value.code == "NOT_FOUND"
        for _ in range(6):
            refused = httpx.post(f"{srv.http_url}/v1/completions", json={"model": "poet", "prompt": "x", "max_tokens": 1})
            assert refused.status_code == 404
        unknown = httpx.post(f"{srv.http_url}/v1/unload_lora_adapter", json={"lora_name": "pirate"})
        assert unknown.status_code == 404 and "pirate" in unknown.json()["error"]["message"]
        # Back as it was for the other tests: poet from its directory again, extra gone.
        assert client.unload_adapter("extra") == ["coder", "critic"]
        assert client.load_adapter("poet", str(lora[2]["poet"])) == ["coder", "critic", "poet"]


def test_loading_adapters_needs_the_flag_and_the_api_key(tmp_path):
    srv = launch_server(tmp_path, "--model", "random:tiny", "--api-key", "sesame")
    try:
        body = {"lora_name": "x", "lora_path": str(tmp_path)}
        assert httpx.post(f"{srv.http_url}/v1/load_lora_adapter", json=body).status_code == 401
        refused = httpx.post(f"{srv.http_url}/v1/load_lora_adapter", json=body,
                             headers={"authorization": "Bearer sesame"})
        assert refused.status_code == 400 and "--allow-runtime-lora-updating" in refused.json()["error"]["message"]
        malformed = httpx.post(f"{srv.http_url}/v1/load_lora_adapter", json={"lora_name": 5},
                               headers={"authorization": "Bearer sesame"})
        assert malformed.status_code == 400 and "lora_name" in malformed.json()["error"]["message"]
        with Client(srv.grpc_target, api_key="sesame") as client:
            with pytest.raises(Gpt2ServeError) as off:
                client.load_adapter("x", str(tmp_path))
            assert off.value.code == "FAILED_PRECONDITION" and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in off.value.message
        with Client(srv.grpc_target) as keyless, pytest.raises(Gpt2ServeError) as denied:
            keyless.list_adapters()
        assert denied.value.code == "UNAUTHENTICATED"
    finally:
        srv.stop()


@pytest.mark.parametrize("entry, why", [("bad=/nonexistent/dir", "no adapter_config.json"),
                                        ("big={big}", "rank 16 is over --max-lora-rank 8")])
def test_an_adapter_that_cannot_be_served_stops_the_start_in_one_line(tmp_path, lora, entry, why):
    _, ckpt, _, _, _ = lora
    big = make_adapter(ckpt, tmp_path / "big", 16, ["c_attn"], 8, False, seed=1)
    entry = entry.format(big=big)
    done = subprocess.run([sys.executable, "-m", "gpt2serve.cli", "serve", "--host", "127.0.0.1", "--grpc-port", "0",
                           "--http-port", "0", "--model", str(ckpt), "--device", "cpu", "--lora-modules", entry,
                           "--max-lora-rank", "8"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    lines = [line for line in (done.stdout + done.stderr).splitlines() if "cannot start" in line]
    assert len(lines) == 1 and f"--lora-modules {entry}" in lines[0] and why in lines[0], done.stdout + done.stderr
    assert "Traceback" not in done.stderr


def test_max_loras_and_max_cpu_loras_serve_every_adapter_as_peft_does(tmp_path, lora):
    """vLLM's flags on a served model: one adapter a step, two of three in memory; concurrent calls
    under all three and the base each get peft's answer, the gauge's max_lora is the limit, and a
    limit that cannot hold (--max-cpu-loras under --max-loras) stops the start in one line."""
    _, ckpt, dirs, judges, hf = lora
    modules = [f"{name}={path}" for name, path in dirs.items()]
    srv = launch_server(tmp_path, "--model", str(ckpt), "--lora-modules", *modules, "--max-lora-rank", "8",
                        "--max-loras", "1", "--max-cpu-loras", "2")
    try:
        names = [None, "poet", "coder", "critic"] * 3
        prompts = [[(5 * i + j) % 50257 for j in range(3 + i % 4)] for i in range(len(names))]

        async def run():
            async with AsyncClient(srv.grpc_target) as client:
                return await asyncio.gather(*(client.generate(p, max_tokens=3, temperature=0, adapter=n)
                                              for p, n in zip(prompts, names)))

        for prompt, name, result in zip(prompts, names, asyncio.run(run())):
            assert [t.token_id for t in result.tokens] == transformers_greedy(judges[name] if name else hf, prompt, 3)
        assert lora_readings(srv.http_url)[0][1]["max_lora"] == "1"
    finally:
        srv.stop()
    done = subprocess.run([sys.executable, "-m", "gpt2serve.cli", "serve", "--model", "random:tiny", "--max-loras", "2",
                           "--max-cpu-loras", "1"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "--max-cpu-loras >= --max-loras" in done.stderr and "Traceback" not in done.stderr
