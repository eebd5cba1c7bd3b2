"""The `gpt2serve` command: `serve` runs the server; `next`, `score`, `generate` and `tokenize` ask
a running one for a next token, every prompt token's log-probability, a generation, or a text's
tokens; `bench` loads a server; `params` shows where a model's parameters live.

The client commands use only the client package, so they start fast and need neither torch nor
transformers; they wait for a server that is still starting, within their --timeout.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Sequence

from gpt2serve_client import Client, Gpt2ServeError, perplexity

from .benchmarks.generate_load import add_generate_bench_arguments, run_generate_bench
from .benchmarks.prefix_load import add_prefix_bench_arguments, run_prefix_bench
from .benchmarks.serving_load import add_bench_arguments, add_engine_bench_arguments, run_bench
from .config import ENV_ERRORS, EnvDefaults, add_serve_arguments, config_from_args
from .errors import ModelLoadError, StartupError
from .introspection.params import add_params_arguments, run_params
from .launch.supervisor import chat_template_parses, run_workers
from .launch.workers_plan import plan_workers

TARGET_ENV = "GPT2SERVE_TARGET"  # the one variable the client commands share: the server they talk to


def visible(token: str) -> str:
    """Show GPT-2's leading space and control characters so a token reads unambiguously."""
    return token.replace(" ", "␣").replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")


def format_next_token(result) -> str:
    rows = [("rank", "token", "prob", "logprob", "id")]
    for rank, t in enumerate(result.top, 1):
        rows.append((str(rank), repr(visible(t.token))[1:-1], f"{math.exp(t.logprob):.4f}", f"{t.logprob:.4f}", str(t.token_id)))
    lines = [
        f"next token: {visible(result.token)!r} (id {result.token_id}, p={math.exp(result.logprob):.4f})",
        f"prompt tokens: {list(result.prompt_token_ids)}",
        "",
        *table(rows, "<<>>>"),
    ]
    t = result.timings
    lines.append("")
    lines.append(f"queue {t.queue_ms:.1f} ms, forward {t.forward_ms:.1f} ms, total {t.total_ms:.1f} ms, batch of {result.batch_size}")
    if result.layers:
        lines += ["", format_layers(result)]
    if result.base_top:
        lines += ["", format_beside_base(result)]
    if result.trace_id:
        lines.append(f"trace id: {result.trace_id}")
    return "\n".join(lines)


def format_layers(result) -> str:
    """One row per block: shapes, what the most focused head looks at, and the logit-lens guess."""
    rows = [("layer", "hidden", "qkv", "attn", "mlp", "focused head -> token (pos, weight)", "logit lens", "ms")]
    for layer in result.layers:
        head_index, head = max(enumerate(layer.heads), key=lambda h: h[1].max_weight)
        lens = layer.logit_lens[0]
        rows.append((
            str(layer.index), shape(layer.hidden_shape), shape(layer.qkv_shape), shape(layer.attn_shape),
            shape(layer.mlp_shape),
            f"h{head_index} -> {visible(head.top_token)!r} ({head.top_position}, {head.max_weight:.2f})",
            f"{visible(lens.token)!r} {lens.prob:.4f}", f"{layer.duration_ms:.2f}",
        ))
    lines = table(rows, "<" * len(rows[0]))
    batch = result.layers[0]
    lines.append(f"(batch shapes: hidden {shape(batch.batch_hidden_shape)}, attn {shape(batch.batch_attn_shape)})")
    return "\n".join(lines)


def format_beside_base(result) -> str:
    """--compare-base: both top-k lists, then per block how far the adapter moved it from the base."""
    p = lambda t: f"{math.exp(t.logprob):.4f}"  # noqa: E731
    rows = [("rank", "with the adapter", "prob", "base", "prob")]
    rows += [(str(rank), repr(visible(t.token))[1:-1], p(t), repr(visible(b.token))[1:-1], p(b))
             for rank, (t, b) in enumerate(zip(result.top, result.base_top), 1)]
    shifts = [("block", "residual moved", "attention moved", "MLP moved", "lens (adapter)", "lens (base)")]
    shifts += [(str(layer.index), f"{layer.base_residual_shift:.1%}", f"{layer.base_attn_shift:.1%}",
                f"{layer.base_mlp_shift:.1%}", repr(visible(layer.logit_lens[0].token)),
                repr(visible(layer.base_logit_lens[0].token))) for layer in result.layers]
    return "\n".join(["beside the base (the same prompt, a row of the same forward; moved: |adapter - base| / |base|,"
                      " last position):", *table(rows, "<<><>"), "", *table(shifts, "<>>><<")])


def table(rows: list[tuple[str, ...]], align: str) -> list[str]:
    """Columns as wide as their widest cell, two spaces apart, a rule under the header row;
    `align` has one of "<" or ">" per column."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(f"{cell:{a}{w}}" for cell, a, w in zip(row, align, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def shape(dims) -> str:
    return "[" + ",".join(str(d) for d in dims) + "]"


def cmd_next(args: argparse.Namespace) -> int:
    try:
        with Client(args.target, timeout=args.timeout) as client:
            result = client.next_token(args.prompt, top_k=args.top_k, trace_layers=args.trace,
                                       include_layers=args.trace, adapter=args.adapter, compare_base=args.compare_base)
    except Gpt2ServeError as exc:
        print(f"error: {exc.code}: {exc.message}", file=sys.stderr)
        return 1
    print(format_next_token(result))
    return 0


def cmd_tokenize(args: argparse.Namespace) -> int:
    try:
        with Client(args.target, timeout=args.timeout) as client:
            result = client.tokenize(args.text, return_token_strs=True)
    except Gpt2ServeError as exc:
        print(f"error: {exc.code}: {exc.message}", file=sys.stderr)
        return 1
    print(f"{result.count} tokens (this server takes prompts of up to {result.max_model_len}): {result.tokens}")
    if args.strs:
        print("\n".join(f"{token_id:>6}  {visible(text)!r}" for token_id, text in zip(result.tokens, result.token_strs or ())))
    return 0


def format_scores(result) -> str:
    """One row per prompt token: its log-probability and rank after the tokens before it, and
    what the model would have put there; then the text's perplexity."""
    rows = [("pos", "token", "logprob", "rank", "model's choice", "its logprob")]
    for position, entry in enumerate(result.prompt_logprobs):
        token = repr(visible(entry.token))[1:-1]
        if entry.logprob is None:
            rows.append((str(position), token, "-", "-", "-", "-"))
            continue
        best = entry.top[0] if entry.top else None
        rows.append((str(position), token, f"{entry.logprob:.4f}", str(entry.rank),
                     repr(visible(best.token))[1:-1] if best else "", f"{best.logprob:.4f}" if best else ""))
    scored = len(result.prompt_logprobs) - 1
    lines = table(rows, "><>><>")
    lines += ["", f"{scored} tokens scored, perplexity {perplexity(result.prompt_logprobs):.4f}" if scored
              else "one token: nothing before it to score it against"]
    return "\n".join(lines)


def cmd_score(args: argparse.Namespace) -> int:
    text = args.text
    if args.file is not None:
        text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text(encoding="utf-8")
    if not text:
        print("error: give TEXT or --file", file=sys.stderr)
        return 2
    try:
        with Client(args.target, timeout=args.timeout) as client:
            result = client.next_token(text, top_k=1, prompt_logprobs=max(args.top_k, 1), adapter=args.adapter)
    except Gpt2ServeError as exc:
        print(f"error: {exc.code}: {exc.message}", file=sys.stderr)
        return 1
    print(format_scores(result))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    """Print the text as it comes, then (on stderr) why it ended and what it cost."""
    try:
        with Client(args.target, timeout=args.timeout) as client:
            for chunk in client.generate_stream(args.prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                                                top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                                                stop=args.stop or None, trace_layers=args.trace,
                                                adapter=args.adapter):
                print(chunk.text, end="", flush=True)
                closing = chunk
    except Gpt2ServeError as exc:
        print(f"\nerror: {exc.code}: {exc.message}", file=sys.stderr)
        return 1
    print(flush=True)
    t = closing.timings
    print(f"[{closing.finish_reason}: {closing.usage.completion_tokens} tokens, first after "
          f"{t.time_to_first_token_ms:.1f} ms, then {t.time_per_output_token_ms:.1f} ms each"
          f"{', trace ' + closing.trace_id if closing.trace_id else ''}]", file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"gpt2serve serve: {exc}", file=sys.stderr)
        return 2
    plan = plan_workers(config)
    try:
        if plan.workers > 1:  # the supervisor checks the chat template once its metrics directory is set
            return run_workers(config, plan)
        if not chat_template_parses(config):
            return 2
        from .launch.single_process import run  # lazy: it imports torch, which only serving needs

        run(replace(config, workers=1), plan.reason())  # resolved: nothing left to measure for it
    except (ModelLoadError, StartupError) as exc:
        # One line that names the cause and the flag; the traceback only when asked for.
        logging.getLogger("gpt2serve").debug("start-up failed", exc_info=exc)
        what = "cannot load model" if isinstance(exc, ModelLoadError) else "cannot start"
        print(f"gpt2serve serve: {what}: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.in_process:
        from .benchmarks.engine_limit import run_engine_bench  # lazy: torch, for the in-process limit

        return run_engine_bench(args)
    if args.shared_prefix:
        return run_prefix_bench(args)
    if args.generate:
        return run_generate_bench(args)
    return run_bench(args)


def cmd_params(args: argparse.Namespace) -> int:
    return run_params(args)


def build_parser(environ=os.environ) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpt2serve", description=__doc__.split("\n\n")[0].replace("\n", " "))
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the gRPC + REST server")
    add_serve_arguments(serve, environ)
    serve.set_defaults(func=cmd_serve)

    nxt = sub.add_parser("next", help="print the next token for a prompt, with a top-k table")
    nxt.add_argument("prompt")
    env = EnvDefaults(nxt, environ, prefix="GPT2SERVE_NEXT_")
    env.add("--top-k", type=int, default=5, help="alternatives to show")
    env.add("--target", default="localhost:50051", help="gRPC server host:port", env=TARGET_ENV)
    env.add("--timeout", type=float, default=30.0, help="deadline in seconds")
    env.add("--adapter", default=None, help="a LoRA adapter the server serves (GetModelInfo's adapters), by name; "
                                            "default: the base model")
    nxt.add_argument("--trace", action="store_true", help="trace this request's layers: print a per-layer table and the trace id")
    nxt.add_argument("--compare-base", action="store_true", help="with --adapter: the base model beside it, its top-k "
                                                                 "and how far the adapter moved each block")
    nxt.set_defaults(func=cmd_next)

    score = sub.add_parser("score", help="score a text: each token's log-probability and rank, the model's choice "
                                         "there, and the perplexity")
    score.add_argument("text", nargs="?", default="")
    score.add_argument("--file", help="read the text from this file ('-': standard input)")
    env = EnvDefaults(score, environ, prefix="GPT2SERVE_SCORE_")
    env.add("--top-k", type=int, default=1, help="alternatives the server returns per position (the first is shown)")
    env.add("--target", default="localhost:50051", help="gRPC server host:port", env=TARGET_ENV)
    env.add("--timeout", type=float, default=60.0, help="deadline in seconds")
    env.add("--adapter", default=None, help="a LoRA adapter the server serves (GetModelInfo's adapters), by name; "
                                            "default: the base model")
    score.set_defaults(func=cmd_score)

    gen = sub.add_parser("generate", help="generate text from a prompt, printed as it comes")
    gen.add_argument("prompt")
    env = EnvDefaults(gen, environ, prefix="GPT2SERVE_GENERATE_")
    env.add("--max-tokens", type=int, default=50, help="tokens to generate at most")
    env.add("--temperature", type=float, default=1.0, help="0: greedy")
    env.add("--top-k", type=int, default=0, help="sample among the k most likely (0: no limit)")
    env.add("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    env.add("--seed", type=int, default=None, help="the same seed, the same text")
    gen.add_argument("--stop", action="append", help="stop before this string (repeatable)")
    env.add("--target", default="localhost:50051", help="gRPC server host:port", env=TARGET_ENV)
    env.add("--timeout", type=float, default=120.0, help="deadline in seconds")
    env.add("--adapter", default=None, help="a LoRA adapter the server serves (GetModelInfo's adapters), by name; "
                                            "default: the base model")
    gen.add_argument("--trace", action="store_true", help="trace the prompt's layers and print the trace id")
    gen.set_defaults(func=cmd_generate)

    tok = sub.add_parser("tokenize", help="a text's token ids as the model reads them, and their count")
    tok.add_argument("text")
    env = EnvDefaults(tok, environ, prefix="GPT2SERVE_TOKENIZE_")
    env.add("--target", default="localhost:50051", help="gRPC server host:port", env=TARGET_ENV)
    env.add("--timeout", type=float, default=30.0, help="deadline in seconds")
    tok.add_argument("--strs", action="store_true", help="also each token's text, one a line")
    tok.set_defaults(func=cmd_tokenize)

    bench = sub.add_parser("bench", help="load a running server and compare with the in-process limit")
    add_bench_arguments(bench)
    add_engine_bench_arguments(bench)
    add_generate_bench_arguments(bench)
    add_prefix_bench_arguments(bench)
    bench.set_defaults(func=cmd_bench)

    params = sub.add_parser("params", help="where the parameters of a model live (GPT, Llama, Qwen, DeepSeek presets or a "
                                           "config.json), or its shapes, counted from its config")
    add_params_arguments(params)
    params.set_defaults(func=cmd_params)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    errors = getattr(args, ENV_ERRORS, [])
    if errors:  # only the chosen command's variables: another command's cannot break this one
        print(f"gpt2serve {args.command}: bad environment: {'; '.join(errors)}", file=sys.stderr)
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
