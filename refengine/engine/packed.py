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

One loop body (`_chains`) computes such chains for a few rows over a few blocks at once. Outputs go
in blocks of 32, split between threads. With 512-bit vectors a single row runs over four blocks at
once, two to four rows over two blocks (several weight streams per thread read memory faster than
one), and more rows go in groups of eight per block (narrower vectors: GROUP, ONE_ROW_BLOCKS); a last
group of one runs alone, a smaller last group repeats its last row. None of this changes any
element's chain. The rows and blocks of a body are separate chains (the same instructions on other
registers), vector lanes are separate outputs, and every step is one fma per lane (llvm.fma: one
rounding). No chain is split or reordered. tests/test_packed.py checks every row of batches of 1-33
rows, at every position, threaded and not, against the row alone and against float64.

The body is LLVM IR, so that its accumulators stay in registers (engine/ir.py says why numba's do
not). Why it prefetches: a thread reading one block from memory waits on each cache line, far below
the bandwidth that several streams get. So each step prefetches AHEAD input positions ahead in every
block it reads; and where a batch's rows take several passes over a block, each pass fetches its
share of the thread's next block instead. Past a thread's first block every pass then reads from
cache, and memory is read at one pace through all of them, not in bursts that the bandwidth cannot
meet (docs/performance/ has the measurement).
benchmarks/test_bench_kernels.py measures the products against numpy's BLAS.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import prange, types
from numba.extending import intrinsic

from .ir import LANES, ZERO, Emitter, float32_arrays, tuples
from .jit import WIDE_VECTORS, jit

BLOCK = 32  # outputs per block: two 512-bit vectors per row
# A body's accumulators must fit the vector registers, with room for the weights it reads: up to
# sixteen 512-bit vectors of 32 (eight rows of a block, four rows of two blocks; a row of four blocks
# takes eight), or eight 256-bit ones of 16 (two rows of a block, a row of two blocks).
# tests/test_packed.py checks that a narrower CPU's build gives the same bits.
GROUP = 8 if WIDE_VECTORS else 2
ONE_ROW_BLOCKS = 4 if WIDE_VECTORS else 2
AHEAD = 32  # input positions the prefetch runs ahead in a block's stream (4 KB)
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
    if x.ndim != 2 or x.shape[1] != blocks.shape[1]:  # the compiled body reads x's rows without bounds
        raise ValueError(f"packed.matmul: x of shape {x.shape} against a weight of {blocks.shape[1]} inputs")
    out = np.empty((x.shape[0], blocks.shape[0] * BLOCK), dtype=np.float32)
    if x.shape[0]:
        (_product_threaded if blocks.nbytes > THREADED_BYTES else _product)(x, blocks, out)
    return out if out.shape[1] == weight.out_features else np.ascontiguousarray(out[:, :weight.out_features])


@intrinsic
def _chains(typingctx, x, blocks, out, rows, count, block_ids, nblocks, prefetch_at, prefetch_step):
    """out[rows[k], block_ids[j] * BLOCK:(block_ids[j] + 1) * BLOCK] for k < count and j < nblocks: the
    chains of the module docstring, len(rows) * len(block_ids) * BLOCK / LANES accumulators, each a
    vector value in a register. Step i also prefetches, in every block it reads, the two cache lines
    at prefetch_at + i * prefetch_step floats from that block's start. x, blocks and out: float32, C
    order; rows and block_ids: tuples of indices (a short group repeats its last)."""
    if not (float32_arrays(x, blocks, out) and tuples(rows, block_ids)):
        return None

    def codegen(context, builder, signature, args):
        e = Emitter(context, builder, signature, args)
        (xs, (_, size)), (bs, _), (outs, (_, width)) = e.array(0), e.array(1), e.array(2)
        row_ids, count, ids, nblocks = e.indices(3), e.index(4), e.indices(5), e.index(6)
        prefetch_at, prefetch_step = e.index(7), e.index(8)
        halves = BLOCK // LANES
        starts = [e.at(bs, e.mul(b, size, e.const(BLOCK))) for b in ids]  # [in, BLOCK] each
        x_rows = [e.at(xs, e.mul(r, size)) for r in row_ids]

        def step(i, acc):
            weights = []                                                   # [block][half] of input row i
            for start in starts:
                row = e.at(start, e.mul(i, e.const(BLOCK)))
                weights.append([e.load(e.at(row, e.const(h * LANES))) for h in range(halves)])
                ahead = e.at(start, e.add(prefetch_at, e.mul(i, prefetch_step)))
                for h in range(halves):
                    e.prefetch(e.at(ahead, e.const(h * LANES)))
            stepped = []
            for x_row in x_rows:
                xi = e.splat(builder.load(e.at(x_row, i), align=4))
                for block in weights:
                    for w in block:
                        stepped.append(e.fma(xi, w, acc[len(stepped)]))
            return stepped

        results = e.loop(e.const(0), size, [ZERO] * (len(x_rows) * len(starts) * halves), step)
        k = 0
        for n, r in enumerate(row_ids):
            for j, b in enumerate(ids):
                with e.when(builder.and_(e.below(e.const(n), count), e.below(e.const(j), nblocks))):
                    dest = e.at(outs, e.add(e.mul(r, width), e.mul(b, e.const(BLOCK))))
                    for h in range(halves):
                        e.store(results[k + h], e.at(dest, e.const(h * LANES)))
                k += halves
        return context.get_dummy_value()
    return types.void(x, blocks, out, rows, count, block_ids, nblocks, prefetch_at, prefetch_step), codegen


@jit
def _groups(x, blocks, out, b):
    """Output block b of every row, GROUP rows at a time. In one pass, the block streams from memory,
    prefetched AHEAD positions ahead; in several, pass g fetches the g-th of `passes` shares of block
    b + 1 (the thread's next task: prange hands each thread a contiguous range of tasks)."""
    rows, size = x.shape
    last = rows - 1
    passes = -(-rows // GROUP)
    share = -(-BLOCK // passes)  # floats of the next block a step fetches: the passes cover its size * BLOCK
    for r0 in range(0, rows, GROUP):
        group = r0 // GROUP
        if passes > 1 and b + 1 < blocks.shape[0]:
            prefetch_at, prefetch_step = size * BLOCK + group * size * share, share
        elif group == 0:
            prefetch_at, prefetch_step = AHEAD * BLOCK, BLOCK
        else:
            prefetch_at, prefetch_step = 0, 0
        if r0 == last:
            _chains(x, blocks, out, (r0,), 1, (b,), 1, prefetch_at, prefetch_step)
        elif WIDE_VECTORS:
            _chains(x, blocks, out, (r0, min(r0 + 1, last), min(r0 + 2, last), min(r0 + 3, last),
                                     min(r0 + 4, last), min(r0 + 5, last), min(r0 + 6, last), min(r0 + 7, last)),
                    rows - r0, (b,), 1, prefetch_at, prefetch_step)
        else:
            _chains(x, blocks, out, (r0, r0 + 1), 2, (b,), 1, prefetch_at, prefetch_step)


@jit
def _task(x, blocks, out, t):
    """Task t of a product: for a single row, output blocks ONE_ROW_BLOCKS * t onwards; for two to
    four rows on wide vectors, blocks 2t and 2t + 1; else output block t of every row."""
    rows, last = x.shape[0], blocks.shape[0] - 1
    if rows == 1:
        b = ONE_ROW_BLOCKS * t
        if WIDE_VECTORS:
            ids = (b, min(b + 1, last), min(b + 2, last), min(b + 3, last))
            _chains(x, blocks, out, (0,), 1, ids, last + 1 - b, AHEAD * BLOCK, BLOCK)
        else:
            _chains(x, blocks, out, (0,), 1, (b, min(b + 1, last)), last + 1 - b, AHEAD * BLOCK, BLOCK)
    elif WIDE_VECTORS and rows <= 4:
        b, r = 2 * t, rows - 1
        _chains(x, blocks, out, (0, min(1, r), min(2, r), min(3, r)), rows, (b, min(b + 1, last)), last + 1 - b,
                AHEAD * BLOCK, BLOCK)
    else:
        _groups(x, blocks, out, t)


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
        return -(-blocks.shape[0] // ONE_ROW_BLOCKS)
    return (blocks.shape[0] + 1) // 2 if WIDE_VECTORS and x.shape[0] <= 4 else blocks.shape[0]
