"""The LoRA adapters a server serves (engine.lora), by name: loaded at start (--lora-modules) and
while serving, and kept in memory up to --max-cpu-loras, least recently used out."""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import Sequence

import torch

from ..errors import NotFound
from .gpt2 import GPT2Config
from .lora import DEFAULT_MAX_RANK, AdapterError, LoraAdapter, load_adapter


class LoraRegistry:
    """The adapters requests may name, by name. Loaded in the engine thread, read from the callers'
    threads: each change swaps in a new dict (one reference assignment), never edits the one in use.
    An adapter's requests hold its LoraAdapter, so one unloaded mid-flight still finishes them.
    With `max_resident` (--max-cpu-loras), at most that many keep their weights in memory: before a
    forward (AdapterRows.of, the engine thread) its adapters are read back where dropped, and the
    least recently used beyond the limit, none of this forward's, are dropped (vLLM's LRU cache).
    Only `ready` drops weights, and only the engine thread calls it once serving, so no forward
    loses an adapter's weights while it runs; a run-time load (another thread) only adds one."""

    def __init__(self, config: GPT2Config | None, max_rank: int = DEFAULT_MAX_RANK, device: torch.device | str = "cpu",
                 max_resident: int | None = None):
        self.config, self.max_rank, self.device, self.max_resident = config, max_rank, device, max_resident
        self._by_name: dict[str, LoraAdapter] = {}
        self._resident: OrderedDict[LoraAdapter, None] = OrderedDict()  # weights in memory, least recent first
        self._lock = threading.Lock()  # _resident: the engine thread's ready() and a run-time load()
        self.reads = 0  # adapters read back into memory (tests and the log)

    @classmethod
    def empty(cls) -> LoraRegistry:
        return cls(None)

    @property
    def names(self) -> list[str]:
        return list(self._by_name)

    @property
    def resident(self) -> list[str]:
        """The adapters with their weights in memory, least recently used first."""
        return [adapter.name for adapter in self._resident]

    def load(self, name: str, path: str | Path) -> LoraAdapter:
        if not name or "=" in name:
            raise AdapterError(f"adapter name {name!r}: empty or with '='")
        if name in self._by_name:
            raise AdapterError(f"adapter {name!r} is loaded already; unload it first")
        adapter = load_adapter(name, path, self.config, self.max_rank, self.device)
        adapter.keeper = self
        self._by_name = {**self._by_name, name: adapter}
        with self._lock:
            self._resident[adapter] = None  # the most recent; the limit applies at the next ready()
        return adapter

    def unload(self, name: str) -> None:
        """Not served from now on; requests that hold it finish with it."""
        self.resolve(name)  # NotFound when it is not loaded
        self._by_name = {n: a for n, a in self._by_name.items() if n != name}

    def resolve(self, name: str | None) -> LoraAdapter | None:
        """The adapter a request names (None: the base); NotFound for a name not loaded."""
        if name is None:
            return None
        adapter = self._by_name.get(name)
        if adapter is None:
            loaded = ", ".join(self._by_name) or "none"
            raise NotFound(f"the LoRA adapter {name!r} is not loaded (loaded: {loaded})", param="adapter")
        return adapter

    def ready(self, adapters: Sequence[LoraAdapter]) -> None:
        """`adapters` (one forward's) in memory, read again where dropped; then the least recently
        used beyond max_resident dropped, and those unloaded that no forward uses now."""
        with self._lock:
            self._ready(adapters)

    def _ready(self, adapters: Sequence[LoraAdapter]) -> None:
        for adapter in adapters:
            if adapter.weights is None:
                adapter.weights = load_adapter(adapter.name, adapter.path, self.config, self.max_rank,
                                               self.device).weights
                self.reads += 1
            self._resident[adapter] = None
            self._resident.move_to_end(adapter)
        served, now = set(self._by_name.values()), set(adapters)
        for adapter in [a for a in self._resident if a not in served and a not in now]:
            del self._resident[adapter]  # unloaded: its last requests hold it until they finish
        while self.max_resident is not None and len(self._resident) > self.max_resident:
            oldest = next((a for a in self._resident if a not in now), None)
            if oldest is None:  # all of this forward's: kept, over the limit for now
                break
            del self._resident[oldest]
            oldest.weights = None
