"""The public operations: each call becomes its record (kvzoo.problem) and takes the one path
(kvzoo.launches.run): checked (kvzoo.calls), chosen by the registry, run.

Inputs may be torch tensors (CPU or GPU) or NumPy arrays (CPU); strided views (K and V
sliced out of a fused QKV projection, caches viewed out of an inline-layout buffer) are taken
as they are, never copied.

A call of a signature met before (its arguments' dtypes, shapes, strides, devices, flags and
host scalars) skips the metadata checks and the registry's choice, and goes to the launch
that signature resolved to, checking what its addresses change (whether a written array meets
another) and, with validate=True, the values it reads: an engine's layers pay the full checks
once per shape. Under torch.compile a call goes to the torch.library op of its operation
(kvzoo.torch_ops), which the graph holds as one node.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import launches
from . import registry as _registry
from .modes import QuantMode
from .problem import Attention, CacheWrite, Dequantize

if TYPE_CHECKING:
    from .arrays import Array

try:
    from torch.compiler import is_compiling as _compiling
except ImportError:  # NumPy-only installs: nothing compiles

    def _compiling() -> bool:
        return False


def reshape_and_cache(
    key: Array,
    value: Array,
    key_cache: Array,
    value_cache: Array,
    slot_mapping: Array,
    *,
    mode: str | QuantMode,
    k_scale_cache: Array | None = None,
    v_scale_cache: Array | None = None,
    k_scale: Array | float | None = None,
    v_scale: Array | float | None = None,
    rounding: str = "nearest",
    impl: str | _registry.Implementation | None = None,
    validate: bool = True,
    check_finite: bool = False,
) -> None:
    """Quantize key/value rows [num_tokens, num_kv_heads, head_size] into their cache slots.

    slot_mapping[t] = block * block_size + offset; a negative slot skips token t. With
    validate=False no device value is read on the host (CUDA-graph safe); a negative slot is
    still skipped. check_finite=True raises instead of storing NaN/Inf rows.
    """
    if _compiling():
        from . import torch_ops

        return torch_ops.compiled_write(
            key, value, key_cache, value_cache, slot_mapping, mode, k_scale_cache, v_scale_cache, k_scale, v_scale,
            rounding, impl, validate, check_finite,
        )  # fmt: skip
    record = CacheWrite(
        key, value, key_cache, value_cache, slot_mapping, k_scale_cache, v_scale_cache, k_scale, v_scale, mode, rounding
    )
    launches.run(record, impl, validate, check_finite=check_finite)


def dequantize(
    cache: Array,
    scale_cache: Array | None = None,
    *,
    mode: str | QuantMode,
    scale: Array | float | None = None,
    block_tables: Array | None = None,
    seq_lens: Array | None = None,
    impl: str | _registry.Implementation | None = None,
    validate: bool = True,
) -> Array:
    """Decode cache codes to float32.

    Without block_tables: the whole cache, shape [num_blocks, block_size, H, D].
    With block_tables and seq_lens: the tokens of each sequence, packed in order,
    shape [sum(seq_lens), H, D].
    """
    record = Dequantize(cache, block_tables, seq_lens, None, None, scale_cache, scale, mode)
    out = launches.run(record, impl, validate)[0][4]
    return out.reshape(*cache.shape[:3], out.shape[2]) if block_tables is None else out


def paged_attention(
    query: Array,
    key_cache: Array,
    value_cache: Array,
    *,
    mode: str | QuantMode,
    block_tables: Array,
    seq_lens: Array,
    query_start_loc: Array,
    k_scale_cache: Array | None = None,
    v_scale_cache: Array | None = None,
    k_scale: Array | float | None = None,
    v_scale: Array | float | None = None,
    softmax_scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: Array | None = None,
    out: Array | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_prefills: int | None = None,
    batch_invariant: bool = False,
    quantize_query: bool = False,
    fp8_dots: bool = False,
    return_lse: bool = False,
    lse: Array | None = None,
    impl: str | _registry.Implementation | None = None,
    validate: bool = True,
) -> Array | tuple[Array, Array]:
    """Causal attention of a varlen batch (prefill chunks and decodes) over the paged cache.

    Sequence s owns query rows query_start_loc[s]:query_start_loc[s+1]; its context is
    seq_lens[s] tokens (this step's included), found through block_tables[s]. Returns `out`
    ([num_tokens, num_q_heads, head_size], query dtype). Pass max_query_len and max_seq_len
    (host ints) together with validate=False to avoid every host synchronisation; num_prefills
    (host int: sequences with more than one query token, as engines count them) then keeps the
    GPU's staged quantized prefill from sizing its workspace for every sequence. Otherwise
    all three are computed from the device values.

    quantize_query=True (int8 per-token-head caches only) quantizes each query row to int8
    the way the cache's rows are, so QK^T runs on int8 codes (int8 tensor cores on the GPU):
    faster, with the query's rounding added to the error (SPEC.md section 8.1).

    fp8_dots=True (fp8_per_token_head caches only) takes each query row as two e4m3 terms and
    rounds each row's probabilities to e4m3 per key tile, so both QK^T and P.V run on the fp8
    codes as stored (SPEC.md section 8.3): 0.4-1.2% relative error on the conformance samples.
    On the H200 it is slower than the default path today (README, known limits).

    return_lse=True returns (out, lse) instead: lse[t, h] (float32 [num_tokens, num_q_heads])
    is the natural log of sum_k exp(l_k) over the logits the row attends to (scaled and
    softcapped), plus exp(sinks[h]) when sinks are given (SPEC.md section 8.2). Partial
    results over disjoint parts of a context combine exactly with kvzoo.merge_attention_states
    (give sinks to one part only). lse: a writable float32 array to write it into (allocated
    when None); it needs return_lse=True, so that the return type follows that flag alone.
    """
    if _compiling():
        from . import torch_ops

        return torch_ops.compiled_attention(
            query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out, k_scale_cache, v_scale_cache,
            k_scale, v_scale, sinks, lse, mode, softmax_scale, sliding_window, softcap, max_query_len, max_seq_len,
            num_prefills, batch_invariant, quantize_query, fp8_dots, return_lse, impl, validate,
        )  # fmt: skip
    record = Attention(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out, k_scale_cache, v_scale_cache,
        k_scale, v_scale, sinks, lse, mode, softmax_scale, sliding_window, softcap, max_query_len, max_seq_len,
        num_prefills, batch_invariant, quantize_query, fp8_dots, return_lse,
    )  # fmt: skip
    operands = launches.run(record, impl, validate)[0]
    return (operands[6], operands[12]) if return_lse else operands[6]
