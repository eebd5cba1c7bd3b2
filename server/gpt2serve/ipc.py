"""The one door between front-end processes and the engine process (`--workers N`, N > 1).

    front end: InferenceService -> EngineClient (zmq DEALER) ─┐
    front end: InferenceService -> EngineClient (zmq DEALER) ─┼─ ipc:// ─> EngineServer (zmq ROUTER)
                                                              ┘             -> Batcher -> Engine

`EngineClient.submit` is the batcher's `submit` seen from another process, so the service and
the transports do not know which side of the door they are on. Only token ids, top-k numbers,
timings, layer reports, errors as (code, message) and trace context as a W3C `traceparent`
cross. Every frame is one msgpack list of messages: what a process has to send is gathered
and sent once per event-loop tick, so 64 answers of one batch cost one frame per front end.

Messages, each a list whose first item is its kind:
    front end -> engine:  [HELLO, pid]  [SUBMIT, id, prompts, top_k, trace | None]  [CANCEL, id]
                          [GENERATE, id, request, trace | None]
    engine -> front end:  [READY, model_info, tokenizer_source, max_batch_size]
                          [RESULT, id, [output, ...]]  [ERROR, id, code, message]
                          [STEP, id, step] ... [END, id]   (a generation's tokens, then its end)
A front end whose caller leaves sends CANCEL: the request leaves the queue, or the generation
its KV-cache slot. A front end that dies sends nothing: the engine watches each front end's
process (a pidfd from its HELLO, readable the moment it exits) and cancels all of its work then.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
from dataclasses import asdict
from typing import Any, AsyncIterator, Sequence

import msgpack
import zmq
import zmq.asyncio
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, get_current_span, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gpt2serve_client.types import LayerReport, ModelInfo

from .engine.engine import TokenScore
from .engine.generation import SampledToken
from .engine.sampling import SamplingParams
from .errors import INTERNAL_MESSAGE, ServeError, Unavailable, error_from_code
from .scheduling.batcher import Batcher, ScheduledOutput
from .scheduling.generation import GeneratedStep, GenerationRequest, GenerationScheduler
from .telemetry.spans import RequestTrace

log = logging.getLogger(__name__)
HELLO, SUBMIT, CANCEL, READY, RESULT, ERROR, GENERATE, STEP, END = range(9)
_END_OF_STREAM = object()
_W3C = TraceContextTextMapPropagator()


def engine_address(directory: str) -> str:
    return f"ipc://{directory}/engine.sock"


# What crosses: traces, outputs ------------------------------------------------------------------

def trace_to_wire(trace: RequestTrace | None) -> list | None:
    if trace is None:
        return None
    carrier: dict[str, str] = {}
    _W3C.inject(carrier, set_span_in_context(NonRecordingSpan(trace.span_context)))
    return [carrier.get("traceparent", ""), trace.sampled, trace.layers_wanted, trace.layer_spans,
            trace.layers_in_response, trace.attention_maps]


def trace_from_wire(wire: list | None) -> RequestTrace | None:
    if wire is None:
        return None
    traceparent, sampled, layers_wanted, layer_spans, layers_in_response, attention_maps = wire
    context = get_current_span(_W3C.extract({"traceparent": traceparent})).get_span_context()
    if not context.is_valid:
        context = SpanContext(0, 0, is_remote=True, trace_flags=TraceFlags(0))
    return RequestTrace(context, sampled, layers_wanted, layer_spans, layers_in_response, attention_maps)


def output_to_wire(out: ScheduledOutput) -> list:
    return [[s.token_id for s in out.top], [s.logprob for s in out.top], out.queue_s, out.forward_s, out.batch_size,
            out.enqueued_ns, out.batch_started_ns, None if out.layers is None else [asdict(r) for r in out.layers]]


def output_from_wire(wire: list) -> ScheduledOutput:
    ids, logprobs, queue_s, forward_s, batch_size, enqueued_ns, batch_started_ns, layers = wire
    return ScheduledOutput([TokenScore(i, v) for i, v in zip(ids, logprobs)], queue_s, forward_s, batch_size,
                           enqueued_ns, batch_started_ns,
                           None if layers is None else [LayerReport.from_dict(r) for r in layers])


def request_to_wire(r: GenerationRequest) -> list:
    p = r.params
    return [r.prompt, [p.temperature, p.top_k, p.top_p, p.logprobs], r.max_tokens, sorted(r.stop_token_ids),
            r.ignore_eos, r.seed, r.deadline]  # deadline: CLOCK_MONOTONIC, the same in every process


def request_from_wire(wire: list) -> GenerationRequest:
    prompt, params, max_tokens, stop_token_ids, ignore_eos, seed, deadline = wire
    return GenerationRequest(prompt, SamplingParams(*params), max_tokens, frozenset(stop_token_ids), ignore_eos, seed,
                             deadline)


def step_to_wire(step: GeneratedStep) -> list:
    t = step.token
    return [t.token_id, t.logprob, [s.token_id for s in t.top], [s.logprob for s in t.top], step.finish_reason,
            step.queue_s, step.forward_s, step.batch_size]


def step_from_wire(wire: list) -> GeneratedStep:
    token_id, logprob, top_ids, top_logprobs, finish_reason, queue_s, forward_s, batch_size = wire
    token = SampledToken(token_id, logprob, [TokenScore(i, v) for i, v in zip(top_ids, top_logprobs)])
    return GeneratedStep(token, finish_reason, queue_s, forward_s, batch_size)


class _Outbox:
    """Messages gathered during one loop tick, then sent as one frame per peer."""

    def __init__(self, send):
        self._send = send  # send(peer, payload bytes)
        self._messages: dict[Any, list] = {}

    def put(self, peer: Any, message: list) -> None:
        if not self._messages:
            asyncio.get_running_loop().call_soon(self._flush)
        self._messages.setdefault(peer, []).append(message)

    def _flush(self) -> None:
        messages, self._messages = self._messages, {}
        for peer, batch in messages.items():
            self._send(peer, msgpack.packb(batch))


# Front-end side ---------------------------------------------------------------------------------

class EngineClient:
    """Stands in for the batcher in a front-end process (see module doc)."""

    def __init__(self, address: str):
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(address)
        self._outbox = _Outbox(lambda _peer, payload: self._socket.send(payload))
        self._pending: dict[int, asyncio.Future] = {}
        self._streams: dict[int, asyncio.Queue] = {}  # generations: their steps as they arrive
        self._ids = itertools.count()
        self._ready = asyncio.Event()
        self._receiver: asyncio.Task | None = None
        self.dead_reason = ""
        self.model_info: ModelInfo | None = None
        self.tokenizer_source = ""
        self.max_batch_size = 0

    async def connect(self) -> None:
        """Say hello and wait for READY (the engine answers once its model is loaded and warm)."""
        self._receiver = asyncio.create_task(self._receive(), name="engine-client")
        self._outbox.put(None, [HELLO, os.getpid()])
        await self._ready.wait()

    async def submit(self, prompts: Sequence[list[int]], top_k: int, trace: RequestTrace | None = None
                     ) -> list[ScheduledOutput]:
        if self.dead_reason:
            raise Unavailable(self.dead_reason)
        request_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        self._outbox.put(None, [SUBMIT, request_id, [list(p) for p in prompts], top_k, trace_to_wire(trace)])
        try:
            return await future
        except asyncio.CancelledError:
            if not self.dead_reason:
                self._outbox.put(None, [CANCEL, request_id])  # its prompts leave the engine's queue
            raise
        finally:
            self._pending.pop(request_id, None)

    async def generate(self, request: GenerationRequest, trace: RequestTrace | None = None
                       ) -> AsyncIterator[GeneratedStep]:
        """The generation scheduler's `generate`, seen from another process."""
        if self.dead_reason:
            raise Unavailable(self.dead_reason)
        request_id = next(self._ids)
        steps = self._streams[request_id] = asyncio.Queue()
        self._outbox.put(None, [GENERATE, request_id, request_to_wire(request), trace_to_wire(trace)])
        ended = False
        try:
            while True:
                item = await steps.get()
                if item is _END_OF_STREAM:
                    ended = True
                    return
                if isinstance(item, ServeError):
                    ended = True
                    raise item
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not ended and not self.dead_reason:
                self._outbox.put(None, [CANCEL, request_id])  # its KV-cache slot comes free

    def engine_gone(self, reason: str) -> None:
        """The engine process died: every waiting request and every new one is UNAVAILABLE at once."""
        self.dead_reason = reason
        for future in self._pending.values():
            if not future.done():
                future.set_exception(Unavailable(reason))
        for steps in self._streams.values():
            steps.put_nowait(Unavailable(reason))

    async def close(self) -> None:
        if self._receiver is not None:
            self._receiver.cancel()
            await asyncio.gather(self._receiver, return_exceptions=True)
        self._socket.close(0)
        self._context.term()

    async def _receive(self) -> None:
        while True:
            for message in msgpack.unpackb(await self._socket.recv()):
                kind = message[0]
                if kind == RESULT:
                    future = self._pending.get(message[1])
                    if future is not None and not future.done():
                        future.set_result([output_from_wire(out) for out in message[2]])
                elif kind == STEP:
                    steps = self._streams.get(message[1])
                    if steps is not None:
                        steps.put_nowait(step_from_wire(message[2]))
                elif kind == END:
                    steps = self._streams.get(message[1])
                    if steps is not None:
                        steps.put_nowait(_END_OF_STREAM)
                elif kind == ERROR:
                    future, steps = self._pending.get(message[1]), self._streams.get(message[1])
                    if future is not None and not future.done():
                        future.set_exception(error_from_code(message[2], message[3]))
                    elif steps is not None:
                        steps.put_nowait(error_from_code(message[2], message[3]))
                elif kind == READY:
                    self.model_info = ModelInfo.from_dict(message[1])
                    self.tokenizer_source, self.max_batch_size = message[2], message[3]
                    self._ready.set()


# Engine side ------------------------------------------------------------------------------------

class EngineServer:
    """Serves front ends from the engine process: each SUBMIT becomes a batcher.submit, each
    GENERATE a generation.generate."""

    def __init__(self, address: str, batcher: Batcher, generation: GenerationScheduler, model_info: ModelInfo,
                 tokenizer_source: str):
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(address)
        self._outbox = _Outbox(lambda peer, payload: self._socket.send_multipart([peer, payload]))
        self._batcher = batcher
        self._generation = generation
        self._ready = [READY, asdict(model_info), tokenizer_source, batcher.max_batch_size]
        self._running: dict[tuple[bytes, int], asyncio.Task] = {}
        self._watched: dict[bytes, int] = {}  # front end (zmq identity) -> pidfd of its process

    async def serve(self) -> None:
        while True:
            peer, payload = await self._socket.recv_multipart()
            for message in msgpack.unpackb(payload):
                kind = message[0]
                if kind == SUBMIT:
                    _, request_id, prompts, top_k, trace = message
                    key = (peer, request_id)
                    self._running[key] = asyncio.create_task(self._submit(key, prompts, top_k, trace_from_wire(trace)))
                elif kind == GENERATE:
                    _, request_id, request, trace = message
                    key = (peer, request_id)
                    self._running[key] = asyncio.create_task(
                        self._generate(key, request_from_wire(request), trace_from_wire(trace)))
                elif kind == CANCEL:
                    task = self._running.get((peer, message[1]))
                    if task is not None:
                        task.cancel()
                elif kind == HELLO:
                    self._watch(peer, message[1])
                    self._outbox.put(peer, self._ready)

    def _watch(self, peer: bytes, pid: int) -> None:
        """Cancel a front end's work the moment its process exits (see the module doc)."""
        if peer in self._watched:
            return
        try:
            fd = os.pidfd_open(pid)
        except (OSError, AttributeError) as exc:  # no pidfds (old kernel), or it is gone already
            log.warning("cannot watch front end %d (%s); its work is cancelled only by its own CANCELs", pid, exc)
            return
        self._watched[peer] = fd
        asyncio.get_running_loop().add_reader(fd, self._front_end_gone, peer, pid)

    def _front_end_gone(self, peer: bytes, pid: int) -> None:
        fd = self._watched.pop(peer)
        asyncio.get_running_loop().remove_reader(fd)
        os.close(fd)
        tasks = [task for (owner, _), task in self._running.items() if owner == peer]
        for task in tasks:
            task.cancel()  # requests leave the queue; generations free their KV-cache slots
        log.error("front end %d is gone: cancelled its %d request(s)", pid, len(tasks))

    @contextlib.contextmanager
    def _answering(self, key: tuple[bytes, int], what: str):
        """Around one front-end request: its errors become an ERROR message to that front end (a
        cancelled one, whose caller went away, gets none); at the end it leaves `_running`."""
        peer, request_id = key
        try:
            yield
        except ServeError as exc:
            self._outbox.put(peer, [ERROR, request_id, exc.code, exc.message])
        except asyncio.CancelledError:
            pass  # the front end's caller went away
        except Exception:  # never lose a request silently
            log.exception("engine %s failed", what)
            self._outbox.put(peer, [ERROR, request_id, "INTERNAL", INTERNAL_MESSAGE])  # the details: this log
        finally:
            self._running.pop(key, None)

    async def _submit(self, key: tuple[bytes, int], prompts: list[list[int]], top_k: int,
                      trace: RequestTrace | None) -> None:
        peer, request_id = key
        with self._answering(key, "request"):
            outputs = await self._batcher.submit(prompts, top_k, trace)
            self._outbox.put(peer, [RESULT, request_id, [output_to_wire(out) for out in outputs]])

    async def _generate(self, key: tuple[bytes, int], request: GenerationRequest, trace: RequestTrace | None) -> None:
        peer, request_id = key
        steps = self._generation.generate(request, trace)
        with self._answering(key, "generation"):
            try:
                async for step in steps:
                    self._outbox.put(peer, [STEP, request_id, step_to_wire(step)])
                self._outbox.put(peer, [END, request_id])
            finally:
                await steps.aclose()  # frees its KV-cache slot

    def close(self) -> None:
        for task in self._running.values():
            task.cancel()
        for fd in self._watched.values():
            asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)
        self._watched.clear()
        self._socket.close(0)
        self._context.term()
