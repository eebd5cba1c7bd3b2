"""Long prompts prefilled in chunks: one chunk a step, between the running sequences' decode
steps, so a long prompt never stalls them for its whole prefill (vLLM's chunked prefill).

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

from dataclasses import dataclass, field

import torch

from .kv_cache import KVCache
from .prefix_cache import BLOCK, PrefixCache
from .sampling import to_device


class ChunkStore:
    """A KeyValueStore (engine.gpt2) for one chunk of a ChunkedPrefill: its keys and values go
    into the staging, and its queries attend over the staging up to their own position."""

    def __init__(self, job: ChunkedPrefill, start: int, end: int):
        self.job, self.start, self.end = job, start, end

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        return None  # attend, then the model's own kernel with the mask below

    def attend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.job.staging(layer, k)  # (1, nh, L, hs) each
        keys[:, :, self.start:self.end] = k  # k, v: (1, nh, T, hs), this chunk's
        values[:, :, self.start:self.end] = v
        return keys[:, :, :self.end], values[:, :, :self.end]  # (1, nh, end, hs)

    def mask(self, device: torch.device) -> torch.Tensor:
        """(1, 1, T, end): every staged key before the chunk, then its own keys causally."""
        T = self.end - self.start
        before = torch.ones(T, self.start, dtype=torch.bool, device=device)
        own = torch.ones(T, T, dtype=torch.bool, device=device).tril()
        return torch.cat([before, own], dim=1)[None, None]


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
        positions = torch.tensor(PrefixCache.positions(pool.match(self.prompt)), dtype=torch.long,
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

    def read_chunk(self, model, chunk_tokens: int, pool: PrefixCache | None) -> torch.Tensor:
        """Compute the next chunk (the prompt's cached blocks are taken first); returns (1, C),
        the residual stream at its last token."""
        if not self.done:
            self.take_hits(pool, model.config.n_layer)
        start, end = self.done, min(self.done + chunk_tokens, len(self.prompt))
        device = model.wte.weight.device
        store = ChunkStore(self, start, end)
        ids = to_device(self.prompt[start:end], device)[None]  # (1, T)
        positions = torch.arange(start, end, device=device)[None]  # (1, T)
        hidden = model.hidden_states(ids, positions, None, kv=store, mask=store.mask(device))  # (1, T, C)
        if pool is not None:
            self.keep_hidden(start, hidden[0])
        self.done = end
        return hidden[:, -1]

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

        pool.run([self.prompt], write, lambda failed_: [0] if failed_ else [])
