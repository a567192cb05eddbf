"""kvzoo.plan: a step's metadata checked once, then write + attention per layer.

The plan's results must be the functional API's bytes (caches, scales, outputs) with the same
implementation; bad metadata is refused at plan time, bad per-layer arrays at the call, before
anything is written; and the per-layer calls read no device data.
"""

from __future__ import annotations

import doctest
import gc
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import kvzoo
import kvzoo.plan
from kvzoo import KVZooInputError
from kvzoo.layout import KVCacheTensors, inline_views
from kvzoo.registry import Implementation

from support import assert_same_bytes, host_bytes, random_bytes, rng_for

ROOT = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()

BS, NB, HKV, HQ, D = 8, 10, 2, 4, 32
# A prefill chunk of 5 tokens after 3 cached ones, a decode at position 12, a fresh prefill of 4.
Q_LENS, SEQ_LENS = (5, 1, 4), (8, 13, 4)
TABLE = ((3, 9), (5, 1), (7, 9))  # column 1 of sequences 0 and 2 is unused
T = sum(Q_LENS)

SEPARATE = ("none", "int8_per_token_head", "fp8_per_token_head", "fp8_per_tensor", "int4_per_token_head")
INLINE = ("int8_per_token_head", "fp8_per_token_head")
CONFIGS = [(m, "separate") for m in SEPARATE] + [(m, "inline") for m in INLINE]


IMPLS = ("numpy", "numba", "triton-cuda")


def _impl_or_skip(name: str) -> Implementation:
    impl = kvzoo.registry.get("paged_attention", name)
    if not impl.available:
        pytest.skip(f"{name}: {'; '.join(impl.unavailable())}")
    return impl


def _device(impl: Implementation) -> str:
    return "cuda" if "cuda" in impl.devices else "cpu"


def metadata(device: str = "cpu", q_lens=Q_LENS, seq_lens=SEQ_LENS, table=TABLE, block_size=BS) -> dict:
    """The step's index tensors (int32), and the slots of the context written before it."""
    slots, context = [], []
    for s, (q, n) in enumerate(zip(q_lens, seq_lens)):
        where = [table[s][p // block_size] * block_size + p % block_size for p in range(n)]
        context += where[: n - q]
        slots += where[n - q :]
    i32 = dict(dtype=torch.int32, device=device)
    return dict(
        block_tables=torch.tensor(table, **i32),
        seq_lens=torch.tensor(seq_lens, **i32),
        query_start_loc=torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), **i32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        context_slots=torch.tensor(context, dtype=torch.int64, device=device),
    )


def spec_for(mode: str, layout: str, device: str | None = "cpu", model_dtype: str = "bfloat16") -> kvzoo.CacheSpec:
    return kvzoo.CacheSpec(
        mode,
        num_blocks=NB,
        block_size=BS,
        num_kv_heads=HKV,
        head_size=D,
        layout=layout,
        model_dtype=model_dtype,
        device=device,
    )


def poisoned(spec: kvzoo.CacheSpec, rng: np.random.Generator) -> KVCacheTensors:
    """A cache of `spec` filled with random bytes (never zeros)."""
    device, kind = spec.device or "cpu", "torch" if spec.device is not None else "numpy"
    if spec.layout == "inline":
        shape = (spec.num_blocks, 2, spec.block_size, spec.num_kv_heads, spec.head_size + 4)
        return inline_views(random_bytes(rng, shape, "uint8", device, kind), spec.head_size, spec.mode)
    scales = (
        [random_bytes(rng, spec.scale_shape, "float32", device, kind) for _ in range(2)]
        if spec.mode.per_token_head
        else [None, None]
    )
    codes = (
        random_bytes(rng, spec.side_shape(side), side.code_dtype or spec.model_dtype, device, kind)
        for side in (spec.mode.key_side, spec.mode.value_side)
    )
    return KVCacheTensors(*codes, *scales)


def clone(c: KVCacheTensors) -> KVCacheTensors:
    def copy(x):
        return None if x is None else (x.clone() if isinstance(x, torch.Tensor) else x.copy())

    if c.buffer is not None:
        # Views of a fresh copy of the buffer, laid out as the original's.
        mode = "int8_per_token_head" if c.key_cache.dtype in (torch.int8, np.int8) else "fp8_per_token_head"
        return inline_views(copy(c.buffer), c.key_cache.shape[-1], mode)
    return KVCacheTensors(*(copy(x) for x in (c.key_cache, c.value_cache, c.k_scale_cache, c.v_scale_cache)))


def cache_arrays(c: KVCacheTensors) -> list:
    return [x for x in (c.buffer,) if x is not None] or [
        x for x in (c.key_cache, c.value_cache, c.k_scale_cache, c.v_scale_cache) if x is not None
    ]


def scales_of(spec: kvzoo.CacheSpec) -> dict:
    return dict(k_scale=0.75, v_scale=1.25) if spec.mode.per_tensor else {}


def functional_write(key, value, c: KVCacheTensors, slots, spec, impl) -> None:
    kvzoo.reshape_and_cache(
        key,
        value,
        c.key_cache,
        c.value_cache,
        slots,
        mode=spec.mode,
        k_scale_cache=c.k_scale_cache,
        v_scale_cache=c.v_scale_cache,
        impl=impl,
        **scales_of(spec),
    )


def functional_attention(query, c: KVCacheTensors, meta: dict, spec, impl, **options):
    """kvzoo.paged_attention over cache c with meta's index tensors: the reference a plan's
    attention is held to."""
    return kvzoo.paged_attention(
        query,
        c.key_cache,
        c.value_cache,
        mode=spec.mode,
        **{k: meta[k] for k in ("block_tables", "seq_lens", "query_start_loc")},
        k_scale_cache=c.k_scale_cache,
        v_scale_cache=c.v_scale_cache,
        impl=impl,
        **options,
    )


def rows(rng, shape, dtype: str, device: str):
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(getattr(torch, dtype)).to(device)


# ------------------------------------------------------------------------------------------
# Byte equality with the functional API


def compare_with_functional(
    spec: kvzoo.CacheSpec, meta: dict, num_q_heads: int, impl_name: str, rng, layers: int = 2
) -> kvzoo.StepPlan:
    """Poisoned caches, context written, then a step through the plan and through the functional
    API on copies: every cache byte and every output byte must agree."""
    device, h, d = spec.device, spec.num_kv_heads, spec.head_size
    tokens = int(meta["slot_mapping"].shape[0])
    cases = []
    for _ in range(layers):  # several layers: the later ones meet the plan's remembered checks
        c = poisoned(spec, rng)
        # The context tokens this step attends to, as earlier steps wrote them.
        n = int(meta["context_slots"].shape[0])
        functional_write(
            rows(rng, (n, h, d), spec.model_dtype, device),
            rows(rng, (n, h, d), spec.model_dtype, device),
            c,
            meta["context_slots"],
            spec,
            "numpy" if device == "cpu" else impl_name,
        )
        cases.append(
            (
                c,
                clone(c),
                rows(rng, (tokens, h, d), spec.model_dtype, device),
                rows(rng, (tokens, h, d), spec.model_dtype, device),
                rows(rng, (tokens, num_q_heads, d), spec.model_dtype, device),
            )
        )
    index = {k: meta[k] for k in ("block_tables", "seq_lens", "query_start_loc")}
    plan = kvzoo.plan_step(spec, **index, slot_mapping=meta["slot_mapping"], num_q_heads=num_q_heads, impl=impl_name)
    assert plan.write_impl.name == plan.attention_impl.name == impl_name
    for mine, theirs, key, value, query in cases:
        plan.write(key, value, mine, **scales_of(spec))
        out = plan.attention(query, mine, **scales_of(spec))
        functional_write(key, value, theirs, meta["slot_mapping"], spec, impl_name)
        expected = functional_attention(query, theirs, index, spec, impl_name, **scales_of(spec))
        for a, b in zip(cache_arrays(mine), cache_arrays(theirs)):
            assert_same_bytes(a, b, f"{spec.mode.name} {spec.layout} cache after write")
        assert_same_bytes(out, expected, f"{spec.mode.name} {spec.layout} attention output")
        assert torch.isfinite(out.float()).all()
    return plan


@pytest.mark.parametrize("impl_name", IMPLS)
@pytest.mark.parametrize("mode,layout", CONFIGS)
def test_plan_matches_functional_bytes(mode, layout, impl_name):
    impl = _impl_or_skip(impl_name)
    if mode not in impl.modes:
        pytest.skip(f"{impl_name}: does not register mode {mode}")
    device = _device(impl)
    plan = compare_with_functional(
        spec_for(mode, layout, device), metadata(device), HQ, impl_name, rng_for("plan bytes", mode, layout, impl_name)
    )
    assert (plan.max_query_len, plan.max_seq_len, plan.num_prefills, plan.num_tokens) == (5, 13, 2, T)


@pytest.mark.gpu_only
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode,layout", CONFIGS)
def test_plan_matches_functional_bytes_on_the_gpu(mode, layout):
    # A mixed batch at real head sizes: a staged prefill (>= 128 query tokens), decodes with
    # split-KV, a short prefill; three layers.
    if mode not in kvzoo.registry.get("paged_attention", "triton-cuda").modes:
        pytest.skip(f"triton-cuda: does not register mode {mode}")
    q_lens, seq_lens, bs = (130, 1, 1, 40), (300, 77, 1500, 40), 16
    per_seq = -(-max(seq_lens) // bs)
    order = np.random.default_rng(16).permutation(len(q_lens) * per_seq).reshape(len(q_lens), per_seq)
    spec = kvzoo.CacheSpec(
        mode,
        num_blocks=len(q_lens) * per_seq,
        block_size=bs,
        num_kv_heads=2,
        head_size=128,
        layout=layout,
        model_dtype="bfloat16",
        device="cuda",
    )
    meta = metadata("cuda", q_lens, seq_lens, order.tolist(), bs)
    plan = compare_with_functional(spec, meta, 8, "triton-cuda", rng_for("plan bytes gpu", mode, layout), layers=3)
    assert (plan.max_query_len, plan.max_seq_len, plan.num_prefills) == (130, 1500, 2)


@pytest.mark.parametrize("impl_name", ("numpy", "numba"))
def test_numpy_arrays_and_options_match_functional(impl_name):
    # NumPy arrays throughout (spec device None), fp32 model dtype, and attention options.
    _impl_or_skip(impl_name)
    spec = spec_for("int8_per_token_head", "separate", None, "float32")
    rng = rng_for("plan numpy", impl_name)
    meta = {k: v.numpy() for k, v in metadata().items()}
    c = poisoned(spec, rng)
    key, value = (rng.standard_normal((T, HKV, D)).astype(np.float32) for _ in range(2))
    query = rng.standard_normal((T, HQ, D)).astype(np.float32)
    sinks = rng.standard_normal(HQ).astype(np.float32)
    options = dict(softmax_scale=0.3, sliding_window=6, softcap=20.0)
    index = {k: meta[k] for k in ("block_tables", "seq_lens", "query_start_loc")}
    theirs = clone(c)
    plan = kvzoo.plan_step(
        spec, **index, slot_mapping=meta["slot_mapping"], num_q_heads=HQ, sinks=sinks, impl=impl_name, **options
    )
    plan.write(key, value, c)
    out = np.zeros((T, HQ, D), np.float32)
    assert plan.attention(query, c, out=out) is out
    functional_write(key, value, theirs, meta["slot_mapping"], spec, impl_name)
    expected = functional_attention(query, theirs, index, spec, impl_name, sinks=sinks, **options)
    for a, b in zip(cache_arrays(c), cache_arrays(theirs)):
        assert_same_bytes(a, b, "cache after write")
    assert_same_bytes(out, expected, "attention output")
    # A layer's own sinks replace the plan's (gpt-oss learns them per layer).
    layer_sinks = rng.standard_normal(HQ).astype(np.float32)[::-1]  # negative stride, as NumPy allows
    expected = functional_attention(query, theirs, index, spec, impl_name, sinks=layer_sinks, **options)
    assert_same_bytes(plan.attention(query, c, sinks=layer_sinks), expected, "attention with a layer's sinks")


def test_paged_kv_cache_object_and_quantize_query():
    # A PagedKVCache serves as caches (its static scales too); quantize_query goes to numpy,
    # as the registry picks for the functional call (numba declines it).
    spec = spec_for("int8_per_token_head", "inline", model_dtype="float32")
    cache = kvzoo.PagedKVCache(NB, BS, HKV, D, "int8_per_token_head", layout="inline", device="cpu")
    meta = metadata()
    index = {k: meta[k] for k in ("block_tables", "seq_lens", "query_start_loc")}
    rng = rng_for("plan paged")
    key, value, query = (
        torch.from_numpy(rng.standard_normal(s).astype(np.float32)) for s in ((T, HKV, D), (T, HKV, D), (T, HQ, D))
    )
    plan = kvzoo.plan_step(spec, **index, slot_mapping=meta["slot_mapping"], num_q_heads=HQ, quantize_query=True)
    assert plan.attention_impl.name == "numpy"
    plan.write(key, value, cache)
    out = plan.attention(query, cache)
    expected = cache.attention(query, **index, quantize_query=True)
    assert_same_bytes(out, expected, "attention output")

    per_tensor = kvzoo.PagedKVCache(
        NB, BS, HKV, D, "fp8_per_tensor", device="cpu", model_dtype="float32", k_scale=0.5, v_scale=2.0
    )
    twin = kvzoo.PagedKVCache(
        NB, BS, HKV, D, "fp8_per_tensor", device="cpu", model_dtype="float32", k_scale=0.5, v_scale=2.0
    )
    plan = kvzoo.plan_step(
        spec_for("fp8_per_tensor", "separate", model_dtype="float32"),
        **index,
        slot_mapping=meta["slot_mapping"],
        num_q_heads=HQ,
    )
    plan.write(key, value, per_tensor)
    twin.write(key, value, meta["slot_mapping"])
    assert_same_bytes(per_tensor.tensors.key_cache, twin.tensors.key_cache, "fp8_per_tensor key cache")
    assert_same_bytes(plan.attention(query, per_tensor), twin.attention(query, **index), "fp8_per_tensor output")
    with pytest.raises(KVZooInputError, match="caches: a PagedKVCache of mode"):
        plan.write(key, value, cache)


def test_metadata_updated_in_place_is_what_the_next_call_reads():
    # Kept by reference: an engine rewrites its persistent buffers between replays.
    spec = spec_for("int8_per_token_head", "separate", model_dtype="float32")
    meta = metadata()
    index = {k: meta[k] for k in ("block_tables", "seq_lens", "query_start_loc")}
    plan = kvzoo.plan_step(spec, **index, slot_mapping=meta["slot_mapping"], num_q_heads=HQ, impl="numpy")
    assert plan.slot_mapping is not None
    rng = rng_for("plan in place")
    c = poisoned(spec, rng)
    theirs = clone(c)
    key, value, query = (
        torch.from_numpy(rng.standard_normal(s).astype(np.float32)) for s in ((T, HKV, D), (T, HKV, D), (T, HQ, D))
    )
    # Within the plan's bounds: the decode moves back by one position, its slot with it.
    meta["seq_lens"][1] = 12
    meta["slot_mapping"][5] = TABLE[1][1] * BS + 3
    plan.write(key, value, c)
    out = plan.attention(query, c)
    functional_write(key, value, theirs, meta["slot_mapping"], spec, "numpy")
    expected = functional_attention(query, theirs, index, spec, "numpy")
    for a, b in zip(cache_arrays(c), cache_arrays(theirs)):
        assert_same_bytes(a, b, "cache after write")
    assert_same_bytes(out, expected, "attention output")


def test_strided_metadata_is_copied_once_for_unit_stride_kernels():
    impl = _impl_or_skip("triton-cuda")

    def strided_table(device):
        wide = torch.zeros((3, 4), dtype=torch.int32, device=device)
        wide[:, ::2] = torch.tensor(TABLE, dtype=torch.int32)
        return wide[:, ::2]  # stride 2 along a row: the Triton kernels need 1

    meta = metadata(_device(impl))
    strided = strided_table(_device(impl))
    plan = kvzoo.plan_step(
        spec_for("int8_per_token_head", "separate", _device(impl)),
        block_tables=strided,
        seq_lens=meta["seq_lens"],
        query_start_loc=meta["query_start_loc"],
        num_q_heads=HQ,
        impl="triton-cuda",
    )
    assert plan.block_tables.stride(-1) == 1 and torch.equal(plan.block_tables, strided)
    meta, strided = metadata(), strided_table("cpu")
    plan = kvzoo.plan_step(
        spec_for("int8_per_token_head", "separate"),
        block_tables=strided,
        seq_lens=meta["seq_lens"],
        query_start_loc=meta["query_start_loc"],
        num_q_heads=HQ,
        impl="numpy",
    )
    assert plan.block_tables.strides[-1] == 8  # a NumPy view of the caller's tensor, no copy


def test_bounds_given_with_validation_are_kept_and_checked():
    spec = spec_for("int8_per_token_head", "separate")
    meta = metadata()
    index = {k: meta[k] for k in ("block_tables", "seq_lens", "query_start_loc")}
    plan = kvzoo.plan_step(spec, **index, num_q_heads=HQ, max_query_len=8, max_seq_len=16, num_prefills=3)
    assert (plan.max_query_len, plan.max_seq_len, plan.num_prefills) == (8, 16, 3)
    with pytest.raises(KVZooInputError, match="max_seq_len: 12 is below"):
        kvzoo.plan_step(spec, **index, num_q_heads=HQ, max_seq_len=12)
    with pytest.raises(KVZooInputError, match="num_prefills"):
        kvzoo.plan_step(spec, **index, num_q_heads=HQ, num_prefills=4)
    # Without validation the values are read when a max_* bound is missing; the plan keeps
    # the one given, so it is held to them as well.
    plan = kvzoo.plan_step(spec, **index, num_q_heads=HQ, max_seq_len=40, validate=False)
    assert (plan.max_query_len, plan.max_seq_len) == (int(np.diff(meta["query_start_loc"]).max()), 40)
    with pytest.raises(KVZooInputError, match="max_seq_len: 12 is below"):
        kvzoo.plan_step(spec, **index, num_q_heads=HQ, max_seq_len=12, validate=False)


# ------------------------------------------------------------------------------------------
# Refusals


def _good(**changes) -> dict:
    meta = metadata()
    args = dict(
        block_tables=meta["block_tables"],
        seq_lens=meta["seq_lens"],
        query_start_loc=meta["query_start_loc"],
        slot_mapping=meta["slot_mapping"],
        num_q_heads=HQ,
    )
    args.update(changes)
    return args


def _set(name, index, value):
    def change(args):
        args[name] = args[name].clone()
        args[name][index] = value

    return change


PLAN_ERRORS = {
    # case: (change to the arguments, the argument named)
    "block id out of range": (_set("block_tables", (1, 1), NB), "block_tables"),
    "negative block id": (_set("block_tables", (0, 0), -1), "block_tables"),
    "slot out of range": (_set("slot_mapping", 2, NB * BS), "slot_mapping"),
    "slot repeated": (_set("slot_mapping", 1, int(metadata()["slot_mapping"][0])), "slot_mapping"),
    "seq_lens shorter than the query": (_set("seq_lens", 1, 0), "seq_lens"),
    "seq_lens past the table": (_set("seq_lens", 0, 2 * BS + 1), "seq_lens"),
    "query_start_loc decreasing": (_set("query_start_loc", 2, 3), "query_start_loc"),
    "block_tables 1-D": (lambda a: a.update(block_tables=a["block_tables"][0]), "block_tables"),
    "block_tables float": (lambda a: a.update(block_tables=a["block_tables"].float()), "block_tables"),
    "seq_lens length": (lambda a: a.update(seq_lens=a["seq_lens"][:2]), "query_start_loc"),
    "block_tables rows": (lambda a: a.update(block_tables=a["block_tables"][:2]), "seq_lens"),
    "query_start_loc length": (lambda a: a.update(query_start_loc=a["query_start_loc"][:3]), "query_start_loc"),
    "slot_mapping 2-D": (lambda a: a.update(slot_mapping=a["slot_mapping"][None]), "slot_mapping"),
    "slot_mapping float": (lambda a: a.update(slot_mapping=a["slot_mapping"].double()), "slot_mapping"),
    "num_q_heads not a multiple": (lambda a: a.update(num_q_heads=3), "num_q_heads"),
    "num_q_heads bool": (lambda a: a.update(num_q_heads=True), "num_q_heads"),
    "sinks shape": (lambda a: a.update(sinks=torch.zeros(HQ + 1)), "sinks"),
    "sinks dtype": (lambda a: a.update(sinks=torch.zeros(HQ, dtype=torch.float16)), "sinks"),
    "softcap zero": (lambda a: a.update(softcap=0.0), "softcap"),
    "softmax_scale nan": (lambda a: a.update(softmax_scale=float("nan")), "softmax_scale"),
    "sliding_window float": (lambda a: a.update(sliding_window=2.0), "sliding_window"),
    "quantize_query on fp8": (
        lambda a: a.update(quantize_query=True, spec=spec_for("fp8_per_token_head", "separate")),
        "quantize_query",
    ),
    "fp8_dots on int8": (lambda a: a.update(fp8_dots=True), "fp8_dots"),
    "fp8_dots with quantize_query": (
        lambda a: a.update(fp8_dots=True, quantize_query=True, spec=spec_for("fp8_per_token_head", "separate")),
        "fp8_dots",
    ),
    "requires_grad": (lambda a: a.update(sinks=torch.zeros(HQ, requires_grad=True)), "sinks"),
    "unknown impl": (lambda a: a.update(impl="nope"), "impl"),
    "impl mapping of another op": (lambda a: a.update(impl={"dequantize": "numpy"}), "impl"),
    "max_query_len negative": (lambda a: a.update(validate=False, max_query_len=-1, max_seq_len=4), "max_query_len"),
    "spec device": (
        lambda a: a.update(spec=spec_for("int8_per_token_head", "separate", device="cuda")),
        "block_tables",
    ),
    "not a spec": (lambda a: a.update(spec="int8_per_token_head"), "cache_spec"),
}


@pytest.mark.parametrize("case", sorted(PLAN_ERRORS))
def test_plan_refuses_bad_metadata_naming_the_argument(case):
    change, name = PLAN_ERRORS[case]
    args = _good(spec=spec_for("int8_per_token_head", "separate"))
    change(args)
    spec = args.pop("spec")
    with pytest.raises(KVZooInputError) as info:
        kvzoo.plan_step(spec, **args)
    assert str(info.value).startswith(name), str(info.value)


@pytest.mark.parametrize(
    "changes,name",
    [
        (dict(layout="paged"), "layout"),
        (dict(layout="inline", mode="fp8_per_tensor"), "layout"),
        (dict(layout="inline", head_size=30), "head_size"),
        (dict(model_dtype="float64"), "model_dtype"),
        (dict(num_blocks=0), "num_blocks"),
        (dict(num_blocks=2**28, block_size=16), "num_blocks"),
        (dict(mode="fp8_inc"), "mode"),
        (dict(device="meta"), "device"),
        (dict(rounding="trunc", mode="fp8_per_token_head"), "rounding"),
        (dict(mode="int4_per_token_head", head_size=95), "head_size"),  # two codes a byte: even sizes
        (dict(mode="int4_per_token_head_norot", head_size=96), "head_size"),  # powers of two only
        (dict(mode="int4_per_token_head", head_size=514), "head_size"),  # past the sign table
        (dict(mode="int4_per_token_head_norot", layout="inline"), "layout"),
    ],
)
def test_cache_spec_refuses_bad_fields(changes, name):
    fields = dict(mode="int8_per_token_head", num_blocks=NB, block_size=BS, num_kv_heads=HKV, head_size=D)
    fields.update(changes)
    with pytest.raises(KVZooInputError) as info:
        kvzoo.CacheSpec(fields.pop("mode"), **fields)
    assert str(info.value).startswith(name), str(info.value)


def _plan_and_layer(mode="int8_per_token_head", layout="separate"):
    spec = spec_for(mode, layout)
    plan = kvzoo.plan_step(spec, **_good(), impl="numpy")
    rng = rng_for("plan refusals", mode, layout)
    c = poisoned(spec, rng)
    key, value = rows(rng, (T, HKV, D), "bfloat16", "cpu"), rows(rng, (T, HKV, D), "bfloat16", "cpu")
    query = rows(rng, (T, HQ, D), "bfloat16", "cpu")
    return spec, plan, c, key, value, query


LAYER_ERRORS = {
    # case: (call(plan, caches, key, value, query), the argument named)
    "key dtype": (lambda p, c, k, v, q: p.write(k.float(), v, c), "key"),
    "key rows": (lambda p, c, k, v, q: p.write(k[1:], v[1:], c), "key"),
    "key ndim": (lambda p, c, k, v, q: p.write(k.reshape(T, -1), v, c), "key"),
    "value shape": (lambda p, c, k, v, q: p.write(k, v[:, :1], c), "value"),
    "value dtype": (lambda p, c, k, v, q: p.write(k, v.half(), c), "value"),
    "key a list": (lambda p, c, k, v, q: p.write(k.tolist(), v, c), "key"),
    "key requires grad": (lambda p, c, k, v, q: p.write(k.float().requires_grad_(), v, c), "key"),
    "key reads key_cache": (
        lambda p, c, k, v, q: p.write(
            c.value_cache.view(torch.uint8).view(-1)[: T * HKV * D * 2].view(torch.bfloat16).view(T, HKV, D), v, c
        ),
        "value_cache",
    ),
    "caches of another spec": (
        lambda p, c, k, v, q: p.write(
            k,
            v,
            kvzoo.CacheSpec(
                "int8_per_token_head", num_blocks=NB + 1, block_size=BS, num_kv_heads=HKV, head_size=D
            ).allocate(),
        ),
        "key_cache",
    ),
    "caches of another layout": (
        lambda p, c, k, v, q: p.write(k, v, spec_for("int8_per_token_head", "inline").allocate()),
        "caches",
    ),
    "caches without scales": (
        lambda p, c, k, v, q: p.write(k, v, KVCacheTensors(c.key_cache, c.value_cache)),
        "k_scale_cache",
    ),
    "caches a tuple": (lambda p, c, k, v, q: p.write(k, v, (c.key_cache, c.value_cache)), "caches"),
    "cache dtype": (
        lambda p, c, k, v, q: p.write(
            k,
            v,
            KVCacheTensors(
                c.key_cache.view(torch.uint8).view(torch.int8).float(), c.value_cache, c.k_scale_cache, c.v_scale_cache
            ),
        ),
        "key_cache",
    ),
    "value_cache is key_cache": (
        lambda p, c, k, v, q: p.write(k, v, KVCacheTensors(c.key_cache, c.key_cache, c.k_scale_cache, c.v_scale_cache)),
        "key_cache",
    ),
    "static scale for a per-token-head mode": (lambda p, c, k, v, q: p.write(k, v, c, k_scale=1.0), "k_scale"),
    "query heads": (lambda p, c, k, v, q: p.attention(q[:, :2], c), "query"),
    "query rows": (lambda p, c, k, v, q: p.attention(q[1:], c), "query"),
    "query dtype": (lambda p, c, k, v, q: p.attention(q.half(), c), "query"),
    "out dtype": (lambda p, c, k, v, q: p.attention(q, c, out=torch.empty(T, HQ, D)), "out"),
    "out shape": (lambda p, c, k, v, q: p.attention(q, c, out=q[:, :, :16].clone()), "out"),
    "out is query": (lambda p, c, k, v, q: p.attention(q, c, out=q), "out"),
    "out broadcast": (lambda p, c, k, v, q: p.attention(q, c, out=q[:1].expand(T, HQ, D)), "out"),
    "out over key_cache": (
        lambda p, c, k, v, q: p.attention(
            q, c, out=c.key_cache.view(torch.uint8).view(-1)[: T * HQ * D * 2].view(torch.bfloat16).view(T, HQ, D)
        ),
        "out",
    ),
    "sinks override shape": (lambda p, c, k, v, q: p.attention(q, c, sinks=torch.zeros(HQ + 1)), "sinks"),
}


@pytest.mark.parametrize("case", sorted(LAYER_ERRORS))
def test_layer_call_refuses_bad_arrays_before_writing(case):
    call, name = LAYER_ERRORS[case]
    spec, plan, c, key, value, query = _plan_and_layer()
    before = [host_bytes(x).copy() for x in cache_arrays(c)]
    with pytest.raises(KVZooInputError) as info:
        call(plan, c, key, value, query)
    assert str(info.value).startswith(name), str(info.value)
    for x, b in zip(cache_arrays(c), before):
        assert np.array_equal(host_bytes(x), b), "cache bytes changed by a refused call"
    # The refusal was not remembered: the same caches then work.
    plan.write(key, value, c)
    plan.attention(query, c)


def test_step_plan_is_built_by_plan_step_only():
    with pytest.raises(TypeError, match="plan_step"):
        kvzoo.StepPlan()


def test_write_needs_a_plan_with_slot_mapping():
    spec, _, c, key, value, query = _plan_and_layer()
    plan = kvzoo.plan_step(spec, **_good(slot_mapping=None))
    with pytest.raises(KVZooInputError, match="slot_mapping"):
        plan.write(key, value, c)
    assert plan.attention(query, c).shape == query.shape


def _odd_strided_key(rng) -> np.ndarray:
    # float32 rows 2 bytes apart more than packed: NumPy reads them, numba cannot address them.
    buf = np.zeros(T * (HKV * D * 4 + 2) + 8, np.uint8)
    key = np.ndarray((T, HKV, D), np.float32, buf, 0, (HKV * D * 4 + 2, D * 4, 4))
    key[...] = rng.standard_normal((T, HKV, D))
    return key


def test_layer_a_planned_impl_declines_goes_where_the_functional_call_goes():
    _impl_or_skip("numba")
    spec = spec_for("int8_per_token_head", "separate", None, "float32")
    meta = {k: v.numpy() for k, v in metadata().items()}
    index = {k: meta[k] for k in ("block_tables", "seq_lens", "query_start_loc")}
    rng = rng_for("plan declines")
    key, value = _odd_strided_key(rng), rng.standard_normal((T, HKV, D)).astype(np.float32)
    forced = kvzoo.plan_step(spec, **index, slot_mapping=meta["slot_mapping"], num_q_heads=HQ, impl="numba")
    c = spec.allocate()
    with pytest.raises(KVZooInputError, match="impl='numba' cannot run this reshape_and_cache call"):
        forced.write(key, value, c)
    assert not c.key_cache.any()
    plan = kvzoo.plan_step(spec, **index, slot_mapping=meta["slot_mapping"], num_q_heads=HQ)
    assert plan.write_impl.name == "numba"
    theirs = spec.allocate()
    plan.write(key, value, c)
    functional_write(key, value, theirs, meta["slot_mapping"], spec, None)
    for a, b in zip(cache_arrays(c), cache_arrays(theirs)):
        assert_same_bytes(a, b, "cache after write")


# ------------------------------------------------------------------------------------------
# No device reads per layer


def _no_op(op: str) -> Implementation:
    return Implementation(
        f"no-op {op}",
        op,
        "any",
        frozenset(kvzoo.MODES),
        run=lambda problem: None,
        array_kind="torch",
        index_strides="unit",
    )


def _forbid_device_reads(monkeypatch) -> None:
    def read(*args, **kwargs):
        raise AssertionError("a per-layer call read device data")

    monkeypatch.setattr(kvzoo.validate, "host_ints", read)
    monkeypatch.setattr(kvzoo.calls, "host_ints", read)
    for method in ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "to"):
        monkeypatch.setattr(torch.Tensor, method, read)


@pytest.mark.parametrize("mode,layout", [("int8_per_token_head", "inline"), ("fp8_per_tensor", "separate")])
def test_layer_calls_read_no_device_data(monkeypatch, mode, layout):
    spec = spec_for(mode, layout)
    impls = {"reshape_and_cache": _no_op("reshape_and_cache"), "paged_attention": _no_op("paged_attention")}
    plan = kvzoo.plan_step(spec, **_good(), impl=impls)
    rng = rng_for("plan reads")
    layers = [poisoned(spec, rng) for _ in range(2)]
    key, value = rows(rng, (T, HKV, D), "bfloat16", "cpu"), rows(rng, (T, HKV, D), "bfloat16", "cpu")
    query = rows(rng, (T, HQ, D), "bfloat16", "cpu")
    out = torch.empty_like(query)
    scale = torch.tensor([0.5])
    scales = dict(k_scale=scale, v_scale=0.25) if spec.mode.per_tensor else {}
    _forbid_device_reads(monkeypatch)
    for _ in range(2):  # first sight of each caches object, then the remembered checks
        for c in layers:
            plan.write(key, value, c, **scales)
            plan.attention(query, c, **scales)
            plan.attention(query, c, out=out, **scales)


def test_layer_calls_with_a_real_backend_read_no_metadata(monkeypatch):
    # numba and numpy get NumPy views of CPU tensors (Tensor.numpy, a view); nothing calls
    # host_ints or reads a tensor's values through torch.
    spec = spec_for("int8_per_token_head", "separate")
    plan = kvzoo.plan_step(spec, **_good())
    rng = rng_for("plan reads real")
    c = poisoned(spec, rng)
    key, value = rows(rng, (T, HKV, D), "bfloat16", "cpu"), rows(rng, (T, HKV, D), "bfloat16", "cpu")
    query = rows(rng, (T, HQ, D), "bfloat16", "cpu")
    plan.write(key, value, c)
    plan.attention(query, c)

    def read(*args, **kwargs):
        raise AssertionError("a per-layer call read device data")

    monkeypatch.setattr(kvzoo.validate, "host_ints", read)
    monkeypatch.setattr(kvzoo.calls, "host_ints", read)
    for method in ("tolist", "item", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, method, read)
    plan.write(key, value, c)
    plan.attention(query, c)


def test_plan_without_validation_reads_nothing(monkeypatch):
    impls = {"reshape_and_cache": _no_op("reshape_and_cache"), "paged_attention": _no_op("paged_attention")}
    args = _good()
    _forbid_device_reads(monkeypatch)
    plan = kvzoo.plan_step(
        spec_for("int8_per_token_head", "separate"),
        **args,
        validate=False,
        max_query_len=5,
        max_seq_len=13,
        num_prefills=2,
        impl=impls,
    )
    assert plan.num_tokens is None and plan.max_seq_len == 13


def test_checked_caches_are_forgotten_with_their_object():
    spec = spec_for("int8_per_token_head", "separate")
    plan = kvzoo.plan_step(spec, **_good(slot_mapping=None), impl="numpy")
    rng = rng_for("plan forget")
    c = poisoned(spec, rng)
    plan.attention(rows(rng, (T, HQ, D), "bfloat16", "cpu"), c)
    key = (id(c), spec, "cpu")
    assert key in kvzoo.plan._LAYERS
    del plan, c
    gc.collect()
    assert key not in kvzoo.plan._LAYERS


def test_docstring_example_runs():
    assert doctest.testmod(kvzoo.plan, optionflags=doctest.ELLIPSIS).failed == 0


# ------------------------------------------------------------------------------------------
# Host-cost benchmark, smoke-tested


def test_host_cost_benchmark_quick():
    # --cpu: the CPU implementations even on a GPU machine, where compiling would take longer.
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "host_cost.py"), "--quick", "--cpu"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    for row in ("null op", "plan.write", "plan.attention", "validate=True", "validate=False"):
        assert row in run.stdout, run.stdout


def test_host_cost_catches_the_prepared_launch_for_its_bound_relaunch_rows(monkeypatch):
    # Its "bound relaunch" rows catch the launch a plan prepares for the call. On the H200 the
    # graph-replay rows run the bench's plan first, after which that plan recalls the launch
    # instead of preparing it: rows taken from it dropped out of a run silently. The CPU has
    # no graphs, so the replay rows' calls are made here as the GPU makes them.
    sys.path.insert(0, str(ROOT / "bench"))
    import host_cost

    def replay_as_on_a_gpu(call, device):
        call()
        call()

    monkeypatch.setattr(host_cost, "graph_replay", replay_as_on_a_gpu)
    device = "cuda" if CUDA else "cpu"
    s = host_cost.build(host_cost.QUICK_SHAPE, "int8_per_token_head", device, "triton-cuda")
    rows, _ = host_cost.calls(s, "triton-cuda", device)
    assert rows["write: bound relaunch (kvzoo's prepared launch)"] is not None
    assert rows["attention: bound relaunch (kvzoo's prepared launch)"] is not None


# ------------------------------------------------------------------------------------------
# CUDA graph (issue 16 item 5)


@pytest.mark.gpu_only
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("layout", ("separate", "inline"))
def test_cuda_graph_two_layer_step_replays_with_new_metadata(layout):
    device, mode, hq, hkv, d, bs, nb, seqs, max_len = "cuda", "int8_per_token_head", 8, 2, 128, 16, 256, 4, 512
    spec = kvzoo.CacheSpec(
        mode,
        num_blocks=nb,
        block_size=bs,
        num_kv_heads=hkv,
        head_size=d,
        layout=layout,
        model_dtype="bfloat16",
        device=device,
    )
    g = torch.Generator(device="cpu").manual_seed(16)
    layers = [spec.allocate() for _ in range(2)]
    blocks_per_seq = max_len // bs
    table = torch.randperm(nb, generator=g)[: seqs * blocks_per_seq].view(seqs, blocks_per_seq).to(torch.int32)
    block_tables = table.to(device)
    lens = torch.tensor([100, 230, 37, 311], dtype=torch.int32)

    def slots_for(lens_now):  # the decode token of each sequence sits at position len - 1
        pos = lens_now.long() - 1
        return (table[torch.arange(seqs), pos // bs].long() * bs + pos % bs).to(device)

    # Earlier steps' context, written through the functional API.
    for c in layers:
        n = int(lens.max())
        pos = torch.arange(n)
        for s in range(seqs):
            p = pos[: int(lens[s]) - 1]
            slots = (table[s, p // bs].long() * bs + p % bs).to(device)
            kv = torch.randn(len(p), hkv, d, generator=g).to(torch.bfloat16).to(device)
            kvzoo.reshape_and_cache(
                kv,
                kv.clone(),
                c.key_cache,
                c.value_cache,
                slots,
                mode=mode,
                k_scale_cache=c.k_scale_cache,
                v_scale_cache=c.v_scale_cache,
            )
    seq_lens = lens.to(device)
    query_start_loc = torch.arange(seqs + 1, dtype=torch.int32, device=device)
    slot_mapping = slots_for(lens)
    key = [torch.randn(seqs, hkv, d, generator=g).to(torch.bfloat16).to(device) for _ in layers]
    value = [torch.randn(seqs, hkv, d, generator=g).to(torch.bfloat16).to(device) for _ in layers]
    query = [torch.randn(seqs, hq, d, generator=g).to(torch.bfloat16).to(device) for _ in layers]
    out = [torch.empty_like(q) for q in query]
    # Validated now, with the bounds every replay stays under.
    plan = kvzoo.plan_step(
        spec,
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        slot_mapping=slot_mapping,
        num_q_heads=hq,
        max_query_len=1,
        max_seq_len=max_len,
        num_prefills=0,
    )
    assert plan.write_impl.name == plan.attention_impl.name == "triton-cuda"

    def step():
        for i, c in enumerate(layers):
            plan.write(key[i], value[i], c)
            plan.attention(query[i], c, out=out[i])

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile, and meet each caches object, outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    for step_no in range(2):
        # The next decode step: every sequence one token longer, new rows, in place.
        lens = lens + 1
        seq_lens.copy_(lens.to(device))
        slot_mapping.copy_(slots_for(lens))
        for i in range(2):
            key[i].copy_(torch.randn(seqs, hkv, d, generator=g).to(torch.bfloat16))
            value[i].copy_(torch.randn(seqs, hkv, d, generator=g).to(torch.bfloat16))
            query[i].copy_(torch.randn(seqs, hq, d, generator=g).to(torch.bfloat16))
            out[i].fill_(float("nan"))
        expected_caches = [clone_cuda(c) for c in layers]
        graph.replay()
        torch.cuda.synchronize()
        for i, c in enumerate(expected_caches):
            kvzoo.reshape_and_cache(
                key[i],
                value[i],
                c.key_cache,
                c.value_cache,
                slot_mapping,
                mode=mode,
                k_scale_cache=c.k_scale_cache,
                v_scale_cache=c.v_scale_cache,
            )
            eager = kvzoo.paged_attention(
                query[i],
                c.key_cache,
                c.value_cache,
                mode=mode,
                block_tables=block_tables,
                seq_lens=seq_lens,
                query_start_loc=query_start_loc,
                k_scale_cache=c.k_scale_cache,
                v_scale_cache=c.v_scale_cache,
                max_query_len=1,
                max_seq_len=max_len,
                num_prefills=0,
                validate=False,
            )
            for a, b in zip(cache_arrays(layers[i]), cache_arrays(c)):
                assert_same_bytes(a, b, f"layer {i} cache after replay {step_no}")
            assert_same_bytes(out[i], eager, f"layer {i} attention after replay {step_no}")


def clone_cuda(c: KVCacheTensors) -> KVCacheTensors:
    if c.buffer is not None:
        return inline_views(c.buffer.clone(), c.key_cache.shape[-1], "int8_per_token_head")
    return KVCacheTensors(*(x.clone() for x in (c.key_cache, c.value_cache, c.k_scale_cache, c.v_scale_cache)))


@pytest.mark.gpu_only
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ("int8_per_token_head", "int4_per_token_head"))
def test_cuda_graph_replayed_with_lying_metadata_stays_in_bounds(mode):
    """SPEC 11.1 where engines need it most: a captured step whose metadata tensors are then
    updated in place to values that break the rules (a block id past the cache, a negative one,
    a length past the table, offsets past the query). The replay writes nothing outside out
    (guard bytes on both sides), the ill-formed sequences' rows are NaN and the others are the
    unvalidated functional call's on the same metadata."""
    device, hq, hkv, d, bs, nb, seqs = "cuda", 8, 2, 128, 16, 64, 4
    spec = kvzoo.CacheSpec(mode, num_blocks=nb, block_size=bs, num_kv_heads=hkv, head_size=d, device=device)
    g = torch.Generator(device="cpu").manual_seed(1101)
    caches = spec.allocate()
    kv = torch.randn(nb * bs, hkv, d, generator=g).to(torch.bfloat16).to(device)
    kvzoo.reshape_and_cache(kv, kv.flip(0), caches.key_cache, caches.value_cache, torch.arange(nb * bs, device=device),
                            mode=mode, k_scale_cache=caches.k_scale_cache, v_scale_cache=caches.v_scale_cache)  # fmt: skip
    table = torch.randperm(nb, generator=g)[: seqs * 8].view(seqs, 8).to(torch.int32).to(device)
    seq_lens = torch.tensor([100, 37, 120, 64], dtype=torch.int32, device=device)
    qsl = torch.arange(seqs + 1, dtype=torch.int32, device=device)
    query = torch.randn(seqs, hq, d, generator=g).to(torch.bfloat16).to(device)
    guard = 3
    buffer = torch.full(((seqs + 2 * guard) * hq * d,), 7.0, dtype=torch.bfloat16, device=device)
    out = buffer[guard * hq * d : (guard + seqs) * hq * d].view(seqs, hq, d)
    plan = kvzoo.plan_step(spec, block_tables=table, seq_lens=seq_lens, query_start_loc=qsl, num_q_heads=hq,
                           max_query_len=1, max_seq_len=8 * bs, num_prefills=0)  # fmt: skip
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        plan.attention(query, caches, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.attention(query, caches, out=out)
    # The lies, in place: sequence 0 a block past the cache, 1 a negative block, 2 a length past
    # its table row; and every offset one row on, so sequence s owns row s + 1: row 0 is
    # nobody's and sequence 3's row is the first guard row after out.
    table[0, 2] = nb + 1000
    table[1, 1] = -7
    seq_lens[2] = 8 * bs + 5
    qsl.add_(1)
    out.fill_(3.0)
    graph.replay()
    torch.cuda.synchronize()
    before, after = buffer[: guard * hq * d], buffer[(guard + seqs) * hq * d :]
    assert bool((before == 7.0).all()) and bool((after == 7.0).all()), "the replay wrote outside out"
    assert bool((out[0] == 3.0).all()), "row 0 belongs to no sequence and was written"
    assert bool(out[1:].isnan().all()), "an ill-formed sequence's rows are not NaN"


@pytest.mark.gpu_only
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ("int8_per_token_head", "int4_per_token_head", "none"))
def test_plan_calls_read_nothing_back(mode):
    """A plan's per-layer calls under torch's sync debug mode "error" (issue 46 item 2): a
    mixed step (decodes and a prefill that stages its context) writes and attends without a
    single host synchronisation, on the plan's first calls (which prepare the launches) and later."""
    device, hq, hkv, d, bs, nb = "cuda", 8, 2, 128, 16, 64
    spec = kvzoo.CacheSpec(mode, num_blocks=nb, block_size=bs, num_kv_heads=hkv, head_size=d, device=device)
    g = torch.Generator(device="cpu").manual_seed(1102)
    q_lens, lens = [1, 1, 200], [40, 17, 230]
    table = torch.randperm(nb, generator=g)[: 3 * 16].view(3, 16).to(torch.int32).to(device)
    slots = torch.cat(
        [table[s, torch.arange(n - q, n) // bs].long() * bs + torch.arange(n - q, n).to(device) % bs
         for s, (q, n) in enumerate(zip(q_lens, lens))]
    )  # fmt: skip
    plan = kvzoo.plan_step(
        spec,
        block_tables=table,
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, 1, 2, 202], dtype=torch.int32, device=device),
        slot_mapping=slots,
        num_q_heads=hq,
    )
    layers = [spec.allocate() for _ in range(2)]
    rows = sum(q_lens)
    inputs = [
        [torch.randn(rows, h, d, generator=g).to(torch.bfloat16).to(device) for h in (hkv, hkv, hq)] for _ in layers
    ]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            for (k, v, q), caches in zip(inputs, layers):
                plan.write(k, v, caches)
                plan.attention(q, caches)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_step_plan_declares_a_type_for_each_slot_and_no_other():
    """StepPlan's __slots__ and its class annotations name the same attributes (mypy reads the
    annotations, Python the slots): a new attribute added to one and not the other fails here."""
    assert set(kvzoo.plan.StepPlan.__slots__) == set(kvzoo.plan.StepPlan.__annotations__)


def test_an_attention_output_inside_the_steps_slot_mapping_is_refused():
    """Each layer's write reads slot_mapping after the layer before wrote its attention output:
    an out inside it would send the next layer's rows to other slots. Refused at the call,
    unbound and bound alike, with nothing written."""
    rng = rng_for("plan", "out-in-slot-mapping")
    spec = kvzoo.CacheSpec(
        "int8_per_token_head", num_blocks=4, block_size=4, num_kv_heads=2, head_size=8, model_dtype="float32"
    )
    caches = spec.allocate()
    tables, lens, qsl = torch.tensor([[0, 1]]), torch.tensor([6]), torch.tensor([0, 6])
    # slot_mapping and a float32 out [6, 4, 8] (768 bytes) in one buffer, overlapping.
    buffer = torch.zeros(1024, dtype=torch.uint8)
    slot_mapping = buffer[:48].view(torch.int64)
    slot_mapping.copy_(torch.arange(6))
    plan = kvzoo.plan_step(
        spec, block_tables=tables, seq_lens=lens, query_start_loc=qsl, num_q_heads=4, slot_mapping=slot_mapping,
        impl="numpy",
    )  # fmt: skip
    rows = torch.from_numpy(rng.standard_normal((6, 2, 8)).astype(np.float32))
    plan.write(rows, rows, caches)
    query = torch.from_numpy(rng.standard_normal((6, 4, 8)).astype(np.float32))
    plan.attention(query, caches, out=torch.empty(6, 4, 8))  # a separate out: accepted (binds the launch)
    inside = buffer[:768].view(torch.float32).view(6, 4, 8)
    before = buffer.clone()
    for _ in range(2):
        with pytest.raises(KVZooInputError, match="^out: shares memory with slot_mapping"):
            plan.attention(query, caches, out=inside)
    assert torch.equal(buffer, before)


@pytest.mark.parametrize("inside", ["key_cache", "v_scale_cache"])
def test_caches_holding_the_steps_block_tables_are_refused(inside):
    """A write into caches that hold the step's block_tables would change which pages the
    step's attention calls read (refused with nothing written, at the layer's first call)."""
    rng = rng_for("plan", "caches-hold-block-tables", inside)
    spec = kvzoo.CacheSpec(
        "int8_per_token_head", num_blocks=4, block_size=4, num_kv_heads=2, head_size=8, model_dtype="float32"
    )
    caches = spec.allocate()
    holder = getattr(caches, inside)
    tables = holder.view(torch.uint8).flatten()[:16].view(torch.int64).view(1, 2)
    tables.copy_(torch.tensor([[0, 1]]))
    before = [
        host_bytes(a).copy() for a in (caches.key_cache, caches.value_cache, caches.k_scale_cache, caches.v_scale_cache)
    ]
    plan = kvzoo.plan_step(
        spec, block_tables=tables, seq_lens=torch.tensor([6]), query_start_loc=torch.tensor([0, 6]), num_q_heads=4,
        slot_mapping=torch.arange(6), impl="numpy",
    )  # fmt: skip
    rows = torch.from_numpy(rng.standard_normal((6, 2, 8)).astype(np.float32))
    with pytest.raises(KVZooInputError, match=f"^{inside}: shares memory with block_tables"):
        plan.write(rows, rows, caches)
    with pytest.raises(KVZooInputError, match=f"^{inside}: shares memory with block_tables"):
        plan.attention(torch.from_numpy(rng.standard_normal((6, 4, 8)).astype(np.float32)), caches)
    after = [host_bytes(a) for a in (caches.key_cache, caches.value_cache, caches.k_scale_cache, caches.v_scale_cache)]
    assert all(np.array_equal(b, a) for b, a in zip(before, after))
