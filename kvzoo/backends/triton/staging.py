"""Prefill on a quantized cache through a bf16 workspace ("staged" prefill).

A prefill query tile reads every key before it, so the direct kernel converts each key's codes
once per query tile, in the warps that issue the tensor-core dots: 1094 instructions per key
tile against bf16's 696 on the H200 (bench/RESULTS.md). Staging converts each key once. One
gather pass copies the context of every sequence with more than one query token into a bf16
paged workspace, and the attention kernel then streams it like a bf16 cache:

- K keeps its codes, exact in bf16 (int8 and e4m3 both), beside a copy of the K scales; the
  kernel scales the logits, as in decode. Rounding K would add a logit error that grows with
  the logit (the H200 measured 7e-3 against 2e-3 on the benchmark's fp8 data).
- V holds its decoded values, code x scale rounded to the nearest bf16 (2^-9 relative), so
  P . V needs no scaling; that error averages over the keys.

Decode tokens of the same batch keep the direct kernel on the codes, so the workspace holds
only the prefill sequences' context. Nothing reads device values on the host: the workspace is
sized from host-side bounds (max_seq_len, and num_prefills or else num_seqs), so a staged step
can be captured in a CUDA graph. Configs stage only bf16 queries, under STAGE_MAX_BYTES.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ...problem import Attention
from .encode import decode_codes, narrow_to_bf16_bits
from .write_kernels import code_of

# Keys per workspace page: whole prefill key tiles (128) fall in one page.
STAGE_PAGE = 128
# Largest workspace a call may allocate; above it prefill stays direct.
STAGE_MAX_BYTES = 1 << 30
# Sequences need at least this many query tokens in one step before the conversion the direct
# kernel repeats per query tile outweighs staging's extra pass over their context.
STAGE_MIN_QUERY_LEN = 64
# Tokens per gather program.
_GATHER_TOKENS = 32


@triton.jit
def _stage_kernel(
    k_ptr, v_ptr, ks_ptr, vs_ptr, v_scale_ptr, block_tables_ptr, gather_lens_ptr, first_row_ptr,
    ws_k_ptr, ws_v_ptr, ws_ks_ptr,
    head_size, page,
    s_kb, s_kt, s_kh, s_kd, s_vb, s_vt, s_vh, s_vd,
    s_ksb, s_kst, s_ksh, s_vsb, s_vst, s_vsh,
    s_bt, s_wt, s_wh, s_wst, s_wsh,
    CODE: tl.constexpr, PER_TOKEN_HEAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(2).to(tl.int64)
    pos = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    t_ok = pos < tl.load(gather_lens_ptr + seq)
    mask = t_ok[:, None] & (d < head_size)[None, :]
    block = tl.load(block_tables_ptr + seq.to(tl.int64) * s_bt + pos // page, mask=t_ok, other=0).to(tl.int64)
    offset = (pos % page).to(tl.int64)
    row = tl.load(first_row_ptr + seq) + pos.to(tl.int64)
    ws = row[:, None] * s_wt + head * s_wh + d[None, :]

    k_row = block * s_kb + offset * s_kt + head * s_kh
    k = decode_codes(tl.load(k_ptr + k_row[:, None] + d[None, :] * s_kd, mask=mask, other=0), CODE)
    tl.store(ws_k_ptr + ws, narrow_to_bf16_bits(k), mask=mask)  # exact: codes fit bf16

    v_row = block * s_vb + offset * s_vt + head * s_vh
    v = decode_codes(tl.load(v_ptr + v_row[:, None] + d[None, :] * s_vd, mask=mask, other=0), CODE)
    if PER_TOKEN_HEAD:
        ks = tl.load(ks_ptr + block * s_ksb + offset * s_kst + head * s_ksh, mask=t_ok)
        tl.store(ws_ks_ptr + row * s_wst + head * s_wsh, ks, mask=t_ok)
        v = v * tl.load(vs_ptr + block * s_vsb + offset * s_vst + head * s_vsh, mask=t_ok)[:, None]
    else:
        v = v * tl.load(v_scale_ptr)
    tl.store(ws_v_ptr + ws, narrow_to_bf16_bits(v), mask=mask)


def _allocate(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    # One seam for the workspace's memory (tests poison it to see what the gather writes).
    return torch.empty(shape, dtype=dtype, device=device)


def _slots(p: Attention) -> int:
    return max(1, p.num_seqs if p.num_prefills is None else min(p.num_prefills, p.num_seqs))


def _pages_per_seq(p: Attention) -> int:
    return -(-p.max_seq_len // STAGE_PAGE)


def workspace_bytes(p: Attention) -> int:
    """Bytes a staged run of `p` allocates: bf16 K codes and V values (+ fp32 K scales)."""
    rows = _slots(p) * _pages_per_seq(p) * STAGE_PAGE * p.num_kv_heads
    return rows * (2 * 2 * p.head_size + (4 if p.mode.per_token_head else 0))


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
    """Gathers the prefill sequences' context into a fresh workspace; returns `p` over it (K:
    bf16 codes with their scales; V: bf16 values, v scales None). Decode tokens still read the
    codes, so callers run them on `p`."""
    slots, pages_per_seq = _slots(p), _pages_per_seq(p)
    rows = slots * pages_per_seq * STAGE_PAGE
    heads, dim, device = p.num_kv_heads, p.head_size, p.query.device
    # bf16 as int16 bits: the kernel rounds itself (the interpreter's cast truncates).
    ws_k = _allocate((rows, heads, dim), torch.int16, device)
    ws_v = _allocate((rows, heads, dim), torch.int16, device)
    ws_ks = _allocate((rows, heads), torch.float32, device) if p.mode.per_token_head else None
    q_lens = p.query_start_loc[1:] - p.query_start_loc[:-1]
    prefill = q_lens > 1
    slot = torch.cumsum(prefill.to(torch.int32), 0, dtype=torch.int32) - 1
    # A num_prefills hint below the truth (validate=False) leaves the extra sequences
    # ungathered and their table rows clamped: wrong output, never an access out of bounds.
    gathered = prefill & (slot < slots)
    slot = slot.clamp(0, slots - 1)
    gather_lens = torch.where(gathered, p.seq_lens, torch.zeros_like(p.seq_lens))
    first_row = slot.to(torch.int64) * (pages_per_seq * STAGE_PAGE)
    per_token_head = p.mode.per_token_head
    dummy = p.seq_lens
    k_codes = p.key_cache.view(torch.int8 if p.mode.is_int8 else torch.uint8)
    v_codes = p.value_cache.view(k_codes.dtype)
    block_d = triton.next_power_of_2(dim)
    grid = (p.num_seqs, triton.cdiv(p.max_seq_len, _GATHER_TOKENS), heads)
    _stage_kernel[grid](
        k_codes, v_codes,
        p.k_scale_cache if per_token_head else dummy, p.v_scale_cache if per_token_head else dummy,
        dummy if per_token_head else p.v_scale,
        p.block_tables, gather_lens, first_row, ws_k, ws_v, ws_ks if per_token_head else dummy,
        dim, p.block_size,
        *k_codes.stride(), *v_codes.stride(),
        *(p.k_scale_cache.stride() if per_token_head else (0, 0, 0)),
        *(p.v_scale_cache.stride() if per_token_head else (0, 0, 0)),
        p.block_tables.stride(0), ws_k.stride(0), ws_k.stride(1),
        *(ws_ks.stride() if per_token_head else (0, 0)),
        CODE=code_of(p.mode), PER_TOKEN_HEAD=per_token_head, BLOCK_T=_GATHER_TOKENS, BLOCK_D=block_d,
        num_warps=4,
    )
    pages = torch.arange(pages_per_seq, dtype=torch.int32, device=device)
    page_shape = (slots * pages_per_seq, STAGE_PAGE, heads, dim)
    return dataclasses.replace(
        p, key_cache=ws_k.view(torch.bfloat16).view(page_shape), value_cache=ws_v.view(torch.bfloat16).view(page_shape),
        block_tables=slot[:, None] * pages_per_seq + pages[None, :],
        k_scale_cache=None if ws_ks is None else ws_ks.view(page_shape[:3]), v_scale_cache=None, v_scale=None,
    )


__all__ = ["STAGE_MAX_BYTES", "STAGE_MIN_QUERY_LEN", "stageable", "staged_problem", "workspace_bytes", "worth_staging"]
