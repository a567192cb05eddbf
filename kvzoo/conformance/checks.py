"""The conformance checks: one function per operation, run against the oracle.

Each check takes an implementation and a case, builds fresh random inputs, runs the public
API with impl=<name>, and raises AssertionError on any difference (codes and scales compared as
raw bytes; attention within the implementation's declared tolerance of a float64 reference on
the same quantized cache), or NotApplicable when the implementation cannot run the case here.
`matrix()` crosses every registered implementation with every case; tests/ and `kvzoo check`
both run it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import torch

import kvzoo_spec
from kvzoo_spec import oracle

from .. import api, registry
from ..arrays import as_numpy, as_torch, numpy_dtype
from ..capabilities import Requirements
from ..layout import KVCacheTensors, allocate_inline, inline_views
from ..modes import MODES
from .cases import AttentionCase, DequantCase, WriteCase, attention_cases, dequant_cases, write_cases
from .inputs import (
    assert_same_bytes,
    device_for,
    host_bytes,
    host_float32,
    make_rows,
    random_bytes,
    rng_for,
    tensor,
)

GOLDEN_DIR = Path(kvzoo_spec.__file__).parent / "golden"
GOLDEN_FILES = sorted(GOLDEN_DIR.glob("*.npz"))


class NotApplicable(Exception):
    """The case is outside what the implementation declares, or it cannot run on this machine
    (the reason is the message). Decided before anything runs."""


def declared_reasons(impl, mode_name: str, need: Requirements) -> list[str]:
    """Why impl's declarations (modes, capabilities) leave this case out; [] when they take it."""
    if mode_name not in impl.modes:
        return [f"{impl.name}: does not register mode {mode_name}"]
    return impl.capabilities.reasons(impl.name, need)


def _usable(impl, mode_name: str, need: Requirements) -> None:
    reasons = list(impl.unavailable()) or declared_reasons(impl, mode_name, need)
    if reasons:
        raise NotApplicable("; ".join(reasons))


def _run_declared(impl, call: Callable[[], Any]) -> Any:
    """Run a case the declarations say impl takes: a refusal now is a failure, not a skip."""
    try:
        return call()
    except registry.NoImplementationError as refusal:
        raise AssertionError(
            f"{impl.name} declares it takes this case but refused it: {refusal}") from None


def _kind(case_kind: str, device: str) -> str:
    return case_kind if device == "cpu" else "torch"


def _static_scale(rng) -> np.float32:
    return np.float32(2.0 ** rng.integers(-4, 5) * rng.uniform(1.0, 2.0))


def _caches(case: WriteCase, rng, num_blocks, device, kind):
    """Poisoned caches (random bytes) in the case's layout."""
    mode = MODES[case.mode]
    shape = (num_blocks, case.block_size, case.num_kv_heads, case.head_size)
    if case.layout == "inline":
        buf = random_bytes(rng, (num_blocks, 2, case.block_size, case.num_kv_heads, case.head_size + 4),
                           "uint8", device, kind)
        return inline_views(buf, case.head_size, mode)
    dtype = mode.code_dtype or case.dtype
    kc, vc = (random_bytes(rng, shape, dtype, device, kind) for _ in range(2))
    if mode.per_token_head:
        ks, vs = (random_bytes(rng, shape[:3], "float32", device, kind) for _ in range(2))
        return KVCacheTensors(kc, vc, ks, vs)
    return KVCacheTensors(kc, vc)


def _maybe_strided(values32, case, device, kind, slot):
    """K or V as a tensor, or as a view into a fused QKV-like buffer when case.strided."""
    if not case.strided:
        return tensor(values32, case.dtype, device, kind)
    t, h, d = values32.shape
    fused = np.zeros((t, 3 * h + 1, d + 3), np.float32)
    fused[:, 1 + slot * h: 1 + (slot + 1) * h, 2: 2 + d] = values32
    full = tensor(fused, case.dtype, device, kind)
    return full[:, 1 + slot * h: 1 + (slot + 1) * h, 2: 2 + d]


# ---------------------------------------------------------------------------------------------
# reshape_and_cache


def check_reshape_and_cache(impl, case: WriteCase):
    _usable(impl, case.mode, case.requirements())
    mode = MODES[case.mode]
    device = device_for(impl)
    kind = _kind(case.kind, device)
    rng = rng_for("write", case.id)
    T, H, D, BS = case.num_tokens, case.num_kv_heads, case.head_size, case.block_size
    num_blocks = max(1, -(-T // BS)) + 2
    static = _static_scale(rng) if mode.per_tensor else None
    k32 = make_rows(mode, case.dist, case.dtype, (T, H, D), rng, static)
    v32 = make_rows(mode, case.dist, case.dtype, (T, H, D), rng, static)
    slots = rng.permutation(num_blocks * BS)[:T].astype(np.int64)
    if case.negative_slots and T:
        skip = rng.random(T) < 0.3
        slots[skip] = -rng.integers(1, 5, int(skip.sum()))
    oracle_slots = slots
    if case.wild_slots and T:
        # validate=False: out-of-range slots must be skipped like negative ones, and nothing
        # may land in the guard block that follows the cache in memory.
        wild = rng.random(T) < 0.4
        slots = slots.copy()
        slots[wild] = num_blocks * BS + rng.integers(0, 2 * BS, int(wild.sum()))
        oracle_slots = np.where(wild, -1, slots)
    padded = _caches(case, rng, num_blocks + 1, device, kind)
    guard = [None if c is None else (c[num_blocks:].clone() if isinstance(c, torch.Tensor) else c[num_blocks:].copy())
             for c in
             (padded.key_cache, padded.value_cache, padded.k_scale_cache, padded.v_scale_cache)]
    caches = KVCacheTensors(*(None if c is None else c[:num_blocks] for c in
                              (padded.key_cache, padded.value_cache, padded.k_scale_cache, padded.v_scale_cache,
                               padded.buffer)))
    before = [None if c is None else host_bytes(c).copy() for c in
              (caches.key_cache, caches.value_cache, caches.k_scale_cache, caches.v_scale_cache)]

    key = _maybe_strided(k32, case, device, kind, 0)
    value = _maybe_strided(v32, case, device, kind, 1)
    slot_mapping = slots.astype(np.int32 if T % 2 else np.int64)
    slot_mapping = slot_mapping if kind == "numpy" else torch.from_numpy(slot_mapping).to(device)
    api.reshape_and_cache(
        key, value, caches.key_cache, caches.value_cache, slot_mapping, mode=case.mode,
        k_scale_cache=caches.k_scale_cache, v_scale_cache=caches.v_scale_cache,
        k_scale=None if static is None else float(static), v_scale=None if static is None else float(static),
        rounding=case.rounding, impl=impl, validate=not case.wild_slots,
    )
    for got, want in zip((padded.key_cache, padded.value_cache, padded.k_scale_cache, padded.v_scale_cache), guard):
        if want is not None:
            assert_same_bytes(got[num_blocks:], want, f"{impl.name} wrote past the end of the cache")

    if mode.code_dtype is None:
        # A plain copy: the expected bits are the input tensors' own (NaN payloads included).
        model = numpy_dtype(case.dtype)
        expect_inputs = tuple(np.ascontiguousarray(as_numpy(x.cpu() if isinstance(x, torch.Tensor) else x))
                              for x in (key, value))
        expect_caches = [before[0].view(model)[..., 0], before[1].view(model)[..., 0]]
    else:
        expect_inputs = (k32, v32)
        expect_caches = [before[0][..., 0], before[1][..., 0]]
    scale_caches = [None if b is None else b.view(np.float32)[..., 0] for b in before[2:]]
    expected = oracle.reshape_and_cache(
        *expect_inputs, oracle_slots, mode_name=case.mode, num_blocks=num_blocks, block_size=BS,
        rounding=case.rounding, k_scale=static, v_scale=static,
        key_cache=expect_caches[0], value_cache=expect_caches[1],
        k_scale_cache=scale_caches[0], v_scale_cache=scale_caches[1],
    )
    names = ("key_cache", "value_cache", "k_scale_cache", "v_scale_cache")
    actual = (caches.key_cache, caches.value_cache, caches.k_scale_cache, caches.v_scale_cache)
    for name, got, want in zip(names, actual, expected):
        if want is not None:
            assert_same_bytes(got, want, f"{impl.name} {name}")
    if case.layout == "inline":
        # The views cover every byte of the page buffer: nothing else may change either.
        want_buf = oracle.pack_inline(expected[0], expected[1], expected[2], expected[3])
        assert_same_bytes(caches.buffer, want_buf, f"{impl.name} inline buffer")


# ---------------------------------------------------------------------------------------------
# dequantize


def _random_codes_and_scales(mode, rng, shape, model_dtype="float32"):
    """A cache of random codes (NaN codes included) and positive scales spanning decades."""
    if mode.code_dtype is None:
        return rng.standard_normal(shape).astype(np.float32).astype(numpy_dtype(model_dtype)), None
    codes = rng.integers(0, 256, shape, dtype=np.uint8)
    if not mode.per_token_head:
        return codes, None
    scales = (np.abs(rng.standard_normal(shape[:3])) * 10.0 ** rng.uniform(-6, 2, shape[:3])).astype(np.float32)
    return codes, scales


def _assert_same_floats(actual, expected, what):
    """Bitwise equality, except that any NaN matches any NaN (decode of a NaN code)."""
    a = host_float32(actual)
    e = np.asarray(expected, np.float32)
    both_nan = np.isnan(a) & np.isnan(e)
    assert_same_bytes(np.where(both_nan, np.float32(0), a), np.where(both_nan, np.float32(0), e), what)


def check_dequantize(impl, case: DequantCase):
    _usable(impl, case.mode, case.requirements())
    mode = MODES[case.mode]
    device = device_for(impl)
    rng = rng_for("dequant", case.id)
    num_blocks, BS, H, D = 7, case.block_size, case.num_kv_heads, case.head_size
    codes, scales = _random_codes_and_scales(mode, rng, (num_blocks, BS, H, D))
    static = _static_scale(rng) if mode.per_tensor else None
    if case.layout == "inline":
        views = allocate_inline(num_blocks, BS, H, D, mode, device=device)
        views.key_cache.view(torch.uint8).copy_(torch.from_numpy(codes))
        views.k_scale_cache.copy_(torch.from_numpy(scales))
        cache, scale_cache = views.key_cache, views.k_scale_cache
    else:
        cache = torch.from_numpy(codes).view(getattr(torch, mode.code_dtype)) if mode.code_dtype else \
            torch.from_numpy(codes.astype(np.float32))
        cache = cache.to(device)
        scale_cache = None if scales is None else torch.from_numpy(scales).to(device)
    kw = dict(mode=case.mode, scale=None if static is None else float(static), impl=impl)
    raw = codes if mode.code_dtype else codes.astype(np.float32)
    if case.whole_cache:
        got = api.dequantize(cache, scale_cache, **kw)
        want = oracle.decode_cache(raw, scales, case.mode, static)
    else:
        seq_lens = np.array([5, 0, BS * 3 + 1, 1], np.int32)
        tables = np.stack([rng.permutation(num_blocks)[:5] for _ in seq_lens]).astype(np.int32)
        got = api.dequantize(cache, scale_cache, block_tables=torch.from_numpy(tables).to(device),
                               seq_lens=torch.from_numpy(seq_lens).to(device), **kw)
        want = oracle.gather_dequantize(raw, scales, tables, seq_lens, case.mode, static)
    _assert_same_floats(got, want, f"{impl.name} dequantize")


# ---------------------------------------------------------------------------------------------
# paged attention


def _batch(case: AttentionCase, rng):
    """(q_lens, seq_lens) for the case's batch type; some sequences end mid-block."""
    if case.batch == "decode":
        seq_lens = rng.integers(1, 70, 4)
        q_lens = np.ones(4, np.int64)
    elif case.batch == "prefill":
        seq_lens = rng.integers(1, 40, 3)
        q_lens = seq_lens.copy()
    elif case.batch == "long":
        # Prompt-sized query runs (an implementation may take another path for them, as the
        # Triton backend's staged prefill does), next to a decode.
        seq_lens = np.array([rng.integers(128, 150), rng.integers(150, 200), rng.integers(1, 70)])
        q_lens = np.array([seq_lens[0], rng.integers(128, 140), 1])
    else:  # two decodes, a prefill chunk on top of earlier context, a fresh prefill
        seq_lens = np.array([rng.integers(1, 70), rng.integers(20, 50), rng.integers(1, 30), rng.integers(2, 60)])
        q_lens = np.array([1, rng.integers(5, 13), seq_lens[2], 1])
    return q_lens.astype(np.int64), seq_lens.astype(np.int64)


def fill_quantized(mode, rng, shape, model_dtype):
    """Random but realistic cache contents: (codes or values, per-row scales or None)."""
    fmt = mode.format
    if fmt is None:
        return rng.standard_normal(shape).astype(np.float32).astype(numpy_dtype(model_dtype)), None
    # Values spread over the format's range as rows scaled by absmax / qmax are, snapped to codes.
    values = fmt.representable()
    y = np.clip(rng.standard_normal(shape) * fmt.qmax / 3, fmt.qmin, fmt.qmax)
    i = np.clip(np.searchsorted(values, y), 1, len(values) - 1)
    nearer_below = (y - values[i - 1]) < (values[i] - y)
    codes = fmt.codes_of(np.where(nearer_below, values[i - 1], values[i]))
    if not mode.per_token_head:
        return codes, None
    scales = rng.uniform(0.002, 0.05, shape[:3]).astype(np.float32)
    return codes, scales


def check_paged_attention(impl, case: AttentionCase):
    _usable(impl, case.mode, case.requirements())
    mode = MODES[case.mode]
    device = device_for(impl)
    rng = rng_for("attention", case.id)
    BS, Hkv, Hq, D = case.block_size, case.num_kv_heads, case.num_q_heads, case.head_size
    q_lens, seq_lens = _batch(case, rng)
    blocks_per_seq = -(-seq_lens // BS)
    num_blocks = int(blocks_per_seq.sum()) + 3
    max_blocks = int(blocks_per_seq.max()) + 1
    order = rng.permutation(num_blocks)
    tables = rng.integers(0, num_blocks, (len(seq_lens), max_blocks))
    start = 0
    for s, n in enumerate(blocks_per_seq):
        tables[s, :n] = order[start:start + n]
        start += n
    shape = (num_blocks, BS, Hkv, D)
    (kc, ks), (vc, vs) = (fill_quantized(mode, rng, shape, case.query_dtype) for _ in range(2))
    static = (_static_scale(rng), _static_scale(rng)) if mode.per_tensor else (None, None)
    if case.poison:
        # Poison the key that sequence 0's last query attends to, in KV head 0: every output
        # row of that head group must come out non-finite (SPEC.md section 8), no other row.
        pos = int(seq_lens[0]) - 1
        block, off = int(tables[0, pos // BS]), pos % BS
        if mode.per_token_head:
            ks[block, off, 0] = np.nan
        elif mode.per_tensor:
            kc[block, off, 0, 0] = mode.nan_code
        else:
            kc[block, off, 0, 0] = np.nan

    if case.layout == "inline":
        views = allocate_inline(num_blocks, BS, Hkv, D, mode, device=device)
        for dst, src in ((views.key_cache, kc), (views.value_cache, vc)):
            dst.view(torch.uint8).copy_(torch.from_numpy(src))
        views.k_scale_cache.copy_(torch.from_numpy(ks))
        views.v_scale_cache.copy_(torch.from_numpy(vs))
        key_cache, value_cache, k_sc, v_sc = views.key_cache, views.value_cache, views.k_scale_cache, views.v_scale_cache
    else:
        def dev(a, dtype=None):
            t = torch.from_numpy(a) if a.dtype != ml_dtypes.bfloat16 else torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
            return (t.view(getattr(torch, dtype)) if dtype else t).to(device)
        key_cache = dev(kc, mode.code_dtype)
        value_cache = dev(vc, mode.code_dtype)
        k_sc = None if ks is None else dev(ks)
        v_sc = None if vs is None else dev(vs)

    num_tokens = int(q_lens.sum())
    q32 = rng.standard_normal((num_tokens, Hq, D)).astype(np.float32)
    query = tensor(q32, case.query_dtype, device)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    sinks = (rng.standard_normal(Hq) * 2).astype(np.float32) if case.sinks else None
    out = torch.full_like(query, float("nan"))
    api.paged_attention(
        query, key_cache, value_cache, mode=case.mode,
        block_tables=torch.from_numpy(tables.astype(np.int32)).to(device),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
        query_start_loc=torch.from_numpy(qsl).to(device),
        k_scale_cache=k_sc, v_scale_cache=v_sc,
        k_scale=None if static[0] is None else float(static[0]),
        v_scale=None if static[1] is None else float(static[1]),
        sliding_window=case.sliding_window, softcap=case.softcap,
        sinks=None if sinks is None else torch.from_numpy(sinks).to(device),
        out=out, quantize_query=case.quantize_query, impl=impl,
    )

    raw_k = kc if mode.code_dtype else kc.astype(np.float32)
    raw_v = vc if mode.code_dtype else vc.astype(np.float32)
    k_deq = oracle.decode_cache(raw_k, ks, case.mode, static[0])
    v_deq = oracle.decode_cache(raw_v, vs, case.mode, static[1])
    ref_query = as_numpy(query.cpu())
    if case.quantize_query:
        rows = oracle.widen_to_float32(ref_query).reshape(-1, D)
        ref_query = oracle.decode_rows(*oracle.quantize_rows(rows, case.mode), case.mode).reshape(query.shape)
    ref = oracle.attention_f64(
        ref_query, k_deq, v_deq, tables, seq_lens, qsl,
        sliding_window=case.sliding_window, softcap=case.softcap, sinks=sinks,
    )
    got = host_float32(out).astype(np.float64)
    poisoned = ~np.isfinite(ref)
    assert not np.isfinite(got[poisoned]).any(), f"{impl.name}: a poisoned key gave finite output"
    unwritten = ~np.isfinite(got) & ~poisoned
    assert not unwritten.any(), f"{impl.name}: {int(unwritten.sum())} output elements not finite/unwritten"
    got, ref = np.where(poisoned, 0.0, got), np.where(poisoned, 0.0, ref)
    # The output's own rounding (bf16 keeps 8 significant bits) is allowed on top.
    out_roundoff = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 0.0}[case.query_dtype]
    tol = impl.attention_rtol + out_roundoff
    # Per sequence (SPEC.md section 8), so one short sequence cannot hide in a long one's norm.
    for s in range(len(seq_lens)):
        rows = slice(int(qsl[s]), int(qsl[s + 1]))
        err = np.linalg.norm(got[rows] - ref[rows]) / np.linalg.norm(ref[rows])
        assert math.isfinite(err) and err <= tol, (
            f"{impl.name}: sequence {s} relative error {err:.3e} > {tol:.1e}")


# ---------------------------------------------------------------------------------------------
# golden vectors (kvzoo_spec/golden, SPEC.md section 9)


def _load(path: Path):
    z = np.load(path)
    return z, json.loads(str(z["meta"][()]))


def _as(bits: np.ndarray, dtype: str, device: str):
    return as_torch(np.ascontiguousarray(bits).view(numpy_dtype(dtype))).to(device)


def _static(meta, key):
    bits = meta.get(key)
    return None if bits is None else float(np.array(bits, np.uint32).view(np.float32))


def _decoded_matches(got, want_bits, what):
    g = host_float32(got)
    want = np.ascontiguousarray(want_bits).view(np.float32)
    nan = np.isnan(g) & np.isnan(want)
    assert_same_bytes(np.where(nan, 0, g).astype(np.float32), np.where(nan, 0, want).astype(np.float32), what)


def check_golden(impl, path: Path, reg: registry.Registry | None = None) -> None:
    """Write the golden inputs with impl, then decode with the same backend's dequantize."""
    z, meta = _load(path)
    mode_name = meta["mode"]
    head_size = z["x" if meta["kind"] == "rows" else "key"].shape[-1]
    _usable(impl, mode_name, Requirements(head_size, meta.get("dtype"), frozenset(
        ({"inline_layout"} if meta["kind"] == "inline" else set())
        | ({"trunc_rounding"} if meta.get("rounding") == "trunc" else set()))))
    mode = MODES[mode_name]
    device = device_for(impl)
    dequant = (reg or registry.default()).get("dequantize", impl.name)
    if meta["kind"] == "rows":
        x = z["x"]
        n, d = x.shape
        key = _as(x.reshape(n, 1, d), meta["dtype"], device)
        kc = torch.full((n, 1, 1, d), 0x5A, dtype=torch.uint8, device=device).view(getattr(torch, mode.code_dtype))
        vc = kc.clone()
        sc = torch.full((n, 1, 1), -3.0, device=device) if mode.per_token_head else None
        static = _static(meta, "static_scale_bits")
        api.reshape_and_cache(key, key.clone(), kc, vc, torch.arange(n, device=device), mode=mode_name,
                                k_scale_cache=sc, v_scale_cache=None if sc is None else sc.clone(),
                                k_scale=static, v_scale=static, rounding=meta["rounding"], impl=impl)
        assert_same_bytes(kc.reshape(n, d), z["codes"], f"{impl.name} codes")
        assert_same_bytes(vc.reshape(n, d), z["codes"], f"{impl.name} value codes")
        if mode.per_token_head:
            assert_same_bytes(sc.reshape(n), z["scales"].view(np.float32), f"{impl.name} scales")
        decoded = api.dequantize(kc, sc, mode=mode_name, scale=static, impl=dequant)
        _decoded_matches(decoded.reshape(n, d), z["decoded"], f"{impl.name} decoded")
    elif meta["kind"] == "cache":
        dtype = meta["dtype"]
        cache_dtype = mode.code_dtype or dtype
        kc = _as(z["key_cache_before"], cache_dtype, device)
        vc = _as(z["value_cache_before"], cache_dtype, device)
        ks = _as(z["k_scale_cache_before"], "float32", device) if mode.per_token_head else None
        vs = _as(z["v_scale_cache_before"], "float32", device) if mode.per_token_head else None
        k_static, v_static = _static(meta, "k_scale_bits"), _static(meta, "v_scale_bits")
        api.reshape_and_cache(
            _as(z["key"], dtype, device), _as(z["value"], dtype, device), kc, vc,
            torch.from_numpy(z["slot_mapping"]).to(device), mode=mode_name, k_scale_cache=ks, v_scale_cache=vs,
            k_scale=k_static, v_scale=v_static, rounding=meta["rounding"], impl=impl)
        for got, name in ((kc, "key_cache"), (vc, "value_cache"), (ks, "k_scale_cache"), (vs, "v_scale_cache")):
            if got is not None:
                want = z[name] if name.endswith("_cache") and "scale" not in name else z[name].view(np.float32)
                assert_same_bytes(got, want.view(numpy_dtype(cache_dtype)) if "scale" not in name else want,
                                  f"{impl.name} {name}")
        tables = torch.from_numpy(z["block_tables"]).to(device)
        lens = torch.from_numpy(z["seq_lens"]).to(device)
        for cache, sc, static, name in ((kc, ks, k_static, "key_gathered"), (vc, vs, v_static, "value_gathered")):
            got = api.dequantize(cache, sc, mode=mode_name, scale=static, block_tables=tables, seq_lens=lens,
                                   impl=dequant)
            _decoded_matches(got, z[name], f"{impl.name} {name}")
    else:  # inline page
        buf = torch.from_numpy(z["buf_before"].copy()).to(device)
        d = buf.shape[-1] - 4
        views = inline_views(buf, d, mode)
        x_dtype = meta["dtype"]
        api.reshape_and_cache(
            _as(z["key"], x_dtype, device), _as(z["value"], x_dtype, device), views.key_cache, views.value_cache,
            torch.from_numpy(z["slot_mapping"]).to(device), mode=mode_name,
            k_scale_cache=views.k_scale_cache, v_scale_cache=views.v_scale_cache, impl=impl)
        assert_same_bytes(buf, z["buf"], f"{impl.name} inline page")


@dataclass(frozen=True)
class Check:
    op: str
    impl: Any
    case_id: str
    run: Callable[[], None]

    @property
    def id(self) -> str:
        return f"{self.impl.name}-{self.case_id}"


def matrix(reg: registry.Registry | None = None, ops: tuple[str, ...] | None = None) -> list[Check]:
    """Every (implementation, case) pair: the whole conformance suite."""
    reg = reg or registry.default()
    groups = [
        ("reshape_and_cache", write_cases(), check_reshape_and_cache),
        ("dequantize", dequant_cases(), check_dequantize),
        ("paged_attention", attention_cases(), check_paged_attention),
    ]
    checks = []
    for op, cases, fn in groups:
        for impl in reg.implementations(op):
            for case in cases:
                checks.append(Check(op, impl, case.id,
                                    lambda fn=fn, impl=impl, case=case: _run_declared(impl, lambda: fn(impl, case))))
    for impl in reg.implementations("reshape_and_cache"):
        for path in GOLDEN_FILES:
            checks.append(Check("golden", impl, path.stem, lambda impl=impl, path=path: _run_declared(
                impl, lambda: check_golden(impl, path, reg))))
    if ops is not None:
        checks = [c for c in checks if c.op in ops]
    return checks


def runs_something(checks: list[Check]) -> tuple[bool, list[str]]:
    """Whether one implementation's checks of one operation include one it takes and passes;
    with the reasons it gave for the ones it declined. A backend that declines every case must
    fail the suite, not pass it with skips."""
    declined = []
    for check in checks:
        try:
            check.run()
            return True, declined
        except NotApplicable as why:
            declined.append(str(why))
    return False, declined
