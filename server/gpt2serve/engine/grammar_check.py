"""The front end's half of structured output (engine.constraints has the engine's): what a
client sent, a JSON schema, a regex, a choice or a Lark/GBNF grammar, as one llguidance grammar,
checked, so a bad one is a 400 quoting the library before anything runs. It loads no torch: a
front-end process never does (tests/openai/test_chat.py checks its mapped files)."""

from __future__ import annotations

import functools
import json

import llguidance

from ..errors import InvalidArgument

CACHED_GRAMMARS = 256  # grammars kept by content (here checked ones; in the engine, pristine matchers)


@functools.lru_cache(maxsize=CACHED_GRAMMARS)  # by content: a client sends the same schema again and again
def grammar_for(kind: str, spec: str, field: str) -> str:
    """One llguidance grammar for what a client sent, checked; a bad one is INVALID_ARGUMENT
    quoting the library, naming `field`. kind: json_schema (a JSON schema as text), regex,
    choice (a JSON list of strings), grammar (Lark, or GBNF as llama.cpp writes it)."""
    try:
        if kind == "json_schema":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(spec, defaults={"whitespace_flexible": False})
        elif kind == "choice":
            choices = json.loads(spec)
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise ValueError("a choice is a non-empty list of non-empty strings")
            grammar = llguidance.grammar_from("choice", spec)
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(spec)
        else:
            grammar = llguidance.grammar_from("grammar", spec)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise InvalidArgument(f"{field}: llguidance cannot use it: {exc}", param=field) from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise InvalidArgument(f"{field}: llguidance cannot compile it: {error}", param=field)
    return grammar
