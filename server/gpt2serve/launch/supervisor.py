"""`--workers N` (N > 1): N front-end processes around one engine process, under a supervisor.

    supervisor (this process: ports, signals, health of the children; no model, no requests)
    ├── front end 1..N   gRPC + REST on the shared ports (SO_REUSEPORT): parse, validate,
    │                    tokenize, encode; launch.front_end over ipc.socket_client (no torch)
    └── engine           the model, the engine core (one queue, one scheduler), the forward;
                         launch.engine_host behind ipc.engine_server

One Python process caps serving near 1.5k req/s whatever the GPU can do (issue 12): protocol
work spreads over the front ends, while batches still form across all of them in one engine.

- Ready: the supervisor prints "gpt2serve ready" once the engine and every front end are.
- Drain (SIGTERM/SIGINT): every front end drains (not ready, new work UNAVAILABLE, accepted work
  answered); the engine stops last; all within --shutdown-grace-s. A second signal is passed on:
  the front ends cut what is left (and log each call they cut).
- Engine death: front ends are told at once (SIGUSR1), answer UNAVAILABLE and exit; the
  supervisor exits 1 so that its own supervisor (systemd, k8s) restarts the server.
- Front-end death: the engine cancels that front end's work the moment its process exits (ipc),
  so its KV-cache slots come free (ipc.engine_server); the others keep serving (the kernel sends new connections
  only to listening sockets); the supervisor starts a new one after a backoff (0.5 s, doubling
  to 30 s; back to 0.5 s once one has served a minute), logs it and counts it in
  gpt2serve_front_end_restarts_total. Five deaths in a row before ready: the server stops (exit 1).
- Readiness while one is down: per front end. Each live front end stays ready, as it can serve
  everything; gpt2serve_front_ends_up shows the capacity lost. A dead engine is not ready anywhere.
- Children poll their parent: if the supervisor is gone, they exit (no orphans).
- Process titles (ps, top): `gpt2serve: supervisor`, `gpt2serve: engine`, `gpt2serve: front end N`.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import replace

from ..config import ServeConfig
from ..errors import StartupError
from ..ipc.socket_client import engine_address
from ..telemetry.logs import announce, setup_logging
from ..transport.sockets import bind_listening_socket
from .process_common import ENGINE_GONE_SIGNAL, set_title
from .workers_plan import WorkersPlan

log = logging.getLogger("gpt2serve")
CHILD_EXIT_TIMEOUT_S = 5.0  # after the engine died, or past the grace: then killed
RESTART_BACKOFF_S = (0.5, 30.0)  # first delay, cap (doubling)
RESTART_RESET_AFTER_S = 60.0  # a front end that served this long starts the backoff over
MAX_EARLY_DEATHS = 5  # front ends dying before ready, in a row: give up
MULTIPROCESS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # = telemetry.metrics's, without importing prometheus


# The supervisor ---------------------------------------------------------------------------------

def reserve_port(host: str, port: int, flag: str) -> socket.socket:
    """Hold (host, port) with SO_REUSEPORT, unlistened, so port 0 becomes one port all front ends
    share; the kernel only hands connections to listening sockets. A port another process holds
    is an error (StartupError, naming `flag`), not a port shared with it by chance."""
    if port:
        bind_listening_socket(host, port, reuse_port=False, flag=flag).close()
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


class Supervisor:
    def __init__(self, config: ServeConfig, plan: WorkersPlan):
        # --workers auto: the front ends start once the engine has said how fast it is.
        self.config, self.plan, self.workers = config, plan, plan.workers
        self.front_ends_started = not plan.auto
        self.run_dir = tempfile.mkdtemp(prefix="gpt2serve-")
        self.stop_requested = False
        self.draining = False
        self.children: dict[str, tuple[multiprocessing.Process, multiprocessing.connection.Connection]] = {}
        self._restart_at: dict[str, float] = {}  # front ends to start again, and when
        self._backoff: dict[str, float] = {}
        self._started_at: dict[str, float] = {}
        self._early_deaths = 0  # front ends that died before ready, in a row

    def run(self) -> int:
        set_title("supervisor")
        os.makedirs(f"{self.run_dir}/metrics")
        # Before prometheus_client is imported, here or in any child: it picks its mode at import.
        os.environ[MULTIPROCESS_DIR_ENV] = f"{self.run_dir}/metrics"
        from ..telemetry.metrics import Metrics  # lazy: only now, with the directory set

        if not chat_template_parses(self.config):  # after the directory is set: it imports prometheus_client
            shutil.rmtree(self.run_dir, ignore_errors=True)
            return 2

        self.metrics = Metrics()  # the supervisor's own samples (restarts, front ends up) in that directory
        try:
            reserved = [reserve_port(self.config.host, port, flag) for port, flag in
                        ((self.config.grpc_port, "--grpc-port"), (self.config.http_port, "--http-port"))]
        except StartupError:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            raise
        self.child_config = replace(self.config, grpc_port=reserved[0].getsockname()[1],
                                    http_port=reserved[1].getsockname()[1])
        self.address = engine_address(self.run_dir)
        self.spawn = multiprocessing.get_context("spawn")
        self._start("engine")
        if self.front_ends_started:
            self._start_front_ends()
        else:
            log.info("%s", self.plan.reason())
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_stop_signal)
        try:
            return self._supervise(self.child_config)
        finally:
            for sock in reserved:
                sock.close()
            self._reap(0)
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def _start_front_ends(self) -> None:
        self.front_ends_started = True
        for i in range(1, self.workers + 1):
            self._start(f"front-end-{i}")

    def _start(self, name: str) -> None:
        # Lazy: the supervisor loads no model (engine_host imports torch) and must not import
        # prometheus_client before run() has set its directory; a child imports its own module.
        from .engine_host import engine_main
        from .front_end import front_end_main

        target, title = (engine_main, "engine") if name == "engine" else \
            (front_end_main, "front end " + name.rsplit("-", 1)[1])
        reader, writer = self.spawn.Pipe(duplex=False)
        args = (self.child_config, self.address, writer, os.getpid(), title)
        if name in self._started_at:  # a front end started again: it listens once ready
            args += (True,)
        process = self.spawn.Process(target=target, name=name, args=args)
        process.start()
        writer.close()
        self.children[name] = (process, reader)
        self._started_at[name] = time.monotonic()

    def _on_stop_signal(self, *_) -> None:
        """The first signal starts the drain; one during it is passed on: the front ends stop waiting."""
        if self.draining:
            self._signal_all(self._front_ends(), signal.SIGTERM)
        self.stop_requested = True

    def _front_ends(self) -> list[str]:
        return [name for name in self.children if name != "engine"]

    def _supervise(self, config: ServeConfig) -> int:
        listening, ready = set(), set()
        engine_model, announced = "", False
        while True:
            if self.stop_requested:
                return self._drain()
            now = time.monotonic()
            for name, at in list(self._restart_at.items()):
                if at <= now:
                    del self._restart_at[name]
                    log.warning("starting %s again", name)
                    self._start(name)
            processes = {process.sentinel: name for name, (process, _) in self.children.items()}
            pipes = {reader: name for name, (_, reader) in self.children.items() if not reader.closed}
            timeout = min([0.2, *(at - now for at in self._restart_at.values())])
            for item in multiprocessing.connection.wait([*processes, *pipes], timeout=max(timeout, 0.0)):
                if item in pipes:
                    name = pipes[item]
                    try:
                        event, payload = item.recv()
                    except EOFError:
                        item.close()
                        continue
                    if event == "listening":
                        listening.add(name)
                        if len(listening) == self.workers and not announced:
                            scheme = "https" if config.tls_cert else "http"
                            announce(f"gpt2serve listening: grpc={config.host}:{config.grpc_port} "
                                     f"http={scheme}://{config.host}:{config.http_port} "
                                     f"({self.workers} front ends){' (TLS)' if config.tls_cert else ''}",
                                     config.log_format)
                    elif event == "ready":
                        ready.add(name)
                        if name != "engine":
                            self._early_deaths = 0
                        else:
                            engine_model, prompts_per_s = payload
                            if not self.front_ends_started:
                                self.workers, why = self.plan.with_engine_rate(prompts_per_s)
                                log.info("%s", why)
                                self._start_front_ends()
                        if len(ready) == self.workers + 1 and not announced:
                            announced = True
                            announce(f"gpt2serve ready: model={engine_model} workers={self.workers}", config.log_format)
                        self.metrics.front_ends_ready(len(ready - {"engine"}))
                else:
                    name = processes[item]
                    process = self.children[name][0]
                    process.join()
                    forget_metrics_of(process.pid)
                    if name == "engine":
                        log.error("the engine process exited (code %s); stopping the server", process.exitcode)
                        return self._engine_gone()
                    was_ready = name in ready
                    listening.discard(name)
                    ready.discard(name)
                    self.metrics.front_ends_ready(len(ready - {"engine"}))
                    del self.children[name]
                    if not was_ready:
                        self._early_deaths += 1
                        if self._early_deaths >= MAX_EARLY_DEATHS:
                            log.error("%d front ends in a row died before they were ready; stopping the server",
                                      self._early_deaths)
                            self._drain()
                            return 1
                    delay = self._next_backoff(name)
                    self.metrics.front_end_restarted()
                    log.error("%s exited (code %s); the others keep serving; restarting it in %.1f s",
                              name, process.exitcode, delay)
                    self._restart_at[name] = time.monotonic() + delay

    def _next_backoff(self, name: str) -> float:
        """0.5 s, then doubling up to 30 s; from 0.5 s again after a minute of service."""
        first, cap = RESTART_BACKOFF_S
        if time.monotonic() - self._started_at.get(name, 0.0) >= RESTART_RESET_AFTER_S:
            self._backoff[name] = first
        else:
            self._backoff[name] = min(self._backoff.get(name, first / 2) * 2, cap)
        return self._backoff[name]

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
        self._restart_at.clear()
        self.draining = True
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
    from prometheus_client import multiprocess  # lazy: see Supervisor._start

    multiprocess.mark_process_dead(pid)


def chat_template_parses(config: ServeConfig) -> bool:
    """A --chat-template that does not parse stops the server at its start, not at a request.
    (It imports the service package, and so prometheus_client: under --workers only once the
    supervisor has chosen the multiprocess directory, or its own metrics would go unseen.)"""
    if not config.chat_template:
        return True
    from ..service.chat_template import template_from_flag  # lazy: transformers, which serving needs

    try:
        template_from_flag(config.chat_template)
    except ValueError as exc:
        print(f"gpt2serve serve: {exc}", file=sys.stderr)
        return False
    return True


def run_workers(config: ServeConfig, plan: WorkersPlan) -> int:
    setup_logging(config.log_level, config.log_format, "supervisor")
    return Supervisor(config, plan).run()
