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

import math

import numba
import numpy as np
from numba import njit

__all__ = [
    "JIT",
    "KERNEL_OPTIONS",
    "vload",
    "vstore",
    "vzero",
    "vfma",
    "vfmav",
    "vload_wide",
    "vadd",
    "vmax",
    "vlane",
    "fma",
    "as_bits",
    "as_float",
    "lanes",
    "vexp",
    "vsubs",
    "vmuls",
    "vmul",
    "vkeep",
    "vsum",
    "vbest",
    "vtop",
    "exp_float64",
    "exp_float32",
    "vsigmoid",
]

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
            fn = cgutils.get_or_insert_function(builder.module, fnty, f"llvm.fma.{_llvm_name(lt)}")
            return builder.call(fn, [_splat(builder, lt, args[0]), args[1], args[2]])

        return x(a, x, y), codegen

    @intrinsic
    def vfmav(typingctx, x, y, z):
        """x * y + z lane-wise, rounded once (three vectors)."""

        def codegen(context, builder, sig, args):
            lt = context.get_value_type(sig.args[0])
            fnty = ir.FunctionType(lt, [lt] * 3)
            fn = cgutils.get_or_insert_function(builder.module, fnty, f"llvm.fma.{_llvm_name(lt)}")
            return builder.call(fn, list(args))

        return x(x, y, z), codegen

    @intrinsic
    def vload_wide(typingctx, arr, start):
        """:func:`vload` of a float array; of a uint16 array (bfloat16 bits) the 16 values
        from ``start`` widened exactly to float32 (the bits shifted into the high half)."""
        if isinstance(arr.dtype, types.Float):
            vt = Vec(arr.dtype)

            def codegen_float(context, builder, sig, args):
                ptr = _element_pointer(context, builder, sig.args[0], args[0], args[1])
                lt = context.get_value_type(vt)
                return builder.load(builder.bitcast(ptr, lt.as_pointer()), align=1)

            return vt(arr, start), codegen_float
        if arr.dtype != types.uint16:
            return None
        vt = Vec(types.float32)

        def codegen(context, builder, sig, args):
            ptr = _element_pointer(context, builder, sig.args[0], args[0], args[1])
            half = ir.VectorType(ir.IntType(16), 16)
            bits = builder.load(builder.bitcast(ptr, half.as_pointer()), align=1)
            word = ir.VectorType(ir.IntType(32), 16)
            wide = builder.shl(builder.zext(bits, word), ir.Constant(word, [16] * 16))
            return builder.bitcast(wide, context.get_value_type(vt))

        return vt(arr, start), codegen

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
            fn = cgutils.get_or_insert_function(
                builder.module, fnty, f"llvm.maxnum.{_llvm_name(lt)}"
            )
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

    @intrinsic
    def as_bits(typingctx, x):
        """The bits of a float32 (as int32) or float64 (as int64): a bitcast, the inverse of
        :func:`as_float`."""
        if not isinstance(x, types.Float):
            return None
        it = types.int64 if x.bitwidth == 64 else types.int32

        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], context.get_value_type(it))

        return it(x), codegen

else:  # pragma: no cover - exercised by the NUMBA_DISABLE_JIT=1 test tier

    def vload(arr, start):
        width = 64 // arr.itemsize
        return arr[start : start + width].copy()

    def vstore(arr, start, x):
        arr[start : start + x.size] = x

    def vzero(arr):
        return np.zeros(64 // arr.itemsize, arr.dtype)

    def vfma(a, x, y):
        # Not fused here: this twin exists to cover the kernel bodies, not to be bit-exact.
        return (a * x + y).astype(x.dtype)

    def vfmav(x, y, z):
        return (x * y + z).astype(x.dtype)

    def vload_wide(arr, start):
        if arr.dtype == np.uint16:
            bits = arr[start : start + 16].astype(np.uint32) << np.uint32(16)
            return bits.view(np.float32)
        return vload(arr, start)

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

    def as_bits(x):
        x = np.asarray(x)
        return x.view(np.int64 if x.itemsize == 8 else np.int32)[()]


@njit(**_OPTS)
def lanes(arr):
    """Lanes of a 64-byte vector of arr's dtype (8 float64 or 16 float32)."""
    return 64 // arr.itemsize


# --------------------------------------------------------------------------------------
# exp: branch-free scalar kernels and their lane-wise twin :func:`vexp` (the same IEEE
# operations in the same order, so a lane of vexp(x) is bit-identical to exp of that lane)
# --------------------------------------------------------------------------------------
_LOG2E_64 = np.float64(1.4426950408889634)
_LN2_HI_64 = np.float64(6.93147180369123816490e-01)  # 32 significant bits: n * hi is exact
_LN2_LO_64 = np.float64(1.90821492927058770002e-10)
_INV_FACT_64 = tuple(np.float64(1.0 / math.factorial(i)) for i in range(14))

_LOG2E_32 = np.float32(1.44269504)
_LN2_HI_32 = np.float32(0.693359375)  # 9 significant bits: n * hi is exact
_LN2_LO_32 = np.float32(-2.12194440e-4)
_INV_FACT_32 = tuple(np.float32(1.0 / math.factorial(i)) for i in range(9))


@njit(**_OPTS)
def exp_float64(x):
    """exp(x) for float64 to about one ulp, branch-free (Cody-Waite reduction + Taylor(13)).

    x = n ln2 + r with |r| <= ln2/2 (two-constant reduction, exact for |n| <= 2**20), then
    exp(r) by Horner with fused multiply-adds; the truncation error r**14/14! < 5e-18 is far
    below u = 2**-53. 2**n is applied as two exact power-of-two factors so that results in
    the subnormal range are rounded once.

    Examples
    --------
    >>> float(exp_float64(np.float64(1.0))) == math.exp(1.0)
    True
    """
    t = np.floor(x * _LOG2E_64 + np.float64(0.5))
    t = min(max(t, np.float64(-1100.0)), np.float64(1100.0))
    r = fma(-t, _LN2_HI_64, x)
    r = fma(-t, _LN2_LO_64, r)
    p = _INV_FACT_64[13]
    p = fma(p, r, _INV_FACT_64[12])
    p = fma(p, r, _INV_FACT_64[11])
    p = fma(p, r, _INV_FACT_64[10])
    p = fma(p, r, _INV_FACT_64[9])
    p = fma(p, r, _INV_FACT_64[8])
    p = fma(p, r, _INV_FACT_64[7])
    p = fma(p, r, _INV_FACT_64[6])
    p = fma(p, r, _INV_FACT_64[5])
    p = fma(p, r, _INV_FACT_64[4])
    p = fma(p, r, _INV_FACT_64[3])
    p = fma(p, r, _INV_FACT_64[2])
    p = fma(p, r, _INV_FACT_64[1])
    p = fma(p, r, _INV_FACT_64[0])
    t = t if t == t else np.float64(0.0)
    n = np.int64(t)
    half = n >> np.int64(1)
    rest = n - half
    one_bits = np.int64(1023)
    res = p * as_float((half + one_bits) << np.int64(52))
    res = res * as_float((rest + one_bits) << np.int64(52))
    res = np.float64(0.0) if x < np.float64(-746.0) else res
    res = np.float64(np.inf) if x > np.float64(710.0) else res
    return res if x == x else x


@njit(**_OPTS)
def exp_float32(x):
    """exp(x) for float32 to about one ulp, branch-free (Cody-Waite reduction + Taylor(8)).

    Examples
    --------
    >>> abs(float(exp_float32(np.float32(1.0))) - math.exp(1.0)) < 3e-7
    True
    """
    t = np.floor(x * _LOG2E_32 + np.float32(0.5))
    t = min(max(t, np.float32(-200.0)), np.float32(200.0))
    r = fma(-t, _LN2_HI_32, x)
    r = fma(-t, _LN2_LO_32, r)
    p = _INV_FACT_32[8]
    p = fma(p, r, _INV_FACT_32[7])
    p = fma(p, r, _INV_FACT_32[6])
    p = fma(p, r, _INV_FACT_32[5])
    p = fma(p, r, _INV_FACT_32[4])
    p = fma(p, r, _INV_FACT_32[3])
    p = fma(p, r, _INV_FACT_32[2])
    p = fma(p, r, _INV_FACT_32[1])
    p = fma(p, r, _INV_FACT_32[0])
    t = t if t == t else np.float32(0.0)
    n = np.int32(t)
    half = n >> np.int32(1)
    rest = n - half
    one_bits = np.int32(127)
    # numba widens int32 arithmetic to int64: narrow again before the bit cast
    res = p * as_float(np.int32((half + one_bits) << np.int32(23)))
    res = res * as_float(np.int32((rest + one_bits) << np.int32(23)))
    res = np.float32(0.0) if x < np.float32(-104.0) else res
    res = np.float32(np.inf) if x > np.float32(89.0) else res
    return res if x == x else x


if JIT:

    def _vexp_codegen(context, builder, lt, x):
        """IR of exp_float64 / exp_float32 on every lane of x (the same operations)."""
        f64 = isinstance(lt.element, ir.DoubleType)
        n = lt.count
        ity = ir.IntType(64 if f64 else 32)
        ivt = ir.VectorType(ity, n)
        if f64:
            log2e, hi, lo, coef = _LOG2E_64, _LN2_HI_64, _LN2_LO_64, _INV_FACT_64
            clamp, mant, bias, low, high = 1100.0, 52, 1023, -746.0, 710.0
        else:
            log2e, hi, lo, coef = _LOG2E_32, _LN2_HI_32, _LN2_LO_32, _INV_FACT_32
            clamp, mant, bias, low, high = 200.0, 23, 127, -104.0, 89.0

        def const(value):
            return ir.Constant(lt, [ir.Constant(lt.element, float(value))] * n)

        def iconst(value):
            return ir.Constant(ivt, [ir.Constant(ity, value)] * n)

        def call(name, *args):
            fnty = ir.FunctionType(lt, [lt] * len(args))
            fn = cgutils.get_or_insert_function(
                builder.module, fnty, f"llvm.{name}.{_llvm_name(lt)}"
            )
            return builder.call(fn, list(args))

        t = call("floor", builder.fadd(builder.fmul(x, const(log2e)), const(0.5)))
        t = call("minnum", call("maxnum", t, const(-clamp)), const(clamp))
        neg_t = builder.fneg(t)
        r = call("fma", neg_t, const(hi), x)
        r = call("fma", neg_t, const(lo), r)
        p = const(coef[-1])
        for c in reversed(coef[:-1]):
            p = call("fma", p, r, const(c))
        t = builder.select(builder.fcmp_ordered("==", t, t), t, const(0.0))
        k = builder.fptosi(t, ivt)
        half = builder.ashr(k, iconst(1))
        rest = builder.sub(k, half)
        s1 = builder.bitcast(builder.shl(builder.add(half, iconst(bias)), iconst(mant)), lt)
        s2 = builder.bitcast(builder.shl(builder.add(rest, iconst(bias)), iconst(mant)), lt)
        res = builder.fmul(builder.fmul(p, s1), s2)
        res = builder.select(builder.fcmp_ordered("<", x, const(low)), const(0.0), res)
        res = builder.select(builder.fcmp_ordered(">", x, const(high)), const(math.inf), res)
        return builder.select(builder.fcmp_ordered("==", x, x), res, x)

    @intrinsic
    def vexp(typingctx, x):
        """exp of every lane (bit-identical to :func:`exp_float64` / :func:`exp_float32`)."""

        def codegen(context, builder, sig, args):
            return _vexp_codegen(context, builder, context.get_value_type(sig.args[0]), args[0])

        return x(x), codegen

    @intrinsic
    def vsubs(typingctx, x, a):
        """x - a lane-wise (a a scalar, broadcast)."""

        def codegen(context, builder, sig, args):
            lt = context.get_value_type(sig.args[0])
            return builder.fsub(args[0], _splat(builder, lt, args[1]))

        return x(x, a), codegen

    @intrinsic
    def vmuls(typingctx, x, a):
        """x * a lane-wise (a a scalar, broadcast)."""

        def codegen(context, builder, sig, args):
            lt = context.get_value_type(sig.args[0])
            return builder.fmul(args[0], _splat(builder, lt, args[1]))

        return x(x, a), codegen

    @intrinsic
    def vmul(typingctx, x, y):
        """x * y lane-wise."""

        def codegen(context, builder, sig, args):
            return builder.fmul(args[0], args[1])

        return x(x, y), codegen

    @intrinsic
    def vkeep(typingctx, s, x):
        """x where s != -inf (NaN counts as kept), else 0, lane-wise."""

        def codegen(context, builder, sig, args):
            lt = context.get_value_type(sig.args[1])
            neg_inf = ir.Constant(lt, [ir.Constant(lt.element, -math.inf)] * lt.count)
            zero = ir.Constant(lt, [ir.Constant(lt.element, 0.0)] * lt.count)
            keep = builder.fcmp_unordered("!=", args[0], neg_inf)
            return builder.select(keep, args[1], zero)

        return x(s, x), codegen

    @intrinsic
    def vsum(typingctx, x):
        """lane 0 + lane 1 + ... + lane W-1, added in that order (constant lane indices, so
        no trip through memory)."""

        def codegen(context, builder, sig, args):
            lt = context.get_value_type(sig.args[0])
            total = builder.extract_element(args[0], ir.Constant(ir.IntType(32), 0))
            for w in range(1, lt.count):
                lane = builder.extract_element(args[0], ir.Constant(ir.IntType(32), w))
                total = builder.fadd(total, lane)
            return total

        return x.dtype(x), codegen

    @intrinsic
    def vbest(typingctx, x):
        """Largest lane skipping NaN, scanning lanes 0..W-1 (a lane replaces the best so far
        when it is larger or the best so far is NaN); NaN only when every lane is NaN."""

        def codegen(context, builder, sig, args):
            best = builder.extract_element(args[0], ir.Constant(ir.IntType(32), 0))
            for w in range(1, context.get_value_type(sig.args[0]).count):
                lane = builder.extract_element(args[0], ir.Constant(ir.IntType(32), w))
                take = builder.or_(
                    builder.fcmp_ordered(">", lane, best), builder.fcmp_unordered("uno", best, best)
                )
                best = builder.select(take, lane, best)
            return best

        return x.dtype(x), codegen

    @intrinsic
    def vtop(typingctx, x):
        """Largest lane skipping NaN (NaN only when every lane is NaN), as :func:`vbest`, by
        a halving tree of ``maxnum`` (the maximum of a set needs no order: a few shuffles
        instead of a chain of W compare-and-selects). Only the sign of a zero maximum may
        differ from :func:`vbest` (``maxnum`` may return either zero)."""

        def codegen(context, builder, sig, args):
            lt = context.get_value_type(sig.args[0])
            fnty = ir.FunctionType(lt, [lt, lt])
            fn = cgutils.get_or_insert_function(
                builder.module, fnty, f"llvm.maxnum.{_llvm_name(lt)}"
            )
            undef = ir.Constant(lt, ir.Undefined)
            x = args[0]
            half = lt.count // 2
            while half >= 1:
                # lane w takes lane w + half (the upper lanes repeat: never read)
                picks = [(w + half) % lt.count for w in range(lt.count)]
                mask = ir.Constant(
                    ir.VectorType(ir.IntType(32), lt.count),
                    [ir.Constant(ir.IntType(32), w) for w in picks],
                )
                x = builder.call(fn, [x, builder.shuffle_vector(x, undef, mask)])
                half //= 2
            return builder.extract_element(x, ir.Constant(ir.IntType(32), 0))

        return x.dtype(x), codegen

    @intrinsic
    def vsigmoid(typingctx, x):
        """sigma of every lane: ``e = exp(-|x|)`` (the operations of :func:`vexp`), then
        ``1 / (1 + e)`` where ``x >= 0`` and ``e / (1 + e)`` elsewhere (NaN stays NaN)."""

        def codegen(context, builder, sig, args):
            lt = context.get_value_type(sig.args[0])
            fabs = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(lt, [lt]), f"llvm.fabs.{_llvm_name(lt)}"
            )
            e = _vexp_codegen(context, builder, lt, builder.fneg(builder.call(fabs, [args[0]])))
            one = ir.Constant(lt, [ir.Constant(lt.element, 1.0)] * lt.count)
            den = builder.fadd(one, e)
            zero = ir.Constant(lt, [ir.Constant(lt.element, 0.0)] * lt.count)
            positive = builder.fcmp_ordered(">=", args[0], zero)
            return builder.select(positive, builder.fdiv(one, den), builder.fdiv(e, den))

        return x(x), codegen

else:  # pragma: no cover

    def vsum(x):
        total = x[0]
        for lane in x[1:]:
            total = total + lane
        return total

    def vbest(x):
        best = x[0]
        for lane in x[1:]:
            best = lane if lane > best or best != best else best
        return best

    def vtop(x):
        return vbest(x)

    def vmul(x, y):
        return (x * y).astype(x.dtype)

    def vkeep(s, x):
        return np.where(s != -np.inf, x, np.zeros_like(x))

    def vexp(x):
        with np.errstate(all="ignore"):
            f = exp_float64 if x.dtype == np.float64 else exp_float32
            return np.array([f(value) for value in x], x.dtype)

    def vsubs(x, a):
        return (x - a).astype(x.dtype)

    def vmuls(x, a):
        return (x * a).astype(x.dtype)

    def vsigmoid(x):
        with np.errstate(all="ignore"):
            f = exp_float64 if x.dtype == np.float64 else exp_float32
            e = np.array([f(-abs(value)) for value in x], x.dtype)
            return np.where(x >= 0, 1 / (1 + e), e / (1 + e)).astype(x.dtype)
