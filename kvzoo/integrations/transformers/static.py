"""KVZooStaticCache: a fixed-size kvzoo cache whose decode step compiles (transformers' fast path).

transformers' fastest decode is a cache of fixed size with the decode forward compiled:
`generate()` compiles it by itself (torch.compile, mode "reduce-overhead": CUDA graphs) when the
cache says `is_compileable`, as StaticCache does. KVZooStaticCache keeps kvzoo's quantized pages
that way. Row b owns the blocks [b * W, (b + 1) * W) of every layer (W blocks hold
max_cache_len tokens), so the block tables never change; each layer counts the positions it
has seen in a device tensor, and the cache keeps each row's left padding on the device. A
decode step computes its slots and lengths from those on the device and calls kvzoo's torch
ops (kvzoo.torch_ops) with validate=False and host bounds, so the whole step traces into one
graph, reads nothing back and replays as a CUDA graph. Prefill steps (more than one token per
row) run eagerly, as generate() runs them: they read the padding mask once (left padding
only) and write the prompt's real tokens, compacted, to the front of each row's blocks.

Memory is fixed: max_batch_size x max_cache_len tokens of the mode's bytes per layer (sliding
layers too: their window applies in attention, not in storage; KVZooCache releases theirs).
The separate layout only (torch.compile does not take the inline page's views: kvzoo.torch_ops).

>>> import torch, transformers
>>> from kvzoo.integrations.transformers import KVZooStaticCache, use_kvzoo_attention
>>> config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
...                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)
>>> model = use_kvzoo_attention(transformers.LlamaForCausalLM(config).eval())
>>> cache = KVZooStaticCache(model.config, max_batch_size=1, max_cache_len=16, mode="int8_per_token_head",
...                          impl="numpy")
>>> out = model.generate(torch.tensor([[1, 2, 3, 4]]), past_key_values=cache, max_new_tokens=4, do_sample=False)
>>> tuple(out.shape), int(cache.get_seq_length())
((1, 8), 7)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch
from transformers.cache_utils import Cache

from ... import torch_ops
from ...modes import QuantMode, get_kv_quant_mode
from .cache import (
    _HANDOFF,
    KVZooIntegrationError,
    PagedLayer,
    _check_rounding,
    _head_size,
    _layer_scales,
    _layer_windows,
    _prefill_attention,
    _refuse_geometry,
    _require_kvzoo_attention,
    _row_indices,
    _text_config,
)
from .step import fresh_attention


def _static(t: torch.Tensor) -> torch.Tensor:
    # A fixed address: compiled graphs read and mutate it in place, and CUDA graphs replay on
    # it, instead of copying it in as an input on every call (StaticCache marks its tensors so).
    if not torch.compiler.is_compiling():
        torch._dynamo.mark_static_address(t)
    return t


class KVZooStaticLayer(PagedLayer):
    """One decoder layer of a KVZooStaticCache: its pages (a LayerStore of B x W blocks) and the
    positions it has seen (a device int64 scalar, padding included)."""

    is_compileable = True

    def __init__(self, cache: KVZooStaticCache, index: int, sliding_window: int | None) -> None:
        super().__init__(cache, index, sliding_window)
        self.cache: KVZooStaticCache = cache
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.positions: torch.Tensor | None = None

    @property
    def _positions(self) -> torch.Tensor:
        """Positions each row has seen, for the paths that run once initialize() has made them."""
        if self.positions is None:
            raise KVZooIntegrationError(f"layer {self.index}: no positions yet (its first cache.update sets them)")
        return self.positions

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        _, num_kv_heads, _, head_size = key_states.shape
        self.initialize(num_kv_heads, head_size, key_states.dtype, key_states.device)

    def initialize(self, num_kv_heads: int, head_size: int, dtype: torch.dtype, device: torch.device) -> None:
        cache = self.cache
        self.device, self.dtype = torch.device(device), dtype
        store = self._new_store(num_kv_heads, head_size, dtype, device)
        store.ensure(cache.max_batch_size * cache.blocks_per_row)
        for t in store._arrays(store.pages):
            _static(t)
        for t in (store.k_scale, store.v_scale):
            if t is not None:
                _static(t)
        self.store = store
        self.positions = _static(torch.zeros((), dtype=torch.int64, device=device))
        cache._ensure_shared(self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        """Take this step's K/V [B, Hkv, Q, D]; returns them unchanged for kvzoo's attention,
        which writes them into the pages."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cache._check_attention_implementation()
        if key_states.shape[0] != self.cache.max_batch_size:
            raise KVZooIntegrationError(
                f"layer {self.index}: a batch of {key_states.shape[0]} rows; this KVZooStaticCache holds "
                f"max_batch_size={self.cache.max_batch_size}"
            )
        self.pending = (key_states, value_states)
        _HANDOFF.layer = self
        return key_states, value_states

    def _attend_step(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, padding_mask: Any, options: dict[str, Any]
    ) -> torch.Tensor:
        # One token a row after the prefill is the compiled decode step; anything else runs eagerly.
        if self.pending is None or key is not self.pending[0] or value is not self.pending[1]:
            raise KVZooIntegrationError(
                f"layer {self.index}: the key/value given to attention are not the ones the cache handed out"
            )
        self.pending = None
        batch, num_q_heads, q_len, head_size = query.shape
        num_kv_heads = key.shape[1]
        cache = self.cache
        k = key.transpose(1, 2).reshape(batch * q_len, num_kv_heads, head_size)
        v = value.transpose(1, 2).reshape(batch * q_len, num_kv_heads, head_size)
        q = query.transpose(1, 2).reshape(batch * q_len, num_q_heads, head_size)
        if q_len == 1 and cache._prefilled:
            # Slot and length of each row's new token, from device tensors alone.
            before = self._positions - cache._pad  # real tokens each row holds already
            slots = cache.row_base + before
            self._positions.add_(1)
            self._write(k, v, slots)
            seq_lens = (before + 1).to(torch.int32)
            out = self._attend(q, seq_lens, cache.decode_qsl, 1, cache.max_cache_len, **options)
            return out.view(batch, 1, num_q_heads, head_size)
        step = cache._prefill_step(self, padding_mask, batch, q_len)
        self._positions.add_(q_len)
        self._write(k, v, step.slots)
        plain = options["sliding_window"] is None and options["softcap"] is None and options["sinks"] is None
        if cache.prefill_attention == "auto" and step.fresh and plain:
            return fresh_attention(query, key, value, options["softmax_scale"])
        if step.real_rows is not None:
            q = q.index_select(0, step.real_rows)
        out = self._attend(q, step.seq_lens, step.query_start_loc, step.max_query_len, step.max_seq_len, **options)
        if step.real_rows is not None:
            full = out.new_zeros(batch * q_len, num_q_heads, head_size)
            full[step.real_rows] = out
            out = full
        return out.view(batch, q_len, num_q_heads, head_size)

    def _op_arguments(self, op: str) -> dict[str, Any]:
        """What both of this layer's op calls pass besides their own arguments."""
        store, cache = self._store, self.cache
        # validate=False: the compiled decode step reads nothing back from the device.
        return dict(
            kv_cache_dtype=cache.mode.name,
            validate=False,
            impl=cache._impl(op),
            **store.pages.scale_arguments(store.k_scale, store.v_scale),
        )

    def _write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        t = self._store.pages
        torch_ops.reshape_and_cache(
            k,
            v,
            t.key_cache,
            t.value_cache,
            slots,
            rounding=self.cache.rounding,
            **self._op_arguments("reshape_and_cache"),
        )

    def _attend(self, q, seq_lens, qsl, max_query_len: int, max_seq_len: int, **options: Any) -> torch.Tensor:
        t = self._store.pages
        out = torch_ops.paged_attention(
            q,
            t.key_cache,
            t.value_cache,
            block_tables=self.cache.block_tables,
            seq_lens=seq_lens,
            query_start_loc=qsl,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            **self._op_arguments("paged_attention"),
            **options,
        )
        assert not isinstance(out, tuple)  # (out, lse) only with return_lse
        return out

    def get_seq_length(self, *args: Any) -> Any:
        # A device tensor, as StaticLayer's: an int would be read back on every step.
        return self.positions if self.is_initialized else 0

    def get_mask_sizes(self, query_length: Any, *args: Any) -> tuple[int, int]:
        return self.cache.max_cache_len, 0

    def get_max_length(self) -> int:
        return self.cache.max_cache_len

    def get_max_cache_shape(self) -> int:
        return self.cache.max_cache_len

    def offload(self) -> None:
        pass

    def prefetch(self) -> None:
        pass


class _PrefillStep:
    """A prefill step's metadata on the device (shared by every layer): slots [B*Q] int64 (-1
    for padding), the kept query rows (None: all), seq_lens [B] int32, query_start_loc [B+1]
    int32, and the bounds."""

    def __init__(self, slots, real_rows, seq_lens, qsl, max_query_len: int, max_seq_len: int, key: tuple) -> None:
        self.slots, self.real_rows, self.seq_lens, self.query_start_loc = slots, real_rows, seq_lens, qsl
        self.max_query_len, self.max_seq_len, self.key = max_query_len, max_seq_len, key
        # Every row's first step, unpadded: each row attends its own keys only (fresh_attention).
        self.fresh = key[0] == 0 and key[1] > 1 and real_rows is None


class KVZooStaticCache(Cache):
    """A fixed-size transformers Cache on kvzoo's paged, quantized KV cache, for compiled decode.

    config: the model's config. max_batch_size: rows the cache holds (every forward must have
    that many). max_cache_len: tokens per row it holds (prompt + new tokens; padding not counted).
    mode, rounding, k_scale, v_scale, impl, prefill_attention: as KVZooCache. block_size: tokens per page.

    generate() compiles its decode steps by itself on a GPU (the cache is compileable); a
    forward compiled by hand (torch.compile(model, fullgraph=True)) works too. Batch selection
    and repetition are not supported (the batch is fixed), beam reordering copies pages.
    """

    # The separate layout only, so no rows to pad: torch.compile does not take the inline
    # page's views (kvzoo.torch_ops). PagedLayer._new_store reads both off either cache.
    layout = "separate"
    row_align = None

    def __init__(
        self,
        config: Any,
        *,
        max_batch_size: int,
        max_cache_len: int,
        mode: str | QuantMode = "int8_per_token_head",
        block_size: int = 16,
        rounding: str = "nearest",
        k_scale: float | Sequence[float] | None = None,
        v_scale: float | Sequence[float] | None = None,
        impl: str | Mapping[str, Any] | None = None,
        prefill_attention: str = "auto",
    ) -> None:
        text, num_layers = _text_config(config)
        self.mode = get_kv_quant_mode(mode)
        self.prefill_attention = _prefill_attention(prefill_attention)
        _refuse_geometry(self.mode, self.layout, _head_size(text))
        _check_rounding(self.mode, rounding)
        for name, value in (("max_batch_size", max_batch_size), ("max_cache_len", max_cache_len)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
        self._k_scales, self._v_scales = _layer_scales(self.mode, k_scale, v_scale, num_layers)
        self.rounding, self.impl, self.block_size = rounding, impl, int(block_size)
        self._max_batch_size, self._max_cache_len = int(max_batch_size), int(max_cache_len)
        self.blocks_per_row = -(-self._max_cache_len // self.block_size)
        self._config = text
        self._prefilled = False
        self._step: _PrefillStep | None = None
        self.pad: torch.Tensor | None = None
        windows = _layer_windows(text, num_layers)
        super().__init__(layers=[KVZooStaticLayer(self, i, windows[i]) for i in range(num_layers)])

    def __repr__(self) -> str:
        return (
            f"KVZooStaticCache(mode={self.mode.name}, layers={len(self.layers)}, max_batch_size="
            f"{self._max_batch_size}, max_cache_len={self._max_cache_len}, block_size={self.block_size})"
        )

    @property
    def max_batch_size(self) -> int:
        return self._max_batch_size

    @property
    def max_cache_len(self) -> int:
        return self._max_cache_len

    def _impl(self, op: str) -> Any:
        return self.impl.get(op) if isinstance(self.impl, Mapping) else self.impl

    def _check_attention_implementation(self) -> None:
        _require_kvzoo_attention(self._config, "KVZooStaticCache")

    @property
    def _layers(self) -> list[KVZooStaticLayer]:
        # Cache.layers holds the KVZooStaticLayers __init__ made; transformers types it as its own layers.
        return cast("list[KVZooStaticLayer]", self.layers)

    @property
    def _pad(self) -> torch.Tensor:
        """Each row's left padding, for the paths that run once the first layer has made it."""
        if self.pad is None:
            raise KVZooIntegrationError("the cache has no rows yet: its first update makes them")
        return self.pad

    def _ensure_shared(self, device: torch.device) -> None:
        """The tensors every layer reads: fixed block tables, each row's first slot, its left
        padding, and a decode step's query offsets (one row each)."""
        if self.pad is not None:
            return
        batch, width = self._max_batch_size, self.blocks_per_row
        index: dict[str, Any] = dict(device=device)
        self.block_tables = _static(torch.arange(batch * width, dtype=torch.int32, **index).view(batch, width))
        self.row_base = _static(torch.arange(batch, dtype=torch.int64, **index) * (width * self.block_size))
        self.pad = _static(torch.zeros(batch, dtype=torch.int64, **index))
        self.decode_qsl = _static(torch.arange(batch + 1, dtype=torch.int32, **index))

    def early_initialization(self, batch_size, num_heads, head_dim, dtype, device) -> None:  # noqa: D102
        num_heads = [num_heads] * len(self._layers) if isinstance(num_heads, int) else list(num_heads)
        head_dim = [head_dim] * len(self._layers) if isinstance(head_dim, int) else list(head_dim)
        for layer, heads, dim in zip(self._layers, num_heads, head_dim):
            if not layer.is_initialized:
                layer.initialize(heads, dim, dtype, device)

    def _prefill_step(self, layer: KVZooStaticLayer, padding_mask: Any, batch: int, q_len: int) -> _PrefillStep:
        """A step of more than one token a row (or the first): its slots, rows and lengths,
        made on the host once for every layer. Reads the layer's position and, on the first
        step, the padding mask (left padding only)."""
        if layer.index != 0 and self._step is not None:
            return self._step  # layer 0 made this step's (layers run in order; a new step starts at 0)
        start = int(layer._positions)
        key = (start, q_len)
        if start + q_len > self._max_cache_len + int(self._pad.max()):
            raise KVZooIntegrationError(
                f"a row would hold more than max_cache_len={self._max_cache_len} tokens ({start} positions so "
                f"far, {q_len} more); make a KVZooStaticCache with room for the prompt and the new tokens"
            )
        pad = np.zeros(batch, np.int64)
        if start == 0:
            if padding_mask is not None:
                # The mask may be padded to max_cache_len columns (kvzoo_padding_mask): this step's are the first.
                mask = padding_mask.to("cpu").numpy().astype(bool)[:, :q_len]
                first_real = (~mask).argmin(axis=1).astype(np.int64) if mask.any(axis=1).all() else None
                if first_real is None or not np.array_equal(mask, np.arange(q_len)[None, :] >= first_real[:, None]):
                    raise KVZooIntegrationError(
                        "KVZooStaticCache takes left padding only (every row real from its first real token on, "
                        "and at least one real token)"
                    )
                pad = first_real
            self._pad.copy_(torch.from_numpy(pad))
        else:
            pad = self._pad.to("cpu").numpy()
        idx = start + np.arange(q_len)[None, :] - pad[:, None]  # each token's index among its row's real ones
        if int(idx.max()) >= self._max_cache_len:
            raise KVZooIntegrationError(
                f"a row would hold {int(idx.max()) + 1} tokens; this KVZooStaticCache holds max_cache_len="
                f"{self._max_cache_len}"
            )
        real = idx >= 0
        width = self.blocks_per_row * self.block_size
        slots = np.where(real, np.arange(batch)[:, None] * width + idx, -1).reshape(-1)
        counts = real.sum(axis=1)
        seq_lens = (start + q_len - pad).astype(np.int32)
        device = self._pad.device
        put = lambda a, dtype: torch.from_numpy(np.ascontiguousarray(a, dtype)).to(device)  # noqa: E731
        self._step = _PrefillStep(
            put(slots, np.int64),
            None if real.all() else put(np.flatnonzero(real.reshape(-1)), np.int64),
            put(seq_lens, np.int32),
            put(np.concatenate([[0], np.cumsum(counts)]), np.int32),
            int(counts.max()),
            int(seq_lens.max()),
            key,
        )
        self._prefilled = True  # the steps after this one's forward are decode steps
        return self._step

    # -- what generate() calls -------------------------------------------------------------

    def reset(self) -> None:
        """Forget every row (the pages are kept)."""
        for layer in self._layers:
            layer.pending = None
            if layer.is_initialized:
                layer._positions.zero_()
        if self.pad is not None:
            self._pad.zero_()
        self._prefilled, self._step = False, None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row i continues old row beam_idx[i] (beam search): each row's pages are copied."""
        rows = _row_indices("beam_idx", beam_idx, self._max_batch_size)
        if len(rows) != self._max_batch_size:
            raise ValueError(f"beam_idx: {len(rows)} rows for a cache of max_batch_size={self._max_batch_size}")
        index = None
        for layer in self._layers:
            if not layer.is_initialized:
                continue
            index = torch.as_tensor(rows, device=layer.device)
            for t in layer._store._arrays(layer._store.pages):
                by_row = t.view(self._max_batch_size, -1)
                by_row.copy_(by_row.index_select(0, index))
        if index is not None:
            self._pad.copy_(self._pad.index_select(0, index))

    def crop(self, max_length: int) -> None:
        """crop(-n) drops the last n positions of every row."""
        if max_length > 0:
            raise ValueError("crop: KVZooStaticCache takes a negative count of positions to drop")
        for layer in self._layers:
            if layer.is_initialized:
                layer._positions.sub_(min(-max_length, int(layer._positions)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("KVZooStaticCache holds a fixed batch: use KVZooCache to change it")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("KVZooStaticCache holds a fixed batch: use KVZooCache to change it")

    # -- figures -----------------------------------------------------------------------------

    def bytes_per_token(self) -> int:
        """KV bytes one token takes over all layers (codes and scales; 0 before the first update)."""
        return sum(layer.store.bytes_per_token for layer in self._layers if layer.store is not None)

    @property
    def nbytes(self) -> int:
        """Bytes allocated for pages over all layers."""
        return sum(layer.store.nbytes for layer in self._layers if layer.store is not None)
