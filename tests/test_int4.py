"""int4 per-token-head as modes (SPEC.md section 2's int4 rows): the NumPy backend's encoder, rotation and
attention options against the oracle and against the rules restated here, and the API's
refusals of what int4 does not define (head sizes, the inline layout, quantize_query).

The conformance suite holds every backend's bytes to the oracle on random problems; these
tests cover what it does not enumerate: every float32 around every rounding boundary, every
zero point, the zero point's own ties, and the options it does not pass (return_lse).
"""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

import kvzoo
from kvzoo import KVZooInputError, samples
from kvzoo.backends.numpy_vectorized import codec as numpy_codec
from kvzoo.backends.numpy_vectorized import kernels
from kvzoo.modes import MODES
from kvzoo_spec import oracle

from support import assert_same_bytes, random_bytes, rng_for

INT4 = list(oracle.INT4_MODES)
DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}


def _spec_round(v: np.ndarray) -> np.ndarray:
    """SPEC.md 3.5's R(v), restated: 0 below 0, 15 from 15 up, else trunc(fl(v + 0.5))."""
    v = np.asarray(v, np.float32)
    with np.errstate(invalid="ignore"):
        up = np.trunc((v + np.float32(0.5)).astype(np.float32).astype(np.float64))
    return np.where(v < 0, 0, np.where(v >= 15, 15, np.minimum(up, 15))).astype(np.uint8)


def _around_every_half(ulps: int = 6) -> np.ndarray:
    """Every float32 within `ulps` of each multiple of 1/2 in [-1, 16], and those multiples."""
    centres = (np.arange(-2, 33) / 2).astype(np.float32)
    out = [centres]
    for c in centres:
        below, above = c, c
        for _ in range(ulps):
            below = np.nextafter(below, np.float32(-np.inf))
            above = np.nextafter(above, np.float32(np.inf))
            out.append(np.array([below, above], np.float32))
    return np.concatenate(out)


# ---------------------------------------------------------------------------------------------
# the encoder


def test_uint4_rounding_of_every_float32_near_a_boundary():
    """The backend's encoder (clamp, then round half up through one float32 add), the oracle's
    rounding and the rule restated above agree on every float32 near each n/2, on random
    values and on the extremes; 0.5 - 2^-25 goes to 1, as SPEC.md 3.5 says."""
    rng = rng_for("uint4 rounding")
    y = np.concatenate(
        [
            _around_every_half(),
            rng.uniform(-3, 18, 20000).astype(np.float32),
            np.float32([0.0, -0.0, 1e-45, -1e-45, 3e38, -3e38, 14.999999, 15.0, 15.5, 2.0**24]),
        ]
    )
    codec = numpy_codec(MODES["int4_per_token_head_norot"])
    got = kernels.encode(y, codec)
    want = _spec_round(y)
    assert np.array_equal(got, want)
    assert np.array_equal(np.array([oracle._int4_round(np.float32(v)) for v in y], np.uint8), want)
    assert kernels.encode(np.float32([0.5 - 2.0**-25, 0.5, 1.5, 2.5]), codec).tolist() == [1, 1, 2, 3]


@pytest.mark.parametrize("power", [-5, 0, 3])
def test_every_zero_point_and_every_midpoint_in_a_row(power):
    """Rows of scale exactly 2^power and every zero point: the elements on every midpoint (and
    their float32 neighbours) encode as the oracle's rows do, and exact ties go up."""
    codec = numpy_codec(MODES["int4_per_token_head_norot"])
    step = np.float32(2.0**power)
    rows = []
    for zp in range(16):
        mids = (np.arange(15) + 0.5 - zp).astype(np.float32) * step
        values = np.concatenate([mids, np.nextafter(mids, np.float32(-np.inf)), np.nextafter(mids, np.float32(np.inf))])
        for start in range(0, len(values), 14):
            chunk = np.resize(values[start : start + 14], 14)
            rows.append(np.concatenate([np.float32([-zp * step, (15 - zp) * step]), chunk]))
    rows = np.array(rows, np.float32)
    packed, words = kernels.quantize_rows(rows, codec)
    want_packed, want_words = oracle.int4_quantize_rows(rows, "int4_per_token_head_norot")
    assert_same_bytes(packed, want_packed, "codes")
    assert_same_bytes(words, want_words, "scale words")
    scale, zp = MODES["int4_per_token_head_norot"].format.split_scale_words(words)
    assert np.all(scale == step) and sorted(set(zp.tolist())) == list(range(16))
    codes = oracle.int4_unpack(packed).astype(np.int64)
    ties = rows / step + zp[:, None] == np.floor(rows / step + zp[:, None]) + 0.5
    assert ties.any() and np.array_equal(codes[ties], np.floor(rows / step + zp[:, None])[ties] + 1)


def test_the_zero_point_ties_go_up():
    """-lo / scale exactly on z + 1/2 gives the zero point z + 1 (the codes' own rounding)."""
    codec = numpy_codec(MODES["int4_per_token_head_norot"])
    rng = rng_for("zero point ties")
    rows = []
    for z in range(15):
        r = rng.uniform(-(z + 0.5), 14.5 - z, 16).astype(np.float32)
        r[0], r[1] = -(z + 0.5), 14.5 - z
        rows.append(r)
    rows = np.array(rows, np.float32) * np.float32(0.25)
    packed, words = kernels.quantize_rows(rows, codec)
    _, zp = MODES["int4_per_token_head_norot"].format.split_scale_words(words)
    assert zp.tolist() == list(range(1, 16))
    want_packed, want_words = oracle.int4_quantize_rows(rows, "int4_per_token_head_norot")
    assert_same_bytes(packed, want_packed, "codes")
    assert_same_bytes(words, want_words, "scale words")


# ---------------------------------------------------------------------------------------------
# the rotation


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_rotation_is_the_oracles_bit_for_bit(dtype):
    rng = rng_for("rotation", dtype)
    for d in [2**k for k in range(1, 10)] + [6, 80, 96, 192, 510]:
        x = (rng.standard_normal((33, d)) * 10.0 ** rng.uniform(-6, 6, (33, 1))).astype(DTYPES[dtype])
        big = 65504.0 if dtype == "float16" else 3e38
        x[0, :] = big * oracle.int4_rht_signs(d)  # overflows the butterfly (or the narrowing)
        x[1, 0] = np.nan
        got = kernels.rotate_rows(x.astype(np.float32), x.dtype)
        want = oracle.int4_rotate(x)
        both_nan = np.isnan(got) & np.isnan(want)
        assert_same_bytes(np.where(both_nan, 0, got), np.where(both_nan, 0, want), f"rotate D={d}")
        assert not np.isfinite(got[0]).all()
        y = (rng.standard_normal((17, d)) * 10.0 ** rng.uniform(-30, 30, (17, 1))).astype(np.float32)
        assert_same_bytes(kernels.unrotate_rows(y), oracle.int4_unrotate(y), f"unrotate D={d}")


# ---------------------------------------------------------------------------------------------
# attention options the conformance suite does not pass


def _int4_sample(mode, rng, head_size=32):
    return samples.paged_sample(
        rng, mode, batch="mixed", num_q_heads=4, num_kv_heads=2, head_size=head_size, block_size=4, size="small",
        query_dtype="float32", kind="numpy", sinks=True,
    )  # fmt: skip


@pytest.mark.parametrize("mode", INT4)
def test_return_lse_matches_the_reference_and_leaves_out_unchanged(mode):
    s = _int4_sample(mode, rng_for("int4 lse", mode))
    kw = dict(s.api_kwargs(), sliding_window=5, softcap=8.0, impl="numpy")
    plain = kvzoo.paged_attention(s.query, s.caches.key_cache, s.caches.value_cache, **kw)
    out, lse = kvzoo.paged_attention(s.query, s.caches.key_cache, s.caches.value_cache, return_lse=True, **kw)
    assert_same_bytes(out, plain, "out with and without lse")
    k = samples.oracle_model_values(mode, s.key_codes, s.k_scales)
    v = samples.oracle_model_values(mode, s.value_codes, s.v_scales)
    ref, ref_lse = oracle.attention_f64(
        s.query_host, k, v, s.batch.tables, s.batch.seq_lens, s.batch.qsl,
        sliding_window=5, softcap=8.0, sinks=s.sinks_host, return_lse=True,
    )  # fmt: skip
    assert np.all(np.abs(lse - ref_lse) <= 1e-5 * np.maximum(1.0, np.abs(ref_lse)))
    # The lse reference's out (attention on the dequantized rows) is the codes' reference's too.
    codes_ref = s.reference(sliding_window=5, softcap=8.0)
    assert np.linalg.norm(codes_ref - ref) <= 1e-12 * np.linalg.norm(ref)
    samples.assert_attention_close(kvzoo.registry.get("paged_attention", "numpy"), out, ref, s.qsl, "float32")


@pytest.mark.parametrize("mode", INT4)
def test_a_sequence_reads_the_same_alone_and_in_a_batch(mode):
    """batch_invariant: a sequence's rows do not depend on what else is in the batch."""
    s = _int4_sample(mode, rng_for("int4 invariant", mode))
    kw = dict(s.api_kwargs(), impl="numpy", batch_invariant=True)
    whole = kvzoo.paged_attention(s.query, s.caches.key_cache, s.caches.value_cache, **kw)
    for seq in range(len(s.batch.seq_lens)):
        lo, hi = int(s.batch.qsl[seq]), int(s.batch.qsl[seq + 1])
        alone = dict(
            kw,
            block_tables=s.block_tables[seq : seq + 1],
            seq_lens=s.seq_lens[seq : seq + 1],
            query_start_loc=np.array([0, hi - lo], np.int32),
            sinks=s.sinks,
        )
        got = kvzoo.paged_attention(s.query[lo:hi], s.caches.key_cache, s.caches.value_cache, **alone)
        assert_same_bytes(got, whole[lo:hi], f"sequence {seq}")


# ---------------------------------------------------------------------------------------------
# what int4 refuses, named, before any write


@pytest.mark.parametrize(
    "mode, head_size",
    [("int4_per_token_head", d) for d in (1, 67, 514, 1024)]
    + [("int4_per_token_head_norot", d) for d in (1, 6, 67, 96, 1024)],
)
def test_head_sizes_the_mode_does_not_take_are_refused(mode, head_size):
    # The rotated mode takes even sizes to 512 (its blocks, SPEC.md 3.4), _norot powers of two.
    rule = re.escape(str(MODES[mode].head_sizes))
    rng = rng_for("int4 head sizes", mode, head_size)
    with pytest.raises(KVZooInputError, match=r"^head_size: .*" + rule):
        kvzoo.allocate_separate(2, 4, 1, head_size, mode, device=None)
    width = max(1, head_size // 2)
    caches = [random_bytes(rng, (2, 4, 1, width), "uint8", "cpu", "numpy") for _ in range(2)]
    scales = [random_bytes(rng, (2, 4, 1), "float32", "cpu", "numpy") for _ in range(2)]
    before = [c.copy() for c in caches + scales]
    rows = rng.standard_normal((3, 1, head_size)).astype(np.float32)
    with pytest.raises(KVZooInputError, match=r"^head_size: "):
        kvzoo.reshape_and_cache(
            rows, rows.copy(), *caches, np.arange(3), mode=mode, k_scale_cache=scales[0], v_scale_cache=scales[1]
        )
    for got, want in zip(caches + scales, before):
        assert_same_bytes(got, want, "a refused write wrote")
    with pytest.raises(KVZooInputError, match=r"^head_size: "):
        kvzoo.paged_attention(
            rows, *caches, mode=mode, k_scale_cache=scales[0], v_scale_cache=scales[1],
            block_tables=np.array([[0]], np.int32), seq_lens=np.array([3], np.int32),
            query_start_loc=np.array([0, 3], np.int32),
        )  # fmt: skip
    if head_size % 2 == 0 and head_size >= 2:
        # dequantize knows the head size only from the cache's width (2 codes a byte).
        with pytest.raises(KVZooInputError, match=r"^cache: .*" + rule + ", got " + str(head_size)):
            kvzoo.dequantize(caches[0], scales[0], mode=mode)


@pytest.mark.parametrize("mode", INT4)
def test_inline_layout_quantize_query_and_trunc_are_refused_with_their_reasons(mode):
    with pytest.raises(KVZooInputError, match=r"^mode: the inline layout is not defined for"):
        kvzoo.allocate_inline(2, 4, 1, 16, mode, device=None)
    with pytest.raises(KVZooInputError, match=r"^mode: the inline layout is not defined for"):
        kvzoo.layout.inline_views(np.zeros((2, 2, 4, 1, 20), np.uint8), 16, mode)
    t = kvzoo.allocate_separate(2, 4, 1, 16, mode, device=None)
    rows = np.ones((2, 1, 16), np.float32)
    with pytest.raises(KVZooInputError, match=r"^quantize_query: "):
        kvzoo.paged_attention(
            rows, t.key_cache, t.value_cache, mode=mode, k_scale_cache=t.k_scale_cache, v_scale_cache=t.v_scale_cache,
            block_tables=np.array([[0]], np.int32), seq_lens=np.array([2], np.int32),
            query_start_loc=np.array([0, 2], np.int32), quantize_query=True,
        )  # fmt: skip
    with pytest.raises(KVZooInputError, match=r"^rounding: "):
        kvzoo.reshape_and_cache(
            rows, rows, t.key_cache, t.value_cache, np.arange(2), mode=mode,
            k_scale_cache=t.k_scale_cache, v_scale_cache=t.v_scale_cache, rounding="trunc",
        )  # fmt: skip


def test_engine_strings_parse_and_the_cache_object_takes_int4():
    assert kvzoo.get_kv_quant_mode("int4_per_token_head") is MODES["int4_per_token_head"]
    assert kvzoo.get_kv_quant_mode(" INT4_PER_TOKEN_HEAD_NOROT ") is MODES["int4_per_token_head_norot"]
    rng = rng_for("int4 cache object")
    cache = kvzoo.PagedKVCache(4, 8, 2, 64, "int4_per_token_head", device="cpu")
    assert tuple(cache.tensors.key_cache.shape) == (4, 8, 2, 32) and str(cache.tensors.key_cache.dtype) == "torch.uint8"
    import torch

    key = torch.from_numpy(rng.standard_normal((10, 2, 64)).astype(np.float32)).bfloat16()
    cache.write(key, key.clone(), torch.arange(10))
    back = cache.read("key").reshape(-1, 2, 64)[:10]
    assert back.shape == (10, 2, 64) and torch.isfinite(back).all()
    # Round trip within the int4 step (in the model's basis the stored error shrinks by sqrt(D)).
    assert float((back - key.float()).norm() / key.float().norm()) < 0.2


@pytest.mark.parametrize("mode", INT4)
@pytest.mark.parametrize("magnitude", [1e-40, 1e-30, 1.0, 1e30, 3e37])
def test_query_magnitudes_from_subnormal_to_3e37(mode, magnitude):
    """SPEC.md section 11: the query rows' size does not matter where the logits are of moderate
    size (here the key scales shrink as the query grows). The NumPy backend scales each row by a
    power of two before rotating it (a rotation of a 3e37 row would overflow float32: its
    elements grow by up to D)."""
    s = _int4_sample(mode, rng_for("int4 magnitudes", mode, magnitude), head_size=64)
    fmt = MODES[mode].format
    scale, zp = fmt.split_scale_words(s.k_scales)
    s.caches.k_scale_cache[...] = fmt.scale_words((scale * min(0.1 / magnitude, 1e37)).astype(np.float32), zp)
    query = (s.query_host.astype(np.float64) * magnitude).astype(np.float32)
    out = kvzoo.paged_attention(query, s.caches.key_cache, s.caches.value_cache, **s.api_kwargs(), impl="numpy")
    ref = samples.oracle_attention(
        mode, query, s.key_codes, s.value_codes, s.batch.tables, s.batch.seq_lens, s.batch.qsl,
        k_scales=s.caches.k_scale_cache, v_scales=s.v_scales, sinks=s.sinks_host,
    )  # fmt: skip
    assert np.isfinite(ref).all()
    assert np.isfinite(out).all()
    samples.assert_attention_close(kvzoo.registry.get("paged_attention", "numpy"), out, ref, s.qsl, "float32")
