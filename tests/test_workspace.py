"""A workspace the caller gives (TritonAttentionOptions.workspace, kvzoo.plan_step(workspace=)):
the Triton attention's calls carve their split-KV partials and staged prefill's workspace from
it instead of allocating them.

Each check fills the buffer with random bytes first and compares with a call that allocates:
the outputs must be the same bytes, the buffer must have been written (a call that ignored
it would pass the first check alone) and the bytes past what the call asked for left alone.
Refused calls (too small, overlapping an array of the call) write nothing.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import kvzoo  # noqa: E402
from kvzoo import KVZooInputError, samples  # noqa: E402
from kvzoo.backends.triton import platform  # noqa: E402
from kvzoo.inputs import rng_for  # noqa: E402
from kvzoo.problem import Attention  # noqa: E402

CUDA = torch.cuda.is_available() and not platform.interpreted()
pytestmark = pytest.mark.skipif(not (CUDA or platform.interpreted()), reason="needs a CUDA GPU or TRITON_INTERPRET=1")
DEVICE = "cuda" if CUDA else "cpu"
GUARD = 4096

# A prefill long enough to be staged beside a decode long enough to be split (on the
# interpreter's 4 "SMs"; on an H200 the decode splits too), and a split decode alone.
BATCHES = {"mixed": ([130, 1], [130, 2100]), "decode": ([1, 1], [2100, 40])}


def _problem(mode: str, batch: str, seed: int = 0) -> Attention:
    q_lens, seq_lens = BATCHES[batch]
    s = samples.paged_sample(
        rng_for("workspace", mode, batch, seed),
        mode,
        q_lens=q_lens,
        seq_lens=seq_lens,
        num_q_heads=4,
        num_kv_heads=2,
        head_size=32,
        spare_columns=0,
        device=DEVICE,
    )
    return s.attention_record(num_prefills=s.batch.num_prefills)


def _impl(**options):
    impl = kvzoo.registry.get("paged_attention", "triton-cuda")
    return impl.with_options(**options) if options else impl


def _random_buffer(nbytes: int, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.integers(0, 256, nbytes, dtype=np.uint8)).to(DEVICE)


@pytest.mark.parametrize("mode", ["int8_per_token_head", "fp8_per_token_head", "int4_per_token_head"])
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_a_call_in_a_workspace_gives_the_bytes_of_one_that_allocates(mode, batch):
    p = _problem(mode, batch)
    need = _impl().workspace_bytes(p)
    assert need > 0, "the batch takes partials or a staged workspace: nothing would be tested"
    _impl().run(p)
    want = p.out.clone()
    buffer = _random_buffer(need + GUARD)
    before = buffer.clone()
    p.out.fill_(float("nan"))
    _impl(workspace=buffer[:need]).run(p)
    assert torch.equal(p.out.view(torch.uint8), want.view(torch.uint8))
    assert not torch.equal(buffer[:need], before[:need]), "the call did not use the workspace"
    assert torch.equal(buffer[need:], before[need:]), "the call wrote past what it asked for"


def _functional(p: Attention, out: torch.Tensor, impl) -> None:
    """kvzoo.paged_attention of p's arrays into out, unvalidated (so prepared and recalled)."""
    kvzoo.paged_attention(
        p.query,
        p.key_cache,
        p.value_cache,
        mode=p.mode,
        block_tables=p.block_tables,
        seq_lens=p.seq_lens,
        query_start_loc=p.query_start_loc,
        k_scale_cache=p.k_scale_cache,
        v_scale_cache=p.v_scale_cache,
        out=out,
        max_query_len=p.max_query_len,
        max_seq_len=p.max_seq_len,
        impl=impl,
        validate=False,
    )


def test_prepared_and_recalled_calls_run_in_the_workspace():
    p = _problem("int8_per_token_head", "decode")
    need = _impl().workspace_bytes(p)
    _impl().run(p)
    want = p.out.clone()
    buffer = _random_buffer(need + GUARD, 1)
    impl = _impl(workspace=buffer[:need])
    for _ in range(3):  # the first call prepares, the later ones relaunch what it bound
        before = buffer.clone()
        out = torch.full_like(p.out, float("nan"))
        _functional(p, out, impl)
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(buffer[need:], before[need:])
    # After calls of the same metadata, an output inside the workspace is still refused (such
    # calls are never recalled: each checks the workspace against its arrays).
    inside = buffer[: p.out.numel() * p.out.element_size()].view(p.out.dtype).view(p.out.shape)
    before = buffer.clone()
    with pytest.raises(KVZooInputError, match="workspace: shares memory with out"):
        _functional(p, inside, impl)
    assert torch.equal(buffer, before)


def test_a_workspace_too_small_or_overlapping_is_refused_before_any_write():
    p = _problem("int8_per_token_head", "mixed")
    need = _impl().workspace_bytes(p)
    buffer = _random_buffer(need)
    before = buffer.clone()
    with pytest.raises(KVZooInputError, match=f"workspace: this call needs {need} bytes"):
        _impl(workspace=buffer[: need - 1]).run(p)
    assert torch.isnan(p.out).all() and torch.equal(buffer, before)
    # The output's own bytes as the workspace: the kernels would write it twice over.
    big = torch.full((need // 2 + 256, 4, 32), float("nan"), dtype=p.out.dtype, device=DEVICE)
    q = p.replace(out=big[: p.out.shape[0]])
    with pytest.raises(KVZooInputError, match="workspace: shares memory with out"):
        _impl(workspace=big.view(torch.uint8).flatten()).run(q)
    assert torch.isnan(big).all()
    for bad, why in (
        (torch.zeros(need, dtype=torch.int8, device=DEVICE), "uint8"),
        (torch.zeros((2, need), dtype=torch.uint8, device=DEVICE), "1-D"),
        (torch.zeros(need + 1, dtype=torch.uint8, device=DEVICE)[1:], "multiple of 16"),
    ):
        with pytest.raises(KVZooInputError, match=f"workspace: .*{why}"):
            _impl(workspace=bad)


def _plan(spec, p: Attention, **kwargs):
    return kvzoo.plan_step(
        spec,
        num_q_heads=4,
        block_tables=p.block_tables,
        seq_lens=p.seq_lens,
        query_start_loc=p.query_start_loc,
        **kwargs,
    )


def _spec(p: Attention) -> kvzoo.CacheSpec:
    return kvzoo.CacheSpec(
        p.mode.name,
        num_blocks=p.key_cache.shape[0],
        block_size=p.key_cache.shape[1],
        num_kv_heads=2,
        head_size=32,
        model_dtype="bfloat16",
        device=DEVICE,
    )


def test_plan_sizes_the_workspace_and_its_layers_run_in_it():
    p = _problem("int8_per_token_head", "mixed")
    spec = _spec(p)
    caches = kvzoo.KVCacheTensors(p.key_cache, p.value_cache, p.k_scale_cache, p.v_scale_cache)
    want = _plan(spec, p, impl="triton-cuda").attention(p.query, caches)
    sized = _plan(spec, p, impl="triton-cuda")
    assert sized.workspace_bytes == _impl().workspace_bytes(p) > 0
    need = sized.workspace_bytes
    buffer = _random_buffer(need + GUARD, 2)
    before = buffer.clone()
    plan = _plan(spec, p, impl="triton-cuda", workspace=buffer[:need])
    assert plan.workspace_bytes == need and plan.workspace is not None
    for _ in range(2):  # two layers of one step (the same caches: the bytes must repeat)
        got = plan.attention(p.query, caches)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert not torch.equal(buffer[:need], before[:need]) and torch.equal(buffer[need:], before[need:])
    with pytest.raises(KVZooInputError, match=f"workspace: the plan's attention calls need {need} bytes"):
        _plan(spec, p, impl="triton-cuda", workspace=buffer[: need - 1])
    # A planned workspace meeting a layer's cache, or the query, is refused at the call.
    inside = p.key_cache.view(torch.uint8).flatten()
    if inside.numel() >= need:
        with pytest.raises(KVZooInputError, match="workspace: shares memory"):
            _plan(spec, p, impl="triton-cuda", workspace=inside[:need]).attention(p.query, caches)
    query = torch.empty(need + 512, dtype=torch.uint8, device=DEVICE)
    q_view = query[: p.query.numel() * 2].view(p.query.dtype).view(p.query.shape)
    q_view.copy_(p.query)
    with pytest.raises(KVZooInputError, match="query: shares memory with workspace"):
        _plan(spec, p, impl="triton-cuda", workspace=query[:need]).attention(q_view, caches)


@pytest.mark.parametrize("arg", ["sinks", "k_scale", "v_scale"])
def test_a_layers_own_sinks_or_scale_inside_the_workspace_is_refused(arg):
    """A layer's call may bring its own sinks, or a per-tensor mode's static scales; inside the
    plan's workspace the partials would overwrite them (the caller's sinks [3, 2] became
    [3.71, 2.30]). Refused after the first layer prepared the launch, as before it."""
    mode = "int8_per_tensor" if arg != "sinks" else "int8_per_token_head"
    p = _problem("int8_per_token_head", "decode")
    spec = dataclasses.replace(_spec(p), mode=kvzoo.get_kv_quant_mode(mode))
    caches = spec.allocate()
    need = _plan(spec, p, impl="triton-cuda").workspace_bytes
    assert need > 0, "the decode must be split, or the workspace is not written"
    buffer = _random_buffer(need + GUARD, 4)
    plan = _plan(spec, p, impl="triton-cuda", workspace=buffer[:need])
    rng = rng_for("workspace-own-sinks-or-scale", arg)
    own = {"sinks": torch.from_numpy(rng.standard_normal(4).astype(np.float32)).to(DEVICE)}
    if arg != "sinks":
        own = {"k_scale": 0.07, "v_scale": 0.05}
    plan.attention(p.query, caches, **own)  # the first layer: prepares the launch
    inside = buffer[:16].view(torch.float32)
    inside[: own[arg].numel() if arg == "sinks" else 1] = torch.as_tensor(own[arg], dtype=torch.float32)
    own[arg] = inside[: 4 if arg == "sinks" else 1]
    before = buffer.clone()
    keys = caches.key_cache.clone()
    with pytest.raises(KVZooInputError, match=f"workspace: shares memory with {arg}"):
        plan.attention(p.query, caches, **own)
    assert torch.equal(buffer, before) and torch.equal(caches.key_cache, keys)


def test_backends_without_a_workspace_leave_it_unused():
    p = _problem("int8_per_token_head", "decode")
    spec = _spec(p)
    if DEVICE != "cpu":
        pytest.skip("NumPy plans take CPU tensors")
    buffer = _random_buffer(1024, 3)
    before = buffer.clone()
    plan = _plan(spec, p, impl="numpy", workspace=buffer)
    assert plan.workspace_bytes == 0
    caches = kvzoo.KVCacheTensors(p.key_cache, p.value_cache, p.k_scale_cache, p.v_scale_cache)
    want = _plan(spec, p, impl="numpy").attention(p.query, caches)
    assert torch.equal(plan.attention(p.query, caches).view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(buffer, before)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_a_cuda_graph_of_planned_layers_replays_in_the_workspace():
    p = _problem("int8_per_token_head", "mixed")
    spec = _spec(p)
    caches = kvzoo.KVCacheTensors(p.key_cache, p.value_cache, p.k_scale_cache, p.v_scale_cache)
    want = _plan(spec, p, impl="triton-cuda").attention(p.query, caches).clone()
    # Unread metadata: sized for every row the bounds allow (num_seqs x max_query_len).
    bounds = dict(validate=False, max_query_len=p.max_query_len, max_seq_len=p.max_seq_len, num_prefills=p.num_prefills)
    need = _plan(spec, p, impl="triton-cuda", **bounds).workspace_bytes
    assert need >= _impl().workspace_bytes(p)
    buffer = _random_buffer(need + GUARD, 4)
    before = buffer.clone()
    plan = _plan(spec, p, impl="triton-cuda", workspace=buffer[:need], **bounds)
    out = torch.full_like(p.query, float("nan"))
    plan.attention(p.query, caches, out=out)  # outside the capture: compiles and binds
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.attention(p.query, caches, out=out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(buffer[need:], before[need:])


@pytest.mark.parametrize("slots", ["as given", "copied by the plan"])
def test_a_workspace_holding_the_steps_slot_mapping_is_refused(slots):
    """The attention calls write the workspace and the next layer's write reads slot_mapping:
    inside the workspace, the partials would move the next layer's rows to other slots. Refused
    by plan_step whether the plan reads the caller's slot_mapping or its own copy of it (the
    caller's array is written either way), before anything is written."""
    p = _problem("int8_per_token_head", "decode")
    spec = _spec(p)
    need = _plan(spec, p, impl="triton-cuda").workspace_bytes
    assert need > 0, "the decode must be split, or the workspace is not written"
    num_tokens = p.query.shape[0]
    buffer = _random_buffer(need + 16 * num_tokens + GUARD, 5)
    # int64 slots at the start of the workspace (a stride of 2 makes the plan copy them).
    step = 1 if slots == "as given" else 2
    slot_mapping = buffer[: 8 * step * num_tokens].view(torch.int64)[::step]
    slot_mapping.copy_(torch.arange(num_tokens, dtype=torch.int64))
    before = buffer.clone()
    with pytest.raises(KVZooInputError, match="workspace: shares memory with slot_mapping"):
        _plan(spec, p, impl="triton-cuda", slot_mapping=slot_mapping, workspace=buffer[:need])
    assert torch.equal(buffer, before)
