"""PagedKVCache: one layer's quantized paged cache as an object (allocate, write, read, attend)."""

from __future__ import annotations

from typing import Any

from . import api
from .layout import KVCacheTensors, allocate_inline, allocate_separate
from .modes import QuantMode, get_kv_quant_mode
from .validate import fail


class PagedKVCache:
    """Codes and scales for one attention layer, in the separate or the inline layout.

    The cache starts zero-filled, so `read()` of a slot never written gives 0.

    >>> cache = PagedKVCache(num_blocks=64, block_size=16, num_kv_heads=8, head_size=128,
    ...                      mode="int8_per_token_head", device="cpu")
    >>> cache.write(key, value, slot_mapping)
    >>> out = cache.attention(query, block_tables=bt, seq_lens=lens, query_start_loc=qsl)
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        mode: str | QuantMode,
        *,
        layout: str = "separate",
        model_dtype: str = "bfloat16",
        device: str | None = "cpu",
        k_scale: float | None = None,
        v_scale: float | None = None,
    ) -> None:
        self.mode = get_kv_quant_mode(mode)
        if layout == "separate":
            self.tensors: KVCacheTensors = allocate_separate(
                num_blocks,
                block_size,
                num_kv_heads,
                head_size,
                self.mode,
                model_dtype=model_dtype,
                device=device,
            )
        elif layout == "inline":
            self.tensors = allocate_inline(num_blocks, block_size, num_kv_heads, head_size, self.mode, device=device)
        else:
            fail(f"layout: expected 'separate' or 'inline', got {layout!r}")
        self.layout = layout
        self.k_scale, self.v_scale = k_scale, v_scale

    def _scales(self) -> dict[str, Any]:
        t = self.tensors
        return dict(
            k_scale_cache=t.k_scale_cache, v_scale_cache=t.v_scale_cache, k_scale=self.k_scale, v_scale=self.v_scale
        )

    def write(self, key: Any, value: Any, slot_mapping: Any, **options: Any) -> None:
        _refuse_own(options, _WRITE_OWN)
        api.reshape_and_cache(
            key,
            value,
            self.tensors.key_cache,
            self.tensors.value_cache,
            slot_mapping,
            mode=self.mode,
            **self._scales(),
            **options,
        )

    def read(self, which: str = "key", *, block_tables: Any = None, seq_lens: Any = None, **options: Any) -> Any:
        """Decoded float32 keys or values (whole cache, or the tokens of given sequences)."""
        if which not in ("key", "value"):
            fail(f"which: expected 'key' or 'value', got {which!r}")
        t = self.tensors
        cache, scale_cache = (t.key_cache, t.k_scale_cache) if which == "key" else (t.value_cache, t.v_scale_cache)
        scale = self.k_scale if which == "key" else self.v_scale
        _refuse_own(options, _READ_OWN)
        return api.dequantize(
            cache, scale_cache, mode=self.mode, scale=scale, block_tables=block_tables, seq_lens=seq_lens, **options
        )

    def attention(self, query: Any, **kwargs: Any) -> Any:
        _refuse_own(kwargs, _ATTENTION_OWN)
        return api.paged_attention(
            query, self.tensors.key_cache, self.tensors.value_cache, mode=self.mode, **self._scales(), **kwargs
        )


# What a PagedKVCache passes itself: given again per call, Python would raise a bare TypeError.
_WRITE_OWN = ("mode", "key_cache", "value_cache", "k_scale_cache", "v_scale_cache", "k_scale", "v_scale")
_ATTENTION_OWN = _WRITE_OWN
_READ_OWN = ("mode", "cache", "scale_cache", "scale")


def _refuse_own(options: dict[str, Any], own: tuple[str, ...]) -> None:
    for name in own:
        if name in options:
            fail(
                f"{name}: a PagedKVCache passes its own (mode, caches and static scales are fixed when it "
                "is built); leave it out of the call"
            )
