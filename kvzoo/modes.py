"""Quantization modes: what a cache stores and the constants of its encoding.

The arithmetic is written down in kvzoo_spec/SPEC.md; a mode's code format (kvzoo.formats)
holds the constants. This module names the modes and parses the strings engines pass around.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from .errors import did_you_mean, fail
from .formats import FLOAT8_E4M3FN, FLOAT8_E4M3FNUZ, FLOAT8_E5M2, INT8, UINT4, CodeFormat

Granularity = Literal["none", "per_tensor", "per_token_head"]
Rounding = Literal["nearest", "trunc"]
ROUNDINGS: tuple[str, ...] = ("nearest", "trunc")

# float32(1e-6): keeps the scale of an all-zero (or nearly so) row finite and non-zero.
SCALE_FLOOR = np.float32(1e-6)

# fp8_dots (SPEC.md 8.3): a key tile's weights are divided by their largest (floored at
# FP8_DOTS_WEIGHT_FLOOR, so the factor stays finite where a row sees no key of the tile) and
# multiplied by FP8_DOTS_WEIGHT_UNIT (a power of two: exact) before their e4m3 rounding, so the
# largest is the code 256 and none saturates.
FP8_DOTS_WEIGHT_UNIT = 256.0
FP8_DOTS_WEIGHT_FLOOR = 2.0**-100

# Canonical float32 NaN stored as the scale of a row holding a NaN; hardware default NaNs
# differ (x86 gives 0xFFC00000, NVIDIA 0x7FFFFFFF) and scales are compared as raw bytes.
CANONICAL_NAN_BITS = 0x7FC00000

# The randomized Hadamard rotation of int4_per_token_head (SPEC.md section 3.4): bit i set
# means sign -1 for element i; head size D uses bits 0..D-1. vLLM's signs, as SPEC.md says
# they were produced.
RHT_SIGN_BITS = int(
    "75625346365fdb8932d9dff1cfc7869167fc4ca6e46ae22557563834b291e3cc"
    "05dfbc5fcdf467b754503bbeb55b747e9480abc759bbc2937f7fca4e9a8ca6f2",
    16,
)
RHT_MAX_HEAD_SIZE = 512


@functools.cache
def rht_signs(head_size: int) -> np.ndarray:
    """The rotation's signs for head_size (<= RHT_MAX_HEAD_SIZE), float32 +-1 (read-only: one
    array per head size, shared by every caller)."""
    if not 1 <= head_size <= RHT_MAX_HEAD_SIZE:
        raise ValueError(f"head_size: the rotation takes [1, {RHT_MAX_HEAD_SIZE}], got {head_size}")
    signs = np.array([-1.0 if RHT_SIGN_BITS >> i & 1 else 1.0 for i in range(head_size)], dtype=np.float32)
    signs.setflags(write=False)
    return signs


def rht_blocks(head_size: int) -> tuple[tuple[int, int], ...]:
    """(offset, size) of each Hadamard block of the rotation (SPEC.md 3.4): head_size's binary
    digits, largest first, so each block starts at a multiple of its size; a power of two is one."""
    blocks, offset = [], 0
    for bit in reversed(range(head_size.bit_length())):
        if head_size >> bit & 1:
            blocks.append((offset, 1 << bit))
            offset += 1 << bit
    return tuple(blocks)


@functools.cache
def rht_block_sizes(head_size: int) -> np.ndarray:
    """Each element's block size (float32 [head_size], read-only): what SPEC.md 3.4's inverse
    divides it by, head_size itself for a power of two."""
    sizes = np.concatenate([np.full(size, size, dtype=np.float32) for _, size in rht_blocks(head_size)])
    sizes.setflags(write=False)
    return sizes


@dataclass(frozen=True)
class HeadSizes:
    """The head sizes a mode takes: lowest..highest (None: no bound), only powers of two where
    power_of_two, only multiples of `multiple` (int4's two codes a byte). Asked by every layer
    that derives a cache's shape (QuantMode.cache_width) and by the conformance cases, which
    pick their shapes from it."""

    lowest: int = 1
    highest: int | None = None
    power_of_two: bool = False
    multiple: int = 1

    def takes(self, head_size: int) -> bool:
        if head_size < self.lowest or (self.highest is not None and head_size > self.highest):
            return False
        if head_size % self.multiple:
            return False
        return not self.power_of_two or head_size & (head_size - 1) == 0

    def __str__(self) -> str:
        kind = (
            "a power of two"
            if self.power_of_two
            else {1: "an int", 2: "an even int"}.get(self.multiple, f"a multiple of {self.multiple}")
        )
        return f"{kind} in [{self.lowest}, {self.highest}]" if self.highest is not None else f"{kind} >= {self.lowest}"

    def closest(self, head_size: int) -> int:
        """The size taken nearest to head_size (the larger of two equally near)."""
        if self.takes(head_size):
            return head_size
        if not self.power_of_two:
            top = self.highest if self.highest is not None else max(head_size, self.lowest) + self.multiple
            taken = [d for d in range(self.lowest, top + 1) if self.takes(d)]
            return min(taken, key=lambda d: (abs(d - head_size), -d))
        top = self.highest if self.highest is not None else max(head_size, self.lowest) * 2
        taken = [d for d in (1 << k for k in range(top.bit_length())) if self.takes(d)]
        return min(taken, key=lambda d: (abs(d - head_size), -d))


ANY_HEAD_SIZE = HeadSizes()
# Powers of two, as vLLM asserts for its rotation, and its sign table's 512 at most.
INT4_HEAD_SIZES = HeadSizes(2, RHT_MAX_HEAD_SIZE, power_of_two=True)
# The rotation's blocks (SPEC.md 3.4) take any head size; the packing, two codes a byte, an even one.
RHT_HEAD_SIZES = HeadSizes(2, RHT_MAX_HEAD_SIZE, multiple=2)


@dataclass(frozen=True)
class QuantMode:
    """One way of storing K/V rows in the cache: (name, granularity, code format, roundings).

    format is None for mode "none" (the cache holds the model dtype). The properties below
    ask the format, so no layer keeps its own copy of a format's constants.
    """

    name: str
    granularity: Granularity
    format: CodeFormat | None = None
    # Roundings of y to a code the mode defines ("trunc" only for integer formats).
    roundings: tuple[str, ...] = ("nearest",)
    # The rotation applied to every row before it is quantized (and to queries at attention,
    # undone on the output): "rht" (SPEC.md section 3.4) or None.
    rotation: str | None = None
    head_sizes: HeadSizes = ANY_HEAD_SIZE
    # Whether SPEC.md section 5's inline page (each row's codes, then its float32 scale) is
    # defined for the mode's rows: not yet for packed int4 rows (SPEC.md section 5.3).
    inline_page: bool = True
    # Keys and values stored in different formats (SPEC.md section 2's per-side rows): the
    # one-sided modes of the key and of the value rows. None: both sides are this mode. The
    # fields above then describe the key side (so a layer that reads them sees the keys'), and
    # every layer that touches a cache asks key_side / value_side for its side.
    sides: tuple[QuantMode, QuantMode] | None = None

    @property
    def key_side(self) -> QuantMode:
        """The one-sided mode the key rows are stored in (this mode unless it is split)."""
        return self if self.sides is None else self.sides[0]

    @property
    def value_side(self) -> QuantMode:
        """The one-sided mode the value rows are stored in (this mode unless it is split)."""
        return self if self.sides is None else self.sides[1]

    @property
    def key_format(self) -> CodeFormat | None:
        return self.key_side.format

    @property
    def value_format(self) -> CodeFormat | None:
        return self.value_side.format

    @property
    def split(self) -> bool:
        """Whether keys and values are stored in different modes."""
        return self.sides is not None

    @property
    def per_token_head(self) -> bool:
        return self.granularity == "per_token_head"

    @property
    def per_tensor(self) -> bool:
        return self.granularity == "per_tensor"

    @property
    def code_format(self) -> CodeFormat:
        """The format, for callers that have ruled out mode "none" (which stores the model dtype)."""
        if self.format is None:
            raise ValueError(f"mode {self.name!r} stores the model dtype: it has no code format")
        return self.format

    @property
    def code_kind(self) -> str | None:
        """ "int" or "float" (the format's kind), None for mode "none"."""
        return None if self.format is None else self.format.kind

    @property
    def code_dtype(self) -> str | None:
        """Storage dtype of the codes, or None when the cache holds the model dtype."""
        return None if self.format is None else self.format.storage_dtype

    @property
    def qmax(self) -> float:
        return 0.0 if self.format is None else self.format.qmax

    @property
    def qmin(self) -> float:
        return 0.0 if self.format is None else self.format.qmin

    @property
    def nan_code(self) -> int:
        return 0 if self.format is None else self.format.nan_code

    @property
    def inf_codes(self) -> tuple[int, int]:
        """Bytes stored for y = +Inf and -Inf (only a static scale's x / s can be infinite)."""
        return (0, 0) if self.format is None else self.format.inf_codes

    @property
    def scale_floor(self) -> np.float32:
        return SCALE_FLOOR

    @property
    def holds_nan(self) -> bool:
        """Whether a cache of this mode can hold a value that decodes to NaN: the model dtype, a
        per-row scale, or a format with a NaN code (int8_per_tensor has none of them)."""
        return self.format is None or self.per_token_head or bool(self.format.nan_codes)

    def head_size_refusal(self, head_size: int) -> str | None:
        """Why the mode does not take head_size (to follow an argument's name); None if it does."""
        if self.head_sizes.takes(head_size):
            return None
        return f"mode {self.name!r} takes a head_size that is {self.head_sizes}, got {head_size}"

    def cache_width(self, head_size: int) -> int:
        """Last-axis length of a cache holding rows of head_size elements; a head size the mode
        does not take is refused here, where every layer derives a cache's shape."""
        if self.head_sizes is not ANY_HEAD_SIZE:
            refusal = self.head_size_refusal(head_size)
            if refusal:
                fail(f"head_size: {refusal}")
        return head_size if self.format is None else self.format.storage_width(head_size)

    def head_size_of(self, cache_width: int) -> int:
        """The head size of a cache whose last axis is cache_width (cache_width's inverse)."""
        return cache_width if self.format is None else self.format.head_size_of(cache_width)

    def inline_refusal(self) -> str | None:
        """Why the inline layout (SPEC.md section 5) cannot hold this mode's rows; None when it can."""
        if not self.per_token_head:
            return f"the inline layout stores per-row scales; {self.name!r} has none"
        if self.split:
            return f"the inline page holds one format a row; {self.name!r} stores keys and values in two"
        if not self.inline_page:
            return f"the inline layout is not defined for {self.name!r} (SPEC.md section 5.3); use the separate one"
        return None

    @property
    def layouts(self) -> tuple[str, ...]:
        """The cache layouts defined for the mode (kvzoo.layout)."""
        return ("separate",) if self.inline_refusal() else ("separate", "inline")

    def scale_shape(self, num_blocks: int, block_size: int, num_kv_heads: int) -> tuple[int, ...] | None:
        """Shape of the float32 scale storage of one cache (K or V): a scale per row for
        per-token-head, one static [1] scale per tensor, none for mode "none"."""
        if self.per_token_head:
            return (num_blocks, block_size, num_kv_heads)
        return (1,) if self.per_tensor else None

    def __str__(self) -> str:
        return self.name


NONE = QuantMode("none", "none")
FP8_PER_TENSOR = QuantMode("fp8_per_tensor", "per_tensor", FLOAT8_E4M3FN)
INT8_PER_TOKEN_HEAD = QuantMode("int8_per_token_head", "per_token_head", INT8, ROUNDINGS)
FP8_PER_TOKEN_HEAD = QuantMode("fp8_per_token_head", "per_token_head", FLOAT8_E4M3FN)
FP8_E4M3FNUZ_PER_TOKEN_HEAD = QuantMode("fp8_e4m3fnuz_per_token_head", "per_token_head", FLOAT8_E4M3FNUZ)
# vLLM's static-scale int8 (PR 41954): round-to-nearest-even only, as its cache write does.
INT8_PER_TENSOR = QuantMode("int8_per_tensor", "per_tensor", INT8)
FP8_E5M2_PER_TENSOR = QuantMode("fp8_e5m2_per_tensor", "per_tensor", FLOAT8_E5M2)
# vLLM's int4 per-token-head (PR 40835): rows rotated, then asymmetric 4-bit codes with the
# zero point in the scale word (SPEC.md section 2's int4 rows); the variant without rotation is kvzoo's.
INT4_PER_TOKEN_HEAD = QuantMode(
    "int4_per_token_head", "per_token_head", UINT4, rotation="rht", head_sizes=RHT_HEAD_SIZES, inline_page=False
)
INT4_PER_TOKEN_HEAD_NOROT = QuantMode(
    "int4_per_token_head_norot", "per_token_head", UINT4, head_sizes=INT4_HEAD_SIZES, inline_page=False
)


def split_mode(name: str, key: QuantMode, value: QuantMode) -> QuantMode:
    """A mode storing keys as `key` does and values as `value` does (both per token-head): its
    head sizes are those both sides take, its roundings those both define; the inline page
    holds one format a row, so a split mode has the separate layout only."""
    if not (key.per_token_head and value.per_token_head) or key.split or value.split:
        raise ValueError("split_mode: both sides must be one-sided per-token-head modes")
    sides = (key, value)
    highs = [m.head_sizes.highest for m in sides if m.head_sizes.highest is not None]
    head_sizes = HeadSizes(
        max(m.head_sizes.lowest for m in sides),
        min(highs) if highs else None,
        any(m.head_sizes.power_of_two for m in sides),
        math.lcm(*(m.head_sizes.multiple for m in sides)),
    )
    return QuantMode(
        name,
        "per_token_head",
        key.format,
        roundings=tuple(r for r in key.roundings if r in value.roundings),
        rotation=key.rotation,
        head_sizes=head_sizes,
        inline_page=False,
        sides=sides,
    )


# Keys keep 8 bits, values take 4 (keys need the precision: bench/RESULTS.md's K-only and
# V-only ablation); the value side rotated as int4_per_token_head rotates, or not.
INT8_K_INT4_V = split_mode("k_int8_v_int4", INT8_PER_TOKEN_HEAD, INT4_PER_TOKEN_HEAD)
INT8_K_INT4_V_NOROT = split_mode("k_int8_v_int4_norot", INT8_PER_TOKEN_HEAD, INT4_PER_TOKEN_HEAD_NOROT)
FP8_K_INT4_V = split_mode("k_fp8_v_int4", FP8_PER_TOKEN_HEAD, INT4_PER_TOKEN_HEAD)
FP8_K_INT4_V_NOROT = split_mode("k_fp8_v_int4_norot", FP8_PER_TOKEN_HEAD, INT4_PER_TOKEN_HEAD_NOROT)

MODES: dict[str, QuantMode] = {
    m.name: m
    for m in (
        NONE,
        FP8_PER_TENSOR,
        INT8_PER_TOKEN_HEAD,
        FP8_PER_TOKEN_HEAD,
        FP8_E4M3FNUZ_PER_TOKEN_HEAD,
        INT8_PER_TENSOR,
        FP8_E5M2_PER_TENSOR,
        INT4_PER_TOKEN_HEAD,
        INT4_PER_TOKEN_HEAD_NOROT,
        INT8_K_INT4_V,
        INT8_K_INT4_V_NOROT,
        FP8_K_INT4_V,
        FP8_K_INT4_V_NOROT,
    )
}

# Strings engines pass as kv_cache_dtype, mapped to kvzoo modes.
_ALIASES: dict[str, str] = {
    "auto": "none",
    "none": "none",
    # vLLM's --kv-cache-dtype names the model dtype for an unquantized cache.
    "bfloat16": "none",
    "float16": "none",
    "float32": "none",
    "fp8": "fp8_per_tensor",
    "fp8_e4m3": "fp8_per_tensor",
    "fp8_per_tensor": "fp8_per_tensor",
    "int8_per_token_head": "int8_per_token_head",
    "fp8_per_token_head": "fp8_per_token_head",
    "fp8_e4m3_per_token_head": "fp8_per_token_head",
    "fp8_e4m3fnuz_per_token_head": "fp8_e4m3fnuz_per_token_head",
    "int8_per_tensor": "int8_per_tensor",
    # vLLM's fp8_e5m2 is per tensor, like every fp8 string without a granularity.
    "fp8_e5m2": "fp8_e5m2_per_tensor",
    "fp8_e5m2_per_tensor": "fp8_e5m2_per_tensor",
    "int4_per_token_head": "int4_per_token_head",
    "int4_per_token_head_norot": "int4_per_token_head_norot",
    "k_int8_v_int4": "k_int8_v_int4",
    "k_int8_v_int4_norot": "k_int8_v_int4_norot",
    "k_fp8_v_int4": "k_fp8_v_int4",
    "k_fp8_v_int4_norot": "k_fp8_v_int4_norot",
}


# Engine kv-cache dtypes kvzoo knows of but does not implement.
NOT_IMPLEMENTED: frozenset[str] = frozenset({"fp8_inc", "fp8_ds_mla"})


def get_kv_quant_mode(name: str | QuantMode | None) -> QuantMode:
    """Parse an engine's kv-cache dtype string ("auto", "fp8", "int8_per_token_head", ...).

    None (a call record's mode not given) is refused as any other non-mode is."""
    if isinstance(name, QuantMode):
        return name
    if not isinstance(name, str):
        fail(f"mode: expected a str or QuantMode, got {type(name).__name__}")
    key = name.strip().lower()
    if key in NOT_IMPLEMENTED:
        fail(
            f"mode: {name!r} is an engine kv-cache dtype that kvzoo does not implement yet; "
            f"implemented: {', '.join(sorted(_ALIASES))}"
        )
    if key not in _ALIASES:
        fail(
            f"mode: unknown kv-cache quantization mode {name!r}{did_you_mean(key, _ALIASES)}; "
            f"valid names: {', '.join(sorted(_ALIASES))}"
        )
    return MODES[_ALIASES[key]]
