"""Unified paged attention in Triton: varlen prefill + decode over the (quantized) paged cache.

A program computes causal attention for a tile of query rows against the paged K/V of one KV
head. A tile's rows are BLOCK_Q consecutive query tokens of one sequence times the G query
heads that share the KV head (padded to a power of two), so each K/V tile is loaded once per
group and prefill runs tensor-core-sized [BLOCK_M, BLOCK_N] dots. Keys are gathered through
block_tables one key at a time, so a key tile may span several pages of any block size.

Per-token-head modes keep the dots on the codes: q . codes is scaled by the key's scale after
the dot, and the probabilities are scaled by the value's scale before P . V. Codes are exact in
fp16 (int8 and e4m3 both), so quantized modes dot in fp16 on any query dtype; the query rows
are rescaled by a power of two into fp16's range first (exact), which keeps bf16 and fp32
queries safe, and the row's undo factor meets the key's scale before the dot's result does, so
rows of any magnitude give finite logits wherever the logits are (SPEC.md section 11). Mode
"none" dots in the cache dtype (fp32 for fp32 caches).

Long contexts with few sequences use split-KV: each program covers `split_keys` keys of one
decode token and writes its partial (max, sum, acc); a second kernel merges the splits in a
fixed order. Nothing here synchronises with the host (grids come from the problem's host-side
max_query_len / max_seq_len), so a decode step can be captured in a CUDA graph, and nothing
uses atomics, so results are identical run to run.

Prefill on a quantized cache with long query runs is staged (staging.py): the codes are
converted once per key into a workspace of fp16 operands, and the query rows into fp16 once per
row. That is another memory path, so another kernel: _staged_attention_kernel, launched only
from what staging.staged_problem returns (the workspace problem and the rows' undo factors
together) under a StagedConfig; _attention_kernel reads the paged cache under an
AttentionConfig and has no staged inputs at all. Both are the same online softmax over key
tiles (attention_tiles.py); the tables that pick their tiles are attention_tables.py.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch
import triton
import triton.language as tl

from ...modes import SCALE_FLOOR
from ...problem import Attention
from . import encode as _encode
from . import platform as _platform
from . import staging as _staging
from .alignment import row_align
from .attention_constants import (
    CONVERT_BF16_BITS,
    CONVERT_CAST,
    CONVERT_E4M3_ASM,
    CONVERT_I8_ASM,
    CONVERT_I8_OFFSET,
    CONVERT_I8_OFFSET_CAST,
    CONVERT_TABLE,
    I8_OFFSET,
    LN2,
    LOG2E,
    QUERY_CODE,
    QUERY_NAN_CODE,
    QUERY_QMAX,
    SCALE_NONE,
    SCALE_TENSOR,
    SCALE_TOKEN_HEAD,
    offset_codes,
)
from .attention_tables import (
    DECODE_TILES,
    ONE_WAVE_DECODE_TILES,
    PREFILL_TILES,
    SPLIT_RULES,
    UNALIGNED_DECODE_TILES,
    CacheCodes,
    DecodeTile,
    KOperand,
    SplitRule,
)
from .attention_tiles import (
    attend,
    fp8_query_operand,
    logit_scale,
    paged_tile,
    poisoned_sum,
    program_query,
    sequence_ok,
    staged_sequence_ok,
    staged_tile,
    store_partials,
    store_rows,
    tile_rows,
    zero_acc,
)
from .formats import CODE_E4M3FN, CODE_INT8, code_of
from .int4_tiles import unrotate_rows
from .launch import BoundLaunch, launch_nothing, relaunch_all
from .options import TritonAttentionOptions
from .scratch import Need, Scratch, bytes_needed

_DEFAULT_OPTIONS = TritonAttentionOptions()

# Smallest K of a tensor-core dot on NVIDIA GPUs (Triton's min_dot_size): 16 for 16-bit
# operands, 32 for 8-bit ones (quantize_query's int8 q . codes, fp8_dots' e4m3 dots; Triton
# refuses to compile a smaller one).
# The head dimension is padded up to it with masked loads of zeros, which add nothing.
_MIN_DOT_K = 16
_MIN_DOT_K_8BIT = 32


# ----------------------------------------------------------------------------------------
# Kernels.


@triton.jit
def _attention_kernel(
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
    table_ptr,
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
    SCALE_MODE: tl.constexpr,
    CODE_CONVERT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    Q_RESCALE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    PER_SEQ: tl.constexpr,
    SPLIT: tl.constexpr,
    SKIP_DECODE: tl.constexpr,
    SCALE_IN_CODES: tl.constexpr,
    QK_INT8: tl.constexpr,
    SAME_KV_STRIDES: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    SCALE_FLOOR: tl.constexpr,
    LONGEST_FIRST: tl.constexpr,
    INTERPRETED: tl.constexpr,
    HAS_LSE: tl.constexpr,
    FP8_DOTS: tl.constexpr,
    FP8_CODE: tl.constexpr,
):
    """Attention on the paged cache: decode (PER_SEQ, optionally SPLIT into partials for the
    merge) and direct prefill. FP8_DOTS: both dots on e4m3 operands (fp8_dots, SPEC.md 8.3),
    e4m3 codes encoded with FP8_CODE. Each *_strides is its array's stride() (zeros for the
    scales and lse a launch has not)."""
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # Decode launch: one program per (sequence, KV head, split); prefill: per query block.
    seq, q_start, q_len, q_block, live = program_query(qsl_ptr, num_seqs, BLOCK_Q, PER_SEQ, SKIP_DECODE, LONGEST_FIRST)
    if not live:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # position of the sequence's first query token
    row_ok, head, pos, token, d, d_ok = tile_rows(
        q_block, q_start, q_len, context, kv_head, num_tokens, BLOCK_M, BLOCK_Q, G_PAD, GROUP, BLOCK_D, HEAD_D
    )
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    seq_ok = sequence_ok(bt_row, seq_len, q_len, split, split_keys, max_blocks, num_blocks, PAGE, SPLIT, INTERPRETED)

    # Strides are indexed where they are used, never unpacked by assignment: that would turn a
    # stride Triton specialised to the constant 1 into a tensor.
    q_rows = q_ptr + token[:, None] * q_strides[0] + head[:, None] * q_strides[1]
    q_ok = row_ok[:, None] & d_ok[None, :]
    row_scale = tl.full([BLOCK_M], 1.0, tl.float32)
    q = _encode.load_f32(q_rows + d[None, :] * q_strides[2], q_ok)
    row_absmax = tl.max(tl.abs(q), axis=1)
    if Q_RESCALE:
        # Exact powers of two: q's fp16 cast keeps every bf16 bit and cannot overflow, and
        # q . codes has the same size whatever the row's (SPEC.md section 11).
        factor, undo = _encode.fp16_row_factors(row_absmax)
        q = q * factor[:, None]
        row_scale = undo
    if QK_INT8:
        # The cache's own int8 row rule (SPEC.md 8.1), so the codes match the reference's.
        q_scale, _ = _encode.row_scale(_encode.row_absmax_bits(q, 1), QUERY_QMAX, SCALE_FLOOR)
        q = _encode.encode_row_codes(q * _encode.reciprocal(q_scale)[:, None], QUERY_CODE, QUERY_NAN_CODE, False).to(
            tl.int8
        )
        row_scale = q_scale
    elif FP8_DOTS:
        q, row_scale = fp8_query_operand(q, FP8_CODE, SCALE_FLOOR)
    else:
        q = q.to(DOT_DTYPE)
    row_scale = logit_scale(row_scale, ks_ptr, softmax_scale, SCALE_MODE, HAS_SOFTCAP)
    if offset_codes(CODE_CONVERT):
        # Offset codes (I8_OFFSET + c) add I8_OFFSET * sum(q) to every logit of a row.
        q_offset = I8_OFFSET * tl.sum(q.to(tl.float32), axis=1)
    else:
        q_offset = tl.zeros([BLOCK_M], tl.float32)  # unused (and a raw sum could overflow)

    # The split path's sink joins in the merge.
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
        paged_tile,
        (
            q,
            row_scale,
            q_offset,
            pos,
            window,
            softcap,
            kv_head,
            k_ptr,
            v_ptr,
            ks_ptr,
            vs_ptr,
            table_ptr,
            k_strides,
            v_strides,
            ks_strides,
            vs_strides,
            BLOCK_N,
            HEAD_D,
            BLOCK_D,
            PAGE,
            SCALE_MODE,
            CODE_CONVERT,
            DOT_DTYPE,
            DOT_PRECISION,
            HAS_SOFTCAP,
            HAS_WINDOW,
            SCALE_IN_CODES,
            QK_INT8,
            SAME_KV_STRIDES,
            ROW_ALIGN,
            FP8_DOTS,
            FP8_CODE,
        ),
        zero_acc(BLOCK_M, BLOCK_D),
        BLOCK_Q,
        BLOCK_M,
        BLOCK_N,
        HAS_WINDOW,
        SPLIT,
        HAS_SINKS and not SPLIT,
        INTERPRETED,
        seq_ok,
    )

    l_i = poisoned_sum(l_i, seq_ok)
    acc = accs[0]
    if SCALE_MODE == SCALE_TENSOR:
        acc = acc * tl.load(vs_ptr)
    if SPLIT:
        # Decode: one token per sequence.
        at = (part_m_ptr, part_l_ptr, part_acc_ptr, seq, head, split, num_splits)
        store_partials(*at, acc, m_i, l_i, row_ok, NUM_Q_HEADS, BLOCK_D)
    else:
        store_rows(out_ptr, lse_ptr, acc, m_i, l_i, token, head, d, row_ok, d_ok, *out_strides, *lse_strides, HAS_LSE)


@triton.jit
def _staged_attention_kernel(
    q_ptr,
    q_undo_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    out_ptr,
    lse_ptr,
    first_page_ptr,
    seq_lens_ptr,
    qsl_ptr,
    sinks_ptr,
    cache_tables_ptr,
    num_seqs,
    num_tokens,
    num_blocks,
    max_blocks,
    workspace_keys,
    softmax_scale,
    softcap,
    window,
    q_strides,
    out_strides,
    lse_strides,
    w_strides,
    ks_strides,
    vs_strides,
    stride_bt,
    stride_cache_bt,
    NUM_Q_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    CACHE_PAGE: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    LONGEST_FIRST: tl.constexpr,
    INTERPRETED: tl.constexpr,
    HAS_LSE: tl.constexpr,
    ROTATE: tl.constexpr,
):
    """Prefill on staging.py's workspace: q the query rows rescaled into fp16 and q_undo their
    factors, K and V (one layout: w_strides) fp16 operands with one scale per page of PAGE keys
    (ks, vs: [pages, KV heads], their strides ks_strides and vs_strides; static scales in
    per-tensor modes), first_page each sequence's first workspace page. Decode tokens have no workspace: the paged kernel takes
    them. The cache's own block tables (pages of CACHE_PAGE keys) tell an ill-formed sequence,
    as the paged kernel tells it; so does one longer than its workspace slot (workspace_keys).
    ROTATE: an int4 rotated mode's workspace (int4_staging.py), whose query and keys are in the
    rotated basis: the rows are taken back to the model's before they are stored."""
    kv_head = tl.program_id(1)
    # A prefill grid that leaves 1-token sequences to the paged kernel.
    seq, q_start, q_len, q_block, live = program_query(qsl_ptr, num_seqs, BLOCK_Q, False, True, LONGEST_FIRST)
    if not live:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # position of the sequence's first query token
    row_ok, head, pos, token, d, d_ok = tile_rows(
        q_block, q_start, q_len, context, kv_head, num_tokens, BLOCK_M, BLOCK_Q, G_PAD, GROUP, BLOCK_D, HEAD_D
    )
    seq_ok = staged_sequence_ok(
        cache_tables_ptr + seq.to(tl.int64) * stride_cache_bt,
        seq_len,
        q_len,
        max_blocks,
        num_blocks,
        workspace_keys,
        CACHE_PAGE,
        INTERPRETED,
    )

    q_ptrs = q_ptr + token[:, None] * q_strides[0] + head[:, None] * q_strides[1] + d[None, :] * q_strides[2]
    q_ok = row_ok[:, None] & d_ok[None, :]
    # staging.py rescaled the rows into fp16 already: q meets the dot as loaded, so wgmma
    # reads it from shared memory (why that matters: staging.py's docstring).
    q = tl.load(q_ptrs, mask=q_ok, other=0.0)
    row_scale = tl.load(q_undo_ptr + token * NUM_Q_HEADS + head, mask=row_ok, other=0.0)
    row_scale = logit_scale(row_scale, ks_ptr, softmax_scale, SCALE_MODE, HAS_SOFTCAP)

    m_i, l_i, accs = attend(
        seq,
        q_block,
        q_len,
        seq_len,
        context,
        first_page_ptr,
        stride_bt,
        window,
        0,
        0,
        sinks_ptr,
        head,
        row_ok,
        staged_tile,
        (
            q,
            row_scale,
            pos,
            window,
            softcap,
            kv_head,
            k_ptr,
            v_ptr,
            ks_ptr,
            vs_ptr,
            w_strides,
            ks_strides,
            vs_strides,
            BLOCK_N,
            HEAD_D,
            BLOCK_D,
            PAGE,
            SCALE_MODE,
            HAS_SOFTCAP,
            HAS_WINDOW,
        ),
        zero_acc(BLOCK_M, BLOCK_D),
        BLOCK_Q,
        BLOCK_M,
        BLOCK_N,
        HAS_WINDOW,
        False,
        HAS_SINKS,
        INTERPRETED,
        seq_ok,
    )

    l_i = poisoned_sum(l_i, seq_ok)
    acc, v_unit = accs
    if SCALE_MODE == SCALE_TENSOR:
        acc = acc * tl.load(vs_ptr)
    acc = unrotate_rows(acc * v_unit, BLOCK_M, BLOCK_D, HEAD_D, ROTATE)
    store_rows(out_ptr, lse_ptr, acc, m_i, l_i, token, head, d, row_ok, d_ok, *out_strides, *lse_strides, HAS_LSE)


@triton.jit
def _merge_splits_kernel(
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    out_ptr,
    qsl_ptr,
    seq_lens_ptr,
    sinks_ptr,
    lse_ptr,
    num_tokens,
    split_keys,
    num_splits,
    out_strides,
    lse_strides,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_LSE: tl.constexpr,
):
    """A split decode's output row (sequence program_id(0), query head program_id(1)): its
    splits' partials (m, l, acc as store_partials writes them) summed in split order, each weighted by
    exp2(m - the largest m), the sink's term joining the sum; lse from the merged (m, l)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(qsl_ptr + seq)
    if tl.load(qsl_ptr + seq + 1) - q_start != 1:
        return
    if (q_start < 0) | (q_start >= num_tokens):  # a row outside the query (SPEC.md 11.1)
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    # Only this sequence's own splits, in order: its bits do not depend on the batch. No more
    # than the launch has, whatever seq_lens says (a length over max_seq_len).
    own = tl.minimum(tl.cdiv(seq_len, split_keys), num_splits)
    base = (seq.to(tl.int64) * NUM_Q_HEADS + head) * num_splits
    m = tl.full([], float("-inf"), tl.float32)
    if HAS_SINKS:
        m = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E
    # while, not range(): see the interpreter note in attention_tiles.attend_range.
    i = own * 0
    while i < own:
        m = tl.maximum(m, tl.load(part_m_ptr + base + i))
        i += 1
    m_use = tl.where(m > float("-inf"), m, 0.0)
    d = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_D], tl.float32)
    total = tl.zeros([], tl.float32)
    if HAS_SINKS:
        total = tl.exp2(tl.load(sinks_ptr + head).to(tl.float32) * LOG2E - m_use)
    i = own * 0
    while i < own:
        w = tl.exp2(tl.load(part_m_ptr + base + i) - m_use)
        total = total + w * tl.load(part_l_ptr + base + i)
        acc = acc + w * tl.load(part_acc_ptr + (base + i) * BLOCK_D + d)
        i += 1
    # A split of an ill-formed sequence left a NaN sum, which poisons total; one with no key
    # at all (seq_len < 1) has no split to.
    total = poisoned_sum(total, seq_len >= 1)
    out = acc / total
    tl.store(
        out_ptr + q_start.to(tl.int64) * out_strides[0] + head * out_strides[1] + d * out_strides[2],
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_D,
    )
    if HAS_LSE:
        # The splits' merged (max, sum), the sink's term included, in log2 units.
        lse_at = q_start.to(tl.int64) * lse_strides[0] + head * lse_strides[1]
        tl.store(lse_ptr + lse_at, (m_use + tl.log2(total)) * LN2)


# ----------------------------------------------------------------------------------------
# Configuration: the tables of attention_tables.py, keyed by the problem's shape class.


@dataclass(frozen=True)
class AttentionConfig:
    """Tiles of _attention_kernel on the paged cache (decode and direct prefill)."""

    block_q: int  # query tokens per tile (rows = block_q * padded group)
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int
    # Keys per split-KV program (a multiple of block_n); 0 = no split. Decode only.
    split_keys: int = 0
    # Fold per-key scales into the fp16 K/V tiles (prefill) instead of scaling logits and
    # probabilities (decode, where a tile has few rows).
    scale_in_codes: bool = False
    # Register cap per thread (ptxas .maxnreg); None leaves it to the compiler.
    maxnreg: int | None = None
    # Fewest tile rows. Triton 3.6 pads a dot of fewer than 16 rows itself on CUDA, and a tile
    # of only the group's real rows (decode: 4 of 16) carries less softmax and rescaling work.
    min_rows: int = 16
    # Prefill only: start the grid's query blocks in reverse order (StagedConfig's note).
    longest_first: bool = False
    # Whether a config is staged prefill's (a StagedConfig): launches and tables tell the two
    # apart by type; this reads the same on either.
    stage_kv: ClassVar[bool] = False


@dataclass(frozen=True)
class StagedConfig:
    """Tiles of _staged_attention_kernel on staging.py's workspace of fp16 operands."""

    block_q: int
    block_n: int  # keys per tile: a divisor of staging.STAGE_PAGE (one page scale per tile)
    num_warps: int
    num_stages: int
    maxnreg: int | None = None
    min_rows: int = 16
    # Start the grid's query blocks in reverse order. Under a causal mask a sequence's later
    # blocks see more keys, and the GPU starts programs in grid order, so the longest run first
    # and the last wave holds short ones.
    longest_first: bool = True
    stage_kv: ClassVar[bool] = True
    # The workspace holds prefills only, which never split.
    split_keys: ClassVar[int] = 0


# Batch-invariant decode always splits at this many keys: a sequence's split points depend
# on its own length only.
INVARIANT_SPLIT_KEYS = 4096
_MIN_SPLIT_KEYS = 1024
_MAX_SPLITS = 64


def _pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _size_class(head_size: int) -> int:
    return max(64, _pow2(head_size))


@functools.cache
def _num_sms(device_index: int | None) -> int:
    if _platform.interpreted():
        return 4
    return torch.cuda.get_device_properties(device_index or 0).multi_processor_count


# Each format's decode rows by what its codes are; attention_tables.py's docstring says what a
# format outside these needs.
_CODES_OF_FORMAT = {("int", 8): CacheCodes.INT8, ("float", 8): CacheCodes.FP8}


def _cache_codes(p: Attention) -> CacheCodes:
    fmt = p.mode.format
    if fmt is None:
        return CacheCodes.MODEL_DTYPE
    codes = _CODES_OF_FORMAT.get((fmt.kind, fmt.bits))
    if codes is None:
        raise NotImplementedError(
            f"{fmt.name}: no attention table rows for {fmt.bits}-bit {fmt.kind} codes "
            "(kvzoo/backends/triton/attention_tables.py)"
        )
    return codes


def _fit_wide_cache(p: Attention, block_n: int, stages: int) -> tuple[int, int]:
    # fp32 caches (mode none) take twice the shared memory of the tables' tiles.
    if p.key_cache.element_size() == 4:
        return min(block_n, 32), 2
    return block_n, stages


def _decode_tile(p: Attention, tile: DecodeTile, platform: str) -> tuple[int, int, int]:
    """(block_n, num_warps, num_stages) of a decode table row for this problem and platform."""
    block_n, stages = _fit_wide_cache(p, tile.block_n, tile.num_stages)
    if platform != "cuda":
        # The 5-stage depth answers CUDA's pipeliner (timed on NVIDIA only); ROCm's own
        # pipeliner is untimed at that depth, so it keeps 2 stages.
        stages = min(stages, 2)
    return block_n, tile.num_warps, stages


def decode_config(p: Attention, invariant: bool, platform: str = "cuda") -> AttentionConfig:
    codes = _cache_codes(p)
    size = _size_class(p.head_size)
    # Quantized tiles of the group's real rows run fewer instructions per key tile
    # (bench/probes/offline_facts.py counts them) in less shared memory; the bf16 tile
    # timed the same either way and keeps 16. On ROCm a dot under 16 rows falls back to FMA
    # (Triton's AMD backend): padded there.
    min_rows = 1 if platform == "cuda" and codes is not CacheCodes.MODEL_DTYPE else 16
    tile, one_wave = DECODE_TILES[size, codes], ONE_WAVE_DECODE_TILES.get((size, codes))
    if row_align(p.key_cache, p.value_cache) * p.key_cache.element_size() < 16:
        tile = UNALIGNED_DECODE_TILES.get((size, codes), tile)
    return decode_config_of(p, invariant, platform, tile, SPLIT_RULES[codes], one_wave, min_rows=min_rows)


def decode_config_of(
    p: Attention,
    invariant: bool,
    platform: str,
    tile: DecodeTile,
    rule: SplitRule,
    one_wave: DecodeTile | None = None,
    *,
    min_rows: int,
    maxnreg: int | None = None,
) -> AttentionConfig:
    """A decode launch's config from a format's table rows (int4_attention.py has its own):
    `tile`, split by `rule` where the grid leaves SMs idle over a long context, or `one_wave`
    where the grid is under one program per SM and the context needs no split."""
    block_n, warps, stages = _decode_tile(p, tile, platform)
    if invariant:
        return AttentionConfig(1, block_n, warps, stages, INVARIANT_SPLIT_KEYS, maxnreg=maxnreg, min_rows=min_rows)
    programs = p.num_seqs * p.num_kv_heads
    dev = p.query.device.index if p.query.device.type == "cuda" else None
    sms = _num_sms(dev)
    split_keys = 0
    if programs < rule.below * sms and p.max_seq_len >= 2 * _MIN_SPLIT_KEYS:
        want = rule.target * sms
        # Rounded down: one program over the target starts a ragged wave.
        splits = min(_MAX_SPLITS, want // max(programs, 1), p.max_seq_len // _MIN_SPLIT_KEYS)
        if splits > 1:
            split_keys = -(-p.max_seq_len // splits)
            split_keys = -(-split_keys // block_n) * block_n
    # Timed on CUDA only: ROCm keeps the table's tile.
    if split_keys == 0 and programs < sms and one_wave is not None and platform == "cuda":
        block_n, warps, stages = _decode_tile(p, one_wave, platform)
    return AttentionConfig(1, block_n, warps, stages, split_keys, maxnreg=maxnreg, min_rows=min_rows)


def staged_prefill_config(p: Attention) -> StagedConfig:
    """The AS_STORED tile (16-bit operands straight from memory), on the staged workspace, its
    query blocks longest first (attention_tables.STAGED_PREFILL: the runs that chose both)."""
    tile = PREFILL_TILES[_size_class(p.head_size), KOperand.AS_STORED]
    g_pad = _pow2(p.num_q_heads // p.num_kv_heads)
    # Page scales are read once per key tile: a tile must not span two pages.
    assert _staging.STAGE_PAGE % tile.block_n == 0, (tile.block_n, _staging.STAGE_PAGE)
    return StagedConfig(max(1, tile.rows // g_pad), tile.block_n, tile.num_warps, tile.num_stages)


def prefill_config(p: Attention, options: TritonAttentionOptions = _DEFAULT_OPTIONS) -> AttentionConfig | StagedConfig:
    staged = options.prefill == "auto" and _staging.worth_staging(p, options.stage_max_bytes)
    return staged_prefill_config(p) if staged else direct_prefill_config(p)


def direct_prefill_config(p: Attention) -> AttentionConfig:
    """Tiles over the cache itself (codes converted in every query tile)."""
    if p.quantize_query:
        k_operand = KOperand.INT8_CODES
    elif p.fp8_dots:
        k_operand = KOperand.FP8_CODES
    else:
        k_operand = KOperand.AS_STORED if p.mode.code_dtype is None else KOperand.CONVERTED
    tile = PREFILL_TILES[_size_class(p.head_size), k_operand]
    block_n, stages = _fit_wide_cache(p, tile.block_n, tile.num_stages)
    g_pad = _pow2(p.num_q_heads // p.num_kv_heads)
    block_q = max(1, tile.rows // g_pad)
    return AttentionConfig(block_q, block_n, tile.num_warps, stages, 0, True)


# ----------------------------------------------------------------------------------------
# Launch.

_TORCH_TO_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@functools.cache
def _code_table(fmt) -> torch.Tensor:
    # Value of every code byte, for the interpreter's table lookup (the format's own table).
    return torch.from_numpy(fmt.code_values().astype("float32"))


class _Operands(NamedTuple):
    """How _attention_kernel reads a problem's cache: the K and V views it is handed, the code
    table (or None), and its DOT_DTYPE, DOT_PRECISION, CODE_CONVERT and Q_RESCALE."""

    k: torch.Tensor
    v: torch.Tensor
    table: torch.Tensor | None
    dot_dtype: Any
    precision: str
    convert: Any
    q_rescale: bool


def _operands(p: Attention, platform: str, cfg: AttentionConfig) -> _Operands:
    interpreted = _platform.interpreted()
    k, v = p.key_cache, p.value_cache
    if p.mode.code_dtype is None:
        same = k.dtype == p.query.dtype and k.dtype != torch.float32
        if interpreted and k.dtype == torch.bfloat16:
            # The interpreter carries bf16 as raw integers in dots, and its cast to fp32 breaks
            # subnormals: fp32 dots on values widened from the bits.
            return _Operands(
                k.view(torch.int16), v.view(torch.int16), None, tl.float32, "ieee", CONVERT_BF16_BITS, False
            )
        if same:
            return _Operands(k, v, None, _TORCH_TO_TL[k.dtype], "tf32", CONVERT_CAST, False)
        return _Operands(k, v, None, tl.float32, "ieee", CONVERT_CAST, False)
    if p.fp8_dots:
        # The codes are the dot operands; q is quantized in-kernel. Compiled kernels load them as
        # e4m3 (a reinterpreting cast after a byte load added shared-memory stores in offline
        # sm_90a SASS, before K's codes were doubled for the query's two terms); the interpreter
        # takes the bytes and reinterprets them (attention_tiles.as_e4m3).
        dtype = torch.uint8 if interpreted else torch.float8_e4m3fn
        return _Operands(k.view(dtype), v.view(dtype), None, tl.float8e4nv, "ieee", CONVERT_CAST, False)
    table = None
    convert = CONVERT_CAST
    code = code_of(p.mode)
    if code == CODE_INT8:
        # Offset codes for decode tiles (few rows: conversion dominates); exact codes where
        # per-key scales are folded into the tiles (the offset would not factor out).
        if platform == "cuda" and not interpreted:
            convert = CONVERT_I8_ASM if cfg.scale_in_codes else CONVERT_I8_OFFSET
        elif not cfg.scale_in_codes:
            convert = CONVERT_I8_OFFSET_CAST
    elif platform == "cuda" and not interpreted and code == CODE_E4M3FN:
        convert = CONVERT_E4M3_ASM
    elif interpreted:
        table = _code_table(p.mode.format)
        k, v = k.view(torch.uint8), v.view(torch.uint8)
        convert = CONVERT_TABLE
    return _Operands(k, v, table, tl.float16, "tf32", convert, not p.quantize_query)


def _scale_mode(p: Attention):
    return SCALE_TOKEN_HEAD if p.mode.per_token_head else SCALE_TENSOR if p.mode.per_tensor else SCALE_NONE


def _optional_arrays(p: Attention) -> tuple:
    """(ks, vs, K scale strides, V scale strides, sinks, lse, lse strides) of a launch: the
    scales where the mode has them (per key, or static), the sinks and lse where given. Each
    absent one is a stand-in (seq_lens) with zero strides, never dereferenced (HAS_SINKS,
    HAS_LSE and SCALE_MODE tell the kernel)."""
    dummy = p.seq_lens
    token_head, per_tensor = p.mode.per_token_head, p.mode.per_tensor
    ks = p.k_scale_cache if token_head else p.k_scale if per_tensor else dummy
    vs = p.v_scale_cache if token_head else p.v_scale if per_tensor else dummy
    kss = p.k_scale_cache.stride() if token_head else (0, 0, 0)
    vss = p.v_scale_cache.stride() if token_head else (0, 0, 0)
    return (ks, vs, kss, vss, *sinks_and_lse(p))


def sinks_and_lse(p: Attention) -> tuple:
    """(sinks, lse, lse strides) of a launch, stand-ins (seq_lens, zero strides) where absent."""
    dummy = p.seq_lens
    sinks = p.sinks if p.sinks is not None else dummy
    lse, lse_strides = (p.lse, p.lse.stride()) if p.lse is not None else (dummy, (0, 0))
    return sinks, lse, lse_strides


def same_kv_strides(p: Attention) -> bool:
    """V's codes and scales are laid out like K's (two caches of one shape, as engines keep them)."""
    same = p.key_cache.stride() == p.value_cache.stride()
    if p.mode.per_token_head:
        same = same and p.k_scale_cache.stride() == p.v_scale_cache.stride()
    return same


@dataclass
class KernelCall:
    """One launch of an attention kernel: what _launch runs, and what bench/probes/offline_facts.py
    compiles for a GPU it does not have."""

    kernel: Any  # _attention_kernel or _staged_attention_kernel
    grid: tuple[int, int, int]
    args: tuple  # the runtime arguments, in the kernel's order
    constexprs: dict
    options: dict  # num_warps, num_stages, maxnreg
    # The split merge's (grid, args, constexprs), run after it; None without a split.
    merge: tuple | None
    # For each of Attention.operand_names(), the positions of args it fills (and of the merge's
    # args): what a bound launch (launch.py) swaps when a call brings its own tensors. Empty
    # for the staged kernel, whose arrays are the workspace's (prepare() binds no staged call).
    slots: tuple = ()
    merge_slots: tuple = ()


def _arg_positions(kernel) -> dict[str, int]:
    # The runtime parameters come first in each kernel's signature, so a parameter's index there
    # is its position in KernelCall.args.
    return {name: i for i, name in enumerate(kernel.arg_names)}


_MERGE_AT = _arg_positions(_merge_splits_kernel)


@functools.cache
def kernel_slots(
    kernel, split: bool, token_head: bool, per_tensor: bool, sinks: bool, lse: bool
) -> tuple[tuple, tuple]:
    """(slots, merge_slots) of a paged launch of `kernel` (_attention_kernel, or int4's, whose
    arguments carry the same names): for each of Attention.operand_names(), then the split's
    partials (m, l, acc, which a relaunch allocates afresh as run() does), the kernel arguments
    it fills. Where an operand is absent its position keeps the stand-in, which the kernel never
    dereferences."""
    at = _arg_positions(kernel)
    fills = {
        "query": ("q_ptr",),
        "key_cache": ("k_ptr",),
        "value_cache": ("v_ptr",),
        "block_tables": ("block_tables_ptr",),
        "seq_lens": ("seq_lens_ptr",),
        "query_start_loc": ("qsl_ptr",),
        # Without a split the partials' pointers are stand-ins too: the output's.
        "out": ("out_ptr",) if split else ("out_ptr", "part_m_ptr", "part_l_ptr", "part_acc_ptr"),
        "k_scale_cache": ("ks_ptr",) if token_head else (),
        "v_scale_cache": ("vs_ptr",) if token_head else (),
        "k_scale": ("ks_ptr",) if per_tensor else (),
        "v_scale": ("vs_ptr",) if per_tensor else (),
        "sinks": ("sinks_ptr",) if sinks else (),
        "lse": ("lse_ptr",) if lse else (),
    }
    partials = ("part_m_ptr", "part_l_ptr", "part_acc_ptr")
    names = tuple(fills[name] for name in Attention.operand_names())
    slots = tuple(tuple(at[a] for a in args) for args in names)
    slots += tuple((at[a],) for a in partials) if split else ((), (), ())
    if not split:
        return slots, ()
    merge_fills = {
        "seq_lens": ("seq_lens_ptr",),
        "query_start_loc": ("qsl_ptr",),
        "out": ("out_ptr",),
        "sinks": ("sinks_ptr",) if sinks else (),
        "lse": ("lse_ptr",) if lse else (),
    }
    merge_slots = tuple(tuple(_MERGE_AT[a] for a in merge_fills.get(name, ())) for name in Attention.operand_names())
    return slots, merge_slots + tuple((_MERGE_AT[a],) for a in partials)


def split_partials(p: Attention, cfg: AttentionConfig, width: int) -> list[Need]:
    """(shape, dtype) of a split decode's partials (max, sum, acc of `width` columns) per
    sequence, query head and split."""
    shape = (p.num_seqs, p.num_q_heads, -(-p.max_seq_len // cfg.split_keys))
    return [(shape, torch.float32), (shape, torch.float32), (shape + (width,), torch.float32)]


def split_merge(
    p: Attention, cfg: AttentionConfig, split: bool, width: int, scratch: Scratch | None
) -> tuple[int, tuple, tuple | None]:
    """(num_splits, the partials (m, l, acc), the merge's (grid, args, constexprs)) of a paged
    launch: a split's partials of `width` columns from scratch (fresh ones by default), merged
    by _merge_splits_kernel; without a split one program per row, the partials' pointers the
    output's (never used) and no merge."""
    if not split:
        return 1, (p.out, p.out, p.out), None
    num_splits = -(-p.max_seq_len // cfg.split_keys)
    sinks, lse, lse_strides = sinks_and_lse(p)
    scratch = scratch or Scratch(p.query.device, None, ())
    partials = tuple(scratch.take(*a) for a in split_partials(p, cfg, width))
    merge = (
        (p.num_seqs, p.num_q_heads),
        (
            *partials,
            p.out,
            p.query_start_loc,
            p.seq_lens,
            sinks,
            lse,
            p.query.shape[0],
            cfg.split_keys,
            num_splits,
            p.out.stride(),
            lse_strides,
        ),
        dict(
            NUM_Q_HEADS=p.num_q_heads,
            HEAD_D=p.head_size,
            BLOCK_D=width,
            HAS_SINKS=p.sinks is not None,
            HAS_LSE=p.lse is not None,
            num_warps=1,
        ),
    )
    return num_splits, partials, merge


def call_arrays(p: Attention, launches: list, staged_cfg: StagedConfig | None, width: int, page_scales: bool):
    """(shape, dtype) of every array a call takes for itself (scratch.py), in the order it
    takes them: each split launch's partials, then the staged prefill's workspace."""
    arrays = []
    for cfg, per_seq, _ in launches:
        if per_seq and cfg.split_keys > 0:
            arrays += split_partials(p, cfg, width)
    if staged_cfg is not None:
        arrays += _staging.staged_arrays(p, page_scales)
    return arrays


def _block_d(p: Attention) -> int:
    return max(_MIN_DOT_K_8BIT if p.quantizes_query else _MIN_DOT_K, _pow2(p.head_size))


def kernel_call(
    p: Attention,
    platform: str,
    cfg: AttentionConfig,
    *,
    per_seq: bool,
    skip_decode: bool,
    scratch: Scratch | None = None,
) -> KernelCall:
    """_attention_kernel's launch of `p` under `cfg`: one program per decode token (per_seq) or
    per query block, skip_decode leaving 1-token sequences to a decode launch. A split takes
    its partials from scratch (fresh ones by default)."""
    if not isinstance(cfg, AttentionConfig):
        # A StagedConfig tiles staging.py's workspace, which only staged_kernel_call takes.
        raise TypeError(
            f"kernel_call: expected an AttentionConfig, got {type(cfg).__name__} "
            "(staged tiles launch through staged_kernel_call(staging.staged_problem(p), ...))"
        )
    ops = _operands(p, platform, cfg)
    group = p.num_q_heads // p.num_kv_heads
    g_pad = _pow2(group)
    block_m = max(cfg.min_rows, cfg.block_q * g_pad)
    block_d = _block_d(p)
    num_seqs = p.num_seqs
    split = per_seq and cfg.split_keys > 0
    grid0 = num_seqs if per_seq else p.query.shape[0] // cfg.block_q + num_seqs
    dummy = p.seq_lens
    ks, vs, kss, vss, sinks, lse, lse_strides = _optional_arrays(p)
    num_splits, (part_m, part_l, part_acc), merge = split_merge(p, cfg, split, block_d, scratch)
    args = (
        _encode.bf16_as_bits(p.query),
        ops.k,
        ops.v,
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
        ops.table if ops.table is not None else dummy,
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
        ops.k.stride(),
        ops.v.stride(),
        kss,
        vss,
        p.block_tables.stride(0),
    )
    constexprs = dict(
        NUM_Q_HEADS=p.num_q_heads,
        GROUP=group,
        G_PAD=g_pad,
        BLOCK_Q=cfg.block_q,
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        HEAD_D=p.head_size,
        BLOCK_D=block_d,
        PAGE=p.block_size,
        SCALE_MODE=_scale_mode(p),
        CODE_CONVERT=ops.convert,
        DOT_DTYPE=ops.dot_dtype,
        DOT_PRECISION=ops.precision,
        Q_RESCALE=ops.q_rescale,
        HAS_SOFTCAP=p.softcap is not None,
        HAS_WINDOW=p.sliding_window is not None,
        HAS_SINKS=p.sinks is not None,
        PER_SEQ=per_seq,
        SPLIT=split,
        SKIP_DECODE=skip_decode,
        SCALE_IN_CODES=cfg.scale_in_codes,
        QK_INT8=p.quantize_query,
        SAME_KV_STRIDES=same_kv_strides(p),
        ROW_ALIGN=row_align(ops.k, ops.v),
        SCALE_FLOOR=float(SCALE_FLOOR),
        LONGEST_FIRST=cfg.longest_first and not per_seq,
        INTERPRETED=_platform.interpreted(),
        # The split path's rows are written by the merge: the split programs store partials only.
        HAS_LSE=p.lse is not None and not split,
        FP8_DOTS=p.fp8_dots,
        FP8_CODE=_encode.encoder_code(CODE_E4M3FN, p.query),
    )
    slots, merge_slots = kernel_slots(
        _attention_kernel, split, p.mode.per_token_head, p.mode.per_tensor, p.sinks is not None, p.lse is not None
    )
    return KernelCall(
        _attention_kernel,
        (grid0, p.num_kv_heads, num_splits),
        args,
        constexprs,
        _options(cfg),
        merge,
        slots,
        merge_slots,
    )


def staged_kernel_call(staged: _staging.Staged, platform: str, cfg: StagedConfig) -> KernelCall:
    """_staged_attention_kernel's launch on what staging.staged_problem(p) returned: the problem
    over the workspace and the factors that undo its fp16 query rows' rescaling, which mean
    nothing apart (a paged problem, or rows without their factors, would give wrong numbers)."""
    if not isinstance(staged, _staging.Staged):
        raise TypeError(
            f"staged_kernel_call: expected staging.Staged (staging.staged_problem(p)), got {type(staged).__name__}"
        )
    if not isinstance(cfg, StagedConfig):
        raise TypeError(f"staged_kernel_call: expected a StagedConfig, got {type(cfg).__name__}")
    p, q_undo = staged.problem, staged.q_undo
    ws = p.key_cache
    # One layout for K's and V's workspaces (staging.workspace_shape), so the kernel takes one.
    assert p.value_cache.stride() == ws.stride(), (ws.stride(), p.value_cache.stride())
    group = p.num_q_heads // p.num_kv_heads
    g_pad = _pow2(group)
    block_d = max(_MIN_DOT_K, _pow2(p.head_size))
    num_seqs = p.num_seqs
    # Page scales [pages, STAGE_PAGE, KV heads] are stride-0 views over the keys of a page.
    ks, vs, kss, vss, sinks, lse, lse_strides = _optional_arrays(p)
    args = (
        p.query,
        q_undo,
        ws,
        p.value_cache,
        ks,
        vs,
        p.out,
        lse,
        p.block_tables,
        p.seq_lens,
        p.query_start_loc,
        sinks,
        staged.cache_tables,
        num_seqs,
        p.query.shape[0],
        staged.cache_blocks,
        staged.cache_tables.shape[1],
        staged.workspace_keys,
        float(p.softmax_scale),
        float(p.softcap or 1.0),
        int(p.sliding_window or 0),
        p.query.stride(),
        p.out.stride(),
        lse_strides,
        ws.stride(),
        (kss[0], kss[2]),
        (vss[0], vss[2]),
        p.block_tables.stride(0),
        staged.cache_tables.stride(0),
    )
    constexprs = dict(
        NUM_Q_HEADS=p.num_q_heads,
        GROUP=group,
        G_PAD=g_pad,
        BLOCK_Q=cfg.block_q,
        BLOCK_M=max(cfg.min_rows, cfg.block_q * g_pad),
        BLOCK_N=cfg.block_n,
        HEAD_D=p.head_size,
        BLOCK_D=block_d,
        PAGE=p.block_size,
        CACHE_PAGE=staged.cache_page,
        SCALE_MODE=_scale_mode(p),
        HAS_SOFTCAP=p.softcap is not None,
        HAS_WINDOW=p.sliding_window is not None,
        HAS_SINKS=p.sinks is not None,
        LONGEST_FIRST=cfg.longest_first,
        INTERPRETED=_platform.interpreted(),
        HAS_LSE=p.lse is not None,
        ROTATE=p.mode.rotation is not None,
    )
    grid = (p.query.shape[0] // cfg.block_q + num_seqs, p.num_kv_heads, 1)
    return KernelCall(_staged_attention_kernel, grid, args, constexprs, _options(cfg), None)


def _options(cfg: AttentionConfig | StagedConfig) -> dict:
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    if cfg.maxnreg is not None and not _platform.interpreted():
        options["maxnreg"] = cfg.maxnreg
    return options


def _launch(call: KernelCall):
    """Runs `call` (and its split merge); returns the compiled attention kernel."""
    kernel = call.kernel[call.grid](*call.args, **call.constexprs, **call.options)
    if call.merge is not None:
        grid, args, constexprs = call.merge
        _merge_splits_kernel[grid](*args, **constexprs)
    return kernel


def _launches(
    p: Attention,
    platform: str,
    decode: AttentionConfig | None,
    prefill: AttentionConfig | StagedConfig | None,
    options: TritonAttentionOptions,
) -> tuple[list[tuple[AttentionConfig, bool, bool]], StagedConfig | None]:
    """The paged kernel's launches of `p` as (config, per_seq, skip_decode), and the staged
    prefill's config when its prefills go through the staging workspace (after those
    launches), else None."""
    if p.max_query_len <= 1:
        return [(decode or decode_config(p, p.batch_invariant, platform), True, False)], None
    cfg = prefill or prefill_config(p, options)
    if isinstance(cfg, StagedConfig) and not _staging.stageable(p):
        raise ValueError(
            f"stage_kv: this problem cannot be staged (mode {p.mode.name}, "
            f"quantize_query={p.quantize_query}, fp8_dots={p.fp8_dots}, batch_invariant={p.batch_invariant})"
        )
    if p.batch_invariant:
        # 1-token sequences: fixed decode tiles and fixed split points; the rest: fixed
        # prefill tiles. Which launch a sequence takes depends on its own q_len only.
        return [(decode or decode_config(p, True, platform), True, False), (cfg, False, True)], None
    if not isinstance(cfg, StagedConfig):
        return [(cfg, False, False)], None
    if p.num_prefills is None or p.num_prefills < p.num_seqs:
        # Decode tokens read the codes directly: staging their context would only add bytes.
        return [(decode or decode_config(p, False, platform), True, False)], cfg
    return [], cfg


def run(
    p: Attention,
    platform: str = "cuda",
    *,
    decode: AttentionConfig | None = None,
    prefill: AttentionConfig | StagedConfig | None = None,
    options: TritonAttentionOptions = _DEFAULT_OPTIONS,
) -> None:
    """Attention for problem `p`. decode / prefill override the table (tests, tuning)."""
    if p.num_seqs == 0 or p.query.shape[0] == 0:
        return
    launches, staged_cfg = _launches(p, platform, decode, prefill, options)
    arrays = call_arrays(p, launches, staged_cfg, _block_d(p), p.mode.per_token_head)
    run_launches(p, platform, options, launches, staged_cfg, arrays, kernel_call, _staging.staged_problem)


def run_launches(
    p: Attention,
    platform: str,
    options: TritonAttentionOptions,
    launches: list,
    staged_cfg: StagedConfig | None,
    arrays: list[Need],
    paged_call: Any,
    staged_problem: Any,
) -> None:
    """Runs a family's paged `launches` (paged_call: its kernel_call) and then, with staged_cfg,
    its staged prefill (staged_problem: its staging.staged_problem), their arrays (call_arrays)
    taken from the options' workspace or torch's allocator."""
    scratch = Scratch(p.query.device, options.workspace, arrays, p)
    for cfg, per_seq, skip_decode in launches:
        _launch(paged_call(p, platform, cfg, per_seq=per_seq, skip_decode=skip_decode, scratch=scratch))
    if staged_cfg is not None:
        staged = staged_problem(p, options.workspace_fill, scratch)
        _launch(staged_kernel_call(staged, platform, staged_cfg))


def workspace_bytes(p: Attention, platform: str = "cuda", options: TritonAttentionOptions = _DEFAULT_OPTIONS) -> int:
    """Bytes of TritonAttentionOptions.workspace a call of `p` takes (0 where it needs none)."""
    if p.num_seqs == 0 or p.query.shape[0] == 0:
        return 0
    launches, staged_cfg = _launches(p, platform, None, None, options)
    return bytes_needed(call_arrays(p, launches, staged_cfg, _block_d(p), p.mode.per_token_head))


def prepare(p: Attention, platform: str = "cuda", options: TritonAttentionOptions = _DEFAULT_OPTIONS):
    """`p`'s launches bound once (launch.py): a function of p.operands() that runs a problem
    equal to `p` but for its arrays, each of the dtype, shape, strides and 16-byte
    alignment of `p`'s. It launches nothing now. None where `p` takes the staged prefill (its
    workspace is sized and filled per call)."""
    if p.num_seqs == 0 or p.query.shape[0] == 0:
        return launch_nothing
    return bind_launches(p, platform, options.workspace, *_launches(p, platform, None, None, options), kernel_call)


def bind_launches(
    p: Attention,
    platform: str,
    workspace: torch.Tensor | None,
    launches: list,
    staged_cfg: StagedConfig | None,
    paged_call: Any,
):
    """prepare()'s launch function for a family's paged `launches` (paged_call: its kernel_call;
    after each, where it splits, the merge): their BoundLaunches, and the split's partials per
    call from torch's allocator, or bound once from the caller's workspace (scratch.py). None
    with a staged prefill (staged_cfg): its workspace is sized and filled per call."""
    if staged_cfg is not None:
        return None
    calls = [paged_call(p, platform, cfg, per_seq=ps, skip_decode=sd) for cfg, ps, sd in launches]
    bound, partials = [], ()
    for call in calls:
        bound.append(BoundLaunch(call.kernel, call.grid, call.args, {**call.constexprs, **call.options}, call.slots))
        if call.merge is not None:
            grid, args, constexprs = call.merge
            bound.append(BoundLaunch(_merge_splits_kernel, (*grid, 1), args, constexprs, call.merge_slots))
            partials = tuple(args[:3])
    if not partials:
        return functools.partial(relaunch_all, tuple(bound))
    if workspace is not None:
        # Checked here, as run() checks it: the caller's buffer holds the partials.
        held = Scratch(p.query.device, workspace, [(tuple(t.shape), t.dtype) for t in partials], p)
        views = tuple(held.take(tuple(t.shape), t.dtype) for t in partials)
        return functools.partial(_relaunch_in_workspace, tuple(bound), views)
    return functools.partial(_relaunch_split, tuple(bound), tuple(tuple(t.shape) for t in partials), p.query.device)


def _relaunch_split(bound: tuple, partials: tuple, device: torch.device, operands: tuple) -> None:
    # Each call its own partials, from torch's stream-ordered allocator as run() takes them: a
    # buffer kept here would be shared by calls on different streams.
    relaunch_all(bound, (*operands, *(torch.empty(shape, dtype=torch.float32, device=device) for shape in partials)))


def _relaunch_in_workspace(bound: tuple, partials: tuple, operands: tuple) -> None:
    relaunch_all(bound, (*operands, *partials))
