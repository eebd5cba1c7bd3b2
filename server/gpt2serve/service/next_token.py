"""A next-token call: prompts checked and tokenized, sent to the engine as one request, and the
answers built with their texts, timings and (when asked) per-layer reports."""

from __future__ import annotations

import time
from typing import Sequence

from gpt2serve_client.types import NextTokenResult, PromptTokenLogprob, Timings, TokenLogprob

from ..errors import InvalidArgument
from ..protocol import NextTokenOutput, NextTokenRequest, PromptScores
from ..telemetry.records import RequestOptions
from .context import CallContext
from .validation import MAX_ATTENTION_MAP_TOKENS, PromptInput


async def next_token_batch(service: CallContext, prompts: Sequence[PromptInput], top_k: int | None,
                           options: RequestOptions, prompt_logprobs: int | None = None,
                           adapter: str | None = None) -> list[NextTokenResult]:
    received = time.perf_counter()
    with service.telemetry.start_request(options) as request:
        engine, _ = service.require_model()
        validator = service.validator
        if not prompts:
            raise InvalidArgument("prompts: at least one prompt is required")
        if len(prompts) > service.max_batch_size:
            raise InvalidArgument(f"prompts: {len(prompts)} prompts exceed the limit of {service.max_batch_size} "
                                  f"per call")
        k = validator.top_k(top_k)
        scored_k = validator.prompt_logprobs(prompt_logprobs)
        adapter = validator.adapter(adapter)
        if options.compare_base and adapter is None:
            raise InvalidArgument("compare_base: set an adapter to compare with the base model")
        request.adapter_chosen(adapter)
        token_ids = [await validator.prompt(p, where=f"prompts[{i}]" if len(prompts) > 1 else "prompt")
                     for i, p in enumerate(prompts)]
        longest = max(map(len, token_ids))
        if options.attention_maps and longest > MAX_ATTENTION_MAP_TOKENS:
            raise InvalidArgument(f"attention_maps: the prompt has {longest} tokens; attention maps are "
                                  f"returned for prompts of at most {MAX_ATTENTION_MAP_TOKENS} tokens")
        trace = validator.trace(request, options)
        prompt_tokens = sum(map(len, token_ids))
        request.next_token_settings(k)
        outputs = await engine.next_token(NextTokenRequest(token_ids, k, trace, scored_k, adapter=adapter))
        request.prefix_cache_hit(sum(o.cached_tokens for o in outputs))
        if scored_k is not None:
            request.prompts_scored([o.prompt_logprobs for o in outputs])
        for out in outputs[:1]:  # The prompts of one call enter the queue together.
            request.queued(out.enqueued_ns, out.batch_started_ns)
        request.finish(prompt_tokens=prompt_tokens, output_tokens=len(token_ids), queue_s=[o.queue_s for o in outputs])
        total_ms = (time.perf_counter() - received) * 1000
        return [build_result(service, ids, out, total_ms, request.trace_id, options.layers_in_response)
                for ids, out in zip(token_ids, outputs)]


def build_result(service: CallContext, prompt_token_ids: list[int], out: NextTokenOutput, total_ms: float,
                 trace_id: str, include_layers: bool) -> NextTokenResult:
    token_text = service.validator.tokenizer.token_text
    texted = lambda scores: [TokenLogprob(s.token_id, token_text(s.token_id), s.logprob) for s in scores]  # noqa: E731
    top = texted(out.top)
    return NextTokenResult(
        token_id=top[0].token_id, token=top[0].token, logprob=top[0].logprob, top=top,
        prompt_token_ids=prompt_token_ids,
        timings=Timings(queue_ms=out.queue_s * 1000, forward_ms=out.forward_s * 1000, total_ms=total_ms),
        trace_id=trace_id, batch_size=out.batch_size,
        layers=(out.layers or []) if include_layers else [],
        prompt_tokens=[token_text(t) for t in prompt_token_ids] if include_layers else [],
        walkthrough=(out.walkthrough or []) if include_layers else [],
        prompt_logprobs=prompt_token_logprobs(token_text, prompt_token_ids, out.prompt_logprobs),
        base_top=texted(out.base_top or ()),
    )


def prompt_token_logprobs(token_text, token_ids: list[int], scores: PromptScores | None) -> list[PromptTokenLogprob]:
    """One entry per prompt token; the first has nothing before it, so no logprob or rank."""
    if scores is None:
        return []
    first = PromptTokenLogprob(token_ids[0], token_text(token_ids[0]), None, None, [])
    return [first] + [
        PromptTokenLogprob(token, token_text(token), logprob, rank,
                           [TokenLogprob(i, token_text(i), v) for i, v in zip(ids, values)])
        for token, logprob, rank, ids, values in zip(token_ids[1:], scores.token_logprobs, scores.ranks,
                                                     scores.top_ids, scores.top_logprobs)]
