"""OpenAI's two logprobs shapes. Legacy completions: `tokens`, `token_logprobs`, `top_logprobs` (a
dict per token) and `text_offset`, lists in step, for generated tokens and an echoed prompt. Chat:
`content`, one entry per token with its `token`, `logprob`, `bytes` and `top_logprobs` (a list of
the same without their own).

Token strings follow OpenAI's own rule for byte-level pieces: a token whose bytes are whole
UTF-8 is its text (" Paris"); one that holds part of a character is written `bytes:` and its
bytes escaped (`bytes:\\xe2\\x80`). So every string is valid JSON text, no two different tokens
share a key in `top_logprobs` (U+FFFD would merge them), and a client can rebuild the bytes.
lm-evaluation-harness reads only the numbers (`token_logprobs`, and `top_logprobs` values to
tell a greedy continuation), so the rule is free for it.

`text_offset` is each token's character offset in the choice's text: the characters decoded
from the whole characters of the tokens before it (an incomplete character counts once its last
byte has arrived; bytes that are never valid UTF-8 count as U+FFFD, as the text shows them).
"""

from __future__ import annotations

import codecs
from typing import Sequence

from gpt2serve_client.generation import GeneratedToken
from gpt2serve_client.types import PromptTokenLogprob, TokenLogprob

from ...engine.tokenizer import Tokenizer
from ...protocol import SampledToken, TokenScore


def openai_token(tokenizer: Tokenizer, token_id: int) -> str:
    """The token's text, or `bytes:\\xNN...` when its bytes are not whole UTF-8 (see module doc)."""
    raw = tokenizer.token_bytes(token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def text_offsets(tokenizer: Tokenizer, token_ids: Sequence[int]) -> list[int]:
    """Each token's character offset in the text the tokens decode to."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    offsets, offset = [], 0
    for token_id in token_ids:
        offsets.append(offset)
        offset += len(decoder.decode(tokenizer.token_bytes(token_id)))
    return offsets


def echo_logprobs(tokenizer: Tokenizer, prompt: list[PromptTokenLogprob], generated: Sequence[GeneratedToken]) -> dict:
    """The scored prompt's entries (the first with null logprob and null top), then the generated ones."""
    ids = [p.token_id for p in prompt] + [g.token_id for g in generated]
    token_logprobs: list[float | None] = [p.logprob for p in prompt]
    top: list[dict | None] = [None] + [{openai_token(tokenizer, t.token_id): t.logprob for t in p.top}
                                       for p in prompt[1:]]
    for g in generated:
        token_logprobs.append(g.logprob)
        top.append({openai_token(tokenizer, t.token_id): t.logprob for t in g.top})
    return {"tokens": [openai_token(tokenizer, i) for i in ids], "token_logprobs": token_logprobs,
            "top_logprobs": top, "text_offset": text_offsets(tokenizer, ids)}



def chat_logprob(tokenizer: Tokenizer, token: GeneratedToken | TokenLogprob | SampledToken | TokenScore,
                 top: bool = True) -> dict:
    """One entry of chat's `logprobs.content`: the token's string (the rule above), its logprob,
    its UTF-8 bytes (so a client can join characters split over tokens) and its alternatives."""
    entry = {"token": openai_token(tokenizer, token.token_id), "logprob": token.logprob,
             "bytes": list(tokenizer.token_bytes(token.token_id))}
    if top:
        entry["top_logprobs"] = [chat_logprob(tokenizer, alt, top=False) for alt in token.top]
    return entry
