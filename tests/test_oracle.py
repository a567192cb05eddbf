"""Tests of the oracle itself, against facts that do not come from the oracle.

The conformance suite holds every implementation to kvzoo_spec/oracle.py; this file holds the
oracle to the formats' definitions (codes decoded from their bits by formula), to ml_dtypes,
to the round-half-even rule written out by hand, to the special-value table of SPEC.md §4, and
to its own golden vectors.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from kvzoo_spec import oracle

from support import rng_for

GOLDEN = Path(__file__).resolve().parents[1] / "kvzoo_spec" / "golden"
FLOOR = np.float32(1e-6)
NAN_BITS = 0x7FC00000

# name, ml_dtypes type, exponent bias, mantissa bits, NaN codes, Inf codes (+, -), a mode using
# it, that mode's QMAX
FORMATS = {
    "e4m3fn": (ml_dtypes.float8_e4m3fn, 7, 3, {0x7F, 0xFF}, (), "fp8_per_token_head", 448.0),
    "e4m3fnuz": (ml_dtypes.float8_e4m3fnuz, 8, 3, {0x80}, (), "fp8_e4m3fnuz_per_token_head", 224.0),
    "e5m2": (
        ml_dtypes.float8_e5m2,
        15,
        2,
        {0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF},
        (0x7C, 0xFC),
        "fp8_e5m2_per_tensor",
        57344.0,
    ),
}
PTH_MODES = ("int8_per_token_head", "fp8_per_token_head", "fp8_e4m3fnuz_per_token_head")
PER_TENSOR_MODES = ("fp8_per_tensor", "int8_per_tensor", "fp8_e5m2_per_tensor")
NAN_CODE = {"int8_per_token_head": 0x00, "fp8_per_token_head": 0x7F, "fp8_e4m3fnuz_per_token_head": 0x80}


def f32_bits(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float32).view(np.uint32)


def by_definition(code: int, bias: int, nan_codes: set[int], mant: int = 3, inf_codes=()) -> float:
    """An fp8 code's value from IEEE-style field definitions, written independently."""
    if code in nan_codes:
        return math.nan
    sign = -1.0 if code >> 7 else 1.0
    if code in inf_codes:
        return sign * math.inf
    e, m = (code & 0x7F) >> mant, code & ((1 << mant) - 1)
    if e == 0:
        return sign * (m / 2**mant) * 2.0 ** (1 - bias)
    return sign * (1 + m / 2**mant) * 2.0 ** (e - bias)


def quantize_with_unit_scale(y: np.ndarray, mode: str, rounding: str = "nearest") -> np.ndarray:
    """Codes of the values y (|y| <= QMAX) when the scale is exactly 1.

    Per-token-head: the row's first element is QMAX, so absmax / QMAX = 1, inv = 1 and y reaches
    the encoder unchanged. Per-tensor: a static scale of 1, and x / 1 is x.
    """
    if mode in PER_TENSOR_MODES:
        return oracle.quantize_rows(np.asarray(y, np.float32)[None], mode, rounding=rounding, static_scale=1.0)[0][0]
    qmax = {"int8_per_token_head": 127.0, **{v[5]: v[6] for v in FORMATS.values()}}[mode]
    rows = np.empty((len(y), 2), dtype=np.float32)
    rows[:, 0] = qmax
    rows[:, 1] = y
    codes, scales = oracle.quantize_rows(rows, mode, rounding=rounding)
    assert np.all(scales == 1.0)
    return codes[:, 1]


# ---------------------------------------------------------------------------------------------
# fp8 formats


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_fp8_code_decodes_to_its_definition(fmt):
    dtype, bias, mant, nan_codes, inf_codes, mode, _ = FORMATS[fmt]
    codes = np.arange(256, dtype=np.uint8)
    expected = np.array([by_definition(c, bias, nan_codes, mant, inf_codes) for c in range(256)], dtype=np.float64)
    got = oracle.decode_rows(codes[None, :], np.ones(1, np.float32), mode)[0]
    via_ml_dtypes = codes.view(dtype).astype(np.float64)
    for actual in (got.astype(np.float64), via_ml_dtypes):
        assert np.array_equal(np.isnan(actual), np.isnan(expected))
        finite = ~np.isnan(expected)
        assert np.array_equal(actual[finite], expected[finite])
        # Signed zeros: e4m3fn and e5m2 have -0 at 0x80; e4m3fnuz has none (0x80 is its NaN).
        assert np.array_equal(np.signbit(actual[finite]), np.signbit(expected[finite]))
    assert len(nan_codes) == int(np.isnan(expected).sum())


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_midpoints_round_to_even_and_neighbours_to_nearest(fmt):
    dtype, bias, mant, nan_codes, inf_codes, mode, qmax = FORMATS[fmt]
    positive = [
        c for c in range(128) if c not in nan_codes and by_definition(c, bias, nan_codes, mant, inf_codes) <= qmax
    ]
    values = [by_definition(c, bias, nan_codes, mant, inf_codes) for c in positive]
    ys, want = [], []
    for lo_code, lo, hi in zip(positive, values, values[1:]):
        mid = np.float32((lo + hi) / 2)
        assert float(mid) == (lo + hi) / 2, "a midpoint needs one bit more than fp8: exact in float32"
        tie_code = lo_code if lo_code % 2 == 0 else lo_code + 1
        below = np.nextafter(mid, np.float32(0))
        above = np.nextafter(mid, np.float32(np.inf))
        ys += [mid, below, above]
        want += [tie_code, lo_code, lo_code + 1]
    ys = np.array(ys, dtype=np.float32)
    want = np.array(want)
    for sign in (1, -1):
        y = ys * np.float32(sign)
        expect = want | (0x80 if sign < 0 else 0)
        if fmt == "e4m3fnuz":
            expect = np.where(want == 0, 0x00, expect)  # no negative zero
        got = quantize_with_unit_scale(y, mode)
        assert np.array_equal(got, expect.astype(np.uint8))
        # ml_dtypes' cast is RNE too; it differs only where the spec fixes the sign of zero.
        ml = y.astype(dtype).view(np.uint8)
        assert np.array_equal(ml, got)


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_clamp_and_below_smallest_subnormal(fmt):
    dtype, bias, mant, nan_codes, inf_codes, mode, qmax = FORMATS[fmt]
    smallest = 2.0 ** (1 - bias - mant)
    half = np.float32(smallest / 2)
    y = np.array([half, np.nextafter(half, np.float32(1)), np.nextafter(half, np.float32(0)), 1e-30, 0.0], np.float32)
    got_pos = quantize_with_unit_scale(y, mode)
    assert list(got_pos) == [0x00, 0x01, 0x00, 0x00, 0x00]
    got_neg = quantize_with_unit_scale(-y, mode)
    neg_zero = 0x00 if fmt == "e4m3fnuz" else 0x80
    assert list(got_neg) == [neg_zero, 0x81, neg_zero, neg_zero, neg_zero]
    # Rounding that would leave the clamp range is stopped by the clamp (scale exactly 1).
    top = [c for c in range(128) if by_definition(c, bias, nan_codes, mant, inf_codes) == qmax][0]
    near_top = np.array([qmax, np.nextafter(np.float32(qmax), np.float32(0))], np.float32)
    assert list(quantize_with_unit_scale(near_top, mode)) == [top, top]


# ---------------------------------------------------------------------------------------------
# int8


@pytest.mark.parametrize("rounding", ["nearest", "trunc"])
def test_int8_ties_and_neighbours(rounding):
    n = np.arange(-128, 127)  # midpoints n + 0.5 from -127.5 to 126.5
    mids = (n + 0.5).astype(np.float32)
    mids = mids[np.abs(mids) <= 127]
    below = np.nextafter(mids, np.float32(-np.inf))
    above = np.nextafter(mids, np.float32(np.inf))
    y = np.concatenate([mids, below, above])
    floor = np.floor(mids.astype(np.float64))
    if rounding == "nearest":
        tie = np.where(floor % 2 == 0, floor, floor + 1)
        want = np.concatenate([tie, floor, floor + 1])
    else:
        want = np.trunc(y.astype(np.float64))
    got = quantize_with_unit_scale(y, "int8_per_token_head", rounding).view(np.int8)
    assert np.array_equal(got.astype(np.float64), want)


def test_trunc_only_for_int8_and_static_scale_checked():
    x = rng_for("trunc").standard_normal((2, 8)).astype(np.float32)
    # vLLM's int8_per_tensor rounds to nearest only; "trunc" is the per-token-head int8 store's.
    for mode in ("fp8_per_token_head", "fp8_e4m3fnuz_per_token_head", *PER_TENSOR_MODES):
        with pytest.raises(ValueError):
            oracle.quantize_rows(x, mode, rounding="trunc", static_scale=0.5)
    for mode in PER_TENSOR_MODES:
        for bad in (0.0, -1.0, np.inf, np.nan):
            with pytest.raises(ValueError):
                oracle.quantize_rows(x, mode, static_scale=bad)


# ---------------------------------------------------------------------------------------------
# the arithmetic of one row, restated


@pytest.mark.parametrize("mode", PTH_MODES)
def test_scale_and_inverse_are_single_float32_operations(mode):
    rng = rng_for("scale", mode)
    x = (rng.standard_normal((64, 24)) * np.exp(rng.uniform(-12, 12, (64, 1)))).astype(np.float32)
    codes, scales = oracle.quantize_rows(x, mode)
    qmax = {"int8_per_token_head": 127, "fp8_per_token_head": 448, "fp8_e4m3fnuz_per_token_head": 224}[mode]
    for row, scale in zip(x, scales):
        absmax = float(np.max(np.abs(row.astype(np.float64))))
        # Correct rounding of a quotient: float64 division then rounding to float32 is exact
        # enough (53 >= 2*24 + 2 bits), so this is an independent statement of '/'.
        q = np.float32(absmax / qmax)
        assert f32_bits(scale) == f32_bits(max(q, FLOOR))
    decoded = oracle.decode_rows(codes, scales, mode)
    assert np.all(np.isfinite(decoded))
    # The decode is code * scale in one float32 multiply.
    values = codes.view(np.int8).astype(np.float32) if mode.startswith("int8") else None
    if values is not None:
        assert np.array_equal(f32_bits(decoded), f32_bits(values * scales[:, None]))


# ---------------------------------------------------------------------------------------------
# SPEC.md §4: the special-value table


@pytest.mark.parametrize("mode", PTH_MODES)
def test_special_rows(mode):
    rng = rng_for("specials", mode)
    nan_code = NAN_CODE[mode]
    zero_neg = 0x80 if mode == "fp8_per_token_head" else 0x00
    base = rng.standard_normal(8).astype(np.float32)
    base[0] = abs(base[0]) + 0.5  # a positive and a negative finite element in known places
    base[1] = -abs(base[1]) - 0.5

    def one(row):
        codes, scales = oracle.quantize_rows(np.asarray(row, np.float32)[None], mode)
        return codes[0], scales[0], oracle.decode_rows(codes, scales, mode)[0]

    # any NaN: canonical NaN scale, every code the NaN code, all decoded NaN
    row = base.copy()
    row[4] = np.nan
    codes, scale, dec = one(row)
    assert f32_bits(scale) == NAN_BITS and np.all(codes == nan_code) and np.all(np.isnan(dec))

    # ±Inf without NaN: scale +Inf, inf elements the NaN code, finite elements the zero of their sign
    row = base.copy()
    row[2], row[3] = np.inf, -np.inf
    codes, scale, dec = one(row)
    assert scale == np.inf
    assert codes[2] == codes[3] == nan_code
    assert codes[0] == 0x00 and codes[1] == zero_neg
    assert np.all(np.isnan(dec))

    # all zeros, signed: the floor scale, zero codes keeping the sign only in e4m3fn
    row = np.where(rng.random(8) < 0.5, np.float32(0.0), np.float32(-0.0)).astype(np.float32)
    codes, scale, dec = one(row)
    assert f32_bits(scale) == f32_bits(FLOOR)
    assert np.array_equal(codes, np.where(np.signbit(row), zero_neg, 0x00).astype(np.uint8))
    assert np.all(dec == 0) and np.array_equal(np.signbit(dec), np.signbit(row) & (zero_neg == 0x80))

    # tiny rows at and below the floor: y = x * 1e6 exactly as a float32 multiply
    qmax = float(oracle.ORACLE_MODES[mode].qmax)
    for factor in (1.0, 0.25, 1e-30):
        row = (rng.uniform(-1, 1, 8) * qmax * 1e-6 * factor).astype(np.float32)
        codes, scale, _ = one(row)
        assert f32_bits(scale) == f32_bits(FLOOR)
        assert np.float32(1) / FLOOR == np.float32(1e6)
        y = row * np.float32(1e6)
        if mode.startswith("int8"):
            want = np.rint(y).astype(np.int8).view(np.uint8)
        else:
            want = y.astype(FORMATS["e4m3fn" if mode == "fp8_per_token_head" else "e4m3fnuz"][0]).view(np.uint8)
        assert np.array_equal(codes, want)

    # near float32 max: finite scale, extremes at ±QMAX, nothing overflows
    row = (rng.uniform(-1, 1, 8) * 3e38).astype(np.float32)
    row[0], row[1] = np.finfo(np.float32).max, -np.finfo(np.float32).max
    codes, scale, dec = one(row)
    # code * scale may round past FLT_MAX at ±QMAX itself (SPEC.md §4); nowhere else.
    assert np.isfinite(scale) and np.all(np.isfinite(dec[2:]))
    assert dec[0] > 0 and dec[1] < 0
    top = 0x7F if mode.startswith("int8") else 0x7E  # the code of +QMAX
    bottom = 0x81 if mode.startswith("int8") else 0xFE  # the code of -QMAX
    assert codes[0] == top and codes[1] == bottom

    # float32 subnormals inside a normal row become zero codes of their sign
    row = base.copy()
    row[5], row[6] = np.float32(1e-45), np.float32(-1e-45)
    codes, _, _ = one(row)
    assert codes[5] == 0x00 and codes[6] == zero_neg


def test_per_tensor_specials():
    s = np.float32(0.375)
    x = np.array([np.nan, np.inf, -np.inf, 3e38, 449 * 0.375, -1000.0, -0.0, 0.0, 1e-30, -1e-30], dtype=np.float32)
    codes, scales = oracle.quantize_rows(x[None], "fp8_per_tensor", static_scale=s)
    # NaN, ±Inf, and a finite x whose x / s overflows: the NaN code; beyond ±448: the clamp
    assert list(codes[0]) == [0x7F, 0x7F, 0x7F, 0x7F, 0x7E, 0xFE, 0x80, 0x00, 0x00, 0x80]
    assert np.all(scales == s)
    # y = x / s is a division: pick x where x * float32(1/s) differs from x / s.
    inv = np.float32(1) / s
    xs = rng_for("per_tensor_div").uniform(-160, 160, 4096).astype(np.float32)
    differ = xs[(xs / s) != (xs * inv)]
    assert len(differ) > 0
    codes, _ = oracle.quantize_rows(differ[None], "fp8_per_tensor", static_scale=s)
    assert np.array_equal(codes[0], (differ / s).astype(ml_dtypes.float8_e4m3fn).view(np.uint8))


SPECIAL_X = [np.nan, np.inf, -np.inf, 3e38, 449 * 0.375, -1000.0, -0.0, 0.0, 1e-30, -1e-30, 1e5 * 0.375, 61440 * 0.375]


def test_int8_per_tensor_is_vllms_rule():
    """vLLM's int8_per_tensor write: rint(x / s) clamped to [-128, 127] (its tests' reference is
    torch.round(x / s).clamp(-128, 127)); kvzoo fixes what vLLM leaves to the hardware: NaN is 0,
    an infinite y saturates like a finite one beyond the range, and there is no -0."""
    s = np.float32(0.375)
    codes, scales = oracle.quantize_rows(np.float32(SPECIAL_X)[None], "int8_per_tensor", static_scale=s)
    assert list(codes[0]) == [0x00, 0x7F, 0x80, 0x7F, 0x7F, 0x80, 0x00, 0x00, 0x00, 0x00, 0x7F, 0x7F]
    assert np.all(scales == s)
    # Every tie n + 1/2 (and its float32 neighbours) of the whole range, -128 included, and x
    # where x / s and x * (1 / s) differ: the division is what is rounded.
    n = np.arange(-130, 130, dtype=np.float64)
    ties = ((n + 0.5) * float(s)).astype(np.float32)
    xs = np.concatenate(
        [
            ties,
            np.nextafter(ties, np.float32(np.inf)),
            np.nextafter(ties, np.float32(-np.inf)),
            rng_for("int8_per_tensor").uniform(-60, 60, 4096).astype(np.float32),
        ]
    )
    codes, _ = oracle.quantize_rows(xs[None], "int8_per_tensor", static_scale=s)
    want = np.clip(np.rint((xs / s).astype(np.float64)), -128, 127).astype(np.int8)
    assert np.array_equal(codes[0].view(np.int8), want)
    assert (codes[0].view(np.int8) == -128).any() and (codes[0].view(np.int8) == 127).any()
    inv = np.float32(1) / s
    assert ((xs / s) != (xs * inv)).any()


def test_fp8_e5m2_per_tensor_specials():
    """Finite y beyond +-57344 saturates (vLLM's __NV_SATFINITE); +-Inf, from the input or from an
    x / s beyond float32, is stored as +-Inf; NaN as 0x7F; the sign of zero is kept."""
    s = np.float32(0.375)
    codes, _ = oracle.quantize_rows(np.float32(SPECIAL_X)[None], "fp8_e5m2_per_tensor", static_scale=s)
    assert list(codes[0]) == [0x7F, 0x7C, 0xFC, 0x7C, 0x5F, 0xE9, 0x80, 0x00, 0x00, 0x80, 0x7B, 0x7B]
    xs = rng_for("e5m2_per_tensor_div").uniform(-3e4, 3e4, 4096).astype(np.float32)
    codes, _ = oracle.quantize_rows(xs[None], "fp8_e5m2_per_tensor", static_scale=s)
    assert np.array_equal(codes[0], np.clip(xs / s, -57344, 57344).astype(ml_dtypes.float8_e5m2).view(np.uint8))
    assert ((xs / s) != (xs * (np.float32(1) / s))).any()


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16])
def test_input_subnormals_and_widening(dtype):
    # Every bit pattern of the 16-bit type widens exactly (ml_dtypes / numpy as the witness).
    all_bits = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    x = all_bits.view(dtype)
    wide = oracle.widen_to_float32(x)
    ref = x.astype(np.float32)
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(wide), nan)
    assert np.array_equal(f32_bits(wide[~nan]), f32_bits(ref[~nan]))
    # A row of the dtype's subnormals quantizes like their exact float32 values.
    info = ml_dtypes.finfo(dtype) if dtype is ml_dtypes.bfloat16 else np.finfo(dtype)
    row = (np.arange(1, 9) * float(info.smallest_subnormal) * np.array([1, -1] * 4)).astype(dtype)
    key = row.reshape(1, 1, 8)
    for mode in PTH_MODES:
        kc, _, ks, _ = oracle.reshape_and_cache(key, key, [0], mode_name=mode, num_blocks=1, block_size=1)
        codes, scales = oracle.quantize_rows(row.astype(np.float32)[None], mode)
        assert np.array_equal(kc.reshape(1, 8), codes) and np.array_equal(f32_bits(ks.reshape(1)), f32_bits(scales))


def test_mode_none_is_a_bit_copy():
    bits = rng_for("none").integers(0, 2**16, (3, 2, 8)).astype(np.uint16)
    bits[0, 0, 0] = 0x7FC1  # a bf16 NaN with a payload
    key = bits.view(ml_dtypes.bfloat16)
    kc, vc, ks, vs = oracle.reshape_and_cache(key, key, [2, -1, 0], mode_name="none", num_blocks=2, block_size=2)
    assert ks is None and vs is None
    got = kc.view(np.uint16)
    assert np.array_equal(got[1, 0], bits[0]) and np.array_equal(got[0, 0], bits[2])


# ---------------------------------------------------------------------------------------------
# the paged cache


def test_scatter_skips_negative_slots_and_keeps_other_bytes():
    rng = rng_for("scatter")
    NB, BS, H, D = 3, 4, 2, 8
    key = rng.standard_normal((5, H, D)).astype(np.float16)
    value = rng.standard_normal((5, H, D)).astype(np.float16)
    slots = np.array([11, -1, 0, 5, -7])
    before = [rng.integers(0, 256, (NB, BS, H, D)).astype(np.uint8) for _ in range(2)]
    sbefore = [rng.standard_normal((NB, BS, H)).astype(np.float32) for _ in range(2)]
    out = oracle.reshape_and_cache(
        key,
        value,
        slots,
        mode_name="int8_per_token_head",
        num_blocks=NB,
        block_size=BS,
        key_cache=before[0],
        value_cache=before[1],
        k_scale_cache=sbefore[0],
        v_scale_cache=sbefore[1],
    )
    written = np.zeros((NB, BS), bool)
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        b, o = divmod(int(slot), BS)
        written[b, o] = True
        for src, cache, scache in ((key, out[0], out[2]), (value, out[1], out[3])):
            codes, scales = oracle.quantize_rows(src[t].astype(np.float32), "int8_per_token_head")
            assert np.array_equal(cache[b, o], codes) and np.array_equal(scache[b, o], scales)
    for new, old in zip(out, before + sbefore):
        assert np.array_equal(new[~written], old[~written])
    assert not np.shares_memory(out[0], before[0])
    with pytest.raises(AssertionError):
        oracle.reshape_and_cache(
            key, value, [1, 1, -1, 2, 3], mode_name="int8_per_token_head", num_blocks=NB, block_size=BS
        )


def test_inline_layout_bytes():
    rng = rng_for("inline")
    NB, BS, H, D = 2, 3, 2, 8
    kc, vc = (rng.integers(0, 256, (NB, BS, H, D)).astype(np.uint8) for _ in range(2))
    ks, vs = (rng.standard_normal((NB, BS, H)).astype(np.float32) for _ in range(2))
    buf = oracle.pack_inline(kc, vc, ks, vs)
    assert buf.shape == (NB, 2, BS, H, D + 4) and buf.dtype == np.uint8
    # The views of SPEC.md §5 read the same tensors back.
    assert np.array_equal(buf[:, 0, :, :, :D], kc) and np.array_equal(buf[:, 1, :, :, :D], vc)
    f32 = buf.view(np.float32)
    assert np.array_equal(f32[:, 0, :, :, D // 4], ks) and np.array_equal(f32[:, 1, :, :, D // 4], vs)
    # little-endian scale bytes at the row's end
    b, o, h = 1, 2, 1
    assert bytes(buf[b, 1, o, h, D:]) == vs[b, o, h].astype("<f4").tobytes()
    for got, want in zip(oracle.unpack_inline(buf), (kc, vc, ks, vs)):
        assert np.array_equal(got, want)


def test_gather_order():
    rng = rng_for("gather")
    NB, BS, H, D = 5, 2, 1, 4
    codes = rng.integers(-100, 100, (NB, BS, H, D)).astype(np.int8).view(np.uint8)
    scales = rng.uniform(0.5, 2, (NB, BS, H)).astype(np.float32)
    tables = np.array([[3, 0, -1], [4, -1, -1], [1, 2, 0]])
    lens = np.array([3, 0, 6])
    out = oracle.gather_dequantize(codes, scales, tables, lens, "int8_per_token_head")
    positions = [(3, 0), (3, 1), (0, 0), (1, 0), (1, 1), (2, 0), (2, 1), (0, 0), (0, 1)]
    assert out.shape == (9, H, D)
    for row, (b, o) in zip(out, positions):
        assert np.array_equal(row, codes[b, o].view(np.int8).astype(np.float32) * scales[b, o][:, None])
    whole = oracle.decode_cache(codes, scales, "int8_per_token_head")
    assert np.array_equal(whole[3, 1], out[1])


# ---------------------------------------------------------------------------------------------
# attention


def dense_attention(q, keys, vals, q_pos, scale, window, softcap, sinks, group):
    """Masked dense softmax (a different formulation from the oracle's loops): [Tq, Hq, D]."""
    Tq, Hq, _ = q.shape
    kv_head = np.arange(Hq) // group
    logits = np.einsum("thd,khd->htk", q, keys[:, kv_head]) * scale
    if softcap is not None:
        logits = softcap * np.tanh(logits / softcap)
    k_pos = np.arange(keys.shape[0])
    mask = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    logits = np.where(mask[None], logits, -np.inf)
    extra = np.full((Hq, Tq, 1), -np.inf) if sinks is None else np.broadcast_to(sinks[:, None, None], (Hq, Tq, 1))
    both = np.concatenate([logits, extra], axis=2)
    p = np.exp(both - both.max(axis=2, keepdims=True))
    p = p / p.sum(axis=2, keepdims=True)
    return np.einsum("htk,khd->thd", p[:, :, :-1], vals[:, kv_head])


@pytest.mark.parametrize(
    "window,softcap,use_sinks", [(None, None, False), (3, None, False), (None, 5.0, True), (2, 2.0, True)]
)
def test_attention_against_dense_masked_softmax(window, softcap, use_sinks):
    rng = rng_for("attention", window, softcap, use_sinks)
    NB, BS, Hkv, group, D = 8, 3, 2, 4, 6
    Hq = Hkv * group
    k_deq = rng.standard_normal((NB, BS, Hkv, D))
    v_deq = rng.standard_normal((NB, BS, Hkv, D))
    seq_lens = np.array([7, 1, 5, 4])
    q_lens = np.array([7, 1, 2, 0])  # prefill, decode, chunked prefill, no query
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    tables = np.stack([rng.permutation(NB)[:3] for _ in seq_lens])
    q = rng.standard_normal((qsl[-1], Hq, D)).astype(np.float32)
    sinks = rng.standard_normal(Hq) if use_sinks else None
    got = oracle.attention_f64(
        q, k_deq, v_deq, tables, seq_lens, qsl, sliding_window=window, softcap=softcap, sinks=sinks
    )
    for s, (n, ql) in enumerate(zip(seq_lens, q_lens)):
        keys = np.array([k_deq[tables[s, i // BS], i % BS] for i in range(n)])
        vals = np.array([v_deq[tables[s, i // BS], i % BS] for i in range(n)])
        q_pos = n - ql + np.arange(ql)
        want = dense_attention(
            q[qsl[s] : qsl[s + 1]].astype(np.float64),
            keys,
            vals,
            q_pos,
            1 / math.sqrt(D),
            window,
            softcap,
            sinks,
            group,
        )
        np.testing.assert_allclose(got[qsl[s] : qsl[s + 1]], want, rtol=1e-12, atol=1e-12)


def test_attention_poison_reaches_the_output():
    rng = rng_for("attention_nan")
    k = rng.standard_normal((2, 2, 1, 4))
    v = rng.standard_normal((2, 2, 1, 4))
    q = rng.standard_normal((4, 1, 4))
    # A NaN value element poisons that output element of every query that sees it.
    v[0, 1, 0, 2] = np.nan  # position 1 of the sequence
    out = oracle.attention_f64(q, k, v, [[0, 1]], [4], [0, 4])
    assert np.all(np.isfinite(out[0])) and np.all(np.isnan(out[1:, :, 2]))
    assert np.all(np.isfinite(out[1:, :, [0, 1, 3]]))
    # A NaN in a key poisons the whole output row of every query that sees it.
    v[0, 1, 0, 2] = 1.0
    k[1, 0, 0, 3] = np.nan  # position 2
    out = oracle.attention_f64(q, k, v, [[0, 1]], [4], [0, 4])
    assert np.all(np.isfinite(out[:2])) and np.all(np.isnan(out[2:]))


# ---------------------------------------------------------------------------------------------
# golden vectors


def _load_make_golden():
    spec = importlib.util.spec_from_file_location("make_golden", GOLDEN / "make_golden.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_golden_files_regenerate_identically():
    assert _load_make_golden().check(GOLDEN) == []


def _golden_decode(codes, scales, mode):
    """What dequantize returns for golden rows: the oracle's decode (int4: stored-domain decode,
    un-rotated in float32, SPEC.md 3.5)."""
    if mode not in oracle.INT4_MODES:
        return oracle.decode_rows(codes, scales, mode)
    decoded = oracle.int4_decode_rows(codes, scales)
    return oracle.int4_unrotate(decoded) if mode == "int4_per_token_head" else decoded


def test_golden_rows_decode_and_cover_the_specials():
    files = sorted(GOLDEN.glob("rows-*.npz"))
    assert len(files) == 27
    for path in files:
        with np.load(path) as z:
            meta = json.loads(str(z["meta"]))
            mode = meta["mode"]
            int4 = mode in oracle.INT4_MODES
            decoded = _golden_decode(z["codes"], z["scales"].view(np.float32), mode)
            nan = np.isnan(decoded)
            stored = z["decoded"].view(np.float32)
            assert np.array_equal(nan, np.isnan(stored)) and np.all(z["decoded"][nan] == NAN_BITS)
            assert np.array_equal(f32_bits(decoded)[~nan], z["decoded"][~nan])
            x = oracle.widen_to_float32(
                z["x"].view(
                    {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}[meta["dtype"]]
                )
            )
            # The specials are present: NaN, both infinities, both zeros, subnormals, huge values.
            assert np.isnan(x).any() and np.isposinf(x).any() and np.isneginf(x).any()
            assert ((x == 0) & np.signbit(x)).any() and ((x == 0) & ~np.signbit(x)).any()
            tiny = float(np.finfo(np.float16).smallest_normal) if meta["dtype"] == "float16" else 1.1754944e-38
            assert ((np.abs(x) < tiny) & (x != 0)).any()
            assert (np.abs(x[np.isfinite(x)]) > 6e4).any()
            if int4:
                # The scale word's low 4 bits hold the zero point (SPEC.md 5.3).
                floor_words = (z["scales"] & np.uint32(0xFFFFFFF0)) == (f32_bits(FLOOR) & 0xFFFFFFF0)
                assert floor_words.any() and (z["scales"] == NAN_BITS).any()
                assert z["codes"].shape == (x.shape[0], x.shape[1] // 2)
                assert len(np.unique(z["scales"] & 0xF)) >= 8, "zero points of many values"
            elif oracle.ORACLE_MODES[mode].granularity != "per_tensor":
                assert (z["scales"] == f32_bits(FLOOR)).any() and (z["scales"] == NAN_BITS).any()
