"""One layer's paged K/V storage: kvzoo tensors that grow by whole blocks.

The block ids come from the PageTable of the layer's group; a LayerStore keeps tensors of the
table's capacity (growing by copying into bigger ones, as often as the table grows: by
_pages.GROWTH of itself at least) and applies a step's copy-on-write block copies.

>>> import torch
>>> store = LayerStore("int8_per_token_head", "separate", block_size=16, num_kv_heads=2, head_size=64,
...                    model_dtype=torch.float32, device="cpu")
>>> store.ensure(4)
>>> tuple(store.tensors.key_cache.shape), store.bytes_per_token
((4, 16, 2, 64), 272)
"""

from __future__ import annotations

from typing import Any

import torch

from ...layout import KVCacheTensors, allocate_inline, allocate_separate
from ...modes import QuantMode, get_kv_quant_mode
from ...plan import CacheSpec

MODEL_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
}

# Same-width integer carriers: index copies on float8 tensors are not implemented on the CPU.
_CARRIERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _raw(x: torch.Tensor) -> torch.Tensor:
    return x.view(_CARRIERS[x.element_size()])


class LayerStore:
    """Code (and scale) tensors of one attention layer, [num_blocks, block_size, Hkv, ...].

    mode, layout: as kvzoo.PagedKVCache ("separate" or "inline"). model_dtype: the dtype of the
    model's K/V (the cache dtype of mode "none"). k_scale / v_scale: a per-tensor mode's static
    scales (floats), kept here as one-element float32 device tensors.
    """

    def __init__(
        self,
        mode: str | QuantMode,
        layout: str,
        *,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        model_dtype: torch.dtype,
        device: torch.device | str,
        k_scale: float | None = None,
        v_scale: float | None = None,
    ) -> None:
        self.mode = get_kv_quant_mode(mode)
        if model_dtype not in MODEL_DTYPES:
            raise TypeError(f"model_dtype: kvzoo takes {[str(d) for d in MODEL_DTYPES]}, got {model_dtype}")
        self.layout, self.block_size = layout, block_size
        self.num_kv_heads, self.head_size = num_kv_heads, head_size
        self.model_dtype, self.device = model_dtype, torch.device(device)
        self.num_blocks = 0
        self.tensors: KVCacheTensors | None = None
        self._spec: tuple[tuple[int, str], CacheSpec] | None = None
        self.k_scale = self.v_scale = None
        if self.mode.per_tensor:
            if k_scale is None or v_scale is None:
                raise ValueError(f"mode {self.mode.name!r} needs static k_scale and v_scale (floats)")
            self.k_scale = torch.tensor([k_scale], dtype=torch.float32, device=self.device)
            self.v_scale = torch.tensor([v_scale], dtype=torch.float32, device=self.device)

    def _allocate(self, num_blocks: int) -> KVCacheTensors:
        if self.layout == "inline":
            return allocate_inline(
                num_blocks, self.block_size, self.num_kv_heads, self.head_size, self.mode, device=str(self.device)
            )
        return allocate_separate(
            num_blocks,
            self.block_size,
            self.num_kv_heads,
            self.head_size,
            self.mode,
            model_dtype=MODEL_DTYPES[self.model_dtype],
            device=str(self.device),
        )

    def _arrays(self, tensors: KVCacheTensors) -> list[Any]:
        # The inline layout's four views share one buffer: moving the buffer moves them all.
        if tensors.buffer is not None:
            return [tensors.buffer]
        return [
            a
            for a in (tensors.key_cache, tensors.value_cache, tensors.k_scale_cache, tensors.v_scale_cache)
            if a is not None
        ]

    def ensure(self, capacity: int) -> None:
        """Hold at least `capacity` blocks, keeping what is stored."""
        if capacity <= self.num_blocks:
            return
        grown = self._allocate(capacity)
        if self.tensors is not None:
            for old, new in zip(self._arrays(self.tensors), self._arrays(grown)):
                new[: self.num_blocks].copy_(old)
        self.tensors, self.num_blocks = grown, capacity

    def spec(self, rounding: str) -> CacheSpec:
        """The CacheSpec of what this store holds now, built (and checked) again only when the
        store has grown: asked per layer call, it keys the step's plans (equal for every layer
        of one geometry, so they share one)."""
        key = (self.num_blocks, rounding)
        if self._spec is None or self._spec[0] != key:
            spec = CacheSpec(
                self.mode,
                num_blocks=self.num_blocks,
                block_size=self.block_size,
                num_kv_heads=self.num_kv_heads,
                head_size=self.head_size,
                layout=self.layout,
                model_dtype=MODEL_DTYPES[self.model_dtype],
                device=str(self.device),
                rounding=rounding,
            )
            self._spec = (key, spec)
        return self._spec[1]

    @property
    def pages(self) -> KVCacheTensors:
        """The layer's arrays, for the paths that run once ensure() has allocated them."""
        if self.tensors is None:
            raise ValueError("the layer's pages are not allocated yet: ensure() allocates them")
        return self.tensors

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """blocks[dst[i]] = blocks[src[i]] in every array (copy-on-write of shared blocks)."""
        for a in self._arrays(self.pages):
            raw = _raw(a)
            raw[dst] = raw[src]

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token occupies in this layer (K and V codes, plus their scales)."""
        if self.tensors is None:
            self.ensure(1)
        per_slot = sum(a[0].numel() * a.element_size() for a in self._arrays(self.pages))
        return per_slot // self.block_size

    @property
    def nbytes(self) -> int:
        """Bytes allocated for this layer (all blocks, used or not)."""
        return 0 if self.tensors is None else sum(a.numel() * a.element_size() for a in self._arrays(self.tensors))
