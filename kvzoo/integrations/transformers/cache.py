"""KVZooCache: a transformers `Cache` whose layers keep K/V in kvzoo's paged cache.

Every layer owns kvzoo code (and scale) tensors in the chosen mode and layout. Layers that keep
the same keys share a PageTable that hands out their blocks as sequences grow: every
full-attention layer one, each sliding window (from the config's layer_types) another, whose
blocks leave with the window, so a sliding layer holds its window and not the sequence.
`update` does not copy K/V anywhere: it hands this step's new rows to the `"kvzoo_paged"`
attention function (kvzoo.integrations.transformers.attention), which writes them into their
slots and runs kvzoo.paged_attention on the codes. The write waits for the attention call
because only there is the padding mask known, and padding tokens get no slot.

A forward step is a transaction: planned by the first layer, committed when every layer has
run it. A step that fails (pages exhausted, a refused argument, an error in the model between
layers) leaves the tables, the lengths and every layer as they were before it: the cache
rolls it back at once, or at its next use if the failure came from outside kvzoo.

Memory: each layer holds its mode's bytes for the tokens stored, a partly filled block per
row, and at most _pages.GROWTH more (the pool grows by that fraction when it must, never by
doubling); `max_cache_len` (or `reserve`) sizes it once ahead.

Beam search, batch selection and repetition re-point block tables (blocks are shared by
reference, copy-on-write for a partly filled one); `crop` drops positions; `reset` empties
the tables and keeps the tensors for reuse.

Sequence length (`get_seq_length`) counts positions, padding included, as DynamicCache does,
so transformers' position ids and mask sizes are unchanged. In a step of one token per row
after the first step (decode), every new token is taken as real and the padding mask is not
read (generate's mask columns for generated tokens are ones): the step reads nothing back
from the device. validate=True reads and checks it.

>>> import torch, transformers
>>> from kvzoo.integrations.transformers import KVZooCache, use_kvzoo_attention
>>> config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
...                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)
>>> model = transformers.LlamaForCausalLM(config).eval()
>>> model = use_kvzoo_attention(model)               # registers "kvzoo_paged" and selects it
>>> cache = KVZooCache(model.config, mode="int8_per_token_head", impl="numpy")
>>> out = model.generate(torch.tensor([[1, 2, 3, 4]]), past_key_values=cache, max_new_tokens=4, do_sample=False)
>>> tuple(out.shape), cache.get_seq_length()
((1, 8), 7)
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch
import transformers
from transformers.cache_utils import Cache, CacheLayerMixin

from ...layout import inline_row_bytes
from ...modes import QuantMode, get_kv_quant_mode
from ._pages import PageTable
from ._store import LayerStore
from .step import ForwardStep, KeptMetadata

# Tokens a sliding-window layer keeps beyond its window, so crop(-n) (assisted decoding's
# rollback of rejected candidates) can take back up to this many without reaching released keys.
WINDOW_SLACK = 64

ATTENTION_NAME = "kvzoo_paged"

# transformers 5 made `crop(n)` take only n <= 0 (tokens to remove); 4.x also took n >= 0 as
# the length to keep. crop(0) means "nothing" in 5 and "everything" in 4.
_LEGACY_CROP = int(transformers.__version__.split(".")[0]) < 5

# update() hands the layer to the attention function that runs next, in the same thread.
_HANDOFF = threading.local()


class KVZooIntegrationError(RuntimeError):
    """The model, the cache and the attention function are not used together as they must be."""


def _per_layer(name: str, value: float | Sequence[float] | None, num_layers: int) -> list[float | None]:
    if value is None or isinstance(value, (int, float)):
        return [None if value is None else float(value)] * num_layers
    values: list[float | None] = [float(v) for v in value]
    if len(values) != num_layers:
        raise ValueError(f"{name}: {len(values)} values for {num_layers} layers")
    return values


def _text_config(config: Any) -> tuple[Any, int]:
    """The model config's text part (a multimodal config's decoder) and its number of layers."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return text, int(text.num_hidden_layers)


def _check_rounding(mode: QuantMode, rounding: str) -> None:
    if rounding not in mode.roundings:
        raise ValueError(f"rounding: mode {mode.name!r} takes {list(mode.roundings)}, not {rounding!r}")


def _layer_scales(
    mode: QuantMode, k_scale: float | Sequence[float] | None, v_scale: float | Sequence[float] | None, num_layers: int
) -> tuple[list[float | None], list[float | None]]:
    """Each layer's static K and V scales: required by the per-tensor modes, refused by the others."""
    k_scales, v_scales = _per_layer("k_scale", k_scale, num_layers), _per_layer("v_scale", v_scale, num_layers)
    if mode.per_tensor and (None in k_scales or None in v_scales):
        raise ValueError(f"mode {mode.name!r} needs static k_scale and v_scale (see static_fp8_scales)")
    if not mode.per_tensor and (k_scale is not None or v_scale is not None):
        raise ValueError(f"k_scale/v_scale: only the per-tensor modes take static scales, not {mode.name!r}")
    return k_scales, v_scales


def _layer_windows(config: Any, num_layers: int) -> list[int | None]:
    """Each layer's sliding window from the config (None: full attention)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return [None] * num_layers  # windows, if any, come with each attention call
    windows: list[int | None] = []
    for i, kind in enumerate(layer_types[:num_layers]):
        if kind == "full_attention":
            windows.append(None)
        elif kind == "sliding_attention":
            windows.append(int(config.sliding_window))
        else:
            raise NotImplementedError(
                f"layer {i}: layer type {kind!r} is not supported by KVZooCache "
                "(full_attention and sliding_attention are)"
            )
    return windows


class PagedLayer(CacheLayerMixin):
    """What the layers of both caches share: their cache and index, their window, their pages (a
    LayerStore, which the first update makes) and attend(), which the attention function calls
    with the K/V that update handed out."""

    is_croppable = True
    supports_early_init = True

    def __init__(self, cache: Any, index: int, sliding_window: int | None) -> None:
        super().__init__()
        self.cache, self.index = cache, index
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.store: LayerStore | None = None
        self.is_initialized = False

    def _new_store(self, num_kv_heads: int, head_size: int, dtype: torch.dtype, device: torch.device) -> LayerStore:
        """The layer's pages, empty, as either cache holds them: its mode, layout, page size and
        row alignment, and this layer's own static scales."""
        cache = self.cache
        return LayerStore(
            cache.mode,
            cache.layout,
            block_size=cache.block_size,
            row_align=cache.row_align,
            k_scale=cache._k_scales[self.index],
            v_scale=cache._v_scales[self.index],
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            model_dtype=dtype,
            device=device,
        )

    @property
    def _store(self) -> LayerStore:
        """The layer's pages, for the paths that run after its first update made them."""
        if self.store is None:
            raise KVZooIntegrationError(f"layer {self.index}: no pages yet (its first cache.update makes them)")
        return self.store

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        padding_mask: Any,
        *,
        softmax_scale: float | None,
        sliding_window: int | None,
        softcap: float | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """Write the pending K/V and attend (called by the attention function): [B, Q, Hq, D].
        A sliding_window of None is the layer's own."""
        window = sliding_window if sliding_window is not None else self.sliding_window
        options = dict(softmax_scale=softmax_scale, sliding_window=window, softcap=softcap, sinks=sinks)
        return self._attend_step(query, key, value, padding_mask, options)

    def _attend_step(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, padding_mask: Any, options: dict[str, Any]
    ) -> torch.Tensor:
        raise NotImplementedError


class KVZooLayer(PagedLayer):
    """One decoder layer's kvzoo storage and its count of positions seen.

    Reordering, cropping and resetting act on the whole KVZooCache (its layers share block
    tables); call them on the cache, not on a layer.
    """

    is_compileable = False

    def __init__(self, cache: KVZooCache, index: int, sliding_window: int | None = None) -> None:
        super().__init__(cache, index, sliding_window)
        self.cache: KVZooCache = cache
        self.pending: tuple[torch.Tensor, torch.Tensor, int] | None = None

    def __repr__(self) -> str:
        return f"KVZooLayer({self.index}, {self.cache.mode.name}, {self.cache.layout}, seen={self.get_seq_length()})"

    @property
    def pages(self) -> PageTable:
        """The page table of this layer's group (its window's, or the full-attention layers')."""
        return self.cache._tables[self.sliding_window]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        _, num_kv_heads, _, head_size = key_states.shape
        self.device, self.dtype = key_states.device, key_states.dtype
        self.store = self._new_store(num_kv_heads, head_size, key_states.dtype, key_states.device)
        self.is_initialized = True

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Take this step's K/V [B, Hkv, Q, D]; returns them unchanged for kvzoo's attention,
        which writes them into the pages."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        cache = self.cache
        if cache._step is None:  # the step's first layer (the others run in the same forward)
            cache._check_attention_implementation()
        if self.pending is not None:
            cache._abort_step()
            raise KVZooIntegrationError(
                f"layer {self.index}: the previous step's K/V were never written, because attention did not run "
                f"through {ATTENTION_NAME!r}; a KVZooCache needs model.set_attn_implementation({ATTENTION_NAME!r}) "
                "(or kvzoo.integrations.transformers.use_kvzoo_attention(model))"
            )
        if cache._step is not None and self.index in cache._step.done:
            # This layer already ran the step in progress: that forward pass stopped part way
            # (an error between layers), and this is a new one. Its step is undone first.
            cache._abort_step()
        store = self._store
        if (
            (key_states.shape[1], key_states.shape[3]) != (store.num_kv_heads, store.head_size)
            or key_states.dtype != store.model_dtype
            or key_states.device != store.device
        ):
            raise KVZooIntegrationError(
                f"layer {self.index}: key_states {tuple(key_states.shape)} {key_states.dtype} on {key_states.device}; "
                f"this layer holds {store.num_kv_heads} heads x {store.head_size}, {store.model_dtype} on {store.device}"
            )
        self.pending = (key_states, value_states, cache._committed_positions())
        _HANDOFF.layer = self
        return key_states, value_states

    def _attend_step(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, padding_mask: Any, options: dict[str, Any]
    ) -> torch.Tensor:
        if self.pending is None:
            raise KVZooIntegrationError(
                f"layer {self.index}: attention ran with no K/V of this step; cache.update hands them out first"
            )
        pending_key, pending_value, start = self.pending
        if key is not pending_key or value is not pending_value:
            raise KVZooIntegrationError(
                f"layer {self.index}: the key/value given to attention are not the ones the cache handed out; "
                "this model changes them between cache.update and attention, which kvzoo_paged does not support"
            )
        self.pending = None
        cache = self.cache
        try:
            step = cache._step_for(self, start, query, padding_mask)
            if options["sliding_window"] is not None and step.layouts[self.sliding_window].gapped:
                raise KVZooIntegrationError(
                    "a sliding window with padding after a real token: kvzoo counts the window in real tokens, "
                    "transformers in positions; only left padding is supported with sliding windows"
                )
            out = step.run_layer(
                self.sliding_window,
                self._store,
                query,
                key,
                value,
                rounding=cache.rounding,
                impl=cache.impl,
                validate=cache.validate,
                fresh_prefill=cache.prefill_attention == "auto",
                **options,
            )
        except BaseException:
            cache._abort_step()
            raise
        step.done.add(self.index)
        if len(step.done) == len(cache.layers):
            cache._commit_step()
        return out

    def get_seq_length(self, *args: Any) -> int:
        # Positions of committed steps: a step in progress counts once every layer has run it.
        return self.cache._committed_positions()

    def get_mask_sizes(self, query_length: int | torch.Tensor, *args: Any) -> tuple[int, int]:
        # transformers 4.x passes cache_position (a tensor of the query's positions), 5.x its length.
        q = int(query_length.shape[0]) if isinstance(query_length, torch.Tensor) else int(query_length)
        return self.get_seq_length() + q, 0

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:
        return -1

    def offload(self) -> None:  # KVZooCache does not offload (it takes no offloading option)
        pass

    def prefetch(self) -> None:
        pass

    def _whole_cache_only(self, *args: Any, **kwargs: Any) -> None:
        raise KVZooIntegrationError(
            "the layers of a KVZooCache share block tables: call reset, reorder_cache, "
            "crop and batch_* on the cache, not on a layer"
        )

    reset = reorder_cache = crop = batch_repeat_interleave = batch_select_indices = _whole_cache_only


class KVZooCache(Cache):
    """A transformers Cache backed by kvzoo's paged, quantized KV cache.

    config: the model's config (model.config; its decoder text config is used): the number of
        layers, their head size, sliding-window layer types, and the attention implementation
        checked on update.
    mode: a kvzoo mode or engine string ("none", "int8_per_token_head", "fp8_per_token_head",
        "fp8_e4m3fnuz_per_token_head", "fp8_per_tensor", "fp8", "int8_per_tensor", "fp8_e5m2", ...).
    layout: "separate" (vLLM's tensors) or "inline" (one page buffer; the modes that define it).
        row_align: the inline layout's rows padded to a multiple of 16 bytes (16) or to a power
        of two ("pow2"), so each starts on 16 bytes; None keeps vLLM's head_size + 4
        (kvzoo.allocate_inline).
    block_size: tokens per page. num_blocks: pages allocated up front per page table (the pool
        grows by what a step needs, and by at least 1/32 of itself, when it runs out);
        max_num_blocks: a ceiling (None: none). max_cache_len: tokens per row the cache will
        reach (a prompt plus max_new_tokens): with it the first step allocates every page once
        and no step regrows. window_slack: tokens a sliding-window layer keeps beyond its
        window, so crop(-n) can take back up to that many.
    rounding: "nearest" or "trunc" (int8_per_token_head only). k_scale, v_scale: a per-tensor
        mode's static scales, one float or one per layer (see static_fp8_scales).
    impl: a kvzoo implementation name for both operations, or {"reshape_and_cache": ...,
        "paged_attention": ...}; None lets kvzoo's registry choose. validate: run kvzoo's full
        argument checks on every call, and read the padding mask in decode steps too (host
        reads of the metadata per layer; for debugging).
    prefill_attention: "auto" attends a step whose rows hold no earlier token and no padding
        (a fresh, unpadded prompt) with torch SDPA on its own K/V, as DynamicCache does (its
        numbers, and its speed: flash attention), while the pages still get the quantized
        codes that every later step reads; "kvzoo" runs kvzoo's paged kernels on the codes
        for every step.

    Use it with attention "kvzoo_paged" (use_kvzoo_attention(model)); inference only.
    """

    def __init__(
        self,
        config: Any,
        *,
        mode: str | QuantMode = "int8_per_token_head",
        layout: str = "separate",
        row_align: int | str | None = None,
        block_size: int = 16,
        num_blocks: int = 0,
        max_num_blocks: int | None = None,
        max_cache_len: int | None = None,
        window_slack: int = WINDOW_SLACK,
        rounding: str = "nearest",
        k_scale: float | Sequence[float] | None = None,
        v_scale: float | Sequence[float] | None = None,
        impl: str | Mapping[str, Any] | None = None,
        validate: bool = False,
        prefill_attention: str = "auto",
    ) -> None:
        text, num_layers = _text_config(config)
        self.mode = get_kv_quant_mode(mode)
        self.prefill_attention = _prefill_attention(prefill_attention)
        if layout not in ("separate", "inline"):
            raise ValueError(f"layout: expected 'separate' or 'inline', got {layout!r}")
        _refuse_geometry(self.mode, layout, _head_size(text))
        if row_align is not None:
            if layout != "inline":
                raise ValueError(f"row_align: pads the inline layout's rows; layout {layout!r} has none")
            head = _head_size(text)
            inline_row_bytes(head or 4, row_align)  # a bad row_align fails here, not at the first step
        self.row_align = row_align
        _check_rounding(self.mode, rounding)
        if max_cache_len is not None and max_cache_len < 1:
            raise ValueError(f"max_cache_len: expected a number of tokens >= 1 or None, got {max_cache_len}")
        self.layout, self.rounding, self.impl, self.validate = layout, rounding, impl, validate
        self._k_scales, self._v_scales = _layer_scales(self.mode, k_scale, v_scale, num_layers)
        self._config = text
        self._max_cache_len = max_cache_len
        windows = _layer_windows(text, num_layers)
        # One page table per set of keys the layers keep: the full-attention layers' (None),
        # and each window's.
        self._tables: dict[int | None, PageTable] = {
            w: PageTable(block_size, num_blocks, max_num_blocks, window=w, window_slack=window_slack)
            for w in dict.fromkeys(windows)
        }
        self._step: ForwardStep | None = None
        # Decode steps' metadata and plans, kept across steps (not when validating: a kept
        # plan does not check the metadata it is given again).
        self._kept = KeptMetadata()
        super().__init__(layers=[KVZooLayer(self, i, windows[i]) for i in range(num_layers)])

    def __repr__(self) -> str:
        pages = self.pages
        return (
            f"KVZooCache(mode={self.mode.name}, layout={self.layout}, layers={len(self.layers)}, "
            f"block_size={pages.block_size}, blocks={pages.blocks_in_use()}/{pages.capacity}, "
            f"seq_len={self.get_seq_length()})"
        )

    @property
    def block_size(self) -> int:
        """Tokens per page (every page table's)."""
        return self.pages.block_size

    @property
    def pages(self) -> PageTable:
        """The full-attention layers' page table (the first sliding one's if every layer slides);
        every table holds the same rows, lengths and positions."""
        return self._tables.get(None) or next(iter(self._tables.values()))

    # -- used by the layers --------------------------------------------------------------

    def _check_attention_implementation(self) -> None:
        _require_kvzoo_attention(self._config, "KVZooCache", f" (or model.set_attn_implementation({ATTENTION_NAME!r}))")

    def _committed_positions(self) -> int:
        return self._step.start if self._step is not None else self.pages.positions

    def _step_for(self, layer: KVZooLayer, start: int, query: torch.Tensor, padding_mask: Any) -> ForwardStep:
        """This forward step's metadata: planned by the first layer to attend (every page
        table at once), reused by the rest."""
        batch, q_len = int(query.shape[0]), int(query.shape[2])
        step = self._step
        if step is not None:
            if (step.start, step.q_len, step.batch) != (start, q_len, batch):
                raise KVZooIntegrationError(
                    f"layer {layer.index}: a step of [B={batch}, Q={q_len}] at position {start} inside a forward "
                    f"step of [B={step.batch}, Q={step.q_len}] at {step.start}: every layer must run once per "
                    "forward step, in step with the others"
                )
            return step
        real = self._real_flags(padding_mask, batch, q_len, start)
        self._reserve_ahead(batch)
        layouts = {}
        try:
            for window, table in self._tables.items():
                layouts[window] = table.plan_step(real, batch, q_len)
        except BaseException:
            for table in self._tables.values():
                table.rollback()
            raise
        self._step = ForwardStep(layouts, query.device, kept=None if self.validate else self._kept)
        return self._step

    def _reserve_ahead(self, batch: int) -> None:
        """With max_cache_len, the first step sizes every table for the whole generation."""
        if self._max_cache_len is not None and self.pages.batch_size is None:
            self._reserve(batch, self._max_cache_len)

    def _reserve(self, batch: int, max_cache_len: int) -> None:
        for window, table in self._tables.items():
            keep = max_cache_len if window is None else min(max_cache_len, window + table.window_slack)
            # A window's rows also hold the block their window starts in and the one being filled.
            blocks = -(-keep // table.block_size) + (0 if window is None else 1)
            table.reserve(batch * blocks)

    def _commit_step(self) -> None:
        for table in self._tables.values():
            table.commit()
        self._step = None

    def _abort_step(self) -> None:
        """Undo the step in progress (if any): every table, and what every layer holds of it."""
        for table in self._tables.values():
            table.rollback()
        for layer in self._layers:
            layer.pending = None
        self._step = None

    def _real_flags(self, padding_mask: Any, batch: int, q_len: int, start: int) -> np.ndarray | None:
        """[B, Q] bool (True: a real token) from the 2-D padding mask, or None if all are real.
        A decode step's (one token per row, after the first step) mask is not read unless
        validating: reading it would wait for the GPU, and generate's new columns are ones."""
        if padding_mask is None or (q_len == 1 and start > 0 and not self.validate):
            return None
        if not isinstance(padding_mask, torch.Tensor) or padding_mask.ndim != 2:
            shape = tuple(getattr(padding_mask, "shape", ()))
            raise KVZooIntegrationError(
                f"{ATTENTION_NAME} takes transformers' 2-D padding mask (it applies the causal rule itself); "
                f"got a {type(padding_mask).__name__} of shape {shape}: custom 4-D masks are not supported"
            )
        mask = padding_mask.to("cpu").numpy().astype(bool)
        if mask.shape[0] != batch or mask.shape[1] < q_len:
            raise KVZooIntegrationError(f"attention_mask: shape {mask.shape} for {batch} rows of {q_len} new tokens")
        if (
            mask.shape[1] == start + q_len
            and start
            and not np.array_equal(mask[:, :start], self.pages._real[:, :start])
        ):
            raise KVZooIntegrationError(
                "attention_mask: its columns for tokens already in the cache differ from the mask they were "
                "written under; a KVZooCache drops padding tokens when writing, so the past cannot be re-masked"
            )
        real = mask[:, mask.shape[1] - q_len :]
        return None if real.all() else real

    # -- what generate() calls -------------------------------------------------------------

    def _between_steps(self) -> None:
        # A step still in progress here was stopped part way (an error between layers): undone.
        self._abort_step()

    def reset(self) -> None:
        """Forget every sequence; the allocated pages are kept for reuse."""
        self._abort_step()
        for table in self._tables.values():
            table.reset()

    def reserve(self, batch_size: int, max_cache_len: int) -> None:
        """Size every page table for batch_size rows of max_cache_len tokens now (generate()
        does not tell a cache how long it will run: call this, or pass max_cache_len)."""
        self._between_steps()
        self._reserve(int(batch_size), int(max_cache_len))

    def _reorder(self, index: np.ndarray) -> None:
        for table in self._tables.values():
            table.reorder(index)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row i continues old row beam_idx[i] (beam search): block tables are re-pointed, no copy.
        beam_idx: 1-D integer indices of rows (as torch.index_select takes them)."""
        self._between_steps()
        self._reorder(_row_indices("beam_idx", beam_idx, self.pages.batch_size))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows `indices` (1-D integer row indices)."""
        self._between_steps()
        self._reorder(_row_indices("indices", indices, self.pages.batch_size))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each row `repeats` times in place (row b becomes rows b*repeats ... b*repeats+repeats-1)."""
        self._between_steps()
        if isinstance(repeats, bool) or not isinstance(repeats, (int, np.integer)) or repeats < 1:
            raise ValueError(f"repeats: expected an integer >= 1, got {repeats!r}")
        rows = self.pages.batch_size
        if rows is not None:
            self._reorder(np.repeat(np.arange(rows), int(repeats)))

    def crop(self, max_length: int) -> None:
        """crop(-n) drops the last n positions (assisted decoding's rollback); with transformers 4.x
        crop(n >= 0) keeps the first n, as DynamicCache does there."""
        self._between_steps()
        seen = self.get_seq_length()
        if max_length < 0:
            count = -max_length
        elif _LEGACY_CROP:
            count = seen - max_length
        elif max_length == 0:
            count = 0
        else:
            raise ValueError(
                f"Calling `crop` with a positive value (`{max_length}`) is not supported. Please use a "
                "negative integer to remove that number of tokens from the cache instead."
            )
        count = min(count, seen)
        if count <= 0:
            return
        for table in self._tables.values():  # checked on every table before any changes
            refusal = table.crop_refusal(count)
            if refusal:
                raise ValueError(f"crop: {refusal}")
        for table in self._tables.values():
            table.crop(count)

    @property
    def max_batch_size(self) -> int:
        return -1 if self.pages.batch_size is None else self.pages.batch_size

    @property
    def _layers(self) -> list[KVZooLayer]:
        # Cache.layers holds the KVZooLayers __init__ made; transformers types it as its own layers.
        return cast("list[KVZooLayer]", self.layers)

    @property
    def max_cache_len(self) -> int:
        return -1 if self._max_cache_len is None else self._max_cache_len

    # -- figures -----------------------------------------------------------------------------

    def bytes_per_token(self) -> int:
        """KV bytes one token takes over all layers (codes and scales; 0 before the first update)."""
        return sum(layer.store.bytes_per_token for layer in self._layers if layer.store is not None)

    @property
    def nbytes(self) -> int:
        """Bytes allocated for pages over all layers."""
        return sum(layer.store.nbytes for layer in self._layers if layer.store is not None)

    def audit(self, **options: Any) -> Any:
        """kvzoo.audit of this cache's pages and block tables (read in place on the CPU, copied
        from a GPU); options as kvzoo.audit's (replay=N, ...). Returns its AuditReport."""
        from ...auditing import audit, cache_dump

        stores = [layer.store for layer in self._layers if layer.store is not None and layer.store.tensors is not None]
        if not stores or self.pages.tables is None:
            raise ValueError("audit: the cache holds nothing yet (no forward step has written to it)")
        if any(layer.is_sliding for layer in self._layers):
            # A window's layers index pages by their own table, and release blocks their window
            # left (the table keeps the ids): a dump has one table for every layer.
            raise KVZooIntegrationError(
                "audit: this cache has sliding-window layers, whose pages have their own block tables "
                "(blocks outside the window released); kvzoo.audit reads one table for every layer and "
                "does not take such a cache yet"
            )
        rows = self.pages.tables
        tables = np.full((len(rows), max(1, max(map(len, rows)))), -1, np.int32)
        for b, row in enumerate(rows):
            tables[b, : len(row)] = row
        dump = cache_dump(
            [store.pages for store in stores],
            mode=self.mode,
            block_tables=tables,
            seq_lens=self.pages.lens.astype(np.int32),
            rounding=self.rounding,
            k_scales=[store.k_scale for store in stores] if self.mode.per_tensor else None,
            v_scales=[store.v_scale for store in stores] if self.mode.per_tensor else None,
        )
        return audit(dump, **options)


PREFILL_ATTENTION = ("auto", "kvzoo")


def _require_kvzoo_attention(config: Any, cache_name: str, also: str = "") -> None:
    """Refuse a model whose attention is not kvzoo's (which alone reads the cache's pages)."""
    name = getattr(config, "_attn_implementation", ATTENTION_NAME)
    if name != ATTENTION_NAME:
        raise KVZooIntegrationError(
            f"the model's attention implementation is {name!r}; a {cache_name} is read only by "
            f"{ATTENTION_NAME!r}: call kvzoo.integrations.transformers.use_kvzoo_attention(model){also} first"
        )


def _prefill_attention(choice: str) -> str:
    if choice not in PREFILL_ATTENTION:
        raise ValueError(f"prefill_attention: expected one of {list(PREFILL_ATTENTION)}, got {choice!r}")
    return choice


def _head_size(config: Any) -> int | None:
    head = getattr(config, "head_dim", None)
    if head is None and getattr(config, "num_attention_heads", None):
        head = config.hidden_size // config.num_attention_heads
    return None if head is None else int(head)


def _refuse_geometry(mode: QuantMode, layout: str, head_size: int | None) -> None:
    """What a mode and layout cannot store, refused when the cache is made (not at the first
    forward, part way through a step)."""
    if layout == "inline":
        refusal = mode.inline_refusal()
        if refusal:
            raise ValueError(f"layout: {refusal}")
        if head_size is not None and head_size % 4:
            raise ValueError(f"layout: the inline layout needs a head size that is a multiple of 4, got {head_size}")
    if head_size is not None:
        refusal = mode.head_size_refusal(head_size)
        if refusal:
            raise ValueError(f"mode: {mode.name!r} cannot store this model's heads: {refusal}")


def _row_indices(name: str, indices: Any, rows: int | None) -> np.ndarray:
    """indices as int64 row numbers: a 1-D integer tensor or array, as torch.index_select takes
    (no bool mask, no floats, no 2-D), each in [0, rows)."""
    dtype = getattr(indices, "dtype", None)
    if isinstance(indices, torch.Tensor):
        ok = not indices.is_floating_point() and not indices.is_complex() and indices.dtype != torch.bool
        values = indices.detach().to("cpu").numpy() if ok else None
    elif isinstance(indices, np.ndarray):
        ok = indices.dtype.kind in "iu"
        values = indices
    else:
        ok, values = False, None
    if not ok or values is None:
        raise ValueError(f"{name}: expected a 1-D integer tensor of row indices, got {type(indices).__name__} {dtype}")
    if values.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D tensor of row indices, got shape {tuple(values.shape)}")
    values = values.astype(np.int64)
    if rows is not None and values.size and (values.min() < 0 or values.max() >= rows):
        raise IndexError(f"{name}: rows {values.tolist()[:8]} out of range for a batch of {rows}")
    return values


def static_fp8_scales(cache: Any, qmax: float = 448.0) -> tuple[list[float], list[float]]:
    """Per-layer static (k_scale, v_scale) for a per-tensor mode from a calibration run: absmax / qmax.

    cache: a filled transformers DynamicCache (its layers' keys/values [B, Hkv, T, D]), e.g. the
    one returned by a forward pass over calibration text. qmax: the mode's (kvzoo.get_kv_quant_mode
    (mode).qmax): 448 for fp8_per_tensor (the default), 127 for int8_per_tensor, 57344 for fp8_e5m2.
    Padding rows in the calibration batch count too: calibrate on unpadded text.
    """
    k_scales, v_scales = [], []
    layers = getattr(cache, "layers", None)
    pairs = [(layer.keys, layer.values) for layer in layers] if layers is not None else list(cache)
    for keys, values in pairs:
        k_scales.append(max(float(keys.detach().abs().max()), 1e-6) / qmax)
        v_scales.append(max(float(values.detach().abs().max()), 1e-6) / qmax)
    return k_scales, v_scales
