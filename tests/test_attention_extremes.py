"""Attention with query rows of extreme magnitude (SPEC.md section 11, last paragraph) and
quantize_query at small head sizes (issue 21, item 1), on every paged_attention implementation.

Where the logits are in range, the size of the query must not matter: a query row near 1e37
against keys near 1e-37, or a subnormal row (1e-38) against keys near 1e37, gives logits of
O(1) and must give the oracle's output within the implementation's tolerance, although the
dot of such a row with the key codes alone (before the key scale) overflows float32, or
underflows in fp16. Each (sequence, KV head) has its own magnitude pair, and in the "mixed"
scenario some query rows are far smaller than their cell's, so one batch holds rows that differ
by 75 decades. The caches are filled directly (codes and scales, as the conformance suite's
attention check does): keys near 1e-37 need key scales below the write's floor, subnormal ones
included, and any scale bits are defined (SPEC.md section 9).

Inputs are fresh every session (kvzoo.inputs.SEED, printed in the pytest header).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

import kvzoo
from kvzoo import registry
from kvzoo.inputs import SEED, device_for, host_float32, rng_for, tensor, to_dtype_exact
from kvzoo.modes import MODES
from kvzoo_spec import oracle

try:
    from kvzoo.backends.triton import staging
except ImportError:  # no triton here: its implementations skip, the others still run
    staging = None

IMPLS = [impl.name for impl in registry.implementations("paged_attention")]
# Query tokens of the "long" batch's prompt: enough for the Triton backend's staged prefill.
LONG_PROMPT = staging.STAGE_MIN_QUERY_LEN if staging else 128
MODE_NAMES = ("int8_per_token_head", "fp8_per_token_head", "fp8_e4m3fnuz_per_token_head", "fp8_per_tensor", "none")
# bf16 holds every magnitude here (fp16 holds none of them); fp32 rows take the fp32 paths.
QUERY_DTYPES = ("bfloat16", "float32")
# Magnitudes of the query rows of each (sequence, KV head) cell, cycled through the cells.
SCENARIOS = {
    "q1e35": (1e35,),
    "q1e37": (1e37,),
    "q1e-38": (1e-38,),
    "mixed": (3e37, 1e-38, 1e35, 1.0, 1e-30, 1e20),
}
# Key rows get magnitude LOGIT_SIZE / (query magnitude), so the logits are of O(1) to O(10)
# (softmax_scale = 1/sqrt(D) cancels the sqrt(D) of a random dot product); capped so that
# decoded keys stay below bf16's and float32's largest finite values.
LOGIT_SIZE = 3.0
KEY_MAX = 5e37
# Query rows of a cell range over 1/ROW_SPREAD..1 times its magnitude (elements stay below
# 3.4e38); in "mixed" a third of them go down to SMALLEST_ROW instead.
ROW_SPREAD = 4.0
SMALLEST_ROW = 1e-38
OUT_ROUNDOFF = {"bfloat16": 2.0**-8, "float32": 0.0}  # the output's own rounding, as in checks.py


def _impl(name: str):
    impl = registry.get("paged_attention", name)
    reasons = impl.unavailable()
    if reasons:
        pytest.skip("; ".join(reasons))
    return impl


def _impl_with_mode(name: str, mode: str):
    impl = _impl(name)
    if mode not in impl.modes:
        pytest.skip(f"{name} does not register mode {mode}")
    return impl


def _batch(kind: str, rng):
    """(q_lens, seq_lens): decodes, prefills (one a chunk on top of earlier context), or a
    prompt long enough for the Triton backend's staged prefill beside a decode."""
    if kind == "decode":
        seq_lens = rng.integers(1, 70, 4)
        q_lens = np.ones(4, np.int64)
    elif kind == "prefill":
        seq_lens = np.array([rng.integers(2, 40), rng.integers(20, 50), rng.integers(1, 20)])
        q_lens = np.array([seq_lens[0], rng.integers(5, 13), seq_lens[2]])
    else:
        q_len = LONG_PROMPT + int(rng.integers(0, 8))
        seq_lens = np.array([q_len + int(rng.integers(0, 12)), rng.integers(1, 40)])
        q_lens = np.array([q_len, 1])
    return q_lens.astype(np.int64), seq_lens.astype(np.int64)


def _tables(seq_lens, block_size, rng):
    """Shuffled block tables (unused entries random) and the number of blocks."""
    blocks_per_seq = -(-seq_lens // block_size)
    num_blocks = int(blocks_per_seq.sum()) + 3
    order = rng.permutation(num_blocks)
    tables = rng.integers(0, num_blocks, (len(seq_lens), int(blocks_per_seq.max()) + 1))
    start = 0
    for s, n in enumerate(blocks_per_seq):
        tables[s, :n] = order[start : start + n]
        start += n
    return tables, num_blocks


def _cache_tensor(a, mode, model_dtype, device):
    """Codes (uint8 bytes) as the mode's code dtype, or mode none's float32 values (exact in
    the model dtype) as that dtype."""
    if mode.code_dtype is None:
        return tensor(a, model_dtype, device)
    return torch.from_numpy(np.ascontiguousarray(a)).view(getattr(torch, mode.code_dtype)).to(device)


def _run_and_compare(
    impl,
    mode_name,
    q32,
    query_dtype,
    caches,
    static,
    tables,
    seq_lens,
    q_lens,
    *,
    quantize_query=False,
    what=lambda s: "",
):
    """kvzoo.paged_attention with impl against the float64 oracle on the decoded cache (on the
    query's int8 round trip with quantize_query: SPEC.md 8.1), per sequence, as
    kvzoo.conformance.checks.check_paged_attention compares. caches: ((K codes or values, K
    scales or None), (V ..., ...)); static: the per-tensor (k_scale, v_scale) or Nones."""
    mode = MODES[mode_name]
    device = device_for(impl)
    (kc, ks), (vc, vs) = caches
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    query = tensor(q32, query_dtype, device)
    out = torch.full_like(query, float("nan"))
    as_device = lambda a: None if a is None else torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    try:
        kvzoo.paged_attention(
            query,
            _cache_tensor(kc, mode, query_dtype, device),
            _cache_tensor(vc, mode, query_dtype, device),
            mode=mode_name,
            block_tables=as_device(tables.astype(np.int32)),
            seq_lens=as_device(seq_lens.astype(np.int32)),
            query_start_loc=as_device(qsl),
            k_scale_cache=as_device(ks),
            v_scale_cache=as_device(vs),
            k_scale=None if static[0] is None else float(static[0]),
            v_scale=None if static[1] is None else float(static[1]),
            out=out,
            quantize_query=quantize_query,
            impl=impl.name,
        )
    except registry.NoImplementationError as e:
        pytest.skip(str(e))

    k_deq = oracle.decode_cache(kc, ks, mode_name, static[0])
    v_deq = oracle.decode_cache(vc, vs, mode_name, static[1])
    ref_query = q32
    if quantize_query:
        rows = q32.reshape(-1, q32.shape[-1])
        ref_query = oracle.decode_rows(*oracle.quantize_rows(rows, mode_name), mode_name).reshape(q32.shape)
    with np.errstate(over="raise"):
        ref = oracle.attention_f64(ref_query, k_deq, v_deq, tables, seq_lens, qsl)
    assert np.isfinite(ref).all(), "the inputs' logits are in range"
    got = host_float32(out).astype(np.float64)
    bad = ~np.isfinite(got)
    if bad.any():
        sizes = sorted({f"{a:.0e}" for a in np.abs(q32).max(-1)[bad.any(-1)]})
        pytest.fail(
            f"{impl.name}: {int(bad.sum())} of {bad.size} output elements not finite, in query rows of "
            f"magnitudes {sizes} (seed {SEED})"
        )
    tol = impl.attention_rtol + OUT_ROUNDOFF[query_dtype]
    for s in range(len(seq_lens)):
        rows = slice(int(qsl[s]), int(qsl[s + 1]))
        err = np.linalg.norm(got[rows] - ref[rows]) / np.linalg.norm(ref[rows])
        if not err <= tol:
            pytest.fail(f"{impl.name}: sequence {s}{what(s)} relative error {err:.3e} > {tol:.1e} (seed {SEED})")


# ---------------------------------------------------------------------------------------------
# Query rows of any magnitude


def _key_size(q_size: float) -> float:
    return min(LOGIT_SIZE / q_size, KEY_MAX)


def _random_cache(mode, rng, shape, sizes):
    """(codes or float32 values, per-row scales or None) whose decoded rows have standard
    deviation sizes[block, offset, head]; per-tensor codes take their static scale instead."""
    if mode.code_dtype is None:
        return np.clip(rng.standard_normal(shape), -4, 4) * sizes[..., None], None
    if mode.code_dtype == "int8":
        codes = rng.integers(-127, 128, shape).astype(np.int8).view(np.uint8)
        code_std = 127 / math.sqrt(3)
    else:
        y = np.clip(rng.standard_normal(shape) * mode.qmax / 3, mode.qmin, mode.qmax).astype(np.float32)
        codes = y.astype(getattr(ml_dtypes, mode.code_dtype)).view(np.uint8)
        code_std = mode.qmax / 3
    if not mode.per_token_head:
        return codes, None
    # Scales vary by up to 4x between the keys of a cell, as a real cache's do.
    return codes, (sizes / code_std * rng.uniform(0.5, 2.0, shape[:3])).astype(np.float32)


def _query(rng, q_sizes, head_size, spread_rows: bool):
    """float32 query rows of magnitude q_sizes[token, head] (times 1/4..1), a third of them
    (when spread_rows) at a random size between SMALLEST_ROW and their cell's instead."""
    sizes = q_sizes * rng.uniform(1 / ROW_SPREAD, 1.0, q_sizes.shape)
    if spread_rows:
        small = rng.random(q_sizes.shape) < 1 / 3
        low = np.minimum(np.log10(SMALLEST_ROW), np.log10(sizes))
        sizes = np.where(small, 10.0 ** (low + rng.random(q_sizes.shape) * (np.log10(sizes) - low)), sizes)
    q = np.clip(rng.standard_normal((*q_sizes.shape, head_size)), -3, 3) * sizes[..., None]
    return q.astype(np.float32)


def _check(
    impl,
    mode_name,
    q_lens,
    seq_lens,
    *,
    magnitudes,
    query_dtype,
    rng,
    num_q_heads=4,
    num_kv_heads=2,
    head_size=64,
    block_size=16,
    quantize_query=False,
    spread_rows=False,
):
    """A random batch whose (sequence, KV head) cells take query magnitudes from `magnitudes`
    (cycled) and keys of the size that puts their logits at O(LOGIT_SIZE), run and compared."""
    mode = MODES[mode_name]
    group = num_q_heads // num_kv_heads
    tables, num_blocks = _tables(seq_lens, block_size, rng)
    cells = np.resize(np.asarray(magnitudes, np.float64), (len(seq_lens), num_kv_heads))

    # Key magnitude of every cache row: its sequence's cell (rows no sequence reads: 1).
    key_sizes = np.ones((num_blocks, block_size, num_kv_heads))
    for s, n in enumerate(seq_lens):
        pos = np.arange(n)
        key_sizes[tables[s, pos // block_size], pos % block_size] = [_key_size(c) for c in cells[s]]
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    static = (None, None)
    if mode.per_tensor:
        # One scale for the whole cache: every cell's keys take the largest query's size.
        static = (np.float32(_key_size(float(cells.max())) / (mode.qmax / 3)), np.float32(2.0 ** rng.integers(-4, 5)))
    caches = []
    for sizes in (key_sizes, np.ones(shape[:3])):
        codes, scales = _random_cache(mode, rng, shape, sizes)
        if mode.code_dtype is None:
            codes = to_dtype_exact(codes.astype(np.float32), query_dtype)  # mode none's values
        caches.append((codes, scales))

    seq_of_token = np.repeat(np.arange(len(seq_lens)), q_lens)
    q_sizes = cells[seq_of_token][:, np.arange(num_q_heads) // group]
    q32 = to_dtype_exact(_query(rng, q_sizes, head_size, spread_rows), query_dtype)
    assert np.count_nonzero(q32) > 0.9 * q32.size, "the query rows hold their random values"
    _run_and_compare(
        impl,
        mode_name,
        q32,
        query_dtype,
        caches,
        static,
        tables,
        seq_lens,
        q_lens,
        quantize_query=quantize_query,
        what=lambda s: f" (query cells {cells[s]})",
    )


@pytest.fixture
def staged_calls(monkeypatch):
    """The Triton backend's staged prefills during the test (the problems it staged)."""
    calls = []
    if staging is None:
        return calls
    real = staging.staged_problem

    def spy(p, *args, **kwargs):
        calls.append(p)
        return real(p, *args, **kwargs)

    monkeypatch.setattr(staging, "staged_problem", spy)
    return calls


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("query_dtype", QUERY_DTYPES)
@pytest.mark.parametrize("batch", ["decode", "prefill", "long"])
@pytest.mark.parametrize("mode", MODE_NAMES)
@pytest.mark.parametrize("impl_name", IMPLS)
def test_extreme_query_magnitudes(impl_name, mode, batch, query_dtype, scenario, staged_calls):
    impl = _impl_with_mode(impl_name, mode)
    rng = rng_for("extremes", impl_name, mode, batch, query_dtype, scenario)
    q_lens, seq_lens = _batch(batch, rng)
    _check(
        impl,
        mode,
        q_lens,
        seq_lens,
        magnitudes=SCENARIOS[scenario],
        query_dtype=query_dtype,
        rng=rng,
        spread_rows=scenario == "mixed",
    )
    if impl_name.startswith("triton") and batch == "long" and MODES[mode].code_dtype is not None:
        assert staged_calls, "the long prompt did not take the staged prefill"


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("query_dtype", QUERY_DTYPES)
@pytest.mark.parametrize("batch", ["decode", "prefill"])
@pytest.mark.parametrize("impl_name", IMPLS)
def test_extreme_query_magnitudes_quantize_query(impl_name, batch, query_dtype, scenario):
    # The query's int8 round trip keeps its magnitude in the row's scale (a subnormal row
    # rounds to zero codes at the scale floor): the dot of its codes must not overflow either.
    impl = _impl(impl_name)
    rng = rng_for("extremes-qq", impl_name, batch, query_dtype, scenario)
    q_lens, seq_lens = _batch(batch, rng)
    _check(
        impl,
        "int8_per_token_head",
        q_lens,
        seq_lens,
        magnitudes=SCENARIOS[scenario],
        query_dtype=query_dtype,
        rng=rng,
        quantize_query=True,
        spread_rows=scenario == "mixed",
    )


# ---------------------------------------------------------------------------------------------
# One key far above the rest


# A decode query with one key (position 0) this far above the others (natural units, logits
# of the others O(1)): the later key tiles' weights, exp(-90) ~ 2^-130 times the V scales,
# are subnormal float32. Normalising them by their largest (the Triton decode tile does,
# before its fp16 dot) must not take the reciprocal of a subnormal.
DOMINANT_LOGIT = (85.0, 95.0)


@pytest.mark.parametrize("query_dtype", QUERY_DTYPES)
@pytest.mark.parametrize("mode", MODE_NAMES)
@pytest.mark.parametrize("impl_name", IMPLS)
def test_keys_far_below_the_largest_logit(impl_name, mode, query_dtype):
    impl = _impl_with_mode(impl_name, mode)
    rng = rng_for("far-below", impl_name, mode, query_dtype)
    m = MODES[mode]
    heads, head_size, block_size = 2, 64, 16
    seq_lens = rng.integers(70, 130, 3)  # several key tiles after key 0's
    q_lens = np.ones(3, np.int64)
    tables, num_blocks = _tables(seq_lens, block_size, rng)
    q32 = to_dtype_exact(rng.standard_normal((3, heads, head_size)).astype(np.float32), query_dtype)
    softmax_scale = 1 / math.sqrt(head_size)
    keys = rng.standard_normal((num_blocks, block_size, heads, head_size))
    for s in range(3):
        q = q32[s].astype(np.float64)
        logit = rng.uniform(*DOMINANT_LOGIT, heads)
        keys[tables[s, 0], 0] = q * (logit / (softmax_scale * np.sum(q * q, axis=-1)))[:, None]
    values = rng.standard_normal(keys.shape)
    # A real cache this time: the rows go through the write's rule (the oracle's).
    static = (np.float32(0.25), np.float32(2.0**-4)) if m.per_tensor else (None, None)
    caches = []
    for x, scale in zip((keys, values), static):
        rows = to_dtype_exact(x.astype(np.float32), query_dtype)
        if m.code_dtype is None:
            caches.append((rows, None))
            continue
        codes, scales = oracle.quantize_rows(
            rows.reshape(-1, head_size), mode, static_scale=None if scale is None else float(scale)
        )
        caches.append((codes.reshape(x.shape), scales.reshape(x.shape[:3]) if m.per_token_head else None))
    _run_and_compare(impl, mode, q32, query_dtype, caches, static, tables, seq_lens, q_lens)


# ---------------------------------------------------------------------------------------------
# quantize_query at every small head size: the int8 dot needs K >= 32 on NVIDIA GPUs, so the
# kernel pads the head dimension of that path (issue 21, item 1). The interpreter accepts any
# K, so it checks the padding's numbers; the GPU test below checks that it compiles and runs.
SMALL_HEAD_SIZES = list(range(1, 33))


def _quantize_query_small_head(impl, head_size, batch, rng):
    q_lens, seq_lens = _batch(batch, rng)
    _check(
        impl,
        "int8_per_token_head",
        q_lens,
        seq_lens,
        magnitudes=(1.0,),
        query_dtype="bfloat16",
        rng=rng,
        head_size=head_size,
        quantize_query=True,
    )


@pytest.mark.parametrize("batch", ["decode", "prefill"])
@pytest.mark.parametrize("head_size", SMALL_HEAD_SIZES)
@pytest.mark.parametrize("impl_name", IMPLS)
def test_quantize_query_small_head_sizes(impl_name, head_size, batch):
    impl = _impl(impl_name)
    _quantize_query_small_head(impl, head_size, batch, rng_for("qq-small-head", impl_name, head_size, batch))


@pytest.mark.gpu_only
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("batch", ["decode", "prefill"])
@pytest.mark.parametrize("head_size", SMALL_HEAD_SIZES + [64, 80, 128, 256])
def test_quantize_query_small_head_sizes_on_cuda(head_size, batch):
    impl = _impl("triton-cuda")
    assert device_for(impl) == "cuda", "the CUDA kernels, not the interpreter"
    _quantize_query_small_head(impl, head_size, batch, rng_for("qq-small-head-cuda", head_size, batch))
