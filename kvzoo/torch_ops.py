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

The engine-step plan (kvzoo.plan_step) through ops: ``torch.ops.kvzoo.step_write`` and
``torch.ops.kvzoo.step_attention`` take a layer's tensors and a plan *name*; the step's
metadata is not in the graph. The engine registers each step's plan under that name outside
the compiled function, so one graph serves every step (the pattern of vLLM's forward context):

    plan = kvzoo.plan_step(spec, block_tables=..., seq_lens=..., query_start_loc=...,
                           slot_mapping=..., num_q_heads=...)
    with kvzoo.torch_ops.step_plans(default=plan):      # or set_step_plan("default", plan)
        hidden = compiled_model(x, caches)             # step_write / step_attention per layer

The registry of names is process-wide (like vLLM's forward context), not per thread. Step ops
take the separate layout only. Under CUDA graphs (inductor's cudagraphs, a manual capture) the
ops' Python runs at capture only: a replay reuses the plan registered then, so a new step must
update that plan's metadata tensors in place (kvzoo.plan's CUDA-graph recipe) rather than
register a new plan.

A plan remembers each caches object (KVCacheTensors) by identity, while an op is handed bare
tensors, and under functionalization (aot_eager, export's run_decompositions) clones of the
graph's caches. So the ops keep the KVCacheTensors built for each tuple of cache tensors,
keyed on their addresses and view metadata, holding the tensors (an address cannot pass to
other memory while its tensor is held); the last MAX_HELD_CACHES tuples are kept. A backend
that hands the op fresh clones on every call (aot_eager: one per layer and step) misses, and
its entries hold those clones until they age out; eager and inductor (which re-inplaces the
functionalized write) hand the op the caches themselves and hit, once per layer
(tests/test_torch_ops.py pins both, with torch 2.13).
"""

import contextlib
import inspect
import math
from collections.abc import Iterator
from typing import Any

import torch
from cachetools import LRUCache

from . import calls, launches
from .errors import fail
from .layout import KVCacheTensors
from .modes import QuantMode
from .plan import StepPlan
from .problem import Attention, CacheWrite
from .registry import Implementation
from .validate import float32_scalar, require_array

__all__ = [
    "DEFAULT_PLAN",
    "paged_attention",
    "reshape_and_cache",
    "set_step_plan",
    "step_attention",
    "step_plans",
    "step_write",
]

# Both device types torch reports for kvzoo's tensors (ROCm tensors are "cuda" to torch).
# Naming them, rather than registering for every backend, makes a call on another device fail
# in the dispatcher with torch's own message instead of deep inside kvzoo's argument checks.
DEVICE_TYPES = ("cpu", "cuda")

_WRITE_MUTATES = ("key_cache", "value_cache", "k_scale_cache", "v_scale_cache")


def _refuse_real_call(**named: torch.Tensor | None) -> None:
    """A fake kernel runs for two reasons: tracing (every tensor fake, or every one on meta) and
    a real call with one argument on meta, which the dispatcher routes here by that argument's
    device. The second would return having written nothing: refuse it as the functional API
    does (kvzoo_spec/SPEC.md section 11), naming the first argument not on a CPU or GPU."""
    tensors = [(name, t) for name, t in named.items() if isinstance(t, torch.Tensor)]
    # Fake and functional tensors are subclasses; only a real call hands over plain ones with memory.
    if any(type(t) is torch.Tensor and t.device.type != "meta" for _, t in tensors):
        for name, t in tensors:
            require_array(name, t)


def _write_record(a: dict) -> CacheWrite:
    """The op's arguments (its schema's names) as the functional call's record."""
    return CacheWrite(
        a["key"], a["value"], a["key_cache"], a["value_cache"], a["slot_mapping"], a["k_scale_cache"],
        a["v_scale_cache"], a["k_scale"], a["v_scale"], a["kv_cache_dtype"], a["rounding"],
    )  # fmt: skip


def _attention_record(a: dict) -> Attention:
    return Attention(
        a["query"], a["key_cache"], a["value_cache"], a["block_tables"], a["seq_lens"], a["query_start_loc"],
        a["out"], a["k_scale_cache"], a["v_scale_cache"], a["k_scale"], a["v_scale"], a["sinks"], a["lse"],
        a["kv_cache_dtype"], a["softmax_scale"], a["sliding_window"], a["softcap"], a["max_query_len"],
        a["max_seq_len"], a["num_prefills"], a["batch_invariant"], a["quantize_query"], a["fp8_dots"],
        a["lse"] is not None,
    )  # fmt: skip


def _define(name: str, mutates: tuple[str, ...], kernel: Any, check: Any) -> None:
    """Define torch.ops.kvzoo.<name> (once per process: a second execution of this module, by
    importlib.reload or under another name, must not define it again) with `kernel` as its
    real implementation and, as its fake one, `check` of its arguments by name: the metadata
    tier of the call's record (kvzoo.calls), which reads no data, so a bad call fails while
    tracing, with kvzoo's error, not later on the device."""
    if hasattr(torch.ops.kvzoo, name):
        return
    op = torch.library.custom_op(f"kvzoo::{name}", mutates_args=mutates, device_types=DEVICE_TYPES)(kernel)
    parameters = inspect.signature(kernel)

    @op.register_fake
    def _fake(*args: Any, **kwargs: Any) -> None:
        bound = parameters.bind(*args, **kwargs)
        bound.apply_defaults()
        named = bound.arguments
        _refuse_real_call(**{n: x for n, x in named.items() if isinstance(x, torch.Tensor)})
        check(named)


# Every argument up to `rounding` has no default so the schema reads in the order an engine
# passes them; the trailing ones default to the functional API's defaults.
def _reshape_and_cache(
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
    launches.run(_write_record(locals()), impl, validate)


# lse is a mutated argument without a default, before the defaulted ones: torch 2.11's
# in-place bookkeeping indexes mutated arguments by schema position among those passed, so a
# defaulted mutated argument left out of a call fails there (torch 2.13 copes).
def _paged_attention(
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
    max_query_len: int | None,
    max_seq_len: int | None,
    batch_invariant: bool,
    quantize_query: bool,
    fp8_dots: bool,
    lse: torch.Tensor | None,
    num_prefills: int | None = None,
    validate: bool = True,
    impl: str | None = None,
) -> None:
    launches.run(_attention_record(locals()), impl, validate)


_define("reshape_and_cache", _WRITE_MUTATES, _reshape_and_cache, lambda a: calls.check(_write_record(a), fake=True))
_define("paged_attention", ("out", "lse"), _paged_attention, lambda a: calls.check(_attention_record(a), fake=True))


def _mode_name(kv_cache_dtype: str | QuantMode) -> str:
    return kv_cache_dtype.name if isinstance(kv_cache_dtype, QuantMode) else kv_cache_dtype


def _schema_takes(tensors: tuple, scales: tuple, strs: tuple) -> bool:
    """Whether torch.ops.kvzoo's schema carries these arguments on to kvzoo's checks. What it
    cannot carry (a list where a tensor goes, a mode or rounding that is no str) or no kernel
    of the dispatcher's takes (a sparse tensor), torch would refuse in its own words; the
    wrappers then run the functional API's checks (calls.check) first, which refuse it as
    kvzoo.reshape_and_cache / kvzoo.paged_attention do, before anything is written. A type
    check an argument: a valid call builds no record. scales: static scales, numbers too."""
    for x in tensors:
        if x is not None and not _strided(x):
            return False
    for x in scales:
        if x is not None and type(x) not in (int, float) and not _strided(x):
            return False
    return all(isinstance(x, str) for x in strs)


def _strided(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.layout == torch.strided


def _outputs(
    query: object, out: torch.Tensor | None, lse: torch.Tensor | None, return_lse: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An attention op's (out, lse), allocated where not given: the op writes lse exactly when
    it is given one, so return_lse is settled here."""
    # query's shape sizes out and lse before the op, which checks the rest, is called. Only
    # what torch.compile traces: the op's own checks run outside the graph.
    if not isinstance(query, torch.Tensor):
        fail(f"query: expected a torch.Tensor [num_tokens, num_q_heads, head_size], got {type(query).__name__}")
    if query.dim() != 3:
        fail(f"query: expected 3 dimensions [num_tokens, num_q_heads, head_size], got shape {tuple(query.shape)}")
    if out is None:
        out = torch.empty_like(query)
    return out, calls.lse_output(lse, return_lse, query, query.shape[0], query.shape[1])


def _result(
    out: torch.Tensor, lse: torch.Tensor | None, return_lse: bool
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if return_lse:
        assert lse is not None  # allocated where not given (calls.check_lse)
        return out, lse
    return out


def _static_scale(name: str, scale: torch.Tensor | float | None, like: torch.Tensor) -> torch.Tensor | None:
    # The schema carries a static scale as a tensor (an engine keeps it on the device); a
    # Python float is accepted here for convenience and becomes a float32 [1] tensor, checked
    # first, as the functional API checks a float on every call (a tensor's value is read only
    # under validate=True).
    if scale is None or isinstance(scale, torch.Tensor):
        return scale
    if torch.compiler.is_compiling():
        # Traced, a float argument is a graph input once torch makes it dynamic (a SymFloat,
        # which NumPy cannot take): float32_scalar's rule as comparisons torch checks. Dynamo
        # (torch 2.11) takes a message function only if it reads no variable: one per name.
        ok = _FLOAT32_UNDERFLOW < scale < _FLOAT32_OVERFLOW
        if name == "k_scale":
            torch._check(ok, lambda: "k_scale: expected a finite float > 0 in float32 (the precision the kernels use)")
        else:
            torch._check(ok, lambda: "v_scale: expected a finite float > 0 in float32 (the precision the kernels use)")
    else:
        scale = float32_scalar(name, scale)
    return torch.tensor([scale], dtype=torch.float32, device=getattr(like, "device", None))


def _static_scales(
    k_scale: torch.Tensor | float | None, v_scale: torch.Tensor | float | None, like: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    return _static_scale("k_scale", k_scale, like), _static_scale("v_scale", v_scale, like)


# The least real number float32 rounds to +Inf (ties to even), and the largest it rounds to 0.
_FLOAT32_OVERFLOW = 2.0**128 - 2.0**103
_FLOAT32_UNDERFLOW = 2.0**-150


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
    mode = _mode_name(kv_cache_dtype)
    tensors = (key, value, key_cache, value_cache, slot_mapping, k_scale_cache, v_scale_cache)
    if not torch.compiler.is_compiling() and not _schema_takes(tensors, (k_scale, v_scale), (mode, rounding)):
        calls.check(CacheWrite(*tensors, k_scale, v_scale, kv_cache_dtype, rounding))
    torch.ops.kvzoo.reshape_and_cache(
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        k_scale_cache,
        v_scale_cache,
        *_static_scales(k_scale, v_scale, key_cache),
        mode,
        rounding,
        validate,
        impl,
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
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
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
    fp8_dots: bool = False,
    return_lse: bool = False,
    lse: torch.Tensor | None = None,
    validate: bool = True,
    impl: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of a varlen batch (prefill chunks and decodes) over the paged cache.

    Calls ``torch.ops.kvzoo.paged_attention``, which runs ``kvzoo.paged_attention``; returns
    ``out``, or ``(out, lse)`` with ``return_lse=True``.

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
    max_query_len, max_seq_len : int, optional
        Host ints: the batch's longest query chunk and longest context. With
        ``validate=True`` they are recomputed from the tensors; with ``validate=False`` they
        are trusted, and must be exact. None: read from the tensors (a synchronisation).
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
    fp8_dots : bool
        fp8_per_token_head caches: quantize the query rows and the probabilities to e4m3 and
        run both dot products on the fp8 codes (SPEC.md section 8.3).
    return_lse : bool
        Also return the log-sum-exp of each row's logits (natural log, sinks included), the
        weight ``kvzoo.merge_attention_states`` combines partial attentions with.
    lse : torch.Tensor, optional
        ``[num_tokens, num_q_heads]``, float32, written; allocated when not given. Only with
        ``return_lse=True`` (the return type follows that flag alone).
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
    >>> out, lse = kvzoo.torch_ops.paged_attention(
    ...     query, t.key_cache, t.value_cache, block_tables=torch.tensor([[0, 1]], dtype=torch.int32),
    ...     seq_lens=torch.tensor([20], dtype=torch.int32), query_start_loc=torch.tensor([0, 20], dtype=torch.int32),
    ...     max_query_len=20, max_seq_len=20, return_lse=True, **kv)
    >>> lse.shape, lse.dtype
    (torch.Size([20, 8]), torch.float32)
    """
    mode = _mode_name(kv_cache_dtype)
    if not torch.compiler.is_compiling() and not _schema_takes(
        (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out, k_scale_cache, v_scale_cache,
         sinks, lse),
        (k_scale, v_scale),
        (mode,),
    ):  # fmt: skip
        calls.check(
            Attention(
                query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out, k_scale_cache,
                v_scale_cache, k_scale, v_scale, sinks, lse, kv_cache_dtype, softmax_scale, sliding_window, softcap,
                max_query_len, max_seq_len, num_prefills, batch_invariant, quantize_query, fp8_dots, return_lse,
            )
        )  # fmt: skip
    out, lse = _outputs(query, out, lse, return_lse)
    if softmax_scale is None:
        # As kvzoo.paged_attention defaults it, so the op's result equals the API's. A head size
        # of 0 is the op's to refuse, naming the query as the API does, not a ZeroDivisionError
        # here: any scale stands in for one that is never used.
        head_size = query.shape[-1]
        softmax_scale = 1.0 / math.sqrt(head_size) if head_size > 0 else 1.0
    if not torch.compiler.is_compiling():
        _host_scalars(softmax_scale, sliding_window, softcap, (max_query_len, max_seq_len, num_prefills), seq_lens)
    torch.ops.kvzoo.paged_attention(
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        k_scale_cache,
        v_scale_cache,
        *_static_scales(k_scale, v_scale, key_cache),
        sinks,
        mode,
        softmax_scale,
        sliding_window,
        softcap,
        max_query_len,
        max_seq_len,
        batch_invariant,
        quantize_query,
        fp8_dots,
        lse,
        num_prefills,
        validate,
        impl,
    )
    return _result(out, lse, return_lse)


def _host_scalars(softmax_scale: Any, sliding_window: Any, softcap: Any, bounds: tuple, seq_lens: Any) -> None:
    """The functional API's rules for the host scalars, before the op's schema sees them: it
    casts True to 1.0 or 1 (which kvzoo.paged_attention refuses) and refuses a str, or an int
    past int64, with torch's RuntimeError instead of kvzoo's KVZooInputError naming it. The
    op's own checks run again inside it (what torch.ops.kvzoo.paged_attention is given)."""
    # The functional API's own checks; what they return (the values as the kernels take them)
    # is the op's to work out again.
    calls.attention_scalars(1, calls.INT32_MAX, softmax_scale, sliding_window, softcap)
    # A bound the schema carries unchanged (an int of int64) is left to the op, whose check
    # knows num_seqs and runs after the arrays': checked here, num_prefills=-1 was refused in
    # other words than kvzoo.paged_attention's.
    mangled = tuple(None if _schema_int(b) else b for b in bounds)
    num_seqs = seq_lens.shape[0] if isinstance(seq_lens, torch.Tensor) and seq_lens.dim() == 1 else None
    calls.check_bounds(mangled, num_seqs)


def _schema_int(value: Any) -> bool:
    return value is None or (type(value) is int and -(2**63) <= value < 2**63)


def _impl_name(impl: str | Implementation | None) -> str | None:
    # The op's schema names an implementation; one made with options (a workspace) has no name
    # that says them.
    if isinstance(impl, Implementation):
        if impl.options is not None:
            fail(
                f"impl: {impl.name} with options cannot be handed to a compiled call's op; pass its name, or call eagerly"
            )
        return impl.name
    return impl


def compiled_write(
    key, value, key_cache, value_cache, slot_mapping, mode, k_scale_cache, v_scale_cache, k_scale, v_scale, rounding,
    impl, validate, check_finite,
) -> None:  # fmt: skip
    """kvzoo.reshape_and_cache under torch.compile: its op, one node of the graph."""
    if check_finite:
        fail("check_finite: reads the rows on the host, which a compiled graph does not; check them eagerly")
    reshape_and_cache(
        key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype=mode, k_scale_cache=k_scale_cache,
        v_scale_cache=v_scale_cache, k_scale=k_scale, v_scale=v_scale, rounding=rounding, validate=validate,
        impl=_impl_name(impl),
    )  # fmt: skip


def compiled_attention(
    query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out, k_scale_cache, v_scale_cache,
    k_scale, v_scale, sinks, lse, mode, softmax_scale, sliding_window, softcap, max_query_len, max_seq_len,
    num_prefills, batch_invariant, quantize_query, fp8_dots, return_lse, impl, validate,
):  # fmt: skip
    """kvzoo.paged_attention under torch.compile: its op, one node of the graph."""
    return paged_attention(
        query, key_cache, value_cache, kv_cache_dtype=mode, block_tables=block_tables, seq_lens=seq_lens,
        query_start_loc=query_start_loc, max_query_len=max_query_len, max_seq_len=max_seq_len,
        k_scale_cache=k_scale_cache, v_scale_cache=v_scale_cache, k_scale=k_scale, v_scale=v_scale,
        softmax_scale=softmax_scale, sliding_window=sliding_window, softcap=softcap, sinks=sinks, out=out,
        num_prefills=num_prefills, batch_invariant=batch_invariant, quantize_query=quantize_query,
        fp8_dots=fp8_dots, return_lse=return_lse, lse=lse, validate=validate, impl=_impl_name(impl),
    )  # fmt: skip


# -- the engine-step plan through ops ---------------------------------------------------------

DEFAULT_PLAN = "default"

# Process-wide, as vLLM's forward context is: an engine registers a step's plan, then runs the
# compiled model, whose ops look it up by name when they run (never while tracing).
_STEP_PLANS: dict[str, StepPlan] = {}


def set_step_plan(name: str, plan: StepPlan | None) -> StepPlan | None:
    """Register ``plan`` under ``name`` for :func:`step_write` / :func:`step_attention`.

    Parameters
    ----------
    name : str
        The ``plan_name`` the ops are called with (``"default"`` unless the engine runs
        several plans in one step, e.g. a draft model's).
    plan : kvzoo.StepPlan or None
        This step's plan (``kvzoo.plan_step``); None removes the name.

    Returns the plan registered under ``name`` before, or None. The registry is process-wide;
    :func:`step_plans` scopes registrations to a ``with`` block.
    """
    if not isinstance(name, str) or not name:
        fail(f"name: expected a non-empty str, got {name!r}")
    if plan is not None and not isinstance(plan, StepPlan):
        fail(f"plan: expected a kvzoo.StepPlan (from kvzoo.plan_step) or None, got {type(plan).__name__}")
    previous = _STEP_PLANS.pop(name, None)
    if plan is not None:
        _STEP_PLANS[name] = plan
    return previous


@contextlib.contextmanager
def step_plans(**plans: StepPlan | None) -> Iterator[None]:
    """Register plans by name for the body of a ``with`` block; the previous ones come back on exit.

    ``with kvzoo.torch_ops.step_plans(default=plan): ...`` serves ops called with
    ``plan_name="default"``; each keyword is a name (a value of None hides the name inside;
    a name that is no Python identifier goes through :func:`set_step_plan`). The plans are
    checked as :func:`set_step_plan` checks them, all before any is registered.
    """
    for name, plan in plans.items():
        if plan is not None and not isinstance(plan, StepPlan):
            fail(f"{name}: expected a kvzoo.StepPlan (from kvzoo.plan_step) or None, got {type(plan).__name__}")
    previous = {name: set_step_plan(name, plan) for name, plan in plans.items()}
    try:
        yield
    finally:
        for name, plan in previous.items():
            set_step_plan(name, plan)


def _plan_named(name: str, op: str) -> StepPlan:
    plan = _STEP_PLANS.get(name)
    if plan is None:
        fail(
            f"plan_name: no kvzoo step plan is registered under {name!r} (registered: {sorted(_STEP_PLANS)}); "
            f"{op} looks its step's plan up when it runs: register it first with "
            f"kvzoo.torch_ops.set_step_plan({name!r}, plan) or kvzoo.torch_ops.step_plans(...)"
        )
    if plan.spec.layout != "separate":
        fail(
            f"plan_name: the plan registered under {name!r} is for {plan.spec.layout!r} caches; {op} takes the "
            "separate layout only (inline views do not survive torch's functionalization)"
        )
    return plan


# Enough for one entry per layer of the largest models, with room for a second cache set.
MAX_HELD_CACHES = 256
# Least recently used let go first.
_HELD: LRUCache[tuple, KVCacheTensors] = LRUCache(maxsize=MAX_HELD_CACHES)


def _view_key(x: torch.Tensor | None) -> tuple | None:
    # Address, dtype and view geometry: two tensors agreeing on all of them, while the first
    # is held alive, are views of the same bytes with the same meaning.
    if x is None:
        return None
    return (x.data_ptr(), x.device, x.dtype, tuple(x.shape), x.stride())


def _caches_for(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    k_scale_cache: torch.Tensor | None,
    v_scale_cache: torch.Tensor | None,
) -> KVCacheTensors:
    """The one KVCacheTensors for these tensors, so the plan's per-object check runs once."""
    tensors = (key_cache, value_cache, k_scale_cache, v_scale_cache)
    key = tuple(map(_view_key, tensors))
    held = _HELD.get(key)  # a hit is the most recently used now
    # The held tensors are compared again because set_ or resize_ on one of them would leave
    # its key naming an address it no longer owns, which other memory may since have taken.
    if (
        held is not None
        and tuple(map(_view_key, (held.key_cache, held.value_cache, held.k_scale_cache, held.v_scale_cache))) == key
    ):
        return held
    held = _HELD[key] = KVCacheTensors(*tensors)
    return held


def _step_write(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    k_scale_cache: torch.Tensor | None,
    v_scale_cache: torch.Tensor | None,
    plan_name: str,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    plan = _plan_named(plan_name, "kvzoo.step_write")
    caches = _caches_for(key_cache, value_cache, k_scale_cache, v_scale_cache)
    plan.write(key, value, caches, k_scale=k_scale, v_scale=v_scale)


def _step_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    k_scale_cache: torch.Tensor | None,
    v_scale_cache: torch.Tensor | None,
    plan_name: str,
    lse: torch.Tensor | None,  # no default: see _paged_attention
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    plan = _plan_named(plan_name, "kvzoo.step_attention")
    caches = _caches_for(key_cache, value_cache, k_scale_cache, v_scale_cache)
    plan.attention(
        query, caches, out=out, k_scale=k_scale, v_scale=v_scale, sinks=sinks, return_lse=lse is not None, lse=lse
    )


def _check_step_write(a: dict) -> None:
    # While tracing no plan is looked up: what the rows and the caches say of each other.
    scales = (a["k_scale_cache"], a["v_scale_cache"])
    calls.check_layer_rows(("key", a["key"]), ("value", a["value"]), a["key_cache"], a["value_cache"], *scales, True)


def _check_step_attention(a: dict) -> None:
    query, scales = a["query"], (a["k_scale_cache"], a["v_scale_cache"])
    calls.check_layer_rows(("query", query), ("out", a["out"]), a["key_cache"], a["value_cache"], *scales, True)
    calls.check_lse(a["lse"], a["lse"] is not None, query.shape[0], query.shape[1], True)


_define("step_write", _WRITE_MUTATES, _step_write, _check_step_write)
_define("step_attention", ("out", "lse"), _step_attention, _check_step_attention)


def step_write(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *,
    k_scale_cache: torch.Tensor | None = None,
    v_scale_cache: torch.Tensor | None = None,
    plan_name: str = DEFAULT_PLAN,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
) -> None:
    """Write this layer's K/V rows into its cache with the step's registered plan, in place.

    Calls ``torch.ops.kvzoo.step_write``, which runs ``plan.write`` of the plan registered
    under ``plan_name`` (:func:`set_step_plan`, :func:`step_plans`) at the time the op runs:
    the slots, mode and implementation are the plan's. Raises ``kvzoo.KVZooInputError``, with
    nothing written, when no plan is registered under the name.

    Parameters
    ----------
    key, value : torch.Tensor
        ``[num_tokens, num_kv_heads, head_size]``, the plan's ``model_dtype``; ``num_tokens``
        is the plan's ``slot_mapping`` length. Strided views are read in place.
    key_cache, value_cache : torch.Tensor
        ``[num_blocks, block_size, num_kv_heads, cache width]``, separate layout, of the
        plan's CacheSpec, written (see :func:`reshape_and_cache` for the dtypes).
    k_scale_cache, v_scale_cache : torch.Tensor, optional
        ``[num_blocks, block_size, num_kv_heads]``, float32, written; required by the
        per-token-head modes.
    plan_name : str
        The name the step's plan is registered under.
    k_scale, v_scale : torch.Tensor or float, optional
        float32 ``[1]`` static scales, for ``fp8_per_tensor`` only.

    Example
    -------
    >>> import torch, kvzoo, kvzoo.torch_ops
    >>> spec = kvzoo.CacheSpec("int8_per_token_head", num_blocks=4, block_size=16, num_kv_heads=2,
    ...                        head_size=64, model_dtype="float32")
    >>> t = spec.allocate()
    >>> plan = kvzoo.plan_step(spec, num_q_heads=4, block_tables=torch.tensor([[0, 1]], dtype=torch.int32),
    ...                        seq_lens=torch.tensor([20], dtype=torch.int32),
    ...                        query_start_loc=torch.tensor([0, 20], dtype=torch.int32), slot_mapping=torch.arange(20))
    >>> key, value = torch.randn(2, 20, 2, 64)
    >>> with kvzoo.torch_ops.step_plans(default=plan):
    ...     kvzoo.torch_ops.step_write(key, value, t.key_cache, t.value_cache,
    ...                                k_scale_cache=t.k_scale_cache, v_scale_cache=t.v_scale_cache)
    >>> bool(t.k_scale_cache[0, :16].gt(0).all()), bool(t.k_scale_cache[1, 4:].eq(0).all())
    (True, True)
    """
    torch.ops.kvzoo.step_write(
        key,
        value,
        key_cache,
        value_cache,
        k_scale_cache,
        v_scale_cache,
        plan_name,
        *_static_scales(k_scale, v_scale, key_cache),
    )


def step_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *,
    k_scale_cache: torch.Tensor | None = None,
    v_scale_cache: torch.Tensor | None = None,
    plan_name: str = DEFAULT_PLAN,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    lse: torch.Tensor | None = None,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """This layer's paged attention with the step's registered plan; returns ``out``.

    Calls ``torch.ops.kvzoo.step_attention``, which runs ``plan.attention`` of the plan
    registered under ``plan_name`` when the op runs: the block tables, lengths, softmax
    options and implementation are the plan's. Raises ``kvzoo.KVZooInputError`` when no plan
    is registered under the name.

    Parameters
    ----------
    query : torch.Tensor
        ``[num_tokens, num_q_heads, head_size]``, the plan's ``model_dtype`` and
        ``num_q_heads``; rows as the plan's ``query_start_loc`` splits them.
    key_cache, value_cache : torch.Tensor
        ``[num_blocks, block_size, num_kv_heads, cache width]``, separate layout, of the
        plan's CacheSpec, as written by :func:`step_write`.
    k_scale_cache, v_scale_cache : torch.Tensor, optional
        ``[num_blocks, block_size, num_kv_heads]``, float32 (per-token-head modes).
    plan_name : str
        The name the step's plan is registered under.
    out : torch.Tensor, optional
        ``[num_tokens, num_q_heads, head_size]``, query's dtype, written; allocated with
        ``torch.empty_like(query)`` when not given.
    return_lse : bool
        Return ``(out, lse)``: lse float32 ``[num_tokens, num_q_heads]``, the natural-log
        sum of exp of each row's logits (for ``kvzoo.merge_attention_states``).
    lse : torch.Tensor, optional
        float32 ``[num_tokens, num_q_heads]`` to write lse into (with ``return_lse=True``).
    k_scale, v_scale : torch.Tensor or float, optional
        float32 ``[1]`` static scales, for ``fp8_per_tensor`` only.
    sinks : torch.Tensor, optional
        ``[num_q_heads]``, float32: this layer's sinks, in place of the plan's.

    Example
    -------
    >>> import torch, kvzoo, kvzoo.torch_ops
    >>> spec = kvzoo.CacheSpec("fp8_per_token_head", num_blocks=4, block_size=16, num_kv_heads=2,
    ...                        head_size=64, model_dtype="float32")
    >>> t = spec.allocate()
    >>> scales = dict(k_scale_cache=t.k_scale_cache, v_scale_cache=t.v_scale_cache)
    >>> plan = kvzoo.plan_step(spec, num_q_heads=4, block_tables=torch.tensor([[0, 1]], dtype=torch.int32),
    ...                        seq_lens=torch.tensor([20], dtype=torch.int32),   # one prefill of 20 tokens
    ...                        query_start_loc=torch.tensor([0, 20], dtype=torch.int32), slot_mapping=torch.arange(20))
    >>> key, value = torch.randn(2, 20, 2, 64)
    >>> with kvzoo.torch_ops.step_plans(default=plan):
    ...     kvzoo.torch_ops.step_write(key, value, t.key_cache, t.value_cache, **scales)
    ...     out, lse = kvzoo.torch_ops.step_attention(torch.randn(20, 4, 64), t.key_cache, t.value_cache,
    ...                                               return_lse=True, **scales)
    >>> tuple(out.shape), tuple(lse.shape), lse.dtype
    ((20, 4, 64), (20, 4), torch.float32)
    """
    out, lse = _outputs(query, out, lse, return_lse)
    torch.ops.kvzoo.step_attention(
        out,
        query,
        key_cache,
        value_cache,
        k_scale_cache,
        v_scale_cache,
        plan_name,
        lse,
        *_static_scales(k_scale, v_scale, key_cache),
        sinks,
    )
    return _result(out, lse, return_lse)
