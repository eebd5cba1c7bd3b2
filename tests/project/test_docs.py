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
    """bench/README.md is the drawer's index: a script it does not name is one nobody finds."""
    index = (ROOT / "bench" / "README.md").read_text()
    scripts = sorted(p.name for p in (ROOT / "bench").iterdir() if p.suffix in (".py", ".sh"))
    assert scripts, "no scripts found: the check would pass on nothing"
    assert [name for name in scripts if f"`{name}`" not in index] == []
