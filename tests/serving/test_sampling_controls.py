"""The logits controls over the wire: gRPC, REST and the official `openai` client (OpenAI's
fields, and vLLM's through extra_body) reach the engine, with one process and with the engine
behind IPC (--workers 2); each gives the reference's tokens (transformers' forward with the
controls written out); bad values are refused naming the field; min_tokens holds back the end."""

from __future__ import annotations

import httpx
import openai
import pytest
from support.generation import LIVELY, PROMPTS, reference_greedy
from support.reference import transformers_random_model
from support.servers import launch_server, openai_client

from gpt2serve.protocol import SamplingParams
from gpt2serve_client import Client, Gpt2ServeError, RestClient

EOS = 50256
# The bias brings a prompt token in; the penalties then keep it from coming back (the three
# references below differ, so each kind of control shows in the tokens).
CONTROLS = dict(repetition_penalty=1.2, frequency_penalty=1.5, presence_penalty=1.0, logit_bias={PROMPTS[4][1]: 8.0})
REFERENCE = SamplingParams(temperature=0.0, repetition_penalty=1.2, frequency_penalty=1.5, presence_penalty=1.0,
                           logit_bias=((PROMPTS[4][1], 8.0),))


@pytest.fixture(scope="module")
def hf():
    return transformers_random_model(seed=3, **LIVELY)


@pytest.fixture(scope="module", params=["1", "2"], ids=["workers-1", "workers-2"])
def server(request, tmp_path_factory, hf):
    path = tmp_path_factory.mktemp("controls")
    hf.save_pretrained(path / "ckpt")
    srv = launch_server(path, "--model", str(path / "ckpt"), "--workers", request.param,
                        "--chat-template", "{% for m in messages %}{{ m.content }}{% endfor %}")
    yield srv
    srv.stop()


def ids(result) -> list[int]:
    return [t.token_id for t in result.tokens]


def test_each_api_gives_the_references_tokens(server, hf):
    want = reference_greedy(hf, PROMPTS[4], 16, REFERENCE)
    for weaker in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logit_bias=REFERENCE.logit_bias),
                   SamplingParams(temperature=0.0, logit_bias=REFERENCE.logit_bias, repetition_penalty=1.2)):
        assert want != reference_greedy(hf, PROMPTS[4], 16, weaker), ("a control changes nothing", weaker)
    with Client(server.grpc_target) as grpc:
        assert ids(grpc.generate(PROMPTS[4], max_tokens=16, temperature=0, ignore_eos=True, **CONTROLS)) == want
    with RestClient(server.http_url) as rest:
        assert ids(rest.generate(PROMPTS[4], max_tokens=16, temperature=0, ignore_eos=True, **CONTROLS)) == want
        streamed = [c.token.token_id for c in rest.generate_stream(PROMPTS[4], max_tokens=16, temperature=0,
                                                                   ignore_eos=True, **CONTROLS) if c.token]
        assert streamed == want
    oai = openai_client(server.http_url)
    model = oai.models.list().data[0].id
    completion = oai.completions.create(
        model=model, prompt=PROMPTS[4], max_tokens=16, temperature=0, presence_penalty=1.0, frequency_penalty=1.5,
        logit_bias={str(PROMPTS[4][1]): 8}, extra_body={"repetition_penalty": 1.2, "ignore_eos": True})
    with Client(server.grpc_target) as grpc:
        plain = grpc.generate(PROMPTS[4], max_tokens=16, temperature=0, ignore_eos=True)
        controlled = grpc.generate(PROMPTS[4], max_tokens=16, temperature=0, ignore_eos=True, **CONTROLS)
    assert completion.choices[0].finish_reason == "length"
    assert completion.choices[0].text == controlled.text != plain.text

def test_min_tokens_holds_the_end_back_then_lets_it_come(server):
    with Client(server.grpc_target) as grpc:
        result = grpc.generate(PROMPTS[2], max_tokens=10, temperature=0, logit_bias={EOS: 100.0}, min_tokens=3)
    assert len(result.tokens) == 3 and EOS not in ids(result)
    assert result.finish_reason == "eos"


def test_chat_takes_the_controls(server):
    """A bias of 100 on "," makes every token a comma; OpenAI's fields and vLLM's (extra_body)."""
    oai = openai_client(server.http_url)
    model = oai.models.list().data[0].id
    chat = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       temperature=0.7, presence_penalty=-0.5, logit_bias={"11": 100},
                                       extra_body={"min_p": 0.1, "min_tokens": 2, "repetition_penalty": 1.1})
    assert chat.choices[0].message.content == ",,,,"


@pytest.mark.parametrize(("field", "value", "says"), [
    ("presence_penalty", 2.5, "presence_penalty: 2.5 is outside [-2, 2]"),
    ("frequency_penalty", -3, "frequency_penalty: -3"),
    ("repetition_penalty", 0, "repetition_penalty: 0"),
    ("min_p", 1.5, "min_p: 1.5"),
    ("min_tokens", 99, "min_tokens: 99 is outside 0..max_tokens (8)"),
    ("logit_bias", {"50257": 1}, "logit_bias: token 50257 is outside the vocabulary"),
    ("logit_bias", {"7": 101}, "logit_bias: 101"),
    ("logit_bias", {"seven": 1}, "logit_bias: key 'seven' is not a token id"),
])
def test_a_bad_value_is_refused_naming_the_field(server, field, value, says):
    body = {"prompt_token_ids": PROMPTS[1], "max_tokens": 8, field: value}
    response = httpx.post(f"{server.http_url}/v1/generate", json=body, timeout=30)
    assert response.status_code == 400 and says in response.json()["error"]["message"], response.text
    model = httpx.get(f"{server.http_url}/v1/models", timeout=30).json()["data"][0]["id"]
    oai = httpx.post(f"{server.http_url}/v1/completions", json={"model": model, "prompt": PROMPTS[1], "max_tokens": 8,
                                                                 field: value}, timeout=30)
    assert oai.status_code == 400 and says in oai.json()["error"]["message"], oai.text
    assert oai.json()["error"]["param"] == field


def test_grpc_refuses_a_bad_value_naming_the_field(server):
    with Client(server.grpc_target) as grpc, pytest.raises(Gpt2ServeError) as caught:
        grpc.generate(PROMPTS[1], max_tokens=4, presence_penalty=9.0)
    assert caught.value.code == "INVALID_ARGUMENT" and "presence_penalty" in caught.value.message


def test_completions_n_gives_each_prompts_choices_in_order_each_its_own_seed(server):
    """Choice i * n + j of prompt i draws with seed + j: the answer a one-choice request with
    that seed gets."""
    oai = openai_client(server.http_url)
    model = oai.models.list().data[0].id
    prompts = [PROMPTS[2], PROMPTS[6]]
    many = oai.completions.create(model=model, prompt=prompts, n=3, max_tokens=6, temperature=1.0, seed=40,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in many.choices] == list(range(6))
    for i, prompt in enumerate(prompts):
        for j in range(3):
            one = oai.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=1.0, seed=40 + j,
                                         extra_body={"ignore_eos": True})
            assert many.choices[i * 3 + j].text == one.choices[0].text
    assert len({c.text for c in many.choices[:3]}) > 1, "the choices drew alike"


def test_completions_best_of_returns_the_n_of_highest_cumulative_logprob(server):
    oai = openai_client(server.http_url)
    model = oai.models.list().data[0].id
    candidates = []
    for j in range(4):
        one = oai.completions.create(model=model, prompt=PROMPTS[7], max_tokens=5, temperature=1.0, seed=9 + j,
                                     logprobs=0, extra_body={"ignore_eos": True})
        candidates.append((sum(one.choices[0].logprobs.token_logprobs), one.choices[0].text))
    best = oai.completions.create(model=model, prompt=PROMPTS[7], n=2, best_of=4, max_tokens=5, temperature=1.0,
                                  seed=9, extra_body={"ignore_eos": True})
    want = [text for _, text in sorted(candidates, key=lambda c: -c[0])[:2]]
    assert [c.text for c in best.choices] == want and [c.index for c in best.choices] == [0, 1]
    for bad, param in ((dict(n=3, best_of=2), "best_of"), (dict(best_of=2, stream=True), "best_of"),
                       (dict(n=0), "n"), (dict(n=65), "n")):
        with pytest.raises(openai.BadRequestError) as refused:
            oai.completions.create(model=model, prompt=PROMPTS[7], max_tokens=2, **bad)
        assert refused.value.body["param"] == param, (bad, refused.value.body)


def test_openai_stop_token_ids_end_the_text(server, hf):
    oai = openai_client(server.http_url)
    model = oai.models.list().data[0].id
    full = reference_greedy(hf, PROMPTS[4], 8, SamplingParams(temperature=0.0))
    cut = oai.completions.create(model=model, prompt=PROMPTS[4], max_tokens=8, temperature=0,
                                 extra_body={"stop_token_ids": [full[3]], "ignore_eos": True}, logprobs=0)
    assert len(cut.choices[0].logprobs.tokens) == 3 and cut.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_an_unknown_field_is_refused_naming_it_and_the_ignored_ones_are_taken(server, route):
    model = httpx.get(f"{server.http_url}/v1/models", timeout=30).json()["data"][0]["id"]
    base = ({"model": model, "prompt": PROMPTS[1], "max_tokens": 2} if route == "/v1/completions" else
            {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    for unknown in ({"guided_choise": ["yes", "no"]}, {"guided_decoding_backend": "xgrammar"},
                    {"structured_output": {"choice": ["a"]}}, {"topk": 3}):
        refused = httpx.post(f"{server.http_url}{route}", json={**base, **unknown}, timeout=30)
        (field,) = unknown
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field, refused.text
        assert "refused, never ignored" in refused.json()["error"]["message"]
    ignored = {"user": "u1"} if route == "/v1/completions" else {"user": "u1", "metadata": {"k": "v"}, "store": False}
    assert httpx.post(f"{server.http_url}{route}", json={**base, **ignored}, timeout=30).status_code == 200
