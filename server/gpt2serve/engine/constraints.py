"""Structured output: a request's grammar, as llguidance compiles it, allows some tokens at each
step and no others. Why llguidance: a new JSON schema compiles in a small fraction of the time
the other libraries took, so a request's own schema costs it little (docs/benchmarks.md,
"Structured output: which library").

The front end turns what a client sent (a JSON schema, a regex, a choice, a Lark or GBNF
grammar) into one llguidance grammar and checks it (engine.grammar_check, which loads no torch),
so a bad one is a 400 quoting the library before anything runs. The engine keeps one matcher per constrained
sequence, copied from a pristine one per grammar (`Grammars`, cached by content), asks it for
the allowed tokens before each sampling (`allowed`, applied as -inf elsewhere by
engine.logits_controls) and feeds it each token read. The mask needs the last token, so a step
with a constrained sequence is read before the next is launched (scheduling.runner).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import llguidance
import numpy as np
import torch

from .grammar_check import CACHED_GRAMMARS
from .tokenizer import Tokenizer


class Grammars:
    """The engine's side: llguidance's view of the tokenizer (made at the first constrained
    request, about 0.2 s) and a pristine matcher per grammar, copied for each sequence."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._ll: llguidance.LLTokenizer | None = None
        self._pristine: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll is None:
            tokenizer = self.tokenizer

            class Words:  # what llguidance.TokenizerWrapper reads
                eos_token_id, bos_token_id = tokenizer.eos_token_id, None
                tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
                special_token_ids = [tokenizer.eos_token_id]

                def __call__(self, text):
                    return tokenizer.encode(text.decode("utf-8", "replace") if isinstance(text, bytes) else text)

            self._ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Words()))
        return self._ll

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        pristine = self._pristine.get(grammar)
        if pristine is None:
            pristine = llguidance.LLMatcher(self._ll_tokenizer(), grammar, log_level=0)
            if pristine.is_error():
                raise ValueError(pristine.get_error())
            self._pristine[grammar] = pristine
            if len(self._pristine) > CACHED_GRAMMARS:
                self._pristine.popitem(last=False)
        else:
            self._pristine.move_to_end(grammar)
        return pristine.deep_copy()


def allowed(matchers: Sequence[llguidance.LLMatcher], vocab_size: int,
            device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """(R, V) bool: the tokens each matcher allows next (one bit per token from llguidance,
    little-endian within each byte); and how many each allows, counted on the host."""
    bits = np.frombuffer(b"".join(m.compute_bitmask() for m in matchers), dtype=np.uint8).reshape(len(matchers), -1)
    mask = np.unpackbits(bits, axis=1, bitorder="little")[:, :vocab_size].astype(bool)  # (R, V)
    counts = mask.sum(axis=1).tolist()
    mask = torch.from_numpy(mask)
    return (mask if device.type == "cpu" else mask.pin_memory().to(device, non_blocking=True)), counts
