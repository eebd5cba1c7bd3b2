"""Generate over the wire: gRPC streams, REST (JSON and server-sent events), the official
`openai` client, and the CLI, against a real server on a checkpoint saved here."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from support.servers import launch_server, metric_value, requests_total, openai_client
from support.reference import transformers_random_model
from support.generation import LIVELY, PROMPTS, transformers_greedy

from gpt2serve_client import Client, Gpt2ServeError, RestClient


@pytest.fixture(scope="module")
def hf():
    return transformers_random_model(seed=3, **LIVELY)


@pytest.fixture(scope="module")
def gen_server(tmp_path_factory, hf):
    path = tmp_path_factory.mktemp("generate")
    hf.save_pretrained(path / "ckpt")
    srv = launch_server(path, "--model", str(path / "ckpt"), "--max-running-sequences", "8")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def grpc(gen_server):
    with Client(gen_server.grpc_target) as client:
        yield client


@pytest.fixture(scope="module")
def rest(gen_server):
    with RestClient(gen_server.http_url) as client:
        yield client


@pytest.fixture(scope="module")
def oai(gen_server):
    return openai_client(gen_server.http_url)


def ids(result) -> list[int]:
    return [t.token_id for t in result.tokens]


def test_greedy_over_grpc_matches_transformers(grpc, hf):
    result = grpc.generate(PROMPTS[5], max_tokens=24, temperature=0, ignore_eos=True)
    assert ids(result) == transformers_greedy(hf, PROMPTS[5], 24)
    assert result.finish_reason == "length" and result.usage.completion_tokens == 24
    assert result.usage.prompt_tokens == len(PROMPTS[5]) and result.prompt_token_ids == PROMPTS[5]


def test_sixteen_concurrent_streams_joining_midway_match_transformers(gen_server, hf):
    """16 callers, staggered, over 8 slots: each stream equals transformers' generate alone."""
    lengths = [8 + 4 * (i % 5) for i in range(16)]
    got: dict[int, list[int]] = {}

    def one(i: int) -> None:
        time.sleep(0.01 * i)
        with Client(gen_server.grpc_target) as client:
            got[i] = [c.token.token_id for c in client.generate_stream(PROMPTS[i], max_tokens=lengths[i],
                                                                        temperature=0, ignore_eos=True) if c.token]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(16):
        assert got[i] == transformers_greedy(hf, PROMPTS[i], lengths[i]), i


def test_seeded_sampling_is_reproducible_alone_and_batched(gen_server, grpc):
    settings = dict(max_tokens=20, temperature=0.9, top_p=0.95, top_k=100, seed=77, ignore_eos=True)
    alone = ids(grpc.generate(PROMPTS[2], **settings))
    assert ids(grpc.generate(PROMPTS[2], **settings)) == alone
    batched: dict[str, list[int]] = {}

    def other(i: int) -> None:
        with Client(gen_server.grpc_target) as client:
            client.generate(PROMPTS[8 + i], max_tokens=30, temperature=1.2, seed=i)

    def mine() -> None:
        time.sleep(0.02)
        with Client(gen_server.grpc_target) as client:
            batched["mine"] = ids(client.generate(PROMPTS[2], **settings))

    threads = [threading.Thread(target=other, args=(i,)) for i in range(6)] + [threading.Thread(target=mine)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert batched["mine"] == alone
    assert ids(grpc.generate(PROMPTS[2], **{**settings, "seed": 78})) != alone


def test_max_tokens_and_stop_end_where_they_should(grpc, rest, hf):
    greedy = grpc.generate(PROMPTS[4], max_tokens=12, temperature=0, ignore_eos=True)
    assert len(greedy.tokens) == 12 and greedy.finish_reason == "length"
    # A stop token: the output is everything before it.
    stop_id = greedy.tokens[5].token_id
    cut = next(i for i, t in enumerate(greedy.tokens) if t.token_id == stop_id)
    by_id = rest.generate(PROMPTS[4], max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[stop_id])
    assert ids(by_id) == ids(greedy)[:cut] and by_id.finish_reason == "stop"
    # A stop string spanning the end of one token and the start of the next: cut out of the text.
    texts = [t.token for t in greedy.tokens]
    stop = texts[6][-2:] + texts[7][:2]
    start = greedy.text.find(stop)
    by_text = grpc.generate(PROMPTS[4], max_tokens=12, temperature=0, ignore_eos=True, stop=[stop, "never seen"])
    assert by_text.text == greedy.text[:start] and by_text.finish_reason == "stop"
    streamed = "".join(c.text for c in rest.generate_stream(PROMPTS[4], max_tokens=12, temperature=0,
                                                            ignore_eos=True, stop=stop))
    assert streamed == by_text.text


def test_every_stream_yields_the_non_streamed_tokens(grpc, rest, oai):
    prompt = "The capital of France is"
    settings = dict(max_tokens=16, temperature=0.8, seed=5, ignore_eos=True)
    reference = grpc.generate(prompt, logprobs=3, **settings)
    assert len(reference.tokens) == 16 and all(len(t.top) == 3 for t in reference.tokens)
    grpc_chunks = list(grpc.generate_stream(prompt, **settings))
    assert [c.token.token_id for c in grpc_chunks[:-1]] == ids(reference)
    assert grpc_chunks[-1].token is None and grpc_chunks[-1].finish_reason == "length"
    assert "".join(c.text for c in grpc_chunks) == reference.text
    rest_chunks = list(rest.generate_stream(prompt, **settings))
    assert [c.token.token_id for c in rest_chunks if c.token] == ids(reference)
    assert ids(rest.generate(prompt, **settings)) == ids(reference)
    # OpenAI's client: its ids are the model's, its texts are ours.
    model = oai.models.list().data[0].id
    openai_settings = dict(max_tokens=16, temperature=0.8, seed=5, extra_body={"ignore_eos": True})
    completion = oai.completions.create(model=model, prompt=prompt, logprobs=3, **openai_settings)
    assert completion.choices[0].text == reference.text
    assert completion.choices[0].logprobs.tokens == [t.token for t in reference.tokens]
    assert completion.usage.completion_tokens == 16 and completion.usage.prompt_tokens == 5
    stream = oai.completions.create(model=model, prompt=prompt, stream=True,
                                    stream_options={"include_usage": True}, **openai_settings)
    events = list(stream)
    assert "".join(e.choices[0].text for e in events if e.choices) == reference.text
    assert events[-2].choices[0].finish_reason == "length" and events[-1].usage.completion_tokens == 16


def test_openai_token_prompt_and_errors(oai, grpc):
    model = oai.models.list().data[0].id
    by_ids = oai.completions.create(model=model, prompt=PROMPTS[3], max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == grpc.generate(PROMPTS[3], max_tokens=5, temperature=0).text
    with pytest.raises(openai.NotFoundError) as missing:
        oai.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert missing.value.body["code"] == "model_not_found"
    for bad in (dict(max_tokens=5000), dict(temperature=-1), dict(n=0), dict(top_p=0), dict(logprobs=50),
                dict(temperature="warm")):
        with pytest.raises(openai.BadRequestError) as err:
            oai.completions.create(**{"model": model, "prompt": "hi", "max_tokens": 2, **bad})
        assert err.value.body["type"] == "invalid_request_error" and err.value.body["message"]


def test_openai_prompt_list_runs_as_choices(gen_server, oai, grpc):
    """A list of prompts: one choice per prompt, in order, each what the prompt gives alone;
    streamed, the chunks carry their choice's index; one bad prompt fails the whole request."""
    model = oai.models.list().data[0].id
    prompts = ["The capital of France is", "Hello", "a b c d e f g"]
    alone = [grpc.generate(p, max_tokens=6, temperature=0, ignore_eos=True) for p in prompts]
    settings = dict(model=model, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    completion = oai.completions.create(prompt=prompts, logprobs=2, **settings)
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert [c.text for c in completion.choices] == [r.text for r in alone]
    assert [c.logprobs.tokens for c in completion.choices] == [[t.token for t in r.tokens] for r in alone]
    assert completion.usage.completion_tokens == 18
    assert completion.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in alone)
    by_ids = oai.completions.create(prompt=[PROMPTS[3], PROMPTS[5]], **settings)
    assert [c.text for c in by_ids.choices] == [grpc.generate(p, max_tokens=6, temperature=0, ignore_eos=True).text
                                                for p in (PROMPTS[3], PROMPTS[5])]

    texts, finished, usage = {}, {}, None
    for event in oai.completions.create(prompt=prompts, stream=True, stream_options={"include_usage": True},
                                        **settings):
        for choice in event.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
        usage = event.usage or usage
    assert texts == {i: r.text for i, r in enumerate(alone)} and finished == {0: "length", 1: "length", 2: "length"}
    assert usage.completion_tokens == 18 and usage.total_tokens == 18 + completion.usage.prompt_tokens

    limit = grpc.model_info().max_batch_size
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(prompt=["x"] * (limit + 1), **settings)
    assert f"limit of {limit}" in err.value.body["message"]
    long_prompt = PROMPTS[15] * 2  # 92 tokens + 200 > the context of 256
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            oai.completions.create(prompt=[PROMPTS[1], long_prompt], stream=stream,
                                   **{**settings, "max_tokens": 200})
        assert "context" in err.value.body["message"]
    # The good prompt's generation was cancelled with the request: no slot stays taken.
    assert wait_for_metric(gen_server.http_url, "gpt2serve_running_sequences", 0) == 0


def test_a_prompt_list_longer_than_the_cache_runs_in_turns(gen_server, oai, grpc):
    """20 prompts for 8 KV-cache slots: served (in turns), not refused with a 429 because the
    list's own choices hold the slots; each choice what its prompt gives alone. Counted as
    documented: one request per prompt (each choice is a generation of its own)."""
    model = oai.models.list().data[0].id
    slots = grpc.model_info().max_running_sequences
    assert slots == 8
    prompts = [PROMPTS[i % 16][: 3 + i] for i in range(20)]
    alone = [grpc.generate(p, max_tokens=5, temperature=0, ignore_eos=True).text for p in prompts]
    settings = dict(model=model, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    url = gen_server.http_url
    counted = requests_total(url, "openai", "Completions", "OK")
    completion = oai.completions.create(prompt=prompts, **settings)
    assert [c.text for c in completion.choices] == alone
    assert requests_total(url, "openai", "Completions", "OK") == counted + 20
    texts: dict[int, str] = {}
    for event in oai.completions.create(prompt=prompts, stream=True, **settings):
        for choice in event.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert [texts[i] for i in range(20)] == alone
    # A bad prompt anywhere in the list refuses the whole request at once, naming it.
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(prompt=[*prompts[:15], [50257]], **settings)
    assert "prompt[15]" in err.value.body["message"] and err.value.body["param"] == "prompt"
    assert wait_for_metric(url, "gpt2serve_running_sequences", 0) == 0


@pytest.mark.parametrize("kind", ["grpc", "rest"])
def test_bad_generate_requests_are_clear_errors(kind, grpc, rest, gen_server):
    client = grpc if kind == "grpc" else rest
    cases = [(dict(max_tokens=300), "context of 256"), (dict(temperature=-0.5), "temperature"),
             (dict(top_p=1.5), "top_p"), (dict(logprobs=21), "logprobs"), (dict(stop_token_ids=[60000]), "vocabulary"),
             (dict(max_tokens=0), "max_tokens")]
    for settings, words in cases:
        with pytest.raises(Gpt2ServeError) as err:
            client.generate("hello", **settings)
        assert err.value.code == "INVALID_ARGUMENT" and words in err.value.message
    response = httpx.post(f"{gen_server.http_url}/v1/generate", json={"prompt": "hi", "max_tokens": 999, "stream": True})
    assert response.status_code == 400 and "context" in response.json()["error"]["message"]
    response = httpx.post(f"{gen_server.http_url}/v1/generate", json={"prompt": "hi", "max_token": 3})
    assert response.status_code == 422  # a misspelt field is reported, not ignored
    assert client.generate("still serving", max_tokens=2).usage.completion_tokens == 2


def test_next_token_requests_are_not_starved_by_generation(gen_server, grpc):
    """While 8 long generations run, next-token calls are answered before the generations end."""
    done = []

    def long_one(i: int) -> None:
        with Client(gen_server.grpc_target) as client:
            client.generate(PROMPTS[i], max_tokens=200, temperature=0, ignore_eos=True)
            done.append(time.monotonic())

    threads = [threading.Thread(target=long_one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    answered = []
    for _ in range(5):
        grpc.next_token("The capital of France is")
        answered.append(time.monotonic())
    for t in threads:
        t.join()
    assert len(done) == 8 and max(answered) < min(done)


def test_generation_metrics(gen_server, grpc):
    url = gen_server.http_url
    before = metric_value(url, "gpt2serve_generated_tokens_total", {"api": "grpc"})
    ttft = metric_value(url, "gpt2serve_time_to_first_token_seconds_count", {"api": "grpc", "method": "Generate"})
    grpc.generate("metrics", max_tokens=7, temperature=0, ignore_eos=True)
    assert metric_value(url, "gpt2serve_generated_tokens_total", {"api": "grpc"}) == before + 7
    assert metric_value(url, "gpt2serve_time_to_first_token_seconds_count",
                        {"api": "grpc", "method": "Generate"}) == ttft + 1
    assert metric_value(url, "gpt2serve_time_per_output_token_seconds_count", {"api": "grpc"}) >= 1
    assert metric_value(url, "gpt2serve_running_sequences") == 0


def test_cli_generate_prints_tokens_as_they_come(gen_server, grpc):
    expected = grpc.generate("Once upon a time", max_tokens=10, temperature=0.8, top_p=0.95, seed=1).text
    out = subprocess.run([sys.executable, "-m", "gpt2serve.cli", "generate", "Once upon a time", "--max-tokens", "10",
                          "--temperature", "0.8", "--top-p", "0.95", "--seed", "1", "--target", gen_server.grpc_target],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == expected + "\n" and "length: 10 tokens" in out.stderr


# One slot: hang-ups and the wait for cache space --------------------------------------------------

@pytest.fixture(scope="module")
def one_slot(tmp_path_factory):
    """GPT-2 small's shape, so a long generation holds the slot for seconds on any CPU."""
    srv = launch_server(tmp_path_factory.mktemp("one-slot"), "--model", "random:gpt2", "--max-running-sequences", "1",
                        "--max-queue-wait-s", "0.3")
    yield srv
    srv.stop()


def wait_for_metric(url: str, name: str, value: float, labels=None, timeout: float = 5.0) -> float:
    deadline = time.monotonic() + timeout
    while (got := metric_value(url, name, labels)) != value and time.monotonic() < deadline:
        time.sleep(0.02)
    return got


@pytest.mark.parametrize("kind", ["grpc", "rest"])
def test_a_client_that_hangs_up_frees_its_slot(one_slot, kind):
    url = one_slot.http_url
    api = "grpc" if kind == "grpc" else "rest"
    cancelled = requests_total(url, api, "Generate", "CANCELLED")
    client = Client(one_slot.grpc_target) if kind == "grpc" else RestClient(url)
    stream = client.generate_stream("A very long story", max_tokens=400, temperature=0, ignore_eos=True)
    next(stream), next(stream), next(stream)
    assert metric_value(url, "gpt2serve_running_sequences") == 1
    # 4 prompt tokens + 400 may grow to 404 positions: 7 of the 16 blocks of one 1024-token slot
    assert metric_value(url, "gpt2serve_kv_cache_usage_ratio") == 7 / 16
    stream.close()  # hang up mid-stream
    assert wait_for_metric(url, "gpt2serve_running_sequences", 0) == 0
    assert wait_for_metric(url, "gpt2serve_kv_cache_usage_ratio", 0) == 0
    assert wait_for_metric(url, "gpt2serve_requests_total", cancelled + 1,
                           {"api": api, "method": "Generate", "status": "CANCELLED"}) == cancelled + 1
    # The one slot is free: the next generation starts at once.
    assert client.generate("next", max_tokens=3).usage.completion_tokens == 3
    client.close()


@pytest.mark.parametrize("kind", ["grpc", "rest"])
def test_no_cache_space_waits_then_resource_exhausted(one_slot, kind):
    """The holder has no deadline and a generation far longer than the refusals take on any CPU
    (1000 tokens of GPT-2 small); it hangs up at the end, so nothing races a clock."""
    url = one_slot.http_url
    holder_client = Client(one_slot.grpc_target, timeout=None)
    holder = holder_client.generate_stream("hold the slot", max_tokens=1000, temperature=0, ignore_eos=True)
    first = next(holder)
    assert first.token is not None
    client = Client(one_slot.grpc_target, retries=0) if kind == "grpc" else RestClient(url, retries=0)
    started = time.monotonic()
    with pytest.raises(Gpt2ServeError) as err:
        client.generate("no room", max_tokens=3)
    assert err.value.code == "RESOURCE_EXHAUSTED" and "no room in the KV cache" in err.value.message
    assert time.monotonic() - started >= 0.25  # it waited for --max-queue-wait-s
    if kind == "rest":
        assert err.value.http_status == 429
    # OpenAI's client gets the same refusal in OpenAI's shape, with the REST answers' Retry-After.
    oai = openai_client(url)
    with pytest.raises(openai.RateLimitError) as limited:
        oai.completions.create(model="random:gpt2", prompt="no room", max_tokens=3)
    assert "no room in the KV cache" in limited.value.body["message"] and limited.value.response.headers["retry-after"] == "1"
    # The accepted generation went on throughout: still streaming, nowhere near its end.
    more = [next(holder) for _ in range(3)]
    assert all(c.token is not None and not c.finish_reason for c in more)
    holder.close()
    holder_client.close()
    assert wait_for_metric(url, "gpt2serve_running_sequences", 0) == 0  # the slot is back for the next test
