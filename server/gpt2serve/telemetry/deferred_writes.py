"""Prometheus multiprocess samples written once per event-loop turn, not once per update.

Under `--workers N` each update of a metric is a write to this process's file: a lock, a
`getpid` call and a packed write into the mmap, 1-2 µs, and a next-token call makes about
eleven of them (its counters, three histograms of two values each, the in-flight gauge). A
front end answers its calls in bursts (one engine answer ends many calls in one loop turn), so
here an update on the loop's thread changes the value in memory and marks it; the marked values
are written at the start of the loop's next turn, each once, whatever the number of updates.
A scrape, served on a later turn of some front end's loop, reads what every turn before wrote.

Only `inc` is deferred (counters, histograms' buckets and sums, `Gauge.inc/dec`); `set` writes
at once, as do updates from other threads (the engine process has no loop of its own to flush).
"""

from __future__ import annotations

import asyncio
import atexit
import threading

from prometheus_client import values


def defer_metric_writes(loop: asyncio.AbstractEventLoop) -> bool:
    """Call before any metric is made in this process; False (and nothing changes) outside
    multiprocess mode, where an update is an in-memory add already."""
    base = values.ValueClass
    if not getattr(base, "_multiprocess", False) or getattr(base, "_deferred", False):
        return False
    loop_thread = threading.get_ident()
    marked: list = []

    def flush() -> None:
        for value in marked:
            value._marked = False
            base.set(value, value._value)  # the library's own write: its lock, its fork check
        marked.clear()

    class DeferredValue(base):
        """The library's per-process mmap value (same files, same lock), written later."""
        _deferred = True
        _marked = False

        def inc(self, amount) -> None:
            if threading.get_ident() != loop_thread:
                return base.inc(self, amount)
            self._value += amount  # read by get(), written by flush()
            if not self._marked:
                self._marked = True
                marked.append(self)
                if len(marked) == 1:
                    try:
                        loop.call_soon(flush)
                    except RuntimeError:  # the loop is closed: nothing later would write it
                        flush()

    values.ValueClass = DeferredValue
    atexit.register(flush)  # what the last turn marked
    return True
