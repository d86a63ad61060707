"""The BLAS numpy multiplies with, as threadpoolctl reports it: library, version, the CPU kernel it
picked at load time, threads. Float results depend on it (calibration cache keys, golden headers and
`refengine info` record it); engine.numerics probes whether invariant mode's assumption holds on it.
"""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_info

# Fields of blas_identity() a result can depend on; `threads` is left out: it changes under
# OPENBLAS_NUM_THREADS / threadpool_limits, and OpenBLAS splits a gemm between threads over output rows
# and columns, never over the reduction.
NUMERICS_FIELDS = ("internal_api", "name", "version", "architecture")


def _numpy_blas(libraries: list[dict]) -> dict | None:
    """Of the BLAS libraries loaded in this process, the one numpy links: the one inside numpy's own
    folders (numpy.libs, numpy/.dylibs) when several are loaded (torch brings its own), else the only one."""
    blas = [lib for lib in libraries if lib.get("user_api") == "blas"]
    numpy_dir = str(Path(np.__file__).parent)
    own = [lib for lib in blas if str(lib.get("filepath", "")).startswith(numpy_dir)]
    return (own or blas or [None])[0]


def blas_identity() -> dict:
    """The BLAS numpy uses, as a JSON-able dict: internal_api ("openblas", "mkl", ...), name (the library's
    file prefix), version, architecture (the CPU kernel OpenBLAS or BLIS picked; None for MKL) and threads.
    Values are None where threadpoolctl finds no BLAS (a numpy built against an unsupported one)."""
    lib = _numpy_blas(threadpool_info()) or {}
    return {"internal_api": lib.get("internal_api"), "name": lib.get("prefix"), "version": lib.get("version"),
            "architecture": lib.get("architecture"), "threads": lib.get("num_threads")}


@functools.cache  # the library numpy loaded does not change under a running process
def blas_numerics() -> dict:
    """blas_identity() without the thread count: the part calibration cache keys record."""
    identity = blas_identity()
    return {key: identity[key] for key in NUMERICS_FIELDS}


def describe_blas(identity: dict) -> str:
    """One line for messages: "openblas 0.3.31 (libscipy_openblas, kernel SkylakeX, 2 threads)"."""
    if identity.get("internal_api") is None:
        return "an unidentified BLAS (threadpoolctl found none loaded by numpy)"
    details = [identity.get("name")]
    if identity.get("architecture"):
        details.append(f"kernel {identity['architecture']}")
    if identity.get("threads") is not None:
        details.append(f"{identity['threads']} threads")
    return f"{identity['internal_api']} {identity.get('version')} ({', '.join(d for d in details if d)})"
