"""`--workers N` (N > 1): N front-end processes around one engine process, under a supervisor.

    supervisor (this process: ports, signals, health of the children; no model, no requests)
    ├── front end 1..N   gRPC + REST on the shared ports (SO_REUSEPORT): parse, validate,
    │                    tokenize, encode; InferenceService over an ipc.EngineClient
    └── engine           the model, the one global queue and batcher, the forward; ipc.EngineServer

One Python process caps serving near 1.5k req/s whatever the GPU can do (issue 12): protocol
work spreads over the front ends, while batches still form across all of them in one engine.

- Ready: the supervisor prints "gpt2serve ready" once the engine and every front end are.
- Drain (SIGTERM/SIGINT): every front end drains (not ready, new work UNAVAILABLE, accepted work
  answered); the engine stops last; all within --shutdown-grace-s.
- Engine death: front ends are told at once (SIGUSR1), answer UNAVAILABLE and exit; the
  supervisor exits 1 so that its own supervisor (systemd, k8s) restarts the server.
- Front-end death: logged; the others keep serving (the kernel stops sending it connections).
- Children poll their parent: if the supervisor is gone, they exit (no orphans).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from .config import ServeConfig

log = logging.getLogger("gpt2serve")
ENGINE_GONE_SIGNAL = signal.SIGUSR1
CHILD_EXIT_TIMEOUT_S = 5.0  # after the engine died, or past the grace: then killed
PARENT_POLL_S = 1.0


# In the children ------------------------------------------------------------------------------

def _child_setup(config: ServeConfig, name: str) -> None:
    # Signals for the server's process group (Ctrl-C, `timeout`, `kill -- -pgid`) go to the
    # supervisor alone, which stops the children in order: the engine must outlive the drain.
    os.setpgrp()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=config.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s {name}[%(process)d] %(name)s: %(message)s")


async def _watch_parent(parent_pid: int, stop: asyncio.Event) -> None:
    while os.getppid() == parent_pid:
        await asyncio.sleep(PARENT_POLL_S)
    log.error("the supervisor is gone; stopping")
    stop.set()


def engine_main(config: ServeConfig, address: str, status, parent_pid: int) -> None:
    from .errors import ModelLoadError

    _child_setup(config, "engine")
    try:
        asyncio.run(_engine(config, address, status, parent_pid))
    except ModelLoadError as exc:
        print(f"gpt2serve serve: cannot load model: {exc}", flush=True)
        raise SystemExit(1)


async def _engine(config: ServeConfig, address: str, status, parent_pid: int) -> None:
    from .app import flush_traces, start_engine
    from .ipc import EngineServer
    from .telemetry.spans import Telemetry
    from .telemetry.tracing import setup_tracing

    tracer_provider = setup_tracing(config.otel_traces_exporter, config.trace_sample_ratio)
    telemetry = Telemetry()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)  # also while loading
    schedulers, info = await start_engine(config, telemetry)
    server = EngineServer(address, schedulers.batcher, schedulers.generation, info,
                          schedulers.batcher.engine.loaded.tokenizer.source)
    serving = asyncio.create_task(server.serve(), name="ipc")
    status.send(("ready", info.model))
    log.info("engine ready at %s", address)
    watch = asyncio.create_task(_watch_parent(parent_pid, stop))
    while not stop.is_set() and not serving.done():  # gauges the front ends' /metrics read
        telemetry.metrics.refresh()
        await asyncio.wait([asyncio.create_task(stop.wait())], timeout=0.5)
    watch.cancel()
    if serving.done() and not serving.cancelled() and serving.exception() is not None:
        log.error("the IPC server failed", exc_info=serving.exception())
    serving.cancel()
    await schedulers.stop()
    server.close()
    if tracer_provider is not None:
        flush_traces(tracer_provider, 1.0)
    log.info("engine stopped")


def front_end_main(config: ServeConfig, address: str, status, parent_pid: int) -> None:
    _child_setup(config, "front-end")
    raise SystemExit(asyncio.run(_front_end(config, address, status, parent_pid)))


async def _front_end(config: ServeConfig, address: str, status, parent_pid: int) -> int:
    from .app import Transports, flush_traces, shut_down, until_signalled
    from .engine.tokenizer import load_tokenizer
    from .ipc import EngineClient
    from .service import InferenceService
    from .telemetry.spans import Telemetry
    from .telemetry.tracing import setup_tracing

    tracer_provider = setup_tracing(config.otel_traces_exporter, config.trace_sample_ratio)
    service = InferenceService(config, Telemetry())
    transports = await Transports.start(config, service, reuse_port=True)
    status.send(("listening", (transports.grpc.port, transports.http_port)))
    log.info("front end listening (grpc %d, http %d)", transports.grpc.port, transports.http_port)
    engine = EngineClient(address)
    stop = asyncio.Event()
    engine_gone = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)  # also while the engine is still loading
    loop.add_signal_handler(ENGINE_GONE_SIGNAL, engine_gone.set)
    watch = asyncio.create_task(_watch_parent(parent_pid, stop))
    connected = asyncio.create_task(engine.connect())
    await asyncio.wait([connected, asyncio.create_task(engine_gone.wait()), asyncio.create_task(stop.wait())],
                       return_when=asyncio.FIRST_COMPLETED)
    if connected.done():
        source = engine.tokenizer_source
        tokenizer = load_tokenizer(Path(source) if os.path.isdir(source) else None)
        service.attach(tokenizer, engine.model_info, engine, engine)
        service.ready = True
        await transports.grpc.set_serving(True)
        status.send(("ready", None))
    gone = asyncio.create_task(engine_gone.wait())
    await until_signalled(stop, transports.http_task, gone, signals=(signal.SIGTERM,))
    exit_code = 0
    if engine_gone.is_set():
        log.error("the engine process is gone: answering UNAVAILABLE and exiting")
        engine.engine_gone("the engine process died; the server is restarting")
        exit_code = 1
    watch.cancel()
    await shut_down(config, service, transports, stop, engine.close)
    if tracer_provider is not None:
        flush_traces(tracer_provider, 1.0)
    return exit_code


# The supervisor ---------------------------------------------------------------------------------

def reserve_port(host: str, port: int) -> socket.socket:
    """Hold (host, port) with SO_REUSEPORT, unlistened, so port 0 becomes one port all front ends
    share; the kernel only hands connections to listening sockets."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


class Supervisor:
    def __init__(self, config: ServeConfig, workers: int):
        self.config, self.workers = config, workers
        self.run_dir = tempfile.mkdtemp(prefix="gpt2serve-")
        self.stop_requested = False

    def run(self) -> int:
        from .ipc import engine_address
        from .telemetry.metrics import MULTIPROCESS_DIR_ENV

        os.makedirs(f"{self.run_dir}/metrics")
        os.environ[MULTIPROCESS_DIR_ENV] = f"{self.run_dir}/metrics"  # before any child imports prometheus
        reserved = [reserve_port(self.config.host, port) for port in (self.config.grpc_port, self.config.http_port)]
        config = replace(self.config, grpc_port=reserved[0].getsockname()[1], http_port=reserved[1].getsockname()[1])
        address = engine_address(self.run_dir)
        spawn = multiprocessing.get_context("spawn")
        self.children: dict[str, tuple[multiprocessing.Process, multiprocessing.connection.Connection]] = {}
        for name, target in [("engine", engine_main)] + [(f"front-end-{i}", front_end_main)
                                                         for i in range(1, self.workers + 1)]:
            reader, writer = spawn.Pipe(duplex=False)
            process = spawn.Process(target=target, name=name, args=(config, address, writer, os.getpid()))
            process.start()
            writer.close()
            self.children[name] = (process, reader)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: setattr(self, "stop_requested", True))
        try:
            return self._supervise(config, reserved)
        finally:
            for sock in reserved:
                sock.close()
            self._reap(0)
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def _front_ends(self) -> list[str]:
        return [name for name in self.children if name != "engine"]

    def _supervise(self, config: ServeConfig, reserved: list[socket.socket]) -> int:
        listening, ready = set(), set()
        engine_model = ""
        while True:
            if self.stop_requested:
                return self._drain()
            processes = {process.sentinel: name for name, (process, _) in self.children.items()}
            pipes = {reader: name for name, (_, reader) in self.children.items() if not reader.closed}
            for item in multiprocessing.connection.wait([*processes, *pipes], timeout=0.2):
                if item in pipes:
                    name = pipes[item]
                    try:
                        event, payload = item.recv()
                    except EOFError:
                        item.close()
                        continue
                    if event == "listening":
                        listening.add(name)
                        if len(listening) == self.workers:
                            scheme = "https" if config.tls_cert else "http"
                            print(f"gpt2serve listening: grpc={config.host}:{config.grpc_port} "
                                  f"http={scheme}://{config.host}:{config.http_port} "
                                  f"({self.workers} front ends){' (TLS)' if config.tls_cert else ''}", flush=True)
                    elif event == "ready":
                        ready.add(name)
                        engine_model = payload if name == "engine" else engine_model
                        if len(ready) == self.workers + 1:
                            print(f"gpt2serve ready: model={engine_model} workers={self.workers}", flush=True)
                else:
                    name = processes[item]
                    process = self.children[name][0]
                    process.join()
                    forget_metrics_of(process.pid)
                    if name == "engine":
                        log.error("the engine process exited (code %s); stopping the server", process.exitcode)
                        return self._engine_gone()
                    log.error("%s exited (code %s); the others keep serving", name, process.exitcode)
                    del self.children[name]
                    if not self._front_ends():
                        log.error("no front end is left; stopping the server")
                        self._drain()
                        return 1

    def _signal_all(self, names: list[str], sig: int) -> None:
        for name in names:
            process = self.children[name][0]
            if process.is_alive():
                os.kill(process.pid, sig)

    def _wait(self, names: list[str], deadline: float) -> None:
        for name in names:
            self.children[name][0].join(max(deadline - time.monotonic(), 0.0))

    def _drain(self) -> int:
        """Front ends first (they finish what they accepted, which needs the engine), engine last."""
        deadline = time.monotonic() + self.config.shutdown_grace_s
        front_ends = self._front_ends()
        self._signal_all(front_ends, signal.SIGTERM)
        self._wait(front_ends, deadline + 1.0)
        self._signal_all(["engine"], signal.SIGTERM)
        self._wait(["engine"], max(deadline, time.monotonic() + 2.0))
        failed = [name for name, (process, _) in self.children.items() if process.exitcode not in (0, None)]
        log.info("shutdown complete%s", f" ({', '.join(failed)} exited non-zero)" if failed else "")
        return 0

    def _engine_gone(self) -> int:
        front_ends = self._front_ends()
        self._signal_all(front_ends, ENGINE_GONE_SIGNAL)
        self._wait(front_ends, time.monotonic() + CHILD_EXIT_TIMEOUT_S)
        return 1

    def _reap(self, grace_s: float) -> None:
        """No child outlives the supervisor."""
        for process, _ in self.children.values():
            process.join(grace_s)
            if process.is_alive():
                process.kill()
                process.join()


def forget_metrics_of(pid: int) -> None:
    """A dead process's gauges leave the sums (its counters stay: they counted real requests)."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid)


def resolve_workers(config: ServeConfig) -> int:
    """--workers auto: 1 on a CPU (the single-process path; our CI machines have 2 cores), and
    about min(cores - 2, 8) front ends on a GPU, leaving cores for the engine and the clients."""
    if config.workers is not None:
        return config.workers
    gpu = config.device.startswith("cuda")
    if config.device == "auto":
        import torch

        gpu = torch.cuda.is_available()
    return max(1, min((os.cpu_count() or 1) - 2, 8)) if gpu else 1


def run_workers(config: ServeConfig, workers: int) -> int:
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s supervisor %(name)s: %(message)s")
    return Supervisor(config, workers).run()
