"""Generated tokens -> output text as it becomes certain, with stop strings cut out.

Two things can make the text of the tokens so far uncertain:
- a character split across tokens (byte-level BPE): its bytes decode to U+FFFD until the last
  one arrives, so such tokens are held and decoded together;
- a stop string: text that may be the start of one is held until it is, or cannot be, one.
What is released is final, so streamed texts add up to the whole output.
"""

from __future__ import annotations

from typing import Sequence

from ..engine.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"
MAX_HELD_TOKENS = 4  # a UTF-8 character has at most 4 bytes: past that the U+FFFD is real


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self._longest_stop = max(map(len, self.stop), default=0)
        self.text = ""  # with stop strings: decoded output so far (cut off once one is found)
        self.released = 0  # characters of `text` handed out
        self.stopped = False  # a stop string was found
        self._undecoded: list[int] = []  # tokens of an incomplete character

    def add(self, token_id: int) -> str:
        """The text this token makes certain ("" while something is held)."""
        if self.stopped:
            return ""
        if self._undecoded:  # the bytes of a character held: decoded with this token's
            self._undecoded.append(token_id)
            piece = self.tokenizer.decode(self._undecoded)
            if piece.endswith(REPLACEMENT) and len(self._undecoded) < MAX_HELD_TOKENS:
                return ""
            self._undecoded = []
        else:  # one token alone (nearly always): its text is cached
            piece = self.tokenizer.token_text(token_id)
            if piece.endswith(REPLACEMENT):
                self._undecoded = [token_id]
                return ""
        if not self.stop:  # nothing can hold it back (and no text is kept: a per-token copy of it all)
            return piece
        searched_from = max(len(self.text) - self._longest_stop, 0)
        self.text += piece
        found = [i for i in (self.text.find(s, searched_from) for s in self.stop) if i >= 0]
        if found:
            self.text, self.stopped = self.text[:min(found)], True
            return self._release(len(self.text))
        return self._release(len(self.text) - self._maybe_stop_suffix())

    def finish(self) -> str:
        """The rest, once generation has ended (held bytes decode as they are)."""
        if self._undecoded and not self.stopped:
            piece = self.tokenizer.decode(self._undecoded)
            self._undecoded = []
            if not self.stop:
                return piece
            self.text += piece
        return self._release(len(self.text))

    def _maybe_stop_suffix(self) -> int:
        """Length of the longest end of `text` that begins some stop string."""
        for n in range(min(len(self.text), self._longest_stop - 1), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def _release(self, upto: int) -> str:
        upto = max(upto, self.released)
        out, self.released = self.text[self.released:upto], upto
        return out
