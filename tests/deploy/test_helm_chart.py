"""The Helm chart (deploy/helm/gpt2serve), with no cluster: `helm lint --strict`, and `helm template`
over every values file in its ci/ folder (chart-testing's convention), each rendered object valid
under the real Kubernetes schemas (kubernetes-validate --strict) or its CRD's schema (KEDA,
Prometheus operator). Then what a cluster would rely on: probe and grace timings that fit
together, and autoscaling queries whose metrics a live server exports."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml
from support.servers import launch_server, metric_value, wait_for
from support.held_streams import HeldGenerations
from support.prometheus_server import Prometheus

pytestmark = pytest.mark.helm

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy/helm/gpt2serve"
TOOLS = ROOT / ".tools"
HELM = TOOLS / "bin/helm"
KUBERNETES_VERSIONS = ("1.29.0", "1.33.0")  # the oldest we claim in docs, and a current one
CRD_KINDS = {"ScaledObject", "ServiceMonitor"}
CI_VALUES = sorted(CHART.glob("ci/*-values.yaml"))


@pytest.fixture(scope="module", autouse=True)
def tools():
    out = subprocess.run([str(ROOT / "scripts/chart_tools.sh")], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"scripts/chart_tools.sh failed:\n{out.stdout}{out.stderr}"


def helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(HELM), *args], capture_output=True, text=True, timeout=120)


def render(values: Path | None, *sets: str) -> list[dict]:
    args = ["template", "rel", str(CHART), "--namespace", "serving"]
    if values is not None:
        args += ["-f", str(values)]
    for item in sets:
        args += ["--set", item]
    out = helm(*args)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def by_kind(objects: list[dict]) -> dict[str, list[dict]]:
    kinds: dict[str, list[dict]] = {}
    for obj in objects:
        kinds.setdefault(obj["kind"], []).append(obj)
    return kinds


def server_container(objects: list[dict]) -> dict:
    (deployment,) = by_kind(objects)["Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=lambda v: v.name if v else "defaults")
def test_lint_strict(values):
    out = helm("lint", str(CHART), "--strict", *(["-f", str(values)] if values else []))
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=lambda v: v.name if v else "defaults")
def test_every_rendered_object_is_valid(values, tmp_path):
    objects = render(values)
    builtin = [o for o in objects if o["kind"] not in CRD_KINDS]
    custom = [o for o in objects if o["kind"] in CRD_KINDS]
    (tmp_path / "builtin.yaml").write_text(yaml.safe_dump_all(builtin))
    for version in KUBERNETES_VERSIONS:
        out = subprocess.run([str(Path(sys.executable).with_name("kubernetes-validate")), "--strict", "-k", version,
                              str(tmp_path / "builtin.yaml")], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        assert out.stdout.count("passed for resource") == len(builtin), out.stdout
    if custom:
        (tmp_path / "custom.json").write_text(json.dumps(custom))
        out = subprocess.run(["node", str(ROOT / "tests/support/validate_crds.mjs"), str(TOOLS), str(tmp_path / "custom.json")],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        assert out.stdout.count("ok ") == len(custom)


def test_the_validators_can_say_no(tmp_path):
    """A wrong field in a built-in object and in a custom resource are caught, so the test above
    is worth something."""
    objects = render(ROOT / "deploy/helm/gpt2serve/ci/keda-values.yaml")
    kinds = by_kind(objects)
    deployment = kinds["Deployment"][0]
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pathh"] = "/readyz"
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(deployment))
    out = subprocess.run([str(Path(sys.executable).with_name("kubernetes-validate")), "--strict",
                          str(tmp_path / "bad.yaml")], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "pathh" in out.stdout + out.stderr
    scaled = kinds["ScaledObject"][0]
    scaled["spec"]["triggers"][0]["metadata"]["threshold"] = 4  # KEDA wants a string
    (tmp_path / "bad.json").write_text(json.dumps([scaled]))
    out = subprocess.run(["node", str(ROOT / "tests/support/validate_crds.mjs"), str(TOOLS), str(tmp_path / "bad.json")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "threshold must be string" in out.stdout


def test_defaults_render_the_serving_shape():
    objects = render(None)
    kinds = by_kind(objects)
    assert set(kinds) == {"Deployment", "Service", "PodDisruptionBudget"}
    deployment = kinds["Deployment"][0]
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxSurge": "100%", "maxUnavailable": 0}}
    pod = deployment["spec"]["template"]["spec"]
    container = server_container(objects)
    assert container["image"] == "gpt2serve:0.1.0-cpu"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert pod["securityContext"]["runAsNonRoot"] is True
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/dev/shm", "/tmp", "/models"} <= mounts
    (shm,) = [v for v in pod["volumes"] if v["name"] == "shm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    services = {s["metadata"]["name"]: s["spec"] for s in kinds["Service"]}
    assert services["rel-gpt2serve-grpc"]["clusterIP"] == "None"  # headless: per-call balancing
    assert [p["port"] for p in services["rel-gpt2serve-grpc"]["ports"]] == [50051]
    assert services["rel-gpt2serve"]["type"] == "ClusterIP"


def test_gpu_values_ask_for_a_gpu_on_gpu_nodes():
    objects = render(CHART / "ci/gpu-values.yaml")
    container = server_container(objects)
    pod = by_kind(objects)["Deployment"][0]["spec"]["template"]["spec"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["image"] == "gpt2serve:0.1.0"
    assert pod["runtimeClassName"] == "nvidia" and pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert env_of(container)["GPT2SERVE_DEVICE"] == "cuda"


def test_secrets_values_wire_tls_and_the_key():
    objects = render(CHART / "ci/secrets-values.yaml")
    container = server_container(objects)
    env = env_of(container)
    assert env["GPT2SERVE_API_KEY"] == {"secretKeyRef": {"name": "gpt2serve-api-key", "key": "key"}}
    assert env["GPT2SERVE_TLS_CERT"] == "/tls/tls.crt"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["scheme"] == "HTTPS", probe
    assert by_kind(objects)["ServiceMonitor"][0]["spec"]["endpoints"][0]["scheme"] == "https"


@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=lambda v: v.name if v else "defaults")
def test_probe_and_grace_timings_fit_together(values):
    """The pod leaves the endpoints (readiness fails at once when draining), the preStop sleep
    lets that spread, SIGTERM starts the drain, and the kubelet's SIGKILL comes only after the
    server's own grace; the startup probe allows a model load; liveness never probes /readyz."""
    objects = render(values)
    pod = by_kind(objects)["Deployment"][0]["spec"]["template"]["spec"]
    container = server_container(objects)
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    grace = float(env_of(container)["GPT2SERVE_SHUTDOWN_GRACE_S"])
    readiness, liveness, startup = (container[p] for p in ("readinessProbe", "livenessProbe", "startupProbe"))
    assert pod["terminationGracePeriodSeconds"] > pre_stop + grace
    assert readiness["httpGet"]["path"] == "/readyz" and startup["httpGet"]["path"] == "/readyz"
    assert liveness["httpGet"]["path"] == "/healthz"
    assert pre_stop >= readiness["periodSeconds"] * readiness["failureThreshold"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300  # gpt2-xl loads in minutes
    # Liveness may not kill a pod that is loading: it starts only after the startup probe passes,
    # and it tolerates a busy server for longer than one readiness period.
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > readiness["periodSeconds"]


def autoscaling_metric_names() -> set[str]:
    keda = by_kind(render(CHART / "ci/keda-values.yaml"))["ScaledObject"][0]
    query = keda["spec"]["triggers"][0]["metadata"]["query"]
    hpa = by_kind(render(CHART / "ci/hpa-values.yaml"))["HorizontalPodAutoscaler"][0]
    names = set(re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{", query))
    names.add(hpa["spec"]["metrics"][0]["external"]["metric"]["name"])
    return names


def test_autoscaling_queries_use_metrics_a_live_server_exports(tmp_path):
    names = autoscaling_metric_names()
    assert names == {"gpt2serve_requests_waiting"}
    srv = launch_server(tmp_path, "--model", "random:tiny", "--metrics-compat", "vllm")
    try:
        text = httpx.get(f"{srv.http_url}/metrics", timeout=10).text
    finally:
        srv.stop()
    exported = set(re.findall(r"^# TYPE (\S+) ", text, flags=re.MULTILINE))
    assert names <= exported
    assert {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"} <= exported


def test_the_autoscaling_query_over_live_replicas_gives_the_formulas_replica_count(tmp_path):
    """Three replicas with one KV-cache slot each, held busy: 3, 2 and 0 requests waiting. A real
    Prometheus scrapes them with the labels a ServiceMonitor gives (namespace, service), and the
    chart's own KEDA query sums to 5: KEDA and the HPA then ask for ceil(5 / target) replicas,
    within min and max."""
    keda = by_kind(render(CHART / "ci/keda-values.yaml"))["ScaledObject"][0]
    trigger = keda["spec"]["triggers"][0]["metadata"]
    hpa = by_kind(render(CHART / "ci/hpa-values.yaml"))["HorizontalPodAutoscaler"][0]["spec"]
    replicas = [launch_server(tmp_path, "--model", "random:gpt2", "--max-running-sequences", "1",
                              "--max-queue-wait-s", "120") for _ in range(3)]
    held, prometheus = [], None
    try:
        held = [HeldGenerations(r.grpc_target, running=1, waiting=w) for r, w in zip(replicas, (3, 2, 0))]
        prometheus = Prometheus(tmp_path, [r.http_url.removeprefix("http://") for r in replicas],
                                labels={"namespace": "serving", "service": "rel-gpt2serve"})
        wait_for(lambda: prometheus.scalar(trigger["query"]) == 5, 30, "the query never summed to 5")
        waiting = prometheus.scalar(trigger["query"])
        assert waiting == 5
        assert sum(metric_value(r.http_url, "gpt2serve_requests_waiting") for r in replicas) == 5

        def desired(total: float, target: float, low: int, high: int) -> int:
            return min(high, max(low, math.ceil(total / target)))  # KEDA AverageValue / HPA external

        assert desired(waiting, float(trigger["threshold"]), keda["spec"]["minReplicaCount"],
                       keda["spec"]["maxReplicaCount"]) == 2
        assert desired(waiting, float(hpa["metrics"][0]["external"]["target"]["averageValue"]),
                       hpa["minReplicas"], hpa["maxReplicas"]) == 2  # ceil(5 / 8) = 1, held at min 2
    finally:
        for group in held:
            group.close()
        if prometheus is not None:
            prometheus.stop()
        for replica in replicas:
            replica.stop()


def test_the_chart_readme_documents_every_value():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    readme = (CHART / "README.md").read_text()
    table = readme[readme.index("## Values"):]

    def leaves(tree: dict, prefix: str = ""):
        for key, value in tree.items():
            path = f"{prefix}{key}"
            if isinstance(value, dict) and value and key not in ("resources", "podSecurityContext", "securityContext"):
                yield from leaves(value, path + ".")
            else:
                yield path

    missing = [path for path in leaves(values)
               if f"`{path}`" not in table and f"`{path.rsplit('.', 1)[-1]}`" not in table]
    assert not missing, missing
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert set(schema["properties"]) == set(values)
