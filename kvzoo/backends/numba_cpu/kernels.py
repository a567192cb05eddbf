"""Numba kernels: the quantizing cache write, dequantize/gather, and paged attention.

Every array arrives as a flat 1-D contiguous view of the caller's memory plus a tuple
(offset, stride, stride, ...) in elements (see strided.py), so one compiled specialization
serves every layout (contiguous, inline-scale pages, views into a fused QKV tensor) and the
innermost loops see a plain 1-D array LLVM can vectorize. Float inputs travel as their bit
patterns (uint16 for bf16/fp16, uint32 for fp32) and are widened in-kernel (bits.py).

Indices in hot loops are cast to uint64 (`_u`): numba wraps negative signed indices, and that
per-element select keeps LLVM from vectorizing (measured 8x on the widening loop). Offsets
themselves are computed in int64 and are never negative.

Branches on the element kind / format sit outside the inner loops and pass the constant on to
an inlined helper, so each inner loop is compiled for one format.

fastmath stays off in this module: the write and dequantize bytes are fixed by the spec, and
the attention kernel keeps IEEE NaN/Inf propagation so a poisoned cache row shows in the output.
The single exception is the q.k dot product of attention (see _dot): reassociation only.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .bits import BF16, E4M3FN, E4M3FNUZ, F16, F32, I8, decode_element, encode_e4m3, f32_from_bits, i32_from_f32, widen

_OPTS = dict(cache=True, fastmath=False, error_model="numpy", boundscheck=False)

_u = np.uint64
_i32 = np.int32
_ONE = np.float32(1.0)
_ZERO = np.float32(0.0)
_NEG_INF = np.float32(-np.inf)
_SCALE_FLOOR = np.float32(1e-6)
_CANONICAL_NAN = 0x7FC00000
# (y + 1.5 * 2^23) - 1.5 * 2^23 rounds fp32 y to an integer, half to even, for |y| < 2^22.
_RNE_MAGIC = np.float32(12582912.0)
# Rows (token, head) per parallel chunk of the write: one scratch row buffer per chunk.
_WRITE_CHUNK = 32
# Keys per attention tile: decoded K and V tiles (TILE x head_size fp32) stay in L1.
TILE = 32


# ----------------------------------------------------------------------------------------------
# Quantizing write
# ----------------------------------------------------------------------------------------------


@njit(inline="always")
def _code(y, fmt, trunc, qmax, qmin):
    """Code of y = x * inv (or x / s): non-finite -> the format's NaN code, else clamp + round."""
    finite = (i32_from_f32(y) & _i32(0x7FFFFFFF)) < _i32(0x7F800000)
    yc = min(max(y, qmin), qmax)
    if fmt == I8:
        c = _i32(yc) if trunc else _i32((yc + _RNE_MAGIC) - _RNE_MAGIC)
        return c if finite else _i32(0)
    if fmt == E4M3FN:
        return encode_e4m3(yc, False) if finite else _i32(0x7F)
    return encode_e4m3(yc, True) if finite else _i32(0x80)


@njit(inline="always")
def _load_row(src, s0, sd, kind, xf, n):
    for d in range(n):
        xf[_u(d)] = widen(src[_u(s0 + d * sd)], kind)


@njit(inline="always")
def _load_row_absmax(src, s0, sd, kind, xf, xb, n):
    """Widen a row into xf and return max |x| as bits: magnitudes order like their bit
    patterns, NaN above +Inf, so an integer max is exact and NaN wins it."""
    amax = np.uint32(0)
    for d in range(n):
        xf[_u(d)] = widen(src[_u(s0 + d * sd)], kind)
        amax = max(amax, xb[_u(d)] & np.uint32(0x7FFFFFFF))
    return amax


@njit(inline="always")
def _store_codes(xf, mul, div, dst, d0, dd, n, fmt, trunc, qmax, qmin):
    if div:
        for d in range(n):
            dst[_u(d0 + d * dd)] = _code(xf[_u(d)] / mul, fmt, trunc, qmax, qmin)
    else:
        for d in range(n):
            dst[_u(d0 + d * dd)] = _code(xf[_u(d)] * mul, fmt, trunc, qmax, qmin)


@njit(inline="always")
def _quantize_row(src, s0, sd, kind, xf, xb, dst, d0, dd, n, fmt, trunc, qmax, qmin, per_tensor, tscale):
    """Quantize one row of n elements; returns the bits to store as its scale."""
    if kind == BF16:
        amax = _load_row_absmax(src, s0, sd, BF16, xf, xb, n)
    elif kind == F16:
        amax = _load_row_absmax(src, s0, sd, F16, xf, xb, n)
    else:
        amax = _load_row_absmax(src, s0, sd, F32, xf, xb, n)
    if per_tensor:
        mul = tscale
        scale = tscale
    else:
        scale = f32_from_bits(amax) / qmax
        if scale != scale:
            mul = scale
        else:
            scale = max(scale, _SCALE_FLOOR)
            mul = _ONE / scale
    if fmt == I8:
        if trunc:
            _store_codes(xf, mul, per_tensor, dst, d0, dd, n, I8, True, qmax, qmin)
        else:
            _store_codes(xf, mul, per_tensor, dst, d0, dd, n, I8, False, qmax, qmin)
    elif fmt == E4M3FN:
        _store_codes(xf, mul, per_tensor, dst, d0, dd, n, E4M3FN, False, qmax, qmin)
    else:
        _store_codes(xf, mul, per_tensor, dst, d0, dd, n, E4M3FNUZ, False, qmax, qmin)
    return _i32(_CANONICAL_NAN) if scale != scale else i32_from_f32(scale)


@njit(parallel=True, **_OPTS)
def write_quantized(
    key, ks_, value, vs_, kind, slots,
    kc, kcs, vc, vcs, ksc, kscs, vsc, vscs,
    block_size, num_heads, head_size,
    fmt, trunc, qmax, qmin, per_tensor, k_tscale, v_tscale,
):  # fmt: skip
    """reshape_and_cache for quantized modes; parallel over chunks of (token, kv head) rows.

    key/value: flat input bits with (offset, sT, sH, sD); kc/vc: flat uint8 codes with
    (offset, sB, sS, sH, sD); ksc/vsc: flat uint32 scale bits with (offset, sB, sS, sH).
    """
    rows = slots.shape[0] * num_heads
    for chunk in prange((rows + _WRITE_CHUNK - 1) // _WRITE_CHUNK):
        xf = np.empty(head_size, dtype=np.float32)
        xb = xf.view(np.uint32)
        for item in range(chunk * _WRITE_CHUNK, min(rows, (chunk + 1) * _WRITE_CHUNK)):
            t = item // num_heads
            h = item - t * num_heads
            slot = slots[t]
            if slot < 0:
                continue
            blk = slot // block_size
            off = slot - blk * block_size
            kbits = _quantize_row(
                key, ks_[0] + t * ks_[1] + h * ks_[2], ks_[3], kind, xf, xb,
                kc, kcs[0] + blk * kcs[1] + off * kcs[2] + h * kcs[3], kcs[4],
                head_size, fmt, trunc, qmax, qmin, per_tensor, k_tscale,
            )  # fmt: skip
            vbits = _quantize_row(
                value, vs_[0] + t * vs_[1] + h * vs_[2], vs_[3], kind, xf, xb,
                vc, vcs[0] + blk * vcs[1] + off * vcs[2] + h * vcs[3], vcs[4],
                head_size, fmt, trunc, qmax, qmin, per_tensor, v_tscale,
            )  # fmt: skip
            if not per_tensor:
                ksc[_u(kscs[0] + blk * kscs[1] + off * kscs[2] + h * kscs[3])] = kbits
                vsc[_u(vscs[0] + blk * vscs[1] + off * vscs[2] + h * vscs[3])] = vbits


@njit(parallel=True, **_OPTS)
def write_plain(key, ks_, value, vs_, slots, kc, kcs, vc, vcs, block_size, num_heads, head_size):
    """reshape_and_cache for mode none: a bit copy of each row into its slot."""
    rows = slots.shape[0] * num_heads
    for item in prange(rows):
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
            kc[_u(kd + d * kcs[4])] = key[_u(k0 + d * ks_[3])]
        for d in range(head_size):
            vc[_u(vd + d * vcs[4])] = value[_u(v0 + d * vs_[3])]


# ----------------------------------------------------------------------------------------------
# Dequantize / gather
# ----------------------------------------------------------------------------------------------


@njit(inline="always")
def _decode_row(src, s0, sd, kind, dst, d0, dd, n, scale, scaled):
    """dst[d] = float32(code) * scale (scaled) or the widened element (mode none)."""
    if scaled:
        for d in range(n):
            dst[_u(d0 + d * dd)] = decode_element(src[_u(s0 + d * sd)], kind) * scale
    else:
        for d in range(n):
            dst[_u(d0 + d * dd)] = decode_element(src[_u(s0 + d * sd)], kind)


@njit(inline="always")
def _decode_row_any(src, s0, sd, kind, dst, d0, dd, n, scale, scaled):
    if kind == I8:
        _decode_row(src, s0, sd, I8, dst, d0, dd, n, scale, scaled)
    elif kind == E4M3FN:
        _decode_row(src, s0, sd, E4M3FN, dst, d0, dd, n, scale, scaled)
    elif kind == E4M3FNUZ:
        _decode_row(src, s0, sd, E4M3FNUZ, dst, d0, dd, n, scale, scaled)
    elif kind == BF16:
        _decode_row(src, s0, sd, BF16, dst, d0, dd, n, scale, scaled)
    elif kind == F16:
        _decode_row(src, s0, sd, F16, dst, d0, dd, n, scale, scaled)
    else:
        _decode_row(src, s0, sd, F32, dst, d0, dd, n, scale, scaled)


@njit(parallel=True, **_OPTS)
def dequantize(
    cache, cs, kind, scales, ss, has_scales, tscale, scaled,
    block_tables, cu_seq_lens, out, os_, num_heads, head_size, block_size,
):  # fmt: skip
    """Gather the tokens of each sequence and decode them: x = float32(code) * scale."""
    num_seqs = cu_seq_lens.shape[0] - 1
    total = cu_seq_lens[num_seqs]
    for t in prange(total):
        s = np.searchsorted(cu_seq_lens, t, side="right") - 1
        i = t - cu_seq_lens[s]
        blk = block_tables[s, i // block_size]
        off = i - (i // block_size) * block_size
        for h in range(num_heads):
            sc = tscale
            if has_scales:
                sc = f32_from_bits(scales[_u(ss[0] + blk * ss[1] + off * ss[2] + h * ss[3])])
            _decode_row_any(
                cache, cs[0] + blk * cs[1] + off * cs[2] + h * cs[3], cs[4], kind,
                out, os_[0] + t * os_[1] + h * os_[2], os_[3], head_size, sc, scaled,
            )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Paged attention
# ----------------------------------------------------------------------------------------------


@njit(inline="always")
def _row_address(pos, seq, block_tables, block_size, st, head):
    blk = block_tables[seq, pos // block_size]
    off = pos - (pos // block_size) * block_size
    return st[0] + blk * st[1] + off * st[2] + head * st[3]


# The one place fastmath flags are used: "reassoc" alone, so LLVM may split this sum into vector
# lanes (2x on decode attention). It changes only the summation order of q.k (attention output
# is compared with a tolerance, never bytes); NaN/Inf/signed-zero semantics stay IEEE because
# nnan/ninf/nsz/contract are not set. The code path is the same for every sequence, so output
# stays batch invariant. Not inlined at numba level so the flag stays on these instructions.
DOT_FASTMATH = frozenset({"reassoc"})


@njit(cache=True, fastmath=set(DOT_FASTMATH), error_model="numpy", boundscheck=False)
def _dot(a, a0, b, b0, n):
    acc = _ZERO
    for d in range(n):
        acc += a[_u(a0 + d)] * b[_u(b0 + d)]
    return acc


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
):  # fmt: skip
    """Causal paged attention; one parallel item per (query block, kv head).

    A query block is up to a few query tokens of one sequence; the item processes all
    Hq/Hkv query heads of its KV head together, so each K/V row is decoded once per group.
    Online softmax over tiles of TILE keys. Per-token-head scales are applied per key: the K
    scale on the q.codes product, the V scale on the probability.
    """
    group = num_q_heads // num_kv_heads
    n_items = items_seq.shape[0]
    hd = head_size
    for it in prange(n_items * num_kv_heads):
        wi = it // num_kv_heads
        g = it - wi * num_kv_heads
        seq = items_seq[wi]
        t0 = items_t0[wi]
        nq = items_nq[wi]
        q_len = query_start_loc[seq + 1] - query_start_loc[seq]
        first_pos = seq_lens[seq] - q_len + (t0 - query_start_loc[seq])
        rows = nq * group

        # Row r is query token t0 + r // group, head g * group + r % group; widened to fp32.
        q = np.empty(rows * hd, dtype=np.float32)
        pos = np.empty(rows, dtype=np.int64)
        m = np.empty(rows, dtype=np.float32)
        l_sum = np.empty(rows, dtype=np.float32)
        acc = np.zeros(rows * hd, dtype=np.float32)
        for r in range(rows):
            j = r // group
            h = g * group + (r - j * group)
            pos[r] = first_pos + j
            q0 = qs[0] + (t0 + j) * qs[1] + h * qs[2]
            if q_kind == BF16:
                _load_row(query, q0, qs[3], BF16, q[r * hd :], hd)
            elif q_kind == F16:
                _load_row(query, q0, qs[3], F16, q[r * hd :], hd)
            else:
                _load_row(query, q0, qs[3], F32, q[r * hd :], hd)
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

        kt = np.empty(TILE * hd, dtype=np.float32)
        vt = np.empty(TILE * hd, dtype=np.float32)
        kscale = np.empty(TILE, dtype=np.float32)
        vscale = np.empty(TILE, dtype=np.float32)
        sc = np.empty(TILE, dtype=np.float32)

        for k0 in range(lo, hi, TILE):
            n = min(TILE, hi - k0)
            # Decode the tile's K and V rows once for the whole group (codes, unscaled).
            for kk in range(n):
                kp = k0 + kk
                _decode_row_any(
                    kc, _row_address(kp, seq, block_tables, block_size, kcs, g), kcs[4], kv_kind,
                    kt, kk * hd, 1, hd, _ONE, False,
                )  # fmt: skip
                _decode_row_any(
                    vc, _row_address(kp, seq, block_tables, block_size, vcs, g), vcs[4], kv_kind,
                    vt, kk * hd, 1, hd, _ONE, False,
                )  # fmt: skip
                if has_scales:
                    ka = _row_address(kp, seq, block_tables, block_size, kscs, g)
                    va = _row_address(kp, seq, block_tables, block_size, vscs, g)
                    kscale[kk] = f32_from_bits(ksc[_u(ka)]) * softmax_scale
                    vscale[kk] = f32_from_bits(vsc[_u(va)])
                else:
                    kscale[kk] = k_tscale * softmax_scale
                    vscale[kk] = v_tscale

            for r in range(rows):
                p = pos[r]
                if k0 > p:
                    continue  # the whole tile is in this row's future
                tile_max = _NEG_INF
                for kk in range(n):
                    kp = k0 + kk
                    if kp > p or (window > 0 and kp <= p - window):
                        sc[kk] = _NEG_INF
                        continue
                    x = _dot(q, r * hd, kt, kk * hd, hd) * kscale[kk]
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
                a0 = r * hd
                if alpha != _ONE:
                    for d in range(hd):
                        acc[_u(a0 + d)] *= alpha
                for kk in range(n):
                    w = sc[kk]
                    if w == _ZERO:
                        continue
                    v0 = kk * hd
                    for d in range(hd):
                        acc[_u(a0 + d)] += w * vt[_u(v0 + d)]

        for r in range(rows):
            j = r // group
            h = g * group + (r - j * group)
            o0 = os_[0] + (t0 + j) * os_[1] + h * os_[2]
            inv_l = _ONE / l_sum[r]
            for d in range(hd):
                out[_u(o0 + d * os_[3])] = acc[_u(r * hd + d)] * inv_l


# ----------------------------------------------------------------------------------------------
# Test hooks: the exact element functions applied to whole arrays
# ----------------------------------------------------------------------------------------------


@njit(**_OPTS)
def encode_codes_array(x, out, fmt, trunc, qmax, qmin):
    """The write path's encoder on already-scaled values y: non-finite -> the format's NaN
    code, else clamp to [qmin, qmax] and round (int8 half-even or trunc; fp8 RNE)."""
    if fmt == I8:
        if trunc:
            _store_codes(x, _ONE, False, out, 0, 1, x.shape[0], I8, True, qmax, qmin)
        else:
            _store_codes(x, _ONE, False, out, 0, 1, x.shape[0], I8, False, qmax, qmin)
    elif fmt == E4M3FN:
        _store_codes(x, _ONE, False, out, 0, 1, x.shape[0], E4M3FN, False, qmax, qmin)
    else:
        _store_codes(x, _ONE, False, out, 0, 1, x.shape[0], E4M3FNUZ, False, qmax, qmin)


@njit(**_OPTS)
def decode_codes_array(codes, kind, out):
    """Decode every element of an array of kind I8 / E4M3FN / E4M3FNUZ / BF16 / F16 / F32."""
    _decode_row_any(codes, 0, 1, kind, out, 0, 1, codes.shape[0], _ONE, False)


__all__ = [
    "TILE",
    "attention",
    "decode_codes_array",
    "dequantize",
    "encode_codes_array",
    "write_plain",
    "write_quantized",
]
