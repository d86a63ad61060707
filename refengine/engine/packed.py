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

Why the body is LLVM IR written here rather than a numba loop: a numba body's accumulators live in
an array, which LLVM cannot keep in registers across the input loop (the inputs might alias it), so
that body loaded and stored every accumulator at every step. Why it prefetches: a thread reading one block from
memory waits on each cache line, far below the bandwidth that several streams get. So each step
prefetches AHEAD input positions ahead in every block it reads; and where a batch's rows take several
passes over a block (the later ones from cache), the second and third passes fetch the thread's next
block instead, so that its first pass need not wait for memory.
benchmarks/test_bench_kernels.py measures the products against numpy's BLAS.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .jit import WIDE_VECTORS, jit

BLOCK = 32  # outputs per block: two 512-bit vectors per row
LANES = 16  # float32 lanes of a 512-bit vector; on a narrower CPU LLVM splits each vector (same bits)
# A body's accumulators must fit the vector registers, with room for the weights it reads: up to
# sixteen 512-bit vectors of 32 (eight rows of a block, four rows of two blocks; a row of four blocks
# takes eight), or eight 256-bit ones of 16 (two rows of a block, a row of two blocks).
# tests/test_packed.py checks that a narrower CPU's build gives the same bits.
GROUP = 8 if WIDE_VECTORS else 2
ONE_ROW_BLOCKS = 4 if WIDE_VECTORS else 2
AHEAD = 32  # input positions the prefetch runs ahead in a block's stream (4 KB)
LINE = 16   # floats per 64-byte cache line
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
    arrays = (x, blocks, out)
    if not (all(isinstance(a, types.Array) and a.dtype == types.float32 and a.layout == "C" for a in arrays)
            and isinstance(rows, types.BaseTuple) and isinstance(block_ids, types.BaseTuple)):
        return None

    def codegen(context, builder, signature, args):
        intp = context.get_value_type(types.intp)
        i32, i8p = ir.IntType(32), ir.IntType(8).as_pointer()
        vec = ir.VectorType(ir.FloatType(), LANES)
        halves = BLOCK // LANES

        def index(k):
            return context.cast(builder, args[k], signature.args[k], types.intp)

        def indices(k):
            values = cgutils.unpack_tuple(builder, args[k])
            return [context.cast(builder, v, t, types.intp) for v, t in zip(values, signature.args[k])]

        def const(v):
            return ir.Constant(intp, v)

        def at(pointer, offset):
            return builder.gep(pointer, [offset])

        def vector(pointer):
            return builder.bitcast(pointer, vec.as_pointer())

        xa, ba, oa = (context.make_array(t)(context, builder, a) for t, a in zip(signature.args[:3], args[:3]))
        row_ids, count, ids, nblocks = indices(3), index(4), indices(5), index(6)
        prefetch_at, prefetch_step = index(7), index(8)
        size = cgutils.unpack_tuple(builder, xa.shape)[1]
        width = cgutils.unpack_tuple(builder, oa.shape)[1]
        starts = [at(ba.data, builder.mul(builder.mul(b, size), const(BLOCK))) for b in ids]  # [in, BLOCK] each
        x_rows = [at(xa.data, builder.mul(r, size)) for r in row_ids]
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [vec] * 3), f"llvm.fma.v{LANES}f32")
        prefetch = builder.module.declare_intrinsic(  # named as numba names its own (llvm.memcpy's)
            "llvm.prefetch", [i8p], ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]))
        zero, undef = ir.Constant(vec, [0.0] * LANES), ir.Constant(vec, ir.Undefined)
        broadcast = ir.Constant(ir.VectorType(i32, LANES), [0] * LANES)

        entry = builder.basic_block
        loop, done = builder.append_basic_block("chains.step"), builder.append_basic_block("chains.done")
        builder.cbranch(builder.icmp_signed(">", size, const(0)), loop, done)
        builder.position_at_end(loop)
        i = builder.phi(intp)                                      # the input index
        acc = [builder.phi(vec) for _ in range(len(x_rows) * len(starts) * halves)]
        weights = []                                               # [block][half] of input row i
        for start in starts:
            row = at(start, builder.mul(i, const(BLOCK)))
            weights.append([builder.load(vector(at(row, const(h * LANES))), align=4) for h in range(halves)])
            ahead = at(start, builder.add(prefetch_at, builder.mul(i, prefetch_step)))
            for h in range(halves):  # read, keep in every cache level (llvm.prefetch's arguments)
                builder.call(prefetch, [builder.bitcast(at(ahead, const(h * LANES)), i8p), i32(0), i32(3), i32(1)])
        stepped = []
        for x_row in x_rows:
            scalar = builder.insert_element(undef, builder.load(at(x_row, i), align=4), i32(0))
            xi = builder.shuffle_vector(scalar, undef, broadcast)
            for block in weights:
                for w in block:
                    stepped.append(builder.call(fma, [xi, w, acc[len(stepped)]]))
        following = builder.add(i, const(1))
        i.add_incoming(const(0), entry)
        i.add_incoming(following, loop)
        for a, s in zip(acc, stepped):
            a.add_incoming(zero, entry)
            a.add_incoming(s, loop)
        builder.cbranch(builder.icmp_signed("<", following, size), loop, done)

        builder.position_at_end(done)
        results = []
        for s in stepped:
            results.append(builder.phi(vec))
            results[-1].add_incoming(zero, entry)
            results[-1].add_incoming(s, loop)
        k = 0
        for n, r in enumerate(row_ids):
            for j, b in enumerate(ids):
                wanted = builder.and_(builder.icmp_signed("<", const(n), count),
                                      builder.icmp_signed("<", const(j), nblocks))
                with builder.if_then(wanted):
                    dest = at(oa.data, builder.add(builder.mul(r, width), builder.mul(b, const(BLOCK))))
                    for h in range(halves):
                        builder.store(results[k + h], vector(at(dest, const(h * LANES))), align=4)
                k += halves
        return context.get_dummy_value()
    return types.void(x, blocks, out, rows, count, block_ids, nblocks, prefetch_at, prefetch_step), codegen


@jit
def _groups(x, blocks, out, b):
    """Output block b of every row, GROUP rows at a time. The first group reads the block from memory,
    prefetching ahead in it; the second and third read it from cache and fetch block b + 1, half
    each: the thread's next task, since prange hands each thread a contiguous range of tasks."""
    rows, size = x.shape
    last = rows - 1
    for r0 in range(0, rows, GROUP):
        group = r0 // GROUP
        if group == 0:
            prefetch_at, prefetch_step = AHEAD * BLOCK, BLOCK
        elif group <= BLOCK // LINE and b + 1 < blocks.shape[0]:  # a line a step: a block's lines in two passes
            prefetch_at, prefetch_step = size * BLOCK + (group - 1) * size * LINE, LINE
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
