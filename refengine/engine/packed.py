"""The step's weight products: a few rows against weights stored for them, compiled (engine/jit.py).

A decode step multiplies 1-32 rows by every weight of the model. OpenBLAS's sgemm does poorly with so
few rows: it re-packs the weight on every call, and its microkernel wants more rows. Here each
weight is packed once, at load, into blocks of 32 outputs, [out/32, in, 32] (`pack`). A block
streams from memory contiguously while the rows of the step pass over it, their accumulators in
vector registers, so each weight is read from memory once per step.

Why a row's result cannot depend on the batch (the guarantee invariant mode needs, here by
construction): every output element is one chain of fused multiply-adds over the input index, in
order, starting from zero:

    y[r, o] = fma(x[r, K-1], w[o, K-1], ... fma(x[r, 1], w[o, 1], fma(x[r, 0], w[o, 0], 0)))

Outputs go in blocks of 32, split between threads. A single row runs a one-row body over four
blocks at once; two to four rows a four-row body over two blocks (two weight streams per thread
read memory faster than one); more rows go in groups of eight per block, a last group of one in
the one-row body, a smaller last group repeating its last row. None of this changes any element's
chain. The rows of a group are separate chains (the same instructions on
other registers). Vector lanes are separate outputs. No chain is split or reordered, and every step
is an explicit fma (jit.py). tests/test_packed.py checks every row of batches of 1-33 rows, at every
position, threaded and not, against the row alone and against float64.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import prange

from .jit import fma, jit

BLOCK = 32  # outputs per block: two 512-bit vectors per row
# Below this many weight bytes a product runs on the calling thread: a second thread cannot pay for
# its wake-up there, and when every core is busy (a test run on all cores) the wake-up can cost a
# whole scheduler slice.
THREADED_BYTES = 1 << 20


@dataclass(frozen=True)
class PackedWeight:
    """A weight [out, in] as blocks [ceil(out / BLOCK), in, BLOCK], the last block zero-padded."""
    blocks: np.ndarray
    out_features: int

    @property
    def in_features(self) -> int:
        return self.blocks.shape[1]

    def rows(self, ids) -> np.ndarray:
        """Rows `ids` of the original [out, in] weight (a tied embedding's lookup). -> [len(ids), in]"""
        ids = np.asarray(ids)
        return self.blocks[ids // BLOCK, :, ids % BLOCK]


def pack(weight: np.ndarray) -> PackedWeight:
    """[out, in] in any memory order -> PackedWeight (float32, its own memory)."""
    out_features, in_features = weight.shape
    num_blocks = -(-out_features // BLOCK)
    blocks = np.zeros((num_blocks, in_features, BLOCK), dtype=np.float32)
    for b in range(num_blocks):  # one block at a time: no temporary the size of the weight
        part = weight[b * BLOCK:(b + 1) * BLOCK]
        blocks[b, :, :len(part)] = part.T
    return PackedWeight(blocks, out_features)


def matmul(x: np.ndarray, weight: PackedWeight) -> np.ndarray:
    """x [rows, in] @ weight.T -> [rows, out] float32, C order."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    blocks = weight.blocks
    out = np.empty((x.shape[0], blocks.shape[0] * BLOCK), dtype=np.float32)
    if x.shape[0]:
        (_product_threaded if blocks.nbytes > THREADED_BYTES else _product)(x, blocks, out)
    return out if out.shape[1] == weight.out_features else np.ascontiguousarray(out[:, :weight.out_features])


@jit
def _block(x, blocks, out, b):
    """Output block b of every row: the chains of the module docstring, eight rows at a time (sixteen
    accumulators: enough independent chains to keep both fma units busy)."""
    rows, size = x.shape
    whole = size - size % 4
    for r0 in range(0, rows, 8):
        if rows - r0 == 1:
            _one_row_blocks(x, blocks, out, b, 1, r0)
            continue
        last = rows - 1
        r1, r2, r3 = min(r0 + 1, last), min(r0 + 2, last), min(r0 + 3, last)
        r4, r5, r6, r7 = min(r0 + 4, last), min(r0 + 5, last), min(r0 + 6, last), min(r0 + 7, last)
        acc = np.zeros((8, BLOCK), dtype=np.float32)
        for i in range(0, whole, 4):
            i1, i2, i3 = i + 1, i + 2, i + 3
            for o in range(BLOCK):
                w0, w1, w2, w3 = blocks[b, i, o], blocks[b, i1, o], blocks[b, i2, o], blocks[b, i3, o]
                acc[0, o] = fma(x[r0, i3], w3, fma(x[r0, i2], w2, fma(x[r0, i1], w1, fma(x[r0, i], w0, acc[0, o]))))
                acc[1, o] = fma(x[r1, i3], w3, fma(x[r1, i2], w2, fma(x[r1, i1], w1, fma(x[r1, i], w0, acc[1, o]))))
                acc[2, o] = fma(x[r2, i3], w3, fma(x[r2, i2], w2, fma(x[r2, i1], w1, fma(x[r2, i], w0, acc[2, o]))))
                acc[3, o] = fma(x[r3, i3], w3, fma(x[r3, i2], w2, fma(x[r3, i1], w1, fma(x[r3, i], w0, acc[3, o]))))
                acc[4, o] = fma(x[r4, i3], w3, fma(x[r4, i2], w2, fma(x[r4, i1], w1, fma(x[r4, i], w0, acc[4, o]))))
                acc[5, o] = fma(x[r5, i3], w3, fma(x[r5, i2], w2, fma(x[r5, i1], w1, fma(x[r5, i], w0, acc[5, o]))))
                acc[6, o] = fma(x[r6, i3], w3, fma(x[r6, i2], w2, fma(x[r6, i1], w1, fma(x[r6, i], w0, acc[6, o]))))
                acc[7, o] = fma(x[r7, i3], w3, fma(x[r7, i2], w2, fma(x[r7, i1], w1, fma(x[r7, i], w0, acc[7, o]))))
        for i in range(whole, size):
            for o in range(BLOCK):
                w = blocks[b, i, o]
                acc[0, o] = fma(x[r0, i], w, acc[0, o])
                acc[1, o] = fma(x[r1, i], w, acc[1, o])
                acc[2, o] = fma(x[r2, i], w, acc[2, o])
                acc[3, o] = fma(x[r3, i], w, acc[3, o])
                acc[4, o] = fma(x[r4, i], w, acc[4, o])
                acc[5, o] = fma(x[r5, i], w, acc[5, o])
                acc[6, o] = fma(x[r6, i], w, acc[6, o])
                acc[7, o] = fma(x[r7, i], w, acc[7, o])
        for rr in range(min(8, rows - r0)):
            for o in range(BLOCK):
                out[r0 + rr, b * BLOCK + o] = acc[rr, o]


@jit
def _one_row_blocks(x, blocks, out, b, count, r):
    """Row r's part of output blocks b..b+count-1 (count <= 4): the same chains as _block's, for one
    row; up to four blocks at once, for eight independent chains."""
    size = x.shape[1]
    whole = size - size % 4
    b1, b2, b3 = b + min(1, count - 1), b + min(2, count - 1), b + min(3, count - 1)
    blocks0, blocks1, blocks2, blocks3 = blocks[b], blocks[b1], blocks[b2], blocks[b3]
    acc = np.zeros((4, BLOCK), dtype=np.float32)
    for i in range(0, whole, 4):
        x0, x1, x2, x3 = x[r, i], x[r, i + 1], x[r, i + 2], x[r, i + 3]
        i1, i2, i3 = i + 1, i + 2, i + 3
        for o in range(BLOCK):
            acc[0, o] = fma(x3, blocks0[i3, o], fma(x2, blocks0[i2, o],
                                                    fma(x1, blocks0[i1, o], fma(x0, blocks0[i, o], acc[0, o]))))
            acc[1, o] = fma(x3, blocks1[i3, o], fma(x2, blocks1[i2, o],
                                                    fma(x1, blocks1[i1, o], fma(x0, blocks1[i, o], acc[1, o]))))
            acc[2, o] = fma(x3, blocks2[i3, o], fma(x2, blocks2[i2, o],
                                                    fma(x1, blocks2[i1, o], fma(x0, blocks2[i, o], acc[2, o]))))
            acc[3, o] = fma(x3, blocks3[i3, o], fma(x2, blocks3[i2, o],
                                                    fma(x1, blocks3[i1, o], fma(x0, blocks3[i, o], acc[3, o]))))
    for i in range(whole, size):
        for o in range(BLOCK):
            acc[0, o] = fma(x[r, i], blocks0[i, o], acc[0, o])
            acc[1, o] = fma(x[r, i], blocks1[i, o], acc[1, o])
            acc[2, o] = fma(x[r, i], blocks2[i, o], acc[2, o])
            acc[3, o] = fma(x[r, i], blocks3[i, o], acc[3, o])
    for j in range(count):
        for o in range(BLOCK):
            out[r, (b + j) * BLOCK + o] = acc[j, o]


@jit
def _four_rows_two_blocks(x, blocks, out, b, count):
    """Rows 0..3 of x (fewer repeat the last) for output blocks b..b+count-1 (count <= 2): the same
    chains as _block's, two blocks at once -- two weight streams per thread, which a batch of two to
    four rows needs to read memory as fast as a single row does."""
    size, last = x.shape[1], x.shape[0] - 1
    whole = size - size % 4
    r1, r2, r3 = min(1, last), min(2, last), min(3, last)
    blocks0, blocks1 = blocks[b], blocks[b + count - 1]
    acc = np.zeros((8, BLOCK), dtype=np.float32)  # [block * 4 + row, o]
    for i in range(0, whole, 4):
        i1, i2, i3 = i + 1, i + 2, i + 3
        for o in range(BLOCK):
            for j in range(2):
                w = blocks0 if j == 0 else blocks1
                w0, w1, w2, w3 = w[i, o], w[i1, o], w[i2, o], w[i3, o]
                acc[4 * j, o] = fma(x[0, i3], w3, fma(x[0, i2], w2, fma(x[0, i1], w1, fma(x[0, i], w0, acc[4 * j, o]))))
                acc[4 * j + 1, o] = fma(x[r1, i3], w3, fma(x[r1, i2], w2,
                                                   fma(x[r1, i1], w1, fma(x[r1, i], w0, acc[4 * j + 1, o]))))
                acc[4 * j + 2, o] = fma(x[r2, i3], w3, fma(x[r2, i2], w2,
                                                   fma(x[r2, i1], w1, fma(x[r2, i], w0, acc[4 * j + 2, o]))))
                acc[4 * j + 3, o] = fma(x[r3, i3], w3, fma(x[r3, i2], w2,
                                                   fma(x[r3, i1], w1, fma(x[r3, i], w0, acc[4 * j + 3, o]))))
    for i in range(whole, size):
        for o in range(BLOCK):
            for j in range(2):
                w = blocks0[i, o] if j == 0 else blocks1[i, o]
                acc[4 * j, o] = fma(x[0, i], w, acc[4 * j, o])
                acc[4 * j + 1, o] = fma(x[r1, i], w, acc[4 * j + 1, o])
                acc[4 * j + 2, o] = fma(x[r2, i], w, acc[4 * j + 2, o])
                acc[4 * j + 3, o] = fma(x[r3, i], w, acc[4 * j + 3, o])
    for j in range(count):
        for r in range(last + 1):
            for o in range(BLOCK):
                out[r, (b + j) * BLOCK + o] = acc[4 * j + r, o]


@jit
def _task(x, blocks, out, t):
    """Task t of a product: for a single row, output blocks 4t..4t+3; for two to four rows, blocks
    2t, 2t+1; else output block t of every row."""
    if x.shape[0] == 1:
        _one_row_blocks(x, blocks, out, 4 * t, min(4, blocks.shape[0] - 4 * t), 0)
    elif x.shape[0] <= 4:
        _four_rows_two_blocks(x, blocks, out, 2 * t, min(2, blocks.shape[0] - 2 * t))
    else:
        _block(x, blocks, out, t)


@jit
def _product(x, blocks, out):
    for t in range(_tasks(x, blocks)):
        _task(x, blocks, out, t)


@jit(parallel=True)
def _product_threaded(x, blocks, out):
    for t in prange(_tasks(x, blocks)):
        _task(x, blocks, out, t)


@jit
def _tasks(x, blocks):
    if x.shape[0] == 1:
        return (blocks.shape[0] + 3) // 4
    return (blocks.shape[0] + 1) // 2 if x.shape[0] <= 4 else blocks.shape[0]
