"""Server configuration: one frozen dataclass, read from CLI flags and GPT2SERVE_* env vars.

Every flag `--some-flag` of `serve` may also come from `GPT2SERVE_SOME_FLAG`; an explicit flag
wins. The client commands read theirs under their own name, `GPT2SERVE_<COMMAND>_<FLAG>`
(GPT2SERVE_GENERATE_SEED is generate's sampling seed, GPT2SERVE_SEED serve's weight seed), except
GPT2SERVE_TARGET, the server every client command talks to. This module and its flag helpers
(config_env.py) are the only ones that read the environment for gpt2serve settings.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Mapping

from .config_env import (ENV_ERRORS, ENV_PREFIX, EnvDefaults, auto_float, auto_or_int, env_bool, env_name, lora_modules,
                         parse_bool, traces_exporter_configured)

__all__ = ["ENV_ERRORS", "ENV_PREFIX", "EnvDefaults", "ServeConfig", "add_serve_arguments", "auto_float",
           "auto_or_int", "config_from_args", "env_name", "parse_bool", "validate"]
DEVICES_HELP = "auto (CUDA when present, else CPU), cpu, cuda, cuda:N"
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZE_MODES = ("none", "int8", "fp16")  # engine.quantize.MODES
TRACE_LAYERS_MODES = ("never", "on-request", "always")
METRICS_COMPAT_CHOICES = ("vllm",)  # telemetry.metrics.METRICS_COMPAT
GRPC_SERVERS = ("grpcio", "builtin")  # transport.grpc_server.GrpcTransport
# --max-batch-size auto: on a GPU, batch 256 costs about what 64 does (issue 11, H100: CUDA-graph
# forwards of 1.65 ms at 64 and 3.5 ms at 256); on a CPU, 64 already fills the cores.
AUTO_MAX_BATCH_SIZE = {"cuda": 256, "cpu": 64}


@dataclass(frozen=True)
class ServeConfig:
    model: str = "gpt2"
    device: str = "auto"
    dtype: str = "auto"
    # Smaller weights for CPU decoding: int8 (per output channel) or fp16 storage (engine.quantize).
    quantize: str = "none"
    host: str = "0.0.0.0"
    grpc_port: int = 50051
    http_port: int = 8000
    max_batch_size: int | None = None  # None: auto, by device (AUTO_MAX_BATCH_SIZE)
    max_batch_delay_ms: float = 25.0
    max_queue: int = 1024
    # Padded tokens (batch size x longest prompt) in one forward; bounds activation memory.
    max_batch_tokens: int = 16384
    # A forward's fixed cost in padded tokens' worth, for length grouping; None: measured at warm-up.
    fixed_cost_tokens: float | None = None
    # 0 means "the model's context length".
    max_prompt_tokens: int = 0
    # When the default hub model cannot be loaded, serve random weights instead of failing.
    random_fallback: bool = True
    seed: int = 0
    log_level: str = "info"
    log_format: str = "text"  # or "json": one object a line, for a log shipper
    log_requests: bool = True  # a line per request (vLLM's --disable-log-requests turns it off); failures always
    log_stats_interval_s: float = 10.0  # the engine's stats line; 0: never
    # The model's name in /v1/models, every "model" field and the metrics' label; None: --model's.
    served_model_name: str | None = None
    # Per-layer spans and reports: never, when a request asks (trace_layers / include_layers), always.
    trace_layers: str = "on-request"
    # Share of requests traced (parent-based); layer-traced requests are always kept.
    trace_sample_ratio: float = 1.0
    # "otlp", "console" or None: decided by the standard OTEL_* variables (see telemetry.tracing).
    otel_traces_exporter: str | None = None
    # Largest request message (gRPC) or body (REST) accepted, in bytes.
    max_message_bytes: int = 4 * 1024 * 1024
    # Bearer key required on every inference call when set (health probes stay open).
    api_key: str | None = field(default=None, repr=False)
    metrics_require_key: bool = False
    # PEM files; both set means gRPC and HTTP serve TLS only.
    tls_cert: str | None = None
    tls_key: str | None = None
    # After SIGTERM: refuse new work, finish what was accepted, exit within this many seconds.
    shutdown_grace_s: float = 30.0
    # Load .bin (pickle) checkpoints; off: safetensors only (a pickle can run code when loaded).
    allow_pickle: bool = False
    # Replay captured CUDA graphs for bucketed shapes (cuda only; see engine.cuda_graphs).
    cuda_graphs: bool = True
    # Device memory the captured graphs may take; shapes past it run eagerly.
    cuda_graph_memory_mb: float = 4096.0
    # Front-end processes around one engine process; None: auto (1 on a CPU; see launch.workers_plan).
    workers: int | None = None
    # Generations in the running batch at most (one KV-cache slot each); None: --max-batch-size.
    max_running_sequences: int | None = None
    # A generation's prompt with more uncached tokens than this is read in chunks of this many, one
    # a step between the running generations' decode steps (engine.chunked_prefill); 0: never.
    prefill_chunk_tokens: int = 512
    # Most memory the KV cache may hold; None: auto (40% of free device memory on cuda, claimed at
    # start; 25% of what this process may use on a CPU, allocated as used; launch.engine_host).
    kv_cache_mb: float | None = None
    # Most memory the prefix cache may hold (0: off); None: auto (10% of free device memory on cuda,
    # claimed at start; 10% of what this process may use on a CPU, touched as used; launch.engine_host).
    prefix_cache_mb: float | None = None
    # A generation that has found no room in the KV cache by then gets RESOURCE_EXHAUSTED (unless its
    # own deadline, e.g. gRPC's, comes first).
    max_queue_wait_s: float = 30.0
    # A tracing UI's page for one trace, "{trace_id}" replaced (the /ui page links to it).
    trace_ui_url: str | None = None
    # Also export the router gauges under another server's names ("vllm"; telemetry.metrics).
    metrics_compat: str | None = None
    # gRPC connections closed (GOAWAY) after this long, so clients re-resolve and reach new replicas; 0: never.
    grpc_max_connection_age_s: float = 0.0
    # gRPC: keepalive pings a client may send (GOAWAY after 2 strikes), idle connections closed, streams
    # per connection (more wait their turn), connections per front end (past it: eviction or refusal).
    grpc_min_ping_interval_s: float = 10.0
    grpc_max_connection_idle_s: float = 300.0
    grpc_max_concurrent_streams: int = 256
    grpc_max_connections: int = 1024
    # A connection without its HTTP/2 handshake by then is closed; a call without its whole request, cancelled.
    grpc_handshake_timeout_s: float = 10.0
    grpc_request_timeout_s: float = 30.0
    grpc_send_timeout_s: float = 30.0  # an answer a client gives no window resets its stream (NGINX's send_timeout)
    grpc_server: str = "builtin"  # our gRPC layer on libnghttp2 (transport.grpc_builtin), or grpc.aio
    # REST: idle keep-alive connections closed, a request read whole in time; past the connection limit a new
    # one takes the place of the oldest without a request's headers, or is refused when all are busy.
    http_keep_alive_s: float = 5.0
    http_request_timeout_s: float = 30.0
    http_max_connections: int = 1024
    http_max_header_bytes: int = 16384  # 431 past it (NGINX's and Node's defaults are 8-16 KiB)
    http_max_request_line_bytes: int = 8192  # 414 past it
    # Streamed tokens go this many at a time, as vLLM's --stream-interval: the first at once, then every this
    # many, the rest at the end; 1: each as it comes. What a slow reader has not taken goes together.
    stream_interval: int = 1
    # A Jinja chat template (file, or inline) for /v1/chat/completions; None: the checkpoint's own, if any.
    chat_template: str | None = None
    # LoRA adapters beside the base, each "name=path" (a peft directory), chosen per request by name.
    lora_modules: tuple[str, ...] = ()
    max_lora_rank: int = 16
    max_loras: int | None = None  # distinct adapters one step may hold (vLLM's); None: every one loaded
    max_cpu_loras: int | None = None  # adapters whose weights stay in memory, least recently used out; None: all
    allow_runtime_lora_updating: bool = False  # adapters loaded and unloaded while serving

    @property
    def step_loras(self) -> int | None:
        """Distinct adapters a step may hold: --max-loras, else --max-cpu-loras (None: any number)."""
        return self.max_loras or self.max_cpu_loras

    def max_batch_size_on(self, device_type: str) -> int:
        return self.max_batch_size or AUTO_MAX_BATCH_SIZE.get(device_type, AUTO_MAX_BATCH_SIZE["cpu"])


def add_serve_arguments(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    d = ServeConfig()
    env = EnvDefaults(parser, environ)
    env.add("--model", default=d.model,
            help="Hugging Face id, local checkpoint directory, or random:<arch> (random:gpt2, random:tiny, ...)")
    env.add("--device", default=d.device, help=DEVICES_HELP)
    env.add("--dtype", default=d.dtype, choices=DTYPES, help="auto: bf16/fp16 on GPU, fp32 on CPU")
    env.add("--quantize", default=d.quantize, choices=QUANTIZE_MODES,
            help="CPU only: int8 weights per output channel (LM head and embedding included; activations "
                 "rounded per row in two parts, about 14 bits), or fp16 weight storage; fp32 compute either way")
    env.add("--host", default=d.host, help="address both servers bind to")
    env.add("--grpc-port", type=int, default=d.grpc_port, help="gRPC port (0: pick a free one)")
    env.add("--http-port", type=int, default=d.http_port, help="REST port (0: pick a free one)")
    env.add("--max-batch-size", type=auto_or_int, default="auto",
            help="most prompts in one forward pass, and in one NextTokenBatch call; auto: "
                 f"{AUTO_MAX_BATCH_SIZE['cuda']} on a GPU, {AUTO_MAX_BATCH_SIZE['cpu']} on a CPU")
    env.add("--max-batch-delay-ms", type=float, default=d.max_batch_delay_ms,
            help="longest wait for the clients of the last batch to send again (see scheduling)")
    env.add("--max-queue", type=int, default=d.max_queue, help="prompts waiting beyond this are refused")
    env.add("--max-batch-tokens", type=int, default=d.max_batch_tokens,
            help="most padded tokens (prompts x longest prompt) in one forward; a longer single prompt still runs "
                 "alone. A step that reads prompts beside running generations' decode rows reads at most this or 512 "
                 "tokens, whichever is lower")
    env.add("--fixed-cost-tokens", type=auto_float, default="auto",
            help="a forward's fixed cost in padded tokens' worth, which decides when prompts of different "
                 "lengths run apart (see scheduling.grouping); auto: measured at warm-up")
    env.add("--max-prompt-tokens", type=int, default=d.max_prompt_tokens,
            help="longest prompt accepted; 0: the model's context length")
    env.add("--random-fallback", type=parse_bool, default=d.random_fallback,
            help="serve random:<arch> weights, with a warning, when the model cannot be loaded; "
                 "set false in production")
    env.add("--seed", type=int, default=d.seed, help="seed for random:<arch> weights")
    env.add("--log-level", default=d.log_level, choices=("debug", "info", "warning", "error"),
            help="debug also shows a start-up error's traceback")
    env.add("--log-format", default=d.log_format, choices=("text", "json"), help="json: one object a line")
    parser.add_argument("--disable-log-requests", dest="log_requests", action="store_false",
                        default=env_bool(environ, "--log-requests", d.log_requests),
                        help="no line per request (failures are still logged, with their reason); the variable "
                             "set false does the same [env GPT2SERVE_LOG_REQUESTS; default: true]")
    env.add("--log-stats-interval-s", type=float, default=d.log_stats_interval_s,
            help="seconds between the engine's stats lines (running, waiting, tokens/s, cache use); 0: none")
    env.add("--served-model-name", default=None,
            help="the model's name in /v1/models, every `model` field and the metrics; default: --model's")
    env.add("--trace-layers", default=d.trace_layers, choices=TRACE_LAYERS_MODES,
            help="per-layer spans and reports: never, on-request (trace_layers / include_layers), always")
    env.add("--trace-sample-ratio", type=float, default=d.trace_sample_ratio,
            help="share of requests traced when OTEL_EXPORTER_OTLP_ENDPOINT is set; layer-traced ones always are")
    env.add("--max-message-bytes", type=int, default=d.max_message_bytes,
            help="largest gRPC request message / REST body accepted (bytes)")
    env.add("--api-key", default=d.api_key, secret=True,
            help="require 'authorization: Bearer <key>' on gRPC and REST (probes stay open); "
                 "prefer the env variable: flags show in the process list")
    env.add("--metrics-require-key", type=parse_bool, default=d.metrics_require_key,
            help="with --api-key, /metrics needs the key too")
    env.add("--tls-cert", default=d.tls_cert, help="PEM certificate chain: serve gRPC and HTTPS over TLS")
    env.add("--tls-key", default=d.tls_key, help="PEM private key for --tls-cert")
    env.add("--shutdown-grace-s", type=float, default=d.shutdown_grace_s,
            help="on SIGTERM, time to finish accepted requests before exiting")
    env.add("--allow-pickle", type=parse_bool, default=d.allow_pickle,
            help="also load pickle (.bin) checkpoints; default: safetensors only")
    env.add("--cuda-graphs", type=parse_bool, default=d.cuda_graphs,
            help="on cuda, replay captured CUDA graphs for bucketed batch shapes (on/off)")
    env.add("--cuda-graph-memory-mb", type=float, default=d.cuda_graph_memory_mb,
            help="device memory each kind of captured CUDA graph (next-token forwards, prefills, decode steps) "
                 "may take; other shapes run eagerly")
    env.add("--trace-ui-url", default=d.trace_ui_url,
            help="link each /ui answer to its trace, e.g. http://localhost:16686/trace/{trace_id} (Jaeger)")
    env.add("--max-running-sequences", type=auto_or_int, default="auto",
            help="generations decoded together at most, one KV-cache slot each (auto: --max-batch-size)")
    env.add("--prefill-chunk-tokens", type=int, default=d.prefill_chunk_tokens,
            help="a generation's prompt with more uncached tokens than this is read in chunks of this many, "
                 "one a step, so running generations keep taking tokens meanwhile (0: never)")
    env.add("--kv-cache-mb", type=auto_float, default="auto",
            help="most memory the KV cache may hold; a generation is admitted when it fits at prompt + max_tokens "
                 "(auto: 40%% of free device memory on cuda, claimed at start; 25%% of the memory this process "
                 "may use on a CPU, allocated as used)")
    env.add("--prefix-cache-mb", type=auto_float, default="auto",
            help="most memory the prefix cache may hold: prompts' keys and values kept in blocks of 16 tokens, so "
                 "a prompt that starts like an earlier one computes only the rest; least recently used blocks go "
                 "first; 0: off (auto: 10%% of free device memory on cuda, claimed at start; 10%% of the memory "
                 "this process may use on a CPU, touched as used)")
    env.add("--max-queue-wait-s", type=float, default=d.max_queue_wait_s,
            help="a generation waiting this long for a KV-cache slot gets RESOURCE_EXHAUSTED / 429")
    env.add("--metrics-compat", default=d.metrics_compat, choices=METRICS_COMPAT_CHOICES,
            help="also export the router gauges (requests waiting, running, KV-cache usage) under another "
                 "server's names: vllm (vllm:num_requests_waiting, vllm:num_requests_running, vllm:kv_cache_usage_perc)")
    env.add("--grpc-max-connection-age-s", type=float, default=d.grpc_max_connection_age_s,
            help="close each gRPC connection after this long (GOAWAY; in-flight calls finish), so clients "
                 "re-resolve and spread over new replicas; 0: never")
    env.add("--grpc-min-ping-interval-s", type=float, default=d.grpc_min_ping_interval_s,
            help="shortest interval between a gRPC client's keepalive pings, with or without calls; a client "
                 "pinging more often is sent GOAWAY (too_many_pings) after 2 strikes")
    env.add("--grpc-max-connection-idle-s", type=float, default=d.grpc_max_connection_idle_s,
            help="close a gRPC connection that has had no call for this long (GOAWAY; clients reconnect when they "
                 "next call); 0: never")
    env.add("--grpc-max-concurrent-streams", type=int, default=d.grpc_max_concurrent_streams,
            help="calls at once on one gRPC connection; more wait in the client until one ends")
    env.add("--grpc-max-connections", type=int, default=d.grpc_max_connections,
            help="open gRPC connections per front end; a new one past it takes the place of the oldest connection "
                 "with no call open (sent GOAWAY; gpt2serve_connections_evicted_total), or is closed at once when "
                 "every one has calls (gpt2serve_connections_refused_total); with --grpc-server grpcio, gRPC's core "
                 "refuses it, uncounted")
    env.add("--grpc-handshake-timeout-s", type=float, default=d.grpc_handshake_timeout_s,
            help="close a gRPC connection that has not completed its HTTP/2 handshake within this long "
                 "(gRPC's own default is 120 s, long enough for idle sockets to hold a front end's connections)")
    env.add("--grpc-request-timeout-s", type=float, default=d.grpc_request_timeout_s,
            help="cancel a gRPC call whose request has not arrived whole within this long of its opening, so stalled "
                 "calls cannot hold a connection (--grpc-server builtin; gRPC's core has no such limit)")
    env.add("--grpc-send-timeout-s", type=float, default=d.grpc_send_timeout_s, help="reset a call's stream when its "
            "answer has waited this long, without progress, for a client that does not read (builtin server only)")
    env.add("--grpc-server", default=d.grpc_server, choices=GRPC_SERVERS,
            help="builtin: the project's gRPC layer on libnghttp2 on the front end's event loop (a quarter of "
                 "grpc.aio's CPU a unary call); grpcio: gRPC's own server (grpc.aio). Both serve the same methods, "
                 "health and reflection, under the same flags")
    env.add("--http-keep-alive-s", type=float, default=d.http_keep_alive_s,
            help="close an idle REST keep-alive connection after this long")
    env.add("--http-request-timeout-s", type=float, default=d.http_request_timeout_s,
            help="a REST request's headers and body must arrive within this long of its first byte (or of the "
                 "connection's opening); a slower one has its connection closed")
    env.add("--http-max-connections", type=int, default=d.http_max_connections,
            help="open REST connections per front end; a new one past it takes the place of the oldest "
                 "connection without a request's headers (gpt2serve_connections_evicted_total), or is closed at "
                 "once when every one is busy with a request (gpt2serve_connections_refused_total)")
    env.add("--http-max-header-bytes", type=int, default=d.http_max_header_bytes,
            help="a REST request's largest header section; a larger one is answered 431 and its connection closed")
    env.add("--http-max-request-line-bytes", type=int, default=d.http_max_request_line_bytes,
            help="a REST request's longest request line; a longer one is answered 414 and its connection closed")
    env.add("--stream-interval", type=int, default=d.stream_interval,
            help="a streamed generation (gRPC Generate, SSE) sends its tokens this many at a time: its first at "
                 "once, then every this many, the rest at its end (as vLLM's); fewer messages for less front-end "
                 "CPU a token; 1: each token as it comes")
    env.add("--chat-template", default=d.chat_template,
            help="Jinja chat template for /v1/chat/completions: a file, or the template inline (rendered as "
                 "transformers' apply_chat_template renders it); default: the checkpoint's own "
                 "(tokenizer_config.json or chat_template.jinja); with neither, chat answers 400")
    env.add("--lora-modules", type=lora_modules, default=d.lora_modules, nargs="*",
            help="LoRA adapters served beside the base, each name=path (a directory peft's save_pretrained wrote), "
                 "chosen by the OpenAI `model` or `adapter` on gRPC and REST (the variable: entries space-separated)")
    env.add("--max-lora-rank", type=int, default=d.max_lora_rank,
            help="largest LoRA rank an adapter may have; a higher one is refused at load")
    env.add("--max-loras", type=int, default=d.max_loras,
            help="distinct LoRA adapters one step may hold (vLLM's); requests under others wait for a later step; "
                 "default: --max-cpu-loras where set, else every adapter loaded")
    env.add("--max-cpu-loras", type=int, default=d.max_cpu_loras,
            help="LoRA adapters whose weights stay in memory (vLLM's; at least --max-loras): the least recently used "
                 "beyond it are dropped and read again from their directory when next used; default: all")
    env.add("--allow-runtime-lora-updating", type=parse_bool,
            default=d.allow_runtime_lora_updating or environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower()
            in ("1", "true", "yes", "on"),
            help="allow loading and unloading LoRA adapters while serving (POST /v1/load_lora_adapter and "
                 "/v1/unload_lora_adapter, gRPC LoadAdapter and UnloadAdapter; vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING "
                 "turns it on too)")
    env.add("--workers", type=auto_or_int, default="auto",
            help="front-end processes (gRPC + REST on shared ports) around one engine process; "
                 "auto: 1 on a CPU (one process); on a GPU, the front ends the engine's measured rate needs "
                 "at about 150 us of CPU a call (600 with --grpc-server grpcio), at most the cores less 2 for "
                 "the engine (logged)")
    parser.set_defaults(otel_traces_exporter=traces_exporter_configured(environ))


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    values = {name: getattr(args, name) for name in ServeConfig.__dataclass_fields__}
    values["lora_modules"] = tuple(e for entry in values["lora_modules"] for e in (
        entry if isinstance(entry, tuple) else (entry,)))
    config = ServeConfig(**values)
    validate(config)
    return config


def validate(config: ServeConfig) -> None:
    problems = []
    if config.max_batch_size is not None and config.max_batch_size < 1:
        problems.append("--max-batch-size must be >= 1")
    if config.max_running_sequences is not None and config.max_running_sequences < 1:
        problems.append("--max-running-sequences must be >= 1 (or auto)")
    if config.prefill_chunk_tokens < 0:
        problems.append("--prefill-chunk-tokens must be >= 0 (0: never)")
    if config.kv_cache_mb is not None and config.kv_cache_mb <= 0:
        problems.append("--kv-cache-mb must be > 0 (or auto)")
    if config.prefix_cache_mb is not None and config.prefix_cache_mb < 0:
        problems.append("--prefix-cache-mb must be >= 0 (0: off; or auto)")
    if config.max_queue_wait_s < 0:
        problems.append("--max-queue-wait-s must be >= 0")
    if config.max_batch_delay_ms < 0:
        problems.append("--max-batch-delay-ms must be >= 0")
    if config.max_queue < 1:
        problems.append("--max-queue must be >= 1")
    if config.fixed_cost_tokens is not None and config.fixed_cost_tokens < 0:
        problems.append("--fixed-cost-tokens must be >= 0 (or auto)")
    if config.max_batch_tokens < 1:
        problems.append("--max-batch-tokens must be >= 1")
    if not 0.0 <= config.trace_sample_ratio <= 1.0:
        problems.append("--trace-sample-ratio must be within 0..1")
    if config.max_prompt_tokens < 0:
        problems.append("--max-prompt-tokens must be >= 0")
    if config.max_message_bytes < 1024:
        problems.append("--max-message-bytes must be >= 1024")
    if config.api_key is not None and not config.api_key.strip():
        problems.append("--api-key must not be empty")
    if config.metrics_require_key and not config.api_key:
        problems.append("--metrics-require-key needs --api-key")
    if bool(config.tls_cert) != bool(config.tls_key):
        problems.append("--tls-cert and --tls-key go together")
    for path in (config.tls_cert, config.tls_key):
        if path and not os.path.isfile(path):
            problems.append(f"{path}: no such file")
    if config.trace_ui_url and "{trace_id}" not in config.trace_ui_url:
        problems.append("--trace-ui-url must contain {trace_id}")
    if config.workers is not None and config.workers < 1:
        problems.append("--workers must be >= 1 (or auto)")
    if config.cuda_graph_memory_mb < 0:
        problems.append("--cuda-graph-memory-mb must be >= 0")
    if config.grpc_min_ping_interval_s < 0 or config.grpc_max_connection_idle_s < 0 or config.http_keep_alive_s <= 0:
        problems.append("--grpc-min-ping-interval-s and --grpc-max-connection-idle-s must be >= 0, "
                        "--http-keep-alive-s > 0")
    if config.http_request_timeout_s <= 0 or config.http_max_connections < 1:
        problems.append("--http-request-timeout-s must be > 0 and --http-max-connections >= 1")
    if config.grpc_max_concurrent_streams < 1 or config.grpc_max_connections < 1:
        problems.append("--grpc-max-concurrent-streams and --grpc-max-connections must be >= 1")
    if config.grpc_handshake_timeout_s <= 0 or config.grpc_request_timeout_s <= 0 or config.grpc_send_timeout_s <= 0:
        problems.append("--grpc-handshake-timeout-s, --grpc-request-timeout-s and --grpc-send-timeout-s must be > 0")
    if config.http_max_header_bytes < 1024 or config.http_max_request_line_bytes < 256:
        problems.append("--http-max-header-bytes must be >= 1024, --http-max-request-line-bytes >= 256")
    if config.grpc_max_connection_age_s < 0:
        problems.append("--grpc-max-connection-age-s must be >= 0")
    names = [entry.partition("=")[0] for entry in config.lora_modules]
    if len(set(names)) != len(names):
        problems.append("--lora-modules: each adapter needs a name of its own")
    if not 1 <= config.max_lora_rank <= 512:
        problems.append("--max-lora-rank must be within 1..512")
    loras = 1 if config.max_loras is None else config.max_loras
    if loras < 1 or (config.max_cpu_loras is not None and config.max_cpu_loras < loras):
        problems.append("--max-loras must be >= 1, and --max-cpu-loras >= --max-loras")
    if config.stream_interval < 1:
        problems.append("--stream-interval must be >= 1")
    if config.shutdown_grace_s < 0:
        problems.append("--shutdown-grace-s must be >= 0")
    for port in (config.grpc_port, config.http_port):
        if not 0 <= port <= 65535:
            problems.append(f"port {port} is outside 0..65535")
    if problems:
        raise ValueError("; ".join(problems))
