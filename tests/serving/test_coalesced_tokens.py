"""Tokens a slow reader has not read go out together: one gRPC Generate message brings them
(`more_tokens`, its `text` the text of all), so a front end that cannot write a message per
token to every stream spends one per read instead. A reader that keeps up gets each token as it
comes. The clients split such a message back into one chunk a token.

The slow reader here is a raw gRPC stub whose HTTP/2 window is 1 KiB (no BDP probing): the
server's writes wait for it, as they wait for a slow client on a real network."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque

import grpc
import pytest

from gpt2serve.protocol import SampledToken, TokenScore
from gpt2serve.service.generation_stream import _End, joined_with_queued, token_chunk
from gpt2serve_client import AsyncClient, Client, RestClient
from gpt2serve_client._proto import gpt2serve_pb2 as pb
from gpt2serve_client._proto import gpt2serve_pb2_grpc as pb_grpc
from gpt2serve_client.generation import GeneratedToken, GenerateChunk, GenerateResult, Usage
from gpt2serve_client.types import TokenLogprob

PROMPT = [464, 3139, 286]
TOKENS = 120
SLOW_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]


def read_raw(target: str, options: list, delay_s: float) -> list[pb.GenerateResponse]:
    with grpc.insecure_channel(target, options=options) as channel:
        messages = []
        request = pb.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=TOKENS, ignore_eos=True, temperature=0)
        for message in pb_grpc.Gpt2ServeStub(channel).Generate(request, timeout=120):
            messages.append(message)
            time.sleep(delay_s)
        return messages


def token_ids(messages: list[pb.GenerateResponse]) -> list[int]:
    ids = []
    for m in messages:
        if m.HasField("token"):
            ids.append(m.token.token_id)
        ids += [t.token_id for t in m.more_tokens]
    return ids


def test_a_slow_reader_gets_the_tokens_it_had_not_read_in_one_message(server):
    with Client(server.grpc_target) as client:
        want = client.generate(PROMPT, max_tokens=TOKENS, ignore_eos=True, temperature=0)
    slow = read_raw(server.grpc_target, SLOW_WINDOW, delay_s=0.02)
    assert token_ids(slow) == [t.token_id for t in want.tokens]  # all of them, in order
    assert "".join(m.text for m in slow) == want.text  # the texts still add up to the output
    assert len(slow) < TOKENS / 2, len(slow)  # several tokens a message
    joined = [m for m in slow if m.more_tokens]
    assert joined and all(m.HasField("token") for m in joined)
    assert slow[-1].finish_reason == "length" and not slow[-1].more_tokens  # the closing message stays its own


def test_the_clients_give_one_chunk_a_token_whatever_the_messages(server):
    with Client(server.grpc_target) as client:
        chunks = list(client.generate_stream(PROMPT, max_tokens=TOKENS, ignore_eos=True, temperature=0))
        whole = client.generate(PROMPT, max_tokens=TOKENS, ignore_eos=True, temperature=0)

    async def async_chunks():
        async with AsyncClient(server.grpc_target) as client:
            return [c async for c in client.generate_stream(PROMPT, max_tokens=TOKENS, ignore_eos=True, temperature=0)]

    with RestClient(server.http_url) as client:
        rest = list(client.generate_stream(PROMPT, max_tokens=TOKENS, ignore_eos=True, temperature=0))

    for got in (chunks, asyncio.run(async_chunks()), rest):
        assert len(got) == TOKENS + 1 and all(not c.more_tokens for c in got)
        assert [c.token.token_id for c in got[:-1]] == [t.token_id for t in whole.tokens]
        assert "".join(c.text for c in got) == whole.text


def _token(i: int) -> GeneratedToken:
    return GeneratedToken(i, f"<{i}>", -1.0 * i, [])


def _sampled(i: int) -> SampledToken:
    return SampledToken(i, -1.0 * i)


def _text(token_id: int) -> str:
    return f"<{token_id}>"


def test_a_chunk_is_joined_only_with_tokens_already_queued():
    """What a reader that keeps up gets: nothing queued behind its token, so nothing joined. And
    a closing chunk (or the end) is never folded in: it is sent next, on its own."""
    first = ("a", [_sampled(1)])
    assert joined_with_queued(first, deque()) == first
    closing = GenerateChunk("", None, finish_reason="length", usage=Usage(3, 3, 6))
    items = deque([("b", [_sampled(2)]), ("c", [_sampled(3)]), closing, _End()])
    text, tokens = joined_with_queued(first, items)
    assert list(items) == [closing, _End()]  # the closing chunk and the end still queued, in order
    chunk = token_chunk(_text, text, tokens)
    assert chunk == GenerateChunk("abc", _token(1), more_tokens=[_token(2), _token(3)])
    parts = chunk.split()
    assert [p.token for p in parts] == [_token(1), _token(2), _token(3)] and "".join(p.text for p in parts) == "abc"
    assert GenerateChunk.from_proto(chunk.to_proto()) == chunk
    assert GenerateChunk.from_dict({"text": "abc", "token": {"token_id": 1, "token": "<1>", "logprob": -1.0, "top": []},
                                    "more_tokens": [{"token_id": 2, "token": "<2>", "logprob": -2.0, "top": []}]}
                                   ).more_tokens == [_token(2)]
    assert GenerateResult.from_chunks([chunk, closing]).tokens == [_token(1), _token(2), _token(3)]


def test_tokens_released_together_keep_their_tokens_when_joined_again():
    """An interval's tokens (--stream-interval, queued as one item) behind a slow reader's token."""
    items = deque([("bcd", [_sampled(2), _sampled(3), _sampled(4)]), ("e", [_sampled(5)])])
    text, tokens = joined_with_queued(("a", [_sampled(1)]), items)
    assert not items and text == "abcde" and tokens == [_sampled(i) for i in range(1, 6)]


def test_a_token_chunk_built_without_init_is_the_chunk_init_builds():
    """token_chunk makes the frozen dataclasses without their __init__ (generation_stream.frozen):
    every field is there, equal to __init__'s, each list its own, and the chunk is still frozen."""
    top = SampledToken(7, -0.5, [TokenScore(7, -0.5), TokenScore(9, -1.5)])
    chunk = token_chunk(_text, "<7>", [top])
    want = GenerateChunk("<7>", GeneratedToken(7, "<7>", -0.5, [TokenLogprob(7, "<7>", -0.5),
                                                                 TokenLogprob(9, "<9>", -1.5)]))
    assert chunk == want and repr(chunk) == repr(want)
    assert set(vars(chunk)) == {f.name for f in dataclasses.fields(GenerateChunk)}
    assert dataclasses.asdict(chunk) == dataclasses.asdict(want)
    assert chunk.prompt_token_ids is not token_chunk(_text, "", [top]).prompt_token_ids
    assert chunk.more_tokens == [] and chunk.more_tokens is not token_chunk(_text, "", [top]).more_tokens
    with pytest.raises(dataclasses.FrozenInstanceError):
        chunk.text = "changed"
    with pytest.raises(dataclasses.FrozenInstanceError):
        chunk.token.logprob = 0.0
    assert hash(chunk.token.top[0]) == hash(TokenLogprob(7, "<7>", -0.5))
