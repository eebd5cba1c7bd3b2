"""OpenAI's chat completions, `POST /v1/chat/completions`, for the `openai` SDK's
`chat.completions`, LangChain's ChatOpenAI, LiteLLM, chat UIs and agent frameworks.

A translation onto the generation streams completions use (common.Choices), not a path of its
own: the messages become one prompt through the chat template (service.chat_template: the
--chat-template file, or the checkpoint's own; none is a 400 naming the flag), the fields become
GenerateSettings, the n choices run together in the running batch, and their chunks become
`chat.completion` objects or `chat.completion.chunk` events (each choice's first carries the
role, its last the finish_reason). Scheduler, KV and prefix caches, metrics (api "openai",
method "ChatCompletions"), errors, tracing, drain and hang-ups are the generation's own.

As vLLM does: `max_completion_tokens` (or `max_tokens`) defaults to what the context has left;
choice i of a seeded request draws with seed + i; text parts of a message's content are joined
with newlines; `chat_template_kwargs`, `add_generation_prompt` and `continue_final_message` go to
the template. The penalties, `logit_bias`, `min_p` and `min_tokens` apply as on /v1/generate
(transport.sampling_fields). Tools, functions, response formats other than text, non-text
content and a request's own template are refused with a 400 naming the field.
"""

from __future__ import annotations

import os
import time
from typing import Any, AsyncIterator, Callable

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from gpt2serve_client.generation import GenerateChunk

from ...engine.tokenizer import Tokenizer
from ...errors import InvalidArgument, ServeError
from ...protocol import SampledToken
from ...service import GenerateSettings, InferenceService, PromptInput
from ..http_direct import CallHead, EventStream
from ..http_shared import call_options
from ..sampling_fields import SamplingControls, StructuredOutputFields
from ..sse import TextEvent, json_bytes, sse_event
from .common import Choices, check_model, choice_seed, finish_reason, refuse
from .logprobs import chat_logprob

ROUTE = "/v1/chat/completions"
ROLES = ("system", "user", "assistant")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: StrictStr
    content: StrictStr | list[dict[str, Any]] | None = None
    name: StrictStr | None = None
    tool_calls: list[Any] | None = None
    function_call: dict[str, Any] | None = None

    def plain(self, index: int) -> dict:
        """What the template sees: {role, content (text), name if given}."""
        where = f"messages[{index}]"
        if self.role not in ROLES:
            raise InvalidArgument(f"{where}.role: {self.role!r} is not supported; gpt2serve takes "
                                  f"{', '.join(ROLES)} messages (no tools)", param="messages")
        if self.tool_calls or self.function_call:
            raise InvalidArgument(f"{where}: tool and function calls are not supported by gpt2serve", param="messages")
        if self.content is None:
            raise InvalidArgument(f"{where}.content: required (text, or a list of text parts)", param="messages")
        if isinstance(self.content, str):
            text = self.content
        else:
            texts = []
            for j, part in enumerate(self.content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidArgument(f"{where}.content[{j}]: only text parts ({{'type': 'text', 'text': ...}}) "
                                          f"are supported by this text-only model, not {part.get('type')!r}",
                                          param="messages")
                texts.append(part["text"])
            text = "\n".join(texts)
        return {"role": self.role, "content": text, **({"name": self.name} if self.name is not None else {})}


async def conversation_prompt(service: InferenceService, messages: list[ChatMessage], add_generation_prompt: bool = True,
                              continue_final_message: bool = False,
                              template_kwargs: dict | None = None) -> tuple[list[int], dict]:
    """A conversation's prompt tokens through the chat template, and what its request span says
    of it (shared by this route and /v1/generate's `messages`)."""
    if not messages:
        raise InvalidArgument("messages: at least one message is needed", param="messages")
    plain = [message.plain(index) for index, message in enumerate(messages)]
    prompt = await service.chat_prompt(plain, add_generation_prompt, continue_final_message, template_kwargs)
    return prompt, {"gpt2serve.chat.template": service.chat.source, "gpt2serve.chat.messages": len(plain),
                    "gpt2serve.chat.prompt_tokens": len(prompt)}


class ChatCompletionBody(SamplingControls, StructuredOutputFields):
    # A field this server does not know is refused naming it, as OpenAI's own API does; those it
    # knows and does not do are refused too (`check`); the few below, marked, are taken and
    # ignored (the list: docs/generation.md).
    model_config = ConfigDict(extra="forbid")

    model: StrictStr
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = Field(None, description="Default: what the context has left")
    max_tokens: StrictInt | None = Field(None, description="The older name of max_completion_tokens")
    temperature: StrictFloat | StrictInt | None = None
    top_p: StrictFloat | StrictInt | None = None
    n: StrictInt = 1
    stream: StrictBool | None = False
    stream_options: dict[str, Any] | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None
    user: StrictStr | None = None
    # Accepted and ignored: bookkeeping for OpenAI's platform, none of which changes the answer
    # (parallel_tool_calls matters only with tools, which are refused).
    metadata: dict[str, Any] | None = None
    store: StrictBool | None = None
    service_tier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    parallel_tool_calls: StrictBool | None = None
    # Refused unless left at their defaults (see `check`).
    modalities: list[StrictStr] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: StrictStr | None = None
    verbosity: StrictStr | None = None
    web_search_options: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    # Not OpenAI's, but vLLM's (passed as extra_body).
    top_k: StrictInt | None = Field(None, description="gpt2serve extension: sample among the k most likely")
    ignore_eos: StrictBool = Field(False, description="gpt2serve extension: generate past the end-of-text token")
    stop_token_ids: list[StrictInt] | None = Field(None, description="vLLM's: stop at these tokens (not returned)")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="Extra variables for the chat template")
    add_generation_prompt: StrictBool = Field(True, description="End the prompt with the assistant's turn opening")
    continue_final_message: StrictBool = Field(False, description="Continue the last (assistant) message instead")
    chat_template: StrictStr | None = Field(None, description="Refused: the server's template is the one used")

    def check(self, max_choices: int) -> None:
        no_tools = "gpt2serve does no tool or function calling"
        refuse([("tools", not self.tools, no_tools), ("tool_choice", self.tool_choice in (None, "none"), no_tools),
                ("functions", not self.functions, no_tools),
                ("function_call", self.function_call in (None, "none"), no_tools),
                ("modalities", self.modalities in (None, ["text"]), "gpt2serve answers in text only"),
                ("audio", self.audio is None, "gpt2serve answers in text only"),
                ("prediction", self.prediction is None, ""), ("reasoning_effort", self.reasoning_effort is None,
                                                              "GPT-2 does not reason in a hidden channel"),
                ("verbosity", self.verbosity is None, ""),
                ("web_search_options", self.web_search_options is None, "gpt2serve does no web search"),
                ("chat_template", self.chat_template is None,
                 "a request cannot bring its own template; the server's (--chat-template, or the checkpoint's) is used")])
        if not 1 <= self.n <= max_choices:
            raise InvalidArgument(f"n: {self.n} is outside 1..{max_choices} (this server's --max-batch-size)",
                                  param="n")
        if self.stream_options is not None and not self.stream:
            raise InvalidArgument("stream_options: only with stream: true", param="stream_options")
        if self.top_logprobs and not self.logprobs:
            raise InvalidArgument("top_logprobs: needs logprobs: true", param="top_logprobs")

    def settings(self, max_tokens: int, choice: int, adapter: str | None = None) -> GenerateSettings:
        return GenerateSettings(
            max_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
            seed=choice_seed(self.seed, choice),
            stop=[self.stop] if isinstance(self.stop, str) else self.stop or [],
            logprobs=(self.top_logprobs or 0) if self.logprobs else 0, ignore_eos=self.ignore_eos,
            stop_token_ids=self.stop_token_ids or [], **self.controls(), constraint=self.constraint(), adapter=adapter)


class ChatCompletions:
    """The route's handler (see the module doc)."""

    def __init__(self, service: InferenceService, error_body: Callable[[ServeError], dict]):
        self.service = service
        self.error_body = error_body

    async def completions(self, head: CallHead, body: ChatCompletionBody) -> bytes | EventStream:
        """OpenAI's chat completions: messages through the chat template, `n` choices; `stream`
        for `chat.completion.chunk` events then `[DONE]`. Errors in OpenAI's shape."""
        service = self.service
        info = service.model_info()
        adapter = check_model(body.model, info)
        body.check(service.max_batch_size)
        prompt, seen = await conversation_prompt(service, body.messages, body.add_generation_prompt,
                                                 body.continue_final_message, body.chat_template_kwargs)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:
            max_tokens = info.architecture.n_ctx - len(prompt)
            if max_tokens < 1:
                raise InvalidArgument(f"messages: the prompt's {len(prompt)} tokens fill the model's context of "
                                      f"{info.architecture.n_ctx}; nothing is left to generate", param="messages")
        try:  # checked once for all choices, before any of them starts
            await service.generation_request(PromptInput(token_ids=prompt), body.settings(max_tokens, 0, adapter))
        except InvalidArgument as exc:  # named as chat names the field
            field, _, why = exc.message.partition(": ")
            field = {"max_tokens": "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens",
                     "logprobs": "top_logprobs"}.get(field, field)
            raise InvalidArgument(f"{field}: {why}", param=field if field in ChatCompletionBody.model_fields else None) from None
        options = call_options(head, ROUTE, "ChatCompletions", api="openai", attributes=seen)
        choices = Choices(service, [(PromptInput(token_ids=prompt), body.settings(max_tokens, i, adapter))
                                    for i in range(body.n)], options, coalesce=body.stream)
        answer = {"id": f"chatcmpl-{os.urandom(16).hex()}", "created": int(time.time()), "model": body.model}
        tokenizer = service.validator.tokenizer
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            events = ChatEvents(answer, include_usage, tokenizer, bool(body.logprobs))
            return EventStream(chunk_events(events, await choices.chunks(), body.n, len(prompt), include_usage,
                                            self.error_body), choices.push(events.tokens))
        results = await choices.results()
        answers = [{"index": index, "message": {"role": "assistant", "content": result.text},
                    "logprobs": {"content": [chat_logprob(tokenizer, token) for token in result.tokens]}
                    if body.logprobs else None, "finish_reason": finish_reason(result.finish_reason)}
                   for index, result in enumerate(results)]
        usage = chat_usage(len(prompt), sum(result.usage.completion_tokens for result in results))
        return json_bytes({**answer, "object": "chat.completion", "choices": answers, "usage": usage})


def chat_usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """The prompt counts once, however many choices share it (as OpenAI and vLLM count)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class ChatEvents:
    """Chat's stream events: `chat.completion.chunk`s of a delta each; with include_usage every
    chunk has `usage: null`. `tokens` is the first choice's token event straight from its
    sampled tokens (GenerationStream.follow): the same bytes, with no chunk built."""

    def __init__(self, answer: dict, include_usage: bool, tokenizer: Tokenizer, logprobs: bool):
        self.head = {**answer, "object": "chat.completion.chunk", **({"usage": None} if include_usage else {})}
        self.tokenizer, self.logprobs = tokenizer, logprobs
        self._plain: TextEvent | None = None  # made at the first token pushed

    def _payload(self, index: int, delta: dict, logprobs: dict | None = None, finish: str | None = None) -> dict:
        return {**self.head, "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

    def event(self, index: int, delta: dict, logprobs: dict | None = None, finish: str | None = None) -> bytes:
        return sse_event(self._payload(index, delta, logprobs, finish))

    def chunk(self, index: int, chunk: GenerateChunk) -> bytes:
        """A chunk of tokens (not the closing one): their text as a content delta, a logprobs entry each when asked."""
        tokenizer = self.tokenizer
        logprobs = ({"content": [chat_logprob(tokenizer, t) for t in [chunk.token, *chunk.more_tokens]]}
                    if self.logprobs and chunk.token else None)
        return self.event(index, {"content": chunk.text}, logprobs)

    def tokens(self, text: str, tokens: list[SampledToken]) -> bytes:
        if not self.logprobs:
            if self._plain is None:
                self._plain = TextEvent(lambda text: self._payload(0, {"content": text}))
            return self._plain(text)
        # A SampledToken has what chat_logprob reads (token_id, logprob, top): no chunk between.
        return self.event(0, {"content": text}, {"content": [chat_logprob(self.tokenizer, t) for t in tokens]})


async def chunk_events(events: ChatEvents, chunks: AsyncIterator[tuple[int, GenerateChunk]], n: int,
                       prompt_tokens: int, include_usage: bool, error_body: Callable[[ServeError], dict]):
    """Chat's stream: each choice's role first, then a content delta per token, or per run of
    tokens its reader had not taken yet (`events.chunk`), each choice's last with its
    finish_reason; with include_usage a last chunk with the usage; then `data: [DONE]`."""
    completion_tokens = 0
    try:
        for index in range(n):
            yield events.event(index, {"role": "assistant", "content": ""})
        async for index, chunk in chunks:
            if chunk.finish_reason:
                completion_tokens += chunk.usage.completion_tokens if chunk.usage else 0
                yield events.event(index, {"content": chunk.text} if chunk.text else {}, None,
                                   finish_reason(chunk.finish_reason))
            else:
                yield events.chunk(index, chunk)
        if include_usage:
            yield sse_event({**events.head, "choices": [], "usage": chat_usage(prompt_tokens, completion_tokens)})
    except ServeError as exc:  # after the 200: the error as one more event, in OpenAI's shape
        yield sse_event(error_body(exc))
    yield sse_event("[DONE]")
