"""The CUDA path: dtypes against the fp32 reference, CUDA graphs against eager, traced rows, a
real out-of-memory split, and the first request after ready. Skipped without CUDA; `make test`
runs them where CUDA is present, and scripts/gpu_check.sh runs them with the bench table.

Tolerances on logprobs, against transformers in fp32 on the CPU:
- float32 on cuda: 1e-3 (other kernels and summation orders; TF32 stays off);
- float16: 0.02 and bfloat16: 0.15. Their unit roundoffs are 2^-11 and 2^-8 (8x apart), and on
  the CPU the `peaked` model below strayed by at most 0.0066 (fp16) and 0.052 (bf16) over 80
  logprobs: about 3x that, since GPU kernels round in other places.
Top-1 agreement is checked wherever the reference's top-2 margin exceeds twice the tolerance;
with N(0, 0.02) random weights every margin is below 0.2, which would leave nothing to check,
so the token embedding is scaled 3x (`peaked`): top-1 logprobs from -1.4 to -5, margins to 6.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import random
import statistics
import time

import pytest
import torch
from support.servers import launch_server
from support.reference import assert_layer_matches, reference_layers, reference_logprobs
from support.reference import report_as_dict

from gpt2serve.engine.engine import Engine, EngineOptions
from gpt2serve.engine.generator import Generator
from gpt2serve.engine.steps import PromptLaunch, StepPlan, plain_asks
from support.asks import traced_asks
from gpt2serve.engine.loading import LoadedModel, build_random_model
from gpt2serve.engine.model_info import parameter_breakdown
from gpt2serve.engine.padding import IDS, POSITIONS, VALID, left_pad
from gpt2serve.engine.tokenizer import bundled_gpt2_tokenizer
from gpt2serve.scheduling.core import EngineCore, new_engine_thread
from gpt2serve_client import Client

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run by make test where present)")]

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
LOGPROB_TOLERANCE = {"float32": 1e-3, "float16": 0.02, "bfloat16": 0.15}
EMBEDDING_SCALE = 3.0
CUDA = torch.device("cuda")


def make_prompts(count: int, seed: int, max_len: int = 24) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(50257) for _ in range(rng.randint(1, max_len))] for _ in range(count)]


@pytest.fixture(scope="module")
def peaked():
    """random:gpt2 with a 3x token embedding, fp32 on the CPU (see the module doc)."""
    model = build_random_model("gpt2", seed=0)
    with torch.no_grad():
        model.wte.weight.mul_(EMBEDDING_SCALE)
    return model


def cuda_engine(model, dtype: torch.dtype, **options) -> Engine:
    """An engine over a copy of `model` on cuda in `dtype` (the CPU original stays the reference)."""
    on_device = copy.deepcopy(model).to(device=CUDA, dtype=dtype)
    loaded = LoadedModel(on_device, bundled_gpt2_tokenizer(), "test", "random", "test", CUDA, dtype,
                         parameter_breakdown(on_device))
    engine = Engine(loaded, EngineOptions(**{"max_batch_size": 64, **options}))
    engine.warm_up()
    return engine


def peak_of(call):
    """call()'s result, and the device memory it took at its peak beyond what was held before."""
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    result = call()
    return result, torch.cuda.max_memory_allocated() - base


@contextlib.contextmanager
def full_card_but(room: int):
    """The card filled but for `room` bytes (torch's cache emptied first) until the block ends."""
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    blocker = torch.empty(max(free - room, 0), dtype=torch.uint8, device=CUDA)
    try:
        yield
    finally:
        del blocker
        torch.cuda.empty_cache()


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_cuda_dtypes_agree_with_the_fp32_reference(peaked, dtype):
    tolerance = LOGPROB_TOLERANCE[dtype]
    prompts = make_prompts(48, seed=1)
    engine = cuda_engine(peaked, DTYPES[dtype])
    out = engine.next_token(plain_asks(prompts, [5] * len(prompts)))
    assert out.cuda_graph
    checked = 0
    for prompt, top in zip(prompts, out.top):
        ref = reference_logprobs(peaked, prompt)
        best2 = ref.topk(2).values
        for score in top:
            assert abs(score.logprob - ref[score.token_id].item()) <= tolerance, (dtype, score, ref[score.token_id])
        if best2[0] - best2[1] > 2 * tolerance:
            assert top[0].token_id == ref.argmax().item()
            checked += 1
    assert checked >= len(prompts) // 2, f"only {checked} prompts had a clear top-1"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replay_equals_the_eager_forward(peaked, dtype):
    """Same bucket-padded inputs: replayed graph vs the same forward run eagerly. And what a
    caller sees: graph answers vs eager answers at the prompts' own shape."""
    engine = cuda_engine(peaked, DTYPES[dtype])
    for count, seed in ((1, 2), (5, 3), (37, 4), (64, 5)):
        prompts = make_prompts(count, seed)
        replayed = engine.graphs.run(prompts)
        assert replayed is not None
        logprobs, (batch, length) = replayed
        logprobs = logprobs.clone()
        padded = left_pad(prompts, engine.pad_token_id, batch, length).to(CUDA)
        with torch.inference_mode():
            eager = engine.last_logprobs(padded[IDS], padded[POSITIONS], padded[VALID].bool())[:count]
        assert torch.allclose(logprobs, eager, atol=1e-5 if dtype == "float32" else 1e-2), (logprobs - eager).abs().max()
        graph_out = engine.next_token(plain_asks(prompts, [3] * count))
        eager_out = engine._eager(prompts, [3] * count, (), time.perf_counter(), time.time_ns())
        assert graph_out.cuda_graph and not eager_out.cuda_graph
        for a, b in zip(graph_out.top, eager_out.top):
            assert [s.logprob for s in a] == pytest.approx([s.logprob for s in b], abs=LOGPROB_TOLERANCE[dtype])


def test_traced_rows_on_cuda_equal_the_eager_reference(tiny_model):
    engine = cuda_engine(tiny_model.model, torch.float32)
    prompts = [[464, 3139, 286, 4881, 318], [40, 588], [1212, 318, 257, 1332, 286, 262, 1080, 13, 632]]
    out = engine.layer_reports(engine.next_token(traced_asks(prompts, 5, [0, 2])))
    assert not out.cuda_graph and sorted(out.layers) == [0, 2]
    for row in (0, 2):
        want = reference_layers(tiny_model.model, prompts[row])
        for report, expected in zip(out.layers[row], want):
            assert_layer_matches(report_as_dict(report), expected, tolerance=LOGPROB_TOLERANCE["float32"])
            assert report.duration_ms > 0  # CUDA events


def test_a_real_out_of_memory_splits_the_batch(peaked):
    """Fill the card until a batch of 64 long prompts cannot fit but a few can; the batcher
    splits it and every prompt still gets its answer. As in the server, the engine is built and
    warmed on the thread that later runs its forwards: cuBLAS makes its handle per thread, at
    its first matmul, and on a full card that fails (CUBLAS_STATUS_ALLOC_FAILED)."""
    thread = new_engine_thread()
    engine = thread.submit(cuda_engine, peaked, torch.float32, cuda_graphs=False).result()
    prompts = make_prompts(64, seed=6, max_len=1)
    prompts = [p * 1000 for p in prompts]  # 64 prompts of 1000 tokens
    expected, one_prompt = peak_of(lambda: thread.submit(
        lambda: [engine.next_token(plain_asks([p], [3])).top[0] for p in prompts[:8]]).result())
    with full_card_but(8 * one_prompt):  # room for ~8 prompts
        async def run():
            batcher = EngineCore(Generator(engine, slots=1), max_batch_size=64, max_batch_delay_s=0.01, max_queue=1024,
                                 max_batch_tokens=10**6, engine_thread=thread)
            batcher.start()
            try:
                return await batcher.submit(prompts, 3), batcher.batches_run
            finally:
                await batcher.stop()

        outputs, batches = asyncio.run(run())
    assert batches > 1, "the batch of 64 fitted: the card was not full enough"
    for got, want in zip(outputs, expected):
        assert [s.token_id for s in got.top] == [s.token_id for s in want]
        assert [s.logprob for s in got.top] == pytest.approx([s.logprob for s in want], abs=1e-4)


def test_a_real_out_of_memory_in_a_prefill_splits_it(peaked):
    """The same for generations: a prefill of 16 long prompts meets a full card, leaves no row
    behind, runs again in halves, and every stream gets its tokens (the first one each prompt's
    greedy next token)."""
    from support.scheduler_events import events

    from gpt2serve.protocol import GenerateRequest, SamplingParams

    async def drain(stream) -> list:
        return [e async for e in stream]

    thread = new_engine_thread()
    engine = thread.submit(cuda_engine, peaked, torch.float32, cuda_graphs=False).result()
    generator = Generator(engine, slots=16, graphs=False)
    thread.submit(generator.warm_up).result()  # the KV cache claimed whole, as in the server
    prompts = [p * 250 for p in make_prompts(16, seed=7, max_len=4)]  # up to 1,000 tokens each
    firsts, one_prompt = peak_of(lambda: thread.submit(
        lambda: [engine.next_token(plain_asks([p], [1])).top[0][0].token_id for p in prompts]).result())
    with full_card_but(4 * one_prompt):  # room for ~4 prompts
        async def run():
            core = EngineCore(generator, max_batch_size=16, max_batch_delay_s=0.01, max_queue=64,
                              max_batch_tokens=10**6, engine_thread=thread)
            core.start()
            try:
                streams = [events(core, GenerateRequest(p, SamplingParams(temperature=0.0), 2, ignore_eos=True))
                           for p in prompts]
                return await asyncio.gather(*(drain(s) for s in streams))
            finally:
                await core.stop()

        streamed = asyncio.run(run())
    assert [[e.token.token_id for e in got][0] for got in streamed] == firsts
    assert all(len(got) == 2 for got in streamed)


def test_the_first_request_after_ready_is_as_fast_as_the_steady_state(tmp_path):
    """Ready means warm: the first request, untraced or traced, within 1.5x of requests that
    follow the same idle (0.5 s) at steady state (the server's own timings; the client's channel
    is opened before). Measured against the busy median alone, any request after an idle is
    slower (on a CPU, 1.6x after 2 s: tests/scheduling/test_ready_is_warm.py), first or not."""
    srv = launch_server(tmp_path, "--model", "random:gpt2", "--device", "cuda", "--dtype", "bfloat16")
    try:
        with Client(srv.grpc_target) as client:
            client.model_info()  # connect
            for include_layers in (False, True):
                def timed(last: int) -> tuple[float, float, float]:
                    """(total, queue, forward) ms, so a failure says where the time went."""
                    t = client.next_token([464, 3139, 286, 4881, last], include_layers=include_layers).timings
                    return round(t.total_ms, 2), round(t.queue_ms, 2), round(t.forward_ms, 2)

                time.sleep(0.5)
                first = timed(318)
                after_idle, busy = [], []
                for round_ in range(3):
                    busy += [timed(400 + 20 * round_ + i)[0] for i in range(20)]
                    time.sleep(0.5)
                    after_idle.append(timed(500 + round_))
                assert first[0] <= 1.5 * max(t[0] for t in after_idle), \
                    (include_layers, "first", first, "after idle", after_idle, "busy", statistics.median(busy))
    finally:
        assert srv.stop() == 0



def test_decode_graphs_generate_what_eager_decoding_does(peaked):
    """Greedy generation on cuda, fp32: decode steps replayed from captured CUDA graphs give the
    tokens eager decode steps give, for sequences joining and leaving; both equal the CPU's."""
    from support.generation import PROMPTS, transformers_greedy
    from support.reference import as_transformers

    from gpt2serve.engine.generator import NewSequence
    from gpt2serve.protocol import SamplingParams

    engine = cuda_engine(peaked, torch.float32)
    greedy = SamplingParams(temperature=0.0)

    def generate(graphs: bool) -> dict[int, list[int]]:
        generator = Generator(engine, slots=8, graphs=graphs)
        got: dict[int, list[int]] = {}
        for start in range(0, 12, 4):  # three waves joining a running batch
            out = generator.prefill([NewSequence(i, PROMPTS[i], greedy, 0) for i in range(start, start + 4)])
            for seq_id, token in out.tokens.items():
                got[seq_id] = [token.token_id]
            for _ in range(6):
                for seq_id, token in generator.decode().tokens.items():
                    got[seq_id].append(token.token_id)
            generator.remove({i for i in got if len(got[i]) >= 13})
        assert generator.graphs is None or generator.graphs.graphs > 0
        return got

    with_graphs, eager = generate(True), generate(False)
    assert with_graphs == eager
    hf = as_transformers(peaked)
    for seq_id in (0, 5, 11):
        assert eager[seq_id] == transformers_greedy(hf, PROMPTS[seq_id], len(eager[seq_id]))


def test_a_decode_launch_on_cuda_waits_for_nothing(peaked):
    """The engine core queues step N+1 while step N runs (scheduling.runner): that only overlaps
    if launching a step never waits for the device. torch's sync debug mode raises on any call
    that would (a pageable copy, a read of a device value), for greedy and every sampling mode,
    with the penalties (their token history is on the device), bias, min_p and min_tokens."""
    from gpt2serve.engine.generator import NewSequence
    from gpt2serve.protocol import SamplingParams

    engine = cuda_engine(peaked, torch.float32)
    generator = Generator(engine, slots=8)
    modes = [SamplingParams(temperature=0.0, repetition_penalty=1.2, logit_bias=((11, 2.0),), min_tokens=3,
                            banned_early=(50256,)),
             SamplingParams(temperature=0.8, top_k=40, frequency_penalty=0.5, presence_penalty=0.3),
             SamplingParams(temperature=0.9, top_p=0.9, min_p=0.05), SamplingParams(temperature=1.0, logprobs=3)]
    generator.prefill([NewSequence(i, p, modes[i % 4], i) for i, p in enumerate(make_prompts(8, 5))])
    generator.finish(generator.launch(StepPlan()))  # its bucket's graph is captured here
    torch.cuda.set_sync_debug_mode("error")
    try:
        launched = [generator.launch(StepPlan()), generator.launch(StepPlan())]  # two in flight, as the core has them
    finally:
        torch.cuda.set_sync_debug_mode(0)
    steps = [generator.finish(launch) for launch in launched]
    assert all(len(step.tokens) == 8 and not step.failed for step in steps)


def test_launched_next_token_batches_wait_for_nothing_and_answer_as_next_token_does(peaked):
    """engine.cuda_graphs.BucketedForward.launch on cuda: two plain batches launched back to back under torch's sync
    debug mode (a launch that waited for the device would raise), then read, give each prompt
    the top-k a whole next_token() call gives it."""
    engine = cuda_engine(peaked, torch.float32)
    first, second = make_prompts(64, seed=11, max_len=12), make_prompts(40, seed=12, max_len=12)
    engine.launch_prompts(plain_asks(first, 5))  # captures any bucket not yet captured
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        launched = [engine.launch_prompts(plain_asks(first, 5)), engine.launch_prompts(plain_asks(second, 3))]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(isinstance(launch.prompts, PromptLaunch) for launch in launched)  # queued, not run whole
    for prompts, k, launch in zip((first, second), (5, 3), launched):
        got, want = engine.finish_prompts(launch).riders, engine.next_token(plain_asks(prompts, [k] * len(prompts)))
        assert got.cuda_graph and not got.failed_rows
        for mine, theirs in zip(got.top, want.top):
            assert [s.token_id for s in mine] == [s.token_id for s in theirs]
            assert [s.logprob for s in mine] == pytest.approx([s.logprob for s in theirs], abs=1e-4)


def test_the_overlapped_core_on_cuda_generates_what_it_does_without_overlap(peaked):
    """On cuda the core launches each decode step before reading the last one (its default
    there): streams joining and leaving, greedy and seeded, give the tokens they give without it.
    The seeded rows sample from their top 40: overlap changes when streams join, so the batch
    makeup, so the logits' last bits (engine.sampling), and a top-p draw over the flat tail of
    50,257 tokens can land on the neighbour of a step 1e-5 wide. A top-40 step is far wider: a
    token from the wrong draw, or a draw spent twice, still shows."""
    from support.generation import PROMPTS, run_joining

    from gpt2serve.protocol import GenerateRequest, SamplingParams

    engine = cuda_engine(peaked, torch.float32)
    requests = [(0.002 * i, GenerateRequest(PROMPTS[i], SamplingParams(temperature=0.0) if i % 2 else
                                            SamplingParams(temperature=0.9, top_k=40), 6 + 3 * (i % 4), seed=i))
                for i in range(12)]
    assert Generator(engine, slots=6).overlaps
    overlapped = asyncio.run(run_joining(Generator(engine, slots=6), requests))
    plain = asyncio.run(run_joining(Generator(engine, slots=6), requests, overlap=False))
    assert overlapped == plain
    assert [len(tokens) for tokens in plain] == [r.max_tokens for _, r in requests]


def test_prefix_cache_hits_on_cuda_equal_the_uncached_answers_with_graphs_on(peaked):
    """fp32 on cuda with graphs captured: a pool claimed at start, next tokens behind cached
    blocks (packed and per-row layouts) equal the same engine's answers without the cache, and
    generations prefilled from cached blocks decode through the graphs to the same tokens."""
    from gpt2serve.engine.generator import NewSequence
    from gpt2serve.protocol import SamplingParams

    engine = cuda_engine(peaked, torch.float32)
    rng = random.Random(3)
    shared = [rng.randrange(50257) for _ in range(100)]
    prompts = [shared + [rng.randrange(50257) for _ in range(n)] for n in (1, 5, 40)] + make_prompts(3, 4)
    engine.attach_prefix_cache(0)
    plain = engine.next_token(plain_asks(prompts, [5] * len(prompts)))
    greedy = SamplingParams(temperature=0.0)

    def generate() -> list[list[int]]:
        generator = Generator(engine, slots=8)
        out = generator.prefill([NewSequence(i, p, greedy, 0) for i, p in enumerate(prompts)])
        tokens = [[out.tokens[i].token_id] for i in range(len(prompts))]
        for _ in range(6):
            step = generator.decode()
            for i in range(len(prompts)):
                tokens[i].append(step.tokens[i].token_id)
        return tokens

    plain_tokens = generate()
    engine.attach_prefix_cache(64, doorkeeper=False)
    assert engine.prefix_cache.keys.device.type == "cuda"
    engine.next_token(plain_asks(prompts, [5] * len(prompts)))
    cached = engine.next_token(plain_asks(prompts, [5] * len(prompts)))
    assert cached.cached_tokens[:3] == [96, 96, 128]
    for a, b in zip(cached.top, plain.top):
        assert [t.token_id for t in a] == [t.token_id for t in b]
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a, b)) <= LOGPROB_TOLERANCE["float32"]
    assert generate() == plain_tokens


def test_controls_and_grammars_on_cuda_under_the_overlapped_core(peaked):
    """On cuda, with the core overlapping steps: penalized and biased streams give the tokens they
    give without overlap (their history is written on the device by each step), and constrained
    streams (read before the next launch) give outputs that validate."""
    import json

    import jsonschema
    from support.generation import PROMPTS, run_joining

    from gpt2serve.engine.grammar_check import grammar_for
    from gpt2serve.protocol import GenerateRequest, SamplingParams

    engine = cuda_engine(peaked, torch.float32)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    penalized = SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5,
                               logit_bias=((PROMPTS[3][0], 4.0),))
    constrained = SamplingParams(temperature=0.9, grammar=grammar_for("json_schema", json.dumps(schema), "test"))
    requests = [(0.002 * i, GenerateRequest(PROMPTS[i], penalized if i % 2 else constrained, 24, seed=i,
                                            ignore_eos=bool(i % 2))) for i in range(8)]
    overlapped = asyncio.run(run_joining(Generator(engine, slots=6), requests))
    plain = asyncio.run(run_joining(Generator(engine, slots=6), requests, overlap=False))
    tokenizer = engine.loaded.tokenizer
    for (_, request), got, want in zip(requests, overlapped, plain):
        if request.params is penalized:
            assert got == want
        else:
            text = tokenizer.decode([t for t in got if t != 50256])
            jsonschema.validate(json.loads(text), schema)
