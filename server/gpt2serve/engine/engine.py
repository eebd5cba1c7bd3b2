"""Batched next-token forward passes over a loaded GPT-2.

Prompts of different lengths share one forward, and a prompt in a batch gets the same answer it
gets alone. Only the last position goes through the LM head. Three ways through the model:
- prompt rows of one packed forward (engine.step_forward), the default: every matrix of the model
  runs over the prompts' real tokens only, and attention over rows padded to the longest. With
  the prefix cache (engine.prefix_cache) a row starts after its cached blocks and attends over
  them, and new full blocks go into the cache;
- CUDA graphs (on cuda, `--cuda-graphs on`): a plain batch left-padded up to a captured bucket
  shape (engine.padding), its last tokens in the last column;
- right-padded rows of one (R, T) forward: traced batches (introspection taps run Python per
  block, and their reports cover every position), computed whole; they keep their blocks in the
  prefix cache too.
Either way the answer reaches the host in one copy.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from ..protocol import TraceContext
from ..introspection.probe import LayerProbe
from ..introspection.walkthrough import traced_walkthrough
from .cuda_graphs import BucketedForward
from .head import ScoredSpan, score_prompts, top_k_rows
from .constraints import Grammars
from .loading import LoadedModel
from .lora_registry import LoraRegistry
from .logits_controls import controlled_view
from .prefix_cache import BLOCK as PREFIX_BLOCK, PrefixCache, RowPlan, root_for
from .padding import CPU_FORWARD_TOKENS, Buckets, forward_parts, right_padded
from .steps import Ask, BatchOutput, PromptAsk, PromptLaunch, StepLaunch, StepOutput, plain_asks, traced
from .step_forward import PromptRow, padded_forward, prompt_forward, prompt_scores

log = logging.getLogger(__name__)


# A forward's cost that does not grow with the batch, in padded tokens' worth (see warm_up).
DEFAULT_FIXED_COST_TOKENS = 32.0
MAX_FIXED_COST_TOKENS = 4096.0
# CUDA graphs cover prompts up to this many tokens; longer ones are compute-bound, so the
# launches a graph saves matter little there, and padding to the next bucket would cost more.
GRAPH_MAX_LEN = 256
WARM_GRAPH_MAX_LEN = 32  # bucket lengths captured at warm-up (all batch buckets); longer lazily
WARM_UP_TRACE = TraceContext(layers_wanted=True)


@dataclass(frozen=True)
class EngineOptions:
    """The engine's slice of the server config."""

    max_batch_size: int = 64
    cuda_graphs: bool = True  # on cuda only
    cuda_graph_memory_mb: float = 4096.0
    fixed_cost_tokens: float | None = None  # None: measured by warm_up()


class OutOfMemory(Exception):
    """The device ran out of memory for this batch; the cached blocks were released, so a
    smaller batch may fit (the scheduler splits and retries)."""


class MemoryReserve:
    """Device memory held back from the caches and the forwards, handed back when a forward runs
    out, so that what the retry needs outside torch's allocator (a library's lazily made handle
    or workspace) and the first split half find room; taken again once a forward succeeds.
    The caches are sized from the free memory after it is taken (launch.engine_host)."""

    BYTES = 64 * 2**20

    def __init__(self):
        self.held: torch.Tensor | None = None
        self.device: torch.device | None = None  # None: none kept (a CPU)
        self.nbytes = 0

    @property
    def missing(self) -> bool:
        """Kept, and not held now: take it again after the next forward that fits."""
        return self.device is not None and self.held is None

    def keep(self, device: torch.device, nbytes: int = BYTES) -> None:
        self.device, self.nbytes = device, nbytes
        self.take()

    def take(self) -> None:
        try:
            self.held = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        except torch.cuda.OutOfMemoryError:  # still full
            self.held = None

    def release(self) -> None:
        """Hand it back (to the device once torch's cache is emptied: a library allocates outside
        torch's allocator)."""
        self.held = None


RESERVE = MemoryReserve()  # one per process: the engine process has one device


def oom_as_out_of_memory(method):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return _held_again(method(self, *args, **kwargs))
        except torch.cuda.OutOfMemoryError as exc:
            message = str(exc).splitlines()[0]
        # Out of the handler first: torch's exception holds the failed forward's frames, and with
        # them its activations. Raised inside the handler, the caller's retry of each half (also
        # inside a handler) would run with all of them still allocated, and fail again.
        RESERVE.release()
        torch.cuda.empty_cache()  # the reserve and the failed forward's blocks go back to the device
        raise OutOfMemory(message)

    return wrapper


def _held_again(result):
    """After an out-of-memory: take the reserve again once a forward fits."""
    if RESERVE.missing:
        RESERVE.take()
    return result


class Engine:
    """Owns the model. Not thread-safe: one worker thread calls it (see scheduling)."""

    def __init__(self, loaded: LoadedModel, options: EngineOptions = EngineOptions()):
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.options = options
        self.pad_token_id = loaded.tokenizer.eos_token_id or 0
        pinned = options.fixed_cost_tokens
        self.fixed_cost_tokens = DEFAULT_FIXED_COST_TOKENS if pinned is None else pinned  # else measured by warm_up()
        config = self.model.config
        assert config.vocab_size < 2**24, "token ids travel to the host as float32 (see head.top_k_rows)"
        self.graphs: BucketedForward | None = None
        if self.device.type == "cuda" and options.cuda_graphs:
            self.graphs = self.bucketed(capture=True)
        self.prefix_cache: PrefixCache | None = None  # attach_prefix_cache()
        # A batch's padded tokens per forward (engine.padding); None: the whole batch in one.
        self.forward_tokens = CPU_FORWARD_TOKENS if self.device.type == "cpu" else None
        self.grammars = Grammars(loaded.tokenizer)  # structured output's compiled grammars (the generator's too)
        self.adapters = LoraRegistry(config, device=self.device)  # LoRA adapters requests may name

    @property
    def kv_dtype(self) -> torch.dtype:
        """The generation KV cache's: fp16 beside quantized weights on a CPU (as llama.cpp keeps its
        cache: half the bytes each decode step reads and the cache holds; the attention still adds
        up in fp32), else the model's own."""
        if self.device.type == "cpu" and self.loaded.quantize != "none":
            return torch.float16
        return self.loaded.dtype

    def attach_prefix_cache(self, capacity_blocks: int, doorkeeper: bool = True) -> None:
        """Keep prompts' blocks from now on (after warm-up, so it starts empty); 0: off.
        `doorkeeper`: a block is kept the second time its prefix is seen (engine.prefix_cache)."""
        self.prefix_cache = None if capacity_blocks <= 0 else PrefixCache(
            self.model.config, capacity_blocks, self.device, self.loaded.dtype, doorkeeper)

    def bucketed(self, capture: bool) -> BucketedForward:
        """The bucketed forward (without capture: the same padding and buffers, run eagerly)."""
        config = self.model.config
        buckets = Buckets.for_model(self.options.max_batch_size, min(config.n_ctx, GRAPH_MAX_LEN))
        return BucketedForward(self.last_logprobs, buckets, device=self.device, vocab_size=config.vocab_size,
                               pad_id=self.pad_token_id, capture=capture,
                               memory_budget_bytes=int(self.options.cuda_graph_memory_mb * 2**20))

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Before the server says ready: capture the common graphs, run the eager and traced
        paths (first-call allocations, kernel choice and loading), and measure `fixed_cost_tokens`,
        fixed / c below: the scheduler's length grouping needs it (large on a GPU, tens of
        tokens on a CPU)."""
        if self.graphs is not None:
            started = time.perf_counter()
            buckets = self.graphs.buckets
            self.graphs.warm_up([(b, t) for b in buckets.batch for t in buckets.length if t <= WARM_GRAPH_MAX_LEN])
            log.info("captured %d CUDA graphs in %.1f s (%.0f MiB)", self.graphs.graphs,
                     time.perf_counter() - started, self.graphs.memory_used_bytes / 2**20)
        # Eager with taps at an aligned and unaligned length, two ks: cuda loads each kernel on first use.
        for length, top_k in ((8, 1), (5, 5)):
            self.layer_reports(self.next_token([Ask([self.pad_token_id] * length, top_k, trace=WARM_UP_TRACE)]))
        if self.options.fixed_cost_tokens is not None:  # pinned (--fixed-cost-tokens): nothing to measure
            return
        # A forward costs about fixed + r * rows + c * padded tokens (rows: the last-position
        # lm_head, a large share for small models). Splitting a batch by length repeats `fixed`
        # and saves padding, while r * rows is paid either way: so three shapes, r kept apart.
        one_short, rows_short, rows_long = (1, 8), (8, 8), (8, 32)  # (prompts, tokens each)

        def best_of_3(shape: tuple[int, int]) -> float:
            batch = [[self.pad_token_id] * shape[1]] * shape[0]
            return min(self.next_token(plain_asks(batch)).forward_s for _ in range(3))

        t1, t2, t3 = best_of_3(one_short), best_of_3(rows_short), best_of_3(rows_long)
        per_token = (t3 - t2) / (8 * (32 - 8))
        per_row = (t2 - t1 - 8 * (8 - 1) * per_token) / (8 - 1)
        fixed = t1 - per_row - 8 * per_token
        if per_token > 0 and fixed > 0:
            self.fixed_cost_tokens = min(max(fixed / per_token, 1.0), MAX_FIXED_COST_TOKENS)
        else:  # Timing noise, or the device is far from saturated: padding is nearly free.
            self.fixed_cost_tokens = MAX_FIXED_COST_TOKENS

    @oom_as_out_of_memory
    @torch.inference_mode()
    def next_token(self, asks: Sequence[PromptAsk]) -> BatchOutput:
        """Each prompt's answer (engine.steps.PromptAsk says what it wants). Prompts with every
        position scored (engine.head) run as prompt rows, since a graph keeps only the last
        position. A traced batch (per-layer reports, introspection, or a traced generation step's
        controls, engine.logits_controls.controlled_view) computes every prompt whole, right-padded
        (its reports cover every position), and still leaves its blocks in the prefix cache; an
        untraced one runs in parts of at most `forward_tokens` padded tokens, counted after the
        prefix cache (engine.padding)."""
        started, started_ns = time.perf_counter(), time.time_ns()
        prompts = [a.prompt for a in asks]
        traced_batch = any(map(traced, asks))

        def forward(plans: list[RowPlan] | None) -> BatchOutput:
            if traced_batch:
                return self._traced(asks, plans, started, started_ns)
            cached = [plan.cached_tokens for plan in plans] if plans is not None else [0] * len(prompts)
            parts = forward_parts([len(p) - c for p, c in zip(prompts, cached)], self.forward_tokens)
            outputs = [self._untraced(asks[a:b], plans[a:b] if plans is not None else None, started, started_ns)
                       for a, b in parts]
            return outputs[0] if len(outputs) == 1 else _joined(outputs, [a for a, _ in parts])

        if self.prefix_cache is None:
            return forward(None)
        return self.prefix_cache.run(prompts, forward, lambda output: output.failed_rows, use_hits=not traced_batch,
                                     roots=[root_for(a.adapter) for a in asks])

    def launch_prompts(self, asks: Sequence[PromptAsk]) -> StepLaunch:
        """A batch's step (a plan of riders alone, engine.steps.StepPlan.next_token), queued and
        not waited for where a graph holds it (engine.cuda_graphs.BucketedForward.launch): a plain
        batch (top-k alone, since a graph keeps only the last position) with no prompt the prefix
        cache could hold a block of (the synchronous path reads or keeps those); any other run
        whole (next_token)."""
        started, started_ns = time.perf_counter(), time.time_ns()
        pool, prompts, top_ks = self.prefix_cache, [a.prompt for a in asks], [a.top_k for a in asks]
        launched = None
        plain = not any(a.prompt_logprobs is not None or a.adapter is not None or traced(a) for a in asks)
        if plain and self.graphs is not None and not (pool is not None and any(len(p) >= PREFIX_BLOCK for p in prompts)):
            try:
                launched = self._graph_launch(prompts, top_ks, pool is not None)
            except Exception as exc:  # out of memory too: run whole, it fails or the core splits it
                log.warning("launching a batch of %d failed (%s); running it whole", len(asks), exc)
        computed = sum(map(len, prompts))  # less what the prefix cache held, once read (finish_prompts)
        return StepLaunch([], None, None, None, computed, started, started_ns,
                          prompts=launched if launched is not None else self.next_token(asks))

    @oom_as_out_of_memory
    @torch.inference_mode()
    def _graph_launch(self, prompts: list[Sequence[int]], top_ks: list[int], looked_up: bool) -> PromptLaunch | None:
        return self.graphs.launch(prompts, top_ks, looked_up=looked_up)  # None: no bucket holds it

    def finish_prompts(self, step: StepLaunch) -> StepOutput:
        """A batch's answers (launch_prompts): read once its graph has run, or already there."""
        out = step.prompts
        if isinstance(out, PromptLaunch):
            top, failed, forward_s = out.read()
            out = BatchOutput(top, forward_s, out.padded_len, out.started_ns, out.started_ns + int(forward_s * 1e9),
                              cuda_graph=True, failed_rows=failed, cached_tokens=[0] * len(top) if out.looked_up else [])
        return StepOutput({}, "next-token", len(out.top), step.tokens_in - sum(out.cached_tokens), out.forward_s,
                          out.started_ns, out.ended_ns, riders=out)

    def _untraced(self, asks: Sequence[PromptAsk], plans: list[RowPlan] | None, started: float,
                  started_ns: int) -> BatchOutput:
        """A plain batch from a graph that holds it; any other as prompt rows (engine.step_forward)."""
        prompts, top_ks = [a.prompt for a in asks], [a.top_k for a in asks]
        # A graph keeps only the last position (no scores) and is recorded without adapters.
        graphless = any(a.prompt_logprobs is not None or a.adapter is not None for a in asks)
        kept = plans is not None and any(plan.hit or plan.new for plan in plans)
        replayed = self.graphs.run(prompts) if self.graphs is not None and not (graphless or kept) else None
        if replayed is not None:
            logprobs, (_, length) = replayed
            top, failed = top_k_rows(logprobs, top_ks)
            looked_up = [0] * len(asks) if plans is not None else []  # none read: a graph reads no cache
            return BatchOutput(top, time.perf_counter() - started, length, started_ns, time.time_ns(),
                               cuda_graph=True, failed_rows=failed, cached_tokens=looked_up)
        return self._rows(asks, plans, started, started_ns)

    def _rows(self, asks: Sequence[PromptAsk], plans: list[RowPlan] | None, started: float,
              started_ns: int) -> BatchOutput:
        """Each prompt a row of one forward (engine.step_forward): with the prefix cache (`plans`),
        its tokens after its cached blocks, attending over those blocks (shared layout or rows),
        its new full blocks kept. Rows pad only attention, so a batch of mixed lengths costs
        little more than its real tokens (docs/benchmarks.md, "Next-token batches as prompt rows")."""
        rows = [PromptRow.planned(plan, adapter=a.adapter) for plan, a in zip(plans, asks)] if plans is not None \
            else [PromptRow(a.prompt, adapter=a.adapter) for a in asks]
        for pack in (True, False) if plans is not None else (False,):
            hidden, layout = prompt_forward(self.model, rows, self.prefix_cache, plans or (), pack=pack)  # (1, N, C)
            logits = self.model.head(hidden[0, layout.last])  # (B, V)
            top, failed = top_k_rows(torch.log_softmax(logits.float(), dim=-1), [a.top_k for a in asks])
            if not layout.needs_rows_again(failed):
                break
        scored_rows = {row: a.prompt_logprobs for row, a in enumerate(asks) if a.prompt_logprobs is not None}
        scores = prompt_scores(hidden, layout, self.prefix_cache, scored_rows, self.model.head, self.model.config.vocab_size)
        return BatchOutput(top, time.perf_counter() - started, layout.width, started_ns, time.time_ns(),
                           failed_rows=failed, prompt_scores=scores,
                           cached_tokens=[r.start for r in rows] if plans is not None else [])

    def _traced(self, asks: Sequence[PromptAsk], plans: list[RowPlan] | None, started: float,
                started_ns: int) -> BatchOutput:
        """Every prompt whole, as rows of one right-padded forward (engine.step_forward.padded_forward)
        with the probe's taps on the traced rows; with `plans`, full blocks go into the prefix cache.
        A traced row under an adapter that asks compare_base gets a twin row after the batch's:
        its prompt under the base, in the same forward, which the probe sets beside it block by block."""
        n = len(asks)
        traces = {row: a.trace for row, a in enumerate(asks) if a.trace is not None and a.trace.layers_wanted}
        twins = {row: n + i for i, row in enumerate(
            row for row, trace in traces.items() if trace.compare_base and asks[row].adapter is not None)}
        prompts = [a.prompt for a in asks] + [asks[row].prompt for row in twins]  # R = n + twins rows
        top_ks = [a.top_k for a in asks]
        ids = right_padded(prompts, self.pad_token_id, self.device)  # (R, T)
        probe = None
        if traces:
            traced_rows = [*traces, *twins.values()]
            probe = LayerProbe(self.model, traced_rows, [len(prompts[r]) for r in traced_rows], ids,
                               self.loaded.tokenizer.token_text, [r for r, t in traces.items() if t.attention_maps],
                               [r for r, t in traces.items() if t.last_row_maps], twins=twins)
            probe.start()
        hidden = padded_forward(self.model, prompts, ids, self.prefix_cache, plans or (), taps=probe,
                                adapters=[a.adapter for a in asks] + [None] * len(twins))  # (R, T, C)
        ends = torch.tensor([len(p) - 1 for p in prompts], device=self.device)  # (R,) each row's last column
        last = hidden[torch.arange(len(prompts), device=self.device), ends]  # (R, C)
        logits = self.model.head(last)  # (R, V): only the last position is decoded
        if probe is not None:
            probe.unembedded(last, logits)
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # (R, V)
        top, failed = top_k_rows(logprobs[:n], top_ks)
        base_top = {}
        if twins:
            twin_top, _ = top_k_rows(logprobs[n:], [top_ks[row] for row in twins])
            base_top = {row: twin_top[i] for i, row in enumerate(twins)}
        spans = [ScoredSpan(row, 0, len(a.prompt), a.prompt_logprobs) for row, a in enumerate(asks)
                 if a.prompt_logprobs is not None]
        scores = {} if not spans else dict(zip([s.row for s in spans], score_prompts(
            hidden, ids, spans, self.model.head, self.model.config.vocab_size)))
        if probe:
            probe.finish()
        controlled = {}
        rows = [row for row, a in enumerate(asks) if a.controls is not None]
        if rows:  # traced generation steps: their top tokens after their controls too
            views = controlled_view(logits[rows], [prompts[r] for r in rows], [asks[r].controls for r in rows],
                                    self.grammars, max(top_ks[r] for r in rows))
            controlled = dict(zip(rows, views))
        return BatchOutput(top, time.perf_counter() - started, ids.shape[1], started_ns, time.time_ns(),
                           probe=probe, failed_rows=failed, prompt_scores=scores, controlled=controlled,
                           cached_tokens=[0] * n if plans is not None else [], base_top=base_top)  # no hit is read

    def last_logprobs(self, input_ids: torch.Tensor, position_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """(B, T) left-padded inputs -> (B, V) fp32 log-probs of the next token. What CUDA graphs capture."""
        logits = self.model(input_ids, position_ids, valid)  # (B, V): only the last position is decoded
        return torch.log_softmax(logits.float(), dim=-1)  # (B, V), fp32 whatever the model dtype

    @oom_as_out_of_memory
    @torch.inference_mode()
    def layer_reports(self, output: BatchOutput) -> BatchOutput:
        """The traced rows' per-layer reports, logit lens decoded here: called after the answers
        went out, since decoding every block costs about one more unembedding of n_layer rows."""
        layers, timeline = output.probe.reports(self.model.lm_head)
        walkthrough = traced_walkthrough(output.probe, self.model)
        return replace(output, layers=layers, timeline=timeline, probe=None,
                       walkthrough=walkthrough)


def _joined(outputs: list[BatchOutput], firsts: list[int]) -> BatchOutput:
    """One batch's output from its parts' (part i starts at row firsts[i]; each part's forward_s
    counts from the batch's start)."""
    last = outputs[-1]
    return BatchOutput([top for o in outputs for top in o.top], last.forward_s, max(o.padded_len for o in outputs),
                       outputs[0].started_ns, last.ended_ns, all(o.cuda_graph for o in outputs),
                       failed_rows=frozenset(a + row for a, o in zip(firsts, outputs) for row in o.failed_rows),
                       prompt_scores={a + row: s for a, o in zip(firsts, outputs) for row, s in o.prompt_scores.items()},
                       cached_tokens=[c for o in outputs for c in o.cached_tokens])
