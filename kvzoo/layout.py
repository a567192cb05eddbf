"""Cache layouts, all plain strided views so kernels only ever see strides.

separate: vLLM's tensors, key_cache/value_cache [num_blocks, block_size, H, D] and float32
    k_scale_cache/v_scale_cache [num_blocks, block_size, H].
inline: one byte buffer [num_blocks, 2, block_size, H, D + 4]; each (slot, head) row holds its
    D codes then its float32 scale (little-endian), so a page decodes with no side tensor.
    Byte-compatible with vLLM's later Triton backend (K at index 0, V at index 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .arrays import is_torch, numpy_dtype, require_torch, torch_dtype
from .modes import QuantMode, get_kv_quant_mode
from .validate import FLOAT_INPUTS, fail, int_scalar

SCALE_BYTES = 4


@dataclass(frozen=True)
class KVCacheTensors:
    key_cache: Any
    value_cache: Any
    k_scale_cache: Any | None = None
    v_scale_cache: Any | None = None
    # The single buffer behind an inline layout (None for separate tensors).
    buffer: Any | None = None


def _zeros(shape, dtype: str, device: str | None):
    # Zero-filled, not uninitialised: a slot never written decodes to 0 (codes 0, scale 0),
    # never to whatever bytes the allocator left there.
    if device is None:
        return np.zeros(shape, numpy_dtype(dtype))
    torch = require_torch(f"device={device!r} (torch tensors)", "or pass device=None for NumPy arrays")
    return torch.zeros(shape, dtype=torch_dtype(dtype), device=device)


def _check_geometry(num_blocks: Any, block_size: Any, num_kv_heads: Any, head_size: Any) -> None:
    for name, value in (
        ("num_blocks", num_blocks),
        ("block_size", block_size),
        ("num_kv_heads", num_kv_heads),
        ("head_size", head_size),
    ):
        int_scalar(name, value, 1)


def allocate_separate(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    mode: str | QuantMode,
    *,
    model_dtype: str = "bfloat16",
    device: str | None = "cpu",
) -> KVCacheTensors:
    """Zero-filled separate-layout tensors (device=None gives NumPy arrays).

    model_dtype is the cache dtype of mode "none" ("bfloat16", "float16" or "float32")."""
    mode = get_kv_quant_mode(mode)
    _check_geometry(num_blocks, block_size, num_kv_heads, head_size)
    if model_dtype not in FLOAT_INPUTS:
        fail(f"model_dtype: expected one of {list(FLOAT_INPUTS)}, got {model_dtype!r}")
    shape = (num_blocks, block_size, num_kv_heads, mode.cache_width(head_size))
    dtype = mode.code_dtype or model_dtype
    scales = (
        (_zeros(shape[:3], "float32", device), _zeros(shape[:3], "float32", device))
        if mode.per_token_head
        else (None, None)
    )
    return KVCacheTensors(_zeros(shape, dtype, device), _zeros(shape, dtype, device), *scales)


def allocate_inline(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    mode: str | QuantMode,
    *,
    device: str | None = "cpu",
) -> KVCacheTensors:
    """A zero-filled inline-layout page buffer and its four views (device=None gives NumPy)."""
    mode = get_kv_quant_mode(mode)
    _require_inline(mode)
    _check_geometry(num_blocks, block_size, num_kv_heads, head_size)
    buffer = _zeros((num_blocks, 2, block_size, num_kv_heads, head_size + SCALE_BYTES), "uint8", device)
    return inline_views(buffer, head_size, mode)


def _require_inline(mode: QuantMode) -> None:
    refusal = mode.inline_refusal()
    if refusal:
        fail(f"mode: {refusal}")


def inline_views(buffer: Any, head_size: int, mode: str | QuantMode) -> KVCacheTensors:
    """Code and scale views of an inline-layout byte buffer."""
    mode = get_kv_quant_mode(mode)
    _require_inline(mode)
    if head_size % SCALE_BYTES:
        fail(f"head_size: the inline layout needs a multiple of 4 (float32 scale alignment), got {head_size}")
    if tuple(buffer.shape[1:2]) != (2,) or buffer.shape[-1] != head_size + SCALE_BYTES or len(buffer.shape) != 5:
        fail(
            f"buffer: expected uint8 [num_blocks, 2, block_size, H, {head_size + SCALE_BYTES}], got {tuple(buffer.shape)}"
        )
    code_dtype = mode.code_format.storage_dtype  # _require_inline refused mode "none"
    if is_torch(buffer):
        codes = buffer[..., :head_size].view(torch_dtype(code_dtype))
        words = buffer.view(torch_dtype("float32"))[..., head_size // SCALE_BYTES]
    else:
        codes = buffer[..., :head_size].view(numpy_dtype(code_dtype))
        words = buffer.view(np.float32)[..., head_size // SCALE_BYTES]
    return KVCacheTensors(codes[:, 0], codes[:, 1], words[:, 0], words[:, 1], buffer=buffer)


__all__ = ["KVCacheTensors", "allocate_separate", "allocate_inline", "inline_views"]
