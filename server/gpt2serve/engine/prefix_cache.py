"""Automatic prefix caching: the keys and values of prompt blocks already computed, kept for the
next prompt that starts with the same tokens (vLLM's automatic prefix caching, SGLang's radix
cache; see DESIGN for which parts we took).

A prompt is cut into blocks of BLOCK tokens. A full block is known by its tokens and the block
before it, so a block stands for the whole prefix up to its end, and a lookup walks the prompt's
blocks from the first while they are cached: a tree of blocks (a radix tree cut at block
edges). The index maps (parent block, tokens) to a block, with the tokens compared, not only
hashed, so two prompts can never share a block by collision.

What a block holds, in one pool claimed at start (pages on a CPU are touched only as blocks are
written, so resident memory follows use up to the budget):
    keys, values  (n_layer, NB * BLOCK, nh, hs)  every layer's keys and values of its positions
    hidden        (NB * BLOCK, C)                the residual stream after the last block there,
                                                 so a scored prompt's cached positions still get
                                                 their log-probabilities (engine.head)
Block 0 is all zeros and never given out: it pads the rows of a gather (engine.step_forward).

Life of a block:
    free ─ allocate() ─> written by a forward ─ commit() ─> cached (in the index, LRU order)
                                  └─ release() (the forward failed) ─> free, never indexed
    cached ─ evicted (least recently used leaf, when allocate() needs room) ─> free
A block is written the second time its prefix is seen, not the first (a doorkeeper, as in
TinyLFU's admission): each full block's chain digest is remembered (a bounded LRU set of
DOORKEEPER_PER_BLOCK x capacity digests), and only blocks already remembered get a pool block.
Prompts that never repeat then cost a hash per block instead of a copy of every layer's keys and
values (3.5% of a 16 x 64-token forward on a 2-core CPU, bench/engine/prefix_cache.py); a shared prefix
is computed twice before it is served from the cache (prompts of one batch count as seen
by the rows after them, so four continuations of one context in a batch admit it at once).

A block enters the index only after the forward that wrote it returned finite numbers, so a
failed or interrupted forward leaves nothing a later prompt could hit. Only leaves are evicted
(a block's parent is touched whenever the block is, later), and never a block pinned by the
forward under way; running generations hold copies in their own KV-cache slots
(engine.kv_cache), so nothing outlives one engine call.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Collection, Sequence, TypeVar

import torch

from .gpt2 import GPT2Config

BLOCK = 16  # tokens: vLLM's default block; 800 shared tokens then leave at most 15 to compute again
NULL_BLOCK = 0
ROOT = -1  # the parent of a prompt's first block; an adapter's prompts hang under a root of their own
DOORKEEPER_PER_BLOCK = 4  # digests remembered per block of capacity
Output = TypeVar("Output")


def full_blocks(length: int) -> int:
    return length // BLOCK


def root_for(adapter) -> int:
    """The parent of a prompt's first block: ROOT for the base, one root per loaded LoRA adapter
    (engine.lora), so a prefix computed under one adapter is never read under another."""
    return ROOT if adapter is None else ROOT - adapter.uid


@dataclass
class _Entry:
    parent: int
    tokens: tuple[int, ...]
    children: int = 0


@dataclass
class RowPlan:
    """One prompt's part of a forward: the cached blocks it starts with and the new ones it fills."""

    tokens: Sequence[int]
    hit: list[int]  # cached blocks, from the prompt's first token
    new: list[int] = field(default_factory=list)  # allocated for the full blocks after them
    root: int = ROOT  # root_for(its adapter)

    @property
    def cached_tokens(self) -> int:
        return len(self.hit) * BLOCK

    def new_block_tokens(self, i: int) -> tuple[int, ...]:
        start = (len(self.hit) + i) * BLOCK
        return tuple(self.tokens[start:start + BLOCK])


class PrefixCache:
    """Block bookkeeping and the pool. Engine thread only."""

    def __init__(self, config: GPT2Config, capacity_blocks: int, device: torch.device, dtype: torch.dtype,
                 doorkeeper: bool = True):
        """`doorkeeper`: keep a block the second time its prefix is seen (False: the first)."""
        self.config, self.device, self.dtype = config, device, dtype
        self._seen: OrderedDict[int, None] | None = OrderedDict() if doorkeeper else None  # chain digests
        self._seen_max = max(DOORKEEPER_PER_BLOCK * capacity_blocks, 1024)
        self.capacity_blocks = capacity_blocks
        positions = (capacity_blocks + 1) * BLOCK  # + the null block
        shape = (config.n_layer, positions, config.n_head, config.d_head)
        self.keys = torch.empty(shape, device=device, dtype=dtype)  # (n_layer, NB * BLOCK, nh, hs)
        self.values = torch.empty(shape, device=device, dtype=dtype)
        self.hidden = torch.empty((positions, config.d_model), device=device, dtype=dtype)  # (NB * BLOCK, C)
        for pool in (self.keys[:, :BLOCK], self.values[:, :BLOCK], self.hidden[:BLOCK]):
            pool.zero_()  # the null block
        self._index: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent, tokens) -> block
        self._entries: dict[int, _Entry] = {}  # cached blocks
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached blocks, least recently used first
        self._free = list(range(capacity_blocks, 0, -1))  # pop() gives the lowest first

    @staticmethod
    def bytes_per_block(config: GPT2Config, dtype: torch.dtype) -> int:
        """Keys, values and the last residual stream of BLOCK positions."""
        per_token = (2 * config.n_layer + 1) * config.d_model * torch.finfo(dtype).bits // 8
        return BLOCK * per_token

    @property
    def cached_blocks(self) -> int:
        return len(self._entries)

    def match(self, tokens: Sequence[int], root: int = ROOT) -> list[int]:
        """The cached blocks `tokens` starts with (under `root`, root_for), leaving at least its last
        token to compute (its logits are the answer). Touches them (most recently used)."""
        chain, parent = [], root
        for b in range(full_blocks(len(tokens) - 1)):
            block = self._index.get((parent, tuple(tokens[b * BLOCK:(b + 1) * BLOCK])))
            if block is None:
                break
            chain.append(block)
            parent = block
        self._touch(chain)
        return chain

    def uncached(self, tokens: Sequence[int], adapter=None) -> int:
        """What reading a prompt under `adapter` (engine.lora; None: the base) computes: its tokens
        past the blocks cached for it."""
        return len(tokens) - len(self.match(tokens, root_for(adapter))) * BLOCK

    def run(self, prompts: Sequence[Sequence[int]], forward: Callable[[list[RowPlan]], Output],
            failed_rows: Callable[[Output], Collection[int]], use_hits: bool = True,
            roots: Sequence[int] | None = None) -> Output:
        """Plan the prompts (under `roots`, root_for: default all ROOT), run `forward` on the plans,
        then index what it wrote, less the rows `failed_rows(output)` names; when `forward` raises,
        its blocks go back free, unindexed."""
        plans = self.plan(prompts, use_hits, roots)
        try:
            output = forward(plans)
        except BaseException:
            self.release([block for plan in plans for block in plan.new])
            raise
        self.commit(plans, failed_rows(output))
        return output

    def plan(self, prompts: Sequence[Sequence[int]], use_hits: bool = True,
             roots: Sequence[int] | None = None) -> list[RowPlan]:
        """Each prompt's hit (none when not `use_hits`) and new blocks for its full blocks past it,
        as many as room allows (the pool is a cache: a prompt that finds no room is not kept)."""
        roots = roots or [ROOT] * len(prompts)
        rows = [RowPlan(p, self.match(p, root) if use_hits else [], root=root) for p, root in zip(prompts, roots)]
        pinned = {block for row in rows for block in row.hit}
        for row in rows:
            row.new = self.allocate(self._admitted(row), pinned)
        return rows

    def _admitted(self, row: RowPlan) -> int:
        """How many of the row's full blocks after its hit to keep: all, or (doorkeeper) those
        whose prefix was seen before, up to the first that was not; every one is seen now."""
        wanted = full_blocks(len(row.tokens)) - len(row.hit)
        seen = self._seen
        if seen is None:
            return wanted
        digest, admitted, blocked = row.root, 0, False
        for b in range(full_blocks(len(row.tokens))):
            digest = hash((digest, tuple(row.tokens[b * BLOCK:(b + 1) * BLOCK])))
            if b < len(row.hit):
                continue
            if digest in seen:
                seen.move_to_end(digest)
                admitted += not blocked
            else:
                seen[digest] = None
                blocked = True  # a block after one not kept has no parent to hang under
        while len(seen) > self._seen_max:
            seen.popitem(last=False)
        return admitted

    def allocate(self, count: int, pinned: Collection[int] = ()) -> list[int]:
        """Up to `count` free blocks, evicting least recently used leaves that are not pinned."""
        blocks = []
        while len(blocks) < count:
            if not self._free and not self._evict_one(pinned):
                break
            blocks.append(self._free.pop())
        return blocks

    def _evict_one(self, pinned: Collection[int]) -> bool:
        for block in self._lru:
            entry = self._entries[block]
            if entry.children == 0 and block not in pinned:
                self._forget(block)
                return True
        return False

    def _forget(self, block: int) -> None:
        entry = self._entries.pop(block)
        del self._index[(entry.parent, entry.tokens)]
        del self._lru[block]
        if entry.parent > NULL_BLOCK:  # not a root
            self._entries[entry.parent].children -= 1
        self._free.append(block)

    def commit(self, rows: Sequence[RowPlan], failed: Collection[int] = ()) -> None:
        """The forward wrote every row's new blocks: index them (rows in `failed`, whose numbers
        were not finite, give theirs back). A block another row of the batch indexed first is
        given back, and its children hang under that one."""
        for i, row in enumerate(rows):
            if i in failed:
                self.release(row.new)
                continue
            parent = row.hit[-1] if row.hit else row.root
            chain = list(row.hit)
            for j, block in enumerate(row.new):
                key = (parent, row.new_block_tokens(j))
                existing = self._index.get(key)
                if existing is not None:
                    self._free.append(block)
                    parent = existing
                else:
                    self._index[key] = block
                    self._entries[block] = _Entry(*key)
                    if parent > NULL_BLOCK:
                        self._entries[parent].children += 1
                    self._lru[block] = None
                    parent = block
                chain.append(parent)
            self._touch(chain)

    def release(self, blocks: Sequence[int]) -> None:
        """Allocated blocks whose forward failed: free again, never indexed."""
        self._free.extend(blocks)

    def _touch(self, chain: Sequence[int]) -> None:
        """Most recently used, the leaf first so its ancestors are more recent still: the least
        recently used block is then always a leaf."""
        for block in reversed(chain):
            self._lru.move_to_end(block)

    @staticmethod
    def positions(blocks: Sequence[int]) -> list[int]:
        """Pool positions of these blocks' tokens, in order."""
        return [block * BLOCK + i for block in blocks for i in range(BLOCK)]
