"""Combining attention computed over disjoint parts of one context (prefix sharing, chunks).

Attention over a context split into parts A and B is a weighted mean of the parts' outputs,
each part weighted by its share of the softmax denominator: with lse_X the log-sum-exp of the
row's logits over part X (kvzoo.paged_attention(..., return_lse=True); SPEC.md section 8.2),

    out = (e^lse_a out_a + e^lse_b out_b) / (e^lse_a + e^lse_b),   lse = log(e^lse_a + e^lse_b)

exactly. The sink's term belongs to one part only: pass sinks to one of the calls.

    >>> import numpy as np, kvzoo
    >>> out_a = np.ones((1, 1, 4), np.float32); lse_a = np.zeros((1, 1), np.float32)
    >>> out_b = np.zeros((1, 1, 4), np.float32); lse_b = np.zeros((1, 1), np.float32)
    >>> out, lse = kvzoo.merge_attention_states(out_a, lse_a, out_b, lse_b)
    >>> out[0, 0].tolist(), round(float(lse[0, 0]), 6)    # equal weights; log(e^0 + e^0) = log 2
    ([0.5, 0.5, 0.5, 0.5], 0.693147)
    >>> empty = np.full((1, 1), -np.inf, np.float32)        # a part with no keys for the row
    >>> out, lse = kvzoo.merge_attention_states(out_a, lse_a, np.full_like(out_b, np.nan), empty)
    >>> out[0, 0].tolist(), float(lse[0, 0])               # the empty part's out is ignored
    ([1.0, 1.0, 1.0, 1.0], 0.0)
"""

from __future__ import annotations

import numpy as np

from . import memory
from .arrays import Array, dtype_name, is_torch, same_kind_empty, torch
from .validate import (
    FLOAT_INPUTS,
    fail,
    require_array,
    require_dtype,
    require_same_device,
    require_shape,
    require_writable,
)

__all__ = ["merge_attention_states"]


def merge_attention_states(
    out_a: Array,
    lse_a: Array,
    out_b: Array,
    lse_b: Array,
    out: Array | None = None,
    lse_out: Array | None = None,
) -> tuple[Array, Array]:
    """Attention over the union of two disjoint key sets, from each set's (out, lse).

    out_a, out_b: [num_tokens, num_heads, head_size] (any leading shape [..., head_size]),
        bfloat16 / float16 / float32, one dtype; lse_a, lse_b: float32 out_a.shape[:-1], natural
        log (as paged_attention's return_lse gives). All four torch tensors on one device (CPU
        or CUDA) or all NumPy arrays.
    out: None (allocated) or a writable array of out_a's shape and dtype; lse_out likewise,
        float32 of lse_a's shape. Either may be one of the inputs (the merge is computed before
        anything is written), but not overlap the other.
    Returns (out, lse_out). Computed in float32, with the larger lse subtracted first so no
    exponential overflows; out rounds once to its dtype.

    Rows: an lse of -inf is a part with no keys (and no sink) for that row: it contributes
    nothing and its out is not read (it may hold NaN, or garbage from an empty allocation);
    both -inf gives out 0 and lse -inf. A NaN lse on either side gives NaN out and lse; a NaN
    in the out of a part with a finite lse gives NaN in that element. An lse of +inf (no
    attention gives one) is invalid and gives NaN. Reads no device value (no synchronisation;
    CUDA-graph safe).
    """
    for name, x in (("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        require_array(name, x)
    torch_inputs = {is_torch(x) for x in (out_a, lse_a, out_b, lse_b)}
    if len(torch_inputs) != 1:
        fail("out_a, lse_a, out_b, lse_b: pass all four as torch tensors or all four as NumPy arrays")
    if len(out_a.shape) < 1:
        fail(f"out_a: expected [..., head_size], got shape {tuple(out_a.shape)}")
    require_dtype("out_a", out_a, FLOAT_INPUTS)
    require_shape("out_b", out_b, tuple(out_a.shape), "(same as out_a)")
    require_dtype("out_b", out_b, (dtype_name(out_a),))
    rows = tuple(out_a.shape[:-1])
    for name, x in (("lse_a", lse_a), ("lse_b", lse_b)):
        require_shape(name, x, rows, "(out_a's shape without head_size)")
        require_dtype(name, x, ("float32",))
    if out is None:
        out = same_kind_empty(out_a, tuple(out_a.shape), dtype_name(out_a))
    else:
        _require_output("out", out, out_a, dtype_name(out_a))
    if lse_out is None:
        lse_out = same_kind_empty(lse_a, rows, "float32")
    else:
        _require_output("lse_out", lse_out, lse_a, "float32")
    require_same_device(
        {"out_a": out_a, "lse_a": lse_a, "out_b": out_b, "lse_b": lse_b, "out": out, "lse_out": lse_out}
    )
    if memory.overlap(out, lse_out):
        fail("lse_out: shares memory with out; pass separate (non-overlapping) arrays")
    if is_torch(out_a):
        _merge_torch(out_a, lse_a, out_b, lse_b, out, lse_out)
    else:
        _merge_numpy(out_a, lse_a, out_b, lse_b, out, lse_out)
    return out, lse_out


def _require_output(name: str, x: Array, like: Array, dtype: str) -> None:
    require_array(name, x)
    if is_torch(x) != is_torch(like):
        fail(f"{name}: expected a {'torch tensor' if is_torch(like) else 'NumPy array'} like the inputs")
    require_shape(name, x, tuple(like.shape), f"(same as {'out_a' if name == 'out' else 'lse_a'})")
    require_dtype(name, x, (dtype,))
    require_writable(name, x)
    if memory.self_overlap(x):
        fail(
            f"{name}: elements overlap one another (a stride-0 or overlapping view, shape {tuple(x.shape)}); "
            "a written array needs one address per element"
        )


def _merge_torch(out_a, lse_a, out_b, lse_b, out, lse_out) -> None:
    neg_inf = float("-inf")
    la, lb = lse_a.float(), lse_b.float()
    m = torch.maximum(la, lb)  # NaN on either side stays NaN
    # Both sides empty: subtract 0, so exp gives 0 and 0 rather than exp(-inf + inf) = NaN.
    m = torch.where(m == neg_inf, 0.0, m)
    wa, wb = torch.exp(la - m), torch.exp(lb - m)
    total = wa + wb
    lse = m + torch.log(total)
    inv = 1.0 / torch.where(total == 0.0, 1.0, total)
    # An empty side's out is never read: 0 * NaN would poison the row.
    ta = torch.where((la == neg_inf)[..., None], 0.0, out_a.float() * (wa * inv)[..., None])
    tb = torch.where((lb == neg_inf)[..., None], 0.0, out_b.float() * (wb * inv)[..., None])
    merged = ta + tb
    out.copy_(merged)
    lse_out.copy_(lse)


def _merge_numpy(out_a, lse_a, out_b, lse_b, out, lse_out) -> None:
    neg_inf = np.float32(-np.inf)
    la, lb = np.asarray(lse_a, np.float32), np.asarray(lse_b, np.float32)
    with np.errstate(all="ignore"):
        m = np.maximum(la, lb)
        m = np.where(m == neg_inf, np.float32(0), m)
        wa, wb = np.exp(la - m), np.exp(lb - m)
        total = wa + wb
        lse = m + np.log(total)
        inv = np.float32(1) / np.where(total == 0, np.float32(1), total)
        ta = np.where((la == neg_inf)[..., None], np.float32(0), out_a.astype(np.float32) * (wa * inv)[..., None])
        tb = np.where((lb == neg_inf)[..., None], np.float32(0), out_b.astype(np.float32) * (wb * inv)[..., None])
        merged = ta + tb
    np.copyto(out, merged.astype(out.dtype))
    np.copyto(lse_out, lse.astype(np.float32))
