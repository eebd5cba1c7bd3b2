"""The front end of a server: gRPC and REST over the service, over an engine client.

    FrontEnd.listen()   both transports listening, not serving: probes answer "alive, not ready"
    FrontEnd.serve()    the service attached to the engine client; ready, health SERVING
    FrontEnd.stop()     drain (not ready at once, new work UNAVAILABLE, accepted work answered),
                        then close; all within --shutdown-grace-s
    front_end_main()    --workers N: a FrontEnd over ipc.socket_client, until SIGTERM

No torch is imported here or below: a front-end process of `--workers N` is the transports,
the service and the tokenizer (tests/processes/test_workers.py checks it).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

import uvicorn

from gpt2serve_client.types import ModelInfo

from ..config import ServeConfig
from ..engine.tokenizer import Tokenizer, load_tokenizer
from ..ipc.socket_client import SocketEngineClient
from ..protocol import EngineClient
from ..service import InferenceService
from ..telemetry.deferred_writes import defer_metric_writes
from ..telemetry.logs import RequestLog
from ..telemetry.spans import Telemetry
from ..telemetry.tracing import flush_traces, setup_tracing
from ..transport.grpc_server import BuiltinGrpcTransport, GrpcTransport, grpc_transport
from ..transport.http_connections import bounded_http_protocol
from ..transport.rest import create_app
from ..transport.sockets import bind_listening_socket
from .process_common import ENGINE_GONE_SIGNAL, child_setup, freeze_startup_heap, run_front_end_loop, watch_parent

log = logging.getLogger("gpt2serve")
# Once the drain is over, the transports close within this: the calls it waited for are answered
# (or were cut and told so); what is left is idle connections and quick GETs (probes, /metrics).
CLOSE_S = 1.0


@dataclass
class Transports:
    """gRPC and REST over one service, started and stopped together."""

    grpc: GrpcTransport | BuiltinGrpcTransport
    http_server: uvicorn.Server
    http_task: asyncio.Task
    http_port: int

    @classmethod
    async def start(cls, config: ServeConfig, service: InferenceService, reuse_port: bool = False) -> Transports:
        """Listening, not serving yet: probes answer (alive, not ready) while the model loads."""
        grpc = grpc_transport(service, config, reuse_port)
        log.info("gRPC served by %s", "the built-in server" if config.grpc_server == "builtin" else "grpc.aio")
        http_socket = bind_listening_socket(config.host, config.http_port, reuse_port, flag="--http-port")
        app, direct = create_app(service, config)
        http_server = uvicorn.Server(uvicorn.Config(
            app, log_level=config.log_level, access_log=False, lifespan="off",
            log_config=None,  # uvicorn's loggers go through ours (telemetry.logs: text or JSON)
            ws="none",  # no WebSocket routes: a request asking to upgrade is answered in HTTP/1.1
            ssl_certfile=config.tls_cert, ssl_keyfile=config.tls_key,
            timeout_keep_alive=config.http_keep_alive_s,
            http=bounded_http_protocol(config.http_max_connections, config.http_request_timeout_s,
                                       lambda: service.telemetry.connection_refused("rest"),
                                       lambda: service.telemetry.connection_evicted("rest"), direct,
                                       max_header_bytes=config.http_max_header_bytes,
                                       max_request_line_bytes=config.http_max_request_line_bytes),
        ))
        await grpc.start()
        await grpc.set_serving(False)
        http_task = asyncio.create_task(http_server.serve(sockets=[http_socket]), name="http")
        while not http_server.started and not http_task.done():
            await asyncio.sleep(0.01)
        if http_task.done():
            await http_task  # Raises why uvicorn could not start.
        return cls(grpc, http_server, http_task, http_socket.getsockname()[1])

    async def stop(self, grace_s: float) -> None:
        """Close within `grace_s`: what is left then is cancelled."""
        self.http_server.config.timeout_graceful_shutdown = max(grace_s, 0.1)
        self.http_server.should_exit = True
        await self.grpc.stop(grace_s)
        await asyncio.wait([self.http_task], timeout=grace_s + 0.5)


async def until_signalled(stop: asyncio.Event, *also: asyncio.Task,
                          signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> None:
    """Until one of `signals` sets `stop` (or one of `also` ends)."""
    loop = asyncio.get_running_loop()
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    await asyncio.wait([asyncio.create_task(stop.wait()), *also], return_when=asyncio.FIRST_COMPLETED)


class FrontEnd:
    def __init__(self, config: ServeConfig, telemetry: Telemetry, reuse_port: bool = False, label: str = ""):
        """`label`: this process in the request log's lines (a front end of several: "front-end[pid]")."""
        self.config, self.reuse_port = config, reuse_port
        telemetry.metrics.prepare_answered()  # the first request of each kind does not make its series
        telemetry.request_log = self.request_log = RequestLog(config.log_requests, config.log_format, label)
        self.service = InferenceService(config, telemetry)
        self.transports: Transports | None = None

    async def listen(self) -> Transports:
        self.transports = await Transports.start(self.config, self.service, self.reuse_port)
        return self.transports

    def listening_line(self) -> str:
        config, transports = self.config, self.transports
        scheme = "https" if config.tls_cert else "http"
        return (f"gpt2serve listening: grpc={config.host}:{transports.grpc.port} "
                f"http={scheme}://{config.host}:{transports.http_port}"
                f"{' (TLS)' if config.tls_cert else ''}{' (API key required)' if config.api_key else ''}")

    async def serve(self, tokenizer: Tokenizer, info: ModelInfo, engine: EngineClient) -> None:
        """Ready: requests reach the engine; probes and gRPC health say so."""
        self.service.attach(tokenizer, info, engine)
        self.service.ready = True
        await self.transports.grpc.set_serving(True)

    def ready_line(self) -> str:
        info = self.service.model_info()
        return f"gpt2serve ready: model={info.model} weights={info.weights} device={info.device} dtype={info.dtype}"

    async def stop(self, stop: asyncio.Event, then: Callable[[], Awaitable[None]] | None = None) -> float:
        """Drain, then close, all within --shutdown-grace-s; `then` runs last (stops the engine
        side). Returns the seconds of grace left.

        Not ready at once (probes and load balancers stop sending), new requests UNAVAILABLE / 503
        while the listeners stay open for the connections still in use; every accepted request is
        answered; then the transports close. A second signal skips the wait.
        """
        config, service, transports = self.config, self.service, self.transports
        stop.clear()  # before any await: a second signal from here on is heard
        second_signal = asyncio.create_task(stop.wait())
        loop = asyncio.get_running_loop()
        began = loop.time()
        deadline = began + config.shutdown_grace_s
        accepted = service.in_flight
        log.info("shutting down: %d request(s) in flight, up to %.1f s to finish them",
                 accepted, config.shutdown_grace_s)
        service.ready = service.accepting = False
        await transports.grpc.set_serving(False)
        drained = asyncio.create_task(service.drained(config.shutdown_grace_s))
        await asyncio.wait([drained, second_signal], return_when=asyncio.FIRST_COMPLETED)
        second_signal.cancel()
        if drained.done() and drained.result():
            log.info("shutdown: all %d request(s) in flight at the signal were answered in full, in %.1f s",
                     accepted, loop.time() - began)
            await transports.stop(min(max(deadline - loop.time(), 0.0), CLOSE_S))
            if then is not None:
                await then()
        else:
            why = "a second signal" if second_signal.done() and not second_signal.cancelled() else \
                f"the grace of {config.shutdown_grace_s:.1f} s expired"
            cut = service.in_flight_calls()
            log.warning("shutdown: %s; %d request(s) still in flight are cut: %s", why, len(cut), "; ".join(cut))
            if then is not None:  # the engine side first: each call cut ends with an error its caller reads
                await then()
            await transports.stop(CLOSE_S)
        drained.cancel()
        self.request_log.flush()
        return max(deadline - loop.time(), 0.0)


# --workers N: a front-end process -------------------------------------------------------------------

def front_end_main(config: ServeConfig, address: str, status, parent_pid: int, title: str,
                   restarted: bool = False) -> None:
    child_setup(config, "front-end", title)
    raise SystemExit(run_front_end_loop(_front_end_process(config, address, status, parent_pid, restarted)))


async def _front_end_process(config: ServeConfig, address: str, status, parent_pid: int, restarted: bool) -> int:
    """At the server's start a front end listens at once (probes answer "alive, not ready"
    while the model loads); a restarted one listens only once ready, as its siblings serve
    meanwhile and a caller it took would get a 503."""
    tracer_provider = setup_tracing(config.otel_traces_exporter, config.trace_sample_ratio)
    defer_metric_writes(asyncio.get_running_loop())  # before Telemetry() makes the metrics
    front = FrontEnd(config, Telemetry(), reuse_port=True, label=f"front-end[{os.getpid()}]")

    async def listen() -> Transports:
        transports = await front.listen()
        status.send(("listening", (transports.grpc.port, transports.http_port)))
        log.info("front end listening (grpc %d, http %d)", transports.grpc.port, transports.http_port)
        return transports

    if not restarted:
        await listen()
    engine = SocketEngineClient(address)
    stop, engine_gone = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)  # also while the engine is still loading
    loop.add_signal_handler(ENGINE_GONE_SIGNAL, engine_gone.set)
    watch = asyncio.create_task(watch_parent(parent_pid, stop))
    connected = asyncio.create_task(engine.connect())
    await asyncio.wait([connected, asyncio.create_task(engine_gone.wait()), asyncio.create_task(stop.wait())],
                       return_when=asyncio.FIRST_COMPLETED)
    if connected.done():
        source = engine.tokenizer_source
        tokenizer = load_tokenizer(Path(source) if os.path.isdir(source) else None)
        if front.transports is None:
            await listen()
        engine.on_adapters = front.service.adapters_changed  # another front end loaded or unloaded one
        await front.serve(tokenizer, engine.model_info, engine)
        freeze_startup_heap()
        status.send(("ready", None))
    if front.transports is None:  # stopped, or the engine died, before this restarted one served
        watch.cancel()
        await engine.close()
        return 1 if engine_gone.is_set() else 0
    gone = asyncio.create_task(engine_gone.wait())
    await until_signalled(stop, front.transports.http_task, gone, signals=(signal.SIGTERM,))
    exit_code = 0
    if engine_gone.is_set():
        log.error("the engine process is gone: answering UNAVAILABLE and exiting")
        engine.engine_gone("the engine process died; the server is restarting")
        exit_code = 1
    watch.cancel()
    await front.stop(stop, engine.close)
    if tracer_provider is not None:
        flush_traces(tracer_provider, 1.0)
    return exit_code
