"""Float32 building blocks of the batched forward: norms, rotary embedding and the SwiGLU product
(compiled, jit.py: numpy spent more time per call than the arithmetic), softmax, and fast mode's
attention for a prefill chunk. Row-wise norms, exp and elementwise ops give a row the same bits
whatever rows share the call. attend_fast does not: its masked product sums zeros for future keys,
so a row's bits depend on the chunk it was computed in. The weight products and the paged
attention are compiled too (packed.py, paged_attention.py).
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ..sampling import greedy_token, top2_margin
from .exp import exp32
from .faults import Fault
from .ir import I32, LANES, Emitter, float32_arrays
from .jit import jit


def rms_norm(x, weight, eps):  # x [..., dim] -> the same shape, C order
    rows = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
    out = np.empty_like(rows)
    _rms_norm_rows(rows, weight, np.float32(eps), out)
    return out.reshape(x.shape)


@jit
def _rms_norm_rows(x, weight, eps, out):
    """Each row alone: its sum of squares in float64 (more accurate than a float32 sum), as sixteen
    partial sums (i mod 16) added in one fixed order (_sum_of_squares) -- the same for every row, and
    no other row can reach it."""
    rows, dim = x.shape
    for r in range(rows):
        inverse = np.float32(1) / np.float32(np.sqrt(np.float32(_sum_of_squares(x, r) / dim) + eps))
        for i in range(dim):
            out[r, i] = x[r, i] * inverse * weight[i]


@intrinsic
def _sum_of_squares(typingctx, x, row):
    """The float64 sum of the squares of x[row] (float32, C order): element i goes to partial sum i mod
    LANES, each partial sum in order of i from zero, and the partial sums are added in lane order, from
    zero. The partial sums are one vector in registers (ir.py); a row's tail is a masked load, whose
    zero lanes add +0 to sums that are +0 or more (a square is never negative), which leaves them as
    they are."""
    if not (float32_arrays(x) and x.ndim == 2):
        return None

    def codegen(context, builder, signature, args):
        e = Emitter(context, builder, signature, args)
        xs, (_, dim) = e.array(0)
        start = e.at(xs, e.mul(e.index(1), dim))
        wide = ir.VectorType(ir.DoubleType(), LANES)

        def squared(vector):
            v = builder.fpext(vector, wide)
            return builder.fmul(v, v)

        whole = e.mul(builder.sdiv(dim, e.const(LANES)), e.const(LANES))
        zero = ir.Constant(wide, [0.0] * LANES)
        sums = e.loop(e.const(0), builder.sdiv(dim, e.const(LANES)), [zero],
                      lambda i, s: [builder.fadd(s[0], squared(e.load(e.at(start, e.mul(i, e.const(LANES))))))])[0]
        sums = builder.fadd(sums, squared(e.load(e.at(start, whole), e.mask(builder.sub(dim, whole)))))
        total = ir.Constant(ir.DoubleType(), 0.0)
        for lane in range(LANES):
            total = builder.fadd(total, builder.extract_element(sums, I32(lane)))
        return total
    return types.float64(x, row), codegen


def silu_mul(gate_up):  # [rows, 2 * width] -> silu(gate) * up, [rows, width] C order
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = np.empty((rows, width), dtype=np.float32)
    _silu_mul(np.ascontiguousarray(gate_up, dtype=np.float32), out)
    return out


@jit
def _silu_mul(gate_up, out):
    width = out.shape[1]
    for r in range(out.shape[0]):
        for i in range(width):
            gate = gate_up[r, i]
            # exp(-gate) overflows to inf for very negative gates, and gate / inf = -0 is right
            out[r, i] = gate / (np.float32(1) + exp32(-gate)) * gate_up[r, width + i]


@functools.cache  # read-only tables, shared by every engine with the same three numbers
def rope_tables(max_positions, head_dim, theta):  # -> cos, sin [max_positions, head_dim] float32
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.outer(np.arange(max_positions, dtype=np.float64), inv_freq)
    angles = np.concatenate([angles, angles], axis=-1)
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    cos.flags.writeable = sin.flags.writeable = False
    return cos, sin


def apply_rope(x, cos, sin):  # x [tokens, heads, head_dim]; cos, sin [tokens, head_dim] -> like x, C order
    out = np.empty(x.shape, dtype=np.float32)
    _rope(np.ascontiguousarray(x, dtype=np.float32), cos, sin, out)
    return out


@jit
def _rope(x, cos, sin, out):
    """x * cos + rotate_half(x) * sin, where rotate_half([a, b]) = [-b, a] (the tables hold each angle twice)."""
    tokens, heads, dim = x.shape
    half = dim // 2
    for t in range(tokens):
        for h in range(heads):
            for i in range(half):
                a, b = x[t, h, i], x[t, h, i + half]
                out[t, h, i] = a * cos[t, i] - b * sin[t, i]
                out[t, h, i + half] = b * cos[t, i + half] + a * sin[t, i + half]


SMALL_VOCAB = 4096  # rows up to this wide go through one compiled pass (top2 says why)


def top2(rows):
    """Each row's greedy token and top-2 margin, [rows] each: sampling.greedy_token's and
    sampling.top2_margin's, for a whole step's rows. The token is the first maximum, a nan counting as
    one (np.argmax's rule); the margin is its logit minus the best of the other ids, nan where either
    is nan. A maximum is exact, so no row can depend on the others. A tiny model's rows take one
    compiled call (a numpy call per operation cost more than its forward); a real vocabulary's rows
    go through those two functions themselves, whose vectorized numpy passes are several times
    faster there than the compiled loop (tests/test_kernels.py holds both paths to the rules)."""
    if rows.shape[1] <= SMALL_VOCAB:
        return _top2_rows(rows)
    return (np.array([greedy_token(row) for row in rows], dtype=np.int64),
            np.array([top2_margin(row) for row in rows], dtype=rows.dtype))


@jit
def _top2_rows(rows):
    count, width = rows.shape
    best = np.empty(count, dtype=np.int64)
    margins = np.empty(count, dtype=rows.dtype)
    for r in range(count):
        b = 0
        for j in range(1, width):
            if np.isnan(rows[r, b]):
                break
            if np.isnan(rows[r, j]) or rows[r, j] > rows[r, b]:
                b = j
        second = -np.inf
        for j in range(width):
            if j != b:
                if np.isnan(rows[r, j]):
                    second = np.nan
                    break
                second = max(second, rows[r, j])
        best[r] = b
        margins[r] = rows[r, b] - second  # in float64, then float32: float32's own difference (53 >= 2*24+2 bits)
    return best, margins


def softmax_rows(scores):  # in place
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return scores


def _softmax_rows_exp2_without_log2e(scores):
    """Fault.ATTENTION_BOUND_INFLATING: the exp2 form of the softmax (exp(s) = exp2(s * log2 e), as fused
    attention kernels write it) with the log2(e) factor dropped: exp2(s) = exp(s * ln 2), so every score
    counts ln 2 = 0.69 times what it should -- attention too flat, the same in every batch."""
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp2(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return scores


def attend_fast(q, k, v, start, scale, softmax=softmax_rows):
    """q [n, H, D] at positions start..start+n-1; k, v [start+n, KVH, D]. -> [n, H*D]

    All queries of the chunk in one batched product per kv head, future keys masked."""
    n, num_heads, head_dim = q.shape
    num_kv_heads, context = k.shape[1], k.shape[0]
    group = num_heads // num_kv_heads
    q_grouped = q.reshape(n, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3)   # [KVH, G, n, D]
    scores = q_grouped @ k.transpose(1, 2, 0)[:, None]                           # [KVH, G, n, ctx]
    scores *= np.float32(scale)
    if n > 1:
        future = np.arange(context)[None, :] > start + np.arange(n)[:, None]      # [n, ctx]
        scores = np.where(future, np.float32(-np.inf), scores)
    out = softmax(scores) @ v.transpose(1, 0, 2)[:, None]                         # [KVH, G, n, D]
    return out.transpose(2, 0, 1, 3).reshape(n, num_heads * head_dim)


class Attention(NamedTuple):
    """A mode's attention: `flatten` for paged_attention.attend, and fast mode's attend for a prefill
    chunk, `chunk(q, k, v, start, scale)` (None in invariant mode, where every row is paged)."""
    flatten: float
    chunk: Callable | None


def attention(invariant: bool, fault: Fault | None = None) -> Attention:
    """The attention of a mode, with Fault.ATTENTION_BOUND_INFLATING's softmax where that fault is
    injected: exponents scaled by ln 2 in the paged kernel, the exp2 softmax in attend_fast. The one
    code point of that fault."""
    if fault is not Fault.ATTENTION_BOUND_INFLATING:
        return Attention(1.0, None if invariant else attend_fast)
    return Attention(float(np.log(2)), None if invariant else (
        lambda q, k, v, start, scale: attend_fast(q, k, v, start, scale, softmax=_softmax_rows_exp2_without_log2e)))
