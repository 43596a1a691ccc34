"""SIMD building blocks of the Numba CPU kernels: a 64-byte vector type and ``llvm.fma``.

:class:`Vec` is 64 bytes of one float dtype as an LLVM vector (8 x float64 or 16 x float32);
:func:`vload`, :func:`vstore`, :func:`vfma`, ... are Numba intrinsics on it, lowered to one LLVM
instruction each, so the kernels choose the vector shape themselves instead of relying on the
auto-vectoriser (which may re-associate nothing with fastmath off, and so vectorises little).
:func:`fma` is the scalar ``llvm.fma`` (one rounding on every machine).

Under ``NUMBA_DISABLE_JIT=1`` the same names are pure-Python twins on small NumPy arrays, so the
kernel bodies run as Python (a test tier covers them; they are not bit-exact there).

Examples
--------
>>> import numpy as np
>>> @njit
... def twice_plus_one(a):  # the intrinsics are called from compiled code
...     return vlane(vfma(np.float64(2.0), vload(a, 0), vload(a, 8)), 3)
>>> float(twice_plus_one(np.concatenate([np.arange(8.0), np.ones(8)])))
7.0
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit

__all__ = ["JIT", "KERNEL_OPTIONS", "vload", "vstore", "vzero", "vfma", "vadd", "vmax",
           "vlane", "fma", "as_float", "lanes"]

#: Whether Numba compiles (False under ``NUMBA_DISABLE_JIT=1``).
JIT = not numba.config.DISABLE_JIT
#: Options of every kernel function: fastmath off (the reduction orders are documented and
#: fixed), no bounds checks, on-disk cache, GIL released.
KERNEL_OPTIONS = dict(fastmath=False, boundscheck=False, cache=True, nogil=True)
_OPTS = KERNEL_OPTIONS

if JIT:
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.core.extending import intrinsic, models, register_model

    class Vec(types.Type):
        """64 bytes of one float dtype as an LLVM vector (8 x float64 or 16 x float32)."""

        def __init__(self, dtype):
            self.dtype = dtype
            self.width = 64 // (dtype.bitwidth // 8)
            super().__init__(name=f"RefattnVec({dtype}x{self.width})")

    @register_model(Vec)
    class _VecModel(models.PrimitiveModel):
        def __init__(self, dmm, fe_type):
            element = dmm.lookup(fe_type.dtype).get_value_type()
            super().__init__(dmm, fe_type, ir.VectorType(element, fe_type.width))

    def _element_pointer(context, builder, arrty, arr, start):
        ary = context.make_array(arrty)(context, builder, arr)
        return builder.gep(ary.data, [start])

    def _splat(builder, vtype, scalar):
        undef = ir.Constant(vtype, ir.Undefined)
        one = builder.insert_element(undef, scalar, ir.Constant(ir.IntType(32), 0))
        zeros = ir.Constant(ir.VectorType(ir.IntType(32), vtype.count), [0] * vtype.count)
        return builder.shuffle_vector(one, undef, zeros)

    def _llvm_name(vtype):
        bits = 64 if isinstance(vtype.element, ir.DoubleType) else 32
        return f"v{vtype.count}f{bits}"

    @intrinsic
    def vload(typingctx, arr, start):
        vt = Vec(arr.dtype)

        def codegen(context, builder, sig, args):
            ptr = _element_pointer(context, builder, sig.args[0], args[0], args[1])
            lt = context.get_value_type(vt)
            return builder.load(builder.bitcast(ptr, lt.as_pointer()), align=1)

        return vt(arr, start), codegen

    @intrinsic
    def vstore(typingctx, arr, start, x):
        def codegen(context, builder, sig, args):
            ptr = _element_pointer(context, builder, sig.args[0], args[0], args[1])
            lt = context.get_value_type(sig.args[2])
            builder.store(args[2], builder.bitcast(ptr, lt.as_pointer()), align=1)
            return context.get_dummy_value()

        return types.none(arr, start, x), codegen

    @intrinsic
    def vzero(typingctx, arr):
        vt = Vec(arr.dtype)

        def codegen(context, builder, sig, args):
            lt = context.get_value_type(vt)
            return ir.Constant(lt, [ir.Constant(lt.element, 0.0)] * lt.count)

        return vt(arr), codegen

    @intrinsic
    def vfma(typingctx, a, x, y):
        """a * x + y lane-wise, rounded once (a is a scalar, broadcast)."""

        def codegen(context, builder, sig, args):
            lt = context.get_value_type(sig.args[1])
            fnty = ir.FunctionType(lt, [lt] * 3)
            fn = cgutils.get_or_insert_function(builder.module, fnty,
                                                f"llvm.fma.{_llvm_name(lt)}")
            return builder.call(fn, [_splat(builder, lt, args[0]), args[1], args[2]])

        return x(a, x, y), codegen

    @intrinsic
    def vadd(typingctx, x, y):
        def codegen(context, builder, sig, args):
            return builder.fadd(args[0], args[1])

        return x(x, y), codegen

    @intrinsic
    def vmax(typingctx, x, y):
        """Lane-wise maxnum (a NaN lane yields the other operand, like ``max`` skipping NaN)."""

        def codegen(context, builder, sig, args):
            lt = context.get_value_type(sig.args[0])
            fnty = ir.FunctionType(lt, [lt] * 2)
            fn = cgutils.get_or_insert_function(builder.module, fnty,
                                                f"llvm.maxnum.{_llvm_name(lt)}")
            return builder.call(fn, args)

        return x(x, y), codegen

    @intrinsic
    def vlane(typingctx, x, index):
        def codegen(context, builder, sig, args):
            return builder.extract_element(args[0], args[1])

        return x.dtype(x, index), codegen

    @intrinsic
    def fma(typingctx, a, b, c):
        if not (a == b == c and isinstance(a, types.Float)):
            return None

        def codegen(context, builder, sig, args):
            lt = context.get_value_type(sig.return_type)
            fnty = ir.FunctionType(lt, [lt] * 3)
            bits = 64 if isinstance(lt, ir.DoubleType) else 32
            fn = cgutils.get_or_insert_function(builder.module, fnty, f"llvm.fma.f{bits}")
            return builder.call(fn, args)

        return a(a, b, c), codegen

    @intrinsic
    def as_float(typingctx, n):
        ft = types.float64 if n.bitwidth == 64 else types.float32

        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], context.get_value_type(ft))

        return ft(n), codegen

else:  # pragma: no cover - exercised by the NUMBA_DISABLE_JIT=1 test tier

    def vload(arr, start):
        width = 64 // arr.itemsize
        return arr[start:start + width].copy()

    def vstore(arr, start, x):
        arr[start:start + x.size] = x

    def vzero(arr):
        return np.zeros(64 // arr.itemsize, arr.dtype)

    def vfma(a, x, y):
        # Not fused here: this twin exists to cover the kernel bodies, not to be bit-exact.
        return (a * x + y).astype(x.dtype)

    def vadd(x, y):
        return x + y

    def vmax(x, y):
        return np.fmax(x, y)

    def vlane(x, index):
        return x[index]

    def fma(a, b, c):
        return type(a)(a * b + c)

    def as_float(n):
        return n.view(np.float64 if n.dtype == np.int64 else np.float32)


@njit(**_OPTS)
def lanes(arr):
    """Lanes of a 64-byte vector of arr's dtype (8 float64 or 16 float32)."""
    return 64 // arr.itemsize
