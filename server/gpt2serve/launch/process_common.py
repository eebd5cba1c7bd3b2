"""What every child process of `--workers N` does the same way: its title, its signals, its
logging, and watching that its supervisor is still there."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from ..config import ServeConfig

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
    logging.basicConfig(level=config.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s {name}[%(process)d] %(name)s: %(message)s")


async def watch_parent(parent_pid: int, stop: asyncio.Event) -> None:
    """Children poll their parent: if the supervisor is gone, they stop (no orphans)."""
    while os.getppid() == parent_pid:
        await asyncio.sleep(PARENT_POLL_S)
    log.error("the supervisor is gone; stopping")
    stop.set()
