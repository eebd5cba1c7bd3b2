"""Continuous batching for generation: sequences join and leave the running batch at step boundaries.

One loop, on the event loop, drives the engine thread (engine.generator.Generator):

    leave    finished and abandoned sequences give their cache slots back (at once: the next
             engine call frees them before anything else)
    admit    waiting sequences, oldest first, while cache slots, the cache's blocks and the
             prefill token budget (--max-batch-tokens) last; each one's prefill gives its first
             token. A sequence counts at the longest it may grow (prompt + max_tokens), so
             one admitted never runs out of cache (engine.kv_cache: blocks_needed)
    decode   one token for every running sequence

Each engine call goes to the same one-thread executor as the next-token batches, one step at a
time, so the two kinds of work take turns there and neither starves the other.

A sequence that finds no room waits; past its deadline (the caller's, or
--max-queue-wait-s, whichever comes first) it gets RESOURCE_EXHAUSTED. More than --max-queue waiting are refused at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from ..errors import INTERNAL_MESSAGE, InvalidArgument, NonFiniteOutput, ResourceExhausted, ServeError, ShuttingDown, Unavailable
from ..protocol import GenerateRequest, SampledToken, TokenEvent, TokenSink
from ..telemetry.records import PrefixCacheUse, StepDone

from ..engine.engine import OutOfMemory
from ..engine.generator import NewSequence, StepOutput
from ..engine.kv_cache import BLOCK, blocks_for, blocks_needed

log = logging.getLogger(__name__)


class GenerationEngine(Protocol):
    """What the scheduler needs of engine.generator.Generator."""

    slots: int  # sequences at most
    capacity_blocks: int  # KV-cache blocks that may be held
    n_ctx: int

    def remove(self, seq_ids) -> None: ...

    def prefill(self, sequences: Sequence[NewSequence]) -> StepOutput: ...

    def decode(self) -> StepOutput: ...


class StepObserver(Protocol):
    """Told about every engine step (telemetry)."""

    def record_step(self, record: StepDone) -> None: ...


@dataclass(eq=False)
class _Sequence:
    seq_id: int
    request: GenerateRequest
    sink: TokenSink
    enqueued_at: float = field(default_factory=time.perf_counter)
    state: str = "waiting"  # -> running -> leaving (slot freed at the next engine call) -> gone
    generated: int = 0
    expiry: asyncio.TimerHandle | None = None  # while waiting: the deadline for a cache slot


class ContinuousBatcher:
    def __init__(self, engine: GenerationEngine, executor: Executor, *, eos_token_id: int | None, max_queue: int,
                 max_prefill_tokens: int, max_queue_wait_s: float, observer: StepObserver | None = None):
        self.engine = engine
        self.executor = executor
        self.eos_token_id = eos_token_id
        self.max_queue = max_queue
        self.max_prefill_tokens = max_prefill_tokens
        self.max_queue_wait_s = max_queue_wait_s
        self.observer = observer
        self.slots = engine.slots
        self.capacity_blocks = engine.capacity_blocks
        self.n_ctx = engine.n_ctx
        self._waiting: list[_Sequence] = []
        self._running: dict[int, _Sequence] = {}  # admitted, until their slot is freed
        self._leaving: set[int] = set()  # slots to free at the next engine call
        self._sequences: dict[int, _Sequence] = {}  # every live one, for abort()
        self._ids = itertools.count()
        self._seeds = random.Random()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.steps_run = 0

    # What telemetry reads -----------------------------------------------------------------------
    @property
    def running(self) -> int:
        return sum(s.state == "running" for s in self._running.values())

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def cache_usage(self) -> float:
        """Share of the KV cache's blocks held by live sequences, each at the longest it may grow
        (a leaving one's are already free for the next admission, which the same engine call
        frees them for)."""
        staying = self._staying()
        return self._blocks(staying) / self.capacity_blocks if self.capacity_blocks else 0.0

    def _staying(self) -> list[_Sequence]:
        return [s for s in self._running.values() if s.seq_id not in self._leaving]

    def _longest(self, request: GenerateRequest) -> int:
        """The most positions the sequence may hold: its prompt and all its new tokens."""
        return min(len(request.prompt) + request.max_tokens, self.n_ctx)

    def _blocks(self, members: list[_Sequence]) -> int:
        """What these sequences take in the dense cache, each slot as long as the longest may grow."""
        return blocks_needed(len(members), max((self._longest(s.request) for s in members), default=0))

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="generation")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for seq in list(self._sequences.values()):
            self._end(seq, ShuttingDown("server is shutting down"))

    def add(self, request: GenerateRequest, sink: TokenSink) -> int:
        """Queue a sequence; its tokens go to `sink` as they come. Returns its id, for abort().
        Refusals raise here: the loop is not running, or the queue is full."""
        if self._task is None or self._task.done():
            raise Unavailable("the generation loop is not running")
        longest = self._longest(request)
        if blocks_for(longest) > self.capacity_blocks:
            raise InvalidArgument(f"the prompt plus max_tokens needs {longest} tokens of KV cache, and it holds "
                                  f"{self.capacity_blocks * BLOCK} (--kv-cache-mb); lower max_tokens")
        if len(self._waiting) >= self.max_queue:
            raise ResourceExhausted(f"queue full ({len(self._waiting)} sequences waiting for the KV cache, "
                                    f"--max-queue {self.max_queue}); retry later")
        seq = _Sequence(next(self._ids), request, sink)
        loop = asyncio.get_running_loop()
        wait_s = self.max_queue_wait_s
        if request.deadline is not None:
            wait_s = min(wait_s, request.deadline - time.monotonic())
        seq.expiry = loop.call_later(max(wait_s, 0.0), self._expire, seq)
        self._waiting.append(seq)
        self._sequences[seq.seq_id] = seq
        self._wake.set()
        return seq.seq_id

    def abort(self, seq_id: int) -> None:
        """The caller left (hung up, or found a stop string): the sequence leaves the queue, or
        frees its cache slot at the next step boundary. Its sink hears nothing more."""
        seq = self._sequences.get(seq_id)
        if seq is not None:
            self._end(seq, None)

    def _expire(self, seq: _Sequence) -> None:
        if seq.state == "waiting":
            self._end(seq, ResourceExhausted(
                f"no room in the KV cache came free within the deadline ({len(self._running)} of {self.slots} "
                f"sequences, {self.cache_usage:.0%} of its blocks in use, {len(self._waiting)} waiting); retry later"))

    def _end(self, seq: _Sequence, error: Exception | None) -> None:
        """The sequence is done for its caller (`error`: what it is told, if anything)."""
        if seq.expiry is not None:
            seq.expiry.cancel()
        if seq.state == "waiting":
            self._waiting.remove(seq)
        elif seq.state == "running":
            self._leaving.add(seq.seq_id)
            self._wake.set()
        seq.state = "leaving" if seq.state == "running" else "gone"
        self._sequences.pop(seq.seq_id, None)
        if error is not None:
            seq.sink.fail(error)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._waiting and not self._running:
                self._wake.clear()
                await self._wake.wait()
            admitted = self._admit()
            called = await self._step(loop, admitted) if admitted else False
            # After a prefill, always a decode: arrivals can delay the running streams by one
            # prefill each step, never stop them.
            called = await self._step(loop, []) or called
            # The streams send what a step gave them while the engine runs the next one (awaiting
            # its result yields to them), not in a gap between steps; with no engine call, yield here.
            if not called:
                await asyncio.sleep(0)

    def _admit(self) -> list[_Sequence]:
        staying = self._staying()
        free = self.slots - len(staying)
        admitted, tokens = [], 0
        while self._waiting and len(admitted) < free:
            seq = self._waiting[0]
            if admitted and tokens + len(seq.request.prompt) > self.max_prefill_tokens:
                break
            members = staying + admitted + [seq]
            if self._blocks(members) > self.capacity_blocks:
                break  # oldest first: a long one is not passed by shorter ones behind it
            self._waiting.pop(0)
            seq.expiry.cancel()
            admitted.append(seq)
            tokens += len(seq.request.prompt)
        return admitted

    async def _step(self, loop: asyncio.AbstractEventLoop, admitted: list[_Sequence]) -> bool:
        """One engine call: free the slots of those leaving, then prefill `admitted`, or (when
        none) decode everyone running. False when there was nothing to call the engine for."""
        leaving, self._leaving = self._leaving, set()
        for seq_id in leaving:
            self._running.pop(seq_id, None)
        if admitted:
            kind, members = "prefill", admitted
            sequences = [NewSequence(s.seq_id, s.request.prompt, s.request.params,
                                     s.request.seed if s.request.seed is not None else self._seeds.getrandbits(63),
                                     s.request.prompt_logprobs)
                         for s in admitted]
            for seq in admitted:
                seq.state = "running"
                self._running[seq.seq_id] = seq
        else:
            kind, members = "decode", [s for s in self._running.values() if s.state == "running"]
        if not members and not leaving:
            return False

        def call() -> StepOutput | None:
            self.engine.remove(leaving)
            if not members:
                return None
            return self.engine.prefill(sequences) if admitted else self.engine.decode()

        try:
            output = await loop.run_in_executor(self.executor, call)
        except OutOfMemory as exc:
            log.error("%s step: out of device memory for %d sequences: %s", kind, len(members), exc)
            self._fail(members, ResourceExhausted(f"the device ran out of memory in a {kind} step of "
                                                  f"{len(members)} sequences; retry later"))
            return True
        except Exception as exc:  # Fail the sequences of this step, keep serving the rest.
            log.error("%s step failed for %d sequences", kind, len(members), exc_info=exc)
            self._fail(members, ServeError(f"the {kind} step failed; {INTERNAL_MESSAGE}"))
            return True
        if output is None:
            return True
        self.steps_run += 1
        for seq in members:
            token = output.tokens.get(seq.seq_id)
            if token is not None and seq.state == "running":
                self._deliver(seq, token, output)
        if output.failed:
            log.error("%s step: %d of %d sequences had non-finite logits; failing them alone",
                      kind, len(output.failed), len(members))
            self._fail([s for s in members if s.seq_id in output.failed], NonFiniteOutput(
                "the model's output for this sequence was not finite (a numerical overflow); it was stopped"))
        if self.observer is not None:
            prefix = None
            if output.cached_tokens:  # a prefill with the prefix cache on
                prefix = PrefixCacheUse(sum(len(s.request.prompt) for s in members), sum(output.cached_tokens.values()))
            try:
                self.observer.record_step(StepDone(output.kind, [s.request.trace for s in members], output.rows,
                                                   output.tokens_in, output.forward_s, output.started_ns,
                                                   output.ended_ns, prefix))
            except Exception:  # Telemetry must never fail a request or the loop.
                log.exception("step observer failed")
        return True

    def _deliver(self, seq: _Sequence, token: SampledToken, output: StepOutput) -> None:
        request = seq.request
        seq.generated += 1
        if token.token_id == self.eos_token_id and not request.ignore_eos:
            finish = "eos"
        elif token.token_id in request.stop_token_ids:
            finish = "stop"
        elif seq.generated >= request.max_tokens:
            finish = "length"
        else:
            finish = ""
        queue_s = max(time.perf_counter() - output.forward_s - seq.enqueued_at, 0.0) if seq.generated == 1 else 0.0
        if finish:
            self._end(seq, None)
        try:
            seq.sink.put(TokenEvent(token, finish, queue_s, output.forward_s, output.rows,
                                    output.prompt_scores.get(seq.seq_id), output.cached_tokens.get(seq.seq_id, 0)))
        except Exception:  # A sink's failure is its own request's; the loop goes on.
            log.exception("generation %d: its sink failed; stopping it", seq.seq_id)
            self._end(seq, None)

    def _fail(self, members: list[_Sequence], error: ServeError) -> None:
        for seq in members:
            if seq.state == "running":
                self._end(seq, error)
