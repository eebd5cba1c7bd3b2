"""Token-by-token generation over a KV cache: the engine side of continuous batching.

The scheduler (scheduling.scheduler) decides who runs; this module runs each step's plan
(engine.steps.StepPlan), in the engine thread, as one of three kinds of step:
- next-token: prompts that keep no slot, alone: a batch of the prompt forward (engine.engine);
- prefill: new prompts in one forward (on a CPU, forwards of at most CPU_FORWARD_TOKENS) that fills
  their slots and gives each its first token; blocks found in the prefix cache are copied into the
  slot, not computed (engine.step_forward); out of memory, it leaves no row behind. On cuda,
  prompts that need nothing from the prefix cache replay a graph (engine.cuda_graphs);
- decode: one token for every running sequence, each fed its last token at its own position;
  replayed as a CUDA graph (engine.cuda_graphs) or a TorchScript trace on a CPU (engine.traced_decode;
  rows under LoRA adapters, engine.lora: a trace that takes them, eager on cuda); with prompt rows
  (riders, joining prompts, a chunk), one eager forward for all (engine.step_forward). Compaction refills slots (engine.kv_cache).

Every step ends in one copy to the host: per row [token, logprob, top logprobs, top ids]. The
sampled ids also stay on the device (`last_ids`, one per slot), where the next decode step reads
them, so a step can be launched before the host has read the last one's answers (`launch`, then
`finish`: overlapped on cuda). Each row's controls and grammar: engine.logits_controls."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Collection, Sequence

import torch

from .chunked_prefill import ChunkQueue
from .cuda_graphs import DecodeGraphs, PrefillGraphs
from .traced_decode import TracedDecode
from .engine import Engine, oom_as_out_of_memory
from .head import top_k_rows
from .kv_cache import KVCache, SlotStore, blocks_needed
from .padding import forward_parts
from .lora import AdapterRows
from .prefix_cache import PrefixCache, RowPlan, root_for
from .step_forward import PromptRow, packed_forward, prompt_scores
from .logits_controls import TokenHistory, controlled_logits
from .sampling import TOKEN, WARM_UP_PARAMS, choose, read_choices, to_device, to_host
from .steps import Ask, BatchOutput, NewSequence, PackedAnswers, PromptAsk, Running, StepLaunch, StepOutput, StepPlan


class Generator:
    """Owns the KV cache and the running sequences, in slot order. Engine thread only."""

    def __init__(self, engine: Engine, slots: int, capacity_blocks: int | None = None, graphs: bool | None = None,
                 chunk_tokens: int = 0):
        """`slots`: sequences at most; `capacity_blocks`: KV-cache blocks that may be held (see
        engine.kv_cache; default: every slot at full context). `graphs`: decode steps from bucketed
        buffers, replayed as CUDA graphs on cuda (with --cuda-graphs) or run as TorchScript traces on
        a CPU (engine.traced_decode), the default; False: eager, at the exact shape. `chunk_tokens`:
        a prompt whose uncached part is longer is read in chunks of this many tokens, one a step
        (engine.chunked_prefill); 0: never."""
        self.engine, self.model, self.slots, self.n_ctx = engine, engine.model, slots, engine.model.config.n_ctx
        self.capacity_blocks = blocks_needed(slots, self.n_ctx) if capacity_blocks is None else capacity_blocks
        self.cache: KVCache | None = None  # allocated at the first step (or warm-up), not at load
        self.last_ids: torch.Tensor | None = None  # (slots,) on the device: each slot's last sampled token
        self.history: TokenHistory | None = None  # rows with penalties: their tokens, on the device
        self.grammars = engine.grammars  # structured output's compiled grammars
        self.running: list[Running] = []
        self.chunked = ChunkQueue(chunk_tokens)  # long prompts being read, oldest first
        self.use_graphs = (engine.options.cuda_graphs or engine.device.type != "cuda") if graphs is None else graphs
        self.graphs: DecodeGraphs | None = None  # cuda
        self.prefill_graphs: PrefillGraphs | None = None  # cuda: short prompts' prefills (engine.cuda_graphs)
        self.traces: TracedDecode | None = None  # cpu

    def allocate(self) -> KVCache:
        if self.cache is None:
            config = self.model.config
            self.cache = KVCache(config, self.slots, self.capacity_blocks, self.engine.device, self.engine.kv_dtype,
                                 grow=self.engine.device.type != "cuda")
            self.last_ids = torch.zeros(self.slots, dtype=torch.long, device=self.engine.device)
            self.history = TokenHistory(self.slots, config.n_ctx, self.engine.device)  # 4 MiB at 1,024 slots
            if self.use_graphs and self.engine.device.type == "cpu":
                self.traces = TracedDecode(self._decode_logits, self.model, self.cache)
            elif self.use_graphs:
                self.graphs = DecodeGraphs(
                    self._decode_logits, slots=self.slots, n_ctx=config.n_ctx, device=self.engine.device,
                    vocab_size=config.vocab_size, pad_id=self.engine.pad_token_id, capture=self.engine.device.type == "cuda",
                    memory_budget_bytes=int(self.engine.options.cuda_graph_memory_mb * 2**20))
                self.prefill_graphs = self.prefill_buckets(capture=True)
        return self.cache

    def prefill_buckets(self, capture: bool) -> PrefillGraphs:
        """Bucketed prefills (without capture: the same padding and buffers, run eagerly)."""
        config = self.model.config
        return PrefillGraphs(self._prefill_logits, slots=self.slots, n_ctx=config.n_ctx, device=self.engine.device,
                             vocab_size=config.vocab_size, pad_id=self.engine.pad_token_id, capture=capture,
                             memory_budget_bytes=int(self.engine.options.cuda_graph_memory_mb * 2**20))

    def warm_up(self) -> None:
        """Claim the cache and run each kind of step once (first-call allocations, kernel choice)."""
        self.allocate()
        if self.prefill_graphs is not None:  # before any sequence holds a slot: captures write slots from 0
            self.prefill_graphs.warm_up()
        pad = self.engine.pad_token_id
        self.prefill([NewSequence(-1, [pad] * 8, WARM_UP_PARAMS, 0)])
        self.decode()
        if self.takes_riders:  # and a packed step (engine.step_forward), a sequence joining where a slot is free
            self.decode([Ask([pad] * 4)], joining=[NewSequence(-2, [pad] * 8, WARM_UP_PARAMS, 0)][:self.slots - 1])
        self.remove({-1, -2})

    @torch.inference_mode()
    def remove(self, seq_ids: Collection[int]) -> None:
        """Free these sequences' slots: the last running sequence moves into each hole."""
        for i, r in enumerate(self.running):
            if r.seq_id in seq_ids and (not r.finite or r.unread):
                # Its NaNs would stay past the next occupant's length, read there at weight 0
                # (one that leaves with a step unread may have some: nobody has looked yet).
                self.cache.clear(i, r.length + 1)
        i = 0
        while i < len(self.running):
            if self.running[i].seq_id not in seq_ids:
                i += 1
                continue
            last = self.running.pop()
            if i < len(self.running):
                self.cache.move(len(self.running), i, last.length)
                self.last_ids[i] = self.last_ids[len(self.running)]  # a device copy: no wait for the step under way
                if last.history_written:
                    self.history.move(len(self.running), i)
                self.running[i] = last  # checked again: it may be leaving too
        if self.cache is not None:
            self.cache.fit(len(self.running), max((r.length for r in self.running), default=0) + 1)
        self.chunked.drop(seq_ids)

    def prefill(self, sequences: Sequence[NewSequence]) -> StepOutput:  # tests' and benches' short forms
        return self.finish(self.launch(StepPlan(decode=False, joining=sequences)))

    def decode(self, riders: Sequence[PromptAsk] = (), chunk: bool = False, joining: Sequence[NewSequence] = ()):
        return self.finish(self.launch(StepPlan(riders=riders, joining=joining, chunk=self.chunked.chunk_tokens * chunk)))

    @oom_as_out_of_memory
    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> StepLaunch:
        """Queue one step of `plan`'s rows. Its decode rows' last tokens come from last_ids, their
        sampled ones go back there, and their answers to the host by a copy that finish() waits
        for: on cuda nothing here waits for the device unless a prompt rides the step. Joining
        sequences alone are a prefill, answered here: in parts of at most `forward_tokens` on a
        CPU, from a graph on cuda where it holds them; out of memory, it leaves no row behind.
        Riders alone are a next-token batch (engine.engine), queued where a graph holds it."""
        if plan.next_token:
            return self.engine.launch_prompts(plan.riders)
        started, started_ns = time.perf_counter(), time.time_ns()
        self.allocate()  # it may be the first step of all
        if plan.joining and not (plan.riders or plan.chunk or (plan.decode and self.running)):
            answers = self._prefill(plan.joining)
            return StepLaunch([], torch.zeros(0), None, None, 0, started, started_ns, time.perf_counter() - started,
                              answers)
        return self._launch_step(plan, started, started_ns)

    def _prefill(self, sequences: Sequence[NewSequence]) -> PackedAnswers:
        first = len(self.running)
        if first + len(sequences) > self.slots:
            raise ValueError(f"{first + len(sequences)} sequences for {self.slots} cache slots")
        prompts = [s.prompt for s in sequences]

        def forward(plans: list[RowPlan]) -> PackedAnswers:
            graphed = self._prefill_graphed(sequences, prompts, plans, first)
            if graphed is not None:
                return graphed
            parts = forward_parts([len(p) - plan.cached_tokens for p, plan in zip(prompts, plans)],
                                  self.engine.forward_tokens)
            self.cache.reserve(first + len(sequences), max(map(len, prompts)))  # no decode rows: last_ids[:0]
            return PackedAnswers.merged([self._read_rows(None, self.last_ids[:0], [], [], sequences[a:b], [], plans[a:b],
                                                         first + a, pack=True)[1] for a, b in parts], [a for a, _ in parts])

        pool = self.engine.prefix_cache
        try:
            answers = forward([RowPlan(p, []) for p in prompts]) if pool is None else pool.run(
                prompts, forward, lambda out: out.failed_plans, roots=[root_for(s.adapter) for s in sequences])
        except torch.cuda.OutOfMemoryError:
            del self.running[first:]  # all or none: parts that fit leave too (the core splits it)
            raise
        answers.prompt_rows = len(sequences)
        return answers

    def _prefill_graphed(self, sequences: Sequence[NewSequence], prompts: list[list[int]], plans: list[RowPlan],
                         first: int) -> PackedAnswers | None:
        """The prefill from a graph (engine.cuda_graphs): prompts that read and keep nothing in the prefix
        cache, score nothing and take no adapter. None where it does not apply or no bucket holds them."""
        if (self.prefill_graphs is None or any(plan.hit or plan.new for plan in plans)
                or any(s.prompt_logprobs is not None or s.adapter is not None for s in sequences)):
            return None
        shape = self.prefill_graphs.shape_for(prompts)
        if shape is None:
            return None
        # Padding columns write there too, and padding rows their slot (a CPU's cache grows).
        self.cache.reserve(max(first + len(prompts), self.prefill_graphs.padding_slot(first, len(prompts)) + 1),
                           shape[1])
        logits = self.prefill_graphs.run_prefill(prompts, first, shape)  # (P, V)
        if logits is None:  # over the graphs' memory budget
            return None
        added = [Running.of(s) for s in sequences]
        tokens, failed = read_choices(self._sample(logits, added, first, decode=False).cpu().tolist(), added)
        self.running.extend(added)
        return PackedAnswers(first_tokens=tokens, first_failed=failed, cached_tokens={s.seq_id: 0 for s in sequences},
                             prompt_tokens=sum(map(len, prompts)))

    def layer_reports(self, output: BatchOutput) -> BatchOutput:  # a traced batch's, once it is answered
        return self.engine.layer_reports(output)

    @property
    def fixed_cost_tokens(self) -> float:  # what the scheduler weighs padding against (Engine.warm_up)
        return self.engine.fixed_cost_tokens

    def uncached_tokens(self, prompt: Sequence[int], adapter=None) -> int:  # what reading it computes
        return len(prompt) if self.engine.prefix_cache is None else self.engine.prefix_cache.uncached(prompt, adapter)

    def chunk_if_long(self, sequence: NewSequence) -> bool:
        """Queue a long prompt to be read in chunks (engine.chunked_prefill), one chunk a step
        (StepPlan.chunk): more uncached tokens than a chunk, no scores. Whether it was queued."""
        if not self.chunked.reads_in_chunks(sequence, self.uncached_tokens):
            return False
        self.chunked.add(sequence)
        return True

    @property
    def next_chunk(self) -> tuple[int, int] | None:
        """(The sequence whose chunk StepPlan.chunk reads next (the oldest queued), the tokens
        its next chunk reads at most), or None."""
        job = self.chunked.oldest
        return None if job is None else (job.sequence.seq_id, self.chunked.next_tokens)

    @property
    def takes_riders(self) -> bool:
        """Whether prompts (next-token, admitted, a chunk) may ride decode steps
        (engine.step_forward): not where steps replay CUDA graphs, which a packed step could not."""
        graphed = self.graphs is not None or self.prefill_graphs is not None
        return not graphed and not (self.use_graphs and self.engine.device.type == "cuda")

    @property
    def overlaps(self) -> bool:
        """Whether a launched step runs on while the host goes on (a device with its own queue)."""
        return self.engine.device.type == "cuda"

    def _launch_step(self, plan: StepPlan, started: float, started_ns: int) -> StepLaunch:
        riders, chunk, joining = plan.riders, plan.chunk, plan.joining
        rows, device = list(self.running) if plan.decode else [], self.engine.device
        B, lengths = len(rows), [r.length for r in rows]
        needed = max(lengths, default=0) + 1  # positions, with the new token's
        device_started = done = None
        if device.type == "cuda":
            device_started, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            device_started.record()
        last = self.last_ids[:B]  # (B,) on the device
        logits, packed, adapters = None, None, [r.adapter for r in rows]
        replay = not any(adapters)  # CUDA graphs are recorded without LoRA adapters: eager
        lora = None if replay or not plan.decode_only else AdapterRows.of(adapters, 1, device)  # trace's or eager's
        if not plan.decode_only:
            logits, packed = self._packed_step(last, lengths, needed, riders, chunk, joining, adapters)
        elif replay and self.graphs is not None:  # cuda: the whole cache is there; the bucket pads rows and span
            logits = self.graphs.run_decode(last, lengths)
        elif self.traces is not None:  # cpu: a trace per span (and adapters' signature), any number of rows
            span = self.cache.span_for(B, needed)
            self.cache.reserve(B, span)
            logits = self.traces.run(last, torch.tensor(lengths), span, lora)
        if logits is None:  # eager, at the exact batch
            logits = self._decode_logits(last, to_device(lengths, device), self.cache.eager_span(B, needed), lora)
        chosen = self._sample(logits, rows, 0, decode=True) if B else torch.zeros(0)  # (B, 3 + 2n)
        if done is not None:
            chosen = to_host(chosen, done)
        for r in rows:
            r.length += 1
            r.unread += 1
        cached = packed.riders.cached_tokens if packed and packed.riders else ()  # computed: past the cache
        return StepLaunch(rows, chosen, done, device_started, B + sum(len(r.prompt) for r in riders) - sum(cached),
                          started, started_ns, time.perf_counter() - started, packed)

    def finish(self, step: StepLaunch) -> StepOutput:
        """Wait for a launched step's answers (cuda; on a CPU they are there) and read them."""
        if step.prompts is not None:
            return self.engine.finish_prompts(step)
        forward_s = step.forward_s
        if step.done is not None:
            step.done.synchronize()  # lets go of the GIL while it waits
            forward_s = step.device_started.elapsed_time(step.done) / 1000
        tokens, failed = read_choices(step.chosen.tolist(), step.rows) if step.rows else ({}, frozenset())
        for r in step.rows:
            r.unread -= 1
        packed, ended_ns = step.packed or PackedAnswers(), step.started_ns + int(forward_s * 1e9)
        riders = packed.riders and replace(packed.riders, forward_s=forward_s, started_ns=step.started_ns, ended_ns=ended_ns)
        return StepOutput({**tokens, **packed.first_tokens}, "decode" if step.rows else "prefill",
                          len(step.rows) + packed.prompt_rows, step.tokens_in + packed.prompt_tokens, forward_s,
                          step.started_ns, ended_ns, failed | packed.first_failed, prompt_scores=packed.prompt_scores,
                          cached_tokens=packed.cached_tokens, prompt_tokens=packed.prompt_tokens,
                          prompts_read=frozenset(packed.first_tokens), riders=riders)

    def _packed_step(self, last: torch.Tensor, lengths: list[int], needed: int, riders: Sequence[PromptAsk],
                     chunk: int, joining: Sequence[NewSequence], adapters: list) -> tuple[torch.Tensor, PackedAnswers]:
        """One forward (engine.step_forward) of D decode tokens ((D,) `last`, at `needed`
        positions), the riders' prompts and the joining sequences' (each after what the prefix
        cache holds of it; into the next free slots), and the next `chunk` tokens at most of the
        oldest prompt read in chunks, whose sequence joins after them with its last
        -> ((D, V) decode logits, the rest's answers)."""
        device, D, pool, first = self.engine.device, len(last), self.engine.prefix_cache, len(self.running)
        chunk_rows = [self.chunked.next_row(pool, self.model.config.n_layer, chunk)] if chunk else []
        job = self.chunked.oldest if chunk and chunk_rows[0].stop == len(chunk_rows[0].prompt) else None
        if job is not None:  # its last chunk: the sequence joins, its keys into its slot too
            chunk_rows = [replace(chunk_rows[0], slot=first + len(joining))]
        joined = [*joining, *([job.sequence] if job is not None else [])]
        if first + len(joined) > self.slots:
            raise ValueError(f"{first + len(joined)} sequences for {self.slots} cache slots")
        self.cache.reserve(first + len(joined), max([needed, *(len(s.prompt) for s in joined)]))
        decode = SlotStore(self.cache, to_device(lengths, device), self.cache.eager_span(D, needed)) if D else None
        if job is not None:
            job.into_slot(self.cache, first + len(joining))  # its earlier chunks
        prompts = [*(r.prompt for r in riders), *(s.prompt for s in joining)]

        def forward(plans: list[RowPlan]) -> tuple[torch.Tensor, PackedAnswers, torch.Tensor | None]:
            return self._read_rows(decode, last, lengths, riders, joined, chunk_rows, plans, first, adapters=adapters)

        if pool is None or not prompts:
            logits, answers, chunk_hidden = forward([RowPlan(p, []) for p in prompts])
        else:
            roots = [root_for(a.adapter) for a in (*riders, *joining)]
            logits, answers, chunk_hidden = pool.run(prompts, forward, lambda out: out[1].failed_plans, roots=roots)
        answers.prompt_rows = len(joining) + bool(chunk)
        if chunk:  # (T, C) chunk_hidden: the chunk's residual stream, for its blocks
            answers.prompt_tokens += len(chunk_rows[0].tokens)
            self.chunked.read(chunk_rows[0], chunk_hidden, pool)
        if job is not None:
            answers.cached_tokens[job.sequence.seq_id] = job.cached
            if pool is not None:
                job.fill_pool(pool, job.sequence.seq_id in answers.first_failed)
        return logits, answers

    def _read_rows(self, decode: SlotStore | None, last: torch.Tensor, lengths: Sequence[int],
                   riders: Sequence[PromptAsk], joined: Sequence[NewSequence], chunk_rows: list[PromptRow],
                   plans: list[RowPlan], first: int, pack: bool = False, adapters: Sequence = ()
                   ) -> tuple[torch.Tensor, PackedAnswers, torch.Tensor | None]:
        """The packed forward of a step's rows (`plans`: the riders', then the joining prompts');
        the joined (the joining, then a chunk's whose last chunk is read) take slots first, ... and
        first tokens -> ((D, V) decode logits, the answers, the chunk's (T, C) residual stream or
        None). `pack`: the shared layout where cheaper, again in rows if it poisoned two rows."""
        D, R, J, pool = len(last), len(riders), len(joined), self.engine.prefix_cache
        for i, plan in enumerate(plans[R:]):
            if plan.hit:  # into its slot, for its decode steps
                self.cache.copy_in(first + i, pool.keys, pool.values, PrefixCache.positions(plan.hit))
        rows = [PromptRow.planned(plan, None if i < R else first + i - R, ask.adapter)
                for i, (plan, ask) in enumerate(zip(plans, (*riders, *joined)))]
        a, top, failed = PackedAnswers(), [], frozenset()
        for pack in (True, False) if pack else (False,):
            hidden, layout = packed_forward(self.model, decode, last, lengths, rows + chunk_rows, pool, plans,
                                            self.cache, pack, adapters)  # (1, N, C)
            wanted = torch.cat((torch.arange(D, device=hidden.device), layout.last[:R + J]))
            logits = self.model.head(hidden[0, wanted])  # (D + R + J, V)
            if R:
                top, failed = top_k_rows(torch.log_softmax(logits[D:D + R].float(), dim=-1), [r.top_k for r in riders])
            added = [Running.of(s) for s in joined]
            if J:  # their first tokens, into last_ids, brought over in one copy
                chosen = self._sample(logits[D + R:], added, first, decode=False).cpu().tolist()
                a.first_tokens, a.first_failed = read_choices(chosen, added)
            if not layout.needs_rows_again([*failed, *a.first_failed]):
                break
        self.running.extend(added)
        wants = [*(r.prompt_logprobs for r in riders), *(s.prompt_logprobs for s in joined)]
        scores = prompt_scores(hidden, layout, pool, {i: k for i, k in enumerate(wants[:len(rows)]) if k is not None},
                               self.model.head, self.model.config.vocab_size)
        if R:  # timed when the step is read (finish)
            a.riders = BatchOutput(top, 0.0, max(len(r.prompt) for r in riders), 0, 0, failed_rows=failed,
                                   prompt_scores={i: score for i, score in scores.items() if i < R},
                                   cached_tokens=[r.start for r in rows[:R]] if pool is not None else [])
        a.prompt_scores = {joined[i - R].seq_id: score for i, score in scores.items() if i >= R}
        a.cached_tokens = {s.seq_id: r.start for s, r in zip(joined, rows[R:])}
        a.prompt_tokens = sum(len(r.tokens) for r in rows[R:])
        a.failed_plans = [*failed, *(R + i for i, s in enumerate(joined[:len(rows) - R])
                                             if s.seq_id in a.first_failed)]
        return logits[:D], a, hidden[0, layout.firsts[-1]:] if chunk_rows else None

    def _decode_logits(self, last: torch.Tensor, positions: torch.Tensor, span: int,
                       adapters: AdapterRows | None = None) -> torch.Tensor:
        """(B,) last tokens at (B,) positions -> (B, V) logits; keys over the first `span` positions
        of slots 0..B-1. What a decode graph captures (without adapters)."""
        store = SlotStore(self.cache, positions, span)
        hidden = self.model.hidden_states(last[:, None], positions[:, None], None, kv=store, mask=store.mask(),
                                          adapters=adapters)  # (B, 1, C)
        return self.model.head(hidden[:, -1])  # (B, V)

    def _prefill_logits(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                        last: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """(B, T) right-padded prompts into their slots (B,) -> (B, V) logits after each row's
        `last` column; rows not `real` (B,) change no slot. What a prefill graph captures."""
        store = SlotStore(self.cache, positions, ids.shape[1], slots, real)
        hidden = self.model.hidden_states(ids, positions, None, kv=store)  # (B, T, C)
        return self.model.head(hidden[torch.arange(len(ids), device=ids.device), last])  # (B, V)

    def _sample(self, logits: torch.Tensor, rows: Sequence[Running], first_slot: int, decode: bool) -> torch.Tensor:
        """choose() each row's token under its controls (engine.logits_controls), into last_ids
        (and the token history of rows with penalties) from `first_slot` on; (B, 3 + 2n)."""
        slots = range(first_slot, first_slot + len(rows))
        generated = [r.length - r.prompt_length + decode for r in rows]  # a decode feeds one not yet in the cache
        controlled = controlled_logits(logits, rows, slots, generated, self.history, self.grammars)
        chosen = choose(logits, [r.params for r in rows], [r.rng.random() for r in rows], controlled)  # (B, 3 + 2n)
        self.last_ids[first_slot:first_slot + len(rows)] = chosen[:, TOKEN]  # the next step's inputs, on the device
        kept = [i for i, r in enumerate(rows) if r.history_written]
        if kept:
            self.history.record([slots[i] for i in kept], [rows[i].prompt_length + generated[i] for i in kept],
                                chosen[to_device(kept, chosen.device), TOKEN])
        return chosen
