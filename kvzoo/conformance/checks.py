"""The conformance checks: one function per operation, run against the oracle.

Each check takes an implementation and a case, builds fresh random inputs, runs the public
API with impl=<name>, and raises AssertionError on any difference (codes and scales compared as
raw bytes; attention within the implementation's declared tolerance of a float64 reference on
the same quantized cache), or NotApplicable when the implementation cannot run the case here.
`matrix()` crosses every registered implementation with every case; tests/ and `kvzoo check`
both run it.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

import kvzoo_spec
from kvzoo_spec import oracle

from .. import api, registry, samples
from ..arrays import as_numpy, as_torch, numpy_dtype
from ..capabilities import Requirements
from ..inputs import assert_same_bytes, device_for, host_bytes, host_float32, rng_for
from ..layout import allocate_inline, inline_views
from ..modes import MODES
from .cases import AttentionCase, DequantCase, WriteCase, attention_cases, dequant_cases, write_cases

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
        raise AssertionError(f"{impl.name} declares it takes this case but refused it: {refusal}") from None


def _kind(case_kind: samples.Kind, device: str) -> samples.Kind:
    return case_kind if device == "cpu" else "torch"


# ---------------------------------------------------------------------------------------------
# reshape_and_cache


def check_reshape_and_cache(impl, case: WriteCase):
    _usable(impl, case.mode, case.requirements())
    mode = MODES[case.mode]
    device = device_for(impl)
    kind = _kind(case.kind, device)
    rng = rng_for("write", case.id)
    # One guard block after the cache: with validate=False, out-of-range (wild) slots must be
    # skipped like negative ones, and nothing may land in the memory that follows the cache.
    index_dtype = "int32" if case.num_tokens % 2 else "int64"
    w = samples.write_sample(
        rng,
        mode,
        kind=kind,
        device=device,
        guard_blocks=1,
        static_scale="wide",
        index_dtype=index_dtype,
        **case.sample_args(),
    )
    caches, key, value, static = w.caches, w.key, w.value, w.static_scale
    key_cache, value_cache, k_scale_cache, v_scale_cache = w.cache_arrays()
    key_before, value_before = host_bytes(key_cache).copy(), host_bytes(value_cache).copy()
    scales_before = [None if c is None else host_bytes(c).copy() for c in (k_scale_cache, v_scale_cache)]
    buffer_before = None if caches.buffer is None else host_bytes(caches.buffer)[..., 0].copy()
    api.reshape_and_cache(
        key,
        value,
        caches.key_cache,
        caches.value_cache,
        w.slot_mapping,
        **w.api_kwargs(),
        rounding=case.rounding,
        impl=impl,
        validate=not case.wild_slots,
    )
    w.assert_guard_unchanged(impl.name)

    if mode.code_dtype is None:
        # A plain copy: the expected bits are the input tensors' own (NaN payloads included).
        model = numpy_dtype(case.dtype)
        expect_key, expect_value = (
            np.ascontiguousarray(as_numpy(x.cpu() if isinstance(x, torch.Tensor) else x)) for x in (key, value)
        )
        expect_caches = [key_before.view(model)[..., 0], value_before.view(model)[..., 0]]
    else:
        # In the input dtype (exact): a rotated mode rounds its rotated rows to it.
        expect_key, expect_value = (x.astype(numpy_dtype(case.dtype)) for x in (w.key32, w.value32))
        expect_caches = [key_before[..., 0], value_before[..., 0]]
    scale_caches = [None if b is None else b.view(np.float32)[..., 0] for b in scales_before]
    expected = samples.oracle_write(
        mode,
        expect_key,
        expect_value,
        w.oracle_slots,
        num_blocks=w.num_blocks,
        block_size=w.block_size,
        rounding=case.rounding,
        k_scale=static,
        v_scale=static,
        key_cache=expect_caches[0],
        value_cache=expect_caches[1],
        k_scale_cache=scale_caches[0],
        v_scale_cache=scale_caches[1],
    )
    names = ("key_cache", "value_cache", "k_scale_cache", "v_scale_cache")
    actual = (caches.key_cache, caches.value_cache, caches.k_scale_cache, caches.v_scale_cache)
    for name, got, want in zip(names, actual, expected):
        if want is not None:
            assert_same_bytes(got, want, f"{impl.name} {name}")
    if case.layout == "inline":
        # The views cover every byte of the page buffer but an aligned row's padding, which
        # keeps its poison: nothing else may change.
        assert buffer_before is not None
        packed = oracle.pack_inline(expected[0], expected[1], expected[2], expected[3])
        want_buf = buffer_before
        want_buf[..., : packed.shape[-1]] = packed
        assert_same_bytes(caches.buffer, want_buf, f"{impl.name} inline buffer")


# ---------------------------------------------------------------------------------------------
# dequantize


def _random_codes_and_scales(mode, rng, shape, model_dtype="float32"):
    """A cache of random codes (NaN codes included) and positive scales spanning decades, for
    rows of shape [..., head_size] (codes at the mode's cache width). A format whose scale word
    also carries a zero point gets random low bits there, and some words of random bits
    (negative, NaN, Inf, subnormal: SPEC.md 3.5 decodes every word)."""
    if mode.code_dtype is None:
        return rng.standard_normal(shape).astype(np.float32).astype(numpy_dtype(model_dtype)), None
    codes = rng.integers(0, 256, (*shape[:3], mode.cache_width(shape[3])), dtype=np.uint8)
    if not mode.per_token_head:
        return codes, None
    scales = (np.abs(rng.standard_normal(shape[:3])) * 10.0 ** rng.uniform(-6, 2, shape[:3])).astype(np.float32)
    if mode.format.row_zero_point:
        wild = rng.random(shape[:3]) < 0.125
        scales[wild] = rng.integers(0, 2**32, int(wild.sum()), dtype=np.uint64).astype(np.uint32).view(np.float32)
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
    static = samples.wide_static_scale(rng) if mode.per_tensor else None
    page, page_before = None, None
    if case.layout == "inline":
        views = allocate_inline(num_blocks, BS, H, D, mode, device=device, row_align=case.row_align)
        if views.k_scale_cache is None or views.buffer is None:
            raise ValueError(f"allocate_inline gave no scale cache or page for mode {mode.name!r}")
        page = views.buffer
        if case.row_align is not None:
            # Padding of random bytes: a read that strayed into it would decode them.
            padding = page[..., D + 4 :]
            padding.copy_(torch.from_numpy(rng.integers(0, 256, tuple(padding.shape), dtype=np.uint8)))
        views.key_cache.view(torch.uint8).copy_(torch.from_numpy(codes))
        views.k_scale_cache.copy_(torch.from_numpy(scales))
        cache, scale_cache = views.key_cache, views.k_scale_cache
        page_before = host_bytes(page)[..., 0].copy()
    else:
        cache = (
            torch.from_numpy(codes).view(getattr(torch, mode.code_dtype))
            if mode.code_dtype
            else torch.from_numpy(codes.astype(np.float32))
        )
        cache = cache.to(device)
        scale_cache = None if scales is None else torch.from_numpy(scales).to(device)
    kw = dict(mode=case.mode, scale=None if static is None else float(static), impl=impl)
    raw = codes if mode.code_dtype else codes.astype(np.float32)
    if case.whole_cache:
        got = api.dequantize(cache, scale_cache, **kw)
        want = samples.oracle_decoded_cache(mode, raw, scales, static)
    else:
        seq_lens = np.array([5, 0, BS * 3 + 1, 1], np.int32)
        tables = np.stack([rng.permutation(num_blocks)[:5] for _ in seq_lens]).astype(np.int32)
        got = api.dequantize(
            cache,
            scale_cache,
            block_tables=torch.from_numpy(tables).to(device),
            seq_lens=torch.from_numpy(seq_lens).to(device),
            **kw,
        )
        want = samples.oracle_gathered(mode, raw, scales, tables, seq_lens, static)
    _assert_same_floats(got, want, f"{impl.name} dequantize")
    if page_before is not None:
        assert_same_bytes(page, page_before, f"{impl.name} dequantize wrote to the inline page")


# ---------------------------------------------------------------------------------------------
# paged attention


def check_paged_attention(impl, case: AttentionCase):
    _usable(impl, case.mode, case.requirements())
    device = device_for(impl)
    rng = rng_for("attention", case.id)
    s = samples.paged_sample(rng, case.mode, device=device, static_scales="wide", **case.sample_args())
    out = s.new_out()
    page_before = None if s.caches.buffer is None else host_bytes(s.caches.buffer)[..., 0].copy()
    api.paged_attention(
        s.query,
        s.caches.key_cache,
        s.caches.value_cache,
        **s.api_kwargs(),
        sliding_window=case.sliding_window,
        softcap=case.softcap,
        out=out,
        quantize_query=case.quantize_query,
        fp8_dots=case.fp8_dots,
        impl=impl,
    )
    ref = s.reference(
        quantize_query=case.quantize_query,
        fp8_dots=case.fp8_dots,
        sliding_window=case.sliding_window,
        softcap=case.softcap,
    )
    # Without return_slack the reference is one array (samples.py's overloads will say so).
    assert isinstance(ref, np.ndarray)
    got = host_float32(out)
    samples.assert_attention_close(impl, got, ref, s.qsl, case.query_dtype, fp8_dots=case.fp8_dots)
    if page_before is not None:
        assert_same_bytes(s.caches.buffer, page_before, f"{impl.name} attention wrote to the inline page")
    if case.fp8_dots and impl.probability_tile is not None:
        # The probabilities' rounding at the implementation's own tile: attention_rtol again,
        # plus one code step wherever float32 weights may round the other way (the oracle's slack).
        ref, slack = s.reference(
            fp8_dots=True,
            probability_tile=impl.probability_tile,
            sliding_window=case.sliding_window,
            softcap=case.softcap,
            return_slack=True,
        )
        samples.assert_attention_close(impl, got, ref, s.qsl, case.query_dtype, " (its probability tile)", slack=slack)


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
    _usable(
        impl,
        mode_name,
        Requirements(
            head_size,
            meta.get("dtype"),
            frozenset(
                ({"inline_layout"} if meta["kind"] == "inline" else set())
                | ({"trunc_rounding"} if meta.get("rounding") == "trunc" else set())
            ),
        ),
    )
    mode = MODES[mode_name]
    device = device_for(impl)
    dequant = (reg or registry.default()).get("dequantize", impl.name)
    if meta["kind"] == "rows":
        x = z["x"]
        n, d = x.shape
        key = _as(x.reshape(n, 1, d), meta["dtype"], device)
        width = mode.cache_width(d)
        kc = torch.full((n, 1, 1, width), 0x5A, dtype=torch.uint8, device=device).view(
            getattr(torch, mode.code_format.storage_dtype)
        )
        vc = kc.clone()
        sc = torch.full((n, 1, 1), -3.0, device=device) if mode.per_token_head else None
        static = _static(meta, "static_scale_bits")
        api.reshape_and_cache(
            key,
            key.clone(),
            kc,
            vc,
            torch.arange(n, device=device),
            mode=mode_name,
            k_scale_cache=sc,
            v_scale_cache=None if sc is None else sc.clone(),
            k_scale=static,
            v_scale=static,
            rounding=meta["rounding"],
            impl=impl,
        )
        assert_same_bytes(kc.reshape(n, width), z["codes"], f"{impl.name} codes")
        assert_same_bytes(vc.reshape(n, width), z["codes"], f"{impl.name} value codes")
        if sc is not None:
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
            _as(z["key"], dtype, device),
            _as(z["value"], dtype, device),
            kc,
            vc,
            torch.from_numpy(z["slot_mapping"]).to(device),
            mode=mode_name,
            k_scale_cache=ks,
            v_scale_cache=vs,
            k_scale=k_static,
            v_scale=v_static,
            rounding=meta["rounding"],
            impl=impl,
        )
        for got, name in ((kc, "key_cache"), (vc, "value_cache"), (ks, "k_scale_cache"), (vs, "v_scale_cache")):
            if got is not None:
                want = z[name] if name.endswith("_cache") and "scale" not in name else z[name].view(np.float32)
                assert_same_bytes(
                    got, want.view(numpy_dtype(cache_dtype)) if "scale" not in name else want, f"{impl.name} {name}"
                )
        tables = torch.from_numpy(z["block_tables"]).to(device)
        lens = torch.from_numpy(z["seq_lens"]).to(device)
        for cache, sc, static, name in ((kc, ks, k_static, "key_gathered"), (vc, vs, v_static, "value_gathered")):
            got = api.dequantize(
                cache, sc, mode=mode_name, scale=static, block_tables=tables, seq_lens=lens, impl=dequant
            )
            _decoded_matches(got, z[name], f"{impl.name} {name}")
    else:  # inline page
        buf = torch.from_numpy(z["buf_before"].copy()).to(device)
        d = buf.shape[-1] - 4
        views = inline_views(buf, d, mode)
        x_dtype = meta["dtype"]
        api.reshape_and_cache(
            _as(z["key"], x_dtype, device),
            _as(z["value"], x_dtype, device),
            views.key_cache,
            views.value_cache,
            torch.from_numpy(z["slot_mapping"]).to(device),
            mode=mode_name,
            k_scale_cache=views.k_scale_cache,
            v_scale_cache=views.v_scale_cache,
            impl=impl,
        )
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
    groups: list[tuple[str, Sequence[Any], Callable[[Any, Any], Any]]] = [
        ("reshape_and_cache", write_cases(), check_reshape_and_cache),
        ("dequantize", dequant_cases(), check_dequantize),
        ("paged_attention", attention_cases(), check_paged_attention),
    ]
    checks = []
    for op, cases, fn in groups:
        for impl in reg.implementations(op):
            for case in cases:
                checks.append(
                    Check(
                        op,
                        impl,
                        case.id,
                        functools.partial(_run_declared, impl, functools.partial(fn, impl, case)),
                    )
                )
    for impl in reg.implementations("reshape_and_cache"):
        for path in GOLDEN_FILES:
            checks.append(
                Check(
                    "golden",
                    impl,
                    path.stem,
                    functools.partial(_run_declared, impl, functools.partial(check_golden, impl, path, reg)),
                )
            )
    if ops is not None:
        checks = [c for c in checks if c.op in ops]
    return checks


def runs_something(checks: list[Check]) -> tuple[bool, list[str]]:
    """Whether one implementation's checks of one operation include one it takes and passes;
    with the reasons it gave for the ones it declined. A backend that declines every case must
    fail the suite, not pass it with skips."""
    declined: list[str] = []
    for check in checks:
        try:
            check.run()
            return True, declined
        except NotApplicable as why:
            declined.append(str(why))
    return False, declined
