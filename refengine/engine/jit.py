"""How the engine's compiled kernels (packed.py, paged_attention.py, kernels.py, exp.py, fused.py) are
compiled: numba, for this CPU, with IEEE arithmetic exactly as written -- no fastmath flag, so no sum
is reordered and no multiply and add are fused behind the code's back. Where a kernel wants an fma
it says `fma(a, b, c)`, one rounding, on every path (packed.py's loop body, written as LLVM IR, calls
llvm.fma itself). (Left to the compiler, fusion depends on the context a function is inlined into:
a product it can prove used twice stays unfused there, and that row gets other bits.)
Compiled code is cached on disk, so only the first process on a machine compiles: in numba's cache,
under a folder named by a digest of this package's sources (cache_folder). numba checks a cached
function against its own file only, and kernels call kernels of other files (fused.py calls them
all, every kernel calls exp.py): left to numba, editing exp.py would leave the old exp inside every
cached caller. A new digest is a fresh cache.

LLVM's tuning for recent Intel cores prefers 256-bit vectors even where the CPU has 512-bit ones.
The packed product is compute-bound from about 16 rows, where wider vectors do twice the work per
instruction, so unless the caller chose features (NUMBA_CPU_FEATURES) the host's features are used
without that preference.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numba
from numba import types
from numba.core import config
from numba.extending import intrinsic

from ..model.cache import cache_dir


def cache_folder() -> str:
    """Where numba caches the kernels: NUMBA_CACHE_DIR (default: refengine's cache, `numba/`), then a
    digest of every source file of this package, so that no cached kernel outlives an edit of a
    kernel it calls."""
    digest = hashlib.sha256()
    for source in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return os.path.join(config.CACHE_DIR or cache_dir() / "numba", digest.hexdigest()[:16])


config.CACHE_DIR = cache_folder()  # before any kernel is decorated: numba picks the folder then
if config.CPU_FEATURES is None:
    import llvmlite.binding as llvm

    config.CPU_FEATURES = llvm.get_host_cpu_features().flatten() + ",-prefer-256-bit"
# Whether the kernels are compiled for 512-bit vectors, and so 32 vector registers: packed.py sizes its
# loop bodies to the registers there are.
WIDE_VECTORS = "+avx512f" in config.CPU_FEATURES.split(",")

OPTIONS = {"cache": True, "nogil": True, "error_model": "numpy"}


def compiler_identity() -> dict:
    """What the compiled kernels' bits can depend on besides their source: numba's and LLVM's
    versions and the CPU features compiled for."""
    import llvmlite

    return {"numba": numba.__version__, "llvmlite": llvmlite.__version__, "cpu_features": config.CPU_FEATURES}


def jit(function=None, *, parallel: bool = False):
    """numba.njit with OPTIONS; `parallel` for a kernel whose outer loop is a prange. A parallel
    kernel is called from Python only, never from another compiled function: numba loads such a
    caller from its cache broken (a segfault on the first threaded call; numba issue 8578), which
    fusing a layer's kernels into one call ran into (docs/performance/)."""
    decorate = numba.njit(parallel=parallel, **OPTIONS)
    return decorate if function is None else decorate(function)


@intrinsic
def fma(typingctx, a, b, c):
    """a * b + c rounded once (LLVM's fma: one instruction where the CPU has it). float32 or float64."""
    if not (isinstance(a, types.Float) and a == b == c):
        return None

    def codegen(context, builder, signature, args):
        return builder.fma(*args)
    return a(a, b, c), codegen
