"""Every implementation reproduces reference/golden/ byte for byte (see SPEC.md section 9)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import kvzoo
import reference
from kvzoo.arrays import as_torch, numpy_dtype
from kvzoo.layout import inline_views
from kvzoo.modes import MODES
from support import assert_same_bytes, device_for, host_float32

GOLDEN_DIR = Path(reference.__file__).parent / "golden"
GOLDEN_FILES = sorted(GOLDEN_DIR.glob("*.npz"))


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


def _usable(impl, mode):
    if impl.unavailable():
        pytest.skip("; ".join(impl.unavailable()))
    if mode not in impl.modes:
        pytest.skip(f"{impl.name} does not register {mode}")


def test_golden_files_exist():
    kinds = {p.name.split("-")[0] for p in GOLDEN_FILES}
    assert kinds == {"rows", "cache", "inline"}, kinds
    assert len(GOLDEN_FILES) >= 30


@pytest.mark.parametrize("path", GOLDEN_FILES, ids=lambda p: p.stem)
@pytest.mark.parametrize("impl", kvzoo.registry.implementations("reshape_and_cache"), ids=lambda i: i.name)
def test_golden_write_and_decode(impl, path):
    z, meta = _load(path)
    mode_name = meta["mode"]
    _usable(impl, mode_name)
    mode = MODES[mode_name]
    device = device_for(impl)
    dequant = kvzoo.registry.get("dequantize", impl.name)
    if meta["kind"] == "rows":
        x = z["x"]
        n, d = x.shape
        key = _as(x.reshape(n, 1, d), meta["dtype"], device)
        kc = torch.full((n, 1, 1, d), 0x5A, dtype=torch.uint8, device=device).view(getattr(torch, mode.code_dtype))
        vc = kc.clone()
        sc = torch.full((n, 1, 1), -3.0, device=device) if mode.per_token_head else None
        static = _static(meta, "static_scale_bits")
        kvzoo.reshape_and_cache(key, key.clone(), kc, vc, torch.arange(n, device=device), mode=mode_name,
                                k_scale_cache=sc, v_scale_cache=None if sc is None else sc.clone(),
                                k_scale=static, v_scale=static, rounding=meta["rounding"], impl=impl.name)
        assert_same_bytes(kc.reshape(n, d), z["codes"], f"{impl.name} codes")
        assert_same_bytes(vc.reshape(n, d), z["codes"], f"{impl.name} value codes")
        if mode.per_token_head:
            assert_same_bytes(sc.reshape(n), z["scales"].view(np.float32), f"{impl.name} scales")
        decoded = kvzoo.dequantize(kc, sc, mode=mode_name, scale=static, impl=dequant.name)
        _decoded_matches(decoded.reshape(n, d), z["decoded"], f"{impl.name} decoded")
    elif meta["kind"] == "cache":
        dtype = meta["dtype"]
        cache_dtype = mode.code_dtype or dtype
        kc = _as(z["key_cache_before"], cache_dtype, device)
        vc = _as(z["value_cache_before"], cache_dtype, device)
        ks = _as(z["k_scale_cache_before"], "float32", device) if mode.per_token_head else None
        vs = _as(z["v_scale_cache_before"], "float32", device) if mode.per_token_head else None
        k_static, v_static = _static(meta, "k_scale_bits"), _static(meta, "v_scale_bits")
        kvzoo.reshape_and_cache(
            _as(z["key"], dtype, device), _as(z["value"], dtype, device), kc, vc,
            torch.from_numpy(z["slot_mapping"]).to(device), mode=mode_name, k_scale_cache=ks, v_scale_cache=vs,
            k_scale=k_static, v_scale=v_static, rounding=meta["rounding"], impl=impl.name)
        for got, name in ((kc, "key_cache"), (vc, "value_cache"), (ks, "k_scale_cache"), (vs, "v_scale_cache")):
            if got is not None:
                want = z[name] if name.endswith("_cache") and "scale" not in name else z[name].view(np.float32)
                assert_same_bytes(got, want.view(numpy_dtype(cache_dtype)) if "scale" not in name else want,
                                  f"{impl.name} {name}")
        tables = torch.from_numpy(z["block_tables"]).to(device)
        lens = torch.from_numpy(z["seq_lens"]).to(device)
        for cache, sc, static, name in ((kc, ks, k_static, "key_gathered"), (vc, vs, v_static, "value_gathered")):
            got = kvzoo.dequantize(cache, sc, mode=mode_name, scale=static, block_tables=tables, seq_lens=lens,
                                   impl=dequant.name)
            _decoded_matches(got, z[name], f"{impl.name} {name}")
    else:  # inline page
        buf = torch.from_numpy(z["buf_before"].copy()).to(device)
        d = buf.shape[-1] - 4
        views = inline_views(buf, d, mode)
        x_dtype = meta["dtype"]
        kvzoo.reshape_and_cache(
            _as(z["key"], x_dtype, device), _as(z["value"], x_dtype, device), views.key_cache, views.value_cache,
            torch.from_numpy(z["slot_mapping"]).to(device), mode=mode_name,
            k_scale_cache=views.k_scale_cache, v_scale_cache=views.v_scale_cache, impl=impl.name)
        assert_same_bytes(buf, z["buf"], f"{impl.name} inline page")
