"""Scoring whole prompts (prompt_logprobs) over the wire: the engine's numbers
(tests/engine/test_prompt_scores.py) over gRPC, REST, both clients and the official `openai` client
(echo + logprobs); bad input refused."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from support.servers import openai_client
import torch
from support.reference import (TOLERANCE, assert_matches_reference, assert_prompt_scores_match, reference_prompt_logprobs)

from gpt2serve_client import AsyncClient, Client, Gpt2ServeError, RestClient, perplexity
from gpt2serve_client.types import NextTokenResult

# On the shared random:tiny server ---------------------------------------------------------------------

TEXT = "The quick brown fox jumps over the lazy dog, and then it naps."


def random_prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 50257, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_result_scores(model, result: NextTokenResult, k: int) -> None:
    entries = result.prompt_logprobs
    ids = result.prompt_token_ids
    assert [e.token_id for e in entries] == ids
    assert entries[0].logprob is None and entries[0].rank is None and entries[0].top == []
    assert all(len(e.top) == k for e in entries[1:])
    assert_prompt_scores_match(model, ids, [e.logprob for e in entries[1:]], [e.rank for e in entries[1:]],
                               [[t.token_id for t in e.top] for e in entries[1:]],
                               [[t.logprob for t in e.top] for e in entries[1:]])


def test_grpc_and_rest_score_prompts_as_transformers_does(server, tiny_model, tokenizer):
    with Client(server.grpc_target) as grpc, RestClient(server.http_url) as rest:
        one = grpc.next_token(TEXT, prompt_logprobs=3)
        assert_result_scores(tiny_model.model, one, 3)
        assert [e.token for e in one.prompt_logprobs] == [tokenizer.token_text(i) for i in one.prompt_token_ids]
        assert not grpc.next_token(TEXT).prompt_logprobs  # not asked: not computed, not sent
        batch = rest.next_token_batch([TEXT, [464, 3139, 286, 4881, 318], "Hi"], prompt_logprobs=0)
        for result in batch:
            assert_result_scores(tiny_model.model, result, 0)
        assert rest.next_token(TEXT, prompt_logprobs=3).prompt_logprobs == one.prompt_logprobs or \
            all(abs(a.logprob - b.logprob) <= TOLERANCE
                for a, b in zip(rest.next_token(TEXT, prompt_logprobs=3).prompt_logprobs[1:], one.prompt_logprobs[1:]))
        grpc_batch = grpc.next_token_batch([TEXT, "Hi"], prompt_logprobs=1)
        assert_result_scores(tiny_model.model, grpc_batch[0], 1)
        assert len(grpc_batch[1].prompt_logprobs) == 1  # one token: nothing to score, its entry says so


def test_scored_and_plain_requests_share_batches_and_both_stay_right(server, tiny_model):
    """Concurrent calls, half of them scored: the server batches them together (batch_size > 1)
    and every answer equals the prompt's own."""
    prompts = [random_prompt(n, 100 + n) for n in (3, 12, 30, 5, 21, 8, 16, 2)]

    async def run():
        async with AsyncClient(server.grpc_target) as client:
            return await asyncio.gather(*(client.next_token(p, top_k=2, prompt_logprobs=2 if i % 2 else None)
                                          for i, p in enumerate(prompts)))

    results = asyncio.run(run())
    assert max(r.batch_size for r in results) > 1
    for i, (prompt, result) in enumerate(zip(prompts, results)):
        assert_matches_reference(tiny_model.model, result, prompt, 2)
        if i % 2:
            assert_result_scores(tiny_model.model, result, 2)
        else:
            assert result.prompt_logprobs == []


def test_perplexity_is_the_exponent_of_the_mean_negative_logprob(server, tiny_model):
    with Client(server.grpc_target) as grpc:
        result = grpc.next_token(TEXT, prompt_logprobs=0)
    ref = reference_prompt_logprobs(tiny_model.model, result.prompt_token_ids)[:-1]
    want = torch.exp(-ref.gather(1, torch.tensor(result.prompt_token_ids[1:])[:, None]).mean()).item()
    assert perplexity(result.prompt_logprobs) == pytest.approx(want, rel=1e-4)


@pytest.mark.parametrize("value", [-1, 21])
def test_an_out_of_range_prompt_logprobs_is_refused_on_every_api(server, value):
    with Client(server.grpc_target) as grpc:
        with pytest.raises(Gpt2ServeError) as refused:
            grpc.next_token(TEXT, prompt_logprobs=value)
        assert refused.value.code == "INVALID_ARGUMENT" and "prompt_logprobs" in refused.value.message
    for path, body in (("/v1/next-token", {"prompt": TEXT}), ("/v1/next-token/batch", {"prompts": [TEXT]})):
        response = httpx.post(f"{server.http_url}{path}", json={**body, "prompt_logprobs": value})
        assert response.status_code == 400 and "prompt_logprobs" in response.text


def test_a_prompt_past_the_context_is_refused_naming_the_limit(server):
    with Client(server.grpc_target) as grpc:
        with pytest.raises(Gpt2ServeError) as refused:
            grpc.next_token(list(range(300)), prompt_logprobs=0)  # random:tiny holds 256
    assert refused.value.code == "INVALID_ARGUMENT" and "256" in refused.value.message


# The official openai client: echo + logprobs -----------------------------------------------------------

@pytest.fixture(scope="module")
def oai(server):
    return openai_client(server.http_url)


def test_echo_with_max_tokens_0_scores_each_prompt_of_a_list(oai, tiny_model, tokenizer):
    prompts = [tokenizer.encode(TEXT), [464, 3139, 286, 4881, 318], [15496]]
    completion = oai.completions.create(model="random:tiny", prompt=prompts, max_tokens=0, echo=True, logprobs=2)
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert completion.usage.prompt_tokens == sum(map(len, prompts)) and completion.usage.completion_tokens == 0
    for prompt, choice in zip(prompts, completion.choices):
        lp = choice.logprobs
        assert choice.text == tokenizer.decode(prompt)
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(prompt)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        ref = reference_prompt_logprobs(tiny_model.model, prompt)
        for i in range(1, len(prompt)):
            assert abs(lp.token_logprobs[i] - ref[i - 1, prompt[i]].item()) <= TOLERANCE
            assert len(lp.top_logprobs[i]) == 2
            assert max(lp.top_logprobs[i].values()) == pytest.approx(ref[i - 1].max().item(), abs=TOLERANCE)
        assert "".join(tokenizer.token_text(t) for t in prompt).startswith(choice.text[:lp.text_offset[-1]])


def test_echo_with_generation_lists_the_prompt_then_the_generated_tokens(oai, tiny_model):
    prompt = [464, 3139, 286, 4881, 318]
    plain = oai.completions.create(model="random:tiny", prompt=prompt, max_tokens=3, temperature=0, logprobs=1,
                                   extra_body={"ignore_eos": True})
    echoed = oai.completions.create(model="random:tiny", prompt=prompt, max_tokens=3, temperature=0, logprobs=1,
                                    echo=True, extra_body={"ignore_eos": True})
    lp = echoed.choices[0].logprobs
    assert echoed.choices[0].text.endswith(plain.choices[0].text)
    assert lp.token_logprobs[len(prompt):] == plain.choices[0].logprobs.token_logprobs
    assert lp.tokens[len(prompt):] == plain.choices[0].logprobs.tokens
    ref = reference_prompt_logprobs(tiny_model.model, prompt)
    assert lp.token_logprobs[0] is None
    for i in range(1, len(prompt)):
        assert abs(lp.token_logprobs[i] - ref[i - 1, prompt[i]].item()) <= TOLERANCE
    # lm-evaluation-harness' reading: the last prompt entry is greedy iff it is the top one
    assert lp.text_offset == sorted(lp.text_offset) and len(lp.text_offset) == len(prompt) + 3


def test_partial_utf8_tokens_are_written_as_bytes(oai, tokenizer):
    prompt = tokenizer.encode("snow \u2603 man")  # the snowman is three tokens of one byte-level piece each
    choice = oai.completions.create(model="random:tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=0).choices[0]
    pieces = [tokenizer.token_bytes(t) for t in prompt]
    for token, raw in zip(choice.logprobs.tokens, pieces):
        try:
            assert token == raw.decode("utf-8")
        except UnicodeDecodeError:
            assert token == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    assert any(t.startswith("bytes:") for t in choice.logprobs.tokens)
    assert choice.text == "snow \u2603 man"
    assert choice.logprobs.text_offset[-1] == choice.text.index(" man")


@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 0, "echo": True, "logprobs": 21}, "logprobs"),
    ({"echo": True, "stream": True}, "echo"),
])
def test_what_is_still_refused_is_a_400_naming_it(oai, fields, param):
    with pytest.raises(openai.BadRequestError) as refused:
        oai.completions.create(model="random:tiny", prompt="Hi there", **fields)
    assert refused.value.body["param"] == param and param in refused.value.body["message"]


def test_an_empty_or_too_long_echo_prompt_is_refused(oai):
    for prompt, words in (("", "empty"), (list(range(300)), "256")):
        with pytest.raises(openai.BadRequestError) as refused:
            oai.completions.create(model="random:tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
        assert words in refused.value.body["message"]


# gpt2serve score ----------------------------------------------------------------------------------------

def test_score_prints_each_token_its_logprob_rank_and_the_perplexity(server, tiny_model, tokenizer, tmp_path):
    import math
    import re
    import subprocess
    import sys

    path = tmp_path / "text.txt"
    path.write_text(TEXT)
    out = subprocess.run([sys.executable, "-m", "gpt2serve.cli", "score", "--file", str(path), "--target",
                          server.grpc_target], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    ids = tokenizer.encode(TEXT)
    ref = reference_prompt_logprobs(tiny_model.model, ids)
    lines = out.stdout.splitlines()
    rows = [line.split() for line in lines[2:2 + len(ids)]]
    assert [int(r[0]) for r in rows] == list(range(len(ids)))
    assert rows[0][2:] == ["-", "-", "-", "-"]
    for position, row in enumerate(rows[1:], 1):
        want = ref[position - 1, ids[position]].item()
        assert abs(float(row[2]) - want) < 1e-3
        assert int(row[3]) == int((ref[position - 1] > want).sum()) + 1
        assert abs(float(row[5]) - ref[position - 1].max().item()) < 1e-3
    mean = ref[:-1].gather(1, torch.tensor(ids[1:])[:, None]).mean().item()
    scored, shown = re.fullmatch(r"(\d+) tokens scored, perplexity ([\d.]+)", lines[-1]).groups()
    assert int(scored) == len(ids) - 1 and float(shown) == pytest.approx(math.exp(-mean), rel=1e-5)
    refused = subprocess.run([sys.executable, "-m", "gpt2serve.cli", "score", "", "--target", server.grpc_target],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "TEXT or --file" in refused.stderr


# Fuzz: the scoring fields, with an oracle ---------------------------------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

SCORING_FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
fuzz_prompts = st.one_of(st.lists(st.integers(0, 50256), min_size=1, max_size=40),
                         st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=80),
                         st.lists(st.lists(st.integers(0, 50256), min_size=1, max_size=12), min_size=1, max_size=4))


def encodes_to_tokens(prompt, tokenizer) -> bool:
    texts = [prompt] if isinstance(prompt, str) else []
    return all(tokenizer.encode(t) for t in texts)


@SCORING_FUZZ
@given(prompt=fuzz_prompts, echo=st.booleans(), max_tokens=st.integers(-1, 3),
       logprobs=st.one_of(st.none(), st.integers(-2, 24)), stream=st.booleans())
def test_completions_scoring_fields_answered_or_refused_as_documented(server, tokenizer, prompt, echo, max_tokens,
                                                                       logprobs, stream):
    body = {"model": "random:tiny", "prompt": prompt, "echo": echo, "max_tokens": max_tokens, "stream": stream,
            "temperature": 0}
    if logprobs is not None:
        body["logprobs"] = logprobs
    valid = (encodes_to_tokens(prompt, tokenizer) and max_tokens >= 0 and not (max_tokens == 0 and not echo)
             and not (echo and stream) and (logprobs is None or 0 <= logprobs <= 20))
    response = httpx.post(f"{server.http_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == (200 if valid else 400), (body, response.text[:300])
    if not valid:
        assert response.json()["error"]["message"]
    elif not stream:
        prompts = prompt if isinstance(prompt, list) and isinstance(prompt[0], list) else [prompt]
        choices = response.json()["choices"]
        assert len(choices) == len(prompts)
        for item, choice in zip(prompts, choices):
            ids = tokenizer.encode(item) if isinstance(item, str) else item
            if echo and logprobs is not None:
                lp = choice["logprobs"]
                assert lp["token_logprobs"][0] is None and len(lp["tokens"]) >= len(ids)
                assert all(v <= 0 for v in lp["token_logprobs"][1:len(ids)])


@SCORING_FUZZ
@given(prompt=st.one_of(st.lists(st.integers(0, 50256), min_size=1, max_size=40),
                        st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=80)),
       k=st.integers(-3, 24), top_k=st.integers(1, 30))
def test_rest_prompt_logprobs_answered_or_refused_as_documented(server, tokenizer, prompt, k, top_k):
    field = {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": prompt}
    response = httpx.post(f"{server.http_url}/v1/next-token", json={**field, "prompt_logprobs": k, "top_k": top_k},
                          timeout=60)
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    valid = bool(ids) and 0 <= k <= 20
    assert response.status_code == (200 if valid else 400), response.text[:300]
    if valid:
        entries = response.json()["prompt_logprobs"]
        assert [e["token_id"] for e in entries] == ids
        assert entries[0]["logprob"] is None and all(len(e["top"]) == k and e["rank"] >= 1 for e in entries[1:])
