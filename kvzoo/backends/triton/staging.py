"""Prefill on a quantized cache through a workspace of fp16 operands ("staged" prefill).

A prefill query tile reads every key before it, so the direct kernel converts each key's codes
once per query tile, in the warps that issue the tensor-core dots, which makes its key tile
about half again as long as bf16's. Staging converts each key once. One
gather pass writes, for every sequence with more than one query token, the fp16 operands the
direct kernel builds per tile (SCALE_IN_CODES): codes x (scale / the page's largest scale),
with that largest scale kept per page. The workspace is itself a per-token-head cache whose
scale is constant over each page of STAGE_PAGE keys, so the staged attention kernel
(attention_kernels._staged_attention_kernel) streams it like a bf16 cache and applies one
scale per key tile.

The numbers are the direct kernel's: codes and ratios exact or rounded to fp16 the same way,
the query rescaled into fp16 the same way (here by _stage_query_kernel, once per row: a query
the kernel computes itself stays a register operand, reloaded from shared memory on every key
tile, while rows it loads as they are go to wgmma from shared memory). Rounding to bf16
instead would add a logit error that grows with the logit (bf16 keeps 3 fewer bits).
One difference in range: the kernel counts its fp32 accumulator in units of the current page's
V scale (a factor per row when the page changes, not a product per element), so a sequence
whose V page scales span more than about 2^90 (V rows above 1e24 beside rows at the scale
floor) would overflow it.

Decode tokens of the same batch keep the direct kernel on the codes, so the workspace holds
only the prefill sequences' context. Nothing reads device values on the host: the workspace is
sized from host-side bounds (max_seq_len, and num_prefills or else num_seqs), so a staged step
can be captured in a CUDA graph. Configs stage only under STAGE_MAX_BYTES.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ...problem import Attention
from . import platform as _platform
from .encode import SMALLEST_NORMAL, bf16_as_bits, decode_codes, fp16_row_factors, load_f32
from .formats import CODE_E4M3FN, CODE_INT8, code_of
from .scratch import Scratch

# Keys per workspace page, and per scale: a multiple of every staged key tile (128 at most).
STAGE_PAGE = 128
# Rows of a page one gather program converts (of K or of V), and its warps: a quarter page
# per program gives the gather enough programs to fill the GPU on short batches; the
# neighbouring choices time within a few percent (bench/probes/staging_sweep.py).
GATHER_ROWS = 32
GATHER_WARPS = 4
# Sequences the slot kernel places per step of its loop (one step up to this batch size).
SLOT_BLOCK = 1024
# Default largest workspace a call may allocate (TritonAttentionOptions.stage_max_bytes).
STAGE_MAX_BYTES = 1 << 30
# Sequences need at least this many query tokens in one step before the conversion the direct
# kernel repeats per query tile outweighs staging's extra pass over their context: at 64
# query tokens staging loses, from 128 it wins (bench/probes/staging_sweep.py).
STAGE_MIN_QUERY_LEN = 128
# The codes _stage_rows converts in hardware where compiled, as the Triton dtype of their bytes.
_HW_DTYPES = {CODE_INT8: tl.int8, CODE_E4M3FN: tl.float8e4nv}


@triton.jit
def _stage_rows(
    codes_ptr,
    scales_ptr,
    ws_ptr,
    page_scale_ptr,
    strides,
    scale_strides,
    rows,
    page_rows,
    head,
    store_page_scale,
    mask,
    d,
    CODE: tl.constexpr,
    HW_DTYPE: tl.constexpr,
    PER_TOKEN_HEAD: tl.constexpr,
):
    """One tensor's rows: fp16 codes x (scale / page max) to ws_ptr (per-token-head: and the
    page max, by the page's first program), or the codes alone (per-tensor). HW_DTYPE: the
    Triton dtype the code bytes convert from in hardware, or None for the integer decoder.
    strides, scale_strides: the codes' and the scales' stride(); rows, page_rows: (block,
    offset in the block, in_sequence) of its keys and its page's."""
    block, offset, t_ok = rows
    row = block * strides[0] + offset * strides[1] + head * strides[2]
    raw = tl.load(codes_ptr + row[:, None] + d[None, :] * strides[3], mask=mask, other=0)
    if HW_DTYPE is not None:
        # int8 or e4m3 straight to fp16 (one conversion instruction per code, or per pair).
        x = raw.to(HW_DTYPE, bitcast=True).to(tl.float16)
    else:
        x = decode_codes(raw, CODE).to(tl.float16)
    if PER_TOKEN_HEAD:
        page_block, page_offset, page_ok = page_rows
        page_scales = tl.load(
            scales_ptr + page_block * scale_strides[0] + page_offset * scale_strides[1] + head * scale_strides[2],
            mask=page_ok,
            other=0.0,
        )
        # A NaN scale (a poisoned row) must poison its own key only, as in the direct kernel.
        page_max = tl.max(tl.where(page_scales == page_scales, page_scales, 0.0), axis=0)
        # Floored at the smallest normal float32 so that 1 / page_max stays finite: a page of
        # subnormal scales (keys near 1e-37, for query rows near 1e37) keeps ratios below 1.
        page_max = tl.maximum(page_max, SMALLEST_NORMAL)
        scale = tl.load(
            scales_ptr + block * scale_strides[0] + offset * scale_strides[1] + head * scale_strides[2],
            mask=t_ok,
            other=0.0,
        )
        ratio = scale * (1.0 / page_max)
        x = x * ratio.to(tl.float16)[:, None]
        if store_page_scale:
            tl.store(page_scale_ptr, page_max)
    tl.store(ws_ptr, x, mask=mask)


@triton.jit
def cache_blocks(bt_row, pos, seq_len, page, max_blocks, num_blocks):
    """(block, in_sequence) of key positions pos. Where metadata breaks the rules (SPEC.md
    11.1), an entry past the table row or a block id outside the cache stands for block 0, so
    the gather never leaves the cache; such a key is either before the window, where no row
    attends it, or in an ill-formed sequence, whose rows the attention kernel makes NaN."""
    in_sequence = pos < seq_len
    entry_ok = in_sequence & (pos // page < max_blocks)
    block = tl.load(bt_row + pos // page, mask=entry_ok, other=0).to(tl.int64)
    return tl.where((block >= 0) & (block < num_blocks), block, 0), in_sequence


@triton.jit
def page_places(bt_row, stage_page, seq_len, page, max_blocks, num_blocks, STAGE: tl.constexpr):
    """(block, offset in the block, in_sequence) of the STAGE keys of workspace page stage_page:
    every gather program of a page reads the page's scales for its largest (from cache: they
    are 4 bytes a row); only the first stores it."""
    page_pos = stage_page * STAGE + tl.arange(0, STAGE)
    page_block, page_ok = cache_blocks(bt_row, page_pos, seq_len, page, max_blocks, num_blocks)
    return page_block, (page_pos % page).to(tl.int64), page_ok


@triton.jit
def _slot_kernel(qsl_ptr, num_seqs, num_slots, pages_per_slot, seq_of_slot_ptr, first_page_ptr, BLOCK: tl.constexpr):
    """Workspace slots, in batch order, for the sequences with more than one query token.
    Writes each used slot's sequence, the count of used slots (at index num_slots), and every
    sequence's first workspace page (a slot's pages are consecutive)."""
    used = tl.program_id(0) * 0
    start = used
    # while, not range(): see the interpreter note in attention_tiles.attend_range.
    while start < num_seqs:
        seq = start + tl.arange(0, BLOCK)
        ok = seq < num_seqs
        q_len = tl.load(qsl_ptr + seq + 1, mask=ok, other=0) - tl.load(qsl_ptr + seq, mask=ok, other=0)
        prefill = ok & (q_len > 1)
        slot = used + tl.cumsum(prefill.to(tl.int32), axis=0) - 1
        tl.store(seq_of_slot_ptr + slot, seq, mask=prefill & (slot < num_slots))
        # Decodes, and prefills past a num_prefills hint below the truth (validate=False), get
        # a clamped slot: wrong output for the latter, never an access out of bounds.
        tl.store(first_page_ptr + seq, tl.minimum(tl.maximum(slot, 0), num_slots - 1) * pages_per_slot, mask=ok)
        used += tl.sum(prefill.to(tl.int32), axis=0)
        start += BLOCK
    tl.store(seq_of_slot_ptr + num_slots, tl.minimum(used, num_slots))


@triton.jit
def _stage_kernel(
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    seq_of_slot_ptr,
    ws_k_ptr,
    ws_v_ptr,
    k_page_scales_ptr,
    v_page_scales_ptr,
    head_size,
    page,
    pages_per_slot,
    num_blocks,
    max_blocks,
    k_strides,
    v_strides,
    ks_strides,
    vs_strides,
    s_bt,
    s_wt,
    s_wh,
    s_wsp,
    s_wsh,
    CODE: tl.constexpr,
    HW_DTYPE: tl.constexpr,
    PER_TOKEN_HEAD: tl.constexpr,
    STAGE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """ROWS rows of one workspace page of one KV head, of K (even programs) or V (odd)."""
    slot = tl.program_id(0)
    chunk = tl.program_id(1)
    head = (tl.program_id(2) // 2).to(tl.int64)
    is_key = tl.program_id(2) % 2 == 0
    if slot >= tl.load(seq_of_slot_ptr + tl.num_programs(0)):  # a slot no prefill took
        return
    seq = tl.load(seq_of_slot_ptr + slot)
    seq_len = tl.load(seq_lens_ptr + seq)
    if chunk * ROWS >= seq_len:
        return
    stage_page = chunk // (STAGE // ROWS)
    pos = chunk * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK_D)
    bt_row = block_tables_ptr + seq.to(tl.int64) * s_bt
    block, t_ok = cache_blocks(bt_row, pos, seq_len, page, max_blocks, num_blocks)
    mask = t_ok[:, None] & (d < head_size)[None, :]
    rows = (block, (pos % page).to(tl.int64), t_ok)
    page_rows = page_places(bt_row, stage_page, seq_len, page, max_blocks, num_blocks, STAGE)
    ws_page = slot.to(tl.int64) * pages_per_slot + stage_page
    ws = (ws_page * STAGE + pos % STAGE)[:, None] * s_wt + head * s_wh + d[None, :]
    first_of_page = chunk % (STAGE // ROWS) == 0
    # The same rows of K or V: the places they share (tensors only: a tuple kept in a variable
    # would turn constexprs into tensors).
    at = (rows, page_rows, head, first_of_page, mask, d)
    if is_key:
        k_ws, k_page_scale = ws_k_ptr + ws, k_page_scales_ptr + ws_page * s_wsp + head * s_wsh
        _stage_rows(k_ptr, ks_ptr, k_ws, k_page_scale, k_strides, ks_strides, *at, CODE, HW_DTYPE, PER_TOKEN_HEAD)
    else:
        v_ws, v_page_scale = ws_v_ptr + ws, v_page_scales_ptr + ws_page * s_wsp + head * s_wsh
        _stage_rows(v_ptr, vs_ptr, v_ws, v_page_scale, v_strides, vs_strides, *at, CODE, HW_DTYPE, PER_TOKEN_HEAD)


@triton.jit
def _stage_query_kernel(
    q_ptr, ws_ptr, undo_ptr, num_heads, head_size, s_qt, s_qh, s_qd, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr
):
    """One token's query rows, rescaled by powers of two into fp16 (exact for bf16 and fp16
    rows); the attention multiplies each row's logits by the row's undo factor."""
    token = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_ok = h < num_heads
    mask = h_ok[:, None] & (d < head_size)[None, :]
    q = load_f32(q_ptr + token * s_qt + h[:, None] * s_qh + d[None, :] * s_qd, mask)
    factor, undo = fp16_row_factors(tl.max(tl.abs(q), axis=1))
    row = token * num_heads + h
    tl.store(ws_ptr + row[:, None] * head_size + d[None, :], (q * factor[:, None]).to(tl.float16), mask=mask)
    tl.store(undo_ptr + row, undo, mask=h_ok)


def _pages_per_seq(p: Attention) -> int:
    return -(-p.max_seq_len // STAGE_PAGE)


def workspace_shape(p: Attention) -> tuple[int, int, int, int]:
    """[pages, STAGE_PAGE, num_kv_heads, head_size] of K's (and V's) workspace: a slot of
    max_seq_len keys for each possible prefill sequence."""
    slots = max(1, p.num_seqs if p.num_prefills is None else min(p.num_prefills, p.num_seqs))
    return (slots * _pages_per_seq(p), STAGE_PAGE, p.num_kv_heads, p.head_size)


def workspace_bytes(p: Attention) -> int:
    """Bytes a staged run of `p` allocates: fp16 K and V (+ fp32 page scales), and the fp16
    query with an fp32 factor per row."""
    pages, page, heads, dim = workspace_shape(p)
    kv = pages * heads * (page * 2 * 2 * dim + (2 * 4 if p.mode.per_token_head else 0))
    return kv + p.query.shape[0] * p.num_q_heads * (2 * dim + 4)


def stageable(p: Attention) -> bool:
    """Whether staging can take `p` with the direct kernel's semantics."""
    # batch_invariant: a sequence's path would depend on the batch (its bound decides staging).
    # A split mode's sides would stage through two families' gathers: its prefills stay direct.
    return p.mode.code_dtype is not None and not p.quantizes_query and not p.batch_invariant and not p.mode.split


def worth_staging(p: Attention, max_bytes: int = STAGE_MAX_BYTES) -> bool:
    return stageable(p) and p.max_query_len >= STAGE_MIN_QUERY_LEN and workspace_bytes(p) <= max_bytes


class Staged(NamedTuple):
    """A staged run: `problem` is `p` over the workspace, whose query is the fp16 rows of
    _stage_query_kernel; `q_undo` [tokens, num_q_heads] undoes their factors in the logits.
    The rest is what the kernel tells an ill-formed sequence by (SPEC.md 11.1): p's own block
    tables, its cache's blocks and block size, and the keys a workspace slot holds."""

    problem: Attention
    q_undo: torch.Tensor
    cache_tables: torch.Tensor
    cache_blocks: int
    cache_page: int
    workspace_keys: int


def staged_arrays(p: Attention, page_scales: bool) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of the arrays a staged run of `p` takes, in the order it takes them: K's
    and V's workspaces, their page scales (page_scales), each slot's sequence and each
    sequence's first page, the fp16 query and its rows' factors."""
    shape = workspace_shape(p)
    pages, _, heads, dim = shape
    slots = pages // _pages_per_seq(p)
    arrays = [(shape, torch.float16), (shape, torch.float16)]
    if page_scales:
        arrays.append(((2, pages, heads), torch.float32))
    tokens = p.query.shape[0]
    arrays += [
        ((slots + 1,), torch.int32),
        ((p.num_seqs,), torch.int32),
        ((tokens, p.num_q_heads, dim), torch.float16),
        ((tokens, p.num_q_heads), torch.float32),
    ]
    return arrays


def take_staged(p: Attention, page_scales: bool, scratch: Scratch, fill: float | None) -> list[torch.Tensor]:
    """staged_arrays(p, page_scales), taken from scratch; the workspaces filled with `fill`
    (TritonAttentionOptions.workspace_fill), the index arrays (the int32 ones, which the slot
    kernel writes whole) left as they come."""
    return [
        scratch.take(shape, dtype, None if dtype == torch.int32 else fill)
        for shape, dtype in staged_arrays(p, page_scales)
    ]


def staged_problem(p: Attention, fill: float | None = None, scratch: Scratch | None = None) -> Staged:
    """Gathers the prefill sequences' context into a workspace (scratch's; fresh by default),
    and the query into fp16. The problem's block_tables hold one column, each sequence's first
    workspace page: a slot's pages are consecutive, and the staged kernel reads nothing else.
    Decode tokens still read the codes, so callers run them on `p`."""
    shape = workspace_shape(p)
    pages, _, heads, dim = shape
    pages_per_seq = _pages_per_seq(p)
    slots = pages // pages_per_seq
    per_token_head = p.mode.per_token_head
    if scratch is None:
        scratch = Scratch(p.query.device, None, ())
    taken = take_staged(p, per_token_head, scratch, fill)
    ws_k, ws_v = taken[:2]
    page_scales = taken[2] if per_token_head else None
    seq_of_slot, first_page, ws_q, q_undo = taken[-4:]
    # One launch places the prefills: a dozen small torch ops would each be a node of the
    # step's CUDA graph, and cost measurable time. The gather's grid runs over slots, not sequences: decodes
    # beside a few prefills would each launch a sequence's worth of empty programs.
    _slot_kernel[(1,)](
        p.query_start_loc, p.num_seqs, slots, pages_per_seq, seq_of_slot, first_page, BLOCK=SLOT_BLOCK, num_warps=4
    )
    dummy = p.seq_lens
    code = code_of(p.mode)
    # Hardware conversions on CUDA (e4m3fn; int8 anywhere compiled); the interpreter and
    # ROCm's fnuz codes take the integer decoder.
    hw_dtype = None if _platform.interpreted() else _HW_DTYPES.get(code)
    kind = torch.int8 if code == CODE_INT8 else torch.uint8
    k_codes, v_codes = p.key_cache.view(kind), p.value_cache.view(kind)
    k_scales, v_scales = (p.k_scale_cache, p.v_scale_cache) if per_token_head else (dummy, dummy)
    k_pages, v_pages = (page_scales[0], page_scales[1]) if per_token_head else (dummy, dummy)
    no_strides = (0, 0, 0)
    _stage_kernel[(slots, pages_per_seq * (STAGE_PAGE // GATHER_ROWS), heads * 2)](
        k_codes,
        v_codes,
        k_scales,
        v_scales,
        p.block_tables,
        p.seq_lens,
        seq_of_slot,
        ws_k,
        ws_v,
        k_pages,
        v_pages,
        dim,
        p.block_size,
        pages_per_seq,
        p.key_cache.shape[0],
        p.block_tables.shape[1],
        k_codes.stride(),
        v_codes.stride(),
        k_scales.stride() if per_token_head else no_strides,
        v_scales.stride() if per_token_head else no_strides,
        p.block_tables.stride(0),
        ws_k.stride(1),
        ws_k.stride(2),
        *(k_pages.stride() if per_token_head else (0, 0)),
        CODE=code,
        HW_DTYPE=hw_dtype,
        PER_TOKEN_HEAD=per_token_head,
        STAGE=STAGE_PAGE,
        ROWS=GATHER_ROWS,
        BLOCK_D=triton.next_power_of_2(dim),
        num_warps=GATHER_WARPS,
    )
    scales = {}
    if per_token_head:
        # Every key of a page carries the page's scale: a stride-0 view, no copies.
        scales = dict(
            k_scale_cache=page_scales[0][:, None, :].expand(pages, STAGE_PAGE, heads),
            v_scale_cache=page_scales[1][:, None, :].expand(pages, STAGE_PAGE, heads),
        )
    tokens, q_heads = p.query.shape[0], p.num_q_heads
    _stage_query_kernel[(tokens,)](
        bf16_as_bits(p.query),
        ws_q,
        q_undo,
        q_heads,
        dim,
        *p.query.stride(),
        BLOCK_H=triton.next_power_of_2(q_heads),
        BLOCK_D=triton.next_power_of_2(dim),
        num_warps=4,
    )
    staged = p.replace(query=ws_q, key_cache=ws_k, value_cache=ws_v, block_tables=first_page[:, None], **scales)
    return Staged(staged, q_undo, p.block_tables, p.key_cache.shape[0], p.block_size, pages_per_seq * STAGE_PAGE)


__all__ = [
    "STAGE_MAX_BYTES",
    "STAGE_MIN_QUERY_LEN",
    "Staged",
    "stageable",
    "staged_arrays",
    "staged_problem",
    "take_staged",
    "workspace_bytes",
    "workspace_shape",
    "worth_staging",
]
