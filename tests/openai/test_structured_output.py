"""Structured output over the wire, with the clients people use: the `openai` SDK
(response_format json_schema and json_object, vLLM's structured_outputs and guided_* through
extra_body), LangChain's `ChatOpenAI(...).with_structured_output(PydanticModel)`, our REST
/v1/generate and gRPC `Generate`; with the engine in process and behind IPC (--workers 2). Every
answer parses and validates (jsonschema); a schema that does not compile is a 400 quoting
llguidance; a generation cut by max_tokens says "length"."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pydantic
import pytest
from support.servers import launch_server, openai_client

from gpt2serve_client import Client, Gpt2ServeError, RestClient

TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "role": {"enum": ["admin", "user"]}},
          "required": ["name", "age", "role"], "additionalProperties": False}


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=120)


@pytest.fixture(scope="module", params=["1", "2"], ids=["workers-1", "workers-2"])
def server(request, tmp_path_factory):
    srv = launch_server(tmp_path_factory.mktemp("structured"), "--model", "random:gpt2", "--workers", request.param,
                        "--chat-template", TEMPLATE)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oai(server):
    return openai_client(server.http_url)


@pytest.fixture(scope="module")
def model(oai):
    return oai.models.list().data[0].id


def test_completions_json_schema_and_json_object(oai, model):
    """json_object: any object; cut by max_tokens it says so, and nothing is claimed of its text."""
    # response_format is chat's in OpenAI's API; on completions it is vLLM's (through extra_body)
    answer = oai.completions.create(model=model, prompt="A person:", max_tokens=80, temperature=0.9, seed=3,
                                    extra_body={"response_format": {"type": "json_schema",
                                                                    "json_schema": {"name": "person", "schema": PERSON}}})
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].text), PERSON)
    anything = oai.completions.create(model=model, prompt="{", max_tokens=60, temperature=0.7, seed=4,
                                      extra_body={"response_format": {"type": "json_object"}})
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].text), dict)


def test_vllm_fields_choice_regex_and_grammar(oai, model):
    def text(**extra) -> str:
        answer = oai.completions.create(model=model, prompt="Answer:", max_tokens=24, temperature=1.0, seed=5,
                                        extra_body=extra)
        assert answer.choices[0].finish_reason == "stop", answer
        return answer.choices[0].text

    assert text(guided_choice=["yes", "no"]) in ("yes", "no")
    assert text(structured_outputs={"choice": ["red", "blue"]}) in ("red", "blue")
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", text(guided_regex=r"[0-9]{3}-[0-9]{4}"))
    assert re.fullmatch(r"[0-9]{2}", text(structured_outputs={"regex": r"[0-9]{2}"}))
    assert text(structured_outputs={"grammar": 'start: "go " ("left" | "right")'}) in ("go left", "go right")
    assert text(guided_grammar='root ::= "a" | "b"') in ("a", "b")  # GBNF, as llama.cpp writes it
    jsonschema.validate(json.loads(text(guided_json=PERSON)), PERSON)


def test_chat_and_langchain_with_structured_output(server, oai, model):
    answer = oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Who?"}], max_tokens=80, temperature=0.8, seed=2,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    jsonschema.validate(json.loads(answer.choices[0].message.content), PERSON)
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model=model, base_url=f"{server.http_url}/v1", api_key="unused", temperature=0.8,
                      max_tokens=80, seed=1, max_retries=0)
    person = chat.with_structured_output(Person, method="json_schema").invoke("Describe someone.")
    assert isinstance(person, Person) and 0 <= person.age <= 120


def test_our_own_apis(server):
    with RestClient(server.http_url) as rest:
        body = {"prompt": "Phone:", "max_tokens": 20, "temperature": 1.0, "seed": 1,
                "structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}}
        answer = httpx.post(f"{server.http_url}/v1/generate", json=body, timeout=60).json()
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", answer["text"]) and answer["finish_reason"] == "eos"
        streamed = "".join(c.text for c in rest.generate_stream("Pick:", max_tokens=10, choice=["north", "south"]))
        assert streamed in ("north", "south")
    with Client(server.grpc_target) as grpc:
        result = grpc.generate("A person:", max_tokens=80, temperature=0.9, seed=7, json_schema=PERSON)
        jsonschema.validate(json.loads(result.text), PERSON)
        assert result.finish_reason == "eos"
        assert grpc.generate("Hex:", max_tokens=12, regex="[a-f0-9]{4}").text.__len__() == 4
        with pytest.raises(Gpt2ServeError) as refused:
            grpc.generate("x", max_tokens=4, regex="[0-9")
        assert refused.value.code == "INVALID_ARGUMENT" and "unclosed character class" in refused.value.message


def test_cut_by_max_tokens_says_length(oai, model):
    answer = oai.completions.create(model=model, prompt="Digits:", max_tokens=3, temperature=0.5,
                                    extra_body={"guided_regex": "[0-9]{60}"})  # 3 tokens cannot hold 60 digits
    assert answer.choices[0].finish_reason == "length" and re.fullmatch("[0-9]{1,59}", answer.choices[0].text)


@pytest.mark.parametrize(("extra", "param", "says"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format", "llguidance"),
    ({"response_format": {"type": "yaml"}}, "response_format", "not one of text, json_object, json_schema"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "llguidance"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice", "one structured output a request"),
    ({"guided_choice": ["a"], "ignore_eos": True}, "ignore_eos", "not with guided_choice"),
    ({"structured_outputs": {"choices": ["a"]}}, "structured_outputs", "refused, never ignored"),
])
def test_a_bad_constraint_is_a_400_naming_the_field(server, model, extra, param, says):
    response = httpx.post(f"{server.http_url}/v1/completions",
                          json={"model": model, "prompt": "x", "max_tokens": 4, **extra}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert says in error["message"] and error["param"] == param, error
