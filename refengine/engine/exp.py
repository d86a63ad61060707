"""exp for the compiled float32 kernels (SwiGLU's sigmoid, attention's softmax), in a form LLVM
vectorizes.

numba turns math.exp into a call to the C library's expf, one value at a time, which no loop can
vectorize: SwiGLU and the softmax spent most of their time in those calls (docs/performance/).
This one is branch-free arithmetic, so a loop calling it runs 8 values per instruction, computed in
float64 and rounded to float32 once:

    exp(x) = 2^n * exp(r),  n = round(x / ln 2),  r = x - n ln 2,  |r| <= ln(2) / 2

exp(r) by its Taylor series to r^10 (truncation below 3e-13 relative, against float32's 6e-8
half-ulp), 2^n written straight into a float64's exponent bits. x is clamped to [-104, 89] first:
below, the float32 result is 0 either way; above, it is inf either way. NaN passes through.
Every value is correctly rounded but where exp(x) lies within ~1e-12 of a float32 rounding
boundary (tests/test_exp.py). Each value depends on its own x only, so it cannot bring batch
dependence into a kernel.
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .jit import jit

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
LOWEST, HIGHEST = -104.0, 89.0  # exp(-104) < 2^-150 rounds to 0 in float32; exp(89) > 2^128 is inf
C = tuple(1.0 / math.factorial(k) for k in range(11))


@intrinsic
def _float64_with_bits(typingctx, bits):
    """The float64 whose IEEE bits are the int64 `bits` (a bitcast: no conversion)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.DoubleType())
    return types.float64(types.int64), codegen


@jit
def exp32(x):
    """exp of a float32, as a float32 (module docstring)."""
    v = np.float64(x)
    clamped = min(max(v, LOWEST), HIGHEST)
    n = np.floor(clamped * LOG2E + 0.5)
    r = clamped - n * LN2
    p = C[0] + r * (C[1] + r * (C[2] + r * (C[3] + r * (C[4] + r * (C[5] + r * (C[6] + r * (
        C[7] + r * (C[8] + r * (C[9] + r * C[10])))))))))
    result = np.float32(p * _float64_with_bits((np.int64(n) + 1023) << 52))
    return result if v == v else x
