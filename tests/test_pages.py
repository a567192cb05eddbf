"""kvzoo.distributed in one process: pages gathered and placed (either layout, any mode), host
offload, safetensors files (round trip, refusals, truncated and altered files), head shards'
arguments. The multi-process parts are tests/test_distributed.py.

Every cache starts as random bytes (never zeros), so a byte written where it should not be,
or not written where it should, shows; every comparison is of bits.
"""

from __future__ import annotations

import doctest
import importlib
import json
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
from distributed_scenarios import arrays, bits, poison, snapshot, untouched

import kvzoo
from kvzoo import KVZooInputError
from kvzoo.distributed import (
    FORMAT_VERSION,
    CorruptPagesError,
    Pages,
    PagesMismatchError,
    gather_pages,
    load_pages,
    pages_header,
    place_pages,
    save_pages,
    shard_spec,
)

from support import rng_for

BS, D, NB = 8, 16, 24
LENS = [20, 8, 17]  # sequence 1 is sequence 0's first block


def _spec(mode, layout="separate", heads=2, **kw):
    return kvzoo.CacheSpec(
        mode, num_blocks=NB, block_size=BS, num_kv_heads=heads, head_size=D, layout=layout, model_dtype="bfloat16", **kw
    )


def _static(mode, rng):
    return (float(rng.uniform(0.02, 0.05)), float(rng.uniform(0.02, 0.05))) if mode.per_tensor else None


def _rows(rng, n, heads):
    return torch.from_numpy(rng.standard_normal((n, heads, D)).astype(np.float32)).to(torch.bfloat16)


def _written(spec, rng, layers=2, static=None):
    """Caches of spec (random bytes first) with sequences 0 and 2 written; sequence 1 is
    sequence 0's first block. Returns (caches, block table rows)."""
    caches = [spec.allocate() for _ in range(layers)]
    poison(caches, rng)
    free = [int(b) for b in rng.permutation(NB)]
    t0, t2 = free[:3], free[3:6]
    slots = [t0[p // BS] * BS + p % BS for p in range(20)] + [t2[p // BS] * BS + p % BS for p in range(17)]
    scales = {} if static is None else {"k_scale": static[0], "v_scale": static[1]}
    for t in caches:
        kvzoo.reshape_and_cache(
            _rows(rng, 37, spec.num_kv_heads),
            _rows(rng, 37, spec.num_kv_heads),
            t.key_cache,
            t.value_cache,
            torch.tensor(slots),
            mode=spec.mode,
            k_scale_cache=t.k_scale_cache,
            v_scale_cache=t.v_scale_cache,
            impl="numpy",
            **scales,
        )
    return caches, [t0, t0[:1], t2]


def _table(rows):
    width = max(len(r) for r in rows)
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int32)


def _decode_outputs(spec, caches, rows, lens, static, rng_key):
    """One decode step of every sequence (queries from rng_key), each layer's attention bytes."""
    rng = rng_for(*rng_key)
    Hq = 2 * spec.num_kv_heads
    scales = {} if static is None else {"k_scale": static[0], "v_scale": static[1]}
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32)
    outs = []
    for t in caches:
        out = kvzoo.paged_attention(
            _rows(rng, len(lens), Hq),
            t.key_cache,
            t.value_cache,
            mode=spec.mode,
            block_tables=_table(rows),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            query_start_loc=qsl,
            k_scale_cache=t.k_scale_cache,
            v_scale_cache=t.v_scale_cache,
            impl="numpy",
            **scales,
        )
        outs.append(bits(out))
    return outs


def _blocks(caches, rows, heads=slice(None)):
    return [bits(a)[[b for r in rows for b in r]][:, :, heads] for t in caches for a in arrays(t)]


# kvzoo.distributed moves one-format modes (split ones are refused: test below).
ONE_FORMAT = [m for m in kvzoo.MODES.values() if not m.split]
LAYOUT_PAIRS = [(m, a, b) for m in ONE_FORMAT for a in m.layouts for b in m.layouts]


@pytest.mark.parametrize("mode", [m for m in kvzoo.MODES.values() if m.split], ids=lambda m: m.name)
def test_split_modes_are_refused_naming_the_spec(mode):
    spec = _spec(mode, "separate")
    caches = spec.allocate()
    with pytest.raises(KVZooInputError, match="^spec: mode .* two formats"):
        gather_pages([caches], spec, _table([[0]]), torch.tensor([1]))


@pytest.mark.parametrize("mode, src, dst", LAYOUT_PAIRS, ids=[f"{m.name}-{a}-{b}" for m, a, b in LAYOUT_PAIRS])
def test_pages_placed_into_either_layout_hold_the_source_bytes_and_attend_alike(mode, src, dst):
    rng = rng_for("pages", mode.name, src, dst)
    static = _static(mode, rng)
    scales = None if static is None else [static, static]
    source_spec, target_spec = _spec(mode, src), _spec(mode, dst)
    source, rows = _written(source_spec, rng, static=static)
    pages = gather_pages(
        source, source_spec, _table(rows), torch.tensor(LENS), seq_ids=[7, "b", 9], static_scales=scales
    )
    assert pages.header.num_pages == 6 and pages.header.layout == src  # the shared block is one page

    target = [target_spec.allocate() for _ in range(2)]
    poison(target, rng)
    snap = snapshot(target)
    engine = torch.from_numpy(rng.integers(0, NB, (5, 6)).astype(np.int32))
    engine_lens = torch.from_numpy(rng.integers(0, 99, 5).astype(np.int32))
    before, lens_before = engine.clone(), engine_lens.clone()
    free = [int(b) for b in rng.permutation(NB)]
    placed = place_pages(
        pages.to_host(), target, target_spec, allocate=free, block_tables=engine, rows=[3, 0, 4], seq_lens=engine_lens
    )
    new_rows = [[b for b in r if b >= 0] for r in placed.block_tables.tolist()]
    assert placed.block_ids.tolist() == free[:6] and placed.seq_ids == (7, "b", 9)
    assert placed.seq_lens.tolist() == LENS and new_rows[1] == new_rows[0][:1]
    as_f32 = None if static is None else tuple(float(np.float32(s)) for s in static)
    assert placed.static_scales == (None if static is None else (as_f32, as_f32))
    for got, want in zip(_blocks(target, new_rows), _blocks(source, rows)):
        assert torch.equal(got, want)
    untouched(target, snap, skip_blocks=free[:6])
    for s, r in enumerate([3, 0, 4]):
        n = len(new_rows[s])
        assert engine[r, :n].tolist() == new_rows[s] and torch.equal(engine[r, n:], before[r, n:])
        assert int(engine_lens[r]) == LENS[s]
    assert torch.equal(engine[[1, 2]], before[[1, 2]]) and torch.equal(engine_lens[[1, 2]], lens_before[[1, 2]])
    key = ("pages-decode", mode.name, src, dst)
    for got, want in zip(
        _decode_outputs(target_spec, target, new_rows, LENS, static, key),
        _decode_outputs(source_spec, source, rows, LENS, static, key),
    ):
        assert torch.equal(got, want)


def test_the_whole_cache_goes_back_to_its_own_blocks_and_offload_is_a_plain_copy_without_cuda():
    rng = rng_for("whole")
    spec = _spec("fp8_per_token_head", "inline")
    source, _ = _written(spec, rng, layers=3)
    host = gather_pages(source, spec).to_host()
    assert host.header.source_blocks == tuple(range(NB)) and host.header.seq_lens == ()
    assert host.device.type == "cpu" and host.pinned == torch.cuda.is_available()
    target = [spec.allocate() for _ in range(3)]
    poison(target, rng)
    placed = place_pages(host, target, spec)
    assert placed.block_ids.tolist() == list(range(NB)) and tuple(placed.block_tables.shape) == (0, 0)
    for got, want in zip(snapshot(target), snapshot(source)):
        assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("mode", ONE_FORMAT, ids=lambda m: m.name)
def test_a_saved_file_restores_the_same_bytes(mode, tmp_path):
    rng = rng_for("file", mode.name)
    static = _static(mode, rng)
    spec = _spec(mode, mode.layouts[-1])
    source, rows = _written(spec, rng, static=static)
    pages = gather_pages(
        source, spec, _table(rows), torch.tensor(LENS), static_scales=None if static is None else [static] * 2
    )
    path = tmp_path / "pages.safetensors"
    size = save_pages(path, pages)
    assert size == path.stat().st_size and not list(tmp_path.glob(".*partial"))
    assert pages_header(path) == pages.header
    loaded = load_pages(path)
    assert loaded.header == pages.header
    for a, b in zip(loaded.layers, pages.layers):
        assert torch.equal(a, b)
    target = [spec.allocate() for _ in range(2)]
    poison(target, rng)
    placed = place_pages(loaded, target, spec, allocate=list(range(NB - 1, -1, -1)))
    new_rows = [[b for b in r if b >= 0] for r in placed.block_tables.tolist()]
    for got, want in zip(_blocks(target, new_rows), _blocks(source, rows)):
        assert torch.equal(got, want)
    # Readable without kvzoo: the file's tensors are named pieces, codes as bytes.
    from safetensors.numpy import load_file

    tensors = load_file(str(path))
    assert set(tensors) == {f"layers.{n}.{p}" for n in range(2) for p in _pieces(mode)}
    codes = tensors["layers.0.k.codes"]
    assert codes.dtype == np.uint8 and codes.shape[:3] == (6, BS, 2)


def _pieces(mode):
    return ("k.codes", "v.codes", "k.scales", "v.scales") if mode.per_token_head else ("k.codes", "v.codes")


def _file(tmp_path, mode="int8_per_token_head", heads=2, layers=2):
    rng = rng_for("refusals", mode, heads)
    spec = _spec(mode, heads=heads)
    source, rows = _written(spec, rng, layers=layers)
    path = tmp_path / "pages.safetensors"
    save_pages(path, gather_pages(source, spec, _table(rows), torch.tensor(LENS)))
    return path


@pytest.mark.parametrize(
    "field, target",
    [
        ("mode", dict(mode="fp8_per_token_head")),
        ("total_kv_heads", dict(heads=4)),
        ("head_size", dict(head_size=32)),
        ("block_size", dict(block_size=16)),
        ("num_layers", dict(layers=3)),
        ("model_dtype", dict(mode="none", model_dtype="float16")),
    ],
)
def test_loading_into_a_cache_that_does_not_fit_is_refused_naming_the_field(tmp_path, field, target):
    path = _file(tmp_path, mode="none" if field == "model_dtype" else "int8_per_token_head")
    spec = kvzoo.CacheSpec(
        target.get("mode", "none" if field == "model_dtype" else "int8_per_token_head"),
        num_blocks=NB,
        block_size=target.get("block_size", BS),
        num_kv_heads=target.get("heads", 2),
        head_size=target.get("head_size", D),
        model_dtype=target.get("model_dtype", "bfloat16"),
    )
    caches = [spec.allocate() for _ in range(target.get("layers", 2))]
    poison(caches, rng_for("refused", field))
    snap = snapshot(caches)
    calls = []
    with pytest.raises(PagesMismatchError, match=rf"^{field}: the pages have"):
        place_pages(load_pages(path), caches, spec, allocate=lambda n: calls.append(n) or list(range(n)))
    untouched(caches, snap)
    assert not calls, "the allocator was asked before the pages were found not to fit"


def _rewrite_header(path, change):
    """The file with its pages header changed by `change` (checksums left as they were)."""
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    head = json.loads(data[8 : 8 + size])
    header = json.loads(head["__metadata__"]["kvzoo.header"])
    change(header)
    head["__metadata__"]["kvzoo.header"] = json.dumps(header, separators=(",", ":"))
    text = json.dumps(head).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + size :])


def test_a_file_of_another_format_version_is_refused_naming_the_version(tmp_path):
    path = _file(tmp_path)
    _rewrite_header(path, lambda h: h.update(version=FORMAT_VERSION + 1))
    with pytest.raises(PagesMismatchError, match=rf"^version: the pages are of format version {FORMAT_VERSION + 1}"):
        load_pages(path)
    with pytest.raises(PagesMismatchError, match="^version"):
        pages_header(path)


def test_an_altered_header_is_refused_by_its_checksum(tmp_path):
    path = _file(tmp_path)
    _rewrite_header(path, lambda h: h.update(seq_lens=[20, 8, 18]))  # consistent, but not what was saved
    with pytest.raises(CorruptPagesError, match="header's checksum does not match"):
        load_pages(path)


def test_a_truncated_file_is_refused_at_every_length(tmp_path):
    path = _file(tmp_path)
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    cuts = {0, 4, 8, 8 + size // 2, 8 + size, 8 + size + 1, (8 + size + len(data)) // 2, len(data) - 1}
    cuts |= {int(c) for c in rng_for("cuts").integers(0, len(data), 8)}
    for cut in sorted(cuts):
        path.write_bytes(data[:cut])
        with pytest.raises(CorruptPagesError):
            load_pages(path)


def test_a_flipped_byte_is_refused_or_changes_nothing(tmp_path):
    """A flip anywhere: refused, or (a flip in the JSON's padding that leaves it meaning the
    same) the very same pages; never different pages."""
    path = _file(tmp_path)
    data = path.read_bytes()
    original = load_pages(path)
    (size,) = struct.unpack("<Q", data[:8])
    rng = rng_for("flips")
    header_spots = rng.integers(0, 8 + size, 40)
    data_spots = rng.integers(8 + size, len(data), 40)
    refused = 0
    for spot in [*header_spots, *data_spots]:
        flipped = bytearray(data)
        flipped[spot] ^= int(rng.integers(1, 256))
        path.write_bytes(bytes(flipped))
        try:
            pages = load_pages(path)
        except (CorruptPagesError, PagesMismatchError):
            refused += 1
            continue
        assert spot < 8 + size, f"a flip of data byte {spot} was not refused"
        assert pages.header == original.header
        assert all(torch.equal(a, b) for a, b in zip(pages.layers, original.layers))
    assert refused >= 40 + 30, f"only {refused} of 80 flips refused"


def test_place_pages_refuses_bad_block_ids_and_table_arguments_before_writing():
    rng = rng_for("place-args")
    spec = _spec("int8_per_token_head")
    source, rows = _written(spec, rng)
    pages = gather_pages(source, spec, _table(rows), torch.tensor(LENS))
    target = [spec.allocate() for _ in range(2)]
    poison(target, rng)
    snap = snapshot(target)
    table = torch.zeros(4, 3, dtype=torch.int32)
    cases = [
        (dict(allocate=[1, 2, 3]), "allocate: 3 free blocks given, the pages need 6"),
        (dict(allocate=[1, 2, 3, 4, 5, 5]), "allocate: block ids must be distinct"),
        (dict(allocate=[1, 2, 3, 4, 5, NB]), rf"allocate: block ids must be in \[0, {NB}\)"),
        (dict(allocate=lambda n: [0] * (n - 1)), "allocate: expected 6 integer block ids"),
        (dict(allocate=range(NB), rows=[0, 1, 2]), "rows, seq_lens: .* pass block_tables too"),
        (dict(allocate=range(NB), block_tables=table), "rows: required with block_tables"),
        (dict(allocate=range(NB), block_tables=table, rows=[0, 0, 1]), "rows: expected distinct rows"),
        (dict(allocate=range(NB), block_tables=table, rows=[0, 1]), "rows: 2 rows for the pages' 3 sequences"),
        (dict(allocate=range(NB), block_tables=table[:, :2], rows=[0, 1, 2]), "block_tables: a sequence .* needs 3"),
        (dict(allocate=range(NB), block_tables=table, rows=[0, 1, 9]), r"rows\[2\]: expected an int in \[0, 3\]"),
        (dict(allocate=3.5), "allocate: expected a callable"),
    ]
    for kwargs, message in cases:
        with pytest.raises(KVZooInputError, match=message):
            place_pages(pages, target, spec, **kwargs)
        untouched(target, snap)
        assert not table.any()


def test_a_whole_model_file_restores_into_each_rank_of_a_head_sharded_cache(tmp_path):
    rng = rng_for("shard-restore")
    full = _spec("fp8_per_token_head", heads=4)
    source, rows = _written(full, rng)
    path = tmp_path / "model.safetensors"
    save_pages(path, gather_pages(source, full, _table(rows), torch.tensor(LENS)))
    for rank in range(2):
        shard = shard_spec(full, 8, rank=rank, world_size=2)
        mine = [shard.allocate() for _ in range(2)]
        placed = place_pages(load_pages(path), mine, shard, allocate=range(NB))
        new_rows = [[b for b in r if b >= 0] for r in placed.block_tables.tolist()]
        heads = slice(shard.kv_heads.start, shard.kv_heads.stop)
        for got, want in zip(_blocks(mine, new_rows), _blocks(source, rows, heads)):
            assert torch.equal(got, want)
    # The other way round a shard's pages hold too few heads for the whole model.
    part = gather_pages(mine, shard, placed.block_tables, placed.seq_lens)
    assert part.header.kv_heads == (2, 4) and part.header.total_kv_heads == 4
    with pytest.raises(PagesMismatchError, match=r"^kv_heads: the pages hold the model's KV heads \[2, 4\]"):
        place_pages(part, [full.allocate() for _ in range(2)], full, allocate=range(NB))


def test_shard_spec_splits_by_whole_kv_heads_and_refuses_what_does_not_divide():
    spec = _spec("int8_per_token_head", heads=4)
    shard = shard_spec(spec, 12, rank=3, world_size=4)
    assert (shard.spec.num_kv_heads, shard.kv_heads, shard.q_heads) == (1, range(3, 4), range(9, 12))
    assert shard.spec.layout == spec.layout and shard.spec.num_blocks == spec.num_blocks
    x = torch.arange(5 * 12 * 3).reshape(5, 12, 3)
    assert torch.equal(shard.local_q(x), x[:, 9:12]) and torch.equal(
        shard.local_q(torch.arange(12)), torch.arange(9, 12)
    )
    assert torch.equal(shard.local_kv(x[:, :4]), x[:, 3:4])
    with pytest.raises(KVZooInputError, match="world_size: the cache's 4 KV heads do not split evenly over 3 ranks"):
        shard_spec(spec, 12, rank=0, world_size=3)
    with pytest.raises(KVZooInputError, match="num_q_heads: 10 must be a multiple"):
        shard_spec(spec, 10, rank=0, world_size=2)
    with pytest.raises(KVZooInputError, match="rank, world_size: give both"):
        shard_spec(spec, 12, rank=0)
    with pytest.raises(KVZooInputError, match=r"rank: expected an int in \[0, world_size - 1=1\]"):
        shard_spec(spec, 12, rank=2, world_size=2)
    with pytest.raises(KVZooInputError, match="x: expected 12 heads on axis 1"):
        shard.local_q(x[:, :4])
    with pytest.raises(KVZooInputError, match="num_q_heads, cache_spec: a HeadShard passes its own"):
        shard.plan_step(num_q_heads=3, block_tables=None, seq_lens=None, query_start_loc=None)


def test_transfers_need_a_process_group_and_a_finite_timeout():
    from kvzoo.distributed import recv_pages, send_pages

    spec = _spec("int8_per_token_head")
    caches = [spec.allocate()]
    if not torch.distributed.is_initialized():
        with pytest.raises(KVZooInputError, match="torch.distributed is not initialised"):
            send_pages(caches, spec, torch.tensor([[0]]), torch.tensor([3]), dst=1)
    with pytest.raises(KVZooInputError, match="allocate: required"):
        recv_pages(caches, spec, src=0, allocate=None)
    with pytest.raises(KVZooInputError, match="timeout: expected a finite number of seconds > 0"):
        recv_pages(caches, spec, src=0, allocate=[1], timeout=float("inf"))
    with pytest.raises(KVZooInputError, match="static_scales: mode 'fp8_per_tensor' reads its pages with static"):
        gather_pages([_spec("fp8_per_tensor").allocate()], _spec("fp8_per_tensor"))
    with pytest.raises(KVZooInputError, match="spec: kvzoo.distributed moves torch tensors"):
        gather_pages(caches, _spec("int8_per_token_head", device=None))


def test_without_safetensors_the_files_say_what_to_install(monkeypatch, tmp_path):
    pages = gather_pages([_spec("int8_per_token_head").allocate()], _spec("int8_per_token_head"))
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.numpy", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'kvzoo\[dist\]'"):
        save_pages(tmp_path / "x.safetensors", pages)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'kvzoo\[dist\]'"):
        load_pages(tmp_path / "x.safetensors")


def test_importing_kvzoo_imports_neither_this_package_nor_safetensors():
    code = "import sys, kvzoo; print(sorted(m for m in ('kvzoo.distributed', 'safetensors') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_no_sequences_make_pages_of_nothing_that_place_nothing():
    spec = _spec("fp8_per_token_head", "inline")
    caches = [spec.allocate()]
    poison(caches, rng_for("empty"))
    snap = snapshot(caches)
    pages = gather_pages(caches, spec, torch.zeros(2, 1, dtype=torch.int32), torch.tensor([0, 0]))
    assert pages.header.num_pages == 0 and pages.nbytes == 0 and pages.header.seq_lens == (0, 0)
    placed = place_pages(pages, caches, spec, allocate=lambda n: list(range(n)))
    assert placed.block_ids.numel() == 0 and placed.seq_lens.tolist() == [0, 0]
    untouched(caches, snap)


def test_without_torch_kvzoo_imports_and_this_package_says_what_to_install():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import kvzoo\n"
        "try:\n    import kvzoo.distributed\nexcept ModuleNotFoundError as e:\n    print(e)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "kvzoo.distributed needs torch: pip install 'kvzoo[dist]'", out.stdout + out.stderr


def test_pages_check_their_buffers():
    header = gather_pages([_spec("int8_per_token_head").allocate()], _spec("int8_per_token_head")).header
    with pytest.raises(KVZooInputError, match="layers: expected 1 uint8 tensors"):
        Pages(header, [torch.zeros(3, dtype=torch.uint8)])


@pytest.mark.parametrize("module", ["pages", "persist", "sharding", "transfer"])
def test_docstring_examples_run(module):
    mod = importlib.import_module(f"kvzoo.distributed.{module}")
    assert doctest.testmod(mod, optionflags=doctest.ELLIPSIS).failed == 0


def test_transfer_arguments_are_checked_before_anything_is_sent(tmp_path):
    import torch.distributed as dist

    from kvzoo.distributed import recv_pages, send_pages

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        spec = _spec("int8_per_token_head")
        caches = [spec.allocate()]
        table, lens = torch.tensor([[0]]), torch.tensor([3])
        with pytest.raises(KVZooInputError, match="dst: expected another rank of the group, got 0"):
            send_pages(caches, spec, table, lens, dst=0)
        with pytest.raises(KVZooInputError, match="src: expected another rank of the group, got 3"):
            recv_pages(caches, spec, src=3, allocate=[1])
        with pytest.raises(KVZooInputError, match="workspace: expected a contiguous 1-D uint8 tensor"):
            send_pages(caches, spec, table, lens, dst=1, workspace=torch.zeros(64, dtype=torch.int32))
        with pytest.raises(KVZooInputError, match="workspace: expected a contiguous 1-D uint8 tensor"):
            recv_pages(caches, spec, src=1, allocate=[1], workspace=torch.zeros(64, 2, dtype=torch.uint8))
        with pytest.raises(KVZooInputError, match="the sequences hold no token; there are no pages to send"):
            send_pages(caches, spec, table, torch.tensor([0]), dst=1)
        with pytest.raises(KVZooInputError, match="rows: required with block_tables"):
            recv_pages(caches, spec, src=1, allocate=[1], block_tables=torch.zeros(2, 2, dtype=torch.int32))
    finally:
        dist.destroy_process_group()
