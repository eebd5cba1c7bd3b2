"""The command-line examples in README.md and docs/ are what the commands print today: each is run
against `random:gpt2` by scripts/gen_examples.py and compared (timings masked). And the check can
fail: an example whose output was edited is named stale."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gen_examples.py"


def check(*files: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--check", *map(str, files)], capture_output=True, text=True,
                          timeout=900, cwd=ROOT)


def test_the_examples_in_the_docs_are_what_the_commands_print():
    done = check()
    assert done.returncode == 0, done.stdout + done.stderr
    pages = [p for p in (ROOT / "README.md", *(ROOT / "docs").glob("*.md")) if "<!-- example: " in p.read_text()]
    assert {p.name for p in pages} >= {"README.md", "api.md", "generation.md"}


def test_an_edited_example_is_found_stale(tmp_path):
    page = tmp_path / "page.md"
    text = (ROOT / "README.md").read_text()
    start = text.index("<!-- example: gpt2serve next")
    edited = text[:start] + text[start:].replace("prompt tokens: [464, 3139, 286, 4881, 318]",
                                                  "prompt tokens: [464, 3139, 286, 4881, 319]", 1)
    assert edited != text
    page.write_text(edited)
    done = check(page)
    assert done.returncode == 1 and 'stale: page.md: gpt2serve next "The capital of France is"' in done.stdout
    page.write_text(text[:start] + text[start:].replace("forward ", "forward 1", 1))  # a timing alone: not stale
    assert check(page).returncode == 0
