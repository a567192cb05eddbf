"""The Numba backend's int4 per-token-head kernels (SPEC.md section 2's int4 rows) against the oracle.

The conformance suite runs the int4 modes on its shapes; this file takes the kernels to their
edges: every head size the modes take (the powers of two 2..512), every input dtype, the special
rows of SPEC.md 4.1 and rounding ties, caches that are views into larger poisoned buffers
(the bytes around every written row must stay as they were), every 32-bit scale word through
dequantize, and attention with its options against the float64 reference. Codes and scale
words are compared as raw bytes.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import kvzoo
from kvzoo import registry
from kvzoo.formats import FORMATS
from kvzoo.modes import rht_signs
from kvzoo.samples import assert_attention_close
from kvzoo_spec import oracle

from support import rng_for

numba = pytest.importorskip("numba")

from kvzoo.backends import numba_cpu  # noqa: E402
from kvzoo.backends.numba_cpu import formats as kinds  # noqa: E402
from kvzoo.backends.numba_cpu import kernels  # noqa: E402

MODES = ("int4_per_token_head", "int4_per_token_head_norot")
DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}
HEAD_SIZES = tuple(2**k for k in range(1, 10))  # every size the modes take
IMPL = "numba"
NAN_WORD = 0x7FC00000


def test_kernel_constants_are_the_format_row():
    fmt = FORMATS["uint4"]
    assert (fmt.bits, fmt.zero_point_bits, fmt.qmax, fmt.qmin) == (4, 4, 15.0, 0.0)
    assert int(kernels._ZP_MASK) == (1 << fmt.zero_point_bits) - 1
    assert int(kernels._SCALE_BITS) & 0xFFFFFFFF == 0xFFFFFFFF ^ int(kernels._ZP_MASK)
    assert numba_cpu.FORMAT_KINDS["uint4"] == kinds.U4
    # The signs the backend rotates with are kvzoo's; the oracle keeps its own table.
    assert np.array_equal(rht_signs(512), oracle.int4_rht_signs(512))
    for mode in MODES:
        for op in ("reshape_and_cache", "dequantize", "paged_attention"):
            assert mode in registry.default().get(op, IMPL).modes


# ----------------------------------------------------------------------------------------------
# rows
# ----------------------------------------------------------------------------------------------

ROW_KINDS = (
    "normal",
    "outliers",
    "one_sign",
    "constant",
    "zeros",
    "tiny",
    "subnormal",
    "ties",
    "nan",
    "inf",
    "huge",
)


def _dtype_max(dtype: str) -> float:
    return float(ml_dtypes.finfo(DTYPES[dtype]).max)


def _row(kind: str, dtype: str, d: int, rng: np.random.Generator) -> np.ndarray:
    """One row of d float64 values of a given character (cast to dtype by the caller)."""
    if kind == "normal":
        return rng.standard_normal(d) * rng.choice([1e-3, 1.0, 40.0])
    if kind == "outliers":
        x = rng.standard_t(2.0, d)
        x[rng.choice(d, max(1, d // 16), replace=False)] *= rng.uniform(20, 200)
        return x
    if kind == "one_sign":
        return (np.abs(rng.standard_normal(d)) + 0.5) * rng.choice([-1.0, 1.0])
    if kind == "constant":
        return np.full(d, rng.standard_normal() * 3)
    if kind == "zeros":
        return np.where(rng.random(d) < 0.5, -0.0, 0.0)
    if kind == "tiny":  # range / 15 at or below the scale floor
        return rng.standard_normal(d) * rng.choice([1e-6, 1e-7, 1e-9])
    if kind == "subnormal":  # the input dtype's subnormals (float16's are float32 normals)
        tiny = {"float32": 2.0**-149, "float16": 2.0**-24, "bfloat16": 2.0**-133}[dtype]
        return rng.integers(-40, 41, d) * tiny
    if kind == "ties":
        # y = r / scale + zp exactly halfway between two codes: a power-of-two scale s and a
        # range of exactly 15 s, so every y is computed exactly (rotated: just another row).
        s = 2.0 ** int(rng.integers(-8, 4))
        zp = int(rng.integers(0, 16))
        x = (rng.integers(-zp, 15 - zp, d) + rng.choice([0.5, 0.0], d)) * s
        x[:2] = (-zp * s, (15 - zp) * s)
        return x
    if kind == "nan":
        x = rng.standard_normal(d)
        x[rng.integers(d)] = np.nan
        return x
    if kind == "inf":
        x = rng.standard_normal(d)
        x[rng.integers(d)] = rng.choice([np.inf, -np.inf])
        return x
    if kind == "huge":
        # Near the dtype's largest finite value: float32's range overflows (norot) and the
        # butterfly overflows (rotated); float16's rotation overflows its narrowing.
        top = _dtype_max(dtype)
        return rng.choice([-1.0, 1.0], d) * top * rng.uniform(0.6, 1.0, d)
    raise ValueError(kind)


def _rows(shape: tuple[int, ...], dtype: str, rng: np.random.Generator) -> np.ndarray:
    """Rows [..., d] in dtype, each of a random kind; every kind appears when there is room."""
    *lead, d = shape
    n = int(np.prod(lead))
    picks = rng.permutation(np.resize(np.arange(len(ROW_KINDS)), n))
    with np.errstate(over="ignore"):
        x = np.stack([_row(ROW_KINDS[k], dtype, d, rng) for k in picks]).astype(np.float32)
        return x.astype(DTYPES[dtype]).reshape(shape)


def _bits32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32)


# ----------------------------------------------------------------------------------------------
# reshape_and_cache
# ----------------------------------------------------------------------------------------------

_PAD = 3  # poisoned bytes (and scale words) beside every row of a strided cache


def _caches(nb, bs, h, d, strided, rng):
    """(key_cache, value_cache, k_scale_cache, v_scale_cache, the buffers they view), every byte
    random. Strided: each row sits between _PAD foreign bytes, each scale word beside foreign
    words, and K and V share one buffer."""
    w = d // 2
    if strided:
        codes = rng.integers(0, 256, (nb, 2, bs, h, w + 2 * _PAD), dtype=np.uint8)
        words = rng.integers(0, 2**32, (nb, bs, 2 * h + 1), dtype=np.uint32).view(np.float32)
        buffers = (codes, words)
    else:
        kc, vc = (rng.integers(0, 256, (nb, bs, h, w), dtype=np.uint8) for _ in range(2))
        ks, vs = (rng.integers(0, 2**32, (nb, bs, h), dtype=np.uint32).view(np.float32) for _ in range(2))
        buffers = (kc, vc, ks, vs)
    return (*_cache_views(buffers, strided, d), buffers)


def _cache_views(buffers, strided, d):
    """The four caches _caches makes of its buffers (or of copies of them)."""
    if not strided:
        return buffers
    codes, words = buffers
    w = d // 2
    return codes[:, 0, ..., _PAD : _PAD + w], codes[:, 1, ..., _PAD : _PAD + w], words[..., 1::2], words[..., 0:-1:2]


@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_write_matches_oracle_byte_for_byte(mode, dtype, head_size):
    rng = rng_for("numba-int4-write", mode, dtype, head_size)
    nb, bs, h, t = 4, 4, 2, 12
    strided = head_size.bit_length() % 2 == 0  # half the sizes take the strided layout
    kc, vc, ks, vs, buffers = _caches(nb, bs, h, head_size, strided, rng)
    before = [b.copy() for b in buffers]
    # K and V as views into one fused projection, as an engine hands them over.
    qkv = np.empty((t, 3, h, head_size), DTYPES[dtype])
    qkv[:, 1], qkv[:, 2] = _rows((t, h, head_size), dtype, rng), _rows((t, h, head_size), dtype, rng)
    key, value = qkv[:, 1], qkv[:, 2]
    slots = rng.permutation(nb * bs)[:t].astype(np.int64)
    slots[rng.choice(t, 2, replace=False)] = -1  # skipped: nothing written for them
    kvzoo.reshape_and_cache(key, value, kc, vc, slots, mode=mode, k_scale_cache=ks, v_scale_cache=vs, impl=IMPL)

    expect = [b.copy() for b in before]
    views = _cache_views(expect, strided, head_size)
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        blk, off = divmod(slot, bs)
        for rows, codes_view, words_view in ((key, views[0], views[2]), (value, views[1], views[3])):
            packed, words = oracle.int4_quantize_rows(np.asarray(rows[i]), mode)
            codes_view[blk, off] = packed
            words_view[blk, off] = words
    for got, want in zip(buffers, expect):
        assert got.view(np.uint8).tobytes() == want.view(np.uint8).tobytes(), (mode, dtype, head_size, strided)


@pytest.mark.parametrize("dtype", DTYPES)
def test_special_rows_give_the_words_of_spec_12_5(dtype):
    """The table of SPEC.md 4.1 written out, not read from the oracle."""
    d = 16
    rows = np.zeros((4, 1, d), np.float32)
    rows[0, 0, 3] = np.nan
    rows[1, 0, 5] = -np.inf
    rows[2, 0] = np.where(np.arange(d) % 3 == 0, -0.0, 0.0)
    rows[3, 0] = np.where(np.arange(d) % 2 == 0, 1.0, -1.0) * _dtype_max(dtype)
    x = rows.astype(DTYPES[dtype])
    for mode in MODES:
        kc = np.full((4, 1, 1, d // 2), 0x5A, np.uint8)
        ks = np.full((4, 1, 1), -3.0, np.float32)
        kvzoo.reshape_and_cache(
            x, x.copy(), kc, kc.copy(), np.arange(4), mode=mode, k_scale_cache=ks, v_scale_cache=ks.copy(), impl=IMPL
        )
        words = _bits32(ks).reshape(4)
        assert words[0] == words[1] == NAN_WORD, mode
        assert words[2] == 0x358637B0, mode  # the scale floor with its low bits cleared, zp 0
        assert not kc[:3].any(), mode  # poisoned rows and the zero row: all codes 0
        # A range overflowing float32 poisons the row; the rotation of float16 values near
        # 65504 overflows the narrowing, also poison. Norot float16: finite range, a normal row.
        poisoned = dtype != "float16" or mode == "int4_per_token_head"
        assert (words[3] == NAN_WORD) == poisoned, (mode, dtype)


# ----------------------------------------------------------------------------------------------
# dequantize
# ----------------------------------------------------------------------------------------------


def _decoded(packed, words, mode):
    stored = oracle.int4_decode_rows(packed, words)
    return oracle.int4_unrotate(stored) if mode == "int4_per_token_head" else stored


def _assert_same_floats(got, want, what):
    """Equal bits, any NaN equal to any NaN (SPEC.md: a decoded NaN's sign and payload vary)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, what
    same = (_bits32(got) == _bits32(want)) | (np.isnan(got) & np.isnan(want))
    assert same.all(), f"{what}: {int((~same).sum())} elements differ"


@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("mode", MODES)
def test_dequantize_every_word_and_byte(mode, head_size):
    rng = rng_for("numba-int4-dequantize", mode, head_size)
    nb, bs, h = 5, 4, 2
    strided = head_size.bit_length() % 2 == 1
    kc, _, ks, _, _ = _caches(nb, bs, h, head_size, strided, rng)
    # Random words reach every class the rule covers: NaN, Inf, negative, subnormal and zero
    # scales; a few sane ones so the rotation meets finite rows too.
    sane = rng.random(ks.shape) < 0.5
    ks[sane] = rng.uniform(1e-3, 1.0, int(sane.sum())).astype(np.float32)
    whole = kvzoo.dequantize(kc, ks, mode=mode, impl=IMPL)
    _assert_same_floats(whole, _decoded(np.asarray(kc), np.asarray(ks), mode), f"{mode} D={head_size} whole cache")

    block_tables = rng.permutation(nb).astype(np.int32)[None, :].repeat(2, 0)
    block_tables[1] = rng.permutation(nb)
    seq_lens = np.array([rng.integers(1, nb * bs + 1), 0], np.int32)[rng.permutation(2)]
    got = kvzoo.dequantize(kc, ks, mode=mode, block_tables=block_tables, seq_lens=seq_lens, impl=IMPL)
    where = [(int(block_tables[s, i // bs]), i % bs) for s in range(2) for i in range(int(seq_lens[s]))]
    want = np.stack([_decoded(np.asarray(kc)[b, o], np.asarray(ks)[b, o], mode) for b, o in where])
    _assert_same_floats(got, want, f"{mode} D={head_size} gathered")


# ----------------------------------------------------------------------------------------------
# paged_attention
# ----------------------------------------------------------------------------------------------

OPTIONS = {
    "plain": {},
    "window": {"sliding_window": 7},
    "softcap": {"softcap": 3.0},
    "sinks": {"sinks": True},
    "lse": {"return_lse": True},
    "all": {"sliding_window": 11, "softcap": 5.0, "sinks": True, "return_lse": True},
}


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("head_size", (2, 16, 128, 512))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_attention_matches_float64_reference(mode, dtype, head_size, options):
    rng = rng_for("numba-int4-attention", mode, dtype, head_size, options)
    opts = dict(OPTIONS[options])
    bs, hq, hkv = 4, 6, 2
    # A decode, a chunked prefill and a whole prefill in one batch: the decode's rows (one
    # token x 3 heads) read the cache's bytes, the others decoded tiles; 40 keys span 2 tiles.
    seq_lens = np.array([40, 23, 13], np.int32)
    q_lens = np.array([1, 9, 13])
    per_seq = -(-seq_lens.max() // bs)
    nb = per_seq * len(seq_lens)
    block_tables = rng.permutation(nb).astype(np.int32).reshape(len(seq_lens), per_seq)
    tokens = nb * bs
    kv = [(rng.standard_normal((tokens, hkv, head_size)) * rng.uniform(0.5, 3)).astype(np.float32) for _ in range(2)]
    kv = [x.astype(DTYPES[dtype]) for x in kv]
    slots = rng.permutation(tokens)
    kc, vc, ks, vs = oracle.int4_reshape_and_cache(*kv, slots, num_blocks=nb, block_size=bs, mode_name=mode)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    query = (rng.standard_normal((int(qsl[-1]), hq, head_size)) * 2).astype(np.float32).astype(DTYPES[dtype])
    sinks = rng.standard_normal(hq).astype(np.float32) if opts.pop("sinks", False) else None
    want_lse = opts.pop("return_lse", False)
    out = np.full(query.shape, np.nan, query.dtype)
    lse = np.full(query.shape[:2], np.nan, np.float32) if want_lse else None
    result = kvzoo.paged_attention(
        query,
        kc,
        vc,
        mode=mode,
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_start_loc=qsl,
        k_scale_cache=ks,
        v_scale_cache=vs,
        sinks=sinks,
        out=out,
        lse=lse,
        return_lse=want_lse,
        impl=IMPL,
        **opts,
    )
    ref = oracle.int4_attention_f64(
        query, kc, vc, ks, vs, block_tables, seq_lens, qsl, mode_name=mode, sinks=sinks, **opts
    )
    impl = registry.default().get("paged_attention", IMPL)
    assert_attention_close(impl, out.astype(np.float32), ref, qsl, dtype, f" {mode} D={head_size} {options}")
    if want_lse:
        assert result[1] is lse
        k64, v64 = (oracle.int4_dequantize_rows_f64(c, s, mode) for c, s in ((kc, ks), (vc, vs)))
        ref_out, ref_lse = oracle.attention_f64(
            query, k64, v64, block_tables, seq_lens, qsl, sinks=sinks, return_lse=True, **opts
        )
        assert np.allclose(ref_out, ref, rtol=1e-9, atol=1e-12)  # the two references agree
        assert (np.abs(lse - ref_lse) <= 1e-5 * np.maximum(1.0, np.abs(ref_lse))).all(), (mode, dtype, options)


@pytest.mark.parametrize("mode", MODES)
def test_attention_of_a_poisoned_key_is_not_finite(mode):
    """A NaN in a key row poisons its word (SPEC.md 4.1): every query that attends it gets a
    non-finite row, and sequences that do not read it stay finite."""
    rng = rng_for("numba-int4-poison", mode)
    d, bs = 64, 4
    key = rng.standard_normal((16, 1, d)).astype(np.float32)
    value = rng.standard_normal((16, 1, d)).astype(np.float32)
    key[2, 0, 9] = np.nan
    kc, vc, ks, vs = oracle.int4_reshape_and_cache(
        key, value, np.arange(16), num_blocks=4, block_size=bs, mode_name=mode
    )
    out = kvzoo.paged_attention(
        rng.standard_normal((2, 2, d)).astype(np.float32),
        kc,
        vc,
        mode=mode,
        block_tables=np.array([[0, 1], [2, 3]], np.int32),
        seq_lens=np.array([8, 8], np.int32),
        query_start_loc=np.array([0, 1, 2], np.int32),
        k_scale_cache=ks,
        v_scale_cache=vs,
        impl=IMPL,
    )
    assert not np.isfinite(out[0]).any() and np.isfinite(out[1]).all()
