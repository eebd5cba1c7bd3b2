"""Prometheus metrics: every metric gpt2serve exports, owned by one class, in its own registry.

Names carry the `gpt2serve_` prefix and seconds; duration buckets follow the OpenTelemetry GenAI
conventions. Histograms take the request's trace id as an exemplar when the request was
sampled, so a dashboard can jump from a slow bucket to its trace (OpenMetrics format only: ask
for it with `Accept: application/openmetrics-text`, as Prometheus does).

With `--workers N` (N > 1) every process writes its samples to files in PROMETHEUS_MULTIPROC_DIR
(prometheus_client's multiprocess mode, switched on by that variable before the import), and
any front end's /metrics sums them: the counters are the whole server's. That mode has no
exemplars, no Info metric (the model is a gauge of 1 with the same name and labels) and no
callback gauges (the engine process sets queue depth and device memory as they change).

Routers and autoscalers (the Gateway API Inference Extension, KEDA, an HPA over
prometheus-adapter) read three gauges, one value per engine: `gpt2serve_requests_waiting`,
`gpt2serve_requests_running` and `gpt2serve_kv_cache_usage_ratio`. `--metrics-compat vllm`
exports them under vLLM's names as well, so routers and dashboards written for vLLM work as they
are (METRICS_COMPAT).
"""

from __future__ import annotations

import os
import time
from bisect import bisect_left
from dataclasses import dataclass
from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.exposition import choose_encoder
from prometheus_client.multiprocess import MultiProcessCollector

from .records import FirstToken, ModelLoaded, PrefixCacheUse, RequestDone, RequestRefused, SchedulerStats

MULTIPROCESS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

# GenAI semantic conventions: gen_ai.server.request.duration / time_to_first_token buckets.
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
QUEUE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# A generation step: half a millisecond (a decode step on a card) to a second (a long prefill on a CPU).
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.024)
# gen_ai.server.time_per_output_token buckets, with finer ones below 10 ms for GPUs.
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
GENERATING_METHODS = ("Generate", "Completions", "ChatCompletions")  # their first token is not their answer
# Every (api, method) a front end answers: their series are made when it starts (prepare_answered).
ANSWERED = (("grpc", "NextToken"), ("grpc", "NextTokenBatch"), ("grpc", "Generate"), ("rest", "NextToken"),
            ("rest", "NextTokenBatch"), ("rest", "Generate"), ("openai", "Completions"),
            ("openai", "ChatCompletions"))
# --metrics-compat: other servers' names for the router gauges (ours -> theirs). vLLM's carry
# the labels model_name and engine; its kv_cache_usage_perc is a ratio too (1 = 100%).
METRICS_COMPAT = {
    "vllm": {"requests_waiting": "vllm:num_requests_waiting", "requests_running": "vllm:num_requests_running",
             "kv_cache_usage": "vllm:kv_cache_usage_perc"},
}
# --metrics-compat: the prefix cache's counters under other servers' names (vLLM counts tokens too).
COUNTERS_COMPAT = {
    "vllm": {"prefix_cache_queries": "vllm:prefix_cache_queries", "prefix_cache_hits": "vllm:prefix_cache_hits"},
}


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.multiprocess_dir = os.environ.get(MULTIPROCESS_DIR_ENV)
        self._gauges: list[tuple[Gauge, Callable[[SchedulerStats], float]]] = []  # set by refresh() (multiprocess mode)
        self._stats: Callable[[], SchedulerStats] | None = None
        self._max_lora = ""  # adapters served, as vllm:lora_requests_info's label ("": none, no gauge)
        self._children: dict[tuple, object] = {}  # (metric, label values) -> its child (see _child)
        self._series: dict[tuple[str, str], _RequestSeries] = {}  # (api, method) -> see request_done
        r = self.registry
        self.requests = Counter("gpt2serve_requests", "Requests answered, by API, method and status code",
                                ["api", "method", "status"], registry=r)
        self.request_duration = Histogram("gpt2serve_request_duration_seconds", "Time from arrival to answer",
                                          ["api", "method"], buckets=DURATION_BUCKETS, registry=r)
        self.time_to_first_token = Histogram("gpt2serve_time_to_first_token_seconds",
                                             "Time from arrival to the first generated token",
                                             ["api", "method"], buckets=DURATION_BUCKETS, registry=r)
        self.time_per_output_token = Histogram("gpt2serve_time_per_output_token_seconds",
                                               "Mean time between a generation's tokens after the first",
                                               ["api"], buckets=TOKEN_BUCKETS, registry=r)
        self.queue_duration = Histogram("gpt2serve_queue_duration_seconds", "Time waiting for a batch",
                                        buckets=QUEUE_BUCKETS, registry=r)
        self.forward_duration = Histogram("gpt2serve_forward_duration_seconds", "Forward pass of one batch",
                                          buckets=DURATION_BUCKETS, registry=r)
        self.batch_size = Histogram("gpt2serve_batch_size", "Prompts per forward pass",
                                    buckets=BATCH_SIZE_BUCKETS, registry=r)
        self.step_duration = Histogram("gpt2serve_step_duration_seconds",
                                       "One generation step, by kind: prefill (new sequences' prompts, each "
                                       "giving its first token) or decode (a token for every running sequence)",
                                       ["kind"], buckets=STEP_BUCKETS, registry=r)
        self.step_sequences = Histogram("gpt2serve_step_sequences", "Sequences in one generation step, by kind",
                                        ["kind"], buckets=BATCH_SIZE_BUCKETS, registry=r)
        self.step_tokens = Histogram("gpt2serve_step_tokens",
                                     "Tokens one generation step computed, by kind: one per decode row and the "
                                     "prompt tokens read beside them, past the prefix cache (what the step's token "
                                     "budget bounds; vLLM's iteration tokens)", ["kind"],
                                     buckets=STEP_TOKEN_BUCKETS, registry=r)
        self.prompt_tokens = Counter("gpt2serve_prompt_tokens", "Prompt tokens processed", ["api"], registry=r)
        self.lora_requests = Counter("gpt2serve_lora_requests", "Requests that named a LoRA adapter, by adapter and "
                                     "status code (the base's are requests_total's alone)", ["adapter", "status"],
                                     registry=r)
        self.generated_tokens = Counter("gpt2serve_generated_tokens", "Tokens generated", ["api"], registry=r)
        self.prefix_cache_queries = Counter("gpt2serve_prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache", registry=r)
        self.prefix_cache_hits = Counter("gpt2serve_prefix_cache_hits",
                                         "Prompt tokens found in the prefix cache, so not computed again", registry=r)
        self.connections_refused = Counter("gpt2serve_connections_refused",
                                           "Connections closed at once: past the front end's connection limit",
                                           ["api"], registry=r)
        self.connections_evicted = Counter("gpt2serve_connections_evicted",
                                           "Connections closed to make room for a new one at the front end's "
                                           "connection limit: the oldest without a request's headers (REST) or "
                                           "with no call open (gRPC)", ["api"], registry=r)
        self._compat_counters: list[tuple[Counter, Counter]] = []  # (ours, under another server's name)
        live_sum = dict(multiprocess_mode="livesum")  # across the processes alive (multiprocess mode)
        self.in_flight = Gauge("gpt2serve_in_flight_requests", "Requests being handled", registry=r, **live_sum)
        self.in_flight_value = self.in_flight._value  # request_started / request_done: an add each, no checks
        self.queue_depth = Gauge("gpt2serve_queue_depth", "Prompts waiting for a batch", registry=r, **live_sum)
        self.running_sequences = Gauge("gpt2serve_running_sequences", "Generations in the running batch",
                                       registry=r, **live_sum)
        self.waiting_sequences = Gauge("gpt2serve_waiting_sequences", "Generations waiting for a KV-cache slot",
                                       registry=r, **live_sum)
        self.kv_cache_usage = Gauge("gpt2serve_kv_cache_usage_ratio", "Share of the KV cache's blocks held by running generations, each at the longest it may grow (0..1)",
                                    registry=r, **live_sum)
        self.requests_waiting = Gauge(
            "gpt2serve_requests_waiting",
            "Requests waiting to run: prompts queued for a next-token batch and generations waiting for a "
            "KV-cache slot (what a router or autoscaler reads)", registry=r, **live_sum)
        self.requests_running = Gauge(
            "gpt2serve_requests_running",
            "Requests running: prompts in the forward pass under way and generations being decoded",
            registry=r, **live_sum)
        self.device_memory = Gauge("gpt2serve_device_memory_bytes",
                                   "Memory in use on the model's device (CPU: process RSS)", ["device"], registry=r,
                                   **live_sum)
        self.front_end_restarts = Counter("gpt2serve_front_end_restarts",
                                          "Front-end processes started again after they died (--workers)", registry=r)
        self.front_ends_up = Gauge("gpt2serve_front_ends_up", "Front-end processes ready to serve (--workers)",
                                   registry=r, multiprocess_mode="livemax")
        if self.multiprocess_dir:
            self.model_gauge = Gauge("gpt2serve_model_info", "The served model",
                                     ["model", "dtype", "device", "weights"], registry=r, multiprocess_mode="max")
        else:
            self.model = Info("gpt2serve_model", "The served model", registry=r)

    def model_loaded(self, model: ModelLoaded, stats: Callable[[], SchedulerStats],
                     device_memory: Callable[[], float], compat: str | None = None) -> None:
        """Called once the model is loaded, in the process that owns it: the model's labels, and
        the gauges read from `stats()` and `device_memory()`. In multiprocess mode those are read
        by `refresh()`, which the engine process calls as it works."""
        labels = {"model": model.model, "dtype": model.dtype, "device": model.device, "weights": model.weights}
        router = {"requests_waiting": lambda s: s.prompts_waiting + s.generations_waiting,
                  "requests_running": lambda s: s.prompts_running + s.generations_running,
                  "kv_cache_usage": lambda s: s.kv_cache_usage}
        gauges = [(self.queue_depth, lambda s: s.prompts_waiting), (self.running_sequences, lambda s: s.generations_running),
                  (self.waiting_sequences, lambda s: s.generations_waiting),
                  (self.device_memory.labels(device=model.device), lambda _: device_memory()),
                  *((getattr(self, name), read) for name, read in router.items())]
        if compat:  # The same readings under another server's names (a gauge's own help says whose).
            for name, their_name in METRICS_COMPAT[compat].items():
                (ours,) = getattr(self, name).describe()
                gauge = Gauge(their_name, f"{ours.name} under its --metrics-compat {compat} name: {ours.documentation}",
                              ["model_name", "engine"], registry=self.registry, multiprocess_mode="livesum")
                gauges.append((gauge.labels(model_name=model.model, engine="0"), router[name]))
            for name, their_name in COUNTERS_COMPAT[compat].items():
                (ours,) = getattr(self, name).describe()
                counter = Counter(their_name, f"{ours.name} under its --metrics-compat {compat} name: {ours.documentation}",
                                  ["model_name", "engine"], registry=self.registry)
                self._compat_counters.append((getattr(self, name), counter.labels(model_name=model.model, engine="0")))
        if model.adapters:  # vLLM's LoRA gauge: its labels are the reading, its value the reading's time
            self.lora_info = Gauge("vllm:lora_requests_info", "LoRA adapters of the generations running and of the "
                                   "requests waiting (vLLM's gauge: the labels name them, comma-separated; the value "
                                   "is when they were read)", ["max_lora", "running_lora_adapters",
                                                               "waiting_lora_adapters"],
                                   registry=None, multiprocess_mode="mostrecent")
            self._max_lora = str(model.adapters)
            if not self.multiprocess_dir:  # read at each scrape, before the gauge itself is collected
                self.registry.register(_OnScrape(lambda: self._lora_reading(stats(), clear=True)))
            self.registry.register(self.lora_info)
        if self.multiprocess_dir:
            self.model_gauge.labels(**labels).set(1)
            self._gauges, self._stats = gauges, stats
            self.refresh()
        else:
            self.model.info(labels)
            for gauge, read in gauges:
                gauge.set_function(lambda read=read: read(stats()))

    def refresh(self) -> None:
        if self._stats is None:
            return
        stats = self._stats()
        for gauge, read in self._gauges:
            gauge.set(read(stats))
        if self._max_lora:  # each reading a series of its own labels; the latest has the latest time
            self._lora_reading(stats, clear=False)

    def _lora_reading(self, stats: SchedulerStats, clear: bool) -> None:
        if clear:  # one process: only the current reading is exported
            self.lora_info.clear()
        self.lora_info.labels(max_lora=self._max_lora, running_lora_adapters=",".join(stats.running_adapters),
                              waiting_lora_adapters=",".join(stats.waiting_adapters)).set(time.time())

    def _child(self, metric, **labels):
        """metric.labels(**labels), kept: labels() validates and takes a lock on every call
        (about 2 µs), and each request asks for five. Label values come from small fixed sets."""
        key = (metric, *labels.values())
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(**labels)
        return child

    def prepare_answered(self) -> None:
        """Make the answered-request series of every (api, method) a front end serves, at 0. A
        series' first use made its children, about 60 values with their entries in the
        multiprocess files: 1.2 ms on our 2-core EPYC and 1.9 ms on an H100 machine's, which the
        first request of each kind paid (tests/gpu: the first request after ready). Dashboards
        then also read 0 for a method not yet called, not "no data"."""
        for api, method in ANSWERED:
            self._request_series(api, method)

    def request_started(self) -> None:
        self.in_flight_value.inc(1)

    def request_done(self, record: RequestDone) -> None:
        self.in_flight_value.inc(-1)
        api, method = record.api, record.method
        if record.adapter:
            self._child(self.lora_requests, adapter=record.adapter, status=record.status).inc()
        if record.status != "OK":
            self._child(self.requests, api=api, method=method, status=record.status).inc()
            return
        series = self._series.get((api, method)) or self._request_series(api, method)
        series.ok.inc(1)
        exemplar = _exemplar(record.trace_id)
        observe(series.duration, record.duration_s, exemplar)
        if series.first_token is not None:  # a next token is the first token
            observe(series.first_token, record.duration_s, exemplar)
        # A count of 0 writes nothing new; the series exists from its child's creation on.
        if record.prompt_tokens:
            series.prompt_tokens.inc(record.prompt_tokens)
        if record.output_tokens:
            series.generated_tokens.inc(record.output_tokens)
        for queue_s in record.queue_s:
            observe(self.queue_duration, queue_s, exemplar)
        if record.time_per_output_token_s is not None:
            observe(series.time_per_output_token, record.time_per_output_token_s, exemplar)

    def _request_series(self, api: str, method: str) -> _RequestSeries:
        series = self._series[api, method] = _RequestSeries(
            ok=self._child(self.requests, api=api, method=method, status="OK")._value,
            duration=self._child(self.request_duration, api=api, method=method),
            first_token=(None if method in GENERATING_METHODS else
                         self._child(self.time_to_first_token, api=api, method=method)),
            prompt_tokens=self._child(self.prompt_tokens, api=api)._value,
            generated_tokens=self._child(self.generated_tokens, api=api)._value,
            time_per_output_token=self._child(self.time_per_output_token, api=api))
        return series

    def request_refused(self, record: RequestRefused) -> None:
        """A request refused before it reached the service: counted with its status, no duration."""
        self._child(self.requests, api=record.api, method=record.method, status=record.code).inc()

    def first_token(self, record: FirstToken) -> None:
        self._child(self.time_to_first_token, api=record.api, method=record.method).observe(
            record.seconds, _exemplar(record.trace_id))

    def batch(self, size: int, forward_s: float) -> None:
        self.batch_size.observe(size)
        self.forward_duration.observe(forward_s)

    def step(self, kind: str, sequences: int, tokens: int, seconds: float) -> None:
        self._child(self.step_duration, kind=kind).observe(seconds)
        self._child(self.step_sequences, kind=kind).observe(sequences)
        self._child(self.step_tokens, kind=kind).observe(tokens)

    def prefix_cache(self, use: PrefixCacheUse) -> None:
        counts = {self.prefix_cache_queries: use.queried_tokens, self.prefix_cache_hits: use.hit_tokens}
        for counter, value in counts.items():
            counter.inc(value)
        for ours, theirs in self._compat_counters:
            theirs.inc(counts[ours])

    def front_ends_ready(self, count: int) -> None:
        """How many front-end processes are ready now (the supervisor's view, or 1 in one process)."""
        self.front_ends_up.set(count)

    def front_end_restarted(self) -> None:
        self.front_end_restarts.inc()

    def exposition(self, accept_header: str | None) -> tuple[bytes, str]:
        """The scrape body and its content type (OpenMetrics, with exemplars, when asked for)."""
        encoder, content_type = choose_encoder(accept_header or "")
        if self.multiprocess_dir:  # every process's samples, summed
            registry = CollectorRegistry()
            MultiProcessCollector(registry, self.multiprocess_dir)
            return encoder(registry), content_type
        return encoder(self.registry), content_type


class _OnScrape:
    """A collector that exports nothing: it calls `read` when a scrape reaches it (registered before
    the metrics `read` sets)."""

    def __init__(self, read: Callable[[], None]):
        self.read = read

    def describe(self) -> list:
        return []

    def collect(self) -> list:
        self.read()
        return []


@dataclass(slots=True)
class _RequestSeries:
    """What an answered request of one (api, method) updates, held: `labels()`, the library's
    checks and its bucket loop cost a next-token call about 18 µs in process, the adds below 5."""

    ok: Any  # requests_total{status="OK"}'s value
    duration: Histogram
    first_token: Histogram | None  # None for the generating methods, which report it as it comes
    prompt_tokens: Any  # the counters' values
    generated_tokens: Any
    time_per_output_token: Histogram


def observe(histogram: Histogram, amount: float, exemplar: dict[str, str] | None = None) -> None:
    """A labelled histogram child's observe(), without the checks Metrics makes true by how it
    builds children, and with a bisection for the bucket loop: the sum, and the one bucket the
    amount falls in (the first bound at or above it). With an exemplar, the library's own,
    which keeps it with the bucket. tests/observability/test_metric_series.py holds the two equal."""
    if exemplar:
        return histogram.observe(amount, exemplar)
    histogram._sum.inc(amount)
    histogram._buckets[bisect_left(histogram._upper_bounds, amount)].inc(1)


def _exemplar(trace_id: str) -> dict[str, str] | None:
    """A histogram sample's link to its trace, when the request was sampled."""
    return {"trace_id": trace_id} if trace_id else None
