"""The "kvzoo_paged" attention function and its mask function, for transformers' interfaces.

transformers calls an attention function as
`fn(module, query [B, Hq, Q, D], key, value, attention_mask, scaling=..., dropout=..., **kwargs)`
and expects `(output [B, Q, Hq, D], weights or None)`. Here key and value are the rows a
KVZooCache layer handed out from `update`; the function writes them into the layer's pages and
runs kvzoo.paged_attention on the codes (no dequantized copy of the cache is ever made).

The mask: transformers builds one per forward pass through the function registered for the
attention implementation in `AttentionMaskInterface`. kvzoo applies the causal rule (and any
sliding window) itself, so its mask function passes on only the 2-D padding mask
[B, past + Q] (True = real token); the cache gives padding tokens no slot, so they are never
attended. Custom 4-D masks are refused, since kvzoo cannot apply an arbitrary pattern.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from .cache import _HANDOFF, ATTENTION_NAME, KVZooIntegrationError, KVZooLayer


def _take_layer(key: torch.Tensor) -> KVZooLayer:
    layer = getattr(_HANDOFF, "layer", None)
    _HANDOFF.layer = None
    if layer is None or layer.pending is None or layer.pending[0] is not key:
        raise KVZooIntegrationError(
            f"{ATTENTION_NAME!r} attention reads a KVZooCache's pages, but this call's key/value did not come from "
            "one: pass past_key_values=KVZooCache(model.config, ...) (use_cache=True) to the forward or generate call"
        )
    return layer


def kvzoo_paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal paged attention over a KVZooCache layer: query [B, Hq, Q, D] -> ([B, Q, Hq, D], None).

    GQA comes from the cache (Hq a multiple of Hkv). kwargs read: sliding_window, softcap,
    s_aux (attention sinks, [Hq]), is_causal (must not be False). Padding query rows give 0.
    """
    layer = _take_layer(key)
    if dropout:
        raise KVZooIntegrationError(f"{ATTENTION_NAME}: dropout={dropout}; kvzoo attention is inference-only")
    if kwargs.get("is_causal", getattr(module, "is_causal", True)) is False:
        raise KVZooIntegrationError(f"{ATTENTION_NAME}: only causal (decoder) attention is supported")
    if value.shape[-1] != query.shape[-1]:
        raise KVZooIntegrationError(
            f"{ATTENTION_NAME}: value head size {value.shape[-1]} differs from the query's {query.shape[-1]}"
        )
    sinks = kwargs.get("s_aux")
    if sinks is not None:
        sinks = sinks.detach().to(torch.float32).contiguous()
    softcap = kwargs.get("softcap")
    out = layer.attend(
        query,
        key,
        value,
        attention_mask,
        softmax_scale=scaling,
        sliding_window=kwargs.get("sliding_window"),
        softcap=softcap or None,
        sinks=sinks,
    )
    return out, None


def kvzoo_padding_mask(
    *args: Any, attention_mask: torch.Tensor | None = None, kv_length: int | None = None, **kwargs: Any
) -> torch.Tensor | None:
    """The mask transformers hands to kvzoo_paged: the 2-D padding mask's last kv_length columns
    (bool [B, kv_length], True = real), or None without padding information. A fixed-size cache
    (KVZooStaticCache) asks for max_cache_len columns: the mask is padded with False to that
    width, so a compiled decode step meets one shape every step (generate builds it outside the
    compiled forward and hands it in)."""
    if attention_mask is None:
        return None
    width = attention_mask.shape[-1]
    if kv_length is not None and width > kv_length:
        attention_mask = attention_mask[:, -kv_length:]
    elif kv_length is not None and width < kv_length:
        attention_mask = torch.nn.functional.pad(attention_mask, (0, kv_length - width), value=False)
    return attention_mask


def register(name: str = ATTENTION_NAME) -> None:
    """Register the attention and mask functions under `name` (idempotent)."""
    AttentionInterface.register(name, kvzoo_paged_attention)
    AttentionMaskInterface.register(name, kvzoo_padding_mask)


def use_kvzoo_attention(model: Any) -> Any:
    """Register "kvzoo_paged" and make `model` use it; returns the model.

    Equivalent to `from_pretrained(..., attn_implementation="kvzoo_paged")` after register().
    """
    register()
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(ATTENTION_NAME)
    else:  # older transformers: the attribute the attention modules read
        model.config._attn_implementation = ATTENTION_NAME
    return model
