"""The codec that puts protocol's messages on the IPC wire: each message is [tag, field, ...],
a frame one msgpack list of messages. Decoding checks every field's type, so a bad frame is a
BadFrame, never a half-built message."""

from __future__ import annotations

import struct
import threading
from collections.abc import Sequence
from dataclasses import asdict
from itertools import chain
from typing import Any, Callable

import msgpack
import numpy as np

from gpt2serve_client.types import LayerReport, ModelInfo, ShapeStep

from ..protocol import (AdapterUpdate, Adapters, Answers, Cancel, EngineReady, Failed, Generate, GenerateRequest, Hello, NextTokenOutput,
                        NextTokenRequest, Prompts, PromptScores, Result, SampledToken, SamplingParams, Step, StepControls,
                        Submit, TokenEvent, TokenScore, Tokens, TopRow, TopScores, TraceContext, cut_rows,
                        read_rows)
from .field_checks import (FLOATS, INTS, LISTS, BadFrame, as_bool, as_fields, as_float, as_floats, as_id_lists,
                           as_ids, as_int, as_list, as_str, optional)


def _pack_scores(scores: Sequence[TokenScore]) -> list:
    if type(scores) is TopRow:
        scores = scores.read()
    if type(scores) is TopScores:  # already in columns
        return [scores.ids, scores.logprobs]
    return [[s.token_id for s in scores], [s.logprob for s in scores]]


def _scores(x: Any) -> TopScores:
    ids, logprobs = as_fields(x, 2)
    if len(as_ids(ids)) != len(as_fields(logprobs, len(ids))):
        raise BadFrame("scores: ids and logprobs differ in length")
    if any(type(v) is not float for v in logprobs):  # msgpack gives floats back as floats
        logprobs = [as_float(v) for v in logprobs]
    return TopScores(ids, logprobs)


def _score_rows(x: Any) -> list[TopScores]:
    """A column of answers' [ids, logprobs], checked over all of them at once (a few passes in C);
    where that fails, one by one, so that the error names what is wrong."""
    if as_list(x) and set(map(type, x)) == LISTS and set(map(len, x)) == {2}:
        ids, logprobs = [s[0] for s in x], [s[1] for s in x]
        if (set(map(type, ids)) == LISTS == set(map(type, logprobs)) and list(map(len, ids)) == list(map(len, logprobs))
                and not set(map(type, chain(*ids))) - INTS and not set(map(type, chain(*logprobs))) - FLOATS):
            return list(map(TopScores, ids, logprobs))
    return [_scores(s) for s in x]


def _pack_prompt_scores(p: PromptScores | None) -> list | None:
    return None if p is None else [p.token_logprobs, p.ranks, p.top_ids, p.top_logprobs]


def _prompt_scores(x: Any) -> PromptScores | None:
    if x is None:
        return None
    logprobs, ranks, top_ids, top_logprobs = as_fields(x, 4)
    n = len(as_floats(logprobs))
    if len(as_ids(ranks)) != n or len(as_list(top_ids)) != n or len(as_list(top_logprobs)) != n:
        raise BadFrame("prompt scores: columns differ in length")
    for ids, values in zip(top_ids, top_logprobs):
        if len(as_ids(ids)) != len(as_floats(values)):
            raise BadFrame("prompt scores: top ids and logprobs differ in length")
    return PromptScores(logprobs, ranks, top_ids, top_logprobs)


def _pack_trace(t: TraceContext | None) -> list | None:
    return None if t is None else [t.traceparent, t.sampled, t.layers_wanted, t.layer_spans, t.layers_in_response,
                                   t.attention_maps, t.last_row_maps, t.compare_base]


def _trace(x: Any) -> TraceContext | None:
    if x is None:
        return None
    traceparent, *flags = as_fields(x, 8)
    return TraceContext(as_str(traceparent), *map(as_bool, flags))


def _from_dicts(what: str, build: Callable[[], Any]) -> Any:
    """A part the client types build from dicts; whatever they trip on is a BadFrame."""
    try:
        return build()
    except (TypeError, KeyError, AttributeError, ValueError) as exc:
        raise BadFrame(f"{what}: {exc}") from None


def _layers(x: Any) -> list[LayerReport] | None:
    if x is None:
        return None
    return _from_dicts("layer reports", lambda: [LayerReport.from_dict(report) for report in x])


def _pack_output(o: NextTokenOutput) -> list:
    return [_pack_scores(o.top), o.queue_s, o.forward_s, o.batch_size, o.enqueued_ns, o.batch_started_ns,
            None if o.layers is None else [asdict(r) for r in o.layers],
            None if o.walkthrough is None else [asdict(s) for s in o.walkthrough], _pack_prompt_scores(o.prompt_logprobs),
            o.cached_tokens, None if o.controlled_top is None else _pack_scores(o.controlled_top), o.allowed_tokens,
            None if o.base_top is None else _pack_scores(o.base_top)]


def _walkthrough(x: Any) -> list[ShapeStep] | None:
    if x is None:
        return None
    return _from_dicts("walk-through", lambda: [ShapeStep.from_dict(step) for step in x])


def _output(x: Any) -> NextTokenOutput:
    (top, queue_s, forward_s, batch_size, enqueued_ns, started_ns, layers, walkthrough, scores, cached,
     controlled_top, allowed, base_top) = as_fields(x, 13)
    return NextTokenOutput(_scores(top), as_float(queue_s), as_float(forward_s), as_int(batch_size),
                           as_int(enqueued_ns), as_int(started_ns), _layers(layers), _walkthrough(walkthrough),
                           _prompt_scores(scores), as_int(cached), optional(_scores, controlled_top), as_int(allowed),
                           optional(_scores, base_top))


def _pack_params(p: SamplingParams) -> list:
    return [p.temperature, p.top_k, p.top_p, p.logprobs, p.presence_penalty, p.frequency_penalty,
            p.repetition_penalty, [t for t, _ in p.logit_bias], [b for _, b in p.logit_bias], p.min_p, p.min_tokens,
            list(p.banned_early), p.grammar]


def _pack_generate(r: GenerateRequest) -> list:
    return [r.prompt, _pack_params(r.params), r.max_tokens, sorted(r.stop_token_ids), r.ignore_eos, r.seed,
            r.deadline, _pack_trace(r.trace), r.prompt_logprobs, r.adapter]


def _pack_controls(c: StepControls | None) -> list | None:
    return None if c is None else [_pack_params(c.params), c.prompt_length]


def _controls(x: Any) -> StepControls | None:
    if x is None:
        return None
    params, prompt_length = as_fields(x, 2)
    return StepControls(_params(params), as_int(prompt_length))


def _params(x: Any) -> SamplingParams:
    (temperature, top_k, top_p, logprobs, presence, frequency, repetition, bias_ids, biases, min_p, min_tokens,
     banned_early, grammar) = as_fields(x, 13)
    bias_ids, biases = as_ids(bias_ids), as_floats(biases)
    if len(bias_ids) != len(biases):
        raise BadFrame("expected as many biases as biased tokens")
    return SamplingParams(as_float(temperature), as_int(top_k), as_float(top_p), as_int(logprobs), as_float(presence),
                          as_float(frequency), as_float(repetition), tuple(zip(bias_ids, map(float, biases))),
                          as_float(min_p), as_int(min_tokens), tuple(as_ids(banned_early)), as_str(grammar))


def _generate(x: Any) -> GenerateRequest:
    prompt, params, max_tokens, stop_ids, ignore_eos, seed, deadline, trace, prompt_logprobs, adapter = as_fields(x, 10)
    return GenerateRequest(as_ids(prompt), _params(params), as_int(max_tokens), frozenset(as_ids(stop_ids)),
                           as_bool(ignore_eos), optional(as_int, seed), optional(as_float, deadline), _trace(trace),
                           optional(as_int, prompt_logprobs), optional(as_str, adapter))


def _pack_event(e: TokenEvent) -> list:
    t = e.token
    return [t.token_id, t.logprob, _pack_scores(t.top), e.finish_reason, e.queue_s, e.forward_s, e.batch_size,
            _pack_prompt_scores(e.prompt_logprobs), e.cached_tokens, t.allowed]


def _event(x: Any) -> TokenEvent:
    token_id, logprob, top, finish, queue_s, forward_s, batch_size, scores, cached, allowed = as_fields(x, 10)
    return TokenEvent(SampledToken(as_int(token_id), as_float(logprob), _scores(top), as_int(allowed)),
                      as_str(finish), as_float(queue_s), as_float(forward_s), as_int(batch_size),
                      _prompt_scores(scores), as_int(cached))


def _pack_tokens(m: Tokens) -> list:
    tops = [_pack_scores(top) for top in m.tops] if any(m.tops) else []
    return [m.request_ids, m.token_ids, m.logprobs, m.finish_reasons, tops, m.forward_s, m.batch_size,
            m.allowed if any(m.allowed) else []]


def _unpack_tokens(f: list) -> Tokens:
    request_ids, token_ids, logprobs, finish_reasons, tops, forward_s, batch_size, allowed = as_fields(f, 8)
    n = len(as_ids(request_ids))
    if (len(as_ids(token_ids)) != n or len(as_floats(logprobs)) != n or len(as_list(finish_reasons)) != n
            or len(as_list(tops)) not in (0, n) or len(as_ids(allowed)) not in (0, n)):
        raise BadFrame("tokens: columns of unequal length")
    return Tokens(request_ids, token_ids, [float(v) for v in logprobs], [as_str(r) for r in finish_reasons],
                  _score_rows(tops) if tops else [[] for _ in range(n)], as_float(forward_s),
                  as_int(batch_size), allowed)


def _pack_prompts(m: Prompts) -> list:
    return [m.request_ids, m.prompts, m.top_ks]


def _unpack_prompts(f: list) -> Prompts:
    request_ids, prompts, top_ks = as_fields(f, 3)
    n = len(as_ids(request_ids))
    if len(as_list(prompts)) != n or len(as_ids(top_ks)) != n:
        raise BadFrame("prompts: columns of unequal length")
    return Prompts(request_ids, as_id_lists(prompts), top_ks)


def _pack_answers(m: Answers) -> list:
    tops, packed = [], None
    if m.table is not None:  # rows of the batch's table: their bytes, not lists of numbers
        packed = m.table.packed(m.tops)
    else:
        tops = [_pack_scores(top) for top in m.tops]
    return [m.request_ids, tops, m.queue_s, m.enqueued_ns, m.cached_tokens if any(m.cached_tokens) else [],
            m.forward_s, m.batch_size, m.batch_started_ns, packed]


def _unpack_answers(f: list) -> Answers:
    request_ids, tops, queue_s, enqueued_ns, cached, forward_s, batch_size, started_ns, packed = as_fields(f, 9)
    n = len(as_ids(request_ids))
    if packed is not None:
        if as_list(tops):
            raise BadFrame("answers: both top lists and a packed table")
        tops = _packed_tops(packed, n)
    else:
        tops = _score_rows(tops)
    if (len(tops) != n or len(as_floats(queue_s)) != n or len(as_ids(enqueued_ns)) != n
            or len(as_ids(cached)) not in (0, n)):
        raise BadFrame("answers: columns of unequal length")
    return Answers(request_ids, tops, [float(v) for v in queue_s], enqueued_ns, cached, as_float(forward_s),
                   as_int(batch_size), as_int(started_ns))


# Up to this many values a side (8 rows of top 5), struct reads a packed table, not numpy: for a lone
# call's row, 3.2 against 7.0 µs timed in a loop, and about 100 against 60 µs of a front end's CPU
# from the answer's frame read to its dispatch (bench/host_path/call_timeline.py), where numpy's set-up
# runs on cold caches. Past about 40 values numpy reads faster.
SMALL_TABLE_VALUES = 40


def _packed_tops(x: Any, n: int) -> list[TopScores]:
    """TopTable.packed's [bytes, top_ks] for n answers -> their TopScores."""
    blob, top_ks = as_fields(x, 2)
    if type(blob) is not bytes or not n or len(blob) % (8 * n):
        raise BadFrame("answers: a packed table is 2 x n x k float32 values")
    k_max = len(blob) // (8 * n)
    if as_ids(top_ks) and (len(top_ks) != n or not all(0 < k <= k_max for k in top_ks)):
        raise BadFrame("answers: packed top_ks do not fit the table")
    top_ks = top_ks or [k_max] * n
    if n * k_max > SMALL_TABLE_VALUES:
        table = np.frombuffer(blob, dtype=np.float32).reshape(2, n, k_max)  # (2, n, k_max): values, ids
        ids = table[1]
        if not ((ids >= 0) & (ids < 2**24) & (ids == np.floor(ids))).all():  # NaN fails too
            raise BadFrame("answers: packed token ids are not integers")
        return read_rows(table, top_ks)
    floats = struct.unpack(f"{2 * n * k_max}f", blob)  # values (n x k_max), then ids, as Python floats
    cells = n * k_max
    if not all(0 <= i < 2**24 and i.is_integer() for i in floats[cells:]):  # NaN fails too
        raise BadFrame("answers: packed token ids are not integers")
    values, ids, starts = list(floats[:cells]), list(map(int, floats[cells:])), range(0, cells, k_max)
    return cut_rows([ids[s:s + k_max] for s in starts], [values[s:s + k_max] for s in starts], top_ks, k_max)


def _model_info(x: Any) -> ModelInfo:
    return _from_dicts("model info", lambda: ModelInfo.from_dict(x))


def _unpack_ready(f: list) -> EngineReady:
    info, source, max_batch_size = as_fields(f, 3)
    return EngineReady(_model_info(info), as_str(source), as_int(max_batch_size))


def _unpack_submit(f: list) -> Submit:
    request_id, (prompts, top_k, trace, prompt_logprobs, controls, adapter) = as_int(as_fields(f, 2)[0]), as_fields(f[1], 6)
    return Submit(request_id, NextTokenRequest(as_id_lists(prompts), as_int(top_k), _trace(trace),
                                               optional(as_int, prompt_logprobs), _controls(controls),
                                               optional(as_str, adapter)))


def _pack_result(m: Result) -> list:
    """Plain answers (a NextTokenBatch's) go in columns: as a list of 12 fields each, 64 of them
    cost the engine 1.9 µs a prompt to encode and the front end 6.6 to decode. When they are rows
    of one batch's TopTable (TopRow), their top tokens go as those rows' bytes (TopTable.packed)."""
    outputs = m.outputs
    if not all(o.plain for o in outputs):
        return [m.request_id, [_pack_output(o) for o in outputs], None]
    tops, scores, packed = [o.top for o in outputs], [], None
    table = tops[0].table if tops and type(tops[0]) is TopRow else None
    if table is not None and all(type(t) is TopRow and t.table is table for t in tops):
        packed = table.packed([t.row for t in tops])
    else:
        scores = [_pack_scores(t) for t in tops]
    return [m.request_id, [], [scores, [o.queue_s for o in outputs], [o.forward_s for o in outputs],
                               [o.batch_size for o in outputs], [o.enqueued_ns for o in outputs],
                               [o.batch_started_ns for o in outputs], [o.cached_tokens for o in outputs], packed]]


def _unpack_result(f: list) -> Result:
    request_id, outputs, columns = as_fields(f, 3)
    if columns is None:
        return Result(as_int(request_id), [_output(o) for o in as_list(outputs)])
    if as_list(outputs):
        raise BadFrame("result: both whole answers and columns")
    scores, queue_s, forward_s, batch_size, enqueued_ns, started_ns, cached, packed = as_fields(columns, 8)
    if packed is not None:
        if as_list(scores):
            raise BadFrame("result: both top lists and a packed table")
        tops = _packed_tops(packed, len(as_floats(queue_s)))
    else:
        tops = _score_rows(scores)
    if any(len(c) != len(tops) for c in (as_floats(queue_s), as_floats(forward_s), as_ids(batch_size),
                                         as_ids(enqueued_ns), as_ids(started_ns), as_ids(cached))):
        raise BadFrame("result: columns of unequal length")
    return Result(as_int(request_id), [NextTokenOutput(t, q, f, b, e, s, None, None, None, c) for t, q, f, b, e, s, c
                                       in zip(tops, queue_s, forward_s, batch_size, enqueued_ns, started_ns, cached)])


def _unpack_failed(f: list) -> Failed:
    request_id, code, message = as_fields(f, 3)
    return Failed(as_int(request_id), as_str(code), as_str(message))


# tag -> (message type, pack: message -> fields, unpack: fields -> message)
_WIRE: dict[int, tuple[type, Callable[[Any], list], Callable[[list], Any]]] = {
    0: (Hello, lambda m: [m.pid], lambda f: Hello(as_int(as_fields(f, 1)[0]))),
    1: (EngineReady, lambda m: [asdict(m.model_info), m.tokenizer_source, m.max_batch_size], _unpack_ready),
    2: (Submit, lambda m: [m.request_id, [m.request.prompts, m.request.top_k, _pack_trace(m.request.trace),
                            m.request.prompt_logprobs, _pack_controls(m.request.controls), m.request.adapter]],
        _unpack_submit),
    3: (Generate, lambda m: [m.request_id, _pack_generate(m.request)],
        lambda f: Generate(as_int(as_fields(f, 2)[0]), _generate(f[1]))),
    4: (Cancel, lambda m: [m.request_id], lambda f: Cancel(as_int(as_fields(f, 1)[0]))),
    5: (Result, _pack_result, _unpack_result),
    6: (Step, lambda m: [m.request_id, _pack_event(m.event)], lambda f: Step(as_int(as_fields(f, 2)[0]), _event(f[1]))),
    7: (Failed, lambda m: [m.request_id, m.code, m.message], _unpack_failed),
    8: (Tokens, _pack_tokens, _unpack_tokens),
    9: (Prompts, _pack_prompts, _unpack_prompts),
    10: (Answers, _pack_answers, _unpack_answers),
    11: (AdapterUpdate, lambda m: [m.request_id, m.name, m.path],
         lambda f: AdapterUpdate(*(read(x) for read, x in zip((as_int, as_str, as_str), as_fields(f, 3))))),
    12: (Adapters, lambda m: [m.request_id, m.names],
         lambda f: Adapters(as_int(as_fields(f, 2)[0]), [as_str(name) for name in as_list(f[1])])),
}
_TAGS = {cls: (tag, pack) for tag, (cls, pack, _) in _WIRE.items()}
MESSAGE_TYPES = tuple(cls for cls, _, _ in _WIRE.values())


_packers = threading.local()  # a Packer per thread: msgpack.packb makes a new one for every frame


def encode(messages: list) -> bytes:
    """One frame: the messages, in order."""
    frame = []
    for message in messages:
        tag, pack = _TAGS[type(message)]
        frame.append([tag, *pack(message)])
    packer = getattr(_packers, "packer", None)
    if packer is None:
        packer = _packers.packer = msgpack.Packer()
    return packer.pack(frame)


def decode(frame: bytes) -> list:
    """The messages of one frame; BadFrame if any part of it is not a known message."""
    try:
        items = msgpack.unpackb(frame)
    except Exception as exc:  # msgpack raises several types (ExtraData, FormatError, ValueError, ...)
        raise BadFrame(f"not msgpack: {exc}") from None
    if type(items) is not list:
        raise BadFrame("a frame is a list of messages")
    messages = []
    for item in items:
        if type(item) is not list or not item or type(item[0]) is not int or item[0] not in _WIRE:
            raise BadFrame(f"unknown message {str(item)[:40]}")
        messages.append(_WIRE[item[0]][2](item[1:]))
    return messages
