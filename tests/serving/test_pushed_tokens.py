"""Token events written as the tokens arrive (GenerationStream.follow, http_direct.StreamWrites):
a stream's task is not woken per token while its reader keeps up, so what must hold is that
nothing changes for the reader. The pushed event is the bytes the task would have written; a
token goes straight only while the task waits with nothing queued, so the order holds across
the two paths; tokens taken in one callback leave as one event once it ends; and a stream whose
client falls behind still sends every token in order, what it had not read joined. (Over
loopback the kernel's autotuned buffers hold a random:tiny stream whole, so the full window is
made here, with uvicorn's own flow control.)"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from uvicorn.protocols.http.flow_control import FlowControl

from gpt2serve.engine.tokenizer import bundled_gpt2_tokenizer
from gpt2serve.protocol import SampledToken, TokenScore
from gpt2serve.service.generation_stream import GenerationStream, StreamClock, _End, token_chunk
from gpt2serve.transport.http_direct import DirectCall, EventStream, StreamWrites
from gpt2serve.transport.openai.common import alone
from gpt2serve.transport.openai.chat import ChatEvents
from gpt2serve.transport.openai.completions import CompletionEvents, stream_events
from gpt2serve_client.generation import GenerateChunk, Usage
from gpt2serve.transport.openai.logprobs import openai_token

TOKENIZER = bundled_gpt2_tokenizer()
# Texts a token event carries: plain, JSON's escapes, non-ASCII, held bytes (""), and a run of tokens.
RUNS = [(" Once", [7454]), (' "said"\n', [366, 30, 1]), ("é\u2028", [2634]), ("", [171]), ("ab", [64, 65])]


def sampled(token_id: int) -> SampledToken:
    return SampledToken(token_id, -0.25 * (token_id % 7), [TokenScore(token_id, -0.25), TokenScore(13, -1.5)])


def test_a_pushed_completions_event_is_the_bytes_of_the_tasks_event():
    for logprobs in (None, 2):
        completion = {"id": "cmpl-x", "object": "text_completion", "created": 1, "model": "m"}

        def events() -> CompletionEvents:
            return CompletionEvents(completion, logprobs, lambda i: openai_token(TOKENIZER, i), TOKENIZER.token_text)

        pushed, task = events(), events()  # each keeps its own offsets, run by run
        for text, ids in RUNS:
            tokens = [sampled(i) for i in ids]
            assert pushed.tokens(text, tokens) == task.chunk(0, token_chunk(TOKENIZER.token_text, text, tokens))


def test_a_pushed_chat_event_is_the_bytes_of_the_tasks_event():
    for include_usage in (False, True):
        for logprobs in (False, True):
            events = ChatEvents({"id": "chatcmpl-x", "created": 1, "model": "m"}, include_usage, TOKENIZER, logprobs)
            for text, ids in RUNS:
                tokens = [sampled(i) for i in ids]
                assert events.tokens(text, tokens) == events.chunk(0, token_chunk(TOKENIZER.token_text, text, tokens))


def waiting_stream() -> GenerationStream:
    """A stream whose start is skipped: what is tested is how its tokens reach the reader."""
    stream = GenerationStream(SimpleNamespace(stream_interval=1), None, None, None)

    async def started():
        stream.tokenizer, stream.clock = TOKENIZER, StreamClock()

    stream._start = started
    return stream


def test_a_token_goes_straight_only_while_the_reader_waits_with_nothing_queued():
    async def scenario():
        stream, taken, accept = waiting_stream(), [], [True]

        def take(text: str, tokens: list) -> bool:
            if accept[0]:
                taken.append(text)
            return accept[0]

        stream.follow(take)
        chunks = stream.chunks(coalesce=True)
        reader = asyncio.ensure_future(anext(chunks))
        await asyncio.sleep(0)  # the reader now waits
        stream._token("a", [sampled(1)])
        await asyncio.sleep(0)
        assert taken == ["a"] and not reader.done()  # sent, and the reader not woken

        accept[0] = False  # the client's window is full: queued, the reader woken
        stream._token("b", [sampled(2)])
        accept[0] = True
        stream._token("c", [sampled(3)])  # behind b, queued though take would send it
        chunk = await reader
        assert taken == ["a"] and chunk.text == "bc" and [chunk.token.token_id, chunk.more_tokens[0].token_id] == [2, 3]

        stream._token("d", [sampled(4)])  # the reader holds a chunk, not waiting: queued
        assert taken == ["a"] and (await anext(chunks)).text == "d"

        reader = asyncio.ensure_future(anext(chunks))
        await asyncio.sleep(0)
        stream._token("e", [sampled(5)])
        assert taken == ["a", "e"]
        stream.follow(None)  # the transport stopped following: tokens queue again
        stream._token("f", [sampled(6)])
        assert (await reader).text == "f" and taken == ["a", "e"]
        await chunks.aclose()

    asyncio.run(scenario())


class Transport:
    def __init__(self):
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def close(self) -> None:
        self.closed = True


def test_what_one_callback_makes_is_written_once_after_it():
    async def scenario():
        flow = SimpleNamespace(write_paused=False)
        call = SimpleNamespace(protocol=SimpleNamespace(flow=flow, transport=Transport()), disconnected=False,
                               path="/v1/completions", response_complete=False)
        followed = []
        pushed = StreamWrites(call)
        pushed.push_from((followed.append, lambda text, tokens: f"{text}{len(tokens)}".encode()))
        assert followed == [pushed.take]
        assert pushed.take("a", [1]) and pushed.take("bc", [2, 3])
        assert call.protocol.transport.writes == []  # not in the dispatch's callback
        await asyncio.sleep(0)
        assert call.protocol.transport.writes == [b"4\r\nabc3\r\n"]  # one chunk: "abc", 3 tokens

        flow.write_paused = True
        assert not pushed.take("d", [4])  # the task takes it, once the window opens
        flow.write_paused, call.disconnected = False, True
        assert not pushed.take("d", [4])

        call.disconnected = False
        assert pushed.take("e", [5])
        call.disconnected = True  # hung up before the write: nothing written
        await asyncio.sleep(0)
        assert call.protocol.transport.writes == [b"4\r\nabc3\r\n"]

        call.disconnected = False
        pushed.add(b"X")  # the task's bytes and taken tokens in one callback: one write, in order
        assert pushed.take("y", [7])
        pushed.add(b"Z")
        await asyncio.sleep(0)
        assert call.protocol.transport.writes[-1] == b"X" + b"2\r\ny1\r\n" + b"Z"

        pushed.encode = lambda text, tokens: 1 / 0  # a fault in the encoding: logged, the answer cut short
        assert pushed.take("f", [6])
        await asyncio.sleep(0)
        assert call.protocol.transport.closed and call.response_complete
        pushed.stop()
        assert followed[-1] is None

    asyncio.run(scenario())


class Protocol:
    """What DirectCall.stream uses of the front end's protocol, with uvicorn's own flow control."""

    def __init__(self):
        self.transport = Transport()
        self.flow = FlowControl(self.transport)
        self.server_state = SimpleNamespace(default_headers=[])
        self.completed = 0

    def on_response_complete(self) -> None:
        self.completed += 1


def test_a_stream_whose_client_falls_behind_sends_every_token_in_order_across_both_paths():
    """DirectCall.stream over a stream's tokens: pushed while the window is open, queued and
    joined while it is full (the task waits for it), pushed again once it opens."""
    async def scenario():
        stream = waiting_stream()
        chunks = stream.chunks(coalesce=True)
        stream._token("A", [sampled(1)])
        first = await anext(chunks)  # the route waits for the first chunk before the 200
        events = CompletionEvents({"object": "text_completion"}, 1, TOKENIZER.token_text, TOKENIZER.token_text)
        answer = EventStream(stream_events(events, alone(first, chunks), False, lambda e: {}),
                             (stream.follow, events.tokens))
        protocol = Protocol()
        call = DirectCall(protocol, "/v1/completions", [], "http", True, False)
        writer = asyncio.create_task(call.stream(200, answer))
        for _ in range(3):
            await asyncio.sleep(0)
        writes = protocol.transport.writes
        assert len(writes) == 1 and writes[0].startswith(b"HTTP/1.1 200")  # the head with the first event
        stream._token("B", [sampled(2)])
        await asyncio.sleep(0)
        assert len(writes) == 2  # pushed: written after the callback, the task still waiting

        protocol.flow.pause_writing()  # the client's window is full
        stream._token("C", [sampled(3)])  # refused by the push: queued, the task woken
        stream._token("D", [sampled(4)])
        for _ in range(3):
            await asyncio.sleep(0)  # the task takes C and D together, and waits for the window
        stream._token("E", [sampled(5)])
        assert len(writes) == 2
        protocol.flow.resume_writing()
        for _ in range(5):
            await asyncio.sleep(0)
        stream._token("F", [sampled(6)])  # the task waits again: pushed
        stream._push(GenerateChunk("", None, finish_reason="length", usage=Usage(3, 6, 9)))
        stream._push(_End())
        await writer

        body = b"".join(writes).split(b"\r\n\r\n", 1)[1]
        got = sse_choices(body)
        assert [c["text"] for c in got] == ["A", "B", "CD", "E", "F", ""]
        assert [c["logprobs"]["text_offset"] for c in got[:5]] == [[0], [1], [2, 3], [4], [5]]
        assert got[-1]["finish_reason"] == "length" and body.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
        assert b'"finish_reason":"length"' in writes[-1] and writes[-1].endswith(b"0\r\n\r\n")  # the tail: one write
        assert protocol.completed == 1

    asyncio.run(scenario())


def sse_choices(body: bytes) -> list[dict]:
    """The choice of each `data:` event of a chunked SSE body (chunk framing dropped)."""
    events, rest = [], body
    while rest:
        size_line, rest = rest.split(b"\r\n", 1)
        size = int(size_line, 16)
        events.append(rest[:size])
        rest = rest[size + 2:]
    lines = [line for event in events for line in event.split(b"\n") if line.startswith(b"data: {")]
    return [json.loads(line[len(b"data: "):])["choices"][0] for line in lines]
