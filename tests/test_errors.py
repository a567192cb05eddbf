"""Bad input: a clear error naming the argument, raised before anything is written."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

import kvzoo
from kvzoo import KVZooInputError, samples

from support import SEED, assert_same_bytes, host_bytes, random_bytes, rng_for

T, H, D, BS, NB = 6, 2, 64, 16, 4


def _write_args(mode="int8_per_token_head", rng=None):
    rng = rng or rng_for("errors", mode)
    m = kvzoo.get_kv_quant_mode(mode)
    cache_dtype = m.code_dtype or "bfloat16"
    args = dict(
        key=torch.randn(T, H, D, dtype=torch.bfloat16),
        value=torch.randn(T, H, D, dtype=torch.bfloat16),
        key_cache=random_bytes(rng, (NB, BS, H, D), cache_dtype, "cpu", "torch"),
        value_cache=random_bytes(rng, (NB, BS, H, D), cache_dtype, "cpu", "torch"),
        slot_mapping=torch.from_numpy(rng.permutation(NB * BS)[:T]),
    )
    kw = dict(mode=mode)
    if m.per_token_head:
        kw["k_scale_cache"] = random_bytes(rng, (NB, BS, H), "float32", "cpu", "torch")
        kw["v_scale_cache"] = random_bytes(rng, (NB, BS, H), "float32", "cpu", "torch")
    if m.per_tensor:
        kw["k_scale"] = kw["v_scale"] = 0.5
    return args, kw


def _snapshot(args, kw):
    tensors = [args["key_cache"], args["value_cache"], kw.get("k_scale_cache"), kw.get("v_scale_cache")]
    return [(t, t.clone()) for t in tensors if isinstance(t, torch.Tensor) and t.device.type != "meta"]


def _assert_untouched(snapshot):
    for t, before in snapshot:
        assert_same_bytes(t, before, "cache after a rejected call")


WRITE_ERRORS = {
    # name: (mutation, words the message must contain)
    "key dtype": (lambda a, k: a.update(key=a["key"].to(torch.float64)), ["key", "dtype"]),
    "value shape": (lambda a, k: a.update(value=a["value"][:, :1]), ["value", "shape"]),
    "key ndim": (lambda a, k: a.update(key=a["key"].reshape(T, -1)), ["key", "dimensions"]),
    "cache dtype": (
        lambda a, k: a.update(key_cache=a["key_cache"].view(torch.uint8).to(torch.float16)),
        ["key_cache", "dtype"],
    ),
    "cache head_size": (lambda a, k: a.update(value_cache=a["value_cache"][..., :32]), ["value_cache", "shape"]),
    "slot out of range": (lambda a, k: a["slot_mapping"].__setitem__(2, NB * BS), ["slot_mapping", "out of range"]),
    "slot repeated": (
        lambda a, k: a["slot_mapping"].__setitem__(1, int(a["slot_mapping"][0])),
        ["slot_mapping", "more than once"],
    ),
    "slot dtype": (lambda a, k: a.update(slot_mapping=a["slot_mapping"].float()), ["slot_mapping", "dtype"]),
    "slot length": (lambda a, k: a.update(slot_mapping=a["slot_mapping"][:-1]), ["slot_mapping", "shape"]),
    "scale cache missing": (lambda a, k: k.pop("k_scale_cache"), ["k_scale_cache", "required"]),
    "scale cache dtype": (lambda a, k: k.update(v_scale_cache=k["v_scale_cache"].half()), ["v_scale_cache", "dtype"]),
    "scale cache shape": (
        lambda a, k: k.update(k_scale_cache=k["k_scale_cache"][:, :, :1]),
        ["k_scale_cache", "shape"],
    ),
    "unknown mode": (lambda a, k: k.update(mode="int4_magic"), ["mode", "int8_per_token_head"]),
    "rounding": (lambda a, k: k.update(rounding="up"), ["rounding", "nearest"]),
    "device": (
        lambda a, k: a.update(key_cache=torch.empty(NB, BS, H, D, dtype=torch.int8, device="meta")),
        ["device", "key_cache"],
    ),
    "not a tensor": (lambda a, k: a.update(key=[[1.0]]), ["key", "Tensor"]),
    "static scale on per-token-head": (lambda a, k: k.update(k_scale=1.0), ["k_scale", "not used"]),
    "unknown impl": (lambda a, k: k.update(impl="cuda-magic"), ["impl", "registered"]),
    # Two written arrays: the message names the other one's role in plain words.
    "caches alias": (
        lambda a, k: a.update(value_cache=a["key_cache"]),
        ["key_cache", "shares memory with value_cache, which this call also writes;"],
    ),
    "key inside the key cache": (
        lambda a, k: a.update(key=a["key_cache"].view(torch.bfloat16).reshape(-1)[: T * H * D].view(T, H, D)),
        ["key_cache: shares memory with key, which this call also reads;"],
    ),
}


@pytest.mark.parametrize("name", list(WRITE_ERRORS))
def test_reshape_and_cache_rejects(name):
    args, kw = _write_args()
    mutate, words = WRITE_ERRORS[name]
    mutate(args, kw)
    snapshot = _snapshot(args, kw)
    with pytest.raises((KVZooInputError, ValueError, TypeError)) as info:
        kvzoo.reshape_and_cache(*args.values(), **kw)
    for word in words:
        assert word in str(info.value), f"message {str(info.value)!r} lacks {word!r}"
    _assert_untouched(snapshot)


@pytest.mark.parametrize(
    "mode, mutate, words",
    [
        ("fp8_per_tensor", lambda a, k: k.pop("k_scale"), ["k_scale", "required"]),
        ("fp8_per_tensor", lambda a, k: k.update(v_scale=-1.0), ["v_scale", "> 0"]),
        ("fp8_per_token_head", lambda a, k: k.update(rounding="trunc"), ["rounding", "int8"]),
        (
            "none",
            lambda a, k: a.update(key_cache=a["key_cache"].half(), value_cache=a["value_cache"].half()),
            ["key_cache", "bfloat16"],
        ),
    ],
)
def test_mode_specific_rejections(mode, mutate, words):
    args, kw = _write_args(mode)
    mutate(args, kw)
    snapshot = _snapshot(args, kw)
    with pytest.raises(KVZooInputError) as info:
        kvzoo.reshape_and_cache(*args.values(), **kw)
    for word in words:
        assert word in str(info.value)
    _assert_untouched(snapshot)


def test_check_finite_rejects_poisoned_rows():
    args, kw = _write_args()
    args["value"][3, 1, 7] = float("inf")
    snapshot = _snapshot(args, kw)
    with pytest.raises(KVZooInputError, match=r"value: holds 1 non-finite values \(first at index \(3, 1, 7\)"):
        kvzoo.reshape_and_cache(*args.values(), **kw, check_finite=True)
    _assert_untouched(snapshot)
    kvzoo.reshape_and_cache(*args.values(), **kw)  # without the check the row is stored, poisoned


def _attention_args():
    rng = rng_for("attention-errors")
    seq_lens = torch.tensor([5, 20, 1], dtype=torch.int32)
    q_lens = [1, 4, 1]
    return dict(
        query=torch.randn(sum(q_lens), 8, D, dtype=torch.bfloat16),
        key_cache=random_bytes(rng, (NB, BS, H, D), "int8", "cpu", "torch"),
        value_cache=random_bytes(rng, (NB, BS, H, D), "int8", "cpu", "torch"),
    ), dict(
        mode="int8_per_token_head",
        k_scale_cache=torch.rand(NB, BS, H) + 0.01,
        v_scale_cache=torch.rand(NB, BS, H) + 0.01,
        block_tables=torch.tensor([[0, 1], [2, 3], [1, 0]], dtype=torch.int32),
        seq_lens=seq_lens,
        query_start_loc=torch.tensor([0, 1, 5, 6], dtype=torch.int32),
    )


ATTENTION_ERRORS = {
    "block id out of range": (lambda a, k: k["block_tables"].__setitem__((1, 1), NB), ["block_tables", "out of range"]),
    "negative block id": (lambda a, k: k["block_tables"].__setitem__((0, 0), -1), ["block_tables", "-1"]),
    "seq_lens vs query_start_loc": (lambda a, k: k["seq_lens"].__setitem__(1, 3), ["seq_lens", "query tokens"]),
    "query_start_loc end": (lambda a, k: k["query_start_loc"].__setitem__(3, 5), ["query_start_loc", "num_tokens"]),
    "seq too long": (lambda a, k: k["seq_lens"].__setitem__(0, 2 * BS + 1), ["seq_lens", "blocks"]),
    "heads not a multiple": (lambda a, k: a.update(query=a["query"][:, :3]), ["num_q_heads", "multiple"]),
    "head size": (lambda a, k: a.update(query=a["query"][..., :32]), ["key_cache", "shape"]),
    "query dtype": (lambda a, k: a.update(query=a["query"].to(torch.int32)), ["query", "dtype"]),
    "sinks shape": (lambda a, k: k.update(sinks=torch.zeros(3)), ["sinks", "shape"]),
    "window": (lambda a, k: k.update(sliding_window=0), ["sliding_window"]),
    "softcap": (lambda a, k: k.update(softcap=-1.0), ["softcap"]),
    "out dtype": (lambda a, k: k.update(out=torch.empty(6, 8, D)), ["out", "dtype"]),
    "v scales missing": (lambda a, k: k.pop("v_scale_cache"), ["v_scale_cache", "required"]),
    "num_prefills over num_seqs": (
        lambda a, k: k.update(num_prefills=4, validate=False, max_query_len=4, max_seq_len=20),
        ["num_prefills", "num_seqs=3"],
    ),
    "quantize_query on fp8": (
        lambda a, k: k.update(mode="fp8_per_token_head", quantize_query=True),
        ["quantize_query", "int8", "fp8_per_token_head"],
    ),
    "fp8_dots on int8": (lambda a, k: k.update(fp8_dots=True), ["fp8_dots", "e4m3fn", "int8_per_token_head"]),
    "fp8_dots with quantize_query": (
        lambda a, k: k.update(fp8_dots=True, quantize_query=True),
        ["fp8_dots", "quantize_query"],
    ),
}


@pytest.mark.parametrize("name", list(ATTENTION_ERRORS))
def test_paged_attention_rejects(name):
    args, kw = _attention_args()
    mutate, words = ATTENTION_ERRORS[name]
    mutate(args, kw)
    with pytest.raises(KVZooInputError) as info:
        kvzoo.paged_attention(*args.values(), **kw)
    for word in words:
        assert word in str(info.value), f"message {str(info.value)!r} lacks {word!r}"


def test_dequantize_rejects_block_ids():
    cache = torch.randint(-128, 127, (NB, BS, H, D), dtype=torch.int8)
    with pytest.raises(KVZooInputError, match="block_tables"):
        kvzoo.dequantize(
            cache,
            torch.rand(NB, BS, H),
            mode="int8_per_token_head",
            block_tables=torch.tensor([[0, NB + 3]], dtype=torch.int32),
            seq_lens=torch.tensor([BS + 1], dtype=torch.int32),
        )


def test_get_kv_quant_mode_lists_valid_names():
    assert kvzoo.get_kv_quant_mode("fp8") is kvzoo.MODES["fp8_per_tensor"]
    assert kvzoo.get_kv_quant_mode("auto").name == "none"
    with pytest.raises(ValueError, match="int8_per_token_head") as info:
        kvzoo.get_kv_quant_mode("int3")
    assert "'int3'" in str(info.value)


# --------------------------------------------------------------------------------------------
# property: random calls, valid ones match the oracle, invalid ones raise and write nothing

FAULTS = ("none", "slot_range", "slot_repeat", "cache_dtype", "scale_shape", "token_count")


# Drawn from the session seed: fresh every run, replayed with KVZOO_SEED like the rest.
@seed(SEED)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mode=st.sampled_from(sorted(kvzoo.MODES)),
    num_tokens=st.integers(0, 12),
    heads=st.integers(1, 3),
    head_size=st.sampled_from([8, 12, 33]),
    block_size=st.sampled_from([1, 4, 16]),
    fault=st.sampled_from(FAULTS),
    seed=st.integers(0, 2**32 - 1),
)
def test_random_calls(mode, num_tokens, heads, head_size, block_size, fault, seed):
    rng = np.random.default_rng(seed)
    m = kvzoo.get_kv_quant_mode(mode)
    head_size = m.head_sizes.closest(head_size)  # int4: even sizes only, _norot powers of two
    num_blocks = num_tokens // block_size + 2
    key32 = (rng.standard_normal((num_tokens, heads, head_size)) * 3).astype(np.float32)
    val32 = (rng.standard_normal((num_tokens, heads, head_size)) * 3).astype(np.float32)
    key = torch.from_numpy(key32).half()
    value = torch.from_numpy(val32).half()
    kc, vc = (
        random_bytes(
            rng,
            (num_blocks, block_size, heads, side.cache_width(head_size)),
            side.code_dtype or "float16",
            "cpu",
            "torch",
        )
        for side in (m.key_side, m.value_side)
    )
    scale_shape = (num_blocks, block_size, heads)
    ks = random_bytes(rng, scale_shape, "float32", "cpu", "torch") if m.per_token_head else None
    vs = random_bytes(rng, scale_shape, "float32", "cpu", "torch") if m.per_token_head else None
    slots = rng.permutation(num_blocks * block_size)[:num_tokens].astype(np.int64)
    slots[rng.random(num_tokens) < 0.2] = -1
    static = 0.25 if m.per_tensor else None
    invalid = fault != "none"
    if fault == "slot_range" and num_tokens:
        slots[rng.integers(num_tokens)] = num_blocks * block_size + int(rng.integers(0, 5))
    elif fault == "slot_repeat" and num_tokens >= 2:
        slots[0] = slots[1] = abs(int(slots[1])) % (num_blocks * block_size)
    elif fault == "cache_dtype":
        kc = kc.view(torch.uint8).to(torch.int32)
    elif fault == "scale_shape" and m.per_token_head:
        ks = ks[:, :, :0]
    elif fault == "token_count":
        slots = np.concatenate([slots, [0]])
    else:
        invalid = False
    snapshot = [(t, t.clone()) for t in (kc, vc, ks, vs) if t is not None]
    call = lambda: kvzoo.reshape_and_cache(  # noqa: E731
        key,
        value,
        kc,
        vc,
        torch.from_numpy(slots),
        mode=mode,
        k_scale_cache=ks,
        v_scale_cache=vs,
        k_scale=static,
        v_scale=static,
    )
    if invalid:
        with pytest.raises(KVZooInputError):
            call()
        _assert_untouched(snapshot)
        return
    call()
    expect_in = (key.numpy(), value.numpy())  # fp16: the oracle widens it exactly (and int4 rounds to it)
    before = [host_bytes(b) for _, b in snapshot]
    view = (lambda b: b.view(np.float16)[..., 0]) if m.code_dtype is None else (lambda b: b[..., 0])
    want = samples.oracle_write(
        m,
        *expect_in,
        slots,
        num_blocks=num_blocks,
        block_size=block_size,
        k_scale=static,
        v_scale=static,
        key_cache=view(before[0]),
        value_cache=view(before[1]),
        k_scale_cache=None if ks is None else before[2].view(np.float32)[..., 0],
        v_scale_cache=None if vs is None else before[3].view(np.float32)[..., 0],
    )
    for got, exp in zip((kc, vc, ks, vs), want):
        if exp is not None:
            assert_same_bytes(got, exp, f"{mode} random call")
