"""The engine process's side of the IPC door (see socket_client): each Submit becomes an
EngineCore.queue_prompts answered by a callback (no task or future per request). A Prompts
message's one-prompt calls are queued together (EngineCore.queue_calls), each answered straight
into its front end's Answers message of the batch (ipc.engine_answers): a batch's plain answers for one
front end are one message, the others Results. Each Generate becomes an EngineCore.add whose
tokens go back to the front end that asked: a step's plain tokens for one front end as one
Tokens message, a first token (with its queue time and prompt scores) as a Step.

A front end whose caller leaves sends Cancel. A front end that dies sends nothing, but the
kernel closes its socket: the server cancels all of its work then, so its KV-cache slots come
free. A frame that does not decode is logged and dropped; the front ends' other requests go on.

It runs on a thread of its own, not on an event loop (vLLM v1's engine core has its IO threads
the same way), over a listening Unix socket and one connection per front end (ipc.framing: a
frame is its length, then its bytes). One epoll waits for frames, new front ends, the socket
room a backed-up front end was waiting for, and the core's outputs (handed over with an eventfd
wake-up); then everything that arrived is handled and each front end's messages go out as one
frame, written straight into its socket. So a lone request's answer costs no event-loop pass and
no other thread, and message handling runs while the core's thread waits on the device.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import select
import socket
import threading
from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING, Callable

from ..errors import INTERNAL_MESSAGE, ServeError
from ..protocol import (AdapterUpdate, Adapters, Answers, Cancel, EngineReady, Failed, Generate, Hello, NextTokenOutput, Prompts, Result,
                        StepControls, Submit, TopTable, TraceContext)
from ..scheduling.outputs import run_posted
from .engine_answers import Key, PeerSink, PlainCalls
from .framing import LENGTH, BrokenStream, FrameReader, Outbox, deliver

if TYPE_CHECKING:
    from ..scheduling.core import EngineCore
    from ..scheduling.outputs import PromptGroup

log = logging.getLogger(__name__)
READ_BYTES = 1 << 18  # read from one front end a pass: neither side starves the other


class _FrontEnd:
    """One front end's connection: the frames it has sent in part, what its socket has not
    taken yet, and its pid (from its Hello, for the log)."""

    __slots__ = ("number", "sock", "reader", "unsent", "pid", "calls")

    def __init__(self, server: EngineServer, number: int, sock: socket.socket):
        self.number, self.sock = number, sock
        self.calls = PlainCalls(server, number)  # its one-prompt calls in the core
        self.reader = FrameReader()
        self.unsent = bytearray()  # written when its socket has room (EPOLLOUT)
        self.pid = 0


class EngineServer:
    def __init__(self, address: str, core: EngineCore, ready: EngineReady):
        """`address`: the path of the Unix socket to listen on (an earlier engine's file there is replaced)."""
        if os.path.exists(address):
            os.unlink(address)  # left by an engine that died; no other listens in this run directory
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(address)
        self._listener.listen(128)
        self._listener.setblocking(False)
        self._front_ends: dict[int, _FrontEnd] = {}  # by connection number (a Key's first half)
        self._by_fd: dict[int, _FrontEnd] = {}
        self._numbers = itertools.count()
        self.outbox = Outbox(self._write, flushed_by_owner=True)
        self.core = core
        self._ready = ready
        self._submits: dict[Key, PromptGroup] = {}  # Submits' (one-prompt calls: _FrontEnd.calls)
        self.generations: dict[Key, int] = {}  # -> the core's generation id
        self._posted: deque[tuple[Callable, tuple]] = deque()  # from the core's thread
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._epoll = select.epoll()
        self._epoll.register(self._listener.fileno(), select.EPOLLIN)
        self._epoll.register(self._wake_fd, select.EPOLLIN)
        self._stopping = False
        self._thread: threading.Thread | None = None
        core.hand_outputs_to(self)  # the core's answers run on this server's thread

    # Any thread ---------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._serve, name="ipc", daemon=True)
        self._thread.start()

    @property
    def serving(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def call_soon_threadsafe(self, fn: Callable, *args) -> None:  # the core's outputs come here
        """fn(*args) on the IPC thread, in order."""
        self._posted.append((fn, args))
        os.eventfd_write(self._wake_fd, 1)

    def stop(self) -> None:
        """The IPC thread ends after its pass; what it had not sent is dropped (the front ends
        have drained by now: the supervisor stops them first)."""
        self._stopping = True
        os.eventfd_write(self._wake_fd, 1)
        if self._thread is not None:
            self._thread.join(timeout=10)

    # The IPC thread ------------------------------------------------------------------------------------
    def _serve(self) -> None:
        listener, wake_fd, by_fd = self._listener.fileno(), self._wake_fd, self._by_fd
        try:
            while not self._stopping:
                received = False
                for fd, events in self._epoll.poll():
                    if fd == wake_fd:
                        os.eventfd_read(wake_fd)  # before the queue is read: a later post wakes the poll again
                        run_posted(self._posted)
                    elif fd == listener:
                        self._accept()
                    elif (front_end := by_fd.get(fd)) is not None:
                        if events & select.EPOLLOUT:
                            self._write_unsent(front_end)
                        if events & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR):
                            received |= self._receive(front_end)
                if received:
                    self.core.wake()  # once for the pass's requests (queued with wake=False)
                self.outbox.flush()
        except BaseException:  # the door is shut: the engine process ends (launch.engine_host)
            log.exception("the IPC thread failed")

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            sock.setblocking(False)
            front_end = _FrontEnd(self, next(self._numbers), sock)
            self._front_ends[front_end.number] = self._by_fd[sock.fileno()] = front_end
            self._epoll.register(sock.fileno(), select.EPOLLIN)

    def _receive(self, front_end: _FrontEnd) -> bool:
        """What one front end sent (up to READ_BYTES), each frame handed over; False when it is gone."""
        try:
            data = front_end.sock.recv(READ_BYTES)
            frames = front_end.reader.feed(data) if data else None
        except BlockingIOError:
            return False
        except (OSError, BrokenStream) as exc:
            log.error("front end %d's connection failed: %s", front_end.pid, exc)
            frames = None
        if frames is None:  # closed: it exited, or died
            self._front_end_gone(front_end)
            return False
        dispatch = functools.partial(self._dispatch, front_end.number)
        for frame in frames:
            deliver(frame, dispatch, "a front end")
        return True

    def _write(self, number: int, frame: bytes) -> None:
        """A frame to a front end: into its socket now, or what it cannot take yet kept for EPOLLOUT."""
        front_end = self._front_ends.get(number)
        if front_end is None:
            return  # gone: its work was cancelled
        if front_end.unsent:
            front_end.unsent += LENGTH.pack(len(frame))
            front_end.unsent += frame
            return
        length = LENGTH.pack(len(frame))
        try:
            sent = front_end.sock.sendmsg((length, frame))
        except BlockingIOError:
            sent = 0
        except OSError:
            return  # it hung up; its read side says so next
        if sent < 4 + len(frame):
            front_end.unsent += (length + frame)[sent:]
            self._epoll.modify(front_end.sock.fileno(), select.EPOLLIN | select.EPOLLOUT)

    def _write_unsent(self, front_end: _FrontEnd) -> None:
        try:
            sent = front_end.sock.send(front_end.unsent)
        except BlockingIOError:
            return
        except OSError:
            front_end.unsent.clear()
            sent = 0
        del front_end.unsent[:sent]
        if not front_end.unsent:
            self._epoll.modify(front_end.sock.fileno(), select.EPOLLIN)

    def _dispatch(self, peer: int, message) -> None:
        kind = type(message)
        if kind is Generate:
            key = (peer, message.request_id)
            try:
                self.generations[key] = self.core.add(message.request, PeerSink(self, key), wake=False)
            except Exception as exc:  # refused (queue full, shutting down)
                self.send_error(key, exc, "generation")
        elif kind is Prompts:
            self._queue_calls(peer, message)
        elif kind is Submit:
            request = message.request
            self._queue(peer, message.request_id, request.prompts, request.top_k, request.trace,
                        request.prompt_logprobs, request.controls, request.adapter)
        elif kind is Cancel:
            key = (peer, message.request_id)
            self._cancel(key)
        elif kind is AdapterUpdate:  # off this thread: a load reads files for milliseconds
            threading.Thread(target=self._update_adapter, args=(peer, message), name="lora", daemon=True).start()
        elif kind is Hello:
            self._front_ends[peer].pid = message.pid
            self.outbox.put(peer, self._ready)
        else:
            log.error("dropped a %s message: not one a front end sends", kind.__name__)

    def _queue(self, peer: int, request_id: int, prompts: list[list[int]], top_k: int,
               trace: TraceContext | None = None, prompt_logprobs: int | None = None,
               controls: StepControls | None = None, adapter: str | None = None) -> None:
        key = (peer, request_id)
        try:
            answered = functools.partial(self._answered, key)
            self._submits[key] = self.core.queue_prompts(prompts, top_k, trace, prompt_logprobs, answered,
                                                          wake=False, controls=controls, adapter=adapter)
        except Exception as exc:  # refused (queue full, too many prompts, shutting down)
            self.send_error(key, exc, "request")

    def _queue_calls(self, peer: int, message: Prompts) -> None:
        """A Prompts message's calls, queued together (EngineCore.queue_calls); those the queue
        has no room for are refused one by one."""
        calls = self._front_ends[peer].calls
        try:
            requests, refusal = self.core.queue_calls(message.prompts, message.top_ks, message.request_ids, calls)
        except Exception as exc:  # not running: every call is refused
            requests, refusal = [], exc
        calls.pending.update(zip(message.request_ids, requests))
        for request_id in message.request_ids[len(requests):]:
            self.send_error((peer, request_id), refusal, "request")

    def _answered(self, key: Key, result: list[NextTokenOutput] | Exception) -> None:
        if self._submits.pop(key, None) is None:
            return  # cancelled: nobody to answer
        if isinstance(result, Exception):
            self.send_error(key, result, "request")
        elif len(result) == 1 and result[0].plain:  # joins its front end's Answers message of this batch
            (o,) = result
            self.answers_of_batch(key[0], o.forward_s, o.batch_size, o.batch_started_ns).extend(
                [key[1]], [o.top], [o.queue_s], [o.enqueued_ns], [o.cached_tokens])
        else:
            self.outbox.put(key[0], Result(key[1], result))

    def answers_of_batch(self, peer: int, forward_s: float, batch_size: int, batch_started_ns: int,
                          table: TopTable | None = None) -> Answers:
        """The front end's Answers message of this batch, to extend: its last message when that
        is one of the same form (rows of `table`, or TopScores when None; an answer must not
        pass an earlier message), else a new one."""
        answers = self.outbox.last(peer)
        if (type(answers) is not Answers or answers.forward_s != forward_s or answers.batch_size != batch_size
                or answers.batch_started_ns != batch_started_ns or answers.table is not table):
            answers = Answers([], [], [], [], [], forward_s, batch_size, batch_started_ns, table)
            self.outbox.put(peer, answers)
        return answers

    def _cancel(self, key: Key) -> None:
        group, seq_id = self._submits.pop(key, None), self.generations.pop(key, None)
        if group is not None:
            self.core.cancel_prompts(group)  # its prompts leave the queue
        elif (front_end := self._front_ends.get(key[0])) is not None:
            front_end.calls.cancel(key[1])  # if it is a one-prompt call
        if seq_id is not None:
            self.core.abort(seq_id)  # its slot comes free at the next step

    def send_error(self, key: Key, error: Exception, what: str) -> None:
        if isinstance(error, ServeError):
            self.outbox.put(key[0], Failed(key[1], error.code, error.message))
        else:  # never lose a request silently; the details stay in this log
            log.error("engine %s failed", what, exc_info=error)
            self.outbox.put(key[0], Failed(key[1], "INTERNAL", INTERNAL_MESSAGE))

    def _update_adapter(self, peer: int, message: AdapterUpdate) -> None:
        """Load or unload (on a thread of its own); the answer goes to `peer`, and the adapters now
        served to every front end (each checks names against its list, and lists them)."""
        try:
            names = self.core.update_adapter(message.name, message.path or None)
        except Exception as exc:
            self.call_soon_threadsafe(self.send_error, (peer, message.request_id), exc, "adapter update")
            return
        self.call_soon_threadsafe(self._adapters_changed, peer, message.request_id, names)

    def _adapters_changed(self, peer: int, request_id: int, names: list[str]) -> None:
        self._ready = replace(self._ready, model_info=replace(self._ready.model_info, adapters=names))  # for a new front end
        for number in self._front_ends:
            self.outbox.put(number, Adapters(request_id if number == peer else -1, names))

    def _front_end_gone(self, front_end: _FrontEnd) -> None:
        """Its socket closed (an exit, a drain's or a death's): its requests leave the queue and
        its generations free their KV-cache slots."""
        del self._front_ends[front_end.number], self._by_fd[front_end.sock.fileno()]
        self._epoll.unregister(front_end.sock.fileno())
        front_end.sock.close()
        keys = [key for key in [*self._submits, *self.generations] if key[0] == front_end.number]
        for key in keys:
            self._cancel(key)
        cancelled = len(keys) + front_end.calls.cancel_all()
        if cancelled:
            log.error("front end %d is gone: cancelled its %d request(s)", front_end.pid, cancelled)
        else:  # it exited with nothing left here: a drain, or a death between requests
            log.info("front end %d exited with no request in the engine", front_end.pid)

    def close(self) -> None:
        """After stop(): cancel what is left, close the sockets and the descriptors."""
        for key in [*self._submits, *self.generations]:
            self._cancel(key)
        for front_end in self._front_ends.values():
            front_end.calls.cancel_all()
            front_end.sock.close()
        self._front_ends.clear()
        self._by_fd.clear()
        address = self._listener.getsockname()
        self._listener.close()
        if address and os.path.exists(address):
            os.unlink(address)
        self._epoll.close()
        os.close(self._wake_fd)
