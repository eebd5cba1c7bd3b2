"""A streamed token's CPU in a front end's own code, in process: from the engine's `Tokens` frame
to the bytes of each stream's event, without sockets or the event loop's I/O.

N OpenAI completions streams wait for their next token as a served stream does (its task waits
in `GenerationStream.chunks`, its transport follows it through `http_direct.StreamWrites`); each
round decodes one frame of N tokens (one a stream, as a decode step sends them), hands each token
to its stream, and lets the loop run the writes, which a counter takes in place of a socket. What
a front end spends beyond this is the event loop and the socket calls (bench/host_path/front_end_profile.py).

    .venv/bin/python bench/host_path/stream_token_path.py [--streams 64] [--steps 4000] [--rounds 3] [--logprobs N]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "server"), str(ROOT / "client")]

import uvloop  # noqa: E402
from uvicorn.protocols.http.flow_control import FlowControl  # noqa: E402

from gpt2serve.engine.tokenizer import bundled_gpt2_tokenizer  # noqa: E402
from gpt2serve.ipc import codec  # noqa: E402
from gpt2serve.protocol import Tokens, TokenScore  # noqa: E402
from gpt2serve.service.detokenizer import Detokenizer  # noqa: E402
from gpt2serve.service.generation_stream import GenerationStream, StreamClock  # noqa: E402
from gpt2serve.transport.http_direct import StreamWrites  # noqa: E402
from gpt2serve.transport.openai.completions import CompletionEvents  # noqa: E402

TOKENIZER = bundled_gpt2_tokenizer()


class CountingTransport:
    def __init__(self):
        self.writes = 0
        self.bytes = 0

    def write(self, data: bytes) -> None:
        self.writes += 1
        self.bytes += len(data)

    def close(self) -> None:
        pass


def waiting_stream() -> GenerationStream:
    """A stream past its start (its first token sent): what is measured is a later token's path."""
    stream = GenerationStream(SimpleNamespace(stream_interval=1), None, None, None)

    async def started():
        stream.tokenizer, stream.text = TOKENIZER, Detokenizer(TOKENIZER, [])
        stream.clock = StreamClock(first=0.0, steps=1)

    stream._start = started
    return stream


async def one_round(streams: int, steps: int, logprobs: int | None) -> tuple[float, float]:
    """(CPU µs a token, bytes written a token)."""
    transports, sinks, readers = [], [], []
    completion = {"id": "cmpl-" + "0" * 32, "object": "text_completion", "created": 1, "model": "random:gpt2"}
    for _ in range(streams):
        stream = waiting_stream()
        chunks = stream.chunks(coalesce=True)
        readers.append(asyncio.ensure_future(anext(chunks)))  # the stream's task, waiting
        transport = CountingTransport()
        call = SimpleNamespace(protocol=SimpleNamespace(flow=FlowControl(transport), transport=transport),
                               disconnected=False, path="/v1/completions", response_complete=False)
        events = CompletionEvents(completion, logprobs, lambda i: TOKENIZER.token_text(i), TOKENIZER.token_text)
        StreamWrites(call).push_from((stream.follow, events.tokens))
        transports.append(transport)
        sinks.append(stream)
    await asyncio.sleep(0)
    rng = random.Random(0)
    top = [[TokenScore(rng.randrange(50000), -1.0) for _ in range(logprobs or 0)] for _ in range(streams)]
    frames = [codec.encode([Tokens(list(range(streams)), [rng.randrange(50000) for _ in range(streams)],
                                   [-1.0] * streams, [""] * streams, top if logprobs else [[] for _ in range(streams)],
                                   0.001, streams, [])]) for _ in range(64)]
    started = time.process_time()
    for step in range(steps):
        for message in codec.decode(frames[step % len(frames)]):
            for request_id, event in message.events():
                sinks[request_id].put(event)
        await asyncio.sleep(0)  # the writes, due at the end of the dispatch's callback
    cpu_s = time.process_time() - started
    tokens = steps * streams
    assert sum(t.writes for t in transports) == tokens, "a token was not written on its own step"
    assert not any(r.done() for r in readers), "a stream's task was woken"
    for reader in readers:
        reader.cancel()
    return cpu_s / tokens * 1e6, sum(t.bytes for t in transports) / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--logprobs", type=int, default=None, help="each event with this many alternatives")
    args = parser.parse_args()
    for _ in range(args.rounds):
        us, size = uvloop.run(one_round(args.streams, args.steps, args.logprobs))
        print(f"{args.streams} streams: {us:.2f} µs of CPU a token, {size:.0f} bytes an event")


if __name__ == "__main__":
    main()
