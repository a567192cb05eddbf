"""Compile-time values that the attention's host code passes and its kernels test: one definition
each, shared by both sides.

Each is a tl.constexpr. Kernels read them as globals by name, which Triton folds into the
cache key of every kernel that uses one, so renumbering a value here recompiles what tests it
(a plain int read as a module attribute would leave stale kernels in the on-disk cache). The
host passes the same objects as constexpr arguments.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...formats import FLOAT8_E4M3FN, INT8
from ...modes import FP8_DOTS_WEIGHT_FLOOR, FP8_DOTS_WEIGHT_UNIT
from .formats import CODE_E4M3FN, CODE_E4M3FN_CVT, CODE_INT8

# Where a mode's scales live (SCALE_MODE).
SCALE_NONE = tl.constexpr(0)  # mode "none"
SCALE_TENSOR = tl.constexpr(1)  # one static scale for K and one for V (k_scale, v_scale)
SCALE_TOKEN_HEAD = tl.constexpr(2)  # a scale per key and KV head (k_scale_cache, v_scale_cache)

# How the paged kernel turns what it loads from the cache into dot operands (CODE_CONVERT).
CONVERT_CAST = tl.constexpr(0)  # .to(dot dtype)
CONVERT_I8_ASM = tl.constexpr(1)  # int8 -> fp16 with byte permutes (CUDA): the cast is an I2F per code
CONVERT_TABLE = tl.constexpr(2)  # fp8 byte -> float32 through a 256-entry table (the interpreter has no fp8 math)
CONVERT_E4M3_ASM = tl.constexpr(3)  # e4m3 -> fp16 (CUDA), as inline asm so it stays in the load layout
CONVERT_BF16_BITS = tl.constexpr(4)  # bf16 caches as int16 bits, widened by hand (interpreter: encode.bf16_as_bits)
CONVERT_I8_OFFSET = tl.constexpr(5)  # int8 -> fp16 1152 + c (CUDA); dots corrected per row (decode)
CONVERT_I8_OFFSET_CAST = tl.constexpr(6)  # the same values through a cast and an add (interpreter)
# fp16 value of an int8 code c under the offset conversions, less c.
I8_OFFSET = tl.constexpr(1152.0)


@triton.constexpr_function
def offset_codes(convert):
    """Whether `convert` gives I8_OFFSET + c: every dot on such operands carries I8_OFFSET times
    the sum of the other operand's row, which the kernel takes back out."""
    return convert == CONVERT_I8_OFFSET or convert == CONVERT_I8_OFFSET_CAST


# exp2 and log2 carry the online softmax (one instruction each on a GPU): logits are kept in
# log2 units, and lse leaves in natural ones.
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)

# quantize_query's query codes follow the int8 cache format's row rule (SPEC.md 8.1), so they
# match the reference's: its code, its qmax and its NaN code.
QUERY_CODE = tl.constexpr(CODE_INT8)
QUERY_QMAX = tl.constexpr(INT8.qmax)
QUERY_NAN_CODE = tl.constexpr(INT8.nan_code)

# fp8_dots (SPEC.md 8.3): a query row's high term follows the e4m3fn cache format's row rule,
# its low term is the residual's e4m3 rounding; the tiles' weights as kvzoo.modes says.
FP8_QMAX = tl.constexpr(FLOAT8_E4M3FN.qmax)
FP8_CACHE_CODE = tl.constexpr(CODE_E4M3FN)  # how the high term's codes decode
FP8_CVT_CODE = tl.constexpr(CODE_E4M3FN_CVT)  # the hardware convert (encode.encoder_code)
FP8_NAN_CODE = tl.constexpr(FLOAT8_E4M3FN.nan_code)
FP8_WEIGHT_UNIT = tl.constexpr(FP8_DOTS_WEIGHT_UNIT)
FP8_WEIGHT_FLOOR = tl.constexpr(FP8_DOTS_WEIGHT_FLOOR)

# Block-table entries attention_tiles.sequence_ok reads per step of its pass.
TABLE_SCAN = tl.constexpr(128)
