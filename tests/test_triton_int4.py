"""The Triton int4 kernels (kvzoo/backends/triton/int4_*.py) against the oracle, beyond what the
conformance suite enumerates.

The butterfly and the sign flip bit for bit against oracle.int4_fwht at every head size; the
write kernel's bytes on every distribution, dtype and head size the mode takes, through the
memory paths the host picks (bf16 pairs, strided rows, several tokens a program), poisoned
caches left alone outside the written rows; dequantize on every word (NaN, Inf, subnormal and
negative scales); attention against oracle.int4_attention_f64 for decode, split decode, direct
and staged prefill and the options; prepared launches. On a machine without a GPU the kernels
run under TRITON_INTERPRET=1 at small sizes; the paths only a GPU compiles (the nibble and bf16
conversions in inline PTX) are compiled for sm_90a here and assembled by ptxas.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import types
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    # Must be set before the kernels are decorated (first import of the kernel modules).
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from kvzoo import samples  # noqa: E402
from kvzoo.backends.triton import attention_kernels, attention_ops, int4_attention, int4_rotation, int4_write  # noqa: E402
from kvzoo.backends.triton import platform as triton_platform  # noqa: E402
from kvzoo.inputs import make_rows, random_bytes, rng_for  # noqa: E402
from kvzoo.modes import MODES, SCALE_FLOOR, rht_signs  # noqa: E402
from kvzoo.problem import Attention, CacheWrite, Dequantize  # noqa: E402
from kvzoo_spec import oracle  # noqa: E402

ON_GPU = torch.cuda.is_available() and not triton_platform.interpreted()
DEVICE = "cuda" if ON_GPU else "cpu"
INT4 = list(oracle.INT4_MODES)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
NUMPY_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}
HEAD_SIZES = [2, 4, 8, 16, 32, 64, 128, 256, 512]
# Head sizes that are no power of two, which the rotated mode takes (SPEC.md 3.4's blocks):
# two blocks, the requested ones, and every block from 256 down to 2.
BLOCK_HEAD_SIZES = [6, 80, 96, 192, 510]
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (not the interpreter)")


def _bits(x) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x, np.float32)).view(np.uint32)


def _host(t: torch.Tensor) -> np.ndarray:
    """A tensor's values on the host in its own dtype (bf16 as ml_dtypes' bfloat16)."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


# ----------------------------------------------------------------------------------------
# The rotation's pieces


@triton.jit
def _fwht_kernel(x_ptr, y_ptr, ROWS: tl.constexpr, W: tl.constexpr, N: tl.constexpr, FLIP: tl.constexpr):
    r = tl.arange(0, ROWS)[:, None] * W + tl.arange(0, W)[None, :]
    x = tl.load(x_ptr + r)
    if FLIP:
        x = int4_rotation.flip_signs(x, W)
    tl.store(y_ptr + r, int4_rotation.fwht(x, ROWS, W, N))


@pytest.mark.parametrize("D", HEAD_SIZES)
def test_butterfly_is_the_oracles_bit_for_bit(D):
    rng = rng_for("int4 fwht", D)
    rows = 8
    # Magnitudes spread over the exponent range, so that the rounding of each add shows.
    x = (rng.standard_normal((rows, D)) * 10.0 ** rng.uniform(-30, 30, (rows, 1))).astype(np.float32)
    x[0, : D // 2] = np.float32(2.0**-149) * rng.integers(1, 9, D // 2)  # subnormal sums
    x[1] = np.float32(3e38) * rng.choice([-1, 1], D)  # overflow to +-Inf, and Inf - Inf
    y = torch.full((rows, D), float("nan"), device=DEVICE)
    _fwht_kernel[(1,)](torch.from_numpy(x).to(DEVICE), y, rows, D, D, False)
    with np.errstate(all="ignore"):
        want = oracle.int4_fwht(x)
    same = (_bits(y.cpu().numpy()) == _bits(want)) | (np.isnan(y.cpu().numpy()) & np.isnan(want))
    assert same.all(), f"{int((~same).sum())} elements differ from oracle.int4_fwht"


@triton.jit
def _unrotate_kernel(x_ptr, y_ptr, ROWS: tl.constexpr, W: tl.constexpr, N: tl.constexpr):
    r = tl.arange(0, ROWS)[:, None] * W + tl.arange(0, W)[None, :]
    x = tl.load(x_ptr + r)
    y = int4_rotation.over_blocks(int4_rotation.flip_signs(int4_rotation.fwht(x, ROWS, W, N), W), W, N)
    tl.store(y_ptr + r, y)


@pytest.mark.parametrize("D", BLOCK_HEAD_SIZES)
def test_block_butterflies_of_any_head_size_are_the_oracles_bit_for_bit(D):
    # A head that is no power of two: the masked butterfly in the tile padded to a power of
    # two must give each block's transform (oracle.int4_fwht) and leave the padding zero; the
    # inverse divides each element by its own block's size.
    rng = rng_for("int4 fwht blocks", D)
    W, rows = triton.next_power_of_2(D), 8
    x = np.zeros((rows, W), np.float32)
    x[:, :D] = (rng.standard_normal((rows, D)) * 10.0 ** rng.uniform(-30, 30, (rows, 1))).astype(np.float32)
    x[0, : D // 2] = np.float32(2.0**-149) * rng.integers(1, 9, D // 2)
    y = torch.full((rows, W), float("nan"), device=DEVICE)
    _fwht_kernel[(1,)](torch.from_numpy(x).to(DEVICE), y, rows, W, D, False)
    with np.errstate(all="ignore"):
        want = oracle.int4_fwht(x[:, :D])
    assert np.array_equal(_bits(y.cpu().numpy()[:, :D]), _bits(want))
    assert np.array_equal(y.cpu().numpy()[:, D:], np.zeros((rows, W - D), np.float32))
    _unrotate_kernel[(1,)](torch.from_numpy(x).to(DEVICE), y, rows, W, D)
    with np.errstate(all="ignore"):
        want = oracle.int4_unrotate(x[:, :D])
    assert np.array_equal(_bits(y.cpu().numpy()[:, :D]), _bits(want))


@pytest.mark.parametrize("D", [2, 8, 16])
def test_butterfly_in_a_padded_tile_keeps_each_row_and_its_zeros(D):
    # The attention tiles pad small heads to 32 columns: the transform of size D must act on
    # the first D and leave the zero padding zero.
    rng = rng_for("int4 fwht padded", D)
    W, rows = 32, 4
    x = np.zeros((rows, W), np.float32)
    x[:, :D] = rng.standard_normal((rows, D)).astype(np.float32)
    y = torch.full((rows, W), float("nan"), device=DEVICE)
    _fwht_kernel[(1,)](torch.from_numpy(x).to(DEVICE), y, rows, W, D, False)
    assert np.array_equal(_bits(y.cpu().numpy()[:, :D]), _bits(oracle.int4_fwht(x[:, :D])))
    assert np.array_equal(y.cpu().numpy()[:, D:], np.zeros((rows, W - D), np.float32))


def test_sign_flip_is_the_table_exactly():
    D = 512
    rng = rng_for("int4 signs")
    x = rng.standard_normal((4, D)).astype(np.float32)
    x[1] = np.float32(0.0)
    x[2] = np.float32(-0.0)
    x[3, ::3] = np.nan
    x[3, 1::3] = np.inf
    # A transform of size 1 is the identity: the kernel only flips.
    y = torch.full((4, D), float("nan"), device=DEVICE)
    _fwht_kernel[(1,)](torch.from_numpy(x).to(DEVICE), y, 4, D, 1, True)
    signs = rht_signs(D)
    assert np.array_equal(signs, oracle.int4_rht_signs(D))
    # Each element's sign bit flipped where its sign is -1, and nothing else: NaN, Inf and 0 too.
    assert np.array_equal(_bits(y.cpu().numpy()), _bits(x) ^ (_bits(signs) & 0x80000000))


@triton.jit
def _narrow_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, int4_write.narrow_bf16(tl.load(x_ptr + offs, mask=mask)), mask=mask)


def test_bf16_narrowing_on_the_bits_is_round_to_nearest_even():
    rng = rng_for("int4 narrow")
    # Finite values only: a NaN's bits are left to the row's poisoning (quantize_rows).
    ties = (rng.integers(0, 0x7F80, 4096).astype(np.uint32) << 16) | 0x8000  # exact halfway
    near = ties[:2048] + rng.choice([-1, 1], 2048).astype(np.uint32)
    subnormal = rng.integers(0, 1 << 23, 2048).astype(np.uint32)
    top = np.array([0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x7F800000, 0x00000000, 0x00008000, 0x00018000], np.uint32)
    finite = rng.integers(0, 0x7F800000, 8192).astype(np.uint32)
    bits = np.concatenate([ties, near, subnormal, top, finite])
    bits = np.concatenate([bits, bits | 0x80000000])
    x = bits.view(np.float32)
    y = torch.empty(len(x), device=DEVICE)
    _narrow_kernel[(triton.cdiv(len(x), 1024),)](torch.from_numpy(x.copy()).to(DEVICE), y, len(x), 1024)
    with np.errstate(over="ignore"):
        want = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    assert np.array_equal(_bits(y.cpu().numpy()), _bits(want))


# ----------------------------------------------------------------------------------------
# reshape_and_cache


def _write_problem(mode, key, value, slots, caches):
    kc, vc, ks, vs = caches
    return CacheWrite(
        mode=MODES[mode],
        key=key,
        value=value,
        key_cache=kc,
        value_cache=vc,
        slot_mapping=slots,
        k_scale_cache=ks,
        v_scale_cache=vs,
    )


def _poisoned_caches(rng, num_blocks, block_size, heads, head_size):
    """Caches of random bytes (never zeros): (key codes, value codes, K words, V words)."""
    shape = (num_blocks, block_size, heads)
    codes = [random_bytes(rng, (*shape, head_size // 2), "uint8", DEVICE, "torch") for _ in range(2)]
    words = [random_bytes(rng, shape, "float32", DEVICE, "torch") for _ in range(2)]
    return (*codes, *words)


def _check_written(mode, key, value, slots, caches, before, num_blocks, block_size):
    """The caches hold the oracle's bytes at the written slots and their old bytes elsewhere."""
    kc, vc, ks, vs = (c.cpu() for c in caches)
    slots = slots.cpu().numpy()
    slots = np.where(slots < num_blocks * block_size, slots, -1)  # past the end: skipped
    want = oracle.int4_reshape_and_cache(
        _host(key), _host(value), slots, num_blocks=num_blocks, block_size=block_size, mode_name=mode
    )
    written = np.zeros(num_blocks * block_size, bool)
    written[slots[slots >= 0]] = True
    for got, old, ref in zip((kc, vc, ks, vs), before, (want[0], want[1], want[2], want[3])):
        g = got.contiguous().view(torch.uint8).numpy().reshape(num_blocks * block_size, -1)
        o = old.cpu().contiguous().view(torch.uint8).numpy().reshape(num_blocks * block_size, -1)
        r = np.ascontiguousarray(ref).view(np.uint8).reshape(num_blocks * block_size, -1)
        assert np.array_equal(g[written], r[written]), "written rows differ from the oracle"
        assert np.array_equal(g[~written], o[~written]), "bytes outside the written rows changed"


@pytest.mark.parametrize("mode", INT4)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("dist", ["normal", "outliers", "tiny", "midpoints", "specials"])
def test_write_matches_the_oracle(mode, dtype, dist):
    rng = rng_for("int4 write", mode, dtype, dist)
    head_size = int(rng.choice([16, 64, 128]))
    T, H, NB, BS = 37, 3, 12, 4
    m = MODES[mode]
    key = torch.from_numpy(make_rows(m, dist, dtype, (T, H, head_size), rng)).to(DTYPES[dtype]).to(DEVICE)
    value = torch.from_numpy(make_rows(m, dist, dtype, (T, H, head_size), rng)).to(DTYPES[dtype]).to(DEVICE)
    slots = torch.from_numpy(rng.permutation(NB * BS)[:T]).to(DEVICE)
    slots[::5] = -1  # skipped tokens
    caches = _poisoned_caches(rng, NB, BS, H, head_size)
    before = tuple(c.clone() for c in caches)
    int4_write.reshape_and_cache(_write_problem(mode, key, value, slots, caches), float(SCALE_FLOOR))
    _check_written(mode, key, value, slots, caches, before, NB, BS)


@pytest.mark.skipif(ON_GPU, reason="the interpreter's row range against the compiled one, run interpreted")
@pytest.mark.parametrize("mode", INT4)
def test_interpreted_row_range_gives_the_compiled_ones_bytes(mode, monkeypatch):
    """Under the interpreter the write folds each row's halves for its max and min; compiled, it
    runs tl.reduce (int4_write.range_with_zero). Both run here, interpreted, on rows of NaN,
    +-Inf, +-0 and subnormals beside ordinary ones, and give the oracle's bytes."""
    rng = rng_for("int4 row range branches", mode)
    T, H, NB, BS, D = 6, 2, 4, 4, 16
    m = MODES[mode]
    key = make_rows(m, "specials", "float32", (T, H, D), rng)
    key[0, 0] = np.where(rng.random(D) < 0.5, -0.0, 0.0)  # a row of zeros of both signs
    key[0, 1, : D // 2] = -0.0
    key[1, 0, 3], key[1, 1, 5], key[2, 0, 0] = np.nan, np.inf, -np.inf
    key = torch.from_numpy(key).to(DEVICE)
    value = torch.from_numpy(make_rows(m, "normal", "float32", (T, H, D), rng)).to(DEVICE)
    slots = torch.from_numpy(rng.permutation(NB * BS)[:T]).to(DEVICE)
    first = _poisoned_caches(rng, NB, BS, H, D)
    before = tuple(c.clone() for c in first)
    got = {}
    for branch in (True, False):
        caches = tuple(c.clone() for c in first)
        monkeypatch.setattr(int4_write, "interpreted", lambda branch=branch: branch)
        assert int4_write._write_call(_write_problem(mode, key, value, slots, caches), 0.0)[2]["INTERPRETED"] is branch
        int4_write.reshape_and_cache(_write_problem(mode, key, value, slots, caches), float(SCALE_FLOOR))
        _check_written(mode, key, value, slots, caches, before, NB, BS)
        got[branch] = caches
    for a, b in zip(got[True], got[False]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("mode", INT4)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("tokens,heads", [(1, 1), (1, 2), (2, 1), (3, 1), (1, 4)])
def test_write_of_a_few_rows_matches_the_oracle(mode, dtype, tokens, heads):
    # A decode step writes a row per KV head: tiles of one to four rows. On the H200 a
    # two-row tile of 16-bit rows at head size 64 gave wrong scales (int4_write.MIN_TILE_ROWS).
    rng = rng_for("int4 few rows", mode, dtype, tokens, heads)
    NB, BS, D = 4, 8, 64
    m = MODES[mode]
    key = torch.from_numpy(make_rows(m, "normal", dtype, (tokens, heads, D), rng)).to(DTYPES[dtype]).to(DEVICE)
    value = torch.from_numpy(make_rows(m, "normal", dtype, (tokens, heads, D), rng)).to(DTYPES[dtype]).to(DEVICE)
    slots = torch.from_numpy(rng.permutation(NB * BS)[:tokens]).to(DEVICE)
    caches = _poisoned_caches(rng, NB, BS, heads, D)
    before = tuple(c.clone() for c in caches)
    int4_write.reshape_and_cache(_write_problem(mode, key, value, slots, caches), float(SCALE_FLOOR))
    _check_written(mode, key, value, slots, caches, before, NB, BS)


@pytest.mark.parametrize(
    "mode, head_size",
    [(m, d) for m in INT4 for d in HEAD_SIZES] + [("int4_per_token_head", d) for d in BLOCK_HEAD_SIZES],
)
def test_write_every_head_size(mode, head_size):
    # Every head size the mode takes: the row tile's 16-byte chunks, the packed store's and the
    # lanes a long row is shared by all change with it.
    rng = rng_for("int4 write D", mode, head_size)
    T, H, NB, BS = 9, 2, 4, 4
    dtype = str(rng.choice(list(DTYPES)))
    m = MODES[mode]
    key = torch.from_numpy(make_rows(m, "specials", dtype, (T, H, head_size), rng)).to(DTYPES[dtype]).to(DEVICE)
    value = torch.from_numpy(make_rows(m, "normal", dtype, (T, H, head_size), rng)).to(DTYPES[dtype]).to(DEVICE)
    slots = torch.from_numpy(rng.permutation(NB * BS)[:T]).to(DEVICE)
    caches = _poisoned_caches(rng, NB, BS, H, head_size)
    before = tuple(c.clone() for c in caches)
    int4_write.reshape_and_cache(_write_problem(mode, key, value, slots, caches), float(SCALE_FLOOR))
    _check_written(mode, key, value, slots, caches, before, NB, BS)


@pytest.mark.parametrize("layout", ["fused_qkv", "odd_offset", "strided_d", "many_heads"])
def test_write_through_every_input_path(layout):
    # bf16 rows are read as int32 pairs where their strides allow, else one element at a time;
    # a token's heads beyond a warp's rows take several warps.
    mode = "int4_per_token_head"
    rng = rng_for("int4 write layout", layout)
    T, H, D, NB, BS = 21, 2, 64, 8, 4
    if layout == "many_heads":
        H = 64
    qkv = torch.from_numpy(make_rows(MODES[mode], "normal", "bfloat16", (T + 1, 3 * H, D + 2), rng)).to(torch.bfloat16)
    qkv = qkv.to(DEVICE)
    if layout == "fused_qkv":
        fused = qkv.reshape(-1)[: (T + 1) * 3 * H * D].view(T + 1, 3 * H, D)  # rows 16-byte aligned
        key, value = fused[:T, H : 2 * H], fused[:T, 2 * H :]
    elif layout == "odd_offset":
        key, value = qkv[:T, H : 2 * H, 1 : D + 1], qkv[:T, 2 * H :, 1 : D + 1]
    elif layout == "strided_d":
        flat = qkv.reshape(-1)[: T * H * D * 2].view(T, H, D, 2)
        key, value = flat[..., 0], flat[..., 1]
    else:
        key, value = qkv[:T, :H, :D].contiguous(), qkv[:T, H : 2 * H, :D].contiguous()
    expect_pairs = layout in ("fused_qkv", "many_heads")
    assert (int4_write._as_pairs(key) is not None) == expect_pairs
    slots = torch.from_numpy(rng.permutation(NB * BS)[:T]).to(DEVICE)
    caches = _poisoned_caches(rng, NB, BS, H, D)
    before = tuple(c.clone() for c in caches)
    int4_write.reshape_and_cache(_write_problem(mode, key, value, slots, caches), float(SCALE_FLOOR))
    _check_written(mode, key, value, slots, caches, before, NB, BS)


@pytest.mark.parametrize("mode", INT4)
@pytest.mark.parametrize("stores", ["words", "bytes"])
@pytest.mark.parametrize("tile", [None, (8, 4, 1), (4, 4, 2)])
def test_write_through_each_store_and_tile(mode, stores, tile):
    # The int32 word stores (where the cache's rows allow them) and the byte stores beside
    # them, at the table's tile and at the others bench/probes/int4_write_probe.py times; a strided
    # cache view has no word path and must fall back to bytes.
    rng = rng_for("int4 stores", mode, stores, tile)
    T, H, D, NB, BS = 13, 4, 32, 6, 4
    dtype = str(rng.choice(list(DTYPES)))
    m = MODES[mode]
    key = torch.from_numpy(make_rows(m, "specials", dtype, (T, H, D), rng)).to(DTYPES[dtype]).to(DEVICE)
    value = torch.from_numpy(make_rows(m, "midpoints", dtype, (T, H, D), rng)).to(DTYPES[dtype]).to(DEVICE)
    slots = torch.from_numpy(rng.permutation(NB * BS)[:T]).to(DEVICE)
    slots[::4] = -1
    caches = _poisoned_caches(rng, NB, BS, H, D)
    p = _write_problem(mode, key, value, slots, caches)
    assert (int4_write._as_words(p.key_cache) is not None) and int4_write._as_words(p.key_cache[..., 1:5]) is None
    before = tuple(c.clone() for c in caches)
    grid, args, kwargs, _ = int4_write._write_call(p, float(SCALE_FLOOR), tile=tile, pack_words=stores == "words")
    assert kwargs["PACK_WORDS"] == (stores == "words")
    if tile is not None:
        assert (kwargs["BLOCK_T"], kwargs["BLOCK_H"], kwargs["num_warps"]) == tile
    int4_write._int4_write_kernel[grid](*args, **kwargs)
    _check_written(mode, key, value, slots, caches, before, NB, BS)


def test_write_caps_a_code_that_rounds_to_16():
    # A row of range [-0.5, 14.5] has scale 1 and zp R(0.5) = 1, so its largest element gives
    # y = 15.5 and fl(y + 0.5) = 16: the cap at 15 (SPEC.md 3.5's R) is all that keeps it out
    # of the next nibble of the packed word.
    mode = "int4_per_token_head_norot"
    rng = rng_for("int4 cap")
    T, H, D, NB, BS = 5, 2, 16, 4, 4
    rows = rng.uniform(-0.5, 14.5, (T, H, D)).astype(np.float32)
    rows[..., 0], rows[..., 7] = -0.5, 14.5
    key = torch.from_numpy(rows).to(DEVICE)
    value = torch.from_numpy(rows[:, ::-1].copy()).to(DEVICE)
    want = oracle.int4_reshape_and_cache(rows, rows, np.arange(T), num_blocks=NB, block_size=BS, mode_name=mode)
    codes = np.concatenate([want[0].reshape(-1, D // 2) & 0xF, want[0].reshape(-1, D // 2) >> 4], 1)
    assert (codes[: T * H] == 15).any()
    slots = torch.from_numpy(rng.permutation(NB * BS)[:T]).to(DEVICE)
    caches = _poisoned_caches(rng, NB, BS, H, D)
    before = tuple(c.clone() for c in caches)
    int4_write.reshape_and_cache(_write_problem(mode, key, value, slots, caches), float(SCALE_FLOOR))
    _check_written(mode, key, value, slots, caches, before, NB, BS)


def test_write_skips_slots_past_the_cache():
    # With validation off a slot past the end reaches the kernel: skipped like a negative one.
    mode = "int4_per_token_head"
    rng = rng_for("int4 write past the end")
    T, H, D, NB, BS = 6, 2, 32, 2, 4
    key = torch.from_numpy(make_rows(MODES[mode], "normal", "float32", (T, H, D), rng)).to(DEVICE)
    value = torch.from_numpy(make_rows(MODES[mode], "normal", "float32", (T, H, D), rng)).to(DEVICE)
    slots = torch.tensor([0, NB * BS, 5, NB * BS + 7, -3, 7], device=DEVICE)
    caches = _poisoned_caches(rng, NB, BS, H, D)
    before = tuple(c.clone() for c in caches)
    int4_write.reshape_and_cache(_write_problem(mode, key, value, slots, caches), float(SCALE_FLOOR))
    _check_written(mode, key, value, slots, caches, before, NB, BS)


def test_prepared_write_relaunches_with_other_tensors():
    mode = "int4_per_token_head"
    rng = rng_for("int4 prepared write")
    T, H, D, NB, BS = 11, 2, 64, 6, 4

    def draw():
        key = torch.from_numpy(make_rows(MODES[mode], "normal", "bfloat16", (T, H, D), rng)).to(torch.bfloat16)
        value = torch.from_numpy(make_rows(MODES[mode], "outliers", "bfloat16", (T, H, D), rng)).to(torch.bfloat16)
        slots = torch.from_numpy(rng.permutation(NB * BS)[:T])
        return key.to(DEVICE), value.to(DEVICE), slots.to(DEVICE), _poisoned_caches(rng, NB, BS, H, D)

    first = draw()
    first_before = tuple(c.clone() for c in first[3])
    launch = int4_write.prepare_write(_write_problem(mode, *first[:3], first[3]), float(SCALE_FLOOR))
    key, value, slots, caches = draw()
    before = tuple(c.clone() for c in caches)
    launch(_write_problem(mode, key, value, slots, caches).operands())
    _check_written(mode, key, value, slots, caches, before, NB, BS)
    # Binding launched nothing: the bound problem's caches are as they were.
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(first[3], first_before))


# ----------------------------------------------------------------------------------------
# dequantize


@pytest.mark.parametrize(
    "mode, head_size",
    [(m, d) for m in INT4 for d in (2, 16, 128, 512)] + [("int4_per_token_head", d) for d in (6, 80, 192)],
)
def test_dequantize_every_byte_and_word(mode, head_size):
    rng = rng_for("int4 dequantize", mode, head_size)
    NB, BS, H = 5, 4, 2
    codes = rng.integers(0, 256, (NB, BS, H, head_size // 2), dtype=np.uint8)
    words = rng.integers(0, 1 << 32, (NB, BS, H), dtype=np.uint64).astype(np.uint32)
    specials = np.array([0x7FC00000, 0x7F800000, 0xFF800003, 0x00000012, 0x80000075, 0x358637B5, 0xC1200009], np.uint32)
    words.reshape(-1)[: len(specials)] = specials
    scales = words.view(np.float32)
    seq_lens = np.array([7, 0, 13], np.int32)
    tables = np.stack([rng.permutation(NB)[:4] for _ in seq_lens]).astype(np.int32)
    tables[1] = -1  # an empty sequence's row is never read
    total = int(seq_lens.sum())
    out = torch.full((total, H, head_size), float("nan"), device=DEVICE)
    p = Dequantize(
        mode=MODES[mode],
        cache=torch.from_numpy(codes).to(DEVICE),
        block_tables=torch.from_numpy(tables).to(DEVICE),
        seq_lens=torch.from_numpy(seq_lens).to(DEVICE),
        cu_seq_lens=torch.from_numpy(np.concatenate([[0], np.cumsum(seq_lens)]).astype(np.int32)).to(DEVICE),
        out=out,
        scale_cache=torch.from_numpy(scales.copy()).to(DEVICE),
    )
    int4_write.dequantize(p)
    with np.errstate(all="ignore"):
        decoded = oracle.int4_decode_rows(codes, scales)
        if mode == "int4_per_token_head":
            decoded = oracle.int4_unrotate(decoded)
    want = np.concatenate(
        [decoded[tables[s, i // BS], i % BS] for s, n in enumerate(seq_lens) for i in range(n)]
    ).reshape(total, H, head_size)
    got = out.cpu().numpy()
    same = (_bits(got) == _bits(want)) | (np.isnan(got) & np.isnan(want))
    assert same.all(), f"{int((~same).sum())} values differ from the oracle's decode"


# ----------------------------------------------------------------------------------------
# paged attention


def _attention_problem(
    mode, q_lens, seq_lens, *, head_size, num_q_heads=4, num_kv_heads=2, dtype="bfloat16", seed=0, **opts
):
    s = samples.paged_sample(
        rng_for("int4 attention", mode, seed),
        mode,
        q_lens=q_lens,
        seq_lens=seq_lens,
        block_size=opts.pop("block_size", 4),
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        query_dtype=dtype,
        sinks=opts.pop("sinks", False),
        spare_blocks=2,
        spare_columns=1,
        device=DEVICE,
    )
    lse = torch.full((sum(q_lens), num_q_heads), float("nan"), device=DEVICE) if opts.pop("lse", False) else None
    return s.attention_record(sinks=s.sinks, lse=lse, num_prefills=s.batch.num_prefills, **opts)


def _reference(p: Attention) -> np.ndarray:
    return oracle.int4_attention_f64(
        _host(p.query),
        p.key_cache.cpu().numpy(),
        p.value_cache.cpu().numpy(),
        p.k_scale_cache.cpu().numpy(),
        p.v_scale_cache.cpu().numpy(),
        p.block_tables.cpu().numpy(),
        p.seq_lens.cpu().numpy(),
        p.query_start_loc.cpu().numpy(),
        mode_name=p.mode.name,
        softmax_scale=p.softmax_scale,
        sliding_window=p.sliding_window,
        softcap=p.softcap,
        sinks=None if p.sinks is None else p.sinks.cpu().numpy(),
    )


def _reference_lse(p: Attention) -> np.ndarray:
    """The rows' log-sum-exp (SPEC.md 8.2) on the model-basis decoded caches: the rotation does
    not change a logit, so attention_f64 on int4_dequantize_rows_f64's rows has int4's lse."""
    kc, vc = p.key_cache.cpu().numpy(), p.value_cache.cpu().numpy()
    ks, vs = p.k_scale_cache.cpu().numpy(), p.v_scale_cache.cpu().numpy()
    keys = oracle.int4_dequantize_rows_f64(kc, ks, p.mode.name)
    values = oracle.int4_dequantize_rows_f64(vc, vs, p.mode.name)
    _, lse = oracle.attention_f64(
        _host(p.query),
        keys,
        values,
        p.block_tables.cpu().numpy(),
        p.seq_lens.cpu().numpy(),
        p.query_start_loc.cpu().numpy(),
        softmax_scale=p.softmax_scale,
        sliding_window=p.sliding_window,
        softcap=p.softcap,
        sinks=None if p.sinks is None else p.sinks.cpu().numpy(),
        return_lse=True,
    )
    return lse


def _check_attention(p: Attention, what: str = "") -> None:
    impl = types.SimpleNamespace(name="triton int4", attention_rtol=int4_attention.ATTENTION_RTOL)
    dtype = str(p.query.dtype).removeprefix("torch.")
    samples.assert_attention_close(
        impl, p.out.cpu().float().numpy(), _reference(p), p.query_start_loc.cpu(), dtype, what
    )
    if p.lse is not None:
        ref = _reference_lse(p)
        got = p.lse.cpu().numpy()
        assert np.all(np.abs(got - ref) <= 3e-3 * np.maximum(1.0, np.abs(ref))), f"lse{what}"


def test_declared_tolerance_covers_the_int4_kernels():
    assert int4_attention.ATTENTION_RTOL <= attention_ops.ATTENTION_RTOL


def test_every_int4_head_size_class_has_tile_rows():
    # The int4 modes take their tiles from int4_attention.TILES, not attention_tables' (whose
    # kinds of codes they are not): every class the attention takes has a row, and every row
    # says what chose it.
    from kvzoo.backends.triton import formats

    for name in INT4:
        assert formats.family_of(MODES[name]) == formats.INT4
    for size in (64, 128, 256):
        tiles = int4_attention.TILES[size]
        for row in (tiles.decode, tiles.prefill, int4_attention.SPLIT):
            assert row.chosen_by and all(run.command and run.settled for run in row.chosen_by)
    assert max(int4_attention.TILES) == attention_ops.MAX_HEAD_SIZE


@pytest.mark.parametrize(
    "mode, head_size",
    [(m, d) for m in INT4 for d in (2, 16, 64, 128, 256)] + [("int4_per_token_head", d) for d in (6, 80, 96, 192)],
)
def test_decode_matches_the_oracle(mode, head_size):
    p = _attention_problem(mode, [1, 1, 1], [37, 1, 9], head_size=head_size, seed=head_size)
    int4_attention.run(p, "cuda")
    _check_attention(p)


@pytest.mark.parametrize("mode", INT4)
@pytest.mark.parametrize("group", [1, 2, 8])
def test_every_query_dtype_and_group(mode, group):
    for dtype in DTYPES:
        p = _attention_problem(
            mode, [3, 1], [11, 20], head_size=32, num_q_heads=2 * group, num_kv_heads=2, dtype=dtype, seed=group
        )
        int4_attention.run(p, "cuda")
        _check_attention(p, f" ({dtype}, group {group})")


@pytest.mark.parametrize("mode", INT4)
@pytest.mark.parametrize("order", ["rising", "falling", "random"])
def test_decode_over_value_scales_far_apart(mode, order):
    # The V scales of one context span 2^-60..2^60 (exact: the words' exponents moved, the
    # zero points kept): the weights of P . V change by far more than fp16 holds from tile to
    # tile, which each tile's own normalisation must carry. Rising: each tile outweighs what
    # came before; falling: each is negligible against it.
    seq_len = 200
    p = _attention_problem(mode, [1, 1], [seq_len, 90], head_size=64, seed=7)
    shift = {
        "rising": np.linspace(-60, 60, seq_len),
        "falling": np.linspace(60, -60, seq_len),
        "random": rng_for("int4 value scales", mode).uniform(-60, 60, seq_len),
    }[order].astype(np.int32)
    words = p.v_scale_cache.view(torch.int32)
    for seq in range(2):
        pos = torch.arange(int(p.seq_lens[seq]), device=DEVICE)
        block = p.block_tables[seq, pos // p.block_size].long()
        words[block, pos % p.block_size] += torch.from_numpy(shift[: len(pos), None] << 23).to(DEVICE)
    # One pass over every tile (no split), so each tile's weights meet all that came before.
    cfg = dataclasses.replace(int4_attention.decode_config(p, False), split_keys=0)
    attention_kernels._launch(int4_attention.kernel_call(p, "cuda", cfg, per_seq=True, skip_decode=False))
    _check_attention(p, f" (V scales {order})")


@pytest.mark.parametrize("mode", INT4)
def test_split_decode_matches_the_oracle_and_the_single_pass(mode):
    p = _attention_problem(mode, [1, 1], [300, 70], head_size=64, sinks=True, lse=True)
    cfg = int4_attention.decode_config(p, False)
    one = dataclasses.replace(cfg, split_keys=0)
    split = dataclasses.replace(cfg, split_keys=2 * cfg.block_n)  # three splits of 300, the last ragged
    for c in (one, split):
        p.out.fill_(float("nan"))
        p.lse.fill_(float("nan"))
        call = int4_attention.kernel_call(p, "cuda", c, per_seq=True, skip_decode=False)
        assert (call.merge is not None) == (c.split_keys > 0)
        attention_kernels._launch(call)
        _check_attention(p, f" (split_keys {c.split_keys})")


@pytest.mark.parametrize("mode", INT4)
@pytest.mark.parametrize(
    "opts",
    [
        dict(sliding_window=5),
        dict(softcap=8.0),
        dict(sinks=True, lse=True),
        dict(sliding_window=3, softcap=20.0, sinks=True, lse=True, block_size=16),
        dict(batch_invariant=True),
        dict(softmax_scale=0.03),
    ],
)
def test_prefill_and_options_match_the_oracle(mode, opts):
    p = _attention_problem(mode, [9, 1, 4], [9, 14, 30], head_size=32, **opts)
    int4_attention.run(p, "cuda")
    _check_attention(p, f" {opts}")


@pytest.mark.parametrize("mode, head_size", [(m, 32) for m in INT4] + [("int4_per_token_head", 48)])
def test_staged_prefill_reads_only_what_it_gathered(mode, head_size):
    # A workspace filled with NaN: any entry the gather missed would poison an output row
    # (48 = 32 + 16: a head padded in the gather and the query's staging).
    q_len = 130  # at least staging.STAGE_MIN_QUERY_LEN
    p = _attention_problem(mode, [q_len, 1], [q_len + 9, 23], head_size=head_size, dtype="float16", lse=True)
    options = attention_ops.TritonAttentionOptions(workspace_fill=float("nan"))
    launches, staged = int4_attention._launches(p, "cuda", options)
    assert staged is not None and [per_seq for _, per_seq, _ in launches] == [True]
    int4_attention.run(p, "cuda", options)
    _check_attention(p, " (staged)")
    direct = attention_ops.TritonAttentionOptions(prefill="direct")
    assert int4_attention._launches(p, "cuda", direct)[1] is None
    p.out.fill_(float("nan"))
    p.lse.fill_(float("nan"))
    int4_attention.run(p, "cuda", direct)
    _check_attention(p, " (direct)")


@pytest.mark.parametrize("mode", INT4)
def test_a_poisoned_row_poisons_the_rows_that_attend_it(mode):
    p = _attention_problem(mode, [1, 1, 4], [12, 12, 12], head_size=32)
    tables = p.block_tables.cpu().numpy()
    bs = p.block_size
    # Sequence 0: key 5 poisoned (every head of the KV head's group reads it); sequence 1: value
    # 3; sequence 2: key 10, which only its last two query tokens see (positions 10 and 11).
    for seq, pos, words in ((0, 5, p.k_scale_cache), (1, 3, p.v_scale_cache), (2, 10, p.k_scale_cache)):
        words.view(torch.int32)[int(tables[seq, pos // bs]), pos % bs, 0] = 0x7FC00000
    int4_attention.run(p, "cuda")
    out = p.out.float().cpu().numpy()
    g = p.num_q_heads // p.num_kv_heads
    assert np.isnan(out[0, :g]).all() and np.isfinite(out[0, g:]).all()
    assert np.isnan(out[1, :g]).all() and np.isfinite(out[1, g:]).all()
    assert np.isfinite(out[2:4]).all() and np.isnan(out[4:6, :g]).all()


@pytest.mark.parametrize("mode", INT4)
def test_prepared_attention_relaunches_with_other_tensors(mode):
    # Long enough to split (the relaunch allocates its own partials, as run does).
    first = _attention_problem(mode, [1, 1], [2100, 40], head_size=32, lse=True, seed=1)
    assert int4_attention.decode_config(first, False).split_keys > 0
    launch = int4_attention.prepare(first, "cuda")
    second = _attention_problem(mode, [1, 1], [2100, 40], head_size=32, lse=True, seed=2)
    launch(second.operands())
    _check_attention(second, " (prepared)")
    assert torch.isnan(first.out).all()  # binding launched nothing


# ----------------------------------------------------------------------------------------
# What only a GPU compiles: the inline PTX, assembled for sm_90a


_PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
_OFFLINE = Path(__file__).resolve().parents[1] / "bench" / "probes" / "int4_offline_facts.py"


@pytest.mark.skipif(not _PTXAS.exists(), reason="the triton wheel's ptxas is not here")
def test_the_gpu_paths_compile_for_sm90_and_keep_their_roundings():
    # In a process of its own: this one decorated the kernels for the interpreter.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(_OFFLINE), "--check"], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
