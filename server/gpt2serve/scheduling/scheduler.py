"""One scheduler for every request: what the engine's next step does.

Every request is a prompt and a number of new tokens (`EngineRequest`): 0 for next-token and
scoring prompts, answered from their prompt's forward; more for generations, which then hold a
KV-cache slot and take a token each step until they finish. Each step (`Step`) is:

    leaving   generations that finished or were cancelled: their slots come free first
    chunk     tokens of the next chunk of a long prompt read in chunks (engine.chunked_prefill)
    admitted  waiting generations, oldest first, while slots, the cache's blocks and the step's
              token budget last; each one's prefill gives its first token. A generation counts
              at the longest it may grow (prompt + max_tokens), so one admitted never runs out
              of cache (engine.kv_cache: blocks_needed)
    prompts   waiting next-token prompts: the length group (scheduling.grouping) of the oldest,
              at most --max-batch-size
    decode    one token for every running generation

One token budget a step, in vLLM v1's order, where prompts share the decode step's forward
(`step_tokens`; not where steps replay CUDA graphs): the running generations' decode rows (one
token each) first, then the chunk (at least SMALLEST_CHUNK tokens, so a long prompt always
moves on), then admitted prompts, whole, while they fit (each counts what it computes, past
the blocks the prefix cache holds); next-token prompts ride with what is left
(scheduling.runner). So a wave of prompts arriving while generations run is read over a few
steps, each bounded, and the running streams take a token between them: read in one prefill of
its own, it stalled them for the whole wave (docs/benchmarks.md, "One token budget a step").
With nothing running, admission fills a prefill of its own up to --max-batch-tokens, as it does
where steps do not pack prompts; the oldest waiting prompt is always admitted when no chunk is
read, so one longer than the budget is not stuck (it is read whole or in chunks).

Only the core's thread calls it (scheduling.core), so it holds no lock.

When to run prompts: with generations running, at once (they ride the next step; there is no
idle device to wait for). With nothing else to do, the batch aims at what was queued when the
last batch finished plus that many returns, waiting at most --max-batch-delay-ms for them: the
callers answered by the last batch are likely to send again (closed-loop clients). A lone client
thus never waits (its target is 1), while 64 clients settle into full batches of 64 instead of
two half-size groups that take turns. Callers that did not come back within the return window
are not waited for: after a burst and a pause, a lone request runs at once. REST callers come
back more slowly than gRPC ones: with a fixed 3 delays, 63 of 64 often made it and the last one
ran a batch alone, a rhythm that then repeats; so while callers are still arriving the wait
stretches to STREAMING_WAIT_FACTOR delays or half the last forward, whichever is longer.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from ..protocol import SamplingParams, StepControls, TraceContext
from .grouping import plan_batch
from ..engine.kv_cache import blocks_needed
from ..engine.steps import traced

STREAMING_WAIT_FACTOR = 3
STREAMING_WAIT_SHARE_OF_FORWARD = 0.5
SMALLEST_CHUNK = 16  # tokens a step's chunk reads at least, however many decode rows share the step


@dataclass(eq=False, slots=True)  # one per prompt: slots make it cheaper to make and read
class EngineRequest:
    """One prompt as the engine core sees it. `new_tokens` 0: a next-token (or scoring) prompt,
    answered with its `top_k` alternatives from its prompt's forward; more: a generation."""

    prompt: list[int]
    new_tokens: int = 0
    top_k: int = 1
    params: SamplingParams = SamplingParams()  # frozen: one shared default (prompts take none)
    prompt_logprobs: int | None = None  # score every prompt position too, with this many alternatives
    trace: TraceContext | None = None
    controls: StepControls | None = None  # a traced generation step's (service.step_trace)
    adapter: Any = None  # its LoRA adapter (engine.lora.LoraAdapter); None: the base model
    seed: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    expires_at: float = math.inf  # perf_counter: a generation still waiting then is refused
    output: Any = None  # where answers go, on the caller's event loop: a PromptGroup, a TokenSink, or the
    # IPC door's plain calls of a front end (ipc.engine_answers.PlainCalls)
    request_id: int = -1  # a generation's: its KV-cache row's sequence id; a plain call's: its id at its front end
    row: int = 0  # a next-token prompt's place in its request (PromptGroup)
    arrived: float = field(default_factory=time.perf_counter)
    arrived_ns: int = field(default_factory=time.time_ns)
    state: str = "waiting"  # -> running (a generation in its slot) -> done
    generated: int = 0
    # Set from the caller's thread when it leaves; the core acts on it at its next step, and its
    # output hears nothing more from then on.
    cancelled: bool = False

    def took(self, token_id: int, eos_token_id: int | None) -> str:
        """Count a generated token; its finish reason ("" while the generation goes on). A
        finished generation is done: its slot comes free at the next step."""
        self.generated += 1
        if token_id == eos_token_id and not self.ignore_eos:
            finish = "eos"
        elif token_id in self.stop_token_ids:
            finish = "stop"
        elif self.generated >= self.new_tokens:
            finish = "length"
        else:
            return ""
        self.state = "done"
        return finish

    @property
    def rides(self) -> bool:
        """A prompt that may be a row of a decode step's forward (engine.step_forward): its top-k,
        or a generation's first token, and its scores; not a layer trace or a traced step's controls."""
        return not traced(self)

    @property
    def longest(self) -> int:
        """Positions a generation may hold: its prompt and all its new tokens."""
        return len(self.prompt) + self.new_tokens


_DEFAULT_PARAMS, _NO_STOPS = SamplingParams(), frozenset()


def next_token_request(prompt: list[int], top_k: int, output: Any, row: int, call_id: int, arrived: float,
                       arrived_ns: int, trace: TraceContext | None = None, prompt_logprobs: int | None = None,
                       controls: StepControls | None = None, adapter: Any = None) -> EngineRequest:
    """The EngineRequest of a next-token prompt (EngineCore.queue_prompts, queue_calls), every
    slot set here: the dataclass's keyword __init__, with its two clock reads, costs more than
    twice as much a prompt, at tens of thousands of prompts a second (docs/benchmarks.md, "One
    output for a front end's plain calls"). The same defaults as the dataclass's;
    tests/scheduling/test_prompt_batches.py compares the two field by field."""
    r = object.__new__(EngineRequest)
    r.prompt, r.new_tokens, r.top_k, r.params, r.prompt_logprobs, r.trace, r.controls, r.adapter = \
        prompt, 0, top_k, _DEFAULT_PARAMS, prompt_logprobs, trace, controls, adapter
    r.seed, r.stop_token_ids, r.ignore_eos, r.expires_at, r.output, r.request_id, r.row = \
        0, _NO_STOPS, False, math.inf, output, call_id, row
    r.arrived, r.arrived_ns, r.state, r.generated, r.cancelled = arrived, arrived_ns, "waiting", 0, False
    return r


@dataclass
class Step:
    leaving: list[EngineRequest] = field(default_factory=list)
    admitted: list[EngineRequest] = field(default_factory=list)
    prompts: list[EngineRequest] = field(default_factory=list)
    decode: bool = False
    chunk: int = 0  # tokens of the next chunk to read, at most (0: none)
    admitted_tokens: list[int] = field(default_factory=list)  # what each admitted prompt computes (uncached)

    @property
    def empty(self) -> bool:
        return not (self.leaving or self.admitted or self.prompts or self.decode)


class Scheduler:
    def __init__(self, *, slots: int, capacity_blocks: int, n_ctx: int, max_batch_size: int, max_batch_tokens: int,
                 max_batch_delay_s: float, fixed_cost_tokens: float, step_tokens: int | None = None,
                 uncached: Callable[[list[int], object], int] = lambda prompt, adapter: len(prompt),
                 max_loras: int | None = None):
        """`step_tokens`: the token budget of a step whose prompts share the decode rows' forward;
        None where they never do (admission then fills prefills of their own). `uncached(prompt, adapter)`:
        the tokens reading it computes, past what the prefix cache holds (vLLM's computed tokens).
        `max_loras`: distinct LoRA adapters a step may hold (None: any number); as vLLM's scheduler
        does, a request under another one is passed over, keeping its place, until a step has room."""
        self.uncached, self.max_loras = uncached, max_loras
        self.slots, self.capacity_blocks, self.n_ctx = slots, capacity_blocks, n_ctx
        self.max_batch_size, self.max_batch_tokens, self.step_tokens = max_batch_size, max_batch_tokens, step_tokens
        self.max_batch_delay_s, self.fixed_cost_tokens = max_batch_delay_s, fixed_cost_tokens
        self.prompts: deque[EngineRequest] = deque()  # waiting next-token prompts, oldest first
        self.waiting: list[EngineRequest] = []  # waiting generations, oldest first
        self.running: dict[int, EngineRequest] = {}  # generations in a slot, until it is freed
        self._window_started: float | None = None  # when the prompts now waiting began to gather
        self._last_arrival = 0.0
        self._expected_batch = 1
        self._last_forward_s = 0.0
        self._last_answered = -math.inf

    # Intake (the core's thread) -------------------------------------------------------------------
    def add(self, arrived: list[EngineRequest]) -> None:
        """Arrivals, in order: generations wait for a slot, next-token prompts for a forward."""
        prompts, waiting, last = self.prompts, self.waiting, self._last_arrival
        for request in arrived:
            if request.new_tokens:
                waiting.append(request)
            else:
                prompts.append(request)
                if request.arrived > last:
                    last = request.arrived
        self._last_arrival = last

    def staying(self) -> list[EngineRequest]:
        return [r for r in list(self.running.values()) if r.state == "running" and not r.cancelled]

    def blocks(self, members: list[EngineRequest]) -> int:
        """What these generations take in the dense cache, each slot as long as the longest may grow."""
        return blocks_needed(len(members), self._longest(members))

    def _longest(self, members: list[EngineRequest]) -> int:
        return max((min(r.longest, self.n_ctx) for r in members), default=0)

    def take_leaving(self) -> list[EngineRequest]:
        """Generations that finished or were cancelled: out of the running set (their slots are
        the caller's to free)."""
        leaving = [r for r in self.running.values() if r.state != "running" or r.cancelled]
        for r in leaving:
            del self.running[r.request_id]
        return leaving

    # The step ---------------------------------------------------------------------------------------
    def schedule(self, now: float, chunk_waiting: int = 0) -> Step | float | None:
        """The next step; or, when only prompts wait and their batch may still fill, the time to
        look again; None when there is nothing to do. `chunk_waiting`: tokens of the next chunk
        of a prompt read in chunks, at most (0: none)."""
        step = Step(leaving=self.take_leaving())
        staying = self.staying()  # a prompt still read in chunks is one of them: a row it does not have yet
        budget = self.max_batch_tokens
        if self.step_tokens is not None and staying:  # the decode rows first, then the chunk
            budget = self.step_tokens - len(staying)
            step.chunk = self.chunk_within(chunk_waiting, budget)
            budget -= step.chunk
        else:
            step.chunk = chunk_waiting
        loras = set() if self.max_loras is None else {r.adapter for r in staying if r.adapter is not None}
        if self.waiting:
            step.admitted, step.admitted_tokens = self._admit(staying, budget, step.chunk, loras)
        step.decode = bool(staying or step.admitted)
        busy = step.decode or step.admitted
        if self.prompts:
            wake = None if busy else self._fill_until(now)
            if wake is None:
                step.prompts = self._take_prompts(loras)
            elif step.empty:
                return wake
        return None if step.empty else step

    def chunk_within(self, waiting: int, budget: int) -> int:
        """The tokens a chunk of at most `waiting` reads in a step with `budget` tokens left: all of
        them where steps do not pack prompts with decode rows, else what is left, SMALLEST_CHUNK at least."""
        return waiting if self.step_tokens is None else min(waiting, max(budget, SMALLEST_CHUNK))

    def _has_room(self, adapter: object, loras: set) -> bool:
        """Whether a request under `adapter` may join a step holding the adapters `loras` (max_loras)."""
        return adapter is None or self.max_loras is None or adapter in loras or len(loras) < self.max_loras

    def _admit(self, staying: list[EngineRequest], budget: int, chunk: int,
               loras: set) -> tuple[list[EngineRequest], list[int]]:
        """The oldest waiting generations, while slots, blocks and `budget` tokens to compute last
        (the first one even over it, unless a chunk is read this step), and what each computes.
        One under an adapter the step has no room for (`loras`, max_loras) is passed over."""
        self.waiting = [r for r in self.waiting if not r.cancelled and r.state == "waiting"]
        free = self.slots - len(staying)
        admitted, costs, tokens, passed = [], [], 0, 0
        longest = self._longest(staying)
        while passed < len(self.waiting) and len(admitted) < free:
            request = self.waiting[passed]
            if not self._has_room(request.adapter, loras):
                passed += 1  # keeps its place in the queue
                continue
            cost = self.uncached(request.prompt, request.adapter)
            if (admitted or chunk) and tokens + cost > budget:
                break
            with_it = max(longest, min(request.longest, self.n_ctx))
            if blocks_needed(len(staying) + len(admitted) + 1, with_it) > self.capacity_blocks:
                break  # oldest first: a long one is not passed by shorter ones behind it
            longest = with_it
            if request.adapter is not None:
                loras.add(request.adapter)
            self.waiting.pop(passed)
            request.state = "running"
            self.running[request.request_id] = request
            admitted.append(request)
            costs.append(cost)
            tokens += cost
        return admitted, costs

    def _live_prompts(self) -> None:
        while self.prompts and self.prompts[0].cancelled:
            self.prompts.popleft()

    def _fill_until(self, now: float) -> float | None:
        """None: run the waiting prompts now; else when to look again (see the module doc)."""
        self._live_prompts()
        if not self.prompts:
            return None
        if self._window_started is None:
            self._window_started = now
            if now - self._last_answered > self._return_window():
                self._expected_batch = 1  # the last batch's callers did not come back: nothing to wait for
        waiting = sum(not r.cancelled for r in self.prompts)
        target = min(self.max_batch_size, max(self._expected_batch, waiting))
        if waiting >= target:
            return None
        started = self._window_started
        still_arriving = min(started + self._return_window(), self._last_arrival + self.max_batch_delay_s / 2)
        until = max(started + self.max_batch_delay_s, still_arriving)
        return None if now >= until else until

    def _return_window(self) -> float:
        """How long after their answers closed-loop callers may still be coming back."""
        return max(STREAMING_WAIT_FACTOR * self.max_batch_delay_s, STREAMING_WAIT_SHARE_OF_FORWARD * self._last_forward_s)

    def _take_prompts(self, loras: set) -> list[EngineRequest]:
        if len(self.prompts) <= self.max_batch_size:  # all of them: one pass, not a pop each
            candidates = [r for r in self.prompts if not r.cancelled]
            self.prompts.clear()
        else:
            candidates = []
            while self.prompts and len(candidates) < self.max_batch_size:
                request = self.prompts.popleft()
                if not request.cancelled:
                    candidates.append(request)
        if self.max_loras is not None and any(r.adapter is not None for r in candidates):
            taken, passed = [], []
            for request in candidates:
                room = self._has_room(request.adapter, loras)
                (taken if room else passed).append(request)
                if room and request.adapter is not None:
                    loras.add(request.adapter)
            self.prompts.extendleft(reversed(passed))  # no room this step: back to the front, in order
            candidates = taken
        self._window_started = None
        if not candidates:
            return []
        chosen = plan_batch([len(r.prompt) for r in candidates], 0, max_batch_size=self.max_batch_size,
                            max_batch_tokens=self.max_batch_tokens, fixed_cost_tokens=self.fixed_cost_tokens)
        if len(chosen) == len(candidates):  # the usual case: one batch
            return candidates
        chosen = set(chosen)
        # Left over by length grouping: back to the front, before newer arrivals.
        self.prompts.extendleft(reversed([r for i, r in enumerate(candidates) if i not in chosen]))
        return [r for i, r in enumerate(candidates) if i in chosen]

    def prompts_answered(self, batch: int, forward_s: float) -> None:
        """A batch of prompts was answered: the next one expects its callers back."""
        self._expected_batch = sum(not r.cancelled for r in self.prompts) + batch
        self._last_forward_s = forward_s
        self._last_answered = time.perf_counter()

    def expired(self, now: float) -> list[EngineRequest]:
        """Waiting generations past their deadline: they leave the queue."""
        gone = [r for r in self.waiting if r.expires_at <= now and not r.cancelled]
        if gone:
            self.waiting = [r for r in self.waiting if r not in gone]
            for r in gone:
                r.state = "done"
        return gone

    def next_deadline(self) -> float:
        return min((r.expires_at for r in self.waiting), default=math.inf)
