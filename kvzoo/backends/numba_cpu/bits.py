"""Bit-level float helpers for the Numba kernels: reinterpretation, widening and fp8 coding.

Everything that decides output bytes is integer arithmetic or a single IEEE fp32 operation, so
the result cannot depend on the compiler's floating-point choices (fastmath is never enabled
for these functions or their callers). Format codes used across the backend:

    element kinds  F32 (float32 bits), BF16, F16 (uint16 bits), I8, E4M3FN, E4M3FNUZ (uint8)
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .formats import BF16, E4M3FN, E4M3FNUZ, F16, F32, I8  # noqa: F401  (re-exported)

_I32 = ir.IntType(32)


@intrinsic
def f32_from_bits(typingctx, bits):
    """The float32 whose bit pattern is the low 32 bits of an integer."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        (v,) = args
        width = v.type.width
        if width > 32:
            v = builder.trunc(v, _I32)
        elif width < 32:
            v = builder.zext(v, _I32)
        return builder.bitcast(v, ir.FloatType())

    return types.float32(bits), codegen


_i32 = np.int32
_F32_MAGIC = np.float32(8388608.0)  # 2^23: (f + 2^23) - 2^23 rounds 0 <= f < 2^22 half to even


@intrinsic
def i32_from_f32(typingctx, x):
    """The bit pattern of a float32 as int32 (sign bit is the int's sign)."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], _I32)

    return types.int32(x), codegen


# The helpers below are written branch-free in int32 where they sit in inner loops, so LLVM
# vectorizes them (16 lanes with AVX-512); each select computes both sides, exactly.


@njit(inline="always")
def f16_bits_to_f32_bits(raw):
    """Exact IEEE half -> single widening on bit patterns (numba has no float16 type)."""
    h = _i32(raw)
    sign = (h & _i32(0x8000)) << _i32(16)
    em = h & _i32(0x7FFF)
    e = em >> _i32(10)
    normal = (em << _i32(13)) + _i32(112 << 23)
    special = (em << _i32(13)) | _i32(0x7F800000)
    # Zero or subnormal: em * 2^-24 is exact in float32.
    tiny = i32_from_f32(np.float32(em) * np.float32(5.9604644775390625e-08))
    r = tiny if e == _i32(0) else (special if e == _i32(31) else normal)
    return r | sign


@njit(inline="always")
def widen(raw, kind):
    """float32 value of one stored element of kind F32 / BF16 / F16 (exact)."""
    if kind == BF16:
        return f32_from_bits(_i32(raw) << _i32(16))
    if kind == F16:
        return f32_from_bits(f16_bits_to_f32_bits(raw))
    return f32_from_bits(raw)


@njit(inline="always")
def encode_e4m3(y, fnuz):
    """One RNE rounding of a finite float32 y (|y| <= format max) to e4m3fn / e4m3fnuz.

    Normal range: integer round-half-even of the fp32 bits to 3 mantissa bits (a carry into
    the exponent is the correct result). Subnormal range: |y| * 2^9 (2^10 for fnuz) is exact
    and lies in [0, 8), where adding and removing 2^23 rounds half to even.
    e4m3fn keeps the sign of zero (-0.0 and negatives rounding to zero give 0x80); e4m3fnuz
    has no negative zero (0x80 is its NaN), so anything rounding to zero gives 0x00.
    """
    u = i32_from_f32(y)
    a = u & _i32(0x7FFFFFFF)
    sign = (u >> _i32(24)) & _i32(0x80)
    rounded = (a + (_i32(0x7FFFF) + ((a >> _i32(20)) & _i32(1)))) >> _i32(20)
    if fnuz:
        normal = rounded - _i32(119 << 3)
        f = f32_from_bits(a) * np.float32(1024.0)
        sub = _i32((f + _F32_MAGIC) - _F32_MAGIC)
        code = normal if a >= _i32(0x3C000000) else sub  # 2^-7, smallest normal
        return code | sign if code != _i32(0) else _i32(0)
    normal = rounded - _i32(120 << 3)
    f = f32_from_bits(a) * np.float32(512.0)
    sub = _i32((f + _F32_MAGIC) - _F32_MAGIC)
    code = normal if a >= _i32(0x3C800000) else sub  # 2^-6, smallest normal
    return code | sign


@njit(inline="always")
def decode_code(raw, kind):
    """Exact float32 value of one stored 8-bit code (int8 or e4m3 family); NaN codes -> NaN."""
    c = _i32(raw) & _i32(0xFF)
    if kind == I8:
        return np.float32((c ^ _i32(0x80)) - _i32(0x80))
    sign = (c & _i32(0x80)) << _i32(24)
    mag = c & _i32(0x7F)
    if kind == E4M3FN:
        normal = (mag << _i32(20)) + _i32(120 << 23)
        sub = i32_from_f32(np.float32(mag) * np.float32(0.001953125))
        nan = mag == _i32(0x7F)
    else:
        normal = (mag << _i32(20)) + _i32(119 << 23)
        sub = i32_from_f32(np.float32(mag) * np.float32(0.0009765625))
        nan = c == _i32(0x80)
    r = sub if mag < _i32(8) else normal
    r = _i32(0x7FC00000) if nan else r | sign
    return f32_from_bits(r)


@njit(inline="always")
def decode_element(raw, kind):
    """float32 value of one cache element of any kind (model dtype or code)."""
    if kind <= F16:
        return widen(raw, kind)
    return decode_code(raw, kind)
