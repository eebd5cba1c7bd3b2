"""A real Prometheus (Debian's package) on loopback for tests: scrapes the given targets every
0.5 s with the shipped config's job, and answers PromQL."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml
from .servers import free_ports

ROOT = Path(__file__).resolve().parents[2]


def query(url: str, promql: str) -> list[dict]:
    """An instant query against the Prometheus at `url` (ours, or one in a container)."""
    body = httpx.get(f"{url}/api/v1/query", params={"query": promql}, timeout=10).json()
    assert body["status"] == "success", body
    return body["data"]["result"]


def scalar(url: str, promql: str) -> float:
    """The query's first value; 0.0 when there is no sample."""
    result = query(url, promql)
    return float(result[0]["value"][1]) if result else 0.0


class Prometheus:
    def __init__(self, tmp: Path, targets: list[str], labels: dict[str, str] | None = None):
        """`targets`: host:port of each server; `labels`: added to every series (what a
        ServiceMonitor's relabelling would add in a cluster, e.g. namespace and service)."""
        if not shutil.which("prometheus"):
            pytest.fail("prometheus is not installed: `make test` installs it (scripts/debian_test_deps.sh)")
        config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
        config["global"]["scrape_interval"] = "500ms"
        (job,) = config["scrape_configs"]
        job["static_configs"] = [{"targets": targets, "labels": labels or {}}]
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_ports()[0]}"
        self.log = tmp / "prometheus.log"
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address={self.url.removeprefix('http://')}", "--enable-feature=exemplar-storage"],
            stdout=open(self.log, "wb"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(self.log.read_text())

    def query(self, promql: str) -> list[dict]:
        return query(self.url, promql)

    def scalar(self, promql: str) -> float:
        return scalar(self.url, promql)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
