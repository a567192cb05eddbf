"""The code-format objects (kvzoo.formats) against the oracle's own definitions, and every
backend's table of formats.

kvzoo_spec/oracle.py defines its modes and fp8 fields independently of kvzoo; these tests hold
kvzoo.formats to it, so a wrong constant in a format row fails here before any backend runs.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvzoo import modes as kvzoo_modes
from kvzoo import registry
from kvzoo.formats import FORMATS
from kvzoo.modes import MODES
from kvzoo_spec import oracle

from support import rng_for

CODED_MODES = [name for name, m in MODES.items() if m.format is not None]
# The oracle states int4 (SPEC.md section 2's int4 rows) in functions of its own beside ORACLE_MODES.
TABLE_MODES = [name for name in CODED_MODES if name in oracle.ORACLE_MODES]
INT4_MODES = list(oracle.INT4_MODES)


def test_every_mode_is_an_oracle_mode_with_the_same_constants():
    assert set(MODES) == set(oracle.ORACLE_MODES) | set(oracle.INT4_MODES) | set(oracle.SPLIT_MODES)
    for name, mode in MODES.items():
        if name in oracle.SPLIT_MODES:
            assert (mode.key_side.name, mode.value_side.name) == oracle.SPLIT_MODES[name]
            assert mode.granularity == "per_token_head" and not (mode.key_side.split or mode.value_side.split)
            continue
        assert not mode.split and mode.key_side is mode.value_side is mode
        assert mode.rotation == ("rht" if name == "int4_per_token_head" else None)
        if name in oracle.INT4_MODES:
            assert mode.granularity == "per_token_head" and mode.format.storage_dtype == "uint8"
            assert (mode.qmin, mode.qmax) == (0, oracle.INT4_QMAX) and mode.roundings == ("nearest",)
            assert mode.scale_floor == oracle.SCALE_FLOOR
            continue
        spec = oracle.ORACLE_MODES[name]
        assert mode.granularity == spec.granularity
        assert (None if mode.format is None else mode.format.storage_dtype) == spec.code
        assert np.float32(mode.qmax) == spec.qmax and np.float32(mode.qmin) == spec.qmin
        assert mode.nan_code == spec.nan_code
        assert mode.roundings == spec.roundings
        assert mode.scale_floor == oracle.SCALE_FLOOR


@pytest.mark.parametrize("name", TABLE_MODES)
def test_non_finite_codes_are_the_oracle_encoding_of_nan_and_inf(name):
    """The format row's NaN and +-Inf bytes are what the oracle's encoder, from its own rules,
    stores for y = NaN, +Inf and -Inf (every format: a per-token-head row never reaches +-Inf,
    a per-tensor one does)."""
    mode = MODES[name]
    y = np.float32([np.nan, -np.nan, np.inf, -np.inf])
    codes = oracle._encode_y(y, oracle.ORACLE_MODES[name], "nearest")
    assert list(codes) == [mode.nan_code, mode.nan_code, *mode.inf_codes]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_inf_codes_follow_the_format(name):
    """Infinities where the format has them, its NaN where it has none, the ends of the range
    for int8 (which has neither)."""
    fmt = FORMATS[name]
    values = fmt.code_values()
    pos, neg = fmt.inf_codes
    if fmt.kind == "int":
        assert not np.isnan(values).any()
        assert (values[pos], values[neg]) == (fmt.qmax, fmt.qmin)
    elif np.isinf(values).any():
        assert (values[pos], values[neg]) == (np.inf, -np.inf)
    else:
        assert pos == neg == fmt.nan_code
    if fmt.kind == "float":
        assert fmt.nan_code in fmt.nan_codes


@pytest.mark.parametrize("name", TABLE_MODES)
def test_code_values_are_the_oracle_decoding_of_every_byte(name):
    fmt = MODES[name].format
    codes = np.arange(2**fmt.bits, dtype=np.uint8)[None, :]
    want = oracle.decode_rows(codes, np.ones(1, np.float32), name)[0].astype(np.float64)
    got = fmt.code_values()
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(got[~np.isnan(got)], want[~np.isnan(want)])
    assert fmt.nan_codes == tuple(int(c) for c in np.flatnonzero(np.isnan(want)))


@pytest.mark.parametrize("name", TABLE_MODES)
def test_midpoints_round_away_as_the_oracle_rounds(name):
    """Values just below and just above each midpoint of the format object encode (in the
    oracle) to its two neighbours, and representable values encode to themselves. Only
    |y| <= qmax can reach the oracle's encoder with a scale of exactly 1 (int8's -128 cannot)."""
    fmt = MODES[name].format
    values = fmt.representable()
    values = values[np.abs(values) <= fmt.qmax]
    mids = (values[1:] + values[:-1]) / 2
    assert set(mids) <= set(fmt.midpoints())
    mids32 = mids.astype(np.float32)
    assert np.all(mids32.astype(np.float64) == mids), "midpoints must be exact in float32"
    for y, side in ((np.nextafter(mids32, -np.inf), 0), (np.nextafter(mids32, np.inf), 1)):
        codes = _oracle_codes(name, y)
        got = oracle.decode_rows(codes[None, :], np.ones(1, np.float32), name)[0].astype(np.float64)
        assert np.array_equal(got, values[np.arange(len(mids)) + side])
    assert np.array_equal(fmt.codes_of(values), _oracle_codes(name, values.astype(np.float32)))


def _oracle_codes(name: str, y: np.ndarray) -> np.ndarray:
    # A row of [qmax, y...] has scale exactly 1, so y reaches the encoder unchanged.
    qmax = np.float32(oracle.ORACLE_MODES[name].qmax)
    if MODES[name].per_tensor:
        return oracle.quantize_rows(y[None, :], name, static_scale=np.float32(1.0))[0][0]
    rows = np.concatenate([[qmax], y]).astype(np.float32)[None, :]
    codes, scales = oracle.quantize_rows(rows, name)
    assert scales[0] == 1.0
    return codes[0, 1:]


# ---------------------------------------------------------------------------------------------
# uint4: packing and the zero point in the scale word (SPEC.md 5.3), against the oracle's own


@pytest.mark.parametrize("name", INT4_MODES)
def test_uint4_rows_match_the_oracle_definitions(name):
    fmt = MODES[name].format
    assert fmt is FORMATS["uint4"] and (fmt.bits, fmt.signed, fmt.codes_per_byte) == (4, False, 2)
    assert fmt.storage_width(128) == 64 and fmt.head_size_of(64) == 128
    assert fmt.code_values().tolist() == list(range(16)) and fmt.nan_codes == ()
    assert fmt.midpoints().tolist() == [n + 0.5 for n in range(15)]
    # Every byte, both ways.
    all_bytes = np.arange(256, dtype=np.uint8).reshape(16, 16)
    assert np.array_equal(fmt.unpack(all_bytes), oracle.int4_unpack(all_bytes))
    rng = rng_for("uint4 rows", name)
    codes = rng.integers(0, 16, (5, 3, 64), dtype=np.uint8)
    assert np.array_equal(fmt.pack(codes), oracle.int4_pack(codes))
    assert np.array_equal(fmt.unpack(fmt.pack(codes)), codes)
    # Every 32-bit word splits as the oracle splits it; scale_words puts the zero point back.
    words = rng.integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32).view(np.float32)
    scale, zp = fmt.split_scale_words(words)
    want_scale, want_zp = oracle.int4_split_scale(words)
    assert np.array_equal(scale.view(np.uint32), want_scale.view(np.uint32)) and np.array_equal(zp, want_zp)
    assert np.array_equal(fmt.scale_words(scale, zp).view(np.uint32), words.view(np.uint32))
    # The value of code c in a row of zero point zp is c - zp, as the oracle decodes it.
    for z in range(16):
        word = fmt.scale_words(np.ones(1, np.float32), np.array([z]))
        decoded = oracle.int4_decode_rows(oracle.int4_pack(np.arange(16, dtype=np.uint8))[None], word)[0]
        assert np.array_equal(decoded, fmt.code_values() - z)


@pytest.mark.parametrize("name", INT4_MODES)
def test_int4_head_sizes_and_rotation_signs_are_the_oracles(name):
    mode = MODES[name]
    for d in range(0, 1100):
        try:
            oracle.int4_rht_signs(d)
            oracle_takes = True
        except ValueError:
            oracle_takes = False
        # The oracle's rotation takes every even size; _norot keeps the powers of two among them.
        want = oracle_takes and (mode.rotation is not None or d & (d - 1) == 0)
        assert mode.head_sizes.takes(d) == want, d
    for d in [2**k for k in range(1, 10)] + [6, 80, 96, 192, 510]:
        assert np.array_equal(kvzoo_modes.rht_signs(d), oracle.int4_rht_signs(d))
        assert np.array_equal(kvzoo_modes.rht_block_sizes(d), oracle.int4_rht_block_sizes(d))
    # A uint4 poisoned row stores code 0 everywhere under the canonical NaN word.
    codes, word = oracle.int4_quantize_row_f32(np.array([1.0, np.nan, 2.0, 3.0], np.float32))
    assert (codes == mode.nan_code).all() and int(word) == kvzoo_modes.CANONICAL_NAN_BITS


def test_storage_widths_and_scale_shapes():
    for fmt in FORMATS.values():
        assert fmt.codes_per_byte * fmt.bits == 8
        for d in (1, 7, 64, 67, 256):
            assert fmt.storage_width(d) * fmt.codes_per_byte >= d > (fmt.storage_width(d) - 1) * fmt.codes_per_byte
    assert MODES["int8_per_token_head"].scale_shape(3, 16, 2) == (3, 16, 2)
    assert MODES["fp8_per_tensor"].scale_shape(3, 16, 2) == (1,)
    assert MODES["int8_per_tensor"].scale_shape(3, 16, 2) == MODES["fp8_e5m2_per_tensor"].scale_shape(3, 16, 2) == (1,)
    assert MODES["none"].scale_shape(3, 16, 2) is None
    assert MODES["int4_per_token_head"].scale_shape(3, 16, 2) == (3, 16, 2)
    assert MODES["int4_per_token_head"].cache_width(128) == 64


def format_table() -> dict[str, dict[str, object]]:
    """{implementation/op: {format: that backend's own code for it, or None}}."""
    table = {}
    for impl in registry.implementations():
        declared = impl.capabilities.formats
        table[f"{impl.name}/{impl.op}"] = {f: declared.get(f) for f in FORMATS}
    return table


def test_format_table_every_backend(capsys):
    """Each backend's code for every format, printed; a format missing from a backend's table
    is a mode it does not register (a declared refusal), never one it registers."""
    table = format_table()
    with capsys.disabled():
        print("\nformat table (backend code per format; - = declined):")
        for key, row in table.items():
            print(f"  {key:36s} " + "  ".join(f"{f}={'-' if c is None else c}" for f, c in row.items()))
    for impl in registry.implementations():
        declared = impl.capabilities.formats
        for mode_name in impl.modes:
            fmt = MODES[mode_name].format
            assert fmt is None or fmt.name in declared, (
                f"{impl.name} registers {mode_name} but has no code for format {fmt.name}"
            )
        for fmt_name in declared:
            assert fmt_name in FORMATS, f"{impl.name} declares an unknown format {fmt_name}"
    # Every format has at least one backend on every machine: the NumPy one.
    numpy_rows = [row for key, row in table.items() if key.startswith("numpy/")]
    assert numpy_rows and all(all(c is not None for c in row.values()) for row in numpy_rows)


@pytest.mark.parametrize("name", [f.name for f in FORMATS.values() if f.kind == "float"])
def test_float_fields_describe_the_values(name):
    """sign | exponent_bits | mantissa_bits with exponent_bias give every finite code's value."""
    fmt = FORMATS[name]
    assert 1 + fmt.exponent_bits + fmt.mantissa_bits == fmt.bits
    values = fmt.code_values()
    for code in range(2**fmt.bits):
        if np.isnan(values[code]):
            continue
        sign = -1.0 if code >> (fmt.bits - 1) else 1.0
        e = (code >> fmt.mantissa_bits) & (2**fmt.exponent_bits - 1)
        m = code & (2**fmt.mantissa_bits - 1)
        frac = m / 2**fmt.mantissa_bits
        if np.isinf(values[code]):
            # IEEE-style formats spend the top exponent on Inf (mantissa 0) and NaN.
            assert e == 2**fmt.exponent_bits - 1 and m == 0 and values[code] == sign * np.inf, (name, code)
            continue
        want = sign * (frac * 2.0 ** (1 - fmt.exponent_bias) if e == 0 else (1 + frac) * 2.0 ** (e - fmt.exponent_bias))
        assert values[code] == want, (name, code)
