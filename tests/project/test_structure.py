"""The package's shape, as the contributing notes describe it: layers that import only downwards
and no import cycles (import-linter, contracts in pyproject.toml), a small package root, module
names that say one job each, modules of a readable size, and telemetry as the one place that
names span attributes and moves metrics."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "server" / "gpt2serve"
# import-linter's command, run by this interpreter: its script sits beside the venv's python, not
# beside the machine's python3 where the packages are on PYTHONPATH (a GPU machine's wheels).
LINT_IMPORTS = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                "sys.argv[0] = 'lint-imports'; sys.exit(lint_imports_command())"]
# Modules allowed past ~400 lines, each with its reason. None today.
LONG_MODULES: dict[str, str] = {}


def lint_imports(pythonpath: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{pythonpath}{os.pathsep}{ROOT / 'client'}"}
    return subprocess.run([*LINT_IMPORTS, "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_import_contracts_are_kept():
    result = lint_imports(ROOT / "server")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 kept, 0 broken" in result.stdout


def lint_with_lines_added(tmp_path: Path, module: str, lines: str) -> subprocess.CompletedProcess:
    """lint_imports on a copy of the package with `lines` added at the end of `module` (a path in it)."""
    copy = tmp_path / "gpt2serve"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    changed = copy / module
    changed.write_text(changed.read_text() + lines)
    return lint_imports(tmp_path)


def test_an_upward_import_breaks_the_layers_contract(tmp_path):
    """The contract can fail: the engine importing the service (even only for type checking) does."""
    result = lint_with_lines_added(tmp_path, "engine/kv_cache.py", "\nfrom typing import TYPE_CHECKING\n"
                                   "if TYPE_CHECKING:\n    from ..service.inference import InferenceService\n")
    assert result.returncode != 0
    assert "gpt2serve.engine.kv_cache -> gpt2serve.service.inference" in result.stdout


def test_an_opentelemetry_import_on_the_engine_side_breaks_its_contract(tmp_path):
    """The engine side tells telemetry in records: a request carrying an OpenTelemetry object
    (as RequestOptions' parent Context once did) would pull the library into the engine."""
    result = lint_with_lines_added(tmp_path, "telemetry/records.py", "\nfrom opentelemetry.context import Context\n")
    assert result.returncode != 0
    assert "gpt2serve.engine is not allowed to import opentelemetry" in result.stdout
    assert "gpt2serve.engine.steps -> gpt2serve.telemetry.records" in result.stdout  # the chain named


def test_the_package_root_holds_at_most_six_modules():
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert modules == ["__init__.py", "__main__.py", "cli.py", "config.py", "config_env.py", "errors.py"]  # protocol/: a package


def test_no_two_modules_share_a_name():
    stems = Counter(p.stem for p in PACKAGE.rglob("*.py") if p.stem != "__init__")
    assert [stem for stem, n in stems.items() if n > 1] == []


def test_modules_stay_readable_in_size():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert set(long) <= set(LONG_MODULES), long


# Calls that write telemetry: spans' API, and prometheus_client's on a `metrics` attribute's metric.
SPAN_WRITES = {"set_attribute", "set_attributes", "set_status", "add_event", "record_exception", "start_span",
               "start_as_current_span"}
METRIC_WRITES = {"inc", "dec", "set", "observe", "labels"}


def telemetry_writes_in(source: str) -> list[str]:
    """Each span write, and each write to a metric reached through a `metrics` attribute, in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        name, owner = node.func.attr, node.func.value
        through_metrics = isinstance(owner, ast.Attribute) and isinstance(owner.value, ast.Attribute) \
            and owner.value.attr == "metrics"
        if name in SPAN_WRITES or (name in METRIC_WRITES and through_metrics):
            found.append(f"line {node.lineno}: {ast.unparse(node.func)}")
    return found


def test_telemetry_names_every_span_attribute_and_moves_every_metric():
    """The service tells telemetry what happened (RequestTelemetry.prefix_cache_hit, prompts_scored,
    ...) and telemetry names the attributes; nothing outside telemetry/ writes a span or a metric."""
    writes = {str(p.relative_to(PACKAGE)): found for p in PACKAGE.rglob("*.py")
              if p.relative_to(PACKAGE).parts[0] != "telemetry" and (found := telemetry_writes_in(p.read_text()))}
    assert writes == {}


def test_the_telemetry_writes_check_finds_what_it_looks_for():
    """The check can fail: the service's old hand-set attribute and the supervisor's old gauge write are found."""
    assert telemetry_writes_in('request.span.set_attribute("gen_ai.request.top_k", k)\n'
                               'self.metrics.front_ends_up.set(2)\n'
                               'self.stop.set()\n') == [
        "line 1: request.span.set_attribute", "line 2: self.metrics.front_ends_up.set"]
