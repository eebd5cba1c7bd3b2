"""`--workers 1`: the front end and the engine host in one process, joined by the in-process
engine client."""

from __future__ import annotations

import asyncio
import logging

from ..config import ServeConfig
from ..telemetry.logs import announce, setup_logging
from ..telemetry.spans import Telemetry
from ..telemetry.tracing import flush_traces, setup_tracing
from .engine_host import EngineHost
from .front_end import FrontEnd, until_signalled
from .process_common import freeze_startup_heap, run_front_end_loop

log = logging.getLogger("gpt2serve")


async def serve(config: ServeConfig) -> None:
    tracer_provider = setup_tracing(config.otel_traces_exporter, config.trace_sample_ratio)
    telemetry = Telemetry()
    front = FrontEnd(config, telemetry)
    await front.listen()
    announce(front.listening_line(), config.log_format)
    engine = EngineHost(config, telemetry)
    try:
        await engine.start()
    except BaseException:
        await front.transports.stop(0)
        raise
    await front.serve(engine.tokenizer, engine.info, engine.client())
    telemetry.metrics.front_ends_ready(1)  # the one process is the one front end
    freeze_startup_heap()
    announce(front.ready_line(), config.log_format)

    stop = asyncio.Event()
    await until_signalled(stop, front.transports.http_task)
    remaining_s = await front.stop(stop, then=engine.stop)
    if tracer_provider is not None:
        flush_traces(tracer_provider, remaining_s)
    log.info("shutdown complete")


def run(config: ServeConfig, workers_reason: str = "") -> None:
    setup_logging(config.log_level, config.log_format)
    if workers_reason:
        log.info("%s", workers_reason)
    run_front_end_loop(serve(config))
