"""LoRA adapters (engine.lora) against peft's own unmerged forward, on a checkpoint and adapters
this test saves itself: next-token top-k, scored prompts and greedy generation, each adapter
alone and mixed with the base and each other in one forward; the prefix cache never shares a
block across adapters; and every adapter peft can save that we cannot serve is refused by name."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from gpt2serve.engine.engine import Engine
from gpt2serve.engine.generator import Generator, NewSequence
from gpt2serve.engine import traced_decode
from gpt2serve.engine.loading import load_model
from gpt2serve.engine.lora import AdapterError, AdapterRows, load_adapter
from gpt2serve.engine.steps import Ask
from gpt2serve.protocol import GenerateRequest, TraceContext
from gpt2serve.scheduling.core import EngineCore, new_engine_thread
from support.asks import LAYERS
from support.generation import GREEDY, LIVELY, transformers_greedy
from support.lora import ADAPTERS, make_adapter, make_adapters, peft_blocks, peft_model, peft_shifts
from support.reference import (
    TOLERANCE,
    as_result,
    assert_matches_reference,
    assert_prompt_scores_match,
    transformers_random_model,
)
from support.scheduler_events import events

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [(3 * j + 1) % 50257 for j in range(40)], [7, 8, 9], [12]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(base transformers model, its checkpoint dir, adapter dirs, peft models by name)."""
    directory = tmp_path_factory.mktemp("lora")
    hf = transformers_random_model(seed=3, **LIVELY)
    hf.save_pretrained(directory / "ckpt")
    dirs = make_adapters(directory / "ckpt", directory)
    return hf, directory / "ckpt", dirs, {name: peft_model(directory / "ckpt", path) for name, path in dirs.items()}


def engine_with_adapters(setup, quantize: str = "none") -> tuple[Engine, dict]:
    _, ckpt, dirs, _ = setup
    engine = Engine(load_model(str(ckpt), "cpu", "float32", quantize=quantize))
    return engine, {name: load_adapter(name, path, engine.model.config) for name, path in dirs.items()}


def judge(setup, name):
    hf, _, _, peft = setup
    return hf if name is None else peft[name]


MIXED = [None, "poet", "coder", "critic", "coder"]  # one per prompt: the base and all three, in one forward


def test_next_token_equals_peft_for_each_adapter_mixed_with_the_base_in_one_batch(setup):
    engine, adapters = engine_with_adapters(setup)
    out = engine.next_token([Ask(p, 5, adapter=adapters.get(n)) for p, n in zip(PROMPTS, MIXED)])
    for prompt, name, top in zip(PROMPTS, MIXED, out.top):
        assert_matches_reference(judge(setup, name), as_result(prompt, top), prompt, 5)
    # The adapters move the answer: the base's top-5 for the coder's prompt is another list.
    base = engine.next_token([Ask(PROMPTS[2], 5)]).top[0]
    assert [t.token_id for t in base] != [t.token_id for t in out.top[2]]


def test_scored_prompts_equal_peft_under_their_adapters(setup):
    engine, adapters = engine_with_adapters(setup)
    out = engine.next_token([Ask(p, 1, prompt_logprobs=3, adapter=adapters.get(n)) for p, n in zip(PROMPTS, MIXED)])
    for row, (prompt, name) in enumerate(zip(PROMPTS, MIXED)):
        if len(prompt) < 2:
            continue
        s = out.prompt_scores[row]
        assert_prompt_scores_match(judge(setup, name), prompt, s.token_logprobs, s.ranks, s.top_ids, s.top_logprobs)


@pytest.mark.parametrize("riders", [False, True])
def test_greedy_generation_equals_peft_with_adapters_and_the_base_decoding_side_by_side(setup, riders):
    engine, adapters = engine_with_adapters(setup)
    generator = Generator(engine, slots=4)
    names = [None, "poet", "coder", "critic"]
    prompts = PROMPTS[:4]
    generator.prefill([NewSequence(i, p, GREEDY, i, adapter=adapters.get(n))
                       for i, (p, n) in enumerate(zip(prompts, names))])
    tokens = {i: [] for i in range(4)}
    first = generator.running
    assert [r.adapter for r in first] == [adapters.get(n) for n in names]
    for _ in range(8):  # the prefill's tokens came back in its output; read each decode step's
        step = generator.decode([Ask(PROMPTS[4], 3, adapter=adapters["coder"])] if riders else [])
        for i, token in step.tokens.items():
            tokens[i].append(token.token_id)
        if riders:  # a rider under an adapter in a decode step's forward answers as peft does
            assert_matches_reference(judge(setup, "coder"), as_result(PROMPTS[4], step.riders.top[0]), PROMPTS[4], 3)
    for i, (prompt, name) in enumerate(zip(prompts, names)):
        want = transformers_greedy(judge(setup, name), prompt, 9)
        assert tokens[i] == want[1:], name


def test_int8_adapter_rows_stay_within_int8s_own_error(setup):
    """int8 weights, the LoRA term in fp32 on top: under each adapter the answers are as far from
    peft's as the int8 base is from transformers' (on these lively weights, up to 0.3 in a
    log-probability), while an adapter moves them by 9 to 24: every prompt under every adapter
    and the base, twenty rows in one forward."""
    engine, adapters = engine_with_adapters(setup, quantize="int8")
    names = [None, *ADAPTERS]
    out = engine.next_token([Ask(p, 1, adapter=adapters.get(n)) for n in names for p in PROMPTS])
    errors = {}
    for i, top in enumerate(out.top):
        name, prompt = names[i // len(PROMPTS)], PROMPTS[i % len(PROMPTS)]
        with torch.no_grad():
            ref = torch.log_softmax(judge(setup, name)(torch.tensor([prompt])).logits[0, -1], -1)
        errors.setdefault(name, []).append(abs(ref[top[0].token_id].item() - top[0].logprob))
    base_error = max(errors.pop(None))
    assert base_error > TOLERANCE  # int8 is not exact: the bar below is int8's own error
    for name, errs in errors.items():
        assert max(errs) <= 2 * base_error, (name, errs, base_error)
    # Alone, the same numbers as beside the base and the other adapters: rows do not reach each other.
    alone = engine.next_token([Ask(PROMPTS[2], 1, adapter=adapters["coder"])]).top[0]
    assert alone[0].logprob == pytest.approx(out.top[2 * len(PROMPTS) + 2][0].logprob, abs=1e-5)


def test_the_prefix_cache_never_serves_a_block_computed_under_another_adapter(setup):
    engine, adapters = engine_with_adapters(setup)
    engine.attach_prefix_cache(64, doorkeeper=False)
    prompt = PROMPTS[2]  # 40 tokens: two full blocks
    first = engine.next_token([Ask(prompt, 3, adapter=adapters["coder"])])
    assert first.cached_tokens == [0]
    again = engine.next_token([Ask(prompt, 3, adapter=adapters["coder"]), Ask(prompt, 3), Ask(prompt, 3, adapter=adapters["poet"])])
    assert again.cached_tokens == [32, 0, 0]  # the coder's blocks, for the coder alone
    for name, top in zip(["coder", None, "poet"], again.top):
        assert_matches_reference(judge(setup, name), as_result(prompt, top), prompt, 3)
    base_again = engine.next_token([Ask(prompt, 3)])
    assert base_again.cached_tokens == [32]  # the base kept its own blocks
    assert_matches_reference(judge(setup, None), as_result(prompt, base_again.top[0]), prompt, 3)


def test_adapter_weights_cost_their_own_bytes(setup):
    _, adapters = engine_with_adapters(setup)
    coder = adapters["coder"]
    config = transformers_random_model(seed=3, **LIVELY).config
    C, r, L = config.n_embd, ADAPTERS["coder"][0], config.n_layer
    # per layer: c_attn (r x C + 3C x r), attn c_proj (2 x C x r), mlp c_fc (r x C + 4C x r), mlp c_proj (r x 4C + C x r)
    assert coder.nbytes == 4 * L * r * (C + 3 * C + 2 * C + C + 4 * C + 4 * C + C)
    assert coder.rank == r and coder.targets == ("c_attn", "c_proj", "c_fc")


def _refusal(tmp_path, setup, edit=None, targets=("c_attn",), **extra) -> str:
    _, ckpt, _, _ = setup
    path = make_adapter(ckpt, tmp_path / "bad", 4, list(targets), 8, False, seed=9, **extra)
    if edit is not None:
        edit(path)
    engine, _ = engine_with_adapters(setup)
    with pytest.raises(AdapterError) as refused:
        load_adapter("bad", path, engine.model.config, max_rank=8)
    return str(refused.value)


def test_a_rank_over_the_limit_is_refused(tmp_path, setup):
    _, ckpt, _, _ = setup
    path = make_adapter(ckpt, tmp_path / "big", 16, ["c_attn"], 8, False, seed=9)
    engine, _ = engine_with_adapters(setup)
    with pytest.raises(AdapterError, match="rank 16 is over --max-lora-rank 8"):
        load_adapter("big", path, engine.model.config, max_rank=8)


def test_dora_modules_to_save_and_biases_are_refused_by_name(tmp_path, setup):
    assert "use_dora" in _refusal(tmp_path / "dora", setup, use_dora=True)
    assert "modules_to_save" in _refusal(tmp_path / "save", setup, modules_to_save=["lm_head"])
    assert "bias" in _refusal(tmp_path / "bias", setup, bias="lora_only")


def test_an_embedding_adapter_is_refused_by_its_weight(tmp_path, setup):
    message = _refusal(tmp_path, setup, edit=lambda p: _set_config(p, target_modules=["c_attn"]),
                       targets=["c_attn", "wte"])
    assert "wte" in message


def test_a_corrupt_or_missing_file_and_another_models_shapes_are_refused(tmp_path, setup):
    def truncate(path):
        data = (path / "adapter_model.safetensors").read_bytes()
        (path / "adapter_model.safetensors").write_bytes(data[:len(data) // 2])

    assert "not readable" in _refusal(tmp_path / "cut", setup, edit=truncate)
    assert "no adapter_model" in _refusal(tmp_path / "gone", setup,
                                          edit=lambda p: (p / "adapter_model.safetensors").unlink())
    assert "adapter_config.json" in _refusal(tmp_path / "noconf", setup,
                                             edit=lambda p: (p / "adapter_config.json").unlink())
    # An adapter made for a wider GPT-2: its A and B do not fit this base.
    other = tmp_path / "other"
    transformers_random_model(seed=4, n_embd=128).save_pretrained(other / "ckpt")
    path = make_adapter(other / "ckpt", other / "adapter", 4, ["c_attn"], 8, False, seed=9)
    engine, _ = engine_with_adapters(setup)
    with pytest.raises(AdapterError, match="do not fit the base"):
        load_adapter("other", path, engine.model.config)


def test_a_bin_adapter_loads_as_its_safetensors_twin_does(tmp_path, setup):
    _, ckpt, _, _ = setup
    a = make_adapter(ckpt, tmp_path / "st", 4, ["c_fc"], 8, False, seed=5)
    b = make_adapter(ckpt, tmp_path / "bin", 4, ["c_fc"], 8, False, seed=5, safetensors=False)
    assert (b / "adapter_model.bin").exists()
    engine, _ = engine_with_adapters(setup)
    one, two = (load_adapter(n, p, engine.model.config) for n, p in (("st", a), ("bin", b)))
    assert one.weights.keys() == two.weights.keys()
    for key in one.weights:
        assert all(torch.equal(x, y) for x, y in zip(one.weights[key], two.weights[key]))


def _set_config(path, **fields):
    config = json.loads((path / "adapter_config.json").read_text())
    config.update(fields)
    (path / "adapter_config.json").write_text(json.dumps(config))


def test_a_long_prompt_read_in_chunks_under_an_adapter_beside_base_streams_generates_as_peft_does(setup):
    """Through the engine core, as a server runs it: the adapter named by the request, its prompt
    read in chunks of 16 riding the base stream's decode steps, the prefix cache on."""
    engine, _ = engine_with_adapters(setup)
    engine.attach_prefix_cache(64, doorkeeper=False)
    _, ckpt, dirs, _ = setup
    engine.adapters.load("coder", dirs["coder"])
    generator = Generator(engine, slots=4, chunk_tokens=16)
    long_prompt = [(7 * j + 3) % 50257 for j in range(60)]
    requests = [(0.0, GenerateRequest(PROMPTS[0], GREEDY, 12)),
                (0.05, GenerateRequest(long_prompt, GREEDY, 6, adapter="coder")),
                (0.05, GenerateRequest(long_prompt, GREEDY, 6))]
    core = EngineCore(generator, max_batch_size=64, max_batch_delay_s=0.001, max_queue=64, max_batch_tokens=4096,
                      engine_thread=new_engine_thread(), adapters=engine.adapters)

    async def run():
        core.start()
        try:
            async def one(delay, request):
                await asyncio.sleep(delay)
                return [event.token.token_id async for event in events(core, request)]
            return await asyncio.gather(*(one(d, r) for d, r in requests))
        finally:
            await core.stop()

    base_tokens, coder_tokens, plain_tokens = asyncio.run(run())
    assert coder_tokens == transformers_greedy(judge(setup, "coder"), long_prompt, 6)
    assert plain_tokens == transformers_greedy(judge(setup, None), long_prompt, 6)  # the adapter's blocks not reused
    assert base_tokens == transformers_greedy(judge(setup, None), PROMPTS[0], 12)
    assert coder_tokens != plain_tokens


def test_a_traced_prompt_under_an_adapter_reports_peft_s_layers(setup):
    engine, adapters = engine_with_adapters(setup)
    out = engine.layer_reports(engine.next_token([Ask(PROMPTS[2], 5, trace=LAYERS, adapter=adapters["poet"]),
                                                  Ask(PROMPTS[2], 5, trace=LAYERS)]))
    for row, name in enumerate(["poet", None]):
        assert_matches_reference(judge(setup, name), as_result(PROMPTS[2], out.top[row]), PROMPTS[2], 5)
        with torch.no_grad():
            want = torch.softmax(judge(setup, name)(torch.tensor([PROMPTS[2]])).logits[0, -1], -1).topk(3)
        lens = out.layers[row][-1].logit_lens  # the last block's lens: the model's own answer
        assert [t.token_id for t in lens[:3]] == want.indices.tolist()
        assert [t.prob for t in lens[:3]] == pytest.approx(want.values.tolist(), abs=1e-4)


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_compare_base_sets_each_block_beside_the_base_as_peft_measures_it(setup, prefix_cache):
    engine, adapters = engine_with_adapters(setup)
    if prefix_cache:
        engine.attach_prefix_cache(64, doorkeeper=False)
    beside = TraceContext(layers_wanted=True, compare_base=True)
    prompt = PROMPTS[2]
    asks = [Ask(PROMPTS[0], 5), Ask(prompt, 5, trace=beside, adapter=adapters["coder"]),
            Ask(PROMPTS[1], 5, adapter=adapters["poet"]), Ask(PROMPTS[3], 4, trace=beside, adapter=adapters["critic"])]
    out = engine.layer_reports(engine.next_token(asks))
    assert len(out.top) == 4 and set(out.layers) == {1, 3}  # the twins are no rows of the answer
    assert set(out.base_top) == {1, 3}
    for row, name in ((1, "coder"), (3, "critic")):
        model, text = judge(setup, name), asks[row].prompt
        assert_matches_reference(model, as_result(text, out.top[row]), text, asks[row].top_k)
        assert_matches_reference(judge(setup, None), as_result(text, out.base_top[row]), text, asks[row].top_k)
        want = peft_shifts(model, text)
        got = [(r.base_residual_shift, r.base_attn_shift, r.base_mlp_shift) for r in out.layers[row]]
        assert got == [pytest.approx(w, rel=1e-3, abs=1e-5) for w in want]
        _, base_logits = peft_blocks(model, text, base=True)
        lens = out.layers[row][-1].base_logit_lens  # the last block's base lens: the base's own answer
        assert [t.token_id for t in lens[:3]] == base_logits.softmax(-1).topk(3).indices.tolist()
        assert min(min(shift) for shift in got) > 1e-3  # every block moved: the test can tell
    # Rows that did not ask are answered as before, with no base beside them.
    assert_matches_reference(judge(setup, "poet"), as_result(PROMPTS[1], out.top[2]), PROMPTS[1], 5)
    assert 2 not in out.base_top
    if prefix_cache:  # the traced row kept its blocks under its adapter, read back as peft's
        again = engine.next_token([Ask(prompt, 3, adapter=adapters["coder"])])
        assert again.cached_tokens == [32]
        assert_matches_reference(judge(setup, "coder"), as_result(prompt, again.top[0]), prompt, 3)


@pytest.mark.parametrize("max_loras", [1, None])
def test_max_loras_bounds_a_forwards_adapters_and_max_cpu_loras_the_ones_in_memory(setup, monkeypatch, max_loras):
    """vLLM's --max-loras and --max-cpu-loras through the engine core: streams under three adapters
    and the base, each equal to peft's; with max_loras 1 no forward holds two adapters (without it
    one does); with two of three kept in memory the third is read back from its directory when used."""
    engine, _ = engine_with_adapters(setup)
    _, _, dirs, _ = setup
    engine.adapters.max_resident = 2
    for name in ("poet", "coder", "critic"):
        engine.adapters.load(name, dirs[name])
    assert engine.adapters.resident == ["poet", "coder", "critic"]  # a load drops nothing: not the engine thread
    engine.adapters.ready([])  # as the server's start does once all are read
    assert engine.adapters.resident == ["coder", "critic"] and engine.adapters.resolve("poet").weights is None
    seen = []  # the distinct adapters of every forward that had any
    real_of = AdapterRows.of.__func__
    monkeypatch.setattr(AdapterRows, "of", classmethod(lambda cls, adapters, lengths, device: (
        seen.append(len({a for a in adapters if a is not None})), real_of(cls, adapters, lengths, device))[1]))
    names = ["poet", "coder", None, "critic", "poet", "coder"]
    requests = [GenerateRequest(PROMPTS[i % 4], GREEDY, 5, adapter=name) for i, name in enumerate(names)]
    core = EngineCore(Generator(engine, slots=8), max_batch_size=64, max_batch_delay_s=0.001, max_queue=64,
                      max_batch_tokens=4096, engine_thread=new_engine_thread(), adapters=engine.adapters,
                      max_loras=max_loras)

    async def run():
        core.start()
        try:
            async def one(request):
                return [event.token.token_id async for event in events(core, request)]
            return await asyncio.gather(*(one(r) for r in requests))
        finally:
            await core.stop()

    for request, name, tokens in zip(requests, names, asyncio.run(run())):
        assert tokens == transformers_greedy(judge(setup, name), request.prompt, 5), name
    assert max(seen) == (1 if max_loras == 1 else 3)
    assert engine.adapters.reads >= 1  # poet, read back from its directory
    if max_loras is None:  # a forward keeps all of its adapters, over the limit for that time
        return
    assert len(engine.adapters.resident) == 2
    dropped = [n for n in ("poet", "coder", "critic") if n not in engine.adapters.resident]
    assert [engine.adapters.resolve(n).weights for n in dropped] == [None]


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_a_cpu_decode_trace_takes_the_adapters_as_inputs_so_another_set_of_that_shape_answers_as_peft(
        setup, tmp_path, monkeypatch, quantize):
    """engine.traced_decode: decode steps with adapter rows run a trace once their signature
    (adapters' count, rank, targets) recurs; the adapters' weights and mask are its inputs, so a
    twin of the coder (same rank and targets, other weights) replays the coder's trace with its own
    answers: the eager steps' token for token, and peft's (fp32; int8 is within its own error of
    peft, test_int8_adapter_rows_stay_within_int8s_own_error)."""
    engine, adapters = engine_with_adapters(setup, quantize)
    _, ckpt, dirs, _ = setup
    rank, targets, alpha, rslora = ADAPTERS["coder"]
    twin_dir = make_adapter(ckpt, tmp_path / "twin", rank, targets, alpha, rslora, seed=11)
    adapters["twin"] = load_adapter("twin", twin_dir, engine.model.config)
    judges = {None: judge(setup, None), "coder": judge(setup, "coder"), "twin": peft_model(ckpt, twin_dir)}

    def generate(generator: Generator, names: list, first_id: int) -> list[list[int]]:
        generator.prefill([NewSequence(first_id + i, p, GREEDY, i, adapter=adapters.get(n))
                           for i, (p, n) in enumerate(zip(PROMPTS, names))])
        tokens = {first_id + i: [] for i in range(len(names))}
        for _ in range(8):
            for i, token in generator.decode([]).tokens.items():
                tokens[i].append(token.token_id)
        generator.remove(list(tokens))
        return list(tokens.values())

    # One adapter beside the base, then two (in both places): the second set of each shape
    # replays the trace the first recorded, with its own adapters as inputs.
    sets = ([None, "coder", "coder"], [None, "twin", "twin"], [None, "coder", "twin"], [None, "twin", "coder"])
    monkeypatch.setattr(traced_decode, "ADAPTER_TRACE_AFTER", 10**9)  # never: eager
    eager_generator = Generator(engine, slots=4)
    eager = [generate(eager_generator, names, 10 * k) for k, names in enumerate(sets)]
    assert eager_generator.traces.adapter_traces == {}
    monkeypatch.setattr(traced_decode, "ADAPTER_TRACE_AFTER", 3)
    generator = Generator(engine, slots=4)
    for k, names in enumerate(sets):
        got = generate(generator, names, 10 * k)
        assert len(generator.traces.adapter_traces) == 1 + k // 2  # a second set of a shape records none
        assert got == eager[k], names
        if quantize == "none":
            assert got == [transformers_greedy(judges[n], p, 9)[1:] for p, n in zip(PROMPTS, names)], names


def test_prompt_rows_take_their_adapters_by_runs_and_decode_rows_by_the_mask_a_trace_takes(setup):
    """AdapterRows.of: long runs of one adapter's tokens (prompt rows, a length each) go by runs;
    decode rows (one length for all) always by the mask, even in long runs, since their traces
    take the mask as an input and a trace without it would give every row every adapter."""
    _, adapters = engine_with_adapters(setup)
    coder, critic = adapters["coder"], adapters["critic"]
    by_runs = AdapterRows.of([coder, coder, None, critic], [16, 16, 4, 16], torch.device("cpu"))
    assert by_runs.runs == [(0, 32, coder), (36, 52, critic)] and by_runs.mask is None
    decode = AdapterRows.of([coder] * 10 + [critic] * 10, 1, torch.device("cpu"))
    assert decode.runs == () and decode.mask.shape == (2 * 8, 20)
    short = AdapterRows.of([coder, critic, coder], [2, 3, 1], torch.device("cpu"))  # runs too short: masked
    assert short.runs == () and short.mask is not None
