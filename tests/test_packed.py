"""The packed weight product (engine/packed.py) that every projection of a step goes through.

Invariant mode rests on its claim that a row's bits never depend on the batch: not on its size, on
the row's place in it, on the other rows, or on whether the product ran threaded. So every row of
batches of 1-33 rows, taken as slices, subsets, permutations and with repeats, is compared bit for
bit with the row multiplied alone, on shapes that reach every code path: a last block of fewer than
32 outputs, an input length that leaves a remainder after the four-wide steps, the one-row body and
the short groups that repeat their last row, and a weight large enough to run threaded. Values are
checked against float64 within the rounding bound of a sequential float32 sum.
"""
import numpy as np
import pytest

from refengine.engine import numerics, packed

# (out, in): tiny ones, out off a multiple of 32, in off a multiple of 4, and two above THREADED_BYTES.
SHAPES = [(1, 1), (3, 2), (31, 7), (32, 4), (33, 5), (48, 64), (100, 130), (1000, 96), (4100, 67), (8224, 40)]
ROWS = 33  # four groups of eight and a group of one


def _name(shape):
    return "{}x{}".format(*shape)


def _case(shape, seed=0):
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal(shape, dtype=np.float32)
    return weight, rng.standard_normal((ROWS, shape[1]), dtype=np.float32)


def _within_rounding(y, x, weight):
    """|y - exact| within the bound of a sequential float32 sum of K products: (K + 1) u sum |x w|."""
    exact = x.astype(np.float64) @ weight.T.astype(np.float64)
    bound = (weight.shape[1] + 1) * 2.0 ** -24 * (np.abs(x).astype(np.float64) @ np.abs(weight).T.astype(np.float64))
    return np.all(np.abs(y - exact) <= bound)


def test_the_large_shapes_run_threaded():
    """Otherwise the tests below would never exercise _product_threaded through matmul."""
    assert packed.pack(np.zeros((4100, 67), dtype=np.float32)).blocks.nbytes > packed.THREADED_BYTES
    assert packed.pack(np.zeros((8224, 40), dtype=np.float32)).blocks.nbytes > packed.THREADED_BYTES
    assert packed.pack(np.zeros((1000, 96), dtype=np.float32)).blocks.nbytes <= packed.THREADED_BYTES


@pytest.mark.parametrize("shape", SHAPES, ids=_name)
def test_a_rows_bits_do_not_depend_on_the_batch(shape):
    weight, x = _case(shape)
    w = packed.pack(weight)
    alone = np.concatenate([packed.matmul(x[i:i + 1], w) for i in range(ROWS)])
    assert _within_rounding(alone, x, weight)
    rng = np.random.default_rng(1)
    for n in range(1, ROWS + 1):
        lo = int(rng.integers(0, ROWS - n + 1))
        selections = [np.arange(n), np.arange(ROWS - n, ROWS), np.arange(lo, lo + n),
                      rng.permutation(ROWS)[:n],                       # a subset in shuffled order
                      rng.integers(0, ROWS, n)]                        # with repeated rows
        for ids in selections:
            y = packed.matmul(x[ids], w)
            assert y.shape == (n, shape[0]) and y.dtype == np.float32 and y.flags.c_contiguous
            assert y.tobytes() == alone[ids].tobytes(), (n, ids)


@pytest.mark.parametrize("shape", SHAPES, ids=_name)
def test_serial_and_threaded_products_give_the_same_bits(shape):
    weight, x = _case(shape, seed=2)
    blocks = packed.pack(weight).blocks
    width = blocks.shape[0] * packed.BLOCK
    for n in (1, 2, 7, 8, 9, 16, 33):
        serial = np.empty((n, width), dtype=np.float32)
        threaded = np.empty((n, width), dtype=np.float32)
        packed._product(x[:n], blocks, serial)
        packed._product_threaded(x[:n], blocks, threaded)
        assert np.array_equal(serial, threaded)
        assert not serial[:, shape[0]:].any()                             # the zero padding's outputs
        assert _within_rounding(serial[:, :shape[0]], x[:n], weight)


@pytest.mark.parametrize("shape", [(33, 5), (100, 130), (4100, 67)], ids=_name)
def test_pack_keeps_the_weight(shape):
    weight, _ = _case(shape)
    w = packed.pack(weight)
    assert (w.out_features, w.in_features) == shape
    assert w.blocks.shape == (-(-shape[0] // packed.BLOCK), shape[1], packed.BLOCK)
    assert np.array_equal(w.rows(np.arange(shape[0])), weight)
    ids = np.random.default_rng(3).integers(0, shape[0], 50)
    assert np.array_equal(w.rows(ids), weight[ids])
    assert not w.blocks[-1, :, shape[0] % packed.BLOCK or packed.BLOCK:].any()


@pytest.mark.parametrize("shape", [(31, 7), (100, 130), (8224, 40)], ids=_name)
def test_the_weights_memory_order_does_not_matter(shape):
    """Checkpoints hand over transposed views and Fortran-order arrays; pack copies them into blocks."""
    weight, x = _case(shape)
    expected = packed.matmul(x, packed.pack(weight))
    strided = np.zeros((2 * shape[0], 3 * shape[1]), dtype=np.float32)
    strided[::2, ::3] = weight
    for layout in (np.ascontiguousarray(weight.T).T, np.asfortranarray(weight), strided[::2, ::3]):
        assert not layout.flags.c_contiguous
        w = packed.pack(layout)
        assert w.blocks.flags.c_contiguous
        assert packed.matmul(x, w).tobytes() == expected.tobytes()


def test_the_inputs_memory_order_does_not_matter():
    weight, x = _case((100, 130))
    w = packed.pack(weight)
    expected = packed.matmul(x[::2], w)
    assert packed.matmul(np.asfortranarray(x[::2]), w).tobytes() == expected.tobytes()
    assert packed.matmul(np.ascontiguousarray(x)[::2], w).tobytes() == expected.tobytes()


def test_inputs_of_another_width_are_refused():
    """The compiled body indexes without bounds checks: a mismatch must not reach it."""
    w = packed.pack(_case((100, 130))[0])
    for x in (np.ones((4, 129), dtype=np.float32), np.ones((4, 131), dtype=np.float32), np.ones(130, dtype=np.float32)):
        with pytest.raises(ValueError, match="130 inputs"):
            packed.matmul(x, w)


@pytest.mark.parametrize("shape", [(3, 2), (8224, 40)], ids=_name)
def test_no_rows_give_no_rows(shape):
    y = packed.matmul(np.empty((0, shape[1]), dtype=np.float32), packed.pack(_case(shape)[0]))
    assert y.shape == (0, shape[0]) and y.dtype == np.float32


def test_the_start_up_probe_finds_the_kernels_invariant_here():
    """What an invariant-mode engine checks before it starts (numerics.require_invariant_kernels)."""
    assert numerics.invariant_kernels_hold()
    numerics.require_invariant_kernels()
    weight, x = _case((1000, 96))
    assert numerics.product_rows_are_independent(weight, x[:12])
