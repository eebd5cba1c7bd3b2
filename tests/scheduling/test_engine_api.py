"""The engine interface the core declares (scheduling/engine_api.py) is the one it uses: every
member of the generator that the core and its runner touch is declared there,
and nothing is declared that they do not touch."""

from __future__ import annotations

import ast
from pathlib import Path

SCHEDULING = Path(__file__).resolve().parents[2] / "server" / "gpt2serve" / "scheduling"
USERS = ("core.py", "runner.py")
HOLDERS = {"generator": "ModelRunner"}  # a name or self.<name> -> its Protocol


def declared(source: str) -> dict[str, set[str]]:
    """Protocol name -> the members it declares (attributes, properties and methods)."""
    members = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef):
            members[node.name] = {item.target.id if isinstance(item, ast.AnnAssign) else item.name
                                  for item in node.body if isinstance(item, (ast.AnnAssign, ast.FunctionDef))}
    return members


def used(sources: list[str]) -> dict[str, set[str]]:
    """Protocol name -> the members read or called on `generator` or `self.generator` in these modules."""
    found: dict[str, set[str]] = {protocol: set() for protocol in HOLDERS.values()}
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.Attribute):
                continue
            holder = node.value
            if isinstance(holder, ast.Attribute) and isinstance(holder.value, ast.Name) and holder.value.id == "self":
                name = holder.attr
            elif isinstance(holder, ast.Name):
                name = holder.id
            else:
                continue
            if name in HOLDERS:
                found[HOLDERS[name]].add(node.attr)
    return found


def sources() -> list[str]:
    return [(SCHEDULING / name).read_text() for name in USERS]


def test_the_core_uses_what_engine_api_declares_and_nothing_else():
    members = declared((SCHEDULING / "engine_api.py").read_text())
    for protocol, touched in used(sources()).items():
        assert touched == members[protocol], (
            f"{protocol}: used but not declared {sorted(touched - members[protocol])}, "
            f"declared but not used {sorted(members[protocol] - touched)}")


def test_an_undeclared_call_is_found():
    """The check can fail: a runner that reaches into the generator's queue of chunks."""
    members = declared((SCHEDULING / "engine_api.py").read_text())
    reaching = sources() + ["def step(self):\n    self.generator.chunked.popleft()\n"]
    touched = used(reaching)["ModelRunner"]
    assert touched - members["ModelRunner"] == {"chunked"}
