"""The engine core: one plain loop, in the engine's own thread, that runs every step.

    callers' loop or IPC thread                  engine thread (EngineCore._run)
    submit() / add() / abort() ── intake ──────> Scheduler.schedule() -> Step -> StepRunner.run:
                                                   free leaving slots, prefill admitted generations,
                                                   decode running ones (overlapped with the device
                                                   on cuda) with next-token prompts and a long
                                                   prompt's next chunk riding the same forward
                                                   (engine.step_forward), forward the others
    answers, token events, telemetry  <───────── handed over in order, one wake-up at a time

A next-token prompt that arrives while generations run is answered from their next decode step
where it can ride it: untraced (scored or not), within the step's token budget, and on a device whose
decode steps are not CUDA graphs (Generator.takes_riders); the prefix cache is read and filled
for it as for any prompt.

The loop never runs on the callers' event loop: while a forward runs, that loop (or, in the
engine process, the IPC thread: ipc.engine_server) decodes and encodes messages (vLLM v1's busy
loop beside its IO threads). Refusals (queue full, a prompt that
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

from ..engine.kv_cache import BLOCK, blocks_for
from ..engine.lora_registry import LoraRegistry
from ..engine.padding import CPU_FORWARD_TOKENS
from ..errors import InvalidArgument, ResourceExhausted, ShuttingDown, Unavailable
from ..protocol import GenerateRequest, NextTokenOutput, StepControls, TokenSink, TraceContext
from .engine_api import ModelRunner
from .outputs import Handover, Observer, Outputs, PromptGroup
from .runner import StepRunner
from .scheduler import EngineRequest, Scheduler, Step, next_token_request

log = logging.getLogger(__name__)


def new_engine_thread() -> ThreadPoolExecutor:
    """The one thread that loads the model and then runs the core's loop (see the module doc)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")


class EngineCore:
    def __init__(self, generator: ModelRunner, *, max_batch_size: int,
                 max_batch_delay_s: float, max_queue: int, max_batch_tokens: int, max_queue_wait_s: float = 60.0,
                 eos_token_id: int | None = None, engine_thread: ThreadPoolExecutor | None = None,
                 observer: Observer | None = None, overlap: bool | None = None,
                 adapters: LoraRegistry | None = None, max_loras: int | None = None):
        """overlap: launch each decode step, and each plain next-token batch, before reading the
        last one's answers (default: where the device runs on by itself, cuda); on a CPU the
        launch is the whole step, so it only makes each token a step later (tests force it on
        there). adapters: the LoRA adapters requests may name (engine.lora); None: none. max_loras:
        distinct adapters one step may hold (scheduling.scheduler.Scheduler)."""
        self.generator, self.adapters = generator, adapters or LoraRegistry.empty()
        self.outputs = Outputs(observer)  # the callers' side: answers, on their loop
        self.max_batch_size, self.max_queue, self.max_queue_wait_s = max_batch_size, max_queue, max_queue_wait_s
        self.slots, self.capacity_blocks, self.n_ctx = generator.slots, generator.capacity_blocks, generator.n_ctx
        step_tokens = min(max_batch_tokens, CPU_FORWARD_TOKENS)  # the rows of a step that packs prompts with decodes
        self.scheduler = Scheduler(slots=self.slots, capacity_blocks=self.capacity_blocks, n_ctx=self.n_ctx,
                                   max_batch_size=max_batch_size, max_batch_tokens=max_batch_tokens,
                                   max_batch_delay_s=max_batch_delay_s, fixed_cost_tokens=generator.fixed_cost_tokens,
                                   step_tokens=step_tokens if generator.takes_riders else None,
                                   uncached=generator.uncached_tokens, max_loras=max_loras)
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
        self._post = Handover()  # fn(*args) on the callers' loop, from this core's thread
        self.runner = StepRunner(
            generator, self.scheduler, self.outputs, self._post,
            overlap=generator.overlaps if overlap is None else overlap,
            step_tokens=step_tokens,
            eos_token_id=eos_token_id, prompts_started=self._prompts_started, wake=self._wake.set)

    @property  # what telemetry reads, from here to cache_usage
    def queue_depth(self) -> int:
        """Next-token prompts waiting for a forward."""
        return self._prompts_waiting

    @property
    def prompts_running(self) -> int:
        """Next-token prompts in the forward under way."""
        return self.runner.prompts_running

    @property
    def batches_run(self) -> int:
        return self.runner.batches_run

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

    def update_adapter(self, name: str, path: str | None) -> list[str]:
        """Load the LoRA adapter at `path` as `name`, or unload it (None); the adapters served after.
        Any thread but a caller's event loop (a load reads its files): requests hold their adapter,
        so one unloaded while they run finishes them, and the loop never waits for a load."""
        if path is None:
            self.adapters.unload(name)
            log.info("LoRA adapter %r unloaded", name)
        else:
            adapter = self.adapters.load(name, path)
            log.info("loaded %s", adapter)
        return self.adapters.names

    def adapters_in_use(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The LoRA adapters of the generations running, and of the requests waiting, by name."""
        if not self.adapters.names:
            return (), ()
        running = {r.adapter.name for r in list(self.scheduler.running.values()) if r.adapter is not None}
        with self._lock:
            arriving = list(self._intake)
        waiting = {r.adapter.name for r in arriving + list(self.scheduler.waiting) + list(self.scheduler.prompts)
                   if r.adapter is not None and not r.cancelled}
        return tuple(sorted(running)), tuple(sorted(waiting))

    # The callers' side (their event loop's thread) ------------------------------------------------
    def start(self) -> None:
        self._loop = self._post.loop = asyncio.get_running_loop()
        self._task = self._loop.run_in_executor(self._executor, self._run)

    def hand_outputs_to(self, loop) -> None:
        """Answers and token events go to `loop` (its call_soon_threadsafe) instead of the loop
        that started the core: the engine process's IPC thread (ipc.engine_server), so they
        never wait on an event loop."""
        self._post.loop = loop

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
                     prompt_logprobs: int | None = None, controls: StepControls | None = None,
                     adapter: str | None = None) -> list[NextTokenOutput]:
        """Queue all prompts of one request together (or none of them) and await their answers."""
        answered = self._loop.create_future()

        def done(result) -> None:
            if not answered.done():
                answered.set_exception(result) if isinstance(result, BaseException) else answered.set_result(result)

        group = self.queue_prompts(prompts, top_k, trace, prompt_logprobs, done, controls=controls, adapter=adapter)
        try:
            return await answered
        except asyncio.CancelledError:
            self.cancel_prompts(group)  # the caller left: its prompts leave the queue
            raise

    def queue_prompts(self, prompts: Sequence[list[int]], top_k: int, trace: TraceContext | None,
                      prompt_logprobs: int | None, done: Callable, wake: bool = True,
                      controls: StepControls | None = None, adapter: str | None = None) -> PromptGroup:
        """Queue all prompts of one request together, or none of them (refusals raise here).
        `done` is called once on the callers' loop: with every prompt's answer, in order, or
        with the error that ended the request (its other prompts then leave the queue).
        wake=False: the caller calls wake() once after a run of requests (the IPC door, after
        each frame), so the loop does not wake, and take the GIL, for each one. `adapter`: a
        loaded LoRA adapter's name (NotFound otherwise), or None for the base."""
        self._check_running("model worker")
        lora = self.adapters.resolve(adapter)
        if len(prompts) > self.max_queue:  # no wait can serve it: the caller's mistake, not "busy"
            raise InvalidArgument(f"prompts: {len(prompts)} prompts can never fit a queue of {self.max_queue} "
                                  f"(--max-queue)")

        group = PromptGroup(len(prompts), done, self.cancel_prompts)
        now, now_ns = time.perf_counter(), time.time_ns()
        group.requests = requests = [
            next_token_request(list(p), top_k, group, row, -1, now, now_ns, trace, prompt_logprobs, controls, lora)
            for row, p in enumerate(prompts)]
        with self._lock:
            if self._prompts_waiting + len(prompts) > self.max_queue:
                raise self._queue_full(self._prompts_waiting)
            self._prompts_waiting += len(prompts)
            self._intake += requests
        if wake:
            self._wake.set()
        return group

    def queue_calls(self, prompts: Sequence[list[int]], top_ks: Sequence[int], call_ids: Sequence[int],
                    output) -> tuple[list[EngineRequest], Exception | None]:
        """One-prompt calls (the IPC door's Prompts message), each answered alone through
        `output`, which all of them share (`answers_top`: answer_tops() and fail(error, request);
        each request's request_id is its call's id), under one lock and one clock read: the first
        n are queued while the queue has room. Returns their requests and the error for the
        others (queue full), or None. Not running: raises, none queued. The caller wakes the
        core (as queue_prompts(wake=False))."""
        self._check_running("model worker")
        now, now_ns = time.perf_counter(), time.time_ns()
        with self._lock:
            waiting = self._prompts_waiting
            n = min(max(self.max_queue - waiting, 0), len(prompts))
            requests = list(map(next_token_request, prompts[:n], top_ks[:n], itertools.repeat(output, n),
                                itertools.repeat(0, n), call_ids[:n], itertools.repeat(now, n),
                                itertools.repeat(now_ns, n)))
            self._prompts_waiting += n
            self._intake += requests
        if n == len(prompts):
            return requests, None
        return requests, self._queue_full(waiting)

    def _queue_full(self, waiting: int) -> ResourceExhausted:
        return ResourceExhausted(f"queue full ({waiting} of {self.max_queue} waiting); retry later")

    def wake(self) -> None:
        """The loop looks at what arrived (after queue_prompts(wake=False) or add(wake=False))."""
        self._wake.set()

    def cancel_prompts(self, group: PromptGroup) -> None:
        """The request's caller left (or one of its prompts failed): its prompts leave the queue,
        and `done` hears nothing more."""
        self.cancel_requests(group.requests)
        group.release()

    def cancel_requests(self, requests: Sequence[EngineRequest]) -> None:
        """These prompts leave the queue (a forward that has them drops their answers)."""
        with self._lock:  # in step with _prompt_step's count: each prompt stops waiting once
            for request in requests:
                if not request.cancelled and request.state == "waiting":
                    self._prompts_waiting -= 1
                request.cancelled = True

    def add(self, request: GenerateRequest, sink: TokenSink, wake: bool = True) -> int:
        """Queue a generation; its tokens go to `sink` as they come. Returns its id, for abort().
        Refusals raise here: the loop is not running, or the queue is full. wake: as for
        queue_prompts."""
        self._check_running("generation loop")
        lora = self.adapters.resolve(request.adapter)
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
            expires_at=time.perf_counter() + max(wait_s, 0.0), output=sink, request_id=next(self._ids), adapter=lora)
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
        self.runner.finish_in_flight()
        self.runner.finish_prompts_in_flight()

    def _prompts_started(self, batch: list[EngineRequest]) -> None:
        """The runner took these prompts into a forward: they stop counting as waiting."""
        with self._lock:
            for r in batch:
                if not r.cancelled:  # a cancelled one stopped counting when it was cancelled
                    self._prompts_waiting -= 1
                r.state = "running"

    def _iteration(self) -> None:
        self._wake.clear()  # before the intake is read: a later arrival sets it again
        with self._lock:
            arrived, self._intake = self._intake, []
        self.scheduler.add(arrived)
        now = time.perf_counter()
        for request in self.scheduler.expired(now):
            self.runner.fail([request], ResourceExhausted(
                f"no room in the KV cache came free within the deadline ({len(self.scheduler.running)} of "
                f"{self.slots} sequences, {self.cache_usage:.0%} of its blocks in use, "
                f"{len(self.scheduler.waiting)} waiting); retry later"))
        if self.runner.last_tokens_in_flight():
            self.runner.finish_in_flight()
        chunk = self.generator.next_chunk
        step = self.scheduler.schedule(now, chunk[1] if chunk is not None else 0)
        if not isinstance(step, Step):
            if self.runner.prompts_in_flight is not None:  # nothing to launch behind it: its callers wait
                self.runner.finish_prompts_in_flight()
                return
            if self.runner.in_flight is not None:  # its answers may change what comes next
                self.runner.finish_in_flight()
                return
            wake = min(step if step is not None else math.inf, self.scheduler.next_deadline())
            self._wake.wait(None if wake == math.inf else max(wake - time.perf_counter(), 0.0))
            return
        self.runner.run(step)
