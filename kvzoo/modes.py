"""Quantization modes: what a cache stores and the constants of its encoding.

The arithmetic is written down in kvzoo_spec/SPEC.md; a mode's code format (kvzoo.formats)
holds the constants. This module names the modes and parses the strings engines pass around.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from .errors import fail
from .formats import FLOAT8_E4M3FN, FLOAT8_E4M3FNUZ, FLOAT8_E5M2, INT8, CodeFormat

Granularity = Literal["none", "per_tensor", "per_token_head"]
Rounding = Literal["nearest", "trunc"]
ROUNDINGS: tuple[str, ...] = ("nearest", "trunc")

# float32(1e-6): keeps the scale of an all-zero (or nearly so) row finite and non-zero.
SCALE_FLOOR = np.float32(1e-6)

# Canonical float32 NaN stored as the scale of a row holding a NaN; hardware default NaNs
# differ (x86 gives 0xFFC00000, NVIDIA 0x7FFFFFFF) and scales are compared as raw bytes.
CANONICAL_NAN_BITS = 0x7FC00000


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

    @property
    def per_token_head(self) -> bool:
        return self.granularity == "per_token_head"

    @property
    def per_tensor(self) -> bool:
        return self.granularity == "per_tensor"

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

    def cache_width(self, head_size: int) -> int:
        """Last-axis length of a cache holding rows of head_size elements."""
        return head_size if self.format is None else self.format.storage_width(head_size)

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
}


# Engine kv-cache dtypes kvzoo knows of but does not implement.
NOT_IMPLEMENTED: frozenset[str] = frozenset({"fp8_inc", "fp8_ds_mla", "int4_per_token_head"})


def get_kv_quant_mode(name: str | QuantMode) -> QuantMode:
    """Parse an engine's kv-cache dtype string ("auto", "fp8", "int8_per_token_head", ...)."""
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
        fail(f"mode: unknown kv-cache quantization mode {name!r}; valid names: {', '.join(sorted(_ALIASES))}")
    return MODES[_ALIASES[key]]
