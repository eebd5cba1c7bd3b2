"""Next-token asks (engine.steps.Ask) for tests that want per-layer reports of some rows."""

from __future__ import annotations

from typing import Sequence

from gpt2serve.engine.steps import Ask
from gpt2serve.protocol import TraceContext

LAYERS = TraceContext(layers_wanted=True)
MAPS = TraceContext(layers_wanted=True, attention_maps=True)


def traced_asks(prompts: Sequence[Sequence[int]], top_k: int, traced: Sequence[int], mapped: Sequence[int] = ()) -> list[Ask]:
    """Each prompt's top-k; rows `traced` want layer reports, rows `mapped` attention maps too."""
    return [Ask(p, top_k, trace=MAPS if i in mapped else LAYERS if i in traced else None) for i, p in enumerate(prompts)]
