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
from .engine.engine import Engine
from .engine.loading import load_model
from .scheduling.batcher import Batcher, new_engine_thread
from .service import InferenceService
from .telemetry.spans import Telemetry
from .telemetry.tracing import setup_tracing
from .transport.grpc_server import GrpcTransport
from .transport.rest import create_app

log = logging.getLogger("gpt2serve")
SHUTDOWN_GRACE_S = 10.0


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
                        random_fallback=config.random_fallback)
    engine = Engine(loaded)
    engine.warm_up()
    log.info("warm-up done; a forward's fixed cost is worth %.0f padded tokens (length grouping)",
             engine.fixed_cost_tokens)
    return engine


async def serve(config: ServeConfig) -> None:
    # Transports come up first, so probes answer (alive, not ready) while the model loads.
    tracer_provider = setup_tracing(config.otel_traces_exporter, config.trace_sample_ratio)
    telemetry = Telemetry()
    service = InferenceService(config, telemetry)
    grpc_transport = GrpcTransport(service, config.host, config.grpc_port)
    http_socket = bind_http_socket(config.host, config.http_port)
    http_server = uvicorn.Server(
        uvicorn.Config(create_app(service), log_level=config.log_level, access_log=False, lifespan="off")
    )
    await grpc_transport.start()
    await grpc_transport.set_serving(False)
    http_task = asyncio.create_task(http_server.serve(sockets=[http_socket]), name="http")
    while not http_server.started and not http_task.done():
        await asyncio.sleep(0.01)
    if http_task.done():
        await http_task  # Raises why uvicorn could not start.
    print(f"gpt2serve listening: grpc={config.host}:{grpc_transport.port} "
          f"http=http://{config.host}:{http_socket.getsockname()[1]}", flush=True)

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
        engine, max_batch_size=config.max_batch_size, max_batch_delay_s=config.max_batch_delay_ms / 1000,
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

    log.info("shutting down")
    service.ready = False
    await grpc_transport.set_serving(False)
    http_server.should_exit = True
    await grpc_transport.stop(SHUTDOWN_GRACE_S)
    await asyncio.gather(http_task, return_exceptions=True)
    await batcher.stop()
    if tracer_provider is not None:
        tracer_provider.shutdown()  # Flushes the spans still queued for export.


def run(config: ServeConfig) -> None:
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(config))
