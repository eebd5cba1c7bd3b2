"""The engine side of a server: the model loaded and warmed in its own thread, the engine core
running its loop in that thread, and the engine process of `--workers N` around them.

    EngineHost.start()   load + warm up (engine thread), then the EngineCore's loop there, metrics
    EngineHost.client()  the in-process engine client (--workers 1)
    EngineHost.stop()    the core stops; queued work is told UNAVAILABLE
    engine_main()        --workers N: an EngineHost behind ipc.engine_server, until SIGTERM
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from dataclasses import replace
from typing import Callable

import torch

from gpt2serve_client.types import ModelInfo

from ..config import ServeConfig
from ..engine.engine import RESERVE, Engine, EngineOptions
from ..engine.steps import plain_asks
from ..engine.generator import Generator
from ..engine.kv_cache import BLOCK, KVCache, blocks_for
from ..engine.loading import LoadedModel, load_model
from ..engine.prefix_cache import BLOCK as PREFIX_BLOCK, PrefixCache
from ..engine.model_info import architecture
from ..engine.lora import AdapterError
from ..engine.lora_registry import LoraRegistry
from ..errors import ModelLoadError, StartupError
from ..ipc.engine_server import EngineServer
from ..ipc.inproc_client import InprocEngineClient
from ..protocol import EngineReady
from ..scheduling.core import EngineCore, new_engine_thread
from ..telemetry.logs import StatsLog
from ..telemetry.records import ModelLoaded, SchedulerStats
from ..telemetry.spans import Telemetry
from ..telemetry.tracing import flush_traces, setup_tracing
from .process_common import child_setup, freeze_startup_heap, watch_parent
from .resources import available_cpus, available_memory_bytes

log = logging.getLogger("gpt2serve")
REFRESH_S = 0.5  # --workers N: how often the engine process writes its gauges for the front ends' /metrics


def describe_model(loaded: LoadedModel) -> ModelInfo:
    """The model part of ModelInfo; the service fills in its limits when attached."""
    return ModelInfo(
        model=loaded.name, weights=loaded.weights, weights_source=loaded.weights_source,
        dtype=str(loaded.dtype).removeprefix("torch."), device=str(loaded.device),
        architecture=architecture(loaded.model.config), parameters=loaded.parameters,
        max_prompt_tokens=0, max_batch_size=0, quantize=loaded.quantize,
    )


def device_memory_probe(device: torch.device) -> Callable[[], float]:
    """Bytes in use on the model's device: CUDA allocations, or the process's resident memory."""
    if device.type == "cuda":
        return lambda: float(torch.cuda.memory_allocated(device))
    page = os.sysconf("SC_PAGE_SIZE")

    def resident_bytes() -> float:
        with open("/proc/self/statm") as statm:
            return float(int(statm.read().split()[1]) * page)

    return resident_bytes


def engine_options(config: ServeConfig, loaded: LoadedModel) -> EngineOptions:
    return EngineOptions(max_batch_size=config.max_batch_size_on(loaded.device.type),
                         cuda_graphs=config.cuda_graphs, cuda_graph_memory_mb=config.cuda_graph_memory_mb,
                         fixed_cost_tokens=config.fixed_cost_tokens)


def kv_cache_size(config: ServeConfig, engine: Engine) -> tuple[int, int]:
    """(sequences at most, KV-cache blocks that may be held). The budget is --kv-cache-mb, or by
    default 40% of the free device memory on cuda and 25% of the memory this process may use on a
    CPU (its container's limit, where there is one). On a CPU that is a ceiling the cache grows
    towards as sequences need it; on cuda it is claimed whole at start, so there the sequences
    are as many as fit at full context. At least one full-context sequence, whatever the budget."""
    model_config, device = engine.model.config, engine.device
    if config.kv_cache_mb is not None:
        budget = config.kv_cache_mb * 2**20
    elif device.type == "cuda":
        budget = 0.4 * torch.cuda.mem_get_info(device)[0]
    else:
        budget = 0.25 * available_memory_bytes()
    slots = config.max_running_sequences or engine.options.max_batch_size
    block_bytes = KVCache.bytes_per_token(model_config, engine.kv_dtype) * BLOCK
    full = blocks_for(model_config.n_ctx)  # one sequence at full context
    blocks = max(int(budget // block_bytes), full)
    if device.type == "cuda":
        slots = max(1, min(slots, blocks // full))
    return slots, min(blocks, slots * full)


PREFIX_CACHE_SHARE = 0.10  # --prefix-cache-mb auto: of free device memory (cuda) or of the process's (CPU)


def prefix_cache_blocks(config: ServeConfig, engine: Engine) -> int:
    """Blocks the prefix cache may hold: --prefix-cache-mb, or by default 10% of the free device
    memory on cuda (claimed at start, after the KV cache) and 10% of the memory this process may
    use on a CPU (its pages touched only as blocks are written). 0: off."""
    if config.prefix_cache_mb is not None:
        budget = config.prefix_cache_mb * 2**20
    elif engine.device.type == "cuda":
        budget = PREFIX_CACHE_SHARE * torch.cuda.mem_get_info(engine.device)[0]
    else:
        budget = PREFIX_CACHE_SHARE * available_memory_bytes()
    return int(budget // PrefixCache.bytes_per_block(engine.model.config, engine.loaded.dtype))


def prefix_cache_bytes(engine: Engine) -> int:
    cache = engine.prefix_cache
    return 0 if cache is None else cache.capacity_blocks * PrefixCache.bytes_per_block(cache.config, cache.dtype)


def measure_prompt_rate(engine: Engine, prompt_tokens: int = 8, forwards: int = 5) -> float:
    """Next-token prompts a second at the engine's largest batch, warm (the median of a few
    forwards): what `--workers auto` sizes the front ends by (launch.workers_plan)."""
    size, vocab = engine.options.max_batch_size, engine.model.config.vocab_size
    batch = [[(row * 31 + i * 7) % vocab for i in range(prompt_tokens)] for row in range(size)]
    times = sorted(engine.next_token(plain_asks(batch, [5] * size)).forward_s for _ in range(forwards))
    return size / times[len(times) // 2]


def load_adapters(adapters: LoraRegistry, config: ServeConfig) -> None:
    """--lora-modules, each name=path, into the registry; the first that cannot be served stops the start."""
    adapters.max_rank, adapters.max_resident = config.max_lora_rank, config.max_cpu_loras
    for entry in config.lora_modules:
        name, _, path = entry.partition("=")
        try:
            adapter = adapters.load(name, path)
        except AdapterError as exc:
            raise StartupError(f"--lora-modules {entry}: {exc.message}") from exc
        log.info("%s", adapter)
    adapters.ready([])  # --max-cpu-loras: each was read once (so a bad one stops the start); keep the newest


def load_engine(config: ServeConfig) -> tuple[Engine, Generator, float]:
    """Runs in the engine thread: load, then warm up (see Engine.warm_up) so the first request is
    not slow. Also returns the engine's measured prompts a second under --workers auto (else 0)."""
    cpus = available_cpus()
    if torch.get_num_threads() > cpus:  # a container's CPU quota below the host's cores
        torch.set_num_threads(cpus)
    loaded = load_model(config.model, config.device, config.dtype, seed=config.seed,
                        random_fallback=config.random_fallback, allow_pickle=config.allow_pickle,
                        quantize=config.quantize)
    if loaded.device.type == "cuda" and torch.get_num_threads() > 1 and "OMP_NUM_THREADS" not in os.environ:
        # On a card the engine's CPU work is staging a step's few small tensors; OpenMP's pool
        # (a thread per core, spinning after each parallel region) only took cores from the
        # front ends and the IO threads. vLLM's workers drop to one thread for the same reason.
        log.info("torch CPU threads: 1 (was %d; the model runs on cuda; OMP_NUM_THREADS overrides)",
                 torch.get_num_threads())
        torch.set_num_threads(1)
    engine = Engine(loaded, engine_options(config, loaded))
    load_adapters(engine.adapters, config)
    engine.warm_up()  # on this thread, which serves: cuBLAS makes its handle here, before the caches claim memory
    if loaded.device.type == "cuda":
        RESERVE.keep(loaded.device)  # before the caches are sized from what is free
    log.info("warm-up done; a forward's fixed cost is worth %.0f padded tokens (length grouping)",
             engine.fixed_cost_tokens)
    prompts_per_s = 0.0
    if config.workers is None:  # --workers auto: the supervisor starts the front ends this rate needs
        prompts_per_s = measure_prompt_rate(engine)  # before the prefix cache: nothing left in it
        log.info("%.0f next-token prompts/s at batch %d (--workers auto)", prompts_per_s,
                 engine.options.max_batch_size)
    generator = Generator(engine, *kv_cache_size(config, engine), chunk_tokens=config.prefill_chunk_tokens)
    # Ready means warm: each kind of step has run once (on cuda the whole cache is claimed and
    # written now; on a CPU it grows with use, a few slots and positions at a time).
    generator.warm_up()
    if generator.prefill_graphs is not None:
        log.info("prefill graphs: %d captured (%.0f MiB), for prompts of up to %d tokens", generator.prefill_graphs.graphs,
                 generator.prefill_graphs.memory_used_bytes / 2**20, generator.prefill_graphs.buckets.length[-1])
    log.info("KV cache: up to %d sequences and %d tokens (%.0f MiB, %s), %s", generator.slots,
             generator.capacity_blocks * BLOCK,
             generator.capacity_blocks * BLOCK * KVCache.bytes_per_token(loaded.model.config, engine.kv_dtype) / 2**20,
             str(engine.kv_dtype).removeprefix("torch."), "claimed now" if loaded.device.type == "cuda" else "allocated as used")
    engine.attach_prefix_cache(prefix_cache_blocks(config, engine))  # after warm-up: it starts empty
    if engine.prefix_cache is None:
        log.info("prefix cache: off (--prefix-cache-mb 0)")
    else:
        log.info("prefix cache: up to %d tokens (%.0f MiB), %s", engine.prefix_cache.capacity_blocks * PREFIX_BLOCK,
                 prefix_cache_bytes(engine) / 2**20, "claimed now" if loaded.device.type == "cuda" else "touched as used")
    return engine, generator, prompts_per_s


class EngineHost:
    def __init__(self, config: ServeConfig, telemetry: Telemetry):
        self.config, self.telemetry = config, telemetry

    async def start(self) -> None:
        """Load and warm the model in its own thread, then put the schedulers in front of it."""
        config, telemetry = self.config, self.telemetry
        engine_thread = new_engine_thread()
        try:
            engine, generator, self.prompts_per_s = await asyncio.get_running_loop().run_in_executor(
                engine_thread, load_engine, config)
        except BaseException:
            engine_thread.shutdown(wait=False)
            raise
        self.core = EngineCore(
            generator, max_batch_size=engine.options.max_batch_size,
            max_batch_delay_s=config.max_batch_delay_ms / 1000, max_queue=config.max_queue,
            max_batch_tokens=config.max_batch_tokens, max_queue_wait_s=config.max_queue_wait_s,
            eos_token_id=engine.loaded.tokenizer.eos_token_id, engine_thread=engine_thread, observer=telemetry,
            adapters=engine.adapters, max_loras=config.step_loras)
        self.core.start()
        loaded = engine.loaded
        self.tokenizer = loaded.tokenizer
        prefix = engine.prefix_cache
        described = describe_model(loaded)
        self.info = replace(described, model=config.served_model_name or described.model,  # the name clients use
                            adapters=engine.adapters.names,
                            max_running_sequences=generator.slots,
                            prefix_cache_tokens=prefix.capacity_blocks * PREFIX_BLOCK if prefix else 0,
                            prefix_cache_bytes=prefix_cache_bytes(engine))
        info = self.info
        telemetry.model_loaded(ModelLoaded(info.model, info.dtype, info.device, info.weights,
                                           info.architecture.vocab_size,
                                           len(info.adapters) and (config.step_loras or len(info.adapters))),
                               self.stats, device_memory_probe(loaded.device), config.metrics_compat)
        self.stats_log = StatsLog(config.log_stats_interval_s, self.stats, self.core.runner.counts.totals)
        self.stats_log.start()

    def stats(self) -> SchedulerStats:
        core = self.core
        return SchedulerStats(core.queue_depth, core.prompts_running, core.waiting, core.running, core.cache_usage,
                              *core.adapters_in_use())

    def client(self) -> InprocEngineClient:
        return InprocEngineClient(self.core)

    async def stop(self) -> None:
        self.stats_log.stop()
        await self.core.stop()


# --workers N: the engine process --------------------------------------------------------------------

def engine_main(config: ServeConfig, address: str, status, parent_pid: int, title: str) -> None:
    child_setup(config, "engine", title)
    try:
        asyncio.run(_engine_process(config, address, status, parent_pid))
    except (ModelLoadError, StartupError) as exc:
        what = "cannot load model" if isinstance(exc, ModelLoadError) else "cannot start"
        print(f"gpt2serve serve: {what}: {exc}", flush=True)
        raise SystemExit(1)


async def _engine_process(config: ServeConfig, address: str, status, parent_pid: int) -> None:
    tracer_provider = setup_tracing(config.otel_traces_exporter, config.trace_sample_ratio)
    telemetry = Telemetry()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)  # also while loading
    host = EngineHost(config, telemetry)
    await host.start()
    # The IPC door runs on its own thread (ipc.engine_server); this loop only starts and stops
    # things and writes the gauges.
    server = EngineServer(address, host.core, EngineReady(host.info, host.tokenizer.source, host.core.max_batch_size))
    server.start()
    freeze_startup_heap()
    status.send(("ready", (host.info.model, host.prompts_per_s)))
    log.info("engine ready at %s", address)
    watch = asyncio.create_task(watch_parent(parent_pid, stop))
    while not stop.is_set() and server.serving:  # gauges the front ends' /metrics read
        telemetry.metrics.refresh()
        await asyncio.wait([asyncio.create_task(stop.wait())], timeout=REFRESH_S)
    watch.cancel()
    server.stop()
    await host.stop()
    server.close()
    if tracer_provider is not None:
        flush_traces(tracer_provider, 1.0)
    log.info("engine stopped")
