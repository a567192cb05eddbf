"""Tests specific to the Triton write/dequantize kernels and their exact encode helpers.

The conformance suite already holds "triton-cuda"/"triton-rocm" against the reference for
every mode and layout; these tests cover what it cannot see from outside: the encode helpers
over whole value ranges (ties, subnormals, saturation), that no multiply-add was contracted,
and the 64-bit offsets of caches over 4 GiB (GPU only). On a machine without a GPU they run
under TRITON_INTERPRET=1 at small sizes. Random draws come from the session seed
(kvzoo.inputs.rng_for); paged write problems from kvzoo.samples.
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    # Must be set before the kernels are decorated (first import of the kernel modules).
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

import kvzoo  # noqa: E402
from kvzoo import samples  # noqa: E402
from kvzoo.backends.triton import encode  # noqa: E402
from kvzoo.inputs import rng_for  # noqa: E402
from kvzoo.modes import MODES, SCALE_FLOOR  # noqa: E402

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
DEVICE = "cuda" if ON_GPU else "cpu"
IMPL = "triton-rocm" if ON_GPU and torch.version.hip else "triton-cuda"
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (not the interpreter)")

_FP8 = {
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8_e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
    "float8_e5m2": ml_dtypes.float8_e5m2,
}
_CODE = {
    "int8": encode.CODE_INT8,
    "float8_e4m3fn": encode.CODE_E4M3FN,
    "float8_e4m3fnuz": encode.CODE_E4M3FNUZ,
    "float8_e5m2": encode.CODE_E5M2,
}
_BLOCK = 1024


@triton.jit
def _encode_kernel(
    y_ptr,
    out_ptr,
    n,
    CODE: tl.constexpr,
    QMIN: tl.constexpr,
    QMAX: tl.constexpr,
    NAN_CODE: tl.constexpr,
    INF_POS: tl.constexpr,
    INF_NEG: tl.constexpr,
    TRUNC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    y = tl.load(y_ptr + offs, mask=mask, other=0.0)
    code = encode.encode_codes(y, CODE, QMIN, QMAX, NAN_CODE, INF_POS, INF_NEG, TRUNC)
    tl.store(out_ptr + offs, code.to(tl.uint8), mask=mask)


@triton.jit
def _row_encode_kernel(
    y_ptr, out_ptr, n, CODE: tl.constexpr, NAN_CODE: tl.constexpr, TRUNC: tl.constexpr, BLOCK: tl.constexpr
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    y = tl.load(y_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, encode.encode_row_codes(y, CODE, NAN_CODE, TRUNC).to(tl.uint8), mask=mask)


@triton.jit
def _decode_kernel(code_ptr, out_ptr, CODE: tl.constexpr):
    offs = tl.arange(0, 256)
    tl.store(out_ptr + offs, encode.decode_codes(tl.load(code_ptr + offs), CODE))


def _run_encode(y: np.ndarray, mode_name: str, trunc: bool = False) -> np.ndarray:
    mode = MODES[mode_name]
    y_t = torch.from_numpy(np.ascontiguousarray(y, np.float32)).to(DEVICE)
    out = torch.full(y_t.shape, 0x55, dtype=torch.uint8, device=DEVICE)
    _encode_kernel[(triton.cdiv(y.size, _BLOCK),)](
        y_t,
        out,
        y.size,
        CODE=_CODE[mode.code_dtype],
        QMIN=mode.qmin,
        QMAX=mode.qmax,
        NAN_CODE=mode.nan_code,
        INF_POS=mode.inf_codes[0],
        INF_NEG=mode.inf_codes[1],
        TRUNC=trunc,
        BLOCK=_BLOCK,
        enable_fp_fusion=False,
    )
    return out.cpu().numpy()


def _expected_codes(y: np.ndarray, mode_name: str, trunc: bool = False) -> np.ndarray:
    """The spec's encode, written with NumPy / ml_dtypes (RNE casts): NaN and +-Inf to the
    format's bytes, the rest clamped and rounded."""
    mode = MODES[mode_name]
    finite = np.isfinite(y)
    yc = np.clip(np.where(finite, y, 0), np.float32(mode.qmin), np.float32(mode.qmax)).astype(np.float32)
    if mode.code_dtype == "int8":
        codes = (np.trunc(yc) if trunc else np.rint(yc)).astype(np.int8).view(np.uint8)
    else:
        codes = yc.astype(_FP8[mode.code_dtype]).view(np.uint8)
    inf_pos, inf_neg = (np.uint8(c) for c in mode.inf_codes)
    special = np.where(np.isnan(y), np.uint8(mode.nan_code), np.where(y > 0, inf_pos, inf_neg))
    return np.where(finite, codes, special)


def _fp8_probe_values(dtype) -> np.ndarray:
    """Every finite code's value, the midpoints between neighbours (ties) and one fp32 ulp on
    either side of each, both signs, plus values far below the smallest subnormal."""
    vals = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32)
    vals = np.unique(vals[np.isfinite(vals)])
    mids = ((vals[:-1].astype(np.float64) + vals[1:]) / 2).astype(np.float32)
    probes = np.concatenate(
        [
            vals,
            mids,
            np.nextafter(mids, np.float32(np.inf)),
            np.nextafter(mids, np.float32(-np.inf)),
            np.float32([1e-30, 1e-40, 2.0**-12, 1e30]),
        ]
    )
    return np.concatenate([probes, -probes]).astype(np.float32)


def _random_bit_patterns(n: int, seed: int) -> np.ndarray:
    """fp32 values from uniformly random bit patterns (every exponent, NaN/Inf included),
    plus a uniform sample in the format's interesting range."""
    rng = rng_for("triton write", "bit patterns", seed)
    bits = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    near = rng.uniform(-600, 600, size=n).astype(np.float32)
    wide = rng.uniform(-7e4, 7e4, size=n).astype(np.float32)  # e5m2's range and past it
    return np.concatenate([bits, near, wide, np.float32([np.inf, -np.inf, np.nan, 0.0, -0.0])])


@triton.jit
def _both_e4m3_encoders_kernel(base, out_ptr, n, BLOCK: tl.constexpr):
    # Every fp32 bit pattern base + i: 1 where the hardware convert and the integer rounding
    # give different bytes, through both the clamping and the per-row encoders.
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    y = (base + i.to(tl.int64)).to(tl.uint32).to(tl.float32, bitcast=True)
    clamped_hw = encode.encode_codes(y, encode.CODE_E4M3FN_CVT, -448.0, 448.0, 0x7F, 0x7F, 0x7F, False) & 0xFF
    clamped_int = encode.encode_codes(y, encode.CODE_E4M3FN, -448.0, 448.0, 0x7F, 0x7F, 0x7F, False) & 0xFF
    # The per-row encoder only ever sees |y| <= 448 (plus an ulp) or NaN.
    r = tl.where(tl.abs(y) <= 448.0, y, float("nan"))
    row_hw = encode.encode_row_codes(r, encode.CODE_E4M3FN_CVT, 0x7F, False) & 0xFF
    row_int = encode.encode_row_codes(r, encode.CODE_E4M3FN, 0x7F, False) & 0xFF
    differ = (clamped_hw != clamped_int) | (row_hw != row_int)
    tl.store(out_ptr + i, differ.to(tl.uint8), mask=i < n)


@needs_gpu
def test_hardware_e4m3_convert_matches_integer_rounding_on_every_float32():
    if torch.version.hip or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the hardware e4m3 convert is used on sm_90+ only")
    chunk = 1 << 28
    flags = torch.empty(chunk, dtype=torch.uint8, device=DEVICE)
    for base in range(0, 1 << 32, chunk):
        flags.fill_(0x55)
        _both_e4m3_encoders_kernel[(chunk // _BLOCK,)](base, flags, chunk, BLOCK=_BLOCK, enable_fp_fusion=False)
        bad = torch.nonzero(flags != 0)
        assert bad.numel() == 0, [hex(base + int(i)) for i in bad[:10, 0]]


@needs_gpu
def test_fp8_write_uses_the_hardware_convert_on_hopper():
    t = torch.empty(1, device=DEVICE)
    want = (
        encode.CODE_E4M3FN_CVT
        if torch.cuda.get_device_capability()[0] >= 9 and not torch.version.hip
        else encode.CODE_E4M3FN
    )
    assert encode.encoder_code(encode.CODE_E4M3FN, t) == want
    assert encode.encoder_code(encode.CODE_E4M3FN, t.cpu()) == encode.CODE_E4M3FN


@pytest.mark.parametrize("mode_name", ["fp8_per_token_head", "fp8_e4m3fnuz_per_token_head", "fp8_e5m2_per_tensor"])
def test_fp8_encode_matches_single_rne(mode_name):
    dtype = _FP8[MODES[mode_name].code_dtype]
    y = np.concatenate([_fp8_probe_values(dtype), _random_bit_patterns(20000, 1)])
    got, want = _run_encode(y, mode_name), _expected_codes(y, mode_name)
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, [(float(y[i]), hex(got[i]), hex(want[i])) for i in bad[:10]]


@pytest.mark.parametrize("trunc", [False, True], ids=["nearest", "trunc"])
def test_int8_encode_ties_and_range(trunc):
    halves = np.arange(-130, 130, 0.5, dtype=np.float32)
    y = np.concatenate(
        [
            halves,
            np.nextafter(halves, np.float32(np.inf)),
            np.nextafter(halves, np.float32(-np.inf)),
            _random_bit_patterns(20000, 2),
        ]
    )
    got = _run_encode(y, "int8_per_token_head", trunc)
    want = _expected_codes(y, "int8_per_token_head", trunc)
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, [(float(y[i]), int(got[i]), int(want[i])) for i in bad[:10]]


def _row_values(mode_name: str, seed: int) -> np.ndarray:
    """What y = x * (1 / scale) can be in a per-token-head row: |y| up to QMAX * (1 + 3 * 2**-24)
    (the bound of two correct roundings), +-0 and NaN; never Inf or anything beyond."""
    mode = MODES[mode_name]
    qmax = np.float32(mode.qmax)
    top = np.float32(qmax * (1 + 3 * 2.0**-24))
    rng = rng_for("triton write", "row values", mode_name, seed)
    if mode.code_dtype == "int8":
        halves = np.arange(-127, 127.5, 0.5, dtype=np.float32)
        probes = np.concatenate(
            [halves, np.nextafter(halves, np.float32(np.inf)), np.nextafter(halves, -np.float32(np.inf))]
        )
    else:
        probes = _fp8_probe_values(_FP8[mode.code_dtype])
    # Random magnitudes over every exponent up to QMAX (subnormals included), both signs.
    bits = rng.integers(0, np.float32(qmax).view(np.uint32) + 1, size=200000, dtype=np.uint64).astype(np.uint32)
    rand = bits.view(np.float32) * rng.choice(np.float32([-1, 1]), size=bits.size)
    edge = np.float32([qmax, top, -qmax, -top, np.nextafter(qmax, top), 0.0, -0.0, np.nan, -np.nan])
    y = np.concatenate([probes, rand, rng.uniform(-top, top, 20000).astype(np.float32), edge])
    return y[~(np.abs(y) > top)].astype(np.float32)


@pytest.mark.parametrize(
    "mode_name,trunc",
    [
        ("int8_per_token_head", False),
        ("int8_per_token_head", True),
        ("fp8_per_token_head", False),
        ("fp8_e4m3fnuz_per_token_head", False),
    ],
)
def test_row_encode_matches_clamped_encode(mode_name, trunc):
    """encode_row_codes (no clamp, NaN the only non-finite) gives the spec's codes on every
    value a per-token-head row can produce."""
    mode = MODES[mode_name]
    y = _row_values(mode_name, 4)
    y_t = torch.from_numpy(y).to(DEVICE)
    out = torch.full(y_t.shape, 0x55, dtype=torch.uint8, device=DEVICE)
    _row_encode_kernel[(triton.cdiv(y.size, _BLOCK),)](
        y_t,
        out,
        y.size,
        CODE=_CODE[mode.code_dtype],
        NAN_CODE=mode.nan_code,
        TRUNC=trunc,
        BLOCK=_BLOCK,
        enable_fp_fusion=False,
    )
    got, want = out.cpu().numpy(), _expected_codes(y, mode_name, trunc)
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, [(float(y[i]), hex(got[i]), hex(want[i])) for i in bad[:10]]


@pytest.mark.parametrize(
    "mode_name", ["int8_per_token_head", "fp8_per_token_head", "fp8_e4m3fnuz_per_token_head", "fp8_e5m2_per_tensor"]
)
def test_decode_every_code(mode_name):
    mode = MODES[mode_name]
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    if mode.code_dtype == "int8":
        codes = codes.view(torch.int8)
        want = np.arange(256, dtype=np.uint8).view(np.int8).astype(np.float32)
    else:
        want = np.arange(256, dtype=np.uint8).view(_FP8[mode.code_dtype]).astype(np.float32)
    out = torch.full((256,), float("nan"), device=DEVICE)
    _decode_kernel[(1,)](codes.to(DEVICE), out, CODE=_CODE[mode.code_dtype])
    got = out.cpu().numpy()
    assert np.array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    # Compared as bits so -0.0 (e4m3fn and e5m2 0x80) must come back as -0.0, and e5m2's Inf as Inf.
    assert np.array_equal(got[ok].view(np.uint32), want[ok].view(np.uint32))


def _contraction_rows(num_rows: int, head_size: int, seed: int) -> np.ndarray:
    """int8 rows in which at least one element rounds differently when x * inv is fused into
    the round-half-even addition: fl(x * inv) sits exactly on a half while the exact product
    does not (fp32 x fp32 products are exact in float64)."""
    rng = rng_for("triton write", "contraction rows", seed)
    found = []
    while len(found) < num_rows:
        x = rng.standard_normal((4096, head_size)).astype(np.float32)
        # Values on a 1/2 grid of the scale make half-way products common.
        x = (np.round(x * 64) / 64).astype(np.float32)
        absmax = np.abs(x).max(axis=1)
        scale = np.maximum(absmax / np.float32(127), SCALE_FLOOR).astype(np.float32)
        inv = (np.float32(1) / scale).astype(np.float32)
        y32 = x * inv[:, None]
        exact = x.astype(np.float64) * inv[:, None].astype(np.float64)
        differs = (np.rint(np.clip(y32, -128, 127)) != np.rint(np.clip(exact, -128, 127))).any(axis=1)
        found.extend(x[differs])
    return np.stack(found[:num_rows])


def _write_both(key, value, mode, rounding="nearest", layout="separate"):
    """Write the same rows with the Triton impl (on DEVICE) and the NumPy reference (CPU);
    returns the cache bytes of each. The caches hold random bytes beforehand (kvzoo.samples),
    so unwritten bytes show."""
    num_tokens, heads, head_size = key.shape
    results = []
    for impl, device in ((IMPL, DEVICE), ("numpy", "cpu")):
        # One seed for both: the same slots into the same poisoned bytes.
        w = samples.write_sample(
            rng_for("triton write", "both", mode, rounding, layout),
            mode,
            num_tokens=num_tokens,
            num_kv_heads=heads,
            head_size=head_size,
            block_size=4,
            num_blocks=4,
            dtype="float32",
            layout=layout,
            device=device,
            key32=key.float().numpy(),
            value32=value.float().numpy(),
        )
        c = w.caches
        tensors = [c.buffer] if layout == "inline" else [t for t in w.cache_arrays() if t is not None]
        # The caller's own tensors (views of a fused QKV buffer, say), not the sample's copies.
        kvzoo.reshape_and_cache(
            key.to(device),
            value.to(device),
            c.key_cache,
            c.value_cache,
            w.slot_mapping,
            mode=mode,
            k_scale_cache=c.k_scale_cache,
            v_scale_cache=c.v_scale_cache,
            rounding=rounding,
            impl=impl,
        )
        results.append([t.cpu().contiguous().view(torch.uint8).numpy().copy() for t in tensors])
    return results


@pytest.mark.parametrize("rounding", ["nearest", "trunc"])
def test_no_fma_contraction(rounding):
    rows = _contraction_rows(8, 32, seed=3)
    key = torch.from_numpy(rows.reshape(4, 2, 32))
    value = torch.from_numpy(rows[::-1].copy().reshape(4, 2, 32))
    got, want = _write_both(key, value, "int8_per_token_head", rounding)
    for g, w in zip(got, want):
        assert np.array_equal(g, w)


def test_fused_qkv_views_into_inline_pages():
    """K and V as strided views of one QKV projection, written into the inline layout."""
    tokens, q_heads, kv_heads, head_size = 5, 4, 2, 24
    qkv = torch.from_numpy(
        rng_for("triton write", "qkv")
        .standard_normal((tokens, (q_heads + 2 * kv_heads) * head_size))
        .astype(np.float32)
        * 4
    )
    split = qkv.view(tokens, q_heads + 2 * kv_heads, head_size)
    key, value = split[:, q_heads : q_heads + kv_heads], split[:, q_heads + kv_heads :]
    for mode in ("int8_per_token_head", "fp8_per_token_head"):
        got, want = _write_both(key, value, mode, layout="inline")
        assert np.array_equal(got[0], want[0]), mode


def test_only_16_byte_rows_drop_to_one_warp():
    # One warp pays where each thread stores 16 bytes at a time; the inline page's rows, stored
    # 4 bytes at a time, were faster on two (bench/archive/RESULTS-history.md).
    from kvzoo.backends.triton import write_kernels as wk

    many, few = wk.FP8_ONE_WARP_TOKENS, wk.FP8_ONE_WARP_TOKENS - 1
    fp8, int8 = wk.code_of(MODES["fp8_per_token_head"]), wk.code_of(MODES["int8_per_token_head"])
    assert [wk._write_warps(1024, fp8, many, align) for align in (16, 8, 4)] == [1, 2, 2]
    assert wk._write_warps(1024, fp8, few) == wk._write_warps(1024, int8, many) == 2


@needs_gpu
@pytest.mark.parametrize("mode", ["fp8_per_token_head", "int8_per_token_head"])
def test_large_writes_take_the_many_token_config_and_match_the_reference(mode):
    """Past FP8_ONE_WARP_TOKENS fp8 writes launch on one warp (write_kernels._write_warps): a
    batch that large, bf16 rows into random slots of a paged cache, gives the NumPy
    reference's bytes in every block, the unwritten ones left as poisoned."""
    from kvzoo.backends.triton import write_kernels

    tokens, heads, head_size, block_size = write_kernels.FP8_ONE_WARP_TOKENS + 3, 8, 128, 16
    code = write_kernels.code_of(MODES[mode])
    assert write_kernels._write_warps(heads * head_size, code, tokens) == (1 if mode.startswith("fp8") else 2)
    num_blocks = 2 * -(-tokens // block_size)
    caches = []
    for impl, device in ((IMPL, DEVICE), ("numpy", "cpu")):
        # One seed for both: the same bf16 rows into the same random slots of the same poisoned bytes.
        w = samples.write_sample(
            rng_for("triton write", "large", mode),
            mode,
            num_tokens=tokens,
            num_kv_heads=heads,
            head_size=head_size,
            block_size=block_size,
            num_blocks=num_blocks,
            device=device,
        )
        c = w.caches
        kvzoo.reshape_and_cache(w.key, w.value, c.key_cache, c.value_cache, w.slot_mapping, **w.api_kwargs(), impl=impl)
        caches.append([t.cpu().view(torch.uint8) for t in w.cache_arrays()])
    for got, want in zip(*caches):
        assert torch.equal(got, want)


@needs_gpu
@pytest.mark.parametrize("mode", ["none", "int8_per_token_head"])
def test_cache_over_4gib(mode):
    """A slot whose byte offset is past 2**32 (element offset past 2**31 for bf16) is written
    where it belongs and reads back the same as a small cache holding the same token."""
    heads, head_size, block_size = 8, 128, 16
    per_block = block_size * heads * head_size * (2 if mode == "none" else 1)
    num_blocks = (2**32 + per_block - 1) // per_block + 2
    m = kvzoo.get_kv_quant_mode(mode)
    dtype = torch.bfloat16 if mode == "none" else torch.int8
    rng = rng_for("triton write", "over 4 GiB", mode)
    key, value = (
        torch.from_numpy(rng.standard_normal((1, heads, head_size)).astype(np.float32) * 3).to(torch.bfloat16).cuda()
        for _ in range(2)
    )
    outs = []
    for nb in (num_blocks, 1):
        kc = torch.empty(nb, block_size, heads, head_size, dtype=dtype, device="cuda")
        vc = torch.empty_like(kc)
        sc = [torch.empty(nb, block_size, heads, device="cuda") for _ in range(2)] if m.per_token_head else [None, None]
        slot = torch.tensor([nb * block_size - 1], device="cuda")
        kvzoo.reshape_and_cache(
            key, value, kc, vc, slot, mode=mode, k_scale_cache=sc[0], v_scale_cache=sc[1], impl=IMPL
        )
        table = torch.tensor([[nb - 1]], dtype=torch.int32, device="cuda")
        lens = torch.tensor([block_size], dtype=torch.int32, device="cuda")
        rows = [
            kvzoo.dequantize(c, s, mode=mode, block_tables=table, seq_lens=lens, impl=IMPL)[-1]
            for c, s in ((kc, sc[0]), (vc, sc[1]))
        ]
        outs.append((kc[-1, -1].cpu(), vc[-1, -1].cpu(), *[r.cpu() for r in rows]))
        del kc, vc, sc
        torch.cuda.empty_cache()
    for big, small in zip(*outs):
        assert torch.equal(big.view(torch.uint8), small.view(torch.uint8))
    if mode == "none":
        assert torch.equal(outs[0][0], key[0].cpu())


_PTX_PROBE = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvzoo.backends.triton import write_kernels as wk

k = wk._reshape_and_cache_kernel
out = {}
# (CODE, PER_TENSOR, QMAX, QMIN, NaN code, Inf codes, cache type): each format's row encoder, and
# the static-scale encoder of every format a per-tensor mode uses.
# The e4m3 row encoder twice: wide_rows' layout on (the inline page on CUDA) and off (ROCm).
for code, per_tensor, qmax, qmin, nan, infs, cache, wide in (
        (1, False, 127.0, -128.0, 0, (0x7F, 0x80), "*i8", True), (2, False, 448.0, -448.0, 0x7F, (0x7F, 0x7F), "*u8", True),
        (2, False, 448.0, -448.0, 0x7F, (0x7F, 0x7F), "*u8", False),
        (3, False, 224.0, -224.0, 0x80, (0x80, 0x80), "*u8", True), (1, True, 127.0, -128.0, 0, (0x7F, 0x80), "*i8", True),
        (2, True, 448.0, -448.0, 0x7F, (0x7F, 0x7F), "*u8", True), (5, True, 57344.0, -57344.0, 0x7F, (0x7C, 0xFC), "*u8", True)):
    types = dict(key_ptr="*i16", value_ptr="*i16", key_cache_ptr=cache, value_cache_ptr=cache,
                 k_scale_cache_ptr="*i32", v_scale_cache_ptr="*i32", k_scale_ptr="*fp32",
                 v_scale_ptr="*fp32", slot_ptr="*i64")
    consts = dict(CODE=code, PER_TENSOR=per_tensor, IN_KIND=2, QMAX=qmax, QMIN=qmin, NAN_CODE=nan,
                  INF_POS=infs[0], INF_NEG=infs[1], SCALE_FLOOR=1e-6, TRUNC=False, BLOCK_H=8, BLOCK_D=128,
                  ROW_ALIGN=4, WIDE_TILE_LAYOUT=wide)  # the inline page's rows: the hints compile too
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in k.arg_names}
    src = ASTSource(fn=k, signature=sig,
                    constexprs={(k.arg_names.index(n),): v for n, v in consts.items()})
    # Fusion on: the helpers must be contraction-proof without the launch flag.
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options=dict(enable_fp_fusion=True)).asm["ptx"]
    out[f"{code}-{'tensor' if per_tensor else 'row'}{'' if wide else '-narrow'}"] = {name: len(re.findall(pat, ptx)) for name, pat in (
        ("fma_f32", r"\bfma\.[a-z.]*f32"), ("div_rn", r"\bdiv\.rn\.f32"),
        ("div_inexact", r"\bdiv\.(full|approx)"), ("ftz", r"\.ftz\b"))}
# The inline page's rows (4-byte aligned, which no stride argument shows): with the alignment
# asserted the int8 codes go out 4 bytes at a time, without it one byte at a time. With
# wide_rows' layout the bf16 input loads (and the encoding on them) take 16 elements a thread,
# without it 8; the stores keep their 4 bytes either way. Integers divisible by 16 are marked so,
# as a launch on the inline page (8 heads of 128) specialises them; its head strides (132
# bytes, 33 scale words) are not.
launch_multiples_of_16 = ("num_slots", "head_size", "block_size", "s_kt", "s_kh", "s_vt", "s_vh",
                          "s_kcb", "s_kcs", "s_vcb", "s_vcs")
stores = {}
for row_align, wide in ((4, True), (4, False), (1, False)):
    consts = dict(CODE=1, PER_TENSOR=False, IN_KIND=2, QMAX=127.0, QMIN=-128.0, NAN_CODE=0, INF_POS=0x7F,
                  INF_NEG=0x80, SCALE_FLOOR=1e-6, TRUNC=False, BLOCK_H=8, BLOCK_D=128, EVEN_D=True,
                  ROW_ALIGN=row_align, WIDE_TILE_LAYOUT=wide,
                  s_kd=1, s_vd=1, s_kcd=1, s_vcd=1)  # unit strides: as Triton specialises
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in k.arg_names}
    sig.update(key_cache_ptr="*i8", value_cache_ptr="*i8")
    marked = [n for n in sig if sig[n].startswith("*") or n in launch_multiples_of_16]
    attrs = {(k.arg_names.index(n),): [["tt.divisibility", 16]] for n in marked}
    src = ASTSource(fn=k, signature=sig, constexprs={(k.arg_names.index(n),): v for n, v in consts.items()},
                    attrs=attrs)
    asm = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=2)).asm
    counts = {w: len(re.findall(rf"st\.global\.{w}\b", asm["ptx"])) for w in ("b8", "b32")}
    layouts = dict(re.findall(r"^(#blocked\d*) = #ttg\.blocked<\{sizePerThread = \[1, (\d+)\]", asm["ttgir"], re.M))
    input_loads = re.findall(r"tt\.load .*tensor<8x128x!tt\.ptr<i16>, (#blocked\d*)>", asm["ttgir"])
    counts["input_per_thread"] = sorted({int(layouts[name]) for name in input_loads})
    stores[f"{row_align}{' wide' if wide else ''}"] = counts
out["inline-row stores"] = stores
print(json.dumps(out))
"""


def test_wide_tile_layout_is_taken_by_one_byte_codes_in_rows_4_to_15_bytes_aligned():
    # wide_rows.py was timed on the inline page's int8 and fp8 writes (whole power-of-two rows)
    # on CUDA; everything else keeps the layout it had.
    from kvzoo.backends.triton import wide_rows
    from kvzoo.backends.triton import write_kernels as wk
    from kvzoo.problem import CacheWrite

    def wanted(row_align, element_size=1, platform="cuda"):
        return wide_rows.wanted(
            quantized=True, whole_rows=True, element_size=element_size, row_align=row_align, platform=platform
        )

    assert all(wanted(a) for a in (4, 8, 12))
    assert not any(wanted(a) for a in (1, 2, 16))
    assert not wanted(4, 2) and not wanted(4, 1, "rocm")

    def takes_it(mode, layout, head_size):
        alloc = kvzoo.allocate_inline if layout == "inline" else kvzoo.allocate_separate
        extra = {} if layout == "inline" else {"model_dtype": "bfloat16"}
        c = alloc(2, 16, 8, head_size, mode, device="cpu", **extra)
        rows = torch.zeros(3, 8, head_size, dtype=torch.bfloat16)
        p = CacheWrite(
            mode=kvzoo.get_kv_quant_mode(mode),
            key=rows,
            value=rows,
            key_cache=c.key_cache,
            value_cache=c.value_cache,
            slot_mapping=torch.arange(3),
            k_scale_cache=c.k_scale_cache,
            v_scale_cache=c.v_scale_cache,
        )
        return wk._write_call(p, float(SCALE_FLOOR))[2]["WIDE_TILE_LAYOUT"]

    assert takes_it("int8_per_token_head", "inline", 128) and takes_it("fp8_per_token_head", "inline", 128)
    assert not takes_it("int8_per_token_head", "inline", 68)  # rows masked to 68 of 128 columns
    assert not takes_it("int8_per_token_head", "separate", 128)  # 16-byte rows
    assert not takes_it("none", "separate", 68)  # bf16 copies, 8-byte rows


def test_ptx_exact_arithmetic():
    """Compiles the write kernel for sm_90 (no GPU needed) and reads its PTX: correctly rounded
    divisions, no fp32 fused multiply-add even with fp fusion enabled, no flush-to-zero. Also
    catches kernels that run under the interpreter but fail Triton's compiler."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton.backends.nvidia")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(root)}
    proc = subprocess.run(
        [sys.executable, "-c", _PTX_PROBE], env=env, cwd=root, capture_output=True, text=True, timeout=600
    )
    if proc.returncode != 0 and "ptxas" in proc.stderr.lower() and "not found" in proc.stderr.lower():
        pytest.skip("no ptxas to compile with")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    stores = result.pop("inline-row stores")
    assert stores["4"]["b8"] == 0 and stores["4"]["b32"] > 0, stores
    assert stores["1"]["b8"] > 0, stores  # without the hint: the one-byte stores the hint removes
    assert stores["4 wide"]["b8"] == 0 and stores["4 wide"]["b32"] == stores["4"]["b32"], stores
    assert stores["4 wide"]["input_per_thread"] == [16] and stores["4"]["input_per_thread"] == [8], stores
    for code, counts in result.items():
        assert counts["fma_f32"] == 0 and counts["div_inexact"] == 0 and counts["ftz"] == 0, (code, counts)
        assert counts["div_rn"] > 0, (code, counts)
