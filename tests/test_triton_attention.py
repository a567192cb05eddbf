"""Triton paged attention: what the generic conformance suite does not cover.

Split-KV against the single-pass kernel, run-to-run determinism, batch invariance, CUDA graph
capture of a decode step and a cache over 4 GiB. On CPU the kernels run under the Triton
interpreter (TRITON_INTERPRET=1) at tiny sizes; GPU-only tests skip without CUDA. Problems
come from kvzoo.samples (drawn from the session seed), references from kvzoo_spec's oracle.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kvzoo import samples  # noqa: E402
from kvzoo.backends.triton import platform  # noqa: E402
from kvzoo.inputs import rng_for  # noqa: E402
from kvzoo.problem import Attention  # noqa: E402

CUDA = torch.cuda.is_available() and not platform.interpreted()
RUNNABLE = CUDA or platform.interpreted()
pytestmark = pytest.mark.skipif(not RUNNABLE, reason="needs a CUDA GPU or TRITON_INTERPRET=1")
DEVICE = "cuda" if CUDA else "cpu"
gpu_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def _kernels():
    from kvzoo.backends.triton import attention_kernels

    return attention_kernels


def make_problem(
    q_lens,
    seq_lens,
    *,
    mode="int8_per_token_head",
    num_q_heads=4,
    num_kv_heads=2,
    head_size=32,
    block_size=16,
    dtype=torch.bfloat16,
    sliding_window=None,
    softcap=None,
    sinks=False,
    batch_invariant=False,
    extra_blocks=3,
    seed=0,
    num_blocks=None,
    device=DEVICE,
    quantize_query=False,
):
    """A random Attention problem (kvzoo.samples: realistic codes and scales, scattered pages);
    the same seed gives the same problem within a session. Tables are exactly as wide as the
    longest sequence's pages, so a row of them is that sequence's pages only."""
    s = samples.paged_sample(
        rng_for("triton attention", seed),
        mode,
        q_lens=q_lens,
        seq_lens=seq_lens,
        block_size=block_size,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        query_dtype=str(dtype).removeprefix("torch."),
        sinks=sinks,
        spare_blocks=extra_blocks,
        spare_columns=0,
        num_blocks=num_blocks,
        device=device,
    )
    static = lambda x: None if x is None else torch.tensor([float(x)], dtype=torch.float32, device=device)  # noqa: E731
    return s.attention_record(
        k_scale=static(s.k_scale),
        v_scale=static(s.v_scale),
        sliding_window=sliding_window,
        softcap=softcap,
        sinks=s.sinks,
        batch_invariant=batch_invariant,
        quantize_query=quantize_query,
    )


def _f64(t):
    return t.detach().cpu().to(torch.float64)


def reference(p: Attention, quantize_query: bool = False) -> torch.Tensor:
    """The float64 oracle on p's caches as they are now (tests edit them in place), with the
    query as given unless quantize_query (p.quantize_query is what the kernel is told)."""
    ref = samples.oracle_attention(
        p.mode,
        p.query,
        samples.host_codes(p.key_cache, p.mode),
        samples.host_codes(p.value_cache, p.mode),
        p.block_tables,
        p.seq_lens,
        p.query_start_loc,
        k_scales=p.k_scale_cache,
        v_scales=p.v_scale_cache,
        k_static=p.k_scale,
        v_static=p.v_scale,
        quantize_query=quantize_query,
        softmax_scale=p.softmax_scale,
        sliding_window=p.sliding_window,
        softcap=p.softcap,
        sinks=p.sinks,
    )
    return torch.from_numpy(ref)


def run(p: Attention, **override):
    _kernels().run(p, "cuda", **override)
    return p.out


def rel_err(out, ref):
    return float(torch.linalg.norm(_f64(out) - ref) / torch.linalg.norm(ref))


def check(p: Attention, **override):
    out = run(p, **override)
    assert not torch.isnan(out).any(), "some output elements were not written"
    err = rel_err(out, reference(p))
    assert err <= 1e-2, err
    return err


CASES = {
    "decode": dict(q_lens=[1, 1, 1], seq_lens=[5, 40, 17]),
    "mixed": dict(q_lens=[1, 7, 20, 1], seq_lens=[33, 7, 50, 1]),
}


@pytest.mark.parametrize("mode", ["none", "fp8_per_tensor", "int8_per_token_head", "fp8_per_token_head"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_modes_against_float64(mode, case):
    check(make_problem(**CASES[case], mode=mode))


@pytest.mark.parametrize(
    "options",
    [
        dict(head_size=80, num_q_heads=6, num_kv_heads=2),  # D not a power of two, G=3
        dict(block_size=32, num_q_heads=4, num_kv_heads=1),  # MQA
        dict(sliding_window=9, softcap=5.0, sinks=True),
        dict(dtype=torch.float16, head_size=48),
        dict(dtype=torch.float32),
    ],
    ids=["d80-g3", "mqa-b32", "window-softcap-sinks", "fp16-d48", "fp32"],
)
@pytest.mark.parametrize("mode", ["none", "int8_per_token_head", "fp8_per_token_head"])
def test_options_against_float64(mode, options):
    check(make_problem(**CASES["mixed"], mode=mode, **options))


def test_rocm_fnuz_under_the_interpreter():
    if CUDA:
        pytest.skip("fp8 e4m3fnuz runs on ROCm GPUs or under the interpreter")
    p = make_problem(**CASES["mixed"], mode="fp8_e4m3fnuz_per_token_head")
    for cache in (p.key_cache, p.value_cache):
        assert not (cache.view(torch.uint8) == 0x80).any(), "0x80 is fnuz's NaN: the sample holds finite codes"
    _kernels().run(p, "rocm")
    assert rel_err(p.out, reference(p)) <= 1e-2


@pytest.mark.parametrize("mode", ["none", "int8_per_token_head"])
@pytest.mark.parametrize("extra", [dict(), dict(sliding_window=40, sinks=True)], ids=["plain", "window-sinks"])
def test_split_kv_matches_single_pass(mode, extra):
    k = _kernels()
    lens = [300, 129, 64, 1]
    p = make_problem([1, 1, 1, 1], lens, mode=mode, **extra)
    single = k.AttentionConfig(1, 32, 4, 2, 0)
    split = k.AttentionConfig(1, 32, 4, 2, 64)
    a = run(p, decode=single).clone()
    p.out.fill_(float("nan"))
    b = run(p, decode=split).clone()
    ref = reference(p)
    assert rel_err(a, ref) <= 1e-2 and rel_err(b, ref) <= 1e-2
    # Different summation orders: close, not bitwise.
    assert torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("split_keys", [0, 64], ids=["single", "split"])
@pytest.mark.parametrize("batch", ["decode", "prefill"])
def test_quantize_query_attends_with_the_quantized_query(batch, split_keys):
    # fp32 query and output, so the query's int8 rounding (~4e-3 here) stands far above the
    # kernel's own error: the output must follow the round-tripped query, not the raw one.
    k = _kernels()
    q_lens, lens = ([1, 1, 1], [300, 129, 64]) if batch == "decode" else ([40, 7], [40, 60])
    p = make_problem(q_lens, lens, dtype=torch.float32, head_size=64, quantize_query=True, sinks=True)
    out = run(p, decode=k.AttentionConfig(1, 32, 4, 2, split_keys))
    assert not torch.isnan(out).any(), "some output elements were not written"
    err_quantized = rel_err(out, reference(p, quantize_query=True))
    err_raw = rel_err(out, reference(p))
    assert err_quantized <= 1.5e-3 and err_raw > 2 * err_quantized, (err_quantized, err_raw)


@pytest.mark.parametrize("mode", ["none", "int8_per_token_head", "fp8_per_token_head"])
@pytest.mark.parametrize("window", [None, 70])
def test_prefill_tiles_span_pages(mode, window):
    # 16-key pages, 32-key tiles: each tile gathers two pages; long contexts give whole tiles
    # (unmasked), a window gives masked tiles before them too.
    k = _kernels()
    p = make_problem([24, 3, 1], [230, 90, 160], block_size=16, mode=mode, sliding_window=window)
    check(p, prefill=k.AttentionConfig(8, 32, 4, 2, 0, True))


@pytest.mark.parametrize("mode", ["none", "int8_per_token_head"])
def test_deterministic(mode):
    p = make_problem(**CASES["mixed"], mode=mode, sinks=True)
    a = run(p).clone()
    p.out.fill_(float("nan"))
    assert torch.equal(run(p).view(torch.int16), a.view(torch.int16))


def _sub_batch(p: Attention, keep: list[int], invariant=True) -> Attention:
    """The same sequences (same caches) as a smaller batch."""

    qsl = p.query_start_loc.cpu()
    rows = torch.cat([torch.arange(int(qsl[s]), int(qsl[s + 1])) for s in keep])
    q_lens = [int(qsl[s + 1] - qsl[s]) for s in keep]
    lens = p.seq_lens.cpu()[keep]
    dev = p.query.device
    return p.replace(
        query=p.query[rows.to(dev)].clone(),
        out=torch.full_like(p.query[rows.to(dev)], float("nan")),
        block_tables=p.block_tables[torch.tensor(keep, device=dev)].clone(),
        seq_lens=lens.to(dev),
        query_start_loc=torch.tensor([0] + list(np.cumsum(q_lens)), dtype=torch.int32, device=dev),
        max_query_len=max(q_lens),
        max_seq_len=int(lens.max()),
        batch_invariant=invariant,
    )


@pytest.mark.parametrize("mode", ["none", "int8_per_token_head"])
def test_batch_invariant(mode):
    # Sequence 1 (a decode over a long context) and 2 (a prefill chunk) alone and in a batch
    # whose other members change the grid, the max lengths and the split count.
    long = 9000 if CUDA else 700
    p = make_problem(
        [5, 1, 9, 1], [long, long - 300, 40, 20], mode=mode, batch_invariant=True, head_size=64 if CUDA else 32
    )
    k = _kernels()
    if not CUDA:  # small split points so the interpreter crosses several of them
        import dataclasses

        cfg = dataclasses.replace(k.decode_config(p, True), block_n=32, split_keys=128)
        override = dict(decode=cfg)
    else:
        override = {}
    full = run(p, **override)
    qsl = p.query_start_loc.cpu()
    for keep in ([1], [2], [1, 2], [3, 1]):
        sub = _sub_batch(p, keep)
        got = run(sub, **override)
        sub_qsl = sub.query_start_loc.cpu()
        for i, s in enumerate(keep):
            a = full[int(qsl[s]) : int(qsl[s + 1])]
            b = got[int(sub_qsl[i]) : int(sub_qsl[i + 1])]
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), (keep, s)


@gpu_only
def test_cuda_graph_decode_step():
    p = make_problem([1] * 8, [700 + 37 * i for i in range(8)], head_size=128, num_q_heads=8, num_kv_heads=2)
    eager = run(p).clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run(p)  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    p.out.fill_(float("nan"))
    with torch.cuda.graph(graph):
        run(p)
    p.out.fill_(float("nan"))
    # New query values in place, then replay: the graph reads the live tensors.
    fresh = rng_for("triton attention", "graph query").standard_normal(tuple(p.query.shape)).astype(np.float32)
    p.query.copy_(torch.from_numpy(fresh).to(p.query.dtype))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(p.out, reference(p)) <= 1e-2
    assert not torch.equal(p.out, eager)


@gpu_only
def test_cache_over_4gib_far_block():
    # int8 cache of 2^18 + 64 blocks x 16 KiB = 4.3 GB per K and V; the sequence's blocks sit
    # past the 2^31-byte mark, so block id * block stride needs 64-bit offsets.
    block_size, heads, d = 16, 8, 128
    num_blocks = (1 << 18) + 64
    p = make_problem(
        [1, 4],
        [40, 40],
        num_q_heads=32,
        num_kv_heads=heads,
        head_size=d,
        block_size=block_size,
        num_blocks=64,
        device="cpu",
    )
    far = num_blocks - 64
    big = []
    for small in (p.key_cache, p.value_cache):
        cache = torch.empty((num_blocks,) + tuple(small.shape[1:]), dtype=small.dtype, device="cuda")
        cache[far:] = small.cuda()
        big.append(cache)
    scales = []
    for small in (p.k_scale_cache, p.v_scale_cache):
        sc = torch.empty((num_blocks,) + tuple(small.shape[1:]), dtype=small.dtype, device="cuda")
        sc[far:] = small.cuda()
        scales.append(sc)

    assert big[0].numel() * big[0].element_size() > 4 * 2**30 or big[0].stride(0) * far > 2**31
    gp = p.replace(
        query=p.query.cuda(),
        out=p.out.cuda(),
        key_cache=big[0],
        value_cache=big[1],
        k_scale_cache=scales[0],
        v_scale_cache=scales[1],
        block_tables=(p.block_tables + far).cuda(),
        seq_lens=p.seq_lens.cuda(),
        query_start_loc=p.query_start_loc.cuda(),
    )
    run(gp)
    assert not torch.isnan(gp.out).any()
    assert rel_err(gp.out, reference(p)) <= 1e-2


def _heads_major(x: torch.Tensor) -> torch.Tensor:
    """The same values as x [num_blocks, block_size, Hkv, ...], stored heads-major."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.parametrize("mode", ["none", "int8_per_token_head", "fp8_per_token_head"])
@pytest.mark.parametrize("batch", ["decode", "mixed"])
def test_value_cache_laid_out_unlike_key_cache(mode, batch):
    # The kernel shares K's address arithmetic with V when their strides match; a V cache (and
    # V scales) stored in another order must take its own strides.
    k = _kernels()
    q_lens, lens = ([1, 1, 1], [300, 129, 64]) if batch == "decode" else ([24, 1, 3], [230, 90, 160])
    p = make_problem(q_lens, lens, mode=mode, sinks=True)
    assert k.same_kv_strides(p)
    check(p)
    expected = p.out.clone()
    v_scales = None if p.v_scale_cache is None else _heads_major(p.v_scale_cache)
    q = p.replace(
        value_cache=_heads_major(p.value_cache), v_scale_cache=v_scales, out=torch.full_like(p.out, float("nan"))
    )
    assert not k.same_kv_strides(q)
    assert torch.equal(run(q).view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("mode", ["int8_per_token_head", "fp8_per_token_head"])
def test_rocm_decode_keeps_the_configs_it_was_checked_with(mode):
    # Under 16 rows and past 2 stages were measured on CUDA only; Triton's AMD backend runs a
    # dot under 16 rows on FMA units. The interpreter cannot tell, so the choice is pinned here.
    k = _kernels()
    p = make_problem([1, 1], [300, 64], mode=mode)
    rocm, cuda = k.decode_config(p, False, "rocm"), k.decode_config(p, False, "cuda")
    assert (rocm.min_rows, cuda.min_rows) == (16, 1)
    assert rocm.num_stages <= 2 < cuda.num_stages


@pytest.mark.parametrize("mode", ["int8_per_token_head", "fp8_per_token_head"])
@pytest.mark.parametrize("extra", [dict(), dict(sliding_window=40, softcap=20.0, sinks=True)], ids=["plain", "options"])
def test_a_decode_grid_under_one_wave_takes_the_wide_tile(mode, extra, monkeypatch):
    from kvzoo.backends.triton import attention_tables as tables

    k = _kernels()
    few = make_problem([1], [300], mode=mode, **extra)  # 1 sequence x 2 KV heads: under the SMs
    codes = k._cache_codes(few)
    wide, default = tables.ONE_WAVE_DECODE_TILES[64, codes], tables.DECODE_TILES[64, codes]
    assert wide.block_n != default.block_n
    cfg = k.decode_config(few, False)
    assert (cfg.block_n, cfg.num_warps, cfg.split_keys) == (wide.block_n, wide.num_warps, 0)
    check(few)  # 300 keys: two full wide tiles and a partial one
    # A grid of at least one program per SM keeps the table's tile.
    seqs = -(-k._num_sms(None if DEVICE == "cpu" else 0) // 2)
    many = make_problem([1] * seqs, [300] * seqs, mode=mode)
    assert k.decode_config(many, False).block_n == default.block_n
    # So does a context long enough to split, a batch-invariant decode, and ROCm (timed on CUDA only).
    long = make_problem([1], [4096], mode=mode)
    assert k.decode_config(long, False).split_keys > 0
    assert k.decode_config(few, True).block_n == default.block_n
    assert k.decode_config(few, False, "rocm").block_n == default.block_n
    # The inline page's 4-byte rows on the wide tile (4 KV heads: a grid under one wave of a
    # GPU's SMs, not of the interpreter's 4).
    monkeypatch.setattr(k, "_num_sms", lambda device: 132)
    inline, around = _inline_decode(mode, 4, 64, [300], **extra)
    cfg = k.decode_config(inline, False)
    assert cfg.block_n == wide.block_n
    check(inline)
    assert torch.isnan(around[..., :4]).all() and torch.isnan(around[..., 4 + 64 :]).all(), "wrote outside out"


# ----------------------------------------------------------------------------------------
# Staged prefill (staging.py): quantized context converted once into a workspace of fp16 operands.

STAGED_BATCHES = {
    # prompts only; chunks on context beside decodes; a window, softcap and sinks; ...
    "prefill": dict(q_lens=[130, 33], seq_lens=[130, 33]),
    "mixed": dict(q_lens=[1, 66, 1, 20], seq_lens=[150, 200, 17, 40]),
    "options": dict(q_lens=[80, 1], seq_lens=[130, 90], sliding_window=37, softcap=20.0, sinks=True),
    "fp16 query, three pages": dict(q_lens=[72, 1], seq_lens=[300, 60], dtype=torch.float16),
}


def _staged(p):
    return _kernels().staged_prefill_config(p)


@pytest.mark.parametrize("mode", ["int8_per_token_head", "fp8_per_token_head", "fp8_per_tensor"])
@pytest.mark.parametrize("batch", sorted(STAGED_BATCHES))
def test_staged_prefill_against_float64(mode, batch):
    p = make_problem(**STAGED_BATCHES[batch], mode=mode, head_size=64, seed=len(batch))
    assert _kernels().prefill_config(p).stage_kv == (p.max_query_len >= _kernels()._staging.STAGE_MIN_QUERY_LEN)
    staged_err = check(p, prefill=_staged(p))
    # The workspace holds the direct kernel's own fp16 operands: no error of its own.
    direct = p.replace(out=torch.full_like(p.out, float("nan")))
    direct_err = check(direct, prefill=_kernels().direct_prefill_config(p))
    assert staged_err <= direct_err * 1.1, (staged_err, direct_err)


def test_staged_prefill_with_a_num_prefills_hint():
    # The engine's count sizes the workspace for the prefill sequences only; a count below the
    # truth (validate=False) leaves the extra sequences wrong but touches nothing outside.
    k = _kernels()
    q_lens, lens = [1, 66, 1, 70], [150, 200, 17, 100]
    exact = make_problem(q_lens, lens).replace(num_prefills=2)
    # K/V slots scale with the count; the fp16 query and its row factors cover every token.
    query_bytes = exact.query.shape[0] * exact.num_q_heads * (2 * exact.head_size + 4)
    unhinted = exact.replace(num_prefills=None)
    assert (k._staging.workspace_bytes(exact) - query_bytes) * 2 == k._staging.workspace_bytes(unhinted) - query_bytes
    check(exact, prefill=_staged(exact))
    short = make_problem(q_lens, lens).replace(num_prefills=1)
    run(short, prefill=_staged(short))
    ref = reference(short)
    assert rel_err(short.out[:67], ref[:67]) <= 1e-2  # the decode and the first prefill
    assert rel_err(short.out[68:], ref[68:]) > 1e-2  # the prefill that got no workspace


@pytest.mark.parametrize("num_slots", [14, 9])  # every prefill; fewer slots than prefills
def test_slot_kernel_places_prefills_in_batch_order_across_its_loop_steps(num_slots):
    # 40 sequences in steps of 16: the running count must carry from step to step.
    staging = _kernels()._staging
    rng = rng_for("triton attention", "slot kernel", num_slots)
    q_lens = rng.choice([1, 1, 2, 7], size=40)
    q_lens[[0, 15, 16, 39]] = [5, 1, 3, 9]
    num_prefills = int((q_lens > 1).sum())
    assert num_prefills >= num_slots
    pages_per_slot = 3
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32, device=DEVICE)
    seq_of_slot = torch.full((num_slots + 1,), -7, dtype=torch.int32, device=DEVICE)
    first_page = torch.full((40,), -7, dtype=torch.int32, device=DEVICE)
    staging._slot_kernel[(1,)](qsl, 40, num_slots, pages_per_slot, seq_of_slot, first_page, BLOCK=16)
    prefills = np.flatnonzero(q_lens > 1)
    used = min(num_prefills, num_slots)
    assert seq_of_slot.cpu().tolist() == prefills[:used].tolist() + [used]
    slot = np.clip(np.cumsum(q_lens > 1) - 1, 0, num_slots - 1)
    assert first_page.cpu().tolist() == (slot * pages_per_slot).tolist()


def test_staged_tiles_launch_only_on_the_staged_workspace_with_its_query_factors():
    # Staged tiles on the paged problem, or the staged rows without their factors, would run and
    # give wrong numbers. So the staged kernel is its own entry, launched from staging's Staged
    # (the workspace problem and the factors, made together) under a StagedConfig, and the
    # paged kernel takes neither the factors nor a StagedConfig.
    k = _kernels()
    p = make_problem([1, 130], [40, 200])
    staged_cfg, direct_cfg = k.staged_prefill_config(p), k.direct_prefill_config(p)
    assert "q_undo_ptr" not in k._attention_kernel.arg_names
    assert staged_cfg.stage_kv and not direct_cfg.stage_kv
    with pytest.raises(TypeError, match="StagedConfig"):
        k.kernel_call(p, "cuda", staged_cfg, per_seq=False, skip_decode=True)
    staged = k._staging.staged_problem(p)
    with pytest.raises(TypeError, match="q_undo"):
        k.kernel_call(p, "cuda", direct_cfg, per_seq=False, skip_decode=False, q_undo=staged.q_undo)
    with pytest.raises(TypeError, match="Staged"):
        k.staged_kernel_call(p, "cuda", staged_cfg)
    with pytest.raises(TypeError, match="StagedConfig"):
        k.staged_kernel_call(staged, "cuda", direct_cfg)
    call = k.staged_kernel_call(staged, "cuda", staged_cfg)
    assert call.kernel is k._staged_attention_kernel
    w = staged.problem
    assert all(a is b for a, b in zip(call.args, (w.query, staged.q_undo, w.key_cache, w.value_cache)))
    assert k.kernel_call(p, "cuda", direct_cfg, per_seq=False, skip_decode=False).kernel is k._attention_kernel


def test_every_platform_format_has_tile_rows():
    # A format a platform registers picks its decode and split rows by what its codes are; one
    # the tables have no kind for must fail here rather than in a launch.
    import types

    from kvzoo.backends.triton import attention_tables as tables
    from kvzoo.backends.triton.formats import PAGED, family_of
    from kvzoo.modes import MODES

    k = _kernels()
    for name in set().union(*platform.PLATFORM_MODES.values()):
        if family_of(MODES[name]) != PAGED:
            continue  # int4's own kernels keep their own tables (test_triton_int4.py checks them)
        codes = k._cache_codes(types.SimpleNamespace(mode=MODES[name]))
        assert codes in tables.SPLIT_RULES, name
        for size in (64, 128, 256):
            assert (size, codes) in tables.DECODE_TILES, (name, size)
    for size in (64, 128, 256):
        assert all((size, operand) in tables.PREFILL_TILES for operand in tables.KOperand)
    # Every timed row names the command and the commit that chose it.
    rows = (tables.DECODE_TILES, tables.ONE_WAVE_DECODE_TILES, tables.PREFILL_TILES, tables.SPLIT_RULES)
    for row in (row for table in rows for row in table.values()):
        assert row.chosen_by and all(run.settled for run in row.chosen_by)
        assert row.chosen_by is tables.NOT_TIMED or all(run.command and run.commit for run in row.chosen_by)


def test_every_format_names_a_family_with_the_entry_points():
    # The registration reaches a format's kernels only through the family its row in formats.py
    # names, by these names: a format is one row there, its family one module per part.
    from kvzoo.backends.triton import formats

    parts = {
        "attention": ("run", "prepare", "workspace_bytes"),
        "write": ("reshape_and_cache", "prepare_write", "dequantize"),
    }
    for name, row in formats.FORMATS.items():
        for part, entry_points in parts.items():
            module = formats._module(getattr(row.family, part))
            missing = [e for e in entry_points if not callable(getattr(module, e, None))]
            assert not missing, (name, module.__name__, missing)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_staged_query_rows_times_their_undo_factor_give_the_query_back(dtype):
    # The query rows staged in fp16 (rows of any magnitude its dtype holds, and a zero row)
    # times their power-of-two undo factors: exactly the query for bf16 and fp16 rows, the
    # query to fp16's precision for fp32 rows. Every row and factor is written.
    k = _kernels()
    p = make_problem([3, 40, 1], [30, 75, 20], dtype=dtype, head_size=48, seed=5)
    uniform = torch.from_numpy(rng_for("triton attention", "query magnitudes").random(tuple(p.query.shape[:2])))
    span = 4.0 if dtype == torch.float16 else 30.0
    magnitudes = 10.0 ** (uniform * 2 * span - span)
    query = (p.query.double() * magnitudes[..., None].to(p.query.device)).to(dtype)
    query[1, 2] = 0.0
    p = p.replace(query=query)
    staged = k._staging.staged_problem(p, fill=float("nan"))
    undo = staged.q_undo.double()
    assert torch.equal(torch.exp2(torch.log2(undo).round()), undo), "undo factors are powers of two"
    back = staged.problem.query.double() * undo[..., None]
    # Scaled rows sit in [2^14, 2^15): exact in fp16 for bf16 and fp16 rows; an fp32 row's top
    # element may round up to 2^15 itself in the cast (fp16 spacing 16 there), still far from overflow.
    top = staged.problem.query.abs().max()
    assert top <= 2.0**15 if dtype == torch.float32 else top < 2.0**15
    if dtype == torch.float32:
        assert torch.allclose(back, query.double(), rtol=2.0**-11, atol=0)
    else:
        assert torch.equal(back, query.double())


@pytest.mark.parametrize("mode", ["int8_per_token_head", "fp8_per_token_head", "fp8_per_tensor"])
def test_workspace_decodes_to_the_cache_values(mode):
    # The workspace is a cache of fp16 "codes" with one scale per page: decoded, it must give
    # the quantized cache's values to fp16 precision (exactly, for per-tensor codes).
    k = _kernels()
    p = make_problem([1, 40, 1], [30, 75, 50], mode=mode, head_size=48)
    w = k._staging.staged_problem(p, fill=float("nan")).problem
    pos = torch.arange(75, device=DEVICE)
    blk, off = p.block_tables[1, pos // p.block_size].long(), pos % p.block_size
    row = w.block_tables[1, 0].long() + pos // w.block_size, pos % w.block_size
    for cache, scales, ws, ws_scales in (
        (p.key_cache, p.k_scale_cache, w.key_cache, w.k_scale_cache),
        (p.value_cache, p.v_scale_cache, w.value_cache, w.v_scale_cache),
    ):
        codes = cache[blk, off].to(torch.float64)
        if scales is None:  # per-tensor: the codes themselves, the kernel keeps the tensor's scale
            assert torch.equal(ws[row].to(torch.float64), codes)
            continue
        assert torch.equal(ws_scales[row][0], scales[blk, off].max(dim=0).values), "page scale = largest row scale"
        want = codes * scales[blk, off].to(torch.float64)[..., None]
        got = ws[row].to(torch.float64) * ws_scales[row].to(torch.float64)[..., None]
        assert torch.allclose(got, want, rtol=2.0**-10, atol=0), float(((got - want) / want).abs().nanmax())
    # Only the prefill's 75 rows were written: the decodes' pages and the page's tail keep the poison.
    written = torch.zeros(w.key_cache.shape[:2], dtype=torch.bool)
    written[row[0].cpu(), row[1].cpu()] = True
    for ws in (w.key_cache, w.value_cache):
        assert torch.isnan(ws[~written.to(DEVICE)]).all()
    if w.k_scale_cache is not None:
        assert torch.isnan(w.k_scale_cache[1:, 0]).all(), "scales of pages no prefill owns were written"


def test_conformance_long_batches_reach_the_staged_path():
    # The shared suite's "long" batches are what checks staged prefill on every Triton platform;
    # raising STAGE_MIN_QUERY_LEN past their prompts would leave it unchecked without a failure.
    least = _kernels()._staging.STAGE_MIN_QUERY_LEN
    for draw in range(50):
        q_lens, _ = samples.draw_lens(rng_for("triton attention", "long", draw), "long")
        assert q_lens.max() >= least, (draw, q_lens)


def test_staging_is_chosen_only_where_it_keeps_the_semantics(monkeypatch):
    k = _kernels()
    least = k._staging.STAGE_MIN_QUERY_LEN
    long = dict(q_lens=[least, 1], seq_lens=[least, 40])
    assert k.prefill_config(make_problem(**long)).stage_kv
    assert k.prefill_config(make_problem(**long, mode="fp8_per_tensor")).stage_kv
    assert k.prefill_config(make_problem(**long, dtype=torch.float16)).stage_kv
    declined = {
        "mode none": make_problem(**long, mode="none"),
        "quantize_query": make_problem(**long, quantize_query=True),
        "batch_invariant": make_problem(**long, batch_invariant=True),
        "short query runs": make_problem([least - 1, 1], [least, 40]),
    }
    for why, p in declined.items():
        assert not k.prefill_config(p).stage_kv, why
    p = make_problem(**long)
    options = k.TritonAttentionOptions
    assert not k.prefill_config(p, options(stage_max_bytes=k._staging.workspace_bytes(p) - 1)).stage_kv, (
        "workspace over stage_max_bytes"
    )
    assert k.prefill_config(p, options(stage_max_bytes=k._staging.workspace_bytes(p))).stage_kv
    assert not k.prefill_config(p, options(prefill="direct")).stage_kv
    with pytest.raises(ValueError, match="stage_kv"):
        run(make_problem(**long, quantize_query=True), prefill=_staged(make_problem(**long)))


def test_staged_prefill_with_scales_far_apart_across_pages():
    # K and V scales grow 1000x per 128-key page: per-page scales (and acc counted in the
    # current page's V scale) must carry the magnitude across pages without losing precision.
    # The last page's keys come out ~1000x the usual, and so would its logits (~1000): fp16
    # operands cannot resolve two of them a fraction apart (any kernel, staged or direct; a
    # random draw has such a near-tie now and then), so the softmax scale takes the 1000x back.
    p = make_problem([100, 1], [400, 300], head_size=64, seed=7)
    p = p.replace(softmax_scale=p.softmax_scale / 1000)
    blocks = p.block_tables[0].long()
    for scales in (p.k_scale_cache, p.v_scale_cache):
        for j, block in enumerate(blocks):
            scales[block] *= 1000.0 ** (j * p.block_size // 128) * 1e-6
    err = check(p, prefill=_staged(p))
    direct = p.replace(out=torch.full_like(p.out, float("nan")))
    assert err <= check(direct, prefill=_kernels().direct_prefill_config(p)) * 1.1


@pytest.mark.parametrize("path", ["decode", "direct prefill", "staged prefill"])
def test_zero_key_scales_weigh_visible_keys_evenly(path):
    # Zero key scales zero every logit. Direct prefill divides by a tile's largest scale and
    # staging by a page's: their guards must give even weights, not NaN.
    k = _kernels()
    batch = dict(q_lens=[1, 1], seq_lens=[150, 40]) if path == "decode" else STAGED_BATCHES["mixed"]
    p = make_problem(**batch, head_size=64, seed=11)
    p.k_scale_cache.zero_()
    override = {
        "decode": {},
        "direct prefill": dict(prefill=k.direct_prefill_config(p)),
        "staged prefill": dict(prefill=_staged(p)),
    }[path]
    check(p, **override)


def test_staged_prefill_never_reads_workspace_it_did_not_write():
    # Rows past a sequence's end in its last page hold whatever the allocator left (NaN here):
    # masked tiles must not let them into a dot.
    k = _kernels()
    p = make_problem(**STAGED_BATCHES["mixed"], head_size=64, seed=5)
    check(p, prefill=_staged(p), options=k.TritonAttentionOptions(workspace_fill=float("nan")))


def test_window_hidden_keys_with_nan_scales_leave_decode_output_unchanged():
    # SPEC 8 allows NaN from a masked read, but the decode tile zeroes hidden keys' weighted
    # scales on purpose (a poisoned row the window has passed must not end a sequence's output).
    lens, window = [100, 70], 20
    clean = make_problem([1, 1], lens, sliding_window=window, head_size=64, seed=3)
    poisoned = clean.replace(
        out=torch.full_like(clean.out, float("nan")),
        k_scale_cache=clean.k_scale_cache.clone(),
        v_scale_cache=clean.v_scale_cache.clone(),
    )
    for s, n in enumerate(lens):
        hidden = torch.arange(n - window - 16, n - window, device=DEVICE)  # shares a key tile with the window
        blocks, offsets = poisoned.block_tables[s, hidden // poisoned.block_size].long(), hidden % poisoned.block_size
        poisoned.k_scale_cache[blocks, offsets] = float("nan")
        poisoned.v_scale_cache[blocks, offsets] = float("nan")
    check(clean)
    assert torch.equal(run(poisoned), clean.out)


def test_row_align_is_what_every_cache_row_offset_divides_by():
    # The inline page's rows are head_size + 4 bytes apart: the kernel is told 4 (or 8), which
    # Triton's own integer specialisation (multiples of 16) cannot see; separate caches get 16.
    from kvzoo.backends.triton.alignment import row_align
    from kvzoo.layout import allocate_inline, allocate_separate

    for head_size, want in ((128, 4), (64, 4), (36, 8), (60, 16)):
        t = allocate_inline(3, 16, 2, head_size, "int8_per_token_head", device="cpu")
        assert row_align(t.key_cache, t.value_cache) == want, head_size
    s = allocate_separate(3, 16, 2, 128, "int8_per_token_head", device="cpu")
    assert row_align(s.key_cache, s.value_cache) == 16
    odd = allocate_separate(3, 16, 2, 130, "none", model_dtype="bfloat16", device="cpu")
    assert row_align(odd.key_cache, odd.value_cache) == 2


def _inline_decode(mode, num_kv_heads, head_size, lens, seed=0, **extra):
    s = samples.paged_sample(
        rng_for("triton inline decode", mode, num_kv_heads, head_size, seed),
        mode,
        q_lens=[1] * len(lens),
        seq_lens=lens,
        num_q_heads=2 * num_kv_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        layout="inline",
        sinks=extra.pop("sinks", False),
        spare_columns=0,
        device=DEVICE,
    )
    # The output is a window of a NaN buffer wider on both sides, to see what was written.
    around = torch.full((len(lens), s.query.shape[1], head_size + 8), float("nan"), dtype=s.query.dtype, device=DEVICE)
    p = s.attention_record(out=around[:, :, 4 : 4 + head_size], sinks=s.sinks, **extra)
    return p, around


@pytest.mark.parametrize("mode", ["int8_per_token_head", "fp8_per_token_head"])
def test_inline_decode_takes_the_unaligned_rows_tile(mode):
    # The inline page's rows are 4-byte aligned; the separate layout's, 16-byte: each gets its
    # own table row (a grid of at least a wave, context too short to split).
    from kvzoo.backends.triton import attention_tables as tables

    k = _kernels()
    lens = [40] * 200
    inline, _ = _inline_decode(mode, 4, 64, lens)
    separate = make_problem([1] * len(lens), lens, mode=mode, num_q_heads=8, num_kv_heads=4, head_size=64)
    codes = k._cache_codes(inline)
    for p, row in ((inline, tables.UNALIGNED_DECODE_TILES[64, codes]), (separate, tables.DECODE_TILES[64, codes])):
        cfg = k.decode_config(p, False)
        assert (cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.split_keys) == (
            row.block_n,
            row.num_warps,
            row.num_stages,
            0,
        )
    assert tables.UNALIGNED_DECODE_TILES[64, codes] != tables.DECODE_TILES[64, codes]


@pytest.mark.parametrize("mode", ["int8_per_token_head", "fp8_per_token_head"])
@pytest.mark.parametrize("heads,head_size", [(4, 64), (8, 32)], ids=["H4-D64", "H8-D32"])
@pytest.mark.parametrize("split_keys", [0, 64], ids=["single", "split"])
def test_inline_decode_at_every_row_offset_against_float64(mode, heads, head_size, split_keys):
    # Every offset from 16-byte alignment a KV head's rows can have (0, 4, 8, 12 bytes, at
    # either shape). In fp8 the scale bytes beside each row can read as NaN codes: a load that
    # strayed past a row's codes would put them in the logits.
    extra = dict(sliding_window=40, softcap=30.0, sinks=True) if split_keys else {}
    p, around = _inline_decode(mode, heads, head_size, [300, 129, 64, 1], **extra)
    cfg = _kernels().AttentionConfig(1, 32, 1, 2, split_keys)
    check(p, decode=cfg)
    assert torch.isnan(around[..., :4]).all() and torch.isnan(around[..., 4 + head_size :]).all(), "wrote outside out"
