"""KVZooCache: a transformers `Cache` whose layers keep K/V in kvzoo's paged cache.

Every layer owns kvzoo code (and scale) tensors in the chosen mode and layout; one shared
PageTable hands out their blocks as sequences grow, so all layers share one set of block
tables. `update` does not copy K/V anywhere: it hands this step's new rows to the
`"kvzoo_paged"` attention function (kvzoo.integrations.transformers.attention), which writes
them into their slots and runs kvzoo.paged_attention on the codes. The write waits for the
attention call because only there is the padding mask known, and padding tokens get no slot.

Beam search, batch selection and repetition re-point block tables (blocks are shared by
reference, copy-on-write for a partly filled one); `crop` drops positions; `reset` empties
the tables and keeps the tensors for reuse.

Sequence length (`get_seq_length`) counts positions, padding included, as DynamicCache does,
so transformers' position ids and mask sizes are unchanged.

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
from typing import Any

import numpy as np
import torch
import transformers
from transformers.cache_utils import Cache, CacheLayerMixin

from ...modes import QuantMode, get_kv_quant_mode
from ._pages import PageTable
from ._store import LayerStore
from .step import ForwardStep

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
    values = [float(v) for v in value]
    if len(values) != num_layers:
        raise ValueError(f"{name}: {len(values)} values for {num_layers} layers")
    return values


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


class KVZooLayer(CacheLayerMixin):
    """One decoder layer's kvzoo storage and its count of positions seen.

    Reordering, cropping and resetting act on the whole KVZooCache (its layers share block
    tables); call them on the cache, not on a layer.
    """

    is_compileable = False
    is_croppable = True
    supports_early_init = True

    def __init__(self, cache: KVZooCache, index: int, sliding_window: int | None = None) -> None:
        super().__init__()
        self.cache, self.index = cache, index
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.seen = 0  # positions, padding included
        self.store: LayerStore | None = None
        self.pending: tuple[torch.Tensor, torch.Tensor, int] | None = None
        self.is_initialized = False

    def __repr__(self) -> str:
        return f"KVZooLayer({self.index}, {self.cache.mode.name}, {self.cache.layout}, seen={self.seen})"

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        _, num_kv_heads, _, head_size = key_states.shape
        self.device, self.dtype = key_states.device, key_states.dtype
        self.store = self.cache._new_store(self.index, num_kv_heads, head_size, key_states.dtype, key_states.device)
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
        self.cache._check_attention_implementation()
        if self.pending is not None:
            raise KVZooIntegrationError(
                f"layer {self.index}: the previous step's K/V were never written, because attention did not run "
                f"through {ATTENTION_NAME!r}; a KVZooCache needs model.set_attn_implementation({ATTENTION_NAME!r}) "
                "(or kvzoo.integrations.transformers.use_kvzoo_attention(model))"
            )
        store = self.store
        if (
            (key_states.shape[1], key_states.shape[3]) != (store.num_kv_heads, store.head_size)
            or key_states.dtype != store.model_dtype
            or key_states.device != store.device
        ):
            raise KVZooIntegrationError(
                f"layer {self.index}: key_states {tuple(key_states.shape)} {key_states.dtype} on {key_states.device}; "
                f"this layer holds {store.num_kv_heads} heads x {store.head_size}, {store.model_dtype} on {store.device}"
            )
        self.pending = (key_states, value_states, self.seen)
        self.seen += int(key_states.shape[-2])
        _HANDOFF.layer = self
        return key_states, value_states

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
        """Write the pending K/V and attend (called by the attention function): [B, Q, Hq, D]."""
        pending_key, pending_value, start = self.pending
        if key is not pending_key or value is not pending_value:
            raise KVZooIntegrationError(
                f"layer {self.index}: the key/value given to attention are not the ones the cache handed out; "
                "this model changes them between cache.update and attention, which kvzoo_paged does not support"
            )
        self.pending = None
        step = self.cache._step_for(self, start, query, padding_mask)
        window = sliding_window if sliding_window is not None else self.sliding_window
        if window is not None and step.layout.gapped:
            raise KVZooIntegrationError(
                "a sliding window with padding after a real token: kvzoo counts the window in real tokens, "
                "transformers in positions; only left padding is supported with sliding windows"
            )
        cache = self.cache
        out = step.run_layer(
            self.store,
            query,
            key,
            value,
            softmax_scale=softmax_scale,
            sliding_window=window,
            softcap=softcap,
            sinks=sinks,
            rounding=cache.rounding,
            impl=cache.impl,
            validate=cache.validate,
        )
        step.done.add(self.index)
        return out

    def get_seq_length(self, *args: Any) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int | torch.Tensor, *args: Any) -> tuple[int, int]:
        # transformers 4.x passes cache_position (a tensor of the query's positions), 5.x its length.
        q = int(query_length.shape[0]) if isinstance(query_length, torch.Tensor) else int(query_length)
        return self.seen + q, 0

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
        layers, sliding-window layer types, and the attention implementation checked on update.
    mode: a kvzoo mode or engine string ("none", "int8_per_token_head", "fp8_per_token_head",
        "fp8_e4m3fnuz_per_token_head", "fp8_per_tensor", "fp8", "int8_per_tensor", "fp8_e5m2", ...).
    layout: "separate" (vLLM's tensors) or "inline" (one page buffer; per-token-head modes).
    block_size: tokens per page. num_blocks: pages allocated up front (the pool doubles when it
        runs out); max_num_blocks: a ceiling (None: none).
    rounding: "nearest" or "trunc" (int8_per_token_head only). k_scale, v_scale: a per-tensor
        mode's static scales, one float or one per layer (see static_fp8_scales).
    impl: a kvzoo implementation name for both operations, or {"reshape_and_cache": ...,
        "paged_attention": ...}; None lets kvzoo's registry choose. validate: run kvzoo's full
        argument checks on every call (host reads of the metadata per layer; for debugging).

    Use it with attention "kvzoo_paged" (use_kvzoo_attention(model)); inference only.
    """

    def __init__(
        self,
        config: Any,
        *,
        mode: str | QuantMode = "int8_per_token_head",
        layout: str = "separate",
        block_size: int = 16,
        num_blocks: int = 0,
        max_num_blocks: int | None = None,
        rounding: str = "nearest",
        k_scale: float | Sequence[float] | None = None,
        v_scale: float | Sequence[float] | None = None,
        impl: str | Mapping[str, Any] | None = None,
        validate: bool = False,
    ) -> None:
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        num_layers = int(text.num_hidden_layers)
        self.mode = get_kv_quant_mode(mode)
        if layout not in ("separate", "inline"):
            raise ValueError(f"layout: expected 'separate' or 'inline', got {layout!r}")
        if layout == "inline" and not self.mode.per_token_head:
            raise ValueError(f"layout: the inline layout stores per-row scales; mode {self.mode.name!r} has none")
        if rounding not in self.mode.roundings:
            raise ValueError(f"rounding: mode {self.mode.name!r} takes {list(self.mode.roundings)}, not {rounding!r}")
        self.layout, self.rounding, self.impl, self.validate = layout, rounding, impl, validate
        self._k_scales = _per_layer("k_scale", k_scale, num_layers)
        self._v_scales = _per_layer("v_scale", v_scale, num_layers)
        if self.mode.per_tensor and (None in self._k_scales or None in self._v_scales):
            raise ValueError(f"mode {self.mode.name!r} needs static k_scale and v_scale (see static_fp8_scales)")
        if not self.mode.per_tensor and (k_scale is not None or v_scale is not None):
            raise ValueError(f"k_scale/v_scale: only the per-tensor modes take static scales, not {self.mode.name!r}")
        self.pages = PageTable(block_size, num_blocks, max_num_blocks)
        self._config = text
        self._step: ForwardStep | None = None
        windows = _layer_windows(text, num_layers)
        super().__init__(layers=[KVZooLayer(self, i, windows[i]) for i in range(num_layers)])

    def __repr__(self) -> str:
        return (
            f"KVZooCache(mode={self.mode.name}, layout={self.layout}, layers={len(self.layers)}, "
            f"block_size={self.pages.block_size}, blocks={self.pages.blocks_in_use()}/{self.pages.capacity}, "
            f"seq_len={self.get_seq_length()})"
        )

    # -- used by the layers --------------------------------------------------------------

    def _new_store(
        self, index: int, num_kv_heads: int, head_size: int, dtype: torch.dtype, device: torch.device
    ) -> LayerStore:
        return LayerStore(
            self.mode,
            self.layout,
            block_size=self.pages.block_size,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            model_dtype=dtype,
            device=device,
            k_scale=self._k_scales[index],
            v_scale=self._v_scales[index],
        )

    def _check_attention_implementation(self) -> None:
        name = getattr(self._config, "_attn_implementation", ATTENTION_NAME)
        if name != ATTENTION_NAME:
            raise KVZooIntegrationError(
                f"the model's attention implementation is {name!r}; a KVZooCache is read only by "
                f"{ATTENTION_NAME!r}: call kvzoo.integrations.transformers.use_kvzoo_attention(model) "
                f"(or model.set_attn_implementation({ATTENTION_NAME!r})) first"
            )

    def _step_for(self, layer: KVZooLayer, start: int, query: torch.Tensor, padding_mask: Any) -> ForwardStep:
        """This forward step's metadata: built by the first layer to attend, reused by the rest."""
        batch, q_len = int(query.shape[0]), int(query.shape[2])
        pages, step = self.pages, self._step
        if (
            step is not None
            and step.epoch == pages.epoch
            and step.layout.start == start
            and step.layout.q_len == q_len
            and step.layout.batch == batch
            and layer.index not in step.done
        ):
            return step
        if start != pages.positions:
            raise KVZooIntegrationError(
                f"layer {layer.index} starts at position {start} but the cache is at {pages.positions}: "
                "every layer must run once per forward step, in step with the others"
            )
        real = self._real_flags(padding_mask, batch, q_len, start)
        step = ForwardStep.build(pages.plan_step(real, batch, q_len), query.device, pages.epoch)
        self._step = step
        return step

    def _real_flags(self, padding_mask: Any, batch: int, q_len: int, start: int) -> np.ndarray | None:
        """[B, Q] bool (True: a real token) from the 2-D padding mask, or None if all are real."""
        if padding_mask is None:
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
        if any(layer.pending is not None for layer in self.layers):
            raise KVZooIntegrationError("the cache was changed between a layer's update and its attention call")
        self._step = None

    def reset(self) -> None:
        """Forget every sequence; the allocated pages are kept for reuse."""
        for layer in self.layers:
            layer.pending, layer.seen = None, 0
        self._step = None
        self.pages.reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row i continues old row beam_idx[i] (beam search): block tables are re-pointed, no copy."""
        self._between_steps()
        self.pages.reorder(beam_idx.detach().to("cpu").numpy())

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows `indices` (long indices or a bool mask over the batch)."""
        self._between_steps()
        rows = self.pages.batch_size
        if rows is None:
            return
        self.pages.reorder(torch.arange(rows)[torch.as_tensor(indices).to("cpu")].numpy())

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each row `repeats` times in place (row b becomes rows b*repeats ... b*repeats+repeats-1)."""
        self._between_steps()
        rows = self.pages.batch_size
        if rows is not None:
            self.pages.reorder(np.repeat(np.arange(rows), repeats))

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
        self.pages.crop(count)
        for layer in self.layers:
            layer.seen = max(layer.seen - count, 0)

    @property
    def max_batch_size(self) -> int:
        return -1 if self.pages.batch_size is None else self.pages.batch_size

    @property
    def max_cache_len(self) -> int:
        return -1

    # -- figures -----------------------------------------------------------------------------

    def bytes_per_token(self) -> int:
        """KV bytes one token takes over all layers (codes and scales; 0 before the first update)."""
        return sum(layer.store.bytes_per_token for layer in self.layers if layer.store is not None)

    @property
    def nbytes(self) -> int:
        """Bytes allocated for pages over all layers."""
        return sum(layer.store.nbytes for layer in self.layers if layer.store is not None)

    def audit(self, **options: Any) -> Any:
        """kvzoo.audit of this cache's pages and block tables (read in place on the CPU, copied
        from a GPU); options as kvzoo.audit's (replay=N, ...). Returns its AuditReport."""
        from ...auditing import audit, cache_dump

        stores = [layer.store for layer in self.layers if layer.store is not None and layer.store.tensors is not None]
        if not stores or self.pages.tables is None:
            raise ValueError("audit: the cache holds nothing yet (no forward step has written to it)")
        rows = self.pages.tables
        tables = np.full((len(rows), max(1, max(map(len, rows)))), -1, np.int32)
        for b, row in enumerate(rows):
            tables[b, : len(row)] = row
        dump = cache_dump(
            [store.tensors for store in stores],
            mode=self.mode,
            block_tables=tables,
            seq_lens=self.pages.lens.astype(np.int32),
            rounding=self.rounding,
            k_scales=[store.k_scale for store in stores] if self.mode.per_tensor else None,
            v_scales=[store.v_scale for store in stores] if self.mode.per_tensor else None,
        )
        return audit(dump, **options)


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
