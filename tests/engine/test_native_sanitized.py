"""engine.native's ops never read or write outside their buffers, whatever they are called with:
built with AddressSanitizer and libstdc++'s assertions (native.SANITIZED_FLAGS), and fuzzed by
hypothesis over shapes, positions, dtypes and argument mistakes (native_fuzz.py) in a child
process that preloads the sanitizer's runtime. A canary first shows that this harness does
catch an overflow: a test that cannot fail proves nothing.

Before the checks in native_ops.cpp ran ahead of every pointer, this found decode_attention
reading `positions` past its end (a heap-buffer-overflow) within a few hundred calls.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpt2serve.engine import native

pytestmark = pytest.mark.sanitize
FUZZ = Path(__file__).with_name("native_fuzz.py")
CANARY = """
#include <stdlib.h>
int read_past_the_end(int n) { int* a = malloc(sizeof(int) * n); int v = a[n]; free(a); return v; }
"""


def _runtime(name: str) -> str:
    path = subprocess.run([native.compiler(), f"-print-file-name={name}"], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert os.path.isabs(path), f"the compiler has no {name} (its sanitizer runtime)"
    return path


@pytest.fixture(scope="module")
def sanitized_env() -> dict[str, str]:
    """A child's environment with AddressSanitizer's runtime loaded first (Python itself is not
    built with it), and leak reports off (the interpreter keeps its objects at exit)."""
    return {**os.environ, "LD_PRELOAD": f"{_runtime('libasan.so')} {_runtime('libstdc++.so')}",
            "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0:halt_on_error=1"}


def test_the_harness_catches_an_overflow(tmp_path, sanitized_env):
    source, library = tmp_path / "canary.c", tmp_path / "canary.so"
    source.write_text(CANARY)
    subprocess.run(["cc", "-shared", "-fPIC", "-g", "-fsanitize=address", str(source), "-o", str(library)], check=True)
    call = f"import ctypes; ctypes.CDLL({str(library)!r}).read_past_the_end(8)"
    done = subprocess.run([sys.executable, "-c", call], capture_output=True, text=True, timeout=120,
                          env=sanitized_env)
    assert done.returncode != 0 and "heap-buffer-overflow" in done.stderr, done.stderr[-2000:]


def test_the_ops_stay_inside_their_buffers_under_a_fuzz(tmp_path, sanitized_env):
    library = tmp_path / "native_ops_sanitized.so"
    native.compile_ops(library, native.SANITIZED_FLAGS)
    done = subprocess.run([sys.executable, str(FUZZ), str(library), "400"], capture_output=True, text=True,
                          timeout=900, env=sanitized_env)
    assert done.returncode == 0 and "AddressSanitizer" not in done.stderr, done.stderr[-4000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    # Both ops were really exercised, with calls they must answer and calls they must refuse.
    assert all(counts[kind] >= 40 for kind in ("attention_ok", "attention_refused", "linear_ok", "linear_refused")), counts
