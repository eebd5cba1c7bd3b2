"""Forwards at bucketed shapes from static buffers; on cuda, replayed as captured CUDA graphs.

GPT-2 small's eager forward is launch-bound on a GPU: about 174 kernel launches and 8 ms of
host time while the device is busy about 1 ms (issue 11, H100). A CUDA graph replays all of
them in one launch, but only for the shapes it was captured with. So a batch is padded up to a
bucket (engine.padding.Buckets): extra rows are all padding, extra columns are left padding,
and the mask keeps both out of every real row's answer.

Each bucket owns a (3, B, T) input buffer on the device. Every bucket writes its log-probs into
one shared (max batch, V) output buffer, and all graphs share one memory pool: a replay's
intermediates are dead once it returns, and replays never overlap (one engine thread).
Graphs for common shapes are captured at warm-up, the rest at their first launch (from that
launch's own inputs) while the memory they took stays within the budget; other shapes run
eagerly. Without capture (on the CPU, in tests) the same buffers and padding run eagerly, so
that path is tested everywhere.

Three kinds of step run so (every CUDA graph of the engine is in this module):
- next-token batches (`BucketedForward`), left-padded into (3, B, T): ids, positions, real;
- decode steps (`DecodeGraphs`): the most launch-bound forward there is (one token per row), run
  once per generated token, bucketed by (rows, attention span). Rows past the running ones are
  padding: they feed the pad token at position 0 of slots no sequence holds (the cache keeps
  running sequences in slots 0..n-1), which a prefill overwrites before use;
- prefills of short prompts (`PrefillGraphs`): an eager prefill of GPT-2 small is about 2,800
  torch calls from Python for 16 prompts of 5 tokens, and took 20.5 ms a step on an H100 at 16
  sequences (fcf3306, bench --generate at 1 to 256 streams) against 1.5 ms for a decode step of
  36, stalling every running stream. Prompts that need nothing from the prefix cache (no cached
  block to read, no new block to keep: engine.step_forward does those) are captured per bucket
  (rows, columns), right-padded, so attention is causal and a real token never sees padding.
  Each row writes its keys and values at positions 0..T-1 of its own slot (columns past its
  prompt write positions past its length, which the decode mask hides and the next decode steps
  overwrite). Rows past the prompts are padding: they all target one slot that is not a new
  one's (the first after them, or where the cache is full the last before them) and write back
  what is there, so they change nothing, whichever of them lands last
  (engine.kv_cache.SlotStore). Their (3, B, T) buffer holds ids, positions, and in its third
  plane each row's slot, last real column and whether it is real.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .head import top_k_table
from .padding import IDS, POSITIONS, VALID, Buckets, batch_buckets, left_pad_into, length_buckets
from .sampling import to_host
from .steps import PromptLaunch

log = logging.getLogger(__name__)
WARM_UP_STEPS = 2  # eager runs on a side stream before a capture: kernels chosen, workspaces made

# (B, T) ids, (B, T) positions, (B, T) bool real-token mask -> (B, V) fp32 log-probs
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class _Bucket:
    inputs: torch.Tensor  # (3, B, T) int64 on the device: what the graph reads
    shape: tuple[int, int]
    graph: torch.cuda.CUDAGraph | None = None  # None: run eagerly from the same buffers
    capture: bool = False  # to be captured at its first launch


class BucketedForward:
    def __init__(self, forward: Forward, buckets: Buckets, *, device: torch.device, vocab_size: int, pad_id: int,
                 capture: bool, memory_budget_bytes: int):
        self.forward = forward
        self.buckets = buckets
        self.device = device
        self.pad_id = pad_id
        self.capture = capture
        self.memory_budget_bytes = memory_budget_bytes
        self.memory_used_bytes = 0  # device memory the captures took (reserved by their pool)
        max_batch, max_len = buckets.batch[-1], buckets.length[-1]
        self.output = torch.empty(max_batch, vocab_size, dtype=torch.float32, device=device)  # (B_max, V)
        # Host staging for the inputs on a CPU; on cuda each run stages into pinned memory of its own
        # (the copy to the device is asynchronous, and a batch launched before may still be copying:
        # `launch`).
        self.staging = torch.empty(3 * max_batch * max_len, dtype=torch.long) if device.type != "cuda" else None
        self.ready: dict[tuple[int, int], _Bucket] = {}
        self.refused: set[tuple[int, int]] = set()  # over the memory budget, or the capture failed
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    @property
    def graphs(self) -> int:
        return sum(bucket.graph is not None for bucket in self.ready.values())

    @torch.inference_mode()
    def run(self, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, tuple[int, int]] | None:
        """(P, V) fp32 log-probs of the next token for each prompt, a view of the shared output
        (valid until the next run), and the bucket shape it ran at; None when this shape has no
        bucket (run it eagerly)."""
        shape = self.buckets.shape_for(len(prompts), max(len(p) for p in prompts))
        bucket = self._bucket(shape) if shape is not None else None
        if bucket is None:
            return None
        batch, length = shape
        staging = (self.staging[:3 * batch * length] if self.staging is not None
                   else torch.empty(3 * batch * length, dtype=torch.long, pin_memory=True))
        staged = left_pad_into(staging.view(3, batch, length), prompts, self.pad_id)
        bucket.inputs.copy_(staged, non_blocking=True)
        self._launch(bucket)
        return self.output[:len(prompts)], shape

    @torch.inference_mode()
    def launch(self, prompts: Sequence[Sequence[int]], top_ks: Sequence[int], looked_up: bool) -> PromptLaunch | None:
        """Queue a plain next-token batch and its top-k, not waited for (PromptLaunch.read waits);
        None where no bucket holds it. The engine core launches the next batch before it reads
        this one (scheduling.runner), as it does decode steps: on an H100 (fcf3306)
        NextTokenBatch served 0.52 of the engine's in-process rate at batch 256 when the host's
        share of a batch (its answers) came on top of the device's instead of beside it."""
        started, started_ns = time.perf_counter(), time.time_ns()
        on_cuda = self.device.type == "cuda"
        device_started = done = None
        if on_cuda:
            device_started, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            device_started.record()
        replayed = self.run(prompts)
        if replayed is None:
            return None
        logprobs, (_, length) = replayed  # (P, V), a view of the shared output
        both = top_k_table(logprobs, top_ks)  # (2, P, k_max)
        if on_cuda:
            both = to_host(both, done)
        return PromptLaunch(both, done, device_started, list(top_ks), length, started, started_ns, looked_up)

    @torch.inference_mode()
    def warm_up(self, shapes: Sequence[tuple[int, int]]) -> None:
        """Capture these bucket shapes now, largest first, so the shared pool is sized once.
        From the buckets' initial inputs: only before anything runs that their step could
        overwrite (a generation's steps write the KV cache)."""
        for shape in sorted(shapes, key=lambda s: s[0] * s[1], reverse=True):
            bucket = self._bucket(shape)
            if bucket is not None:
                self._capture_once(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        """Run the bucket's step from its inputs as they stand: replayed, captured first if it
        has not been. Capture comes after the inputs are in place because its warm-up runs
        execute the step: from the real inputs they write only what the replay writes again (a
        decode or prefill step writes its rows' keys and values into the KV cache), where
        placeholder inputs would have written over running sequences' slots."""
        self._capture_once(bucket)
        if bucket.graph is not None:
            bucket.graph.replay()
        else:
            self._step(bucket)

    def _step(self, bucket: _Bucket) -> None:
        """The captured computation: the forward from the bucket's inputs into the shared output."""
        inputs = bucket.inputs
        logprobs = self.forward(inputs[IDS], inputs[POSITIONS], inputs[VALID].bool())  # (B, V)
        self.output[:inputs.shape[1]].copy_(logprobs)

    def _new_inputs(self, shape: tuple[int, int]) -> torch.Tensor:
        return torch.zeros((3, *shape), dtype=torch.long, device=self.device)  # (3, B, T)

    def _bucket(self, shape: tuple[int, int]) -> _Bucket | None:
        """The bucket for this shape, made if new (its graph is captured at its first launch);
        None once the graphs' memory budget is spent (that shape runs eagerly, at its own size)."""
        if shape in self.ready:
            return self.ready[shape]
        if shape in self.refused:
            return None
        if self.capture and self.memory_used_bytes >= self.memory_budget_bytes:
            log.info("CUDA graph memory budget spent (%.0f MiB): shape %s runs eagerly",
                     self.memory_used_bytes / 2**20, shape)
            self.refused.add(shape)
            return None
        bucket = self.ready[shape] = _Bucket(self._new_inputs(shape), shape, capture=self.capture)
        return bucket

    def _capture_once(self, bucket: _Bucket) -> None:
        if not bucket.capture:
            return
        bucket.capture = False  # one try: a shape that cannot be captured runs eagerly from its buffers
        try:
            bucket.graph = self._capture(bucket)
        except RuntimeError as exc:  # out of memory, or an op that cannot be captured
            torch.cuda.empty_cache()
            log.warning("capturing a CUDA graph for shape %s failed (%s); it runs eagerly", bucket.shape,
                        str(exc).splitlines()[0])

    def _capture(self, bucket: _Bucket) -> torch.cuda.CUDAGraph:
        reserved = torch.cuda.memory_reserved(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARM_UP_STEPS):
                self._step(bucket)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self._step(bucket)
        self.memory_used_bytes += max(torch.cuda.memory_reserved(self.device) - reserved, 0)
        return graph


# Decode steps ----------------------------------------------------------------------------------
DECODE_MIN_SPAN = 64  # (rows, span) buckets' shortest span

# (B,) tokens, (B,) positions, span -> (B, V) logits
DecodeForward = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


class DecodeGraphs(BucketedForward):
    def __init__(self, forward: DecodeForward, *, slots: int, n_ctx: int, device: torch.device, vocab_size: int,
                 pad_id: int, capture: bool, memory_budget_bytes: int):
        buckets = Buckets(tuple(batch_buckets(slots)), tuple(length_buckets(n_ctx, DECODE_MIN_SPAN)))
        super().__init__(forward, buckets, device=device, vocab_size=vocab_size, pad_id=pad_id, capture=capture,
                         memory_budget_bytes=memory_budget_bytes)

    @torch.inference_mode()
    def run_decode(self, tokens: torch.Tensor, positions: Sequence[int]) -> torch.Tensor | None:
        """(B,) tokens on the device (the generator's last_ids) at these positions -> (B, V) logits
        for the rows' next tokens, a view of the shared output (valid until the next run); None
        when no bucket holds this step (run it eagerly). Waits for nothing: the positions go
        through a pinned buffer of their own (the last step's may still be in flight, its copy
        from its own buffer not yet done)."""
        shape = self.buckets.shape_for(len(tokens), max(positions) + 1)
        bucket = self._bucket(shape) if shape is not None else None
        if bucket is None:
            return None
        rows = len(tokens)
        staged = torch.zeros(shape[0], dtype=torch.long, pin_memory=self.device.type == "cuda")  # (B_bucket,)
        staged[:rows] = torch.tensor(positions)
        bucket.inputs[POSITIONS].copy_(staged, non_blocking=True)
        bucket.inputs[IDS, :rows].copy_(tokens)
        bucket.inputs[IDS, rows:] = self.pad_id
        self._launch(bucket)
        return self.output[:rows]

    def _new_inputs(self, shape: tuple[int, int]) -> torch.Tensor:
        return torch.zeros((2, shape[0]), dtype=torch.long, device=self.device)  # (2, B): tokens (IDS), positions

    def _step(self, bucket: _Bucket) -> None:
        inputs = bucket.inputs
        logits = self.forward(inputs[IDS], inputs[POSITIONS], bucket.shape[1])  # (B, V), span from the bucket
        self.output[:inputs.shape[1]].copy_(logits)


# Prefills ----------------------------------------------------------------------------------------
PREFILL_MAX_LEN = 128  # longest prompt prefilled from a graph; longer ones are few and their forward is not launch-bound
PREFILL_MIN_LEN = 8
PREFILL_WARM_LEN = 8  # the column bucket captured at warm-up for every row bucket (short prompts); others lazily
ROWS = 2  # the prefill buffer's third plane (after IDS and POSITIONS): per row, these columns
SLOT, LAST, REAL = 0, 1, 2

# (B, T) ids, (B, T) positions, (B,) slots, (B,) last columns, (B,) bool real rows (else padding)
#   -> (B, V) logits after each row's last token
PrefillForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class PrefillGraphs(BucketedForward):
    def __init__(self, forward: PrefillForward, *, slots: int, n_ctx: int, device: torch.device, vocab_size: int,
                 pad_id: int, capture: bool, memory_budget_bytes: int):
        self.slots = slots
        buckets = Buckets(tuple(batch_buckets(slots)), tuple(length_buckets(min(n_ctx, PREFILL_MAX_LEN), PREFILL_MIN_LEN)))
        super().__init__(forward, buckets, device=device, vocab_size=vocab_size, pad_id=pad_id, capture=capture,
                         memory_budget_bytes=memory_budget_bytes)

    def warm_up(self, shapes: Sequence[tuple[int, int]] | None = None) -> None:
        """Capture every row bucket at PREFILL_WARM_LEN columns (the default), largest first."""
        super().warm_up(shapes if shapes is not None else [(b, PREFILL_WARM_LEN) for b in self.buckets.batch])

    def shape_for(self, prompts: Sequence[Sequence[int]]) -> tuple[int, int] | None:
        """The bucket these prompts would run at; None: prefill them eagerly (too long)."""
        return self.buckets.shape_for(len(prompts), max(len(p) for p in prompts))

    def padding_slot(self, first_slot: int, count: int) -> int:
        """The one slot every padding row of a prefill into slots first_slot .. first_slot +
        count - 1 targets: not a new one's, the first after them or, where the cache is full, the
        last before them (a full cache with padding rows has running sequences before the new)."""
        return first_slot + count if first_slot + count < self.slots else first_slot - 1

    @torch.inference_mode()
    def run_prefill(self, prompts: Sequence[Sequence[int]], first_slot: int,
                    shape: tuple[int, int]) -> torch.Tensor | None:
        """Each prompt's keys and values into slots first_slot, first_slot + 1, ... (all within
        the slots) and (P, V) logits of the token after each one, a view of the shared output
        (valid until the next run), at bucket `shape` (shape_for); None over the graphs' memory
        budget."""
        bucket = self._bucket(shape)
        if bucket is None:
            return None
        B, T = shape
        # A buffer of its own, pinned on cuda (an asynchronous copy), as every launch stages its inputs.
        staged = torch.empty((3, B, T), dtype=torch.long, pin_memory=self.device.type == "cuda")
        staged[IDS].fill_(self.pad_id)
        staged[POSITIONS] = torch.arange(T)  # padding columns and rows too: in range, never read
        staged[ROWS].zero_()
        P = len(prompts)
        staged[ROWS, :P, SLOT] = torch.arange(first_slot, first_slot + P)
        staged[ROWS, :P, REAL] = 1
        staged[ROWS, P:, SLOT] = self.padding_slot(first_slot, P)
        for row, prompt in enumerate(prompts):
            staged[IDS, row, :len(prompt)] = torch.tensor(prompt, dtype=torch.long)
            staged[ROWS, row, LAST] = len(prompt) - 1
        bucket.inputs.copy_(staged, non_blocking=True)
        self._launch(bucket)
        return self.output[:len(prompts)]

    def _new_inputs(self, shape: tuple[int, int]) -> torch.Tensor:
        inputs = torch.zeros((3, *shape), dtype=torch.long, device=self.device)  # (3, B, T)
        inputs[POSITIONS] = torch.arange(shape[1], device=self.device)
        inputs[ROWS, :, SLOT] = torch.arange(shape[0], device=self.device)  # distinct slots for the capture's runs
        inputs[ROWS, :, REAL] = 1
        return inputs

    def _step(self, bucket: _Bucket) -> None:
        inputs = bucket.inputs
        rows = inputs[ROWS]  # (B, T): slot, last column and real in the first three columns
        logits = self.forward(inputs[IDS], inputs[POSITIONS], rows[:, SLOT], rows[:, LAST],
                              rows[:, REAL].bool())  # (B, V)
        self.output[:inputs.shape[1]].copy_(logits)
