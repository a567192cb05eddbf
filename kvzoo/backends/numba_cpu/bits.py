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

F32, BF16, F16, I8, E4M3FN, E4M3FNUZ = 0, 1, 2, 3, 4, 5

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


@intrinsic
def bits_from_f32(typingctx, x):
    """The bit pattern of a float32, zero-extended to int64."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.zext(builder.bitcast(args[0], _I32), ir.IntType(64))

    return types.int64(x), codegen


@njit(inline="always")
def f16_bits_to_f32_bits(h):
    """Exact IEEE half -> single widening, on bit patterns (no dependence on numba's float16)."""
    h = np.int64(h)
    sign = (h & 0x8000) << 16
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0x1F:
        return sign | 0x7F800000 | (m << 13)
    if e != 0:
        return sign | ((e + 112) << 23) | (m << 13)
    # Zero or subnormal: m * 2^-24 is exact in float32.
    return sign | bits_from_f32(np.float32(m) * np.float32(5.9604644775390625e-08))


@njit(inline="always")
def widen_bits(raw, kind):
    """float32 bit pattern (int64) of one stored element of kind F32 / BF16 / F16."""
    if kind == BF16:
        return np.int64(raw) << 16
    if kind == F16:
        return f16_bits_to_f32_bits(raw)
    return np.int64(raw) & 0xFFFFFFFF


@njit(inline="always")
def _rne_shift(mant, shift):
    """mant >> shift rounded half to even (shift >= 1)."""
    q = mant >> shift
    rem = mant & ((np.int64(1) << shift) - 1)
    half = np.int64(1) << (shift - 1)
    if rem > half or (rem == half and (q & 1) == 1):
        q += 1
    return q


@njit(inline="always")
def encode_e4m3(y, fnuz):
    """One RNE rounding of a finite float32 y (|y| <= format max) to e4m3fn / e4m3fnuz.

    e4m3fn keeps the sign of zero (-0.0 and negatives that round to zero give 0x80); e4m3fnuz
    has no negative zero (0x80 is its NaN), so anything rounding to zero gives 0x00.
    """
    u = bits_from_f32(y)
    sign = (u >> 31) << 7
    a = u & 0x7FFFFFFF
    exp = a >> 23
    if fnuz:
        # bias 8: smallest normal 2^-7 (fp32 exponent field 120), subnormal step 2^-10.
        if exp >= 120:
            code = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (119 << 3)
        else:
            code = _rne_shift((a & 0x7FFFFF) | 0x800000, min(140 - exp, 31))
        return 0 if code == 0 else code | sign
    # bias 7: smallest normal 2^-6 (fp32 exponent field 121), subnormal step 2^-9.
    if exp >= 121:
        code = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    else:
        code = _rne_shift((a & 0x7FFFFF) | 0x800000, min(141 - exp, 31))
    return code | sign


@njit(inline="always")
def decode_code(c, kind):
    """Exact float32 value of one stored 8-bit code (int8 or e4m3 family); NaN codes -> NaN."""
    c = np.int64(c)
    if kind == I8:
        return np.float32(c - ((c >> 7) << 8))
    sign = (c & 0x80) << 24
    mag = c & 0x7F
    if kind == E4M3FN:
        if mag == 0x7F:
            return np.float32(np.nan)
        e = mag >> 3
        if e == 0:
            return f32_from_bits(sign | bits_from_f32(np.float32(mag) * np.float32(0.001953125)))
        return f32_from_bits(sign | ((e + 120) << 23) | ((mag & 7) << 20))
    # E4M3FNUZ
    if c == 0x80:
        return np.float32(np.nan)
    e = mag >> 3
    if e == 0:
        return f32_from_bits(sign | bits_from_f32(np.float32(mag) * np.float32(0.0009765625)))
    return f32_from_bits(sign | ((e + 119) << 23) | ((mag & 7) << 20))


@njit(inline="always")
def decode_element(raw, kind):
    """float32 value of one cache element of any kind (model dtype or code)."""
    if kind <= F16:
        return f32_from_bits(widen_bits(raw, kind))
    return decode_code(raw, kind)
