"""Plan once per engine step, run per layer (the shape of FlashInfer's paged-KV wrappers).

Every attention layer of an engine step reads the same metadata: block tables, sequence
lengths, query offsets and slots. `plan_step` checks that metadata once (every read of device
data happens there), fixes the kernels' host-side bounds (max_query_len, max_seq_len,
num_prefills) and picks the implementations. Each layer then calls `StepPlan.write` and
`StepPlan.attention`, which check metadata only (shapes, dtypes, devices, addresses: O(1)
host work, no device read, no synchronisation) and launch; a layer's calls can therefore be
captured in a CUDA graph. Results are byte for byte those of the functional API
(`kvzoo.reshape_and_cache`, `kvzoo.paged_attention`) with the same implementation.

The example under `plan_step` runs as a doctest (tests/test_plan.py). For a CUDA graph: plan
with the bounds the graph will serve (max_query_len, max_seq_len, num_prefills: validated now,
kept), run the step once outside the capture (so each layer's caches are met and the kernels
compiled), capture it, then update the metadata and the inputs in place and replay
(tests/test_plan.py, test_cuda_graph_two_layer_step_replays_with_new_metadata).

What a plan promises, and what it leaves to the caller:

- The metadata tensors are kept by reference, so an engine may update them in place between
  CUDA-graph replays. The plan's host-side facts were read at plan time and are not re-read:
  after such an update every slot and block id must still be in range, no slot repeated,
  query_start_loc[-1] still equal to the query's rows, and max_query_len / max_seq_len /
  num_prefills still upper bounds (plan with the largest values the graph serves). An index
  tensor that the chosen implementation cannot step through at unit stride is copied once at
  plan time (`StepPlan.block_tables` etc. are the tensors the kernels read): pass unit-stride
  tensors (slices of persistent buffers are) when updating in place.
- A caches object (`KVCacheTensors`, or the `.tensors` of a `PagedKVCache`) is checked in full
  (shapes, dtypes, strides, devices, layout, its arrays' aliasing among themselves) the first
  time a plan of a given CacheSpec meets it, and the result is remembered for as long as the
  object lives; later layers and later steps pay a dictionary look-up. Do not resize or
  re-point its tensors in place (`set_`, `resize_`): build a new KVCacheTensors instead. Each
  call still checks its own arrays (key, value, query, out) and their aliasing with the
  caches and the metadata, from addresses only.
- A static per-tensor scale (fp8_per_tensor) given as an array is not read: its value is the
  caller's, as with validate=False. A float is converted once per caches object and value.
- Inputs (key, value, query) must be of the CacheSpec's model_dtype; attention's output is too.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from bisect import bisect_right
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from . import memory, recall
from . import registry as _registry
from .api import (
    _run,
    attention_bounds,
    attention_scalars,
    cache_dtypes,
    check_block_tables,
    check_query_start_loc_shape,
    check_rounding,
    check_sinks,
    check_slot_values,
    lse_output,
)
from .arrays import (
    CPU_DEVICE,
    as_numpy,
    as_torch,
    device_of,
    dtype_name,
    is_torch,
    numpy_dtype,
    same_kind_empty,
    torch,
    torch_dtype,
)
from .cache import PagedKVCache
from .layout import SCALE_BYTES, KVCacheTensors, allocate_inline, allocate_separate
from .modes import QuantMode, get_kv_quant_mode
from .problem import Attention, CacheWrite
from .registry import Implementation, NoImplementationError
from .validate import (
    FLOAT_INPUTS,
    INDEX_DTYPES,
    as_code_storage,
    check_query_options,
    fail,
    int_scalar,
    require_array,
    require_dtype,
    require_ndim,
    require_no_negative_strides,
    require_same_device,
    require_sizes,
    require_workspace,
    require_writable,
    static_scale,
    unit_index_strides,
)

Array = Any
ImplChoice = str | Implementation | Mapping[str, str | Implementation] | None

__all__ = ["CacheSpec", "StepPlan", "plan_step"]

LAYOUTS = ("separate", "inline")


@dataclass(frozen=True)
class CacheSpec:
    """What every layer's paged cache looks like: the plan checks each layer's caches against it.

    mode: a kvzoo mode (or engine string, see kvzoo.get_kv_quant_mode).
    num_blocks, block_size, num_kv_heads, head_size: the cache is
        [num_blocks, block_size, num_kv_heads, cache width of head_size] per K and V.
    layout: "separate" (vLLM's tensors, float32 scale caches [num_blocks, block_size, num_kv_heads])
        or "inline" (one uint8 page buffer, scales after each row; per-token-head modes).
    model_dtype: dtype of key, value, query and attention's output ("bfloat16", "float16",
        "float32"); also the cache dtype of mode "none".
    device: "cpu", "cuda", "cuda:1", ... or None for NumPy arrays (allocate() then gives NumPy).
    rounding: how writes round to int8 codes ("nearest", or vLLM's old "trunc").
    """

    mode: QuantMode
    _: KW_ONLY
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int
    layout: str = "separate"
    model_dtype: str = "bfloat16"
    device: str | None = "cpu"
    rounding: str = "nearest"

    def __post_init__(self) -> None:
        # Frozen: normalised values go in through object.__setattr__, once, here.
        mode = get_kv_quant_mode(self.mode)
        object.__setattr__(self, "mode", mode)
        for name in ("num_blocks", "block_size", "num_kv_heads", "head_size"):
            object.__setattr__(self, name, int_scalar(name, getattr(self, name), 1))
        require_sizes("num_blocks", num_blocks=self.num_blocks, block_size=self.block_size)
        if self.layout not in LAYOUTS:
            fail(f"layout: expected one of {list(LAYOUTS)}, got {self.layout!r}")
        refusal = mode.head_size_refusal(self.head_size)
        if refusal:
            fail(f"head_size: {refusal}")
        if self.layout == "inline":
            refusal = mode.inline_refusal()
            if refusal:
                fail(f"layout: {refusal}")
            if self.head_size % SCALE_BYTES:
                fail(
                    f"head_size: the inline layout needs a multiple of 4 (float32 scale alignment), "
                    f"got {self.head_size}"
                )
        if self.model_dtype not in FLOAT_INPUTS:
            fail(f"model_dtype: expected one of {list(FLOAT_INPUTS)}, got {self.model_dtype!r}")
        if self.device is not None:
            if torch is None:
                fail("device: torch is not installed; pass device=None for NumPy arrays")
            try:
                device = torch.device(self.device)
            except (RuntimeError, TypeError) as exc:
                fail(f"device: expected 'cpu', 'cuda', 'cuda:N' or None, got {self.device!r} ({exc})")
            if device.type not in ("cpu", "cuda"):
                fail(f"device: kvzoo runs on cpu and cuda tensors, got {self.device!r}")
            object.__setattr__(self, "device", str(device))
        check_rounding(mode, self.rounding)

    @property
    def cache_shape(self) -> tuple[int, int, int, int]:
        """Shape of key_cache and value_cache."""
        return (self.num_blocks, self.block_size, self.num_kv_heads, self.mode.cache_width(self.head_size))

    @property
    def scale_shape(self) -> tuple[int, int, int] | None:
        """Shape of k_scale_cache and v_scale_cache (per-token-head modes), else None."""
        return self.cache_shape[:3] if self.mode.per_token_head else None

    @property
    def cache_dtypes(self) -> tuple[str, ...]:
        """dtypes the code caches may have (the code dtype or uint8; model_dtype for mode none)."""
        return cache_dtypes(self.mode, self.model_dtype)

    def allocate(self) -> KVCacheTensors:
        """A zero-filled cache of this spec (one layer's)."""
        if self.layout == "inline":
            return allocate_inline(
                self.num_blocks, self.block_size, self.num_kv_heads, self.head_size, self.mode, device=self.device
            )
        return allocate_separate(
            self.num_blocks,
            self.block_size,
            self.num_kv_heads,
            self.head_size,
            self.mode,
            model_dtype=self.model_dtype,
            device=self.device,
        )


# ------------------------------------------------------------------------------------------
# A layer's caches, checked once per (object, spec, device) and remembered while it lives.


class _Layer:
    """One caches object as the kernels take it: code-storage views, extents, converted views."""

    __slots__ = ("arrays", "extents", "views", "signatures", "write_checked", "statics")

    def __init__(self, arrays: tuple[Array, Array, Array | None, Array | None]) -> None:
        self.arrays = arrays  # key_cache, value_cache, k_scale_cache, v_scale_cache
        self.extents = tuple((name, a, memory.byte_extent(a)) for name, a in zip(_CACHE_NAMES, arrays) if a is not None)
        self.views: dict[str, tuple] = {}  # array_kind -> arrays converted for it
        self.signatures: dict[str, tuple] = {}  # array_kind -> _signature of those views
        self.write_checked = False
        self.statics: dict[tuple[str, float], Array] = {}

    def for_kind(self, kind: str) -> tuple:
        views = self.views.get(kind)
        if views is None:
            convert = as_numpy if kind == "numpy" else as_torch
            views = self.views[kind] = tuple(None if a is None else convert(a) for a in self.arrays)
            self.signatures[kind] = _registry.prepared_signature(views)
        return views

    def check_written(self) -> None:
        """What a write adds to the caches' rules: writable, and no two elements at one address."""
        if self.write_checked:
            return
        for name, a in zip(_CACHE_NAMES, self.arrays):
            if a is not None:
                require_writable(name, a)
                if memory.self_overlap(a):
                    fail(
                        f"{name}: elements overlap one another (a stride-0 or overlapping view, shape "
                        f"{tuple(a.shape)}); a written array needs one address per element"
                    )
        written = self.extents
        for n, (name, a, extent) in enumerate(written):
            _refuse_overlap(name, a, extent, written[n + 1 :], "write")
        self.write_checked = True

    def static(self, name: str, value: Any, like: Array) -> Array:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            # A float becomes a one-element array once, so a graph replays the same tensor.
            key = (name, value)
            array = self.statics.get(key)
            if array is None:
                array = static_scale(name, value, like, validate=False)
                # Not remembered from inside a CUDA-graph capture: its fill would run only on
                # replay, and an eager call would read the uninitialised tensor.
                capturing = is_torch(array) and array.is_cuda and torch.cuda.is_current_stream_capturing()
                if not capturing and len(self.statics) < _MAX_STATICS:
                    self.statics[key] = array
            return array
        return static_scale(name, value, like, validate=False)


_CACHE_NAMES = ("key_cache", "value_cache", "k_scale_cache", "v_scale_cache")
# Static scales remembered per caches object: a layer has two; a caller passing a new float on
# every call must not grow the table without end.
_MAX_STATICS = 16
# Recalled per-layer calls a plan keeps (StepPlan._keep): a handful of argument shapes per layer.
_MAX_RECALLED = 1024
_LAYERS: dict[tuple[int, CacheSpec, str], _Layer] = {}


def _forget(key: tuple[int, CacheSpec, str]) -> None:
    _LAYERS.pop(key, None)


def _layer_of(tensors: KVCacheTensors, spec: CacheSpec, device: Any) -> _Layer:
    key = (id(tensors), spec, str(device))
    layer = _LAYERS.get(key)
    if layer is None:
        layer = _check_caches(tensors, spec, device)
        # The entry holds no reference to the caches object, so it does not keep it alive, and
        # it goes when the object does: its id cannot name another object while it is here.
        weakref.finalize(tensors, _forget, key)
        _LAYERS[key] = layer
    return layer


def _check_caches(tensors: Any, spec: CacheSpec, device: Any) -> _Layer:
    if not isinstance(tensors, KVCacheTensors):
        fail(f"caches: expected a kvzoo.KVCacheTensors or kvzoo.PagedKVCache, got {type(tensors).__name__}")
    mode = spec.mode
    if (tensors.buffer is not None) != (spec.layout == "inline"):
        fail(
            f"caches: the CacheSpec's layout is {spec.layout!r}, but the caches "
            f"{'are views of an inline buffer' if tensors.buffer is not None else 'have no inline buffer'}"
        )
    shape, layout = spec.cache_shape, "[num_blocks, block_size, num_kv_heads, cache width of head_size]"
    arrays: list[Array] = []
    for name in ("key_cache", "value_cache"):
        x = getattr(tensors, name)
        require_ndim(name, x, 4, layout)
        _require_spec_shape(name, x, shape, layout)
        require_dtype(name, x, spec.cache_dtypes)
        require_no_negative_strides(name, x)
        arrays.append(as_code_storage(x, mode))
    for name in ("k_scale_cache", "v_scale_cache"):
        x = getattr(tensors, name)
        if not mode.per_token_head:
            if x is not None:
                fail(
                    f"{name}: not used by mode {mode.name!r} (only per-token-head modes keep a scale per row); "
                    "the caches must have None there"
                )
            arrays.append(None)
            continue
        if x is None:
            fail(f"{name}: required for per-token-head mode {mode.name!r} (float32 {shape[:3]})")
        require_ndim(name, x, 3, "[num_blocks, block_size, num_kv_heads]")
        _require_spec_shape(name, x, shape[:3], "[num_blocks, block_size, num_kv_heads]")
        require_dtype(name, x, ("float32",))
        require_no_negative_strides(name, x)
        arrays.append(x)
    for name, x in zip(_CACHE_NAMES, arrays):
        if x is not None:
            _require_on(name, x, device)
    return _Layer(tuple(arrays))  # type: ignore[arg-type]


def _require_spec_shape(name: str, x: Array, shape: tuple[int, ...], layout: str) -> None:
    if tuple(x.shape) != shape:
        fail(f"{name}: expected shape {shape} {layout} (the CacheSpec's), got {tuple(x.shape)}")


def _refuse_overlap(name: str, x: Array, extent: Any, others: Any, role: str) -> None:
    """Refuse written array x sharing a byte with any of others ((name, array, extent) each).
    Extents first: only arrays whose byte ranges meet go on to the exact test."""
    if extent is None:
        return
    low, high = extent
    for other, y, theirs in others:
        if theirs is None or high <= theirs[0] or theirs[1] <= low:
            continue
        if memory.overlap(x, y):
            fail(
                f"{name}: shares memory with {other}, which this call also {role}s; pass separate "
                "(non-overlapping) arrays"
            )


# ------------------------------------------------------------------------------------------


def _stand_in(like: Array, shape: tuple[int, ...], dtype: str) -> Array:
    """One element broadcast to `shape`: what the registry inspects (shape, dtype, device,
    strides) at the cost of one element."""
    if is_torch(like):
        return torch.zeros(1, dtype=torch_dtype(dtype), device=like.device).expand(shape)
    return np.broadcast_to(np.zeros(1, numpy_dtype(dtype)), shape)


def _stand_in_caches(like: Array, spec: CacheSpec) -> tuple[Array, Array | None]:
    """Stand-ins for a layer's codes and scales. Inline ones are views of one buffer, as the
    real ones are: that is how the registry tells the inline layout from the separate one."""
    code = spec.mode.code_dtype or spec.model_dtype
    if spec.layout != "inline":
        scales = _stand_in(like, spec.cache_shape[:3], "float32") if spec.mode.per_token_head else None
        return _stand_in(like, spec.cache_shape, code), scales
    if is_torch(like):
        base = torch.zeros(2 * SCALE_BYTES, dtype=torch.uint8, device=like.device)
        return (
            base[:1].view(torch_dtype(code)).expand(spec.cache_shape),
            base[SCALE_BYTES:].view(torch.float32).expand(spec.cache_shape[:3]),
        )
    base = np.zeros(2 * SCALE_BYTES, np.uint8)
    return (
        as_strided(base[:1].view(numpy_dtype(code)), spec.cache_shape, (0,) * 4),
        as_strided(base[SCALE_BYTES:].view(np.float32), spec.cache_shape[:3], (0,) * 3),
    )


def _impl_for(impl: ImplChoice, op: str) -> str | Implementation | None:
    if impl is None or isinstance(impl, str):
        return impl
    if isinstance(impl, Implementation):
        return impl if impl.op == op else None
    if isinstance(impl, Mapping):
        unknown = set(impl) - {"reshape_and_cache", "paged_attention"}
        if unknown:
            fail(f"impl: keys must be 'reshape_and_cache' or 'paged_attention', got {sorted(unknown)}")
        return impl.get(op)
    fail(f"impl: expected a name, an Implementation or a mapping op -> either, got {type(impl).__name__}")
    return None


def _refused_starts(span: tuple[int, int], extents: Sequence[tuple[int, int]]) -> tuple[int, ...]:
    """Where an array of byte span `span` (offsets from its element 0) may not start, as sorted
    boundaries [l0, r0, l1, r1, ...] of half-open address ranges: it meets extent [a, b) when
    a - span[1] < start < b - span[0]. A start is refused when bisect_right puts it at an odd
    index."""
    ranges = sorted((a - span[1] + 1, b - span[0]) for a, b in extents)
    merged: list[list[int]] = []
    for low, high in ranges:
        if merged and low <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], high)
        else:
            merged.append([low, high])
    return tuple(bound for pair in merged for bound in pair)


class _Held:
    """A layer as one plan holds it: the caches object (so its id stays its own), its checked
    _Layer, and the recalled write and attention the layer's last calls went through (one
    comparison finds them again, where the plan's table would hash the whole key)."""

    __slots__ = ("layer", "tensors", "write", "attention")

    def __init__(self, layer: _Layer, tensors: Any) -> None:
        self.layer, self.tensors = layer, tensors
        self.write: _Recalled | None = None
        self.attention: _Recalled | None = None


class _Recalled:
    """What StepPlan._keep kept for later calls of one recall key (see there): call, the key
    less its op and layer (what _Held's comparison reads); the launch; the operands it takes
    beside the call's own arrays (fixed: after the first, tail: after out); per checked array,
    the starts that the fixed extents refuse, and the differences (its address minus the other
    array's) at which it meets the other array, as an open interval ((0, 0), empty, where
    either has no span)."""

    __slots__ = ("call", "launch", "fixed", "tail", "refused", "apart")

    def __init__(self, call: tuple, launch: Any, fixed: tuple, tail: tuple, refused: tuple, apart: tuple) -> None:
        self.call, self.launch, self.fixed, self.tail = call, launch, fixed, tail
        self.refused, self.apart = refused, apart


class StepPlan:
    """One engine step's checked metadata and chosen implementations; built by `plan_step`.

    Per layer: `write(key, value, caches)` then `attention(query, caches, out=None)`.
    Attributes (read-only by convention): spec, num_q_heads, softmax_scale, sliding_window,
    softcap, max_query_len, max_seq_len, num_prefills, num_tokens (query rows, from
    query_start_loc[-1]; None when planned with validate=False and the bounds given),
    block_tables, seq_lens, query_start_loc, slot_mapping (the tensors the kernels read),
    write_impl, attention_impl (the chosen Implementations), workspace (the caller's buffer, or
    None), workspace_bytes (what attention_impl's calls take of it, at the plan's bounds; 0
    for an implementation that takes none).
    """

    __slots__ = (
        "spec",
        "num_q_heads",
        "softmax_scale",
        "sliding_window",
        "softcap",
        "sinks",
        "batch_invariant",
        "quantize_query",
        "fp8_dots",
        "max_query_len",
        "max_seq_len",
        "num_prefills",
        "num_tokens",
        "block_tables",
        "seq_lens",
        "query_start_loc",
        "slot_mapping",
        "write_impl",
        "attention_impl",
        "_forced",
        "_device",
        "_layers",
        "_meta_extents",
        "_slot_extent",
        "_key_shape",
        "_query_tail",
        "_prepared",
        "_recalled",
        "workspace",
        "workspace_bytes",
    )

    def __init__(self) -> None:
        raise TypeError("build a StepPlan with kvzoo.plan_step(...)")

    def __repr__(self) -> str:
        impls = f"write={self.write_impl.name if self.write_impl else None}, attention={self.attention_impl.name}"
        return (
            f"StepPlan({self.spec.mode.name}, {self.spec.layout}, seqs={int(self.seq_lens.shape[0])}, "
            f"tokens={self.num_tokens}, max_query_len={self.max_query_len}, max_seq_len={self.max_seq_len}, "
            f"num_prefills={self.num_prefills}, {impls})"
        )

    # Per-layer checks: metadata only, and the fewest calls that give the functional API's errors.

    def _layer(self, caches: Any) -> tuple[_Held, Any, Any]:
        tensors, k_scale, v_scale = caches, None, None
        if isinstance(caches, PagedKVCache):
            tensors, k_scale, v_scale = caches.tensors, caches.k_scale, caches.v_scale
            if caches.mode != self.spec.mode:
                fail(f"caches: a PagedKVCache of mode {caches.mode.name!r}; the plan's is {self.spec.mode.name!r}")
        held = self._layers.get(id(tensors))
        if held is None:
            layer = _layer_of(tensors, self.spec, self._device)
            if self.workspace is not None:
                ws = self.workspace
                _refuse_overlap("workspace", ws, memory.byte_extent(ws), layer.extents, "read or write")
            # The plan holds the object beside its entry, so the id stays its own meanwhile.
            held = self._layers[id(tensors)] = _Held(layer, tensors)
        return held, k_scale, v_scale

    def _operand(self, name: str, x: Array, shape: tuple[int, ...], layout: str) -> None:
        # The caller has run require_array(name, x).
        if tuple(x.shape) != shape:
            if len(x.shape) != len(shape):
                fail(f"{name}: expected {len(shape)} dimensions {layout}, got shape {tuple(x.shape)}")
            fail(f"{name}: expected shape {shape} {layout}, got {tuple(x.shape)}")
        if dtype_name(x) != self.spec.model_dtype:
            fail(f"{name}: expected dtype {self.spec.model_dtype} (the CacheSpec's model_dtype), got {dtype_name(x)}")
        _require_on(name, x, self._device)

    def _statics(self, layer: _Layer, k_scale: Any, v_scale: Any) -> tuple[Array | None, Array | None]:
        mode = self.spec.mode
        if not mode.per_tensor:
            for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
                if s is not None:
                    fail(
                        f"{name}: not used by mode {mode.name!r} (only fp8_per_tensor takes a static scale); pass None"
                    )
            return None, None
        like = layer.arrays[0]
        return layer.static("k_scale", k_scale, like), layer.static("v_scale", v_scale, like)

    # A call whose own arguments have the metadata of one already checked for this layer
    # (recall.call_key: everything the per-layer checks read of them but their addresses) goes
    # from its arguments to the prepared launch, checking only what the addresses decide: that
    # the arrays it writes meet none it reads, or none of the layer's caches it writes. That
    # path is write's and attention's first lines, inlined: it is what every layer of every
    # step runs, and each call or look-up it does not make is time the launch waits for.

    def _launch(
        self,
        op: str,
        impl: Implementation,
        operands: tuple,
        make_problem: Callable[[], Any],
        layer: _Layer,
        own: tuple,
        keep: Callable[[Any], None] | None = None,
    ) -> None:
        """Run one layer's call: through the launch `impl` prepared for operands of this
        signature (dtypes, strides, alignment) where it has one, else through run. own: the
        operands that are not the layer's caches (whose signature the layer keeps). keep:
        where the call's checks passed on arguments handed on as given, what keeps the launch
        for later calls of its recall key (a partial of _keep)."""
        key = None
        if impl.prepare is not None:
            key = (op, layer.signatures[impl.array_kind], _registry.prepared_signature(own))
            launch = self._prepared.get(key)
            if launch is not None:
                if keep is not None:
                    keep(launch)
                launch(operands)
                return
        problem = make_problem()
        reasons = impl.problem_reasons(problem)
        if not reasons:
            if key is not None and key not in self._prepared:
                # Prepared on the first layer that brings this signature; kept as None when
                # impl does not prepare this problem, so later layers go straight to run.
                launch = self._prepared[key] = impl.prepare(problem)
                if launch is not None:
                    if keep is not None:
                        keep(launch)
                    launch(operands)
                    return
            impl.run(problem)
            return
        if self._forced[op]:
            raise NoImplementationError(f"impl={impl.name!r} cannot run this {op} call: " + "; ".join(reasons))
        # The planned choice declines this layer's arrays (strides it cannot address): the
        # functional API's path picks another, as a plain call would.
        _run(op, problem, None)

    def _keep(
        self,
        recall_key: tuple,
        checked: Sequence[Array],
        against: Sequence[tuple],
        other: Array | None,
        fixed: tuple,
        tail: tuple,
        launch: Any,
    ) -> None:
        """Keep `launch` for later calls of recall_key, with what they are checked by: the
        spans of the arrays `checked` (the call's written arrays) and of `other` (the one it
        reads), and the extents of `against` ((name, array, extent) each: the layer's and the
        plan's arrays, whose addresses do not change). fixed, tail: the launch's other
        operands (see _Recalled)."""
        if recall_key in self._recalled:
            return
        if any(type(x) is not recall._TENSOR for x in (*checked, other) if x is not None):
            # A recalled call reads its arguments' addresses with data_ptr() and hands them on
            # as given: only a launch of torch tensors qualifies (Triton's; Numba's takes NumPy
            # views of them, made per call, so its calls take the checked path).
            return
        spans = tuple(recall.span(x) for x in checked)
        theirs = None if other is None else recall.span(other)
        extents = [extent for _, _, extent in against if extent is not None]
        refused = tuple(() if span is None else _refused_starts(span, extents) for span in spans)
        # A checked array at address a meets the other at b when a + span[0] < b + theirs[1]
        # and b + theirs[0] < a + span[1]: when a - b lies strictly between these two.
        apart = tuple(
            (0, 0) if span is None or theirs is None else (theirs[0] - span[1], theirs[1] - span[0]) for span in spans
        )
        entry = _Recalled(recall_key[-1], launch, fixed, tail, refused, apart)
        recall.put_bounded(self._recalled, recall_key, entry, _MAX_RECALLED)

    def write(self, key: Array, value: Array, caches: Any, *, k_scale: Any = None, v_scale: Any = None) -> None:
        """Quantize key/value rows into their slots of this layer's cache (reshape_and_cache).

        key, value: [num_tokens, num_kv_heads, head_size], model_dtype, any strides;
        num_tokens is slot_mapping's length. caches: the layer's KVCacheTensors or PagedKVCache
        (whose k_scale/v_scale serve fp8_per_tensor). k_scale, v_scale: fp8_per_tensor's static
        scales (float32 [1] arrays or floats). Reads no device data.
        """
        impl = self.write_impl
        if impl is None:
            fail("slot_mapping: this plan was built without slot_mapping, so it cannot write")
        # A caches object this plan holds is a KVCacheTensors (no static scales of its own);
        # any other goes through _layer.
        held = self._layers.get(id(caches))
        k_from = v_from = None
        if held is None:
            held, k_from, v_from = self._layer(caches)
        layer = held.layer
        if not layer.write_checked:
            layer.check_written()
        call = None
        if k_scale is None and v_scale is None and k_from is None and v_from is None:
            call = recall.call_key((key, value))
            # A call call_key declines (a tensor subclass) is checked in full, and never kept.
            if call is not None:
                entry = held.write
                if entry is None or entry.call != call:
                    entry = self._recalled.get(("w", id(layer), call))
                if entry is not None:
                    held.write = entry
                    refused_key, refused_value = entry.refused
                    # Read at these addresses, neither may meet the caches the call writes (a
                    # refused start is at an odd index of its boundaries).
                    if not (
                        bisect_right(refused_key, key.data_ptr()) & 1
                        or bisect_right(refused_value, value.data_ptr()) & 1
                    ):
                        entry.launch((key, value, *entry.fixed))
                        return
        shape = self._key_shape
        require_array("key", key)
        self._operand("key", key, shape, "[num_tokens, num_kv_heads, head_size]")
        require_array("value", value)
        self._operand("value", value, shape, "(same as key)")
        ks, vs = self._statics(
            layer, k_scale if k_scale is not None else k_from, v_scale if v_scale is not None else v_from
        )
        reads = [("key", key, memory.byte_extent(key)), ("value", value, memory.byte_extent(value)), self._slot_extent]
        if ks is not None:
            reads += [("k_scale", ks, memory.byte_extent(ks)), ("v_scale", vs, memory.byte_extent(vs))]
        for name, a, extent in layer.extents:
            _refuse_overlap(name, a, extent, reads, "read")
        kind = impl.array_kind
        convert = as_numpy if kind == "numpy" else as_torch
        kc, vc, ksc, vsc = layer.for_kind(kind)
        own = (convert(key), convert(value), None if ks is None else convert(ks), None if vs is None else convert(vs))
        operands = (own[0], own[1], kc, vc, self.slot_mapping, ksc, vsc, own[2], own[3])  # CacheWrite's order
        keep = None
        if call is not None and ks is None and own[0] is key and own[1] is value:
            # Recalled calls hand their arguments on as given.
            fixed = (kc, vc, self.slot_mapping, ksc, vsc, None, None)
            recall_key = ("w", id(layer), call)
            keep = functools.partial(self._keep, recall_key, (key, value), layer.extents, None, fixed, ())
        self._launch(
            "reshape_and_cache",
            impl,
            operands,
            lambda: CacheWrite(
                mode=self.spec.mode,
                key=own[0],
                value=own[1],
                key_cache=kc,
                value_cache=vc,
                slot_mapping=self.slot_mapping,
                k_scale_cache=ksc,
                v_scale_cache=vsc,
                k_scale=own[2],
                v_scale=own[3],
                rounding=self.spec.rounding,
            ),
            layer,
            own,
            keep,
        )

    def attention(
        self,
        query: Array,
        caches: Any,
        out: Array | None = None,
        *,
        k_scale: Any = None,
        v_scale: Any = None,
        sinks: Array | None = None,
        return_lse: bool = False,
        lse: Array | None = None,
    ) -> Array | tuple[Array, Array]:
        """Causal attention of this step's query rows over this layer's paged cache.

        query: [num_tokens, num_q_heads, head_size], model_dtype, any strides. out: None (allocated)
        or a writable array of query's shape and dtype. sinks: this layer's [num_q_heads] float32
        sinks, replacing the plan's. Returns out. Reads no device data.
        return_lse=True returns (out, lse), lse float32 [num_tokens, num_q_heads] as in
        kvzoo.paged_attention (allocated, or the writable array given as lse=).
        """
        held = self._layers.get(id(caches))  # as in write
        k_from = v_from = None
        if held is None:
            held, k_from, v_from = self._layer(caches)
        layer = held.layer
        if self.workspace is not None:
            # The workspace is written by the call, the query read.
            require_array("query", query)
            _refuse_overlap("query", query, memory.byte_extent(query), self._meta_extents[-1:], "write")
        call = None
        if sinks is None and lse is None and k_scale is None and v_scale is None and k_from is None and v_from is None:
            call = recall.call_key((query, out))
            if call is not None:
                call = (return_lse, call)
                entry = held.attention
                if entry is None or entry.call != call:
                    entry = self._recalled.get(("a", id(layer), call))
                if entry is not None:
                    held.attention = entry
                    if out is None:  # then nothing the call is given is written
                        # same_kind_empty's out (the query's shape, device and dtype, the
                        # model's), without parsing them again.
                        out = torch.empty_like(query, memory_format=torch.contiguous_format)
                        clear = True
                    else:
                        at = out.data_ptr()
                        ((low, high),) = entry.apart
                        clear = not (bisect_right(entry.refused[0], at) & 1 or low < at - query.data_ptr() < high)
                    if clear:
                        lse = (
                            torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)
                            if return_lse
                            else None
                        )
                        entry.launch((query, *entry.fixed, out, *entry.tail, lse))
                        return (out, lse) if return_lse else out
        require_array("query", query)
        num_tokens = self.num_tokens
        if num_tokens is None:  # planned without reading query_start_loc: rows as they come
            num_tokens = int(query.shape[0]) if len(query.shape) else 0
        shape = (num_tokens, *self._query_tail)
        self._operand("query", query, shape, "[num_tokens, num_q_heads, head_size]")
        own_reads = []  # what the call brings besides the query: the plan checked its own
        if sinks is None:
            sinks = self.sinks
        else:
            check_sinks(sinks, self.num_q_heads)
            _require_on("sinks", sinks, self._device)
            own_reads.append(("sinks", sinks, memory.byte_extent(sinks)))
        ks, vs = self._statics(
            layer, k_scale if k_scale is not None else k_from, v_scale if v_scale is not None else v_from
        )
        if ks is not None:
            own_reads += [("k_scale", ks, memory.byte_extent(ks)), ("v_scale", vs, memory.byte_extent(vs))]
        if self.workspace is not None:
            _refuse_overlap("workspace", self.workspace, self._meta_extents[-1][2], own_reads, "read")
        reads = [("query", query, memory.byte_extent(query)), *layer.extents, *self._meta_extents, *own_reads]
        given_out = out
        if out is None:
            out = same_kind_empty(query, shape, self.spec.model_dtype)
        else:
            require_array("out", out)
            self._operand("out", out, shape, "(same as query)")
            require_writable("out", out)
            if memory.self_overlap(out):
                fail(
                    f"out: elements overlap one another (a stride-0 or overlapping view, shape {tuple(out.shape)}); "
                    "a written array needs one address per element"
                )
            _refuse_overlap("out", out, memory.byte_extent(out), reads, "read")
        given_lse = lse is not None
        lse = lse_output(lse, return_lse, query, num_tokens, self.num_q_heads)
        if given_lse:
            _require_on("lse", lse, self._device)
            if memory.self_overlap(lse):
                fail(
                    f"lse: elements overlap one another (a stride-0 or overlapping view, shape {tuple(lse.shape)}); "
                    "a written array needs one address per element"
                )
            _refuse_overlap("lse", lse, memory.byte_extent(lse), reads, "read")
            _refuse_overlap("lse", lse, memory.byte_extent(lse), [("out", out, memory.byte_extent(out))], "write")
        if num_tokens == 0:
            return (out, lse) if return_lse else out
        impl = self.attention_impl
        kind = impl.array_kind
        convert = as_numpy if kind == "numpy" else as_torch
        kc, vc, ksc, vsc = layer.for_kind(kind)
        if sinks is not None and sinks is not self.sinks:
            sinks = convert(sinks)
            if impl.index_strides == "unit":
                sinks = unit_index_strides(_Sinks(sinks)).sinks
        own = (
            convert(query),
            None if ks is None else convert(ks),
            None if vs is None else convert(vs),
            sinks,
            convert(out),
            None if lse is None else convert(lse),
        )
        # Attention.operand_names() order; the metadata is the plan's own.
        operands = (
            own[0],
            kc,
            vc,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            own[4],
            ksc,
            vsc,
            own[1],
            own[2],
            own[3],
            own[5],
        )

        def problem() -> Attention:
            return Attention(
                mode=self.spec.mode,
                query=operands[0],
                key_cache=kc,
                value_cache=vc,
                block_tables=self.block_tables,
                seq_lens=self.seq_lens,
                query_start_loc=self.query_start_loc,
                out=own[4],
                max_query_len=self.max_query_len,
                max_seq_len=self.max_seq_len,
                softmax_scale=self.softmax_scale,
                k_scale_cache=ksc,
                v_scale_cache=vsc,
                k_scale=own[1],
                v_scale=own[2],
                sliding_window=self.sliding_window,
                softcap=self.softcap,
                sinks=sinks,
                batch_invariant=self.batch_invariant,
                quantize_query=self.quantize_query,
                fp8_dots=self.fp8_dots,
                num_prefills=self.num_prefills,
                lse=own[5],
            )

        if lse is not None and "return_lse" not in impl.capabilities.options:
            # Planned without lse: an implementation that does not write it is not used for it.
            if self._forced["paged_attention"]:
                raise NoImplementationError(
                    f"impl={impl.name!r} cannot run this paged_attention call: {impl.name}: does not take return_lse"
                )
            _run("paged_attention", problem(), None)
        else:
            keep = None
            if call is not None and sinks is self.sinks and own[0] is query and own[4] is out and own[5] is lse:
                # Recalled calls hand their arguments on as given. A given out is checked on
                # recall against the caches, the metadata and the query.
                checked, against = (
                    ((given_out,), (*layer.extents, *self._meta_extents)) if given_out is not None else ((), ())
                )
                fixed = (kc, vc, self.block_tables, self.seq_lens, self.query_start_loc)
                tail = (ksc, vsc, None, None, self.sinks)
                recall_key = ("a", id(layer), call)
                keep = functools.partial(self._keep, recall_key, checked, against, query, fixed, tail)
            self._launch("paged_attention", impl, operands, problem, layer, own, keep)
        return (out, lse) if return_lse else out


@dataclass(frozen=True)
class _Sinks:
    # unit_index_strides takes a problem; a per-layer sinks override is the one index tensor left.
    sinks: Array
    INDICES = ("sinks",)

    def replace(self, **changes: Any) -> _Sinks:
        return dataclasses.replace(self, **changes)


def plan_step(
    cache_spec: CacheSpec,
    *,
    block_tables: Array,
    seq_lens: Array,
    query_start_loc: Array,
    slot_mapping: Array | None = None,
    num_q_heads: int,
    softmax_scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: Array | None = None,
    batch_invariant: bool = False,
    quantize_query: bool = False,
    fp8_dots: bool = False,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_prefills: int | None = None,
    validate: bool = True,
    impl: ImplChoice = None,
    workspace: Array | None = None,
) -> StepPlan:
    """Check one step's metadata and choose its implementations; once per step, for every layer.

    block_tables: [num_seqs, max_blocks_per_seq] int32/int64, the cache blocks of each sequence.
    seq_lens: [num_seqs] int32/int64, each sequence's context length, this step's tokens included.
    query_start_loc: [num_seqs + 1] int32/int64; sequence s owns query rows
        query_start_loc[s]:query_start_loc[s+1].
    slot_mapping: [num_tokens] int32/int64, slot (block * block_size + offset) of each token's
        K/V row, negative to skip; None for a plan that only attends.
    num_q_heads: query heads (a multiple of the spec's num_kv_heads).
    softmax_scale (default 1/sqrt(head_size)), sliding_window, softcap, sinks ([num_q_heads]
    float32), batch_invariant, quantize_query, fp8_dots: as kvzoo.paged_attention.
    validate=True reads slot_mapping, block_tables, seq_lens and query_start_loc on the host
    (one synchronisation on a GPU) and refuses out-of-range slots and block ids, repeated slots,
    and inconsistent offsets and lengths; it computes max_query_len, max_seq_len, num_prefills
    from the values, or keeps those given once checked to be at least the values (so a plan
    for a CUDA graph can be validated now and bound the steps it will replay). validate=False
    with max_query_len and max_seq_len given reads nothing at all (num_prefills, if given,
    bounds the GPU's staged prefill workspace); with either missing it reads query_start_loc
    and seq_lens, checks them, computes the missing bounds and keeps a given one as above. impl: an implementation name for both operations, an Implementation
    (for its own operation), or a mapping {"reshape_and_cache": ..., "paged_attention": ...};
    None lets the registry choose. workspace: a contiguous 1-D uint8 tensor on the plan's
    device, of at least `StepPlan.workspace_bytes`, that the attention's calls carve their own
    arrays from (split-KV partials, the staged prefill's workspace) instead of allocating
    them, so an engine sizes and places that memory once; None lets each call allocate. Its
    size is checked here, against the bounds (plan a CUDA graph's step with the bounds it will
    replay under); implementations that take none (NumPy, Numba) leave it unused. One layer's
    call uses it at a time: a step whose layers may run on several streams at once needs a
    plan (and a workspace) per stream. Raises kvzoo.KVZooInputError naming the argument.

    Example: a step of two prefills (20 and 5 tokens) over two layers.

    >>> import torch, kvzoo
    >>> spec = kvzoo.CacheSpec("int8_per_token_head", num_blocks=8, block_size=16, num_kv_heads=2,
    ...                        head_size=64, model_dtype="float32", device="cpu")
    >>> layers = [spec.allocate() for _ in range(2)]          # a KVCacheTensors per layer
    >>> plan = kvzoo.plan_step(
    ...     spec, num_q_heads=4,
    ...     block_tables=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),  # [num_seqs, max_blocks]
    ...     seq_lens=torch.tensor([20, 5], dtype=torch.int32),       # context, this step's tokens included
    ...     query_start_loc=torch.tensor([0, 20, 25], dtype=torch.int32),   # query rows of each sequence
    ...     slot_mapping=torch.cat([torch.arange(20), torch.arange(32, 37)]))   # [num_tokens]
    >>> for caches in layers:
    ...     key, value = torch.randn(25, 2, 64), torch.randn(25, 2, 64)   # [num_tokens, kv heads, head]
    ...     plan.write(key, value, caches)
    ...     out = plan.attention(torch.randn(25, 4, 64), caches)        # [num_tokens, q heads, head]
    >>> tuple(out.shape), out.dtype, plan.max_query_len, plan.max_seq_len, plan.num_prefills
    ((25, 4, 64), torch.float32, 20, 20, 2)
    """
    if not isinstance(cache_spec, CacheSpec):
        fail(f"cache_spec: expected a kvzoo.CacheSpec, got {type(cache_spec).__name__}")
    spec = cache_spec
    mode = spec.mode
    check_query_options(mode, quantize_query, fp8_dots)
    num_q_heads = int_scalar("num_q_heads", num_q_heads, 1)
    if num_q_heads % spec.num_kv_heads:
        fail(f"num_q_heads: {num_q_heads} must be a multiple of the cache's num_kv_heads {spec.num_kv_heads}")
    num_seqs = check_query_start_loc_shape(query_start_loc, seq_lens)
    require_ndim("block_tables", block_tables, 2, "[num_seqs, max_blocks_per_seq]")
    softmax_scale, sliding_window, softcap = attention_scalars(
        spec.head_size, int(block_tables.shape[1]) * spec.block_size, softmax_scale, sliding_window, softcap
    )
    if sinks is not None:
        check_sinks(sinks, num_q_heads)
    if slot_mapping is not None:
        require_ndim("slot_mapping", slot_mapping, 1, "[num_tokens]")
        require_dtype("slot_mapping", slot_mapping, INDEX_DTYPES)
    named = {
        "block_tables": block_tables,
        "seq_lens": seq_lens,
        "query_start_loc": query_start_loc,
        "slot_mapping": slot_mapping,
        "sinks": sinks,
    }
    require_same_device(named)
    device = device_of(block_tables)
    if spec.device is not None:  # (None: NumPy arrays, or CPU tensors beside them)
        want = torch.device(spec.device)
        if device.type != want.type or (want.index is not None and device != want):
            fail(f"block_tables: on {device}, the CacheSpec's device is {spec.device}")
    elif device != CPU_DEVICE:
        fail(f"block_tables: on {device}, the CacheSpec's device is None (NumPy arrays, on the CPU)")
    lens_read = check_block_tables(block_tables, seq_lens, spec.num_blocks, spec.block_size, validate)
    if validate and slot_mapping is not None:
        check_slot_values(slot_mapping, spec.num_blocks, spec.block_size)
    max_query_len, max_seq_len, num_prefills, num_tokens = attention_bounds(
        query_start_loc,
        seq_lens,
        None,
        validate,
        max_query_len,
        max_seq_len,
        num_prefills,
        table=(int(block_tables.shape[1]), spec.block_size),
        keep_given=True,
        lens_read=lens_read,
    )

    plan = object.__new__(StepPlan)
    plan.spec, plan.num_q_heads, plan._device = spec, num_q_heads, device
    plan.softmax_scale, plan.sliding_window, plan.softcap = softmax_scale, sliding_window, softcap
    plan.batch_invariant, plan.quantize_query, plan.fp8_dots = (
        bool(batch_invariant),
        bool(quantize_query),
        bool(fp8_dots),
    )
    plan.max_query_len, plan.max_seq_len, plan.num_prefills = max_query_len, max_seq_len, num_prefills
    plan.num_tokens = num_tokens
    plan._layers = {}
    plan._prepared = {}  # (op, operand signature) -> the implementation's prepared launch, or None
    plan._recalled = {}  # see StepPlan._keep
    plan._forced = {op: _impl_for(impl, op) is not None for op in ("reshape_and_cache", "paged_attention")}
    plan._query_tail = (num_q_heads, spec.head_size)

    # The implementations, chosen on stand-ins of this spec's layers (the registry looks at
    # shapes, dtypes, devices and options, not at values).
    reg = _registry.default()
    dtype = spec.model_dtype
    kc, sc = _stand_in_caches(block_tables, spec)
    static = _stand_in(block_tables, (1,), "float32") if mode.per_tensor else None
    stand_in = Attention(
        mode=mode,
        query=_stand_in(block_tables, (max(num_tokens or 0, 1), num_q_heads, spec.head_size), dtype),
        key_cache=kc,
        value_cache=kc,
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        out=_stand_in(block_tables, (1, num_q_heads, spec.head_size), dtype),
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        softmax_scale=softmax_scale,
        k_scale_cache=sc,
        v_scale_cache=sc,
        k_scale=static,
        v_scale=static,
        sliding_window=sliding_window,
        softcap=softcap,
        sinks=sinks,
        batch_invariant=plan.batch_invariant,
        quantize_query=plan.quantize_query,
        fp8_dots=plan.fp8_dots,
        num_prefills=num_prefills,
    )
    plan.attention_impl = chosen = reg.select(stand_in, "paged_attention", _impl_for(impl, "paged_attention"))
    meta = _for_impl(chosen, stand_in)
    plan.block_tables, plan.seq_lens, plan.query_start_loc = meta.block_tables, meta.seq_lens, meta.query_start_loc
    plan.sinks = meta.sinks
    plan._meta_extents = tuple(
        (name, getattr(meta, name), memory.byte_extent(getattr(meta, name)))
        for name in ("block_tables", "seq_lens", "query_start_loc", "sinks")
        if getattr(meta, name) is not None
    )
    plan.workspace, plan.workspace_bytes = None, 0
    if chosen.workspace_bytes is not None:
        # At the bounds: every query row the step may bring (validate=False plans do not read
        # query_start_loc[-1]).
        rows = num_tokens if num_tokens is not None else num_seqs * max_query_len
        sizing = meta.replace(query=_stand_in(block_tables, (rows, num_q_heads, spec.head_size), dtype))
        plan.workspace_bytes = int(chosen.workspace_bytes(sizing, options=chosen.options))
    if workspace is not None:
        _check_workspace(workspace, plan.workspace_bytes, device, plan._meta_extents)
        plan.workspace = workspace
        if chosen.workspace_bytes is not None:
            plan.attention_impl = chosen.with_options(workspace=workspace)
        plan._meta_extents += (("workspace", workspace, memory.byte_extent(workspace)),)

    plan.write_impl = plan.slot_mapping = plan._slot_extent = None
    if slot_mapping is not None:
        tokens = int(slot_mapping.shape[0])
        plan._key_shape = (tokens, spec.num_kv_heads, spec.head_size)
        row = _stand_in(block_tables, plan._key_shape, dtype)
        write = CacheWrite(
            mode=mode,
            key=row,
            value=row,
            key_cache=kc,
            value_cache=kc,
            slot_mapping=slot_mapping,
            k_scale_cache=sc,
            v_scale_cache=sc,
            k_scale=static,
            v_scale=static,
            rounding=spec.rounding,
        )
        plan.write_impl = chosen = reg.select(write, "reshape_and_cache", _impl_for(impl, "reshape_and_cache"))
        plan.slot_mapping = slots = _for_impl(chosen, write).slot_mapping
        plan._slot_extent = ("slot_mapping", slots, memory.byte_extent(slots))
    return plan


def _require_on(name: str, x: Array, device: Any) -> None:
    if device_of(x) != device:
        fail(f"{name}: on {device_of(x)}, the plan's tensors are on {device}")


def _check_workspace(workspace: Any, need: int, device: Any, metadata: Sequence[tuple]) -> None:
    require_workspace(workspace)
    _require_on("workspace", workspace, device)
    if workspace.numel() < need:
        fail(f"workspace: the plan's attention calls need {need} bytes, the buffer holds {workspace.numel()}")
    _refuse_overlap("workspace", workspace, memory.byte_extent(workspace), metadata, "read")


def _for_impl(impl: Implementation, problem: Any) -> Any:
    """The problem's index tensors as `impl` reads them: its array kind, unit strides if it
    needs them (one copy now, none per layer)."""
    convert = as_numpy if impl.array_kind == "numpy" else as_torch
    changes = {name: convert(getattr(problem, name)) for name in problem.INDICES if getattr(problem, name) is not None}
    problem = problem.replace(**changes)
    return unit_index_strides(problem) if impl.index_strides == "unit" else problem
