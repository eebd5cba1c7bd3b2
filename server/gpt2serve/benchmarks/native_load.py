"""`gpt2serve bench --native`: the load from a native load generator, h2load (Debian's
`nghttp2-client`) for gRPC with a prepared request body, wrk for REST, so that a headline figure
measures the server and not a Python client sharing its cores.

Every load generator's CPU is counted (`LoadGeneratorCpu`), the Python clients' included: a
figure whose load generator kept its own threads busy past `HEADROOM` may have measured the load
generator, and the report marks it rejected.

What the native tools do not see, the server's `/metrics` tells: gRPC answers an error with HTTP
200 and a status in its trailers, which h2load counts as a success, so errors are the server's
`gpt2serve_requests_total` by status over the run. One request body is sent over and over (h2load
cannot vary it); next-token work does not depend on which ids a prompt holds, only on its length.
"""

from __future__ import annotations

import json
import math
import os
import re
import resource
import shutil
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Callable
from urllib.parse import urlparse

HEADROOM = 0.9  # a load generator busier than this share of its threads' cores may be the limit
MAX_CONNECTIONS = 64  # h2load: connections the in-flight calls are spread over (several front ends share a port)
REQUEST_TIMEOUT_S = 30  # per call, for both tools: a stuck server ends the run, not the bench


@dataclass
class LoadGeneratorCpu:
    """The CPU a load generator spent over a run, against the cores its threads could use."""

    name: str
    threads: int  # processes or threads that generate the load, one core each at most
    cpu_s: float
    wall_s: float
    machine_cores: int = field(default_factory=lambda: os.cpu_count() or 1)

    @property
    def busy(self) -> float:
        """Share of its own threads' cores it used (1.0: every thread always on a core)."""
        return self.cpu_s / (self.wall_s * self.threads) if self.wall_s > 0 else 0.0

    @property
    def machine_share(self) -> float:
        return self.cpu_s / (self.wall_s * self.machine_cores) if self.wall_s > 0 else 0.0

    @property
    def rejected(self) -> str:
        """Why the figure cannot stand, or '' when the load generator had headroom."""
        if self.busy < HEADROOM:
            return ""
        return (f"the load generator ({self.name}) kept its {self.threads} thread(s) {self.busy:.0%} busy: "
                f"it may be the limit; add --processes or use --native")

    def as_dict(self) -> dict:
        return {"name": self.name, "threads": self.threads, "cpu_s": round(self.cpu_s, 3),
                "wall_s": round(self.wall_s, 3), "busy": round(self.busy, 3),
                "machine_share": round(self.machine_share, 3), "rejected": self.rejected}

    def describe(self) -> str:
        return (f"load generator: {self.name}, {self.cpu_s / self.wall_s:.2f} cores "
                f"({self.busy:.0%} of its {self.threads} thread(s), {self.machine_share:.0%} of the machine's "
                f"{self.machine_cores})" + (f"; REJECTED: {self.rejected}" if self.rejected else "; headroom ok"))


def cpu_seconds(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


class CpuMeter:
    """CPU of this process and of its children that ended within the block (spawned client
    processes and native tools are reaped before the block ends)."""

    def __enter__(self) -> CpuMeter:
        self.wall0 = time.monotonic()
        self.cpu0 = cpu_seconds(resource.RUSAGE_SELF) + cpu_seconds(resource.RUSAGE_CHILDREN)
        return self

    def __exit__(self, *_) -> None:
        self.wall_s = time.monotonic() - self.wall0
        self.cpu_s = cpu_seconds(resource.RUSAGE_SELF) + cpu_seconds(resource.RUSAGE_CHILDREN) - self.cpu0

    def result(self, name: str, threads: int) -> LoadGeneratorCpu:
        return LoadGeneratorCpu(name, threads, self.cpu_s, self.wall_s)


# The server's own count of what it answered -------------------------------------------------------

def scrape(http_target: str) -> dict[tuple[str, tuple], float]:
    """The server's /metrics as {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families  # lazy: a server dependency

    with urllib.request.urlopen(f"{http_target.rstrip('/')}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def answered_by_status(metrics: dict, api: str, method: str) -> dict[str, float]:
    """gpt2serve_requests_total for (api, method), by status."""
    counts: dict[str, float] = {}
    for (name, labels), value in metrics.items():
        labels = dict(labels)
        if name == "gpt2serve_requests_total" and labels.get("api") == api and labels.get("method") == method:
            counts[labels["status"]] = counts.get(labels["status"], 0.0) + value
    return counts


def status_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    return {status: int(after[status] - before.get(status, 0.0)) for status in after
            if after[status] - before.get(status, 0.0) > 0}


def mean_batch_between(before: dict, after: dict) -> float:
    """Prompts per forward over the run, from the gpt2serve_batch_size histogram."""
    prompts = after.get(("gpt2serve_batch_size_sum", ()), 0.0) - before.get(("gpt2serve_batch_size_sum", ()), 0.0)
    forwards = after.get(("gpt2serve_batch_size_count", ()), 0.0) - before.get(("gpt2serve_batch_size_count", ()), 0.0)
    return prompts / forwards if forwards else 0.0


# The native runs ------------------------------------------------------------------------------------

@dataclass
class NativeRun:
    requests: int  # answered with HTTP 2xx within the measured window
    duration_s: float
    p50_s: float
    p90_s: float
    p99_s: float
    transport_errors: int  # connect, read, write, timeout and non-2xx as the tool saw them
    concurrency: int  # calls in flight
    threads: int


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest rank."""
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))]


def need_tool(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise SystemExit(f"gpt2serve bench --native needs {name} (Debian: apt-get install {package})")
    return path


def grpc_frame(message: bytes) -> bytes:
    """A gRPC message on the wire: not compressed (0), its length (4 bytes, big-endian), itself."""
    return b"\x00" + len(message).to_bytes(4, "big") + message


def grpc_request_body(api: str, prompt: list[int], per_call: int) -> tuple[str, bytes]:
    """The method's HTTP/2 path and one framed request, from the client's generated messages."""
    from gpt2serve_client._proto import gpt2serve_pb2 as pb

    service = pb.DESCRIPTOR.services_by_name["Gpt2Serve"].full_name
    if api == "grpc-batch":
        message = pb.NextTokenBatchRequest(prompts=[pb.Prompt(prompt_token_ids=prompt)] * per_call, top_k=5)
        return f"/{service}/NextTokenBatch", grpc_frame(message.SerializeToString())
    message = pb.NextTokenRequest(prompt_token_ids=prompt, top_k=5)
    return f"/{service}/NextToken", grpc_frame(message.SerializeToString())


def run_h2load(target: str, path: str, body: bytes, concurrency: int, threads: int, duration_s: float,
               warmup_s: float) -> NativeRun:
    """Closed-loop gRPC calls over HTTP/2: `concurrency` in flight, spread over connections."""
    h2load = need_tool("h2load", "nghttp2-client")
    connections = max(threads, min(concurrency, MAX_CONNECTIONS))
    streams = math.ceil(concurrency / connections)
    with tempfile.TemporaryDirectory(prefix="gpt2serve-h2load-") as tmp:
        body_file, log_file = f"{tmp}/body", f"{tmp}/log"
        with open(body_file, "wb") as out:
            out.write(body)
        run = subprocess.run(
            [h2load, "-D", f"{round(duration_s * 1000)}ms", "--warm-up-time", f"{round(max(warmup_s, 0.1) * 1000)}ms",
             "-c", str(connections), "-m", str(streams), "-t", str(min(threads, connections)),
             "-T", str(REQUEST_TIMEOUT_S), "-d", body_file, "--log-file", log_file,
             "-H", "content-type: application/grpc", "-H", "te: trailers", f"http://{target}{path}"],
            capture_output=True, text=True, timeout=warmup_s + duration_s + REQUEST_TIMEOUT_S + 30)
        if run.returncode != 0:
            raise SystemExit(f"h2load failed ({run.returncode}): {run.stderr.strip() or run.stdout.strip()}")
        latencies, bad = [], 0
        with open(log_file) as log:  # the measured calls only: start (µs since the epoch), status, µs
            for line in log:
                _, status, duration_us = line.split("\t")[:3]
                if status.startswith("2"):
                    latencies.append(int(duration_us) / 1e6)
                else:
                    bad += 1
    counts = re.search(r"requests: .* (\d+) failed, (\d+) errored, (\d+) timeout", run.stdout)
    failed = sum(int(n) for n in counts.groups()) if counts else 0
    latencies.sort()
    return NativeRun(len(latencies), duration_s, *(percentile(latencies, q) for q in (0.5, 0.9, 0.99)),
                     bad + failed, connections * streams, min(threads, connections))


WRK_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local bodies = %s
local i = 0
request = function()
  i = i %% #bodies + 1
  return wrk.format(nil, nil, nil, bodies[i])
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('{"requests": %%d, "duration_us": %%d, "errors": %%d, "p50_us": %%d, "p90_us": %%d, "p99_us": %%d}\\n',
    summary.requests, summary.duration, e.connect + e.read + e.write + e.status + e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99)))
end
"""


def next_token_body(prompt: list[int]) -> dict:
    return {"prompt_token_ids": prompt, "top_k": 5}


def run_wrk(base_url: str, prompts: list[list[int]], concurrency: int, threads: int, duration_s: float,
            warmup_s: float, path: str = "/v1/next-token",
            body_of: Callable[[list[int]], dict] = next_token_body) -> NativeRun:
    """Closed-loop REST calls over HTTP/1.1 keep-alive connections, one in flight on each; wrk has
    no warm-up of its own, so a first short run is it. wrk counts whole seconds. `path` and
    `body_of(prompt)`: another POST route (a streamed answer counts once, when it is whole)."""
    wrk = need_tool("wrk", "wrk")
    bodies = "{" + ", ".join(json.dumps(json.dumps(body_of(p))) for p in prompts[:256]) + "}"
    url = f"{base_url.rstrip('/')}{path}"
    threads = max(1, min(threads, concurrency))
    with tempfile.NamedTemporaryFile("w", suffix=".lua", prefix="gpt2serve-wrk-") as script:
        script.write(WRK_SCRIPT % bodies)
        script.flush()

        def once(seconds: float) -> dict:
            run = subprocess.run([wrk, "-t", str(threads), "-c", str(concurrency), "-d", f"{max(1, math.ceil(seconds))}s",
                                  "--timeout", f"{REQUEST_TIMEOUT_S}s", "-s", script.name, url],
                                 capture_output=True, text=True, timeout=seconds + REQUEST_TIMEOUT_S + 30)
            if run.returncode != 0:
                raise SystemExit(f"wrk failed ({run.returncode}): {run.stderr.strip() or run.stdout.strip()}")
            return json.loads(run.stdout.strip().splitlines()[-1])

        if warmup_s > 0:
            once(warmup_s)
        report = once(duration_s)
    return NativeRun(report["requests"] - report["errors"], report["duration_us"] / 1e6, report["p50_us"] / 1e6,
                     report["p90_us"] / 1e6, report["p99_us"] / 1e6, report["errors"], concurrency, threads)


def host_port(target: str) -> str:
    """host:port of a gRPC target or a URL."""
    parsed = urlparse(target if "://" in target else f"//{target}")
    return f"{parsed.hostname}:{parsed.port}"


def run_native(api: str, target: str, http_target: str, prompts: list[list[int]], per_call: int,
               concurrency: int, threads: int, duration_s: float,
               warmup_s: float) -> tuple[NativeRun, dict[str, int], float, LoadGeneratorCpu]:
    """One native load: the run, the server's answers by status over it, its mean batch, and
    the load generator's CPU."""
    label, method = ("rest" if api == "rest" else "grpc"), ("NextTokenBatch" if api == "grpc-batch" else "NextToken")
    before = scrape(http_target)
    with CpuMeter() as meter:
        if api == "rest":
            run = run_wrk(target, prompts, concurrency, threads, duration_s, warmup_s)
        else:
            path, body = grpc_request_body(api, prompts[0], per_call)
            run = run_h2load(host_port(target), path, body, concurrency, threads, duration_s, warmup_s)
    after = scrape(http_target)
    statuses = status_delta(answered_by_status(before, label, method), answered_by_status(after, label, method))
    # Both tools stop by closing their connections, so the calls then in flight end CANCELLED on
    # the server: up to one per call in flight, once per tool run (wrk runs twice: its warm-up).
    runs = 2 if api == "rest" and warmup_s > 0 else 1
    stopped = min(statuses.get("CANCELLED", 0), runs * run.concurrency)
    if stopped:
        statuses["CANCELLED"] -= stopped
    tool = "wrk" if api == "rest" else "h2load"
    return run, statuses, mean_batch_between(before, after), meter.result(tool, run.threads)
