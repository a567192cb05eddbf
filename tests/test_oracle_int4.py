"""Tests of the oracle's int4 per-token-head functions (kvzoo_spec/SPEC.md section 2's int4 rows).

These hold the oracle itself (the backends are held to it by the conformance suite) to facts written out here:
the Hadamard matrix by Sylvester's construction, the nibble layout, the scale / zero-point bit
layout, hand-computed bytes, and attention on dequantized rows.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from kvzoo_spec import oracle

NAN_BITS = 0x7FC00000
FLOOR_BITS = 0x358637BD


def _bits(a):
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _sylvester(D):
    H = np.ones((1, 1), dtype=np.int64)
    while H.shape[0] < D:
        H = np.block([[H, H], [H, -H]])
    return H


def _rng(seed):
    return np.random.default_rng(seed)


# ---------------------------------------------------------------------------- layout


def test_nibble_order_even_element_in_low_nibble():
    codes = np.arange(16, dtype=np.uint8)
    packed = oracle.int4_pack(codes)
    assert packed.tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]
    assert np.array_equal(oracle.int4_unpack(packed), codes)
    all_bytes = np.arange(256, dtype=np.uint8)
    assert np.array_equal(oracle.int4_pack(oracle.int4_unpack(all_bytes[:, None])).ravel(), all_bytes)


def test_zero_point_lives_in_low_four_scale_bits():
    x = _rng(1).standard_normal((200, 64)).astype(np.float32) + 0.3
    packed, scales = oracle.int4_quantize_rows(x, "int4_per_token_head_norot")
    bits = _bits(scales)
    s_t, zp = oracle.int4_split_scale(scales)
    assert np.array_equal(zp, bits & 0xF)
    assert np.array_equal(_bits(s_t), bits & 0xFFFFFFF0)
    for n in range(len(x)):
        mx, mn = max(np.float32(x[n].max()), np.float32(0)), min(np.float32(x[n].min()), np.float32(0))
        scale = np.float32(np.float32(mx - mn) / np.float32(15))
        # the stored scale is the computed one truncated to a multiple of 16 ulp
        assert int(bits[n]) >> 4 == int(_bits(np.array([scale]))[0]) >> 4
        t = np.float32(np.float32(-mn) / scale)
        assert int(bits[n]) & 0xF == min(15, int(np.float32(t + np.float32(0.5))))
    # a row's zero element (when present) decodes to exactly 0 when the code equals zp:
    # codes == zp  <=>  decoded == 0
    dec = oracle.int4_decode_rows(packed, scales)
    assert np.array_equal(oracle.int4_unpack(packed) == zp[:, None], dec == 0)


# ---------------------------------------------------------------------------- rotation


def test_signs_table():
    assert oracle.int4_rht_signs(8).tolist() == [1, -1, 1, 1, -1, -1, -1, -1]  # 0xF2
    s512 = oracle.int4_rht_signs(512)
    for D in (2, 4, 16, 64, 128, 256):
        assert np.array_equal(oracle.int4_rht_signs(D), s512[:D])
    for bad in (0, 1, 3, 95, 514, 1024):
        with pytest.raises(ValueError):
            oracle.int4_rht_signs(bad)


@pytest.mark.parametrize("D", [2, 8, 64, 128, 256])
def test_fwht_is_sylvester_hadamard_and_rotation_orthogonal(D):
    H = _sylvester(D)
    eye = np.eye(D, dtype=np.float64)
    assert np.array_equal(oracle.int4_fwht(eye), H.astype(np.float64))  # rows of H (H symmetric)
    R = H * oracle.int4_rht_signs(D).astype(np.int64)[None, :]  # R = H diag(s)
    assert np.array_equal(R @ R.T, D * np.eye(D, dtype=np.int64))  # R / sqrt(D) is orthogonal
    x = np.eye(D, dtype=np.float32)
    assert np.array_equal(oracle.int4_rotate(x), R.T.astype(np.float32))  # rotate(e_j) = R[:, j]
    assert np.array_equal(oracle.int4_unrotate(R.T.astype(np.float32)), x)


@pytest.mark.parametrize("D", [6, 80, 96, 192, 510])
def test_fwht_of_any_head_size_is_block_diagonal(D):
    # SPEC.md 3.4: D's binary digits, largest block first, each block a Sylvester matrix.
    blocks = oracle.int4_rht_blocks(D)
    assert [size for _, size in blocks] == [1 << b for b in reversed(range(D.bit_length())) if D >> b & 1]
    H = np.zeros((D, D), dtype=np.int64)
    for offset, size in blocks:
        assert offset % size == 0
        H[offset : offset + size, offset : offset + size] = _sylvester(size)
    sizes = oracle.int4_rht_block_sizes(D)
    # Element i's block is the largest power of two <= D ^ i.
    assert sizes.tolist() == [float(1 << ((D ^ i).bit_length() - 1)) for i in range(D)]
    assert np.array_equal(oracle.int4_fwht(np.eye(D)), H.astype(np.float64))
    R = H * oracle.int4_rht_signs(D).astype(np.int64)[None, :]
    assert np.array_equal(R @ R.T, np.diag(sizes).astype(np.int64))  # rows of R / sqrt(B) orthonormal
    x = np.eye(D, dtype=np.float32)
    assert np.array_equal(oracle.int4_rotate(x), R.T.astype(np.float32))
    assert np.array_equal(oracle.int4_unrotate(R.T.astype(np.float32)), x)
    assert np.array_equal(oracle.int4_unrotate_f64(R.T.astype(np.float64)), x)


def test_fwht_stage_order_is_the_specified_butterfly():
    # float32 rounding makes the order visible: 1 + 2^-24 + 2^-24 depends on grouping.
    x = np.array([1.0, 2.0**-24, 2.0**-24, 2.0**-24], dtype=np.float32)
    # stage h=1: (1+e, 1-e, 2e, 0) -> 1+e rounds to 1, 1-e is exact (1 - 2^-24)
    s1 = [np.float32(1.0), np.float32(1 - 2.0**-24), np.float32(2.0**-23), np.float32(0.0)]
    want = [s1[0] + s1[2], s1[1] + s1[3], s1[0] - s1[2], s1[1] - s1[3]]
    assert _bits(oracle.int4_fwht(x)).tolist() == _bits(np.array(want, dtype=np.float32)).tolist()


@pytest.mark.parametrize("D", [16, 96, 128, 512])
def test_inverse_exact_to_fp32_rounding(D):
    x = (_rng(D).standard_normal((64, D)) * 10.0 ** _rng(D + 1).uniform(-3, 3, (64, 1))).astype(np.float32)
    back = oracle.int4_unrotate(oracle.int4_rotate(x))
    bound = 4 * math.log2(D) * 2.0**-24 * np.abs(x).sum(axis=1, keepdims=True)
    assert np.all(np.abs(back.astype(np.float64) - x) <= bound)
    # float64 inverse of the float32 forward is within the forward's rounding only
    back64 = oracle.int4_unrotate_f64(oracle.int4_rotate(x))
    assert np.all(np.abs(back64 - x) <= bound)
    # small integers: everything exact
    xi = _rng(2).integers(-100, 100, (16, D)).astype(np.float32)
    assert np.array_equal(oracle.int4_unrotate(oracle.int4_rotate(xi)), xi)


def test_rotation_rounds_to_the_input_dtype():
    x = _rng(3).standard_normal((8, 64)).astype(np.float32)
    xb = x.astype(ml_dtypes.bfloat16)
    r = oracle.int4_rotate(xb)
    r32 = oracle.int4_fwht(xb.astype(np.float32) * oracle.int4_rht_signs(64))
    assert np.array_equal(r, r32.astype(ml_dtypes.bfloat16).astype(np.float32))
    xh = x.astype(np.float16)
    assert np.array_equal(
        oracle.int4_rotate(xh),
        oracle.int4_fwht(xh.astype(np.float32) * oracle.int4_rht_signs(64)).astype(np.float16).astype(np.float32),
    )


# ---------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("mode", oracle.INT4_MODES)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_round_trip_error_within_half_step(mode, dtype):
    x = (_rng(4).standard_normal((100, 128)) * _rng(5).uniform(0.01, 5, (100, 1))).astype(dtype)
    packed, scales = oracle.int4_quantize_rows(x, mode)
    assert packed.shape == (100, 64) and packed.dtype == np.uint8 and scales.dtype == np.float32
    r = oracle.int4_rotate(x) if mode == "int4_per_token_head" else oracle.widen_to_float32(x)
    s_t, _ = oracle.int4_split_scale(scales)
    dec = oracle.int4_decode_rows(packed, scales).astype(np.float64)
    # per element in the stored domain: at most half a step (+ the truncation of the scale)
    assert np.all(np.abs(dec - r) <= s_t[:, None] * (0.5 + 1e-4))
    # in the model's basis, the L2 error is the stored-domain one / sqrt(D) (orthogonality)
    # (measured against the exact inverse of the stored-domain row r: the rotation's own
    # float32 / input-dtype rounding is tested above)
    r_back = oracle.int4_unrotate_f64(r) if mode == "int4_per_token_head" else r.astype(np.float64)
    back = oracle.int4_dequantize_rows_f64(packed, scales, mode)
    err = np.linalg.norm(back - r_back, axis=1)
    factor = 1 / math.sqrt(128) if mode == "int4_per_token_head" else 1.0
    assert np.all(err <= np.linalg.norm(dec - r, axis=1) * factor * (1 + 1e-9) + 1e-30)


# ---------------------------------------------------------------------------- special values


@pytest.mark.parametrize("mode", oracle.INT4_MODES)
def test_special_rows(mode):
    D = 16
    rows = np.zeros((7, D), dtype=np.float32)
    rows[0, 3] = np.nan
    rows[1, 5] = np.inf
    rows[2, :] = -0.0
    rows[2, ::2] = 0.0
    rows[3, :] = np.float32(1e-40)  # subnormal
    rows[4, :] = 3e38
    rows[4, 1] = -3e38  # max - min overflows float32
    rows[5, 0] = -np.inf
    rows[5, 1] = np.inf
    rows[6, :] = 2.5  # one-signed row
    packed, scales = oracle.int4_quantize_rows(rows, mode)
    bits = _bits(scales)
    dec = oracle.int4_decode_rows(packed, scales)
    for n in (0, 1, 4, 5):
        assert bits[n] == NAN_BITS and not packed[n].any() and np.isnan(dec[n]).all()
    assert bits[2] == (FLOOR_BITS & ~0xF) and not packed[2].any()
    assert np.array_equal(_bits(dec[2]), np.zeros(D, np.uint32))  # +0 throughout
    assert bits[3] == (FLOOR_BITS & ~0xF)  # tiny row: scale floor, zero point 0
    back = oracle.int4_dequantize_rows_f64(packed, scales, mode)
    assert np.all(np.abs(back[3]) <= 1e-6)
    # kvzoo includes 0 in the range, so a one-signed (here constant) row keeps its magnitude
    assert np.allclose(back[6], 2.5, rtol=0.2 if mode == "int4_per_token_head" else 0.02)


def test_fp16_rotation_overflow_poisons_the_row():
    x = np.full((1, 8), 10000.0, dtype=np.float16)  # rotated element 0 = 10000 * sum(signs)...
    x[0] = 10000.0 * oracle.int4_rht_signs(8)  # ... = 80000 > 65504 with these signs
    packed, scales = oracle.int4_quantize_rows(x)
    assert _bits(scales)[0] == NAN_BITS and not packed.any()
    # the variant without rotation keeps it
    _, s2 = oracle.int4_quantize_rows(x, "int4_per_token_head_norot")
    assert np.isfinite(s2[0])


def test_decode_of_arbitrary_bits_is_defined():
    packed = np.arange(256, dtype=np.uint8).reshape(32, 8)
    raw = np.array(
        [0x3F800003, 0x7F800000, 0x7F800005, 0x80000001, 0x00000010, 0xBF80000F, 0, 0xFFFFFFFF] * 4, np.uint32
    )
    dec = oracle.int4_decode_rows(packed, raw.view(np.float32))
    codes = oracle.int4_unpack(packed).astype(np.int64)
    s = (raw & 0xFFFFFFF0).view(np.float32).astype(np.float64)
    with np.errstate(all="ignore"):
        want = ((codes - (raw & 0xF)[:, None].astype(np.int64)) * s[:, None]).astype(np.float32)
    assert np.array_equal(np.isnan(dec), np.isnan(want))
    assert np.array_equal(dec[~np.isnan(dec)], want[~np.isnan(want)])


# ---------------------------------------------------------------------------- vLLM layout


def _vllm_reading(r):
    """My reading of vLLM's _reshape_cache_int4_kernel (vllm/v1/attention/ops/int4_per_token_head.py),
    for one finite, already rotated float32 row, written from scratch: min/max of the row,
    scale = max((max - min) / 15, 1e-6), zp = clamp(round-half-away via +-0.5 and truncation of
    -min / scale, 0, 15), codes the same way from x * (1 / scale) + zp (taken here without FMA),
    stored scale bits = (bits & -16) | zp, byte = even | odd << 4."""
    f = np.float32
    mn, mx = f(r.min()), f(r.max())
    scale = max(f(f(mx - mn) / f(15.0)), f(1e-6))

    def rnd(v):
        return int(min(15, max(0, int(f(v + f(0.5))) if v >= 0 else int(f(v - f(0.5))))))

    zp = rnd(f(-mn / scale))
    inv = f(f(1.0) / scale)
    codes = [rnd(f(f(v * inv) + f(zp))) for v in r]
    bits = (int(_bits(np.array([scale]))[0]) & ~0xF & 0xFFFFFFFF) | zp
    return [codes[2 * j] | (codes[2 * j + 1] << 4) for j in range(len(r) // 2)], bits


def test_golden_hand_computed_vllm_bytes():
    # Written by hand from my reading of vLLM's int4 module (not generated by the oracle):
    # x = e_1 (D = 8, float32). Signs for D = 8 are 0xF2 -> s = (+,-,+,+,-,-,-,-), so s*x = -e_1
    # and H(-e_1) = (-1, 1, -1, 1, -1, 1, -1, 1). min -1, max 1, scale = fl(2/15) = 0x3E088889;
    # t = fl(1 / scale) = 7.4999995 -> fl(t + 0.5) = 7.9999995 -> zp 7; stored 0x3E088880 | 7.
    # Codes: -1 -> fl(-7.4999995 + 7) < 0 -> 0; +1 -> fl(7.4999995 + 7) = 14.5 (tie to even)
    # -> 15. Bytes: even (low nibble) 0, odd (high nibble) 15 -> 0xF0 four times.
    x = np.zeros((1, 8), dtype=np.float32)
    x[0, 1] = 1.0
    packed, scales = oracle.int4_quantize_rows(x)
    assert packed[0].tolist() == [0xF0, 0xF0, 0xF0, 0xF0]
    assert int(_bits(scales)[0]) == 0x3E088887
    assert _vllm_reading(oracle.int4_rotate(x)[0]) == ([0xF0] * 4, 0x3E088887)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_bytes_equal_vllm_reading_on_rows_straddling_zero(dtype):
    x = _rng(6).standard_normal((300, 64)).astype(dtype)
    packed, scales = oracle.int4_quantize_rows(x)
    r = oracle.int4_rotate(x)
    checked = 0
    for n in range(len(x)):
        if r[n].min() <= 0 <= r[n].max():
            want_bytes, want_bits = _vllm_reading(r[n])
            assert packed[n].tolist() == want_bytes and int(_bits(scales)[n]) == want_bits
            checked += 1
    assert checked > 250


def test_one_signed_row_is_where_kvzoo_differs_from_vllm():
    r = np.linspace(1.0, 2.0, 16, dtype=np.float32)[None]
    packed, scales = oracle.int4_quantize_rows(r, "int4_per_token_head_norot")
    vb, vbits = _vllm_reading(r[0])
    assert int(_bits(scales)[0]) != vbits
    # both pages decode under the same rule; kvzoo's keeps the row, vLLM's range [1, 2] has
    # zero point -15 clamped to 0 and every code saturates at 15: all elements read back as ~1
    s_v = np.array([vbits & ~0xF], np.uint32).view(np.float32)[0]
    v_dec = np.array([(b >> (4 * k)) & 0xF for b in vb for k in (0, 1)]) * float(s_v)
    assert np.allclose(v_dec, 1.0, rtol=1e-5)
    back = oracle.int4_dequantize_rows_f64(packed, scales, "int4_per_token_head_norot")
    assert np.abs(back - r).max() <= float(oracle.int4_split_scale(scales)[0][0]) * (0.5 + 1e-4)


# ---------------------------------------------------------------------------- attention


@pytest.mark.parametrize("mode", oracle.INT4_MODES)
@pytest.mark.parametrize("opts", [{}, {"softcap": 5.0}, {"sliding_window": 3}, {"sinks": True}])
def test_attention_matches_dequantize_then_attend(mode, opts):
    rng = _rng(7)
    D, Hkv, Hq, BS, NB = 32, 2, 4, 4, 8
    seq_lens = np.array([5, 9, 1], dtype=np.int32)
    qsl = np.array([0, 1, 10, 11], dtype=np.int32)  # decode, prefill, decode
    T = int(qsl[-1])
    block_tables = np.array([[3, 1, -1], [0, 2, 5], [7, -1, -1]], dtype=np.int32)
    slots = []
    for s, L in enumerate(seq_lens.tolist()):
        slots += [int(block_tables[s, i // BS]) * BS + i % BS for i in range(L)]
    key = rng.standard_normal((len(slots), Hkv, D)).astype(np.float32)
    value = rng.standard_normal((len(slots), Hkv, D)).astype(np.float32)
    kc, vc, ks, vs = oracle.int4_reshape_and_cache(
        key, value, np.array(slots), num_blocks=NB, block_size=BS, mode_name=mode
    )
    k_deq = oracle.int4_dequantize_rows_f64(kc, ks, mode)
    v_deq = oracle.int4_dequantize_rows_f64(vc, vs, mode)
    query = rng.standard_normal((T, Hq, D)).astype(np.float32)
    kw = dict(opts)
    if kw.pop("sinks", False):
        kw["sinks"] = rng.standard_normal(Hq)
    got = oracle.int4_attention_f64(query, kc, vc, ks, vs, block_tables, seq_lens, qsl, mode_name=mode, **kw)
    ref = oracle.attention_f64(query, k_deq, v_deq, block_tables, seq_lens, qsl, **kw)
    assert np.linalg.norm(got - ref) <= 1e-12 * np.linalg.norm(ref)
    # and it is attention on the unquantized data up to int4's error
    k_exact, v_exact = _place(key, slots, NB, BS), _place(value, slots, NB, BS)
    exact = oracle.attention_f64(query, k_exact, v_exact, block_tables, seq_lens, qsl, **kw)
    assert np.linalg.norm(got - exact) <= 0.5 * np.linalg.norm(exact)


def _place(rows, slots, NB, BS):
    cache = np.zeros((NB * BS,) + rows.shape[1:], dtype=np.float64)
    cache[np.array(slots)] = rows
    return cache.reshape((NB, BS) + rows.shape[1:])
