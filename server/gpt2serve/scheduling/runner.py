"""The engine core's runner: it carries out one scheduled step (scheduling.scheduler.Step) as
plans of rows (engine.steps.StepPlan) that the generator launches and reads, and hands every
answer to the callers' side (scheduling.outputs).

    leaving   their KV-cache slots come free
    admitted  one prefill, which gives each its first token; a long prompt is read instead in
              chunks, one chunk a step (engine.chunked_prefill), the oldest first, riding the
              decode step where it can (engine.step_forward), else in a forward of its own
    prompts   next-token prompts: riding this step's decode (engine.step_forward) where they
              can, the others a step of their own; with overlap a plain batch is launched and the
              batch before it read while it runs (engine.cuda_graphs.BucketedForward.launch), and a
              batch with none launched behind it is read at the next step, or at once when none is
    decode    launched; then the step before it is read. With overlap (on cuda) the two are
              different steps: this one is queued behind the one still running on the device,
              whose answers are read while it runs, so the host's work hides behind the device's
              (vLLM v1's async scheduling, SGLang's overlap scheduler). Without it, the step is
              read at once.

Overlapped, a generation's token is read one step after its step was launched, so the step
after a stop token (or EOS) still carries it: that row's token is dropped, never sent. The last
step of generations that all end by length is read before another is launched (it would be all
such rows). A generation that leaves with a step unread has its slot cleared (engine.generator).

A forward that raises fails only its own requests; out of device memory, next-token prompts and
a prefill run again as two halves, down to one prompt, and a decode step fails its sequences.
"""

from __future__ import annotations

import logging
from dataclasses import astuple, dataclass
from typing import Callable

from ..engine.engine import OutOfMemory
from ..engine.steps import BatchOutput, NewSequence, StepLaunch, StepOutput, StepPlan
from ..errors import INTERNAL_MESSAGE, NonFiniteOutput, ResourceExhausted, ServeError
from .engine_api import ModelRunner
from .outputs import Handover, Outputs
from .scheduler import EngineRequest, Scheduler, Step

log = logging.getLogger(__name__)


class EngineFailure(ServeError):
    """A forward raised; only the requests of that forward see it."""


@dataclass
class TokenCounts:
    """Running totals for the stats line (telemetry.logs.StatsLog), counted a batch or a step at a
    time: prompt tokens computed, tokens generated, prompt tokens looked up in the prefix cache and
    those found there."""

    prompt: int = 0
    generated: int = 0
    queried: int = 0
    hits: int = 0

    def totals(self) -> tuple[int, int, int, int]:
        return astuple(self)

    def prompts(self, prompt_tokens: int, cached: int | None) -> None:
        """Prompts read by a forward; `cached`: of them, from the prefix cache (None: the cache is off)."""
        self.prompt += prompt_tokens - (cached or 0)
        if cached is not None:
            self.queried += prompt_tokens
            self.hits += cached


class StepRunner:
    """Runs in the core's thread only."""

    def __init__(self, generator: ModelRunner, scheduler: Scheduler,
                 outputs: Outputs, post: Handover, *, overlap: bool, step_tokens: int, eos_token_id: int | None,
                 prompts_started: Callable[[list[EngineRequest]], None], wake: Callable[[], None]):
        """prompts_started(batch): they stop counting as waiting (the core's count, under its
        lock); wake(): the core's loop looks again (a sink failed: its slot comes free)."""
        self.generator, self.scheduler = generator, scheduler
        self.outputs, self._post = outputs, post
        self.overlap, self.step_tokens, self.eos_token_id = overlap, step_tokens, eos_token_id
        self._prompts_started, self._wake = prompts_started, wake
        self.in_flight: tuple[StepLaunch, list[EngineRequest]] | None = None  # launched, not yet read
        self.prompts_in_flight: tuple[StepLaunch, list[EngineRequest]] | None = None  # a next-token batch's
        self.prompts_running = 0  # next-token prompts in the forward under way
        self.steps_run = 0
        self.batches_run = 0
        self.counts = TokenCounts()

    def run(self, step: Step) -> None:
        if not step.prompts:  # a batch in flight is read now unless the next one launches first
            self.finish_prompts_in_flight()
        if step.leaving:
            self.generator.remove({r.request_id for r in step.leaving})
        # One budget for the step's rows (scheduling.scheduler): decode rows, the chunk, then prompts
        budget = self.step_tokens - (len(self.generator.running) + step.chunk if step.decode else 0)
        joining, joining_tokens = self._prefill_step(step, budget) if step.admitted else ([], 0)
        budget -= joining_tokens
        queued = self.generator.next_chunk
        chunk = step.chunk if queued is not None else 0
        if queued is not None and not chunk:  # queued just now: its first chunk, within what is left
            chunk = self.scheduler.chunk_within(queued[1], budget)
            budget -= chunk
        riders, prompts = self._riders(step.prompts, budget) if step.decode else ([], step.prompts)
        if prompts:
            self._prompt_step(prompts)
        if step.decode:
            leaving = self.scheduler.take_leaving()
            if leaving:  # finished at their first token: out before the decode
                self.generator.remove({r.request_id for r in leaving})
            members = self.scheduler.staying()
            joining = [seq for r, seq in joining if r.state == "running" and not r.cancelled]  # no slot for leavers
            rides = chunk if self.generator.takes_riders else 0
            if members and (self.generator.running or joining or rides):  # (a prompt read in chunks has no slot yet)
                self._decode_step(members, StepPlan(riders=riders, joining=joining, chunk=rides))
                riders, chunk = [], 0 if rides else chunk
        if chunk:  # no decode step took it along
            self._chunk_step(chunk)
        if riders:  # nobody left to decode: they take their own forward
            self._prompt_step(riders)

    def _riders(self, prompts: list[EngineRequest], budget: int) -> tuple[list[EngineRequest], list[EngineRequest]]:
        """(the prompts that ride this step's decode, within `budget` tokens to compute, after the
        prefix cache; the rest)."""
        if not self.generator.takes_riders:
            return [], prompts
        riders, rest, tokens = [], [], 0
        for r in prompts:
            cost = self.generator.uncached_tokens(r.prompt, r.adapter) if r.rides else 0
            if r.rides and tokens + cost <= budget:
                riders.append(r)
                tokens += cost
            else:
                rest.append(r)
        return riders, rest

    # Next-token prompts ---------------------------------------------------------------------------
    def _prompts_start(self, batch: list[EngineRequest]) -> None:
        self._prompts_started(batch)
        self.prompts_running += len(batch)

    def _settle_running(self) -> None:
        """The running count back to what is in flight (after a step, whatever it raised)."""
        self.prompts_running = len(self.prompts_in_flight[1]) if self.prompts_in_flight is not None else 0

    def _prompt_step(self, batch: list[EngineRequest]) -> None:
        log.debug("batch: %d prompts in their own forward (%d queued)", len(batch), len(self.scheduler.prompts))
        self._prompts_start(batch)
        try:
            self._forward_prompts(batch)
        finally:
            self._settle_running()

    def _forward_prompts(self, batch: list[EngineRequest]) -> None:
        """A step of these next-token rows alone, launched (engine.generator). With overlap and a
        backlog (a full batch, or prompts left waiting), one queued on the device is read at the
        next step, and the batch before it now, while it runs; else it is read at once. Callers
        that all fit one batch are answered sooner so: overlapping them split them into two half
        batches, which cost more a prompt (docs/benchmarks.md, "Next-token batches overlapped with
        the device"). Out of device memory: each half on its own."""
        overlapped = self.overlap and (len(batch) >= self.scheduler.max_batch_size or bool(self.scheduler.prompts))
        if not overlapped:
            self.finish_prompts_in_flight()  # answers in the order the batches ran
        try:
            launch = self.generator.launch(StepPlan(decode=False, riders=batch))
        except OutOfMemory as exc:
            if len(batch) == 1:
                self.fail(batch, ResourceExhausted(f"the device is out of memory even for this prompt alone "
                                                   f"({len(batch[0].prompt)} tokens)"), exc)
                return
            self._in_halves(batch, self._forward_prompts, exc, "batch")
            return
        except Exception as exc:  # fail this batch only; keep serving
            self.fail(batch, EngineFailure(f"the forward pass failed; {INTERNAL_MESSAGE}"), exc, "forward pass")
            return
        self.finish_prompts_in_flight()
        if overlapped and not launch.answered:
            self.prompts_in_flight = (launch, batch)
        else:
            self._finish_prompts(launch, batch)

    def finish_prompts_in_flight(self) -> None:
        """Read the launched batch and answer it."""
        if self.prompts_in_flight is not None:
            (launch, batch), self.prompts_in_flight = self.prompts_in_flight, None
            self._finish_prompts(launch, batch)

    def _finish_prompts(self, launch: StepLaunch, batch: list[EngineRequest]) -> None:
        try:
            output = self.generator.finish(launch).riders
        except Exception as exc:
            self.fail(batch, EngineFailure(f"the forward pass failed; {INTERNAL_MESSAGE}"), exc, "forward pass")
            return
        self._answer(batch, output, launch.started, launch.started_ns)

    def _answer(self, batch: list[EngineRequest], output: BatchOutput, started: float, started_ns: int) -> None:
        self.batches_run += 1
        self.counts.prompts(sum(len(r.prompt) for r in batch), sum(output.cached_tokens) if output.cached_tokens else None)
        self.scheduler.prompts_answered(len(batch), output.forward_s)
        if output.probe is not None:
            # Per-layer reports cost extra (the logit lens): answer everyone who does not need
            # them in the response first, then build them.
            self._post(self.outputs.answer_prompts, batch, output, started, started_ns, False)
            try:
                output = self.generator.layer_reports(output)
            except Exception as exc:
                self.fail(batch, EngineFailure(f"the per-layer reports failed; {INTERNAL_MESSAGE}"), exc,
                          "per-layer reports")
                return
        self._answered(batch)
        self._post(self.outputs.answer_prompts, batch, output, started, started_ns, True)

    # Generations ------------------------------------------------------------------------------------
    def _prefill_step(self, step: Step, budget: int) -> tuple[list[tuple[EngineRequest, NewSequence]], int]:
        """One prefill of the step's admitted prompts; the long ones join the queue read in chunks.
        With a decode step to come where prompts may ride it, the rest are left to join it (scored
        ones too), within `budget` tokens to compute (after the prefix cache, as the scheduler
        counted them): returned, not read, each with its sequence, and the tokens they take."""
        whole, joining, tokens = [], [], 0
        rides = step.decode and self.generator.takes_riders and bool(self.generator.running)
        for r, cost in zip(step.admitted, step.admitted_tokens):
            sequence = _sequence(r)
            if self.generator.chunk_if_long(sequence):
                continue
            if rides and tokens + cost <= budget:
                joining.append((r, sequence))
                tokens += cost
            else:
                whole.append((r, sequence))
        if whole:
            self._prefill([r for r, _ in whole], [seq for _, seq in whole])
        return joining, tokens

    def _prefill(self, whole: list[EngineRequest], sequences: list[NewSequence] | None = None) -> None:
        """Out of device memory (the prefill left nothing behind): each half on its own, down to
        one prompt, which then fails alone, as next-token batches split. (`sequences`: the
        requests' own, where the caller made them.)"""
        plan = StepPlan(decode=False, joining=sequences or [_sequence(r) for r in whole])
        halves = (lambda exc: self._in_halves(whole, self._prefill, exc, "prefill")) if len(whole) > 1 else None
        output = self._step("prefill", whole, lambda: self._run(plan), on_oom=halves)
        if output is not None:
            self._took(output, whole)

    def _chunk_step(self, tokens: int) -> None:
        """The next chunk (at most `tokens`) of the oldest prompt read in chunks
        (engine.chunked_prefill) in a step of its own: one a step, so running generations take a
        token between chunks."""
        seq_id, _ = self.generator.next_chunk
        request = self.scheduler.running.get(seq_id)
        if request is None:  # failed or left since: its job goes, as its removal would drop it
            self.generator.remove({seq_id})
            return
        output = self._step("prefill", [request], lambda: self._run(StepPlan(decode=False, chunk=tokens)))
        if output is not None:
            self._took(output, [request])

    def _run(self, plan: StepPlan) -> StepOutput:
        return self.generator.finish(self.generator.launch(plan))

    def _decode_step(self, members: list[EngineRequest], plan: StepPlan) -> None:
        """Launch this decode step, then read the one before it (with overlap, still running
        on the device while this one was prepared and queued behind it); without overlap, or
        with prompts riding it (answered at once), read this one too."""
        if self.in_flight is not None and any(r.params.grammar for r in self.in_flight[1]):
            self.finish_in_flight()  # a grammar's next mask needs the token under way (engine.constraints)
        riders = list(plan.riders)
        if riders:
            log.debug("batch: %d prompts riding a decode step of %d (%d queued)", len(riders), len(members),
                      len(self.scheduler.prompts))
            self._prompts_start(riders)
        launch = self._step("decode", members, lambda: self.generator.launch(plan), riders)
        self.finish_in_flight()
        if launch is None:
            return
        if self.overlap and plan.decode_only:
            self.in_flight = (launch, members)
        else:
            self._finish_decode(launch, members, riders)

    def finish_in_flight(self) -> None:
        if self.in_flight is not None:
            (launch, members), self.in_flight = self.in_flight, None
            self._finish_decode(launch, members)

    def _finish_decode(self, launch: StepLaunch, members: list[EngineRequest],
                       riders: list[EngineRequest] = ()) -> None:
        output = self._step("decode", members, lambda: self.generator.finish(launch), riders)
        if output is None:
            return
        if riders:
            self._answer(riders, output.riders, launch.started, output.started_ns)
        self._took(output, members)

    def last_tokens_in_flight(self) -> bool:
        """Whether every generation in the step under way is taking its last token there: the
        next step would then be all wasted rows, so its answers are read first."""
        launch_members = self.in_flight[1] if self.in_flight is not None else ()
        return bool(launch_members) and not any(
            r.generated + 1 < r.new_tokens for r in launch_members if r.state == "running" and not r.cancelled)

    def _step(self, kind: str, members: list[EngineRequest], call: Callable, riders: list[EngineRequest] = (),
              on_oom: Callable[[OutOfMemory], None] | None = None):
        """call() (a prefill, a decode launch or its reading), or None where it failed: its
        sequences (and riders) are told, and the loop goes on. on_oom: what to do instead when
        the device ran out of memory (a prefill tries smaller parts)."""
        try:
            return call()
        except OutOfMemory as exc:
            if on_oom is not None:
                on_oom(exc)
                return None
            log.error("%s step: out of device memory for %d sequences: %s", kind, len(members), exc)
            self.fail(members, ResourceExhausted(f"the device ran out of memory in a {kind} step of "
                                                 f"{len(members)} sequences; retry later"))
            if riders:  # not theirs to fail: their own forward
                self._forward_prompts(riders)
        except Exception as exc:  # fail the sequences of this step, keep serving the rest
            self.fail(members + list(riders), ServeError(f"the {kind} step failed; {INTERNAL_MESSAGE}"), exc,
                      f"{kind} step")
        finally:
            self._settle_running()
        return None

    def _took(self, output: StepOutput, members: list[EngineRequest]) -> None:
        """Each live generation counts its token (a finished one is done: its slot comes free at
        the next step; a token for one that ended meanwhile, read a step late, is dropped)."""
        self.steps_run += 1
        tokens, eos, taken = output.tokens, self.eos_token_id, []
        for request in members:
            token = tokens.get(request.request_id)
            if token is not None and request.state == "running":
                taken.append((request, token, request.took(token.token_id, eos)))
        self.counts.generated += len(taken)
        if output.prompt_tokens or output.cached_tokens:  # a prefill's, or a chunk's
            cached = sum(output.cached_tokens.values()) if output.cached_tokens else None
            self.counts.prompts(output.prompt_tokens + (cached or 0), cached)
        if output.failed:
            log.error("%s step: %d of %d sequences had non-finite logits; failing them alone",
                      output.kind, len(output.failed), len(members))
            self.fail([r for r in members if r.request_id in output.failed and r.state == "running"],
                      NonFiniteOutput("the model's output for this sequence was not finite (a numerical "
                                      "overflow); it was stopped"))
        self._post(self.outputs.deliver, taken, output, members, self._wake)

    # Failures and the way back to the callers ------------------------------------------------------
    @staticmethod
    def _in_halves(requests: list[EngineRequest], run: Callable[[list[EngineRequest]], None], exc: OutOfMemory,
                   what: str) -> None:
        """Out of device memory (the failed forward left nothing behind): each half on its own."""
        log.warning("out of memory for a %s of %d; retrying it as two halves (%s)", what, len(requests), exc)
        half = len(requests) // 2
        for part in (requests[:half], requests[half:]):
            live = [r for r in part if not r.cancelled]  # callers may have left meanwhile
            if live:
                run(live)

    def fail(self, requests: list[EngineRequest], error: ServeError, exc: Exception | None = None,
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


def _sequence(request: EngineRequest) -> NewSequence:
    """What the generator takes of a generation request."""
    return NewSequence(request.request_id, request.prompt, request.params, request.seed, request.prompt_logprobs,
                       request.adapter)
