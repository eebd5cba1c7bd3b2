"""`gpt2serve bench --in-process`: the engine against transformers' own forward, same weights, same
inputs, same device and dtype, in one run.

Both sides answer the same question for a batch: the top-5 next tokens of every prompt, on the
host. The engine starts from Python token lists (padding, copies, CUDA graphs on cuda, one copy
back); transformers from left-padded tensors already on the device (its forward with logits for
the last position only, then log_softmax and top-k). Rounds alternate between the two so a noisy
machine's drift hits both sides alike; medians are reported, and their ratio.

Also measured: the first request after warm-up (what a caller meets right after "ready"),
untraced and traced, against the steady state.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

from .serving_load import make_prompts
from ..engine.convert import to_transformers
from ..engine.engine import Engine, EngineOptions
from ..engine.steps import Ask, plain_asks
from ..protocol import TraceContext
from ..engine.loading import load_model
from ..engine.padding import IDS, POSITIONS, VALID, left_pad

TOP_K = 5
LAYERS = TraceContext(layers_wanted=True)


@dataclass
class SizeResult:
    batch_size: int
    engine_ms: float  # median per batch
    transformers_ms: float
    engine_prompts_per_s: float
    transformers_prompts_per_s: float
    ratio: float  # engine / transformers throughput
    cuda_graph: bool  # the engine replayed a captured graph for this size


@dataclass
class FirstRequest:
    first_ms: float
    steady_ms: float
    ratio: float


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TransformersSide:
    """transformers' GPT2LMHeadModel with the engine's weights, fed pre-built device tensors."""

    def __init__(self, engine: Engine):
        loaded = engine.loaded
        self.model = to_transformers(loaded.model).to(device=loaded.device, dtype=loaded.dtype)
        self.device, self.pad_id = loaded.device, engine.pad_token_id

    def inputs(self, prompts: list[list[int]]) -> dict[str, torch.Tensor]:
        batch = left_pad(prompts, self.pad_id).to(self.device)  # (3, B, T)
        return dict(input_ids=batch[IDS], position_ids=batch[POSITIONS], attention_mask=batch[VALID])

    @torch.inference_mode()
    def top(self, inputs: dict[str, torch.Tensor]) -> list:
        logits = self.model(**inputs, use_cache=False, logits_to_keep=1).logits[:, -1]  # (B, V)
        values, ids = torch.log_softmax(logits.float(), dim=-1).topk(TOP_K, dim=-1)
        return torch.stack((values, ids.float())).cpu().tolist()  # one copy to the host, as the engine does


def first_request(engine: Engine, prompt: list[int], traced: bool, steady_runs: int = 20) -> FirstRequest:
    def call():
        out = engine.next_token([Ask(prompt, TOP_K, trace=LAYERS if traced else None)])
        if traced:
            engine.layer_reports(out)

    first = timed(call)
    steady = statistics.median(timed(call) for _ in range(steady_runs))
    return FirstRequest(first * 1000, steady * 1000, first / steady)


def measure(engine: Engine, hf: TransformersSide, prompts: list[list[int]], rounds: int, per_round: int) -> SizeResult:
    size, inputs = len(prompts), hf.inputs(prompts)
    cuda_graph = engine.next_token(plain_asks(prompts, [TOP_K] * size)).cuda_graph
    hf.top(inputs)
    engine_s, hf_s = [], []
    for _ in range(rounds):  # alternate, so drift hits both sides
        engine_s += [timed(lambda: engine.next_token(plain_asks(prompts, [TOP_K] * size))) for _ in range(per_round)]
        hf_s += [timed(lambda: hf.top(inputs)) for _ in range(per_round)]
    e, h = statistics.median(engine_s), statistics.median(hf_s)
    return SizeResult(size, e * 1000, h * 1000, size / e, size / h, h / e, cuda_graph)


def format_table(header: str, sizes: list[SizeResult], firsts: dict[str, FirstRequest]) -> str:
    lines = [header, "",
             "| batch | engine ms | transformers ms | engine prompts/s | transformers prompts/s | ratio | path |",
             "|---|---|---|---|---|---|---|"]
    for r in sizes:
        lines.append(f"| {r.batch_size} | {r.engine_ms:.2f} | {r.transformers_ms:.2f} | {r.engine_prompts_per_s:,.0f} "
                     f"| {r.transformers_prompts_per_s:,.0f} | {r.ratio:.2f} | {'graph' if r.cuda_graph else 'eager'} |")
    lines.append("")
    for name, f in firsts.items():
        lines.append(f"first {name} request after warm-up: {f.first_ms:.2f} ms, steady {f.steady_ms:.2f} ms "
                     f"({f.ratio:.2f}x)")
    return "\n".join(lines)


def run_engine_bench(args) -> int:
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    loaded = load_model(args.model, args.device, args.dtype, seed=args.seed)
    options = EngineOptions(max_batch_size=max(sizes), cuda_graphs=args.cuda_graphs)
    engine = Engine(loaded, options)
    warm_s = timed(engine.warm_up)
    # two at least: the first-request figures use two different prompts, so neither meets a warm cache
    prompts = make_prompts(max(*sizes, 2), args.prompt_tokens, loaded.model.config.vocab_size, args.seed)
    firsts = {"untraced": first_request(engine, prompts[0], traced=False),
              "traced": first_request(engine, prompts[1], traced=True)}
    hf = TransformersSide(engine)
    results = [measure(engine, hf, prompts[:size], args.rounds or 5, args.per_round) for size in sizes]
    header = (f"{args.model}, {str(loaded.dtype).removeprefix('torch.')} on {loaded.device} "
              f"({torch.cuda.get_device_name(loaded.device) if loaded.device.type == 'cuda' else 'CPU'}), "
              f"{args.prompt_tokens}-token prompts, torch {torch.__version__}; warm-up {warm_s:.1f} s"
              + (f", {engine.graphs.graphs} CUDA graphs" if engine.graphs is not None else ""))
    if args.json:
        json.dump({"header": header, "sizes": [asdict(r) for r in results],
                   "first_request": {k: asdict(v) for k, v in firsts.items()}}, sys.stdout, indent=2)
        print()
    else:
        print(format_table(header, results, firsts))
    return 0
