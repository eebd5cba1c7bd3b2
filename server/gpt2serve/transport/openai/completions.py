"""OpenAI's legacy completions, `POST /v1/completions`, for the official `openai` client,
lm-evaluation-harness and the tools built on them.

Translation only, like the other transports: OpenAI's fields become service generate calls, one
per prompt and choice (a list of prompts runs them all at once, in the running batch, prompt i's
n choices as i * n .. i * n + n - 1: common.Choices; with best_of, that many per prompt and the n
of highest cumulative logprob returned), and their chunks become OpenAI's JSON.

`echo` returns the prompt before the completion; with `logprobs` the prompt is scored too (its
first token's entries null), in the generation's own prefill, or, with `max_tokens: 0`, as one
next-token call of every prompt (scoring only: lm-evaluation-harness' loglikelihood, perplexity).
Token strings and offsets: logprobs.py. Errors use OpenAI's shape (common.OpenAIErrorBody).
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import replace
from typing import Any, AsyncIterator, Callable

from pydantic import ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from gpt2serve_client.generation import GeneratedToken, GenerateChunk, Usage

from ...errors import InvalidArgument, ServeError
from ...protocol import SampledToken
from ...service import GenerateSettings, InferenceService, PromptInput
from ...service.validation import Validator
from ..http_direct import CallHead, EventStream
from ..http_shared import call_options
from ..sampling_fields import SamplingControls, StructuredOutputFields
from ..sse import TextEvent, json_bytes, sse_event
from .common import Choices, check_model, choice_seed, finish_reason, usage_json
from .logprobs import echo_logprobs, openai_token

ROUTE = "/v1/completions"


class CompletionBody(SamplingControls, StructuredOutputFields):
    # A field this server does not know is refused naming it, as OpenAI's own API does: one that
    # would change the answer (vLLM's guided_choice, say) is never silently ignored. `user` is
    # accepted and ignored (the list: docs/generation.md).
    model_config = ConfigDict(extra="forbid")

    model: StrictStr
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16
    temperature: StrictFloat | StrictInt | None = None
    top_p: StrictFloat | StrictInt | None = None
    n: StrictInt | None = 1
    stream: StrictBool | None = False
    stream_options: dict[str, Any] | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    logprobs: StrictInt | None = None
    echo: StrictBool | None = False
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None
    user: StrictStr | None = None
    # Not OpenAI's, but common in OpenAI-compatible servers (vLLM): passed as extra_body.
    top_k: StrictInt | None = Field(None, description="gpt2serve extension: sample among the k most likely")
    ignore_eos: StrictBool = Field(False, description="gpt2serve extension: generate past the end-of-text token")
    stop_token_ids: list[StrictInt] | None = Field(None, description="vLLM's: stop at these tokens (not returned)")

    def prompt_inputs(self, max_prompts: int) -> list[PromptInput]:
        """One prompt (text or token ids), or a list of them."""
        many = isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list))
        prompts = self.prompt if many else [self.prompt]
        if len(prompts) > max_prompts:
            raise InvalidArgument(f"prompt: {len(prompts)} prompts in one request, over this server's limit of "
                                  f"{max_prompts} (--max-batch-size)")
        return [PromptInput(text=p) if isinstance(p, str) else PromptInput(token_ids=p) for p in prompts]

    def candidates(self, prompts: int, max_total: int) -> tuple[int, int]:
        """(n, best_of): choices returned per prompt, and generated per prompt to pick them from."""
        n = 1 if self.n is None else self.n
        best_of = n if self.best_of is None else self.best_of
        if n < 1:
            raise InvalidArgument(f"n: {n} must be at least 1", param="n")
        if best_of < n:
            raise InvalidArgument(f"best_of: {best_of} must be at least n ({n})", param="best_of")
        if best_of > n and self.stream:
            raise InvalidArgument("best_of: its results cannot be streamed (only the best are returned)",
                                  param="best_of")
        if prompts * best_of > max_total:
            name = "best_of" if self.best_of is not None else "n"
            raise InvalidArgument(f"{name}: {prompts} prompts x {best_of} generations each exceed this server's "
                                  f"limit of {max_total} (--max-batch-size)", param=name)
        return n, best_of

    def settings(self) -> GenerateSettings:
        unsupported = [name for name, ok in (
            ("echo", not (self.echo and self.stream)),
            ("suffix", self.suffix is None),
        ) if not ok]
        if unsupported == ["echo"]:
            raise InvalidArgument("echo: not supported with stream by gpt2serve; send the request without stream",
                                  param="echo")
        if unsupported:
            raise InvalidArgument(f"{unsupported[0]}: not supported by gpt2serve (only its default)")
        if self.max_tokens == 0 and not self.echo:
            raise InvalidArgument("max_tokens: 0 generates nothing; with echo (and logprobs) it scores the prompt",
                                  param="max_tokens")
        return GenerateSettings(
            max_tokens=self.max_tokens, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
            seed=self.seed, stop=[self.stop] if isinstance(self.stop, str) else self.stop or [],
            logprobs=self.logprobs or 0, ignore_eos=self.ignore_eos, stop_token_ids=self.stop_token_ids or [],
            prompt_logprobs=self.logprobs if self.echo and self.logprobs is not None else None, **self.controls(),
            constraint=self.constraint())


def best_candidates(candidates: list[tuple[Any, Any]], n: int, best_of: int) -> list[tuple[Any, Any]]:
    """Each prompt's n (result, stream) pairs of the highest cumulative logprob among its best_of,
    best first (OpenAI's best_of; vLLM ranks the same way); all of them, in order, when n == best_of."""
    if n == best_of:
        return candidates
    kept = []
    for first in range(0, len(candidates), best_of):
        group = candidates[first:first + best_of]
        kept += sorted(group, key=lambda pair: -sum(t.logprob for t in pair[0].tokens))[:n]
    return kept


def logprobs_json(name: Callable[[int], str], tokens: list[GeneratedToken] | list[SampledToken], texts: list[str],
                  offset: int) -> dict:
    """OpenAI's legacy completions logprobs: per token its string (`name`, see logprobs.py),
    logprob, top alternatives and offset."""
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": [name(t.token_id) for t in tokens], "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{name(a.token_id): a.logprob for a in t.top} for t in tokens], "text_offset": offsets}


class Completions:
    """The route's handler (see the module doc)."""

    def __init__(self, service: InferenceService, error_body: Callable[[ServeError], dict]):
        """`error_body`: an error as OpenAI's error object (transport.http_errors renders it)."""
        self.service = service
        self.error_body = error_body

    async def completions(self, head: CallHead, body: CompletionBody) -> bytes | EventStream:
        """OpenAI's completions API: a prompt (text or token ids) or a list of them, one choice
        each; `stream` for server-sent chunks then `[DONE]`. Errors in OpenAI's shape."""
        service = self.service
        adapter = check_model(body.model, service.model_info())
        options = call_options(head, ROUTE, "Completions", api="openai")
        settings = replace(body.settings(), adapter=adapter)
        prompts = body.prompt_inputs(service.max_batch_size)
        tokenizer = service.validator.tokenizer
        name = functools.partial(openai_token, tokenizer)
        completion = {"id": f"cmpl-{os.urandom(16).hex()}", "object": "text_completion", "created": int(time.time()),
                      "model": body.model}
        if body.echo and body.max_tokens == 0:
            return await self.score(body, prompts, options, completion, adapter)
        if len(prompts) > 1:  # one bad prompt refuses the request whole, before any generation starts
            for index, prompt in enumerate(prompts):
                try:
                    checked = await service.generation_request(prompt, settings)
                except InvalidArgument as exc:
                    raise InvalidArgument(f"prompt[{index}]: {exc.message}", param="prompt") from None
                prompts[index] = PromptInput(token_ids=checked.prompt)  # tokenized once
        n, best_of = body.candidates(len(prompts), service.max_batch_size)
        # Prompt i's candidates are inputs i * best_of .. (i + 1) * best_of - 1; candidate j of a
        # seeded request draws with seed + j, as chat's choices do.
        inputs = [(prompt, replace(settings, seed=choice_seed(settings.seed, j)) if j else settings)
                  for prompt in prompts for j in range(best_of)]
        choices = Choices(service, inputs, options, coalesce=body.stream)
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            events = CompletionEvents(completion, body.logprobs, name, tokenizer.token_text)
            return EventStream(stream_events(events, await choices.chunks(), include_usage, self.error_body),
                               choices.push(events.tokens))
        results = await choices.results()
        kept = best_candidates(list(zip(results, choices.streams)), n, best_of)
        answers = []
        for index, (result, stream) in enumerate(kept):
            choice = {"index": index, "text": result.text, "finish_reason": finish_reason(result.finish_reason),
                      "logprobs": logprobs_json(name, result.tokens, [t.token for t in result.tokens], 0)
                      if body.logprobs is not None else None}
            if body.echo:  # the prompt first; the end token too, as vLLM lists it (lm-eval drops the last entry)
                generated = result.tokens + ([stream.end_token] if stream.end_token else [])
                choice.update(text=tokenizer.decode(stream.token_ids) + result.text, logprobs=echo_logprobs(
                    tokenizer, stream.prompt_logprobs, generated) if body.logprobs is not None else None)
            answers.append(choice)
        return json_bytes({**completion, "choices": answers, "usage": usage_json([r.usage for r in results])})

    async def score(self, body: CompletionBody, prompts: list[PromptInput], options, completion: dict,
                    adapter: str | None = None) -> bytes:
        """echo with max_tokens 0: every prompt scored in one next-token call, nothing generated."""
        service = self.service
        tokenizer = service.validator.tokenizer
        try:
            scored = Validator.prompt_logprobs(body.logprobs, "logprobs")
        except InvalidArgument as exc:
            raise InvalidArgument(exc.message, param="logprobs") from None
        try:
            results = await service.next_token_batch(prompts, 1, options, scored, adapter)
        except InvalidArgument as exc:
            raise InvalidArgument(exc.message, param=exc.param or "prompt") from None
        choices = []
        for index, result in enumerate(results):
            choices.append({"index": index, "text": tokenizer.decode(result.prompt_token_ids), "finish_reason": "length",
                            "logprobs": echo_logprobs(tokenizer, result.prompt_logprobs, [])
                            if body.logprobs is not None else None})
        usage = [Usage(len(r.prompt_token_ids), 0, len(r.prompt_token_ids)) for r in results]
        return json_bytes({**completion, "choices": choices, "usage": usage_json(usage)})


class CompletionEvents:
    """A completions stream's events: a chunk per token (text delta) with its choice's index, or
    per run of tokens its reader had not taken yet (their text together, a logprobs entry each,
    offsets by each token's own text as in a whole answer), each choice's last with its
    finish_reason. `tokens` is the first choice's token event straight from its sampled tokens
    (GenerationStream.follow): the same bytes, with no chunk built."""

    def __init__(self, completion: dict, logprobs: int | None, name: Callable[[int], str],
                 token_text: Callable[[int], str]):
        self.completion, self.logprobs, self.name, self.token_text = completion, logprobs, name, token_text
        self.offsets: dict[int, int] = {}  # each choice's text so far (logprobs' text_offset)
        self._plain: TextEvent | None = None  # made at the first token pushed

    def chunk(self, index: int, chunk: GenerateChunk) -> bytes:
        tokens = ([chunk.token] if chunk.token else []) + chunk.more_tokens
        texts = [t.token for t in tokens] if chunk.more_tokens else [chunk.text]
        return self._event(index, chunk.text, finish_reason(chunk.finish_reason) or None, tokens, texts)

    def tokens(self, text: str, tokens: list[SampledToken]) -> bytes:
        if self.logprobs is None:
            if self._plain is None:
                self._plain = TextEvent(lambda text: {**self.completion, "choices": [
                    {"index": 0, "text": text, "finish_reason": None, "logprobs": None}]})
            return self._plain(text)
        # A SampledToken has what logprobs_json reads (token_id, logprob, top): no chunk between.
        texts = [self.token_text(t.token_id) for t in tokens] if len(tokens) > 1 else [text]
        return self._event(0, text, None, tokens, texts)

    def _event(self, index: int, text: str, finish: str | None, tokens: list, texts: list[str]) -> bytes:
        offset = self.offsets.get(index, 0)
        choice = {"index": index, "text": text, "finish_reason": finish,
                  "logprobs": logprobs_json(self.name, tokens, texts, offset) if self.logprobs is not None else None}
        self.offsets[index] = offset + len(text)
        return sse_event({**self.completion, "choices": [choice]})


async def stream_events(events: CompletionEvents, chunks: AsyncIterator[tuple[int, Any]], include_usage: bool,
                        error_body: Callable[[ServeError], dict]):
    """OpenAI's stream: `events`' chunks as they come; when asked for, the usage of all choices
    in a chunk of its own after the last; then `data: [DONE]`."""
    usages: list[Usage] = []
    try:
        async for index, chunk in chunks:
            yield events.chunk(index, chunk)
            if chunk.finish_reason:
                usages.append(chunk.usage or Usage())
        if include_usage:
            yield sse_event({**events.completion, "choices": [], "usage": usage_json(usages)})
    except ServeError as exc:  # after the 200: the error as one more event, in OpenAI's shape
        yield sse_event(error_body(exc))
    yield sse_event("[DONE]")
