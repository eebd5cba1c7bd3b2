"""The engine client of a front-end process under `--workers N` (see launch.supervisor):

    front end: service -> SocketEngineClient ─┐
    front end: service -> SocketEngineClient ─┼─ Unix socket ─> EngineServer (its IPC thread) -> the core
                                              ┘

Messages are protocol's dataclasses, a frame one codec.encode of those sent in one loop tick.
Plain one-prompt next-token requests of a tick travel as one Prompts message (in columns), and
their answers come back in columns too (Answers), so a unary call costs each side a few list
appends instead of a message of its own.
A generation's Step messages go straight to its sink (the service's GenerationStream) from the
receive loop: no queue of their own. A frame that does not decode is logged and dropped.

The socket is a plain Unix stream socket, an asyncio protocol on the front end's own loop: a
frame is written by the loop's thread and read by it, with no thread between. Over zmq, each
frame sent or received woke libzmq's I/O thread: a round trip cost the front end 30 µs of CPU
against 10 over the socket, and twice the latency (docs/benchmarks.md, "The IPC door on a
plain socket").
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
from typing import Callable

from gpt2serve_client.types import ModelInfo

from ..errors import ShuttingDown, Unavailable, error_from_code
from ..protocol import (AdapterUpdate, Adapters, Answers, Cancel, EngineReady, Failed, Generate, GenerateRequest, Hello, NextTokenOutput,
                        NextTokenRequest, Prompts, Result, Step, Submit, Tokens, TokenSink)
from .framing import LENGTH, BrokenStream, FrameReader, Outbox, deliver

log = logging.getLogger(__name__)
CONNECT_RETRY_S = (0.01, 0.2)  # the first and the longest wait between tries while the engine loads


def engine_address(directory: str) -> str:
    """The engine's socket, in the server's run directory."""
    return os.path.join(directory, "engine.sock")


class SocketEngineClient(asyncio.Protocol):
    def __init__(self, address: str):
        self._address = address
        self._transport: asyncio.Transport | None = None
        self._reader = FrameReader()
        self._outbox = Outbox(self._send)
        self._pending: dict[int, asyncio.Future] = {}  # next-token requests
        self._sinks: dict[int, TokenSink] = {}  # generations
        self._ids = itertools.count()
        self._ready = asyncio.Event()
        self._closing = False
        self.dead_reason = ""
        self.model_info: ModelInfo | None = None
        self.tokenizer_source = ""
        self.max_batch_size = 0
        self.on_adapters: Callable[[list[str]], None] | None = None  # another front end changed them (the service)

    async def connect(self) -> None:
        """Connect (the engine's socket appears once its model is loaded), say hello and wait
        for EngineReady."""
        loop = asyncio.get_running_loop()
        wait_s, longest_s = CONNECT_RETRY_S
        while True:
            try:
                await loop.create_unix_connection(lambda: self, self._address)
                break
            except (FileNotFoundError, ConnectionRefusedError):  # not bound yet, or an earlier engine's file
                await asyncio.sleep(wait_s)
                wait_s = min(wait_s * 2, longest_s)
        self._outbox.put(None, Hello(os.getpid()))
        await self._ready.wait()

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.Transport) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            frames = self._reader.feed(data)
        except BrokenStream as exc:  # never from our engine; nothing after it can be read
            log.error("the engine's stream broke (%s): closing it", exc)
            self._transport.close()
            return
        for frame in frames:
            deliver(frame, self._dispatch, "the engine")

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        if not self._closing and not self.dead_reason:
            log.error("the engine closed its socket")
            self.engine_gone("the engine process is gone")

    async def next_token(self, request: NextTokenRequest) -> list[NextTokenOutput]:
        if self.dead_reason:
            raise Unavailable(self.dead_reason)
        request_id = next(self._ids)
        future = self._pending[request_id] = asyncio.get_running_loop().create_future()
        if Prompts.plain(request):  # joins this tick's Prompts message
            prompts = self._outbox.last(None)
            if type(prompts) is not Prompts:
                prompts = Prompts([], [], [])
                self._outbox.put(None, prompts)
            prompts.request_ids.append(request_id)
            prompts.prompts.append(request.prompts[0])
            prompts.top_ks.append(request.top_k)
        else:
            self._outbox.put(None, Submit(request_id, request))
        try:
            return await future
        except asyncio.CancelledError:
            if not self.dead_reason:
                self._outbox.put(None, Cancel(request_id))  # its prompts leave the engine's queue
            raise
        finally:
            self._pending.pop(request_id, None)

    def generate(self, request: GenerateRequest, sink: TokenSink) -> Callable[[], None]:
        if self.dead_reason:
            raise Unavailable(self.dead_reason)
        request_id = next(self._ids)
        self._sinks[request_id] = sink
        self._outbox.put(None, Generate(request_id, request))
        return functools.partial(self._cancel_generation, request_id)

    async def update_adapter(self, name: str, path: str | None) -> list[str]:
        """The engine loads (or, path None, unloads) a LoRA adapter; the adapters served after."""
        if self.dead_reason:
            raise Unavailable(self.dead_reason)
        request_id = next(self._ids)
        future = self._pending[request_id] = asyncio.get_running_loop().create_future()
        self._outbox.put(None, AdapterUpdate(request_id, name, path or ""))
        try:
            return await future
        finally:
            self._pending.pop(request_id, None)

    def _cancel_generation(self, request_id: int) -> None:
        if self._sinks.pop(request_id, None) is not None and not self.dead_reason:
            self._outbox.put(None, Cancel(request_id))  # its KV-cache slot comes free

    def engine_gone(self, reason: str) -> None:
        """The engine process died: every waiting request and every new one is UNAVAILABLE at once."""
        self.dead_reason = reason
        self._fail_all(Unavailable(reason))

    def _fail_all(self, error: Exception) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        sinks, self._sinks = self._sinks, {}
        for sink in sinks.values():
            sink.fail(error)

    async def close(self) -> None:
        """Calls still waiting are told the server shut down (the engine frees their slots when
        this socket closes: ipc.engine_server)."""
        self._closing = True
        self._fail_all(ShuttingDown("server is shutting down"))
        if self._transport is not None:
            self._transport.close()

    def _send(self, _peer, frame: bytes) -> None:
        if self._transport is not None:
            self._transport.writelines((LENGTH.pack(len(frame)), frame))

    def _dispatch(self, message) -> None:
        kind = type(message)
        if kind is Tokens:
            sinks = self._sinks
            for request_id, event in message.events():
                sink = sinks.get(request_id)
                if sink is not None:
                    if event.finish_reason:
                        del sinks[request_id]
                    sink.put(event)
        elif kind is Step:
            sink = self._sinks.get(message.request_id)
            if sink is not None:
                if message.event.finish_reason:
                    del self._sinks[message.request_id]
                sink.put(message.event)
        elif kind is Answers:
            pending = self._pending
            for request_id, outputs in message.outputs():
                future = pending.get(request_id)
                if future is not None and not future.done():
                    future.set_result(outputs)
        elif kind is Result:
            future = self._pending.get(message.request_id)
            if future is not None and not future.done():
                future.set_result(message.outputs)
        elif kind is Failed:
            error = error_from_code(message.code, message.message)
            future, sink = self._pending.get(message.request_id), self._sinks.pop(message.request_id, None)
            if future is not None and not future.done():
                future.set_exception(error)
            elif sink is not None:
                sink.fail(error)
        elif kind is Adapters:
            future = self._pending.get(message.request_id)
            if future is not None and not future.done():
                future.set_result(message.names)
            elif message.request_id == -1 and self.on_adapters is not None:
                self.on_adapters(message.names)
        elif kind is EngineReady:
            self.model_info, self.tokenizer_source = message.model_info, message.tokenizer_source
            self.max_batch_size = message.max_batch_size
            self._ready.set()
        else:
            log.error("dropped a %s message: not one the engine sends", kind.__name__)
