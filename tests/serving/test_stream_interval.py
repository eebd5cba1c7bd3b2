"""--stream-interval N (vLLM's): a streamed generation sends its first token at once, then its
tokens N a message, and what is left at its end; the tokens and the text are the same as one a
message. Fewer messages a token is less front-end CPU a token (docs/benchmarks.md)."""

from __future__ import annotations

import json

import grpc
import httpx
import openai
import pytest

from gpt2serve_client import Client, RestClient
from gpt2serve_client._proto import gpt2serve_pb2 as pb
from gpt2serve_client._proto import gpt2serve_pb2_grpc as pb_grpc
from support.servers import launch_server

PROMPT = [464, 3139, 286]
TOKENS = 22  # the first, five of 4, and 1 left at the end
INTERVAL = 4


@pytest.fixture(scope="module")
def interval_server(tmp_path_factory):
    srv = launch_server(tmp_path_factory.mktemp("interval"), "--model", "random:tiny",
                        "--stream-interval", str(INTERVAL))
    yield srv
    srv.stop()


def tokens_a_message(messages: list[pb.GenerateResponse]) -> list[int]:
    """How many tokens each message brought, the closing one (0) left out."""
    return [int(m.HasField("token")) + len(m.more_tokens) for m in messages if not m.finish_reason]


def first_alone(stream_once, attempts: int = 3):
    """(messages, tokens a message) of the first of up to `attempts` runs whose first message
    brings one token, else of the last run. The server sends the first token at once; a reader
    that falls behind (a loaded machine) may still find it joined with the interval after it, so
    one run of three has to show it alone. A server that held it for the interval never would."""
    for _ in range(attempts):
        run = stream_once()
        if run[1][0] == 1:
            break
    return run


def test_grpc_messages_bring_the_tokens_an_interval_at_a_time(server, interval_server):
    with Client(server.grpc_target) as client:  # the same weights, one token a message
        want = client.generate(PROMPT, max_tokens=TOKENS, ignore_eos=True, temperature=0)
    request = pb.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=TOKENS, ignore_eos=True, temperature=0)
    with grpc.insecure_channel(interval_server.grpc_target) as channel:
        def once():
            messages = list(pb_grpc.Gpt2ServeStub(channel).Generate(request, timeout=60))
            return messages, tokens_a_message(messages)

        messages, counts = first_alone(once)
    assert counts[0] == 1  # the first token at once: time to first token is not the interval's
    # Then whole intervals and the rest at the end; a reader behind may get queued ones joined
    # (two intervals as one, or the last interval with the rest), never a part of an interval.
    assert all(n % INTERVAL == 0 for n in counts[1:-1]), counts
    assert counts[-1] % INTERVAL == (TOKENS - 1) % INTERVAL and sum(counts) == TOKENS, counts
    assert len(counts) <= 1 + -(-(TOKENS - 1) // INTERVAL), counts
    ids = [t.token_id for m in messages for t in ([m.token] if m.HasField("token") else []) + list(m.more_tokens)]
    assert ids == [t.token_id for t in want.tokens]
    assert "".join(m.text for m in messages) == want.text
    assert messages[-1].finish_reason == "length" and messages[-1].usage.completion_tokens == TOKENS


def test_the_clients_still_give_one_chunk_a_token(server, interval_server):
    with Client(server.grpc_target) as client:
        want = client.generate(PROMPT, max_tokens=TOKENS, ignore_eos=True, temperature=0)
    with Client(interval_server.grpc_target) as client:
        grpc_chunks = list(client.generate_stream(PROMPT, max_tokens=TOKENS, ignore_eos=True, temperature=0))
    with RestClient(interval_server.http_url) as client:
        rest_chunks = list(client.generate_stream(PROMPT, max_tokens=TOKENS, ignore_eos=True, temperature=0))
    for chunks in (grpc_chunks, rest_chunks):
        assert len(chunks) == TOKENS + 1
        assert [c.token.token_id for c in chunks[:-1]] == [t.token_id for t in want.tokens]
        assert "".join(c.text for c in chunks) == want.text


def test_sse_events_bring_the_tokens_an_interval_at_a_time(interval_server):
    body = {"prompt_token_ids": PROMPT, "max_tokens": TOKENS, "ignore_eos": True, "temperature": 0, "stream": True}

    def once():
        with httpx.stream("POST", f"{interval_server.http_url}/v1/generate", json=body, timeout=60) as response:
            assert response.status_code == 200
            events = [json.loads(line[len("data: "):]) for line in response.iter_lines() if line.startswith("data: ")]
        return events, [int(e.get("token") is not None) + len(e.get("more_tokens") or []) for e in events
                        if not e.get("finish_reason")]

    _, counts = first_alone(once)
    assert counts[0] == 1 and sum(counts) == TOKENS and len(counts) <= 1 + -(-(TOKENS - 1) // INTERVAL), counts


def test_openai_stream_comes_in_fewer_chunks_with_the_same_text(server, interval_server):
    """The official client's stream of completions: the same text and token logprobs as one token
    a chunk (where the reader keeps up)."""
    texts, logprobs, chunks = {}, {}, {}
    for name, srv in (("each", server), ("interval", interval_server)):
        client = openai.OpenAI(base_url=f"{srv.http_url}/v1", api_key="unused")
        stream = client.completions.create(model="random:tiny", prompt=PROMPT, max_tokens=TOKENS, temperature=0,
                                           logprobs=1, stream=True, extra_body={"ignore_eos": True})
        got = [c.choices[0] for c in stream if c.choices]
        texts[name] = "".join(c.text for c in got)
        logprobs[name] = [lp for c in got if c.logprobs for lp in c.logprobs.token_logprobs]
        chunks[name] = sum(c.finish_reason is None for c in got)  # the closing chunk left out
    assert texts["interval"] == texts["each"] and logprobs["interval"] == pytest.approx(logprobs["each"])
    assert chunks["interval"] <= 1 + -(-(TOKENS - 1) // INTERVAL), chunks  # (a slow reader may join more)
