"""The engine core's answers, on the callers' event loop (scheduling.core hands each forward's
outputs over in one call): next-token requests answered (PromptGroup), generations' tokens to
their sinks, errors told once, and telemetry told after the answers, off everyone's critical path.

It also keeps the live generations by id (the callers' abort() finds them here), and drops the
outputs of a caller that left: its sink hears nothing more.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Callable, Protocol, Union

from ..engine.steps import BatchOutput, StepOutput
from ..errors import NonFiniteOutput
from ..protocol import NextTokenOutput, SampledToken, TokenEvent
from ..telemetry.records import BatchDone, PrefixCacheUse, StepDone
from .scheduler import EngineRequest

log = logging.getLogger(__name__)


class Handover:
    """fn(*args) on the callers' loop, in order, from the core's thread; one wake-up for all
    handed over before the loop runs. A wake-up is a syscall that lets go of the GIL, and while
    the loop is busy the core's thread then waits up to a switch interval (5 ms) to get it back."""

    def __init__(self):
        self.loop: asyncio.AbstractEventLoop | None = None  # set when the core starts
        self._posted: deque[tuple[Callable, tuple]] = deque()
        self._wake_posted = False

    def __call__(self, fn: Callable, *args) -> None:
        self._posted.append((fn, args))
        if self._wake_posted:
            return
        self._wake_posted = True
        try:
            self.loop.call_soon_threadsafe(self._run_posted)
        except RuntimeError:  # the callers' loop is closed: nobody left to tell
            pass

    def _run_posted(self) -> None:
        """On the callers' loop: everything handed over so far, in order."""
        self._wake_posted = False  # first: a post from now on wakes the loop again
        run_posted(self._posted)


def run_posted(posted: deque[tuple[Callable, tuple]]) -> None:
    """Each fn(*args) handed over, in order, until none is left; one's failure is not the others'."""
    while posted:
        fn, args = posted.popleft()
        try:
            fn(*args)
        except Exception:
            log.exception("engine core: handing an output over failed")


class PromptGroup:
    """The prompts of one next-token request, answered together: `done` is called once, on the
    callers' loop, with every prompt's answer in order, or with the first error. A plain
    callback, not a future per prompt and a task per request: at thousands of requests a second
    those were most of the engine process's CPU per prompt. Once finished it lets go of its
    callback and its prompts, so nothing of it is left in a reference cycle: cyclic garbage at
    that rate made the garbage collector's full passes a third of the engine's CPU."""

    __slots__ = ("answers", "left", "done", "on_error", "finished", "requests")
    answers_top = False  # see ipc.engine_answers.PlainCalls: an output answered from its top tokens alone

    def __init__(self, size: int, done: Callable[[Union[list[NextTokenOutput], Exception]], None],
                 on_error: Callable[[PromptGroup], None]):
        self.answers: list[NextTokenOutput | None] = [None] * size
        self.left, self.done, self.on_error, self.finished = size, done, on_error, False
        self.requests: list[EngineRequest] = []  # its prompts, in order (EngineRequest.row)

    def answer(self, row: int, output: NextTokenOutput) -> None:
        if self.finished or self.answers[row] is not None:
            return
        self.answers[row] = output
        self.left -= 1
        if not self.left:
            self._finish(self.answers)

    def fail(self, error: Exception, request: EngineRequest | None = None) -> None:
        """The request fails, whichever of its prompts (`request`) failed."""
        if not self.finished:
            self._finish(error)

    def _finish(self, result) -> None:
        self.finished = True
        done, self.done = self.done, None
        try:
            if isinstance(result, Exception):
                self.on_error(self)  # its other prompts leave the queue
            done(result)
        finally:
            self.release()

    def release(self) -> None:
        """Finished or cancelled: no more answers; let go of the callbacks and the prompts."""
        self.finished, self.done, self.on_error, self.requests = True, None, None, []


class Observer(Protocol):
    """Told about every forward (telemetry), on the callers' event loop."""

    def record_batch(self, record: BatchDone) -> None: ...

    def record_step(self, record: StepDone) -> None: ...


class Outputs:
    def __init__(self, observer: Observer | None):
        self.observer = observer
        self.generations: dict[int, EngineRequest] = {}  # live ones by id: added, until done or left

    def cancel(self, generation_id: int) -> EngineRequest | None:
        """The caller left: nothing more reaches its sink. The request, if it was still live."""
        request = self.generations.pop(generation_id, None)
        if request is not None:
            request.cancelled = True
        return request

    def answer_prompts(self, batch: list[EngineRequest], output: BatchOutput, started: float, started_ns: int,
                       with_layers: bool) -> None:
        """Answer the batch's prompts (with_layers=False: only those not waiting for layer
        reports), then tell telemetry."""
        failed_rows, plain, plain_rows = output.failed_rows, [], []
        for row, request in enumerate(batch):
            group = request.output
            if group.answers_top and row not in failed_rows:  # a plain one-prompt call: answered below
                plain.append(request)  # a cancelled one too: answer_tops finds it gone and skips it
                plain_rows.append(row)
                continue
            if request.cancelled or group.finished:
                continue
            if row in failed_rows:
                group.fail(NonFiniteOutput("the model's output for this prompt was not finite (a numerical overflow)"),
                           request)
                continue
            if not with_layers and request.trace is not None and request.trace.layers_in_response:
                continue
            controlled_top, allowed = output.controlled.get(row, (None, 0))
            group.answer(request.row, NextTokenOutput(
                output.top[row], started - request.arrived, output.forward_s, len(batch), request.arrived_ns,
                started_ns, output.layers.get(row), output.walkthrough if row in output.layers else None,
                output.prompt_scores.get(row), output.cached_tokens[row] if output.cached_tokens else 0,
                controlled_top, allowed, output.base_top.get(row)))
        if plain:  # in one call, in columns: per front end, its answers of this batch are one message
            plain[0].output.answer_tops(plain, plain_rows, output.top, started, output.cached_tokens, output.forward_s,
                                        len(batch), started_ns)
        if with_layers and self.observer is not None:
            prefix = None
            if output.cached_tokens:  # the prefix cache is on
                prefix = PrefixCacheUse(sum(len(r.prompt) for r in batch), sum(output.cached_tokens))
            self._observe(self.observer.record_batch, BatchDone(
                [r.trace for r in batch], output.padded_len, output.forward_s, started_ns, output.ended_ns,
                output.timeline, output.layers, prefix))

    def deliver(self, taken: list[tuple[EngineRequest, SampledToken, str]], output: StepOutput,
                members: list[EngineRequest], wake: Callable[[], None]) -> None:
        """Each generation's token (with its finish reason) to its sink, then telemetry. A sink
        that raises stops its own generation (`wake`: the core frees its slot at the next step).
        A sink with `put_plain` (the IPC door's) takes a plain token without a TokenEvent built.
        A prefill's tokens are first tokens, with their extras; the step says so, not the
        request's count, which the core may already have moved on by the time this runs."""
        forward_s, rows = output.forward_s, output.rows
        scores, cached = output.prompt_scores, output.cached_tokens
        for request, token, finish in taken:
            if request.cancelled:
                continue
            if finish:
                self.generations.pop(request.request_id, None)
            sink, first = request.output, output.first(request.request_id)
            try:
                if not first and hasattr(sink, "put_plain"):
                    sink.put_plain(token, finish, forward_s, rows)
                    continue
                queue_s = max((output.started_ns - request.arrived_ns) / 1e9, 0.0) if first else 0.0
                sink.put(TokenEvent(token, finish, queue_s, forward_s, rows, scores.get(request.request_id),
                                    cached.get(request.request_id, 0)))
            except Exception:  # a sink's failure is its own request's; the loop goes on
                log.exception("generation %d: its sink failed; stopping it", request.request_id)
                self.cancel(request.request_id)
                wake()
        if self.observer is not None:
            prefix = None
            if cached:  # prompts read to their end here, with the prefix cache on
                prefix = PrefixCacheUse(sum(len(r.prompt) for r in members if r.request_id in cached),
                                        sum(cached.values()))
            self._observe(self.observer.record_step, StepDone(
                output.kind, [r.trace for r in members], output.rows, output.tokens_in, output.forward_s,
                output.started_ns, output.ended_ns, prefix))

    def fail(self, requests: list[EngineRequest], error: Exception) -> None:
        """Each request that is still live is told `error`, once."""
        for request in requests:
            if request.new_tokens:
                if not request.cancelled and self.generations.pop(request.request_id, None) is not None:
                    request.output.fail(error)
            else:
                request.output.fail(error, request)

    def _observe(self, record: Callable, what) -> None:
        try:
            record(what)
        except Exception:  # telemetry must never fail a request or the loop
            log.exception("observer failed")
