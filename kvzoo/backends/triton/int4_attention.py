"""Paged attention over int4 per-token-head caches (SPEC.md section 8.4), in Triton.

Another memory path, so another kernel beside attention_kernels.py's: a key row is D / 2 bytes
of nibbles and one scale word (scale and zero point), and the rotated mode works in the rotated
basis. A program takes a tile of query rows against the paged K/V of one KV head, as
_attention_kernel does (decode: one token's G query heads, split over the context for long
sequences; direct prefill: BLOCK_Q tokens x the group), with the shared pieces of
attention_tiles.py (rows, key range, masks, online softmax, stores) and its own key tile:

1. once per program, the query rows are scaled by a power of two into fp16's range, rotated
   (q' = R q, the butterfly in float32, times B_max / B for a head that is no power of two;
   `_norot`: q' = q) and rounded to fp16, and split into their even and odd elements, which
   meet the low and the high nibbles of each key byte;
2. per key tile, the bytes are turned into two fp16 tiles in registers, CODE_OFFSET + code
   (an OR with an fp16 exponent: no integer-to-float conversion), and the logits are
   q'_even . lo + q'_odd . hi less sum(q') * (CODE_OFFSET + zp) per key, times the key's scale;
3. P . V likewise, the probabilities scaled by the value's scale before the two dots, and
   sum_k p_k (CODE_OFFSET + zp_k) kept per row and taken off once after the last tile;
4. the output is un-rotated (s * fwht(o') / B, float32) before it is normalised and stored,
   or before a split's partial is stored (the merge, attention_kernels._merge_splits_kernel,
   is linear in the partials).

Prefill with long query runs stages the context instead (int4_staging.py).

A split mode's keys (int8 or fp8 codes a byte, a float32 scale; values int4) are this kernel's
too: KEY_CODE says which loader the key tile takes, and the byte rows meet q'_even and q'_odd as
the nibbles do, so a pairing is a constexpr, not another kernel. The query is rotated only where
the keys are, the output un-rotated only where the values are (SPEC.md section 2). Their prefills
stay on this kernel (staging.stageable: the gathers stage one family's rows).

Tolerance (ATTENTION_RTOL): the dots take fp16 operands with fp32 accumulation. The codes are
exact in fp16; what rounds is q' (fp16, 2^-11 relative per element, against 2^-12 for an fp32
query in the int8 kernel: q' is computed, so bf16 and fp16 queries round too), P (2^-11 per
probability, as for int8) and the offset's cancellation (the dots carry 64 + c, about 20 times
the centred code c - zp: some 4 bits of the fp32 accumulation); the rotations of q' and of the
output in float32 add ~1e-7. That is the int8 kernel's budget with q' rounded twice as coarsely,
so the same 5e-3 before the output's own rounding: measured up to 6e-4 on float32 outputs under
the interpreter (tests/test_triton_int4.py), where the GPU's accumulation order differs; the GPU
error is bench/gpu_bench.py's to report.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...modes import SCALE_FLOOR
from ...problem import Attention
from . import int4_staging, staging
from . import platform as _platform
from .attention_constants import QUERY_CODE, QUERY_NAN_CODE, QUERY_QMAX, SCALE_TOKEN_HEAD

# The split rule's bounds, the merge, the launch records and their runners are the paged
# kernel's own: one definition each.
from .attention_kernels import (
    _DEFAULT_OPTIONS,
    AttentionConfig,
    KernelCall,
    StagedConfig,
    _pow2,
    bind_launches,
    call_arrays,
    decode_config_of,
    kernel_slots,
    run_launches,
    same_kv_strides,
    sinks_and_lse,
    split_merge,
    staged_prefill_config,
)
from .attention_tables import DecodeTile, PrefillTile, Run, SplitRule
from .attention_tiles import (
    attend,
    load_keys,
    load_rows,
    logit_scale,
    mask_logits,
    online_softmax,
    paged_rows,
    poisoned_sum,
    program_query,
    sequence_ok,
    softcap_logits,
    store_partials,
    store_rows,
    tile_rows,
)
from .encode import (
    SMALLEST_NORMAL,
    bf16_as_bits,
    bits_float,
    decode_codes,
    encode_row_codes,
    load_f32,
    reciprocal,
    row_absmax_bits,
    row_scale,
)
from .formats import CODE_INT8, code_of
from .int4_rotation import deinterleave, flip_signs, fwht, interleave, log2, per_block, top_block
from .int4_tiles import CODE_OFFSET, E4M3FN_CODE, INT8_CODE, UINT4_CODE, query_factors, split_words, unrotate_rows
from .launch import launch_nothing
from .options import TritonAttentionOptions
from .scratch import Scratch, bytes_needed

# How the key tile turns code bytes into dot operands (constexpr CONVERT).
CONVERT_ASM = tl.constexpr(0)  # CUDA: byte permutes, a shift and an OR per two codes
CONVERT_CAST = tl.constexpr(1)  # the same values through integer ops, a cast and an add

# Attention tolerance (the module docstring says where it comes from).
ATTENTION_RTOL = 5e-3
# Smallest K of a tensor-core dot on fp16 operands: the half rows (D / 2 bytes, one nibble
# each) are padded to it with masked loads of zeros.
_MIN_DOT_K = 16


# ----------------------------------------------------------------------------------------
# Codes to dot operands.


@triton.jit
def _nibbles_x4_to_fp16(x, PURE: tl.constexpr):
    # Four code bytes b0..b3 in a register -> (64 + low nibbles, 64 + high nibbles) as two
    # fp16x2 registers each: prmt puts b0 and b1 in the two halves' low bytes, the shift moves
    # each low nibble to bits 4-7, and one lop3 masks the nibble and ORs in the exponent.
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 a, b, c, d;
        prmt.b32 a, $4, $4, 0x1100;
        prmt.b32 b, $4, $4, 0x3322;
        shl.b32 c, a, 4;
        shl.b32 d, b, 4;
        lop3.b32 $0, c, 0x00f000f0, 0x54005400, 0xea;
        lop3.b32 $1, d, 0x00f000f0, 0x54005400, 0xea;
        lop3.b32 $2, a, 0x00f000f0, 0x54005400, 0xea;
        lop3.b32 $3, b, 0x00f000f0, 0x54005400, 0xea;
        }
        """,
        constraints="=r,=r,=r,=r,r",
        args=[x],
        dtype=(tl.float16, tl.float16),
        is_pure=PURE,
        pack=4,
    )


@triton.jit
def nibbles_to_dot(raw, CONVERT: tl.constexpr, PURE: tl.constexpr):
    """Code bytes (uint8) -> (CODE_OFFSET + the low nibbles, CODE_OFFSET + the high nibbles),
    fp16 tiles of raw's shape: the even and the odd elements' codes, exact. PURE=False keeps
    the conversion where the bytes were loaded (attention_tiles.codes_to_dot says why V wants
    that)."""
    if CONVERT == CONVERT_ASM:
        lo, hi = _nibbles_x4_to_fp16(raw, PURE)
    else:
        b = raw.to(tl.int32)
        lo = (b & 0xF).to(tl.float16) + CODE_OFFSET
        hi = (b >> 4).to(tl.float16) + CODE_OFFSET
    return lo, hi


@triton.jit
def bytes_to_dot(raw, CODE: tl.constexpr, INTERPRETED: tl.constexpr):
    """A split mode's key bytes (int8 codes, fp8 bits as uint8) -> their values in fp16, exact:
    e4m3fn through the hardware's convert where compiled (staging._stage_rows' choice), the
    integer decoder under the interpreter, whose fp8 casts are not trusted (encode.py)."""
    if CODE == INT8_CODE:
        x = raw.to(tl.float16)
    elif CODE == E4M3FN_CODE and not INTERPRETED:
        x = raw.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    else:
        x = decode_codes(raw, CODE).to(tl.float16)
    return x


# ----------------------------------------------------------------------------------------
# The query rows and the output rows.


@triton.jit
def rotated_query(
    q_ptrs, q_ok, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_D: tl.constexpr, ROTATE: tl.constexpr
):
    """The tile's query rows as the dots take them: (q'_even, q'_odd) fp16 [BLOCK_M, BLOCK_D / 2],
    sum(q') [BLOCK_M] of those fp16 values, and undo, the factor that takes q' back to R q (for a
    head that is no power of two, to R q with each element times B_max / B)."""
    q = load_f32(q_ptrs, q_ok)
    factor, undo = query_factors(tl.max(tl.abs(q), axis=1), log2(HEAD_D) if ROTATE else 0)
    q = q * factor[:, None]
    if ROTATE:
        q = fwht(flip_signs(q, BLOCK_D), BLOCK_M, BLOCK_D, HEAD_D)
        if (HEAD_D & (HEAD_D - 1)) != 0:
            # (R q) / B (SPEC.md 8.4) with the largest block's 1 / B in undo: the smaller
            # blocks' elements times B_max / B, exact, and no larger than the largest block's.
            q = q * per_block(BLOCK_D, HEAD_D, top_block(HEAD_D))
    q16 = q.to(tl.float16)
    q_even, q_odd = deinterleave(q16, BLOCK_M, BLOCK_D)
    return q_even, q_odd, tl.sum(q16.to(tl.float32), axis=1), undo


@triton.jit
def int8_query(q_ptrs, q_ok, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, SCALE_FLOOR: tl.constexpr):
    """quantize_query's rows (SPEC.md 8.1, int8 keys only): rotated_query's values for the int8
    codes of each row, which its scale undoes. Codes are exact in fp16 and their products
    with int8 keys sum exactly in fp32 (under 2^24 for D <= 512), as the paged kernel's int8
    dot does."""
    q = load_f32(q_ptrs, q_ok)
    q_scale, _ = row_scale(row_absmax_bits(q, 1), QUERY_QMAX, SCALE_FLOOR)
    codes = encode_row_codes(q * reciprocal(q_scale)[:, None], QUERY_CODE, QUERY_NAN_CODE, False)
    q_even, q_odd = deinterleave(codes.to(tl.int8).to(tl.float16), BLOCK_M, BLOCK_D)
    return q_even, q_odd, tl.zeros([BLOCK_M], tl.float32), q_scale


# ----------------------------------------------------------------------------------------
# The key tile and the loop over tiles.


@triton.jit
def _int4_tile(
    start,
    kv_end,
    bt_row,
    m_i,
    l_i,
    acc_e,
    acc_o,
    v_off,
    MASKED: tl.constexpr,
    q_e,
    q_o,
    q_sum,
    row_scale,
    pos,
    window,
    softcap,
    kv_head,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    k_strides,
    v_strides,
    ks_strides,
    vs_strides,
    BLOCK_N: tl.constexpr,
    HEAD_D: tl.constexpr,
    HALF: tl.constexpr,
    PAGE: tl.constexpr,
    KEY_CODE: tl.constexpr,
    CONVERT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SAME_KV_STRIDES: tl.constexpr,
    INTERPRETED: tl.constexpr,
    QK_INT8: tl.constexpr,
):
    """Keys [start, start + BLOCK_N) below kv_end: the online softmax's (m, l) and the two
    accumulators of P . (CODE_OFFSET + codes) (even and odd elements) after them, and v_off, the
    sum of p * scale * (CODE_OFFSET + zp) they carry per row, counted as they are. The values
    are int4 rows; the keys are in KEY_CODE's format: int4's, or a split mode's byte codes."""
    j = tl.arange(0, HALF)
    keys = start + tl.arange(0, BLOCK_N)
    key_ok = keys < kv_end
    page = load_keys(bt_row + keys // PAGE, key_ok, MASKED).to(tl.int64)
    in_page = keys % PAGE
    k_row = paged_rows(page, in_page, kv_head, k_strides[0], k_strides[1], k_strides[2], 1)
    if KEY_CODE == UINT4_CODE:
        kc = load_rows(k_ptr + k_row[:, None] + j[None, :] * k_strides[3], key_ok, j, MASKED, HEAD_D // 2, HALF)
        k_words = load_keys(
            ks_ptr + page * ks_strides[0] + in_page * ks_strides[1] + kv_head * ks_strides[2], key_ok, MASKED
        )
        k_scale, k_zp = split_words(k_words)
        k_lo, k_hi = nibbles_to_dot(kc, CONVERT, True)
        s = tl.dot(q_e, tl.trans(k_lo))
        s = tl.dot(q_o, tl.trans(k_hi), s)
        # The row's undo and the key's scale meet first, as in attention_tiles.logits_key_scales.
        s = (s - q_sum[:, None] * k_zp[None, :]) * (row_scale[:, None] * k_scale[None, :])
    else:
        # A code a byte and a float32 scale (SPEC.md 3): the row's even and odd elements meet
        # q'_even and q'_odd as an int4 key's low and high nibbles do, with no zero point.
        d = tl.arange(0, 2 * HALF)
        kc = load_rows(k_ptr + k_row[:, None] + d[None, :] * k_strides[3], key_ok, d, MASKED, HEAD_D, 2 * HALF)
        k_even, k_odd = deinterleave(bytes_to_dot(kc, KEY_CODE, INTERPRETED), BLOCK_N, 2 * HALF)
        k_scale = bits_float(
            load_keys(ks_ptr + page * ks_strides[0] + in_page * ks_strides[1] + kv_head * ks_strides[2], key_ok, MASKED)
        )
        s = tl.dot(q_e, tl.trans(k_even))
        s = tl.dot(q_o, tl.trans(k_odd), s)
        if QK_INT8:
            # An integer s meets the key's scale first (attention_tiles.paged_tile's QK_INT8 says why).
            s = s * k_scale[None, :] * row_scale[:, None]
        else:
            s = s * (row_scale[:, None] * k_scale[None, :])
    if HAS_SOFTCAP:
        s = softcap_logits(s, softcap)
    visible = key_ok
    if MASKED:
        s, visible = mask_logits(s, keys, key_ok, pos, window, HAS_WINDOW)
    m_i, l_i, p, alpha = online_softmax(s, m_i, l_i)

    if SAME_KV_STRIDES:
        v_rows = v_ptr + k_row[:, None] + j[None, :] * k_strides[3]
        v_words = load_keys(
            vs_ptr + page * ks_strides[0] + in_page * ks_strides[1] + kv_head * ks_strides[2], key_ok, MASKED
        )
    else:
        v_row = paged_rows(page, in_page, kv_head, v_strides[0], v_strides[1], v_strides[2], 1)
        v_rows = v_ptr + v_row[:, None] + j[None, :] * v_strides[3]
        v_words = load_keys(
            vs_ptr + page * vs_strides[0] + in_page * vs_strides[1] + kv_head * vs_strides[2], key_ok, MASKED
        )
    vc = load_rows(v_rows, key_ok, j, MASKED, HEAD_D // 2, HALF)
    v_scale, v_zp = split_words(v_words)
    v_lo, v_hi = nibbles_to_dot(vc, CONVERT, False)
    pv = p * v_scale[None, :]
    if MASKED:
        # Hidden keys may hold a NaN scale (a poisoned row): zero them after the product.
        pv = tl.where(visible, pv, 0.0)
    # Each row normalised by its largest weight (floored: attention_tiles.pv_key_scales).
    w = tl.maximum(tl.max(pv, axis=1), SMALLEST_NORMAL)
    pv16 = (pv * (1.0 / w)[:, None]).to(tl.float16)
    acc_e = acc_e * alpha[:, None] + tl.dot(pv16, v_lo) * w[:, None]
    acc_o = acc_o * alpha[:, None] + tl.dot(pv16, v_hi) * w[:, None]
    v_off = v_off * alpha + tl.sum(pv16.to(tl.float32) * v_zp[None, :], axis=1) * w
    return m_i, l_i, acc_e, acc_o, v_off


@triton.jit
def _zero_accs(BLOCK_M: tl.constexpr, HALF: tl.constexpr):
    """_int4_tile's accumulators before the first key: P . (CODE_OFFSET + codes) of the even and
    the odd elements, and v_off, the sum of p * scale * (CODE_OFFSET + zp) they carry per row."""
    return tl.zeros([BLOCK_M, HALF], tl.float32), tl.zeros([BLOCK_M, HALF], tl.float32), tl.zeros([BLOCK_M], tl.float32)


# ----------------------------------------------------------------------------------------
# The kernel.


@triton.jit
def _int4_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    lse_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    qsl_ptr,
    sinks_ptr,
    num_seqs,
    num_tokens,
    num_blocks,
    max_blocks,
    softmax_scale,
    softcap,
    window,
    split_keys,
    num_splits,
    q_strides,
    out_strides,
    lse_strides,
    k_strides,
    v_strides,
    ks_strides,
    vs_strides,
    stride_bt,
    NUM_Q_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    KEY_CODE: tl.constexpr,
    KEY_ROTATE: tl.constexpr,
    VALUE_ROTATE: tl.constexpr,
    CONVERT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    PER_SEQ: tl.constexpr,
    SPLIT: tl.constexpr,
    SKIP_DECODE: tl.constexpr,
    SAME_KV_STRIDES: tl.constexpr,
    LONGEST_FIRST: tl.constexpr,
    INTERPRETED: tl.constexpr,
    HAS_LSE: tl.constexpr,
    QK_INT8: tl.constexpr,
    SCALE_FLOOR: tl.constexpr,
):
    """Attention on an int4 paged cache: decode (PER_SEQ, optionally SPLIT into partials for
    the merge) and direct prefill; attention_kernels._attention_kernel's grid and rows. Keys in
    KEY_CODE's format (_int4_tile), values int4; the query is rotated where the keys are
    (KEY_ROTATE), the output un-rotated where the values are (VALUE_ROTATE): SPEC.md 8.4."""
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq, q_start, q_len, q_block, live = program_query(qsl_ptr, num_seqs, BLOCK_Q, PER_SEQ, SKIP_DECODE, LONGEST_FIRST)
    if not live:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len
    row_ok, head, pos, token, d, d_ok = tile_rows(
        q_block, q_start, q_len, context, kv_head, num_tokens, BLOCK_M, BLOCK_Q, G_PAD, GROUP, BLOCK_D, HEAD_D
    )
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    seq_ok = sequence_ok(bt_row, seq_len, q_len, split, split_keys, max_blocks, num_blocks, PAGE, SPLIT, INTERPRETED)
    q_ptrs = q_ptr + token[:, None] * q_strides[0] + head[:, None] * q_strides[1] + d[None, :] * q_strides[2]
    q_ok = row_ok[:, None] & d_ok[None, :]
    if QK_INT8:
        q_e, q_o, q_sum, undo = int8_query(q_ptrs, q_ok, BLOCK_M, BLOCK_D, SCALE_FLOOR)
    else:
        q_e, q_o, q_sum, undo = rotated_query(q_ptrs, q_ok, BLOCK_M, BLOCK_D, HEAD_D, KEY_ROTATE)
    if KEY_ROTATE:
        undo = undo * (1.0 / top_block(HEAD_D))  # R^-1 = S H / B (SPEC.md 8.4): exact, a power of two
    row_scale = logit_scale(undo, ks_ptr, softmax_scale, SCALE_TOKEN_HEAD, HAS_SOFTCAP)

    m_i, l_i, accs = attend(
        seq,
        q_block,
        q_len,
        seq_len,
        context,
        block_tables_ptr,
        stride_bt,
        window,
        split,
        split_keys,
        sinks_ptr,
        head,
        row_ok,
        _int4_tile,
        (
            q_e,
            q_o,
            q_sum,
            row_scale,
            pos,
            window,
            softcap,
            kv_head,
            k_ptr,
            v_ptr,
            ks_ptr,
            vs_ptr,
            k_strides,
            v_strides,
            ks_strides,
            vs_strides,
            BLOCK_N,
            HEAD_D,
            BLOCK_D // 2,
            PAGE,
            KEY_CODE,
            CONVERT,
            HAS_SOFTCAP,
            HAS_WINDOW,
            SAME_KV_STRIDES,
            INTERPRETED,
            QK_INT8,
        ),
        _zero_accs(BLOCK_M, BLOCK_D // 2),
        BLOCK_Q,
        BLOCK_M,
        BLOCK_N,
        HAS_WINDOW,
        SPLIT,
        HAS_SINKS and not SPLIT,
        INTERPRETED,
        seq_ok,
    )
    # The tile's rows in the rotated basis with the code offsets taken off, unscaled by l.
    acc_e, acc_o, v_off = accs
    acc = interleave(acc_e - v_off[:, None], acc_o - v_off[:, None], BLOCK_M, BLOCK_D)
    l_i = poisoned_sum(l_i, seq_ok)
    # The rotation is linear, so un-rotating acc before the division by l (or before the
    # merge sums the partials) gives the same rows.
    acc = unrotate_rows(acc, BLOCK_M, BLOCK_D, HEAD_D, VALUE_ROTATE)
    if SPLIT:
        at = (part_m_ptr, part_l_ptr, part_acc_ptr, seq, head, split, num_splits)
        store_partials(*at, acc, m_i, l_i, row_ok, NUM_Q_HEADS, BLOCK_D)
    else:
        store_rows(out_ptr, lse_ptr, acc, m_i, l_i, token, head, d, row_ok, d_ok, *out_strides, *lse_strides, HAS_LSE)


# ----------------------------------------------------------------------------------------
# Tiles: fixed rows keyed by the head size's class, like attention_tables.py's (whose
# docstring says what a row is); head 128's decode row is timed, the others are not.


@dataclass(frozen=True)
class Int4Tiles:
    decode: DecodeTile
    prefill: PrefillTile
    # Register cap of the decode tile (ptxas .maxnreg), None leaves it to the compiler.
    decode_maxnreg: int | None = None


_OFFLINE = (
    Run(
        "python bench/probes/int4_offline_facts.py",
        "",
        "the variants without spills on sm_90a and the fewest instructions per key; not timed",
    ),
)
# Decode, heads 64 and 128: int8's 1-warp tile of 32 keys (a 64-key tile on one warp spills;
# on two warps it issues as many instructions per key in a third fewer registers). 256: int8's
# 4-warp tile. Offline, a register cap looked like resident warps bought for free (head 128:
# 255 registers, 8 warps an SM; capped at 168, 12 warps, no more instructions per key tile and
# no spill in the loop), but on the H200 the capped head-128 tile was the slower one (64 x
# 16384: 491 us capped, 459 us not; norot 521 against 450), so head 128 runs uncapped. Head
# 64's cap of 128 (16 warps against 13) is untimed. At 256 a cap spills inside the loop.
# Direct prefill: 32-key tiles (64 spill on sm_90a).
_TIMED_DECODE = (
    Run(
        "python3 bench/probes/attention_probe.py --sections int4",
        "aa45772",
        "32 keys on 1 warp, 5 stages, no register cap: 1.00-1.16x the capped tile; 64-key, 2- and "
        "4-warp tiles slower; 4 or 6 stages (timed capped only) slower or equal",
    ),
)
TILES: dict[int, Int4Tiles] = {
    64: Int4Tiles(DecodeTile(32, 1, 5, _OFFLINE), PrefillTile(128, 32, 8, 2, _OFFLINE), 128),
    128: Int4Tiles(DecodeTile(32, 1, 5, _TIMED_DECODE), PrefillTile(128, 32, 8, 2, _OFFLINE)),
    256: Int4Tiles(DecodeTile(64, 4, 2, _OFFLINE), PrefillTile(64, 16, 8, 2, _OFFLINE)),
}
# The 1-warp decode tiles want as many programs per SM as int8's (attention_tables.SPLIT_RULES).
SPLIT = SplitRule(8, 16, _OFFLINE)


def _tiles(p: Attention) -> Int4Tiles:
    return TILES[max(64, _pow2(p.head_size))]


def decode_config(p: Attention, invariant: bool, platform: str = "cuda") -> AttentionConfig:
    """attention_kernels.decode_config for int4 caches, from TILES and SPLIT."""
    tiles = _tiles(p)
    # The caps were read off CUDA's compiler; ROCm's registers are another file.
    maxnreg = tiles.decode_maxnreg if platform == "cuda" else None
    # Tiles of the group's real rows on CUDA (Triton pads the dot); ROCm's FMA fallback below
    # 16 rows is avoided as attention_kernels.decode_config does.
    min_rows = 1 if platform == "cuda" else 16
    return decode_config_of(p, invariant, platform, tiles.decode, SPLIT, min_rows=min_rows, maxnreg=maxnreg)


def prefill_config(p: Attention) -> AttentionConfig:
    """The direct prefill kernel's tiles over the int4 cache."""
    tile = _tiles(p).prefill
    block_q = max(1, tile.rows // _pow2(p.num_q_heads // p.num_kv_heads))
    return AttentionConfig(block_q, tile.block_n, tile.num_warps, tile.num_stages, 0)


# ----------------------------------------------------------------------------------------
# Launch.


def _convert(platform: str) -> int:
    return CONVERT_ASM if platform == "cuda" and not _platform.interpreted() else CONVERT_CAST


def block_d(head_size: int) -> int:
    """The tile's row width: the head size, or 2 * _MIN_DOT_K for the halves' dots."""
    return max(2 * _MIN_DOT_K, _pow2(head_size))


def kernel_call(
    p: Attention,
    platform: str,
    cfg: AttentionConfig,
    *,
    per_seq: bool,
    skip_decode: bool,
    scratch: Scratch | None = None,
) -> KernelCall:
    """_int4_attention_kernel's launch of `p` under `cfg` (attention_kernels.kernel_call's
    grid: one program per decode token, or per query block; a split's partials from scratch)."""
    group = p.num_q_heads // p.num_kv_heads
    g_pad = _pow2(group)
    width = block_d(p.head_size)
    num_seqs = p.num_seqs
    split = per_seq and cfg.split_keys > 0
    grid0 = num_seqs if per_seq else p.query.shape[0] // cfg.block_q + num_seqs
    key_code = code_of(p.mode.key_side)
    k = p.key_cache.view(torch.int8 if key_code == CODE_INT8 else torch.uint8)
    v = p.value_cache.view(torch.uint8)
    ks, vs = p.k_scale_cache.view(torch.int32), p.v_scale_cache.view(torch.int32)
    sinks, lse, lse_strides = sinks_and_lse(p)
    num_splits, (part_m, part_l, part_acc), merge = split_merge(p, cfg, split, width, scratch)
    args = (
        bf16_as_bits(p.query),
        k,
        v,
        ks,
        vs,
        p.out,
        part_m,
        part_l,
        part_acc,
        lse,
        p.block_tables,
        p.seq_lens,
        p.query_start_loc,
        sinks,
        num_seqs,
        p.query.shape[0],
        p.key_cache.shape[0],
        p.block_tables.shape[1],
        float(p.softmax_scale),
        float(p.softcap or 1.0),
        int(p.sliding_window or 0),
        max(cfg.split_keys, 1),
        num_splits,
        p.query.stride(),
        p.out.stride(),
        lse_strides,
        k.stride(),
        v.stride(),
        ks.stride(),
        vs.stride(),
        p.block_tables.stride(0),
    )
    constexprs = dict(
        NUM_Q_HEADS=p.num_q_heads,
        GROUP=group,
        G_PAD=g_pad,
        BLOCK_Q=cfg.block_q,
        BLOCK_M=max(cfg.min_rows, cfg.block_q * g_pad),
        BLOCK_N=cfg.block_n,
        HEAD_D=p.head_size,
        BLOCK_D=width,
        PAGE=p.block_size,
        KEY_CODE=key_code,
        KEY_ROTATE=p.mode.key_side.rotation is not None,
        VALUE_ROTATE=p.mode.value_side.rotation is not None,
        CONVERT=_convert(platform),
        HAS_SOFTCAP=p.softcap is not None,
        HAS_WINDOW=p.sliding_window is not None,
        HAS_SINKS=p.sinks is not None,
        PER_SEQ=per_seq,
        SPLIT=split,
        SKIP_DECODE=skip_decode,
        SAME_KV_STRIDES=same_kv_strides(p),
        LONGEST_FIRST=cfg.longest_first and not per_seq,
        INTERPRETED=_platform.interpreted(),
        HAS_LSE=p.lse is not None and not split,
        QK_INT8=p.quantize_query,
        SCALE_FLOOR=float(SCALE_FLOOR),
    )
    slots, merge_slots = kernel_slots(
        _int4_attention_kernel, split, True, False, p.sinks is not None, p.lse is not None
    )
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    if cfg.maxnreg is not None and not _platform.interpreted():
        options["maxnreg"] = cfg.maxnreg
    grid = (grid0, p.num_kv_heads, num_splits)
    return KernelCall(_int4_attention_kernel, grid, args, constexprs, options, merge, slots, merge_slots)


def _launches(
    p: Attention, platform: str, options: TritonAttentionOptions
) -> tuple[list[tuple[AttentionConfig, bool, bool]], StagedConfig | None]:
    """The paged kernel's launches of `p` as (config, per_seq, skip_decode), and the staged
    prefill's config when its prefills go through the workspace (int4_staging.py), else None:
    attention_kernels._launches' choices."""
    if p.max_query_len <= 1:
        return [(decode_config(p, p.batch_invariant, platform), True, False)], None
    if p.batch_invariant:
        # Which launch a sequence takes depends on its own q_len only (attention_kernels).
        return [(decode_config(p, True, platform), True, False), (prefill_config(p), False, True)], None
    if options.prefill == "auto" and staging.worth_staging(p, options.stage_max_bytes):
        staged = staged_prefill_config(p)
        if p.num_prefills is None or p.num_prefills < p.num_seqs:
            return [(decode_config(p, False, platform), True, False)], staged
        return [], staged
    return [(prefill_config(p), False, False)], None


def run(p: Attention, platform: str = "cuda", options: TritonAttentionOptions = _DEFAULT_OPTIONS) -> None:
    """Attention for an int4 problem `p`."""
    if p.num_seqs == 0 or p.query.shape[0] == 0:
        return
    launches, staged_cfg = _launches(p, platform, options)
    arrays = call_arrays(p, launches, staged_cfg, block_d(p.head_size), True)
    run_launches(p, platform, options, launches, staged_cfg, arrays, kernel_call, int4_staging.staged_problem)


def workspace_bytes(p: Attention, platform: str = "cuda", options: TritonAttentionOptions = _DEFAULT_OPTIONS) -> int:
    """attention_kernels.workspace_bytes for an int4 problem `p`."""
    if p.num_seqs == 0 or p.query.shape[0] == 0:
        return 0
    launches, staged_cfg = _launches(p, platform, options)
    return bytes_needed(call_arrays(p, launches, staged_cfg, block_d(p.head_size), True))


def prepare(p: Attention, platform: str = "cuda", options: TritonAttentionOptions = _DEFAULT_OPTIONS):
    """attention_kernels.prepare for an int4 problem: its launches bound once (launch.py); None
    where `p` takes the staged prefill (its workspace is sized and filled per call)."""
    if p.num_seqs == 0 or p.query.shape[0] == 0:
        return launch_nothing
    return bind_launches(p, platform, options.workspace, *_launches(p, platform, options), kernel_call)
