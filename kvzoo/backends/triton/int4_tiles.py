"""The int4 family's tile pieces that its direct kernel (int4_attention.py) and its staging
(int4_staging.py) both use: the scale word of SPEC.md 3.5, split into scale and zero point; the
query rows' power-of-two factors; the output rows' way back from the rotated basis. The paged
family's staged kernel (attention_kernels.py) takes the last for int4's workspace."""

from __future__ import annotations

import triton
import triton.language as tl

from .encode import FP16_ROW_EXPONENT, MAX_FACTOR_EXPONENT, bits_float, float_bits
from .formats import CODE_E4M3FN, CODE_INT8, CODE_UINT4
from .int4_rotation import flip_signs, fwht, over_blocks

# The family's KEY_CODEs (formats.py's codes), as constexprs a compiled kernel can read: its own
# int4 rows, and the split modes' int8 and e4m3fn bytes.
UINT4_CODE = tl.constexpr(CODE_UINT4)
INT8_CODE = tl.constexpr(CODE_INT8)
E4M3FN_CODE = tl.constexpr(CODE_E4M3FN)

# fp16 value of a code c under the nibble conversions, less c: 0x5400 | c << 4 is the fp16
# 64 + c (fp16 steps by 1/16 in [64, 128)), so each nibble becomes an fp16 with one OR once it
# sits in bits 4-7 of a half.
CODE_OFFSET = tl.constexpr(64.0)
# The word layout of SPEC.md 3.5 (as int32).
SCALE_MASK = tl.constexpr(-16)  # 0xFFFFFFF0
ZP_MASK = tl.constexpr(0xF)
OFFSET_BITS = tl.constexpr(0x42800000)  # CODE_OFFSET as a float32


@triton.jit
def split_words(words):
    """Scale words (int32) -> (scale_t, CODE_OFFSET + zp), float32 (SPEC.md 3.5). The second
    is built on the bits, as the first is: zp << 17 in the mantissa of 64.0 (whose unit there is
    2^-17) is 64 + zp."""
    return bits_float(words & SCALE_MASK), bits_float(((words & ZP_MASK) << 17) | OFFSET_BITS)


@triton.jit
def query_factors(amax, HEADROOM: tl.constexpr):
    """Powers of two (factor, undo), factor * undo == 1: x * factor puts a row of absmax amax
    at [2^14, 2^15) / 2^HEADROOM (encode.fp16_row_factors with room for the rotation, whose
    outputs are sums of D = 2^HEADROOM of its elements), so the rotated row neither overflows
    float32 nor fp16. The factor stops at 2^+-126, as fp16_row_factors' does."""
    expo = (float_bits(amax) >> 23) & 0xFF
    k = FP16_ROW_EXPONENT - HEADROOM - expo
    k = tl.minimum(tl.maximum(k, -MAX_FACTOR_EXPONENT), MAX_FACTOR_EXPONENT)
    return bits_float((127 + k) << 23), bits_float((127 - k) << 23)


@triton.jit
def unrotate_rows(x, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_D: tl.constexpr, ROTATE: tl.constexpr):
    """Output rows in the rotated basis -> the model's: s * fwht(x) / B (`_norot`: x)."""
    if ROTATE:
        x = over_blocks(flip_signs(fwht(x, BLOCK_M, BLOCK_D, HEAD_D), BLOCK_D), BLOCK_D, HEAD_D)
    return x
