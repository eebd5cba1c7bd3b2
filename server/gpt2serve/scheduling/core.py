"""The engine core: one plain loop, in the engine's own thread, that runs every step.

    caller's event loop                          engine thread (EngineCore._run)
    submit() / add() / abort() ── intake ──────> Scheduler.schedule() -> step: free leaving slots,
                                                   prefill admitted generations, decode running
                                                   ones with next-token prompts riding the same
                                                   forward (engine.riders), forward the others
    answers, token events, telemetry  <───────── handed over in order, one wake-up at a time

A next-token prompt that arrives while generations run is answered from their next decode step
where it can ride it: untraced, unscored, nothing for the prefix cache, within the step's token
budget, and on a device whose decode steps are not CUDA graphs (Generator.can_ride).

The loop never runs on the callers' event loop: while a forward runs, that loop decodes and
encodes messages (vLLM v1's busy loop beside its IO threads). Refusals (queue full, a prompt that
can never fit) raise in the caller's thread at once; everything else the loop does, and its
answers reach callers on their own loop: futures resolved, sinks told. Outputs of a caller that
left are dropped there.

The loop runs in the thread that loaded the model: libgomp keeps an OpenMP pool per calling
thread, and a model loaded in one thread and run in another left two pools contending for the
cores (each forward 30-50% slower on a 2-core machine).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

from ..engine.engine import BatchOutput, OutOfMemory
from ..engine.generator import NewSequence, StepOutput
from ..engine.kv_cache import BLOCK, blocks_for
from ..engine.padding import CPU_FORWARD_TOKENS
from ..errors import (INTERNAL_MESSAGE, InvalidArgument, NonFiniteOutput, ResourceExhausted, ServeError,
                      ShuttingDown, Unavailable)
from ..protocol import GenerateRequest, NextTokenOutput, TokenSink, TraceContext
from .engine_api import GenerationEngine, PromptEngine
from .outputs import Handover, Observer, Outputs, PromptGroup
from .scheduler import EngineRequest, Scheduler, Step

log = logging.getLogger(__name__)


def new_engine_thread() -> ThreadPoolExecutor:
    """The one thread that loads the model and then runs the core's loop (see the module doc)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")


class EngineFailure(ServeError):
    """A forward raised; only the requests of that forward see it."""


class EngineCore:
    def __init__(self, engine: PromptEngine, generator: GenerationEngine | None, *, max_batch_size: int,
                 max_batch_delay_s: float, max_queue: int, max_batch_tokens: int, max_queue_wait_s: float = 60.0,
                 eos_token_id: int | None = None, engine_thread: ThreadPoolExecutor | None = None,
                 observer: Observer | None = None):
        self.engine, self.generator = engine, generator
        self.outputs = Outputs(observer)  # the callers' side: answers, on their loop
        self.max_batch_size, self.max_queue, self.max_queue_wait_s = max_batch_size, max_queue, max_queue_wait_s
        self.rider_tokens = min(max_batch_tokens, CPU_FORWARD_TOKENS)  # prompt tokens that may ride one decode step
        self.eos_token_id = eos_token_id
        self.slots = generator.slots if generator is not None else 0
        self.capacity_blocks = generator.capacity_blocks if generator is not None else 0
        self.n_ctx = generator.n_ctx if generator is not None else 1024
        self.scheduler = Scheduler(slots=self.slots, capacity_blocks=self.capacity_blocks, n_ctx=self.n_ctx,
                                   max_batch_size=max_batch_size, max_batch_tokens=max_batch_tokens,
                                   max_batch_delay_s=max_batch_delay_s, fixed_cost_tokens=engine.fixed_cost_tokens)
        self._executor = engine_thread or new_engine_thread()
        self._intake: list[EngineRequest] = []
        self._lock = threading.Lock()  # the intake and the waiting counts, shared with the callers' thread
        self._wake = threading.Event()
        self._prompts_waiting = 0
        self._ids = itertools.count()
        self._seeds = random.Random()
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Future | None = None
        self.prompts_running = 0  # next-token prompts in the forward under way
        self._post = Handover()  # fn(*args) on the callers' loop, from this core's thread
        self.steps_run = 0
        self.batches_run = 0

    @property  # what telemetry reads, from here to cache_usage
    def queue_depth(self) -> int:
        """Next-token prompts waiting for a forward."""
        return self._prompts_waiting

    @property
    def running(self) -> int:
        """Generations holding a slot (a caller that left stops counting at once)."""
        return len(self.scheduler.staying())

    @property
    def waiting(self) -> int:
        """Generations waiting for a KV-cache slot."""
        with self._lock:
            arriving = [r for r in self._intake if r.new_tokens]
        return sum(r.state == "waiting" and not r.cancelled for r in arriving + list(self.scheduler.waiting))

    @property
    def cache_usage(self) -> float:
        """Share of the KV cache's blocks held by live generations, each at the longest it may grow."""
        if not self.capacity_blocks:
            return 0.0
        return self.scheduler.blocks(self.scheduler.staying()) / self.capacity_blocks

    # The callers' side (their event loop's thread) ------------------------------------------------
    def start(self) -> None:
        self._loop = self._post.loop = asyncio.get_running_loop()
        self._task = self._loop.run_in_executor(self._executor, self._run)

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        with self._lock:
            left, self._intake = self._intake, []
        left += list(self.scheduler.prompts) + self.scheduler.waiting + list(self.scheduler.running.values())
        self.outputs.fail(left, ShuttingDown("server is shutting down"))
        self._executor.shutdown(wait=True)

    def _check_running(self, what: str) -> None:
        if self._task is None or self._task.done() or self._stopping:
            raise Unavailable(f"the {what} is not running")

    async def submit(self, prompts: Sequence[list[int]], top_k: int, trace: TraceContext | None = None,
                     prompt_logprobs: int | None = None) -> list[NextTokenOutput]:
        """Queue all prompts of one request together (or none of them) and await their answers."""
        answered = self._loop.create_future()

        def done(result) -> None:
            if not answered.done():
                answered.set_exception(result) if isinstance(result, BaseException) else answered.set_result(result)

        group = self.queue_prompts(prompts, top_k, trace, prompt_logprobs, done)
        try:
            return await answered
        except asyncio.CancelledError:
            self.cancel_prompts(group)  # the caller left: its prompts leave the queue
            raise

    def queue_prompts(self, prompts: Sequence[list[int]], top_k: int, trace: TraceContext | None,
                      prompt_logprobs: int | None, done: Callable, wake: bool = True) -> PromptGroup:
        """Queue all prompts of one request together, or none of them (refusals raise here).
        `done` is called once on the callers' loop: with every prompt's answer, in order, or
        with the error that ended the request (its other prompts then leave the queue).
        wake=False: the caller calls wake() once after a run of requests (the IPC door, after
        each frame), so the loop does not wake, and take the GIL, for each one."""
        self._check_running("model worker")
        if len(prompts) > self.max_queue:  # no wait can serve it: the caller's mistake, not "busy"
            raise InvalidArgument(f"prompts: {len(prompts)} prompts can never fit a queue of {self.max_queue} "
                                  f"(--max-queue)")

        group = PromptGroup(len(prompts), done, self.cancel_prompts)
        group.requests = requests = [
            EngineRequest(list(p), 0, top_k, trace=trace, prompt_logprobs=prompt_logprobs, output=group, row=row)
            for row, p in enumerate(prompts)]
        with self._lock:
            if self._prompts_waiting + len(prompts) > self.max_queue:
                raise ResourceExhausted(f"queue full ({self._prompts_waiting} of {self.max_queue} waiting); retry later")
            self._prompts_waiting += len(prompts)
            self._intake += requests
        if wake:
            self._wake.set()
        return group

    def wake(self) -> None:
        """The loop looks at what arrived (after queue_prompts(wake=False) or add(wake=False))."""
        self._wake.set()

    def cancel_prompts(self, group: PromptGroup) -> None:
        """The request's caller left (or one of its prompts failed): its prompts leave the queue,
        and `done` hears nothing more."""
        with self._lock:  # in step with _prompt_step's count: each prompt stops waiting once
            for request in group.requests:
                if not request.cancelled and request.state == "waiting":
                    self._prompts_waiting -= 1
                request.cancelled = True
        group.release()

    def add(self, request: GenerateRequest, sink: TokenSink, wake: bool = True) -> int:
        """Queue a generation; its tokens go to `sink` as they come. Returns its id, for abort().
        Refusals raise here: the loop is not running, or the queue is full. wake: as for
        queue_prompts."""
        self._check_running("generation loop")
        longest = min(len(request.prompt) + request.max_tokens, self.n_ctx)
        if blocks_for(longest) > self.capacity_blocks:
            raise InvalidArgument(f"the prompt plus max_tokens needs {longest} tokens of KV cache, and it holds "
                                  f"{self.capacity_blocks * BLOCK} (--kv-cache-mb); lower max_tokens")
        waiting = self.waiting
        if waiting >= self.max_queue:
            raise ResourceExhausted(f"queue full ({waiting} sequences waiting for the KV cache, "
                                    f"--max-queue {self.max_queue}); retry later")
        wait_s = self.max_queue_wait_s
        if request.deadline is not None:
            wait_s = min(wait_s, request.deadline - time.monotonic())
        seed = request.seed if request.seed is not None else self._seeds.getrandbits(63)
        engine_request = EngineRequest(
            request.prompt, request.max_tokens, params=request.params, prompt_logprobs=request.prompt_logprobs,
            trace=request.trace, seed=seed, stop_token_ids=request.stop_token_ids, ignore_eos=request.ignore_eos,
            expires_at=time.perf_counter() + max(wait_s, 0.0), output=sink, request_id=next(self._ids))
        self.outputs.generations[engine_request.request_id] = engine_request
        with self._lock:
            self._intake.append(engine_request)
        if wake:
            self._wake.set()
        return engine_request.request_id

    def abort(self, seq_id: int) -> None:
        """The caller left (hung up, or found a stop string): the generation leaves the queue, or
        frees its cache slot at the next step. Its sink hears nothing more."""
        if self.outputs.cancel(seq_id) is not None:
            self._wake.set()

    # The loop (the engine thread) ------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            try:
                self._iteration()
            except Exception:  # a bug in the loop itself: log it, keep serving
                log.exception("engine core: a step failed")

    def _iteration(self) -> None:
        self._wake.clear()  # before the intake is read: a later arrival sets it again
        with self._lock:
            arrived, self._intake = self._intake, []
        for request in arrived:
            self.scheduler.add(request)
        now = time.perf_counter()
        for request in self.scheduler.expired(now):
            self._fail([request], ResourceExhausted(f"no room in the KV cache came free within the deadline ("
                f"{len(self.scheduler.running)} of {self.slots} sequences, {self.cache_usage:.0%} of its blocks in "
                f"use, {len(self.scheduler.waiting)} waiting); retry later"))
        step = self.scheduler.schedule(now)
        if not isinstance(step, Step):
            wake = min(step if step is not None else math.inf, self.scheduler.next_deadline())
            self._wake.wait(None if wake == math.inf else max(wake - time.perf_counter(), 0.0))
            return
        if step.leaving and self.generator is not None:
            self.generator.remove({r.request_id for r in step.leaving})
        if step.admitted:
            self._generation_step("prefill", step.admitted)
        riders, prompts = self._riders(step.prompts) if step.decode else ([], step.prompts)
        if prompts:
            self._prompt_step(prompts)
        if step.decode:
            leaving = self.scheduler.take_leaving()
            if leaving:  # finished at their first token: out before the decode
                self.generator.remove({r.request_id for r in leaving})
            members = self.scheduler.staying()
            if members:
                self._generation_step("decode", members, riders)
                riders = []
        if riders:  # nobody left to decode: they take their own forward
            self._prompt_step(riders)

    def _riders(self, prompts: list[EngineRequest]) -> tuple[list[EngineRequest], list[EngineRequest]]:
        """(the prompts that ride this step's decode, the rest)."""
        riders, rest, tokens = [], [], 0
        for r in prompts:
            plain = (r.trace is None or not r.trace.layers_wanted) and r.prompt_logprobs is None
            if plain and tokens + len(r.prompt) <= self.rider_tokens and self.generator.can_ride(r.prompt):
                riders.append(r)
                tokens += len(r.prompt)
            else:
                rest.append(r)
        return riders, rest

    # Next-token prompts ---------------------------------------------------------------------------
    def _prompts_start(self, batch: list[EngineRequest]) -> None:
        with self._lock:
            for r in batch:
                if not r.cancelled:  # a cancelled one stopped counting when it was cancelled
                    self._prompts_waiting -= 1
                r.state = "running"
        self.prompts_running = len(batch)

    def _prompt_step(self, batch: list[EngineRequest]) -> None:
        log.debug("batch: %d prompts in their own forward (%d queued)", len(batch), self._prompts_waiting)
        self._prompts_start(batch)
        try:
            self._forward_prompts(batch)
        finally:
            self.prompts_running = 0

    def _forward_prompts(self, batch: list[EngineRequest]) -> None:
        """Forward one batch and answer it. Out of device memory: each half on its own."""
        started, started_ns = time.perf_counter(), time.time_ns()
        traces = [r.trace for r in batch]
        traced_rows = [row for row, t in enumerate(traces) if t is not None and t.layers_wanted]
        mapped_rows = [row for row, t in enumerate(traces) if t is not None and t.attention_maps]
        last_row_rows = [row for row, t in enumerate(traces) if t is not None and t.last_row_maps]
        scored_rows = {row: r.prompt_logprobs for row, r in enumerate(batch) if r.prompt_logprobs is not None}
        try:
            output = self.engine.next_token([r.prompt for r in batch], [r.top_k for r in batch], traced_rows,
                                            mapped_rows, last_row_rows, scored_rows)
        except OutOfMemory as exc:
            if len(batch) == 1:
                self._fail(batch, ResourceExhausted(f"the device is out of memory even for this prompt alone "
                                                    f"({len(batch[0].prompt)} tokens)"), exc)
                return
            log.warning("out of memory for a batch of %d; retrying it as two halves", len(batch))
            half = len(batch) // 2
            for part in (batch[:half], batch[half:]):
                live = [r for r in part if not r.cancelled]  # callers may have left meanwhile
                if live:
                    self._forward_prompts(live)
            return
        except Exception as exc:  # fail this batch only; keep serving
            self._fail(batch, EngineFailure(f"the forward pass failed; {INTERNAL_MESSAGE}"), exc, "forward pass")
            return
        self.batches_run += 1
        self.scheduler.prompts_answered(len(batch), output.forward_s)
        if output.probe is not None:
            # Per-layer reports cost extra (the logit lens): answer everyone who does not need
            # them in the response first, then build them.
            self._post(self.outputs.answer_prompts, batch, output, started, started_ns, False)
            try:
                output = self.engine.layer_reports(output)
            except Exception as exc:
                self._fail(batch, EngineFailure(f"the per-layer reports failed; {INTERNAL_MESSAGE}"), exc,
                           "per-layer reports")
                return
        self._answered(batch)
        self._post(self.outputs.answer_prompts, batch, output, started, started_ns, True)

    # Generations ------------------------------------------------------------------------------------
    def _generation_step(self, kind: str, members: list[EngineRequest], riders: list[EngineRequest] = ()) -> None:
        started = time.perf_counter()
        if riders:
            log.debug("batch: %d prompts riding a decode step of %d (%d queued)", len(riders), len(members),
                      self._prompts_waiting)
            self._prompts_start(riders)
        try:
            if kind == "prefill":
                output = self.generator.prefill([NewSequence(r.request_id, r.prompt, r.params, r.seed, r.prompt_logprobs)
                                                 for r in members])
            elif riders:
                output = self.generator.decode([r.prompt for r in riders], [r.top_k for r in riders])
            else:
                output = self.generator.decode()
        except OutOfMemory as exc:
            log.error("%s step: out of device memory for %d sequences: %s", kind, len(members), exc)
            self._fail(members, ResourceExhausted(f"the device ran out of memory in a {kind} step of "
                                                  f"{len(members)} sequences; retry later"))
            if riders:  # not theirs to fail: their own forward
                self._forward_prompts(riders)
            return
        except Exception as exc:  # fail the sequences of this step, keep serving the rest
            self._fail(members + list(riders), ServeError(f"the {kind} step failed; {INTERNAL_MESSAGE}"), exc,
                       f"{kind} step")
            return
        finally:
            self.prompts_running = 0
        self.steps_run += 1
        if riders:
            self.batches_run += 1
            self.scheduler.prompts_answered(len(riders), output.forward_s)
            self._answered(riders)
            self._post(self.outputs.answer_prompts, riders, BatchOutput(
                output.rider_tops, output.forward_s, max(len(r.prompt) for r in riders), output.started_ns,
                output.ended_ns, failed_rows=output.rider_failed), started, output.started_ns, True)
        tokens, eos, taken = output.tokens, self.eos_token_id, []
        for request in members:
            token = tokens.get(request.request_id)
            if token is not None and request.state == "running":
                taken.append((request, token, request.took(token.token_id, eos)))
        if output.failed:
            log.error("%s step: %d of %d sequences had non-finite logits; failing them alone",
                      kind, len(output.failed), len(members))
            self._fail([r for r in members if r.request_id in output.failed], NonFiniteOutput(
                "the model's output for this sequence was not finite (a numerical overflow); it was stopped"))
        self._post(self.outputs.deliver, taken, output, members, self._wake.set)

    # Failures and the way back to the callers ------------------------------------------------------
    def _fail(self, requests: list[EngineRequest], error: ServeError, exc: Exception | None = None,
              stage: str = "") -> None:
        """These requests end with `error` (told on the callers' loop); generations leave their slots."""
        if exc is not None:
            log.error("%s failed for a batch of %d", stage, len(requests), exc_info=exc)
        for request in requests:
            request.state = "done"
        self._answered([r for r in requests if not r.new_tokens])
        self._post(self.outputs.fail, requests, error)

    def _answered(self, prompts: list[EngineRequest]) -> None:
        """Out of the running count before their callers hear: a caller that looks next sees it."""
        self.prompts_running = max(self.prompts_running - len(prompts), 0)
