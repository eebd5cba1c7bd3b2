"""Chat messages to prompt tokens, through a chat template, as vLLM, TGI and llama.cpp do it.

Where the template comes from, the first of:
    --chat-template PATH     a Jinja file (or the template itself, inline)
    the checkpoint's own     `chat_template` in tokenizer_config.json, or chat_template.jinja
    none                     chat answers FAILED_PRECONDITION (400) naming --chat-template

Rendering is transformers' own `apply_chat_template` (its sandboxed Jinja environment, the
tokenizer's special tokens as variables, `add_generation_prompt`, `continue_final_message`), then
its tokenization of the text. So a prompt here is token for token what transformers gives for the
same template and messages; no torch is involved. A template that fails on a request's messages
(`raise_exception`, a type error) is that request's INVALID_ARGUMENT, never a 500. A template
that does not parse stops `serve` at start (`template_from_flag`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from dataclasses import dataclass
from pathlib import Path

import jinja2
from transformers import PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import _compile_jinja_template

from ..engine.tokenizer import Tokenizer
from ..errors import FailedPrecondition, InvalidArgument

log = logging.getLogger(__name__)
NO_TEMPLATE = ("this model has no chat template, so /v1/chat/completions cannot form a prompt: start the server "
               "with --chat-template PATH (a Jinja file; examples/chat-templates/chatml.jinja is one), or serve a "
               "checkpoint that ships one (chat_template in tokenizer_config.json, or chat_template.jinja)")
# chat_template_kwargs may not set what apply_chat_template itself takes, nor the messages.
RESERVED_KWARGS = (frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters)
                   - {"kwargs"} | {"messages"})
# Longer conversations are rendered and tokenized in a worker thread, off the event loop.
RENDER_INLINE_MAX_CHARS = 2048


@dataclass(frozen=True)
class ChatTemplate:
    text: str
    source: str  # where it came from, for ModelInfo, /v1/models, the log and spans


def parse_check(text: str, where: str) -> None:
    """ValueError naming the line, if transformers' Jinja environment cannot compile `text`."""
    try:
        _compile_jinja_template(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"{where}: the chat template does not parse: line {exc.lineno}: {exc.message}") from None


def template_from_flag(value: str) -> ChatTemplate:
    """--chat-template: a file's template, or the value itself when it is Jinja rather than a path.
    ValueError (serve stops at start) when the file is missing or the template does not parse."""
    path = Path(value).expanduser()
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--chat-template {value}: cannot read it: {exc}") from None
        template = ChatTemplate(text, f"--chat-template {path.resolve()}")
    elif "{{" in value or "{%" in value:
        template = ChatTemplate(value, "--chat-template (inline)")
    else:
        raise ValueError(f"--chat-template {value}: no such file (give a Jinja file, or the template itself)")
    parse_check(template.text, f"--chat-template {value if template.source.endswith(value) else '(inline)'}")
    return template


def resolve_chat_template(flag: str | None, tokenizer: Tokenizer) -> ChatTemplate | None:
    """The template chat uses: the flag's, else the checkpoint's own, else None (chat refused)."""
    if flag:
        return template_from_flag(flag)
    text = tokenizer.own_chat_template()
    if text is None:
        return None
    directory = Path(tokenizer.source)
    jinja_file = directory / "chat_template.jinja"
    shipped_as = ("chat_template.jinja" if jinja_file.is_file() and jinja_file.read_text(encoding="utf-8") == text
                  else "tokenizer_config.json")
    try:
        parse_check(text, f"{directory / shipped_as}")
    except ValueError as exc:  # the checkpoint's own: serve the rest, refuse chat with why
        log.error("%s; chat is off (pass --chat-template to use another)", exc)
        return None
    return ChatTemplate(text, f"checkpoint {shipped_as} ({directory})")


class ChatPrompts:
    """Renders and tokenizes conversations with one template (or refuses them all, without one)."""

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate | None):
        self.tokenizer, self.template = tokenizer, template

    @property
    def source(self) -> str:
        return self.template.source if self.template else ""

    async def prompt(self, messages: list[dict], add_generation_prompt: bool = True,
                     continue_final_message: bool = False, template_kwargs: dict | None = None) -> list[int]:
        """The conversation's prompt tokens. `messages`: plain {role, content[, name]} dicts."""
        if self.template is None:
            raise FailedPrecondition(NO_TEMPLATE, param="messages")
        template_kwargs = template_kwargs or {}
        reserved = sorted(RESERVED_KWARGS.intersection(template_kwargs))
        if reserved:
            raise InvalidArgument(f"chat_template_kwargs: {reserved[0]!r} is set by the request itself, not "
                                  "through chat_template_kwargs", param="chat_template_kwargs")
        if continue_final_message and add_generation_prompt:
            raise InvalidArgument("continue_final_message: continuing the last message and adding a generation "
                                  "prompt exclude each other; set add_generation_prompt to false",
                                  param="continue_final_message")
        if continue_final_message and messages[-1]["role"] != "assistant":
            raise InvalidArgument("continue_final_message: the last message must be the assistant's to continue",
                                  param="continue_final_message")
        def render() -> list[int]:
            return self.tokenizer.apply_chat_template(messages, self.template.text, add_generation_prompt,
                                                      continue_final_message, template_kwargs)

        try:
            if sum(len(m["content"]) for m in messages) <= RENDER_INLINE_MAX_CHARS:
                return render()
            return await asyncio.to_thread(render)
        except jinja2.TemplateError as exc:  # raise_exception() in the template lands here too
            raise InvalidArgument(f"messages: the chat template ({self.source}) failed: {exc}",
                                  param="messages") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise InvalidArgument(f"messages: the chat template ({self.source}) could not render them: "
                                  f"{type(exc).__name__}: {exc}", param="messages") from None
