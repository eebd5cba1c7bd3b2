"""Wire the parts together and run gRPC and REST in one process, over one engine."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from dataclasses import dataclass, replace
from typing import Awaitable, Callable

import uvicorn

from .config import ServeConfig
from gpt2serve_client.types import ModelInfo

from .engine.engine import Engine, EngineOptions
from .engine.generation import Generator
from .engine.kv_cache import KVCache
from .engine.loading import load_model
from .resources import available_cpus, available_memory_bytes
from .scheduling.batcher import Batcher, new_engine_thread
from .scheduling.generation import GenerationScheduler
from .service import InferenceService, describe_model
from .telemetry.spans import Telemetry
from .telemetry.tracing import setup_tracing
from .transport.grpc_server import GrpcTransport
from .transport.rest import create_app

log = logging.getLogger("gpt2serve")


def bind_http_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """Bind here rather than in uvicorn, so port 0 yields a known ephemeral port. With
    `reuse_port`, front-end processes share the port (the kernel spreads connections)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


@dataclass
class Transports:
    """gRPC and REST over one service, started and stopped together."""

    grpc: GrpcTransport
    http_server: uvicorn.Server
    http_task: asyncio.Task
    http_port: int

    @classmethod
    async def start(cls, config: ServeConfig, service: InferenceService, reuse_port: bool = False) -> Transports:
        """Listening, not serving yet: probes answer (alive, not ready) while the model loads."""
        grpc_transport = GrpcTransport(service, config)  # grpc sets SO_REUSEPORT itself on Linux
        http_socket = bind_http_socket(config.host, config.http_port, reuse_port)
        http_server = uvicorn.Server(uvicorn.Config(
            create_app(service, config), log_level=config.log_level, access_log=False, lifespan="off",
            ssl_certfile=config.tls_cert, ssl_keyfile=config.tls_key,
            timeout_graceful_shutdown=max(config.shutdown_grace_s, 0.1),
        ))
        await grpc_transport.start()
        await grpc_transport.set_serving(False)
        http_task = asyncio.create_task(http_server.serve(sockets=[http_socket]), name="http")
        while not http_server.started and not http_task.done():
            await asyncio.sleep(0.01)
        if http_task.done():
            await http_task  # Raises why uvicorn could not start.
        return cls(grpc_transport, http_server, http_task, http_socket.getsockname()[1])

    def listening_line(self, config: ServeConfig) -> str:
        scheme = "https" if config.tls_cert else "http"
        return (f"gpt2serve listening: grpc={config.host}:{self.grpc.port} http={scheme}://{config.host}:{self.http_port}"
                f"{' (TLS)' if config.tls_cert else ''}{' (API key required)' if config.api_key else ''}")

    async def stop(self, grace_s: float) -> None:
        self.http_server.should_exit = True
        await self.grpc.stop(min(grace_s, 1.0))
        await asyncio.wait([self.http_task], timeout=grace_s + 0.5)


def ready_line(info) -> str:
    return f"gpt2serve ready: model={info.model} weights={info.weights} device={info.device} dtype={info.dtype}"


async def until_signalled(stop: asyncio.Event, *also: asyncio.Task,
                          signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> None:
    """Until one of `signals` sets `stop` (or one of `also` ends)."""
    loop = asyncio.get_running_loop()
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    await asyncio.wait([asyncio.create_task(stop.wait()), *also], return_when=asyncio.FIRST_COMPLETED)


def device_memory_probe(device) -> Callable[[], float]:
    """Bytes in use on the model's device: CUDA allocations, or the process's resident memory."""
    if device.type == "cuda":
        import torch

        return lambda: float(torch.cuda.memory_allocated(device))
    page = os.sysconf("SC_PAGE_SIZE")

    def resident_bytes() -> float:
        with open("/proc/self/statm") as statm:
            return float(int(statm.read().split()[1]) * page)

    return resident_bytes


def load_engine(config: ServeConfig) -> tuple[Engine, Generator]:
    """Runs in the engine thread: load, then warm up (see Engine.warm_up) so the first request is not slow."""
    import torch

    cpus = available_cpus()
    if torch.get_num_threads() > cpus:  # a container's CPU quota below the host's cores
        torch.set_num_threads(cpus)
    loaded = load_model(config.model, config.device, config.dtype, seed=config.seed,
                        random_fallback=config.random_fallback, allow_pickle=config.allow_pickle)
    engine = Engine(loaded, engine_options(config, loaded))
    engine.warm_up()
    log.info("warm-up done; a forward's fixed cost is worth %.0f padded tokens (length grouping)",
             engine.fixed_cost_tokens)
    generator = Generator(engine, kv_cache_slots(config, engine))
    # Ready means warm: the cache is claimed and written (zeros) and each kind of step has run
    # once before ready. Claimed at the first generation instead, it stalled that one for
    # seconds on a CPU while the kernel handed out gigabytes of pages.
    generator.warm_up()
    log.info("KV cache: %d sequences of %d tokens (%.0f MiB)", generator.slots, loaded.model.config.n_ctx,
             generator.slots * KVCache.bytes_per_slot(loaded.model.config, loaded.dtype) / 2**20)
    return engine, generator


def kv_cache_slots(config: ServeConfig, engine: Engine) -> int:
    """--max-running-sequences, as far as --kv-cache-mb holds them (at least one)."""
    model_config, device = engine.model.config, engine.device
    if config.kv_cache_mb is not None:
        budget = config.kv_cache_mb * 2**20
    elif device.type == "cuda":
        import torch

        budget = 0.4 * torch.cuda.mem_get_info(device)[0]
    else:
        budget = 0.25 * available_memory_bytes()  # the container's limit, where there is one
    fits = int(budget // KVCache.bytes_per_slot(model_config, engine.loaded.dtype))
    return max(1, min(config.max_running_sequences or engine.options.max_batch_size, fits))


def engine_options(config: ServeConfig, loaded) -> EngineOptions:
    return EngineOptions(max_batch_size=config.max_batch_size_on(loaded.device.type),
                         cuda_graphs=config.cuda_graphs, cuda_graph_memory_mb=config.cuda_graph_memory_mb,
                         fixed_cost_tokens=config.fixed_cost_tokens)


@dataclass
class Schedulers:
    """The two ways into the engine thread: next-token batches and generations."""

    batcher: Batcher
    generation: GenerationScheduler

    async def stop(self) -> None:
        await self.generation.stop()
        await self.batcher.stop()


async def start_engine(config: ServeConfig, telemetry: Telemetry) -> tuple[Schedulers, ModelInfo]:
    """Load and warm the model in its own thread, and put the batcher and the generation loop
    in front of it; with the model's description (see service.describe_model)."""
    engine_thread = new_engine_thread()
    try:
        engine, generator = await asyncio.get_running_loop().run_in_executor(engine_thread, load_engine, config)
    except BaseException:
        engine_thread.shutdown(wait=False)
        raise
    batcher = Batcher(
        engine, max_batch_size=engine.options.max_batch_size, max_batch_delay_s=config.max_batch_delay_ms / 1000,
        max_queue=config.max_queue, max_batch_tokens=config.max_batch_tokens, engine_thread=engine_thread,
        observer=telemetry,
    )
    generation = GenerationScheduler(
        generator, engine_thread, eos_token_id=engine.loaded.tokenizer.eos_token_id, max_queue=config.max_queue,
        max_prefill_tokens=config.max_batch_tokens, max_queue_wait_s=config.max_queue_wait_s, observer=telemetry)
    batcher.start()
    generation.start()
    loaded = engine.loaded
    info = replace(describe_model(loaded), max_running_sequences=generator.slots)
    telemetry.model_name, telemetry.vocab_size = loaded.name, loaded.model.config.vocab_size
    telemetry.metrics.attach(model=info.model, dtype=info.dtype, device=info.device, weights=info.weights,
                             device_memory=device_memory_probe(loaded.device),
                             queue_depth=lambda: batcher.queue_depth, batch_running=lambda: batcher.running,
                             generations_waiting=lambda: generation.waiting,
                             generations_running=lambda: generation.running,
                             kv_cache_usage=lambda: generation.cache_usage, compat=config.metrics_compat)
    return Schedulers(batcher, generation), info


async def serve(config: ServeConfig) -> None:
    """One process: transports, batcher and model (`--workers 1`; see processes.py for more)."""
    tracer_provider = setup_tracing(config.otel_traces_exporter, config.trace_sample_ratio)
    telemetry = Telemetry()
    service = InferenceService(config, telemetry)
    transports = await Transports.start(config, service)
    print(transports.listening_line(config), flush=True)
    try:
        schedulers, info = await start_engine(config, telemetry)
    except BaseException:
        await transports.stop(0)
        raise
    service.attach(schedulers.batcher.engine.loaded.tokenizer, info, schedulers.batcher, schedulers.generation)
    service.ready = True
    telemetry.metrics.front_ends_up.set(1)  # the one process is the one front end
    await transports.grpc.set_serving(True)
    print(ready_line(service.model_info()), flush=True)

    stop = asyncio.Event()
    await until_signalled(stop, transports.http_task)
    remaining_s = await shut_down(config, service, transports, stop, schedulers.stop)
    if tracer_provider is not None:
        flush_traces(tracer_provider, remaining_s)
    log.info("shutdown complete")


def flush_traces(tracer_provider, timeout_s: float) -> None:
    tracer_provider.force_flush(int(max(timeout_s, 0.5) * 1000))  # Spans still queued for export.
    tracer_provider.shutdown()


async def shut_down(config: ServeConfig, service: InferenceService, transports: Transports, stop: asyncio.Event,
                    then: Callable[[], Awaitable[None]] | None = None) -> float:
    """Drain, then close, all within --shutdown-grace-s; `then` runs last (stops the batcher).
    Returns the seconds of grace left.

    Not ready at once (probes and load balancers stop sending), new requests UNAVAILABLE / 503
    while the listeners stay open for the connections still in use; every accepted request is
    answered; then the transports close and the process exits. A second signal skips the wait.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + config.shutdown_grace_s
    log.info("shutting down: %d request(s) in flight, up to %.1f s to finish them",
             service.in_flight, config.shutdown_grace_s)
    service.ready = service.accepting = False
    await transports.grpc.set_serving(False)
    stop.clear()
    second_signal = asyncio.create_task(stop.wait())
    drained = asyncio.create_task(service.drained(config.shutdown_grace_s))
    await asyncio.wait([drained, second_signal], return_when=asyncio.FIRST_COMPLETED)
    second_signal.cancel()
    if not (drained.done() and drained.result()):
        log.warning("shutdown: %d request(s) still in flight are cancelled", service.in_flight)
    drained.cancel()
    await transports.stop(max(deadline - loop.time(), 0.0))
    if then is not None:
        await then()
    return max(deadline - loop.time(), 0.0)


def run(config: ServeConfig) -> None:
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(config))
