"""Tokens a slow reader has not read go out together: one gRPC Generate message brings them
(`more_tokens`, its `text` the text of all), so a front end that cannot write a message per
token to every stream spends one per read instead. A reader that keeps up gets each token as it
comes. The clients split such a message back into one chunk a token.

The slow reader here is a raw gRPC stub whose HTTP/2 window is 1 KiB (no BDP probing): the
server's writes wait for it, as they wait for a slow client on a real network."""

from __future__ import annotations

import asyncio
import time

import grpc

from gpt2serve.service.generation_stream import _End, _joined_with_queued
from gpt2serve_client import AsyncClient, Client, RestClient
from gpt2serve_client._proto import gpt2serve_pb2 as pb
from gpt2serve_client._proto import gpt2serve_pb2_grpc as pb_grpc
from gpt2serve_client.generation import GeneratedToken, GenerateChunk, GenerateResult, Usage

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


def test_a_chunk_is_joined_only_with_token_chunks_already_queued():
    """What a reader that keeps up gets: nothing queued behind its chunk, so nothing joined. And
    a closing chunk (or the end) is never folded in: it is sent next, on its own."""
    first = GenerateChunk("a", _token(1))

    async def run():
        queue: asyncio.Queue = asyncio.Queue()
        alone = _joined_with_queued(first, queue)
        closing = GenerateChunk("", None, finish_reason="length", usage=Usage(3, 3, 6))
        for item in (GenerateChunk("b", _token(2)), GenerateChunk("c", _token(3)), closing, _End()):
            queue.put_nowait(item)
        joined = _joined_with_queued(first, queue)
        return alone, joined, queue.qsize()

    alone, (chunk, held), left = asyncio.run(run())
    assert alone == (first, None)
    assert chunk.text == "abc" and chunk.token == _token(1) and chunk.more_tokens == [_token(2), _token(3)]
    assert held.finish_reason == "length" and left == 1  # the end marker still queued
    parts = chunk.split()
    assert [p.token for p in parts] == [_token(1), _token(2), _token(3)] and "".join(p.text for p in parts) == "abc"
    assert GenerateChunk.from_proto(chunk.to_proto()) == chunk
    assert GenerateChunk.from_dict({"text": "abc", "token": {"token_id": 1, "token": "<1>", "logprob": -1.0, "top": []},
                                    "more_tokens": [{"token_id": 2, "token": "<2>", "logprob": -2.0, "top": []}]}
                                   ).more_tokens == [_token(2)]
    assert GenerateResult.from_chunks([chunk, held]).tokens == [_token(1), _token(2), _token(3)]


def test_a_chunk_joined_already_keeps_its_tokens_when_joined_again():
    """A chunk of a --stream-interval (several tokens already) behind a slow reader's chunk."""
    first = GenerateChunk("a", _token(1))

    async def run():
        queue: asyncio.Queue = asyncio.Queue()
        queue.put_nowait(GenerateChunk("bcd", _token(2), more_tokens=[_token(3), _token(4)]))
        queue.put_nowait(GenerateChunk("e", _token(5)))
        return _joined_with_queued(first, queue)

    chunk, held = asyncio.run(run())
    assert held is None
    assert chunk.text == "abcde" and [chunk.token, *chunk.more_tokens] == [_token(i) for i in range(1, 6)]
