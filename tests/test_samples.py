"""kvzoo.samples, the one builder of random paged problems: what every caller relies on.

Replayable (the same Generator seed gives the same bytes, on every kind and device), fresh (other
seeds give other draws), scattered pages, caches that hold only codes an encoder can produce
(NaN only where asked), the shapes and dtypes the API takes, and an oracle reference and
tolerance that agree with the conformance suite's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvzoo import samples
from kvzoo.arrays import dtype_name
from kvzoo.inputs import host_bytes, rng_for
from kvzoo.modes import MODES, QuantMode
from kvzoo_spec import oracle

PLACES = [
    pytest.param(("torch", "cpu"), id="torch-cpu"),
    pytest.param(("numpy", "cpu"), id="numpy"),
    pytest.param(
        ("torch", "cuda"),
        id="torch-cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    ),
]
# The layouts each mode defines (the inline one: per-token-head modes but int4).
MODE_LAYOUTS = [pytest.param(m, lay, id=f"{m}-{lay}") for m in MODES for lay in MODES[m].layouts]


def _bytes(x) -> bytes:
    return b"" if x is None else host_bytes(x).tobytes()


def _paged_bytes(s: samples.PagedSample) -> list[bytes]:
    c = s.caches
    return [
        _bytes(x)
        for x in (
            s.query,
            c.key_cache,
            c.value_cache,
            c.k_scale_cache,
            c.v_scale_cache,
            s.block_tables,
            s.seq_lens,
            s.query_start_loc,
            s.sinks,
        )
    ] + [repr((s.k_scale, s.v_scale)).encode()]


def _small(rng, mode, **kw) -> samples.PagedSample:
    opts = dict(batch="mixed", num_q_heads=4, num_kv_heads=2, head_size=16, block_size=4)
    return samples.paged_sample(rng, mode, **{**opts, **kw})


# ---------------------------------------------------------------------------------------------
# replayable and fresh


@pytest.mark.parametrize("mode,layout", MODE_LAYOUTS)
def test_paged_sample_is_the_same_for_a_seed_and_differs_across_seeds(mode, layout):
    one = _small(rng_for("samples", "replay"), mode, layout=layout, sinks=True)
    again = _small(rng_for("samples", "replay"), mode, layout=layout, sinks=True)
    other = _small(rng_for("samples", "other"), mode, layout=layout, sinks=True)
    assert _paged_bytes(one) == _paged_bytes(again)
    assert one.reference().tobytes() == again.reference().tobytes()
    differ = [a != b for a, b in zip(_paged_bytes(one), _paged_bytes(other))]
    assert differ[0] and differ[1] and differ[2], "query and caches are fresh draws"


@pytest.mark.parametrize("place", PLACES)
def test_draws_do_not_depend_on_kind_or_device(place):
    # A caller may build the same problem for two implementations on two devices (and compare
    # their bytes): only the placement may differ.
    kind, device = place
    here = _small(rng_for("samples", "placed"), "int8_per_token_head", kind=kind, device=device, sinks=True)
    host = _small(rng_for("samples", "placed"), "int8_per_token_head", kind="torch", device="cpu", sinks=True)
    assert _paged_bytes(here) == _paged_bytes(host)
    w_here = samples.write_sample(
        rng_for("samples", "w"),
        "fp8_per_token_head",
        num_tokens=9,
        head_size=16,
        block_size=4,
        kind=kind,
        device=device,
        negative_slots=True,
    )
    w_host = samples.write_sample(
        rng_for("samples", "w"), "fp8_per_token_head", num_tokens=9, head_size=16, block_size=4, negative_slots=True
    )
    for a, b in zip(
        (w_here.key, w_here.value, w_here.slot_mapping, *w_here.cache_arrays()),
        (w_host.key, w_host.value, w_host.slot_mapping, *w_host.cache_arrays()),
    ):
        assert _bytes(a) == _bytes(b)


def test_torch_fill_is_the_same_for_a_seed_and_differs_across_seeds():
    kw = dict(q_lens=[1, 7], seq_lens=[40, 7], fill="torch", spare_blocks=0, spare_columns=0)
    one, again = (_small(rng_for("samples", "torch fill"), "fp8_per_token_head", **kw) for _ in range(2))
    other = _small(rng_for("samples", "torch fill 2"), "fp8_per_token_head", **kw)
    assert _paged_bytes(one) == _paged_bytes(again)
    assert _paged_bytes(one)[1] != _paged_bytes(other)[1]


def test_write_sample_is_the_same_for_a_seed_and_differs_across_seeds():
    kw = dict(num_tokens=11, head_size=16, block_size=4, dist="outliers", negative_slots=True, guard_blocks=1)
    one, again, other = (
        samples.write_sample(rng_for("samples", key), "int8_per_token_head", **kw)
        for key in ("write", "write", "write 2")
    )
    arrays = lambda w: [w.key, w.value, w.slot_mapping, *w.cache_arrays(), *w.guard]  # noqa: E731
    assert [_bytes(a) for a in arrays(one)] == [_bytes(a) for a in arrays(again)]
    assert _bytes(one.key) != _bytes(other.key) and _bytes(one.caches.key_cache) != _bytes(other.caches.key_cache)
    assert not np.array_equal(one.slots, other.slots)


# ---------------------------------------------------------------------------------------------
# batches and pages


@pytest.mark.parametrize("size,kinds", [("medium", samples.BATCH_KINDS), ("small", ("decode", "prefill", "mixed"))])
def test_batch_kinds(size, kinds):
    for kind in kinds:
        for draw in range(20):
            q, n = samples.draw_lens(rng_for("samples", "lens", size, kind, draw), kind, size)
            assert q.dtype == n.dtype == np.int64 and (1 <= q).all() and (q <= n).all(), (kind, q, n)
            if kind == "decode":
                assert (q == 1).all()
            if kind == "prefill":
                assert (q == n).all()
            if kind == "mixed":
                assert (q == 1).any() and (q > 1).any()
            if kind == "long":
                assert q.max() >= 128 and (q == 1).any()
    with pytest.raises(ValueError):
        samples.draw_lens(rng_for("samples"), "long", "small")


def test_pages_are_scattered():
    unordered = 0
    for draw in range(20):
        b = samples.draw_batch(rng_for("samples", "pages", draw), "mixed", block_size=4)
        pages = -(-b.seq_lens // b.block_size)
        used = np.concatenate([b.tables[s, :n] for s, n in enumerate(pages)])
        assert len(set(used.tolist())) == len(used), "no two positions share a page"
        assert ((0 <= b.tables) & (b.tables < b.num_blocks)).all(), "unused entries are valid ids too"
        assert b.tables.shape == (len(b.seq_lens), pages.max() + 1) and b.num_blocks == pages.sum() + 3
        unordered += any((np.diff(b.tables[s, :n]) != 1).any() for s, n in enumerate(pages))
    assert unordered >= 18, "pages follow each other in memory: not a paged cache"


def test_tables_exactly_as_wide_as_asked():
    tables, nb = samples.scattered_tables(rng_for("samples"), [32, 17], 16, spare_blocks=0, spare_columns=0)
    assert tables.shape == (2, 2) and nb == 4
    assert sorted(tables[0].tolist() + tables[1, :2].tolist()) == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        samples.scattered_tables(rng_for("samples"), [32], 16, num_blocks=1)


# ---------------------------------------------------------------------------------------------
# cache contents


def _valid_codes(m: QuantMode) -> set[int]:
    fmt = m.code_format
    return set(fmt.codes_of(fmt.representable()).tolist())


def _codes_and_scales(m: QuantMode, cache, scales) -> tuple[np.ndarray, np.ndarray | None]:
    """(one code per element, the per-row scales) of a live cache of one side's mode m: packed
    codes unpacked, and a per-row zero point taken off the scale word."""
    codes, sc = samples.host_codes(cache, m), samples.host_scales(scales)
    if m.format is not None and m.format.row_zero_point:
        return m.format.unpack(codes), m.format.split_scale_words(sc)[0]
    return codes, sc


@pytest.mark.parametrize("fill", ["host", "torch"])
@pytest.mark.parametrize("mode", list(MODES))
def test_caches_hold_representable_codes_and_no_nan(mode, fill):
    kw = dict(spare_blocks=0, spare_columns=0) if fill == "torch" else {}
    s = _small(rng_for("samples", "codes", mode, fill), mode, fill=fill, **kw)
    sides = (
        (MODES[mode].key_side, s.caches.key_cache, s.caches.k_scale_cache),
        (MODES[mode].value_side, s.caches.value_cache, s.caches.v_scale_cache),
    )
    for m, cache, scales in sides:
        codes, sc = _codes_and_scales(m, cache, scales)
        if m.code_dtype is None:
            assert np.isfinite(codes.astype(np.float32)).all()
        else:
            assert set(np.unique(codes).tolist()) <= _valid_codes(m)
            # Spread over the format's range (all 16 of uint4's, more than 20 of 8-bit ones).
            assert len(np.unique(codes)) > min(20, len(_valid_codes(m)) - 4), "codes spread over the range"
        if m.per_token_head:
            low, high = samples.row_scale_range(m, 16)
            assert ((np.float32(low) * (1 - 2.0**-19) <= sc) & (sc <= np.float32(high))).all()
        decoded = samples.oracle_model_values(m, samples.host_codes(cache, m), samples.host_scales(scales), s.k_scale)
        assert np.isfinite(decoded).all()
        if m.format is not None and m.format.row_zero_point:
            # Rows decode to values of the size int8's do (about 0.1 to 2), and each row's
            # range holds 0 (its zero point is one of the codes' values), as an encoder's does.
            assert 0.05 < float(np.sqrt(np.mean(decoded**2))) < 2
            zp = m.format.split_scale_words(samples.host_scales(scales))[1]
            assert ((codes.min(axis=-1) <= zp) & (zp <= codes.max(axis=-1))).mean() > 0.9
    if MODES[mode].per_tensor:
        m = MODES[mode]
        # unit_static_scale: codes of about +-qmax / 3 decode to order 1 whatever the format.
        lo, hi = np.float32(0.004 * 448 / m.qmax), np.float32(0.02 * 448 / m.qmax)
        assert lo <= s.k_scale <= hi and lo <= s.v_scale <= hi


@pytest.mark.parametrize("mode", list(MODES))
def test_poison_makes_exactly_the_asked_key_nan(mode):
    if not MODES[mode].holds_nan:
        # int8_per_tensor: no code decodes to NaN and there is no per-row scale to carry it.
        with pytest.raises(ValueError, match="poison"):
            _small(rng_for("samples", "poison", mode), mode, poison=True)
        return
    s = _small(rng_for("samples", "poison", mode), mode, poison=True)
    k = samples.oracle_model_values(MODES[mode].key_side, s.key_codes, s.k_scales, s.k_scale)
    bad = np.argwhere(~np.isfinite(k))
    pos = int(s.batch.seq_lens[0]) - 1
    block, off = int(s.batch.tables[0, pos // 4]), pos % 4
    assert len(bad) and all(tuple(b[:3]) == (block, off, 0) for b in bad), bad
    assert np.isfinite(samples.oracle_model_values(MODES[mode].value_side, s.value_codes, s.v_scales, s.v_scale)).all()
    ref = s.reference()
    group = s.query.shape[1] // s.caches.key_cache.shape[2]
    last = int(s.batch.qsl[1]) - 1
    assert not np.isfinite(ref[last, :group]).any() and np.isfinite(ref[last, group:]).all()
    assert np.isfinite(np.delete(ref, last, axis=0)).all(), "no other sequence reads the poisoned page"


# ---------------------------------------------------------------------------------------------
# shapes, dtypes and places


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("mode,layout", MODE_LAYOUTS)
def test_paged_sample_shapes_and_dtypes(mode, layout, place):
    m = MODES[mode]
    kind, device = place
    s = _small(
        rng_for("samples", "shapes"), mode, layout=layout, kind=kind, device=device, query_dtype="float16", sinks=True
    )
    T, S = s.batch.num_tokens, len(s.batch.seq_lens)
    nb, c = s.batch.num_blocks, s.caches
    is_kind = (
        (lambda x: isinstance(x, np.ndarray))
        if kind == "numpy"
        else (lambda x: isinstance(x, torch.Tensor) and x.device.type == device)
    )
    arrays = [s.query, c.key_cache, c.value_cache, s.block_tables, s.seq_lens, s.query_start_loc, s.sinks]
    assert all(is_kind(x) for x in arrays)
    assert tuple(s.query.shape) == (T, 4, 16) and dtype_name(s.query) == "float16"
    for cache, side in ((c.key_cache, m.key_side), (c.value_cache, m.value_side)):
        want_cache = side.code_dtype or "float16"
        assert tuple(cache.shape) == (nb, 4, 2, side.cache_width(16)) and dtype_name(cache) == want_cache
    if m.per_token_head:
        assert tuple(c.k_scale_cache.shape) == (nb, 4, 2) and dtype_name(c.v_scale_cache) == "float32"
    else:
        assert c.k_scale_cache is None and c.v_scale_cache is None
    assert (s.k_scale is None) == (not m.per_tensor)
    assert tuple(s.block_tables.shape) == s.batch.tables.shape and tuple(s.seq_lens.shape) == (S,)
    assert tuple(s.query_start_loc.shape) == (S + 1,)
    assert {dtype_name(x) for x in (s.block_tables, s.seq_lens, s.query_start_loc)} == {"int32"}
    assert tuple(s.sinks.shape) == (4,) and dtype_name(s.sinks) == "float32"
    if layout == "inline":
        assert tuple(c.buffer.shape) == (nb, 2, 4, 2, 20) and dtype_name(c.buffer) == "uint8"
    # The host copies are the arrays' bytes.
    assert samples.host_codes(c.key_cache, m).tobytes() == s.key_codes.tobytes()
    assert samples.host_codes(c.value_cache, m).tobytes() == s.value_codes.tobytes()
    assert _bytes(s.query) == _bytes(s.query_host)
    out = s.new_out()
    assert is_kind(out) and tuple(out.shape) == tuple(s.query.shape) and dtype_name(out) == "float16"


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize(
    "mode,layout",
    [
        p
        for p in MODE_LAYOUTS
        if p.values[0]
        in ("none", "int8_per_token_head", "fp8_per_tensor", "fp8_e4m3fnuz_per_token_head", "int4_per_token_head")
    ],
)
def test_write_sample_shapes_slots_and_poison(mode, layout, place):
    m = MODES[mode]
    kind, device = place
    # Some slots negative and some wild in every draw of 3 or more tokens (write_slots).
    w = samples.write_sample(
        rng_for("samples", "write shapes"),
        mode,
        num_tokens=64,
        num_kv_heads=2,
        head_size=16,
        block_size=4,
        dtype="float16",
        layout=layout,
        kind=kind,
        device=device,
        strided=True,
        negative_slots=True,
        wild_slots=True,
        guard_blocks=1,
        index_dtype="int32",
    )
    assert w.num_blocks == -(-64 // 4) + 2
    for rows, values in ((w.key, w.key32), (w.value, w.value32)):
        assert tuple(rows.shape) == (64, 2, 16) and dtype_name(rows) == "float16"
        assert not (rows.is_contiguous() if kind == "torch" else rows.flags.c_contiguous), "a fused-QKV view"
        assert np.array_equal(
            np.asarray(torch.as_tensor(np.asarray(host_bytes(rows).view(np.float16)[..., 0])).float()), values
        ), "rows exact in their dtype"
    assert dtype_name(w.slot_mapping) == "int32" and w.slots.dtype == np.int64
    capacity = w.num_blocks * 4
    wild = w.slots >= capacity
    assert wild.any() and (w.slots < capacity + 8).all() and (w.oracle_slots[wild] == -1).all()
    assert (w.slots < 0).any() and (w.oracle_slots[~wild] == w.slots[~wild]).all()
    placed = w.oracle_slots[w.oracle_slots >= 0]
    assert len(set(placed.tolist())) == len(placed)
    for cache, guard in zip(w.cache_arrays(), w.guard):
        if cache is None:
            continue
        assert cache.shape[0] == w.num_blocks and guard.shape[0] == 1
        assert (host_bytes(cache) != 0).any(axis=-1).all(), "poison: random bytes, never zero"
    if layout == "inline":
        assert w.caches.buffer.shape[0] == w.num_blocks
    w.assert_guard_unchanged("nothing")
    w.padded.key_cache[w.num_blocks :][0, 0, 0, 0] = 0
    with pytest.raises(AssertionError, match="past the end"):
        w.assert_guard_unchanged("a write")
    if m.per_tensor:
        assert w.static_scale is not None and "k_scale" in w.api_kwargs()


def test_paged_slots_fill_random_blocks_in_order():
    slots, same = samples.write_slots(rng_for("samples", "paged slots"), 37, 20, 8, order="paged")
    assert np.array_equal(slots, same)
    blocks = slots // 8
    assert (slots % 8 == np.arange(37) % 8).all() and len(set(blocks.tolist())) == 5
    assert (np.diff(blocks[::8]) != 1).any(), "blocks at random, not in memory order"


# ---------------------------------------------------------------------------------------------
# the reference and the tolerance


class _Impl:
    name = "probe"
    attention_rtol = 1e-3


def test_reference_is_the_oracle_on_the_quantized_cache():
    s = _small(rng_for("samples", "reference"), "int8_per_token_head", sinks=True)
    k = oracle.decode_cache(s.key_codes, s.k_scales, "int8_per_token_head")
    v = oracle.decode_cache(s.value_codes, s.v_scales, "int8_per_token_head")
    want = oracle.attention_f64(
        s.query_host, k, v, s.batch.tables, s.batch.seq_lens, s.batch.qsl, sliding_window=3, sinks=s.sinks_host
    )
    assert s.reference(sliding_window=3).tobytes() == want.tobytes()
    qq = s.reference(quantize_query=True)
    assert qq.shape == want.shape and not np.array_equal(qq, s.reference())


def test_tolerance_is_declared_rtol_plus_output_rounding_per_sequence():
    s = _small(rng_for("samples", "tolerance"), "fp8_per_token_head", batch="decode")
    ref = s.reference()
    qsl = s.batch.qsl
    assert samples.attention_tolerance(_Impl, "bfloat16") == 1e-3 + 2.0**-8
    samples.assert_attention_close(_Impl, ref, ref, qsl, "float32")
    # 0.5x the tolerance in every sequence passes; 2x in one short sequence fails.
    near = ref * (1 + 0.5e-3)
    samples.assert_attention_close(_Impl, near, ref, qsl, "float32")
    far = ref.copy()
    far[qsl[1] : qsl[2]] *= 1 + 2e-3
    with pytest.raises(AssertionError, match="sequence 1"):
        samples.assert_attention_close(_Impl, far, ref, qsl, "float32")
    # bf16 output: its rounding is allowed on top.
    samples.assert_attention_close(_Impl, far, ref, qsl, "bfloat16")
    unwritten = ref.copy()
    unwritten[0, 0, 0] = np.nan
    with pytest.raises(AssertionError, match="not finite"):
        samples.assert_attention_close(_Impl, unwritten, ref, qsl, "float32")
    poisoned = ref.copy()
    poisoned[0, 0, 0] = np.nan
    with pytest.raises(AssertionError, match="poisoned"):
        samples.assert_attention_close(_Impl, ref, poisoned, qsl, "float32")


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("layout", ["separate", "inline"])
def test_host_copies_are_not_views_of_the_arrays(layout, place):
    # The reference must be of the cache as built: an implementation that writes into its
    # inputs (or a test that edits them) must not change it.
    kind, device = place
    s = _small(rng_for("samples", "copies"), "int8_per_token_head", layout=layout, kind=kind, device=device, sinks=True)
    before = s.reference()
    for x in (s.query, s.caches.key_cache, s.caches.value_cache, s.caches.k_scale_cache, s.sinks):
        x[...] = 0
    assert s.reference().tobytes() == before.tobytes()
