"""No import circle outside the server package, whose contracts import-linter keeps
(test_structure.py): the client package, and the script folders (bench/*, scripts/), where a
script imports its neighbours by name. Imports inside functions count: a circle closed lazily
still ties the modules into one, and is only found when the last of them runs."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def modules(root: Path) -> dict[str, Path]:
    """Name -> file: the client package by dotted name; a script as "folder:name"."""
    found = {}
    for path in (root / "client").rglob("*.py"):
        if "_proto" in path.parts:  # generated
            continue
        parts = list(path.relative_to(root / "client").with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for folder in ("bench", "scripts"):
        for path in (root / folder).rglob("*.py"):
            found[f"{path.parent.relative_to(root)}:{path.stem}"] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The known modules that `name` imports, anywhere in it."""
    folder = name.split(":")[0] if ":" in name else None
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level and folder:
                continue
            if node.level:  # relative: from the importing module's package, up level - 1
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module
            submodules = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known]
            targets = submodules or [base]  # `from . import x` of a module imports x, not a circle back
        else:
            continue
        for target in targets:
            local = f"{folder}:{target.split('.')[0]}" if folder else None
            if local in known:
                found.add(local)
            elif target in known and target != name:
                found.add(target)
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected parts of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            part = []
            while (top := stack.pop()) != node:
                part.append(top)
            if part:
                found.append(sorted([node, *part]))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    known = modules(root)
    return {name: imported(name, path, known) for name, path in known.items()}


def test_no_import_circle_in_the_client_or_the_scripts():
    assert circles(import_graph(ROOT)) == []


def test_a_circle_closed_inside_a_function_is_found(tmp_path):
    """The check can fail: two scripts that import each other, one of them lazily."""
    (tmp_path / "client" / "pkg").mkdir(parents=True)
    (tmp_path / "client" / "pkg" / "__init__.py").write_text("from . import a\n")
    (tmp_path / "client" / "pkg" / "a.py").write_text("from . import b\n")
    (tmp_path / "client" / "pkg" / "b.py").write_text("def later():\n    from .a import thing\n")
    (tmp_path / "bench" / "tools").mkdir(parents=True)
    (tmp_path / "bench" / "tools" / "one.py").write_text("import two\n")
    (tmp_path / "bench" / "tools" / "two.py").write_text("def later():\n    from one import thing\n")
    (tmp_path / "bench" / "tools" / "three.py").write_text("import one\nimport json\n")
    (tmp_path / "scripts").mkdir()
    assert sorted(circles(import_graph(tmp_path))) == [["bench/tools:one", "bench/tools:two"],
                                                       ["pkg.a", "pkg.b"]]
