"""Quantization modes: what a cache stores and the constants of its encoding.

The arithmetic these constants feed is written down in kvzoo_spec/SPEC.md; this module only
names the modes and parses the strings engines pass around.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from .errors import fail

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
    """One way of storing K/V rows in the cache."""

    name: str
    granularity: Granularity
    # Storage dtype of the codes, or None when the cache holds the model dtype (mode "none").
    code_dtype: str | None
    qmax: float = 0.0
    qmin: float = 0.0
    # Byte value stored for a non-finite y (the format's NaN; int8 has none, the scale
    # carries the poison instead).
    nan_code: int = 0

    @property
    def per_token_head(self) -> bool:
        return self.granularity == "per_token_head"

    @property
    def per_tensor(self) -> bool:
        return self.granularity == "per_tensor"

    @property
    def is_int8(self) -> bool:
        return self.code_dtype == "int8"

    @property
    def is_fp8(self) -> bool:
        return self.code_dtype is not None and self.code_dtype.startswith("float8")

    def __str__(self) -> str:
        return self.name


NONE = QuantMode("none", "none", None)
FP8_PER_TENSOR = QuantMode("fp8_per_tensor", "per_tensor", "float8_e4m3fn", 448.0, -448.0, 0x7F)
INT8_PER_TOKEN_HEAD = QuantMode("int8_per_token_head", "per_token_head", "int8", 127.0, -128.0, 0)
FP8_PER_TOKEN_HEAD = QuantMode(
    "fp8_per_token_head", "per_token_head", "float8_e4m3fn", 448.0, -448.0, 0x7F
)
# ROCm MI300 variant. 224 rather than the format's 240 follows vLLM, whose ROCm path reported
# accuracy problems at 240.
FP8_E4M3FNUZ_PER_TOKEN_HEAD = QuantMode(
    "fp8_e4m3fnuz_per_token_head", "per_token_head", "float8_e4m3fnuz", 224.0, -224.0, 0x80
)

MODES: dict[str, QuantMode] = {
    m.name: m
    for m in (NONE, FP8_PER_TENSOR, INT8_PER_TOKEN_HEAD, FP8_PER_TOKEN_HEAD, FP8_E4M3FNUZ_PER_TOKEN_HEAD)
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
}


# Engine kv-cache dtypes kvzoo knows of but does not implement.
NOT_IMPLEMENTED: frozenset[str] = frozenset(
    {"fp8_e5m2", "fp8_inc", "fp8_ds_mla", "int4_per_token_head", "int8_per_tensor"}
)


def get_kv_quant_mode(name: str | QuantMode) -> QuantMode:
    """Parse an engine's kv-cache dtype string ("auto", "fp8", "int8_per_token_head", ...)."""
    if isinstance(name, QuantMode):
        return name
    if not isinstance(name, str):
        fail(f"mode: expected a str or QuantMode, got {type(name).__name__}")
    key = name.strip().lower()
    if key in NOT_IMPLEMENTED:
        fail(f"mode: {name!r} is an engine kv-cache dtype that kvzoo does not implement yet; "
             f"implemented: {', '.join(sorted(_ALIASES))}")
    if key not in _ALIASES:
        fail(f"mode: unknown kv-cache quantization mode {name!r}; valid names: {', '.join(sorted(_ALIASES))}")
    return MODES[_ALIASES[key]]
