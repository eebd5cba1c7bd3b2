"""The OpenAI streams' events for a run of tokens its reader had not taken yet (one chunk, see
tests/serving/test_coalesced_tokens.py): one event with their text together, and a logprobs
entry for each token, as a whole answer lists them."""

from __future__ import annotations

import asyncio
import json

from gpt2serve.engine.tokenizer import bundled_gpt2_tokenizer
from gpt2serve.transport.openai.chat import ChatEvents, chunk_events
from gpt2serve.transport.openai.completions import CompletionEvents, stream_events
from gpt2serve_client.generation import GeneratedToken, GenerateChunk, Usage
from gpt2serve_client.types import TokenLogprob

TOKENIZER = bundled_gpt2_tokenizer()
IDS = [7454, 2402, 257]  # "Once", " upon", " a"


def token(token_id: int, logprob: float) -> GeneratedToken:
    return GeneratedToken(token_id, TOKENIZER.token_text(token_id), logprob, [TokenLogprob(token_id, "", logprob)])


JOINED = GenerateChunk("Once upon a", token(IDS[0], -1.0), more_tokens=[token(IDS[1], -2.0), token(IDS[2], -3.0)])
CLOSING = GenerateChunk("", None, finish_reason="length", usage=Usage(2, 3, 5))


def events(stream) -> list:
    async def collect():
        return [e async for e in stream]

    lines = [e.decode() for e in asyncio.run(collect())]
    return [json.loads(line.removeprefix("data: ").strip()) for line in lines if "[DONE]" not in line]


async def chunks():
    for chunk in (JOINED, CLOSING):
        yield 0, chunk


def test_completions_streams_a_joined_run_as_one_event_with_a_logprobs_entry_each():
    completion = CompletionEvents({"object": "text_completion"}, 1, TOKENIZER.token_text, TOKENIZER.token_text)
    got = events(stream_events(completion, chunks(), False, lambda e: {}))
    first = got[0]["choices"][0]
    assert first["text"] == "Once upon a" and first["finish_reason"] is None
    logprobs = first["logprobs"]
    assert logprobs["tokens"] == ["Once", " upon", " a"] and logprobs["token_logprobs"] == [-1.0, -2.0, -3.0]
    assert logprobs["text_offset"] == [0, 4, 9]  # each token's own text, as a whole answer's offsets
    assert len(logprobs["top_logprobs"]) == 3
    assert got[1]["choices"][0]["finish_reason"] == "length"


def test_chat_streams_a_joined_run_as_one_delta_with_a_logprobs_entry_each():
    got = events(chunk_events(ChatEvents({"id": "x"}, False, TOKENIZER, True), chunks(), 1, 2, False, lambda e: {}))
    role, joined, closing = got
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert joined["choices"][0]["delta"] == {"content": "Once upon a"}
    content = joined["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["Once", " upon", " a"] and [c["logprob"] for c in content] == [-1, -2, -3]
    assert closing["choices"][0]["finish_reason"] == "length"
