"""The docs: the generated tables match the code that defines them, the site builds with
`mkdocs build --strict` (a broken link, a missing anchor or a page left out of nav fails), and
the README stays a short front page that links every reference page."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_tables_are_fresh():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_docs.py"), "--check"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_site_builds_strictly(tmp_path):
    mkdocs = Path(sys.executable).with_name("mkdocs")
    done = subprocess.run([str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "generation" / "index.html").is_file()


def test_the_readme_is_a_front_page_that_links_every_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)\)", readme))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"index.md", "benchmarks-history.md"}
    assert pages <= linked, sorted(pages - linked)
    for page in linked:
        assert (ROOT / "docs" / page).is_file(), page


def test_bench_readme_names_every_script():
    """bench/README.md is the index of bench/'s folders: a script it does not name, by its path
    under bench/, is one nobody finds."""
    index = (ROOT / "bench" / "README.md").read_text()
    scripts = sorted(str(p.relative_to(ROOT / "bench")) for p in (ROOT / "bench").rglob("*")
                     if p.suffix in (".py", ".sh") and "__pycache__" not in p.parts)
    assert len([s for s in scripts if "/" in s]) > 30, "the scripts' folders were not searched"
    assert [path for path in scripts if f"`{path}`" not in index] == []


def test_no_page_links_to_itself():
    """A link to the page it is on takes the reader nowhere: a section of it is linked by its anchor."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = [f"{page.name}: {match.group(0)}" for page in pages
             for match in re.finditer(rf"\]\((?:\./)?{re.escape(page.name)}\)", page.read_text())]
    assert found == []
