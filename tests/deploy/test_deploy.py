"""The deploy files: docker-compose.yml passes a real compose implementation's `config` check
(Debian's docker-compose) in its GPU and CPU variants, and wires the stack together."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def compose_config(profile: str, **env: str) -> dict:
    out = subprocess.run(["docker-compose", "config"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "COMPOSE_PROFILES": profile, **env})
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def volume(entry) -> tuple[str, str]:
    """(source, target) from compose's short ("src:dst:mode") or long syntax."""
    if isinstance(entry, str):
        source, target = entry.split(":")[:2]
        return source, target
    return entry.get("source", ""), entry["target"]


def published(entry) -> tuple[str, int, int]:
    """(host address, host port, container port) from compose's short or long port syntax."""
    if isinstance(entry, str):
        address, host, container = entry.removesuffix("/tcp").split(":")
        return address, int(host), int(container)
    return entry.get("host_ip", ""), int(entry["published"]), int(entry["target"])


@pytest.mark.parametrize("profile", ["gpu", "cpu"])
def test_compose_config_is_valid_and_wired(profile):
    config = compose_config(profile)
    services = config["services"]
    assert {"gpt2serve", "gpt2serve-cpu", "jaeger", "prometheus", "grafana"} <= set(services)
    for name in ("gpt2serve", "gpt2serve-cpu"):
        server = services[name]
        assert server["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
        assert {published(p)[2] for p in server["ports"]} == {50051, 8000}
        assert any(volume(v)[1] == "/models" for v in server["volumes"])
    gpu = services["gpt2serve"]
    assert gpu["profiles"] == ["gpu"]
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    cpu = services["gpt2serve-cpu"]
    assert cpu["profiles"] == ["cpu"] and cpu["command"] == ["--device", "cpu"]
    assert "gpt2serve" in cpu["networks"]["default"]["aliases"]  # what Prometheus scrapes
    assert "--enable-feature=exemplar-storage" in services["prometheus"]["command"]
    mounts = {Path(source).relative_to(ROOT).as_posix(): target
              for s in ("prometheus", "grafana") for source, target in map(volume, services[s]["volumes"])
              if source.startswith("/")}
    assert mounts == {"deploy/prometheus/prometheus.yml": "/etc/prometheus/prometheus.yml",
                      "deploy/grafana/provisioning": "/etc/grafana/provisioning",
                      "deploy/grafana/dashboards": "/var/lib/grafana/dashboards"}
    ports = [published(p) for s in services.values() for p in s["ports"]]
    assert {host for _, host, _ in ports} >= {50051, 8000, 16686, 4317, 9090, 3000}
    assert {address for address, _, _ in ports} == {"127.0.0.1"}  # loopback unless GPT2SERVE_PUBLISH says


def test_ports_move_with_the_env():
    config = compose_config("cpu", GPT2SERVE_PUBLISH="0.0.0.0", GPT2SERVE_REST_PORT="18000",
                            GPT2SERVE_PROMETHEUS_PORT="19090")["services"]
    assert ("0.0.0.0", 18000, 8000) in map(published, config["gpt2serve-cpu"]["ports"])
    assert ("0.0.0.0", 19090, 9090) in map(published, config["prometheus"]["ports"])


def test_the_offline_stack_builds_every_image_it_starts_with_no_network():
    """`make stack`: with deploy/compose.offline.yml laid over, each service that starts is built
    here with --network none on the debootstrap'd base, so compose has nothing to pull; Jaeger and
    Grafana (registry images only) stay off, and traces go to the Phoenix service."""
    config = compose_config("cpu", COMPOSE_FILE="docker-compose.yml:deploy/compose.offline.yml")["services"]
    started = {name for name, service in config.items() if "cpu" in service.get("profiles", ["cpu"])}
    assert started == {"gpt2serve-cpu", "prometheus", "phoenix"}
    for name in started:
        build = config[name]["build"]
        assert build["network"] == "none" and build["args"]["BASE_IMAGE"] == "gpt2serve-base:bookworm", name
        assert not config[name]["image"].startswith(("prom/", "jaegertracing/", "grafana/")), name
    assert config["gpt2serve-cpu"]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://phoenix:4317"
    stack = (ROOT / "scripts/stack.sh").read_text()
    assert "COMPOSE_FILE=docker-compose.yml:deploy/compose.offline.yml" in stack and "--no-build" in stack


@pytest.mark.parametrize("profile", ["gpu", "cpu"])
def test_the_compose_env_selects_the_model(profile):
    """GPT2SERVE_MODEL=gpt2-medium docker compose up serves gpt2-medium: the env reaches the
    server, and neither compose's command nor the image's CMD passes a --model that would win."""
    config = compose_config(profile, GPT2SERVE_MODEL="gpt2-medium")
    for name in ("gpt2serve", "gpt2serve-cpu"):
        server = config["services"][name]
        assert server["environment"]["GPT2SERVE_MODEL"] == "gpt2-medium"
        assert "--model" not in (server.get("command") or [])
    assert compose_config(profile)["services"]["gpt2serve"]["environment"]["GPT2SERVE_MODEL"] == "gpt2"
    lines = (ROOT / "deploy/Dockerfile").read_text().splitlines()
    assert not any(line.startswith("CMD") and "--model" in line for line in lines)
    assert any("GPT2SERVE_MODEL=gpt2" in line for line in lines)  # the image's own default


def test_container_defaults_drain_build_small_and_say_their_version(tmp_path):
    config = compose_config("cpu")["services"]
    for name in ("gpt2serve", "gpt2serve-cpu"):
        server = config[name]
        grace = server["stop_grace_period"]
        assert int(grace.rstrip("s")) > 30  # the server's own --shutdown-grace-s default
        assert server["image"].startswith("gpt2serve:0.1.0")
        assert server["read_only"] is True and "/tmp" in server["tmpfs"]  # the stack test runs it so
    assert config["gpt2serve-cpu"]["build"]["args"]["TORCH_INDEX_URL"].endswith("/whl/cpu")
    assert "shm_size" in config["gpt2serve"]
    dockerfile = (ROOT / "deploy/Dockerfile").read_text()
    assert "ARG BASE_IMAGE=python:3.11-slim" in dockerfile and "FROM ${BASE_IMAGE}" in dockerfile
    assert "org.opencontainers.image.version" in dockerfile and "--no-index --find-links /wheels" in dockerfile
    assert not any(word in dockerfile for word in ("pip.conf", "PIP_INDEX_URL", "PIP_CERT", "ca-certificates.crt"))
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".git", "tests"} <= set(ignored)


def test_plain_compose_up_means_the_gpu_variant():
    assert "COMPOSE_PROFILES=gpu" in (ROOT / ".env").read_text().splitlines()


def test_dockerfile_runs_as_non_root_with_a_healthcheck_and_a_model_volume():
    lines = [line.strip() for line in (ROOT / "deploy/Dockerfile").read_text().splitlines()]
    user = [line for line in lines if line.startswith("USER ")]
    assert user and user[-1] != "USER root"
    assert any(line.startswith("HEALTHCHECK") for line in lines) and "/readyz" in "\n".join(lines)
    assert "VOLUME /models" in lines and any("HF_HOME=/models" in line for line in lines)
    # The datasource provisioning links exemplars to the Jaeger datasource by uid.
    datasources = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/datasources.yml").read_text())
    by_uid = {d["uid"]: d for d in datasources["datasources"]}
    assert by_uid["prometheus"]["jsonData"]["exemplarTraceIdDestinations"][0]["datasourceUid"] == "jaeger"
    assert by_uid["jaeger"]["url"] == "http://jaeger:16686"
