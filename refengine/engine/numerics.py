"""What the engine's float results depend on beyond its own sources: the BLAS numpy multiplies with
(library, version, the CPU kernel it picked at load time, threads), and whether that BLAS keeps the
assumption invariant mode rests on -- a row of a 16-row tile gets the same bits wherever it sits in
the tile and whatever its neighbours hold (kernels.TILE_ROWS).
"""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_info

from ..errors import RefengineError
from .kernels import SMALL_WEIGHT_BYTES, TILE_ROWS, linear_invariant

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


def tile_rows_are_independent(weight, x, orders) -> bool:
    """The tile assumption, checked: for every order (a list of row indices into x), each row of
    linear_invariant(x[order], weight) has exactly the bits of that row multiplied alone (a tile of its
    own, at position 0, padded with zeros) -- wherever the order puts it in its tile, and whatever the
    rows around it hold."""
    alone = np.concatenate([linear_invariant(x[i:i + 1], weight) for i in range(len(x))])
    return all(np.array_equal(linear_invariant(x[np.asarray(order)], weight), alone[np.asarray(order)])
               for order in orders)


# One weight multiplied on one thread (below kernels.SMALL_WEIGHT_BYTES) and one above it, which OpenBLAS
# may split between threads, as it does the engine's real projections.
PROBE_SHAPES = ((48, 64), (1088, 256))


@functools.cache  # once per process: engines are built by the hundred in a test run
def tile_assumption_holds() -> bool:
    """tile_rows_are_independent on small fixed data: 3 rows repeated to fill a tile, so each row sits at
    every third position next to copies of the other two, then (on the one-thread weight) over a second
    tile beside padding. Few gemms on the larger weight: a threaded gemm takes 0.2 ms with a core free,
    a whole scheduler slice (8 ms) when every core is busy."""
    rng = np.random.default_rng(0)
    rows = np.arange(3)
    orders = (np.resize(rows, TILE_ROWS), np.resize(np.roll(rows, 1), TILE_ROWS + 1))
    for out_features, in_features in PROBE_SHAPES:
        weight = rng.standard_normal((out_features, in_features), dtype=np.float32)
        x = rng.standard_normal((len(rows), in_features), dtype=np.float32)
        if not tile_rows_are_independent(weight, x, orders if weight.nbytes <= SMALL_WEIGHT_BYTES else orders[:1]):
            return False
    return True


def require_tile_assumption() -> None:
    """Refuse invariant mode where this BLAS would silently lose bit-exactness."""
    if not tile_assumption_holds():
        raise RefengineError(
            f"mode: invariant needs the BLAS to compute each row of a {TILE_ROWS}-row tile independently of "
            f"its position and neighbours, and {describe_blas(blas_identity())} does not (batched runs would "
            "not be bit-identical to serial ones); mode 'fast' still works")
