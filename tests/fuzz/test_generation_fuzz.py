"""A generation fuzz over the wire: 2,100 requests from hypothesis over REST, gRPC and the two
OpenAI routes, completions and chat (valid and invalid parameters, raw junk bodies, streams hung
up after the first chunk), while greedy neighbour streams run beside them.

An oracle written from the documented rules (README "Generation") says whether each request is
valid: a valid one must be answered (200 / OK, never a 5xx or a 429 on this idle-enough
server), an invalid one must get the documented 4xx (REST 400 or 422, OpenAI 400, gRPC
INVALID_ARGUMENT). The neighbours' texts must equal what they give alone, before the fuzz. Chat
turns the prompt into messages (token ids as a text part of their decoded text; bad ids as an
image part, which chat refuses) and judges lengths on the prompt the repository's template gives.
"""

from __future__ import annotations

import json
import math
import struct
import threading
import time

import httpx
import pytest
from pathlib import Path

from support.servers import launch_server, metric_value
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpt2serve_client import Client, Gpt2ServeError
from gpt2serve_client._proto import gpt2serve_pb2 as pb

# A fixed amount of work: on a loaded machine it takes longer, and pyproject's 300 s (set to catch a
# hang) is not a speed limit.
pytestmark = [pytest.mark.fuzz, pytest.mark.timeout(1800)]

VOCAB, N_CTX = 50257, 256  # random:tiny
EXAMPLES = 2160  # a quarter per API
APIS = ("rest", "grpc", "openai", "chat")
CHAT_TEMPLATE = Path(__file__).resolve().parents[2] / "examples" / "chat-templates" / "chatml.jinja"
NEIGHBOURS = ["The river", [464, 3139, 286, 4881], "Once upon a time there"]
NEIGHBOUR_SETTINGS = dict(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    srv = launch_server(tmp_path_factory.mktemp("fuzz"), "--model", "random:tiny", "--max-running-sequences", "32",
                        "--max-queue-wait-s", "120", "--chat-template", str(CHAT_TEMPLATE))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tok():
    from gpt2serve.engine.tokenizer import bundled_gpt2_tokenizer

    return bundled_gpt2_tokenizer()


def float32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


# What a request may hold: valid values mostly, the edges, and invalid ones --------------------

# Each field: valid values (the range's edges among them) and invalid ones. A request is valid, or
# has one field spoiled, or is junk: so about half of them run a generation.
VALID = {
    "prompt": st.one_of(st.text(min_size=1, max_size=30), st.lists(st.integers(0, VOCAB - 1), min_size=1,
                                                                   max_size=30)),
    "max_tokens": st.one_of(st.none(), st.integers(1, 6)),
    "temperature": st.one_of(st.none(), st.floats(0, 100), st.sampled_from([0.0, 1e-45, 1e-38, 1e-6, 1e-5, 100.0])),
    "top_k": st.one_of(st.none(), st.integers(0, VOCAB), st.sampled_from([1, VOCAB])),
    "top_p": st.one_of(st.none(), st.floats(0, 1, exclude_min=True), st.sampled_from([1e-30, 1.0])),
    "seed": st.one_of(st.none(), st.integers(-2**63, 2**63 - 1)),
    "logprobs": st.one_of(st.integers(0, 3), st.just(20)),
    "stop": st.one_of(st.none(), st.lists(st.text(min_size=1, max_size=4), max_size=3)),
}
INVALID = {
    "prompt": st.sampled_from(["", [], [VOCAB], [-1, 5], [5, 2**31 - 1]]),
    "max_tokens": st.sampled_from([0, -3, N_CTX, 2**31 - 1]),
    "temperature": st.sampled_from([-0.5, 100.5, 1e9, -1e-30]),
    "top_k": st.sampled_from([-1, VOCAB + 1]),
    "top_p": st.sampled_from([0.0, -0.1, 1.5]),
    "logprobs": st.sampled_from([21, -1]),
    "stop": st.just([""]),
}


@st.composite
def requests(draw, api: str) -> dict:
    r = {name: draw(strategy) for name, strategy in VALID.items()}
    spoiled = draw(st.sampled_from([None, None, *INVALID]))
    if spoiled is not None:
        r[spoiled] = draw(INVALID[spoiled])
    r["api"] = api
    r["stream"], r["hang_up"] = draw(st.booleans()), draw(st.booleans())
    r["junk"] = draw(st.one_of(st.none(), st.none(), st.none(), st.none(), st.none(), st.binary(max_size=40),
                               st.sampled_from([b"{", b'{"prompt": 5}', b"[]", b'{"prompt": "x", "max_tokens": "3"}'])))
    return r


def chat_messages(prompt: str | list[int], tok) -> list[dict]:
    """A chat request's messages for a fuzzed prompt (see the module doc)."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if not prompt:
        return []
    if any(not 0 <= t < VOCAB for t in prompt):
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]
    return [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": tok.decode(prompt)}]}]


def is_valid(r: dict, tok) -> bool:
    """The documented rules (README "Generation", generating.GenerateSettings.request)."""
    if r["junk"] is not None and r["api"] != "grpc":
        return False
    prompt = r["prompt"]
    if r["api"] == "chat":
        messages = chat_messages(prompt, tok)
        if not messages or any(isinstance(m["content"], list) and m["content"][0]["type"] != "text"
                               for m in messages):
            return False
        plain = [{**m, "content": m["content"] if isinstance(m["content"], str)  # text parts join with newlines
                  else "\n".join(part["text"] for part in m["content"])} for m in messages]
        ids = tok.apply_chat_template(plain, CHAT_TEMPLATE.read_text(), True, False, {})
    else:
        ids = tok.encode(prompt) if isinstance(prompt, str) else prompt
    if not ids or any(not 0 <= t < VOCAB for t in ids):
        return False
    max_tokens = (N_CTX - len(ids) if r["api"] == "chat" else 16) if r["max_tokens"] is None else r["max_tokens"]
    if max_tokens < 1 or len(ids) + max_tokens > N_CTX:
        return False
    f = float32 if r["api"] == "grpc" else float  # gRPC carries them as float32
    temperature = 1.0 if r["temperature"] is None else f(r["temperature"])
    top_p = 1.0 if r["top_p"] is None else f(r["top_p"])
    top_k = r["top_k"] or 0
    return (math.isfinite(temperature) and 0 <= temperature <= 100 and 0 <= top_k <= VOCAB
            and 0 < top_p <= 1 and 0 <= r["logprobs"] <= 20 and all(r["stop"] or []))


def fields(r: dict) -> dict:
    prompt = r["prompt"]
    body = {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": prompt}
    for name in ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop"):
        if r[name] is not None:
            body[name] = r[name]
    body["logprobs"] = r["logprobs"]
    return body


# Sending one request, and what came back --------------------------------------------------------

def via_http(http: httpx.Client, r: dict, tok) -> int:
    """The status; a stream is read to its end (or hung up on after its first event)."""
    if r["api"] == "openai":
        body = {"model": "random:tiny", "prompt": r["prompt"]}
        body.update({k: v for k, v in fields(r).items() if k not in ("prompt", "prompt_token_ids")})
        route = "/v1/completions"
    elif r["api"] == "chat":
        body = {"model": "random:tiny", "messages": chat_messages(r["prompt"], tok)}
        body.update({k: v for k, v in fields(r).items() if k not in ("prompt", "prompt_token_ids", "logprobs")})
        body.update(logprobs=True, top_logprobs=r["logprobs"])
        route = "/v1/chat/completions"
    else:
        body, route = fields(r), "/v1/generate"
    body["stream"] = r["stream"]
    content = r["junk"] if r["junk"] is not None else json.dumps(body).encode()
    with http.stream("POST", route, content=content, headers={"content-type": "application/json"}) as response:
        if response.status_code == 200 and r["stream"]:
            for line in response.iter_lines():
                if r["hang_up"] and line.startswith("data:"):
                    break  # leaving the block closes the connection: a hang-up mid-stream
                assert not line.startswith("event: error"), line
        else:
            response.read()
        if response.status_code >= 400:
            assert "error" in response.json(), response.text
        return response.status_code


def via_grpc(client: Client, r: dict) -> str:
    request = fields(r)
    prompt = request.pop("prompt", None) or request.pop("prompt_token_ids", "")
    try:
        pb.GenerateRequest(**{k: v for k, v in request.items()})  # what protobuf itself refuses to carry
    except (ValueError, TypeError):
        return "UNSENDABLE"
    if isinstance(prompt, list) and any(not -2**31 <= t < 2**31 for t in prompt):
        return "UNSENDABLE"
    try:
        stream = client.generate_stream(prompt, **{k: v for k, v in request.items()})
        for _ in stream:
            if r["stream"] and r["hang_up"]:
                stream.close()
                break
        return "OK"
    except Gpt2ServeError as exc:
        return exc.code


class Neighbours:
    """Greedy streams in a loop beside the fuzz; each text compared with the one given alone."""

    def __init__(self, target: str, expected: list[str]):
        self.target, self.expected = target, expected
        self.done = threading.Event()
        self.runs, self.problems = 0, []
        self.threads = [threading.Thread(target=self.loop, args=(i,), daemon=True) for i in range(len(expected))]

    def loop(self, i: int) -> None:
        with Client(self.target, timeout=120, retries=0) as client:
            while not self.done.is_set():
                try:
                    text = client.generate(NEIGHBOURS[i], **NEIGHBOUR_SETTINGS).text
                except Gpt2ServeError as exc:
                    self.problems.append(f"neighbour {i}: {exc}")
                    continue
                self.runs += 1
                if text != self.expected[i]:
                    self.problems.append(f"neighbour {i}: {text!r} != {self.expected[i]!r}")

    def __enter__(self) -> Neighbours:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_) -> None:
        self.done.set()
        for thread in self.threads:
            thread.join(timeout=120)


def test_generation_fuzz_valid_answered_invalid_refused_neighbours_untouched(fuzz_server, tok):
    with Client(fuzz_server.grpc_target, timeout=120, retries=0) as client:
        alone = [client.generate(p, **NEIGHBOUR_SETTINGS).text for p in NEIGHBOURS]
    outcomes: dict[tuple[str, bool], dict] = {}
    sent = 0

    with httpx.Client(base_url=fuzz_server.http_url, timeout=120) as http, \
            Client(fuzz_server.grpc_target, timeout=120, retries=0) as client, \
            Neighbours(fuzz_server.grpc_target, alone) as neighbours:

        for api in APIS:  # EXAMPLES / 4 each

            @settings(max_examples=EXAMPLES // len(APIS), deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(r=requests(api))
            def one_request(r):
                nonlocal sent
                valid = is_valid(r, tok)
                got = via_grpc(client, r) if r["api"] == "grpc" else via_http(http, r, tok)
                if got == "UNSENDABLE":
                    return
                sent += 1
                key = (r["api"], valid)
                outcomes.setdefault(key, {}).setdefault(got, 0)
                outcomes[key][got] += 1
                if valid:
                    assert got in (200, "OK"), (r, got)
                elif r["api"] == "grpc":
                    assert got == "INVALID_ARGUMENT", (r, got)
                elif r["api"] in ("openai", "chat"):
                    assert got == 400, (r, got)
                else:
                    assert got in (400, 415, 422), (r, got)

            one_request()
        while neighbours.runs < 3 * len(NEIGHBOURS) and not neighbours.problems:  # a few more, after
            time.sleep(0.1)
    assert sent >= 2000, sent
    assert not neighbours.problems, neighbours.problems[:5]
    for api in APIS:  # every kind was exercised, valid and invalid
        assert outcomes.get((api, True)) and outcomes.get((api, False)), outcomes
    deadline = time.monotonic() + 10  # every hung-up stream gave its slot back
    while metric_value(fuzz_server.http_url, "gpt2serve_running_sequences") != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric_value(fuzz_server.http_url, "gpt2serve_running_sequences") == 0
    assert "Traceback" not in fuzz_server.log()
    print(f"fuzz: {sent} requests, neighbours ran {neighbours.runs} times; outcomes {outcomes}")
