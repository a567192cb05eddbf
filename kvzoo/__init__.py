"""kvzoo: per-token-head INT8/FP8/int4 quantization of the paged KV cache.

Operations (kvzoo.api): reshape_and_cache, dequantize, paged_attention; per engine step,
kvzoo.plan_step (kvzoo.plan) checks the metadata once and serves every layer. kvzoo.audit
(kvzoo.auditing) reports what is wrong with a paged cache. Implementations are chosen by
kvzoo.registry; semantics are defined in kvzoo_spec/SPEC.md. With torch installed, importing
kvzoo registers the torch.library ops (kvzoo.torch_ops), which a compiled call of the
operations goes to.
"""

from . import arrays, registry
from .api import dequantize, paged_attention, reshape_and_cache
from .auditing import audit, cache_dump, load_cache_dump, save_cache_dump
from .cache import PagedKVCache
from .errors import KVZooInputError
from .layout import KVCacheTensors, allocate_inline, allocate_separate, inline_views
from .merge import merge_attention_states
from .modes import MODES, QuantMode, get_kv_quant_mode
from .plan import CacheSpec, StepPlan, plan_step

if arrays.torch is not None:  # a NumPy-only install has no ops to register
    from . import torch_ops  # noqa: F401  (registers the ops)

__version__ = "0.1.0"

__all__ = [
    "CacheSpec",
    "KVCacheTensors",
    "KVZooInputError",
    "MODES",
    "PagedKVCache",
    "QuantMode",
    "StepPlan",
    "allocate_inline",
    "audit",
    "cache_dump",
    "allocate_separate",
    "dequantize",
    "get_kv_quant_mode",
    "inline_views",
    "load_cache_dump",
    "merge_attention_states",
    "paged_attention",
    "plan_step",
    "registry",
    "reshape_and_cache",
    "save_cache_dump",
]
