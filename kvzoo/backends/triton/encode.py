"""Exact quantization helpers for Triton kernels (@triton.jit, inlined by the caller).

Every helper gives the same bits on an NVIDIA/AMD GPU and under TRITON_INTERPRET=1, because
each step is an operation both agree on: integer arithmetic on float bit patterns, plain fp32
add/multiply/min/max (IEEE on both), and `tl.math.div_rn`, the correctly rounded division.
Things deliberately avoided, each measured to differ from the spec somewhere:
- `a / b` on fp32 (div.full.f32 on CUDA: up to 2 ulp off);
- float -> int8 conversion for rounding (cvt.rzi truncates on CUDA) and libdevice rint (not
  available to the interpreter);
- float -> fp8 conversion (the interpreter mis-rounds ties and subnormals; sm_89 rounds twice),
  except CODE_E4M3FN_CVT below, which compiled kernels on sm_90+ may choose;
- `tl.max` for NaN detection (max.f32 drops NaN);
- bf16 -> fp32 casts under the interpreter (triton 3.6 turns bf16 subnormals into wrong
  values): `bf16_as_bits` and `load_f32` widen bf16 there from its bits instead.

Contraction: the only multiply whose result later meets an add is x * inv, and a min/max (the
clamp, or encode_row_codes' max) or an abs sits between them, so no FMA can form whatever the
kernel's fp-fusion setting (tests/test_triton_write.py reads the PTX with fusion on).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import platform as _platform

# The kernels' constexpr CODE values (host-side ints) live with the format table.
from .formats import CODE_COPY, CODE_E4M3FN, CODE_E4M3FN_CVT, CODE_E4M3FNUZ, CODE_E5M2, CODE_INT8  # noqa: F401

# 1.5 * 2**23: adding then subtracting it rounds an fp32 of magnitude < 2**22 to an integer,
# half to even (the addition's own RNE does the work).
RNE_MAGIC = tl.constexpr(12582912.0)
# The smallest normal float32 (2^-126): a floor for divisors, whose reciprocals then stay finite.
SMALLEST_NORMAL = tl.constexpr(1.1754943508222875e-38)
CANONICAL_NAN_BITS = tl.constexpr(0x7FC00000)


@triton.jit
def float_bits(x):
    return x.to(tl.int32, bitcast=True)


@triton.jit
def bits_float(b):
    return b.to(tl.float32, bitcast=True)


@triton.jit
def widen_bf16_bits(raw16):
    """bf16 bit patterns (int16) -> the exact fp32 values; bf16 is the top half of an fp32."""
    return bits_float(raw16.to(tl.int32) << 16)


@functools.cache
def _has_e4m3_cvt(device_index: int) -> bool:
    # Hopper's cvt.rn.satfinite.e4m3x2.f32 rounds once; earlier GPUs are not trusted with it
    # (docs/hardware.md: the sm_89 claim is unsourced).
    return _platform.build_target() == "cuda" and torch.cuda.get_device_capability(device_index)[0] >= 9


def encoder_code(code: int, t: torch.Tensor) -> int:
    """The CODE a kernel on t's device encodes `code` with: the hardware e4m3 convert where it is
    exact."""
    if code == CODE_E4M3FN and t.is_cuda and not _platform.interpreted() and _has_e4m3_cvt(t.device.index or 0):
        return CODE_E4M3FN_CVT
    return code


def bf16_as_bits(t: torch.Tensor) -> torch.Tensor:
    """A model-dtype tensor as `load_f32` reads it exactly: bf16 as its int16 bits under the
    interpreter, anything else (and everything on a GPU, where the cast is exact) as it is."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 and _platform.interpreted() else t


@triton.jit
def load_f32(ptrs, mask):
    """Model-dtype elements widened to fp32 exactly (0 where masked); an int16 tensor is bf16
    bits (`bf16_as_bits`)."""
    if ptrs.dtype.element_ty == tl.int16:
        return widen_bf16_bits(tl.load(ptrs, mask=mask, other=0))
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def is_finite(y):
    return (float_bits(y) & 0x7F800000) != 0x7F800000


@triton.jit
def row_absmax_bits(xf, AXIS: tl.constexpr):
    """Bits of max |x| along AXIS, NaN-propagating.

    Non-negative floats order like their bit patterns as integers, and every NaN pattern
    (sign cleared) is above +Inf's 0x7F800000, so an integer max propagates NaN exactly.
    """
    return tl.max(float_bits(xf) & 0x7FFFFFFF, axis=AXIS)


@triton.jit
def row_scale(absmax_bits, QMAX: tl.constexpr, SCALE_FLOOR: tl.constexpr):
    """scale = max(absmax / QMAX, SCALE_FLOOR), correctly rounded; canonical NaN for a NaN row.

    Returns (scale, scale_bits): the float to quantize with and the int32 bits to store.
    """
    absmax = bits_float(absmax_bits)
    q = tl.math.div_rn(absmax, tl.full(absmax.shape, QMAX, tl.float32))
    q = tl.maximum(q, SCALE_FLOOR)
    # max.f32 returns the non-NaN operand, so the NaN is put back from the integer test.
    scale_bits = tl.where(absmax_bits > 0x7F800000, CANONICAL_NAN_BITS, float_bits(q))
    return bits_float(scale_bits), scale_bits


# fp16_row_factors: the biased float32 exponent that a row's absmax is moved to (2^14: below
# fp16's largest finite value, 28 binades above its smallest normal), and the largest factor
# exponent whose factor and undo are both normal float32.
FP16_ROW_EXPONENT = tl.constexpr(127 + 14)
MAX_FACTOR_EXPONENT = tl.constexpr(126)


@triton.jit
def fp16_row_factors(amax):
    """Powers of two (factor, undo) per row for a row of absmax `amax` (float32): x * factor
    puts the row's absmax in [2^14, 2^15), so its fp16 cast keeps every bf16 bit and cannot
    overflow, and factor * undo == 1 exactly, both normal.

    Every finite absmax reaches that range (the factor for FLT_MAX is 2^-113), except rows
    below 2^-112, subnormal ones included: their factor stops at 2^126, which still takes a
    float32 subnormal to 2^-23 or more (fp16 holds it; a 1e-38 row lands near 0.85). A zero row
    keeps zeros, and Inf/NaN rows stay Inf/NaN."""
    expo = (float_bits(amax) >> 23) & 0xFF
    k = tl.minimum(tl.maximum(FP16_ROW_EXPONENT - expo, -MAX_FACTOR_EXPONENT), MAX_FACTOR_EXPONENT)
    return bits_float((127 + k) << 23), bits_float((127 - k) << 23)


@triton.jit
def reciprocal(scale):
    """1 / scale, correctly rounded (+Inf -> 0, NaN -> NaN)."""
    return tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)


@triton.jit
def round_half_even(y):
    """Nearest integer (ties to even) of fp32 y with |y| < 2**22, as fp32."""
    return (y + RNE_MAGIC) - RNE_MAGIC


@triton.jit
def int8_code_bits(y):
    """Round-half-even of fp32 y in [-128, 127] to an int32 whose low byte is the int8 code.

    The sum y + 1.5 * 2**23 has ulp 1, so the adder rounds y and leaves the integer in the low
    mantissa bits as an offset from the magic's bits 0x4B400000, whose low byte is zero; taking
    the bits skips the subtract and the float -> int conversion (a quarter-rate instruction).
    """
    return float_bits(y + RNE_MAGIC)


@triton.jit
def minifloat_magnitude_code(a, MANT: tl.constexpr, BIAS: tl.constexpr):
    """RNE of a non-negative finite fp32 (bits `a`, within the format's range) to the 7-bit
    magnitude code of an 8-bit minifloat with MANT mantissa bits and exponent bias BIAS
    (e4m3fn: 3, 7; e4m3fnuz: 3, 8; e5m2: 2, 15)."""
    # One fp32 add rounds both ranges: with E the exponent of |y|, pinned below at the smallest
    # normal's (1 - BIAS), M = 2**(E + 23 - MANT) has an ulp of 2**(E - MANT), the format's step
    # at E (the subnormal step too, once pinned). So |y| + M, still in [M, 2M), is |y| rounded
    # (RNE) to that step, and its bits minus M's count k steps: k in 2**MANT..2**(MANT + 1) for a
    # normal (the top is the next binade's first code) and 0..2**MANT below it. The code is k
    # plus 2**MANT per binade above the first: code = (sum - M) + 2**MANT * (E + BIAS - 1), with
    # M's bits (e + 23 - MANT) << 23 for the biased e.
    # Exact for fp32 subnormal inputs as well: the adder keeps them, no flush.
    e = tl.maximum(a >> 23, 128 - BIAS)
    total = float_bits(bits_float(a) + bits_float((e + (23 - MANT)) << 23))
    return total + e * ((1 << MANT) - (1 << 23)) + (((BIAS - 128) << MANT) - ((23 - MANT) << 23))


@triton.jit
def _finite_codes(yc, CODE: tl.constexpr, TRUNC: tl.constexpr):
    """Code bytes (low 8 bits of an int32) of finite fp32 yc no further than an fp32 rounding
    or two beyond [QMIN, QMAX], where the clamp would not change the code."""
    if CODE == 1:
        if TRUNC:
            code = yc.to(tl.int32)  # exact conversion: cvt.rzi / astype both truncate
        else:
            code = int8_code_bits(yc)
    elif CODE == 4:
        code = yc.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        bits = float_bits(yc)
        sign = (bits >> 24) & 0x80
        if CODE == 2:
            code = minifloat_magnitude_code(bits & 0x7FFFFFFF, 3, 7) + sign
        elif CODE == 5:
            code = minifloat_magnitude_code(bits & 0x7FFFFFFF, 2, 15) + sign
        else:
            mag = minifloat_magnitude_code(bits & 0x7FFFFFFF, 3, 8)
            code = tl.where(mag == 0, 0, mag + sign)  # 0x80 is e4m3fnuz's NaN, not -0
    return code


@triton.jit
def encode_codes(
    y,
    CODE: tl.constexpr,
    QMIN: tl.constexpr,
    QMAX: tl.constexpr,
    NAN_CODE: tl.constexpr,
    INF_POS: tl.constexpr,
    INF_NEG: tl.constexpr,
    TRUNC: tl.constexpr,
):
    """y = x / scale (fp32) -> code bytes in the low 8 bits of an int32 (the caller's cast to
    the 8-bit cache type keeps them; the upper bits are not meaningful).

    NaN -> NAN_CODE, +Inf -> INF_POS, -Inf -> INF_NEG (the format's); otherwise clamp to
    [QMIN, QMAX] and round (int8: half to even, or toward zero when TRUNC; fp8: one RNE from
    fp32, e4m3fnuz has no -0).
    """
    bits = float_bits(y)
    finite = is_finite(y)
    # Non-finite lanes are zeroed first so no conversion or add below ever sees a NaN or Inf
    # (a signalling NaN would raise NumPy's invalid-value warning under the interpreter).
    yc = tl.minimum(tl.maximum(tl.where(finite, y, 0.0), QMIN), QMAX)
    # Told apart by their bits: a float compare on a NaN lane would warn there too.
    special = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, NAN_CODE, tl.where(bits < 0, INF_NEG, INF_POS))
    return tl.where(finite, _finite_codes(yc, CODE, TRUNC), special)


@triton.jit
def encode_row_codes(y, CODE: tl.constexpr, NAN_CODE: tl.constexpr, TRUNC: tl.constexpr):
    """encode_codes for y = x * (1 / scale) of a per-token-head row, bit for bit the same.

    There the clamp is a no-op and NaN is the only non-finite y, so both are skipped: scale >=
    absmax / QMAX and 1 / scale are correctly rounded, so |y| <= QMAX * (1 + 3 * 2**-24), which
    rounds to the same code as QMAX in every format (int8 127, e4m3 448 / 224); a row with an
    Inf has scale = Inf and inv = 0, so y is +-0 or NaN (Inf * 0), and a NaN row gives NaN.
    """
    finite = y == y
    if CODE == 1 and TRUNC:
        code = _finite_codes(tl.where(finite, y, 0.0), CODE, TRUNC)  # cvt never sees a NaN
    elif CODE == 1:
        # The max is a no-op on the row's values but stands between x * inv and the rounding
        # add, so they cannot contract into an FMA whatever the fp-fusion setting (a select
        # would not do: LLVM moves the add into both arms). A NaN lane leaves it as NaN
        # (interpreter) or QMIN (GPU) and is replaced below.
        code = _finite_codes(tl.maximum(y, -128.0), CODE, TRUNC)
    else:
        # |y| meets the add through an abs, which no FMA can absorb; a NaN lane goes through
        # integer ops and an add of a quiet NaN (no trap) and is replaced below.
        code = _finite_codes(y, CODE, TRUNC)
    return tl.where(finite, code, NAN_CODE)


@triton.jit
def minifloat_value(b, MANT: tl.constexpr, BIAS: tl.constexpr):
    """Exact fp32 value of 8-bit minifloat code bytes b (int32 0..255) with MANT mantissa bits
    and exponent bias BIAS; NaN and Inf codes not yet handled."""
    exp = (b & 0x7F) >> MANT
    mant = b & ((1 << MANT) - 1)
    normal = bits_float(((exp + (127 - BIAS)) << 23) | (mant << (23 - MANT)))
    # Subnormals are mant * 2**(1-BIAS-MANT): the product with that power of two is exact.
    unit = bits_float(tl.full(b.shape, (128 - BIAS - MANT) << 23, tl.int32))
    mag = tl.where(exp == 0, mant.to(tl.float32) * unit, normal)
    # The sign goes in as a bit: Triton negates as 0 - x, which turns -0 (0x80) into +0.
    return bits_float(float_bits(mag) | ((b & 0x80) << 24))


@triton.jit
def decode_codes(raw, CODE: tl.constexpr):
    """Code bytes (int8 values, or fp8 bits loaded as uint8) -> their fp32 values, exactly."""
    if CODE == 1:
        value = raw.to(tl.float32)
    else:
        b = raw.to(tl.int32) & 0xFF
        nan = bits_float(tl.full(b.shape, CANONICAL_NAN_BITS, tl.int32))
        if CODE == 2:
            value = tl.where((b & 0x7F) == 0x7F, nan, minifloat_value(b, 3, 7))
        elif CODE == 5:
            # Exponent 31: +-Inf with a zero mantissa, NaN otherwise.
            inf = bits_float(0x7F800000 | ((b & 0x80) << 24))
            top = tl.where((b & 0x3) == 0, inf, nan)
            value = tl.where((b & 0x7C) == 0x7C, top, minifloat_value(b, 2, 15))
        else:
            value = tl.where(b == 0x80, nan, minifloat_value(b, 3, 8))
    return value
