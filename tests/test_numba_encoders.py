"""The Numba backend's own number formats, held against ml_dtypes bit for bit.

The conformance suite checks whole operations; this file checks the element encoders and
decoders on every code and every rounding boundary (and, marked slow, on all 2^32 float32
bit patterns), that fastmath is off where bytes matter, and that the registry prefers numba
on a CPU and falls back to NumPy without it.
"""

from __future__ import annotations

import sys

import ml_dtypes
import numpy as np
import pytest

numba = pytest.importorskip("numba")

from kvzoo import registry as registry_module  # noqa: E402
from kvzoo.backends import numba_cpu  # noqa: E402
from kvzoo.backends.numba_cpu import formats as bits  # noqa: E402
from kvzoo.backends.numba_cpu import kernels  # noqa: E402
from kvzoo.formats import FORMATS  # noqa: E402
from kvzoo.modes import MODES  # noqa: E402

from support import rng_for  # noqa: E402

POISON = 0x55
# (format code, ml_dtypes type, largest finite value, the spec's NaN code)
FP8_FORMATS = {
    "e4m3fn": (bits.E4M3FN, ml_dtypes.float8_e4m3fn, 448.0, 0x7F),
    "e4m3fnuz": (bits.E4M3FNUZ, ml_dtypes.float8_e4m3fnuz, 240.0, 0x80),
    "e5m2": (bits.E5M2, ml_dtypes.float8_e5m2, 57344.0, 0x7F),
}

# The bytes the spec stores for y = NaN, +Inf, -Inf per format code, written out here rather
# than read from kvzoo.formats (int8: NaN 0, its scale is NaN; the infinities saturate).
_SPECIAL_CODES = {
    bits.I8: (0, 0x7F, 0x80),
    bits.E4M3FN: (0x7F, 0x7F, 0x7F),
    bits.E4M3FNUZ: (0x80, 0x80, 0x80),
    bits.E5M2: (0x7F, 0x7C, 0xFC),
    # uint4 rows have their own encoder (tests/test_numba_int4.py): a poisoned row's codes are 0
    # under a NaN scale word; no uint4 mode has a static scale, so no y is ever infinite.
    bits.U4: (0, 15, 0),
}


def test_special_codes_are_the_format_rows():
    kinds = numba_cpu.FORMAT_KINDS
    for name, kind in kinds.items():
        fmt = FORMATS[name]
        assert _SPECIAL_CODES[kind] == (fmt.nan_code, *fmt.inf_codes), name


def _encode(y: np.ndarray, fmt: int, qmax: float, qmin: float, trunc: bool = False) -> np.ndarray:
    y = np.ascontiguousarray(y, dtype=np.float32)
    out = np.full(y.shape, POISON, dtype=np.uint8)
    kernels.encode_codes_array(
        y, out, np.int64(fmt), trunc, np.float32(qmax), np.float32(qmin), *(np.int32(c) for c in _SPECIAL_CODES[fmt])
    )
    return out


def _expected_fp8(y: np.ndarray, ml_type, qmax: float, fmt: int) -> np.ndarray:
    """The spec through ml_dtypes: clamp, one RNE cast; NaN and +-Inf -> the format's codes;
    fnuz has no -0."""
    nan_code, inf_pos, inf_neg = _SPECIAL_CODES[fmt]
    finite = np.isfinite(y)
    clamped = np.clip(np.where(finite, y, 0), np.float32(-qmax), np.float32(qmax)).astype(np.float32)
    codes = clamped.astype(ml_type).view(np.uint8)
    if ml_type == ml_dtypes.float8_e4m3fnuz:
        codes = np.where(codes == 0x80, np.uint8(0), codes)  # ml_dtypes' "-0" is fnuz NaN
    special = np.where(np.isnan(y), np.uint8(nan_code), np.where(y > 0, np.uint8(inf_pos), np.uint8(inf_neg)))
    return np.where(finite, codes, special)


def _boundaries(ml_type) -> np.ndarray:
    """Every midpoint between adjacent finite codes (both signs), each with its two float32
    neighbours, plus the codes themselves, zero's neighbourhood and out-of-range values."""
    codes = np.arange(256, dtype=np.uint8).view(ml_type).astype(np.float32)
    values = np.unique(codes[np.isfinite(codes)])  # sorted, both signs, one zero
    mids = ((values[:-1].astype(np.float64) + values[1:]) / 2).astype(np.float32)
    assert np.array_equal(mids.astype(np.float64), (values[:-1].astype(np.float64) + values[1:]) / 2)
    tiny = np.float32(np.finfo(np.float32).smallest_subnormal)
    extra = np.array(
        [
            0.0,
            -0.0,
            tiny,
            -tiny,
            np.finfo(np.float32).tiny,
            1e30,
            -1e30,
            465.0,
            464.0,
            250.0,
            -250.0,
            61440.0,
            -61440.0,
            65504.0,
            65536.0,
            1e5,
        ],
        dtype=np.float32,
    )
    base = np.concatenate([values, mids, extra])
    up = np.nextafter(base, np.float32(np.inf))
    down = np.nextafter(base, np.float32(-np.inf))
    return np.concatenate([base, up, down]).astype(np.float32)


@pytest.mark.parametrize("name", sorted(FP8_FORMATS))
def test_fp8_every_rounding_boundary(name):
    fmt, ml_type, qmax, nan_code = FP8_FORMATS[name]
    y = _boundaries(ml_type)
    got = _encode(y, fmt, qmax, -qmax)
    want = _expected_fp8(y, ml_type, qmax, fmt)
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, [(float(y[i]), hex(got[i]), hex(want[i])) for i in bad[:10]]


@pytest.mark.parametrize("name", sorted(FP8_FORMATS))
def test_fp8_random_values_and_specials(name):
    fmt, ml_type, qmax, nan_code = FP8_FORMATS[name]
    rng = rng_for("numba fp8 random values", name)
    n = 1 << 20
    y = (rng.standard_normal(n) * np.exp2(rng.integers(-24, 10, n))).astype(np.float32)
    y[:6] = [np.nan, -np.nan, np.inf, -np.inf, -0.0, 0.0]
    got = _encode(y, fmt, qmax, -qmax)
    assert np.array_equal(got, _expected_fp8(y, ml_type, qmax, fmt))
    assert got[0] == got[1] == nan_code
    assert (got[2], got[3]) == ((0x7C, 0xFC) if name == "e5m2" else (nan_code, nan_code))
    assert got[4] == (0x00 if name == "e4m3fnuz" else 0x80)
    assert got[5] == 0x00


@pytest.mark.parametrize("name", sorted(FP8_FORMATS))
def test_fp8_every_code_round_trips(name):
    fmt, ml_type, qmax, nan_code = FP8_FORMATS[name]
    codes = np.arange(256, dtype=np.uint8)
    decoded = np.full(256, np.float32(1234.5), dtype=np.float32)
    kernels.decode_codes_array(codes, np.int64(fmt), decoded)
    want = codes.view(ml_type).astype(np.float32)
    same = (decoded.view(np.uint32) == want.view(np.uint32)) | (np.isnan(decoded) & np.isnan(want))
    assert same.all(), codes[~same]
    # Every finite code encodes back to itself (the one zero of fnuz aside).
    finite = np.isfinite(decoded)
    back = _encode(decoded[finite], fmt, qmax, -qmax)
    expect = codes[finite]
    if name == "e4m3fnuz":
        assert not finite[0x80]
    assert np.array_equal(back, expect)


def test_int8_codes_and_rounding_boundaries():
    codes = np.arange(256, dtype=np.uint8)
    decoded = np.full(256, np.nan, dtype=np.float32)
    kernels.decode_codes_array(codes, np.int64(bits.I8), decoded)
    assert np.array_equal(decoded, codes.view(np.int8).astype(np.float32))

    halves = np.arange(-131, 131, 0.5, dtype=np.float32)
    y = np.concatenate([halves, np.nextafter(halves, np.inf), np.nextafter(halves, -np.inf)])
    y = np.concatenate([y, np.float32([np.nan, np.inf, -np.inf, -0.0, 1e-45, 1e30, -1e30])]).astype(np.float32)
    nan = np.isnan(y)
    # An infinite y saturates like any other beyond the range; NaN is code 0.
    clamped = np.clip(np.where(nan, 0, y), -128, 127).astype(np.float32)
    for trunc, rule in ((False, np.rint), (True, np.trunc)):
        got = _encode(y, bits.I8, 127.0, -128.0, trunc=trunc)
        want = np.where(nan, np.uint8(0), rule(clamped).astype(np.int8).view(np.uint8))
        assert np.array_equal(got, want), trunc


def test_half_and_bfloat16_widening_is_exact():
    every = np.arange(1 << 16, dtype=np.uint16)
    for kind, dtype in ((bits.F16, np.float16), (bits.BF16, ml_dtypes.bfloat16)):
        out = np.full(every.shape, np.float32(7.0), dtype=np.float32)
        kernels.decode_codes_array(every, np.int64(kind), out)
        want = every.view(dtype).astype(np.float32)
        same = (out.view(np.uint32) == want.view(np.uint32)) | (np.isnan(out) & np.isnan(want))
        assert same.all(), every[~same][:10]


def _every_float32_pattern(encode, expected):
    """encode(y) == expected(y) for y over all 2^32 float32 bit patterns, in chunks."""
    chunk = 1 << 24
    for start in range(0, 1 << 32, chunk):
        y = np.arange(start, start + chunk, dtype=np.uint64).astype(np.uint32).view(np.float32)
        got = encode(y)
        with np.errstate(invalid="ignore"):
            want = expected(y)
        if not np.array_equal(got, want):
            i = int(np.nonzero(got != want)[0][0])
            pytest.fail(f"bits {start + i:#010x}: got {got[i]:#04x}, want {want[i]:#04x}")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FP8_FORMATS))
def test_fp8_all_float32_bit_patterns(name):
    fmt, ml_type, qmax, nan_code = FP8_FORMATS[name]
    _every_float32_pattern(lambda y: _encode(y, fmt, qmax, -qmax), lambda y: _expected_fp8(y, ml_type, qmax, fmt))


@pytest.mark.slow
@pytest.mark.parametrize("trunc", [False, True], ids=["nearest", "trunc"])
def test_int8_all_float32_bit_patterns(trunc):
    """int8 (both modes' encoder): NaN 0, everything else clamped to [-128, 127] (an infinity
    too) and rounded half to even, or toward zero."""
    rule = np.trunc if trunc else np.rint

    def expected(y):
        nan = np.isnan(y)
        clamped = np.clip(np.where(nan, 0, y), -128, 127).astype(np.float32)
        return np.where(nan, np.uint8(0), rule(clamped).astype(np.int8).view(np.uint8))

    _every_float32_pattern(lambda y: _encode(y, bits.I8, 127.0, -128.0, trunc=trunc), expected)


# ----------------------------------------------------------------------------------------------
# fastmath
# ----------------------------------------------------------------------------------------------

BYTE_EXACT_KERNELS = ("write", "dequantize", "encode_codes_array", "decode_codes_array")


@pytest.mark.parametrize("name", [*BYTE_EXACT_KERNELS, "attention"])
def test_fastmath_is_off(name):
    dispatcher = getattr(kernels, name)
    assert dispatcher.targetoptions.get("fastmath", False) is False


def test_only_attention_products_relax_rounding():
    # Reassociation / contraction only: no flag that changes NaN, Inf or signed-zero handling.
    assert set(kernels._scores.targetoptions["fastmath"]) == {"reassoc", "contract"}
    assert set(kernels._accumulate.targetoptions["fastmath"]) == {"contract"}
    for leaf in (kernels._softmax_tile, kernels._attention_item, kernels._quantize_row, kernels._decode_row_any):
        assert leaf.targetoptions.get("fastmath", False) is False


def test_vectorizable_exp_matches_libm():
    @numba.njit
    def exps(x, out):
        for i in range(x.shape[0]):
            out[i] = kernels._exp_nonpositive(x[i])

    x = np.concatenate([-np.geomspace(1e-8, 120, 200_000), [0.0, -0.0, -np.inf, np.nan, -87.0, -86.99]])
    x = x.astype(np.float32)
    out = np.empty_like(x)
    exps(x, out)
    want = np.exp(x.astype(np.float64))
    # Results for x < -87 (near the bottom of the float32 normals) flush to 0.
    normal = want >= np.exp(-87.0)
    rel = np.abs(out[normal] - want[normal]) / want[normal]
    assert rel.max() < 5e-7
    assert np.abs(out[~normal & ~np.isnan(x)] - want[~normal & ~np.isnan(x)]).max() < 2e-38
    assert out[-4] == 0.0 and np.isnan(out[-3])


def test_byte_exact_llvm_has_no_fast_math_flags():
    # Numba returns no IR for code loaded from its disk cache, so compile afresh with the
    # dispatcher's own options (cache off) and check that there is IR to read.
    options = {k: v for k, v in kernels.encode_codes_array.targetoptions.items() if k != "nopython"}
    fresh = numba.njit(**options, cache=False)(kernels.encode_codes_array.py_func)
    y = np.float32([1.0, -0.0, np.nan])
    out = np.empty(y.shape, np.uint8)
    fresh(
        y,
        out,
        np.int64(bits.E4M3FN),
        False,
        np.float32(448.0),
        np.float32(-448.0),
        np.int32(0x7F),
        np.int32(0x7F),
        np.int32(0x7F),
    )
    irs = list(fresh.inspect_llvm().values())
    assert irs and all("fmul" in ir and "fcmp" in ir for ir in irs), "no compiled IR to inspect"
    for ir in irs:
        for flag in ("fast ", "nnan", "ninf", "nsz", "reassoc", "contract", "afn", "arcp"):
            assert f"fmul {flag}" not in ir and f"fadd {flag}" not in ir and f"fcmp {flag}" not in ir


def test_signed_zero_and_nan_rows_follow_the_spec():
    import kvzoo
    from kvzoo.layout import allocate_separate

    rng = rng_for("numba signed zero and nan rows")
    heads, d, bs = 2, 16, 4
    key = rng.standard_normal((3, heads, d)).astype(np.float32)
    key[0, 0] = -0.0  # an all -0.0 row: scale = floor, every y = -0.0
    key[1, 1, 5] = np.nan  # a poisoned row
    value = rng.standard_normal((3, heads, d)).astype(np.float32)
    for mode, neg_zero in (("fp8_per_token_head", 0x80), ("fp8_e4m3fnuz_per_token_head", 0x00)):
        cache = allocate_separate(2, bs, heads, d, mode, device=None)
        for a in (cache.key_cache, cache.value_cache):
            a.view(np.uint8)[...] = POISON
        kvzoo.reshape_and_cache(
            key,
            value,
            cache.key_cache,
            cache.value_cache,
            np.arange(3),
            mode=mode,
            k_scale_cache=cache.k_scale_cache,
            v_scale_cache=cache.v_scale_cache,
            impl="numba",
        )
        codes = cache.key_cache.view(np.uint8)
        scales = cache.k_scale_cache.view(np.uint32)
        assert (codes[0, 0, 0] == neg_zero).all()
        assert scales[0, 0, 0] == np.float32(1e-6).view(np.uint32)
        assert (codes[0, 1, 1] == MODES[mode].nan_code).all()
        assert scales[0, 1, 1] == 0x7FC00000


@pytest.mark.parametrize("mode", [m for m in MODES if MODES[m].per_tensor])
def test_per_tensor_specials_follow_the_spec(mode):
    """NaN, +-Inf and an x / s that overflows float32, through the whole write (the checked
    loop of a static scale), byte for byte the oracle's."""
    import kvzoo
    from kvzoo.layout import allocate_separate
    from kvzoo_spec import oracle

    d = 16
    row = np.float32(
        [np.nan, np.inf, -np.inf, 3e38, -3e38, -0.0, 0.0, 1e-45, -1e-45, 1e5, -1e5, 2.5, -2.5, 7.0, 65504.0, 0.1875]
    )
    key = np.stack([row, row[::-1].copy()]).reshape(2, 1, d)
    s = np.float32(0.375)
    cache = allocate_separate(1, 2, 1, d, mode, device=None)
    kvzoo.reshape_and_cache(
        key, key, cache.key_cache, cache.value_cache, np.arange(2), mode=mode, k_scale=s, v_scale=s, impl="numba"
    )
    want, _ = oracle.quantize_rows(key.reshape(2, d), mode, static_scale=s)
    assert np.array_equal(cache.key_cache.view(np.uint8).reshape(2, d), want)
    assert np.array_equal(cache.value_cache.view(np.uint8).reshape(2, d), want)


# ----------------------------------------------------------------------------------------------
# registry
# ----------------------------------------------------------------------------------------------


def _fresh_registry() -> registry_module.Registry:
    return registry_module.Registry().load(registry_module.BACKEND_MODULES)


@pytest.mark.parametrize("op", ["reshape_and_cache", "dequantize", "paged_attention"])
def test_best_on_cpu_is_numba_then_numpy_without_it(op, monkeypatch):
    for mode in MODES:
        if MODES[mode].split and op == "dequantize":
            continue  # dequantize reads one cache in one side's mode: no split mode is taken
        assert _fresh_registry().best(op, mode, "cpu").name == "numba"

    monkeypatch.setenv(numba_cpu.DISABLE_ENV, "1")
    reg = _fresh_registry()
    assert reg.best(op, "int8_per_token_head", "cpu").name == "numpy"
    assert "KVZOO_DISABLE_NUMBA" in " ".join(reg.get(op, "numba").unavailable())
    monkeypatch.delenv(numba_cpu.DISABLE_ENV)

    # As if numba were not installed: importlib finds no spec for it.
    monkeypatch.setitem(sys.modules, "numba", None)
    reg = _fresh_registry()
    assert reg.best(op, "fp8_per_token_head", "cpu").name == "numpy"
    assert reg.get(op, "numba").unavailable() == ["numba: not installed (pip install numba)"]
