"""Long prompts prefilled in chunks: one chunk a step, in the same forward as the running
sequences' decode step (engine.step_forward) where it can, so a long prompt never stalls them
for its whole prefill (vLLM's chunked prefill).

A prompt whose uncached part is longer than the chunk (--prefill-chunk-tokens) becomes a
ChunkedPrefill. Each step computes its next chunk: the chunk's queries attend over the keys
staged so far (the prompt's earlier chunks, and the blocks it found in the prefix cache) and
their own, causally. Its keys, values and residual stream are staged outside the KV cache, so
the sequence holds no cache slot while it is read (decode steps, CUDA graphs included, never see
it). The last chunk gives the first token; the staged keys and values then go into a slot, and
the prompt's full blocks into the prefix cache (a doorkeeper and hit as for any prompt), so a
chunked prompt is found there next time like any other.

Only generations without prompt log-probabilities are chunked (scoring reads every position's
hidden state at once); they wait their turn, one chunk of one prompt a step, oldest first.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Collection

import torch

from .kv_cache import KVCache
from .prefix_cache import BLOCK, PrefixCache, root_for
from .step_forward import PromptRow


@dataclass(eq=False)
class ChunkedPrefill:
    """One prompt being read in chunks: `done` of its tokens are staged (`cached` of them copied
    from the prefix cache)."""

    sequence: object  # engine.generator.NewSequence
    done: int = 0
    cached: int = 0
    keys: list[torch.Tensor] = field(default_factory=list)  # per layer (1, nh, L, hs)
    values: list[torch.Tensor] = field(default_factory=list)
    hidden: torch.Tensor | None = None  # (L, C): the residual stream, for the prefix cache's blocks

    @property
    def prompt(self) -> list[int]:
        return self.sequence.prompt

    def staging(self, layer: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's staged keys and values, made at the first chunk (in `like`'s dtype: the
        forward's own, whatever the cache keeps)."""
        if len(self.keys) <= layer:
            _, nh, _, hs = like.shape
            shape = (1, nh, len(self.prompt), hs)
            self.keys.append(torch.zeros(shape, dtype=like.dtype, device=like.device))
            self.values.append(torch.zeros(shape, dtype=like.dtype, device=like.device))
        return self.keys[layer], self.values[layer]

    def take_hits(self, pool: PrefixCache | None, n_layer: int) -> None:
        """Before the first chunk: the prompt's blocks found in the prefix cache become its first
        staged tokens (copied now, so nothing has to stay pinned in the pool between steps)."""
        if pool is None:
            return
        root = root_for(self.sequence.adapter)
        positions = torch.tensor(PrefixCache.positions(pool.match(self.prompt, root)), dtype=torch.long,
                                 device=pool.device)  # (c,)
        c = len(positions)
        if not c:
            return
        self.hidden = torch.zeros(len(self.prompt), pool.hidden.shape[1], dtype=pool.dtype, device=pool.device)
        self.hidden[:c] = pool.hidden[positions]
        for layer in range(n_layer):
            keys, values = self.staging(layer, pool.keys[layer, :1].transpose(0, 1)[None])
            keys[0, :, :c] = pool.keys[layer, positions].transpose(0, 1)  # (nh, c, hs)
            values[0, :, :c] = pool.values[layer, positions].transpose(0, 1)
        self.done = self.cached = c

    def into_slot(self, cache: KVCache, slot: int) -> None:
        """The whole prompt's staged keys and values into its KV-cache slot."""
        length = len(self.prompt)
        cache.keys[:, slot, :, :length] = torch.cat(self.keys)  # (n_layer, nh, L, hs)
        cache.values[:, slot, :, :length] = torch.cat(self.values)

    def keep_hidden(self, start: int, hidden: torch.Tensor) -> None:
        """(T, C) residual stream of the chunk from `start`."""
        if self.hidden is None:
            self.hidden = torch.zeros(len(self.prompt), hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
        self.hidden[start:start + len(hidden)] = hidden

    def fill_pool(self, pool: PrefixCache, failed: bool) -> None:
        """The whole prompt's full blocks into the prefix cache, as a prefill's would go: planned
        now (the doorkeeper decides), written from the staging, indexed unless it failed."""

        def write(plans):
            plan = plans[0]
            if plan.new:
                start, n = plan.cached_tokens, len(plan.new) * BLOCK
                positions = torch.tensor(PrefixCache.positions(plan.new), dtype=torch.long, device=pool.device)
                for layer, (keys, values) in enumerate(zip(self.keys, self.values)):
                    pool.keys[layer, positions] = keys[0, :, start:start + n].transpose(0, 1).to(pool.dtype)
                    pool.values[layer, positions] = values[0, :, start:start + n].transpose(0, 1).to(pool.dtype)
                pool.hidden[positions] = self.hidden[start:start + n].to(pool.dtype)
            return failed

        pool.run([self.prompt], write, lambda failed_: [0] if failed_ else [], roots=[root_for(self.sequence.adapter)])


class ChunkQueue:
    """The prompts being read in chunks, oldest first: `chunk_tokens` of the oldest one a step
    (0: none is ever chunked)."""

    def __init__(self, chunk_tokens: int):
        self.chunk_tokens = chunk_tokens
        self.jobs: deque[ChunkedPrefill] = deque()

    def __bool__(self) -> bool:
        return bool(self.jobs)

    @property
    def oldest(self) -> ChunkedPrefill | None:
        return self.jobs[0] if self.jobs else None

    def reads_in_chunks(self, sequence, uncached: Callable[[list[int], object], int]) -> bool:
        """More uncached tokens (`uncached(prompt, adapter)`) than a chunk, and no scores (scoring
        reads every position's hidden state at once)."""
        if not self.chunk_tokens or sequence.prompt_logprobs is not None or len(sequence.prompt) <= self.chunk_tokens:
            return False
        return uncached(sequence.prompt, sequence.adapter) > self.chunk_tokens

    def add(self, sequence) -> None:
        self.jobs.append(ChunkedPrefill(sequence))

    def drop(self, seq_ids: Collection[int]) -> None:
        if any(job.sequence.seq_id in seq_ids for job in self.jobs):
            self.jobs = deque(job for job in self.jobs if job.sequence.seq_id not in seq_ids)

    @property
    def next_tokens(self) -> int:
        """What the oldest prompt's next chunk reads at most (less where its first finds blocks
        in the prefix cache)."""
        job = self.jobs[0]
        return min(self.chunk_tokens, len(job.prompt) - job.done)

    def next_row(self, pool: PrefixCache | None, n_layer: int, tokens: int) -> PromptRow:
        """The oldest prompt's next chunk, at most `tokens` (and --prefill-chunk-tokens), as a row
        of a step (engine.step_forward); before its first, the blocks it finds in the prefix
        cache are staged."""
        job = self.jobs[0]
        if not job.done:
            job.take_hits(pool, n_layer)
        stop = min(job.done + min(tokens, self.chunk_tokens), len(job.prompt))
        return PromptRow(job.prompt, job.done, stop, staging=job, adapter=job.sequence.adapter)

    def read(self, row: PromptRow, hidden: torch.Tensor, pool: PrefixCache | None) -> None:
        """`row` was computed, (T, C) `hidden` its residual stream; its job leaves the queue when
        that was its last chunk."""
        job = self.jobs[0]
        if pool is not None:  # for the prompt's blocks
            job.keep_hidden(row.start, hidden)
        job.done = row.stop
        if job.done == len(job.prompt):
            self.jobs.popleft()
