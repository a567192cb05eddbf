"""The object API, NumPy inputs, layouts and validate=False, through the best implementation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvzoo
from kvzoo.arrays import as_numpy
from kvzoo_spec import oracle

from support import assert_same_bytes, rng_for


@pytest.mark.parametrize("layout", ["separate", "inline"])
@pytest.mark.parametrize("mode", ["int8_per_token_head", "fp8_per_token_head", "fp8_e4m3fnuz_per_token_head"])
def test_paged_kv_cache_round_trip(mode, layout):
    rng = rng_for("roundtrip", mode, layout)
    cache = kvzoo.PagedKVCache(6, 16, 4, 128, mode, layout=layout)
    key = torch.from_numpy(rng.standard_normal((50, 4, 128)).astype(np.float32)).bfloat16()
    value = torch.from_numpy(rng.standard_t(3, (50, 4, 128)).astype(np.float32)).bfloat16()
    slots = torch.from_numpy(rng.permutation(96)[:50])
    cache.write(key, value, slots)
    tables = torch.from_numpy(rng.permutation(6)[None].astype(np.int32))
    # The whole cache read back, indexed by slot, equals the oracle's decode of the oracle's codes.
    codes, scales = oracle.quantize_rows(value.float().numpy().reshape(-1, 128), mode)
    want = oracle.decode_rows(codes, scales, mode).reshape(50, 4, 128)
    whole = cache.read("value").reshape(-1, 4, 128)
    assert_same_bytes(whole[slots], want, "decoded values")
    # Gathered read: token i of the sequence sits in slot tables[0, i // 16] * 16 + i % 16.
    seq = cache.read("key", block_tables=tables, seq_lens=torch.tensor([96], dtype=torch.int32))
    positions = torch.arange(96)
    gathered_slots = tables[0, positions // 16].long() * 16 + positions % 16
    assert torch.equal(seq.view(torch.int32), cache.read("key").reshape(-1, 4, 128)[gathered_slots].view(torch.int32))
    # Reconstruction error is bounded by half a step of the row's scale (int8), per the spec.
    if mode.startswith("int8"):
        row_scale = key.float().abs().amax(-1, keepdim=True) / 127
        err = (cache.read("key").reshape(-1, 4, 128)[slots] - key.float()).abs()
        assert bool((err <= row_scale * 0.5 * (1 + 1e-5)).all())


def test_numpy_arrays_in_and_out():
    rng = rng_for("numpy-api")
    # Every slot is written: attention below reads whole pages, and the cache starts as np.empty.
    key = rng.standard_normal((32, 2, 64)).astype(np.float16)
    value = rng.standard_normal((32, 2, 64)).astype(np.float16)
    tensors = kvzoo.allocate_separate(2, 16, 2, 64, "int8_per_token_head", device=None)
    assert isinstance(tensors.key_cache, np.ndarray)
    slots = rng.permutation(32).astype(np.int64)
    kvzoo.reshape_and_cache(
        key,
        value,
        tensors.key_cache,
        tensors.value_cache,
        slots,
        mode="int8_per_token_head",
        k_scale_cache=tensors.k_scale_cache,
        v_scale_cache=tensors.v_scale_cache,
    )
    want_codes, want_scales = oracle.quantize_rows(key.astype(np.float32).reshape(-1, 64), "int8_per_token_head")
    got = tensors.key_cache.reshape(-1, 2, 64)[slots].reshape(-1, 64)
    assert_same_bytes(got.view(np.uint8), want_codes, "numpy codes")
    assert_same_bytes(tensors.k_scale_cache.reshape(-1, 2)[slots].reshape(-1), want_scales, "numpy scales")
    decoded = kvzoo.dequantize(tensors.key_cache, tensors.k_scale_cache, mode="int8_per_token_head")
    assert isinstance(decoded, np.ndarray) and decoded.shape == (2, 16, 2, 64)
    query = rng.standard_normal((3, 4, 64)).astype(np.float32)
    bt = np.array([[int(slots[0]) // 16, 1 - int(slots[0]) // 16]], np.int32)
    out = kvzoo.paged_attention(
        query,
        tensors.key_cache,
        tensors.value_cache,
        mode="int8_per_token_head",
        k_scale_cache=tensors.k_scale_cache,
        v_scale_cache=tensors.v_scale_cache,
        block_tables=bt,
        seq_lens=np.array([3], np.int32),
        query_start_loc=np.array([0, 3], np.int32),
    )
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and np.isfinite(out).all()


def test_inline_layout_is_one_buffer_of_rows_with_trailing_scales():
    tensors = kvzoo.allocate_inline(3, 4, 2, 16, "fp8_per_token_head")
    buf = tensors.buffer
    assert tuple(buf.shape) == (3, 2, 4, 2, 20) and buf.dtype == torch.uint8
    key = torch.randn(5, 2, 16)
    kvzoo.reshape_and_cache(
        key,
        key * 2,
        tensors.key_cache,
        tensors.value_cache,
        torch.arange(5),
        mode="fp8_per_token_head",
        k_scale_cache=tensors.k_scale_cache,
        v_scale_cache=tensors.v_scale_cache,
    )
    # Token 4 (slot 4: block 1, offset 0), head 1, V: bytes 16..19 of its row are the scale.
    row = buf[1, 1, 0, 1]
    scale = row[16:20].numpy().view("<f4")[0]
    _, want_scales = oracle.quantize_rows((key[4, 1] * 2).numpy()[None], "fp8_per_token_head")
    assert scale.tobytes() == want_scales[0].tobytes()
    k_codes, v_codes, k_scales, v_scales = oracle.unpack_inline(as_numpy(buf).copy())
    assert_same_bytes(tensors.v_scale_cache, v_scales, "inline scales")
    assert_same_bytes(tensors.key_cache.view(torch.uint8), k_codes, "inline codes")
    assert row.data_ptr() == tensors.value_cache[1, 0, 1].data_ptr()


def test_validate_false_still_skips_negative_slots():
    cache = kvzoo.PagedKVCache(2, 4, 1, 8, "int8_per_token_head")
    cache.tensors.key_cache.fill_(7)
    before = cache.tensors.key_cache.clone()
    key = torch.randn(3, 1, 8)
    cache.write(key, key, torch.tensor([-1, -5, -2]), validate=False)
    assert torch.equal(cache.tensors.key_cache, before)


def test_attention_returns_query_dtype_and_respects_out():
    cache = kvzoo.PagedKVCache(2, 16, 2, 64, "fp8_per_token_head")
    kv = torch.randn(20, 2, 64, dtype=torch.float16)
    cache.write(kv, kv, torch.arange(20))
    q = torch.randn(20, 4, 64, dtype=torch.float16)
    out = torch.full_like(q, float("nan"))
    got = cache.attention(
        q,
        block_tables=torch.tensor([[0, 1]], dtype=torch.int32),
        seq_lens=torch.tensor([20], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 20], dtype=torch.int32),
        out=out,
    )
    assert got is out and out.dtype == torch.float16 and bool(torch.isfinite(out).all())
    # Causality: the first token attends to itself only, so its output is its own decoded value.
    v0 = cache.read("value")[0, 0]
    torch.testing.assert_close(out[0].float(), v0.repeat_interleave(2, 0), rtol=2e-3, atol=2e-3)
