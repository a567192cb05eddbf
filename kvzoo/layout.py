"""Cache layouts, all plain strided views so kernels only ever see strides.

separate: vLLM's tensors, key_cache/value_cache [num_blocks, block_size, H, D] and float32
    k_scale_cache/v_scale_cache [num_blocks, block_size, H].
inline: one byte buffer [num_blocks, 2, block_size, H, D + 4]; each (slot, head) row holds its
    D codes then its float32 scale (little-endian), so a page decodes with no side tensor.
    Byte-compatible with vLLM's later Triton backend (K at index 0, V at index 1).
aligned inline (row_align): the same page with each row padded to row_bytes, a multiple of 16
    (or a power of two), [num_blocks, 2, block_size, H, row_bytes]: codes, scale, then padding
    no kernel reads or writes. Every row then starts on 16 bytes, which wide loads need.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .arrays import is_torch, numpy_dtype, require_torch, torch_dtype
from .modes import QuantMode, get_kv_quant_mode
from .validate import FLOAT_INPUTS, fail, int_scalar

SCALE_BYTES = 4
# Rows of an aligned inline page start on multiples of this many bytes.
ROW_ALIGN_BYTES = 16

RowAlign = int | str | None


@dataclass(frozen=True)
class KVCacheTensors:
    key_cache: Any
    value_cache: Any
    k_scale_cache: Any | None = None
    v_scale_cache: Any | None = None
    # The single buffer behind an inline layout (None for separate tensors).
    buffer: Any | None = None

    def scale_arguments(self, k_scale: Any = None, v_scale: Any = None) -> dict[str, Any]:
        """What an op call over these pages takes besides their codes: their scale caches (None
        where the mode keeps none) and a per-tensor mode's static scales, as given."""
        return dict(
            k_scale_cache=self.k_scale_cache, v_scale_cache=self.v_scale_cache, k_scale=k_scale, v_scale=v_scale
        )


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
    rows = (num_blocks, block_size, num_kv_heads)
    key_cache, value_cache = (
        _zeros((*rows, side.cache_width(head_size)), side.code_dtype or model_dtype, device)
        for side in (mode.key_side, mode.value_side)
    )
    scales = (_zeros(rows, "float32", device), _zeros(rows, "float32", device)) if mode.per_token_head else (None, None)
    return KVCacheTensors(key_cache, value_cache, *scales)


def allocate_inline(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    mode: str | QuantMode,
    *,
    device: str | None = "cpu",
    row_align: RowAlign = None,
) -> KVCacheTensors:
    """A zero-filled inline-layout page buffer and its four views (device=None gives NumPy).

    row_align: None, vLLM's rows of head_size + 4 bytes; an int (a multiple of 16), each row
    padded to a multiple of it; "pow2", each row padded to a power of two (at least 16), so a
    page holds block_size * num_kv_heads * 2 * a power of two bytes (inline_row_bytes)."""
    mode = get_kv_quant_mode(mode)
    _require_inline(mode)
    _check_geometry(num_blocks, block_size, num_kv_heads, head_size)
    row = inline_row_bytes(head_size, row_align)
    buffer = _zeros((num_blocks, 2, block_size, num_kv_heads, row), "uint8", device)
    return inline_views(buffer, head_size, mode)


def inline_row_bytes(head_size: int, row_align: RowAlign = None) -> int:
    """Bytes of one (slot, head) row of an inline page: head_size codes and a float32 scale,
    padded as row_align asks (allocate_inline)."""
    int_scalar("head_size", head_size, 1)
    row = head_size + SCALE_BYTES
    if row_align is None:
        return row
    if row_align == "pow2":
        return max(ROW_ALIGN_BYTES, 1 << (row - 1).bit_length())
    if isinstance(row_align, bool) or not isinstance(row_align, int) or row_align <= 0 or row_align % ROW_ALIGN_BYTES:
        fail(f"row_align: expected None, 'pow2' or a positive multiple of {ROW_ALIGN_BYTES} (bytes), got {row_align!r}")
    return -(-row // row_align) * row_align


def _require_inline(mode: QuantMode) -> None:
    refusal = mode.inline_refusal()
    if refusal:
        fail(f"mode: {refusal}")


def inline_views(buffer: Any, head_size: int, mode: str | QuantMode) -> KVCacheTensors:
    """Code and scale views of an inline-layout byte buffer, its rows unpadded (head_size + 4
    bytes) or padded (a multiple of 16 bytes, at least head_size + 4): the row's bytes are the
    buffer's last dimension."""
    mode = get_kv_quant_mode(mode)
    _require_inline(mode)
    if head_size % SCALE_BYTES:
        fail(f"head_size: the inline layout needs a multiple of 4 (float32 scale alignment), got {head_size}")
    row = head_size + SCALE_BYTES
    if tuple(buffer.shape[1:2]) != (2,) or len(buffer.shape) != 5:
        fail(f"buffer: expected uint8 [num_blocks, 2, block_size, H, {row}], got {tuple(buffer.shape)}")
    last = int(buffer.shape[-1])
    if last != row and (last < row or last % ROW_ALIGN_BYTES):
        fail(
            f"buffer: expected uint8 [num_blocks, 2, block_size, H, row bytes] with row bytes {row} (head_size + 4) "
            f"or a multiple of {ROW_ALIGN_BYTES} over it (a padded row), got {tuple(buffer.shape)}"
        )
    code_dtype = mode.code_format.storage_dtype  # _require_inline refused mode "none"
    if is_torch(buffer):
        codes = buffer[..., :head_size].view(torch_dtype(code_dtype))
        words = buffer.view(torch_dtype("float32"))[..., head_size // SCALE_BYTES]
    else:
        codes = buffer[..., :head_size].view(numpy_dtype(code_dtype))
        words = buffer.view(np.float32)[..., head_size // SCALE_BYTES]
    return KVCacheTensors(codes[:, 0], codes[:, 1], words[:, 0], words[:, 1], buffer=buffer)


__all__ = ["KVCacheTensors", "allocate_separate", "allocate_inline", "inline_row_bytes", "inline_views"]
