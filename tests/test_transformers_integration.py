"""kvzoo.integrations.transformers: a tiny random Llama generating on kvzoo's paged cache.

The reference is transformers' DynamicCache with eager attention on the same model. Mode
"none" must give the same greedy tokens and logits within fp32 rounding (1e-5; measured
1.5e-7); quantized modes are held to stated tolerances on teacher-forced logits (the same
tokens fed to both, so a flipped greedy token cannot hide or inflate the error): max |logit
error| relative to the largest |logit|, measured on this model (seeded) as int8 nearest
1.8e-3, int8 trunc 5.8e-3, fp8 e4m3fn and e4m3fnuz per-token-head 7.9e-3, fp8 per-tensor
(static scales from a DynamicCache pass over the prompt) 9.1e-3; the bounds in TOLERANCE
leave 2.5-3x of headroom. Greedy argmax agrees at >= 95% of positions (measured: all).

CPU tests use kvzoo's NumPy implementation (impl="numpy"): Numba's first compilation would
cost about a minute on 2 cores. The gpu_only test runs the same checks in bfloat16 on CUDA
with the registry's choice (Triton).
"""

from __future__ import annotations

import doctest
import importlib
import warnings

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.generation import utils as generation_utils  # noqa: E402

from kvzoo.integrations.transformers import (  # noqa: E402
    KVZooCache,
    KVZooIntegrationError,
    KVZooLayer,
    KVZooStaticCache,
    static_fp8_scales,
    use_kvzoo_attention,
)
from kvzoo.integrations.transformers._pages import PagesFullError, PageTable  # noqa: E402
from kvzoo.modes import MODES  # noqa: E402

# transformers 5 renamed generate's/forward's past_key_values to cache (the old name warns).
CACHE_ARG = "cache" if "cache" in getattr(generation_utils, "ALL_CACHE_NAMES", ()) else "past_key_values"
IMPL = "numpy"
PAD = 0

# Relative bound on max |logit error| / max |logit| against mode none (see the module docstring).
TOLERANCE = {
    ("int8_per_token_head", "nearest"): 5e-3,
    ("int8_per_token_head", "trunc"): 1.5e-2,
    ("fp8_per_token_head", "nearest"): 2e-2,
    ("fp8_e4m3fnuz_per_token_head", "nearest"): 2e-2,
    ("fp8_per_tensor", "nearest"): 2.5e-2,
}


def tiny_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        pad_token_id=PAD,
        max_position_embeddings=256,
    )


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    # One thread: these matmuls are tiny, and a second thread only adds hand-off cost (several
    # times the work on a loaded 2-core machine).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(1234)
    yield LlamaForCausalLM(tiny_config()).eval()
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


def attention(model, name: str):
    if name == "kvzoo_paged":
        use_kvzoo_attention(model)
    else:
        model.set_attn_implementation(name)
    return model


def generate(model, cache, ids, mask=None, **kw):
    attention(model, "eager" if isinstance(cache, DynamicCache) else "kvzoo_paged")
    args = dict(max_new_tokens=10, do_sample=False, pad_token_id=PAD, output_logits=True, return_dict_in_generate=True)
    args.update(kw)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, **{CACHE_ARG: cache}, **args)


def teacher_forced(model, cache, seq: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Logits [B, T - prompt_len + 1, V]: prefill seq[:, :prompt_len], then one token at a time."""
    attention(model, "eager" if isinstance(cache, DynamicCache) else "kvzoo_paged")
    with torch.no_grad():
        logits = [model(seq[:, :prompt_len], use_cache=True, **{CACHE_ARG: cache}).logits[:, -1:]]
        for t in range(prompt_len, seq.shape[1]):
            logits.append(model(seq[:, t : t + 1], use_cache=True, **{CACHE_ARG: cache}).logits)
    return torch.cat(logits, 1)


def kvzoo(model, mode="none", **kw) -> KVZooCache:
    kw.setdefault("impl", IMPL)
    # Every step through kvzoo's kernels (the checks below are of them); "auto" has its own test.
    kw.setdefault("prefill_attention", "kvzoo")
    kw.setdefault("block_size", 4)  # small pages: every sequence spans several, and the pool grows
    kw.setdefault("validate", True)
    return KVZooCache(model.config, mode=mode, **kw)


def left_padded(lengths, seed=7):
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 128, (n,), generator=gen) for n in lengths]
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = p
        mask[row, width - len(p) :] = 1
    return prompts, ids, mask


def random_ids(batch, length, seed=3):
    return torch.randint(1, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def max_logit_error(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def calibrated_scales(model, ids):
    attention(model, "eager")
    with torch.no_grad():
        dc = DynamicCache(config=model.config)
        model(ids, use_cache=True, **{CACHE_ARG: dc})
    return static_fp8_scales(dc)


# ---------------------------------------------------------------------------------------------


def test_none_matches_dynamic_cache_with_eager_attention(model):
    ids = random_ids(2, 9)
    ref = generate(model, DynamicCache(config=model.config), ids)
    cache = kvzoo(model)
    out = generate(model, cache, ids)
    assert torch.equal(out.sequences, ref.sequences)
    assert max_logit_error(out.logits, ref.logits) <= 1e-5
    assert cache.get_seq_length() == 9 + 10 - 1
    cache.pages.check()


@pytest.mark.parametrize("mode, rounding", list(TOLERANCE))
def test_quantized_modes_stay_within_tolerance_of_none(model, mode, rounding):
    seq, prompt_len = random_ids(2, 40), 24
    ref = teacher_forced(model, kvzoo(model), seq, prompt_len)
    extra = {}
    if mode == "fp8_per_tensor":  # static scales, calibrated on the prompt with DynamicCache
        extra["k_scale"], extra["v_scale"] = calibrated_scales(model, seq[:, :prompt_len])
    got = teacher_forced(model, kvzoo(model, mode, rounding=rounding, **extra), seq, prompt_len)
    error = float((got - ref).abs().max()) / float(ref.abs().max())
    assert 0 < error <= TOLERANCE[(mode, rounding)], error
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.95


def test_int8_nearest_is_no_worse_than_trunc(model):
    seq, prompt_len = random_ids(2, 40), 24
    ref = teacher_forced(model, kvzoo(model), seq, prompt_len)
    rms = {
        r: float(
            (teacher_forced(model, kvzoo(model, "int8_per_token_head", rounding=r), seq, prompt_len) - ref)
            .pow(2)
            .mean()
            .sqrt()
        )
        for r in ("nearest", "trunc")
    }
    assert rms["nearest"] < rms["trunc"], rms


def test_left_padded_batch_matches_dynamic_cache_and_each_prompt_alone(model):
    prompts, ids, mask = left_padded([3, 7, 5])
    ref = generate(model, DynamicCache(config=model.config), ids, mask)
    cache = kvzoo(model)
    out = generate(model, cache, ids, mask)
    assert torch.equal(out.sequences, ref.sequences)
    assert max_logit_error(out.logits, ref.logits) <= 1e-5
    # Padding gets no slot: each row holds only its real tokens (prompt + generated, less the last).
    assert cache.pages.lens.tolist() == [len(p) + 10 - 1 for p in prompts]
    cache.pages.check()
    for row, p in enumerate(prompts):
        alone = generate(model, kvzoo(model), p[None])
        assert torch.equal(alone.sequences[0, len(p) :], out.sequences[row, ids.shape[1] :])


def test_padding_content_is_never_read(model):
    # Whatever the padding tokens are, a quantized cache's real rows must not change: they are
    # never written, so they can neither be attended nor move a scale.
    prompts, ids, mask = left_padded([2, 6])
    other = ids.clone()
    other[mask == 0] = 77
    a = generate(model, kvzoo(model, "int8_per_token_head"), ids, mask)
    b = generate(model, kvzoo(model, "int8_per_token_head"), other, mask)
    assert torch.equal(a.sequences[:, ids.shape[1] :], b.sequences[:, ids.shape[1] :])
    assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))


def test_left_padded_batch_in_a_quantized_mode_matches_each_prompt_alone(model):
    prompts, ids, mask = left_padded([4, 9, 6], seed=11)
    out = generate(model, kvzoo(model, "fp8_per_token_head"), ids, mask, max_new_tokens=6)
    for row, p in enumerate(prompts):
        alone = generate(model, kvzoo(model, "fp8_per_token_head"), p[None], max_new_tokens=6)
        assert torch.equal(alone.sequences[0, len(p) :], out.sequences[row, ids.shape[1] :])
        assert max_logit_error([x[0] for x in alone.logits], [x[row] for x in out.logits]) <= 1e-5


def test_padding_inside_a_row_is_not_attended(model):
    # A hole in the mask (not only left padding): kvzoo's compacted sequence gives exactly
    # "causal and not padding", as eager's 4-D mask does.
    ids = random_ids(2, 12, seed=9)
    mask = torch.ones_like(ids)
    mask[0, 3:5] = 0
    mask[1, 0] = 0
    logits = {}
    for name, cache in (("eager", DynamicCache(config=model.config)), ("kvzoo", kvzoo(model, "none"))):
        attention(model, "eager" if name == "eager" else "kvzoo_paged")
        with torch.no_grad():
            first = model(ids[:, :10], attention_mask=mask[:, :10], use_cache=True, **{CACHE_ARG: cache}).logits
            second = model(ids[:, 10:], attention_mask=mask, use_cache=True, **{CACHE_ARG: cache}).logits
        logits[name] = torch.cat([first, second], 1)
    real = mask.bool()
    assert float((logits["kvzoo"] - logits["eager"])[real].abs().max()) <= 1e-5


def test_sliding_window_with_a_hole_in_the_padding_is_refused(model):
    torch.manual_seed(0)
    other = transformers.AutoModelForCausalLM.from_config(OTHER_DECODERS["Mistral, window 8"]()).eval()
    ids = random_ids(1, 10)
    mask = torch.ones_like(ids)
    mask[0, 4] = 0
    attention(other, "kvzoo_paged")
    with pytest.raises(KVZooIntegrationError, match="sliding window"), torch.no_grad():
        other(ids, attention_mask=mask, use_cache=True, **{CACHE_ARG: kvzoo(other)})


def test_beam_search_matches_dynamic_cache(model):
    _, ids, mask = left_padded([5, 8], seed=5)
    beams = dict(num_beams=2, max_new_tokens=8, output_logits=False, return_dict_in_generate=False)
    ref = generate(model, DynamicCache(config=model.config), ids, mask, **beams)
    cache = kvzoo(model)
    out = generate(model, cache, ids, mask, **beams)
    assert torch.equal(out, ref)
    cache.pages.check()
    quantized = kvzoo(model, "int8_per_token_head")
    out = generate(model, quantized, ids, mask, **beams)
    assert out.shape == ref.shape
    quantized.pages.check()
    assert quantized.pages.epoch > 0  # the beams were reordered through the block tables


@pytest.mark.parametrize("mode", ["int8_per_token_head", "fp8_per_token_head"])
def test_decode_keeps_its_metadata_and_plans_and_gives_the_planned_steps_numbers(model, mode, monkeypatch):
    """Issue 46: without validation, decode steps copy their metadata into one kept buffer and
    run the plans built on it (each layer's calls then take the plan's bound path). The logits
    are byte for byte those of a cache that plans every step (validate=True), across the kept
    bounds being passed (every 8 tokens here), the pool growing, and a beam reorder (its
    copy-on-write step runs on metadata of its own)."""
    from kvzoo.integrations.transformers import step as step_module

    monkeypatch.setattr(step_module, "_SEQ_BOUND_STEP", 8)
    built = []
    plan = step_module.plan_step
    monkeypatch.setattr(step_module, "plan_step", lambda *a, **k: built.append(k["max_seq_len"]) or plan(*a, **k))
    seq, prompt_len = random_ids(2, 44, seed=41), 12
    planned = teacher_forced(model, kvzoo(model, mode), seq, prompt_len)
    per_step = len(built)
    built.clear()
    cache = kvzoo(model, mode, validate=False)
    kept = teacher_forced(model, cache, seq, prompt_len)
    assert torch.equal(kept, planned)
    steps = seq.shape[1] - prompt_len
    assert per_step == steps + 1  # the planned cache: a plan a step
    # The prefill, then a plan each time the lengths pass a bound or the pool grows.
    assert 1 + (seq.shape[1] - 1) // 8 - prompt_len // 8 <= len(built) <= steps // 2, built
    assert all(bound % 8 == 0 for bound in built) and max(built) <= -(-seq.shape[1] // 8) * 8, built
    cache.pages.check()

    _, ids, mask = left_padded([5, 8], seed=5)
    beams = dict(num_beams=2, max_new_tokens=8)
    ref = generate(model, kvzoo(model, mode), ids, mask, **beams)
    beam_cache = kvzoo(model, mode, validate=False)
    out = generate(model, beam_cache, ids, mask, **beams)
    assert torch.equal(out.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits))
    assert beam_cache.pages.epoch > 0


def test_inline_layout_gives_the_separate_layouts_numbers(model):
    seq = random_ids(2, 20)
    separate = teacher_forced(model, kvzoo(model, "int8_per_token_head"), seq, 12)
    inline = teacher_forced(model, kvzoo(model, "int8_per_token_head", layout="inline"), seq, 12)
    assert torch.equal(separate, inline)


@pytest.mark.parametrize("row_align", [16, "pow2"])
def test_an_aligned_inline_page_gives_the_separate_layouts_numbers(model, row_align):
    seq = random_ids(2, 20)
    separate = teacher_forced(model, kvzoo(model, "int8_per_token_head"), seq, 12)
    cache = kvzoo(model, "int8_per_token_head", layout="inline", row_align=row_align)
    aligned = teacher_forced(model, cache, seq, 12)
    assert torch.equal(separate, aligned)
    head = model.config.head_dim
    row = cache.layers[0].store.tensors.buffer.shape[-1]
    assert row >= head + 4 and row % 16 == 0 and (row_align != "pow2" or row & (row - 1) == 0)
    assert cache.audit().ok


def test_row_align_is_refused_without_an_inline_page(model):
    with pytest.raises(ValueError, match="row_align: pads the inline layout's rows"):
        KVZooCache(model.config, mode="int8_per_token_head", row_align=16)
    with pytest.raises(ValueError, match="row_align: expected None, 'pow2' or a positive multiple of 16"):
        KVZooCache(model.config, mode="int8_per_token_head", layout="inline", row_align=12)


def test_crop_rolls_back_exactly(model):
    seq = random_ids(2, 16)
    cache = kvzoo(model, "int8_per_token_head")
    first = teacher_forced(model, cache, seq, 10)
    cache.crop(-4)
    assert cache.get_seq_length() == 12
    cache.pages.check()
    with torch.no_grad():
        again = [model(seq[:, t : t + 1], use_cache=True, **{CACHE_ARG: cache}).logits for t in range(12, 16)]
    assert torch.equal(torch.cat(again, 1), first[:, -4:])
    cache.crop(0)  # transformers 5 calls crop(0) every step when it defers stopping: a no-op there
    assert cache.get_seq_length() == (0 if transformers.__version__.startswith("4.") else 16)


def test_reset_keeps_pages_and_forgets_sequences(model):
    ids = random_ids(2, 9)
    cache = kvzoo(model, "fp8_per_token_head")
    first = generate(model, cache, ids)
    capacity = cache.pages.capacity
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.pages.blocks_in_use() == 0
    second = generate(model, cache, ids)
    assert cache.pages.capacity == capacity
    assert torch.equal(first.sequences, second.sequences)


def test_batch_repeat_and_select_share_blocks(model):
    seq = random_ids(2, 10)
    cache = kvzoo(model, "int8_per_token_head")
    attention(model, "kvzoo_paged")
    with torch.no_grad():
        model(seq[:, :9], use_cache=True, **{CACHE_ARG: cache})
        used = cache.pages.blocks_in_use()
        cache.batch_repeat_interleave(2)
        assert cache.pages.blocks_in_use() == used  # shared, not copied
        logits = model(seq[:, 9:].repeat_interleave(2, 0), use_cache=True, **{CACHE_ARG: cache}).logits
        assert torch.equal(logits[0], logits[1]) and torch.equal(logits[2], logits[3])
        cache.batch_select_indices(torch.tensor([1, 2]))
        assert cache.pages.batch_size == 2
    cache.pages.check()


def test_cache_grows_by_pages_and_stops_at_its_ceiling(model):
    ids = random_ids(2, 9)
    cache = kvzoo(model, "int8_per_token_head", num_blocks=0)
    generate(model, cache, ids, max_new_tokens=1)
    assert cache.pages.blocks_in_use() == 2 * 3  # 9 tokens in pages of 4, per row
    assert cache.layers[0].store.num_blocks == cache.pages.capacity
    with pytest.raises(PagesFullError):
        generate(model, kvzoo(model, "int8_per_token_head", max_num_blocks=4), ids, max_new_tokens=1)


def test_bytes_per_token(model):
    ids = random_ids(1, 3)
    sizes = {}
    for mode in ("none", "int8_per_token_head", "fp8_per_tensor"):
        extra = dict(k_scale=0.01, v_scale=0.01) if mode == "fp8_per_tensor" else {}
        cache = kvzoo(model, mode, **extra)
        generate(model, cache, ids, max_new_tokens=1)
        sizes[mode] = cache.bytes_per_token()
    # 2 layers x (K + V) x 2 heads x 16: fp32 4 bytes; int8 1 byte + a float32 scale per row; fp8 1 byte.
    assert sizes == {"none": 512, "int8_per_token_head": 160, "fp8_per_tensor": 128}


def test_misuse_fails_loudly(model):
    ids = random_ids(1, 5)
    model.set_attn_implementation("sdpa")
    with pytest.raises(KVZooIntegrationError, match="kvzoo_paged"), torch.no_grad():
        model(ids, use_cache=True, **{CACHE_ARG: kvzoo(model)})
    attention(model, "kvzoo_paged")
    with pytest.raises(KVZooIntegrationError, match="KVZooCache"), torch.no_grad():
        model(ids, use_cache=True, **{CACHE_ARG: DynamicCache(config=model.config)})
    with pytest.raises(ValueError, match="k_scale"):
        KVZooCache(model.config, mode="fp8_per_tensor")
    with pytest.raises(ValueError, match="inline"):
        KVZooCache(model.config, mode="none", layout="inline")
    four_d = torch.zeros(1, 1, 5, 5)
    with pytest.raises(KVZooIntegrationError, match="4-D"), torch.no_grad():
        model(ids, attention_mask=four_d, use_cache=True, **{CACHE_ARG: kvzoo(model)})


COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    pad_token_id=PAD,
)
OTHER_DECODERS = {  # what each adds: kwargs the attention function must honour
    "Qwen2": lambda: transformers.Qwen2Config(**COMMON),
    "Mistral, window 8": lambda: transformers.MistralConfig(**COMMON, sliding_window=8),  # window via kwargs
    "Gemma2": lambda: transformers.Gemma2Config(  # logit softcap, scaling, alternating sliding layers
        **COMMON, sliding_window=8, query_pre_attn_scalar=16, attn_logit_softcapping=5.0
    ),
    "GptOss": lambda: transformers.GptOssConfig(  # attention sinks (s_aux), sliding layer types
        **COMMON,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    ),
}


@pytest.mark.parametrize("arch", list(OTHER_DECODERS))
def test_other_decoders_match_dynamic_cache(model, arch):  # (model: for its one-thread setting)
    torch.manual_seed(0)
    other = transformers.AutoModelForCausalLM.from_config(OTHER_DECODERS[arch]()).eval()
    for layer in other.model.layers:  # sinks start at 0; give them weight so a mistake would show
        if hasattr(layer.self_attn, "sinks"):
            layer.self_attn.sinks.data.normal_(generator=torch.Generator().manual_seed(1))
    _, ids, mask = left_padded([9, 13], seed=2)
    ref = generate(other, DynamicCache(config=other.config), ids, mask, max_new_tokens=12)
    out = generate(other, kvzoo(other), ids, mask, max_new_tokens=12)
    assert torch.equal(out.sequences, ref.sequences)
    assert max_logit_error(out.logits, ref.logits) <= 1e-5


def test_page_table_copy_on_write_and_crop():
    pages = PageTable(block_size=4)
    pages.plan_step(np.ones((2, 6), bool))
    pages.commit()
    pages.reorder(np.array([0, 0]))  # both rows continue row 0; row 1's blocks are freed
    assert pages.refcount[pages.tables[0]].tolist() == [2, 2]
    step = pages.plan_step(None)  # both append into the shared, half-full block 1
    # Row 0 copies it into a free block (3, freed by the reorder); row 1, now its only reader, appends in place.
    assert step.copies.tolist() == [[1, 3]]
    assert pages.tables == [[0, 3], [0, 1]]
    pages.check()
    pages.commit()
    pages.crop(3)
    assert pages.lens.tolist() == [4, 4] and pages.positions == 4
    pages.check()


# -- a step is a transaction ------------------------------------------------------------------


def _layer_lengths(cache: KVZooCache) -> list[int]:
    return [layer.get_seq_length() for layer in cache.layers]


def _tables_state(cache: KVZooCache) -> list:
    return [
        (t.positions, t.lens.tolist(), [list(x) for x in (t.tables or [])], t.refcount.tolist(), sorted(t.free))
        for t in cache._tables.values()
    ]


def test_a_refused_step_changes_nothing_and_the_next_step_works(model):
    """Pages exhausted part way: the step is refused whole; lengths, tables and every layer are
    as before it, and the next step gives the numbers of a cache that never saw it."""
    seq = random_ids(2, 12, seed=21)
    attention(model, "kvzoo_paged")
    refused, fresh = kvzoo(model, "int8_per_token_head", max_num_blocks=4), kvzoo(model, "int8_per_token_head")
    with torch.no_grad():
        for cache in (refused, fresh):
            model(seq[:, :4], use_cache=True, **{CACHE_ARG: cache})
        before = _tables_state(refused)
        with pytest.raises(PagesFullError):  # 8 more tokens a row need 4 blocks more than the 4 allowed
            model(seq[:, 4:12], use_cache=True, **{CACHE_ARG: refused})
        assert refused.get_seq_length() == 4 and _layer_lengths(refused) == [4, 4]
        assert _tables_state(refused) == before
        refused.pages.check()
        got = model(seq[:, 4:5], use_cache=True, **{CACHE_ARG: refused}).logits
        want = model(seq[:, 4:5], use_cache=True, **{CACHE_ARG: fresh}).logits
    assert torch.equal(got, want)
    assert refused.get_seq_length() == 5


def test_a_step_stopped_between_layers_is_undone(model, monkeypatch):
    """An error in the model after layer 0 attended, before layer 1 did: the cache undoes that
    step at its next use, so the retried step gives the numbers of a cache that never saw the
    failure. (An error after the last layer's attention comes after the step is whole: kept, as
    DynamicCache keeps it.)"""
    seq = random_ids(2, 9, seed=22)
    attention(model, "kvzoo_paged")
    broken, fresh = kvzoo(model, "fp8_per_token_head"), kvzoo(model, "fp8_per_token_head")
    with torch.no_grad():
        for cache in (broken, fresh):
            model(seq[:, :6], use_cache=True, **{CACHE_ARG: cache})
        mlp = model.model.layers[0].mlp
        monkeypatch.setattr(mlp, "forward", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
        with pytest.raises(RuntimeError, match="boom"):
            model(seq[:, 6:8], use_cache=True, **{CACHE_ARG: broken})
        monkeypatch.undo()
        assert broken.get_seq_length() == 6
        got = model(seq[:, 6:9], use_cache=True, **{CACHE_ARG: broken}).logits
        want = model(seq[:, 6:9], use_cache=True, **{CACHE_ARG: fresh}).logits
    assert torch.equal(got, want)
    assert _layer_lengths(broken) == [9, 9]
    broken.pages.check()


def test_unstorable_mode_and_layout_pairs_are_refused_when_made(model):
    with pytest.raises(ValueError, match="layout"):
        KVZooCache(model.config, mode="int4_per_token_head", layout="inline")
    odd = tiny_config()
    odd.head_dim = 24  # int4 without rotation takes power-of-two heads only
    with pytest.raises(ValueError, match="head"):
        KVZooCache(odd, mode="int4_per_token_head_norot")
    odd.head_dim = 25  # the rotated one, even heads (two codes a byte)
    with pytest.raises(ValueError, match="head"):
        KVZooCache(odd, mode="int4_per_token_head")
    odd.head_dim = 18  # the inline page needs heads that are a multiple of 4
    with pytest.raises(ValueError, match="multiple of 4"):
        KVZooCache(odd, mode="int8_per_token_head", layout="inline")


@pytest.mark.parametrize(
    "bad",
    [torch.tensor([0.0, 1.0]), torch.tensor([True, False]), torch.tensor([[0, 1]]), np.array([0.0, 1.0]), [1, 0]],
    ids=["float", "bool", "2-D", "numpy float", "list"],
)
def test_row_indices_must_be_one_dimensional_integers(model, bad):
    seq = random_ids(2, 5)
    cache = kvzoo(model, "int8_per_token_head")
    attention(model, "kvzoo_paged")
    with torch.no_grad():
        model(seq, use_cache=True, **{CACHE_ARG: cache})
    before = _tables_state(cache)
    for call in (cache.reorder_cache, cache.batch_select_indices):
        with pytest.raises(ValueError, match="integer|1-D"):
            call(bad)
    with pytest.raises(IndexError):
        cache.reorder_cache(torch.tensor([0, 2]))
    assert _tables_state(cache) == before
    cache.reorder_cache(torch.tensor([1, 1], dtype=torch.int32))  # any integer dtype, as index_select takes
    cache.pages.check()


# -- memory: the mode's bytes for the tokens held ------------------------------------------------


def _live_storages() -> dict[int, int]:
    import gc

    gc.collect()
    held = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type != "meta":
                storage = obj.untyped_storage()
                held[storage.data_ptr()] = storage.nbytes()
        except Exception:  # noqa: BLE001 (objects that are tensors in name only)
            continue
    return held


def _layer_bound(cache: KVZooCache, layer: KVZooLayer) -> int:
    """The most a layer may hold: its mode's bytes for each row's tokens (a sliding layer's:
    its window and slack), a partly filled block per row, and 5% over (SPEC of issue 46)."""
    table = layer.pages
    bs = table.block_size
    per_token = layer.store.bytes_per_token
    tokens = 0
    for length in table.lens.tolist():
        kept = length if table.window is None else min(length, table.window + table.window_slack + bs)
        tokens += kept + bs  # its tokens and a partly filled block (a window's: one at each end)
    return int(1.05 * tokens * per_token)


def _check_memory(cache: KVZooCache, what: str, bounds: dict[int, int] | None = None) -> None:
    """bounds: each layer's largest bound so far, kept across calls: crop and reorder hand
    blocks back to the pool, which keeps them for the next tokens (DynamicCache's crop keeps
    its storage too), so what a layer holds is bounded by the most its rows have needed."""
    bounds = {} if bounds is None else bounds
    for layer in cache.layers:
        if layer.store is not None:
            bound = bounds[layer.index] = max(bounds.get(layer.index, 0), _layer_bound(cache, layer))
            assert layer.store.nbytes <= bound, (
                f"{what}: layer {layer.index} holds {layer.store.nbytes} > {bound} bytes"
            )
    for table in cache._tables.values():
        table.check()


@pytest.mark.parametrize("mode", list(MODES))
def test_cache_holds_its_modes_bytes_for_the_tokens_it_stores(model, mode):
    """After prefill, every decode step, crop and a beam reorder, each layer holds at most its
    mode's bytes for the rows' tokens plus a block per row plus 5%; after generate, kvzoo
    holds no tensor but the pages (no workspace, no step metadata, no old pages)."""
    if MODES[mode].per_tensor:
        extra = dict(k_scale=0.05, v_scale=0.05)
    else:
        extra = {}
    ids = random_ids(3, 37, seed=31)
    attention(model, "kvzoo_paged")
    before = _live_storages()
    cache = kvzoo(model, mode, **extra)
    bounds: dict[int, int] = {}
    with torch.no_grad():
        model(ids[:, :30], use_cache=True, **{CACHE_ARG: cache})
        _check_memory(cache, "after prefill", bounds)
        for t in range(30, 37):
            model(ids[:, t : t + 1], use_cache=True, **{CACHE_ARG: cache})
            _check_memory(cache, f"after decode step {t}", bounds)
        cache.crop(-3)
        _check_memory(cache, "after crop", bounds)
        cache.reorder_cache(torch.tensor([2, 2, 0]))
        _check_memory(cache, "after a beam reorder", bounds)
        model(ids[:, 34:35], use_cache=True, **{CACHE_ARG: cache})
        _check_memory(cache, "after decoding past the reorder", bounds)
    held = {k: v for k, v in _live_storages().items() if k not in before}
    pages = sum(layer.store.nbytes for layer in cache.layers)
    statics = sum(4 * 2 for layer in cache.layers if layer.store.k_scale is not None)
    # What the test itself holds: the ids and, alive in this frame, nothing else of size.
    assert sum(held.values()) - pages - statics <= ids.numel() * ids.element_size(), (
        f"kvzoo holds {sum(held.values()) - pages} bytes beyond its pages: {sorted(held.values())[-5:]}"
    )


def test_generate_sized_ahead_never_regrows(model):
    ids = random_ids(2, 20, seed=32)
    cache = kvzoo(model, "int8_per_token_head", max_cache_len=20 + 12)
    grown = []
    original = cache.pages._add_blocks
    generate(model, cache, ids, max_new_tokens=12)
    capacity = cache.pages.capacity
    assert capacity == 2 * -(-32 // 4)  # the reservation: every row's blocks, once
    cache.pages._add_blocks = lambda n: grown.append(n) or original(n)
    cache.reset()
    generate(model, cache, ids, max_new_tokens=12)
    assert not grown and cache.pages.capacity == capacity


def test_sliding_window_layers_hold_their_window(model):  # (model: for its one-thread setting)
    """Gemma2's alternating layers: past the prompt, the sliding ones keep window + slack tokens
    a row however long the sequence grows, and the numbers stay DynamicCache's."""
    torch.manual_seed(0)
    other = transformers.AutoModelForCausalLM.from_config(OTHER_DECODERS["Gemma2"]()).eval()
    ids = random_ids(2, 10, seed=33)
    ref = generate(other, DynamicCache(config=other.config), ids, max_new_tokens=80)
    cache = kvzoo(other, "none", window_slack=4)  # mode none: the same tokens as DynamicCache
    out = generate(other, cache, ids, max_new_tokens=80)
    assert torch.equal(out.sequences, ref.sequences)
    sliding = [layer for layer in cache.layers if layer.is_sliding]
    full = [layer for layer in cache.layers if not layer.is_sliding]
    assert sliding and full
    window = sliding[0].pages
    # 89 tokens a row; the window (8) and slack (4) in pages of 4, and a block at each end.
    assert window.blocks_in_use() <= 2 * (-(-(8 + 4) // 4) + 2)
    assert sliding[0].store.nbytes < full[0].store.nbytes / 3
    _check_memory(cache, "after generate")
    with pytest.raises(ValueError, match="released"):
        cache.crop(-10)  # past the slack: the window's released keys would be needed
    # A dump holds one block table for every layer; the window's layers keep their own: refused
    # by name before the dump reader meets tables that disagree.
    with pytest.raises(KVZooIntegrationError, match="audit: this cache has sliding-window layers"):
        cache.audit()


@pytest.mark.parametrize("make", ["paged", "static"])
def test_a_fresh_prompt_is_attended_by_sdpa_and_stored_as_codes(model, make):
    """prefill_attention="auto": a first, unpadded step attends its own K/V with torch SDPA, so
    its logits are DynamicCache + SDPA's; the pages get the same codes as with "kvzoo", and the
    steps after it read them (their numbers are the quantized cache's again)."""
    seq = random_ids(2, 14, seed=41)
    attention(model, "sdpa")
    with torch.no_grad():
        reference = model(seq[:, :10], use_cache=True, **{CACHE_ARG: DynamicCache(config=model.config)}).logits
    caches, logits = {}, {}
    for choice in ("auto", "kvzoo"):
        if make == "paged":
            caches[choice] = kvzoo(model, "int8_per_token_head", prefill_attention=choice)
        else:
            caches[choice] = static(model, 2, prefill_attention=choice)
        logits[choice] = teacher_forced(model, caches[choice], seq, 10)
    assert float((logits["auto"][:, 0] - reference[:, -1]).abs().max()) <= 1e-5
    assert float((logits["kvzoo"][:, 0] - reference[:, -1]).abs().max()) > 1e-4  # the codes move it
    # Layer 0's K/V are the embeddings' projections, the same under either choice: so are its codes.
    a, b = caches["auto"].layers[0].store, caches["kvzoo"].layers[0].store
    for x, y in zip(a._arrays(a.tensors), b._arrays(b.tensors)):
        assert torch.equal(x, y)
    # A padded batch is not fresh: every row through the pages, as with "kvzoo".
    _, ids, mask = left_padded([4, 7], seed=42)
    a = generate(model, kvzoo(model, "fp8_per_token_head", prefill_attention="auto"), ids, mask, max_new_tokens=3)
    b = generate(model, kvzoo(model, "fp8_per_token_head"), ids, mask, max_new_tokens=3)
    assert max_logit_error(a.logits, b.logits) == 0.0


# -- the fixed-size cache of compiled decode -----------------------------------------------------


def static(model, batch, length=48, mode="int8_per_token_head", **kw) -> KVZooStaticCache:
    kw.setdefault("impl", IMPL)
    kw.setdefault("prefill_attention", "kvzoo")
    kw.setdefault("block_size", 4)
    return KVZooStaticCache(model.config, max_batch_size=batch, max_cache_len=length, mode=mode, **kw)


def test_static_cache_gives_the_paged_caches_numbers(model):
    """Left-padded rows and beam search: the fixed-size cache's bytes and numbers are
    KVZooCache's (the same kernels on the same tokens)."""
    _, ids, mask = left_padded([4, 9, 6], seed=12)
    for mode in ("int8_per_token_head", "int4_per_token_head"):
        want = generate(model, kvzoo(model, mode), ids, mask)
        got = generate(model, static(model, 3, mode=mode), ids, mask)
        assert torch.equal(got.sequences, want.sequences)
        assert max_logit_error(got.logits, want.logits) == 0.0
    beams = dict(num_beams=2, max_new_tokens=6, output_logits=False, return_dict_in_generate=False)
    assert torch.equal(
        generate(model, static(model, 6), ids, mask, **beams),
        generate(model, kvzoo(model, "int8_per_token_head"), ids, mask, **beams),
    )


def test_int4_takes_a_head_that_is_no_power_of_two():
    """head_dim 24 = 16 + 8, the rotation's two blocks (SPEC.md 3.4): both caches store and
    attend it, with the same numbers, and those are the model's to int4's rounding."""
    config = tiny_config()
    config.head_dim = 24
    torch.manual_seed(1234)
    odd = LlamaForCausalLM(config).eval()
    _, ids, mask = left_padded([4, 7], seed=14)
    want = generate(odd, kvzoo(odd, "int4_per_token_head"), ids, mask)
    got = generate(odd, static(odd, 2, mode="int4_per_token_head"), ids, mask)
    assert torch.equal(got.sequences, want.sequences)
    assert max_logit_error(got.logits, want.logits) == 0.0
    # The two caches share their kernels, so a wrong rotation would pass the above: the first
    # step's logits (the prompt's attention on the int4 cache) against the unquantized model's.
    # int4's rounding moves them by 0.03 here (logits up to 0.59); one butterfly over the tile
    # padded to 32 instead of the blocks, by 0.33.
    exact = generate(odd, DynamicCache(), ids, mask)
    assert max_logit_error(want.logits[:1], exact.logits[:1]) < 0.1


def test_static_cache_decode_compiles_into_one_graph(model):
    """generate() compiles the decode step of a compileable cache by itself (on a GPU; here
    asked to on the CPU): every decode step is one graph, traced once, with the eager numbers."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    _, ids, mask = left_padded([5, 8], seed=13)
    want = generate(model, static(model, 2), ids, mask)
    # generate deep-copies its compile config, so the graphs are counted by dynamo's own counters.
    config = CompileConfig(backend="aot_eager", fullgraph=True, mode=None)
    config._compile_all_devices = True
    torch._dynamo.reset()
    counters.clear()
    try:
        got = generate(model, static(model, 2), ids, mask, compile_config=config)
        graphs = counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    assert graphs == 1, f"{graphs} graphs: a decode step recompiled (or none compiled)"
    assert torch.equal(got.sequences, want.sequences)
    assert max_logit_error(got.logits, want.logits) == 0.0


def test_static_cache_refuses_what_it_cannot_hold(model):
    ids = random_ids(2, 6)
    with pytest.raises(ValueError, match="max_cache_len"):
        static(model, 2, length=0)
    with pytest.raises(KVZooIntegrationError, match="max_batch_size"):
        generate(model, static(model, 3), ids)
    with pytest.raises(KVZooIntegrationError, match="max_cache_len"):
        generate(model, static(model, 2, length=4), ids, max_new_tokens=1)
    hole = torch.ones_like(ids)
    hole[0, 3] = 0
    with pytest.raises(KVZooIntegrationError, match="left padding"):
        generate(model, static(model, 2), ids, hole)


@pytest.mark.parametrize("module", ["__init__", "cache", "static", "step", "_store", "_pages"])
def test_docstring_examples_run(module):
    name = "kvzoo.integrations.transformers" + ("" if module == "__init__" else f".{module}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS).failed == 0
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------


def check_bf16(device: str, impl: str | None) -> dict[str, float]:
    """The CPU checks in bfloat16 on `device`; returns the measured relative errors."""
    torch.manual_seed(1234)
    model = LlamaForCausalLM(tiny_config()).eval().to(device, torch.bfloat16)
    seq, prompt_len = random_ids(2, 40).to(device), 24

    def paged(mode="none", **kw):
        return KVZooCache(model.config, mode=mode, block_size=16, impl=impl, **kw)

    errors = {}
    ref = teacher_forced(model, DynamicCache(config=model.config), seq, prompt_len).float()
    none = teacher_forced(model, paged(), seq, prompt_len).float()
    scale = float(ref.abs().max())
    # eager rounds its probabilities to bf16 before P.V; kvzoo keeps them in fp32.
    errors["none"] = float((none - ref).abs().max()) / scale
    assert errors["none"] <= 3e-2
    assert (none.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.95
    ks, vs = calibrated_scales(model, seq[:, :prompt_len])
    for (mode, rounding), bound in TOLERANCE.items():
        if mode == "fp8_e4m3fnuz_per_token_head" and device != "cpu":
            continue  # ROCm's format: the CUDA kernels do not take it
        extra = dict(k_scale=ks, v_scale=vs) if mode == "fp8_per_tensor" else {}
        got = teacher_forced(model, paged(mode, rounding=rounding, **extra), seq, prompt_len).float()
        errors[f"{mode}/{rounding}"] = float((got - none).abs().max()) / scale
        assert errors[f"{mode}/{rounding}"] <= bound + 3e-2, (mode, rounding, errors)
    # generate: a left-padded batch (each row as if alone) and beam search.
    prompts, ids, mask = left_padded([3, 7, 5])
    ids, mask = ids.to(device), mask.to(device)
    cache = paged("int8_per_token_head")
    out = generate(model, cache, ids, mask, max_new_tokens=6)
    assert cache.pages.lens.tolist() == [len(p) + 5 for p in prompts]
    for row, p in enumerate(prompts):
        alone = generate(model, paged("int8_per_token_head"), p[None].to(device), max_new_tokens=6)
        first = float((alone.logits[0][0].float() - out.logits[0][row].float()).abs().max()) / scale
        errors[f"padded row {row}"] = first
        assert first <= 3e-2
    beams = dict(num_beams=2, max_new_tokens=6, output_logits=False, return_dict_in_generate=False)
    beam_cache = paged("fp8_per_token_head")
    assert generate(model, beam_cache, ids, mask, **beams).shape == (3, ids.shape[1] + 6)
    beam_cache.pages.check()
    return errors


def test_bf16_on_cpu(model):  # (model: for its one-thread setting)
    check_bf16("cpu", IMPL)


@pytest.mark.gpu_only
def test_bf16_on_cuda_matches_dynamic_cache_within_bf16_rounding():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    errors = check_bf16("cuda", None)  # impl: the registry's choice (Triton)
    print("relative logit errors, bf16 on CUDA:", errors)


@pytest.mark.gpu_only
@pytest.mark.parametrize("make", ["paged", "static"])
def test_decode_steps_read_nothing_back_on_cuda(make, monkeypatch):
    """Issue 46 item 2: kvzoo's part of a decode step (the cache's update and the attention
    function's write and attention, for every layer) runs under torch's sync debug mode
    "error": any copy to the host, .item() or blocking copy from pageable memory raises."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from kvzoo.integrations.transformers import KVZooStaticLayer

    torch.manual_seed(1234)
    model = use_kvzoo_attention(LlamaForCausalLM(tiny_config()).eval().to("cuda", torch.bfloat16))
    _, ids, mask = left_padded([5, 9])
    ids, mask = ids.cuda(), mask.cuda()
    if make == "paged":
        cache = KVZooCache(model.config, mode="int8_per_token_head")
    else:
        cache = KVZooStaticCache(model.config, max_batch_size=2, max_cache_len=32, mode="int8_per_token_head")
    strict = [False]

    def checked(fn):
        def run(*args, **kwargs):
            if not strict[0]:
                return fn(*args, **kwargs)
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        return run

    for cls in (KVZooLayer, KVZooStaticLayer):
        monkeypatch.setattr(cls, "update", checked(cls.update))
        monkeypatch.setattr(cls, "attend", checked(cls.attend))
    with torch.no_grad():
        out = model(ids, attention_mask=mask, use_cache=True, **{CACHE_ARG: cache})  # prefill: reads the mask
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(4):
            mask = torch.cat([mask, torch.ones_like(token)], 1)
            strict[0] = True
            out = model(token, attention_mask=mask, use_cache=True, **{CACHE_ARG: cache})
            strict[0] = False
            token = out.logits[:, -1:].argmax(-1)
    torch.cuda.synchronize()


@pytest.mark.gpu_only
def test_static_cache_compiled_on_cuda_gives_the_eager_numbers():
    """generate()'s own compiled decode (inductor, CUDA graphs) over KVZooStaticCache: the
    tokens and logits of the same cache run eagerly."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from transformers import CompileConfig

    torch.manual_seed(1234)
    model = use_kvzoo_attention(LlamaForCausalLM(tiny_config()).eval().to("cuda", torch.bfloat16))
    _, ids, mask = left_padded([5, 9])
    ids, mask = ids.cuda(), mask.cuda()
    args = dict(max_new_tokens=12, do_sample=False, pad_token_id=PAD, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        eager = model.generate(
            ids,
            attention_mask=mask,
            disable_compile=True,
            **{CACHE_ARG: KVZooStaticCache(model.config, max_batch_size=2, max_cache_len=32)},
            **args,
        )
        compiled = model.generate(
            ids,
            attention_mask=mask,
            compile_config=CompileConfig(fullgraph=True),
            **{CACHE_ARG: KVZooStaticCache(model.config, max_batch_size=2, max_cache_len=32)},
            **args,
        )
    assert torch.equal(compiled.sequences, eager.sequences)
    assert max_logit_error(compiled.logits, eager.logits) <= 2e-2  # bf16 model: inductor fuses its matmuls
