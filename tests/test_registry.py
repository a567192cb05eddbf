"""Registry mechanics on registries built fresh for each test."""

from __future__ import annotations

import doctest
import subprocess
import sys

import numpy as np
import pytest
import torch

import kvzoo
from kvzoo import registry
from kvzoo.errors import KVZooInputError
from kvzoo.registry import Implementation, NoImplementationError, Registry, modes_for_formats


def _impl(
    name, priority, *, modes=("int8_per_token_head",), devices=("cpu",), missing=(), limit=None, op="reshape_and_cache"
):
    calls = []
    impl = Implementation(
        name=name,
        op=op,
        platform="cpu",
        modes=frozenset(modes),
        run=calls.append,
        devices=frozenset(devices),
        priority=priority,
        unavailable=lambda: list(missing),
        problem_reasons=(lambda p: [] if limit is None else limit(p)),
    )
    return impl, calls


class _Problem:
    """A cache write reduced to what supports() reads (kvzoo.capabilities.required too)."""

    mode = kvzoo.get_kv_quant_mode("int8_per_token_head")
    device = "cpu"
    head_size = 256
    key_cache = k_scale_cache = None


def test_best_prefers_priority_and_skips_unavailable():
    reg = Registry()
    fast, _ = _impl("fast", 50, missing=["fast: not installed"])
    slow, _ = _impl("slow", 10)
    reg.add(fast)
    reg.add(slow)
    assert reg.best("reshape_and_cache", "int8_per_token_head", "cpu").name == "slow"
    with pytest.raises(NoImplementationError, match="fast: not installed"):
        reg.best("reshape_and_cache", "int8_per_token_head", "cuda")


def test_select_and_best_share_one_ordering():
    # Equal priorities keep registration order; unavailable ones are out of both.
    reg = Registry()
    for name, priority, missing in (("a", 10, ()), ("b", 50, ()), ("c", 10, ()), ("gone", 99, ["gone: no"])):
        reg.add(_impl(name, priority, missing=missing)[0])
    order = [i.name for i in reg.candidates("reshape_and_cache", "int8_per_token_head", "cpu")]
    assert order == ["b", "a", "c"]
    assert reg.best("reshape_and_cache", "int8_per_token_head", "cpu").name == "b"
    assert reg.select(_Problem(), "reshape_and_cache").name == "b"


def test_select_passes_over_a_candidate_that_declines_the_problem():
    # best() looks at no problem; select() asks each candidate in best()'s order.
    reg = Registry()
    reg.add(_impl("small", 50, limit=lambda p: [f"small: head_size {p.head_size} > 128"])[0])
    reg.add(_impl("any", 10)[0])
    assert reg.best("reshape_and_cache", "int8_per_token_head", "cpu").name == "small"
    assert reg.select(_Problem(), "reshape_and_cache").name == "any"


def test_candidates_are_remembered_until_the_registry_changes():
    probes = []
    missing: list[str] = ["fast: not installed"]
    reg = Registry()
    reg.add(
        Implementation(
            "fast",
            "reshape_and_cache",
            "cpu",
            frozenset({"int8_per_token_head"}),
            run=print,
            priority=50,
            unavailable=lambda: probes.append(1) or list(missing),
        )
    )
    reg.add(_impl("slow", 10)[0])
    for _ in range(3):
        assert reg.select(_Problem(), "reshape_and_cache").name == "slow"
        assert reg.candidates("reshape_and_cache", "int8_per_token_head", "cpu")[0].name == "slow"
    assert len(probes) == 1
    missing.clear()
    assert reg.best("reshape_and_cache", "int8_per_token_head", "cpu").name == "slow"  # still remembered
    reg.invalidate()
    assert reg.best("reshape_and_cache", "int8_per_token_head", "cpu").name == "fast"
    reg.add(_impl("fastest", 90)[0])
    assert reg.select(_Problem(), "reshape_and_cache").name == "fastest"
    reg.load(["kvzoo.backends.numpy_vectorized"])
    assert "numpy" in [i.name for i in reg.candidates("reshape_and_cache", "int8_per_token_head", "cpu")]


def test_a_candidate_lost_since_it_was_remembered_is_passed_over():
    # select() still asks supports(), so availability lost mid-process falls to the next one.
    missing: list[str] = []
    reg = Registry()
    reg.add(_impl("fast", 50, missing=missing)[0])
    reg.add(_impl("slow", 10)[0])
    assert reg.select(_Problem(), "reshape_and_cache").name == "fast"
    missing.append("fast: disabled")
    assert reg.select(_Problem(), "reshape_and_cache").name == "slow"


def test_select_explains_every_refusal():
    reg = Registry()
    small, _ = _impl("small", 50, limit=lambda p: [f"small: head_size {p.head_size} > 128"])
    other, _ = _impl("other", 10, modes=("fp8_per_token_head",))
    reg.add(small)
    reg.add(other)
    with pytest.raises(NoImplementationError) as info:
        reg.select(_Problem(), "reshape_and_cache")
    assert "head_size 256 > 128" in str(info.value)
    assert "mode 'int8_per_token_head' is not one of ['fp8_per_token_head']" in str(info.value)
    with pytest.raises(NoImplementationError, match="impl='small' cannot run"):
        reg.select(_Problem(), "reshape_and_cache", impl="small")


def test_duplicate_and_unknown_names_rejected():
    reg = Registry()
    a, _ = _impl("a", 1)
    reg.add(a)
    with pytest.raises(ValueError, match="already registered"):
        reg.add(a)
    with pytest.raises(ValueError, match="registered: \\['a'\\]"):
        reg.get("reshape_and_cache", "b")


def test_broken_backend_is_recorded_not_raised():
    reg = Registry().load(["kvzoo.backends.numpy_vectorized", "kvzoo.backends.does_not_exist"])
    assert [i.name for i in reg.implementations("paged_attention")] == ["numpy"]
    assert "does_not_exist" in next(iter(reg.import_errors))


def test_a_module_without_register_and_a_repeated_module():
    reg = Registry().load(["kvzoo.errors", "kvzoo.backends.numpy_vectorized", "kvzoo.backends.numpy_vectorized"])
    assert list(reg.import_errors) == ["kvzoo.errors"] and "register" in reg.import_errors["kvzoo.errors"]
    assert [i.name for i in reg.implementations("dequantize")] == ["numpy"]


def test_module_docstring_example_runs():
    assert doctest.testmod(kvzoo.registry).failed == 0


def test_default_registry_has_every_op_for_the_numpy_reference():
    for op in ("reshape_and_cache", "dequantize", "paged_attention"):
        impl = kvzoo.registry.get(op, "numpy")
        # dequantize reads one cache in one side's mode: every mode but the split ones.
        every = frozenset(name for name, m in kvzoo.MODES.items() if op != "dequantize" or not m.split)
        assert impl.platform == "any" and impl.modes == every


def test_triton_listed_with_reason_without_a_gpu():
    """Without a GPU and without the interpreter, triton is listed as unavailable, with why."""
    code = (
        "import os; os.environ.pop('TRITON_INTERPRET', None)\n"
        "import kvzoo\n"
        "impls = [i for i in kvzoo.registry.implementations() if i.name.startswith('triton')]\n"
        "assert impls, 'triton backends not registered'\n"
        "print(';'.join(r for i in impls for r in i.unavailable()))\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    if torch.cuda.is_available():
        assert "triton-cuda" not in result.stdout
    else:
        assert "no CUDA GPU here" in result.stdout


def test_impl_argument_forces_an_implementation():
    key = torch.randn(3, 1, 16)
    cache = kvzoo.PagedKVCache(1, 4, 1, 16, "int8_per_token_head")
    cache.write(key, key, torch.arange(3), impl="numpy")
    with pytest.raises(NoImplementationError, match="mode 'fp8_per_tensor'"):
        kvzoo.reshape_and_cache(
            key,
            key,
            torch.empty(1, 4, 1, 16, dtype=torch.float8_e4m3fn),
            torch.empty(1, 4, 1, 16, dtype=torch.float8_e4m3fn),
            torch.arange(3),
            mode="fp8_per_tensor",
            k_scale=1.0,
            v_scale=1.0,
            impl="triton-rocm",
        )


def test_triton_missing_entirely_is_a_reason_not_an_import_error():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import kvzoo\n"
        "impls = [i for i in kvzoo.registry.implementations() if i.name.startswith('triton')]\n"
        "assert len(impls) == 6, impls\n"
        "assert not kvzoo.registry.default().import_errors, kvzoo.registry.default().import_errors\n"
        "print(';'.join(r for i in impls for r in i.unavailable()))\n"
        "print(kvzoo.registry.best('reshape_and_cache', 'int8_per_token_head', 'cpu').name)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "triton is not installed" in result.stdout
    assert result.stdout.strip().splitlines()[-1] in ("numba", "numpy")


@pytest.mark.gpu_only
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_registry_picks_triton_on_cuda():
    for op in ("reshape_and_cache", "dequantize", "paged_attention"):
        for mode in ("none", "int8_per_token_head", "fp8_per_token_head"):
            assert kvzoo.registry.best(op, mode, "cuda").name == "triton-cuda"
    cache = kvzoo.PagedKVCache(4, 16, 2, 64, "int8_per_token_head", device="cuda")
    key = torch.randn(8, 2, 64, device="cuda", dtype=torch.bfloat16)
    cache.write(key, key, torch.arange(8, device="cuda"))  # impl=None: the registry's choice
    # ... and the CPU backends refuse CUDA tensors with a reason naming the device.
    from kvzoo.problem import CacheWrite

    p = CacheWrite(
        mode=cache.mode,
        key=key,
        value=key,
        key_cache=cache.tensors.key_cache,
        value_cache=cache.tensors.value_cache,
        slot_mapping=torch.arange(8, device="cuda"),
        k_scale_cache=cache.tensors.k_scale_cache,
        v_scale_cache=cache.tensors.v_scale_cache,
    )
    assert any("device 'cuda'" in r for r in kvzoo.registry.get("reshape_and_cache", "numpy").supports(p))


def test_an_option_one_backend_lacks_goes_to_one_that_has_it():
    # Numba declines quantize_query with a reason; the automatic choice on CPU then falls to
    # the NumPy reference instead of failing.
    cache = kvzoo.PagedKVCache(2, 16, 2, 64, "int8_per_token_head")
    kv = torch.randn(20, 2, 64)
    cache.write(kv, kv, torch.arange(20))
    q = torch.randn(20, 4, 64)
    args = dict(
        block_tables=torch.tensor([[0, 1]], dtype=torch.int32),
        seq_lens=torch.tensor([20], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 20], dtype=torch.int32),
        quantize_query=True,
    )
    numba = kvzoo.registry.get("paged_attention", "numba")
    if numba.available:
        with pytest.raises(NoImplementationError, match="quantize_query"):
            cache.attention(q, impl="numba", **args)
    auto = cache.attention(q, **args)
    assert torch.equal(auto, cache.attention(q, impl="numpy", **args))


@pytest.mark.parametrize(
    "engine, mode",
    [
        ("auto", "none"),
        ("bfloat16", "none"),
        ("float16", "none"),
        ("float32", "none"),
        ("fp8", "fp8_per_tensor"),
        ("fp8_e4m3", "fp8_per_tensor"),
        (" INT8_PER_TOKEN_HEAD ", "int8_per_token_head"),
        ("fp8_per_token_head", "fp8_per_token_head"),
        ("int8_per_tensor", "int8_per_tensor"),
        ("fp8_e5m2", "fp8_e5m2_per_tensor"),
        ("fp8_e5m2_per_tensor", "fp8_e5m2_per_tensor"),
    ],
)
def test_engine_kv_cache_dtype_strings(engine, mode):
    assert kvzoo.get_kv_quant_mode(engine).name == mode


@pytest.mark.parametrize("engine", sorted(kvzoo.modes.NOT_IMPLEMENTED))
def test_engine_strings_kvzoo_lacks_are_named_not_implemented(engine):
    with pytest.raises(kvzoo.KVZooInputError, match="does not implement"):
        kvzoo.get_kv_quant_mode(engine)


def test_typed_options_reach_run_with_the_call():
    """impl.with_options(...) gives a copy whose run receives the options; no globals patched."""
    import dataclasses as dc

    import numpy as np

    import kvzoo

    @dc.dataclass(frozen=True)
    class Choice:
        path: str = "a"

    seen = []
    base = registry.default().get("dequantize", "numpy")
    impl = dc.replace(
        base, name="with-choice", option_type=Choice, run=lambda p, options=None: (seen.append(options), base.run(p))
    )
    cache = np.random.default_rng(3).integers(-127, 128, (2, 4, 1, 8)).astype(np.int8)
    scales = np.random.default_rng(4).uniform(0.01, 0.1, (2, 4, 1)).astype(np.float32)
    plain = kvzoo.dequantize(cache, scales, mode="int8_per_token_head", impl=impl)
    chosen = kvzoo.dequantize(cache, scales, mode="int8_per_token_head", impl=impl.with_options(path="b"))
    assert seen == [None, Choice("b")] and np.array_equal(plain, chosen)
    assert impl.with_options(path="b").with_options(path="c").options == Choice("c")
    with pytest.raises(KVZooInputError, match="options are \\['path'\\]"):
        impl.with_options(bogus=1)
    with pytest.raises(KVZooInputError, match="takes no options"):
        base.with_options(path="b")
    triton = registry.default().get("paged_attention", "triton-cuda")
    assert triton.with_options(prefill="direct").options.prefill == "direct"
    with pytest.raises(KVZooInputError, match="prefill"):
        triton.with_options(prefill="sideways")


def test_the_registry_says_what_it_chose_and_why_not_the_faster_one(caplog):
    """Logging, not prints: the choice at DEBUG, a declined faster implementation at INFO with
    its reason (on the "kvzoo" logger's children, silent unless the application asks)."""
    import logging

    rng = np.random.default_rng()
    cache = kvzoo.PagedKVCache(2, 16, 2, 64, "int8_per_token_head", device=None)
    rows = rng.standard_normal((20, 2, 64)).astype(np.float32)
    cache.write(rows, rows, np.arange(20), impl="numpy")
    query = rng.standard_normal((1, 4, 64)).astype(np.float32)
    index = dict(block_tables=np.array([[0, 1]], np.int32), seq_lens=np.array([20], np.int32),
                 query_start_loc=np.array([0, 1], np.int32))  # fmt: skip
    with caplog.at_level(logging.DEBUG, logger="kvzoo"):
        cache.read("key")
        cache.attention(query, quantize_query=True, **index)  # numba declines quantize_query
    debug = [r for r in caplog.records if r.levelno == logging.DEBUG and r.name == "kvzoo.registry"]
    info = [r for r in caplog.records if r.levelno == logging.INFO and r.name == "kvzoo.registry"]
    assert any("dequantize (int8_per_token_head on cpu)" in r.getMessage() for r in debug), caplog.text
    declined = [r.getMessage() for r in info if r.getMessage().startswith("paged_attention")]
    assert declined and "numpy" in declined[0] and "quantize_query" in declined[0], caplog.text


def test_a_format_table_gives_the_modes_of_those_formats_split_ones_but_for_dequantize():
    one_sided = {"none", "int8_per_token_head", "int8_per_tensor"}
    assert modes_for_formats({"int8"}, "paged_attention") == one_sided
    int4 = {"int4_per_token_head", "int4_per_token_head_norot"}
    split = {"k_int8_v_int4", "k_int8_v_int4_norot"}  # int8 keys, uint4 values
    for op in ("reshape_and_cache", "paged_attention"):
        assert modes_for_formats(["int8", "uint4"], op) == one_sided | int4 | split
    assert modes_for_formats(["int8", "uint4"], "dequantize") == one_sided | int4
