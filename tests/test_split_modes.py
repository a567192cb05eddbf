"""Split modes: keys and values stored in two formats (SPEC.md section 2's per-side rows).

The conformance suite holds every implementation that registers them to the oracle byte for
byte (tests/test_conformance.py); here: what a split mode is made of, what each layer does with
the two sides, the Numba and Triton backends against the NumPy one on the same calls, and what is
refused where they are not taken.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch

import kvzoo
from kvzoo import KVZooInputError, registry, samples
from kvzoo.arrays import as_torch, numpy_dtype
from kvzoo.backends.triton import platform as triton_platform
from kvzoo.inputs import host_bytes, random_bytes, rng_for
from kvzoo.modes import MODES
from kvzoo.problem import OPS
from kvzoo.registry import NoImplementationError
from kvzoo_spec import oracle

SPLIT = [name for name, m in MODES.items() if m.split]
NB, BS, H, D = 6, 4, 2, 32


def test_every_split_mode_is_two_one_sided_per_token_head_modes():
    assert SPLIT == list(oracle.SPLIT_MODES)
    for name in SPLIT:
        m = MODES[name]
        key, value = m.key_side, m.value_side
        assert (key.name, value.name) == oracle.SPLIT_MODES[name]
        assert m.key_format is key.format and m.value_format is value.format
        assert m.key_format is not m.value_format
        assert m.per_token_head and m.layouts == ("separate",)
        # Head sizes both sides take; roundings both define.
        assert all(
            m.head_sizes.takes(d) == (key.head_sizes.takes(d) and value.head_sizes.takes(d)) for d in range(1, 600)
        )
        assert set(m.roundings) == set(key.roundings) & set(value.roundings)
        assert kvzoo.get_kv_quant_mode(name.upper()) is m


@pytest.mark.parametrize("mode", SPLIT)
def test_allocated_caches_hold_each_side_in_its_own_width_and_dtype(mode):
    m = MODES[mode]
    t = kvzoo.allocate_separate(NB, BS, H, D, mode, device=None)
    for cache, side in ((t.key_cache, m.key_side), (t.value_cache, m.value_side)):
        assert cache.shape == (NB, BS, H, side.cache_width(D)) and cache.dtype.name == side.code_dtype
    # Keys at one byte a code, values at half a byte: 1.5 bytes an element plus two scales a row.
    row_bytes = sum(x.nbytes for x in (t.key_cache, t.value_cache, t.k_scale_cache, t.v_scale_cache)) / (NB * BS * H)
    assert row_bytes == D + D // 2 + 8
    with pytest.raises(KVZooInputError, match="^mode: the inline page holds one format a row; .* in two"):
        kvzoo.PagedKVCache(NB, BS, H, D, mode, layout="inline", device=None)


def _write_call(mode, rng, value_cache=None):
    t = kvzoo.allocate_separate(NB, BS, H, D, mode, device=None)
    for a in (t.key_cache, t.value_cache, t.k_scale_cache, t.v_scale_cache):
        a.view(np.uint8)[...] = rng.integers(1, 256, a.view(np.uint8).shape, dtype=np.uint8)
    if value_cache is not None:
        t = dataclasses.replace(t, value_cache=value_cache)
    rows = [rng.standard_normal((5, H, D)).astype(np.float32) for _ in range(2)]
    slots = rng.permutation(NB * BS)[:5]
    return t, rows, slots


@pytest.mark.parametrize("mode", SPLIT)
def test_a_value_cache_in_the_keys_format_is_refused_before_any_write(mode):
    m = MODES[mode]
    rng = rng_for("split", "refuse", mode)
    wrong = random_bytes(rng, (NB, BS, H, D), m.key_side.code_dtype, "cpu", "numpy")
    t, (key, value), slots = _write_call(mode, rng, value_cache=wrong)
    before = [host_bytes(a).copy() for a in (t.key_cache, t.value_cache, t.k_scale_cache, t.v_scale_cache)]
    expected = f"value_cache: expected shape {(NB, BS, H, m.value_side.cache_width(D))}"
    with pytest.raises(KVZooInputError, match="^" + re.escape(expected)):
        kvzoo.reshape_and_cache(
            key, value, t.key_cache, t.value_cache, slots, mode=mode,
            k_scale_cache=t.k_scale_cache, v_scale_cache=t.v_scale_cache,
        )  # fmt: skip
    with pytest.raises(KVZooInputError, match="^value_cache: expected shape"):
        kvzoo.paged_attention(
            key[:1].repeat(2, axis=1), t.key_cache, t.value_cache, mode=mode,
            block_tables=np.array([[0]], np.int32), seq_lens=np.array([1], np.int32),
            query_start_loc=np.array([0, 1], np.int32), k_scale_cache=t.k_scale_cache, v_scale_cache=t.v_scale_cache,
        )  # fmt: skip
    after = [host_bytes(a) for a in (t.key_cache, t.value_cache, t.k_scale_cache, t.v_scale_cache)]
    assert all(np.array_equal(b, a) for b, a in zip(before, after))


@pytest.mark.parametrize("mode", SPLIT)
def test_dequantize_takes_one_side_mode_and_refuses_the_split_one(mode):
    m = MODES[mode]
    rng = rng_for("split", "dequantize", mode)
    t, (key, value), slots = _write_call(mode, rng)
    cache = kvzoo.PagedKVCache(NB, BS, H, D, mode, device=None)
    cache.tensors = t
    kvzoo.reshape_and_cache(
        key, value, t.key_cache, t.value_cache, slots, mode=mode,
        k_scale_cache=t.k_scale_cache, v_scale_cache=t.v_scale_cache,
    )  # fmt: skip
    with pytest.raises(
        KVZooInputError, match=f"^mode: '{mode}' stores keys and values in two modes.*'{m.value_side.name}'"
    ):
        kvzoo.dequantize(t.value_cache, t.v_scale_cache, mode=mode)
    for which, side, rows, codes, scales in (
        ("key", m.key_side, key, t.key_cache, t.k_scale_cache),
        ("value", m.value_side, value, t.value_cache, t.v_scale_cache),
    ):
        got = cache.read(which)
        want = samples.oracle_decoded_cache(side, host_bytes(codes)[..., 0], scales)
        # Bit for bit, NaN for NaN (slots not written hold random bytes: NaN scale words among them).
        np.testing.assert_array_equal(np.asarray(got), want.astype(np.float32))
        block, offset = np.divmod(slots, BS)
        # Each side keeps its own precision (relative RMS error of the rows written).
        error = np.sqrt(np.mean((np.asarray(got)[block, offset] - rows) ** 2) / np.mean(rows**2))
        assert error < {"int8": 0.01, "float8_e4m3fn": 0.04, "uint4": 0.2}[side.code_format.name], (which, error)


BACKENDS = ("numba", "triton-cuda", "triton-rocm")


def test_every_backend_registers_the_split_modes_for_what_numpy_takes_them():
    # Write and attention, where the backend's format table holds both sides' formats (ROCm's
    # Triton has no e4m3fn); dequantize reads one cache in one side's mode, so none lists them.
    for op in OPS:
        want = {m for m in SPLIT if m in registry.get(op, "numpy").modes}
        assert want == (set() if op == "dequantize" else set(SPLIT)), op
        for backend in BACKENDS:
            impl = registry.get(op, backend)
            sides = {
                m
                for m in want
                if {MODES[m].key_format.name, MODES[m].value_format.name} <= impl.capabilities.formats.keys()
            }
            assert {m for m in SPLIT if m in impl.modes} == sides, (op, backend)
    assert "k_fp8_v_int4" not in registry.get("paged_attention", "triton-rocm").modes


# Triton's kernels take CPU tensors only under the interpreter (CI); on a GPU, CUDA tensors.
TRITON_DEVICE = "cuda" if torch.cuda.is_available() and not triton_platform.interpreted() else "cpu"


def _arrays(impl: str, *arrays):
    """The arrays as impl takes them: Triton's as torch views of the same memory (copies on
    the GPU: _copy_back brings what a write changed home)."""
    return [as_torch(a).to(TRITON_DEVICE) if impl.startswith("triton") else a for a in arrays]


def _copy_back(arrays, taken) -> None:
    for a, t in zip(arrays, taken):
        if isinstance(t, torch.Tensor) and t.device.type != "cpu":
            as_torch(a).copy_(t.cpu())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("mode", SPLIT)
@pytest.mark.parametrize("impl", ["numba", "triton-cuda"])
def test_a_backend_writes_a_split_mode_as_numpy_does_and_attends_to_it(impl, mode, dtype):
    """Fresh rows (a NaN and an Inf among them) into caches of random bytes: the backend's bytes
    are numpy's, each side in its own format, a skipped slot's poison kept; then its attention,
    with every softmax option, over every slot it wrote, against the float64 reference (rows
    free of NaN: a prefill may read a poisoned later key masked, SPEC.md section 8; the
    conformance suite's poisoned decodes cover them)."""
    pytest.importorskip("numba" if impl == "numba" else "triton")
    rng = rng_for("split", impl, mode, dtype)
    t, (key, value), slots = _write_call(mode, rng)
    key[1, 0, 3], value[2, 1, 5] = np.nan, np.inf  # rows whose scale words are the canonical NaN
    slots[0] = -1  # a padded token: no slot written
    key, value = (x.astype(numpy_dtype(dtype)) for x in (key, value))
    arrays = (t.key_cache, t.value_cache, t.k_scale_cache, t.v_scale_cache)
    written = {}
    for writer in ("numpy", impl):
        kc, vc, ks, vs = (a.copy() for a in arrays)
        call = _arrays(writer, key, value, kc, vc, slots, ks, vs)
        kvzoo.reshape_and_cache(*call[:5], mode=mode, k_scale_cache=call[5], v_scale_cache=call[6], impl=writer)
        _copy_back((kc, vc, ks, vs), (call[2], call[3], call[5], call[6]))
        written[writer] = (kc, vc, ks, vs)
    for name, want, got in zip(("key_cache", "value_cache", "k_scale_cache", "v_scale_cache"), *written.values()):
        assert host_bytes(got).tobytes() == host_bytes(want).tobytes(), name
    kc, vc, ks, vs = written[impl]
    rows = [rng.standard_normal((NB * BS, H, D)).astype(numpy_dtype(dtype)) for _ in range(2)]
    every = rng.permutation(NB * BS)
    call = _arrays(impl, *rows, kc, vc, every, ks, vs)
    kvzoo.reshape_and_cache(*call[:5], mode=mode, k_scale_cache=call[5], v_scale_cache=call[6], impl=impl)
    _copy_back((kc, vc, ks, vs), (call[2], call[3], call[5], call[6]))
    # A decode, a prefill and another decode, 4 query heads a KV head.
    tables = rng.permutation(NB).astype(np.int32).reshape(3, 2)
    lens, qsl = np.array([5, 8, 6], np.int32), np.array([0, 1, 6, 7], np.int32)
    query = rng.standard_normal((7, 4 * H, D)).astype(numpy_dtype(dtype))
    sinks = rng.standard_normal(4 * H).astype(np.float32)
    options = dict(sliding_window=6, softcap=20.0)
    attention = registry.get("paged_attention", impl)
    q, kc_, vc_, tables_, lens_, qsl_, ks_, vs_, sinks_ = _arrays(impl, query, kc, vc, tables, lens, qsl, ks, vs, sinks)
    got = kvzoo.paged_attention(
        q, kc_, vc_, mode=mode, block_tables=tables_, seq_lens=lens_, query_start_loc=qsl_,
        k_scale_cache=ks_, v_scale_cache=vs_, impl=attention, **options, sinks=sinks_,
    )  # fmt: skip
    got = got.float().cpu().numpy() if impl.startswith("triton") else got
    ref = samples.oracle_attention(
        mode, query, host_bytes(kc)[..., 0], host_bytes(vc)[..., 0], tables, lens, qsl, k_scales=ks, v_scales=vs,
        **options, sinks=sinks,
    )  # fmt: skip
    samples.assert_attention_close(attention, got, ref, qsl, dtype, f" {mode}")


@pytest.mark.parametrize("impl", ["triton-rocm"])
def test_backends_without_a_sides_format_say_so(impl):
    # ROCm's Triton kernels have no e4m3fn: the fp8-key modes are refused before any launch.
    pytest.importorskip("triton")
    rng = rng_for("split", "registry", impl)
    t, (key, value), slots = _write_call("k_fp8_v_int4", rng)
    chosen = kvzoo.registry.get("reshape_and_cache", impl)
    assert "k_fp8_v_int4" not in chosen.modes
    with pytest.raises(NoImplementationError, match="k_fp8_v_int4"):
        kvzoo.reshape_and_cache(
            torch.from_numpy(key), torch.from_numpy(value), torch.from_numpy(t.key_cache),
            torch.from_numpy(t.value_cache), torch.from_numpy(slots), mode="k_fp8_v_int4",
            k_scale_cache=torch.from_numpy(t.k_scale_cache), v_scale_cache=torch.from_numpy(t.v_scale_cache), impl=impl,
        )  # fmt: skip


@pytest.mark.parametrize("impl", ["numpy", "numba"])
@pytest.mark.parametrize("mode", SPLIT)
def test_a_plan_takes_a_split_cache_and_attends_as_the_functional_call(mode, impl):
    if impl == "numba":
        pytest.importorskip("numba")
    rng = rng_for("split", "plan", mode, impl)
    spec = kvzoo.CacheSpec(
        mode, num_blocks=NB, block_size=BS, num_kv_heads=H, head_size=D, model_dtype="float32", device=None
    )
    caches = spec.allocate()
    rows = [rng.standard_normal((7, H, D)).astype(np.float32) for _ in range(2)]
    tables, lens, qsl = np.array([[0, 1]], np.int32), np.array([7], np.int32), np.array([0, 7], np.int32)
    plan = kvzoo.plan_step(
        spec,
        block_tables=tables,
        seq_lens=lens,
        query_start_loc=qsl,
        num_q_heads=2 * H,
        slot_mapping=np.arange(7),
        impl=impl,
    )
    plan.write(*rows, caches)
    query = rng.standard_normal((7, 2 * H, D)).astype(np.float32)
    got = plan.attention(query, caches)
    want = kvzoo.paged_attention(
        query, caches.key_cache, caches.value_cache, mode=mode, block_tables=tables, seq_lens=lens,
        query_start_loc=qsl, k_scale_cache=caches.k_scale_cache, v_scale_cache=caches.v_scale_cache, impl=impl,
    )  # fmt: skip
    assert np.array_equal(got, want)
    ref = samples.oracle_attention(
        mode, query, host_bytes(caches.key_cache)[..., 0], host_bytes(caches.value_cache)[..., 0], tables, lens, qsl,
        k_scales=caches.k_scale_cache, v_scales=caches.v_scale_cache,
    )  # fmt: skip
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()
