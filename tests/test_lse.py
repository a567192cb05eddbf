"""paged_attention's log-sum-exp output (return_lse) and kvzoo.merge_attention_states.

Every registered paged_attention implementation, against kvzoo_spec's float64 oracle
(attention_f64(..., return_lse=True), SPEC.md section 8.2); the merge of attention over split
contexts against one call over the whole context; the merge's edge cases; the argument checks.
Under TRITON_INTERPRET=1 (tests/conftest.py without a GPU) the Triton kernels run on CPU
tensors at these small sizes; the gpu_only test repeats the Triton checks at engine sizes.
"""

from __future__ import annotations

import dataclasses
import doctest
import math

import numpy as np
import pytest
import torch

import kvzoo
from kvzoo import registry
from kvzoo.capabilities import Capabilities, required
from kvzoo.conformance.checks import declared_reasons
from kvzoo.errors import KVZooInputError
from kvzoo.modes import get_kv_quant_mode
from kvzoo.registry import Implementation, NoImplementationError
from kvzoo.samples import scattered_tables
from kvzoo_spec import oracle

from support import SEED, rng_for

CUDA = torch.cuda.is_available()
gpu_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

IMPLS = [i.name for i in registry.default().implementations("paged_attention")]

# Largest |lse - ref| / max(1, |ref|). lse sits in logit units, and a row's lse moves by the
# softmax-weighted mean of its logits' errors, so the bound is relative to the logits' size,
# for which max(1, |ref|) stands (the logits that carry weight lie within log(keys) of lse).
# numpy / numba: float32 dot products and exp/log (~1e-7 per operation, measured below 1e-6).
# Triton: the dots take fp16 operands with fp32 accumulation: an fp32 query rounds to fp16
# (2^-12 per element) and prefill tiles fold the per-key scale ratios into fp16 K (2^-11 per
# product), so a logit is off by up to 2^-11 of sum_d |q_d k_d| * softmax_scale, ~2e-3 for
# unit-variance rows at D = 64 with every rounding the same way; the probabilities' fp16
# rounding reaches the output only, never l (summed from the fp32 probabilities).
LSE_TOL = {"numpy": 1e-5, "numba": 1e-5}
TRITON_LSE_TOL = 3e-3


def lse_tolerance(impl: Implementation) -> float:
    if impl.name in LSE_TOL:
        return LSE_TOL[impl.name]
    return TRITON_LSE_TOL if impl.name.startswith("triton") else max(impl.attention_rtol, 1e-5)


def _impl(name: str) -> Implementation:
    impl = registry.default().get("paged_attention", name)
    if impl.unavailable():
        pytest.skip("; ".join(impl.unavailable()))
    return impl


def _device(impl: Implementation) -> str:
    return "cuda" if "cuda" in impl.devices else "cpu"


def _skip_undeclared(impl: Implementation, mode: str, options: set[str], head_size: int, dtype: str) -> None:
    need = kvzoo.capabilities.Requirements(head_size, dtype, frozenset(options | {"return_lse"}))
    why = declared_reasons(impl, mode, need)
    if why:
        pytest.skip("; ".join(why))


# ---------------------------------------------------------------------------------------------
# a paged problem, its caches written by kvzoo and decoded by the oracle


@dataclasses.dataclass(frozen=True)
class Case:
    q_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    mode: str = "int8_per_token_head"
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 32
    block_size: int = 16
    dtype: str = "bfloat16"
    sliding_window: int | None = None
    softcap: float | None = None
    sinks: bool = False
    quantize_query: bool = False
    batch_invariant: bool = False

    def options(self) -> set[str]:
        on = {
            "sliding_window": self.sliding_window is not None,
            "softcap": self.softcap is not None,
            "sinks": self.sinks,
            "quantize_query": self.quantize_query,
            "batch_invariant": self.batch_invariant,
        }
        return {name for name, flag in on.items() if flag}


_TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclasses.dataclass
class Paged:
    """The API's arguments on the device, and the oracle's decoded float32 caches."""

    case: Case
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    scales: dict
    block_tables: np.ndarray
    seq_lens: np.ndarray
    qsl: np.ndarray
    sinks: np.ndarray | None
    k_deq: np.ndarray
    v_deq: np.ndarray
    device: str

    def kwargs(self, block_tables=None, seq_lens=None, qsl=None, sinks=True) -> dict:
        dev = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(self.device)  # noqa: E731
        c = self.case
        return dict(
            mode=c.mode,
            block_tables=dev(self.block_tables if block_tables is None else block_tables),
            seq_lens=dev(self.seq_lens if seq_lens is None else seq_lens),
            query_start_loc=dev(self.qsl if qsl is None else qsl),
            sliding_window=c.sliding_window,
            softcap=c.softcap,
            sinks=None if (self.sinks is None or not sinks) else dev(self.sinks),
            quantize_query=c.quantize_query,
            batch_invariant=c.batch_invariant,
            **self.scales,
        )

    def reference(self, query=None, block_tables=None, seq_lens=None, qsl=None, sinks=True):
        q = (self.query if query is None else query).detach().cpu().float().numpy()
        if self.case.quantize_query:
            mode = "int8_per_token_head"
            q = oracle.decode_rows(*oracle.quantize_rows(q.reshape(-1, q.shape[-1]), mode), mode).reshape(q.shape)
        return oracle.attention_f64(
            q,
            self.k_deq,
            self.v_deq,
            self.block_tables if block_tables is None else block_tables,
            self.seq_lens if seq_lens is None else seq_lens,
            self.qsl if qsl is None else qsl,
            sliding_window=self.case.sliding_window,
            softcap=self.case.softcap,
            sinks=self.sinks if sinks else None,
            return_lse=True,
        )


def build(case: Case, device: str, rng: np.random.Generator, spare_blocks: int = 3) -> Paged:
    mode = get_kv_quant_mode(case.mode)
    bs, hkv, d = case.block_size, case.num_kv_heads, case.head_size
    tables, num_blocks = scattered_tables(rng, case.seq_lens, bs, spare_blocks=spare_blocks, spare_columns=0)
    tables = tables.astype(np.int32)
    # Keys and values written by kvzoo's own NumPy reshape_and_cache; only the decoded values
    # matter here, and the oracle decodes them itself.
    rows = num_blocks * bs
    k = rng.standard_normal((rows, hkv, d)).astype(np.float32)
    v = rng.standard_normal((rows, hkv, d)).astype(np.float32)
    model = "float32" if case.dtype == "float32" else case.dtype
    caches = kvzoo.allocate_separate(num_blocks, bs, hkv, d, mode, model_dtype=model, device=None)
    static = 0.02 if mode.per_tensor else None
    kvzoo.reshape_and_cache(
        torch.from_numpy(k).to(_TORCH[model]),
        torch.from_numpy(v).to(_TORCH[model]),
        _t(caches.key_cache),
        _t(caches.value_cache),
        torch.arange(rows),
        mode=mode,
        k_scale_cache=_t(caches.k_scale_cache),
        v_scale_cache=_t(caches.v_scale_cache),
        k_scale=static,
        v_scale=static,
        impl="numpy",
    )
    raw = lambda c: _t(c).float().numpy() if mode.code_dtype is None else _t(c).view(torch.uint8).numpy()
    k_deq = oracle.decode_cache(raw(caches.key_cache), caches.k_scale_cache, mode.name, static)
    v_deq = oracle.decode_cache(raw(caches.value_cache), caches.v_scale_cache, mode.name, static)
    qsl = np.concatenate([[0], np.cumsum(case.q_lens)]).astype(np.int32)
    query = torch.from_numpy(rng.standard_normal((int(qsl[-1]), case.num_q_heads, d)).astype(np.float32))
    dev = lambda x: None if x is None else _t(x).to(device)  # noqa: E731
    scales = dict(
        k_scale_cache=dev(caches.k_scale_cache), v_scale_cache=dev(caches.v_scale_cache), k_scale=static, v_scale=static
    )
    sinks = rng.standard_normal(case.num_q_heads).astype(np.float32) if case.sinks else None
    return Paged(
        case,
        query.to(_TORCH[case.dtype]).to(device),
        dev(caches.key_cache),
        dev(caches.value_cache),
        scales,
        tables,
        np.array(case.seq_lens, np.int32),
        qsl,
        sinks,
        k_deq,
        v_deq,
        device,
    )


def _t(x):
    # kvzoo's NumPy arrays (bfloat16 / fp8 through ml_dtypes) as torch tensors, zero-copy.
    return None if x is None else kvzoo.arrays.as_torch(x)


def attend(p: Paged, impl: Implementation, query=None, **kw):
    args = p.kwargs(**{k: kw.pop(k) for k in ("block_tables", "seq_lens", "qsl", "sinks") if k in kw})
    return kvzoo.paged_attention(
        p.query if query is None else query, p.key_cache, p.value_cache, impl=impl, **args, **kw
    )


def _host(x) -> np.ndarray:
    return x.detach().cpu().double().numpy() if torch.is_tensor(x) else np.asarray(x, np.float64)


def lse_error(lse, ref) -> float:
    """max |lse - ref| / max(1, |ref|) over the rows."""
    got = _host(lse)
    assert got.shape == ref.shape
    assert np.isfinite(got).all(), f"{int((~np.isfinite(got)).sum())} lse rows not finite (unwritten?)"
    return float(np.max(np.abs(got - ref) / np.maximum(1.0, np.abs(ref)))) if ref.size else 0.0


def out_error(out, ref, qsl) -> float:
    """Largest per-sequence relative Frobenius error (SPEC.md section 8's measure)."""
    got, worst = _host(out), 0.0
    for s in range(len(qsl) - 1):
        rows = slice(int(qsl[s]), int(qsl[s + 1]))
        if rows.stop > rows.start:
            worst = max(worst, float(np.linalg.norm(got[rows] - ref[rows]) / max(np.linalg.norm(ref[rows]), 1e-30)))
    return worst


# Output rounding of the query dtype, beside the implementation's own attention_rtol.
OUT_ROUNDOFF = {"float32": 0.0, "float16": 1e-3, "bfloat16": 8e-3}

CASES = {
    "decode-int8": Case((1, 1, 1), (5, 40, 17)),
    "prefill-fp8": Case((12, 7), (12, 20), mode="fp8_per_token_head"),
    "mixed-none": Case((1, 7, 20, 1), (33, 7, 50, 1), mode="none"),
    "mixed-fp8-per-tensor": Case((1, 7, 20, 1), (33, 7, 50, 1), mode="fp8_per_tensor"),
    "mixed-fnuz": Case((1, 7, 3), (33, 7, 50), mode="fp8_e4m3fnuz_per_token_head"),
    "gqa4-window-softcap-sinks": Case((1, 9, 1), (40, 30, 3), num_q_heads=8, sliding_window=9, softcap=5.0, sinks=True),
    "mqa-sinks-fp16-none": Case(
        (1, 6), (21, 26), mode="none", num_q_heads=4, num_kv_heads=1, dtype="float16", sinks=True
    ),
    "fp32-int8-d48": Case((1, 5), (19, 37), dtype="float32", head_size=48, block_size=8),
    "quantize-query": Case((1, 6), (30, 20), dtype="float32", quantize_query=True, sinks=True),
    "batch-invariant": Case((1, 9, 1), (40, 30, 3), batch_invariant=True, sinks=True),
}

MEASURED: dict[tuple[str, str], float] = {}


@pytest.mark.parametrize("case_name", sorted(CASES))
@pytest.mark.parametrize("impl_name", IMPLS)
def test_lse_matches_the_oracle(impl_name, case_name):
    impl = _impl(impl_name)
    case = CASES[case_name]
    _skip_undeclared(impl, case.mode, case.options(), case.head_size, case.dtype)
    p = build(case, _device(impl), rng_for("lse", impl_name, case_name))
    lse_in = torch.full((p.query.shape[0], case.num_q_heads), float("nan"), device=p.device)
    out, lse = attend(p, impl, return_lse=True, lse=lse_in)
    assert lse is lse_in
    ref_out, ref_lse = p.reference()
    err = lse_error(lse, ref_lse)
    MEASURED[impl_name, case_name] = err
    assert err <= lse_tolerance(impl), (impl_name, case_name, err, SEED)
    # The output is unchanged by asking for lse: the same bits as a call without it.
    plain = attend(p, impl)
    assert torch.equal(
        plain.view(torch.uint8) if plain.dtype != torch.float32 else plain,
        out.view(torch.uint8) if out.dtype != torch.float32 else out,
    )
    assert out_error(out, ref_out, p.qsl) <= impl.attention_rtol + OUT_ROUNDOFF[case.dtype]


@pytest.mark.parametrize("impl_name", IMPLS)
def test_lse_allocated_and_numpy_inputs(impl_name):
    """Without lse= the call allocates it (float32, like the query's kind and device);
    NumPy inputs give NumPy lse."""
    impl = _impl(impl_name)
    case = Case((1, 4), (9, 20), dtype="float32")
    _skip_undeclared(impl, case.mode, set(), case.head_size, case.dtype)
    p = build(case, _device(impl), rng_for("alloc", impl_name))
    out, lse = attend(p, impl, return_lse=True)
    assert torch.is_tensor(lse) and lse.dtype == torch.float32 and lse.device == p.query.device
    assert tuple(lse.shape) == (p.query.shape[0], case.num_q_heads)
    if p.device != "cpu":
        return
    np_kw = {k: (v.numpy() if torch.is_tensor(v) else v) for k, v in p.kwargs().items()}
    out_np, lse_np = kvzoo.paged_attention(
        p.query.numpy(), p.key_cache.numpy(), p.value_cache.numpy(), impl=impl, return_lse=True, **np_kw
    )
    assert isinstance(lse_np, np.ndarray) and lse_np.dtype == np.float32
    np.testing.assert_array_equal(lse_np, lse.numpy())


@pytest.mark.parametrize("impl_name", IMPLS)
def test_strided_lse_view_is_written_in_place(impl_name):
    """A caller's lse may be any writable view (here every other column of a wider buffer, and
    transposed); only its elements are written."""
    impl = _impl(impl_name)
    case = Case((1, 3, 1), (17, 9, 30))
    _skip_undeclared(impl, case.mode, set(), case.head_size, case.dtype)
    p = build(case, _device(impl), rng_for("strided", impl_name))
    T, H = p.query.shape[0], case.num_q_heads
    buf = torch.full((H, 2 * T), float("nan"), device=p.device)
    view = buf[:, ::2].T  # [T, H], strides (2, 2T)
    attend(p, impl, return_lse=True, lse=view)
    assert lse_error(view, p.reference()[1]) <= lse_tolerance(impl)
    assert torch.isnan(buf[:, 1::2]).all(), "wrote outside the lse view"


@pytest.mark.parametrize("impl_name", IMPLS)
def test_poisoned_key_gives_a_non_finite_lse_a_poisoned_value_does_not(impl_name):
    """SPEC.md 8.2: a NaN logit makes the row's lse NaN (non-finite, as its out); a NaN value
    element reaches out only, and lse stays the oracle's."""
    impl = _impl(impl_name)
    case = Case((1, 1), (40, 25), mode="none")
    _skip_undeclared(impl, case.mode, set(), case.head_size, case.dtype)
    p = build(case, _device(impl), rng_for("poison", impl_name))
    block, offset = int(p.block_tables[0, 1]), 3  # key 19 of sequence 0, seen by its decode row
    clean_v = p.value_cache.clone()
    p.value_cache[block, offset, 0, 5] = float("nan")
    p.v_deq[block, offset, 0, 5] = np.nan
    _, lse = attend(p, impl, return_lse=True)
    ref_out, ref_lse = p.reference()
    assert lse_error(lse, ref_lse) <= lse_tolerance(impl)
    p.value_cache.copy_(clean_v)
    p.v_deq[block, offset, 0, 5] = np.float32(clean_v[block, offset, 0, 5].float().item())
    p.key_cache[block, offset, 0, 2] = float("nan")
    _, lse = attend(p, impl, return_lse=True)
    group = case.num_q_heads // case.num_kv_heads
    got = _host(lse)
    assert not np.isfinite(got[0, :group]).any(), got[0]  # the heads reading KV head 0
    assert np.isfinite(got[0, group:]).all() and np.isfinite(got[1]).all()


# ---------------------------------------------------------------------------------------------
# merging attention over split contexts


def _check_merged(impl, merged_out, merged_lse, whole_out, whole_lse, ref_out, ref_lse, qsl):
    tol = lse_tolerance(impl)
    assert lse_error(merged_lse, ref_lse) <= tol
    assert out_error(merged_out, ref_out, qsl) <= impl.attention_rtol
    # Against the one call over the whole context: each is within tolerance of the reference.
    assert float(np.max(np.abs(_host(merged_lse) - _host(whole_lse)) / np.maximum(1, np.abs(ref_lse)))) <= 2 * tol
    assert out_error(merged_out, _host(whole_out), qsl) <= 2 * impl.attention_rtol


@pytest.mark.parametrize("variant", ["plain", "softcap-sinks", "none-mode"])
@pytest.mark.parametrize("impl_name", IMPLS)
def test_merge_of_two_halves_of_a_decode_context(impl_name, variant):
    """Decodes whose contexts are split block-aligned into two calls (the block table's first
    pages, then the rest): merged, they are one call over the whole context. Sinks go to the
    first call only, so their term is counted once."""
    impl = _impl(impl_name)
    extra = {"plain": {}, "softcap-sinks": dict(softcap=4.0, sinks=True), "none-mode": dict(mode="none")}[variant]
    case = Case((1, 1, 1), (70, 33, 60), dtype="float32", **extra)
    _skip_undeclared(impl, case.mode, case.options(), case.head_size, case.dtype)
    p = build(case, _device(impl), rng_for("merge-halves", impl_name, variant))
    bs = case.block_size
    cut = np.array([2, 1, 3])  # pages in the first part, per sequence
    first_len = cut * bs
    second_len = p.seq_lens - first_len
    assert (second_len > 0).all()
    second_tables = np.full_like(p.block_tables, -1)
    for s, c in enumerate(cut):
        rest = p.block_tables[s, c:]
        second_tables[s, : len(rest)] = rest
    out_a, lse_a = attend(p, impl, return_lse=True, seq_lens=first_len.astype(np.int32))
    out_b, lse_b = attend(
        p, impl, return_lse=True, block_tables=second_tables, seq_lens=second_len.astype(np.int32), sinks=False
    )
    merged_out, merged_lse = kvzoo.merge_attention_states(out_a, lse_a, out_b, lse_b)
    whole_out, whole_lse = attend(p, impl, return_lse=True)
    ref_out, ref_lse = p.reference()
    _check_merged(impl, merged_out, merged_lse, whole_out, whole_lse, ref_out, ref_lse, p.qsl)


@pytest.mark.parametrize("impl_name", IMPLS)
def test_merge_of_a_shared_prefix_and_per_sequence_suffixes(impl_name):
    """Cascade attention: two prefill chunks over one shared prefix of whole pages. The prefix
    pass treats every query row as a decode over the prefix (each row sees all of it); the
    suffix pass is causal attention over each sequence's own pages; merged they equal causal
    attention over prefix + suffix."""
    impl = _impl(impl_name)
    case = Case((5, 9), (32 + 5, 32 + 9), dtype="float32", softcap=6.0, sinks=True)
    _skip_undeclared(impl, case.mode, case.options(), case.head_size, case.dtype)
    p = build(case, _device(impl), rng_for("cascade", impl_name))
    prefix_pages = 2
    prefix = p.block_tables[0, :prefix_pages]
    tables = p.block_tables.copy()
    tables[1, :prefix_pages] = prefix  # sequence 1 shares sequence 0's first pages
    P = prefix_pages * case.block_size
    rows = int(p.qsl[-1])
    # Prefix pass: one 1-token "sequence" per query row, all over the same prefix pages.
    prefix_tables = np.tile(prefix, (rows, 1)).astype(np.int32)
    out_a, lse_a = attend(
        p,
        impl,
        return_lse=True,
        block_tables=prefix_tables,
        seq_lens=np.full(rows, P, np.int32),
        qsl=np.arange(rows + 1, dtype=np.int32),
    )
    # Suffix pass: each sequence's own pages, causal.
    suffix_tables = np.full_like(tables, -1)
    suffix_tables[:, : tables.shape[1] - prefix_pages] = tables[:, prefix_pages:]
    q_lens = np.diff(p.qsl).astype(np.int32)
    out_b, lse_b = attend(p, impl, return_lse=True, block_tables=suffix_tables, seq_lens=q_lens, sinks=False)
    merged_out = torch.full_like(out_a, float("nan"))
    merged_lse = torch.full_like(lse_a, float("nan"))
    got = kvzoo.merge_attention_states(out_a, lse_a, out_b, lse_b, out=merged_out, lse_out=merged_lse)
    assert got[0] is merged_out and got[1] is merged_lse
    whole_out, whole_lse = attend(p, impl, return_lse=True, block_tables=tables)
    ref_out, ref_lse = p.reference(block_tables=tables)
    _check_merged(impl, merged_out, merged_lse, whole_out, whole_lse, ref_out, ref_lse, p.qsl)


# ---------------------------------------------------------------------------------------------
# Triton: split-KV decode and batch invariance


def _triton_impls():
    return [n for n in IMPLS if n.startswith("triton")]


def _attention_problem(p: Paged, lse: torch.Tensor) -> kvzoo.problem.Attention:
    kw = p.kwargs()
    return kvzoo.problem.Attention(
        mode=get_kv_quant_mode(p.case.mode),
        query=p.query,
        key_cache=p.key_cache,
        value_cache=p.value_cache,
        block_tables=kw["block_tables"],
        seq_lens=kw["seq_lens"],
        query_start_loc=kw["query_start_loc"],
        out=torch.full_like(p.query, float("nan")),
        max_query_len=max(p.case.q_lens),
        max_seq_len=max(p.case.seq_lens),
        softmax_scale=1.0 / math.sqrt(p.case.head_size),
        k_scale_cache=kw["k_scale_cache"],
        v_scale_cache=kw["v_scale_cache"],
        k_scale=None if p.scales["k_scale"] is None else torch.tensor([p.scales["k_scale"]], device=p.device),
        v_scale=None if p.scales["v_scale"] is None else torch.tensor([p.scales["v_scale"]], device=p.device),
        sliding_window=p.case.sliding_window,
        softcap=p.case.softcap,
        sinks=kw["sinks"],
        batch_invariant=p.case.batch_invariant,
        lse=lse,
    )


@pytest.mark.parametrize(
    "extra",
    [{}, dict(sinks=True, sliding_window=40), dict(mode="none", softcap=3.0)],
    ids=["plain", "sinks-window", "none-softcap"],
)
@pytest.mark.parametrize("impl_name", _triton_impls())
def test_triton_split_kv_decode_lse(impl_name, extra):
    """The split-KV decode path (small forced splits): lse comes from the split merge."""
    impl = _impl(impl_name)
    from kvzoo.backends.triton import attention_kernels as K

    case = Case((1, 1, 1, 1), (300, 129, 64, 1), **extra)
    _skip_undeclared(impl, case.mode, case.options(), case.head_size, case.dtype)
    p = build(case, _device(impl), rng_for("split", impl_name, str(extra)))
    prob = _attention_problem(p, torch.full((4, case.num_q_heads), float("nan"), device=p.device))
    K.run(prob, impl.platform, decode=K.AttentionConfig(1, 32, 4, 2, 64))
    ref_out, ref_lse = p.reference()
    assert lse_error(prob.lse, ref_lse) <= lse_tolerance(impl)
    single = prob.replace(out=torch.empty_like(prob.out), lse=torch.full_like(prob.lse, float("nan")))
    K.run(single, impl.platform, decode=K.AttentionConfig(1, 32, 4, 2, 0))
    assert lse_error(single.lse, ref_lse) <= lse_tolerance(impl)


@pytest.mark.parametrize("mode", ["int8_per_token_head", "fp8_per_tensor"])
@pytest.mark.parametrize("impl_name", _triton_impls())
def test_triton_staged_prefill_lse(impl_name, mode):
    """Staged prefill (staging.py's workspace, forced at this size) beside a decode: the staged
    problem carries the caller's lse, and the decode launch writes the decode's rows."""
    impl = _impl(impl_name)
    from kvzoo.backends.triton import attention_kernels as K

    case = Case((20, 1, 7), (50, 33, 7), mode=mode, sinks=True, softcap=8.0)
    _skip_undeclared(impl, case.mode, case.options(), case.head_size, case.dtype)
    p = build(case, _device(impl), rng_for("staged", impl_name, mode))
    prob = _attention_problem(p, torch.full((28, case.num_q_heads), float("nan"), device=p.device))
    K.run(prob, impl.platform, prefill=K.staged_prefill_config(prob))
    ref_out, ref_lse = p.reference()
    MEASURED[impl_name, f"staged-{mode}"] = lse_error(prob.lse, ref_lse)
    assert lse_error(prob.lse, ref_lse) <= lse_tolerance(impl)
    assert out_error(prob.out, ref_out, p.qsl) <= impl.attention_rtol + OUT_ROUNDOFF[case.dtype]


@pytest.mark.parametrize("impl_name", _triton_impls())
def test_triton_split_kv_chosen_by_decode_config(impl_name):
    """A decode long enough for decode_config itself to split, through the public API."""
    impl = _impl(impl_name)
    from kvzoo.backends.triton import attention_kernels as K

    case = Case((1,), (2048 + 40,), block_size=64, sinks=True)
    _skip_undeclared(impl, case.mode, case.options(), case.head_size, case.dtype)
    p = build(case, _device(impl), rng_for("split-config", impl_name), spare_blocks=1)
    assert K.decode_config(_attention_problem(p, None), False, impl.platform).split_keys > 0
    out, lse = attend(p, impl, return_lse=True, lse=torch.full((1, case.num_q_heads), float("nan"), device=p.device))
    ref_out, ref_lse = p.reference()
    assert lse_error(lse, ref_lse) <= lse_tolerance(impl)
    assert out_error(out, ref_out, p.qsl) <= impl.attention_rtol + OUT_ROUNDOFF[case.dtype]


@pytest.mark.parametrize("impl_name", _triton_impls())
def test_triton_batch_invariant_lse_bits(impl_name):
    """batch_invariant: a sequence's lse bits do not depend on the rest of the batch."""
    impl = _impl(impl_name)
    case = Case((5, 1, 9, 1), (200, 150, 40, 20), batch_invariant=True, sinks=True)
    _skip_undeclared(impl, case.mode, case.options(), case.head_size, case.dtype)
    p = build(case, _device(impl), rng_for("invariant", impl_name))
    _, full = attend(p, impl, return_lse=True)
    for keep in ([1], [2], [3, 1]):
        rows = np.concatenate([np.arange(p.qsl[s], p.qsl[s + 1]) for s in keep])
        q_lens = [int(p.qsl[s + 1] - p.qsl[s]) for s in keep]
        qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        _, sub = attend(
            p,
            impl,
            query=p.query[torch.from_numpy(rows).to(p.device)].contiguous(),
            return_lse=True,
            block_tables=p.block_tables[keep],
            seq_lens=p.seq_lens[keep],
            qsl=qsl,
        )
        assert torch.equal(sub.view(torch.int32), full[torch.from_numpy(rows).to(p.device)].view(torch.int32)), keep


# ---------------------------------------------------------------------------------------------
# the API: lse is written only when asked, checked like out


@pytest.mark.parametrize("impl_name", IMPLS)
def test_without_return_lse_the_api_is_unchanged(impl_name):
    impl = _impl(impl_name)
    case = Case((1, 4), (9, 20))
    _skip_undeclared(impl, case.mode, set(), case.head_size, case.dtype)
    p = build(case, _device(impl), rng_for("unchanged", impl_name))
    got = attend(p, impl)
    assert torch.is_tensor(got) and got.shape == p.query.shape
    out = torch.empty_like(p.query)
    assert attend(p, impl, out=out) is out


def _cpu_case():
    p = build(Case((1, 4), (9, 20)), "cpu", rng_for("args"))
    return p, (p.query.shape[0], p.case.num_q_heads)


def test_lse_without_return_lse_is_refused():
    p, shape = _cpu_case()
    with pytest.raises(KVZooInputError, match="lse: given without return_lse=True"):
        attend(p, "numpy", lse=torch.empty(shape))


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda s: torch.empty(s[0], s[1] + 1), r"lse: expected shape \(5, 4\)"),
        (lambda s: torch.empty(s[0]), "lse: expected 2 dimensions"),
        (lambda s: torch.empty(s, dtype=torch.float16), "lse: expected dtype in \\['float32'\\]"),
        (lambda s: np.broadcast_to(np.zeros(1, np.float32), s), "lse: the NumPy array is read-only"),
        (lambda s: torch.zeros(1).expand(s), "lse: elements overlap one another"),
        (lambda s: [[0.0] * s[1]] * s[0], "lse: expected a torch.Tensor or numpy.ndarray"),
    ],
    ids=["shape", "ndim", "dtype", "read-only", "stride-0", "list"],
)
def test_bad_lse_arrays_are_refused(bad, match):
    p, shape = _cpu_case()
    with pytest.raises(KVZooInputError, match=match):
        attend(p, "numpy", return_lse=True, lse=bad(shape))


def test_lse_may_not_alias_out_or_what_the_call_reads():
    p, (T, H) = _cpu_case()
    out = torch.empty(p.query.shape, dtype=torch.float32)
    query = p.query.float()
    with pytest.raises(KVZooInputError, match="lse: shares memory with out|out: shares memory with lse"):
        attend(p, "numpy", query=query, out=out, return_lse=True, lse=out.view(-1)[: T * H].view(T, H))
    with pytest.raises(KVZooInputError, match="shares memory with query|query.*lse"):
        attend(p, "numpy", query=query, return_lse=True, lse=query.view(-1)[: T * H].view(T, H))


def test_an_implementation_not_declaring_return_lse_is_not_chosen_for_it():
    p, _ = _cpu_case()
    quiet = Implementation(
        "no-lse",
        "paged_attention",
        "any",
        frozenset({"int8_per_token_head"}),
        run=lambda prob: prob.out.fill(0.0),
        array_kind="numpy",
        capabilities=Capabilities(),
    )  # the default leaves opt-in options out
    assert "return_lse" not in quiet.capabilities.options
    attend(p, quiet)  # takes a call without lse
    with pytest.raises(NoImplementationError, match="no-lse: does not take return_lse"):
        attend(p, quiet, return_lse=True)
    prob = _attention_problem(p, torch.empty(p.query.shape[0], p.case.num_q_heads))
    assert "return_lse" in required(prob).options
    assert "return_lse" not in required(prob.replace(lse=None)).options


def test_zero_tokens_return_an_empty_lse():
    p, _ = _cpu_case()
    empty = p.query[:0]
    out, lse = attend(p, "numpy", query=empty, return_lse=True, qsl=np.zeros(3, np.int32))
    assert tuple(lse.shape) == (0, p.case.num_q_heads) and lse.dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# the plan


@pytest.mark.parametrize("impl_name", IMPLS)
def test_plan_attention_returns_the_functional_apis_lse(impl_name):
    impl = _impl(impl_name)
    if "int8_per_token_head" not in impl.modes:
        pytest.skip(f"{impl_name}: no int8_per_token_head")
    device = _device(impl)
    spec = kvzoo.CacheSpec(
        "int8_per_token_head",
        num_blocks=8,
        block_size=16,
        num_kv_heads=2,
        head_size=32,
        model_dtype="float32",
        device=device,
    )
    caches = spec.allocate()
    gen = torch.Generator().manual_seed(SEED % 2**31)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device)
    lens = torch.tensor([20, 5], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 1, 6], dtype=torch.int32, device=device)
    slots = torch.cat([torch.arange(20), torch.arange(32, 37)]).to(device)
    plan = kvzoo.plan_step(
        spec,
        num_q_heads=4,
        block_tables=tables,
        seq_lens=lens,
        query_start_loc=qsl,
        slot_mapping=slots,
        sinks=torch.randn(4, generator=gen).to(device),
        impl={"paged_attention": impl, "reshape_and_cache": "numpy" if device == "cpu" else None},
    )
    kv = torch.randn(25, 2, 32, generator=gen).to(device)
    plan.write(kv, kv.clone(), caches)
    query = torch.randn(6, 4, 32, generator=gen).to(device)
    out = plan.attention(query, caches)
    assert torch.is_tensor(out)
    given = torch.full((6, 4), float("nan"), device=device)
    out2, lse = plan.attention(query, caches, return_lse=True, lse=given)
    assert lse is given and torch.equal(out, out2)
    _, lse_alloc = plan.attention(query, caches, return_lse=True)
    want_out, want = kvzoo.paged_attention(
        query,
        caches.key_cache,
        caches.value_cache,
        mode=spec.mode,
        block_tables=tables,
        seq_lens=lens,
        query_start_loc=qsl,
        k_scale_cache=caches.k_scale_cache,
        v_scale_cache=caches.v_scale_cache,
        sinks=plan.sinks,
        impl=impl,
        return_lse=True,
    )
    assert torch.equal(lse, want) and torch.equal(lse_alloc, want) and torch.equal(out, want_out)
    with pytest.raises(KVZooInputError, match="lse: given without return_lse=True"):
        plan.attention(query, caches, lse=given)
    with pytest.raises(KVZooInputError, match="lse: shares memory with query"):
        plan.attention(query, caches, return_lse=True, lse=query.view(-1)[:24].view(6, 4))
    with pytest.raises(KVZooInputError, match="lse: expected dtype"):
        plan.attention(query, caches, return_lse=True, lse=torch.empty(6, 4, dtype=torch.float64, device=device))


def test_plan_with_an_implementation_lacking_return_lse_refuses_it():
    spec = kvzoo.CacheSpec(
        "int8_per_token_head",
        num_blocks=4,
        block_size=16,
        num_kv_heads=2,
        head_size=32,
        model_dtype="float32",
        device="cpu",
    )
    caches = spec.allocate()
    quiet = Implementation(
        "no-lse",
        "paged_attention",
        "any",
        frozenset({"int8_per_token_head"}),
        run=lambda prob: prob.out.fill(0.0),
        array_kind="numpy",
    )
    plan = kvzoo.plan_step(
        spec,
        num_q_heads=4,
        block_tables=torch.tensor([[0]], dtype=torch.int32),
        seq_lens=torch.tensor([3], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 3], dtype=torch.int32),
        impl=quiet,
    )
    query = torch.randn(3, 4, 32)
    assert torch.equal(plan.attention(query, caches), torch.zeros(3, 4, 32))
    with pytest.raises(NoImplementationError, match="does not take return_lse"):
        plan.attention(query, caches, return_lse=True)


# ---------------------------------------------------------------------------------------------
# merge_attention_states on its own


def _merge_f64(out_a, lse_a, out_b, lse_b):
    """The definition in float64 (finite lse on both sides)."""
    la, lb = np.asarray(lse_a, np.float64), np.asarray(lse_b, np.float64)
    m = np.maximum(la, lb)
    wa, wb = np.exp(la - m), np.exp(lb - m)
    out = wa[..., None] * np.asarray(out_a, np.float64) + wb[..., None] * np.asarray(out_b, np.float64)
    return out / (wa + wb)[..., None], m + np.log(wa + wb)


KINDS = ["numpy", "torch"] + (["cuda"] if CUDA else [])


def _as(kind, x):
    if kind == "numpy":
        return np.asarray(x)
    return torch.from_numpy(np.ascontiguousarray(x)).to("cuda" if kind == "cuda" else "cpu")


def _back(x) -> np.ndarray:
    return x.detach().cpu().float().numpy() if torch.is_tensor(x) else np.asarray(x, np.float32)


@pytest.mark.parametrize("kind", KINDS)
def test_merge_matches_the_definition_even_for_huge_lse(kind):
    rng = rng_for("merge-def", kind)
    out_a = rng.standard_normal((7, 3, 16)).astype(np.float32)
    out_b = rng.standard_normal((7, 3, 16)).astype(np.float32)
    # Spread over decades, with values whose exponentials overflow float32 (no max subtracted).
    lse_a = (rng.standard_normal((7, 3)) * 10.0 ** rng.integers(0, 5, (7, 3))).astype(np.float32)
    lse_b = (lse_a + rng.standard_normal((7, 3)) * 3).astype(np.float32)
    out, lse = kvzoo.merge_attention_states(_as(kind, out_a), _as(kind, lse_a), _as(kind, out_b), _as(kind, lse_b))
    want_out, want_lse = _merge_f64(out_a, lse_a, out_b, lse_b)
    np.testing.assert_allclose(_back(out), want_out, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(_back(lse), want_lse, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_merge_edge_cases(kind):
    inf, nan = np.float32(np.inf), np.float32(np.nan)
    # Rows: [b empty, a empty, both empty, a NaN lse, b NaN out (b weighted), a NaN out (a empty), a +inf]
    lse_a = np.array([1.5, -inf, -inf, nan, 0.0, -inf, inf], np.float32)[:, None]
    lse_b = np.array([-inf, 2.0, -inf, 0.0, 0.0, 1.0, 0.0], np.float32)[:, None]
    out_a = np.full((7, 1, 4), 3.0, np.float32)
    out_b = np.full((7, 1, 4), -1.0, np.float32)
    out_a[5] = nan  # the empty side's out is never read
    out_b[0] = nan
    out_b[4, 0, 2] = nan
    out, lse = kvzoo.merge_attention_states(_as(kind, out_a), _as(kind, lse_a), _as(kind, out_b), _as(kind, lse_b))
    out, lse = _back(out), _back(lse)[:, 0]
    np.testing.assert_array_equal(out[0], out_a[0])  # one side empty: the other, exactly
    assert lse[0] == lse_a[0, 0]
    np.testing.assert_array_equal(out[1], out_b[1])
    assert lse[1] == lse_b[1, 0]
    np.testing.assert_array_equal(out[2], 0.0)  # nothing attended on either side
    assert lse[2] == -inf
    assert np.isnan(out[3]).all() and np.isnan(lse[3])
    assert np.isnan(out[4, 0, 2]) and np.isfinite(np.delete(out[4, 0], 2)).all() and lse[4] == np.float32(np.log(2))
    np.testing.assert_array_equal(out[5], out_b[5])
    assert lse[5] == np.float32(1.0)
    assert np.isnan(out[6]).all() and np.isnan(lse[6])


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_merge_in_place_and_in_low_precision(kind):
    rng = rng_for("merge-inplace", kind)
    a32 = rng.standard_normal((5, 2, 8)).astype(np.float32)
    b32 = rng.standard_normal((5, 2, 8)).astype(np.float32)
    la = rng.standard_normal((5, 2)).astype(np.float32)
    lb = rng.standard_normal((5, 2)).astype(np.float32)
    if kind == "torch":
        a, b = torch.from_numpy(a32).bfloat16(), torch.from_numpy(b32).bfloat16()
        lse_a, lse_b = torch.from_numpy(la.copy()), torch.from_numpy(lb)
    else:
        a, b = (
            kvzoo.arrays.as_numpy(torch.from_numpy(a32).bfloat16()),
            kvzoo.arrays.as_numpy(torch.from_numpy(b32).bfloat16()),
        )
        lse_a, lse_b = la.copy(), lb
    want_out, want_lse = _merge_f64(_back(a), la, _back(b), lb)
    out, lse = kvzoo.merge_attention_states(a, lse_a, b, lse_b, out=a, lse_out=lse_a)
    assert out is a and lse is lse_a and kvzoo.arrays.dtype_name(out) == "bfloat16"
    np.testing.assert_allclose(_back(out), want_out, rtol=2**-8, atol=1e-6)
    np.testing.assert_allclose(_back(lse), want_lse, rtol=1e-6, atol=1e-6)


def test_merge_refuses_bad_arguments():
    out = torch.zeros(3, 2, 4)
    lse = torch.zeros(3, 2)
    m = kvzoo.merge_attention_states
    with pytest.raises(KVZooInputError, match="all four as torch tensors or all four as NumPy"):
        m(out, lse, out.numpy(), lse)
    with pytest.raises(KVZooInputError, match=r"out_b: expected shape \(3, 2, 4\)"):
        m(out, lse, torch.zeros(3, 2, 5), lse)
    with pytest.raises(KVZooInputError, match="out_b: expected dtype in \\['float32'\\]"):
        m(out, lse, out.half(), lse)
    with pytest.raises(KVZooInputError, match="lse_b: expected dtype in \\['float32'\\]"):
        m(out, lse, out, lse.double())
    with pytest.raises(KVZooInputError, match=r"lse_a: expected shape \(3, 2\)"):
        m(out, torch.zeros(2, 3), out, lse)
    with pytest.raises(KVZooInputError, match="out: expected dtype"):
        m(out, lse, out, lse, out=torch.zeros(3, 2, 4, dtype=torch.float16))
    with pytest.raises(KVZooInputError, match="lse_out: elements overlap"):
        m(out, lse, out, lse, lse_out=torch.zeros(1).expand(3, 2))
    buf = torch.zeros(3 * 2 * 4)
    with pytest.raises(KVZooInputError, match="lse_out: shares memory with out"):
        m(out, lse, out, lse, out=buf.view(3, 2, 4), lse_out=buf[:6].view(3, 2))


def test_merge_docstring_example_runs():
    import kvzoo.merge

    result = doctest.testmod(kvzoo.merge, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_oracle_lse_is_the_log_of_the_softmax_denominator():
    """attention_f64's lse against logsumexp written out per row, and the oracle's own halves
    merged in float64 against its whole: the reference the implementations are held to."""
    case = Case((1, 3), (20, 11), sinks=True, softcap=4.0)
    p = build(case, "cpu", rng_for("oracle-lse"))
    _, lse = p.reference()
    q = p.query.float().numpy().astype(np.float64)
    group = case.num_q_heads // case.num_kv_heads
    for s in range(2):
        n = int(p.seq_lens[s])
        keys = np.stack([p.k_deq[p.block_tables[s, i // 16], i % 16] for i in range(n)]).astype(np.float64)
        for j, t in enumerate(range(p.qsl[s], p.qsl[s + 1])):
            pos = n - (p.qsl[s + 1] - p.qsl[s]) + j
            for h in range(case.num_q_heads):
                logits = keys[: pos + 1, h // group] @ q[t, h] / math.sqrt(case.head_size)
                logits = 4.0 * np.tanh(logits / 4.0)
                terms = np.concatenate([logits, [p.sinks[h]]])
                want = terms.max() + math.log(np.exp(terms - terms.max()).sum())
                assert abs(lse[t, h] - want) <= 1e-12 * max(1.0, abs(want))
    # Decode row of sequence 0 split at 16 keys: the oracle's halves merge to its whole.
    whole_out, whole_lse = p.reference()
    a_out, a_lse = p.reference(seq_lens=np.array([16, 11], np.int32))
    tables_b = p.block_tables.copy()
    tables_b[0, 0] = p.block_tables[0, 1]
    b_out, b_lse = p.reference(block_tables=tables_b, seq_lens=np.array([4, 11], np.int32), sinks=False)
    m_out, m_lse = _merge_f64(a_out[:1], a_lse[:1], b_out[:1], b_lse[:1])
    np.testing.assert_allclose(m_out, whole_out[:1], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(m_lse, whole_lse[:1], rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# GPU: the Triton checks at engine sizes


def _reference_torch(p: Paged, query, tables, seq_lens, qsl, sinks) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention and lse from the definition, vectorized on the GPU (the oracle's loops
    are too slow at these sizes; the CPU tests hold the oracle itself)."""
    dev = query.device
    k_all = torch.from_numpy(p.k_deq).to(dev, torch.float64)
    v_all = torch.from_numpy(p.v_deq).to(dev, torch.float64)
    q_all = query.to(torch.float64)
    bs, group = p.case.block_size, p.case.num_q_heads // p.case.num_kv_heads
    out = torch.empty_like(q_all)
    lse = torch.empty(q_all.shape[:2], dtype=torch.float64, device=dev)
    for s in range(len(seq_lens)):
        q0, q1, n = int(qsl[s]), int(qsl[s + 1]), int(seq_lens[s])
        pos_k = torch.arange(n, device=dev)
        blk = torch.from_numpy(tables[s]).to(dev).long()[pos_k // bs]
        k = k_all[blk, pos_k % bs].repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = v_all[blk, pos_k % bs].repeat_interleave(group, dim=1)
        logits = torch.einsum("thd,khd->htk", q_all[q0:q1], k) / math.sqrt(p.case.head_size)
        if p.case.softcap is not None:
            logits = p.case.softcap * torch.tanh(logits / p.case.softcap)
        pos_q = n - (q1 - q0) + torch.arange(q1 - q0, device=dev)
        logits = logits.masked_fill(pos_k[None, None, :] > pos_q[None, :, None], -math.inf)
        if sinks is not None:
            sink = torch.from_numpy(sinks).to(dev, torch.float64)[:, None, None].expand(-1, q1 - q0, 1)
            logits = torch.cat([logits, sink], dim=2)
        row_lse = torch.logsumexp(logits, dim=2)  # [Hq, q]
        w = torch.exp(logits - row_lse[..., None])[..., :n]
        out[q0:q1] = torch.einsum("htk,khd->thd", w, v)
        lse[q0:q1] = row_lse.T
    return out, lse


def _engine_checks(impl: Implementation, case: Case, device: str, seed_key: str) -> None:
    """lse of a mixed batch against the vectorized reference; its decodes split in two halves
    of whole pages and merged; on CUDA the merge captured in a CUDA graph and replayed."""
    p = build(case, device, rng_for("engine", seed_key))
    tol = lse_tolerance(impl)
    lse_in = torch.full((p.query.shape[0], case.num_q_heads), float("nan"), device=device)
    out, lse = attend(p, impl, return_lse=True, lse=lse_in)
    ref_out, ref_lse = _reference_torch(p, p.query, p.block_tables, p.seq_lens, p.qsl, p.sinks)
    MEASURED[impl.name, f"engine-{seed_key}"] = lse_error(lse, ref_lse.cpu().numpy())
    assert lse_error(lse, ref_lse.cpu().numpy()) <= tol
    assert out_error(out, ref_out.cpu().numpy(), p.qsl) <= impl.attention_rtol + OUT_ROUNDOFF[case.dtype]
    dec = [s for s, n in enumerate(case.q_lens) if n == 1]
    bs = case.block_size
    cut = np.array([int(p.seq_lens[s]) // 2 // bs for s in dec])
    assert (cut > 0).all()
    tables_b = np.full_like(p.block_tables[dec], -1)
    for i, s in enumerate(dec):
        rest = p.block_tables[s, cut[i] :]
        tables_b[i, : len(rest)] = rest
    qsl = np.arange(len(dec) + 1, dtype=np.int32)
    rows = torch.from_numpy(p.qsl[dec].astype(np.int64)).to(device)
    query = p.query[rows].float().contiguous()
    sub = dict(query=query, qsl=qsl)
    a = attend(p, impl, return_lse=True, block_tables=p.block_tables[dec], seq_lens=(cut * bs).astype(np.int32), **sub)
    b = attend(
        p,
        impl,
        return_lse=True,
        block_tables=tables_b,
        seq_lens=(p.seq_lens[dec] - cut * bs).astype(np.int32),
        sinks=False,
        **sub,
    )
    merged_out, merged_lse = kvzoo.merge_attention_states(*a, *b)
    ref_out, ref_lse = _reference_torch(p, query, p.block_tables[dec], p.seq_lens[dec], qsl, p.sinks)
    assert lse_error(merged_lse, ref_lse.cpu().numpy()) <= tol
    assert out_error(merged_out, ref_out.cpu().numpy(), qsl) <= impl.attention_rtol
    if device != "cuda":
        return
    graph_out, graph_lse = torch.full_like(merged_out, float("nan")), torch.full_like(merged_lse, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kvzoo.merge_attention_states(*a, *b, out=graph_out, lse_out=graph_lse)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_out, merged_out) and torch.equal(graph_lse, merged_lse)


@pytest.mark.parametrize("impl_name", _triton_impls())
def test_engine_checks_at_interpreter_sizes(impl_name):
    """What the GPU test below runs, small enough for the Triton interpreter (and a check of
    its vectorized reference against the oracle)."""
    impl = _impl(impl_name)
    if "cuda" in impl.devices:
        pytest.skip("the GPU runs test_gpu_lse_and_merge_at_engine_sizes")
    case = Case(
        (1, 1, 40, 5), (300, 150, 40 + 64, 5), num_q_heads=8, num_kv_heads=2, head_size=64, sinks=True, softcap=30.0
    )
    _skip_undeclared(impl, case.mode, case.options(), case.head_size, case.dtype)
    p = build(case, "cpu", rng_for("engine", "reference"))
    want_out, want_lse = p.reference()
    got_out, got_lse = _reference_torch(p, p.query, p.block_tables, p.seq_lens, p.qsl, p.sinks)
    np.testing.assert_allclose(got_lse.numpy(), want_lse, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got_out.numpy(), want_out, rtol=1e-10, atol=1e-12)
    _engine_checks(impl, case, "cpu", f"interpreted-{impl_name}")


@gpu_only
@pytest.mark.parametrize("mode", ["int8_per_token_head", "fp8_per_token_head", "none"])
def test_gpu_lse_and_merge_at_engine_sizes(mode):
    """Long decodes (split-KV, by decode_config, in the merge's halves), a prefill chunk long
    enough to be staged (quantized modes), a short prefill; GQA 4, D 128, sinks and softcap."""
    impl = _impl("triton-cuda")
    case = Case(
        (1, 1, 1, 300, 17),
        (9000, 4100, 700, 300 + 1024, 17),
        mode=mode,
        num_q_heads=32,
        num_kv_heads=8,
        head_size=128,
        sinks=True,
        softcap=30.0,
    )
    _engine_checks(impl, case, "cuda", f"gpu-{mode}")


def test_report_measured_errors(capsys):
    """Not a check: prints the lse errors measured above (pytest -s shows them)."""
    with capsys.disabled():
        for (impl_name, case_name), err in sorted(MEASURED.items()):
            print(f"lse error {impl_name:12s} {case_name:28s} {err:.2e}")
