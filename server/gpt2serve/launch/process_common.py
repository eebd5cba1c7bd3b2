"""What every child process of `--workers N` does the same way: its title, its signals, its
logging, watching that its supervisor is still there, and its heap frozen once it is ready."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal

from ..config import ServeConfig
from ..telemetry.logs import setup_logging

log = logging.getLogger("gpt2serve")
PARENT_POLL_S = 1.0
ENGINE_GONE_SIGNAL = signal.SIGUSR1  # the supervisor's word to front ends that the engine died


def set_title(title: str) -> None:
    """`gpt2serve: engine` in ps and top, not `python3 -c from multiprocessing.spawn ...`."""
    try:
        from setproctitle import setproctitle  # lazy: optional, and only processes of --workers N use it
    except ImportError:  # only the title is lost
        return
    setproctitle(f"gpt2serve: {title}")


def child_setup(config: ServeConfig, name: str, title: str) -> None:
    # Signals for the server's process group (Ctrl-C, `timeout`, `kill -- -pgid`) go to the
    # supervisor alone, which stops the children in order: the engine must outlive the drain.
    os.setpgrp()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    set_title(title)
    setup_logging(config.log_level, config.log_format, f"{name}[{os.getpid()}]")


def run_front_end_loop(main) -> object:
    """asyncio.run(main) on uvloop where it is installed (a dependency of the server): a front
    end's CPU is mostly its event loop's, and uvloop's costs a REST call a quarter less and a
    unary gRPC call about a tenth (docs/benchmarks.md). The engine process keeps asyncio's own
    loop: it only starts and stops things there (its IPC door has a thread of its own)."""
    try:
        import uvloop
    except ImportError:  # a server installed without it: the standard loop serves the same
        log.info("event loop: asyncio's (uvloop is not installed)")
        return asyncio.run(main)
    log.info("event loop: uvloop %s", uvloop.__version__)
    return uvloop.run(main)


async def watch_parent(parent_pid: int, stop: asyncio.Event) -> None:
    """Children poll their parent: if the supervisor is gone, they stop (no orphans)."""
    while os.getppid() == parent_pid:
        await asyncio.sleep(PARENT_POLL_S)
    log.error("the supervisor is gone; stopping")
    stop.set()


def freeze_startup_heap() -> None:
    """Once a process is ready: everything alive now (torch, the model's modules, gRPC,
    prometheus_client: several hundred thousand objects) leaves the garbage collector's view.
    Requests in flight outlive the young generations, so full passes come often under load, and
    each one walked that whole heap: at 20,000 prompts a second in the engine process that was
    seconds of CPU a minute for nothing, since none of it ever becomes garbage. vLLM's engine
    does the same after its start-up."""
    gc.collect()
    gc.freeze()
    log.debug("garbage collector: %d objects frozen", gc.get_freeze_count())
