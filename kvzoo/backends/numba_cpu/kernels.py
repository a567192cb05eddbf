"""Numba kernels: the quantizing cache write, dequantize/gather, and paged attention.

Every array arrives as a flat 1-D contiguous view of the caller's memory plus a tuple
(offset, stride, stride, ...) in elements (see strided.py), so one compiled specialization
serves every layout (contiguous, inline-scale pages, views into a fused QKV tensor) and the
innermost loops see a plain 1-D array LLVM can vectorize. Float inputs travel as their bit
patterns (uint16 for bf16/fp16, uint32 for fp32) and are widened in-kernel (bits.py).

fastmath stays off in this module: the write and dequantize bytes are fixed by the spec, and
the attention kernel keeps IEEE NaN/Inf propagation so a poisoned cache row shows in the output.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .bits import (
    E4M3FN,
    E4M3FNUZ,
    F32,
    I8,
    bits_from_f32,
    decode_element,
    encode_e4m3,
    f32_from_bits,
    widen_bits,
)

_OPTS = dict(cache=True, fastmath=False, error_model="numpy", boundscheck=False)

_ONE = np.float32(1.0)
_ZERO = np.float32(0.0)
_NEG_INF = np.float32(-np.inf)
_SCALE_FLOOR = np.float32(1e-6)
_CANONICAL_NAN = 0x7FC00000
# (y + 1.5 * 2^23) - 1.5 * 2^23 rounds fp32 y to an integer, half to even, for |y| < 2^22.
_RNE_MAGIC = np.float32(12582912.0)
# Keys per attention tile: the decoded tile (TILE x head_size fp32, twice) stays in L1.
TILE = 32


# ----------------------------------------------------------------------------------------------
# Quantizing write
# ----------------------------------------------------------------------------------------------


@njit(inline="always")
def _encode_y(y, fmt, trunc, qmax, qmin):
    """Code byte of y = x * inv (or x / s): non-finite -> the format's NaN code, else clamp+round."""
    if (bits_from_f32(y) & 0x7FFFFFFF) >= 0x7F800000:
        if fmt == E4M3FN:
            return 0x7F
        if fmt == E4M3FNUZ:
            return 0x80
        return 0
    y = min(max(y, qmin), qmax)
    if fmt == I8:
        if trunc:
            return np.int64(y) & 0xFF
        return np.int64((y + _RNE_MAGIC) - _RNE_MAGIC) & 0xFF
    return encode_e4m3(y, fmt == E4M3FNUZ)


@njit(inline="always")
def _quantize_row(src, s0, s_d, kind, dst, d0, d_d, n, fmt, trunc, qmax, qmin, per_tensor, tscale):
    """Quantize one row of n elements; returns the bits to store as its scale."""
    if per_tensor:
        for d in range(n):
            y = f32_from_bits(widen_bits(src[s0 + d * s_d], kind)) / tscale
            dst[d0 + d * d_d] = _encode_y(y, fmt, trunc, qmax, qmin)
        return 0
    # |x| ordered as integers: the largest magnitude bits, NaN above +Inf, so NaN wins the max.
    amax = np.int64(0)
    for d in range(n):
        amax = max(amax, widen_bits(src[s0 + d * s_d], kind) & 0x7FFFFFFF)
    scale = f32_from_bits(amax) / qmax
    if scale != scale:
        inv = scale
    else:
        scale = max(scale, _SCALE_FLOOR)
        inv = _ONE / scale
    for d in range(n):
        y = f32_from_bits(widen_bits(src[s0 + d * s_d], kind)) * inv
        dst[d0 + d * d_d] = _encode_y(y, fmt, trunc, qmax, qmin)
    return _CANONICAL_NAN if scale != scale else bits_from_f32(scale)


@njit(parallel=True, **_OPTS)
def write_quantized(
    key, ks_, value, vs_, kind, slots,
    kc, kcs, vc, vcs, ksc, kscs, vsc, vscs,
    block_size, num_heads, head_size,
    fmt, trunc, qmax, qmin, per_tensor, k_tscale, v_tscale,
):  # fmt: off
    """reshape_and_cache for quantized modes; one parallel item per (token, kv head).

    key/value: flat input bits with (offset, sT, sH, sD); kc/vc: flat uint8 codes with
    (offset, sB, sS, sH, sD); ksc/vsc: flat uint32 scale bits with (offset, sB, sS, sH).
    """
    num_tokens = slots.shape[0]
    for item in prange(num_tokens * num_heads):
        t = item // num_heads
        h = item - t * num_heads
        slot = slots[t]
        if slot < 0:
            continue
        blk = slot // block_size
        off = slot - blk * block_size
        kbits = _quantize_row(
            key, ks_[0] + t * ks_[1] + h * ks_[2], ks_[3], kind,
            kc, kcs[0] + blk * kcs[1] + off * kcs[2] + h * kcs[3], kcs[4],
            head_size, fmt, trunc, qmax, qmin, per_tensor, k_tscale,
        )
        vbits = _quantize_row(
            value, vs_[0] + t * vs_[1] + h * vs_[2], vs_[3], kind,
            vc, vcs[0] + blk * vcs[1] + off * vcs[2] + h * vcs[3], vcs[4],
            head_size, fmt, trunc, qmax, qmin, per_tensor, v_tscale,
        )
        if not per_tensor:
            ksc[kscs[0] + blk * kscs[1] + off * kscs[2] + h * kscs[3]] = kbits
            vsc[vscs[0] + blk * vscs[1] + off * vscs[2] + h * vscs[3]] = vbits


@njit(parallel=True, **_OPTS)
def write_plain(key, ks_, value, vs_, slots, kc, kcs, vc, vcs, block_size, num_heads, head_size):
    """reshape_and_cache for mode none: a bit copy of each row into its slot."""
    num_tokens = slots.shape[0]
    for item in prange(num_tokens * num_heads):
        t = item // num_heads
        h = item - t * num_heads
        slot = slots[t]
        if slot < 0:
            continue
        blk = slot // block_size
        off = slot - blk * block_size
        k0 = ks_[0] + t * ks_[1] + h * ks_[2]
        v0 = vs_[0] + t * vs_[1] + h * vs_[2]
        kd = kcs[0] + blk * kcs[1] + off * kcs[2] + h * kcs[3]
        vd = vcs[0] + blk * vcs[1] + off * vcs[2] + h * vcs[3]
        for d in range(head_size):
            kc[kd + d * kcs[4]] = key[k0 + d * ks_[3]]
            vc[vd + d * vcs[4]] = value[v0 + d * vs_[3]]


# ----------------------------------------------------------------------------------------------
# Dequantize / gather
# ----------------------------------------------------------------------------------------------


@njit(parallel=True, **_OPTS)
def dequantize(
    cache, cs, kind, scales, ss, has_scales, tscale, scaled,
    block_tables, cu_seq_lens, out, os_, num_heads, head_size, block_size,
):  # fmt: off
    """Gather the tokens of each sequence and decode them: x = float32(code) * scale."""
    num_seqs = cu_seq_lens.shape[0] - 1
    total = cu_seq_lens[num_seqs]
    for t in prange(total):
        s = np.searchsorted(cu_seq_lens, t, side="right") - 1
        i = t - cu_seq_lens[s]
        blk = block_tables[s, i // block_size]
        off = i - (i // block_size) * block_size
        for h in range(num_heads):
            c0 = cs[0] + blk * cs[1] + off * cs[2] + h * cs[3]
            o0 = os_[0] + t * os_[1] + h * os_[2]
            if has_scales:
                sc = f32_from_bits(scales[ss[0] + blk * ss[1] + off * ss[2] + h * ss[3]])
            else:
                sc = tscale
            if scaled:
                for d in range(head_size):
                    out[o0 + d * os_[3]] = decode_element(cache[c0 + d * cs[4]], kind) * sc
            else:
                for d in range(head_size):
                    out[o0 + d * os_[3]] = decode_element(cache[c0 + d * cs[4]], kind)


# ----------------------------------------------------------------------------------------------
# Paged attention
# ----------------------------------------------------------------------------------------------


@njit(inline="always")
def _key_address(pos, seq, block_tables, block_size, st, head):
    blk = block_tables[seq, pos // block_size]
    off = pos - (pos // block_size) * block_size
    return st[0] + blk * st[1] + off * st[2] + head * st[3]


@njit(parallel=True, **_OPTS)
def attention(
    query, qs, q_kind,
    kc, kcs, vc, vcs, kv_kind,
    ksc, kscs, vsc, vscs, has_scales, k_tscale, v_tscale,
    block_tables, seq_lens, query_start_loc,
    items_seq, items_t0, items_nq,
    out, os_,
    num_q_heads, num_kv_heads, head_size, block_size,
    softmax_scale, window, softcap, sinks, has_sinks,
):  # fmt: off
    """Causal paged attention; one parallel item per (query block, kv head).

    A query block is up to a few query tokens of one sequence; the item processes all
    Hq/Hkv query heads of its KV head together, so each K/V row is decoded once per group.
    Online softmax over tiles of TILE keys. Per-token-head scales are applied per key: the K
    scale on the q.codes product, the V scale on the probability.
    """
    group = num_q_heads // num_kv_heads
    n_items = items_seq.shape[0]
    for it in prange(n_items * num_kv_heads):
        wi = it // num_kv_heads
        g = it - wi * num_kv_heads
        seq = items_seq[wi]
        t0 = items_t0[wi]
        nq = items_nq[wi]
        q_len = query_start_loc[seq + 1] - query_start_loc[seq]
        first_pos = seq_lens[seq] - q_len + (t0 - query_start_loc[seq])
        rows = nq * group

        # Query rows, widened to fp32: row r is token t0 + r // group, head g*group + r % group.
        q = np.empty((rows, head_size), dtype=np.float32)
        pos = np.empty(rows, dtype=np.int64)
        m = np.empty(rows, dtype=np.float32)
        l_sum = np.empty(rows, dtype=np.float32)
        acc = np.zeros((rows, head_size), dtype=np.float32)
        for r in range(rows):
            j = r // group
            h = g * group + (r - j * group)
            pos[r] = first_pos + j
            q0 = qs[0] + (t0 + j) * qs[1] + h * qs[2]
            for d in range(head_size):
                q[r, d] = f32_from_bits(widen_bits(query[q0 + d * qs[3]], q_kind))
            if has_sinks:
                m[r] = sinks[h]
                l_sum[r] = _ONE
            else:
                m[r] = _NEG_INF
                l_sum[r] = _ZERO

        hi = first_pos + nq  # exclusive end of the keys any row sees
        lo = 0
        if window > 0:
            lo = max(0, first_pos - window + 1)

        kt = np.empty((head_size, TILE), dtype=np.float32)  # K tile, transposed
        vt = np.empty((TILE, head_size), dtype=np.float32)
        kscale = np.empty(TILE, dtype=np.float32)
        vscale = np.empty(TILE, dtype=np.float32)
        sc = np.empty(TILE, dtype=np.float32)

        for k0 in range(lo, hi, TILE):
            n = min(TILE, hi - k0)
            # Decode the tile's K and V rows once for the whole group.
            for kk in range(n):
                kp = k0 + kk
                ka = _key_address(kp, seq, block_tables, block_size, kcs, g)
                va = _key_address(kp, seq, block_tables, block_size, vcs, g)
                for d in range(head_size):
                    kt[d, kk] = decode_element(kc[ka + d * kcs[4]], kv_kind)
                for d in range(head_size):
                    vt[kk, d] = decode_element(vc[va + d * vcs[4]], kv_kind)
                if has_scales:
                    kscale[kk] = f32_from_bits(
                        ksc[_key_address(kp, seq, block_tables, block_size, kscs, g)]
                    ) * softmax_scale
                    vscale[kk] = f32_from_bits(
                        vsc[_key_address(kp, seq, block_tables, block_size, vscs, g)]
                    )
                else:
                    kscale[kk] = k_tscale * softmax_scale
                    vscale[kk] = v_tscale
            for kk in range(n, TILE):
                for d in range(head_size):
                    kt[d, kk] = _ZERO

            for r in range(rows):
                p = pos[r]
                if k0 > p:
                    continue  # the whole tile is in this row's future
                # Scores: accumulate over d with the tile's keys as the vector lanes.
                for kk in range(TILE):
                    sc[kk] = _ZERO
                for d in range(head_size):
                    qd = q[r, d]
                    for kk in range(TILE):
                        sc[kk] += qd * kt[d, kk]
                tile_max = _NEG_INF
                for kk in range(n):
                    kp = k0 + kk
                    if kp > p or (window > 0 and kp <= p - window):
                        sc[kk] = _NEG_INF
                        continue
                    x = sc[kk] * kscale[kk]
                    if softcap > 0:
                        x = softcap * math.tanh(x / softcap)
                    sc[kk] = x
                    if x > tile_max or x != x:
                        tile_max = x
                m_old = m[r]
                m_new = tile_max if (tile_max > m_old or tile_max != tile_max) else m_old
                if m_new == _NEG_INF:
                    continue  # nothing visible yet (and no sink)
                alpha = math.exp(m_old - m_new)
                m[r] = m_new
                row_sum = _ZERO
                for kk in range(n):
                    w = math.exp(sc[kk] - m_new)
                    row_sum += w
                    sc[kk] = w * vscale[kk]
                l_sum[r] = l_sum[r] * alpha + row_sum
                if alpha != _ONE:
                    for d in range(head_size):
                        acc[r, d] *= alpha
                for kk in range(n):
                    w = sc[kk]
                    if w == _ZERO:
                        continue
                    for d in range(head_size):
                        acc[r, d] += w * vt[kk, d]

        for r in range(rows):
            j = r // group
            h = g * group + (r - j * group)
            o0 = os_[0] + (t0 + j) * os_[1] + h * os_[2]
            inv_l = _ONE / l_sum[r]
            for d in range(head_size):
                out[o0 + d * os_[3]] = acc[r, d] * inv_l


@njit(**_OPTS)
def encode_fp8_array(x, out, fnuz, clamp):
    """Test hook: the write path's fp8 encoder applied elementwise (clamp to +-clamp first)."""
    fmt = E4M3FNUZ if fnuz else E4M3FN
    for i in range(x.shape[0]):
        out[i] = _encode_y(x[i], fmt, False, clamp, -clamp)


@njit(**_OPTS)
def decode_codes_array(codes, kind, out):
    """Test hook: decode every code of an array (kind I8 / E4M3FN / E4M3FNUZ / F32 bits ...)."""
    for i in range(codes.shape[0]):
        out[i] = decode_element(codes[i], kind)


__all__ = [
    "F32",
    "TILE",
    "attention",
    "decode_codes_array",
    "dequantize",
    "encode_fp8_array",
    "write_plain",
    "write_quantized",
]
