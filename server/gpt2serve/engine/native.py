"""Compiled CPU ops (native_ops.cpp): int8 Linears and decode attention, one call each.

Why: a decode step at one row is mostly small torch ops, not arithmetic. An int8 Linear was 11
ops around fbgemm's GEMM, about 50 us of a 90 us call; attention over the KV cache went through
the flash kernel, which reads every position of the padded span (GPT-2 small, 2 cores, AVX-512,
2026-11-25: a one-row step went from 7.6 to 5.6 ms with the fused Linear alone).

How: built on first use with the machine's C++ compiler (`$CXX`, else `c++`) against the
installed torch's headers, and cached under `$XDG_CACHE_HOME/gpt2serve` (default ~/.cache), keyed
by this source, the flags, torch's version (and its git commit) and the compiler's own version
line, so a machine compiles it once (about 10 s), a new torch or compiler builds it again (a
library built against another torch's headers can crash, not fail), and processes starting
together do not trip over each other (each writes its own file, then renames). Beside each
library, a JSON file records what it was built with; the log says so when it loads.
Where nothing can be compiled (no compiler, a read-only cache) the ops are absent and the callers
keep their torch ops (the same numbers to a few units in the last place; a warning says so once).

The ops check every argument before forming a pointer into it; `SANITIZED_FLAGS` builds them
with AddressSanitizer and libstdc++'s assertions for the test tier that fuzzes them
(tests/engine/test_native_sanitized.py).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native_ops.cpp")
FLAGS = ("-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off")  # OpenMP: torch's own libgomp at run time


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpt2serve"


# AddressSanitizer (any read or write outside a buffer aborts with a report) and libstdc++'s
# bounds assertions; -O1 keeps the reports' lines exact.
SANITIZED_FLAGS = (*(f for f in FLAGS if f != "-O3"), "-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address",
                   "-D_GLIBCXX_ASSERTIONS")


def _compile_command(compiler: str, output: Path, flags: tuple[str, ...] = FLAGS) -> list[str]:
    from torch.utils import cpp_extension

    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    includes = [f"-isystem{path}" for path in cpp_extension.include_paths()]
    libraries = [f"-L{path}" for path in cpp_extension.library_paths()]
    return [compiler, *flags, abi, *includes, str(SOURCE), "-o", str(output), *libraries, "-lc10", "-ltorch_cpu"]


def build_info(name: str) -> dict[str, str]:
    """What a build is made with, all of which the library's name is keyed by."""
    version = subprocess.run([name, "--version"], capture_output=True, text=True, timeout=60)
    lines = (version.stdout or version.stderr).strip().splitlines() or ["(no version)"]
    return {"compiler": name, "compiler_version": lines[0],
            "torch": torch.__version__, "torch_git": torch.version.git_version}


def compiler() -> str:
    """The C++ compiler builds use (`$CXX`, else `c++`); RuntimeError where there is none."""
    name = os.environ.get("CXX") or "c++"
    if shutil.which(name) is None:
        raise RuntimeError(f"no C++ compiler ({name})")
    return name


def compile_ops(output: Path, flags: tuple[str, ...] = FLAGS, name: str | None = None) -> None:
    """Build the ops into `output` with compiler `name` (default: compiler()), written whole or
    not at all."""
    name = name or compiler()
    partial = output.with_name(f"{output.name}.{os.getpid()}.partial")
    done = subprocess.run(_compile_command(name, partial, flags), capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"{name} failed: {done.stderr.strip()[-2000:]}")
    os.replace(partial, output)  # atomic: another process sees the whole file or none


def _build() -> Path:
    info = build_info(compiler())
    key = hashlib.sha256(SOURCE.read_bytes() + json.dumps([info, FLAGS], sort_keys=True).encode()).hexdigest()[:16]
    library = _cache_dir() / f"native_ops-{key}.so"
    if not library.exists():
        library.parent.mkdir(parents=True, exist_ok=True)
        log.info("compiling gpt2serve's CPU ops (once per machine, about 10 s): %s", library)
        compile_ops(library, name=info["compiler"])
        record = library.with_suffix(".json")
        partial = record.with_name(f"{record.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps(info, indent=1) + "\n")
        os.replace(partial, record)
    log.info("gpt2serve's CPU ops: %s (built with %s, torch %s)", library.name, info["compiler_version"],
             info["torch"])
    return library


@functools.cache
def available() -> bool:
    """Whether torch.ops.gpt2serve's ops are loaded (built on the first call in a process)."""
    try:
        torch.ops.load_library(str(_build()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("gpt2serve's compiled CPU ops are unavailable, so int8 Linears and decode attention "
                    "use torch ops (slower at a few rows, the same results): %s", exc)
        return False
    return True
