"""What the loop bodies written as LLVM IR share (packed._chains, paged_attention._scores and _values,
kernels._sum_of_squares).

Why IR rather than numba loops: numba keeps a loop's accumulators in an array, and LLVM cannot hold
an array in registers across a loop that also reads other arrays (they might alias it). Such a loop
loads and stores every accumulator at every step, and a chain that runs through that store waits on
it at every step. Here an accumulator is a vector value (a phi of `loop`), in a register for the
whole loop.

Every body computes fma chains: at each step, one llvm.fma per lane (one rounding), in an order its
kernel's docstring gives. A vector is LANES float32 lanes. Where a vector would run past the end of
a row, a mask keeps its loads and stores inside it (llvm.masked.load/store: a masked-off lane is
neither read nor written; a masked-off load lane is zero).
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils

LANES = 16  # float32 lanes of a 512-bit vector; on a narrower CPU LLVM splits each vector (same bits)
I32 = ir.IntType(32)
VECTOR = ir.VectorType(ir.FloatType(), LANES)
MASK = ir.VectorType(ir.IntType(1), LANES)
ZERO = ir.Constant(VECTOR, [0.0] * LANES)


def float32_arrays(*arrays) -> bool:
    """Whether each numba type is a C-order float32 array: what a body reads and writes by pointer."""
    return all(isinstance(a, types.Array) and a.dtype == types.float32 and a.layout == "C" for a in arrays)


def tuples(*values) -> bool:
    """Whether each numba type is a tuple (of the indices a body unrolls over)."""
    return all(isinstance(v, types.BaseTuple) for v in values)


class Emitter:
    """An intrinsic's codegen arguments, with the few IR idioms the bodies are written in."""

    def __init__(self, context, builder, signature, args):
        self.context, self.builder, self.signature, self.args = context, builder, signature, args
        self.intp = context.get_value_type(types.intp)
        module = builder.module
        self._fma = cgutils.get_or_insert_function(module, ir.FunctionType(VECTOR, [VECTOR] * 3),
                                                   f"llvm.fma.v{LANES}f32")
        # Typed-pointer names, as numba names its own intrinsics; LLVMs with opaque pointers upgrade them.
        vector_pointer = VECTOR.as_pointer()
        self._masked_load = cgutils.get_or_insert_function(
            module, ir.FunctionType(VECTOR, [vector_pointer, I32, MASK, VECTOR]),
            f"llvm.masked.load.v{LANES}f32.p0v{LANES}f32")
        self._masked_store = cgutils.get_or_insert_function(
            module, ir.FunctionType(ir.VoidType(), [VECTOR, vector_pointer, I32, MASK]),
            f"llvm.masked.store.v{LANES}f32.p0v{LANES}f32")
        i8p = ir.IntType(8).as_pointer()
        self._prefetch = module.declare_intrinsic("llvm.prefetch", [i8p],
                                                  ir.FunctionType(ir.VoidType(), [i8p, I32, I32, I32]))

    # arguments
    def index(self, k):
        """Argument k (an integer) as an intp."""
        return self.context.cast(self.builder, self.args[k], self.signature.args[k], types.intp)

    def indices(self, k):
        """Argument k (a tuple of integers) as intps."""
        values = cgutils.unpack_tuple(self.builder, self.args[k])
        return [self.context.cast(self.builder, v, t, types.intp) for v, t in zip(values, self.signature.args[k])]

    def array(self, k):
        """Argument k (an array) as (data pointer, [its shape])."""
        array = self.context.make_array(self.signature.args[k])(self.context, self.builder, self.args[k])
        return array.data, cgutils.unpack_tuple(self.builder, array.shape)

    # arithmetic
    def const(self, value):
        return ir.Constant(self.intp, value)

    def add(self, *terms):
        total = terms[0]
        for t in terms[1:]:
            total = self.builder.add(total, t)
        return total

    def mul(self, *factors):
        product = factors[0]
        for f in factors[1:]:
            product = self.builder.mul(product, f)
        return product

    def at(self, pointer, offset):
        """pointer + offset elements."""
        return self.builder.gep(pointer, [offset])

    # vectors
    def fma(self, a, b, c):
        return self.builder.call(self._fma, [a, b, c])

    def splat(self, scalar):
        """A vector of LANES copies of a float32."""
        undef = ir.Constant(VECTOR, ir.Undefined)
        one = self.builder.insert_element(undef, scalar, I32(0))
        return self.builder.shuffle_vector(one, undef, ir.Constant(ir.VectorType(I32, LANES), [0] * LANES))

    def mask(self, count):
        """Lanes below `count` (an intp; none where it is <= 0)."""
        lanes = ir.Constant(ir.VectorType(self.intp, LANES), list(range(LANES)))  # 0, 1, ..., LANES - 1
        counts = self.builder.insert_element(ir.Constant(ir.VectorType(self.intp, LANES), ir.Undefined), count,
                                             I32(0))
        counts = self.builder.shuffle_vector(counts, counts, ir.Constant(ir.VectorType(I32, LANES), [0] * LANES))
        return self.builder.icmp_signed("<", lanes, counts)

    def load(self, pointer, mask=None):
        """The vector at `pointer` (float32*): LANES floats, or the lanes of `mask` (others zero)."""
        address = self.builder.bitcast(pointer, VECTOR.as_pointer())
        if mask is None:
            return self.builder.load(address, align=4)
        return self.builder.call(self._masked_load, [address, I32(4), mask, ir.Constant(VECTOR, [0.0] * LANES)])

    def store(self, value, pointer, mask=None):
        address = self.builder.bitcast(pointer, VECTOR.as_pointer())
        if mask is None:
            self.builder.store(value, address, align=4)
        else:
            self.builder.call(self._masked_store, [value, address, I32(4), mask])

    def prefetch(self, pointer):
        """Ask for the cache line at `pointer` to be read into every cache level (llvm.prefetch's arguments:
        read, keep, data); never changes a value."""
        self.builder.call(self._prefetch, [self.builder.bitcast(pointer, ir.IntType(8).as_pointer()),
                                           I32(0), I32(3), I32(1)])

    # control
    def loop(self, start, stop, initial, body):
        """The values carried through `for i in range(start, stop)`: body(i, values) emits a step and
        returns the next values. Returns the values after the loop (`initial` where it takes no step)."""
        builder = self.builder
        entry = builder.basic_block
        step, done = builder.append_basic_block("loop.step"), builder.append_basic_block("loop.done")
        builder.cbranch(builder.icmp_signed("<", start, stop), step, done)
        builder.position_at_end(step)
        i = builder.phi(self.intp)
        carried = [builder.phi(v.type) for v in initial]
        stepped = body(i, carried)
        following = builder.add(i, self.const(1))
        last = builder.basic_block
        i.add_incoming(start, entry)
        i.add_incoming(following, last)
        for phi, first, then in zip(carried, initial, stepped):
            phi.add_incoming(first, entry)
            phi.add_incoming(then, last)
        builder.cbranch(builder.icmp_signed("<", following, stop), step, done)
        builder.position_at_end(done)
        results = []
        for first, then in zip(initial, stepped):
            results.append(builder.phi(first.type))
            results[-1].add_incoming(first, entry)
            results[-1].add_incoming(then, last)
        return results

    def when(self, condition):
        """`with emitter.when(c):` emits its body under `if c`."""
        return self.builder.if_then(condition)

    def below(self, a, b):
        return self.builder.icmp_signed("<", a, b)
