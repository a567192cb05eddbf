"""Prefill on a quantized cache through a workspace of dequantized K/V ("staged" prefill).

A prefill query tile reads every key before it, so the direct kernel converts each key's codes
once per query tile, in the warps that issue the tensor-core dots: 1094 instructions per key
tile against bf16's 696 on the H200 (bench/RESULTS.md). Staging converts each key once: the
context of every sequence with more than one query token is dequantized (code x scale, rounded
to bf16) into a bf16 paged workspace, and the bf16 kernel attends to it unchanged. Decode
tokens of the same batch keep the direct kernel on the codes, so the workspace holds only the
prefill sequences' context.

Nothing reads device values on the host: the workspace is sized from host-side bounds
(max_seq_len and num_prefills, or num_seqs without it), so a staged step can still be captured
in a CUDA graph. The price is the workspace's memory and the bf16 rounding of K and V (2^-9
relative per element, inside the backend's stated tolerance); configs choose staging only for
bf16 queries (K/V values cannot overflow bf16) and under STAGE_MAX_BYTES.
"""

from __future__ import annotations

import dataclasses

import torch

from ...modes import NONE
from ...problem import Attention
from . import write_kernels

# Keys per workspace page: whole prefill key tiles (128) fall in one page.
STAGE_PAGE = 128
# Largest workspace (K and V together) a call may allocate; above it prefill stays direct.
STAGE_MAX_BYTES = 1 << 30
# Sequences need at least this many query tokens in one step before the conversion the direct
# kernel repeats per query tile outweighs staging's extra pass over their context.
STAGE_MIN_QUERY_LEN = 64


def _workspace_shape(p: Attention) -> tuple[int, int, int, int]:
    pages_per_seq = -(-p.max_seq_len // STAGE_PAGE)
    slots = p.num_seqs if p.num_prefills is None else min(p.num_prefills, p.num_seqs)
    return (max(slots, 1) * pages_per_seq, STAGE_PAGE, p.num_kv_heads, p.head_size)


def workspace_bytes(p: Attention) -> int:
    """K and V workspace bytes a staged run of `p` allocates."""
    pages, page, heads, dim = _workspace_shape(p)
    return 2 * pages * page * heads * dim * 2


def stageable(p: Attention) -> bool:
    """Whether staging can take `p` with the same semantics as the direct kernel."""
    return (
        p.mode.code_dtype is not None
        and p.query.dtype == torch.bfloat16
        and not p.quantize_query
        # A sequence's bits would depend on the batch (its bound decides staging).
        and not p.batch_invariant
    )


def worth_staging(p: Attention) -> bool:
    return stageable(p) and p.max_query_len >= STAGE_MIN_QUERY_LEN and workspace_bytes(p) <= STAGE_MAX_BYTES


def staged_problem(p: Attention) -> Attention:
    """Dequantizes the prefill sequences' context into a fresh workspace and returns the
    mode-"none" problem over it (same query, output and options; decode tokens still read
    the codes, so callers run them on `p`)."""
    shape = _workspace_shape(p)
    pages_per_seq = -(-p.max_seq_len // STAGE_PAGE)
    slots = shape[0] // pages_per_seq
    device = p.query.device
    workspace = torch.empty((2,) + shape, dtype=torch.bfloat16, device=device)
    q_lens = p.query_start_loc[1:] - p.query_start_loc[:-1]
    prefill = q_lens > 1
    slot = torch.cumsum(prefill.to(torch.int32), 0, dtype=torch.int32) - 1
    # A num_prefills hint below the truth (validate=False) leaves the extra sequences
    # ungathered and their table rows clamped: wrong output, never an access out of bounds.
    gathered = prefill & (slot < slots)
    slot = slot.clamp(0, slots - 1)
    gather_lens = torch.where(gathered, p.seq_lens, torch.zeros_like(p.seq_lens))
    tokens_per_seq = pages_per_seq * STAGE_PAGE
    first_row = slot.to(torch.int64) * tokens_per_seq
    pages = torch.arange(pages_per_seq, dtype=torch.int32, device=device)
    block_tables = slot[:, None] * pages_per_seq + pages[None, :]
    scales = ((p.k_scale_cache, p.k_scale), (p.v_scale_cache, p.v_scale))
    for cache, (scale_cache, scale), dst in zip((p.key_cache, p.value_cache), scales, workspace):
        write_kernels.launch_dequantize(
            p.mode, cache, scale_cache, scale, p.block_tables, gather_lens, first_row,
            dst.view(-1, p.num_kv_heads, p.head_size), p.max_seq_len,
        )
    return dataclasses.replace(
        p, mode=NONE, key_cache=workspace[0], value_cache=workspace[1], block_tables=block_tables,
        k_scale_cache=None, v_scale_cache=None, k_scale=None, v_scale=None,
    )


__all__ = ["STAGE_MAX_BYTES", "STAGE_MIN_QUERY_LEN", "stageable", "staged_problem", "workspace_bytes", "worth_staging"]
