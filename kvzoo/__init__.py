"""kvzoo: per-token-head INT8/FP8/int4 quantization of the paged KV cache.

Operations (kvzoo.api): reshape_and_cache, dequantize, paged_attention; per engine step,
kvzoo.plan_step (kvzoo.plan) checks the metadata once and serves every layer. kvzoo.audit
(kvzoo.auditing) reports what is wrong with a paged cache. Implementations are chosen by
kvzoo.registry; semantics are defined in kvzoo_spec/SPEC.md.

The package is lazy (PEP 562): `import kvzoo` imports none of torch, numba or triton, and each
public name imports its module on first use (`kvzoo list` and `kvzoo --help` so start in a
fraction of a second). The torch.library ops (kvzoo.torch_ops), which a compiled call of the
operations goes to, register:

- on `import kvzoo` itself where torch is already imported (an engine imports torch first);
- else the first time a name of kvzoo resolves with torch imported by then: `kvzoo.paged_attention`
  and every other name that imports torch brings them in with it;
- and always on `import kvzoo.torch_ops`, which an engine may name to be explicit.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import TYPE_CHECKING, Any

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
# The module (of this package) each public name but the module `registry` comes from, as imported below.
_EXPORTS: dict[str, str] = {
    "CacheSpec": "plan",
    "KVCacheTensors": "layout",
    "KVZooInputError": "errors",
    "MODES": "modes",
    "PagedKVCache": "cache",
    "QuantMode": "modes",
    "StepPlan": "plan",
    "allocate_inline": "layout",
    "audit": "auditing",
    "cache_dump": "auditing",
    "allocate_separate": "layout",
    "dequantize": "api",
    "get_kv_quant_mode": "modes",
    "inline_views": "layout",
    "load_cache_dump": "auditing",
    "merge_attention_states": "merge",
    "paged_attention": "api",
    "plan_step": "plan",
    "reshape_and_cache": "api",
    "save_cache_dump": "auditing",
}

if TYPE_CHECKING:  # what mypy and IDEs see; at run time __getattr__ imports these on first use
    from . import registry
    from .api import dequantize, paged_attention, reshape_and_cache
    from .auditing import audit, cache_dump, load_cache_dump, save_cache_dump
    from .cache import PagedKVCache
    from .errors import KVZooInputError
    from .layout import KVCacheTensors, allocate_inline, allocate_separate, inline_views
    from .merge import merge_attention_states
    from .modes import MODES, QuantMode, get_kv_quant_mode
    from .plan import CacheSpec, StepPlan, plan_step

_ops_registered = False


def _register_torch_ops() -> None:
    """Import kvzoo.torch_ops (which registers torch.ops.kvzoo.*) once torch is imported."""
    global _ops_registered
    # None in sys.modules: torch is blocked (a NumPy-only process), so there is nothing to register.
    if _ops_registered or sys.modules.get("torch") is None:
        return
    _ops_registered = True  # first: torch_ops' own imports of kvzoo's names come back here
    try:
        importlib.import_module(f"{__name__}.torch_ops")
    except BaseException:
        _ops_registered = False
        raise


if not TYPE_CHECKING:  # hidden from mypy, which would otherwise type every unknown kvzoo.X as Any

    def __getattr__(name: str) -> Any:
        module = _EXPORTS.get(name)
        if module is not None:  # a function, class or constant: its module may import torch
            value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
            globals()[name] = value  # later look-ups skip this function
            _register_torch_ops()
            return value
        # A module: kvzoo.registry, and any other (kvzoo.layout, kvzoo.torch_ops, ...), which is
        # how `from . import registry` in kvzoo's own modules arrives here, their import under
        # way: registering (importing kvzoo.torch_ops, which imports them) must wait for a name.
        if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}"):
            return importlib.import_module(f"{__name__}.{name}")  # the import sets the attribute
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if sys.modules.get("torch") is not None:  # torch is loaded already: registering costs little
    _register_torch_ops()
