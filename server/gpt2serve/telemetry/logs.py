"""The server's logs, for a person and for a log shipper:

- `setup_logging`: every process's log as text or as one JSON object a line (`--log-format`);
- `RequestLog`: one line per request (route or RPC, status, latency, tokens, request id, trace id),
  on unless `--disable-log-requests`; every 4xx/5xx with its reason, always (WARNING / ERROR);
- `StatsLog`: every `--log-stats-interval-s`, the engine's load and throughput, as vLLM's line.

A request's values are kept until the loop's next flush (at most FLUSH_S later, or FLUSH_LINES
requests), whose lines are made and written together in one call. The logging module's own path
(a record, a formatter, a lock and a write per line: 9.3 µs a line alone) would cost a unary call
several times the 2% this does (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import sys
import time
from typing import Callable, TextIO

from gpt2serve_client.status import ERROR_STATUSES

from .records import SchedulerStats

TEXT_FORMAT = "%(asctime)s %(levelname)s {label}%(name)s: %(message)s"
REQUEST_LOGGER = "gpt2serve.requests"
FLUSH_S = 0.25
FLUSH_LINES = 256
MAX_HEADS = 256
# A status with no error object to ask (a caller that went away), and OK.
HTTP_STATUS = {s.code: s.http for s in reversed(ERROR_STATUSES)} | {"OK": 200}  # the first row of a code wins
SERVER_FAULTS = frozenset({"INTERNAL", "UNKNOWN", "DATA_LOSS"})  # ERROR; every other failure is a WARNING


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (UTC, ISO 8601), level, logger, message, the process's label
    and pid, the record's `fields` (a request's), and the traceback when there is one."""

    def __init__(self, label: str = ""):
        super().__init__()
        self.label = label

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": iso_time(record.created), "level": record.levelname, "logger": record.name,
                 "message": record.getMessage(), "process": self.label or "server", "pid": record.process}
        entry.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def iso_time(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{int(seconds % 1 * 1000):03d}Z"


def setup_logging(level: str, log_format: str = "text", label: str = "") -> None:
    """The root logger's one handler, on stderr: text (`label`, e.g. "front-end[12]", before the
    logger's name) or JSON."""
    handler = logging.StreamHandler()
    text_label = f"{label} " if label else ""
    handler.setFormatter(JsonFormatter(label) if log_format == "json" else
                         logging.Formatter(TEXT_FORMAT.format(label=text_label)))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.captureWarnings(True)


def safe_field(text: str, limit: int = 200) -> str:
    """What a client sent (a path refused, its x-request-id), fit for a log line: printable ASCII
    but quotes and backslashes as they are, the rest %XX-escaped, so no field can end a line or a
    JSON string early; at most `limit` characters."""
    text = text[:limit]
    if text.isascii() and text.isprintable() and '"' not in text and "\\" not in text:
        return text
    return "".join(c if c.isascii() and c.isprintable() and c not in '"\\' else
                   "".join(f"%{b:02X}" for b in c.encode("utf-8", "surrogatepass")) for c in text)


def announce(line: str, log_format: str = "text") -> None:
    """A line the server's watchers wait for ("gpt2serve listening: ...", "gpt2serve ready: ..."),
    on stdout: as is, or as a JSON object with it as the message."""
    if log_format == "json":
        line = JsonFormatter().format(logging.LogRecord("gpt2serve", logging.INFO, __file__, 0, line, None, None))
    print(line, flush=True)


class RequestLog:
    """Request lines, kept and written together. `every`: a line for every request (else only
    the failures)."""

    def __init__(self, every: bool = True, log_format: str = "text", label: str = "", stream: TextIO | None = None):
        self.every, self.json, self.label = every, log_format == "json", label
        self.prefix = f"{label} " if label else ""
        self.stream = stream
        self.pending: list[tuple] = []  # a request's values, until the flush makes its line
        self.heads: dict[tuple, str] = {}  # (route, api, status, http) -> the start of its lines
        self.flush_at: asyncio.TimerHandle | None = None
        self.ids = itertools.count(1)
        self.id_prefix = os.urandom(3).hex()  # ids from different processes do not collide
        self.second, self.second_text = -1, ""
        self.pid = os.getpid()

    def request(self, route: str, api: str, status: str, seconds: float, prompt_tokens: int, output_tokens: int,
                request_id: str | None, trace_id: str, reason: str = "", http: int | None = None,
                adapter: str = "") -> None:
        """`status`: the gRPC status name; `http`: the HTTP status sent (REST, OpenAI), when not the
        status's usual one; `request_id`: the caller's, or None for one of ours; `adapter`: the LoRA
        adapter it ran under ("": the base). The values are
        kept as they are and the lines made at the flush, together: made one by one among a
        call's other work, they cost about three times as much (docs/benchmarks.md)."""
        if status == "OK" and not self.every:
            return
        self.pending.append((time.time(), route, api, status, seconds, prompt_tokens, output_tokens,
                             request_id or next(self.ids), trace_id, reason, http, adapter))
        if len(self.pending) >= FLUSH_LINES:
            self.flush()
        elif self.flush_at is None:
            try:
                self.flush_at = asyncio.get_running_loop().call_later(FLUSH_S, self.flush)
            except RuntimeError:  # no loop in this thread: at once
                self.flush()

    def lines(self, pending: list[tuple]) -> str:
        """The lines of `pending`, made in one loop (a call a line would cost a fifth more)."""
        out, heads, json_format, prefix = [], self.heads, self.json, self.id_prefix
        for (now, route, api, status, seconds, prompt_tokens, output_tokens, request_id, trace_id, reason, http,
             adapter) in pending:
            if type(request_id) is int:
                request_id = f"{prefix}-{request_id:x}"
            second = int(now)
            if second != self.second:  # the second's text made once a second: as logging's asctime, or ISO 8601
                self.second = second
                self.second_text = time.strftime("%Y-%m-%dT%H:%M:%S" if json_format else "%Y-%m-%d %H:%M:%S",
                                                 (time.gmtime if json_format else time.localtime)(second))
            key = (route, api, status, http)
            head = heads.get(key)
            if head is None:
                head = self.head(*key)
                if len(heads) < MAX_HEADS:  # refused paths are the client's: no cache grows with them
                    heads[key] = head
            if json_format:
                out.append(f'{{"time":"{self.second_text}.{int((now - second) * 1000):03d}Z",{head},'
                           f'"latency_ms":{seconds * 1000:.3f},"prompt_tokens":{prompt_tokens},'
                           f'"output_tokens":{output_tokens},"request_id":{json.dumps(request_id)}'
                           f'{f",{chr(34)}adapter{chr(34)}:{json.dumps(adapter)}" if adapter else ""}'
                           f'{f",{chr(34)}trace_id{chr(34)}:{chr(34)}{trace_id}{chr(34)}" if trace_id else ""}'
                           f'{f",{chr(34)}reason{chr(34)}:{json.dumps(reason, ensure_ascii=False)}" if reason else ""}}}')
            else:
                out.append(f"{self.second_text},{int((now - second) * 1000):03d} {head} {seconds * 1000:.1f}ms "
                           f"prompt_tokens={prompt_tokens} output_tokens={output_tokens} request_id={request_id}"
                           f"{f' adapter={adapter}' if adapter else ''}"
                           f"{f' trace_id={trace_id}' if trace_id else ''}{f' reason={reason!r}' if reason else ''}")
        return "\n".join(out) + "\n"

    def head(self, route: str, api: str, status: str, http: int | None) -> str:
        """What lines of one route and status share, made once: level, logger, route, status."""
        level = "INFO" if status == "OK" else "ERROR" if status in SERVER_FAULTS else "WARNING"
        if api != "grpc" and http is None:
            http = HTTP_STATUS.get(status, 500)
        if not self.json:
            return f"{level} {self.prefix}{REQUEST_LOGGER}: {route} {status}{'' if http is None else f' {http}'}"
        return (f'"level":"{level}","logger":"{REQUEST_LOGGER}","message":{json.dumps(f"{route} {status}")},'
                f'"process":"{self.label or "server"}","pid":{self.pid},"route":{json.dumps(route)},"api":"{api}",'
                f'"status":"{status}"{"" if http is None else f",{chr(34)}http_status{chr(34)}:{http}"}')

    def flush(self) -> None:
        if self.flush_at is not None:
            self.flush_at.cancel()
            self.flush_at = None
        if self.pending:
            pending, self.pending = self.pending, []
            text = self.lines(pending)
            stream = self.stream or sys.stderr
            try:
                stream.write(text)
                stream.flush()
            except (OSError, ValueError):  # stderr closed (the process is ending): the lines are lost
                pass


class StatsLog:
    """Every `interval_s`, while anything ran or waits: requests running and waiting, prompt and
    generation tokens a second, the KV cache's use and the prefix cache's hit rate. `counts()`
    gives the engine's running totals (prompt tokens, generated tokens, prompt tokens looked up in
    the prefix cache, those found there)."""

    def __init__(self, interval_s: float, stats: Callable[[], SchedulerStats],
                 counts: Callable[[], tuple[int, int, int, int]]):
        self.interval_s, self.stats, self.counts = interval_s, stats, counts
        self.log = logging.getLogger("gpt2serve.stats")
        self.last = (time.monotonic(), counts())
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        if self.interval_s > 0:
            self.task = asyncio.get_running_loop().create_task(self.run())

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.write()
            except Exception:  # a stats line must never stop the server
                self.log.exception("stats line failed")

    def write(self) -> None:
        now, counts = time.monotonic(), self.counts()
        (then, before), self.last = self.last, (now, counts)
        seconds = max(now - then, 1e-9)
        prompt, generated, queried, hit = (a - b for a, b in zip(counts, before))
        s = self.stats()
        running, waiting = s.prompts_running + s.generations_running, s.prompts_waiting + s.generations_waiting
        if not (prompt or generated or running or waiting):
            return  # idle: no line
        hit_rate = f"{100 * hit / queried:.1f}%" if queried else "n/a"
        fields = {"running": running, "waiting": waiting, "prompt_tokens_per_s": round(prompt / seconds, 1),
                  "generation_tokens_per_s": round(generated / seconds, 1),
                  "kv_cache_usage": round(s.kv_cache_usage, 4),
                  "prefix_cache_hit_rate": round(hit / queried, 4) if queried else None}
        self.log.info("running: %d reqs, waiting: %d reqs, prompt throughput: %.1f tokens/s, generation throughput: "
                      "%.1f tokens/s, KV cache usage: %.1f%%, prefix cache hit rate: %s", running, waiting,
                      prompt / seconds, generated / seconds, 100 * s.kv_cache_usage, hit_rate, extra={"fields": fields})
