"""Helpers for tests/test_hostile_inputs.py: guarded buffers, hostile index views, the oracle.

Every array a hostile test hands to kvzoo is a view into a larger buffer of random bytes: a
guard region before and after, gaps between rows and heads. After a call the test compares
every byte of that buffer with its value before (raw bytes), so a kernel that reads or writes
past a view, into a gap, or through the wrong strides is caught. Expected results come from
kvzoo_spec/oracle.py only (never from another kvzoo implementation). What goes into the buffers
(batches, scattered block tables, realistic codes) and the attention reference and tolerance
are kvzoo.samples', shared with the conformance suite; the guards and views are this module's.

Torch tensors live where the implementation under test takes them (kvzoo.conformance's
device_for: "cuda" for a GPU backend, "cpu" otherwise). The bytes are always drawn on the host;
to_case_device places a buffer and to_host reads one back, and nothing else crosses between
host and device, so KVZOO_HOSTILE_FORCE_COPY=1 (below) exercises the GPU path's copies on a
CPU-only machine.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

import kvzoo
from kvzoo import KVZooInputError, registry, samples
from kvzoo.arrays import as_numpy, numpy_dtype, torch_dtype
from kvzoo.inputs import device_for
from kvzoo.modes import MODES, QuantMode
from kvzoo.samples import OUT_ROUNDOFF, Batch, assert_attention_close  # noqa: F401 (the battery's names)

from support import SEED, rng_for  # noqa: F401

OPS = ("reshape_and_cache", "dequantize", "paged_attention")
INDEX_DTYPES = ("int32", "int64")
_CARRIER = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_BOOL = "bool"


def np_dtype(name: str) -> np.dtype:
    if name == _BOOL:
        return np.dtype(np.bool_)
    return numpy_dtype(name)


def th_dtype(name: str) -> Any:
    return torch.bool if name == _BOOL else torch_dtype(name)


# ---------------------------------------------------------------------------------------------
# where a case's tensors live


# Test-only: on the CPU too, give the implementation copies of the host buffers and check
# through copies read back, as on a GPU. Without it a CPU run views the host bytes directly,
# and a check that forgot to read the device back would still pass here.
FORCE_COPY = os.environ.get("KVZOO_HOSTILE_FORCE_COPY", "0") not in ("", "0")

# Storages to_case_device made in this test (FORCE_COPY runs), by address; holding the tensors
# keeps an address from being reused by a tensor built some other way.
_PLACED: dict[int, Any] = {}


def case_device(impl: Any) -> str:
    """The device of every torch tensor of a case run against impl (None: no implementation)."""
    return "cpu" if impl is None else device_for(impl)


def to_case_device(t: Any, impl: Any) -> Any:
    """CPU tensor t where impl takes its tensors. The plain CPU run keeps t itself, so views of
    it stay views of the host bytes, as the battery always had them. Take views after placing:
    the copy of an expanded view is the whole tensor."""
    device = case_device(impl)
    if device == "cpu" and not FORCE_COPY:
        return t
    placed = t.to(device) if device != "cpu" else t.clone()
    if FORCE_COPY:
        _PLACED[placed.untyped_storage().data_ptr()] = placed
    return placed


def to_host(t: Any) -> np.ndarray:
    """Tensor t's values as a NumPy array on the host, for the byte comparisons. The plain CPU
    run gets a view of t's memory; elsewhere it is a copy, which writing to changes nothing."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    elif FORCE_COPY:
        t = t.clone()
    return as_numpy(t)


def case_tensor(x: Any, impl: Any) -> Any:
    """x (a NumPy array or a CPU tensor) as a tensor on impl's case device."""
    return to_case_device(torch.from_numpy(x) if isinstance(x, np.ndarray) else x, impl)


def case_array(x: np.ndarray, kind: str, impl: Any) -> Any:
    return case_tensor(x, impl) if kind == "torch" else x


def case_kind(kind: str, impl: Any) -> str:
    """The kind a case's arrays take for impl: "torch" where impl takes device tensors, for
    cases in which NumPy only varies the dtype or layout and a device tensor can carry it."""
    return "torch" if kind == "numpy" and case_device(impl) != "cpu" else kind


def placement_checked(fn: Callable) -> Callable:
    """fn, failing first (FORCE_COPY runs) if a tensor argument is not memory to_case_device
    made: built beside it, that tensor would stay on the CPU of a GPU machine."""

    @functools.wraps(fn)
    def checked(*args: Any, **kw: Any) -> Any:
        named = [*((f"argument {i}", x) for i, x in enumerate(args)), *kw.items()]
        stray = [
            name
            for name, x in named
            if isinstance(x, torch.Tensor) and x.device.type != "meta" and x.untyped_storage().data_ptr() not in _PLACED
        ]
        assert not stray, f"{fn.__name__}: tensors not placed through to_case_device: {stray}"
        return fn(*args, **kw)

    return checked


def forget_placed() -> None:
    _PLACED.clear()


# ---------------------------------------------------------------------------------------------
# implementations, as the conformance suite iterates them


def impls(op: str) -> list[Any]:
    return list(registry.implementations(op))


def impl_params(op: str) -> list[Any]:
    return [pytest.param(i, id=i.name) for i in impls(op)]


def require_usable(impl: Any, mode: str | None = None, *, kind: str = "torch") -> None:
    """Skip only where the implementation says it cannot run here, does not register the mode,
    or (kind "numpy") takes device tensors, which NumPy arrays are not."""
    reasons = impl.unavailable()
    if reasons:
        pytest.skip("; ".join(reasons))
    if mode is not None and mode not in impl.modes:
        pytest.skip(f"{impl.name} does not register mode {mode}")
    device = case_device(impl)
    if kind == "numpy" and device != "cpu":
        pytest.skip(f"numpy arrays are CPU memory; {impl.name} takes {device} tensors")


def impl_modes(impl: Any, candidates: Sequence[str]) -> list[str]:
    return [m for m in candidates if m in impl.modes]


def expected_decline(impl: Any, *, quantize_query: bool = False, head_size: int = 16) -> str | None:
    """Where the battery expects an implementation to decline a valid call through the registry.

    Numba does not implement quantize_query (README, SPEC 8.1: "NumPy and Triton implement it,
    Numba declines it"); the Triton attention tiles head sizes up to 256. Nothing else.
    """
    if quantize_query and impl.name == "numba":
        return "numba does not implement quantize_query (README)"
    if head_size > 256 and impl.name.startswith("triton"):
        return "the Triton attention tiles head sizes up to 256"
    return None


def _names_pattern(names: Sequence[str]) -> str:
    return "|".join(re.escape(n) for n in names)


@dataclass(frozen=True)
class Refusal:
    """What a refused call must raise: KVZooInputError whose message starts with one of
    `names` (the argument's name) and contains each of `words`."""

    names: Sequence[str]
    words: Sequence[str] = ()


def check_call(
    impl: Any,
    fn: Callable,
    *args: Any,
    refused: Refusal | None = None,
    guards: Sequence[Any] = (),
    decline_ok: str | None = None,
    **kw: Any,
) -> Any:
    """The battery's one checker: run fn(*args, impl=impl.name, **kw) (an entry point's
    adapter, or a case's call) and assert its outcome.

    refused given: KVZooInputError starting with one of refused.names, containing its words,
    every guarded byte (caches, out, buffers the call was given) unchanged, whatever happened.
    Otherwise accepted: a refusal fails, a registry decline skips only where expected
    (decline_ok), and the call must have reached `impl` itself through launches.run (or a call
    kvzoo found nothing to compute in): an entry point cannot pass by running nothing. Returns
    the call's result (the KVZooInputError for a refusal)."""
    if refused is not None:
        return _refused(impl, fn, refused, guards, *args, **kw)
    LAUNCHED.clear()
    try:
        result = fn(*args, impl=impl.name, **kw)
    except registry.NoImplementationError as e:
        if decline_ok:
            pytest.skip(f"expected decline ({decline_ok}): {e}")
        pytest.fail(f"{impl.name} declined a call the spec defines (NoImplementationError): {e}")
    except KVZooInputError as e:
        pytest.fail(f"{impl.name}: a call the spec accepts was refused: {e}")
    op = getattr(impl, "op", None)
    if op is not None:
        mine = [name for o, name in LAUNCHED if o == op]
        assert mine, f"{impl.name}: the call never reached launches.run for {op}"
        assert all(name in (impl.name, None) for name in mine), f"{op} ran {mine}, not {impl.name}"
    changed = [g.label for g in guards if not g.unchanged()]
    assert not changed, f"{impl.name}: read arrays changed: {changed}"
    return result


def _refused(impl: Any, fn: Callable, refused: Refusal, guards: Sequence[Any], *args: Any, **kw: Any):
    names, words = refused.names, refused.words
    _ENTERED.clear()
    outcome = None
    error = None
    try:
        fn(*args, impl=impl.name, **kw)
        outcome = f"accepted; expected KVZooInputError starting with one of {list(names)}"
    except registry.NoImplementationError as e:
        outcome = f"declined through the registry instead of refusing the argument: {e}"
    except KVZooInputError as e:
        error = e
        msg = str(e)
        if not re.match(rf"({_names_pattern(names)})\b", msg):
            outcome = f"KVZooInputError does not start with the argument's name {list(names)}: {msg!r}"
        else:
            missing = [w for w in words if w.lower() not in msg.lower()]
            if missing:
                outcome = f"message {msg!r} lacks {missing}"
    except Exception as e:  # noqa: BLE001 - any other exception is the defect being reported
        outcome = f"raised {type(e).__name__} instead of KVZooInputError: {e}"
    changed = [g.label for g in guards if not g.unchanged()]
    problems = ([outcome] if outcome else []) + ([f"bytes changed in {changed}"] if changed else [])
    if problems:
        pytest.fail(f"{impl.name}: " + "; ".join(problems))
    entered = sorted(set(_ENTERED))
    twin = _functional_message(impl, fn, *args, **kw)
    if twin is not None and twin != str(error):
        pytest.fail(f"{impl.name}: {entered} refused with {str(error)!r}, the functional API with {twin!r}")
    return error


def _functional_message(impl: Any, fn: Callable, *args: Any, **kw: Any) -> str | None:
    """The message of the same refused call through the functional API (None where the call
    took no other entry). Run after the refusal's checks: the call changed no byte, so its
    replay meets the same arrays."""
    if all(e == "functional" for e in _ENTERED):
        return None
    _TWIN.append("functional")
    try:
        fn(*args, impl=impl.name, **kw)
    except KVZooInputError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - reported as the functional API's outcome
        return f"<{type(e).__name__}: {e}>"
    finally:
        _TWIN.pop()
    return "<accepted>"


def call_accepted(impl: Any, fn: Callable, *args: Any, decline_ok: str | None = None, **kw: Any) -> Any:
    """Run a call the spec accepts (check_call)."""
    return check_call(impl, fn, *args, decline_ok=decline_ok, **kw)


def call_refused(
    impl: Any,
    fn: Callable,
    names: Sequence[str],
    guards: Sequence[Any],
    *args: Any,
    words: Sequence[str] = (),
    **kw: Any,
) -> KVZooInputError:
    """Run a call the spec refuses (check_call with a Refusal)."""
    return check_call(impl, fn, *args, refused=Refusal(names, words), guards=guards, **kw)


# ---------------------------------------------------------------------------------------------
# entry points: one adapter per way a user reaches an operation
#
# A case describes its call once, as the functional API's arguments (kvzoo.reshape_and_cache,
# kvzoo.paged_attention, kvzoo.dequantize: positional arrays, mode=, impl=, validate=, ...).
# via(entry, op) is a function of that same signature which reaches the operation through
# `entry`; the checker below (check_call) asserts the outcome whatever the entry.

# Per operation, the entry points a user reaches it through. "unvalidated" is the functional
# API with validate=False (the kernels alone must honour what the metadata tier refuses). No
# plan or torch op decodes a cache: dequantize has the functional API and PagedKVCache.read.
ENTRY_POINTS = {
    "reshape_and_cache": ("functional", "unvalidated", "plan", "torch_op", "cache"),
    "paged_attention": ("functional", "unvalidated", "plan", "torch_op", "cache"),
    "dequantize": ("functional", "unvalidated", "cache"),
}

# Why an entry point cannot carry a kind of case (skipped at collection, with the reason).
NOT_THROUGH = {
    ("torch_op", "numpy"): "torch ops take torch tensors only (the op's schema), not NumPy arrays",
    ("cache", "caches"): (
        "PagedKVCache passes its own caches and mode (test_paged_kv_cache_refuses_what_it_passes_itself)"
    ),
    ("unvalidated", "validate"): "the case is about what validate=True reads (the functional entry runs it)",
    ("unvalidated", "unvalidated"): "the case runs with validate=False already (the functional entry)",
    ("plan", "static-array"): "a plan does not read a static scale array's value (kvzoo/plan.py)",
    ("unvalidated", "static-array"): "validate=False does not read a static scale array's value (SPEC 11)",
    ("torch_op", "all-meta"): "every tensor on meta is a trace to torch ops (kvzoo/torch_ops.py _refuse_real_call)",
    ("plan", "all-meta"): (
        "a plan takes the step's index arrays (plan_step) before a layer's, so with every tensor on meta it names "
        "slot_mapping or seq_lens where the functional API names key or query, the first of its arguments"
    ),
    ("plan", "zero-size"): (
        "a plan's sizes are its CacheSpec's and num_q_heads plan_step's, refused by those names before any array "
        "(test_plan.test_cache_spec_refuses_bad_fields)"
    ),
}


# Where an entry point fails a case the functional API passes (a defect found, not fixed yet):
# collected as xfail(strict=True), so the fix turns into an XPASS that fails the run until the
# entry is struck from here.
KNOWN_DEFECTS: dict[tuple[str, str], str] = {}


def entry_reason(entry: str, traits: Sequence[str]) -> str | None:
    for trait in traits:
        reason = NOT_THROUGH.get((entry, trait))
        if reason:
            return reason
    return None


def entry_marks(entry: str, traits: Sequence[str]) -> list[Any]:
    """A skip (the entry cannot take the case) or a strict xfail (a known defect), with why."""
    reason = entry_reason(entry, traits)
    if reason:
        return [pytest.mark.skip(reason=f"{entry}: {reason}")]
    defects = [KNOWN_DEFECTS[(entry, t)] for t in traits if (entry, t) in KNOWN_DEFECTS]
    return [pytest.mark.xfail(strict=True, reason=f"{entry}: {defects[0]}")] if defects else []


def with_entries(op: str, cases: Sequence[Any], traits: Callable[[Any], Sequence[str]] = lambda c: (), ids=None):
    """pytest params (case..., entry) for every case through every entry point of op; an entry
    that cannot carry a case is collected as a skip saying why. A case that is a tuple spreads
    over several argument names."""
    params = []
    for case in cases:
        values = case if isinstance(case, tuple) else (case,)
        case_id = ids(case) if ids else "-".join(str(v) for v in values)
        for entry in ENTRY_POINTS[op]:
            marks = entry_marks(entry, traits(case))
            params.append(pytest.param(*values, entry, id=f"{case_id}-{entry}", marks=marks))
    return params


def entries(op: str, *traits: str) -> list[Any]:
    """pytest params of the entry points of op for a case of these traits."""
    return [pytest.param(entry, id=entry, marks=entry_marks(entry, traits)) for entry in ENTRY_POINTS[op]]


def via(entry: str, op: str) -> Callable:
    """op's functional signature, reaching the operation through `entry` (or through the entry
    `functional_twin` names while it runs: a case's own call, replayed)."""

    def call(*args: Any, **kw: Any) -> Any:
        taken = _TWIN[-1] if _TWIN else entry
        _ENTERED.append(taken)
        return _ADAPTERS[taken](op, *args, **kw)

    return call


# The entries a call reached (via appends), and the entry a replay forces: _refused replays a
# refused call through the functional API to compare the two messages byte for byte, which
# needs the case's own call (built once, around via) rather than a second copy of every case.
_ENTERED: list[str] = []
_TWIN: list[str] = []


def _functional(op: str, *args: Any, **kw: Any) -> Any:
    return getattr(kvzoo, op)(*args, **kw)


def _unvalidated(op: str, *args: Any, validate: bool = True, **kw: Any) -> Any:
    return getattr(kvzoo, op)(*args, validate=False, **kw)


def _torch_op(op: str, *args: Any, mode: Any, **kw: Any) -> Any:
    """torch.ops.kvzoo.<op> through kvzoo.torch_ops' wrappers (keyword arguments, float scales)."""
    from kvzoo import torch_ops

    assert op in ("reshape_and_cache", "paged_attention"), op
    return getattr(torch_ops, op)(*args, kv_cache_dtype=mode, **kw)


def _paged_cache(mode: Any, kc: Any, vc: Any, ksc: Any, vsc: Any, ks: Any, vs: Any) -> Any:
    """A PagedKVCache whose tensors are the case's (guarded) caches: the object as its
    constructor leaves it, holding these arrays instead of fresh zeros, so its methods' calls
    meet the same byte checks."""
    from kvzoo.layout import KVCacheTensors
    from kvzoo.modes import get_kv_quant_mode

    cache = object.__new__(kvzoo.PagedKVCache)
    cache.mode = get_kv_quant_mode(mode)
    cache.tensors = KVCacheTensors(kc, vc, ksc, vsc)
    cache.layout = "separate"
    cache.k_scale, cache.v_scale = ks, vs
    return cache


def _cache(op: str, *args: Any, mode: Any, **kw: Any) -> Any:
    scales = [kw.pop(n, None) for n in ("k_scale_cache", "v_scale_cache", "k_scale", "v_scale")]
    if op == "reshape_and_cache":
        key, value, kc, vc, slots = args
        return _paged_cache(mode, kc, vc, *scales).write(key, value, slots, **kw)
    if op == "paged_attention":
        query, kc, vc = args
        return _paged_cache(mode, kc, vc, *scales).attention(query, **kw)
    cache, scale_cache = (*args, None)[:2]
    scale = kw.pop("scale", None)
    return _paged_cache(mode, cache, cache, scale_cache, scale_cache, scale, scale).read("key", **kw)


def _spec(mode: Any, caches: Sequence[Any], rows: Sequence[Any], impl: Any, rounding: str = "nearest") -> Any:
    """The CacheSpec an engine would declare for these caches: their geometry, the rows'
    model dtype (mode none: the cache's), the device the implementation runs on (None for
    NumPy caches). A size the arrays lack stays what the arrays say (0 is refused by name)."""
    from kvzoo.arrays import dtype_name
    from kvzoo.modes import get_kv_quant_mode
    from kvzoo.validate import FLOAT_INPUTS

    def dtype_of(x: Any) -> str | None:
        try:
            name = dtype_name(x)
        except Exception:  # noqa: BLE001 - not an array kvzoo knows: another candidate
            return None
        return name if name in FLOAT_INPUTS else None

    shape = next(tuple(c.shape) for c in caches if len(getattr(c, "shape", ())) == 4)
    head = next((int(r.shape[-1]) for r in rows if len(getattr(r, "shape", ())) == 3), None)
    try:
        m = get_kv_quant_mode(mode)
    except KVZooInputError:
        m = None  # CacheSpec refuses the mode by name
    if head is None:
        head = shape[3] * (2 if m is not None and m.cache_width(2) == 1 else 1)
    candidates = [*caches, *rows] if m is not None and m.code_dtype is None else rows
    model = next((d for d in map(dtype_of, candidates) if d is not None), "bfloat16")
    numpy_caches = all(isinstance(c, np.ndarray) for c in caches)
    device = None if numpy_caches else case_device(_named(impl))
    return kvzoo.CacheSpec(
        mode,
        num_blocks=shape[0],
        block_size=shape[1],
        num_kv_heads=shape[2],
        head_size=head,
        model_dtype=model,
        device=device,
        rounding=rounding,
    )


def _named(impl: Any) -> Any:
    """The registered implementation of this name (either operation's: they share devices)."""
    if not isinstance(impl, str):
        return impl
    return next(i for i in registry.implementations() if i.name == impl)


def _zeros_like_index(like: Any, shape: tuple[int, ...]) -> Any:
    if isinstance(like, torch.Tensor) and like.device.type != "meta":
        return torch.zeros(shape, dtype=torch.int32, device=like.device)
    if isinstance(like, np.ndarray):
        return np.zeros(shape, np.int32)
    return None


def _plan(op: str, *args: Any, mode: Any, impl: Any, validate: bool = True, **kw: Any) -> Any:
    """kvzoo.plan_step on the case's metadata (CacheSpec from its caches), then the layer's
    StepPlan.write / StepPlan.attention with the case's arrays as a KVCacheTensors."""
    from kvzoo.layout import KVCacheTensors

    scales = [kw.pop(n, None) for n in ("k_scale_cache", "v_scale_cache")]
    statics = {n: kw.pop(n, None) for n in ("k_scale", "v_scale")}
    if op == "reshape_and_cache":
        key, value, kc, vc, slots = args
        spec = _spec(mode, (kc, vc), (key, value), impl, kw.pop("rounding", "nearest"))
        assert not kw, kw
        # A plan that only writes still names a batch to attend: an empty one beside the slots
        # (of their kind and device; the spec's where they have none: a list, meta tensors).
        if _zeros_like_index(slots, (1,)) is not None:
            z = functools.partial(_zeros_like_index, slots)
        else:
            z = _spec_zeros(spec)
        plan = kvzoo.plan_step(
            spec,
            block_tables=z((1, 1)),
            seq_lens=z((1,)),
            query_start_loc=z((2,)),
            slot_mapping=slots,
            num_q_heads=spec.num_kv_heads,
            validate=validate,
            impl=impl,
        )
        _check_plan_impl(plan.write_impl, impl)
        return plan.write(key, value, KVCacheTensors(kc, vc, *scales), **statics)
    query, kc, vc = args
    spec = _spec(mode, (kc, vc), (query, kw.get("out")), impl)
    layer = {n: kw.pop(n) for n in ("out", "return_lse", "lse") if n in kw}
    plan = kvzoo.plan_step(spec, num_q_heads=int(query.shape[1]), validate=validate, impl=impl, **kw)
    _check_plan_impl(plan.attention_impl, impl)
    return plan.attention(query, KVCacheTensors(kc, vc, *scales), **layer, **statics)


def _spec_zeros(spec: Any) -> Callable:
    device = spec.device
    if device is None:
        return lambda shape: np.zeros(shape, np.int32)
    return lambda shape: torch.zeros(shape, dtype=torch.int32, device=device)


def _check_plan_impl(chosen: Any, impl: Any) -> None:
    name = impl if isinstance(impl, str) else getattr(impl, "name", None)
    assert chosen is not None and chosen.name == name, f"the plan chose {chosen} for impl={name!r}"


_ADAPTERS = {
    "functional": _functional,
    "unvalidated": _unvalidated,
    "plan": _plan,
    "torch_op": _torch_op,
    "cache": _cache,
}


# What launches.run (the path of every entry point) resolved each call to: (op, the
# implementation's name), or (op, None) for a call with nothing to compute. Filled by
# spy_launches (an autouse fixture of the battery); check_call reads it.
LAUNCHED: list[tuple[str, str | None]] = []


def spy_launches(monkeypatch: Any) -> None:
    from kvzoo import launches

    real = launches.run

    def run(record: Any, *args: Any, **kw: Any) -> Any:
        result = real(record, *args, **kw)
        entry = result[2]
        chosen = None if entry is None else (entry.chosen or entry.held())
        LAUNCHED.append((record.OP, None if chosen is None else chosen.name))
        return result

    monkeypatch.setattr(launches, "run", run)
    LAUNCHED.clear()


# ---------------------------------------------------------------------------------------------
# guarded buffers


class Region:
    """A view of `shape` into a buffer of random bytes (guards before/after, gaps between rows).

    `array` is what the test passes (NumPy view or torch view of the buffer); `index` maps
    every element of the view to its element index in the buffer, so the test reads and
    compares bytes without going through kvzoo. The bytes are drawn on the host (`host`);
    `memory` is the buffer the views are taken of: `host` itself for NumPy views and the plain
    CPU run, else its copy on impl's case device. Checks read it through now().
    """

    parent: Region | None = None

    def __init__(
        self,
        rng: np.random.Generator,
        shape: Sequence[int],
        dtype: str,
        kind: str,
        *,
        impl: Any,
        label: str = "",
        gaps: bool = True,
        steps: Sequence[int] | None = None,
        flip: Sequence[int] = (),
        guard: int = 8,
        align: int = 1,
    ):
        """impl: the implementation under test, which decides the device (None: the host).
        align: every stride, the view's first element and the guards are multiples of
        `align` elements (the inline page needs its float32 scales 4-byte aligned)."""
        shape = tuple(int(s) for s in shape)
        nd = len(shape)
        self.label, self.dtype, self.kind, self.shape = label, dtype, kind, shape
        self.np_dtype = np_dtype(dtype)
        self.itemsize = self.np_dtype.itemsize
        steps = list(steps) if steps is not None else [1] * nd
        pads = [int(rng.integers(1, 3)) if gaps else 0 for _ in range(nd)]
        if gaps and nd:
            pads[-1] = int(rng.integers(1, 4)) * align
        padded = [max(1, n * s + p) for n, s, p in zip(shape, steps, pads)]
        if nd and align > 1:
            padded[-1] = -(-padded[-1] // align) * align
        starts = [int(rng.integers(0, p + 1)) for p in pads]
        if nd and align > 1:
            starts[-1] = starts[-1] // align * align
        lo = (int(rng.integers(1, guard + 1)) if gaps else guard) * align
        hi = (int(rng.integers(1, guard + 1)) if gaps else guard) * align
        body = int(np.prod(padded))
        total = lo + body + hi
        self.host = rng.integers(0, 256, total * self.itemsize, dtype=np.uint8)
        self.impl = impl
        sl = tuple(slice(a, a + n * s, s) for a, n, s in zip(starts, shape, steps))
        index = np.arange(lo, lo + body, dtype=np.int64).reshape(padded)[sl]
        flips = tuple(slice(None, None, -1) if d in flip else slice(None) for d in range(nd))
        self.index = index[flips]
        if kind == "numpy":
            self.memory, self.copied = self.host, False
            typed = self.host.view(self.np_dtype)
            view = typed[lo : lo + body].reshape(padded)[sl][flips]
        else:
            assert not flip, "torch has no negative strides"
            staged = torch.from_numpy(self.host)
            self.memory = to_case_device(staged, impl)
            self.copied = self.memory is not staged
            typed_t = self.memory.view(th_dtype(dtype))
            view = typed_t[lo : lo + body].reshape(padded)[sl]
        self.array = view
        self.before = self.host.copy()

    def sub(self, label: str, array: Any, index: np.ndarray, dtype: str) -> Region:
        """Another view of this region's buffer: `index` counts elements of `dtype` in it."""
        r = Region.__new__(Region)
        r.label, r.dtype, r.kind, r.shape = label, dtype, self.kind, tuple(index.shape)
        r.np_dtype = np_dtype(dtype)
        r.itemsize = r.np_dtype.itemsize
        r.host, r.memory, r.copied, r.impl = self.host, self.memory, self.copied, self.impl
        r.index, r.array, r.parent = index, array, self.root
        return r

    @property
    def root(self) -> Region:
        return self.parent.root if self.parent is not None else self

    @property
    def before(self) -> np.ndarray:
        return self.root._before

    @before.setter
    def before(self, value: np.ndarray) -> None:
        self.root._before = value

    # -- contents
    def now(self) -> np.ndarray:
        """The buffer's bytes as they are now, on the host (the host buffer itself where the
        views are of it, else a copy read back)."""
        return to_host(self.memory) if self.copied else self.host

    def set_values(self, values: np.ndarray) -> None:
        """Store values (of this dtype, or raw uint8 bytes per element) in the view's elements."""
        values = np.asarray(values)
        raw = self.now()
        carrier = raw.view(_CARRIER[self.itemsize]) if self.dtype != _BOOL else raw.view(np.uint8)
        if values.dtype != self.np_dtype and values.dtype == np.uint8 and self.itemsize == 1:
            carrier[self.index] = values
        else:
            carrier[self.index] = np.ascontiguousarray(values.astype(self.np_dtype)).view(carrier.dtype)
        if self.copied:  # raw was a copy: the views see nothing until it is written back
            self.memory.copy_(to_case_device(torch.from_numpy(raw), self.impl))
        self.before = raw.copy()

    def values(self, which: str = "now") -> np.ndarray:
        buf = self.now() if which == "now" else self.before
        return buf.view(self.np_dtype)[self.index]

    def element_bytes(self, which: str = "now") -> np.ndarray:
        buf = self.now() if which == "now" else self.before
        raw = buf.view(_CARRIER[self.itemsize])[self.index]
        return raw.view(np.uint8).reshape(*self.shape, self.itemsize)

    def footprint(self) -> np.ndarray:
        mask = np.zeros(self.host.size, dtype=bool)
        starts = self.index.reshape(-1) * self.itemsize
        for b in range(self.itemsize):
            mask[starts + b] = True
        return mask

    # -- checks
    def unchanged(self) -> bool:
        return bool(np.array_equal(self.now(), self.before))

    def assert_unchanged(self, what: str) -> None:
        now = self.now()
        assert np.array_equal(now, self.before), f"{what}: {self.label} changed ({_diff_report(now, self.before)})"

    def assert_outside_unchanged(self, what: str, others: Sequence[Region] = (), only_others: bool = False) -> None:
        """Bytes outside this view (and `others`, views of the same buffer) unchanged;
        only_others: outside `others` only (this view is a read array: its bytes stay too)."""
        inside = np.zeros(self.host.size, dtype=bool) if only_others else self.footprint()
        for o in others:
            if o.root is self.root:
                inside |= o.footprint()
        bad = ~inside & (self.now() != self.before)
        assert not bad.any(), (
            f"{what}: {int(bad.sum())} bytes of {self.label}'s buffer outside the view changed "
            f"(first at byte {int(np.argmax(bad))} of {self.host.size}; guard/gaps written)"
        )


def _diff_report(a: np.ndarray, b: np.ndarray) -> str:
    d = np.flatnonzero(a != b)
    return f"{d.size} bytes differ, first at {d[:5].tolist()}"


@dataclass
class Guard:
    """Byte snapshot of any array's memory (a whole torch/NumPy buffer), for refusals; a
    tensor is read back (to_host) at every check."""

    label: str
    buf: Any  # a contiguous np.ndarray or torch.Tensor
    before: np.ndarray = field(init=False)

    def now(self) -> np.ndarray:
        host = to_host(self.buf) if isinstance(self.buf, torch.Tensor) else self.buf
        return host.reshape(-1).view(np.uint8)

    def __post_init__(self):
        self.before = self.now().copy()

    def unchanged(self) -> bool:
        return bool(np.array_equal(self.now(), self.before))


def guard_of(label: str, x: Any) -> Guard:
    """A snapshot of the whole storage behind x (torch tensor or NumPy array)."""
    if isinstance(x, Region):
        g = Guard(label, x.memory)
        g.before = x.before.copy()
        return g
    if isinstance(x, torch.Tensor):
        st = x.untyped_storage()
        flat = torch.empty(0, dtype=torch.uint8, device=x.device).set_(st, 0, (st.nbytes(),), (1,))
        return Guard(label, flat)
    base = x
    while isinstance(base, np.ndarray) and base.base is not None and isinstance(base.base, np.ndarray):
        base = base.base
    raw = np.ndarray(base.nbytes, np.uint8, buffer=base) if base.flags.c_contiguous else np.asarray(base).view(np.uint8)
    return Guard(label, raw.reshape(-1))


# ---------------------------------------------------------------------------------------------
# hostile index views


ONE_D_LAYOUTS = ("contiguous", "offset", "stride2", "stride3", "negative", "expand")
TWO_D_LAYOUTS = (
    "contiguous",
    "offset",
    "stride2",
    "fortran",
    "fortran-offset",
    "colstride",
    "negative",
    "negative-rows",
    "expand-rows",
    "expand-cols",
)


def layout_fits(layout: str, values: np.ndarray) -> bool:
    """Whether values can be shown in this layout (stride 0 needs equal values along it)."""
    v = np.asarray(values)
    if layout == "expand":
        return v.size == 0 or bool((v == v.reshape(-1)[0]).all())
    if layout == "expand-rows":
        return v.shape[0] == 0 or bool((v == v[:1]).all())
    if layout == "expand-cols":
        return v.shape[1] == 0 or bool((v == v[:, :1]).all())
    return True


def index_view(
    values: np.ndarray,
    dtype: str,
    kind: str,
    layout: str,
    rng: np.random.Generator,
    junk: Callable[[tuple[int, ...]], np.ndarray] | None = None,
    *,
    impl: Any,
) -> tuple[Any, Guard]:
    """`values` (1-D or 2-D) as an array of `dtype` in a hostile layout (a tensor on impl's
    case device), plus a guard of its buffer. Elements of the buffer outside the view hold
    `junk` (plausible wrong values), so a kernel that reads the view as contiguous reads wrong
    indices."""
    values = np.asarray(values)
    dt = np_dtype(dtype)
    junk = junk or (lambda shape: rng.integers(0, 3, shape))

    def fill(shape):
        with np.errstate(all="ignore"):
            return np.asarray(junk(shape)).astype(dt)

    def cast(v):
        with np.errstate(all="ignore"):
            return np.asarray(v).astype(dt)

    if kind == "torch" and layout.startswith("negative"):
        raise ValueError("torch tensors have no negative strides")
    if values.ndim == 1:
        n = values.shape[0]
        if layout == "contiguous":
            buf = cast(values).copy()
            view = lambda b: b  # noqa: E731
        elif layout == "offset":
            buf = fill((n + 7,))
            buf[3 : 3 + n] = cast(values)
            view = lambda b: b[3 : 3 + n]  # noqa: E731
        elif layout in ("stride2", "stride3"):
            k = int(layout[-1])
            buf = fill((k * n + 3,))
            buf[1 : 1 + k * n : k] = cast(values)
            view = lambda b: b[1 : 1 + k * n : k]  # noqa: E731
        elif layout == "negative":
            buf = fill((2 * n + 3,))
            buf[1 : 1 + 2 * n : 2] = cast(values[::-1])
            view = lambda b: b[1 : 1 + 2 * n : 2][::-1]  # noqa: E731
        elif layout == "expand":
            assert layout_fits(layout, values)
            buf = fill((3,))
            buf[1] = cast(values[:1])[0] if n else buf[1]
            if kind == "torch":
                view = lambda b: b[1:2].expand(n)  # noqa: E731
            else:
                view = lambda b: np.broadcast_to(b[1:2], (n,))  # noqa: E731
        else:
            raise ValueError(layout)
    else:
        r, c = values.shape
        if layout == "contiguous":
            buf = cast(values).copy()
            view = lambda b: b  # noqa: E731
        elif layout == "offset":
            buf = fill((r + 3, c + 4))
            buf[1 : 1 + r, 2 : 2 + c] = cast(values)
            view = lambda b: b[1 : 1 + r, 2 : 2 + c]  # noqa: E731
        elif layout == "stride2":
            buf = fill((2 * r + 1, 2 * c + 1))
            buf[1 : 1 + 2 * r : 2, 0 : 2 * c : 2] = cast(values)
            view = lambda b: b[1 : 1 + 2 * r : 2, 0 : 2 * c : 2]  # noqa: E731
        elif layout == "fortran":
            buf = cast(values.T).copy()
            view = lambda b: b.T  # noqa: E731
        elif layout == "fortran-offset":
            buf = fill((c + 2, r + 3))
            buf[1 : 1 + c, 2 : 2 + r] = cast(values.T)
            view = lambda b: b[1 : 1 + c, 2 : 2 + r].T  # noqa: E731
        elif layout == "colstride":
            buf = fill((r, 3 * c + 1))
            buf[:, 1 : 1 + 3 * c : 3] = cast(values)
            view = lambda b: b[:, 1 : 1 + 3 * c : 3]  # noqa: E731
        elif layout == "negative":
            buf = fill((2 * r + 2, 2 * c + 2))
            buf[1 : 1 + 2 * r : 2, 1 : 1 + 2 * c : 2] = cast(values[::-1, ::-1])
            view = lambda b: b[1 : 1 + 2 * r : 2, 1 : 1 + 2 * c : 2][::-1, ::-1]  # noqa: E731
        elif layout == "negative-rows":  # np.flipud: rows backwards, each row contiguous
            buf = fill((r + 2, c))
            buf[1 : 1 + r] = cast(values[::-1])
            view = lambda b: b[1 : 1 + r][::-1]  # noqa: E731
        elif layout == "expand-rows":
            assert layout_fits(layout, values)
            buf = fill((c + 2,))
            if r:
                buf[1 : 1 + c] = cast(values[0])
            if kind == "torch":
                view = lambda b: b[1 : 1 + c].expand(r, c)  # noqa: E731
            else:
                view = lambda b: np.broadcast_to(b[1 : 1 + c], (r, c))  # noqa: E731
        elif layout == "expand-cols":
            assert layout_fits(layout, values)
            buf = fill((r + 2, 1))
            if c:
                buf[1 : 1 + r, 0] = cast(values[:, 0])
            if kind == "torch":
                view = lambda b: b[1 : 1 + r].expand(r, c)  # noqa: E731
            else:
                view = lambda b: np.broadcast_to(b[1 : 1 + r], (r, c))  # noqa: E731
        else:
            raise ValueError(layout)
    buf = np.ascontiguousarray(buf)
    if kind == "torch":
        memory = to_case_device(torch.from_numpy(buf), impl)
        guard = Guard(f"index buffer ({layout})", memory)
        arr = view(memory)
        got = to_host(arr)
    else:
        guard = Guard(f"index buffer ({layout})", buf)
        arr = view(buf)
        got = np.asarray(arr)
    assert got.shape == values.shape and np.array_equal(got, cast(values)), "index_view built wrong values"
    return arr, guard


def layouts_for(kind: str, ndim: int) -> tuple[str, ...]:
    names = ONE_D_LAYOUTS if ndim == 1 else TWO_D_LAYOUTS
    return tuple(n for n in names if not (kind == "torch" and n.startswith("negative")))


# ---------------------------------------------------------------------------------------------
# realistic cache contents (for attention) and the oracle's view of them


def static_scale(rng: np.random.Generator, mode_name: str | None = None) -> float:
    return samples.unit_static_scale(rng, None if mode_name is None else MODES[mode_name])


def cache_dtype(mode_name: str | QuantMode, model_dtype: str, storage: str = "code") -> str:
    """The dtype of a cache of the mode (of one side's mode, for a split one)."""
    mode = MODES[mode_name] if isinstance(mode_name, str) else mode_name
    if mode.code_dtype is None:
        return model_dtype
    return "uint8" if storage == "uint8" else mode.code_dtype


@dataclass
class Caches:
    """Guarded key/value caches (and scale caches) in one mode."""

    mode: str
    key: Region
    value: Region
    k_scale: Region | None
    v_scale: Region | None
    k_static: float | None = None
    v_static: float | None = None

    @property
    def regions(self) -> list[Region]:
        return [r for r in (self.key, self.value, self.k_scale, self.v_scale) if r is not None]

    def api_kwargs(self) -> dict[str, Any]:
        return dict(
            mode=self.mode,
            k_scale_cache=None if self.k_scale is None else self.k_scale.array,
            v_scale_cache=None if self.v_scale is None else self.v_scale.array,
            k_scale=self.k_static,
            v_scale=self.v_static,
        )

    def side(self, which: str) -> QuantMode:
        """The mode of the key or the value cache (they differ in a split mode)."""
        mode = MODES[self.mode]
        return mode.key_side if which == "key" else mode.value_side

    def oracle_codes(self, which: str, when: str = "now"):
        """(codes uint8 or model-dtype values, float32 scales or None) as the oracle takes them."""
        r = self.key if which == "key" else self.value
        s = self.k_scale if which == "key" else self.v_scale
        codes = r.values(when) if self.side(which).code_dtype is None else r.element_bytes(when)[..., 0]
        scales = None if s is None else s.values(when)
        return codes, scales

    def decoded(self, which: str, when: str = "now") -> np.ndarray:
        codes, scales = self.oracle_codes(which, when)
        static = self.k_static if which == "key" else self.v_static
        return samples.oracle_decoded_cache(self.side(which), codes, scales, static)


def make_caches(
    rng,
    mode_name: str,
    shape: tuple[int, ...],
    kind: str,
    *,
    impl: Any,
    model_dtype: str = "bfloat16",
    storage: str = "code",
    realistic: bool = True,
    gaps: bool = True,
    layout: str = "separate",
) -> Caches:
    """layout "separate": four guarded buffers; "inline": one guarded, 4-byte aligned page
    buffer [NB, 2, BS, H, D + 4] with gaps, viewed through kvzoo.layout.inline_views (SPEC 5);
    "interleaved": separate codes, the two scale caches interleaved in one float32 buffer."""
    mode = MODES[mode_name]
    if layout == "inline":
        from kvzoo.layout import inline_views

        nb, bs, h, d = shape
        page = Region(rng, (nb, 2, bs, h, d + 4), "uint8", kind, impl=impl, label="inline page", gaps=gaps, align=4)
        views = inline_views(page.array, d, mode_name)
        idx = page.index
        key = page.sub("key_cache", views.key_cache, idx[:, 0, ..., :d], mode.code_dtype)
        value = page.sub("value_cache", views.value_cache, idx[:, 1, ..., :d], mode.code_dtype)
        ks = page.sub("k_scale_cache", views.k_scale_cache, idx[:, 0, ..., d] // 4, "float32")
        vs = page.sub("v_scale_cache", views.v_scale_cache, idx[:, 1, ..., d] // 4, "float32")
    else:
        # Rows of shape[-1] elements take each side's cache width (int4: two codes a byte).
        key, value = (
            Region(
                rng,
                (*shape[:3], side.cache_width(shape[3])),
                cache_dtype(side, model_dtype, storage),
                kind,
                impl=impl,
                label=label,
                gaps=gaps,
            )
            for side, label in ((mode.key_side, "key_cache"), (mode.value_side, "value_cache"))
        )
        ks = vs = None
        if mode.per_token_head and layout == "interleaved":
            both = Region(rng, (*shape[:3], 2), "float32", kind, impl=impl, label="k/v scale buffer", gaps=gaps)
            ks = both.sub("k_scale_cache", both.array[..., 0], both.index[..., 0], "float32")
            vs = both.sub("v_scale_cache", both.array[..., 1], both.index[..., 1], "float32")
        elif mode.per_token_head:
            ks = Region(rng, shape[:3], "float32", kind, impl=impl, label="k_scale_cache", gaps=gaps)
            vs = Region(rng, shape[:3], "float32", kind, impl=impl, label="v_scale_cache", gaps=gaps)
    if realistic:
        for side, codes_r, scale_r in ((mode.key_side, key, ks), (mode.value_side, value, vs)):
            codes, scales = samples.fill_quantized(side, rng, shape, model_dtype)
            codes_r.set_values(codes)
            if scale_r is not None:
                scale_r.set_values(scales)
    statics = (static_scale(rng, mode_name), static_scale(rng, mode_name)) if mode.per_tensor else (None, None)
    return Caches(mode_name, key, value, ks, vs, *statics)


def same_bytes_caches(rng_seed_key: Any, mode_name: str, shape, kind: str, storage: str, **kw) -> Caches:
    """Caches whose bytes depend only on the key (so two storages can be compared)."""
    return make_caches(rng_for(*rng_seed_key), mode_name, shape, kind, storage=storage, **kw)


# ---------------------------------------------------------------------------------------------
# inputs


def float_rows(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Fresh random rows (varied magnitudes, never zeros) in dtype."""
    scale = rng.choice([0.05, 1.0, 30.0], size=(*shape[:-1], 1))
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    return x.astype(np.float32).astype(numpy_dtype(dtype))


def data_region(
    rng,
    values: np.ndarray,
    dtype: str,
    kind: str,
    label: str,
    *,
    impl: Any,
    flip: Sequence[int] = (),
    gaps: bool = True,
) -> Region:
    r = Region(rng, values.shape, dtype, kind, impl=impl, label=label, flip=flip, gaps=gaps)
    r.set_values(values)
    return r


# ---------------------------------------------------------------------------------------------
# oracle checks


def expected_write(
    caches: Caches, key_vals: np.ndarray, value_vals: np.ndarray, slots: np.ndarray, rounding: str = "nearest"
):
    """The oracle's caches after the write, from the caches' bytes before it."""
    kc, ks = caches.oracle_codes("key", "before")
    vc, vs = caches.oracle_codes("value", "before")
    nb, bs = caches.key.shape[:2]
    return samples.oracle_write(
        caches.mode,
        key_vals,
        value_vals,
        np.asarray(slots, np.int64),
        num_blocks=nb,
        block_size=bs,
        rounding=rounding,
        k_scale=caches.k_static,
        v_scale=caches.v_static,
        key_cache=kc,
        value_cache=vc,
        k_scale_cache=ks,
        v_scale_cache=vs,
    )


def _raw(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x)
    return x.view(np.uint8).reshape(*x.shape, x.dtype.itemsize)


def assert_write_matches(impl_name: str, caches: Caches, key_vals, value_vals, slots, rounding: str = "nearest"):
    """Nothing outside the views changed; exactly the named (slot, head) rows changed; the
    views equal the oracle's caches byte for byte."""
    what = f"{impl_name} reshape_and_cache"
    for r in caches.regions:
        r.assert_outside_unchanged(what, caches.regions)
    slots = np.asarray(slots, np.int64)
    nb, bs, h = caches.key.shape[:3]
    named = np.zeros((nb, bs), dtype=bool)
    written = slots[slots >= 0]
    named.reshape(-1)[written] = True
    for r in caches.regions:
        diff = (r.element_bytes() != r.element_bytes("before")).reshape(nb, bs, h, -1).any(axis=(2, 3))
        stray = diff & ~named
        assert not stray.any(), (
            f"{what}: {r.label} rows of slots {np.flatnonzero(stray.reshape(-1))[:8].tolist()} changed, "
            f"which slot_mapping does not name"
        )
    want = expected_write(caches, key_vals, value_vals, slots, rounding)
    for r, w in zip((caches.key, caches.value, caches.k_scale, caches.v_scale), want):
        if r is None:
            continue
        got = r.element_bytes()
        exp = _raw(w)
        bad = (got != exp).reshape(got.shape[:-1] + (-1,)).any(axis=-1)
        assert not bad.any(), (
            f"{what}: {r.label}: {int(bad.sum())} of {bad.size} elements differ from the oracle "
            f"(seed {SEED}), first at {np.argwhere(bad)[:3].tolist()}"
        )


def assert_same_floats(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Bitwise equality of float32 arrays, any NaN equal to any NaN."""
    g = np.asarray(got, np.float32)
    w = np.asarray(want, np.float32)
    assert g.shape == w.shape, f"{what}: shape {g.shape} != {w.shape}"
    nan = np.isnan(g) & np.isnan(w)
    g = np.where(nan, np.float32(0), g)
    w = np.where(nan, np.float32(0), w)
    bad = g.view(np.uint32) != w.view(np.uint32)
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {bad.size} values differ (seed {SEED}), first at {np.argwhere(bad)[:3].tolist()}"
    )


def to_host_float32(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return to_host(x.detach().float())
    return np.asarray(x).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# batches


def make_batch(rng: np.random.Generator, kind: str = "mixed", block_size: int = 4) -> Batch:
    """Small varlen batches: 'decode', 'prefill', 'mixed' (decodes, a chunk on earlier context,
    a fresh prefill, sequences ending mid-block)."""
    return samples.draw_batch(rng, kind, block_size=block_size, size="small", spare_blocks=2)


def reference_attention(
    caches: Caches, query_vals: np.ndarray, tables, seq_lens, qsl, *, quantize_query: bool = False, **options
) -> np.ndarray:
    """The oracle on the caches' bytes before the call (so a kernel writing to them is caught)."""
    k_codes, k_scales = caches.oracle_codes("key", "before")
    v_codes, v_scales = caches.oracle_codes("value", "before")
    return samples.oracle_attention(
        caches.mode,
        query_vals,
        k_codes,
        v_codes,
        tables,
        seq_lens,
        qsl,
        k_scales=k_scales,
        v_scales=v_scales,
        k_static=caches.k_static,
        v_static=caches.v_static,
        quantize_query=quantize_query,
        **options,
    )


__all__ = [n for n in dir() if not n.startswith("_")] + ["kvzoo"]
