"""The adversarial battery (issue 14): SPEC.md section 11 against every registered implementation.

Every case runs on every implementation the registry lists for its operation (collected at
import time: registering a backend puts it here with no test edits), through the public API
with impl=<name>. Arrays are views into buffers of random bytes with guards and gaps; after
every call each byte of those buffers is compared with its value before. Accepted calls are
compared with kvzoo_spec/oracle.py (raw bytes for the cache and dequantize, the conformance
tolerance for attention); refused calls must raise kvzoo.KVZooInputError whose message starts
with the argument's name, with every cache, scale cache and output byte unchanged.

Expected outcomes are written from SPEC.md section 11, not from the code. A call that an
implementation declines through the registry is a skip only where `expected_decline` says so
(numba and quantize_query); anywhere else it fails, so a backend cannot pass by running nothing.

Every torch tensor of a case lives on the device the implementation takes (a GPU backend: its
GPU, with the compiled kernels). NumPy arrays are host memory, which such a backend does not
take: a case about NumPy itself (negative strides, byte order, read-only arrays, the "numpy"
kind of a case that also runs as "torch") is skipped there; a case that uses NumPy only to vary
an index dtype or layout runs with device tensors instead (case_kind).
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch
from hostile_support import (
    FORCE_COPY,
    INDEX_DTYPES,
    ONE_D_LAYOUTS,
    TWO_D_LAYOUTS,
    Batch,
    Guard,
    Region,
    assert_attention_close,
    assert_same_floats,
    assert_write_matches,
    call_accepted,
    call_refused,
    case_array,
    case_device,
    case_kind,
    case_tensor,
    data_region,
    entries,
    expected_decline,
    float_rows,
    forget_placed,
    guard_of,
    impl_params,
    impls,
    index_view,
    layout_fits,
    layouts_for,
    make_batch,
    make_caches,
    placement_checked,
    reference_attention,
    require_usable,
    rng_for,
    spy_launches,
    to_host,
    to_host_float32,
    via,
    with_entries,
)
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st
from numpy.lib.stride_tricks import as_strided

import kvzoo
import kvzoo.torch_ops  # noqa: F401 (registers the ops the lying-metadata cases call)
from kvzoo import KVZooInputError, samples
from kvzoo.layout import KVCacheTensors
from kvzoo.modes import MODES

from support import SEED

H, HQ, D, BS = 2, 4, 16, 4
# Every mode with a code format (per-token-head first), so a new mode goes through each test
# below; the inline layout takes the modes that define it (per-token-head ones but int4).
PER_TOKEN_HEAD = tuple(name for name, m in MODES.items() if m.per_token_head)
INLINE = tuple(name for name, m in MODES.items() if "inline" in m.layouts)
PER_TENSOR = tuple(name for name, m in MODES.items() if m.per_tensor)
QUANTIZED = PER_TOKEN_HEAD + PER_TENSOR
ALL_MODES = tuple(MODES)
# Modes whose keys and values share one format (one cache can stand for both).
ONE_FORMAT_MODES = tuple(m for m in ALL_MODES if not MODES[m].split)

# Derandomized (the data inside each example still comes from the session SEED); no shrink
# phase, so a failing backend costs the CI no more time than a passing one (hypothesis still
# prints every draw of the failing example).
FUZZ = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
        HealthCheck.function_scoped_fixture,
    ],
)


@pytest.fixture(autouse=True)
def _tensors_on_the_case_device(monkeypatch):
    """KVZOO_HOSTILE_FORCE_COPY=1: every tensor a case hands kvzoo must come from
    to_case_device, so a CPU run catches the tensor a GPU run would leave on the host."""
    if FORCE_COPY:
        for op in ("reshape_and_cache", "dequantize", "paged_attention"):
            monkeypatch.setattr(kvzoo, op, placement_checked(getattr(kvzoo, op)))
    yield
    forget_placed()


@pytest.fixture(autouse=True)
def _launches_spied(monkeypatch):
    """Every call's launches.run recorded, so check_call can tell an accepted call reached the
    implementation under test through whichever entry point the case took."""
    spy_launches(monkeypatch)


def pick_mode(impl, *key, candidates=ALL_MODES) -> str:
    """A mode the implementation registers, varied (deterministically) across cases."""
    modes = [m for m in candidates if m in impl.modes]
    if not modes:
        pytest.skip(f"{impl.name} registers none of {list(candidates)}")
    return modes[zlib.crc32(repr(key).encode()) % len(modes)]


# ---------------------------------------------------------------------------------------------
# shared set-ups


class WriteSetup:
    """Guarded caches and key/value regions for one reshape_and_cache call (tensors on the
    device `impl` takes)."""

    def __init__(
        self,
        rng,
        mode: str,
        kind: str,
        *,
        impl,
        T: int = 7,
        dtype: str = "bfloat16",
        storage: str = "code",
        num_blocks: int | None = None,
        key_flip=(),
        value_flip=(),
        heads: int = H,
        head_size: int = D,
        block_size: int = BS,
        layout: str = "separate",
        kv_gaps: bool = True,
    ):
        self.mode, self.kind, self.T = mode, kind, T
        self.num_blocks = num_blocks if num_blocks is not None else -(-T // block_size) + 2
        self.block_size = block_size
        shape = (self.num_blocks, block_size, heads, head_size)
        self.caches = make_caches(
            rng, mode, shape, kind, model_dtype=dtype, storage=storage, realistic=False, layout=layout, impl=impl
        )
        self.key = data_region(
            rng,
            float_rows(rng, (T, heads, head_size), dtype),
            dtype,
            kind,
            "key",
            impl=impl,
            flip=key_flip,
            gaps=kv_gaps,
        )
        self.value = data_region(
            rng,
            float_rows(rng, (T, heads, head_size), dtype),
            dtype,
            kind,
            "value",
            impl=impl,
            flip=value_flip,
            gaps=kv_gaps,
        )

    @property
    def capacity(self) -> int:
        return self.num_blocks * self.block_size

    def valid_slots(self, rng, skip_fraction: float = 0.3) -> np.ndarray:
        slots = rng.permutation(self.capacity)[: self.T].astype(np.int64)
        skip = rng.random(self.T) < skip_fraction
        slots[skip] = -rng.integers(1, 5, int(skip.sum()))
        return slots

    def args(self, slot_mapping, key=None, value=None, key_cache=None, value_cache=None):
        c = self.caches
        return (
            self.key.array if key is None else key,
            self.value.array if value is None else value,
            c.key.array if key_cache is None else key_cache,
            c.value.array if value_cache is None else value_cache,
            slot_mapping,
        )

    def guards(self) -> list:
        return list(self.caches.regions)

    def run_accepted(
        self, impl, slot_mapping, slot_values, *, rounding="nearest", extra_guards=(), entry="functional", **kw
    ):
        call_accepted(
            impl,
            via(entry, "reshape_and_cache"),
            *self.args(slot_mapping),
            rounding=rounding,
            **self.caches.api_kwargs(),
            **kw,
        )
        self.key.assert_unchanged(f"{impl.name}: key (a read array)")
        self.value.assert_unchanged(f"{impl.name}: value (a read array)")
        for g in extra_guards:
            assert g.unchanged(), f"{impl.name}: {g.label} (a read array) changed"
        assert_write_matches(impl.name, self.caches, self.key.values(), self.value.values(), slot_values, rounding)


def slot_junk(capacity):
    return lambda shape: np.random.default_rng(capacity).integers(0, capacity, shape)


class AttentionSetup:
    """Guarded caches (realistic contents), query and out regions for a batch (tensors, index
    tensors included, on the device `impl` takes)."""

    def __init__(
        self,
        rng,
        mode: str,
        kind: str,
        batch: Batch,
        *,
        impl,
        qdtype: str = "bfloat16",
        model_dtype: str = "bfloat16",
        storage: str = "code",
        heads_q: int = HQ,
        heads_kv: int = H,
        head_size: int = D,
        query_flip=(),
        cache_gaps: bool = True,
        layout: str = "separate",
        query_gaps: bool = True,
    ):
        self.mode, self.kind, self.batch, self.qdtype, self.impl = mode, kind, batch, qdtype, impl
        shape = (batch.num_blocks, batch.block_size, heads_kv, head_size)
        self.caches = make_caches(
            rng, mode, shape, kind, model_dtype=model_dtype, storage=storage, gaps=cache_gaps, layout=layout, impl=impl
        )
        T = batch.num_tokens
        q = rng.standard_normal((T, heads_q, head_size)).astype(np.float32)
        self.query = data_region(
            rng,
            q.astype(np.float32).astype(_np(qdtype)),
            qdtype,
            kind,
            "query",
            impl=impl,
            flip=query_flip,
            gaps=query_gaps,
        )
        self.out = Region(rng, (T, heads_q, head_size), qdtype, kind, label="out", impl=impl)
        self.sinks_values = None
        self.entry = "functional"  # the entry point call() reaches paged_attention through

    def index_tensors(self, kind: str, dtype: str, rng, layouts: dict | None = None):
        return batch_index_tensors(self.batch, kind, dtype, rng, layouts, impl=self.impl)

    def sinks(self, kind: str, layout: str, rng):
        values = (rng.standard_normal(self.query.shape[1]) * 2).astype(np.float32)
        if layout == "expand":
            values[:] = values[0]
        self.sinks_values = values
        return index_view(
            values,
            "float32",
            "numpy" if layout.startswith("negative") else kind,
            layout,
            rng,
            lambda shape: np.full(shape, 50.0),
            impl=self.impl,
        )

    def call(
        self,
        impl,
        block_tables,
        seq_lens,
        qsl,
        *,
        out="region",
        query=None,
        key_cache=None,
        value_cache=None,
        entry=None,
        **kw,
    ):
        """paged_attention on this set-up's arrays (any replaced by the keywords), through the
        entry point `entry` (hostile_support.via)."""
        entry = entry or self.entry
        c = self.caches
        api_kw = c.api_kwargs()
        for name in ("k_scale_cache", "v_scale_cache"):
            if name in kw:
                api_kw[name] = kw.pop(name)
        return via(entry, "paged_attention")(
            self.query.array if query is None else query,
            c.key.array if key_cache is None else key_cache,
            c.value.array if value_cache is None else value_cache,
            block_tables=block_tables,
            seq_lens=seq_lens,
            query_start_loc=qsl,
            out=self.out.array if isinstance(out, str) and out == "region" else out,
            impl=impl,
            **api_kw,
            **kw,
        )

    def run_accepted(
        self,
        impl,
        block_tables,
        seq_lens,
        qsl,
        *,
        guards=(),
        window=None,
        softcap=None,
        softmax_scale=None,
        quantize_query=False,
        oracle_window="same",
        **kw,
    ):
        decline = expected_decline(impl, quantize_query=quantize_query, head_size=self.query.shape[2])
        result = call_accepted(
            impl,
            lambda *a, impl, **k: self.call(impl, *a, **k),
            block_tables,
            seq_lens,
            qsl,
            sliding_window=window,
            softcap=softcap,
            softmax_scale=softmax_scale,
            quantize_query=quantize_query,
            decline_ok=decline,
            **kw,
        )
        self.check(
            impl,
            result,
            guards=guards,
            window=window if oracle_window == "same" else oracle_window,
            softcap=softcap,
            softmax_scale=softmax_scale,
            quantize_query=quantize_query,
            sinks=kw.get("sinks") is not None,
        )
        return result

    def check(
        self,
        impl,
        result,
        *,
        guards=(),
        window=None,
        softcap=None,
        softmax_scale=None,
        quantize_query=False,
        sinks=False,
    ):
        what = f"{impl.name} paged_attention"
        for r in self.caches.regions:
            r.assert_outside_unchanged(f"{what}: a cache (read array)", [self.out], only_others=True)
        self.query.assert_outside_unchanged(f"{what}: query (a read array)", [self.out], only_others=True)
        for g in guards:
            assert g.unchanged(), f"{what}: {g.label} (a read array) changed"
        self.out.assert_outside_unchanged(what)
        assert tuple(result.shape) == self.out.shape, f"{what}: returned shape {tuple(result.shape)}"
        b = self.batch
        if b.num_tokens == 0:
            return
        ref = reference_attention(
            self.caches,
            self.query.values("before"),
            b.tables,
            b.seq_lens,
            b.qsl,
            quantize_query=quantize_query,
            softmax_scale=softmax_scale,
            sliding_window=window,
            softcap=softcap,
            sinks=self.sinks_values if sinks else None,
        )
        got = self.out.values().astype(np.float32).astype(np.float64)
        assert_attention_close(impl, got, ref, b.qsl, self.qdtype)
        returned = to_host_float32(result).astype(np.float64)
        assert np.array_equal(returned, got, equal_nan=True), f"{what}: the returned array is not `out`"


def batch_index_tensors(b: Batch, kind: str, dtype: str, rng, layouts: dict | None = None, *, impl):
    """(block_tables, seq_lens, query_start_loc, guards) of a batch, each in the layout asked
    for (NumPy for negative strides); the buffers' other elements hold plausible wrong values."""
    layouts = layouts or {}
    T = b.num_tokens
    jt = lambda shape: rng.integers(0, b.num_blocks, shape)  # noqa: E731
    js = lambda shape: rng.integers(1, max(2, int(b.seq_lens.max(initial=1)) + 1), shape)  # noqa: E731
    jq = lambda shape: rng.integers(0, T + 1, shape)  # noqa: E731
    out, guards = [], []
    for values, name, junk in (
        (b.tables, "block_tables", jt),
        (b.seq_lens, "seq_lens", js),
        (b.qsl, "query_start_loc", jq),
    ):
        layout = layouts.get(name, "contiguous")
        arr, g = index_view(
            values, dtype, "numpy" if layout.startswith("negative") else kind, layout, rng, junk, impl=impl
        )
        out.append(arr)
        guards.append(g)
    return (*out, guards)


def _np(dtype: str):
    from kvzoo.arrays import numpy_dtype

    return numpy_dtype(dtype)


def batch_for(rng, q_lens, seq_lens, block_size=BS, tables="distinct") -> Batch:
    q_lens = np.asarray(q_lens, np.int64)
    seq_lens = np.asarray(seq_lens, np.int64)
    blocks = -(-seq_lens // block_size)
    S = len(seq_lens)
    max_blocks = int(blocks.max(initial=0)) + 1
    if tables == "distinct":
        num_blocks = int(blocks.sum()) + 2
        order = rng.permutation(num_blocks)
        t = rng.integers(0, num_blocks, (S, max_blocks))
        start = 0
        for s, n in enumerate(blocks):
            t[s, :n] = order[start : start + n]
            start += n
    elif tables == "shared":  # every sequence reads the same table row
        num_blocks = max_blocks + 2
        t = np.broadcast_to(rng.permutation(num_blocks)[:max_blocks], (S, max_blocks)).copy()
    elif tables == "constant":  # each sequence reads one block for all its positions
        num_blocks = S + 2
        t = np.repeat(rng.permutation(num_blocks)[:S, None], max_blocks, axis=1)
    else:
        raise ValueError(tables)
    return Batch(q_lens, seq_lens, t.astype(np.int64), num_blocks, block_size)


def batch_for_layout(rng, tensor: str, layout: str) -> Batch:
    if tensor == "block_tables" and layout == "expand-rows":
        return batch_for(rng, [1, 3, 2], [9, 7, 2], tables="shared")
    if tensor == "block_tables" and layout == "expand-cols":
        return batch_for(rng, [1, 3, 2], [9, 7, 2], tables="constant")
    if tensor == "seq_lens" and layout == "expand":
        return batch_for(rng, [1, 4, 9], [9, 9, 9])
    if tensor == "query_start_loc" and layout == "expand":
        return batch_for(rng, [0, 0, 0], [5, 9, 1])  # no query tokens: nothing computed, nothing written
    return make_batch(rng, "mixed")


# ---------------------------------------------------------------------------------------------
# 0. the registry contract of section 11


@pytest.mark.parametrize("op", ["reshape_and_cache", "dequantize", "paged_attention"])
def test_every_implementation_declares_index_strides(op):
    """SPEC 11 'strides, index tensors': each implementation declares index_strides 'any' or 'unit'."""
    bad = {
        i.name: getattr(i, "index_strides", "<missing>")
        for i in impls(op)
        if getattr(i, "index_strides", None) not in ("any", "unit")
    }
    assert not bad, f"{op}: implementations without index_strides in ('any', 'unit'): {bad}"


def test_battery_covers_every_registered_implementation():
    for op in ("reshape_and_cache", "dequantize", "paged_attention"):
        assert impls(op), f"no implementation of {op} registered"


# ---------------------------------------------------------------------------------------------
# 1. index tensors in any layout: accepted, the oracle's result


WRITE_LAYOUTS = [
    (layout, dtype, kind)
    for layout in ONE_D_LAYOUTS
    for dtype in INDEX_DTYPES
    for kind in ("torch", "numpy")
    if not (kind == "torch" and layout.startswith("negative"))
]


def _layout_traits(case: tuple) -> tuple[str, ...]:
    """(layout, dtype, kind, validate): NumPy arrays, and validate=False (the unvalidated entry's
    case already, through the functional entry)."""
    return (*(("numpy",) if case[2] == "numpy" else ()), *(() if case[3] else ("unvalidated",)))


@pytest.mark.parametrize(
    "layout,dtype,kind,validate,entry",
    with_entries(
        "reshape_and_cache",
        [(*p, v) for p in WRITE_LAYOUTS for v in (True, False)],
        _layout_traits,
        ids=lambda c: "-".join(c[:3]) + ("-validate" if c[3] else "-novalidate"),
    ),
)
@pytest.mark.parametrize("impl", impl_params("reshape_and_cache"))
def test_write_slot_mapping_layout(impl, layout, dtype, kind, validate, entry):
    require_usable(impl, kind=kind)
    mode = pick_mode(impl, "write-layout", layout, dtype, kind)
    rng = rng_for("hostile-write-layout", impl.name, layout, dtype, kind, validate)
    w = WriteSetup(rng, mode, kind, T=7, impl=impl)
    if layout == "expand":
        # torch.tensor([-1]).expand(T): every token skipped, nothing written.
        slots = np.full(w.T, -1 if dtype == "int32" else -(2**40), np.int64)
    else:
        slots = w.valid_slots(rng)
        if dtype == "int64":
            slots[slots < 0] = -(2**40)  # negative beyond int32: still a skip
    sm, g = index_view(slots, dtype, kind, layout, rng, slot_junk(w.capacity), impl=impl)
    w.run_accepted(impl, sm, slots, extra_guards=[g], validate=validate, entry=entry)
    if layout == "expand":
        for r in w.caches.regions:
            r.assert_unchanged(f"{impl.name}: all slots negative")


def layout_kind(impl, dtype: str, layout: str) -> str:
    """The kind of a layout case's arrays: int64 as NumPy arrays, int32 as torch tensors (so
    both kinds see every layout); negative strides exist in NumPy only. A device implementation
    gets int64 device tensors, and no negative strides."""
    negative = layout.startswith("negative")
    require_usable(impl, kind="numpy" if negative else "torch")
    return case_kind("numpy" if (dtype == "int64" or negative) else "torch", impl)


ATTN_LAYOUTS = [("block_tables", lay) for lay in TWO_D_LAYOUTS] + [
    (t, lay) for t in ("seq_lens", "query_start_loc", "sinks") for lay in ONE_D_LAYOUTS
]


@pytest.mark.parametrize("dtype", INDEX_DTYPES)
@pytest.mark.parametrize("tensor,layout", [pytest.param(t, lay, id=f"{t}-{lay}") for t, lay in ATTN_LAYOUTS])
@pytest.mark.parametrize("impl", impl_params("paged_attention"))
def test_attention_index_layout(impl, tensor, layout, dtype):
    """One index tensor hostile (int32: torch tensors, int64: NumPy arrays), the rest plain."""
    kind = layout_kind(impl, dtype, layout)
    mode = pick_mode(impl, "attn-layout", tensor, layout, dtype)
    rng = rng_for("hostile-attn-layout", impl.name, tensor, layout, dtype)
    batch = batch_for_layout(rng, tensor, layout)
    a = AttentionSetup(rng, mode, kind, batch, impl=impl)
    layouts = {tensor: layout} if tensor != "sinks" else {}
    bt, sl, qsl, guards = a.index_tensors(kind, dtype, rng, layouts)
    sinks = None
    if tensor == "sinks":
        sinks, g = a.sinks(kind, layout, rng)
        guards.append(g)
    a.run_accepted(impl, bt, sl, qsl, guards=guards, sinks=sinks)


ALL_HOSTILE = [  # (block_tables layout, 1-D layout, kind)
    ("stride2", "stride2", "torch"),
    ("fortran-offset", "offset", "torch"),
    ("colstride", "stride3", "torch"),
    ("negative", "negative", "numpy"),
    ("fortran", "stride2", "numpy"),
]


@pytest.mark.parametrize("validate", [True, False], ids=["validate", "novalidate"])
@pytest.mark.parametrize("batch_kind", ["decode", "mixed", "prefill", "invariant"])
@pytest.mark.parametrize("bt_layout,layout,kind", [pytest.param(*p, id="-".join(p)) for p in ALL_HOSTILE])
@pytest.mark.parametrize("impl", impl_params("paged_attention"))
def test_attention_every_index_tensor_hostile(impl, bt_layout, layout, kind, batch_kind, validate):
    """All four index tensors hostile at once, decode and prefill paths, with and without
    validation (validate=False: the kernels alone must honour the strides)."""
    negative = any(lay.startswith("negative") for lay in (bt_layout, layout))
    require_usable(impl, kind="numpy" if negative else "torch")
    mode = pick_mode(impl, "attn-all", bt_layout, layout, kind, batch_kind)
    rng = rng_for("hostile-attn-all", impl.name, bt_layout, layout, kind, batch_kind, validate)
    batch = make_batch(rng, "mixed" if batch_kind == "invariant" else batch_kind)
    qdtype, dtype = ("float16", "int64") if kind == "numpy" else ("bfloat16", "int32")
    kind = case_kind(kind, impl)  # int64 indices and a float16 query: device tensors carry them too
    a = AttentionSetup(rng, mode, kind, batch, qdtype=qdtype, impl=impl)
    bt, sl, qsl, guards = a.index_tensors(
        kind, dtype, rng, {"block_tables": bt_layout, "seq_lens": layout, "query_start_loc": layout}
    )
    sinks, g = a.sinks(kind, layout, rng)
    guards.append(g)
    kw = dict(sinks=sinks, batch_invariant=batch_kind == "invariant")
    if not validate:
        kw.update(
            validate=False,
            max_query_len=int(batch.q_lens.max()),
            max_seq_len=int(batch.seq_lens.max()),
            num_prefills=int((batch.q_lens > 1).sum()),
        )
    a.run_accepted(impl, bt, sl, qsl, guards=guards, **kw)


@pytest.mark.parametrize("impl", impl_params("paged_attention"))
def test_attention_unused_table_entries_hold_anything(impl):
    """SPEC 7/8: entries past ceil(seq_len / block_size) may hold anything (-1, int32 max)."""
    require_usable(impl)
    rng = rng_for("hostile-attn-tail", impl.name)
    mode = pick_mode(impl, "tail")
    batch = make_batch(rng, "mixed")
    used = np.arange(batch.tables.shape[1])[None, :] < -(-batch.seq_lens[:, None] // BS)
    tables = batch.tables.copy()
    tables[~used] = rng.choice([-1, 2**31 - 1, -(2**31)], int((~used).sum()))
    batch.tables = tables
    a = AttentionSetup(rng, mode, "torch", batch, impl=impl)
    bt, sl, qsl, guards = a.index_tensors("torch", "int32", rng, {"block_tables": "offset"})
    a.run_accepted(impl, bt, sl, qsl, guards=guards)


DEQ_LAYOUTS = [("block_tables", lay) for lay in TWO_D_LAYOUTS] + [("seq_lens", lay) for lay in ONE_D_LAYOUTS]


@pytest.mark.parametrize("dtype,entry", with_entries("dequantize", INDEX_DTYPES))
@pytest.mark.parametrize("tensor,layout", [pytest.param(t, lay, id=f"{t}-{lay}") for t, lay in DEQ_LAYOUTS])
@pytest.mark.parametrize("impl", impl_params("dequantize"))
def test_dequantize_index_layout(impl, tensor, layout, dtype, entry):
    kind = layout_kind(impl, dtype, layout)
    mode = pick_mode(impl, "deq-layout", tensor, layout, dtype)
    rng = rng_for("hostile-deq-layout", impl.name, tensor, layout, dtype)
    batch = batch_for_layout(rng, tensor, layout)
    if tensor == "seq_lens" and layout != "expand":
        batch = batch_for(rng, [0, 0, 0, 0], [5, 0, 9, 4])
    caches = make_caches(rng, mode, (batch.num_blocks, BS, H, D), kind, realistic=False, impl=impl)
    bt, sl, _, guards = batch_index_tensors(batch, kind, dtype, rng, {tensor: layout}, impl=impl)
    check_dequantize(impl, caches, bt, sl, batch.tables, batch.seq_lens, guards, entry=entry)


def check_dequantize(
    impl,
    caches,
    bt,
    sl,
    tables,
    seq_lens,
    guards=(),
    cache_array=None,
    scale_array=None,
    storage_caches=None,
    entry="functional",
):
    """dequantize(key cache) accepted and equal to oracle.gather_dequantize (NaN = NaN)."""
    kw = caches.api_kwargs()
    got = call_accepted(
        impl,
        via(entry, "dequantize"),
        caches.key.array if cache_array is None else cache_array,
        kw["k_scale_cache"] if scale_array is None else scale_array,
        mode=caches.mode,
        scale=kw["k_scale"],
        block_tables=bt,
        seq_lens=sl,
    )
    for r in caches.regions:
        r.assert_unchanged(f"{impl.name} dequantize: a cache (read array)")
    for g in guards:
        assert g.unchanged(), f"{impl.name} dequantize: {g.label} changed"
    codes, scales = caches.oracle_codes("key", "before")
    if tables is None:
        want = samples.oracle_decoded_cache(caches.mode, codes, scales, caches.k_static)
    else:
        want = samples.oracle_gathered(
            caches.mode, codes, scales, np.asarray(tables), np.asarray(seq_lens), caches.k_static
        )
    assert_same_floats(to_host_float32(got), want, f"{impl.name} dequantize")
    return got


@pytest.mark.parametrize("kind", ["torch", "numpy"])
@pytest.mark.parametrize("impl", impl_params("dequantize"))
def test_dequantize_whole_strided_cache(impl, kind):
    require_usable(impl, kind=kind)
    mode = pick_mode(impl, "deq-whole", kind)
    rng = rng_for("hostile-deq-whole", impl.name, kind)
    caches = make_caches(rng, mode, (3, BS, H, D), kind, realistic=False, impl=impl)
    check_dequantize(impl, caches, None, None, None, None)


@pytest.mark.parametrize("which", ["index", "table-row", "query"])
@pytest.mark.parametrize("impl", impl_params("paged_attention"))
def test_attention_single_element_negative_strides(impl, which):
    """One decode: seq_lens [1] and block_tables [1, 1] ("index"), one table row [1, M] read
    backwards along its size-1 row axis ("table-row"), or the query's size-1 token dimension,
    with negative NumPy strides. NumPy flags such arrays contiguous; their strides are negative."""
    require_usable(impl, kind="numpy")
    mode = pick_mode(impl, "one-neg", which)
    rng = rng_for("hostile-one-neg", impl.name, which)
    a = AttentionSetup(
        rng,
        mode,
        "numpy",
        batch_for(rng, [1], [3 if which == "index" else 9]),
        query_flip=(0,) if which == "query" else (),
        query_gaps=which != "query",
        impl=impl,
    )
    layout = {"index": "negative", "table-row": "contiguous", "query": "contiguous"}[which]
    bt, sl, qsl, guards = a.index_tensors(
        "numpy",
        "int64",
        rng,
        {
            "block_tables": "negative-rows" if which == "table-row" else layout,
            "seq_lens": layout,
            "query_start_loc": layout,
        },
    )
    sinks, g = a.sinks("numpy", layout, rng)
    a.run_accepted(impl, bt, sl, qsl, guards=guards + [g], sinks=sinks)


@pytest.mark.parametrize("impl", impl_params("dequantize"))
def test_dequantize_single_element_negative_strides(impl):
    require_usable(impl, kind="numpy")
    mode = pick_mode(impl, "one-neg-deq")
    rng = rng_for("hostile-one-neg-deq", impl.name)
    caches = make_caches(rng, mode, (3, BS, H, D), "numpy", realistic=False, impl=impl)
    tables, seq_lens = np.array([[2]]), np.array([3])
    bt, g1 = index_view(tables, "int32", "numpy", "negative", rng, impl=impl)
    sl, g2 = index_view(seq_lens, "int64", "numpy", "negative", rng, impl=impl)
    check_dequantize(impl, caches, bt, sl, tables, seq_lens, [g1, g2])


@pytest.mark.parametrize("which", ["slot_mapping", "key"])
@pytest.mark.parametrize("impl", impl_params("reshape_and_cache"))
def test_write_single_element_negative_strides(impl, which):
    """T = 1: slot_mapping [1], or key's token dimension (size 1), with a negative NumPy stride."""
    require_usable(impl, kind="numpy")
    mode = pick_mode(impl, "one-neg-write", which)
    rng = rng_for("hostile-one-neg-write", impl.name, which)
    # No gaps in key: otherwise contiguous, NumPy flags it C-contiguous despite the negative stride.
    w = WriteSetup(rng, mode, "numpy", T=1, key_flip=(0,) if which == "key" else (), kv_gaps=which != "key", impl=impl)
    slots = w.valid_slots(rng, 0.0)
    layout = "negative" if which == "slot_mapping" else "contiguous"
    sm, g = index_view(slots, "int32", "numpy", layout, rng, slot_junk(w.capacity), impl=impl)
    w.run_accepted(impl, sm, slots, extra_guards=[g])


@pytest.mark.parametrize("mode", QUANTIZED)
@pytest.mark.parametrize("impl", impl_params("paged_attention"))
def test_attention_long_prefill_hostile_indices(impl, mode):
    """Prompt-sized query runs (128+ tokens: the Triton backend stages them) beside a decode,
    every index tensor strided."""
    require_usable(impl, mode)
    rng = rng_for("hostile-long", impl.name, mode)
    a = AttentionSetup(rng, mode, "torch", batch_for(rng, [130, 1], [133, 7], block_size=16), impl=impl)
    bt, sl, qsl, guards = a.index_tensors(
        "torch", "int32", rng, {"block_tables": "fortran-offset", "seq_lens": "stride2", "query_start_loc": "stride3"}
    )
    a.run_accepted(impl, bt, sl, qsl, guards=guards)


@pytest.mark.parametrize("impl", impl_params("reshape_and_cache"))
def test_write_read_arrays_negative_strides(impl):
    """SPEC 11: read arrays (key, value) may have any strides, negative included (NumPy)."""
    require_usable(impl, kind="numpy")
    mode = pick_mode(impl, "neg-kv")
    rng = rng_for("hostile-neg-kv", impl.name)
    w = WriteSetup(rng, mode, "numpy", T=6, key_flip=(0, 2), value_flip=(1,), impl=impl)
    slots = w.valid_slots(rng)
    sm, g = index_view(slots, "int64", "numpy", "negative", rng, slot_junk(w.capacity), impl=impl)
    w.run_accepted(impl, sm, slots, extra_guards=[g])


@pytest.mark.parametrize("impl", impl_params("paged_attention"))
def test_attention_query_negative_strides(impl):
    require_usable(impl, kind="numpy")
    mode = pick_mode(impl, "neg-q")
    rng = rng_for("hostile-neg-q", impl.name)
    a = AttentionSetup(rng, mode, "numpy", make_batch(rng, "mixed"), qdtype="float32", query_flip=(1, 2), impl=impl)
    bt, sl, qsl, guards = a.index_tensors("numpy", "int32", rng)
    a.run_accepted(impl, bt, sl, qsl, guards=guards)


# ---------------------------------------------------------------------------------------------
# 2. codes in uint8 storage: byte-identical to the code dtype


@pytest.mark.parametrize("kind", ["torch", "numpy"])
@pytest.mark.parametrize("mode", QUANTIZED)
@pytest.mark.parametrize("impl", impl_params("reshape_and_cache"))
def test_uint8_storage_write(impl, mode, kind):
    require_usable(impl, mode, kind=kind)
    results = []
    for storage in ("code", "uint8"):
        rng = rng_for("hostile-u8-write", impl.name, mode, kind)  # same bytes for both storages
        w = WriteSetup(rng, mode, kind, T=7, storage=storage, impl=impl)
        slots = w.valid_slots(rng)
        w.run_accepted(impl, case_array(slots, kind, impl), slots)
        results.append([r.now().copy() for r in w.caches.regions])
    for a, b in zip(*results):
        assert np.array_equal(a, b), f"{impl.name} {mode}: uint8 storage wrote other bytes than {mode}'s code dtype"


@pytest.mark.parametrize("mode", QUANTIZED)
@pytest.mark.parametrize("impl", impl_params("dequantize"))
def test_uint8_storage_dequantize(impl, mode):
    require_usable(impl, mode)
    outs = []
    for storage in ("code", "uint8"):
        rng = rng_for("hostile-u8-deq", impl.name, mode)
        caches = make_caches(rng, mode, (5, BS, H, D), "torch", storage=storage, realistic=False, impl=impl)
        tables = np.array([[3, 1, 0], [4, 2, 2]])
        seq_lens = np.array([10, 6])
        bt, sl = case_tensor(tables.astype(np.int32), impl), case_tensor(seq_lens.astype(np.int32), impl)
        outs.append(to_host_float32(check_dequantize(impl, caches, bt, sl, tables, seq_lens)))
    assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32)), (
        f"{impl.name}: uint8 storage decoded differently"
    )


@pytest.mark.parametrize(
    "mode,quantize_query",
    [pytest.param(m, False, id=m) for m in QUANTIZED]
    + [pytest.param("int8_per_token_head", True, id="int8_per_token_head-quantize_query")],
)
@pytest.mark.parametrize("impl", impl_params("paged_attention"))
def test_uint8_storage_attention(impl, mode, quantize_query):
    require_usable(impl, mode)
    outs = []
    for storage in ("code", "uint8"):
        rng = rng_for("hostile-u8-attn", impl.name, mode, quantize_query)
        a = AttentionSetup(rng, mode, "torch", make_batch(rng, "mixed"), storage=storage, impl=impl)
        bt, sl, qsl, guards = a.index_tensors("torch", "int32", rng)
        a.run_accepted(impl, bt, sl, qsl, guards=guards, quantize_query=quantize_query)
        outs.append(a.out.element_bytes().copy())
    assert np.array_equal(outs[0], outs[1]), (
        f"{impl.name} {mode}: attention on uint8 storage is not byte-identical to the code dtype's"
    )


# ---------------------------------------------------------------------------------------------
# 3. byte order: non-native NumPy arrays refused


def _big_endian(a: np.ndarray) -> np.ndarray:
    return a.view(a.dtype.newbyteorder(">"))


BE_WRITE = ["key", "value", "k_scale_cache", "v_scale_cache", "slot_mapping", "key_cache(none)"]


WRITE_CACHES = ("key_cache", "value_cache", "k_scale_cache", "v_scale_cache", "mode")


def _write_traits(arg: str, *more: str) -> tuple[str, ...]:
    """A case's traits (hostile_support.NOT_THROUGH): "caches" where its bad argument is one a
    PagedKVCache passes itself."""
    return (*more, *(("caches",) if arg.split("(")[0] in WRITE_CACHES else ()))


@pytest.mark.parametrize("arg,entry", with_entries("reshape_and_cache", BE_WRITE, lambda a: _write_traits(a, "numpy")))
@pytest.mark.parametrize("impl", impl_params("reshape_and_cache"))
def test_write_big_endian_refused(impl, arg, entry):
    mode = "none" if arg == "key_cache(none)" else "int8_per_token_head"
    require_usable(impl, mode, kind="numpy")
    rng = rng_for("hostile-be-write", impl.name, arg)
    w = WriteSetup(rng, mode, "numpy", T=5, dtype="float32" if mode == "int8_per_token_head" else "float16", impl=impl)
    slots = w.valid_slots(rng).astype(np.int64)
    kw = w.caches.api_kwargs()
    args = list(w.args(slots))
    name = arg.split("(")[0]
    if name == "key":
        args[0] = _big_endian(args[0])
    elif name == "value":
        args[1] = _big_endian(args[1])
    elif name == "slot_mapping":
        args[4] = slots.astype(">i8")
    elif name == "key_cache":
        args[2] = _big_endian(args[2])
    else:
        kw[name] = _big_endian(kw[name])
    call_refused(impl, via(entry, "reshape_and_cache"), [name], w.guards(), *args, **kw)


BE_ATTN = ["query", "out", "k_scale_cache", "block_tables", "seq_lens", "query_start_loc", "sinks", "key_cache(none)"]


ATTN_CACHES = ("key_cache", "value_cache", "k_scale_cache", "v_scale_cache")


def _attn_traits(arg: str, *more: str) -> tuple[str, ...]:
    return (*more, *(("caches",) if arg.split("(")[0] in ATTN_CACHES else ()))


@pytest.mark.parametrize("arg,entry", with_entries("paged_attention", BE_ATTN, lambda a: _attn_traits(a, "numpy")))
@pytest.mark.parametrize("impl", impl_params("paged_attention"))
def test_attention_big_endian_refused(impl, arg, entry):
    mode = "none" if arg == "key_cache(none)" else "int8_per_token_head"
    require_usable(impl, mode, kind="numpy")
    rng = rng_for("hostile-be-attn", impl.name, arg)
    a = AttentionSetup(rng, mode, "numpy", make_batch(rng, "mixed"), qdtype="float32", model_dtype="float32", impl=impl)
    bt, sl, qsl, _ = a.index_tensors("numpy", "int32", rng)
    sinks = a.sinks("numpy", "contiguous", rng)[0]
    name = arg.split("(")[0]
    kw = dict(block_tables=bt, seq_lens=sl, qsl=qsl, sinks=sinks)
    extra = {}
    if name == "query":
        extra["query"] = _big_endian(a.query.array)
    elif name == "out":
        extra["out"] = _big_endian(a.out.array)
    elif name == "key_cache":
        extra["key_cache"] = _big_endian(a.caches.key.array)
    elif name == "k_scale_cache":
        extra["k_scale_cache"] = _big_endian(a.caches.k_scale.array)
    elif name == "query_start_loc":
        kw["qsl"] = qsl.astype(">i4")
    else:
        kw[name] = kw[name].astype(kw[name].dtype.newbyteorder(">"))
    qsl_ = kw.pop("qsl")
    call_refused(
        impl,
        lambda *x, impl, **k: a.call(
            impl, kw["block_tables"], kw["seq_lens"], qsl_, sinks=kw["sinks"], entry=entry, **extra
        ),
        [name],
        a.caches.regions + [a.out],
    )


DEQ_CACHES = ("cache", "scale_cache")


def _deq_traits(arg: str, *more: str) -> tuple[str, ...]:
    return (*more, *(("caches",) if arg.split("(")[0] in DEQ_CACHES else ()))


@pytest.mark.parametrize(
    "arg,entry",
    with_entries(
        "dequantize", ["scale_cache", "block_tables", "seq_lens", "cache(none)"], lambda a: _deq_traits(a, "numpy")
    ),
)
@pytest.mark.parametrize("impl", impl_params("dequantize"))
def test_dequantize_big_endian_refused(impl, arg, entry):
    mode = "none" if arg == "cache(none)" else "int8_per_token_head"
    require_usable(impl, mode, kind="numpy")
    rng = rng_for("hostile-be-deq", impl.name, arg)
    caches = make_caches(rng, mode, (4, BS, H, D), "numpy", model_dtype="float16", realistic=False, impl=impl)
    args = dict(
        cache=caches.key.array,
        scale_cache=None if caches.k_scale is None else caches.k_scale.array,
        block_tables=np.array([[0, 2], [3, 1]], np.int32),
        seq_lens=np.array([5, 8], np.int32),
    )
    name = arg.split("(")[0]
    args[name] = _big_endian(args[name]) if name in ("cache", "scale_cache") else args[name].astype(">i4")
    call_refused(
        impl,
        lambda impl: via(entry, "dequantize")(
            args["cache"],
            args["scale_cache"],
            mode=mode,
            block_tables=args["block_tables"],
            seq_lens=args["seq_lens"],
            impl=impl,
        ),
        [name],
        caches.regions,
    )


# ---------------------------------------------------------------------------------------------
# 4. read-only NumPy arrays: written ones refused, read ones accepted


def _read_only(a: np.ndarray) -> np.ndarray:
    v = a.view()
    v.flags.writeable = False
    return v


@pytest.mark.parametrize(
    "arg,entry",
    with_entries(
        "reshape_and_cache",
        ["key_cache", "value_cache", "k_scale_cache", "v_scale_cache"],
        lambda a: _write_traits(a, "numpy"),
    ),
)
@pytest.mark.parametrize("impl", impl_params("reshape_and_cache"))
def test_write_read_only_cache_refused(impl, arg, entry):
    require_usable(impl, "int8_per_token_head", kind="numpy")
    rng = rng_for("hostile-ro-write", impl.name, arg)
    w = WriteSetup(rng, "int8_per_token_head", "numpy", T=5, impl=impl)
    slots = w.valid_slots(rng)
    args = list(w.args(slots))
    kw = w.caches.api_kwargs()
    if arg in ("key_cache", "value_cache"):
        args[2 if arg == "key_cache" else 3] = _read_only(args[2 if arg == "key_cache" else 3])
    else:
        kw[arg] = _read_only(kw[arg])
    call_refused(impl, via(entry, "reshape_and_cache"), [arg], w.guards(), *args, **kw)


@pytest.mark.parametrize("impl", impl_params("reshape_and_cache"))
def test_write_read_only_inputs_accepted(impl):
    require_usable(impl, kind="numpy")
    mode = pick_mode(impl, "ro-inputs")
    rng = rng_for("hostile-ro-inputs", impl.name)
    w = WriteSetup(rng, mode, "numpy", T=6, impl=impl)
    slots = w.valid_slots(rng)
    w.key.array = _read_only(w.key.array)
    w.value.array = _read_only(w.value.array)
    w.run_accepted(impl, _read_only(slots.copy()), slots)


@pytest.mark.parametrize("entry", entries("paged_attention", "numpy"))
@pytest.mark.parametrize("impl", impl_params("paged_attention"))
def test_attention_read_only_out_refused(impl, entry):
    require_usable(impl, "int8_per_token_head", kind="numpy")
    rng = rng_for("hostile-ro-out", impl.name)
    a = AttentionSetup(rng, "int8_per_token_head", "numpy", make_batch(rng, "mixed"), impl=impl)
    bt, sl, qsl, _ = a.index_tensors("numpy", "int32", rng)
    call_refused(
        impl,
        lambda impl: a.call(impl, bt, sl, qsl, out=_read_only(a.out.array), entry=entry),
        ["out"],
        a.caches.regions + [a.out],
    )


@pytest.mark.parametrize("impl", impl_params("paged_attention"))
def test_attention_read_only_reads_accepted(impl):
    require_usable(impl, kind="numpy")
    mode = pick_mode(impl, "ro-reads", candidates=PER_TOKEN_HEAD)
    rng = rng_for("hostile-ro-reads", impl.name)
    a = AttentionSetup(rng, mode, "numpy", make_batch(rng, "mixed"), impl=impl)
    bt, sl, qsl, guards = a.index_tensors("numpy", "int64", rng)
    sinks = a.sinks("numpy", "stride2", rng)[0]
    a.query.array = _read_only(a.query.array)
    a.caches.key.array = _read_only(a.caches.key.array)
    a.caches.value.array = _read_only(a.caches.value.array)
    a.caches.k_scale.array = _read_only(a.caches.k_scale.array)
    a.caches.v_scale.array = _read_only(a.caches.v_scale.array)
    a.run_accepted(impl, _read_only(bt), _read_only(sl), _read_only(qsl), guards=guards, sinks=_read_only(sinks))


@pytest.mark.parametrize("impl", impl_params("dequantize"))
def test_dequantize_read_only_accepted(impl):
    require_usable(impl, kind="numpy")
    mode = pick_mode(impl, "ro-deq")
    rng = rng_for("hostile-ro-deq", impl.name)
    caches = make_caches(rng, mode, (4, BS, H, D), "numpy", realistic=False, impl=impl)
    tables, seq_lens = np.array([[0, 2], [3, 1]]), np.array([5, 8])
    sc = None if caches.k_scale is None else _read_only(caches.k_scale.array)
    check_dequantize(
        impl,
        caches,
        _read_only(tables.astype(np.int32)),
        _read_only(seq_lens.astype(np.int64)),
        tables,
        seq_lens,
        cache_array=_read_only(caches.key.array),
        scale_array=sc,
    )


# ---------------------------------------------------------------------------------------------
# 5. aliasing


def _strided(x, shape, strides_elems, offset=0):
    """A view of x's memory with element strides (torch or NumPy; writeable)."""
    if isinstance(x, torch.Tensor):
        return torch.as_strided(x, shape, strides_elems, x.storage_offset() + offset)
    assert offset == 0
    return as_strided(x, shape, tuple(s * x.itemsize for s in strides_elems), writeable=True)


def _byte_buffer(rng, nbytes, kind, impl):
    """A buffer of random bytes (a tensor on impl's case device, or a NumPy array)."""
    return case_array(rng.integers(1, 256, nbytes, dtype=np.uint8), kind, impl)


def _as_dtype(buf, start, count, dtype, kind, shape):
    """`count` elements of dtype at byte `start` of a uint8 buffer, reshaped."""
    if kind == "torch":
        from kvzoo.arrays import torch_dtype

        return buf[start : start + count * _np(dtype).itemsize].view(torch_dtype(dtype)).reshape(shape)
    return buf[start : start + count * _np(dtype).itemsize].view(_np(dtype)).reshape(shape)


WRITE_ALIASES = [
    "key_cache is value_cache",
    "k_scale_cache is v_scale_cache",
    "key_cache stride 0 over blocks",
    "k_scale_cache stride 0 over heads",
    "k_scale_cache overlaps key_cache",
    "value_cache overlaps key_cache",
    "key_cache overlaps itself",
    "key is a view of value_cache (none)",
    "v_scale_cache overlaps key",
]


# The last two alias the rows written with a cache (a PagedKVCache's too); the rest alter a cache.
WRITE_ALIASES_OF_CACHES = WRITE_ALIASES[:-2]


@pytest.mark.parametrize(
    "case,kind,entry",
    with_entries(
        "reshape_and_cache",
        [(c, k) for c in WRITE_ALIASES for k in ("torch", "numpy")],
        lambda ck: (
            *(("numpy",) if ck[1] == "numpy" else ()),
            *(("caches",) if ck[0] in WRITE_ALIASES_OF_CACHES else ()),
        ),
    ),
)
@pytest.mark.parametrize("impl", impl_params("reshape_and_cache"))
def test_write_aliasing_refused(impl, case, kind, entry):
    mode = "none" if "(none)" in case else "int8_per_token_head"
    require_usable(impl, mode, kind=kind)
    rng = rng_for("hostile-alias-write", impl.name, case, kind)
    T, NB = 5, 4
    dtype = "float32"
    w = WriteSetup(rng, mode, kind, T=T, dtype=dtype, num_blocks=NB, impl=impl)
    slots = w.valid_slots(rng, 0.0)
    sm = case_array(slots, kind, impl)
    c = w.caches
    args = list(w.args(sm))
    kw = c.api_kwargs()
    guards = list(c.regions) + [w.key, w.value]
    shape = (NB, BS, H, D)
    code = "int8" if mode != "none" else dtype
    if case == "key_cache is value_cache":
        args[3] = args[2]
        names = ["value_cache", "key_cache"]
    elif case == "k_scale_cache is v_scale_cache":
        kw["v_scale_cache"] = kw["k_scale_cache"]
        names = ["v_scale_cache", "k_scale_cache"]
    elif case == "key_cache stride 0 over blocks":
        base = c.key.array
        args[2] = _strided(base, shape, (0, *_elem_strides(base)[1:]))
        names = ["key_cache"]
    elif case == "k_scale_cache stride 0 over heads":
        base = kw["k_scale_cache"]
        st_ = _elem_strides(base)
        kw["k_scale_cache"] = _strided(base, shape[:3], (st_[0], st_[1], 0))
        names = ["k_scale_cache"]
    elif case == "k_scale_cache overlaps key_cache":
        buf = _byte_buffer(rng, NB * BS * H * D + 64, kind, impl)
        args[2] = _as_dtype(buf, 0, NB * BS * H * D, code, kind, shape)
        kw["k_scale_cache"] = _as_dtype(buf, 32, NB * BS * H, "float32", kind, shape[:3])
        guards.append(Guard("shared code/scale buffer", buf))
        names = ["k_scale_cache", "key_cache"]
    elif case == "value_cache overlaps key_cache":
        n = NB * BS * H * D
        buf = _byte_buffer(rng, n + n // 2, kind, impl)
        args[2] = _as_dtype(buf, 0, n, code, kind, shape)
        args[3] = _as_dtype(buf, n // 2, n, code, kind, shape)
        guards.append(Guard("shared cache buffer", buf))
        names = ["value_cache", "key_cache"]
    elif case == "key_cache overlaps itself":
        base = c.key.array
        st_ = _elem_strides(base)
        args[2] = _strided(base, shape, (st_[1] * (BS // 2), *st_[1:]))  # blocks share half their slots
        names = ["key_cache"]
    elif case == "key is a view of value_cache (none)":
        base = c.value.array
        st_ = _elem_strides(base)
        args[0] = _strided(base, (T, H, D), (st_[1], st_[2], st_[3]))  # the first T slots of block 0
        names = ["key", "value_cache"]
    elif case == "v_scale_cache overlaps key":
        buf = _byte_buffer(rng, 4 * (T * H * D + NB * BS * H), kind, impl)
        args[0] = _as_dtype(buf, 0, T * H * D, "float32", kind, (T, H, D))
        args[0][...] = case_array(w.key.values().astype(np.float32), kind, impl)
        kw["v_scale_cache"] = _as_dtype(buf, 4 * (T * H * D // 2), NB * BS * H, "float32", kind, shape[:3])
        guards.append(Guard("key/scale buffer", buf))
        names = ["v_scale_cache", "key"]
    else:
        raise AssertionError(case)
    call_refused(impl, via(entry, "reshape_and_cache"), names, guards, *args, **kw)


def _elem_strides(x):
    if isinstance(x, torch.Tensor):
        return tuple(x.stride())
    return tuple(s // x.itemsize for s in x.strides)


ATTN_ALIASES = [
    "out is query",
    "out overlaps query",
    "out overlaps key_cache (none)",
    "out overlaps k_scale_cache",
    "out stride 0 over tokens",
    "out overlaps sinks",
]


@pytest.mark.parametrize(
    "case,kind,entry",
    with_entries(
        "paged_attention",
        [(c, k) for c in ATTN_ALIASES for k in ("torch", "numpy")],
        lambda ck: ("numpy",) if ck[1] == "numpy" else (),
    ),
)
@pytest.mark.parametrize("impl", impl_params("paged_attention"))
def test_attention_aliasing_refused(impl, case, kind, entry):
    mode = "none" if "(none)" in case else "int8_per_token_head"
    require_usable(impl, mode, kind=kind)
    rng = rng_for("hostile-alias-attn", impl.name, case, kind)
    batch = make_batch(rng, "mixed")
    a = AttentionSetup(rng, mode, kind, batch, qdtype="float32", model_dtype="float32", impl=impl)
    bt, sl, qsl, _ = a.index_tensors(kind, "int32", rng)
    T = batch.num_tokens
    guards = list(a.caches.regions) + [a.query, a.out]
    extra = {}
    if case == "out is query":
        extra["out"] = a.query.array
        names = ["out", "query"]
    elif case == "out overlaps query":
        buf = _byte_buffer(rng, 4 * (T + 1) * HQ * D, kind, impl)
        q = _as_dtype(buf, 0, (T + 1) * HQ * D, "float32", kind, (T + 1, HQ, D))
        q[...] = case_array(rng.standard_normal((T + 1, HQ, D)).astype(np.float32), kind, impl)
        extra["query"], extra["out"] = q[1:], q[:-1]
        guards.append(Guard("query/out buffer", buf))
        names = ["out", "query"]
    elif case == "out overlaps key_cache (none)":
        base = a.caches.key.array
        st_ = _elem_strides(base)
        extra["out"] = _strided(base, (T, HQ, D), (st_[1], st_[3] * D // 2, st_[3]))
        names = ["out", "key_cache"]
    elif case == "out overlaps k_scale_cache":
        base = a.caches.k_scale.array
        st_ = _elem_strides(base)
        extra["out"] = _strided(base, (T, HQ, D), (st_[1], 1, 1))
        names = ["out", "k_scale_cache"]
    elif case == "out stride 0 over tokens":
        base = a.out.array
        st_ = _elem_strides(base)
        extra["out"] = _strided(base, (T, HQ, D), (0, st_[1], st_[2]))
        names = ["out"]
    elif case == "out overlaps sinks":
        base = a.out.array
        st_ = _elem_strides(base)
        extra["sinks"] = _strided(base, (HQ,), (st_[1],))
        names = ["out", "sinks"]
    else:
        raise AssertionError(case)
    call_refused(impl, lambda impl: a.call(impl, bt, sl, qsl, entry=entry, **extra), names, guards)


@pytest.mark.parametrize("kind", ["torch", "numpy"])
@pytest.mark.parametrize("impl", impl_params("reshape_and_cache"))
def test_write_key_is_value_accepted(impl, kind):
    require_usable(impl, kind=kind)
    mode = pick_mode(impl, "key-is-value", kind)
    rng = rng_for("hostile-key-is-value", impl.name, kind)
    w = WriteSetup(rng, mode, kind, T=6, impl=impl)
    w.value = w.key
    slots = w.valid_slots(rng)
    w.run_accepted(impl, case_array(slots, kind, impl), slots)


@pytest.mark.parametrize("kind", ["torch", "numpy"])
@pytest.mark.parametrize("impl", impl_params("paged_attention"))
def test_attention_key_cache_is_value_cache_accepted(impl, kind):
    require_usable(impl, kind=kind)
    mode = pick_mode(impl, "kc-is-vc", kind, candidates=ONE_FORMAT_MODES)
    rng = rng_for("hostile-kc-is-vc", impl.name, kind)
    a = AttentionSetup(rng, mode, kind, make_batch(rng, "mixed"), impl=impl)
    a.caches.value = a.caches.key
    a.caches.v_scale = a.caches.k_scale
    a.caches.v_static = a.caches.k_static
    bt, sl, qsl, guards = a.index_tensors(kind, "int32", rng)
    a.run_accepted(impl, bt, sl, qsl, guards=guards)


@pytest.mark.parametrize("impl", impl_params("paged_attention"))
def test_attention_read_arrays_alias_each_other_accepted(impl):
    """query read from the key cache's own memory (mode none), tables and lengths from one buffer."""
    require_usable(impl, "none")
    rng = rng_for("hostile-read-alias", impl.name)
    batch = batch_for(rng, [1, 2, 1], [3, 6, 5])
    a = AttentionSetup(rng, "none", "torch", batch, qdtype="bfloat16", model_dtype="bfloat16", heads_q=H, impl=impl)
    T = batch.num_tokens
    kc = a.caches.key.array
    st_ = _elem_strides(kc)
    query = _strided(kc, (T, H, D), (st_[1], st_[2], st_[3]))  # rows of block 0, offsets 0..T-1
    assert T <= BS
    a.query = a.caches.key.sub("query (in key_cache)", query, a.caches.key.index[0, :T], "bfloat16")
    # One int32 buffer behind block_tables, seq_lens and query_start_loc.
    S, M = batch.tables.shape
    flat = np.concatenate([batch.tables.reshape(-1), batch.seq_lens, batch.qsl]).astype(np.int32)
    shared = case_tensor(flat, impl)
    bt = shared[: S * M].view(S, M)
    sl = shared[S * M : S * M + S]
    qsl = shared[S * M + S :]
    a.run_accepted(impl, bt, sl, qsl, guards=[Guard("shared index buffer", shared)])


@pytest.mark.parametrize("impl", impl_params("paged_attention"))
def test_attention_stride0_read_cache_accepted(impl):
    """Caches are read arrays in attention: a stride-0 view over blocks is allowed."""
    require_usable(impl)
    mode = pick_mode(impl, "stride0-cache", candidates=QUANTIZED)
    rng = rng_for("hostile-stride0-cache", impl.name)
    batch = make_batch(rng, "mixed")
    a = AttentionSetup(rng, mode, "torch", batch, impl=impl)
    c = a.caches
    NB = batch.num_blocks
    views = {}
    for name, r in (("key", c.key), ("value", c.value), ("k_scale", c.k_scale), ("v_scale", c.v_scale)):
        if r is None:
            continue
        st_ = _elem_strides(r.array)
        views[name] = _strided(r.array, r.shape, (0, *st_[1:]))
        r.index = np.broadcast_to(r.index[:1], r.index.shape)  # the oracle sees block 0 everywhere
        r.array = views[name]
    bt, sl, qsl, guards = a.index_tensors("torch", "int32", rng)
    assert NB == c.key.shape[0]
    a.run_accepted(impl, bt, sl, qsl, guards=guards)


@pytest.mark.parametrize("impl", impl_params("dequantize"))
def test_dequantize_stride0_cache_accepted(impl):
    require_usable(impl)
    mode = pick_mode(impl, "stride0-deq")
    rng = rng_for("hostile-stride0-deq", impl.name)
    caches = make_caches(rng, mode, (4, BS, H, D), "torch", realistic=False, impl=impl)
    for r in caches.regions:
        st_ = _elem_strides(r.array)
        r.array = _strided(r.array, r.shape, (0, *st_[1:]))
        r.index = np.broadcast_to(r.index[:1], r.index.shape)
    tables, seq_lens = np.array([[0, 2], [3, 1]]), np.array([5, 8])
    check_dequantize(
        impl,
        caches,
        case_tensor(tables.astype(np.int32), impl),
        case_tensor(seq_lens.astype(np.int32), impl),
        tables,
        seq_lens,
    )


@pytest.mark.parametrize("kind", ["torch", "numpy"])
@pytest.mark.parametrize("layout", ["inline", "interleaved"])
@pytest.mark.parametrize("impl", impl_params("reshape_and_cache"))
def test_write_views_of_one_buffer_accepted(impl, layout, kind):
    """Disjoint views of one buffer are not aliases: the inline page (SPEC 5, here with gaps
    between rows) and scale caches interleaved in one float32 buffer."""
    mode = pick_mode(impl, "one-buffer", layout, kind, candidates=INLINE if layout == "inline" else PER_TOKEN_HEAD)
    require_usable(impl, mode, kind=kind)
    rng = rng_for("hostile-one-buffer", impl.name, layout, kind)
    w = WriteSetup(rng, mode, kind, T=7, layout=layout, impl=impl)
    slots = w.valid_slots(rng)
    w.run_accepted(impl, case_array(slots, kind, impl), slots)


@pytest.mark.parametrize("kind", ["torch", "numpy"])
@pytest.mark.parametrize("impl", impl_params("paged_attention"))
def test_attention_inline_page_with_gaps(impl, kind):
    mode = pick_mode(impl, "inline-attn", kind, candidates=INLINE)
    require_usable(impl, mode, kind=kind)
    rng = rng_for("hostile-inline-attn", impl.name, kind)
    a = AttentionSetup(rng, mode, kind, make_batch(rng, "mixed"), layout="inline", impl=impl)
    bt, sl, qsl, guards = a.index_tensors(kind, "int32", rng, {"block_tables": "stride2"})
    a.run_accepted(impl, bt, sl, qsl, guards=guards)


@pytest.mark.parametrize("impl", impl_params("dequantize"))
def test_dequantize_inline_page_with_gaps(impl):
    mode = pick_mode(impl, "inline-deq", candidates=INLINE)
    require_usable(impl, mode)
    rng = rng_for("hostile-inline-deq", impl.name)
    caches = make_caches(rng, mode, (4, BS, H, D), "torch", realistic=False, layout="inline", impl=impl)
    tables, seq_lens = np.array([[3, 0], [1, 2]]), np.array([7, 5])
    check_dequantize(
        impl,
        caches,
        case_tensor(tables.astype(np.int32), impl),
        case_tensor(seq_lens.astype(np.int32), impl),
        tables,
        seq_lens,
    )


@pytest.mark.parametrize("kind", ["torch", "numpy"])
@pytest.mark.parametrize("impl", impl_params("paged_attention"))
def test_attention_query_and_out_disjoint_in_one_buffer_accepted(impl, kind):
    """query and out as the two halves of one buffer do not overlap: accepted."""
    require_usable(impl, kind=kind)
    mode = pick_mode(impl, "q-out-one-buffer", kind)
    rng = rng_for("hostile-q-out-one-buffer", impl.name, kind)
    batch = make_batch(rng, "mixed")
    a = AttentionSetup(rng, mode, kind, batch, qdtype="float32", impl=impl)
    T = batch.num_tokens
    both = Region(rng, (2, T, HQ, D), "float32", kind, label="query/out buffer", impl=impl)
    both.set_values(np.stack([a.query.values(), rng.standard_normal((T, HQ, D)).astype(np.float32)]))
    a.query = both.sub("query", both.array[0], both.index[0], "float32")
    a.out = both.sub("out", both.array[1], both.index[1], "float32")
    bt, sl, qsl, guards = a.index_tensors(kind, "int32", rng)
    a.run_accepted(impl, bt, sl, qsl, guards=guards)


NEGATIVE_WRITTEN = ["key_cache", "value_cache", "k_scale_cache", "v_scale_cache"]


@pytest.mark.parametrize(
    "arg,entry", with_entries("reshape_and_cache", NEGATIVE_WRITTEN, lambda a: _write_traits(a, "numpy"))
)
@pytest.mark.parametrize("impl", impl_params("reshape_and_cache"))
def test_write_negative_stride_cache_refused(impl, arg, entry):
    """SPEC 11: written arrays with negative strides are refused."""
    require_usable(impl, "int8_per_token_head", kind="numpy")
    rng = rng_for("hostile-neg-written", impl.name, arg)
    w = WriteSetup(rng, "int8_per_token_head", "numpy", T=5, impl=impl)
    args = list(w.args(w.valid_slots(rng)))
    kw = w.caches.api_kwargs()
    if arg in ("key_cache", "value_cache"):
        i = 2 if arg == "key_cache" else 3
        args[i] = args[i][::-1]
    else:
        kw[arg] = kw[arg][:, ::-1]
    call_refused(impl, via(entry, "reshape_and_cache"), [arg], w.guards(), *args, **kw)


@pytest.mark.parametrize("entry", entries("paged_attention", "numpy"))
@pytest.mark.parametrize("impl", impl_params("paged_attention"))
def test_attention_negative_stride_out_refused(impl, entry):
    require_usable(impl, "int8_per_token_head", kind="numpy")
    rng = rng_for("hostile-neg-out", impl.name)
    a = AttentionSetup(rng, "int8_per_token_head", "numpy", make_batch(rng, "mixed"), impl=impl)
    a.entry = entry
    bt, sl, qsl, _ = a.index_tensors("numpy", "int32", rng)
    call_refused(
        impl, lambda impl: a.call(impl, bt, sl, qsl, out=a.out.array[::-1]), ["out"], a.caches.regions + [a.out]
    )


@pytest.mark.parametrize(
    "kind,entry",
    with_entries("reshape_and_cache", ["torch", "numpy"], lambda k: ("numpy",) if k == "numpy" else ()),
)
@pytest.mark.parametrize("impl", impl_params("reshape_and_cache"))
def test_write_slot_mapping_inside_scale_cache_refused(impl, kind, entry):
    """A read array (slot_mapping, valid values) stored in the elements of a written one."""
    require_usable(impl, "int8_per_token_head", kind=kind)
    rng = rng_for("hostile-slots-in-scales", impl.name, kind)
    w = WriteSetup(rng, "int8_per_token_head", kind, T=5, num_blocks=8, impl=impl)
    slots = w.valid_slots(rng, 0.0)
    ks = w.caches.k_scale
    words = ks.index[: w.T, 0, 0]  # k_scale_cache[0:T, 0, 0]: one word per block, one stride apart
    sm = _words_view(ks, words[:, None], kind)[:, 0]
    ks.sub("slot_mapping", sm, words, "int32").set_values(slots)
    assert np.array_equal(_host_values(sm), slots)
    call_refused(
        impl,
        via(entry, "reshape_and_cache"),
        ["slot_mapping", "k_scale_cache"],
        w.guards(),
        *w.args(sm),
        **w.caches.api_kwargs(),
    )


def _words_view(region: Region, words: np.ndarray, kind: str):
    """int32 view [r, c] of a region's buffer at element indices `words` (an arithmetic grid)."""
    r, c = words.shape
    rs = int(words[1, 0] - words[0, 0]) if r > 1 else 1
    cs = int(words[0, 1] - words[0, 0]) if c > 1 else 1
    assert np.array_equal(words, words[0, 0] + rs * np.arange(r)[:, None] + cs * np.arange(c)[None, :])
    if kind == "torch":
        return torch.as_strided(region.memory.view(torch.int32), (r, c), (rs, cs), int(words[0, 0]))
    return as_strided(region.memory.view(np.int32)[int(words[0, 0]) :], (r, c), (rs * 4, cs * 4), writeable=False)


def _host_values(x) -> np.ndarray:
    return to_host(x) if isinstance(x, torch.Tensor) else np.asarray(x)


@pytest.mark.parametrize(
    "kind,entry",
    with_entries("paged_attention", ["torch", "numpy"], lambda k: ("numpy",) if k == "numpy" else ()),
)
@pytest.mark.parametrize("impl", impl_params("paged_attention"))
def test_attention_block_tables_inside_out_refused(impl, kind, entry):
    """A read array (block_tables, valid ids) stored in the elements of the written out."""
    require_usable(impl, "int8_per_token_head", kind=kind)
    rng = rng_for("hostile-tables-in-out", impl.name, kind)
    batch = make_batch(rng, "mixed")
    a = AttentionSetup(rng, "int8_per_token_head", kind, batch, qdtype="float32", impl=impl)
    a.entry = entry
    S, M = batch.tables.shape
    words = a.out.index[:S, 0, :M]  # out[0:S, 0, 0:M]
    bt = _words_view(a.out, words, kind)
    a.out.sub("block_tables", bt, words, "int32").set_values(batch.tables)
    assert np.array_equal(_host_values(bt), batch.tables)
    _, sl, qsl, _ = a.index_tensors(kind, "int32", rng)
    call_refused(impl, lambda impl: a.call(impl, bt, sl, qsl), ["out", "block_tables"], a.caches.regions + [a.out])


@pytest.mark.parametrize("op", ["reshape_and_cache", "dequantize", "paged_attention"])
def test_unknown_impl_refused(op):
    rng = rng_for("hostile-unknown-impl", op)
    # No implementation to take the tensors: they stay on the host.
    caches = make_caches(rng, "int8_per_token_head", (3, BS, H, D), "torch", impl=None)
    c = caches.api_kwargs()
    t = lambda x: case_tensor(x, None)  # noqa: E731
    if op == "reshape_and_cache":
        call = lambda impl: kvzoo.reshape_and_cache(  # noqa: E731
            t(torch.randn(2, H, D)),
            t(torch.randn(2, H, D)),
            caches.key.array,
            caches.value.array,
            t(torch.tensor([0, 5])),
            impl=impl,
            **c,
        )
    elif op == "dequantize":
        call = lambda impl: kvzoo.dequantize(
            caches.key.array,
            c["k_scale_cache"],
            mode=c["mode"],  # noqa: E731
            impl=impl,
        )
    else:
        call = lambda impl: kvzoo.paged_attention(  # noqa: E731
            t(torch.randn(1, HQ, D)),
            caches.key.array,
            caches.value.array,
            block_tables=t(torch.tensor([[0]])),
            seq_lens=t(torch.tensor([3])),
            query_start_loc=t(torch.tensor([0, 1])),
            impl=impl,
            **c,
        )
    fake = type("Fake", (), {"name": "no-such-impl"})()
    err = call_refused(fake, call, ["impl"], caches.regions)
    assert "no-such-impl" in str(err)


@pytest.mark.parametrize("impl", impl_params("paged_attention"))
def test_impl_that_cannot_take_the_call_refused(impl):
    """SPEC 11: an implementation that cannot take the call is refused (KVZooInputError, naming
    impl, with the reasons). Where the battery expects none, the call must simply run."""
    require_usable(impl, "int8_per_token_head")
    rng = rng_for("hostile-incapable", impl.name)
    a = AttentionSetup(rng, "int8_per_token_head", "torch", make_batch(rng, "mixed"), impl=impl)
    bt, sl, qsl, guards = a.index_tensors("torch", "int32", rng)
    if expected_decline(impl, quantize_query=True) is None:
        a.run_accepted(impl, bt, sl, qsl, guards=guards, quantize_query=True)
        return
    try:
        a.call(impl.name, bt, sl, qsl, quantize_query=True)
    except KVZooInputError as e:
        assert str(e).startswith("impl"), f"message does not start with 'impl': {e}"
        assert impl.name in str(e) and "quantize_query" in str(e), f"the reason is not given: {e}"
    else:
        pytest.fail(f"{impl.name} ran quantize_query, which the battery expects it to decline")
    for r in a.caches.regions + [a.out]:
        r.assert_unchanged(f"{impl.name}: refused call")


# ---------------------------------------------------------------------------------------------
# 6. mode none: the caches share one dtype


@pytest.mark.parametrize("entry", entries("reshape_and_cache", "caches"))
@pytest.mark.parametrize("impl", impl_params("reshape_and_cache"))
def test_write_none_mixed_cache_dtypes_refused(impl, entry):
    require_usable(impl, "none")
    rng = rng_for("hostile-none-mixed-write", impl.name)
    w = WriteSetup(rng, "none", "torch", T=5, dtype="float16", impl=impl)
    other = Region(rng, w.caches.value.shape, "bfloat16", "torch", label="value_cache(bf16)", impl=impl)
    slots = w.valid_slots(rng)
    call_refused(
        impl,
        via(entry, "reshape_and_cache"),
        ["value_cache", "key_cache"],
        w.guards() + [other],
        *w.args(case_tensor(slots, impl), value_cache=other.array),
        mode="none",
    )


@pytest.mark.parametrize("entry", entries("paged_attention", "caches"))
@pytest.mark.parametrize("impl", impl_params("paged_attention"))
def test_attention_none_mixed_cache_dtypes_refused(impl, entry):
    require_usable(impl, "none")
    rng = rng_for("hostile-none-mixed-attn", impl.name)
    a = AttentionSetup(rng, "none", "torch", make_batch(rng, "mixed"), model_dtype="float16", impl=impl)
    a.entry = entry
    other = Region(rng, a.caches.value.shape, "bfloat16", "torch", label="value_cache(bf16)", impl=impl)
    bt, sl, qsl, _ = a.index_tensors("torch", "int32", rng)
    call_refused(
        impl,
        lambda impl: a.call(impl, bt, sl, qsl, value_cache=other.array),
        ["value_cache", "key_cache"],
        a.caches.regions + [a.out, other],
    )


@pytest.mark.parametrize("model_dtype", ["float16", "float32"])
@pytest.mark.parametrize("impl", impl_params("paged_attention"))
def test_attention_none_cache_dtype_other_than_query_accepted(impl, model_dtype):
    require_usable(impl, "none")
    rng = rng_for("hostile-none-other-dtype", impl.name, model_dtype)
    a = AttentionSetup(
        rng, "none", "torch", make_batch(rng, "mixed"), model_dtype=model_dtype, qdtype="bfloat16", impl=impl
    )
    bt, sl, qsl, guards = a.index_tensors("torch", "int32", rng)
    a.run_accepted(impl, bt, sl, qsl, guards=guards)


# ---------------------------------------------------------------------------------------------
# 7. scalars


# An int beyond any float: float() raises OverflowError, which must not leak past the checks.
BEYOND_FLOAT = 10**400


def scalar_id(value) -> str:
    return "beyond-float-int" if value is BEYOND_FLOAT else repr(value)


BAD_SOFTMAX_SCALE = [float("nan"), float("inf"), float("-inf"), 1e39, 1e-46, 0.0, -0.5, "abc", True, BEYOND_FLOAT]
BAD_SOFTCAP = [1e-50, 1e-38, 1e39, float("nan"), float("inf"), 0.0, -1.0, "30", BEYOND_FLOAT]
BAD_WINDOW = [float("nan"), float("inf"), 0, -1, 1.5, 3.0, True, "3"]
HUGE_WINDOW = [2**63, 2**64 + 5, 10**30]


def _attention_for_scalars(impl, key, entry="functional"):
    require_usable(impl, "int8_per_token_head")
    rng = rng_for("hostile-scalars", impl.name, key)
    a = AttentionSetup(rng, "int8_per_token_head", "torch", make_batch(rng, "mixed"), impl=impl)
    a.entry = entry
    bt, sl, qsl, guards = a.index_tensors("torch", "int32", rng)
    return a, bt, sl, qsl, guards


@pytest.mark.parametrize("value,entry", with_entries("paged_attention", BAD_SOFTMAX_SCALE, ids=scalar_id))
@pytest.mark.parametrize("impl", impl_params("paged_attention"))
def test_softmax_scale_refused(impl, value, entry):
    a, bt, sl, qsl, _ = _attention_for_scalars(impl, ("scale", repr(value)), entry)
    call_refused(
        impl, lambda impl: a.call(impl, bt, sl, qsl, softmax_scale=value), ["softmax_scale"], a.caches.regions + [a.out]
    )


@pytest.mark.parametrize("value,entry", with_entries("paged_attention", BAD_SOFTCAP, ids=scalar_id))
@pytest.mark.parametrize("impl", impl_params("paged_attention"))
def test_softcap_refused(impl, value, entry):
    a, bt, sl, qsl, _ = _attention_for_scalars(impl, ("cap", repr(value)), entry)
    call_refused(impl, lambda impl: a.call(impl, bt, sl, qsl, softcap=value), ["softcap"], a.caches.regions + [a.out])


@pytest.mark.parametrize("value,entry", with_entries("paged_attention", BAD_WINDOW, ids=repr))
@pytest.mark.parametrize("impl", impl_params("paged_attention"))
def test_sliding_window_refused(impl, value, entry):
    a, bt, sl, qsl, _ = _attention_for_scalars(impl, ("window", repr(value)), entry)
    call_refused(
        impl,
        lambda impl: a.call(impl, bt, sl, qsl, sliding_window=value),
        ["sliding_window"],
        a.caches.regions + [a.out],
    )


@pytest.mark.parametrize("validate", [True, False], ids=["validate", "novalidate"])
@pytest.mark.parametrize("value", HUGE_WINDOW, ids=repr)
@pytest.mark.parametrize("impl", impl_params("paged_attention"))
def test_sliding_window_huge_is_no_window(impl, value, validate):
    """SPEC 11: a window at least max_blocks_per_seq * block_size masks nothing: the same as None."""
    a, bt, sl, qsl, guards = _attention_for_scalars(impl, ("huge-window", repr(value)))
    kw = (
        {}
        if validate
        else dict(validate=False, max_query_len=int(a.batch.q_lens.max()), max_seq_len=int(a.batch.seq_lens.max()))
    )
    a.run_accepted(impl, bt, sl, qsl, guards=guards, window=value, oracle_window=None, **kw)


@pytest.mark.parametrize("impl", impl_params("paged_attention"))
def test_sliding_window_exactly_table_span_is_no_window(impl):
    a, bt, sl, qsl, guards = _attention_for_scalars(impl, "span-window")
    span = a.batch.tables.shape[1] * BS
    a.run_accepted(impl, bt, sl, qsl, guards=guards, window=span, oracle_window=None)


GOOD_SCALARS = [
    ("sliding_window", 1),
    ("sliding_window", np.int64(3)),
    ("softmax_scale", np.float32(0.3)),
    ("softmax_scale", 1e-30),
    ("softcap", 1e-3),
    ("softcap", 2.0**-126),
    ("softcap", np.float64(30.0)),
]


@pytest.mark.parametrize("name,value", GOOD_SCALARS, ids=lambda v: repr(v))
@pytest.mark.parametrize("impl", impl_params("paged_attention"))
def test_valid_scalars_accepted(impl, name, value):
    a, bt, sl, qsl, guards = _attention_for_scalars(impl, ("good", name, repr(value)))
    kw = {"window" if name == "sliding_window" else name: value}
    a.run_accepted(impl, bt, sl, qsl, guards=guards, **kw)


BAD_STATIC = [1e39, float("inf"), float("nan"), 0.0, -1.0, "abc", BEYOND_FLOAT]


@pytest.mark.parametrize("which,entry", with_entries("reshape_and_cache", ["k_scale", "v_scale"]))
@pytest.mark.parametrize("value", BAD_STATIC, ids=scalar_id)
@pytest.mark.parametrize("impl", impl_params("reshape_and_cache"))
def test_write_static_scale_refused(impl, value, which, entry):
    mode = pick_mode(impl, "static-write", repr(value), which, candidates=PER_TENSOR)
    require_usable(impl, mode)
    rng = rng_for("hostile-static-write", impl.name, repr(value), which)
    w = WriteSetup(rng, mode, "torch", T=5, impl=impl)
    kw = w.caches.api_kwargs()
    kw[which] = value
    call_refused(
        impl,
        via(entry, "reshape_and_cache"),
        [which],
        w.guards(),
        *w.args(case_tensor(w.valid_slots(rng), impl)),
        **kw,
    )


@pytest.mark.parametrize(
    "value,entry",
    with_entries(
        "reshape_and_cache",
        ["tensor-inf", "tensor-two", "tensor-float64"],
        lambda v: ("static-array",) if v == "tensor-inf" else (),
    ),
)
@pytest.mark.parametrize("impl", impl_params("reshape_and_cache"))
def test_write_static_scale_tensor_refused(impl, value, entry):
    mode = pick_mode(impl, "static-tensor", value, candidates=PER_TENSOR)
    require_usable(impl, mode)
    rng = rng_for("hostile-static-tensor", impl.name, value)
    w = WriteSetup(rng, mode, "torch", T=5, impl=impl)
    kw = w.caches.api_kwargs()
    kw["k_scale"] = case_tensor(
        {
            "tensor-inf": torch.tensor([float("inf")]),
            "tensor-two": torch.tensor([0.5, 0.5]),
            "tensor-float64": torch.tensor([0.5], dtype=torch.float64),
        }[value],
        impl,
    )
    call_refused(
        impl,
        via(entry, "reshape_and_cache"),
        ["k_scale"],
        w.guards(),
        *w.args(case_tensor(w.valid_slots(rng), impl)),
        **kw,
    )


@pytest.mark.parametrize(
    "form,entry", with_entries("reshape_and_cache", ["float32-tensor", "offset-view", "numpy-float32"])
)
@pytest.mark.parametrize("impl", impl_params("reshape_and_cache"))
def test_write_static_scale_forms_accepted(impl, form, entry):
    mode = pick_mode(impl, "static-forms", form, candidates=PER_TENSOR)
    require_usable(impl, mode)
    rng = rng_for("hostile-static-forms", impl.name, form)
    w = WriteSetup(rng, mode, "torch", T=5, impl=impl)
    k = w.caches.k_static
    slots = w.valid_slots(rng)
    kw = w.caches.api_kwargs()
    kw["k_scale"] = {
        "float32-tensor": case_tensor(torch.tensor([k], dtype=torch.float32), impl),
        "offset-view": case_tensor(torch.tensor([9.0, k, 7.0], dtype=torch.float32), impl)[1:2],
        "numpy-float32": np.float32(k),
    }[form]  # a number, not an array: fine on any device
    call_accepted(impl, via(entry, "reshape_and_cache"), *w.args(case_tensor(slots, impl)), **kw)
    assert_write_matches(impl.name, w.caches, w.key.values(), w.value.values(), slots)


@pytest.mark.parametrize("entry", entries("paged_attention"))
@pytest.mark.parametrize("impl", impl_params("paged_attention"))
def test_attention_static_scale_refused(impl, entry):
    mode = pick_mode(impl, "static-attn", candidates=PER_TENSOR)
    require_usable(impl, mode)
    rng = rng_for("hostile-static-attn", impl.name)
    a = AttentionSetup(rng, mode, "torch", make_batch(rng, "mixed"), impl=impl)
    a.entry = entry
    bt, sl, qsl, _ = a.index_tensors("torch", "int32", rng)
    a.caches.k_static = 1e39
    call_refused(impl, lambda impl: a.call(impl, bt, sl, qsl), ["k_scale"], a.caches.regions + [a.out])


@pytest.mark.parametrize("entry", entries("dequantize"))
@pytest.mark.parametrize("impl", impl_params("dequantize"))
def test_dequantize_static_scale_refused(impl, entry):
    mode = pick_mode(impl, "static-deq", candidates=PER_TENSOR)
    require_usable(impl, mode)
    rng = rng_for("hostile-static-deq", impl.name)
    caches = make_caches(rng, mode, (3, BS, H, D), "torch", realistic=False, impl=impl)
    call_refused(
        impl,
        lambda impl: via(entry, "dequantize")(caches.key.array, mode=mode, scale=1e39, impl=impl),
        ["scale"],
        caches.regions,
    )


# ---------------------------------------------------------------------------------------------
# 8. sizes


WRITE_SIZES = {  # case: (heads, head_size, num_blocks, block_size)
    "head_size 0": (H, 0, 3, BS),
    "zero kv heads": (0, D, 3, BS),
    "num_blocks 0": (H, D, 0, BS),
    "block_size 0": (H, D, 3, 0),
}


@pytest.mark.parametrize("case,entry", with_entries("reshape_and_cache", list(WRITE_SIZES), lambda c: ("zero-size",)))
@pytest.mark.parametrize("impl", impl_params("reshape_and_cache"))
def test_write_zero_sizes_refused(impl, case, entry):
    require_usable(impl, "int8_per_token_head")
    heads, hs, nb, bs = WRITE_SIZES[case]
    rng = rng_for("hostile-size-write", impl.name, case)
    w = WriteSetup(
        rng, "int8_per_token_head", "torch", T=3, num_blocks=nb, heads=heads, head_size=hs, block_size=bs, impl=impl
    )
    slots = case_tensor(torch.full((3,), -1, dtype=torch.int64), impl)
    names = [
        "key",
        "value",
        "key_cache",
        "value_cache",
        "k_scale_cache",
        "v_scale_cache",
        "slot_mapping",
        "head_size",
        "num_kv_heads",
        "num_blocks",
        "block_size",
    ]
    call_refused(impl, via(entry, "reshape_and_cache"), names, w.guards(), *w.args(slots), **w.caches.api_kwargs())


ATTN_SIZES = {  # case: (heads_q, heads_kv, head_size, num_blocks, block_size)
    "head_size 0": (HQ, H, 0, 3, BS),
    "zero kv heads": (HQ, 0, D, 3, BS),
    "zero query heads": (0, H, D, 3, BS),
    "num_blocks 0": (HQ, H, D, 0, BS),
    "block_size 0": (HQ, H, D, 3, 0),
}


@pytest.mark.parametrize("case,entry", with_entries("paged_attention", list(ATTN_SIZES), lambda c: ("zero-size",)))
@pytest.mark.parametrize("impl", impl_params("paged_attention"))
def test_attention_zero_sizes_refused(impl, case, entry):
    require_usable(impl, "int8_per_token_head")
    hq, hkv, hs, nb, bs = ATTN_SIZES[case]
    rng = rng_for("hostile-size-attn", impl.name, case)
    batch = Batch(np.array([1]), np.array([1]), np.array([[0]]), nb, bs)
    a = AttentionSetup(rng, "int8_per_token_head", "torch", batch, heads_q=hq, heads_kv=hkv, head_size=hs, impl=impl)
    a.entry = entry
    bt, sl, qsl, _ = a.index_tensors("torch", "int32", rng)
    names = [
        "query",
        "key_cache",
        "value_cache",
        "k_scale_cache",
        "v_scale_cache",
        "out",
        "block_tables",
        "head_size",
        "num_kv_heads",
        "num_q_heads",
        "num_blocks",
        "block_size",
    ]
    call_refused(impl, lambda impl: a.call(impl, bt, sl, qsl), names, a.caches.regions + [a.out])


@pytest.mark.parametrize("case,entry", with_entries("dequantize", list(WRITE_SIZES), lambda c: ("zero-size",)))
@pytest.mark.parametrize("impl", impl_params("dequantize"))
def test_dequantize_zero_sizes_refused(impl, case, entry):
    require_usable(impl, "int8_per_token_head")
    heads, hs, nb, bs = WRITE_SIZES[case]
    rng = rng_for("hostile-size-deq", impl.name, case)
    caches = make_caches(rng, "int8_per_token_head", (nb, bs, heads, hs), "torch", realistic=False, impl=impl)
    names = ["cache", "scale_cache", "head_size", "num_kv_heads", "num_heads", "num_blocks", "block_size"]
    call_refused(
        impl,
        lambda impl: via(entry, "dequantize")(
            caches.key.array, caches.k_scale.array, mode="int8_per_token_head", impl=impl
        ),
        names,
        caches.regions,
    )


@pytest.mark.parametrize(
    "kind,entry", with_entries("reshape_and_cache", ["torch", "numpy"], lambda k: ("numpy",) if k == "numpy" else ())
)
@pytest.mark.parametrize("impl", impl_params("reshape_and_cache"))
def test_write_zero_tokens_accepted(impl, kind, entry):
    require_usable(impl, kind=kind)
    mode = pick_mode(impl, "zero-tokens", kind)
    rng = rng_for("hostile-zero-tokens", impl.name, kind)
    w = WriteSetup(rng, mode, kind, T=0, num_blocks=2, impl=impl)
    empty = np.zeros(0, np.int64)
    w.run_accepted(impl, case_array(empty, kind, impl), empty, entry=entry)
    for r in w.caches.regions:
        r.assert_unchanged(f"{impl.name}: zero tokens")


# validate=False through the unvalidated entry is the functional entry's novalidate case.
@pytest.mark.parametrize(
    "validate,entry",
    with_entries(
        "paged_attention",
        [True, False],
        lambda v: () if v else ("unvalidated",),
        ids=lambda v: "validate" if v else "novalidate",
    ),
)
@pytest.mark.parametrize("case", ["zero tokens", "zero sequences"])
@pytest.mark.parametrize("impl", impl_params("paged_attention"))
def test_attention_empty_accepted(impl, case, validate, entry):
    require_usable(impl)
    mode = pick_mode(impl, "empty-attn", case)
    rng = rng_for("hostile-empty-attn", impl.name, case, validate)
    if case == "zero tokens":
        batch = batch_for(rng, [0, 0], [5, 3])
    else:
        batch = Batch(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, 2), np.int64), 3, BS)
    a = AttentionSetup(rng, mode, "torch", batch, impl=impl)
    a.entry = entry
    bt, sl, qsl, guards = a.index_tensors("torch", "int32", rng)
    kw = {} if validate else dict(validate=False, max_query_len=0, max_seq_len=int(batch.seq_lens.max(initial=0)))
    a.run_accepted(impl, bt, sl, qsl, guards=guards, **kw)
    a.out.assert_unchanged(f"{impl.name}: empty batch")


@pytest.mark.parametrize("entry", entries("dequantize"))
@pytest.mark.parametrize("impl", impl_params("dequantize"))
def test_dequantize_empty_accepted(impl, entry):
    require_usable(impl)
    mode = pick_mode(impl, "empty-deq")
    rng = rng_for("hostile-empty-deq", impl.name)
    caches = make_caches(rng, mode, (3, BS, H, D), "torch", realistic=False, impl=impl)
    for tables, seq_lens in (
        (np.zeros((0, 2), np.int64), np.zeros(0, np.int64)),
        (np.array([[0], [1]]), np.array([0, 0])),
    ):
        got = check_dequantize(
            impl,
            caches,
            case_tensor(tables.astype(np.int32), impl),
            case_tensor(seq_lens.astype(np.int32), impl),
            tables,
            seq_lens,
            entry=entry,
        )
        assert tuple(got.shape) == (0, H, D)


BAD_MAX = [
    ("max_query_len", -1),
    ("max_query_len", 2**31),
    ("max_query_len", 2**63),
    ("max_query_len", 1.5),
    ("max_seq_len", -1),
    ("max_seq_len", 2**31),
    ("max_seq_len", 2**40),
    ("num_prefills", -1),
]


@pytest.mark.parametrize(
    "name,value,entry",
    with_entries(
        "paged_attention",
        BAD_MAX,
        lambda nv: ("unvalidated",),
        ids=lambda nv: f"{nv[0]!r}-{nv[1]!r}",
    ),
)
@pytest.mark.parametrize("impl", impl_params("paged_attention"))
def test_max_lens_out_of_range_refused(impl, name, value, entry):
    a, bt, sl, qsl, _ = _attention_for_scalars(impl, ("max", name, repr(value)), entry)
    kw = dict(validate=False, max_query_len=int(a.batch.q_lens.max()), max_seq_len=int(a.batch.seq_lens.max()))
    kw[name] = value
    call_refused(impl, lambda impl: a.call(impl, bt, sl, qsl, **kw), [name], a.caches.regions + [a.out])


@pytest.mark.parametrize(
    "name,value,entry",
    with_entries(
        "paged_attention",
        BAD_MAX + [("max_query_len", "3"), ("num_prefills", 10**6)],
        lambda nv: ("validate",),
        ids=lambda nv: f"{nv[0]!r}-{nv[1]!r}",
    ),
)
@pytest.mark.parametrize("impl", impl_params("paged_attention"))
def test_given_bounds_checked_when_the_values_are_read(impl, name, value, entry):
    """validate=True reads the bounds from the metadata; a bound given beside it is still an
    argument, checked as one (it was ignored, whatever it held)."""
    a, bt, sl, qsl, _ = _attention_for_scalars(impl, ("max-read", name, repr(value)), entry)
    call_refused(impl, lambda impl: a.call(impl, bt, sl, qsl, **{name: value}), [name], a.caches.regions + [a.out])


@pytest.mark.parametrize("validate", [True, False], ids=["validate", "novalidate"])
@pytest.mark.parametrize("name", ["max_query_len", "max_seq_len", "num_prefills"])
@pytest.mark.parametrize("impl", impl_params("paged_attention"))
def test_given_bound_below_the_values_read_is_replaced_by_them(impl, name, validate):
    """Where the values are read (validate=True, or a max_* bound missing), the call runs under
    the bounds they give (SPEC 11), whatever was given: an engine's placeholder passes."""
    a, bt, sl, qsl, guards = _attention_for_scalars(impl, ("max-below", name, validate))
    q_lens, seq_lens = a.batch.q_lens, a.batch.seq_lens
    read = {
        "max_query_len": int(q_lens.max()),
        "max_seq_len": int(seq_lens.max()),
        "num_prefills": int((q_lens > 1).sum()),
    }
    assert read[name] > 0, "the batch must give the bound something to fall below"
    # Alone, so with validate=False the missing max_* bound makes kvzoo read the values.
    a.run_accepted(impl, bt, sl, qsl, guards=guards, validate=validate, **{name: read[name] - 1})


@pytest.mark.parametrize("impl", impl_params("paged_attention"))
def test_a_validated_call_reads_seq_lens_once(impl, monkeypatch):
    """validate=True reads seq_lens once, for the block tables' check and the bounds alike: a
    second read is a second synchronisation, and could see other values than the check did."""
    a, bt, sl, qsl, guards = _attention_for_scalars(impl, "read-once")
    reads = []
    real = kvzoo.calls.host_ints

    def counted(x):
        reads.append(x is sl)
        return real(x)

    monkeypatch.setattr(kvzoo.calls, "host_ints", counted)
    a.run_accepted(impl, bt, sl, qsl, guards=guards, validate=True)
    assert reads.count(True) == 1, f"seq_lens read {reads.count(True)} times"


READ_FAULTS = [
    "qsl-start",
    "qsl-past-the-query",
    "qsl-decreasing",
    "seq-shorter-than-query",
    "seq-negative",
    "seq-past-the-table",
]


@pytest.mark.parametrize("fault", READ_FAULTS)
@pytest.mark.parametrize("impl", impl_params("paged_attention"))
def test_attention_values_read_without_validation_are_checked(impl, fault):
    """validate=False without max_query_len and max_seq_len reads query_start_loc and seq_lens
    to find them, and checks what it read: an offset past the query's rows would put rows of
    out past its end (numba and triton wrote 1152 floats there), a context shorter than its
    query would read before the sequence's first block, one past its table row's blocks would
    read block ids from beyond the row."""
    require_usable(impl, "int8_per_token_head")
    rng = rng_for("hostile-read-values", impl.name, fault)
    a = AttentionSetup(rng, "int8_per_token_head", "torch", make_batch(rng, "mixed"), impl=impl)
    bt = a.index_tensors("torch", "int32", rng)[0]
    q_lens, seq_lens = a.batch.q_lens, a.batch.seq_lens.copy()
    assert len(q_lens) >= 2 and q_lens.max() > 1, "the faults below need two sequences and a prefill"
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    if fault == "qsl-start":
        qsl = qsl + 1
    elif fault == "qsl-past-the-query":
        qsl[-1] += 16
    elif fault == "qsl-decreasing":
        qsl[1] = qsl[2] + 1
    elif fault == "seq-shorter-than-query":
        s = int(np.argmax(q_lens))
        seq_lens[s] = q_lens[s] - 1
    elif fault == "seq-negative":
        seq_lens[-1] = -3
    else:
        seq_lens[0] = int(bt.shape[1]) * a.batch.block_size + 1
    t = lambda v: case_tensor(torch.as_tensor(np.asarray(v, dtype=np.int32)), impl)  # noqa: E731
    call_refused(
        impl,
        lambda impl: a.call(impl, bt, t(seq_lens), t(qsl), validate=False),
        ["query_start_loc" if fault.startswith("qsl") else "seq_lens"],
        a.caches.regions + [a.out, a.query],
    )


@pytest.mark.parametrize("fault", ["negative", "past-the-table", "block-past-the-cache", "negative-block"])
@pytest.mark.parametrize("impl", impl_params("dequantize"))
def test_dequantize_lengths_checked_without_validation(impl, fault):
    """dequantize reads seq_lens to size the out it allocates, validate or not, so it checks
    them either way: a negative length put a sequence's rows before out's first (triton wrote
    160 floats there; numba wrapped them around). The block ids they cover too (SPEC 11): one
    out of range had numba and triton read outside the cache."""
    require_usable(impl, "int8_per_token_head")
    rng = rng_for("hostile-deq-lengths", impl.name, fault)
    caches = make_caches(rng, "int8_per_token_head", (4, BS, H, D), "torch", impl=impl)
    tables = np.array([[0, 1], [2, 3]], dtype=np.int32)
    tables[1, 1] = {"block-past-the-cache": 4 + int(rng.integers(0, 1000)), "negative-block": -1}.get(fault, 3)
    lens = np.array([-5 if fault == "negative" else 3, 2 * BS + (1 if fault == "past-the-table" else 0)], np.int32)
    t = lambda v: case_tensor(torch.as_tensor(v), impl)  # noqa: E731
    call_refused(
        impl,
        lambda impl: kvzoo.dequantize(
            caches.key.array,
            caches.k_scale.array,
            mode="int8_per_token_head",
            block_tables=t(tables),
            seq_lens=t(lens),
            validate=False,
            impl=impl,
        ),
        ["block_tables" if "block" in fault else "seq_lens"],
        caches.regions,
    )


@pytest.mark.parametrize("entry", entries("paged_attention"))
@pytest.mark.parametrize("impl", impl_params("paged_attention"))
def test_positions_over_int32_refused(impl, entry):
    """SPEC 11 'positions': max_blocks_per_seq * block_size at most 2^31 - 1. The caches are read
    arrays here, so stride-0 views make the shape cheap; so is a stride-0 block table."""
    require_usable(impl, "int8_per_token_head")
    bs = 2**12
    t = lambda x: case_tensor(x, impl)  # noqa: E731
    # Expanded after placing: a copy of the expanded view would be the whole cache.
    kc = t(torch.zeros(1, 1, H, D, dtype=torch.int8)).expand(2, bs, H, D)
    sc = t(torch.full((1, 1, H), 0.01)).expand(2, bs, H)
    bt = t(torch.zeros(1, 1, dtype=torch.int32)).expand(1, 2**19 + 1)
    q = t(torch.randn(1, HQ, D, dtype=torch.bfloat16))
    out = t(torch.full((1, HQ, D), 7.0, dtype=torch.bfloat16))
    before = out.clone()
    call_refused(
        impl,
        lambda impl: via(entry, "paged_attention")(
            q,
            kc,
            kc,
            mode="int8_per_token_head",
            k_scale_cache=sc,
            v_scale_cache=sc,
            block_tables=bt,
            seq_lens=t(torch.tensor([1], dtype=torch.int32)),
            query_start_loc=t(torch.tensor([0, 1], dtype=torch.int32)),
            out=out,
            impl=impl,
        ),
        ["block_tables", "seq_lens", "key_cache", "block_size"],
        [guard_of("out", out)],
    )
    assert torch.equal(out, before)


@pytest.mark.parametrize("entry", entries("dequantize"))
@pytest.mark.parametrize("impl", impl_params("dequantize"))
def test_dequantize_slots_over_int32_refused(impl, entry):
    """num_blocks * block_size at most 2^31 - 1 (a stride-0 read cache of 2^20 x 2^11 + 1 slots)."""
    require_usable(impl, "int8_per_token_head")
    nb, bs = 2**20, 2**11 + 1
    t = lambda x: case_tensor(x, impl)  # noqa: E731
    cache = t(torch.zeros(1, 1, 1, 4, dtype=torch.int8)).expand(nb, bs, 1, 4)
    sc = t(torch.full((1, 1, 1), 0.01)).expand(nb, bs, 1)
    call_refused(
        impl,
        lambda impl: via(entry, "dequantize")(
            cache,
            sc,
            mode="int8_per_token_head",
            block_tables=t(torch.tensor([[0]], dtype=torch.int32)),
            seq_lens=t(torch.tensor([1], dtype=torch.int32)),
            impl=impl,
        ),
        ["cache", "scale_cache", "num_blocks", "block_size"],
        [],
    )


# ---------------------------------------------------------------------------------------------
# 9. autograd and devices


REQUIRES_GRAD_WRITE = ["key", "value", "key_cache(none)", "k_scale_cache"]


@pytest.mark.parametrize("arg,entry", with_entries("reshape_and_cache", REQUIRES_GRAD_WRITE, _write_traits))
@pytest.mark.parametrize("impl", impl_params("reshape_and_cache"))
def test_write_requires_grad_refused(impl, arg, entry):
    mode = "none" if "(none)" in arg else "int8_per_token_head"
    require_usable(impl, mode)
    name = arg.split("(")[0]
    rng = rng_for("hostile-grad-write", impl.name, arg)
    w = WriteSetup(rng, mode, "torch", T=5, dtype="float32", impl=impl)
    args = list(w.args(case_tensor(w.valid_slots(rng), impl)))
    kw = w.caches.api_kwargs()
    pos = {"key": 0, "value": 1, "key_cache": 2}
    if name in pos:
        args[pos[name]] = args[pos[name]].requires_grad_()
    else:
        kw[name] = kw[name].requires_grad_()
    call_refused(impl, via(entry, "reshape_and_cache"), [name], w.guards(), *args, words=["grad"], **kw)


REQUIRES_GRAD_ATTN = ["query", "sinks", "k_scale_cache", "key_cache(none)", "out"]


@pytest.mark.parametrize("arg,entry", with_entries("paged_attention", REQUIRES_GRAD_ATTN, _attn_traits))
@pytest.mark.parametrize("impl", impl_params("paged_attention"))
def test_attention_requires_grad_refused(impl, arg, entry):
    mode = "none" if "(none)" in arg else "int8_per_token_head"
    require_usable(impl, mode)
    name = arg.split("(")[0]
    rng = rng_for("hostile-grad-attn", impl.name, arg)
    a = AttentionSetup(rng, mode, "torch", make_batch(rng, "mixed"), qdtype="float32", model_dtype="float32", impl=impl)
    a.entry = entry
    bt, sl, qsl, _ = a.index_tensors("torch", "int32", rng)
    sinks = a.sinks("torch", "contiguous", rng)[0]
    extra = {"sinks": sinks}
    if name == "query":
        extra["query"] = a.query.array.requires_grad_()
    elif name == "sinks":
        extra["sinks"] = sinks.requires_grad_()
    elif name == "k_scale_cache":
        extra["k_scale_cache"] = a.caches.k_scale.array.requires_grad_()
    elif name == "key_cache":
        extra["key_cache"] = a.caches.key.array.requires_grad_()
    else:
        extra["out"] = a.out.array.requires_grad_()
    call_refused(
        impl, lambda impl: a.call(impl, bt, sl, qsl, **extra), [name], a.caches.regions + [a.out], words=["grad"]
    )


@pytest.mark.parametrize("entry", entries("dequantize", "caches"))
@pytest.mark.parametrize("impl", impl_params("dequantize"))
def test_dequantize_requires_grad_refused(impl, entry):
    require_usable(impl, "int8_per_token_head")
    rng = rng_for("hostile-grad-deq", impl.name)
    caches = make_caches(rng, "int8_per_token_head", (3, BS, H, D), "torch", realistic=False, impl=impl)
    call_refused(
        impl,
        lambda impl: via(entry, "dequantize")(
            caches.key.array, caches.k_scale.array.requires_grad_(), mode="int8_per_token_head", impl=impl
        ),
        ["scale_cache"],
        caches.regions,
        words=["grad"],
    )


def negated_view(x: torch.Tensor) -> torch.Tensor:
    """A float32 view whose values are -x's and whose memory holds x's: the imaginary part of a
    lazily conjugated complex tensor (is_neg() True), on x's device."""
    return torch.complex(torch.zeros_like(x), x).conj().imag


@pytest.mark.parametrize("arg", ["key", "value"])
@pytest.mark.parametrize("impl", impl_params("reshape_and_cache"))
def test_write_negated_view_refused(impl, arg):
    """Triton read the view's memory and stored the rows negated; NumPy and Numba raised
    torch's RuntimeError."""
    require_usable(impl, "int8_per_token_head")
    rng = rng_for("hostile-neg-write", impl.name, arg)
    w = WriteSetup(rng, "int8_per_token_head", "torch", T=5, dtype="float32", impl=impl)
    args = list(w.args(case_tensor(w.valid_slots(rng), impl)))
    at = 0 if arg == "key" else 1
    args[at] = negated_view(args[at])
    call_refused(impl, kvzoo.reshape_and_cache, [arg], w.guards(), *args, words=["negated"], **w.caches.api_kwargs())


@pytest.mark.parametrize("arg", ["query", "sinks", "out"])
@pytest.mark.parametrize("impl", impl_params("paged_attention"))
def test_attention_negated_view_refused(impl, arg):
    require_usable(impl, "int8_per_token_head")
    rng = rng_for("hostile-neg-attn", impl.name, arg)
    a = AttentionSetup(
        rng,
        "int8_per_token_head",
        "torch",
        make_batch(rng, "mixed"),
        qdtype="float32",
        model_dtype="float32",
        impl=impl,
    )
    bt, sl, qsl, _ = a.index_tensors("torch", "int32", rng)
    extra = {"sinks": a.sinks("torch", "contiguous", rng)[0]}
    if arg == "query":
        extra["query"] = negated_view(a.query.array)
    elif arg == "sinks":
        extra["sinks"] = negated_view(extra["sinks"])
    else:
        # A fresh tensor: a view of the guarded region's bytes would be written through.
        extra["out"] = negated_view(case_tensor(torch.zeros(a.out.shape), impl))
    call_refused(
        impl, lambda impl: a.call(impl, bt, sl, qsl, **extra), [arg], a.caches.regions + [a.out], words=["negated"]
    )


@pytest.mark.parametrize("impl", impl_params("reshape_and_cache"))
def test_write_negated_view_refused_after_an_unvalidated_call(impl):
    """An unvalidated call goes straight to the launch a checked call of the same metadata
    (dtype, shape, strides, alignment) prepared: a negated view of that metadata is refused
    there too, not run as the plain view was."""
    require_usable(impl, "int8_per_token_head")
    T = 5
    t = lambda x: case_tensor(x, impl)  # noqa: E731
    caches = kvzoo.allocate_separate(4, BS, H, D, "int8_per_token_head", device=case_device(impl))
    kw = dict(mode="int8_per_token_head", k_scale_cache=caches.k_scale_cache, v_scale_cache=caches.v_scale_cache)
    slots = t(torch.randperm(4 * BS)[:T])
    value = t(torch.randn(T, H, D))
    # Odd elements of [T, H, 2D]: the strides and the 4-byte offset of a complex tensor's imag.
    plain = t(torch.randn(T, H, 2 * D))[..., 1::2]
    kvzoo.reshape_and_cache(
        plain, value, caches.key_cache, caches.value_cache, slots, impl=impl.name, validate=False, **kw
    )
    negated = negated_view(t(torch.randn(T, H, D)))
    assert (negated.stride(), negated.data_ptr() % 16 == 0) == (plain.stride(), plain.data_ptr() % 16 == 0)
    written = [guard_of(n, getattr(caches, n)) for n in ("key_cache", "value_cache", "k_scale_cache", "v_scale_cache")]
    call_refused(
        impl,
        lambda impl: kvzoo.reshape_and_cache(
            negated, value, caches.key_cache, caches.value_cache, slots, impl=impl, validate=False, **kw
        ),
        ["key"],
        written,
    )


# The functional entry runs validate=False too (the loop below), as the unvalidated entry would.
@pytest.mark.parametrize("entry", entries("reshape_and_cache", "unvalidated", "sparse"))
@pytest.mark.parametrize("impl", impl_params("reshape_and_cache"))
def test_write_sparse_key_refused(impl, entry):
    require_usable(impl, "int8_per_token_head")
    rng = rng_for("hostile-sparse-write", impl.name)
    w = WriteSetup(rng, "int8_per_token_head", "torch", T=5, dtype="float32", impl=impl)
    args = list(w.args(case_tensor(w.valid_slots(rng), impl)))
    args[0] = args[0].to_sparse()
    for validate in (True, False):
        call_refused(
            impl,
            via(entry, "reshape_and_cache"),
            ["key"],
            w.guards(),
            *args,
            words=["layout"],
            validate=validate,
            **w.caches.api_kwargs(),
        )


def _all_meta(which: str) -> tuple[str, ...]:
    """Every tensor on meta: one a PagedKVCache passes itself among them, and a trace to torch ops."""
    return ("caches", "all-meta") if which == "all" else ()


WRITE_NAMES = ["key", "value", "key_cache", "value_cache", "slot_mapping", "k_scale_cache", "v_scale_cache"]


@pytest.mark.parametrize(
    "which,entry", with_entries("reshape_and_cache", ["key_cache", "all"], lambda w: _write_traits(w, *_all_meta(w)))
)
@pytest.mark.parametrize("impl", impl_params("reshape_and_cache"))
def test_write_meta_refused(impl, which, entry):
    require_usable(impl, "int8_per_token_head")
    rng = rng_for("hostile-meta-write", impl.name, which)
    w = WriteSetup(rng, "int8_per_token_head", "torch", T=5, impl=impl)
    args = list(w.args(case_tensor(w.valid_slots(rng), impl)))
    kw = w.caches.api_kwargs()
    if which == "key_cache":
        args[2] = torch.empty(tuple(args[2].shape), dtype=torch.int8, device="meta")
        names = ["key_cache"] + WRITE_NAMES
    else:
        args = [x.to("meta") for x in args]
        kw = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        names = WRITE_NAMES
    call_refused(impl, via(entry, "reshape_and_cache"), names, w.guards(), *args, **kw)


ATTN_NAMES = [
    "query",
    "key_cache",
    "value_cache",
    "block_tables",
    "seq_lens",
    "query_start_loc",
    "k_scale_cache",
    "v_scale_cache",
    "sinks",
    "out",
]


@pytest.mark.parametrize(
    "which,entry", with_entries("paged_attention", ["query", "block_tables", "all"], lambda w: _all_meta(w))
)
@pytest.mark.parametrize("impl", impl_params("paged_attention"))
def test_attention_meta_refused(impl, which, entry):
    require_usable(impl, "int8_per_token_head")
    rng = rng_for("hostile-meta-attn", impl.name, which)
    a = AttentionSetup(rng, "int8_per_token_head", "torch", make_batch(rng, "mixed"), impl=impl)
    a.entry = entry
    bt, sl, qsl, _ = a.index_tensors("torch", "int32", rng)
    if which == "query":
        fn = lambda impl: a.call(impl, bt, sl, qsl, query=a.query.array.to("meta"))  # noqa: E731
    elif which == "block_tables":
        fn = lambda impl: a.call(impl, bt.to("meta"), sl, qsl)  # noqa: E731
    else:
        c = a.caches

        def fn(impl):
            m = lambda x: x.to("meta")  # noqa: E731
            return via(entry, "paged_attention")(
                m(a.query.array),
                m(c.key.array),
                m(c.value.array),
                mode="int8_per_token_head",
                k_scale_cache=m(c.k_scale.array),
                v_scale_cache=m(c.v_scale.array),
                block_tables=m(bt),
                seq_lens=m(sl),
                query_start_loc=m(qsl),
                impl=impl,
            )

    call_refused(impl, fn, ATTN_NAMES, a.caches.regions + [a.out])


@pytest.mark.parametrize("entry", entries("dequantize", "caches"))
@pytest.mark.parametrize("impl", impl_params("dequantize"))
def test_dequantize_meta_refused(impl, entry):
    require_usable(impl, "int8_per_token_head")
    rng = rng_for("hostile-meta-deq", impl.name)
    caches = make_caches(rng, "int8_per_token_head", (3, BS, H, D), "torch", realistic=False, impl=impl)
    call_refused(
        impl,
        lambda impl: via(entry, "dequantize")(
            caches.key.array.to("meta"), caches.k_scale.array.to("meta"), mode="int8_per_token_head", impl=impl
        ),
        ["cache", "scale_cache"],
        caches.regions,
    )


@pytest.mark.parametrize("entry", entries("reshape_and_cache", "not-a-tensor"))
@pytest.mark.parametrize("impl", impl_params("reshape_and_cache"))
def test_write_list_slot_mapping_refused(impl, entry):
    """SPEC 11 'kind': a torch.Tensor or a numpy.ndarray; a Python list is refused."""
    require_usable(impl, "int8_per_token_head")
    rng = rng_for("hostile-list-slots", impl.name)
    w = WriteSetup(rng, "int8_per_token_head", "torch", T=4, impl=impl)
    call_refused(
        impl,
        via(entry, "reshape_and_cache"),
        ["slot_mapping"],
        w.guards(),
        *w.args(w.valid_slots(rng).tolist()),
        **w.caches.api_kwargs(),
    )


@pytest.mark.parametrize("entry", entries("paged_attention", "not-a-tensor"))
@pytest.mark.parametrize("impl", impl_params("paged_attention"))
def test_attention_list_block_tables_refused(impl, entry):
    require_usable(impl, "int8_per_token_head")
    rng = rng_for("hostile-list-tables", impl.name)
    a = AttentionSetup(rng, "int8_per_token_head", "torch", make_batch(rng, "mixed"), impl=impl)
    a.entry = entry
    _, sl, qsl, _ = a.index_tensors("torch", "int32", rng)
    call_refused(
        impl, lambda impl: a.call(impl, a.batch.tables.tolist(), sl, qsl), ["block_tables"], a.caches.regions + [a.out]
    )


# ---------------------------------------------------------------------------------------------
# 10. strings and the cache object


@pytest.mark.parametrize(
    "kw,entry",
    with_entries(
        "reshape_and_cache",
        [{"mode": "int4_magic"}, {"mode": 3}, {"rounding": None}, {"rounding": "up"}],
        lambda kw: _write_traits(*kw, *(() if isinstance(next(iter(kw.values())), str) else ("schema-str",))),
        ids=repr,
    ),
)
@pytest.mark.parametrize("impl", impl_params("reshape_and_cache"))
def test_write_bad_strings_refused(impl, kw, entry):
    require_usable(impl, "int8_per_token_head")
    rng = rng_for("hostile-strings", impl.name, repr(kw))
    w = WriteSetup(rng, "int8_per_token_head", "torch", T=4, impl=impl)
    api_kw = {**w.caches.api_kwargs(), **kw}
    call_refused(
        impl,
        via(entry, "reshape_and_cache"),
        list(kw),
        w.guards(),
        *w.args(case_tensor(w.valid_slots(rng), impl)),
        **api_kw,
    )


PAGED_BAD = {
    "num_blocks -1": (dict(num_blocks=-1), ["num_blocks"]),
    "num_blocks 0": (dict(num_blocks=0), ["num_blocks"]),
    "block_size 0": (dict(block_size=0), ["block_size"]),
    "head_size 0": (dict(head_size=0), ["head_size"]),
    "num_kv_heads 0": (dict(num_kv_heads=0), ["num_kv_heads"]),
    "model_dtype float64 (none)": (dict(mode="none", model_dtype="float64"), ["model_dtype"]),
    "model_dtype int8 (none)": (dict(mode="none", model_dtype="int8"), ["model_dtype"]),
    "model_dtype float64 (int8)": (dict(model_dtype="float64"), ["model_dtype"]),
    "inline head_size 6": (dict(head_size=6, layout="inline"), ["head_size"]),
    "layout": (dict(layout="paged"), ["layout"]),
}


@pytest.mark.parametrize("case", list(PAGED_BAD))
def test_paged_kv_cache_refused(case):
    """PagedKVCache checks its arguments like the functional API (KVZooInputError, named)."""
    changes, names = PAGED_BAD[case]
    kw = dict(num_blocks=4, block_size=BS, num_kv_heads=H, head_size=D, mode="int8_per_token_head")
    kw.update(changes)
    try:
        kvzoo.PagedKVCache(**kw)
    except KVZooInputError as e:
        assert any(str(e).startswith(n) for n in names), f"message {str(e)!r} does not start with {names}"
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"raised {type(e).__name__} instead of KVZooInputError: {e}")
    else:
        pytest.fail(f"PagedKVCache({kw}) accepted")


@pytest.mark.parametrize(
    "method,name",
    [("write", n) for n in ("mode", "key_cache", "k_scale_cache", "v_scale")]
    + [("read", n) for n in ("mode", "scale_cache")]
    + [("attention", n) for n in ("mode", "value_cache", "k_scale")],
)
def test_paged_kv_cache_refuses_what_it_passes_itself(method, name):
    """A PagedKVCache passes its mode, caches and scales itself: its methods do not take them,
    and Python's TypeError names the argument before anything runs."""
    rng = rng_for("hostile-paged-own", method, name)
    cache = kvzoo.PagedKVCache(4, BS, H, D, "int8_per_token_head")
    rows = torch.from_numpy(rng.standard_normal((3, H, D)).astype(np.float32))
    cache.write(rows, rows, torch.arange(3))
    before = [x.clone() for x in (cache.tensors.key_cache, cache.tensors.k_scale_cache)]
    extra = {name: cache.tensors.key_cache if name.endswith("cache") else 0.5}
    index = dict(dtype=torch.int32)
    calls = {
        "write": lambda: cache.write(rows, rows, torch.arange(3), **extra),
        "read": lambda: cache.read("key", **extra),
        "attention": lambda: cache.attention(
            torch.from_numpy(rng.standard_normal((1, HQ, D)).astype(np.float32)),
            block_tables=torch.zeros(1, 1, **index),
            seq_lens=torch.tensor([3], **index),
            query_start_loc=torch.tensor([0, 1], **index),
            **extra,
        ),
    }
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{name}'"):
        calls[method]()
    assert all(torch.equal(a, b) for a, b in zip(before, (cache.tensors.key_cache, cache.tensors.k_scale_cache)))


# ---------------------------------------------------------------------------------------------
# 11. property-based fuzz of the index tensors


FUZZ_DTYPES = ["int32", "int64", "int32", "int64", "float32", "int16", "uint8", "bool"]


def _draw_layout(data, ndim: int, values: np.ndarray, kind: str, impl) -> tuple[str, str]:
    # Negative strides need NumPy arrays, which a device implementation does not take.
    shown_as = "numpy" if case_device(impl) == "cpu" else "torch"
    choices = [lay for lay in layouts_for(shown_as, ndim) if layout_fits(lay, values)]
    layout = data.draw(st.sampled_from(choices), label="layout")
    if layout.startswith("negative"):
        kind = "numpy"
    return layout, kind


def _int_range(dtype: str):
    if dtype == "int32":
        return -(2**31), 2**31 - 1
    return -(2**62), 2**62


@pytest.mark.parametrize("impl", impl_params("reshape_and_cache"))
@settings(FUZZ, max_examples=40)
@given(data=st.data())
def test_fuzz_slot_mapping(impl, data):
    """Random slot_mapping values, dtypes, lengths and layouts: refused exactly when the values
    (or dtype, or length) break SPEC 6/11; otherwise byte-equal to the oracle. (A device
    implementation gets the "numpy" examples as device tensors, and no negative strides.)"""
    require_usable(impl)
    mode = data.draw(st.sampled_from(sorted(impl.modes)), label="mode")
    T = data.draw(st.integers(0, 8), label="T")
    bs = data.draw(st.sampled_from([4, 8, 16]), label="block_size")
    nb = data.draw(st.integers(1, 3), label="num_blocks")
    hs = data.draw(st.sampled_from([16, 32]), label="head_size")
    kind = case_kind(data.draw(st.sampled_from(["torch", "numpy"]), label="kind"), impl)
    # About half the examples are valid calls (the oracle still judges each from its values).
    valid_intent = data.draw(st.booleans(), label="valid call intended")
    dtype = data.draw(st.sampled_from(INDEX_DTYPES if valid_intent else FUZZ_DTYPES), label="dtype")
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    rng = rng_for("hostile-fuzz-write", impl.name, seed)
    w = WriteSetup(
        rng,
        mode,
        kind,
        T=T,
        num_blocks=nb,
        block_size=bs,
        head_size=hs,
        impl=impl,
        dtype=data.draw(st.sampled_from(["bfloat16", "float16", "float32"]), label="input dtype"),
    )
    cap = nb * bs
    lo, hi = _int_range(dtype)
    perm = list(rng.permutation(cap))
    values = []
    for t in range(T):
        kinds = ["valid", "valid", "valid", "skip", "skip-far"] + (
            [] if valid_intent else ["range", "range-far", "repeat"]
        )
        what = data.draw(st.sampled_from(kinds), label=f"slot {t}")
        if what == "valid" and perm:
            values.append(int(perm.pop()))
        elif what == "skip":
            values.append(-data.draw(st.integers(1, 5)))
        elif what == "skip-far":
            values.append(lo)
        elif what == "range":
            values.append(cap + data.draw(st.integers(0, 3)))
        elif what == "range-far":
            values.append(hi)
        elif what == "repeat" and any(v >= 0 for v in values):
            values.append(next(v for v in values if v >= 0))
        else:
            values.append(-1)
    if data.draw(st.booleans(), label="all equal") and T:
        # A stride-0 view can show it; for a valid call, torch.tensor([-1]).expand(T).
        values = [values[0] if not valid_intent else -1] * T
    values = np.array(values, np.int64)
    length = T + data.draw(st.sampled_from([0, 0, 1, -1]), label="length change") if T and not valid_intent else T
    shown = values[:length] if length <= T else np.concatenate([values, [0]])
    layout, kind_idx = _draw_layout(data, 1, shown, kind, impl)
    sm, g = index_view(shown, dtype, kind_idx, layout, rng, slot_junk(cap), impl=impl)
    nonneg = values[values >= 0]
    valid = dtype in INDEX_DTYPES and length == T and (values < cap).all() and len(np.unique(nonneg)) == len(nonneg)
    event("accepted" if valid else "refused")
    if valid:
        w.run_accepted(impl, sm, values, extra_guards=[g])
    else:
        call_refused(
            impl,
            kvzoo.reshape_and_cache,
            ["slot_mapping"],
            w.guards() + [g, w.key, w.value],
            *w.args(sm),
            **w.caches.api_kwargs(),
        )


def _attention_validity(tables, seq_lens, qsl, T, nb, bs, dtypes, shapes_ok) -> tuple[bool, set]:
    """From SPEC 8/11, on the values: (valid, names the refusal may start with)."""
    bad_dtype = {n for n, d in dtypes.items() if d not in INDEX_DTYPES}
    if bad_dtype:
        return False, bad_dtype
    if not shapes_ok:
        return False, {"block_tables", "seq_lens", "query_start_loc"}
    qsl = np.asarray(qsl, np.int64)
    seq_lens = np.asarray(seq_lens, np.int64)
    q_lens = np.diff(qsl)
    if qsl[0] != 0 or qsl[-1] != T or (q_lens < 0).any():
        return False, {"query_start_loc"}
    if (seq_lens < 0).any() or (seq_lens < q_lens).any():
        return False, {"seq_lens", "query_start_loc"}
    if (seq_lens > tables.shape[1] * bs).any():
        return False, {"seq_lens", "block_tables"}
    used = np.arange(tables.shape[1])[None, :] < -(-seq_lens[:, None] // bs)
    ids = tables[used]
    if ids.size and (ids.min() < 0 or ids.max() >= nb):
        return False, {"block_tables"}
    return True, set()


def _draw_batch_values(data, rng, bs, min_seqs=0):
    S = data.draw(st.integers(min_seqs, 3), label="num_seqs")
    seq_lens = np.array([data.draw(st.integers(1, 10), label=f"seq_len {s}") for s in range(S)], np.int64)
    q_lens = np.array(
        [
            data.draw(st.integers(0, int(n)), label=f"q_len {s}") if data.draw(st.booleans()) else 1
            for s, n in enumerate(seq_lens)
        ],
        np.int64,
    )
    blocks = -(-seq_lens // bs)
    M = int(blocks.max(initial=0)) + data.draw(st.integers(0, 2), label="extra columns")
    M = max(M, 1)
    nb = int(blocks.sum()) + data.draw(st.integers(1, 2), label="spare blocks")
    order = rng.permutation(nb)
    tables = rng.integers(0, nb, (S, M)).astype(np.int64)
    start = 0
    for s, n in enumerate(blocks):
        tables[s, :n] = order[start : start + n]
        start += n
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    return S, seq_lens, q_lens, tables, qsl, nb


ATTN_FAULTS = [
    "none",
    "none",
    "none",
    "qsl-start",
    "qsl-end",
    "qsl-decreasing",
    "seq-short",
    "seq-negative",
    "seq-long",
    "block-range",
    "block-negative",
    "tail-junk",
    "dtype",
    "seq_lens-length",
    "qsl-length",
    "tables-rows",
    "far-values",
]


@pytest.mark.parametrize("impl", impl_params("paged_attention"))
@settings(FUZZ, max_examples=30)
@given(data=st.data())
def test_fuzz_attention_index_tensors(impl, data):
    """Random block_tables / seq_lens / query_start_loc values, dtypes and layouts: refused with
    validate=True exactly when the values break SPEC 8/11; otherwise within tolerance of the oracle."""
    require_usable(impl)
    mode = data.draw(st.sampled_from(sorted(impl.modes)), label="mode")
    bs = data.draw(st.sampled_from([4, 8]), label="block_size")
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    rng = rng_for("hostile-fuzz-attn", impl.name, seed)
    fault = data.draw(st.sampled_from(["none"] * (len(ATTN_FAULTS) // 2) + ATTN_FAULTS), label="fault")
    min_seqs = (
        2
        if fault == "qsl-decreasing"
        else 0
        if fault in ("none", "dtype", "seq_lens-length", "qsl-length", "tables-rows")
        else 1
    )
    S, seq_lens, q_lens, tables, qsl, nb = _draw_batch_values(data, rng, bs, min_seqs)
    dtypes = {
        n: data.draw(st.sampled_from(["int32", "int64"]), label=f"{n} dtype")
        for n in ("block_tables", "seq_lens", "query_start_loc")
    }
    T = int(q_lens.sum())
    shapes_ok = True
    if fault == "qsl-start" and S:
        qsl = qsl + data.draw(st.sampled_from([1, -1]))
    elif fault == "qsl-end" and S:
        qsl = qsl.copy()
        qsl[-1] += data.draw(st.sampled_from([1, -1]))
    elif fault == "qsl-decreasing" and S >= 2:
        qsl = qsl.copy()
        qsl[1] = qsl[2] + 1
    elif fault == "seq-short" and S:
        seq_lens = seq_lens.copy()
        s = int(np.argmax(q_lens))
        seq_lens[s] = q_lens[s] - 1
    elif fault == "seq-negative" and S:
        seq_lens = seq_lens.copy()
        seq_lens[-1] = -data.draw(st.integers(1, 3))
    elif fault == "seq-long" and S:
        seq_lens = seq_lens.copy()
        seq_lens[0] = tables.shape[1] * bs + data.draw(st.integers(1, 4))
    elif fault == "block-range" and S:
        tables = tables.copy()
        tables[0, 0] = nb + data.draw(st.integers(0, 3))
    elif fault == "block-negative" and S:
        tables = tables.copy()
        tables[-1, 0] = -1
    elif fault == "tail-junk" and S:
        tables = tables.copy()
        used = np.arange(tables.shape[1])[None, :] < -(-seq_lens[:, None] // bs)
        tables[~used] = rng.choice([-1, 2**31 - 1, nb, -(2**31)], int((~used).sum()))
    elif fault == "dtype":
        victim = data.draw(st.sampled_from(sorted(dtypes)))
        dtypes[victim] = data.draw(st.sampled_from(["float32", "int16", "uint8", "bool"]))
    elif fault == "seq_lens-length":
        seq_lens = np.concatenate([seq_lens, [1]]) if data.draw(st.booleans()) or not S else seq_lens[:-1]
        shapes_ok = False
    elif fault == "qsl-length":
        qsl = np.concatenate([qsl, [T]]) if data.draw(st.booleans()) or not S else qsl[:-1]
        shapes_ok = False
    elif fault == "tables-rows":
        tables = np.concatenate([tables, tables[:1] if S else np.zeros((1, tables.shape[1]), np.int64)])
        shapes_ok = False
    elif fault == "far-values" and S:
        if dtypes["seq_lens"] == "int64":
            seq_lens = seq_lens.copy()
            seq_lens[0] = 2**40
        if dtypes["block_tables"] == "int64":
            tables = tables.copy()
            tables[0, 0] = -(2**40)
    kind = case_kind(data.draw(st.sampled_from(["torch", "numpy"]), label="kind"), impl)
    batch = Batch(q_lens, np.asarray(seq_lens), np.asarray(tables), nb, bs)
    a = AttentionSetup(rng, mode, kind, batch, impl=impl, qdtype=data.draw(st.sampled_from(["bfloat16", "float32"])))
    arrays, guards = {}, []
    junk = {
        "block_tables": lambda s: rng.integers(0, nb, s),
        "seq_lens": lambda s: rng.integers(1, 11, s),
        "query_start_loc": lambda s: rng.integers(0, T + 1, s),
    }
    for name, values in (("block_tables", tables), ("seq_lens", seq_lens), ("query_start_loc", qsl)):
        layout, k = _draw_layout(data, np.asarray(values).ndim, np.asarray(values), kind, impl)
        arr, g = index_view(np.asarray(values), dtypes[name], k, layout, rng, junk[name], impl=impl)
        arrays[name] = arr
        guards.append(g)
    valid, names = _attention_validity(np.asarray(tables), seq_lens, qsl, T, nb, bs, dtypes, shapes_ok)
    event("accepted" if valid else "refused")
    if valid:
        a.run_accepted(impl, arrays["block_tables"], arrays["seq_lens"], arrays["query_start_loc"], guards=guards)
    else:
        call_refused(
            impl,
            lambda impl: a.call(impl, arrays["block_tables"], arrays["seq_lens"], arrays["query_start_loc"]),
            sorted(names),
            a.caches.regions + guards + [a.out, a.query],
        )


@pytest.mark.parametrize("impl", impl_params("dequantize"))
@settings(FUZZ, max_examples=25)
@given(data=st.data())
def test_fuzz_dequantize_index_tensors(impl, data):
    require_usable(impl)
    mode = data.draw(st.sampled_from(sorted(impl.modes)), label="mode")
    bs = data.draw(st.sampled_from([4, 8]), label="block_size")
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    rng = rng_for("hostile-fuzz-deq", impl.name, seed)
    fault = data.draw(
        st.sampled_from(["none"] * 3 + ["seq-negative", "seq-long", "block-range", "tail-junk", "dtype", "length"]),
        label="fault",
    )
    S, seq_lens, _, tables, _, nb = _draw_batch_values(data, rng, bs, 0 if fault in ("none", "dtype", "length") else 1)
    seq_lens = seq_lens.copy()
    if S and fault != "block-range" and data.draw(st.booleans(), label="zero length"):
        seq_lens[0] = 0
    dtypes = {n: data.draw(st.sampled_from(["int32", "int64"])) for n in ("block_tables", "seq_lens")}
    shapes_ok = True
    if fault == "seq-negative" and S:
        seq_lens[-1] = -1
    elif fault == "seq-long" and S:
        seq_lens[0] = tables.shape[1] * bs + 1
    elif fault == "block-range" and S and seq_lens[0] > 0:
        tables = tables.copy()
        tables[0, 0] = nb
    elif fault == "tail-junk" and S:
        tables = tables.copy()
        used = np.arange(tables.shape[1])[None, :] < -(-seq_lens[:, None] // bs)
        tables[~used] = -1
    elif fault == "dtype":
        dtypes[data.draw(st.sampled_from(sorted(dtypes)))] = data.draw(st.sampled_from(["float32", "int16", "bool"]))
    elif fault == "length":
        seq_lens = np.concatenate([seq_lens, [1]])
        shapes_ok = False
    kind = case_kind(data.draw(st.sampled_from(["torch", "numpy"]), label="kind"), impl)
    caches = make_caches(rng, mode, (nb, bs, H, D), kind, realistic=False, impl=impl)
    arrays, guards = {}, []
    for name, values in (("block_tables", tables), ("seq_lens", seq_lens)):
        layout, k = _draw_layout(data, values.ndim, values, kind, impl)
        arr, g = index_view(values, dtypes[name], k, layout, rng, lambda s: rng.integers(0, nb, s), impl=impl)
        arrays[name] = arr
        guards.append(g)
    qsl_dummy = np.zeros(len(seq_lens) + 1, np.int64)  # dequantize has no query
    valid, names = _attention_validity(
        tables, seq_lens, qsl_dummy, 0, nb, bs, {**dtypes, "query_start_loc": "int64"}, shapes_ok
    )
    if fault == "length":
        valid, names = False, {"seq_lens", "block_tables"}
    event("accepted" if valid else "refused")
    if valid:
        check_dequantize(impl, caches, arrays["block_tables"], arrays["seq_lens"], tables, seq_lens, guards)
    else:
        names = names - {"query_start_loc"} or {"seq_lens", "block_tables"}
        kw = caches.api_kwargs()
        call_refused(
            impl,
            lambda impl: kvzoo.dequantize(
                caches.key.array,
                kw["k_scale_cache"],
                mode=mode,
                scale=kw["k_scale"],
                block_tables=arrays["block_tables"],
                seq_lens=arrays["seq_lens"],
                impl=impl,
            ),
            sorted(names),
            caches.regions + guards,
        )


# ---------------------------------------------------------------------------------------------
# metadata that breaks the rules (SPEC 11.1): no byte outside the given arrays, whatever the
# metadata says, through every entry point that does not read it


LYING_FAULTS = (
    "rows-past-the-query",
    "rows-before-the-first",
    "block-past-the-cache",
    "negative-block",
    "length-past-the-table",
    "length-below-the-query",
)
# One mode per kernel family the faults reach: the paged kernels' codes and model dtype, a
# static scale, and int4's own kernels.
LYING_MODES = ("int8_per_token_head", "none", "fp8_per_tensor", "int4_per_token_head")
# functional and torch_op with validate=False; plan: planned on valid metadata that then takes
# the lying values in place (an engine updating a replayed step); cache: PagedKVCache's methods
# with validate=False (hostile_support.via).
LYING_ENTRIES = ("functional", "plan", "torch_op", "cache")


def lying_metadata(rng, b: Batch, fault: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(block_tables, seq_lens, query_start_loc) of batch b with one fault of LYING_FAULTS.
    Sequence 1 is the one a fault breaks (it has at least 2 query tokens); the others keep
    their rows and results."""
    tables, lens, qsl = b.tables.copy(), b.seq_lens.copy(), b.qsl.copy()
    live = -(-int(lens[1]) // b.block_size)
    if fault == "rows-past-the-query":
        # The last sequence claims rows past the query; its length grows with them, so the rows
        # it keeps sit where they were (and its table has a spare column for them).
        extra = int(rng.integers(1, 3))
        qsl[-1] += extra
        lens[-1] += extra
    elif fault == "rows-before-the-first":
        qsl[0] = 1  # row 0 belongs to no sequence
    elif fault == "block-past-the-cache":
        tables[1, rng.integers(0, live)] = b.num_blocks + int(rng.integers(0, 1000))
    elif fault == "negative-block":
        tables[1, rng.integers(0, live)] = -1 - int(rng.integers(0, 1000))
    elif fault == "length-past-the-table":
        lens[1] = tables.shape[1] * b.block_size + int(rng.integers(1, 5))
    elif fault == "length-below-the-query":
        lens[1] = int(b.q_lens[1]) - int(rng.integers(1, b.q_lens[1] + 1))
    return tables, lens, qsl


def _index(values: np.ndarray, impl) -> torch.Tensor:
    return case_tensor(torch.from_numpy(np.ascontiguousarray(values, dtype=np.int32)), impl)


def _bounds(qsl: np.ndarray, lens: np.ndarray) -> dict:
    q_lens = np.diff(qsl)
    return dict(
        max_query_len=int(max(q_lens.max(initial=0), 0)),
        max_seq_len=int(max(lens.max(initial=0), 0)),
        num_prefills=int((q_lens > 1).sum()),
    )


def _run_lying_attention(a: AttentionSetup, impl, entry: str, valid, lying, rng) -> None:
    """Attention through `entry` on the lying metadata: functional and torch ops with
    validate=False; a plan made on the valid metadata whose tensors then take the lying values
    in place (an engine updating a replayed step)."""
    c = a.caches
    bounds = {k: max(v, _bounds(valid[2], valid[1])[k]) for k, v in _bounds(lying[2], lying[1]).items()}
    if entry in ("functional", "cache"):
        tensors = [_index(x, impl) for x in lying]
        a.call(impl.name, *tensors, validate=False, entry=entry, **bounds)
        return
    if entry == "torch_op":
        bt, sl, qsl = (_index(x, impl) for x in lying)
        torch.ops.kvzoo.paged_attention(
            a.out.array, a.query.array, c.key.array, c.value.array, bt, sl, qsl,
            None if c.k_scale is None else c.k_scale.array, None if c.v_scale is None else c.v_scale.array,
            _static(c.k_static, impl), _static(c.v_static, impl), None, c.mode, 1.0 / math.sqrt(D),
            None, None, bounds["max_query_len"], bounds["max_seq_len"], False, False, False, None,
            num_prefills=bounds["num_prefills"], validate=False, impl=impl.name,
        )  # fmt: skip
        return
    tensors = [_index(x, impl) for x in valid]
    nb, bs, h, d = c.key.shape[0], c.key.shape[1], c.key.shape[2], a.query.shape[2]
    spec = kvzoo.CacheSpec(
        c.mode, num_blocks=nb, block_size=bs, num_kv_heads=h, head_size=d, model_dtype="bfloat16",
        device=case_device(impl),
    )  # fmt: skip
    plan = kvzoo.plan_step(
        spec, block_tables=tensors[0], seq_lens=tensors[1], query_start_loc=tensors[2], num_q_heads=a.query.shape[1],
        impl=impl.name, **bounds,
    )  # fmt: skip
    for t, values in zip(tensors, lying):
        t.copy_(torch.from_numpy(np.ascontiguousarray(values, dtype=np.int32)))
    caches = KVCacheTensors(
        c.key.array, c.value.array, None if c.k_scale is None else c.k_scale.array,
        None if c.v_scale is None else c.v_scale.array,
    )  # fmt: skip
    plan.attention(a.query.array, caches, out=a.out.array, k_scale=c.k_static, v_scale=c.v_static)


def _static(scale, impl):
    return None if scale is None else case_tensor(torch.tensor([scale], dtype=torch.float32), impl)


def check_lying_attention(a: AttentionSetup, impl, lying, what: str) -> None:
    """Nothing outside out changed; rows no sequence owns keep their bytes; an ill-formed
    sequence's rows are NaN; every other row is the oracle's on the metadata as given."""
    from kvzoo_spec.oracle import attended_sequences

    for r in a.caches.regions:
        r.assert_outside_unchanged(f"{what}: a cache (read array)", [a.out], only_others=True)
    a.query.assert_outside_unchanged(f"{what}: query (a read array)", [a.out], only_others=True)
    a.out.assert_outside_unchanged(what)
    tables, lens, qsl = lying
    T = a.query.shape[0]
    nb, bs = a.caches.key.shape[:2]
    sequences = attended_sequences(T, nb, bs, tables, lens, qsl)
    got = a.out.values().astype(np.float64)
    owned = np.zeros(T, bool)
    well = [s for s, (rows, _, _, ok) in enumerate(sequences) if ok and rows]
    ref = reference_attention(a.caches, a.query.values("before"), tables, lens, qsl) if well else None
    tol = samples.attention_tolerance(impl, a.qdtype, False)
    for s, (rows, _, _, ok) in enumerate(sequences):
        owned[rows] = True
        if not rows:
            continue
        if not ok:
            assert np.isnan(got[rows]).all(), f"{what}: ill-formed sequence {s}'s rows are not all NaN"
            continue
        err = np.linalg.norm(got[rows] - ref[rows]) / max(np.linalg.norm(ref[rows]), 1e-30)
        assert err <= tol, f"{what}: sequence {s} relative error {err:.3e} > {tol:.1e} (seed {SEED})"
    unowned = ~owned
    assert np.array_equal(a.out.element_bytes()[unowned], a.out.element_bytes("before")[unowned]), (
        f"{what}: rows {np.flatnonzero(unowned).tolist()} belong to no sequence and were written"
    )


@pytest.mark.parametrize("entry", LYING_ENTRIES)
@pytest.mark.parametrize("fault", LYING_FAULTS)
@pytest.mark.parametrize("impl", impl_params("paged_attention"))
def test_attention_metadata_that_lies(impl, fault, entry):
    mode = pick_mode(impl, "lying", fault, entry, candidates=LYING_MODES)
    require_usable(impl, mode)
    rng = rng_for("hostile-lying-attention", impl.name, fault, entry)
    # A decode on a long context, a prefill and a chunk on earlier context; they end mid-block.
    b = batch_for(rng, [1, int(rng.integers(2, 5)), 2], [int(rng.integers(6, 12)), int(rng.integers(5, 8)), 7])
    b = Batch(b.q_lens, np.maximum(b.seq_lens, b.q_lens), b.tables, b.num_blocks, b.block_size)
    a = AttentionSetup(rng, mode, "torch", b, impl=impl)
    lying = lying_metadata(rng, b, fault)
    _run_lying_attention(a, impl, entry, (b.tables, b.seq_lens, b.qsl), lying, rng)
    check_lying_attention(a, impl, lying, f"{impl.name} {entry} attention ({mode}, {fault})")


@pytest.mark.parametrize("fault", ["block-past-the-cache", "length-past-the-table", "rows-past-the-query"])
@pytest.mark.parametrize("impl", [p for p in impl_params("paged_attention") if p.id.startswith("triton")])
def test_staged_prefill_metadata_that_lies(impl, fault):
    """Triton's staged prefill (128 query tokens or more on a quantized cache) gathers the
    context into a workspace sized by the bounds, then attends over it: both passes bounded."""
    mode = pick_mode(impl, "lying-staged", fault, candidates=("int8_per_token_head", "int4_per_token_head"))
    require_usable(impl, mode)
    rng = rng_for("hostile-lying-staged", impl.name, fault)
    b = batch_for(rng, [1, 130, 2], [9, 133, 6], block_size=16)
    a = AttentionSetup(rng, mode, "torch", b, impl=impl)
    lying = lying_metadata(rng, b, fault)
    _run_lying_attention(a, impl, "functional", (b.tables, b.seq_lens, b.qsl), lying, rng)
    check_lying_attention(a, impl, lying, f"{impl.name} staged attention ({mode}, {fault})")


@pytest.mark.parametrize("entry", LYING_ENTRIES)
@pytest.mark.parametrize("impl", impl_params("reshape_and_cache"))
def test_write_slots_past_the_cache_are_skipped(impl, entry):
    """A slot at or past num_blocks * block_size is skipped like a negative one, through every
    entry point that does not check the values."""
    mode = pick_mode(impl, "lying-write", entry, candidates=LYING_MODES)
    require_usable(impl, mode)
    rng = rng_for("hostile-lying-write", impl.name, entry)
    w = WriteSetup(rng, mode, "torch", T=6, impl=impl)
    slots = w.valid_slots(rng)
    wild = rng.choice(w.T, 2, replace=False)
    slots[wild] = w.capacity + rng.integers(0, 3 * w.capacity, 2)
    c = w.caches
    slot_t = case_tensor(torch.from_numpy(slots), impl)
    statics = dict(k_scale=_static(c.k_static, impl), v_scale=_static(c.v_static, impl))
    if entry in ("functional", "cache"):
        via(entry, "reshape_and_cache")(
            w.key.array, w.value.array, c.key.array, c.value.array, slot_t, validate=False, impl=impl.name,
            **{**c.api_kwargs(), **statics},
        )  # fmt: skip
    elif entry == "torch_op":
        torch.ops.kvzoo.reshape_and_cache(
            w.key.array, w.value.array, c.key.array, c.value.array, slot_t,
            None if c.k_scale is None else c.k_scale.array, None if c.v_scale is None else c.v_scale.array,
            statics["k_scale"], statics["v_scale"], mode, "nearest", validate=False, impl=impl.name,
        )  # fmt: skip
    else:
        valid = case_tensor(torch.from_numpy(np.where(slots >= w.capacity, -1, slots)), impl)
        nb, bs, h = c.key.shape[:3]
        spec = kvzoo.CacheSpec(
            mode, num_blocks=nb, block_size=bs, num_kv_heads=h, head_size=w.key.shape[2], model_dtype="bfloat16",
            device=case_device(impl),
        )  # fmt: skip
        plan = kvzoo.plan_step(
            spec, block_tables=_index(np.zeros((1, 1)), impl), seq_lens=_index(np.zeros(1), impl),
            query_start_loc=_index(np.zeros(2), impl), slot_mapping=valid, num_q_heads=h, impl=impl.name,
        )  # fmt: skip
        valid.copy_(slot_t)  # the engine's in-place update, past the cache
        caches = KVCacheTensors(
            c.key.array, c.value.array, None if c.k_scale is None else c.k_scale.array,
            None if c.v_scale is None else c.v_scale.array,
        )  # fmt: skip
        plan.write(w.key.array, w.value.array, caches, **statics)
    skipped = np.where(slots >= w.capacity, -1, slots)
    assert_write_matches(f"{impl.name} {entry}", c, w.key.values(), w.value.values(), skipped)
