"""Wire the parts together and run gRPC and REST in one process, over one engine."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Callable
import signal
import socket

import uvicorn

from .config import ServeConfig
from .engine.engine import Engine, EngineOptions
from .engine.loading import load_model
from .scheduling.batcher import Batcher, new_engine_thread
from .service import InferenceService
from .telemetry.spans import Telemetry
from .telemetry.tracing import setup_tracing
from .transport.grpc_server import GrpcTransport
from .transport.rest import create_app

log = logging.getLogger("gpt2serve")


def bind_http_socket(host: str, port: int) -> socket.socket:
    """Bind here rather than in uvicorn, so port 0 yields a known ephemeral port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


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


def load_engine(config: ServeConfig) -> Engine:
    """Runs in the engine thread: load, then warm up (see Engine.warm_up) so the first request is not slow."""
    loaded = load_model(config.model, config.device, config.dtype, seed=config.seed,
                        random_fallback=config.random_fallback, allow_pickle=config.allow_pickle)
    options = EngineOptions(max_batch_size=config.max_batch_size_on(loaded.device.type),
                            cuda_graphs=config.cuda_graphs, cuda_graph_memory_mb=config.cuda_graph_memory_mb)
    engine = Engine(loaded, options)
    engine.warm_up()
    log.info("warm-up done; a forward's fixed cost is worth %.0f padded tokens (length grouping)",
             engine.fixed_cost_tokens)
    return engine


async def serve(config: ServeConfig) -> None:
    # Transports come up first, so probes answer (alive, not ready) while the model loads.
    tracer_provider = setup_tracing(config.otel_traces_exporter, config.trace_sample_ratio)
    telemetry = Telemetry()
    service = InferenceService(config, telemetry)
    grpc_transport = GrpcTransport(service, config)
    http_socket = bind_http_socket(config.host, config.http_port)
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
    scheme = "https" if config.tls_cert else "http"
    print(f"gpt2serve listening: grpc={config.host}:{grpc_transport.port} "
          f"http={scheme}://{config.host}:{http_socket.getsockname()[1]}"
          f"{' (TLS)' if config.tls_cert else ''}{' (API key required)' if config.api_key else ''}", flush=True)

    engine_thread = new_engine_thread()
    try:
        engine = await asyncio.get_running_loop().run_in_executor(engine_thread, load_engine, config)
    except BaseException:
        engine_thread.shutdown(wait=False)
        http_server.should_exit = True
        await grpc_transport.stop(0)
        await asyncio.gather(http_task, return_exceptions=True)
        raise
    loaded = engine.loaded
    batcher = Batcher(
        engine, max_batch_size=engine.options.max_batch_size, max_batch_delay_s=config.max_batch_delay_ms / 1000,
        max_queue=config.max_queue, max_batch_tokens=config.max_batch_tokens, engine_thread=engine_thread,
        observer=telemetry,
    )
    batcher.start()
    service.attach(loaded, batcher)
    info = service.model_info()
    telemetry.metrics.attach(model=info.model, dtype=info.dtype, device=info.device, weights=info.weights,
                             queue_depth=lambda: batcher.queue_depth, device_memory=device_memory_probe(loaded.device))
    service.ready = True
    await grpc_transport.set_serving(True)
    print(f"gpt2serve ready: model={info.model} weights={info.weights} device={info.device} dtype={info.dtype}",
          flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await asyncio.wait([asyncio.create_task(stop.wait()), http_task], return_when=asyncio.FIRST_COMPLETED)
    await shut_down(config, service, grpc_transport, http_server, http_task, batcher, tracer_provider, stop)


async def shut_down(config: ServeConfig, service: InferenceService, grpc_transport: GrpcTransport,
                    http_server: uvicorn.Server, http_task: asyncio.Task, batcher: Batcher, tracer_provider,
                    stop: asyncio.Event) -> None:
    """Drain, then close, all within --shutdown-grace-s.

    Not ready at once (probes and load balancers stop sending), new requests UNAVAILABLE / 503
    while the listeners stay open for the connections still in use; every accepted request is
    answered; then the transports close and the process exits. A second signal skips the wait.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + config.shutdown_grace_s
    log.info("shutting down: %d request(s) in flight, up to %.1f s to finish them",
             service.in_flight, config.shutdown_grace_s)
    service.ready = service.accepting = False
    await grpc_transport.set_serving(False)
    stop.clear()
    second_signal = asyncio.create_task(stop.wait())
    drained = asyncio.create_task(service.drained(config.shutdown_grace_s))
    await asyncio.wait([drained, second_signal], return_when=asyncio.FIRST_COMPLETED)
    second_signal.cancel()
    if not (drained.done() and drained.result()):
        log.warning("shutdown: %d request(s) still in flight are cancelled", service.in_flight)
    drained.cancel()
    remaining = lambda: max(deadline - loop.time(), 0.0)  # noqa: E731
    http_server.should_exit = True
    await grpc_transport.stop(min(remaining(), 1.0))
    await asyncio.wait([http_task], timeout=remaining() + 0.5)
    await batcher.stop()
    if tracer_provider is not None:
        tracer_provider.force_flush(int(max(remaining(), 0.5) * 1000))  # Spans still queued for export.
        tracer_provider.shutdown()
    log.info("shutdown complete")


def run(config: ServeConfig) -> None:
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(config))
