"""Whether the BLAS numpy multiplies with (refengine.blas) keeps the assumption invariant mode rests
on: a row of a 16-row tile gets the same bits wherever it sits in the tile and whatever its
neighbours hold (kernels.TILE_ROWS). Probed once per process before an invariant engine is built.
"""
from __future__ import annotations

import functools

import numpy as np

from ..blas import blas_identity, describe_blas
from ..errors import RefengineError
from .kernels import SMALL_WEIGHT_BYTES, TILE_ROWS, linear_invariant


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
