"""Dynamic batching: an asyncio queue in front of the one worker thread that owns the model.

Requests wait in a bounded queue and run in the worker thread, so the event loop keeps serving
(health checks, new requests) during a forward pass. Requests whose caller has gone away are
dropped before they reach the model.

How long to wait for a batch to fill: the callers answered by the last batch are likely to
send again (closed-loop clients), so the next batch aims at what was queued when that batch
finished plus that many returns, waiting at most `max_batch_delay` for them. A lone client
thus never waits (its target is 1), while 64 clients settle into full batches of 64 instead of
two half-size groups that take turns. Callers that did not come back within the return window
(see `_return_window`) are not waited for: after a burst and a pause, a lone request runs at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from ..engine.engine import BatchOutput, OutOfMemory
from ..errors import (INTERNAL_MESSAGE, InvalidArgument, NonFiniteOutput, ResourceExhausted, ServeError, ShuttingDown,
                      Unavailable)
from ..protocol import NextTokenOutput, TraceContext
from ..telemetry.records import BatchDone, PrefixCacheUse
from .grouping import plan_batch

log = logging.getLogger(__name__)
STREAMING_WAIT_FACTOR = 3  # see Batcher._wait_until
STREAMING_WAIT_SHARE_OF_FORWARD = 0.5  # see Batcher._wait_until


class BatchEngine(Protocol):
    """What the batcher needs of an engine (engine.Engine; tests/support/fake_engine.FakeEngine)."""

    fixed_cost_tokens: float  # a forward's fixed cost in padded tokens (see scheduling.grouping)

    def next_token(self, prompts: Sequence[Sequence[int]], top_ks: Sequence[int],
                   traced_rows: Sequence[int] = (), mapped_rows: Sequence[int] = (),
                   last_row_rows: Sequence[int] = (), scored_rows: dict[int, int] | None = None) -> BatchOutput: ...

    def layer_reports(self, output: BatchOutput) -> BatchOutput: ...


class BatchObserver(Protocol):
    """Told about every batch (telemetry)."""

    def record_batch(self, record: BatchDone) -> None: ...


@dataclass
class _Pending:
    token_ids: list[int]
    top_k: int
    future: asyncio.Future
    trace: TraceContext | None = None  # handed to the observer; `layers_wanted` marks traced rows
    prompt_logprobs: int | None = None  # score every position too, with this many alternatives
    enqueued_at: float = field(default_factory=time.perf_counter)
    enqueued_ns: int = field(default_factory=time.time_ns)
    waiting: bool = True  # Counted in the queue depth until taken into a batch or abandoned.


def new_engine_thread() -> ThreadPoolExecutor:
    """The one thread that loads the model and runs every forward.

    Load and run in the same thread: libgomp keeps one OpenMP thread pool per calling thread,
    and a model loaded in one thread and run in another left two pools contending for the
    cores, which made each forward 30-50% slower on a 2-core machine (bf16 worst).
    """
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")


class EngineFailure(ServeError):
    """The forward pass for a batch raised; only that batch's requests see it."""


class Batcher:
    def __init__(self, engine: BatchEngine, *, max_batch_size: int, max_batch_delay_s: float, max_queue: int,
                 max_batch_tokens: int, engine_thread: ThreadPoolExecutor | None = None,
                 observer: BatchObserver | None = None):
        self.engine = engine
        self.observer = observer
        self.max_batch_size = max_batch_size
        self.max_batch_delay_s = max_batch_delay_s
        self.max_queue = max_queue
        self.max_batch_tokens = max_batch_tokens
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self._backlog: list[_Pending] = []  # Left over by length grouping; runs before newer arrivals.
        self._waiting = 0  # Live requests in queue + backlog (abandoned ones stop counting at once).
        self._running = 0  # Prompts in the forward pass under way.
        # Pass the thread that loaded the model: see `new_engine_thread()`.
        self._executor = engine_thread or new_engine_thread()
        self._task: asyncio.Task | None = None
        self.batches_run = 0
        self._expected_batch = 1  # Target size of the next batch (see module doc).
        self._last_forward_s = 0.0
        self._last_answered = 0.0  # loop time the last batch was answered

    @property
    def queue_depth(self) -> int:
        return self._waiting

    @property
    def running(self) -> int:
        """Prompts in the forward pass under way (a router's "requests running")."""
        return self._running

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        leftover = self._backlog
        while not self._queue.empty():
            leftover.append(self._queue.get_nowait())
        for pending in leftover:
            if not pending.future.done():
                pending.future.set_exception(ShuttingDown("server is shutting down"))
        self._executor.shutdown(wait=True)

    async def submit(self, prompts: Sequence[list[int]], top_k: int, trace: TraceContext | None = None,
                     prompt_logprobs: int | None = None) -> list[NextTokenOutput]:
        """Queue all prompts of one request together (or none of them) and await their answers."""
        if self._task is None or self._task.done():
            raise Unavailable("the model worker is not running")
        if len(prompts) > self.max_queue:  # no wait can serve it: the caller's mistake, not "busy"
            raise InvalidArgument(f"prompts: {len(prompts)} prompts can never fit a queue of {self.max_queue} "
                                  f"(--max-queue)")
        if self._waiting + len(prompts) > self.max_queue:
            raise ResourceExhausted(f"queue full ({self._waiting} of {self.max_queue} waiting); retry later")
        loop = asyncio.get_running_loop()
        pending = [_Pending(list(p), top_k, loop.create_future(), trace, prompt_logprobs) for p in prompts]
        for item in pending:
            item.future.add_done_callback(lambda _, item=item: self._stop_waiting(item))
            self._queue.put_nowait(item)
        self._waiting += len(pending)
        try:
            return await asyncio.gather(*(item.future for item in pending))
        except BaseException:
            for item in pending:  # Caller gone or one prompt failed: drop the rest.
                item.future.cancel()
            raise

    def _answer(self, batch: list[_Pending], output: BatchOutput, started: float, started_ns: int,
                needs_layers: bool) -> None:
        """Resolve the batch's futures; with needs_layers=False only those not waiting for layers."""
        for row, (item, top) in enumerate(zip(batch, output.top)):
            if row in output.failed_rows and not item.future.done():
                item.future.set_exception(NonFiniteOutput(
                    "the model's output for this prompt was not finite (a numerical overflow)"))
            if item.future.done() or (not needs_layers and item.trace is not None and item.trace.layers_in_response):
                continue
            item.future.set_result(NextTokenOutput(
                top, started - item.enqueued_at, output.forward_s, len(batch), item.enqueued_ns,
                started_ns, output.layers.get(row), output.walkthrough if row in output.layers else None,
                output.prompt_scores.get(row), output.cached_tokens[row] if output.cached_tokens else 0,
            ))

    def _fail(self, batch: list[_Pending], stage: str, exc: Exception, error: ServeError | None = None) -> None:
        """An exception in the engine fails the batch's unanswered requests, nothing else."""
        log.error("%s failed for a batch of %d", stage, len(batch), exc_info=exc)
        for item in batch:
            if not item.future.done():
                item.future.set_exception(error or EngineFailure(f"the {stage} failed; {INTERNAL_MESSAGE}"))

    def _observe(self, batch: list[_Pending], output: BatchOutput, started_ns: int) -> None:
        prefix = None
        if output.cached_tokens:  # the prefix cache is on
            prefix = PrefixCacheUse(sum(len(p.token_ids) for p in batch), sum(output.cached_tokens))
        try:
            self.observer.record_batch(BatchDone([p.trace for p in batch], output.padded_len, output.forward_s,
                                                 started_ns, output.ended_ns, output.timeline, output.layers, prefix))
        except Exception:  # Telemetry must never fail a request or the scheduler.
            log.exception("batch observer failed")

    def _wait_until(self, started: float, last_arrival: float) -> float:
        """`max_batch_delay` after the batch's first request; past that, keep waiting while the
        expected callers are still arriving (one within the last half delay), up to
        STREAMING_WAIT_FACTOR delays or half the last forward pass, whichever is longer.

        REST callers come back more slowly than gRPC ones: with a fixed 3 delays, 63 of 64
        often made it and the last one ran a batch alone, a rhythm that then repeats. Waiting
        a share of the forward time that a full batch saves keeps slow CPUs at full batches,
        while on a GPU (forwards of milliseconds) the cap stays at a few delays."""
        still_arriving = min(started + self._return_window(), last_arrival + self.max_batch_delay_s / 2)
        return max(started + self.max_batch_delay_s, still_arriving)

    def _return_window(self) -> float:
        """How long after their answers closed-loop callers may still be coming back."""
        return max(STREAMING_WAIT_FACTOR * self.max_batch_delay_s, STREAMING_WAIT_SHARE_OF_FORWARD * self._last_forward_s)

    def _stop_waiting(self, item: _Pending) -> None:
        if item.waiting:
            item.waiting = False
            self._waiting -= 1

    async def _run(self) -> None:
        while True:
            batch = await self._collect_batch(asyncio.get_running_loop())
            if batch:
                self._running = len(batch)
                try:
                    await self._run_batch(batch)
                finally:
                    self._running = 0

    async def _run_batch(self, batch: list[_Pending]) -> None:
        """Forward one batch and answer it. Out of device memory: run each half on its own."""
        loop = asyncio.get_running_loop()
        started, started_ns = time.perf_counter(), time.time_ns()
        traces = [p.trace for p in batch]
        traced_rows = [row for row, t in enumerate(traces) if t is not None and t.layers_wanted]
        mapped_rows = [row for row, t in enumerate(traces) if t is not None and t.attention_maps]
        last_row_rows = [row for row, t in enumerate(traces) if t is not None and t.last_row_maps]
        scored_rows = {row: p.prompt_logprobs for row, p in enumerate(batch) if p.prompt_logprobs is not None}
        try:
            output = await loop.run_in_executor(
                self._executor, self.engine.next_token, [p.token_ids for p in batch], [p.top_k for p in batch],
                traced_rows, mapped_rows, last_row_rows, scored_rows,
            )
        except OutOfMemory as exc:
            if len(batch) == 1:
                self._fail(batch, "forward pass", exc, ResourceExhausted(
                    f"the device is out of memory even for this prompt alone ({len(batch[0].token_ids)} tokens)"))
                return
            log.warning("out of memory for a batch of %d; retrying it as two halves", len(batch))
            half = len(batch) // 2
            for part in (batch[:half], batch[half:]):
                live = [p for p in part if not p.future.done()]  # Callers may have left meanwhile.
                if live:
                    await self._run_batch(live)
            return
        except Exception as exc:  # Fail this batch only; keep serving.
            self._fail(batch, "forward pass", exc)
            return
        self.batches_run += 1
        self._expected_batch = self._waiting + len(batch)
        self._last_forward_s = output.forward_s
        if output.probe is not None:
            # Per-layer reports cost extra (the logit lens): answer everyone who does not need
            # them in the response first, then build them in the engine thread.
            self._answer(batch, output, started, started_ns, needs_layers=False)
            try:
                output = await loop.run_in_executor(self._executor, self.engine.layer_reports, output)
            except Exception as exc:
                self._fail(batch, "per-layer reports", exc)
                return
        self._answer(batch, output, started, started_ns, needs_layers=True)
        self._last_answered = loop.time()
        if self.observer is not None:  # After the answers: spans are not on anyone's critical path.
            loop.call_soon(self._observe, batch, output, started_ns)
        # Let the answered handlers run (encode, send) before the next batch's wait starts:
        # its clock is for callers coming back, not for our own responses going out.
        await asyncio.sleep(0)

    async def _collect_batch(self, loop: asyncio.AbstractEventLoop) -> list[_Pending]:
        """Wait for candidates (see module doc), then run the length group of the oldest one."""
        candidates = self._backlog or [await self._queue.get()]
        started = last_arrival = loop.time()
        if started - self._last_answered > self._return_window():
            self._expected_batch = 1  # The last batch's callers did not come back: nothing to wait for.
        target = min(self.max_batch_size, max(self._expected_batch, self._waiting))
        while len(candidates) < target:
            if self._queue.empty():
                remaining = self._wait_until(started, last_arrival) - loop.time()
                if remaining <= 0:
                    break
                try:
                    candidates.append(await asyncio.wait_for(self._queue.get(), remaining))
                except TimeoutError:
                    break
                last_arrival = loop.time()
            else:
                candidates.append(self._queue.get_nowait())
        log.debug("batch: %d of target %d after %.1f ms (%d queued)", len(candidates), target,
                  (loop.time() - started) * 1000, self._queue.qsize())
        # Callers that cancelled (client gone, deadline passed) never reach the model.
        candidates = [item for item in candidates if not item.future.done()]
        if not candidates:
            self._backlog = []
            return []
        chosen = set(plan_batch(
            [len(item.token_ids) for item in candidates], 0, max_batch_size=self.max_batch_size,
            max_batch_tokens=self.max_batch_tokens, fixed_cost_tokens=self.engine.fixed_cost_tokens,
        ))
        batch = [item for i, item in enumerate(candidates) if i in chosen]
        self._backlog = [item for i, item in enumerate(candidates) if i not in chosen]
        for item in batch:
            self._stop_waiting(item)
        return batch
