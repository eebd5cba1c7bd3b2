"""The engine process's side of the IPC door (see zmq_client): each Submit, and each request of a
Prompts message, becomes an EngineCore.queue_prompts answered by a callback (no task or future
per request): a batch's plain one-prompt answers for one front end as one Answers message, the
others as a Result. Each Generate becomes an EngineCore.add whose tokens go back to the front
end that asked: a step's plain tokens for one front end as one Tokens message, a first token
(with its queue time and prompt scores) as a Step.

A front end whose caller leaves sends Cancel. A front end that dies sends nothing: the server
watches each front end's process (a pidfd from its Hello, readable the moment it exits) and
cancels all of its work then, so its KV-cache slots come free. A frame that does not decode is
logged and dropped; the front ends' other requests go on.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from typing import TYPE_CHECKING

import zmq
import zmq.asyncio

from ..errors import INTERNAL_MESSAGE, ServeError
from ..protocol import (Answers, Cancel, EngineReady, Failed, Generate, Hello, NextTokenOutput, Prompts, Result,
                        SampledToken, Step, StepControls, Submit, TokenEvent, Tokens, TraceContext)
from .framing import Outbox, deliver

if TYPE_CHECKING:
    from ..scheduling.core import EngineCore
    from ..scheduling.outputs import PromptGroup

log = logging.getLogger(__name__)
Key = tuple[bytes, int]  # (front end's zmq identity, its request id)


class _PeerSink:
    """A generation's events, on their way back to the front end that asked."""

    def __init__(self, server: EngineServer, key: Key):
        self.server, self.key = server, key

    def put(self, event: TokenEvent) -> None:
        """A plain token joins the peer's Tokens message of this step (one per front end per
        step); a first token, with its extras, goes as a Step."""
        if not (event.queue_s or event.prompt_logprobs is not None or event.cached_tokens):
            self.put_plain(event.token, event.finish_reason, event.forward_s, event.batch_size)
            return
        if event.finish_reason:
            self.server._generations.pop(self.key, None)
        self.server._outbox.put(self.key[0], Step(self.key[1], event))

    def put_plain(self, token: SampledToken, finish_reason: str, forward_s: float, batch_size: int) -> None:
        """A token with no extras, straight into the peer's Tokens message of this step."""
        server, (peer, request_id) = self.server, self.key
        if finish_reason:
            server._generations.pop(self.key, None)
        tokens = server._outbox.last(peer)  # only the last: a later token must not pass an earlier Step
        if type(tokens) is not Tokens or tokens.forward_s != forward_s or tokens.batch_size != batch_size:
            tokens = Tokens([], [], [], [], [], forward_s, batch_size, [])
            server._outbox.put(peer, tokens)
        tokens.request_ids.append(request_id)
        tokens.token_ids.append(token.token_id)
        tokens.logprobs.append(token.logprob)
        tokens.finish_reasons.append(finish_reason)
        tokens.tops.append(token.top)
        tokens.allowed.append(token.allowed)

    def fail(self, error: Exception) -> None:
        self.server._generations.pop(self.key, None)
        self.server._send_error(self.key, error, "generation")


class EngineServer:
    def __init__(self, address: str, core: EngineCore, ready: EngineReady):
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(address)
        self._outbox = Outbox(lambda peer, frame: self._socket.send_multipart([peer, frame]))
        self._core = core
        self._ready = ready
        self._submits: dict[Key, PromptGroup] = {}
        self._generations: dict[Key, int] = {}  # -> the core's generation id
        self._watched: dict[bytes, int] = {}  # front end (zmq identity) -> pidfd of its process

    async def serve(self) -> None:
        while True:
            peer, frame = await self._socket.recv_multipart()
            deliver(frame, functools.partial(self._dispatch, peer), "a front end")
            self._core.wake()  # once for the frame's requests (queued with wake=False)

    def _dispatch(self, peer: bytes, message) -> None:
        kind = type(message)
        if kind is Generate:
            key = (peer, message.request_id)
            try:
                self._generations[key] = self._core.add(message.request, _PeerSink(self, key), wake=False)
            except Exception as exc:  # refused (queue full, shutting down)
                self._send_error(key, exc, "generation")
        elif kind is Prompts:
            for request_id, prompt, top_k in zip(message.request_ids, message.prompts, message.top_ks):
                self._queue(peer, request_id, [prompt], top_k)
        elif kind is Submit:
            request = message.request
            self._queue(peer, message.request_id, request.prompts, request.top_k, request.trace,
                        request.prompt_logprobs, request.controls)
        elif kind is Cancel:
            key = (peer, message.request_id)
            self._cancel(key)
        elif kind is Hello:
            self._watch(peer, message.pid)
            self._outbox.put(peer, self._ready)
        else:
            log.error("dropped a %s message: not one a front end sends", kind.__name__)

    def _queue(self, peer: bytes, request_id: int, prompts: list[list[int]], top_k: int,
               trace: TraceContext | None = None, prompt_logprobs: int | None = None,
               controls: StepControls | None = None) -> None:
        key = (peer, request_id)
        try:
            answered = functools.partial(self._answered, key)
            self._submits[key] = self._core.queue_prompts(prompts, top_k, trace, prompt_logprobs, answered,
                                                          wake=False, controls=controls)
        except Exception as exc:  # refused (queue full, too many prompts, shutting down)
            self._send_error(key, exc, "request")

    def _answered(self, key: Key, result: list[NextTokenOutput] | Exception) -> None:
        if self._submits.pop(key, None) is None:
            return  # cancelled: nobody to answer
        if isinstance(result, Exception):
            self._send_error(key, result, "request")
        elif Answers.plain(result):  # joins the peer's Answers message of this batch
            (o,), (peer, request_id) = result, key
            answers = self._outbox.last(peer)  # only the last: an answer must not pass an earlier message
            if (type(answers) is not Answers or answers.forward_s != o.forward_s or answers.batch_size != o.batch_size
                    or answers.batch_started_ns != o.batch_started_ns):
                answers = Answers([], [], [], [], [], o.forward_s, o.batch_size, o.batch_started_ns)
                self._outbox.put(peer, answers)
            answers.request_ids.append(request_id)
            answers.tops.append(o.top)
            answers.queue_s.append(o.queue_s)
            answers.enqueued_ns.append(o.enqueued_ns)
            answers.cached_tokens.append(o.cached_tokens)
        else:
            self._outbox.put(key[0], Result(key[1], result))

    def _cancel(self, key: Key) -> None:
        group, seq_id = self._submits.pop(key, None), self._generations.pop(key, None)
        if group is not None:
            self._core.cancel_prompts(group)  # its prompts leave the queue
        if seq_id is not None:
            self._core.abort(seq_id)  # its slot comes free at the next step

    def _send_error(self, key: Key, error: Exception, what: str) -> None:
        if isinstance(error, ServeError):
            self._outbox.put(key[0], Failed(key[1], error.code, error.message))
        else:  # never lose a request silently; the details stay in this log
            log.error("engine %s failed", what, exc_info=error)
            self._outbox.put(key[0], Failed(key[1], "INTERNAL", INTERNAL_MESSAGE))

    def _watch(self, peer: bytes, pid: int) -> None:
        """Cancel a front end's work the moment its process exits (see the module doc)."""
        if peer in self._watched:
            return
        try:
            fd = os.pidfd_open(pid)
        except (OSError, AttributeError) as exc:  # no pidfds (old kernel), or it is gone already
            log.warning("cannot watch front end %d (%s); its work is cancelled only by its own Cancels", pid, exc)
            return
        self._watched[peer] = fd
        asyncio.get_running_loop().add_reader(fd, self._front_end_gone, peer, pid)

    def _front_end_gone(self, peer: bytes, pid: int) -> None:
        fd = self._watched.pop(peer)
        asyncio.get_running_loop().remove_reader(fd)
        os.close(fd)
        keys = [key for key in [*self._submits, *self._generations] if key[0] == peer]
        for key in keys:
            self._cancel(key)  # requests leave the queue; generations free their KV-cache slots
        if keys:
            log.error("front end %d is gone: cancelled its %d request(s)", pid, len(keys))
        else:  # it exited with nothing left here: a drain, or a death between requests
            log.info("front end %d exited with no request in the engine", pid)

    def close(self) -> None:
        for key in [*self._submits, *self._generations]:
            self._cancel(key)
        for fd in self._watched.values():
            asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)
        self._watched.clear()
        self._socket.close(0)
        self._context.term()
