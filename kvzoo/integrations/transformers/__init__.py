"""Hugging Face transformers on kvzoo's paged, quantized KV cache.

`KVZooCache` is a transformers `Cache` whose layers keep K/V in kvzoo's pages (any mode, either
layout, growing by blocks); `"kvzoo_paged"` is an attention function registered through
transformers' `AttentionInterface` (on import) that writes each step's K/V into the pages and
runs `kvzoo.paged_attention` on the codes, for prefill and decode, with GQA, left-padded
batches (padding tokens get no slot, so they are never attended) and the causal rule.
Beam search, `crop` and batch selection re-point the block tables.

Supported: transformers >= 4.56 (checked with 4.56.2, 4.57.6, 5.0.0 and 5.24.0), decoder-only models
whose attention calls `cache.update` and then the attention interface (Llama, Mistral, Qwen2/3,
Gemma, ... : most of transformers' decoders). Not supported: torch.compile of the model,
offloading, custom 4-D masks, training (dropout, gradients).

Example (CPU; `impl="numpy"` skips Numba's first compilation; leave it out on a GPU):

>>> import torch, transformers
>>> from kvzoo.integrations.transformers import KVZooCache, use_kvzoo_attention
>>> config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
...                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)
>>> model = use_kvzoo_attention(transformers.LlamaForCausalLM(config).eval())
>>> prompts = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])            # row 0 left-padded
>>> mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
>>> cache = KVZooCache(model.config, mode="fp8_per_token_head", block_size=16, impl="numpy")
>>> out = model.generate(prompts, attention_mask=mask, past_key_values=cache, max_new_tokens=3,
...                      do_sample=False, pad_token_id=0)
>>> tuple(out.shape), cache.get_seq_length(), cache.pages.lens.tolist()   # positions; real tokens per row
((2, 8), 7, [5, 7])
"""

from __future__ import annotations

try:
    import transformers as _transformers  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("kvzoo.integrations.transformers needs transformers: pip install 'kvzoo[transformers]'") from exc

from .attention import kvzoo_padding_mask, kvzoo_paged_attention, register, use_kvzoo_attention
from .cache import ATTENTION_NAME, KVZooCache, KVZooIntegrationError, KVZooLayer, static_fp8_scales
from .static import KVZooStaticCache, KVZooStaticLayer

register()

__all__ = [
    "ATTENTION_NAME",
    "KVZooCache",
    "KVZooIntegrationError",
    "KVZooLayer",
    "KVZooStaticCache",
    "KVZooStaticLayer",
    "kvzoo_padding_mask",
    "kvzoo_paged_attention",
    "register",
    "static_fp8_scales",
    "use_kvzoo_attention",
]
