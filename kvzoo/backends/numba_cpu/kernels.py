"""Numba kernels: the quantizing cache write, dequantize/gather, and paged attention, for the
8-bit formats and for int4 (uint4 codes, SPEC.md section 2's int4 rows), keys and values each
in their own side's format (records.Side), so a mode storing them in two formats is a pairing
of sides the kernels already take.

Every array arrives as a flat 1-D contiguous view of the caller's memory plus its offset and
strides in elements (see strided.py): a tuple beside it, or an int64 array beside it in one of
records.py's records (a side of the pages, the write's rows, ...). So one compiled
specialization serves every layout (contiguous, inline-scale pages, views into a fused QKV
tensor) and the innermost loops see a plain 1-D array LLVM can vectorize. Float inputs travel
as their bit patterns (uint16 for bf16/fp16, uint32 for fp32) and are widened in-kernel,
exactly.

Indices in hot loops are cast to uint64 (`_u`): numba wraps negative signed indices, and that
per-element select keeps LLVM from vectorizing (measured 8x on the widening loop). Offsets
themselves are computed in int64 and are never negative.

Branches on the element kind / format sit outside the inner loops and pass the constant on to
an inlined helper, so each inner loop is compiled for one format.

fastmath stays off in this module: the write and dequantize bytes are fixed by the spec, and
the attention kernel keeps IEEE NaN/Inf propagation so a poisoned cache row shows in the output.
The exceptions are attention's q.k and p.v products (_scores, _accumulate): reassociation
and contraction only, no flag that changes NaN/Inf/signed-zero behaviour.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from .formats import BF16, E4M3FN, E4M3FNUZ, E5M2, F16, F32, I8, U4
from .records import Encoding, Outputs, Params, Query, Rows, Side, Step

# ----------------------------------------------------------------------------------------------
# Bit-level helpers: reinterpretation, widening, fp8 coding. They live in this file because
# numba's on-disk cache is invalidated only by edits to the file of the cached function itself.
# Everything that decides output bytes is integer arithmetic or one IEEE fp32 operation.
# ----------------------------------------------------------------------------------------------

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
def _prefetch(typingctx, arr, index):
    """Hint the cache to load arr[index] (no effect on results)."""
    if not isinstance(arr, types.Array) or not isinstance(index, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        # One declaration per module serves every element type: pass an i8*.
        ptr = builder.bitcast(builder.gep(ary.data, [args[1]]), ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        builder.call(fn, [ptr, i32(0), i32(3), i32(1)])  # read, keep in all levels, data
        return context.get_dummy_value()

    return types.void(arr, index), codegen


_i32 = np.int32
_i16 = np.int16
_F32_MAGIC = np.float32(8388608.0)  # 2^23: (f + 2^23) - 2^23 rounds 0 <= f < 2^22 half to even


@intrinsic
def i32_from_f32(typingctx, x):
    """The bit pattern of a float32 as int32 (sign bit is the int's sign)."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], _I32)

    return types.int32(x), codegen


@intrinsic
def f32_from_f16_bits(typingctx, bits):
    """Exact half -> single widening of the low 16 bits of an integer (F16C vcvtph2ps)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        (v,) = args
        v = builder.trunc(v, ir.IntType(16)) if v.type.width > 16 else v
        return builder.fpext(builder.bitcast(v, ir.HalfType()), ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def f32_through_f16(typingctx, x):
    """A float32 rounded to IEEE half (nearest even; beyond the half range +-Inf, NaN a NaN)
    and widened back: one fptrunc (F16C vcvtps2ph) and one exact fpext."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.fptrunc(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(x), codegen


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
def encode_e5m2(y):
    """One RNE rounding of a finite float32 y (|y| <= 57344) to e5m2, the sign of zero kept.

    The same two ranges as encode_e4m3 with 2 mantissa bits and bias 15: integer round-half-even
    of the fp32 bits to 2 mantissa bits above the smallest normal 2^-14, and |y| * 2^16 (exact,
    in [0, 4)) rounded by adding and removing 2^23 below it.
    """
    u = i32_from_f32(y)
    a = u & _i32(0x7FFFFFFF)
    sign = (u >> _i32(24)) & _i32(0x80)
    rounded = (a + (_i32(0xFFFFF) + ((a >> _i32(21)) & _i32(1)))) >> _i32(21)
    normal = rounded - _i32(112 << 2)
    f = f32_from_bits(a) * np.float32(65536.0)
    sub = _i32((f + _F32_MAGIC) - _F32_MAGIC)
    code = normal if a >= _i32(0x38800000) else sub  # 2^-14, smallest normal
    return code | sign


@njit(inline="always")
def decode_code(raw, kind):
    """Exact float32 value of one stored 8-bit code (int8, e4m3 family, e5m2); NaN codes -> NaN."""
    c = _i32(raw) & _i32(0xFF)
    if kind == I8:
        return np.float32((c ^ _i32(0x80)) - _i32(0x80))
    if kind == E5M2:
        # e5m2 is the top byte of an IEEE half: its Inf and NaN codes come out as Inf and NaN.
        return f32_from_f16_bits(c << _i32(8))
    # e4m3 bits shifted into a half's exponent/mantissa fields are that half times 2^-8
    # (2^-7 for fnuz): the bias differs by 8 (9), subnormals included. The hardware half ->
    # single conversion is exact and the power-of-two multiply too.
    half = ((c & _i32(0x80)) << _i32(8)) | ((c & _i32(0x7F)) << _i32(7))
    if kind == E4M3FN:
        v = f32_from_f16_bits(half) * np.float32(256.0)
        nan = (c & _i32(0x7F)) == _i32(0x7F)
    else:
        v = f32_from_f16_bits(half) * np.float32(128.0)
        nan = c == _i32(0x80)
    return np.float32(np.nan) if nan else v


@njit(inline="always")
def is_code_kind(kind):
    """Whether kind is a quantized code (the formats' kinds) rather than a model dtype."""
    return kind >= I8


@njit(inline="always")
def decode_element(raw, kind):
    """float32 value of one cache element of any kind (model dtype or code)."""
    if kind <= F16:
        return widen(raw, kind)
    return decode_code(raw, kind)


_OPTS = dict(cache=True, fastmath=False, error_model="numpy", boundscheck=False)

_u = np.uint64
_i32 = np.int32
_ONE = np.float32(1.0)
_ZERO = np.float32(0.0)
_NEG_INF = np.float32(-np.inf)
_CANONICAL_NAN = 0x7FC00000
# (y + 1.5 * 2^23) - 1.5 * 2^23 rounds fp32 y to an integer, half to even, for |y| < 2^22.
_RNE_MAGIC = np.float32(12582912.0)
# Tokens per parallel chunk of the write: one scratch row buffer per chunk.
_WRITE_CHUNK = 8
# Keys per attention tile: decoded K and V tiles (TILE x head_size fp32) stay in L1.
TILE = 32
_FUSED_ROWS = 8


@njit(inline="always")
def _strides3(a):
    """An operand's int64 [offset, *strides] (records.py) as scalars, which stay in registers
    where array elements would be reloaded after every store."""
    return a[0], a[1], a[2]


@njit(inline="always")
def _strides4(a):
    return a[0], a[1], a[2], a[3]


@njit(inline="always")
def _strides5(a):
    return a[0], a[1], a[2], a[3], a[4]


# ----------------------------------------------------------------------------------------------
# Quantizing write: 8-bit rows
# ----------------------------------------------------------------------------------------------


@njit(inline="always")
def _finite_code(y, fmt, trunc, qmax, qmin):
    """Code of a finite y: clamp, then round to the format."""
    yc = min(max(y, qmin), qmax)
    if fmt == I8:
        return _i32(yc) if trunc else _i32((yc + _RNE_MAGIC) - _RNE_MAGIC)
    if fmt == E5M2:
        return encode_e5m2(yc)
    return encode_e4m3(yc, fmt == E4M3FNUZ)


@njit(inline="always")
def _code(y, fmt, trunc, qmax, qmin, nan_code, inf_pos, inf_neg):
    """Code of y = x * inv (or x / s): NaN -> nan_code, +-Inf -> inf_pos / inf_neg (the
    format's), else clamp + round."""
    magnitude = i32_from_f32(y) & _i32(0x7FFFFFFF)
    c = _finite_code(y, fmt, trunc, qmax, qmin)
    special = nan_code if magnitude > _i32(0x7F800000) else (inf_neg if y < _ZERO else inf_pos)
    return c if magnitude < _i32(0x7F800000) else special


@njit(inline="always")
def _load_row(src, s0, sd, kind, xf, n):
    for d in range(n):
        xf[_u(d)] = widen(src[_u(s0 + d * sd)], kind)


@njit(inline="always")
def _widen_absmax(src, s0, sd, kind, xf, n):
    amax = _i32(0)
    for d in range(n):
        v = widen(src[_u(s0 + d * sd)], kind)
        xf[_u(d)] = v
        # int32 lanes: numba types int32 & int32 as int64, and the builtin max widens too.
        b = _i32(i32_from_f32(v) & _i32(0x7FFFFFFF))
        amax = b if b > amax else amax
    return amax


# Inlined into _quantize_row, an ordinary compiled function, where LLVM vectorizes it (inside
# numba's parfor body it stayed scalar).
def _load_row_absmax(src, s0, sd, kind, xf, n):
    """Widen a row into xf and return max |x| as bits: magnitudes order like their bit
    patterns, NaN above +Inf, so an integer max is exact and NaN wins it."""


# Only the kinds src's carrier can hold (uint16: bf16/fp16, uint32: fp32) are compiled.
@overload(_load_row_absmax, inline="always")
def _load_row_absmax_overload(src, s0, sd, kind, xf, n):
    if src.dtype == types.uint16:

        def half(src, s0, sd, kind, xf, n):
            if kind == BF16:
                if sd == 1:
                    return _widen_absmax(src, s0, 1, BF16, xf, n)
                return _widen_absmax(src, s0, sd, BF16, xf, n)
            return _widen_absmax(src, s0, sd, F16, xf, n)

        return half
    return lambda src, s0, sd, kind, xf, n: _widen_absmax(src, s0, sd, F32, xf, n)


@njit(inline="always")
def _store_codes(xf, mul, div, dst, d0, dd, n, fmt, trunc, qmax, qmin, nan_code, inf_pos, inf_neg, checked):
    if not checked and dd == 1:
        # Finite scale, so every x is finite and |x * inv| <= ~qmax: no y can be non-finite.
        # Contiguous codes (both layouts): a unit-stride loop LLVM can vectorize. Strided codes
        # take the checked loop below, which gives the same codes for finite y.
        for d in range(n):
            dst[_u(d0 + d)] = _finite_code(xf[_u(d)] * mul, fmt, trunc, qmax, qmin)
    elif div:
        for d in range(n):
            dst[_u(d0 + d * dd)] = _code(xf[_u(d)] / mul, fmt, trunc, qmax, qmin, nan_code, inf_pos, inf_neg)
    else:
        for d in range(n):
            dst[_u(d0 + d * dd)] = _code(xf[_u(d)] * mul, fmt, trunc, qmax, qmin, nan_code, inf_pos, inf_neg)


# A compiled function rather than inlined: inlining both calls into the write tripled the
# first-call compile time. It must call no other compiled function: numba then drops the
# refcount updates of its array arguments, which otherwise cost an atomic increment and
# decrement per array per row, on counters both threads share (measured ~30% of the write).
@njit(cache=True, fastmath=False, error_model="numpy", boundscheck=False)
def _quantize_row(
    src,
    s0,
    sd,
    kind,
    xf,
    dst,
    d0,
    dd,
    n,
    fmt,
    trunc,
    qmax,
    qmin,
    nan_code,
    inf_pos,
    inf_neg,
    floor,
    per_tensor,
    tscale,
):
    """Quantize one row of n elements; returns the bits to store as its scale."""
    amax = _load_row_absmax(src, s0, sd, kind, xf, n)
    if per_tensor:
        mul = tscale
        scale = tscale
    else:
        scale = f32_from_bits(amax) / qmax
        if scale != scale:
            mul = scale
        else:
            scale = max(scale, floor)
            mul = _ONE / scale
    # Rows holding NaN/Inf (non-finite scale) and static scales (x / s may overflow) take the
    # loop that checks every y; the common row cannot produce a non-finite y.
    checked = per_tensor or not ((i32_from_f32(scale) & _i32(0x7FFFFFFF)) < _i32(0x7F800000))
    if fmt == I8:
        if trunc:
            _store_codes(xf, mul, per_tensor, dst, d0, dd, n, I8, True, qmax, qmin, nan_code, inf_pos, inf_neg, checked)
        else:
            _store_codes(
                xf, mul, per_tensor, dst, d0, dd, n, I8, False, qmax, qmin, nan_code, inf_pos, inf_neg, checked
            )
    elif fmt == E4M3FN:
        _store_codes(
            xf, mul, per_tensor, dst, d0, dd, n, E4M3FN, False, qmax, qmin, nan_code, inf_pos, inf_neg, checked
        )
    elif fmt == E5M2:
        _store_codes(xf, mul, per_tensor, dst, d0, dd, n, E5M2, False, qmax, qmin, nan_code, inf_pos, inf_neg, checked)
    else:
        _store_codes(
            xf, mul, per_tensor, dst, d0, dd, n, E4M3FNUZ, False, qmax, qmin, nan_code, inf_pos, inf_neg, checked
        )
    return _i32(_CANONICAL_NAN) if scale != scale else i32_from_f32(scale)


# ----------------------------------------------------------------------------------------------
# Dequantize / gather: 8-bit rows (and the model dtype's)
# ----------------------------------------------------------------------------------------------


@njit(inline="always")
def _decode_row(src, s0, sd, kind, dst, d0, dd, n, scale, scaled):
    """dst[d] = float32(code) * scale (scaled) or the widened element (mode none)."""
    if scaled:
        for d in range(n):
            dst[_u(d0 + d * dd)] = decode_element(src[_u(s0 + d * sd)], kind) * scale
    else:
        for d in range(n):
            dst[_u(d0 + d * dd)] = decode_element(src[_u(s0 + d * sd)], kind)


@njit(cache=True, fastmath=False, error_model="numpy", boundscheck=False)
def _decode_row_any(src, s0, sd, kind, dst, d0, dd, n, scale, scaled):
    if kind == I8:
        _decode_row(src, s0, sd, I8, dst, d0, dd, n, scale, scaled)
    elif kind == E4M3FN:
        _decode_row(src, s0, sd, E4M3FN, dst, d0, dd, n, scale, scaled)
    elif kind == E4M3FNUZ:
        _decode_row(src, s0, sd, E4M3FNUZ, dst, d0, dd, n, scale, scaled)
    elif kind == E5M2:
        _decode_row(src, s0, sd, E5M2, dst, d0, dd, n, scale, scaled)
    elif kind == BF16:
        _decode_row(src, s0, sd, BF16, dst, d0, dd, n, scale, scaled)
    elif kind == F16:
        _decode_row(src, s0, sd, F16, dst, d0, dd, n, scale, scaled)
    else:
        _decode_row(src, s0, sd, F32, dst, d0, dd, n, scale, scaled)


# ----------------------------------------------------------------------------------------------
# int4 per-token-head (SPEC.md section 2's int4 rows): two 4-bit codes per byte (element 2j in the low
# nibble of byte j), an asymmetric scale per row whose word carries the row's zero point in its
# low 4 bits, and for the rotated mode a sign flip and Walsh-Hadamard butterfly before encoding.
# ----------------------------------------------------------------------------------------------

# The bits of a uint4 row's scale word that hold its zero point (kvzoo.formats' UINT4 has 4
# zero-point bits; tests/test_numba_int4.py holds the two together), and the rest: the scale.
_ZP_MASK = _i32(0xF)
_SCALE_BITS = _i32(-16)  # 0xFFFFFFF0


@njit(inline="always")
def _rht_block(n, d):
    """The size of element d's rotation block (SPEC.md 3.4): the largest power of two <= n ^ d."""
    b = n ^ d
    while b & (b - 1):
        b &= b - 1
    return b


@njit(inline="always")
def _fwht_lanes(t, n, lanes):
    """SPEC.md 3.4's butterflies on `lanes` rows of n elements at once, in place, in float32:
    in each block (n's binary digits, largest first; a power of two is one block), for h = 1,
    2, 4, ..., size/2 in that order, each pair (x[i], x[i+h]) of a row with i & h == 0 becomes
    (x[i] + x[i+h], x[i] - x[i+h]), every add and subtract one rounding of the previous stage's
    values (so only the stage order and the pairing fix the result). The rows are held
    element-major, element d of row r at t[d*lanes + r], so the innermost loop runs over rows
    and vectorizes at every stage; one row at a time, stages 1, 2 and 4 pair elements within a
    vector (D = 128: 27 ns a row over 64 rows, against 180 ns a row alone, measured)."""
    start = 0
    while start < n:
        size = _rht_block(n, start)
        h = 1
        while h < size:
            for b in range(start, start + size, 2 * h):
                for i in range(b, b + h):
                    a0 = i * lanes
                    c0 = (i + h) * lanes
                    for r in range(lanes):
                        a = t[_u(a0 + r)]
                        c = t[_u(c0 + r)]
                        t[_u(a0 + r)] = a + c
                        t[_u(c0 + r)] = a - c
            h *= 2
        start += size


@njit(inline="always")
def _through_bf16(x):
    """x rounded to bfloat16 (nearest even, beyond its range +-Inf) and widened back; a NaN
    stays a NaN (the integer rounding would carry a NaN's mantissa into its sign)."""
    u = i32_from_f32(x)
    rounded = _i32(u + _i32(_i32(0x7FFF) + _i32(_i32(u >> _i32(16)) & _i32(1)))) & _i32(-65536)
    return x if x != x else f32_from_bits(rounded)


@njit(inline="always")
def _narrow_like_input(x, n, kind):
    """SPEC.md 3.4 step 3: each of x[0:n] rounded to the input's dtype and widened back."""
    if kind == BF16:
        for d in range(n):
            x[_u(d)] = _through_bf16(x[_u(d)])
    elif kind == F16:
        for d in range(n):
            x[_u(d)] = f32_through_f16(x[_u(d)])


@njit(inline="always")
def _u4_code(v, qmax, qmin):
    """SPEC.md 3.5's R(v) for a finite v: clamped to [qmin, qmax] = [0, 15], then the integer
    part of fl(v + 0.5) (vLLM's (v + 0.5).to(int32): half away from zero through one add)."""
    return _i32(min(max(v, qmin), qmax) + np.float32(0.5))


@njit(inline="always")
def _encode_u4(xf, dst, d0, dd, n, qmax, qmin, floor):
    """SPEC.md 3.5 on the float32 row xf[0:n] (rotated and narrowed already, or not): n / 2
    bytes of two codes at dst[d0 + j * dd]; returns the scale word."""
    # One integer pass (it vectorizes; a float max without nnan does not): the magnitude bits'
    # max (NaN and Inf above every finite), and the ends of the range as ordered keys, which
    # start at +0's key so the range holds 0. -0's key (-1) moves neither end once decoded.
    amax = _i32(0)
    hi_key = _i32(0)
    lo_key = _i32(0)
    for d in range(n):
        bits = i32_from_f32(xf[_u(d)])
        mag = _i32(bits & _i32(0x7FFFFFFF))
        amax = mag if mag > amax else amax
        key = _i32(bits ^ _i32(_i32(bits >> _i32(31)) & _i32(0x7FFFFFFF)))
        hi_key = key if key > hi_key else hi_key
        lo_key = key if key < lo_key else lo_key
    hi = f32_from_bits(hi_key)
    lo = f32_from_bits(_i32(lo_key ^ _i32(0x7FFFFFFF))) if lo_key < _i32(-1) else _ZERO
    span = hi - lo
    if amax >= _i32(0x7F800000) or not span < np.float32(np.inf):
        # A NaN or Inf in the row, or a range beyond float32: codes 0 under the NaN word.
        for j in range(n // 2):
            dst[_u(d0 + j * dd)] = 0
        return _i32(_CANONICAL_NAN)
    q = span / (qmax - qmin)
    scale = q if q > floor else floor
    zp = _u4_code(-lo / scale, qmax, qmin)
    inv = _ONE / scale
    zpf = np.float32(zp)
    for j in range(n // 2):
        # Two roundings each (the product, then the zero point added): no fused multiply-add.
        c0 = _u4_code(xf[_u(2 * j)] * inv + zpf, qmax, qmin)
        c1 = _u4_code(xf[_u(2 * j + 1)] * inv + zpf, qmax, qmin)
        dst[_u(d0 + j * dd)] = c0 | (c1 << _i32(4))
    return _i32(i32_from_f32(scale) & _SCALE_BITS) | zp


# The row functions below are compiled functions for the reason _quantize_row is one (they
# call no other compiled function, so their array arguments cost no refcount updates).
@njit(cache=True, fastmath=False, error_model="numpy", boundscheck=False)
def _quantize_row_u4(src, s0, sd, kind, xf, dst, d0, dd, n, qmax, qmin, floor):
    """One row of the unrotated mode: widened into xf, then _encode_u4."""
    _load_row_absmax(src, s0, sd, kind, xf, n)
    return _encode_u4(xf, dst, d0, dd, n, qmax, qmin, floor)


@njit(cache=True, fastmath=False, error_model="numpy", boundscheck=False)
def _rotate_rows_u4(src, st, kind, t_lo, t_hi, num_heads, n, signs, lanes, xf):
    """SPEC.md 3.4 steps 1-2 on the rows of tokens t_lo..t_hi-1, every head, at once: row r =
    (t - t_lo) * num_heads + h goes to lanes[d * rows + r] (element-major, see _fwht_lanes)."""
    rows = (t_hi - t_lo) * num_heads
    for t in range(t_lo, t_hi):
        for h in range(num_heads):
            _load_row_absmax(src, st[0] + t * st[1] + h * st[2], st[3], kind, xf, n)
            r = (t - t_lo) * num_heads + h
            for d in range(n):
                lanes[_u(d * rows + r)] = xf[_u(d)] * signs[_u(d)]
    _fwht_lanes(lanes, n, rows)


@njit(cache=True, fastmath=False, error_model="numpy", boundscheck=False)
def _quantize_rotated_u4(lanes, r, rows, kind, xf, dst, d0, dd, n, qmax, qmin, floor):
    """Row r of _rotate_rows_u4's output: narrowed to the input dtype (SPEC.md 3.4 step 3) in xf,
    then _encode_u4."""
    for d in range(n):
        xf[_u(d)] = lanes[_u(d * rows + r)]
    _narrow_like_input(xf, n, kind)
    return _encode_u4(xf, dst, d0, dd, n, qmax, qmin, floor)


@njit(inline="always")
def _unrotate_lanes(t, n, lanes, signs):
    """SPEC.md 3.4's float32 inverse on `lanes` rows of n elements held element-major (see
    _fwht_lanes), in place: fl(fl(fwht(y) * s) / B), B each element's block size."""
    _fwht_lanes(t, n, lanes)
    for d in range(n):
        dsize = np.float32(_rht_block(n, d))
        for r in range(lanes):
            t[_u(d * lanes + r)] = (t[_u(d * lanes + r)] * signs[_u(d)]) / dsize


@njit(inline="always")
def _u4_values(b, zp):
    """The values code - zp of the two codes of byte b (as int32, sign-extended from the int8
    carrier, see __init__._cache_kind): exact integers, as float32."""
    lo = _i32(b & _ZP_MASK)
    hi = _i32(_i32(b >> _i32(4)) & _ZP_MASK)
    return np.float32(_i32(lo - zp)), np.float32(_i32(hi - zp))


@njit(inline="always")
def _decode_u4_row(src, a, sd, zp, dst, d0, half):
    """The values code - zp of the uint4 row of half bytes at src[a + j * sd] into dst[d0:],
    even elements then odd (the attention products' order)."""
    for j in range(half):
        lo, hi = _u4_values(_i32(src[_u(a + j * sd)]), zp)
        dst[_u(d0 + j)] = lo
        dst[_u(d0 + half + j)] = hi


# ----------------------------------------------------------------------------------------------
# The write: keys and values each in their own side's format
# ----------------------------------------------------------------------------------------------

# A side's path is chosen by the carrier of its pages (__init__._cache_kind): uint8 holds 8-bit
# codes, int8 uint4 bytes, uint16 / uint32 the model dtype's bits (mode none). The carrier is
# part of the compiled signature, so a kernel compiles a side's path only where a side of that
# format can reach it, and a mode storing keys and values in two formats (a split mode) runs
# the two paths the one-format modes compile too: a pairing, not a path of its own.


def _rotate_side(codes, src, st, kind, t_lo, t_hi, num_heads, n, rotated, signs, lanes, xf):
    """SPEC.md 3.4 steps 1-2 on a rotated side's rows of tokens t_lo..t_hi-1, into lanes (the
    kernels rotate uint4 rows only; the registration declines a mode rotating any other)."""


@overload(_rotate_side, inline="always")
def _rotate_side_overload(codes, src, st, kind, t_lo, t_hi, num_heads, n, rotated, signs, lanes, xf):
    if codes.dtype == types.int8:

        def rotate(codes, src, st, kind, t_lo, t_hi, num_heads, n, rotated, signs, lanes, xf):
            if rotated:
                _rotate_rows_u4(src, st, kind, t_lo, t_hi, num_heads, n, signs, lanes, xf)

        return rotate
    return lambda codes, src, st, kind, t_lo, t_hi, num_heads, n, rotated, signs, lanes, xf: None


def _store_row(codes, d0, dd, src, s0, sd, kind, xf, lanes, r, rows, n, side, enc):
    """One row into a side's pages at codes[d0 + d * dd], from src[s0 + d * sd] (a rotated
    side's: row r of lanes); returns the row's scale word (0 where the side keeps none)."""


@overload(_store_row, inline="always")
def _store_row_overload(codes, d0, dd, src, s0, sd, kind, xf, lanes, r, rows, n, side, enc):
    if codes.dtype == types.int8:

        def uint4(codes, d0, dd, src, s0, sd, kind, xf, lanes, r, rows, n, side, enc):
            if side.rotated:
                return _quantize_rotated_u4(lanes, r, rows, kind, xf, codes, d0, dd, n, enc.qmax, enc.qmin, enc.floor)
            return _quantize_row_u4(src, s0, sd, kind, xf, codes, d0, dd, n, enc.qmax, enc.qmin, enc.floor)

        return uint4
    if codes.dtype == types.uint8:

        def eight_bit(codes, d0, dd, src, s0, sd, kind, xf, lanes, r, rows, n, side, enc):
            return _quantize_row(
                src, s0, sd, kind, xf, codes, d0, dd, n, side.kind, enc.trunc, enc.qmax, enc.qmin, enc.nan_code,
                enc.inf_pos, enc.inf_neg, enc.floor, not side.per_token_head, side.tensor_scale,
            )  # fmt: skip

        return eight_bit

    def plain(codes, d0, dd, src, s0, sd, kind, xf, lanes, r, rows, n, side, enc):
        # Mode none: the row's bits, as given.
        for d in range(n):
            codes[_u(d0 + d * dd)] = src[_u(s0 + d * sd)]
        return _i32(0)

    return plain


# The parallel body only calls this, so the refcount updates of the arrays passed down happen
# once per chunk of tokens, not once per row.
@njit(cache=True, fastmath=False, error_model="numpy", boundscheck=False)
def _write_side(t_lo, t_hi, xf, lanes, src, st, kind, side, enc, slots, num_slots, block_size, num_heads, n):
    """One side's rows of tokens t_lo..t_hi-1 (src, with st's strides) into its pages, in the
    side's format (see write); lanes holds a rotated side's rotated rows."""
    codes, cs, scs = side.codes, _strides5(side.strides), _strides4(side.scale_strides)
    ss = _strides4(st)
    rows = (t_hi - t_lo) * num_heads
    _rotate_side(codes, src, st, kind, t_lo, t_hi, num_heads, n, side.rotated, side.signs, lanes, xf)
    for t in range(t_lo, t_hi):
        slot = slots[t]
        # Past-the-end slots reach here only with validation off: skipped like negative
        # ones, so nothing is written outside the cache.
        if slot < 0 or slot >= num_slots:
            continue
        blk = slot // block_size
        off = slot - blk * block_size
        for h in range(num_heads):
            d0 = cs[0] + blk * cs[1] + off * cs[2] + h * cs[3]
            s0 = ss[0] + t * ss[1] + h * ss[2]
            r = (t - t_lo) * num_heads + h
            bits = _store_row(codes, d0, cs[4], src, s0, ss[3], kind, xf, lanes, r, rows, n, side, enc)
            if side.per_token_head:
                side.scales[_u(scs[0] + blk * scs[1] + off * scs[2] + h * scs[3])] = bits


@njit(**_OPTS)
def write(rows, keys, values, key_encoding, value_encoding, slots, num_slots, block_size, num_heads, head_size):
    """reshape_and_cache, every mode: the K and V rows (records.Rows) into their pages, each
    side (records.Side) in its own format (records.Encoding). The records arrive as plain
    tuples of their fields (records.py) and are named here."""
    _write_chunks(
        Rows(*rows), Side(*keys), Side(*values), Encoding(*key_encoding), Encoding(*value_encoding), slots,
        num_slots, block_size, num_heads, head_size,
    )  # fmt: skip


@njit(parallel=True, **_OPTS)
def _write_chunks(rows, keys, values, key_encoding, value_encoding, slots, num_slots, block_size, num_heads, head_size):
    """write, parallel over chunks of tokens, heads inside."""
    num_tokens = slots.shape[0]
    lanes = _WRITE_CHUNK * num_heads * head_size if keys.rotated or values.rotated else 0
    for chunk in prange((num_tokens + _WRITE_CHUNK - 1) // _WRITE_CHUNK):
        t_lo = chunk * _WRITE_CHUNK
        t_hi = min(num_tokens, t_lo + _WRITE_CHUNK)
        xf = np.empty(head_size, dtype=np.float32)
        rotated = np.empty(lanes, dtype=np.float32)
        _write_side(
            t_lo, t_hi, xf, rotated, rows.key, rows.key_strides, rows.kind, keys, key_encoding, slots, num_slots,
            block_size, num_heads, head_size,
        )  # fmt: skip
        _write_side(
            t_lo, t_hi, xf, rotated, rows.value, rows.value_strides, rows.kind, values, value_encoding, slots,
            num_slots, block_size, num_heads, head_size,
        )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Dequantize / gather
# ----------------------------------------------------------------------------------------------


def _dequantize_row(codes, c0, cd, word, side, lanes, r, rows, out, o0, od, n):
    """A side's row at codes[c0 + d * cd] decoded into out[o0 + d * od] (word: its scale word
    where the side keeps one); a uint4 row into row r of lanes instead (element-major, see
    _fwht_lanes), its stored values (code - zp) * scale before any rotation is undone."""


@overload(_dequantize_row, inline="always")
def _dequantize_row_overload(codes, c0, cd, word, side, lanes, r, rows, out, o0, od, n):
    if codes.dtype == types.int8:

        def uint4(codes, c0, cd, word, side, lanes, r, rows, out, o0, od, n):
            scale = f32_from_bits(word & _SCALE_BITS)
            zp = _i32(word & _ZP_MASK)
            for j in range(n // 2):
                lo, hi = _u4_values(_i32(codes[_u(c0 + j * cd)]), zp)
                lanes[_u(2 * j * rows + r)] = lo * scale
                lanes[_u((2 * j + 1) * rows + r)] = hi * scale

        return uint4

    def elements(codes, c0, cd, word, side, lanes, r, rows, out, o0, od, n):
        scale = f32_from_bits(word) if side.per_token_head else side.tensor_scale
        _decode_row_any(codes, c0, cd, side.kind, out, o0, od, n, scale, is_code_kind(side.kind))

    return elements


def _lanes_out(codes, rotated, signs, lanes, rows, n, out, os_, t_lo, t_hi, num_heads):
    """A uint4 side's rows from lanes into out, a rotated side's rotation undone first (SPEC.md
    3.4's float32 inverse); nothing for other sides, which decode into out directly."""


@overload(_lanes_out, inline="always")
def _lanes_out_overload(codes, rotated, signs, lanes, rows, n, out, os_, t_lo, t_hi, num_heads):
    if codes.dtype == types.int8:

        def uint4(codes, rotated, signs, lanes, rows, n, out, os_, t_lo, t_hi, num_heads):
            if rotated:
                _unrotate_lanes(lanes, n, rows, signs)
            for t in range(t_lo, t_hi):
                for h in range(num_heads):
                    r = (t - t_lo) * num_heads + h
                    o0 = os_[0] + t * os_[1] + h * os_[2]
                    for d in range(n):
                        out[_u(o0 + d * os_[3])] = lanes[_u(d * rows + r)]

        return uint4
    return lambda codes, rotated, signs, lanes, rows, n, out, os_, t_lo, t_hi, num_heads: None


@njit(cache=True, fastmath=False, error_model="numpy", boundscheck=False)
def _dequantize_tokens(t_lo, t_hi, lanes, side, block_tables, cu_seq_lens, out, os_, num_heads, n, block_size):
    """dequantize of the output rows t_lo..t_hi-1, every head, into the model's basis:
    float32(code) * scale, a uint4 row's fl((code - zp) * scale) then (rotated) SPEC.md 3.4's
    float32 inverse fl(fl(fwht(y) * s) / B), its rows held in lanes."""
    cs, ss = _strides5(side.strides), _strides4(side.scale_strides)
    rows = (t_hi - t_lo) * num_heads
    for t in range(t_lo, t_hi):
        s = np.searchsorted(cu_seq_lens, t, side="right") - 1
        i = t - cu_seq_lens[s]
        blk = block_tables[s, i // block_size]
        off = i - (i // block_size) * block_size
        for h in range(num_heads):
            # A side without per-row scales has the one-word stand-in and zero strides: word 0.
            word = _i32(side.scales[_u(ss[0] + blk * ss[1] + off * ss[2] + h * ss[3])])
            c0 = cs[0] + blk * cs[1] + off * cs[2] + h * cs[3]
            o0 = os_[0] + t * os_[1] + h * os_[2]
            r = (t - t_lo) * num_heads + h
            _dequantize_row(side.codes, c0, cs[4], word, side, lanes, r, rows, out, o0, os_[3], n)
    _lanes_out(side.codes, side.rotated, side.signs, lanes, rows, n, out, os_, t_lo, t_hi, num_heads)


@njit(**_OPTS)
def dequantize(side, block_tables, cu_seq_lens, out, os_, num_heads, head_size, block_size):
    """Gather the tokens of each sequence and decode them (see _dequantize_tokens): side a
    records.Side (a plain tuple of its fields, records.py), out flat float32 with (offset, sT,
    sH, sD)."""
    _dequantize_chunks(Side(*side), block_tables, cu_seq_lens, out, os_, num_heads, head_size, block_size)


@njit(parallel=True, **_OPTS)
def _dequantize_chunks(side, block_tables, cu_seq_lens, out, os_, num_heads, head_size, block_size):
    """dequantize, parallel over chunks of tokens."""
    total = cu_seq_lens[cu_seq_lens.shape[0] - 1]
    lanes = _WRITE_CHUNK * num_heads * head_size if side.kind == U4 else 0
    for chunk in prange((total + _WRITE_CHUNK - 1) // _WRITE_CHUNK):
        t_lo = chunk * _WRITE_CHUNK
        t_hi = min(total, t_lo + _WRITE_CHUNK)
        rows = np.empty(lanes, dtype=np.float32)
        _dequantize_tokens(
            t_lo, t_hi, rows, side, block_tables, cu_seq_lens, out, os_, num_heads, head_size, block_size
        )


# ----------------------------------------------------------------------------------------------
# Paged attention
# ----------------------------------------------------------------------------------------------


# Inner loops of attention are separate compiled functions (LLVM may still inline them): inside
# numba's parfor body they were left scalar (fp8 decode measured 2.5x slower than int8).
_LEAF = dict(cache=True, fastmath=False, error_model="numpy", boundscheck=False)


@njit(inline="always")
def _tile_element(raw, kind):
    """Attention's K/V tile value of one element: decode_element, except that e4m3 codes come
    out times 2^-8 (e4m3fn) or 2^-7 (e4m3fnuz), exactly (_tile_factor undoes it).

    Skipping decode_code's power-of-two multiply and building the half from the sign-extended
    code (sign lands in bit 15, bit 14 is masked off) takes fp8 decode from 9 to 6 vector
    instructions per 8 codes; at 4 query rows per item, decode is a large share of a tile's work.
    """
    if kind == E4M3FN or kind == E4M3FNUZ:
        # int16 throughout, each step cast back: numba widens int op int to int64, and 16-bit
        # lanes halve the vector instructions of the integer steps.
        a = _i16(_i16(np.int8(raw)) << _i16(7))  # bits 15 and 14 are both the sign
        if kind == E4M3FN:
            # Bit 14 must become 0, or 1 for the NaN codes (bits 13..7 all set: a half with
            # exponent 31 and a nonzero mantissa). Adding 2^7 carries into bit 14 exactly for
            # those, so bit 14 of a ^ (a + 2^7) is the NaN flag: an add and one and-xor
            # instead of a mask, a compare and a blend (the compare shares the conversion's port).
            return f32_from_f16_bits(_i16(a ^ _i16(_i16(a + _i16(0x80)) & _i16(0x4000))))
        half = _i16(a & _i16(-0x4080))  # bits 0xBF80
        v = f32_from_f16_bits(half)
        return np.float32(np.nan) if half == _i16(-0x8000) else v
    return decode_element(raw, kind)


@njit(inline="always")
def _tile_factor(kind):
    """What _tile_element's values are multiplied by to give the codes' values (a power of two:
    the product with a score or an output sum is exact, so results match an exact decode)."""
    if kind == E4M3FN:
        return np.float32(256.0)
    if kind == E4M3FNUZ:
        return np.float32(128.0)
    return _ONE


# A row is read element by element, or for uint4 two elements to a byte: the drivers below
# (_decode_rows, _scores_of, _accumulate_of) take the functions that read one row as arguments,
# and numba inlines both, so each driver is one copy of its loops in the source and each kind's
# compiled copy holds its own row functions only.


@njit(inline="always")
def _decode_row_elements(src, s0, sd, kind, zps, kk, dst, d0, n):
    """dst[d0:d0+n] = the tile values of row kk, at src[s0 + d * sd] (_tile_element's)."""
    for d in range(n):
        dst[_u(d0 + d)] = _tile_element(src[_u(s0 + d * sd)], kind)


@njit(inline="always")
def _decode_row_pairs(src, s0, sd, kind, zps, kk, dst, d0, n):
    """dst[d0:d0+n] = uint4 row kk's codes - zps[kk], even elements then odd."""
    _decode_u4_row(src, s0, sd, zps[kk], dst, d0, n // 2)


@njit(inline="always")
def _decode_rows(row, src, st, kind, zps, block_tables, seq, bi, off, g, n, dst, hd, block_size):
    for kk in range(n):
        blk = block_tables[seq, bi]
        a = st[0] + blk * st[1] + off * st[2] + g * st[3]
        if st[4] == 1:  # the stride a constant, so the loop vectorizes
            row(src, a, 1, kind, zps, kk, dst, kk * hd, hd)
        else:
            row(src, a, st[4], kind, zps, kk, dst, kk * hd, hd)
        off += 1
        if off == block_size:
            off = 0
            bi += 1


@njit(inline="always")
def _decode_element_rows(src, st, kind, zps, block_tables, seq, bi, off, g, n, dst, hd, block_size):
    _decode_rows(_decode_row_elements, src, st, kind, zps, block_tables, seq, bi, off, g, n, dst, hd, block_size)


def _decode_rows_any(src, st, kind, zps, block_tables, seq, bi, off, g, n, dst, hd, block_size):
    """_decode_rows for the kinds src's carrier can hold (uint8: 8-bit codes, int8: uint4 bytes,
    uint16: bf16/fp16, uint32: fp32), chosen at typing time: each inlined decode loop is
    compiled only where some mode can reach it."""


@overload(_decode_rows_any)
def _decode_rows_any_overload(src, st, kind, zps, block_tables, seq, bi, off, g, n, dst, hd, block_size):
    if src.dtype == types.uint8:

        def codes(src, st, kind, zps, block_tables, seq, bi, off, g, n, dst, hd, block_size):
            if kind == I8:
                _decode_element_rows(src, st, I8, zps, block_tables, seq, bi, off, g, n, dst, hd, block_size)
            elif kind == E4M3FN:
                _decode_element_rows(src, st, E4M3FN, zps, block_tables, seq, bi, off, g, n, dst, hd, block_size)
            elif kind == E5M2:
                _decode_element_rows(src, st, E5M2, zps, block_tables, seq, bi, off, g, n, dst, hd, block_size)
            else:
                _decode_element_rows(src, st, E4M3FNUZ, zps, block_tables, seq, bi, off, g, n, dst, hd, block_size)

        return codes
    if src.dtype == types.int8:

        def nibbles(src, st, kind, zps, block_tables, seq, bi, off, g, n, dst, hd, block_size):
            _decode_rows(_decode_row_pairs, src, st, U4, zps, block_tables, seq, bi, off, g, n, dst, hd, block_size)

        return nibbles
    if src.dtype == types.uint16:

        def half(src, st, kind, zps, block_tables, seq, bi, off, g, n, dst, hd, block_size):
            if kind == BF16:
                _decode_element_rows(src, st, BF16, zps, block_tables, seq, bi, off, g, n, dst, hd, block_size)
            else:
                _decode_element_rows(src, st, F16, zps, block_tables, seq, bi, off, g, n, dst, hd, block_size)

        return half

    def single(src, st, kind, zps, block_tables, seq, bi, off, g, n, dst, hd, block_size):
        _decode_element_rows(src, st, F32, zps, block_tables, seq, bi, off, g, n, dst, hd, block_size)

    return single


@njit(**_LEAF)
def _decode_tile(src, st, kind, zps, block_tables, seq, bi, off, g, n, dst, hd, block_size):
    """dst[kk*hd:(kk+1)*hd] = float32 values of the n rows starting at page index bi, offset
    off (codes unscaled; e4m3 values divided by _tile_factor; uint4 rows codes - zps[kk], even
    elements then odd). One call per tile: per-row calls cost as much as the decode."""
    _decode_rows_any(src, st, kind, zps, block_tables, seq, bi, off, g, n, dst, hd, block_size)


@njit(**_LEAF)
def _scale(acc, a0, alpha, n):
    for d in range(n):
        acc[_u(a0 + d)] *= alpha


# The one place fastmath flags are used: attention's two products, q.k and p.v. "reassoc" lets
# LLVM split the q.k sum into vector lanes and "contract" lets it fuse multiply-adds. They change
# rounding and summation order only in attention, whose output is compared with a tolerance,
# never as bytes; NaN/Inf/signed-zero semantics stay IEEE because nnan/ninf/nsz/afn/arcp are not
# set. The code path is the same for every sequence, so output stays batch invariant. Compiled
# as their own functions so the flags stay on these instructions only.
DOT_FASTMATH = frozenset({"reassoc", "contract"})
AXPY_FASTMATH = frozenset({"contract"})


def _kv(src, i, kind):
    """K/V tile value at src[i]: src is a decoded float32 tile, or the cache's codes (decoded
    here as _tile_element does, so both give the same value)."""


@overload(_kv)
def _kv_overload(src, i, kind):
    if isinstance(src.dtype, types.Float):

        def load(src, i, kind):
            return src[i]

        return load

    def decode(src, i, kind):
        return _tile_element(src[i], kind)

    return decode


# uint4 rows (SPEC.md 8.4): byte j holds elements 2j and 2j + 1, and the products take a row
# in the order "even elements, then odd" (element 2j at j, 2j + 1 at D/2 + j), so each loop
# runs over a row's D/2 bytes with unit-stride query, accumulator and byte operands. A uint4
# key side keeps the item's query rows in that order (_u4_query_rows), a uint4 value side its
# accumulators (_u4_output_rows). Each code enters as code - zp, exact, keeping the zero point
# out of the products' rounding (SPEC.md's q . codes - sum(q) * zp form subtracts two large
# sums).


def _u4_pair(src, a, j, half, zp):
    """Elements 2j and 2j + 1 of the uint4 row at src[a:], as (code - zp) float32 values:
    decoded from byte a + j of the cache, or read from a decoded tile (at a + j, a + half + j)."""


@overload(_u4_pair, inline="always")
def _u4_pair_overload(src, a, j, half, zp):
    if isinstance(src.dtype, types.Float):
        return lambda src, a, j, half, zp: (src[_u(a + j)], src[_u(a + half + j)])
    return lambda src, a, j, half, zp: _u4_values(_i32(src[_u(a + j)]), zp)


# The K/V rows of a tile come either decoded (a float32 tile, row kk at rowa[kk]) or as code
# rows in the cache (row kk at rowa[kk]), decoded inside the loops below. The second is for few
# query rows: each code is then decoded once per 4 rows in registers, instead of once per tile
# into a buffer that is stored and loaded again. Both give the same bytes: a decoded tile holds
# a row's values in the order the loops take them from the codes (uint4: even then odd), q . k
# sums them in the same order either way, and each element of p . v takes its terms in key
# order with the same expression (tests/test_numba_attention_speed_parity.py holds the two
# paths together). kind U4 says a row is uint4's (src the cache's int8 bytes or their tile).


@njit(inline="always")
def _dot_elements(q, q0, src, k0, kind, zps, kk, hd):
    """q[q0:q0+hd] . K row kk (at src[k0:])."""
    acc = _ZERO
    for d in range(hd):
        acc += q[_u(q0 + d)] * _kv(src, _u(k0 + d), kind)
    return acc


@njit(inline="always")
def _dot4_elements(q, q0, src, k0, kind, zps, kk, hd):
    """_dot_elements of the four query rows from q0 (hd apart): each K element loaded (and
    decoded) once for the four, every row's sum still its own reduction, in the same order."""
    q1, q2, q3 = q0 + hd, q0 + 2 * hd, q0 + 3 * hd
    s0, s1, s2, s3 = _ZERO, _ZERO, _ZERO, _ZERO
    for d in range(hd):
        kv = _kv(src, _u(k0 + d), kind)
        s0 += q[_u(q0 + d)] * kv
        s1 += q[_u(q1 + d)] * kv
        s2 += q[_u(q2 + d)] * kv
        s3 += q[_u(q3 + d)] * kv
    return s0, s1, s2, s3


@njit(inline="always")
def _dot_pairs(q, q0, src, k0, kind, zps, kk, hd):
    """_dot_elements of a uint4 K row, its values and q's in even-then-odd order."""
    acc = _ZERO
    half = hd // 2
    zp = zps[kk]
    for j in range(half):
        lo, hi = _u4_pair(src, k0, j, half, zp)
        acc += q[_u(q0 + j)] * lo + q[_u(q0 + half + j)] * hi
    return acc


@njit(inline="always")
def _dot4_pairs(q, q0, src, k0, kind, zps, kk, hd):
    """_dot4_elements of a uint4 K row (see _dot_pairs)."""
    q1, q2, q3 = q0 + hd, q0 + 2 * hd, q0 + 3 * hd
    s0, s1, s2, s3 = _ZERO, _ZERO, _ZERO, _ZERO
    half = hd // 2
    zp = zps[kk]
    for j in range(half):
        lo, hi = _u4_pair(src, k0, j, half, zp)
        s0 += q[_u(q0 + j)] * lo + q[_u(q0 + half + j)] * hi
        s1 += q[_u(q1 + j)] * lo + q[_u(q1 + half + j)] * hi
        s2 += q[_u(q2 + j)] * lo + q[_u(q2 + half + j)] * hi
        s3 += q[_u(q3 + j)] * lo + q[_u(q3 + half + j)] * hi
    return s0, s1, s2, s3


@njit(inline="always")
def _scores_of(dot4, dot, q, rows, src, rowa, kind, zps, n, hd, out, factor):
    # Four rows per pass (dot4), then the rest one at a time (dot).
    r = 0
    while r + 4 <= rows:
        for kk in range(n):
            s0, s1, s2, s3 = dot4(q, r * hd, src, rowa[kk], kind, zps, kk, hd)
            out[_u(r * TILE + kk)] = s0 * factor
            out[_u(r * TILE + TILE + kk)] = s1 * factor
            out[_u(r * TILE + 2 * TILE + kk)] = s2 * factor
            out[_u(r * TILE + 3 * TILE + kk)] = s3 * factor
        r += 4
    for row in range(r, rows):
        for kk in range(n):
            out[_u(row * TILE + kk)] = dot(q, row * hd, src, rowa[kk], kind, zps, kk, hd) * factor


@njit(cache=True, fastmath=set(DOT_FASTMATH), error_model="numpy", boundscheck=False)
def _scores(q, rows, src, rowa, kind, zps, n, hd, out, factor):
    """out[r*TILE + kk] = (q[r] . K row kk) * factor for every query row and the n keys of a
    tile; K rows at src[rowa[kk]:], 8-bit codes of the given kind in the cache."""
    if kind == E4M3FN:
        _scores_of(_dot4_elements, _dot_elements, q, rows, src, rowa, E4M3FN, zps, n, hd, out, factor)
    elif kind == E4M3FNUZ:
        _scores_of(_dot4_elements, _dot_elements, q, rows, src, rowa, E4M3FNUZ, zps, n, hd, out, factor)
    elif kind == E5M2:
        _scores_of(_dot4_elements, _dot_elements, q, rows, src, rowa, E5M2, zps, n, hd, out, factor)
    else:
        _scores_of(_dot4_elements, _dot_elements, q, rows, src, rowa, I8, zps, n, hd, out, factor)


# A decoded float32 tile reads the same whatever the kind: one copy of the loops, not four.
@njit(cache=True, fastmath=set(DOT_FASTMATH), error_model="numpy", boundscheck=False)
def _scores_tile(q, rows, src, rowa, kind, zps, n, hd, out, factor):
    """_scores on a tile decoded from 8-bit codes or the model dtype's elements."""
    _scores_of(_dot4_elements, _dot_elements, q, rows, src, rowa, I8, zps, n, hd, out, factor)


@njit(cache=True, fastmath=set(DOT_FASTMATH), error_model="numpy", boundscheck=False)
def _scores_u4(q, rows, src, rowa, kind, zps, n, hd, out, factor):
    """_scores on uint4 rows, the cache's bytes or a tile decoded from them, zero points zps."""
    _scores_of(_dot4_pairs, _dot_pairs, q, rows, src, rowa, U4, zps, n, hd, out, factor)


def _product_for(pages, src, eight_bit, uint4, tile):
    """At typing time, the compiled product for a side whose pages have the type of pages, read
    from src (the pages themselves, or a tile decoded from them): uint4 for uint4 pages (int8),
    eight_bit on 8-bit codes, tile on a tile decoded from them or from the model dtype's
    elements; None for those elements themselves, which reach the products decoded."""
    if pages.dtype == types.int8:
        return uint4
    if src.dtype == types.uint8:
        return eight_bit
    return tile if isinstance(src.dtype, types.Float) else None


def _side_scores(codes, q, rows, src, rowa, kind, zps, n, hd, out, factor):
    """The q . k of a tile of the key side whose pages are codes (_product_for)."""


@overload(_side_scores)
def _side_scores_overload(codes, q, rows, src, rowa, kind, zps, n, hd, out, factor):
    scores = _product_for(codes, src, _scores, _scores_u4, _scores_tile)
    if scores is None:
        return lambda codes, q, rows, src, rowa, kind, zps, n, hd, out, factor: None
    return lambda codes, q, rows, src, rowa, kind, zps, n, hd, out, factor: scores(
        q, rows, src, rowa, kind, zps, n, hd, out, factor
    )


@njit(inline="always")
def _weights4(w, i):
    return w[_u(i)], w[_u(i + 1)], w[_u(i + 2)], w[_u(i + 3)]


@njit(inline="always")
def _axpy4(acc, b, x, e0, e1, e2, e3):
    acc[_u(b)] = (((acc[_u(b)] + x[0] * e0) + x[1] * e1) + x[2] * e2) + x[3] * e3


@njit(inline="always")
def _axpy_rows(acc, a, hd, x0, x1, x2, x3, e0, e1, e2, e3):
    """Element a of the four accumulator rows from a (hd apart) += their weights (row i's four
    in xi) times the four keys' elements e, in key order."""
    _axpy4(acc, a, x0, e0, e1, e2, e3)
    _axpy4(acc, a + hd, x1, e0, e1, e2, e3)
    _axpy4(acc, a + 2 * hd, x2, e0, e1, e2, e3)
    _axpy4(acc, a + 3 * hd, x3, e0, e1, e2, e3)


@njit(inline="always")
def _axpy_block(keys, acc, w, src, rowa, kind, zps, r, kk, hd):
    """acc[r+i] += w[(r+i)*TILE + kk+j] * V row kk+j for 4 rows i and 4 keys j, in key order.

    Each acc element is loaded and stored once for the 4 keys and each V element loaded once for
    the 4 rows; the additions into one acc element happen in key order, as one key at a time
    would do them: same result."""
    w0 = r * TILE + kk
    x0 = _weights4(w, w0)
    x1 = _weights4(w, w0 + TILE)
    x2 = _weights4(w, w0 + 2 * TILE)
    x3 = _weights4(w, w0 + 3 * TILE)
    keys(acc, r * hd, hd, src, rowa, kind, zps, kk, x0, x1, x2, x3)


@njit(inline="always")
def _axpy_keys_elements(acc, a0, hd, src, rowa, kind, zps, kk, x0, x1, x2, x3):
    """_axpy_block's loop over the elements of V rows kk..kk+3, weights xi of row i."""
    v0, v1, v2, v3 = rowa[kk], rowa[kk + 1], rowa[kk + 2], rowa[kk + 3]
    for d in range(hd):
        e0 = _kv(src, _u(v0 + d), kind)
        e1 = _kv(src, _u(v1 + d), kind)
        e2 = _kv(src, _u(v2 + d), kind)
        e3 = _kv(src, _u(v3 + d), kind)
        _axpy_rows(acc, a0 + d, hd, x0, x1, x2, x3, e0, e1, e2, e3)


@njit(inline="always")
def _axpy_keys_pairs(acc, a0, hd, src, rowa, kind, zps, kk, x0, x1, x2, x3):
    """_axpy_keys_elements on uint4 V rows: the accumulator rows in even-then-odd order."""
    v0, v1, v2, v3 = rowa[kk], rowa[kk + 1], rowa[kk + 2], rowa[kk + 3]
    z0, z1, z2, z3 = zps[kk], zps[kk + 1], zps[kk + 2], zps[kk + 3]
    half = hd // 2
    for j in range(half):
        e0, f0 = _u4_pair(src, v0, j, half, z0)
        e1, f1 = _u4_pair(src, v1, j, half, z1)
        e2, f2 = _u4_pair(src, v2, j, half, z2)
        e3, f3 = _u4_pair(src, v3, j, half, z3)
        _axpy_rows(acc, a0 + j, hd, x0, x1, x2, x3, e0, e1, e2, e3)
        _axpy_rows(acc, a0 + half + j, hd, x0, x1, x2, x3, f0, f1, f2, f3)


@njit(inline="always")
def _axpy_key_elements(acc, a0, wk, src, v0, kind, zps, k, hd):
    """acc[a0:a0+hd] += wk * V row k (at src[v0:])."""
    for d in range(hd):
        acc[_u(a0 + d)] += wk * _kv(src, _u(v0 + d), kind)


@njit(inline="always")
def _axpy_key_pairs(acc, a0, wk, src, v0, kind, zps, k, hd):
    """_axpy_key_elements on a uint4 V row (see _axpy_keys_pairs)."""
    half = hd // 2
    zp = zps[k]
    for j in range(half):
        lo, hi = _u4_pair(src, v0, j, half, zp)
        acc[_u(a0 + j)] += wk * lo
        acc[_u(a0 + half + j)] += wk * hi


@njit(inline="always")
def _accumulate_of(keys, key, acc, w, src, rowa, kind, zps, rows, n, hd):
    # Groups of 4 rows take 4x4 blocks where all 16 weights are nonzero; every other (row, key)
    # goes one key at a time. One call site of each: every inlined copy of these vectorized
    # loops costs compile time (LLVM unrolled the per-key loops over i and j into 16 copies).
    r = 0
    while r < rows:
        nr = 4 if r + 4 <= rows else 1
        kk = 0
        while kk < n:
            ke = min(kk + 4, n) if nr == 4 else n
            nonzero = ke - kk == 4
            for i in range(nr):
                for j in range(kk, ke):
                    nonzero = nonzero and w[_u((r + i) * TILE + j)] != _ZERO
            if nonzero and nr == 4:
                _axpy_block(keys, acc, w, src, rowa, kind, zps, r, kk, hd)
            else:
                for i in range(nr):
                    for k in range(kk, ke):
                        # A zero weight (masked key, or exp underflow) adds nothing: skipped, so
                        # that a masked key's non-finite V row (0 * Inf = NaN) stays out of the sum.
                        wk = w[_u((r + i) * TILE + k)]
                        if wk != _ZERO:
                            key(acc, (r + i) * hd, wk, src, rowa[k], kind, zps, k, hd)
            kk = ke
        r += nr


@njit(cache=True, fastmath=set(AXPY_FASTMATH), error_model="numpy", boundscheck=False)
def _accumulate(acc, w, src, rowa, kind, zps, rows, n, hd):
    """acc[r] += w[r*TILE + kk] * V row kk for every row and the n keys of a tile, in key order;
    V rows at src[rowa[kk]:], 8-bit codes of the given kind in the cache."""
    if kind == E4M3FN:
        _accumulate_of(_axpy_keys_elements, _axpy_key_elements, acc, w, src, rowa, E4M3FN, zps, rows, n, hd)
    elif kind == E4M3FNUZ:
        _accumulate_of(_axpy_keys_elements, _axpy_key_elements, acc, w, src, rowa, E4M3FNUZ, zps, rows, n, hd)
    elif kind == E5M2:
        _accumulate_of(_axpy_keys_elements, _axpy_key_elements, acc, w, src, rowa, E5M2, zps, rows, n, hd)
    else:
        _accumulate_of(_axpy_keys_elements, _axpy_key_elements, acc, w, src, rowa, I8, zps, rows, n, hd)


# As _scores_tile: one copy of the loops for a decoded tile, uint4's included (each element of
# the accumulators takes its own terms, whatever order a row's elements are held in).
@njit(cache=True, fastmath=set(AXPY_FASTMATH), error_model="numpy", boundscheck=False)
def _accumulate_tile(acc, w, src, rowa, kind, zps, rows, n, hd):
    """_accumulate on a decoded tile."""
    _accumulate_of(_axpy_keys_elements, _axpy_key_elements, acc, w, src, rowa, I8, zps, rows, n, hd)


@njit(cache=True, fastmath=set(AXPY_FASTMATH), error_model="numpy", boundscheck=False)
def _accumulate_u4(acc, w, src, rowa, kind, zps, rows, n, hd):
    """_accumulate on the cache's uint4 bytes, zero points zps: acc rows in even-then-odd order."""
    _accumulate_of(_axpy_keys_pairs, _axpy_key_pairs, acc, w, src, rowa, U4, zps, rows, n, hd)


def _side_accumulate(codes, acc, w, src, rowa, kind, zps, rows, n, hd):
    """The p . v of a tile of the value side whose pages are codes (_product_for; a decoded
    tile is _accumulate_tile's whatever the format)."""


@overload(_side_accumulate)
def _side_accumulate_overload(codes, acc, w, src, rowa, kind, zps, rows, n, hd):
    fused = _product_for(codes, src, _accumulate, _accumulate_u4, _accumulate_tile)
    accumulate = _accumulate_tile if isinstance(src.dtype, types.Float) else fused
    if accumulate is None:
        return lambda codes, acc, w, src, rowa, kind, zps, rows, n, hd: None
    return lambda codes, acc, w, src, rowa, kind, zps, rows, n, hd: accumulate(
        acc, w, src, rowa, kind, zps, rows, n, hd
    )


_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693145751953125)  # ln 2 split so n * _LN2_HI is exact for |n| <= 2^8
_LN2_LO = np.float32(1.4286068203094172e-06)
_EXP_MIN = np.float32(-87.0)  # below, exp leaves the float32 normals: return 0


@njit(inline="always")
def _exp_nonpositive(x):
    """exp(x) for x <= 0 in float32 (Cody-Waite reduction, degree-6 Taylor; ~1e-7 relative),
    in plain arithmetic so a loop of it vectorizes (libm's expf is a scalar call).
    -inf -> 0, NaN -> NaN."""
    xc = x if x > _EXP_MIN else _EXP_MIN
    nf = (xc * _LOG2E + _RNE_MAGIC) - _RNE_MAGIC
    r = (xc - nf * _LN2_HI) - nf * _LN2_LO
    p = np.float32(1.0 / 720.0)
    p = p * r + np.float32(1.0 / 120.0)
    p = p * r + np.float32(1.0 / 24.0)
    p = p * r + np.float32(1.0 / 6.0)
    p = p * r + np.float32(0.5)
    p = p * r + _ONE
    p = p * r + _ONE
    res = p * f32_from_bits((_i32(nf) + _i32(127)) << _i32(23))
    res = _ZERO if x < _EXP_MIN else res
    return x if x != x else res


@njit(cache=True, fastmath=False, error_model="numpy", boundscheck=False)
def _scale_visible(sc, s0, kscale, undo, n):
    """sc[s0+kk] *= kscale[kk] * undo; returns the max, NaN if any is NaN (branch-free)."""
    for kk in range(n):
        sc[_u(s0 + kk)] *= kscale[_u(kk)] * undo
    top = _NEG_INF
    nan = _i32(0)
    for kk in range(n):
        x = sc[_u(s0 + kk)]
        top = x if x > top else top
        nan |= _i32(x != x)
    return np.float32(np.nan) if nan else top


@njit(cache=True, fastmath=False, error_model="numpy", boundscheck=False)
def _softmax_tile(sc, s0, n, m_new, vscale):
    """sc[s0+kk] <- exp(sc[s0+kk] - m_new) * vscale[kk]; returns the sum of the exps."""
    for kk in range(n):
        sc[_u(s0 + kk)] = _exp_nonpositive(sc[_u(s0 + kk)] - m_new)
    total = _ZERO
    for kk in range(n):
        total += sc[_u(s0 + kk)]
    for kk in range(n):
        sc[_u(s0 + kk)] *= vscale[_u(kk)]
    return total


@njit(**_LEAF)
def _prefetch_rows(side, block_tables, seq, bi, off, g, n, hd, block_size):
    """Ask the cache for a side's rows (and scales) of the n keys from page index bi, offset
    off, so their loads overlap the current tile's arithmetic. One page lookup per page run."""
    codes, st, sst = side.codes, _strides5(side.strides), _strides4(side.scale_strides)
    row_bytes = (hd // 2 if side.kind == U4 else hd) * codes.itemsize
    while n > 0:
        blk = block_tables[seq, bi]
        run = min(n, block_size - off)
        a = st[0] + blk * st[1] + off * st[2] + g * st[3]
        for i in range(run):
            for line in range(0, row_bytes, 64):
                _prefetch(codes, a + i * st[2] + line // codes.itemsize)
        if side.per_token_head:
            a = sst[0] + blk * sst[1] + off * sst[2] + g * sst[3]
            for i in range(run):
                _prefetch(side.scales, a + i * sst[2])
        n -= run
        off = 0
        bi += 1


@njit(**_LEAF)
def _tile_rows(side, block_tables, seq, bi, off, g, n, block_size, unit, row, scale, zp):
    """For the n keys from page index bi, offset off: where the side's rows start (row) and
    their scales times unit (scale: the per-row scales, else the static one); a uint4 side's
    zero points, the scale words' low bits, go to zp. One page lookup per page run, not per
    key."""
    st, sst = _strides5(side.strides), _strides4(side.scale_strides)
    u4 = side.kind == U4
    kk = 0
    while kk < n:
        blk = block_tables[seq, bi]
        run = min(n - kk, block_size - off)
        a = st[0] + blk * st[1] + off * st[2] + g * st[3]
        for i in range(run):
            row[kk + i] = a + i * st[2]
        a = sst[0] + blk * sst[1] + off * sst[2] + g * sst[3]
        if not side.per_token_head:
            for i in range(run):
                scale[_u(kk + i)] = side.tensor_scale * unit
        elif u4:
            for i in range(run):
                word = _i32(side.scales[_u(a + i * sst[2])])
                scale[_u(kk + i)] = f32_from_bits(word & _SCALE_BITS) * unit
                zp[_u(kk + i)] = _i32(word & _ZP_MASK)
        else:
            for i in range(run):
                scale[_u(kk + i)] = f32_from_bits(side.scales[_u(a + i * sst[2])]) * unit
        kk += run
        off = 0
        bi += 1


_MAX_FACTOR_EXPONENT = 126  # _unit_row: the largest 2^k whose 2^-k is also a normal float32


@njit(inline="always")
def _unit_row(q, q0, n, unit):
    """Scales the query row q[q0:q0+n] by a power of two 2^k that takes its absmax into [1, 2)
    (k within +-126, so rows below 2^-126, subnormal ones included, stop at 2^126), then by
    unit (one rounding); returns 2^-k. The power of two is exact (an element is rounded only
    below 2^-125 of the row's absmax), so q . codes has the same size whatever the row's, and
    2^-k goes into the logit's scale beside the key scale instead (SPEC.md section 11)."""
    amax = _i32(0)
    for d in range(n):
        b = _i32(i32_from_f32(q[_u(q0 + d)]) & _i32(0x7FFFFFFF))
        amax = b if b > amax else amax
    k = min(max(_i32(127) - (amax >> _i32(23)), -_MAX_FACTOR_EXPONENT), _MAX_FACTOR_EXPONENT)
    factor = f32_from_bits((_i32(127) + k) << _i32(23))
    for d in range(n):
        q[_u(q0 + d)] = (q[_u(q0 + d)] * factor) * unit
    return f32_from_bits((_i32(127) - k) << _i32(23))


@njit(**_LEAF)
def _u4_query_rows(q, rows, n, rotated, signs, t):
    """Each query row q[r*n:(r+1)*n] rotated (rotated: R q, SPEC.md 3.4 in float32, a smaller
    block's elements times B_max / B) and put in the uint4 products' even-then-odd order; t is
    scratch of rows * n."""
    for r in range(rows):
        for d in range(n):
            t[_u(d * rows + r)] = q[_u(r * n + d)] * signs[_u(d)] if rotated else q[_u(r * n + d)]
    if rotated:
        _fwht_lanes(t, n, rows)
        if n & (n - 1):
            # (R q)_d / B_d with the largest block's 1 / B_max on the key scale (key_unit):
            # the smaller blocks' elements times B_max / B_d, exact powers of two.
            top = _rht_block(n, 0)
            for d in range(top, n):
                grow = np.float32(top // _rht_block(n, d))
                for r in range(rows):
                    t[_u(d * rows + r)] = t[_u(d * rows + r)] * grow
    half = n // 2
    for r in range(rows):
        for j in range(half):
            q[_u(r * n + j)] = t[_u(2 * j * rows + r)]
            q[_u(r * n + half + j)] = t[_u((2 * j + 1) * rows + r)]


@njit(**_LEAF)
def _u4_output_rows(acc, rows, n, l_sum, rotated, signs, t):
    """t[d*rows + r] = element d of output row r: o' = acc * (1 / l_sum) back in element order,
    then (rotated) SPEC.md 8.4 step 4, signs * fwht(o') / B, in float32."""
    half = n // 2
    for r in range(rows):
        inv_l = _ONE / l_sum[_u(r)]
        for j in range(half):
            t[_u(2 * j * rows + r)] = acc[_u(r * n + j)] * inv_l
            t[_u((2 * j + 1) * rows + r)] = acc[_u(r * n + half + j)] * inv_l
    if rotated:
        _unrotate_lanes(t, n, rows, signs)


# A uint4 side's pages arrive as int8 (see __init__._cache_kind): the two functions below run
# the uint4 steps for such a side and are nothing for any other, so no other signature
# compiles them.


def _u4_rows_in(kc, q, rows, n, rotated, signs, t):
    """_u4_query_rows where the key side kc holds uint4 codes."""


@overload(_u4_rows_in)
def _u4_rows_in_overload(kc, q, rows, n, rotated, signs, t):
    if kc.dtype == types.int8:
        return lambda kc, q, rows, n, rotated, signs, t: _u4_query_rows(q, rows, n, rotated, signs, t)
    return lambda kc, q, rows, n, rotated, signs, t: None


def _u4_rows_out(vc, acc, rows, n, l_sum, rotated, signs, t):
    """_u4_output_rows where the value side vc holds uint4 codes."""


@overload(_u4_rows_out)
def _u4_rows_out_overload(vc, acc, rows, n, l_sum, rotated, signs, t):
    if vc.dtype == types.int8:
        return lambda vc, acc, rows, n, l_sum, rotated, signs, t: _u4_output_rows(
            acc, rows, n, l_sum, rotated, signs, t
        )
    return lambda vc, acc, rows, n, l_sum, rotated, signs, t: None


@njit(**_LEAF)
def _well_formed(block_tables, seq, seq_len, q_len, block_size, num_blocks):
    """Whether sequence seq's metadata keeps the rules its keys are read by (SPEC.md 11.1):
    its length within its block-table row and at least its query's, and every entry covering
    positions [0, seq_len) in [0, num_blocks)."""
    if q_len < 0 or seq_len < q_len or seq_len > block_tables.shape[1] * block_size:
        return False
    for b in range((seq_len + block_size - 1) // block_size):
        blk = block_tables[seq, b]
        if blk < 0 or blk >= num_blocks:
            return False
    return True


@njit(**_LEAF)
def _poison_rows(outputs, t0, nq, g, group, hd):
    """NaN in every output (and lse) element of the item's rows: an ill-formed sequence's."""
    out, os_ = outputs.out, _strides4(outputs.out_strides)
    lse, ls_ = outputs.lse, _strides3(outputs.lse_strides)
    for j in range(nq):
        for h in range(g * group, (g + 1) * group):
            o0 = os_[0] + (t0 + j) * os_[1] + h * os_[2]
            for d in range(hd):
                out[_u(o0 + d * os_[3])] = np.float32(np.nan)
            if outputs.has_lse:
                lse[_u(ls_[0] + (t0 + j) * ls_[1] + h * ls_[2])] = np.float32(np.nan)


@njit(cache=True, fastmath=False, error_model="numpy", boundscheck=False)
def _attention_item(it, query, keys, values, step, params, outputs):
    """One (query block, kv head) item of attention (see attention())."""
    num_kv_heads = params.num_kv_heads
    group = params.num_q_heads // num_kv_heads
    hd = params.head_size
    softmax_scale = params.softmax_scale
    window = params.sliding_window
    softcap = params.softcap
    q_kind, qs = query.kind, _strides4(query.strides)
    kc, kcs, vc, vcs = keys.codes, _strides5(keys.strides), values.codes, _strides5(values.strides)
    k_u4, v_u4 = keys.kind == U4, values.kind == U4
    block_size = step.block_size
    block_tables, query_start_loc = step.block_tables, step.query_start_loc
    wi = it // num_kv_heads
    g = it - wi * num_kv_heads
    seq = step.item_seq[wi]
    t0 = step.item_first_token[wi]
    nq = step.item_num_tokens[wi]
    q_len = query_start_loc[seq + 1] - query_start_loc[seq]
    seq_len = step.seq_lens[seq]
    first_pos = seq_len - q_len + (t0 - query_start_loc[seq])
    rows = nq * group
    if not _well_formed(block_tables, seq, seq_len, q_len, block_size, step.num_blocks):
        _poison_rows(outputs, t0, nq, g, group, hd)
        return

    # The dot meets codes, whose size is fixed while the key's sits in its scale: q . codes
    # grows with the query row (1e36 x 127 x D overflows) where the logit need not. Such rows
    # are scaled to unit size by a power of two with softmax_scale folded in, and each row's
    # undo meets the key scale before the dot does (kscale * undo: the logit's own scale, in
    # range wherever the logit is). Mode none's q . k is the logit's size already: kept as is.
    codes = is_code_kind(keys.kind)
    key_unit = _ONE if codes else softmax_scale
    if keys.rotated:
        # q . R^-1 y = (R q / B) . y (SPEC.md 8.4): the rows are rotated below and the
        # largest block's 1 / B (1 / D for a power of two) rides with the key scale.
        key_unit = _ONE / np.float32(_rht_block(hd, 0))

    # The products take rows in fours, each K/V element loaded (and decoded) once for the four;
    # a remainder of three (a GQA group of 3, a decode) takes an idle fourth row rather than
    # three passes of one. The idle row's query is 0 and its weights 1: its scores and sums are
    # never read. (uint4's products keep their own row order, so where a side is uint4's the
    # item takes no idle row.)
    padded = rows + 1 if rows % 4 == 3 and not (k_u4 or v_u4) else rows
    # Row r is query token t0 + r // group, head g * group + r % group; widened to fp32.
    q = np.zeros(padded * hd, dtype=np.float32)
    undo = np.empty(rows, dtype=np.float32)
    pos = np.empty(rows, dtype=np.int64)
    m = np.empty(rows, dtype=np.float32)
    l_sum = np.empty(rows, dtype=np.float32)
    acc = np.zeros(padded * hd, dtype=np.float32)
    for r in range(rows):
        j = r // group
        h = g * group + (r - j * group)
        pos[r] = first_pos + j
        q0 = qs[0] + (t0 + j) * qs[1] + h * qs[2]
        if q_kind == BF16:
            _load_row(query.rows, q0, qs[3], BF16, q[r * hd :], hd)
        elif q_kind == F16:
            _load_row(query.rows, q0, qs[3], F16, q[r * hd :], hd)
        else:
            _load_row(query.rows, q0, qs[3], F32, q[r * hd :], hd)
        undo[r] = _unit_row(q, r * hd, hd, softmax_scale) if codes else _ONE
        if params.has_sinks:
            m[r] = params.sinks[h]
            l_sum[r] = _ONE
        else:
            m[r] = _NEG_INF
            l_sum[r] = _ZERO

    # uint4 keys: the query rows rotated (a rotated key side) and put in the products' order;
    # uint4 values: the outputs come back through u4_rows (_u4_rows_out).
    u4_rows = np.empty(rows * hd if k_u4 or v_u4 else 0, dtype=np.float32)
    if k_u4:
        _u4_rows_in(kc, q, rows, hd, keys.rotated, keys.signs, u4_rows)

    hi = first_pos + nq  # exclusive end of the keys any row sees
    lo = 0
    if window > 0:
        lo = max(0, first_pos - window + 1)

    key_factor, value_factor = _tile_factor(keys.kind), _tile_factor(values.kind)
    kscale = np.empty(TILE, dtype=np.float32)
    vscale = np.empty(TILE, dtype=np.float32)
    kzp = np.empty(TILE if k_u4 else 0, dtype=np.int32)
    vzp = np.empty(TILE if v_u4 else 0, dtype=np.int32)
    sc = np.empty(padded * TILE, dtype=np.float32)  # scores, then weights, row-major
    krow = np.empty(TILE, dtype=np.int64)
    vrow = np.empty(TILE, dtype=np.int64)
    # Few rows (decode): the products read the codes in the cache and decode them in registers.
    # Otherwise decode each K/V tile once into kt/vt for all the rows.
    fused = codes and rows <= _FUSED_ROWS and kcs[4] == 1 and vcs[4] == 1
    kt = np.empty(0 if fused else TILE * hd, dtype=np.float32)
    vt = np.empty(0 if fused else TILE * hd, dtype=np.float32)
    tile_rows = np.arange(TILE) * hd

    for k0 in range(lo, hi, TILE):
        n = min(TILE, hi - k0)
        # Page and offset of the tile's first key; stepped, not divided, per key (an int64
        # division per key and array cost more than the decode of a row).
        bi = k0 // block_size
        off = k0 - bi * block_size
        # Ask for the next tile's K/V rows now so their loads overlap this tile's arithmetic.
        nxt = k0 + TILE
        if nxt < hi:
            pbi = nxt // block_size
            poff = nxt - pbi * block_size
            pn = min(TILE, hi - nxt)
            _prefetch_rows(keys, block_tables, seq, pbi, poff, g, pn, hd, block_size)
            _prefetch_rows(values, block_tables, seq, pbi, poff, g, pn, hd, block_size)
        _tile_rows(keys, block_tables, seq, bi, off, g, n, block_size, key_unit, krow, kscale, kzp)
        _tile_rows(values, block_tables, seq, bi, off, g, n, block_size, _ONE, vrow, vscale, vzp)
        if fused:
            _side_scores(kc, q, padded, kc, krow, keys.kind, kzp, n, hd, sc, key_factor)
        else:
            # The tile's K and V rows decoded once for all the rows (codes, unscaled).
            _decode_tile(kc, kcs, keys.kind, kzp, block_tables, seq, bi, off, g, n, kt, hd, block_size)
            _decode_tile(vc, vcs, values.kind, vzp, block_tables, seq, bi, off, g, n, vt, hd, block_size)
            _side_scores(kc, q, padded, kt, tile_rows, keys.kind, kzp, n, hd, sc, key_factor)
        for r in range(rows):
            p = pos[r]
            s0 = r * TILE
            if k0 > p:
                for kk in range(n):
                    sc[s0 + kk] = _ZERO  # the whole tile is in this row's future
                continue
            if softcap == 0 and k0 + n - 1 <= p and (window == 0 or k0 > p - window):
                tile_max = _scale_visible(sc, s0, kscale, undo[r], n)  # every key visible: no mask
            else:
                tile_max = _NEG_INF
                for kk in range(n):
                    kp = k0 + kk
                    if kp > p or (window > 0 and kp <= p - window):
                        sc[s0 + kk] = _NEG_INF
                        continue
                    x = sc[s0 + kk] * (kscale[kk] * undo[r])
                    if softcap > 0:
                        x = softcap * math.tanh(x / softcap)
                    sc[s0 + kk] = x
                    if x > tile_max or x != x:
                        tile_max = x
            m_old = m[r]
            m_new = tile_max if (tile_max > m_old or tile_max != tile_max) else m_old
            if m_new == _NEG_INF:
                for kk in range(n):
                    sc[s0 + kk] = _ZERO  # nothing visible yet (and no sink)
                continue
            alpha = math.exp(m_old - m_new)
            m[r] = m_new
            l_sum[r] = l_sum[r] * alpha + _softmax_tile(sc, s0, n, m_new, vscale)
            if alpha != _ONE:
                _scale(acc, r * hd, alpha, hd)
        for kk in range(rows * TILE, padded * TILE):
            sc[kk] = _ONE  # the idle row's weights: nonzero, so its fours stay whole
        if fused:
            _side_accumulate(vc, acc, sc, vc, vrow, values.kind, vzp, padded, n, hd)
        else:
            _side_accumulate(vc, acc, sc, vt, tile_rows, values.kind, vzp, padded, n, hd)

    out, os_ = outputs.out, _strides4(outputs.out_strides)
    lse, ls_ = outputs.lse, _strides3(outputs.lse_strides)
    if v_u4:
        _u4_rows_out(vc, acc, rows, hd, l_sum, values.rotated, values.signs, u4_rows)
    for r in range(rows):
        j = r // group
        h = g * group + (r - j * group)
        o0 = os_[0] + (t0 + j) * os_[1] + h * os_[2]
        inv_l = _ONE / l_sum[r]
        if v_u4:
            for d in range(hd):
                out[_u(o0 + d * os_[3])] = u4_rows[_u(d * rows + r)]
        else:
            for d in range(hd):
                out[_u(o0 + d * os_[3])] = (acc[_u(r * hd + d)] * value_factor) * inv_l
        if outputs.has_lse:
            # m and l_sum are the running max and the denominator over it (the sink's term
            # included); the log in float64, rounded once. No term: -inf + log(0) = -inf.
            lse[_u(ls_[0] + (t0 + j) * ls_[1] + h * ls_[2])] = np.float32(
                np.float64(m[r]) + math.log(np.float64(l_sum[r]))
            )


@njit(**_OPTS)
def attention(query, keys, values, step, params, outputs):
    """Causal paged attention; one parallel item per (query block, kv head). The arguments are
    the records of records.py (keys and values each a Side, in its own format), as plain
    tuples of their fields, named here.

    A query block is up to a few query tokens of one sequence; the item processes all
    Hq/Hkv query heads of its KV head together, so each K/V row is decoded once per group.
    Online softmax over tiles of TILE keys. Per-token-head scales are applied per key: the K
    scale on the q.codes product, the V scale on the probability.
    """
    _attention_items(Query(*query), Side(*keys), Side(*values), Step(*step), Params(*params), Outputs(*outputs))


@njit(parallel=True, **_OPTS)
def _attention_items(query, keys, values, step, params, outputs):
    """attention's items in parallel."""
    # The per-item work is a compiled function: a small parfor body compiles much faster.
    for it in prange(step.item_seq.shape[0] * params.num_kv_heads):
        _attention_item(np.int64(it), query, keys, values, step, params, outputs)


@njit(**_OPTS)
def decode_work_items(query_start_loc, seq_lens):
    """A decode step's work items (see __init__.work_items): one per sequence, longest first
    (stable), each its one query token; None where a sequence queries other than one token.
    Compiled: a decode runs it once per layer, where NumPy's calls cost more than the kernel's
    smaller items."""
    num_seqs = seq_lens.shape[0]
    for s in range(num_seqs):
        if query_start_loc[s + 1] - query_start_loc[s] != 1:
            return None
    order = np.argsort(-seq_lens, kind="mergesort")
    first = np.empty(num_seqs, dtype=np.int64)
    for i in range(num_seqs):
        first[i] = query_start_loc[order[i]]
    return order, first, np.ones(num_seqs, dtype=np.int64)


# ----------------------------------------------------------------------------------------------
# Test hooks: the exact element functions applied to whole arrays
# ----------------------------------------------------------------------------------------------


@njit(**_OPTS)
def encode_codes_array(x, out, fmt, trunc, qmax, qmin, nan_code, inf_pos, inf_neg):
    """The write path's encoder on already-scaled values y: NaN -> nan_code, +-Inf -> inf_pos /
    inf_neg (the format's), else clamp to [qmin, qmax] and round (int8 half-even or trunc; fp8 RNE)."""
    n = x.shape[0]
    if fmt == I8:
        if trunc:
            _store_codes(x, _ONE, False, out, 0, 1, n, I8, True, qmax, qmin, nan_code, inf_pos, inf_neg, True)
        else:
            _store_codes(x, _ONE, False, out, 0, 1, n, I8, False, qmax, qmin, nan_code, inf_pos, inf_neg, True)
    elif fmt == E4M3FN:
        _store_codes(x, _ONE, False, out, 0, 1, n, E4M3FN, False, qmax, qmin, nan_code, inf_pos, inf_neg, True)
    elif fmt == E5M2:
        _store_codes(x, _ONE, False, out, 0, 1, n, E5M2, False, qmax, qmin, nan_code, inf_pos, inf_neg, True)
    else:
        _store_codes(x, _ONE, False, out, 0, 1, n, E4M3FNUZ, False, qmax, qmin, nan_code, inf_pos, inf_neg, True)


@njit(**_OPTS)
def decode_codes_array(codes, kind, out):
    """Decode every element of an array of kind I8 / E4M3FN / E4M3FNUZ / E5M2 / BF16 / F16 / F32."""
    _decode_row_any(codes, 0, 1, kind, out, 0, 1, codes.shape[0], _ONE, False)


__all__ = [
    "TILE",
    "attention",
    "decode_codes_array",
    "dequantize",
    "encode_codes_array",
    "write",
]
