"""The plan's prepared launches (Implementation.prepare): the first layer of a step binds each
launch, later layers relaunch it with their own tensors. Every result is compared byte for byte
with the functional API on fresh random inputs and poisoned caches.

On a machine without a GPU the Triton kernels run under the interpreter, which exercises the
binding and the operand swap; the compiled launcher itself runs where CUDA is present
(the same tests, and the gpu_only ones below).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from test_plan import (
    BS,
    CONFIGS,
    HKV,
    HQ,
    TABLE,
    cache_arrays,
    clone,
    functional_attention,
    functional_write,
    metadata,
    poisoned,
    rows,
    scales_of,
    spec_for,
)

import kvzoo
from kvzoo import samples
from kvzoo.inputs import device_for, host_float32
from kvzoo.problem import Attention, CacheWrite, Dequantize

from support import assert_same_bytes, rng_for

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def _triton(op: str):
    impl = kvzoo.registry.get(op, "triton-cuda")
    if not impl.available:
        pytest.skip(f"triton-cuda: {'; '.join(impl.unavailable())}")
    return impl


def counted(impl, counts: dict):
    """impl, counting its runs, its prepares and the launches they return."""

    def run(p, **kw):
        counts["run"] += 1
        return impl.run(p, **kw)

    def prepare(p, **kw):
        counts["prepare"] += 1
        launch = impl.prepare(p, **kw)
        counts.setdefault("prepared", []).append(launch)
        if launch is None:
            return None

        def relaunch(operands):
            counts["launch"] += 1
            launch(operands)

        return relaunch

    return dataclasses.replace(impl, run=run, prepare=prepare)


def step_through_plan(spec, meta, layers, rng, *, lse=False, sinks=None, query_view=None):
    """A step over `layers` caches through a plan of counted triton impls, and the same through
    the functional API on copies; returns the counts per op after checking every byte."""
    counts = {op: dict(run=0, prepare=0, launch=0) for op in ("reshape_and_cache", "paged_attention")}
    impls = {op: counted(_triton(op), counts[op]) for op in counts}
    index = {k: meta[k] for k in ("block_tables", "seq_lens", "query_start_loc")}
    plan = kvzoo.plan_step(spec, **index, slot_mapping=meta["slot_mapping"], num_q_heads=HQ, impl=impls, sinks=sinks)
    h, d, tokens = spec.num_kv_heads, spec.head_size, int(meta["slot_mapping"].shape[0])
    n = int(meta["context_slots"].shape[0])
    for layer in range(layers):
        mine = poisoned(spec, rng)
        functional_write(
            rows(rng, (n, h, d), spec.model_dtype, DEVICE),
            rows(rng, (n, h, d), spec.model_dtype, DEVICE),
            mine,
            meta["context_slots"],
            spec,
            "numpy" if DEVICE == "cpu" else "triton-cuda",
        )
        theirs = clone(mine)
        key, value = (rows(rng, (tokens, h, d), spec.model_dtype, DEVICE) for _ in range(2))
        query = rows(rng, (tokens, HQ, d), spec.model_dtype, DEVICE)
        if query_view is not None:
            query = query_view(query, layer)
        plan.write(key, value, mine, **scales_of(spec))
        got = plan.attention(query, mine, return_lse=lse, **scales_of(spec))
        functional_write(key, value, theirs, meta["slot_mapping"], spec, "triton-cuda")
        want = functional_attention(
            query, theirs, index, spec, "triton-cuda", sinks=sinks, return_lse=lse, **scales_of(spec)
        )
        for a, b in zip(cache_arrays(mine), cache_arrays(theirs)):
            assert_same_bytes(a, b, f"layer {layer} cache after write")
        for a, b in zip(got if lse else (got,), want if lse else (want,)):
            assert_same_bytes(a, b, f"layer {layer} attention")
            assert torch.isfinite(a.float()).all()
    return counts, plan


@pytest.mark.parametrize("mode,layout", CONFIGS)
def test_later_layers_relaunch_what_the_first_prepared(mode, layout):
    if mode not in kvzoo.registry.get("paged_attention", "triton-cuda").modes:
        pytest.skip(f"triton-cuda: does not register mode {mode}")
    spec = spec_for(mode, layout, DEVICE)
    counts, _ = step_through_plan(spec, metadata(DEVICE), 3, rng_for("prepared", mode, layout))
    for op, c in counts.items():
        # One prepare on the first layer, which it also launches; no layer goes through run.
        c.pop("prepared")
        assert c == dict(run=0, prepare=1, launch=3), (op, c)


@pytest.mark.parametrize("case", ["lse", "sinks", "decode only", "split decode"])
def test_prepared_attention_variants(case):
    mode, layout = "int8_per_token_head", "separate"
    spec, meta, sinks = spec_for(mode, layout, DEVICE), metadata(DEVICE), None
    rng = rng_for("prepared variant", case)
    if case == "sinks":
        sinks = torch.from_numpy(rng.standard_normal(HQ).astype(np.float32)).to(DEVICE)
    if case == "decode only":
        meta = metadata(DEVICE, q_lens=(1, 1, 1), seq_lens=(8, 13, 4))
    if case == "split decode":
        # One long sequence over few KV heads: the decode splits its keys (the merge kernel is
        # a second bound launch sharing the plan's partials).
        bs, length = 16, 2100
        blocks = -(-length // bs)
        table = [list(np.random.default_rng(7).permutation(blocks))]
        meta = metadata(DEVICE, q_lens=(1,), seq_lens=(length,), table=table, block_size=bs)
        spec = kvzoo.CacheSpec(
            mode,
            num_blocks=blocks,
            block_size=bs,
            num_kv_heads=HKV,
            head_size=spec.head_size,
            model_dtype="bfloat16",
            device=DEVICE,
        )
    counts, plan = step_through_plan(spec, meta, 2, rng, lse=case == "lse", sinks=sinks)
    prepared = counts["paged_attention"].pop("prepared")
    assert counts["paged_attention"] == dict(run=0, prepare=1, launch=2)
    # The split decode binds two launches (the attention kernel and the merge sharing the
    # plan's partials); the others one.
    bound = prepared[0].args[0]
    assert len(bound) == (2 if case == "split decode" else 1)


def test_other_strides_or_alignment_prepare_again():
    spec = spec_for("fp8_per_token_head", "separate", DEVICE)

    def view(query, layer):
        if layer == 1:  # a column slice of a wider tensor: other strides
            wide = torch.empty(query.shape[0], query.shape[1], query.shape[2] * 2, dtype=query.dtype, device=DEVICE)
            wide[..., : query.shape[2]] = query
            return wide[..., : query.shape[2]]
        if layer == 2:  # unit strides, but 2 bytes past a 16-byte boundary
            flat = torch.empty(query.numel() + 1, dtype=query.dtype, device=DEVICE)
            shifted = flat[1:].view(query.shape)
            shifted.copy_(query)
            assert shifted.data_ptr() % 16
            return shifted
        return query

    counts, plan = step_through_plan(spec, metadata(DEVICE), 4, rng_for("prepared strides"), query_view=view)
    # Layers 0 and 3 share a signature; 1 and 2 bring their own.
    for c in counts.values():
        c.pop("prepared")
    assert counts["paged_attention"] == dict(run=0, prepare=3, launch=4)
    assert counts["reshape_and_cache"] == dict(run=0, prepare=1, launch=4)


def test_staged_prefill_is_not_prepared_and_runs():
    # prepare returns None where the staged workspace is filled per call: every layer runs.
    impl = _triton("paged_attention").with_options(prefill="auto", stage_max_bytes=1 << 30)
    if DEVICE == "cpu":
        pytest.skip("staging is chosen by GPU timings (staging.worth_staging); the interpreter stays direct")
    spec = kvzoo.CacheSpec(
        "int8_per_token_head",
        num_blocks=32,
        block_size=16,
        num_kv_heads=2,
        head_size=128,
        model_dtype="bfloat16",
        device="cuda",
    )
    meta = metadata("cuda", q_lens=(300,), seq_lens=(300,), table=[list(range(19))], block_size=16)
    counts = dict(run=0, prepare=0, launch=0)
    plan = kvzoo.plan_step(
        spec,
        block_tables=meta["block_tables"],
        seq_lens=meta["seq_lens"],
        query_start_loc=meta["query_start_loc"],
        num_q_heads=8,
        impl={"paged_attention": counted(impl, counts)},
    )
    c = spec.allocate()
    kvzoo.reshape_and_cache(
        *(torch.randn(2, 300, 2, 128, device="cuda").to(torch.bfloat16)),
        c.key_cache,
        c.value_cache,
        meta["slot_mapping"],
        mode=spec.mode,
        k_scale_cache=c.k_scale_cache,
        v_scale_cache=c.v_scale_cache,
    )
    query = torch.randn(300, 8, 128, device="cuda").to(torch.bfloat16)
    for _ in range(2):
        got = plan.attention(query, c)
    want = kvzoo.paged_attention(
        query,
        c.key_cache,
        c.value_cache,
        mode=spec.mode,
        block_tables=meta["block_tables"],
        seq_lens=meta["seq_lens"],
        query_start_loc=meta["query_start_loc"],
        k_scale_cache=c.k_scale_cache,
        v_scale_cache=c.v_scale_cache,
        impl=impl,
    )
    assert_same_bytes(got, want, "staged prefill through the plan")
    assert counts.pop("prepared") == [None]
    assert counts == dict(run=2, prepare=1, launch=0)


def test_with_options_binds_the_prepare_hook_too():
    impl = kvzoo.registry.get("paged_attention", "triton-cuda")
    direct = impl.with_options(prefill="direct")
    assert direct.prepare.keywords["options"].prefill == "direct"
    again = direct.with_options(stage_max_bytes=5)
    assert again.prepare.func is direct.prepare.func
    assert again.prepare.keywords["options"] == dataclasses.replace(direct.options, stage_max_bytes=5)


def test_operands_are_every_array_field_in_order():
    for cls in (CacheWrite, Attention, Dequantize):
        # The record's fields annotated as arrays, which lead it (its NamedTuple is its first base).
        types = {name: getattr(t, "__forward_arg__", str(t)) for name, t in cls.__mro__[1].__annotations__.items()}
        arrays = [name for name in cls._fields if types[name].startswith("Array")]
        assert list(cls.operand_names()) == arrays == list(cls._fields[: len(arrays)])
        assert set(cls.WRITTEN) | set(cls.INDICES) <= set(arrays)


@pytest.mark.parametrize("q_lens,seq_lens", [((5, 1, 4), (8, 13, 4)), ((1, 1, 1), (8, 13, 4))])
def test_functional_calls_of_a_seen_signature_relaunch(q_lens, seq_lens):
    from kvzoo import launches

    # The counts below assume no eviction: the table lets its oldest entries go when full (256
    # entries), which the tests before this one in a process may bring it close to.
    launches.forget()
    spec = spec_for("int8_per_token_head", "separate", DEVICE)
    meta = metadata(DEVICE, q_lens=q_lens, seq_lens=seq_lens)
    rng = rng_for("functional prepared", q_lens)
    counts = {op: dict(run=0, prepare=0, launch=0) for op in ("reshape_and_cache", "paged_attention")}
    write, attend = (counted(_triton(op), counts[op]) for op in counts)
    tokens, d = int(meta["slot_mapping"].shape[0]), spec.head_size
    for call in range(3):
        c = poisoned(spec, rng)
        functional_write(
            rows(rng, (int(meta["context_slots"].shape[0]), HKV, d), "bfloat16", DEVICE),
            rows(rng, (int(meta["context_slots"].shape[0]), HKV, d), "bfloat16", DEVICE),
            c,
            meta["context_slots"],
            spec,
            "numpy" if DEVICE == "cpu" else "triton-cuda",
        )
        theirs = clone(c)
        key, value = (rows(rng, (tokens, HKV, d), "bfloat16", DEVICE) for _ in range(2))
        query = rows(rng, (tokens, HQ, d), "bfloat16", DEVICE)
        functional_write(key, value, c, meta["slot_mapping"], spec, write)
        got = functional_attention(query, c, meta, spec, attend)
        # The same calls through a fresh object of the same implementation: its own first
        # prepare, on these very tensors.
        functional_write(
            key, value, theirs, meta["slot_mapping"], spec, dataclasses.replace(_triton("reshape_and_cache"))
        )
        want = functional_attention(query, theirs, meta, spec, dataclasses.replace(_triton("paged_attention")))
        for a, b in zip(cache_arrays(c), cache_arrays(theirs)):
            assert_same_bytes(a, b, f"call {call} cache")
        assert_same_bytes(got, want, f"call {call} attention")
    for op, c in counts.items():
        c.pop("prepared")
        assert c == dict(run=0, prepare=1, launch=3), (op, c)


def test_functional_prepared_launches_follow_the_registry_and_let_caches_go():
    import gc
    import weakref

    from kvzoo import launches

    launches.forget()  # no eviction between the two calls
    spec = spec_for("fp8_per_token_head", "separate", DEVICE)
    meta, rng = metadata(DEVICE), rng_for("functional registry")
    c = poisoned(spec, rng)
    tokens, d = int(meta["slot_mapping"].shape[0]), spec.head_size
    key, value = (rows(rng, (tokens, HKV, d), "bfloat16", DEVICE) for _ in range(2))
    functional_write(key, value, c, meta["slot_mapping"], spec, "triton-cuda")
    entries = [
        e
        for k, e in launches._TABLE.items()
        if k[0] == "reshape_and_cache" and (e.chosen or e.held()).name == "triton-cuda"
    ]
    assert entries, "the functional write kept no prepared launch"
    generation = kvzoo.registry.default().generation
    kvzoo.registry.default().invalidate()
    assert kvzoo.registry.default().generation == generation + 1
    functional_write(key, value, c, meta["slot_mapping"], spec, "triton-cuda")
    # The old entry does not serve the new generation: the call selected and prepared anew.
    assert [k for k in launches._TABLE if k[0] == "reshape_and_cache" and k[3] == generation + 1]
    if CUDA:
        # A kept launch holds addresses, not the caller's cache: the cache goes with its owner.
        gone = weakref.ref(c.key_cache)
        del c
        gc.collect()
        assert gone() is None


@pytest.mark.gpu_only
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_a_prepared_step_replays_in_a_cuda_graph():
    # Captured after the first (eager) step bound the launches: the graph holds the relaunches.
    spec = spec_for("int8_per_token_head", "inline", "cuda")
    meta = metadata("cuda", q_lens=(1, 1, 1), seq_lens=(8, 13, 4))
    rng = rng_for("prepared graph")
    layers = [poisoned(spec, rng) for _ in range(2)]
    index = {k: meta[k] for k in ("block_tables", "seq_lens", "query_start_loc")}
    plan = kvzoo.plan_step(spec, **index, slot_mapping=meta["slot_mapping"], num_q_heads=HQ)
    d = spec.head_size
    key = [rows(rng, (3, HKV, d), "bfloat16", "cuda") for _ in layers]
    value = [rows(rng, (3, HKV, d), "bfloat16", "cuda") for _ in layers]
    query = [rows(rng, (3, HQ, d), "bfloat16", "cuda") for _ in layers]
    out = [torch.empty_like(q) for q in query]
    before = [clone(c) for c in layers]

    def step():
        for i, c in enumerate(layers):
            plan.write(key[i], value[i], c)
            plan.attention(query[i], c, out=out[i])

    step()
    assert all(held.write is not None and held.attention is not None for held in plan._layers.values())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for i in range(2):
        key[i].copy_(rows(rng, (3, HKV, d), "bfloat16", "cuda"))
        query[i].copy_(rows(rng, (3, HQ, d), "bfloat16", "cuda"))
        out[i].fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for i, c in enumerate(before):
        functional_write(key[i], value[i], c, meta["slot_mapping"], spec, "triton-cuda")
        want = kvzoo.paged_attention(
            query[i],
            c.key_cache,
            c.value_cache,
            mode=spec.mode,
            **index,
            k_scale_cache=c.k_scale_cache,
            v_scale_cache=c.v_scale_cache,
        )
        for a, b in zip(cache_arrays(layers[i]), cache_arrays(c)):
            assert_same_bytes(a, b, f"layer {i} cache after replay")
        assert_same_bytes(out[i], want, f"layer {i} attention after replay")


# ------------------------------------------------------------------------------------------
# Implementation.prepare's contract, for every implementation that has the hook

PREPARING = [
    pytest.param(op, impl, id=f"{op}-{impl.name}")
    for op in ("reshape_and_cache", "paged_attention")
    for impl in kvzoo.registry.default().implementations(op)
    if impl.prepare is not None
]
# Two batches of one signature and the same host bounds (max_query_len 5, max_seq_len 40, two
# prefills, 10 query rows) whose offsets and lengths differ everywhere else.
BATCHES = (((5, 1, 4), (40, 13, 9)), ((4, 5, 1), (20, 40, 7)))


def _copy(x):
    return None if x is None else (x.clone() if isinstance(x, torch.Tensor) else x.copy())


def _usable(impl, mode):
    if not impl.available:
        pytest.skip("; ".join(impl.unavailable()))
    if mode not in impl.modes:
        pytest.skip(f"{impl.name} does not register {mode}")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("mode", ["none", "int8_per_token_head", "fp8_per_tensor", "int4_per_token_head"])
@pytest.mark.parametrize("op,impl", PREPARING)
def test_a_prepared_launch_serves_a_later_call_with_that_calls_values(op, impl, mode, dtype):
    """The launch prepared on one call, given a later call's arrays of the same signature and
    host fields, runs that call: its rows (strided), caches, slots, offsets, lengths, static
    scales, sinks, out and lse, byte for byte what a launch prepared on the later call itself
    gives. Every mode's kind of cache (model dtype, per-row scales, static scales, packed
    rows), and a float32 model dtype, whose out the CPU kernels write in place."""
    from kvzoo import api, launches

    _usable(impl, mode)
    launches.forget()  # no eviction between the calls counted below
    counts = dict(run=0, prepare=0, launch=0)
    first, fresh = counted(impl, counts), dataclasses.replace(impl)
    where = dict(kind="numpy" if impl.array_kind == "numpy" else "torch", device=device_for(impl))
    rng = rng_for("prepare contract", op, impl.name, mode, dtype)
    if op == "reshape_and_cache":
        draws = [
            samples.write_sample(
                rng,
                mode,
                num_tokens=9,
                head_size=32,
                block_size=4,
                dtype=dtype,
                negative_slots=True,
                strided=True,
                static_scale="wide",
                **where,
            )
            for _ in range(2)
        ]
        later = draws[1]
        theirs = [_copy(c) for c in later.cache_arrays()]

        def write(w, chosen, caches):
            kw = dict(w.api_kwargs(), k_scale_cache=caches[2], v_scale_cache=caches[3])
            api.reshape_and_cache(w.key, w.value, caches[0], caches[1], w.slot_mapping, **kw, impl=chosen)

        for w in draws:
            write(w, first, w.cache_arrays())
        write(later, fresh, theirs)
        pairs = [(a, b) for a, b in zip(later.cache_arrays(), theirs) if a is not None]
    else:
        draws = [
            samples.paged_sample(
                rng,
                mode,
                q_lens=q,
                seq_lens=s,
                head_size=32,
                num_blocks=12,
                query_dtype=dtype,
                sinks=True,
                static_scales="wide",
                **where,
            )
            for q, s in BATCHES
        ]

        def attend(s, chosen):
            out = s.new_out()
            args = (s.query, s.caches.key_cache, s.caches.value_cache)
            return api.paged_attention(*args, **s.api_kwargs(), out=out, return_lse=True, impl=chosen)

        got = [attend(s, first) for s in draws]
        pairs = list(zip(got[1], attend(draws[1], fresh)))
        assert np.isfinite(host_float32(got[1][0])).all(), "rows left unwritten"
    if counts["prepared"][0] is None:
        pytest.skip(f"{impl.name} prepares no launch for this {op} (it runs every call)")
    counts.pop("prepared")
    assert counts == dict(run=0, prepare=1, launch=2), counts
    for a, b in pairs:
        assert_same_bytes(a, b, f"{impl.name} {op}: the later call through the first call's launch")


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("mode", ["int8_per_token_head", "fp8_per_token_head", "int4_per_token_head", "none"])
def test_a_held_launch_follows_metadata_refilled_in_place(mode, index_dtype):
    # A layer's later calls run a launch that holds the layer's records (Implementation.prepare's
    # hold): with int64 metadata it holds the caller's own arrays, so refilling them in place must
    # reach the kernels; int32 metadata is converted per call, so nothing is held.
    numba_impl = kvzoo.registry.get("paged_attention", "numba")
    if not numba_impl.available:
        pytest.skip(f"numba: {'; '.join(numba_impl.unavailable())}")
    if mode not in numba_impl.modes:
        pytest.skip(f"numba: does not register mode {mode}")
    spec = spec_for(mode, "separate", "cpu", model_dtype="float32")
    meta = metadata("cpu")
    for name in ("block_tables", "seq_lens", "query_start_loc"):
        meta[name] = meta[name].to(index_dtype)
    index = {k: meta[k] for k in ("block_tables", "seq_lens", "query_start_loc")}
    plan = kvzoo.plan_step(spec, **index, slot_mapping=meta["slot_mapping"], num_q_heads=HQ, impl="numba")
    rng = rng_for("held launch", mode, str(index_dtype))
    h, d, tokens = spec.num_kv_heads, spec.head_size, int(meta["slot_mapping"].shape[0])
    n = int(meta["context_slots"].shape[0])
    layers = []
    for _ in range(2):
        c = poisoned(spec, rng)
        functional_write(
            *(rows(rng, (n, h, d), "float32", "cpu") for _ in range(2)), c, meta["context_slots"], spec, "numpy"
        )
        layers.append(c)
    for call in range(3):
        if call == 2:
            # Within the plan's bounds: sequence 1's decode moves back one position, its slot with it.
            meta["seq_lens"][1] -= 1
            meta["slot_mapping"][5] = TABLE[1][1] * BS + 3
        for layer, mine in enumerate(layers):
            theirs = clone(mine)
            key, value = (rows(rng, (tokens, h, d), "float32", "cpu") for _ in range(2))
            query = rows(rng, (tokens, HQ, d), "float32", "cpu")
            plan.write(key, value, mine)
            got = plan.attention(query, mine)
            functional_write(key, value, theirs, meta["slot_mapping"], spec, "numba")
            want = functional_attention(query, theirs, index, spec, "numba")
            for a, b in zip(cache_arrays(mine), cache_arrays(theirs)):
                assert_same_bytes(a, b, f"call {call} layer {layer} cache after write")
            assert_same_bytes(got, want, f"call {call} layer {layer} attention")
    bound = plan._layers[id(layers[0])]
    # The prepared launches carry hold; what a layer holds is the launch hold made.
    held = index_dtype == torch.int64
    assert hasattr(bound.attention.launch, "hold") is not held
    assert not hasattr(bound.write.launch, "hold")  # slot_mapping is int64 in both cases
