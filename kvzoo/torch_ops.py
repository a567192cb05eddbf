"""kvzoo's cache write and paged attention as torch.library custom ops.

    import kvzoo.torch_ops   # registers torch.ops.kvzoo.reshape_and_cache and .paged_attention

torch.compile and torch.export see each call as one opaque node with a declared schema (which
arguments it mutates) and a fake implementation (output metadata without touching data), so a
model step that writes its K/V into a kvzoo cache and attends over it traces into one graph
with no break. The real implementations are kvzoo.api's functions, so the ops compute exactly
what `kvzoo.reshape_and_cache` / `kvzoo.paged_attention` compute, byte for byte.

This module needs torch; `import kvzoo` does not import it (torch is an optional extra).

The ops are not differentiable: like the functional API they refuse inputs that require grad,
so run them under torch.no_grad() or torch.inference_mode(), as an inference engine does.

Trace with the separate layout. Inline-layout caches (int8/fp8 and float32 views of one uint8
buffer) work eagerly and under backend="eager", but torch 2.13's functionalization does not
handle them: passed as graph inputs, aot_eager and inductor refuse them ("input mutations on
views with different dtypes"); viewed inside the graph, aot_eager and export's
run_decompositions silently drop the codes written (only inductor's result was right, in one
test). tests/test_torch_ops.py pins the silent case.
"""

import math

import torch

from . import api
from .errors import fail
from .modes import QuantMode

__all__ = ["paged_attention", "reshape_and_cache"]

# Both device types torch reports for kvzoo's tensors (ROCm tensors are "cuda" to torch).
# Naming them, rather than registering for every backend, makes a call on another device fail
# in the dispatcher with torch's own message instead of deep inside kvzoo's argument checks.
DEVICE_TYPES = ("cpu", "cuda")

_WRITE_MUTATES = ("key_cache", "value_cache", "k_scale_cache", "v_scale_cache")


def _registered(name: str) -> bool:
    # A second execution of this module (importlib.reload, or a copy imported under another
    # name) must not define the ops again: torch refuses a second definition of a name.
    return hasattr(torch.ops.kvzoo, name)


def _check(cond: bool, message: str) -> None:
    # The fake kernels see metadata only; refusing what the real call would refuse on shapes
    # alone makes a bad call fail while tracing, with kvzoo's error, not later on the device.
    if not cond:
        fail(message)


def _check_write_meta(key, value, key_cache, value_cache, slot_mapping, k_scale_cache, v_scale_cache) -> None:
    _check(key.dim() == 3, f"key: expected [num_tokens, num_kv_heads, head_size], got {key.dim()} dims")
    _check(value.shape == key.shape, f"value: shape {tuple(value.shape)} != key's {tuple(key.shape)}")
    _check(value.dtype == key.dtype, f"value: dtype {value.dtype} != key's {key.dtype}")
    _check(key_cache.dim() == 4, f"key_cache: expected [num_blocks, block_size, num_kv_heads, head_size], "
                                 f"got {key_cache.dim()} dims")
    _check(value_cache.shape == key_cache.shape,
           f"value_cache: shape {tuple(value_cache.shape)} != key_cache's {tuple(key_cache.shape)}")
    # head_size is not compared: a packed mode's cache rows need not be head_size wide.
    _check(key_cache.shape[2] == key.shape[1],
           f"key_cache: num_kv_heads {key_cache.shape[2]} != key's {key.shape[1]}")
    _check(slot_mapping.shape == key.shape[:1], f"slot_mapping: expected [num_tokens={key.shape[0]}], "
                                                f"got {tuple(slot_mapping.shape)}")
    for name, sc in (("k_scale_cache", k_scale_cache), ("v_scale_cache", v_scale_cache)):
        if sc is not None:
            _check(sc.shape == key_cache.shape[:3],
                   f"{name}: expected [num_blocks, block_size, num_kv_heads], got {tuple(sc.shape)}")


def _check_attention_meta(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc) -> None:
    _check(query.dim() == 3, f"query: expected [num_tokens, num_q_heads, head_size], got {query.dim()} dims")
    _check(out.shape == query.shape, f"out: shape {tuple(out.shape)} != query's {tuple(query.shape)}")
    _check(out.dtype == query.dtype, f"out: dtype {out.dtype} != query's {query.dtype}")
    _check(key_cache.dim() == 4, f"key_cache: expected [num_blocks, block_size, num_kv_heads, head_size], "
                                 f"got {key_cache.dim()} dims")
    _check(value_cache.shape == key_cache.shape,
           f"value_cache: shape {tuple(value_cache.shape)} != key_cache's {tuple(key_cache.shape)}")
    _check(block_tables.dim() == 2, f"block_tables: expected [num_seqs, max_blocks_per_seq], "
                                    f"got {block_tables.dim()} dims")
    _check(seq_lens.shape == block_tables.shape[:1], f"seq_lens: expected [num_seqs={block_tables.shape[0]}], "
                                                     f"got {tuple(seq_lens.shape)}")
    _check(query_start_loc.dim() == 1 and query_start_loc.shape[0] == seq_lens.shape[0] + 1,
           f"query_start_loc: expected [num_seqs + 1], got {tuple(query_start_loc.shape)}")


def _define_reshape_and_cache() -> None:
    # Every argument up to `rounding` has no default so the schema reads in the order an
    # engine passes them; the trailing ones default to the functional API's defaults.
    @torch.library.custom_op("kvzoo::reshape_and_cache", mutates_args=_WRITE_MUTATES, device_types=DEVICE_TYPES)
    def _op(
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale_cache: torch.Tensor | None,
        v_scale_cache: torch.Tensor | None,
        k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None,
        kv_cache_dtype: str,
        rounding: str,
        validate: bool = True,
        impl: str | None = None,
    ) -> None:
        api.reshape_and_cache(
            key, value, key_cache, value_cache, slot_mapping, mode=kv_cache_dtype,
            k_scale_cache=k_scale_cache, v_scale_cache=v_scale_cache, k_scale=k_scale, v_scale=v_scale,
            rounding=rounding, impl=impl, validate=validate,
        )

    @_op.register_fake
    def _fake(key, value, key_cache, value_cache, slot_mapping, k_scale_cache, v_scale_cache, k_scale, v_scale,
              kv_cache_dtype, rounding, validate=True, impl=None) -> None:
        _check_write_meta(key, value, key_cache, value_cache, slot_mapping, k_scale_cache, v_scale_cache)


def _define_paged_attention() -> None:
    @torch.library.custom_op("kvzoo::paged_attention", mutates_args=("out",), device_types=DEVICE_TYPES)
    def _op(
        out: torch.Tensor,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        k_scale_cache: torch.Tensor | None,
        v_scale_cache: torch.Tensor | None,
        k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None,
        sinks: torch.Tensor | None,
        kv_cache_dtype: str,
        softmax_scale: float,
        sliding_window: int | None,
        softcap: float | None,
        max_query_len: int,
        max_seq_len: int,
        batch_invariant: bool,
        quantize_query: bool,
        num_prefills: int | None = None,
        validate: bool = True,
        impl: str | None = None,
    ) -> None:
        api.paged_attention(
            query, key_cache, value_cache, mode=kv_cache_dtype, block_tables=block_tables, seq_lens=seq_lens,
            query_start_loc=query_start_loc, k_scale_cache=k_scale_cache, v_scale_cache=v_scale_cache,
            k_scale=k_scale, v_scale=v_scale, softmax_scale=softmax_scale, sliding_window=sliding_window,
            softcap=softcap, sinks=sinks, out=out, max_query_len=max_query_len, max_seq_len=max_seq_len,
            num_prefills=num_prefills, batch_invariant=batch_invariant, quantize_query=quantize_query,
            impl=impl, validate=validate,
        )

    @_op.register_fake
    def _fake(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, k_scale_cache,
              v_scale_cache, k_scale, v_scale, sinks, kv_cache_dtype, softmax_scale, sliding_window, softcap,
              max_query_len, max_seq_len, batch_invariant, quantize_query, num_prefills=None, validate=True,
              impl=None) -> None:
        _check_attention_meta(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)


if not _registered("reshape_and_cache"):
    _define_reshape_and_cache()
if not _registered("paged_attention"):
    _define_paged_attention()


def _mode_name(kv_cache_dtype: str | QuantMode) -> str:
    return kv_cache_dtype.name if isinstance(kv_cache_dtype, QuantMode) else kv_cache_dtype


def _static_scale(scale: torch.Tensor | float | None, like: torch.Tensor) -> torch.Tensor | None:
    # The schema carries a static scale as a tensor (an engine keeps it on the device); a
    # Python float is accepted here for convenience and becomes a float32 [1] tensor.
    if scale is None or isinstance(scale, torch.Tensor):
        return scale
    return torch.tensor([scale], dtype=torch.float32, device=like.device)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    kv_cache_dtype: str | QuantMode,
    k_scale_cache: torch.Tensor | None = None,
    v_scale_cache: torch.Tensor | None = None,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
    rounding: str = "nearest",
    validate: bool = True,
    impl: str | None = None,
) -> None:
    """Quantize this step's K/V rows and scatter them into their cache slots, in place.

    Calls ``torch.ops.kvzoo.reshape_and_cache``, which runs ``kvzoo.reshape_and_cache``.

    Parameters
    ----------
    key, value : torch.Tensor
        ``[num_tokens, num_kv_heads, head_size]``, bfloat16, float16 or float32 (the same for
        both). Strided views (slices of a fused QKV projection) are read in place.
    key_cache, value_cache : torch.Tensor
        ``[num_blocks, block_size, num_kv_heads, head_size]``, written. int8 for
        ``int8_per_token_head``, float8_e4m3fn for ``fp8_per_token_head``/``fp8_per_tensor``,
        float8_e4m3fnuz for ``fp8_e4m3fnuz_per_token_head``, uint8 raw bytes for any quantized
        mode, the key's dtype for ``none``.
    slot_mapping : torch.Tensor
        ``[num_tokens]``, int32 or int64: ``block * block_size + offset`` of each token; a
        negative slot skips the token. Each non-negative slot at most once.
    kv_cache_dtype : str or QuantMode
        ``"int8_per_token_head"``, ``"fp8_per_token_head"``, ``"fp8_per_tensor"`` (or ``"fp8"``),
        ``"auto"``/``"none"``, ... (see ``kvzoo.get_kv_quant_mode``).
    k_scale_cache, v_scale_cache : torch.Tensor, optional
        ``[num_blocks, block_size, num_kv_heads]``, float32, written: one scale per (token,
        head). Required by the per-token-head modes, refused by the others.
    k_scale, v_scale : torch.Tensor or float, optional
        float32 ``[1]`` static scales, for ``fp8_per_tensor`` only.
    rounding : str
        ``"nearest"`` or ``"trunc"`` (vLLM's old int8 rounding; int8 modes only).
    validate : bool
        True checks slot ranges and duplicates on the host (a device sync on the GPU); False
        reads no device value on the host, so the call can be captured in a CUDA graph.
    impl : str, optional
        Force a kvzoo implementation (``"numba"``, ``"numpy"``, ``"triton-cuda"``, ...).

    Example
    -------
    >>> import torch, kvzoo, kvzoo.torch_ops
    >>> t = kvzoo.allocate_separate(4, 16, 2, 64, "int8_per_token_head")
    >>> key, value = torch.randn(2, 10, 2, 64, dtype=torch.bfloat16)
    >>> kvzoo.torch_ops.reshape_and_cache(key, value, t.key_cache, t.value_cache, torch.arange(10),
    ...                                   kv_cache_dtype="int8_per_token_head",
    ...                                   k_scale_cache=t.k_scale_cache, v_scale_cache=t.v_scale_cache)
    """
    torch.ops.kvzoo.reshape_and_cache(
        key, value, key_cache, value_cache, slot_mapping, k_scale_cache, v_scale_cache,
        _static_scale(k_scale, key_cache), _static_scale(v_scale, key_cache), _mode_name(kv_cache_dtype),
        rounding, validate, impl,
    )


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *,
    kv_cache_dtype: str | QuantMode,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    k_scale_cache: torch.Tensor | None = None,
    v_scale_cache: torch.Tensor | None = None,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
    softmax_scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    num_prefills: int | None = None,
    batch_invariant: bool = False,
    quantize_query: bool = False,
    validate: bool = True,
    impl: str | None = None,
) -> torch.Tensor:
    """Causal attention of a varlen batch (prefill chunks and decodes) over the paged cache.

    Calls ``torch.ops.kvzoo.paged_attention``, which runs ``kvzoo.paged_attention``; returns
    ``out``.

    Parameters
    ----------
    query : torch.Tensor
        ``[num_tokens, num_q_heads, head_size]``, bfloat16, float16 or float32; sequence ``s``
        owns rows ``query_start_loc[s]:query_start_loc[s + 1]``.
    key_cache, value_cache : torch.Tensor
        ``[num_blocks, block_size, num_kv_heads, head_size]`` as written by
        :func:`reshape_and_cache`; ``num_q_heads`` is a multiple of ``num_kv_heads`` (GQA).
    kv_cache_dtype : str or QuantMode
        The mode the cache was written with.
    block_tables : torch.Tensor
        ``[num_seqs, max_blocks_per_seq]``, int32 or int64: the blocks of each sequence.
    seq_lens : torch.Tensor
        ``[num_seqs]``, int32 or int64: context length of each sequence, this step's tokens
        included.
    query_start_loc : torch.Tensor
        ``[num_seqs + 1]``, int32 or int64: offsets from 0 to ``num_tokens``.
    max_query_len, max_seq_len : int
        Host ints: the batch's longest query chunk and longest context. With
        ``validate=True`` they are recomputed from the tensors; with ``validate=False`` they
        are trusted, and must be exact.
    k_scale_cache, v_scale_cache : torch.Tensor, optional
        ``[num_blocks, block_size, num_kv_heads]``, float32 (per-token-head modes).
    k_scale, v_scale : torch.Tensor or float, optional
        float32 ``[1]`` static scales (``fp8_per_tensor``).
    softmax_scale : float, optional
        Defaults to ``1 / sqrt(head_size)``.
    sliding_window : int, optional
        Each query attends to at most this many most recent positions (itself included).
    softcap : float, optional
        Logits become ``softcap * tanh(logits / softcap)``.
    sinks : torch.Tensor, optional
        ``[num_q_heads]``, float32: one extra logit per head in each softmax's denominator.
    out : torch.Tensor, optional
        ``[num_tokens, num_q_heads, head_size]``, query's dtype, written; allocated with
        ``torch.empty_like(query)`` when not given.
    num_prefills : int, optional
        Host int, with ``validate=False``: the sequences with more than one query token (bounds
        the GPU's staged-prefill workspace).
    batch_invariant : bool
        Each row's result independent of the rest of the batch.
    quantize_query : bool
        int8 per-token-head caches: quantize the query rows to int8 and run QK^T on codes.
    validate : bool
        True checks the index tensors on the host (a device sync on the GPU); False reads no
        device value on the host (CUDA-graph capturable).
    impl : str, optional
        Force a kvzoo implementation.

    Example
    -------
    >>> import torch, kvzoo, kvzoo.torch_ops
    >>> t = kvzoo.allocate_separate(4, 16, 2, 64, "fp8_per_token_head")
    >>> kv = dict(kv_cache_dtype="fp8_per_token_head", k_scale_cache=t.k_scale_cache, v_scale_cache=t.v_scale_cache)
    >>> key, value = torch.randn(2, 20, 2, 64, dtype=torch.bfloat16)
    >>> kvzoo.torch_ops.reshape_and_cache(key, value, t.key_cache, t.value_cache, torch.arange(20), **kv)
    >>> query = torch.randn(20, 8, 64, dtype=torch.bfloat16)   # one prefill of 20 tokens
    >>> out = kvzoo.torch_ops.paged_attention(
    ...     query, t.key_cache, t.value_cache, block_tables=torch.tensor([[0, 1]], dtype=torch.int32),
    ...     seq_lens=torch.tensor([20], dtype=torch.int32), query_start_loc=torch.tensor([0, 20], dtype=torch.int32),
    ...     max_query_len=20, max_seq_len=20, **kv)
    >>> out.shape, out.dtype
    (torch.Size([20, 8, 64]), torch.bfloat16)
    """
    if out is None:
        out = torch.empty_like(query)
    if softmax_scale is None:
        # As kvzoo.paged_attention defaults it, so the op's result equals the API's.
        softmax_scale = 1.0 / math.sqrt(query.shape[-1])
    torch.ops.kvzoo.paged_attention(
        out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, k_scale_cache, v_scale_cache,
        _static_scale(k_scale, key_cache), _static_scale(v_scale, key_cache), sinks, _mode_name(kv_cache_dtype),
        softmax_scale, sliding_window, softcap, max_query_len, max_seq_len, batch_invariant, quantize_query,
        num_prefills, validate, impl,
    )
    return out
