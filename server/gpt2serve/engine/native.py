"""Compiled CPU ops (native_ops.cpp): int8 Linears and decode attention, one call each.

Why: a decode step at one row is mostly small torch ops, not arithmetic. An int8 Linear was 11
ops around fbgemm's GEMM, about 50 us of a 90 us call; attention over the KV cache went through
the flash kernel, which reads every position of the padded span (GPT-2 small, 2 cores, AVX-512,
2026-11-25: a one-row step went from 7.6 to 5.6 ms with the fused Linear alone).

How: built on first use with the machine's C++ compiler (`$CXX`, else `c++`) against the
installed torch's headers, and cached under `$XDG_CACHE_HOME/gpt2serve` (default ~/.cache), keyed
by this source, torch's version and the flags, so a machine compiles it once (about 10 s), and
processes starting together do not trip over each other (each writes its own file, then renames).
Where nothing can be compiled (no compiler, a read-only cache) the ops are absent and the callers
keep their torch ops (the same numbers to a few units in the last place; a warning says so once).
"""

from __future__ import annotations

import functools
import hashlib
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


def _compile_command(compiler: str, output: Path) -> list[str]:
    from torch.utils import cpp_extension

    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    includes = [f"-isystem{path}" for path in cpp_extension.include_paths()]
    libraries = [f"-L{path}" for path in cpp_extension.library_paths()]
    return [compiler, *FLAGS, abi, *includes, str(SOURCE), "-o", str(output), *libraries, "-lc10", "-ltorch_cpu"]


def _build() -> Path:
    compiler = os.environ.get("CXX") or "c++"
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler ({compiler})")
    key = hashlib.sha256(SOURCE.read_bytes() + f"{torch.__version__} {compiler} {FLAGS}".encode()).hexdigest()[:16]
    library = _cache_dir() / f"native_ops-{key}.so"
    if not library.exists():
        library.parent.mkdir(parents=True, exist_ok=True)
        partial = library.with_name(f"{library.name}.{os.getpid()}.partial")
        log.info("compiling gpt2serve's CPU ops (once per machine, about 10 s): %s", library)
        done = subprocess.run(_compile_command(compiler, partial), capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            partial.unlink(missing_ok=True)
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
        os.replace(partial, library)  # atomic: another process sees the whole file or none
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
