"""What a call of a signature met before skips: the table of kvzoo/launches.py, and a plan's
layers bound to their launches (kvzoo/plan.py).

A recalled call skips the metadata checks, so these tests hold it to three things: it runs
(hits are counted, so a suite where nothing is recalled fails), it writes what a call checked
in full writes (one through an implementation object of its own, which no entry knows), and
every input a check would refuse is still refused after a good call of the same shapes: each
thing the checks read but the shapes do not show (gradient flags, writability, byte order,
storage sharing, aliasing at new addresses).
"""

from __future__ import annotations

import bisect
import dataclasses

import pytest
import torch

import kvzoo
from kvzoo import launches
from kvzoo.arrays import as_numpy, as_torch
from kvzoo.errors import KVZooInputError

from support import SEED

NUM_BLOCKS, BLOCK_SIZE, HKV, HQ, D = 9, 4, 2, 4, 64
SEQ_LENS = (5, 9, 3)
# Where the test's arrays live: the GPU for the Triton backend where there is one (set by _usable).
_where = {"device": "cpu"}


@pytest.fixture
def hits(monkeypatch):
    """Counts the calls the table answered (a lookup that found an entry)."""
    counted = {"hits": 0}
    lookup = launches.lookup

    def counting(key, held):
        entry = lookup(key, held)
        counted["hits"] += entry is not None
        return entry

    monkeypatch.setattr(launches, "lookup", counting)
    launches.forget()
    _where["device"] = "cpu"
    yield counted
    launches.forget()


def _rows(gen, tokens, heads, dtype=torch.bfloat16):
    return torch.randn(tokens, heads, D, generator=gen).to(dtype).to(_where["device"])


def _caches(mode, gen, layout="separate"):
    spec = kvzoo.CacheSpec(
        mode,
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        num_kv_heads=HKV,
        head_size=D,
        layout=layout,
        device=_where["device"],
    )
    c = spec.allocate()
    # Poison: every byte random, so a write that lands or misses shows.
    for t in (c.buffer,) if c.buffer is not None else (c.key_cache, c.value_cache, c.k_scale_cache, c.v_scale_cache):
        if t is not None:
            t.view(torch.uint8).copy_(
                torch.randint(0, 256, t.view(torch.uint8).shape, generator=gen, dtype=torch.uint8)
            )
    return c


def _cache_arrays(c, kind=lambda x: x):
    arrays = dict(
        key_cache=c.key_cache, value_cache=c.value_cache, k_scale_cache=c.k_scale_cache, v_scale_cache=c.v_scale_cache
    )
    return {n: None if a is None else kind(a) for n, a in arrays.items()}


def _kind(impl):
    """The arrays an implementation takes as they come: NumPy views of the same memory for the
    CPU backends."""
    i = kvzoo.registry.default().get("reshape_and_cache", impl)
    return as_numpy if i.array_kind == "numpy" else (lambda x: x)


def _bytes(c):
    parts = (c.buffer,) if c.buffer is not None else (c.key_cache, c.value_cache, c.k_scale_cache, c.v_scale_cache)
    return [p.view(torch.uint8).clone() for p in parts if p is not None]


def _same_bits(a, b):
    # Poisoned caches give NaN rows; bits compare them where == would not.
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _slots(gen, n):
    return torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:n].to(torch.int32).to(_where["device"])


def _checked(op, impl):
    """impl as an object of its own: the table knows no call of it, so its call is checked in full."""
    return dataclasses.replace(kvzoo.registry.default().get(op, impl))


def _write(key, value, c, slots, mode, impl, validate=False):
    kind = _kind(impl)
    kvzoo.reshape_and_cache(
        kind(key),
        kind(value),
        slot_mapping=kind(slots),
        mode=mode,
        impl=_checked("reshape_and_cache", impl) if validate else impl,
        validate=validate,
        **_cache_arrays(c, kind),
    )


def _metadata():
    lens = torch.tensor(SEQ_LENS, dtype=torch.int32)
    q_lens = torch.tensor((1, 3, 1), dtype=torch.int32)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int32), q_lens.cumsum(0).to(torch.int32)])
    tables = torch.arange(NUM_BLOCKS, dtype=torch.int32).flip(0).view(3, 3)
    bounds = dict(max_query_len=int(q_lens.max()), max_seq_len=max(SEQ_LENS), num_prefills=1)
    meta = dict(block_tables=tables, seq_lens=lens, query_start_loc=qsl)
    return {n: t.to(_where["device"]) for n, t in meta.items()}, bounds, int(qsl[-1])


def _attend(query, c, mode, impl, out=None, validate=False, **kw):
    meta, bounds, _ = _metadata()
    kind = _kind(impl)
    caches = _cache_arrays(c, kind)
    result = kvzoo.paged_attention(
        kind(query),
        caches.pop("key_cache"),
        caches.pop("value_cache"),
        mode=mode,
        **caches,
        out=None if out is None else kind(out),
        impl=_checked("paged_attention", impl) if validate else impl,
        validate=validate,
        **{n: kind(t) for n, t in meta.items()},
        **({} if validate else bounds),
        **kw,
    )
    return tuple(map(as_torch, result)) if isinstance(result, tuple) else as_torch(result)


IMPLS = ("numpy", "numba", "triton-cuda")
MODES = ("int8_per_token_head", "fp8_per_token_head", "none")


def _usable(impl, mode):
    i = kvzoo.registry.default().get("reshape_and_cache", impl)
    if not i.available or mode not in i.modes:
        pytest.skip(f"{impl} does not take {mode} here")
    _where["device"] = "cuda" if "cuda" in i.devices and torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", MODES)
def test_recalled_writes_and_attention_match_checked_calls(impl, mode, hits):
    _usable(impl, mode)
    gen = torch.Generator().manual_seed(SEED + 11)
    recalled, checked = _caches(mode, gen), None
    checked = kvzoo.layout.KVCacheTensors(*(None if t is None else t.clone() for t in _cache_arrays(recalled).values()))
    for step in range(3):
        key, value = _rows(gen, 5, HKV), _rows(gen, 5, HKV)
        slots = _slots(gen, 5)
        _write(key, value, recalled, slots, mode, impl)
        _write(key, value, checked, slots, mode, impl, validate=True)
        for a, b in zip(_bytes(recalled), _bytes(checked)):
            assert torch.equal(a, b), f"step {step}: a recalled write differs from a checked one"
    assert hits["hits"] == 2
    _, _, tokens = _metadata()
    for step in range(3):
        query = _rows(gen, tokens, HQ)
        out = torch.full_like(query, float("nan"))
        _attend(query, recalled, mode, impl, out=out)
        expected = _attend(query, checked, mode, impl, validate=True)
        assert _same_bits(out, expected), f"step {step}: recalled attention differs from a checked call"
    assert hits["hits"] == 4
    # out allocated by the call, and lse, are recalled too.
    query = _rows(gen, tokens, HQ)
    first = _attend(query, recalled, mode, impl, return_lse=True)
    again = _attend(query, recalled, mode, impl, return_lse=True)
    assert hits["hits"] == 5
    assert first[0] is not again[0] and _same_bits(first[0], again[0]) and _same_bits(first[1], again[1])


def _refused_like_a_first_call(call, expected_words, caches):
    before = _bytes(caches)
    with pytest.raises(KVZooInputError) as err:
        call()
    for word in expected_words:
        assert word in str(err.value)
    for a, b in zip(before, _bytes(caches)):
        assert torch.equal(a, b), "a refused call changed the cache"


def test_what_the_shapes_do_not_show_is_checked_after_a_good_call(hits):
    # Torch tensors, for the gradient flag: an implementation taking them as they come.
    mode, impl = "int8_per_token_head", "triton-cuda"
    _usable(impl, mode)
    gen = torch.Generator().manual_seed(SEED + 12)
    c = _caches(mode, gen)
    key, value, slots = _rows(gen, 5, HKV), _rows(gen, 5, HKV), _slots(gen, 5)
    _write(key, value, c, slots, mode, impl)
    _write(key, value, c, slots, mode, impl)
    assert hits["hits"] == 1
    graded = key.clone().requires_grad_(True)
    _refused_like_a_first_call(lambda: _write(graded, value, c, slots, mode, impl), ["key", "requires_grad"], c)

    _, _, tokens = _metadata()
    query = _rows(gen, tokens, HQ)
    out = torch.empty_like(query)
    _attend(query, c, mode, impl, out=out)
    _attend(query, c, mode, impl, out=out)
    assert hits["hits"] == 2
    _refused_like_a_first_call(
        lambda: _attend(query.clone().requires_grad_(True), c, mode, impl, out=out), ["query", "requires_grad"], c
    )


def test_numpy_flags_are_in_the_key(hits):
    mode, impl = "int8_per_token_head", "numpy"
    gen = torch.Generator().manual_seed(SEED + 13)
    c = _caches(mode, gen)
    arrays = {n: t.numpy() for n, t in _cache_arrays(c).items()}
    key, value = _rows(gen, 5, HKV, torch.float32).numpy(), _rows(gen, 5, HKV, torch.float32).numpy()
    slots = _slots(gen, 5).numpy()

    def write(k=key, v=value, **over):
        kvzoo.reshape_and_cache(k, v, slot_mapping=slots, mode=mode, impl=impl, validate=False, **{**arrays, **over})

    write()
    write()
    assert hits["hits"] == 1
    read_only = arrays["key_cache"].view()
    read_only.flags.writeable = False
    _refused_like_a_first_call(lambda: write(key_cache=read_only), ["key_cache", "read-only"], c)
    swapped = key.astype(key.dtype.newbyteorder(">"))
    _refused_like_a_first_call(lambda: write(k=swapped), ["key", "byte order"], c)


def test_a_written_array_meeting_a_read_one_is_refused_at_any_address(hits):
    mode, impl = "int8_per_token_head", "numpy"
    gen = torch.Generator().manual_seed(SEED + 14)
    c = _caches(mode, gen)
    _, _, tokens = _metadata()
    rows = tokens * HQ * D
    buffer = torch.randn(3 * rows, generator=gen).to(torch.bfloat16)
    flat = as_numpy(buffer)
    view = lambda at: flat[at : at + rows].reshape(tokens, HQ, D)  # noqa: E731
    _attend(view(0), c, mode, impl, out=view(rows))
    _attend(view(0), c, mode, impl, out=view(2 * rows))
    assert hits["hits"] == 1
    # Same shapes, strides and alignment as the recalled calls: only the addresses tell.
    untouched = buffer.clone()
    with pytest.raises(KVZooInputError, match="out: shares memory with query"):
        _attend(view(rows), c, mode, impl, out=view(rows + 8 * D))
    assert _same_bits(buffer, untouched)


def test_the_inline_page_is_recalled_and_a_shifted_scale_view_is_not(hits):
    mode, impl = "int8_per_token_head", "numpy"
    gen = torch.Generator().manual_seed(SEED + 15)
    c = _caches(mode, gen, layout="inline")
    key, value, slots = _rows(gen, 5, HKV), _rows(gen, 5, HKV), _slots(gen, 5)
    checked = _caches(mode, torch.Generator().manual_seed(SEED + 15), layout="inline")
    for _ in range(2):
        _write(key, value, c, slots, mode, impl)
        _write(key, value, checked, slots, mode, impl, validate=True)
    assert hits["hits"] == 1
    assert torch.equal(c.buffer, checked.buffer)
    # The scale view moved 16 bytes (its alignment kept) back into the codes: the same
    # metadata as the recalled calls, now overlapping the key codes it is written beside.
    page = c.buffer.view(torch.uint8)
    scales = c.k_scale_cache
    moved = torch.as_strided(
        page.view(-1).view(torch.float32), scales.shape, scales.stride(), scales.storage_offset() - 4
    )
    arrays = {**_cache_arrays(c), "k_scale_cache": moved}
    before = page.clone()
    with pytest.raises(KVZooInputError, match="shares memory"):
        kvzoo.reshape_and_cache(
            *map(as_numpy, (key, value)),
            slot_mapping=as_numpy(slots),
            mode=mode,
            impl=impl,
            validate=False,
            **{n: as_numpy(a) for n, a in arrays.items()},
        )
    assert torch.equal(page, before)


def test_separate_tensors_with_the_inline_strides_choose_as_a_first_call(hits):
    # Storage sharing is an option the registry selects by (inline_layout); no shape shows it.
    # Torch tensors: storage identity is what the registry asks of them.
    mode, impl = "int8_per_token_head", "triton-cuda"
    _usable(impl, mode)
    gen = torch.Generator().manual_seed(SEED + 16)
    inline = _caches(mode, gen, layout="inline")
    key, value, slots = _rows(gen, 5, HKV), _rows(gen, 5, HKV), _slots(gen, 5)
    _write(key, value, inline, slots, mode, impl)
    separate = {
        n: torch.as_strided(torch.empty_like(inline.buffer).view(t.dtype), t.shape, t.stride(), t.storage_offset())
        for n, t in _cache_arrays(inline).items()
    }
    kvzoo.reshape_and_cache(key, value, slot_mapping=slots, mode=mode, impl=impl, validate=False, **separate)
    assert hits["hits"] == 0


# The plan's per-layer calls recall the same way (StepPlan._keep), per layer.


@pytest.fixture
def plan_hits(monkeypatch):
    """Counts the plan's recalled launches: the launch a layer's call is bound to (plan._bind)
    is run by later calls only (the call that bound it ran through the table)."""
    counted = {"hits": 0}
    original = kvzoo.plan._bind

    def counting(call, launch, *rest):
        def counted_launch(operands):
            counted["hits"] += 1
            launch(operands)

        return original(call, None if launch is None else counted_launch, *rest)

    monkeypatch.setattr(kvzoo.plan, "_bind", counting)
    return counted


def _int8_spec():
    return kvzoo.CacheSpec(
        "int8_per_token_head",
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        num_kv_heads=HKV,
        head_size=D,
        device=_where["device"],
    )


def _prepared_plan(gen):
    # The Triton backend: the plan recalls prepared launches (the CPU backends prepare none).
    _usable("triton-cuda", "int8_per_token_head")
    spec = _int8_spec()
    meta, bounds, tokens = _metadata()
    slots = _slots(gen, tokens)
    plan = kvzoo.plan_step(
        spec, **meta, slot_mapping=slots, num_q_heads=HQ, impl="triton-cuda", validate=False, **bounds
    )
    return spec, plan, spec.allocate(), tokens


def _copy(caches):
    return kvzoo.layout.KVCacheTensors(*(a.clone() for a in _cache_arrays(caches).values()))


def test_the_plan_recalls_and_still_refuses_what_the_addresses_decide(plan_hits):
    gen = torch.Generator().manual_seed(SEED + 17)
    spec, plan, caches, tokens = _prepared_plan(gen)
    checked = _copy(caches)
    for _ in range(3):
        key, value = _rows(gen, tokens, HKV), _rows(gen, tokens, HKV)
        plan.write(key, value, caches)
        kvzoo.reshape_and_cache(
            key, value, slot_mapping=plan.slot_mapping, mode=spec.mode, impl="triton-cuda", **_cache_arrays(checked)
        )
        for a, b in zip(_bytes(caches), _bytes(checked)):
            assert torch.equal(a, b), "a recalled plan write differs from a checked call"
    assert plan_hits["hits"] == 2
    # A key whose bytes are the key cache's own: the metadata of the recalled keys, but the
    # write would read rows it overwrites.
    inside = caches.key_cache.view(-1).view(key.dtype)[: key.numel()].view(key.shape)
    before = _bytes(caches)
    with pytest.raises(KVZooInputError, match="shares memory"):
        plan.write(inside, value, caches)
    assert all(torch.equal(a, b) for a, b in zip(before, _bytes(caches)))

    query = _rows(gen, tokens, HQ)
    out = torch.empty_like(query)
    for _ in range(2):
        plan.attention(query, caches, out=out)
    allocated = [plan.attention(query, caches) for _ in range(2)]
    assert allocated[1] is not allocated[0] and all(_same_bits(a, out) for a in allocated)
    assert plan_hits["hits"] == 4
    flat = torch.cat([query.view(-1), query.view(-1)])
    overlapping = flat[query.numel() // 2 : query.numel() // 2 + query.numel()].view(query.shape)
    with pytest.raises(KVZooInputError, match="out: shares memory with query"):
        plan.attention(flat[: query.numel()].view(query.shape), caches, out=overlapping)


class _Subclass(torch.Tensor):
    """A tensor subclass: launches.signature cannot vouch for what its methods report."""


def test_the_plan_checks_tensor_subclasses_in_full_every_call(plan_hits):
    # Neither recalled nor kept: a kept entry would answer any later subclass call of the
    # layer, whatever its shape.
    gen = torch.Generator().manual_seed(SEED + 19)
    _, plan, caches, tokens = _prepared_plan(gen)
    checked = _copy(caches)  # written by the same plan, with plain tensors
    for _ in range(2):
        key, value = _rows(gen, tokens, HKV), _rows(gen, tokens, HKV)
        plan.write(key.as_subclass(_Subclass), value.as_subclass(_Subclass), caches)
        plan.write(key, value, checked)
        for a, b in zip(_bytes(caches), _bytes(checked)):
            assert torch.equal(a, b), "a plan write of tensor subclasses differs from one of tensors"
        query = _rows(gen, tokens, HQ)
        expected = plan.attention(query, checked)
        given = torch.empty_like(query).as_subclass(_Subclass)
        assert _same_bits(plan.attention(query.as_subclass(_Subclass), caches, out=given), expected)
        assert _same_bits(plan.attention(query.as_subclass(_Subclass), caches), expected)
    assert plan_hits["hits"] == 2  # the plain calls' second round only
    narrow = _rows(gen, tokens, HKV)[..., : D // 2].as_subclass(_Subclass)
    with pytest.raises(KVZooInputError, match="expected shape"):
        plan.write(narrow, narrow, caches)
    with pytest.raises(KVZooInputError, match="expected shape"):
        plan.attention(_rows(gen, tokens, HQ)[..., : D // 2].as_subclass(_Subclass), caches)


def _restrided(x):
    """x's values with other strides (its last two dimensions laid out swapped), same shape."""
    return x.transpose(-1, -2).contiguous().transpose(-1, -2)


def _misaligned(x):
    """x's values at an address one element past a 16-byte boundary, same shape and strides."""
    return torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)[1:].view(x.shape).copy_(x)


def test_the_plan_recalls_no_call_whose_metadata_differs(plan_hits):
    # A recalled call skips the checks and launches what was prepared for the strides and
    # alignment of the calls it was kept from: each thing the key reads, changed alone, takes
    # the checked path (nothing recalled) and gives that path's result or refusal.
    gen = torch.Generator().manual_seed(SEED + 23)
    spec, plan, caches, tokens = _prepared_plan(gen)
    checked = _copy(caches)
    key, value = _rows(gen, tokens, HKV), _rows(gen, tokens, HKV)
    for _ in range(2):
        plan.write(key, value, caches)
    query, out = _rows(gen, tokens, HQ), torch.empty(tokens, HQ, D, dtype=torch.bfloat16, device=_where["device"])
    # A layer keeps one binding per operation: the calls of each metadata in a row.
    for given in (out, None):
        for _ in range(2):
            plan.attention(query, caches, out=given)
    assert plan_hits["hits"] == 3
    assert _restrided(key).stride() != key.stride() and _misaligned(key).data_ptr() % 16
    for k, v in ((_restrided(key), value), (key, _misaligned(value))):
        plan.write(k, v, caches)
        kvzoo.reshape_and_cache(
            key, value, slot_mapping=plan.slot_mapping, mode=spec.mode, impl="triton-cuda", **_cache_arrays(checked)
        )
        for a, b in zip(_bytes(caches), _bytes(checked)):
            assert torch.equal(a, b), "a write of other strides or alignment differs from a checked one"
    expected = plan.attention(query, checked)
    for q, o in (
        (_restrided(query), None),
        (_misaligned(query), out),
        (query, _misaligned(out)),
        (query, _restrided(out)),
    ):
        assert _same_bits(plan.attention(q, caches, out=o), expected)
    for bad, name in (
        (lambda: plan.write(key.clone().requires_grad_(), value, caches), "key: requires_grad"),
        (lambda: plan.write(key, value.half(), caches), "value: expected dtype"),
        (lambda: plan.attention(query.clone().requires_grad_(), caches, out=out), "query: requires_grad"),
        (lambda: plan.attention(query, caches, out=out.half()), "out: expected dtype"),
        (lambda: plan.attention(query[:, :, : D // 2], caches), "query: expected shape"),
    ):
        with pytest.raises(KVZooInputError, match=name):
            bad()
    assert plan_hits["hits"] == 3


def _plan_over(buf, at, **meta_views):
    """A Triton plan whose caches (and any metadata tensor named in meta_views, by its byte
    offset) are views of one byte buffer, from offset `at`: arrays the test places in the same
    buffer can then sit exactly at, or across, their edges."""
    spec = _int8_spec()
    codes, scales = NUM_BLOCKS * BLOCK_SIZE * HKV * D, NUM_BLOCKS * BLOCK_SIZE * HKV * 4
    shape = (NUM_BLOCKS, BLOCK_SIZE, HKV)
    kc, vc = (buf[at + n * codes : at + (n + 1) * codes].view(torch.int8).view(*shape, D) for n in (0, 1))
    ks, vs = (
        buf[at + 2 * codes + n * scales : at + 2 * codes + (n + 1) * scales].view(torch.float32).view(shape)
        for n in (0, 1)
    )
    caches = kvzoo.layout.KVCacheTensors(kc, vc, ks, vs)
    meta, bounds, tokens = _metadata()
    for name, offset in meta_views.items():
        t = meta[name]
        view = buf[offset : offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        meta[name] = view.copy_(t)
    gen = torch.Generator().manual_seed(SEED + 31)
    plan = kvzoo.plan_step(
        spec, **meta, slot_mapping=_slots(gen, tokens), num_q_heads=HQ, impl="triton-cuda", validate=False, **bounds
    )
    return plan, caches, tokens, gen, (at, at + 2 * codes + 2 * scales)


def test_a_recalled_call_is_refused_one_granule_across_an_edge_and_taken_at_it(plan_hits):
    # The recalled checks compare addresses against extents kept as ranges: a key or an out
    # that ends where the caches begin, or begins where they end, is recalled; moved 16 bytes
    # (one alignment step, so the recall key is the same) into them, it is refused with the
    # caches' bytes unchanged.
    _usable("triton-cuda", "int8_per_token_head")
    buf = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8).to(_where["device"])
    plan, caches, tokens, gen, (low, high) = _plan_over(buf, 8192)
    key, value = _rows(gen, tokens, HKV), _rows(gen, tokens, HKV)
    for _ in range(2):
        plan.write(key, value, caches)
    assert plan_hits["hits"] == 1

    def at(start, like):
        return buf[start : start + like.numel() * 2].view(torch.bfloat16).view(like.shape)

    def placed(start, like):  # outside the caches only: the copy would write into them
        return at(start, like).copy_(like)

    size = key.numel() * 2
    for start in (low - size, high):
        hits = plan_hits["hits"]
        plan.write(placed(start, key), value, caches)
        assert plan_hits["hits"] == hits + 1, start
    for start in (low - size + 16, high - 16):
        before, hits = _bytes(caches), plan_hits["hits"]
        with pytest.raises(KVZooInputError, match="shares memory"):
            plan.write(at(start, key), value, caches)
        assert plan_hits["hits"] == hits and all(torch.equal(a, b) for a, b in zip(before, _bytes(caches)))

    query = _rows(gen, tokens, HQ)
    size = query.numel() * 2
    plan.attention(query, caches, out=placed(40000, query))
    hits = plan_hits["hits"]
    for start in (low - size, high):
        plan.attention(query, caches, out=at(start, query))
    assert plan_hits["hits"] == hits + 2
    for start in (low - size + 16, high - 16, low + 1024):
        before = _bytes(caches)
        with pytest.raises(KVZooInputError, match="shares memory"):
            plan.attention(query, caches, out=at(start, query))
        assert all(torch.equal(a, b) for a, b in zip(before, _bytes(caches)))
    assert plan_hits["hits"] == hits + 2


def test_a_recalled_out_over_the_plans_metadata_is_refused(plan_hits):
    # The metadata the kernels read (here block_tables) is among the extents a recalled out is
    # checked against: an out over it would overwrite the step's page tables.
    _usable("triton-cuda", "int8_per_token_head")
    buf = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8).to(_where["device"])
    tables_at = 20000
    plan, caches, tokens, gen, _ = _plan_over(buf, 0, block_tables=tables_at)
    tables = plan.block_tables
    assert tables.data_ptr() == buf.data_ptr() + tables_at
    query = _rows(gen, tokens, HQ)
    size = query.numel() * 2

    def out_at(start):
        return buf[start : start + size].view(torch.bfloat16).view(query.shape)

    plan.attention(query, caches, out=out_at(40000))
    plan.attention(query, caches, out=out_at(40000 + size))
    assert plan_hits["hits"] == 1
    end = tables_at + tables.numel() * 4
    for start in (tables_at - size + 16, end - 16 - end % 16):
        before = tables.clone()
        with pytest.raises(KVZooInputError, match="shares memory"):
            plan.attention(query, caches, out=out_at(start - start % 16))
        assert torch.equal(before, tables)
    assert plan_hits["hits"] == 1


def test_the_plans_refused_starts_are_exactly_the_overlapping_ones():
    # StepPlan's recalled calls refuse an array by bisecting its address into ranges built
    # once from the fixed extents: every start must get the verdict of a direct comparison.
    from kvzoo.plan import _refused_starts

    rng = torch.Generator().manual_seed(SEED + 29)
    for _ in range(200):
        n = int(torch.randint(0, 6, (1,), generator=rng))
        extents = []
        for _ in range(n):
            a = int(torch.randint(0, 200, (1,), generator=rng))
            extents.append((a, a + int(torch.randint(1, 40, (1,), generator=rng))))
        low = int(torch.randint(-20, 5, (1,), generator=rng))
        span = (low, low + int(torch.randint(1, 50, (1,), generator=rng)))
        refused = _refused_starts(span, extents)
        assert list(refused) == sorted(refused)
        for start in range(-80, 280):
            meets = any(start + span[0] < b and a < start + span[1] for a, b in extents)
            assert bool(bisect.bisect_right(refused, start) & 1) == meets, (span, extents, start)


def test_a_full_table_lets_go_of_its_oldest_entries_only():
    # The prepared and recalled launches are kept in tables of bounded size: a new signature
    # past the bound evicts the oldest entry, never the whole table (an engine's layers would
    # re-prepare every launch at once); a key already there is replaced, not added.
    assert launches._TABLE.maxsize == launches._MAX_ENTRIES
    table = type(launches._TABLE)(maxsize=3)
    for n in range(5):
        table[n] = str(n)
    assert list(table) == [2, 3, 4]
    table[3] = "again"
    assert dict(table) == {2: "2", 3: "again", 4: "4"}
    table[9], table[10] = "9", "10"
    assert set(table) == {3, 9, 10}  # the oldest inserted or replaced go first: 2, then 4
    entry = launches.Resolved(launches, None, None, None, None)
    assert type(entry.launches) is type(table) and entry.launches.maxsize == launches._MAX_LAUNCHES
