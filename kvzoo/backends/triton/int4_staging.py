"""Staged prefill on int4 caches: staging.py's workspace of fp16 operands, built from nibbles.

A long prefill converts each key once instead of once per query tile (staging.py's docstring
says why that pays). The workspace is the one int8 and fp8 stage into, streamed by the same
tiles and key loop; what is int4's own is on either side of them:

- the gather decodes each row in the stored (rotated) basis, (code - zp) x (scale / the page's
  largest scale) in fp16, with that largest scale kept per page (staging._stage_rows' rule);
- the query rows are rotated once (q' = R q in float32, as the paged kernel does it; a head that
  is no power of two with each element times B_max / B) and rescaled into fp16, their undo
  factors carrying the largest block's 1 / B_max of R^-1 (SPEC.md 8.4: 1 / D for a power of two);
- the attention is attention_kernels._staged_attention_kernel itself, which un-rotates the
  rows before it stores them where the mode rotates (ROTATE).

Decode tokens of the batch stay on the paged kernel (int4_attention.py), which writes theirs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...problem import Attention
from . import staging
from .attention_kernels import KernelCall, staged_kernel_call
from .encode import SMALLEST_NORMAL, bf16_as_bits, load_f32
from .int4_rotation import flip_signs, fwht, interleave, log2, padded, per_block, top_block, unpack_nibbles
from .int4_tiles import ZP_MASK, query_factors, split_words
from .scratch import Scratch


@triton.jit
def _stage_rows(
    codes_ptr,
    words_ptr,
    ws_ptr,
    page_scale_ptr,
    strides,
    word_strides,
    rows,
    page_rows,
    head,
    store_page_scale,
    ROWS: tl.constexpr,
    D: tl.constexpr,
):
    """One tensor's rows: fp16 (code - zp) x (scale / page max) to ws_ptr [ROWS, D], and the page
    max, by the page's first program (staging._stage_rows' rule, for packed rows; strides,
    rows and page_rows as it takes them, word_strides its scale words')."""
    block, offset, t_ok = rows
    page_block, page_offset, page_ok = page_rows
    page_words = tl.load(
        words_ptr + page_block * word_strides[0] + page_offset * word_strides[1] + head * word_strides[2],
        mask=page_ok,
        other=0,
    )
    page_scales, _ = split_words(page_words)
    # A NaN scale (a poisoned row) must poison its own key only, as in the paged kernel; the
    # floor keeps 1 / page_max finite (staging._stage_rows).
    page_max = tl.max(tl.where(page_scales == page_scales, page_scales, 0.0), axis=0)
    page_max = tl.maximum(page_max, SMALLEST_NORMAL)
    words = tl.load(
        words_ptr + block * word_strides[0] + offset * word_strides[1] + head * word_strides[2], mask=t_ok, other=0
    )
    scale, _ = split_words(words)
    zp = (words & ZP_MASK)[:, None]
    ratio = (scale * (1.0 / page_max)).to(tl.float16)[:, None]
    P: tl.constexpr = padded(D)
    j = tl.arange(0, P // 2)
    row = block * strides[0] + offset * strides[1] + head * strides[2]
    ok = t_ok[:, None]
    if P != D:
        ok = ok & (j[None, :] < D // 2)
    packed = tl.load(codes_ptr + row[:, None] + j[None, :] * strides[3], mask=ok)
    even, odd = unpack_nibbles(packed.to(tl.int32))
    # code - zp is an integer in [-15, 15]: exact in fp16.
    x = interleave((even - zp).to(tl.float16) * ratio, (odd - zp).to(tl.float16) * ratio, ROWS, P)
    ok = t_ok[:, None]
    if P != D:
        ok = ok & (tl.arange(0, P)[None, :] < D)
    tl.store(ws_ptr, x, mask=ok)
    if store_page_scale:
        tl.store(page_scale_ptr, page_max)


@triton.jit
def _int4_stage_kernel(
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
    STAGE: tl.constexpr,
    ROWS: tl.constexpr,
    D: tl.constexpr,
):
    """ROWS rows of one workspace page of one KV head, of K (even programs) or V (odd):
    staging._stage_kernel's grid, slots and page scales."""
    slot = tl.program_id(0)
    chunk = tl.program_id(1)
    head = (tl.program_id(2) // 2).to(tl.int64)
    if slot >= tl.load(seq_of_slot_ptr + tl.num_programs(0)):  # a slot no prefill took
        return
    seq = tl.load(seq_of_slot_ptr + slot)
    seq_len = tl.load(seq_lens_ptr + seq)
    if chunk * ROWS >= seq_len:
        return
    stage_page = chunk // (STAGE // ROWS)
    pos = chunk * ROWS + tl.arange(0, ROWS)
    bt_row = block_tables_ptr + seq.to(tl.int64) * s_bt
    block, t_ok = staging.cache_blocks(bt_row, pos, seq_len, page, max_blocks, num_blocks)
    rows = (block, (pos % page).to(tl.int64), t_ok)
    page_rows = staging.page_places(bt_row, stage_page, seq_len, page, max_blocks, num_blocks, STAGE)
    ws_page = slot.to(tl.int64) * pages_per_slot + stage_page
    d = tl.arange(0, padded(D))
    ws = ((ws_page * STAGE + pos % STAGE) * s_wt + head * s_wh)[:, None] + d[None, :]
    first_of_page = chunk % (STAGE // ROWS) == 0
    # The same rows of K or V: the places they share (staging._stage_kernel).
    at = (rows, page_rows, head, first_of_page)
    if tl.program_id(2) % 2 == 0:
        k_ws, k_page_scale = ws_k_ptr + ws, k_page_scales_ptr + ws_page * s_wsp + head * s_wsh
        _stage_rows(k_ptr, ks_ptr, k_ws, k_page_scale, k_strides, ks_strides, *at, ROWS, D)
    else:
        v_ws, v_page_scale = ws_v_ptr + ws, v_page_scales_ptr + ws_page * s_wsp + head * s_wsh
        _stage_rows(v_ptr, vs_ptr, v_ws, v_page_scale, v_strides, vs_strides, *at, ROWS, D)


@triton.jit
def _int4_stage_query_kernel(
    q_ptr,
    ws_ptr,
    undo_ptr,
    num_heads,
    s_qt,
    s_qh,
    s_qd,
    BLOCK_H: tl.constexpr,
    D: tl.constexpr,
    ROTATE: tl.constexpr,
):
    """One token's query rows as the paged kernel makes them (int4_attention.rotated_query):
    scaled into fp16's range, rotated, rounded to fp16; undo takes them back to R q / B."""
    token = tl.program_id(0).to(tl.int64)
    P: tl.constexpr = padded(D)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, P)
    h_ok = h < num_heads
    ok = h_ok[:, None]
    if P != D:
        ok = ok & (d[None, :] < D)
    q = load_f32(q_ptr + token * s_qt + h[:, None] * s_qh + d[None, :] * s_qd, ok)
    factor, undo = query_factors(tl.max(tl.abs(q), axis=1), log2(D) if ROTATE else 0)
    q = q * factor[:, None]
    if ROTATE:
        q = fwht(flip_signs(q, P), BLOCK_H, P, D)
        if P != D:
            # As int4_attention.rotated_query: the smaller blocks times B_max / B.
            q = q * per_block(P, D, top_block(D))
        undo = undo * (1.0 / top_block(D))
    row = token * num_heads + h
    tl.store(ws_ptr + row[:, None] * D + d[None, :], q.to(tl.float16), mask=ok)
    tl.store(undo_ptr + row, undo, mask=h_ok)


def staged_problem(p: Attention, fill: float | None = None, scratch: Scratch | None = None) -> staging.Staged:
    """staging.staged_problem for an int4 `p`: the problem over a workspace (scratch's; fresh
    by default) of its prefills' context (in the stored basis) and its query rows (rotated),
    with their undo factors. staged_call launches it."""
    shape = staging.workspace_shape(p)
    pages, _, heads, dim = shape
    pages_per_seq = -(-p.max_seq_len // staging.STAGE_PAGE)
    slots = pages // pages_per_seq
    if scratch is None:
        scratch = Scratch(p.query.device, None, ())
    ws_k, ws_v, page_scales, seq_of_slot, first_page, ws_q, q_undo = staging.take_staged(p, True, scratch, fill)
    staging._slot_kernel[(1,)](
        p.query_start_loc,
        p.num_seqs,
        slots,
        pages_per_seq,
        seq_of_slot,
        first_page,
        BLOCK=staging.SLOT_BLOCK,
        num_warps=4,
    )
    k, v = p.key_cache.view(torch.uint8), p.value_cache.view(torch.uint8)
    ks, vs = p.k_scale_cache.view(torch.int32), p.v_scale_cache.view(torch.int32)
    _int4_stage_kernel[(slots, pages_per_seq * (staging.STAGE_PAGE // staging.GATHER_ROWS), heads * 2)](
        k,
        v,
        ks,
        vs,
        p.block_tables,
        p.seq_lens,
        seq_of_slot,
        ws_k,
        ws_v,
        page_scales[0],
        page_scales[1],
        p.block_size,
        pages_per_seq,
        p.key_cache.shape[0],
        p.block_tables.shape[1],
        k.stride(),
        v.stride(),
        ks.stride(),
        vs.stride(),
        p.block_tables.stride(0),
        ws_k.stride(1),
        ws_k.stride(2),
        *page_scales[0].stride(),
        STAGE=staging.STAGE_PAGE,
        ROWS=staging.GATHER_ROWS,
        D=dim,
        num_warps=staging.GATHER_WARPS,
    )
    tokens, q_heads = p.query.shape[0], p.num_q_heads
    rotate = p.mode.rotation is not None
    _int4_stage_query_kernel[(tokens,)](
        bf16_as_bits(p.query),
        ws_q,
        q_undo,
        q_heads,
        *p.query.stride(),
        BLOCK_H=triton.next_power_of_2(q_heads),
        D=dim,
        ROTATE=rotate,
        num_warps=4,
    )
    scales = dict(
        k_scale_cache=page_scales[0][:, None, :].expand(pages, staging.STAGE_PAGE, heads),
        v_scale_cache=page_scales[1][:, None, :].expand(pages, staging.STAGE_PAGE, heads),
    )
    staged = p.replace(
        query=ws_q,
        key_cache=ws_k,
        value_cache=ws_v,
        block_tables=first_page[:, None],
        **scales,
    )
    return staging.Staged(
        staged, q_undo, p.block_tables, p.key_cache.shape[0], p.block_size, pages_per_seq * staging.STAGE_PAGE
    )


def staged_call(staged: staging.Staged, platform: str, cfg) -> KernelCall:
    """The staged kernel's launch (attention_kernels.staged_kernel_call: the kernel un-rotates
    its rows where the mode rotates)."""
    return staged_kernel_call(staged, platform, cfg)
