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

import weakref
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from . import launches, memory
from . import registry as _registry
from .arrays import (
    CPU_DEVICE,
    Array,
    as_numpy,
    as_torch,
    device_of,
    is_torch,
    numpy_dtype,
    torch,
    torch_dtype,
)
from .calls import (
    CACHE,
    Geometry,
    attention_bounds,
    attention_scalars,
    block_table_values,
    cache_dtypes,
    check_block_tables,
    check_bounds,
    check_caches,
    check_query_options,
    check_query_start_loc,
    check_rounding,
    check_scale_caches,
    check_sinks,
    check_slot_mapping,
    check_slot_values,
)
from .errors import fail
from .layout import SCALE_BYTES, KVCacheTensors, allocate_inline, allocate_separate
from .modes import QuantMode, get_kv_quant_mode
from .problem import Attention, CacheWrite
from .registry import Implementation
from .validate import (
    FLOAT_INPUTS,
    as_code_storage,
    int_scalar,
    require_array,
    require_same_device,
    require_sizes,
    require_workspace,
    require_writable,
    static_scale,
)

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
        """Shape of key_cache (and of value_cache, unless the mode is split: side_shape)."""
        return self.side_shape(self.mode.key_side)

    def side_shape(self, side: QuantMode) -> tuple[int, int, int, int]:
        """Shape of the cache one side's mode (mode.key_side or mode.value_side) stores."""
        return (self.num_blocks, self.block_size, self.num_kv_heads, side.cache_width(self.head_size))

    @property
    def scale_shape(self) -> tuple[int, int, int] | None:
        """Shape of k_scale_cache and v_scale_cache (per-token-head modes), else None."""
        return self.cache_shape[:3] if self.mode.per_token_head else None

    @property
    def cache_dtypes(self) -> tuple[str, ...]:
        """dtypes key_cache may have (the code dtype or uint8; model_dtype for mode none)."""
        return cache_dtypes(self.mode.key_side, self.model_dtype)

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
    """One caches object as the kernels take it: code-storage views, extents, static scales."""

    __slots__ = ("arrays", "extents", "statics", "write_checked")

    def __init__(self, arrays: tuple[Array, Array, Array | None, Array | None]) -> None:
        self.arrays = arrays  # key_cache, value_cache, k_scale_cache, v_scale_cache
        self.extents = tuple((name, a, memory.byte_extent(a)) for name, a in zip(_CACHE_NAMES, arrays) if a is not None)
        self.statics: dict[tuple[str, float], Array] = {}
        self.write_checked = False

    def check_written(self) -> None:
        """What writing into the caches outside a call adds to their rules (kvzoo.distributed
        places pages into them): writable, and no two elements at one address."""
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


_SPEC = " (the CacheSpec's)"


def _check_caches(tensors: Any, spec: CacheSpec, device: Any) -> _Layer:
    """A caches object against the spec; each call of the layer checks the rest with its own
    arrays (kvzoo.calls)."""
    if not isinstance(tensors, KVCacheTensors):
        fail(f"caches: expected a kvzoo.KVCacheTensors or kvzoo.PagedKVCache, got {type(tensors).__name__}")
    mode = spec.mode
    if (tensors.buffer is not None) != (spec.layout == "inline"):
        fail(
            f"caches: the CacheSpec's layout is {spec.layout!r}, but the caches "
            f"{'are views of an inline buffer' if tensors.buffer is not None else 'have no inline buffer'}"
        )
    sides = (mode.key_side, mode.value_side)
    for name, cache, side in zip(("key_cache", "value_cache"), (tensors.key_cache, tensors.value_cache), sides):
        shape, dtypes = spec.side_shape(side), cache_dtypes(side, spec.model_dtype)
        check_caches(side, ((name, cache),), shape, dtypes, CACHE, source=_SPEC)
    scales = (("k_scale_cache", tensors.k_scale_cache), ("v_scale_cache", tensors.v_scale_cache))
    check_scale_caches(mode, scales, spec.cache_shape[:3], source=_SPEC, absent="the caches must have None there")
    arrays = (
        as_code_storage(tensors.key_cache, sides[0]),
        as_code_storage(tensors.value_cache, sides[1]),
        tensors.k_scale_cache,
        tensors.v_scale_cache,
    )
    for name, x in zip(_CACHE_NAMES, arrays):
        if x is not None and device_of(x) != device:
            fail(f"{name}: on {device_of(x)}, the plan's tensors are on {device}")
    return _Layer(arrays)


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


def _stand_in_caches(like: Array, spec: CacheSpec) -> tuple[Array, Array, Array | None]:
    """Stand-ins for a layer's key codes, value codes and scales. Inline ones are views of one
    buffer, as the real ones are: that is how the registry tells the inline layout from the
    separate one."""
    code = spec.mode.code_dtype or spec.model_dtype
    if spec.layout != "inline":
        scales = _stand_in(like, spec.cache_shape[:3], "float32") if spec.mode.per_token_head else None
        key_side, value_side = spec.mode.key_side, spec.mode.value_side
        return (
            _stand_in(like, spec.side_shape(key_side), key_side.code_dtype or spec.model_dtype),
            _stand_in(like, spec.side_shape(value_side), value_side.code_dtype or spec.model_dtype),
            scales,
        )
    if is_torch(like):
        base = torch.zeros(2 * SCALE_BYTES, dtype=torch.uint8, device=like.device)
        codes = base[:1].view(torch_dtype(code)).expand(spec.cache_shape)
        return codes, codes, base[SCALE_BYTES:].view(torch.float32).expand(spec.cache_shape[:3])
    page = np.zeros(2 * SCALE_BYTES, np.uint8)
    page_codes = as_strided(page[:1].view(numpy_dtype(code)), spec.cache_shape, (0,) * 4)
    return page_codes, page_codes, as_strided(page[SCALE_BYTES:].view(np.float32), spec.cache_shape[:3], (0,) * 3)


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
    _Layer, and the last write and attention the layer's calls resolved to (one comparison
    finds them again)."""

    __slots__ = ("layer", "tensors", "write", "attention")

    def __init__(self, layer: _Layer, tensors: Any) -> None:
        self.layer, self.tensors = layer, tensors
        self.write: _Bound | None = None
        self.attention: _Bound | None = None


# The operands a bound layer's call brings itself (the rest are the layer's and the plan's):
# the positions _Bound.fixed and .tail leave open.
_WRITE_VARIES = ("key", "value")
_ATTEND_VARIES = ("query", "out", "lse")


class _Bound:
    """A layer's call bound to its launch: what a later call of the same own-array metadata
    (`call`, launches.signature of them) runs without going through launches.run. launch: the
    launch the table's entry prepared at the plan's bounds; convert: the implementation's
    array kind for the call's own arrays (None: as given); fixed, tail: the launch's other
    operands (the layer's and the plan's, as the implementation takes them: after the first,
    and after out); per checked array, the starts that the fixed extents refuse, and the
    differences (its address minus the other array's) at which it meets the other array, as an
    open interval ((0, 0), empty, where either has no span)."""

    __slots__ = ("call", "launch", "convert", "fixed", "tail", "refused", "apart")

    def __init__(self, call, launch, convert, fixed, tail, refused, apart) -> None:
        self.call, self.launch, self.convert, self.fixed, self.tail = call, launch, convert, fixed, tail
        self.refused, self.apart = refused, apart


def _bind(
    call: tuple,
    launch: Any,
    adapter: launches.Adapter,
    checked: Sequence[Array],
    against: Sequence[tuple],
    other: Array | None,
    fixed: tuple,
    tail: tuple,
    operands: tuple,
    varying: tuple[str, ...],
) -> _Bound | None:
    """A layer's call bound to its launch, with what later calls are checked by: the spans of
    the arrays `checked` (the call's own written arrays, or the rows it reads into the caches
    it writes) and of `other` (the one it reads), and the extents of `against` ((name,
    array, extent) each: the layer's and the plan's arrays, whose addresses do not change).
    None where the call's own arrays are not plain tensors: a bound call reads their addresses
    with data_ptr()."""
    if launch is None or any(type(x) is not launches._TENSOR for x in (*checked, other) if x is not None):
        return None
    spans = tuple(memory.span(x) for x in checked)
    theirs = None if other is None else memory.span(other)
    extents = [extent for _, _, extent in against if extent is not None]
    refused = tuple(() if span is None else _refused_starts(span, extents) for span in spans)
    # A checked array at address a meets the other at b when a + span[0] < b + theirs[1]
    # and b + theirs[0] < a + span[1]: when a - b lies strictly between these two.
    apart = tuple(
        (0, 0) if span is None or theirs is None else (theirs[0] - span[1], theirs[1] - span[0]) for span in spans
    )
    convert = adapter.convert if adapter.convert_at else None
    hold = getattr(launch, "hold", None)
    held = hold(operands, varying) if hold is not None else None
    return _Bound(call, launch if held is None else held, convert, fixed, tail, refused, apart)


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

    A layer's call is the same record a functional call is (kvzoo.problem), with the plan's
    part filled in: its own arrays are checked against what the plan fixes (calls.Geometry),
    and it runs through launches.run, whose table knows its signature after the first layer.
    A layer then keeps what its call resolved to (_Bound), so its next call of the same
    metadata goes from its arguments to the launch.
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
        "_impl",
        "_device",
        "_layers",
        "_meta_extents",
        "_workspace_extent",
        "_given",
        "_read_between",
        "_rows",
        "_queries",
        "workspace",
        "workspace_bytes",
    )
    spec: CacheSpec
    num_q_heads: int
    softmax_scale: float
    sliding_window: int | None
    softcap: float | None
    sinks: Array | None
    batch_invariant: bool
    quantize_query: bool
    fp8_dots: bool
    max_query_len: int
    max_seq_len: int
    num_prefills: int | None
    num_tokens: int | None
    block_tables: Array
    seq_lens: Array
    query_start_loc: Array
    slot_mapping: Array | None
    write_impl: Implementation | None
    attention_impl: Implementation
    # (write, attention): the impl each operation's calls ask launches.run for.
    _impl: tuple[str | Implementation | None, str | Implementation | None]
    _device: Any
    _layers: dict[int, _Held]
    # (name, array, byte extent) of the plan's own metadata arrays, and of its workspace (none
    # without one).
    _meta_extents: tuple[tuple[str, Array, tuple[int, int] | None], ...]
    _workspace_extent: tuple[tuple[str, Array, tuple[int, int] | None], ...]
    # The caller's metadata arrays the plan copied (name, array, byte extent): a written array
    # must not meet them either, although the kernels read the copies.
    _given: tuple[tuple[str, Array, tuple[int, int] | None], ...]
    # What an attention call's outputs must not meet besides its own arguments: _given, and
    # slot_mapping, which the next layer's write reads after this call has written them.
    _read_between: tuple[tuple[str, Array, tuple[int, int] | None], ...]
    _rows: Geometry | None
    _queries: Geometry
    workspace: Array | None
    workspace_bytes: int

    def __init__(self) -> None:
        raise TypeError("build a StepPlan with kvzoo.plan_step(...)")

    def __repr__(self) -> str:
        impls = f"write={self.write_impl.name if self.write_impl else None}, attention={self.attention_impl.name}"
        return (
            f"StepPlan({self.spec.mode.name}, {self.spec.layout}, seqs={int(self.seq_lens.shape[0])}, "
            f"tokens={self.num_tokens}, max_query_len={self.max_query_len}, max_seq_len={self.max_seq_len}, "
            f"num_prefills={self.num_prefills}, {impls})"
        )

    def _layer(self, caches: Any) -> tuple[_Held, Any, Any]:
        tensors, k_scale, v_scale = caches, None, None
        if isinstance(getattr(caches, "tensors", None), KVCacheTensors):
            # A kvzoo.PagedKVCache (kvzoo.cache, which stands on the functional API): its
            # tensors, and the static scales it passes itself.
            tensors, k_scale, v_scale = caches.tensors, caches.k_scale, caches.v_scale
            if caches.mode != self.spec.mode:
                fail(f"caches: a PagedKVCache of mode {caches.mode.name!r}; the plan's is {self.spec.mode.name!r}")
        held = self._layers.get(id(tensors))
        if held is None:
            layer = _layer_of(tensors, self.spec, self._device)
            # Every write writes the caches and every attention reads the step's metadata after
            # it: the caches may not hold any of it (the caller's arrays the plan copied too).
            # Once per caches object; each call checks the workspace against its own arrays.
            metadata = (*self._meta_extents, *self._given)
            for name, a, extent in layer.extents:
                _refuse_overlap(name, a, extent, metadata, "read")
            # The plan holds the object beside its entry, so the id stays its own meanwhile.
            held = self._layers[id(tensors)] = _Held(layer, tensors)
        return held, k_scale, v_scale

    def _statics(self, layer: _Layer, k_scale: Any, v_scale: Any) -> tuple[Array | None, Array | None]:
        # Floats become arrays once per layer (a graph replays the same tensor); anything else
        # is the record's to check.
        if not self.spec.mode.per_tensor:
            return k_scale, v_scale
        like = layer.arrays[0]
        return layer.static("k_scale", k_scale, like), layer.static("v_scale", v_scale, like)

    # A call whose own arguments have the metadata of one already bound for this layer goes
    # from its arguments to the launch, checking only what the addresses decide: that the
    # arrays it writes meet none it reads, or none of the layer's caches it writes. That path
    # is write's and attention's first lines, inlined: it is what every layer of every step
    # runs, and each call or look-up it does not make is time the launch waits for.

    def write(self, key: Array, value: Array, caches: Any, *, k_scale: Any = None, v_scale: Any = None) -> None:
        """Quantize key/value rows into their slots of this layer's cache (reshape_and_cache).

        key, value: [num_tokens, num_kv_heads, head_size], model_dtype, any strides;
        num_tokens is slot_mapping's length. caches: the layer's KVCacheTensors or PagedKVCache
        (whose k_scale/v_scale serve fp8_per_tensor). k_scale, v_scale: fp8_per_tensor's static
        scales (float32 [1] arrays or floats). Reads no device data.
        """
        if self.write_impl is None:
            fail("slot_mapping: this plan was built without slot_mapping, so it cannot write")
        # A caches object this plan holds is a KVCacheTensors (no static scales of its own);
        # any other goes through _layer.
        held = self._layers.get(id(caches))
        k_from = v_from = None
        if held is None:
            held, k_from, v_from = self._layer(caches)
        call = None
        if k_scale is None and v_scale is None and k_from is None and v_from is None:
            call = launches.signature((key, value))
            bound = held.write
            # A call signature declines (a tensor subclass) is checked in full, and never bound.
            if call is not None and bound is not None and bound.call == call:
                if TYPE_CHECKING:  # _bind binds tensors' calls only (not asked again: the hot path)
                    assert isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor)
                refused_key, refused_value = bound.refused
                # Read at these addresses, neither may meet the caches the call writes (a
                # refused start is at an odd index of its boundaries).
                if not (
                    bisect_right(refused_key, key.data_ptr()) & 1 or bisect_right(refused_value, value.data_ptr()) & 1
                ):
                    c = bound.convert
                    bound.launch((key, value, *bound.fixed) if c is None else (c(key), c(value), *bound.fixed))
                    return
        layer = held.layer
        ks, vs = self._statics(
            layer, k_scale if k_scale is not None else k_from, v_scale if v_scale is not None else v_from
        )
        kc, vc, ksc, vsc = layer.arrays
        spec = self.spec
        # A plan with a write_impl has its slot_mapping (plan_step sets both or neither).
        assert self.slot_mapping is not None
        record = CacheWrite(key, value, kc, vc, self.slot_mapping, ksc, vsc, ks, vs, spec.mode, spec.rounding)
        _, adapted, entry, launch = launches.run(record, self._impl[0], False, geometry=self._rows)
        # A write always runs (launches.run returns None for these only where no query rows are).
        assert adapted is not None and entry is not None
        if call is not None and ks is None:
            held.write = _bind(
                call, launch, entry.adapt, (key, value), layer.extents, None, adapted[2:], (), adapted, _WRITE_VARIES
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
        if self.workspace is not None:
            # The workspace is written by the call, the query read.
            require_array("query", query)
            _refuse_overlap("query", query, memory.byte_extent(query), self._workspace_extent, "write")
        call = None
        if sinks is None and lse is None and k_scale is None and v_scale is None and k_from is None and v_from is None:
            call = launches.signature((query, out))
            if call is not None:
                call = (return_lse, call)
                bound = held.attention
                if bound is not None and bound.call == call:
                    if TYPE_CHECKING:  # as in write
                        assert isinstance(query, torch.Tensor) and (out is None or isinstance(out, torch.Tensor))
                    if out is None:  # then nothing the call is given is written
                        # same_kind_empty's out (the query's shape, device and dtype, the
                        # model's), without parsing them again.
                        out = torch.empty_like(query, memory_format=torch.contiguous_format)
                        clear = True
                    else:
                        at = out.data_ptr()
                        ((low, high),) = bound.apart
                        clear = not (bisect_right(bound.refused[0], at) & 1 or low < at - query.data_ptr() < high)
                    if clear:
                        lse = (
                            torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)
                            if return_lse
                            else None
                        )
                        c = bound.convert
                        if c is None:
                            bound.launch((query, *bound.fixed, out, *bound.tail, lse))
                        else:
                            bound.launch((c(query), *bound.fixed, c(out), *bound.tail, None if lse is None else c(lse)))
                        if return_lse:
                            assert lse is not None  # allocated two lines above
                            return out, lse
                        return out
        layer = held.layer
        if self._read_between:
            for name, x in (("out", out), ("lse", lse)):
                if is_torch(x) or isinstance(x, np.ndarray):  # anything else: the record refuses it
                    _refuse_overlap(name, x, memory.byte_extent(x), self._read_between, "read")
        ks, vs = self._statics(
            layer, k_scale if k_scale is not None else k_from, v_scale if v_scale is not None else v_from
        )
        kc, vc, ksc, vsc = layer.arrays
        if sinks is None:
            sinks = self.sinks
        rows = self._queries
        if rows.rows[0] is None:  # planned without reading query_start_loc: rows as they come
            rows = rows._replace(rows=(query.shape[0] if len(query.shape) else 0, *rows.rows[1:]))
        record = Attention(
            query,
            kc,
            vc,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            out,
            ksc,
            vsc,
            ks,
            vs,
            sinks,
            lse,
            self.spec.mode,
            self.softmax_scale,
            self.sliding_window,
            self.softcap,
            self.max_query_len,
            self.max_seq_len,
            self.num_prefills,
            self.batch_invariant,
            self.quantize_query,
            self.fp8_dots,
            return_lse,
        )
        operands, adapted, entry, launch = launches.run(record, self._impl[1], False, geometry=rows)
        out, lse = operands[6], operands[12]
        if call is not None and entry is not None and adapted is not None and ks is None:
            # A given out is checked on later calls against the caches, the metadata and the query.
            checked: tuple = ()
            against: tuple = ()
            if call[1][1] is not None:
                checked, against = (
                    (out,),
                    (*layer.extents, *self._meta_extents, *self._workspace_extent, *self._read_between),
                )
            held.attention = _bind(
                call, launch, entry.adapt, checked, against, query, adapted[1:6], adapted[7:12], adapted, _ATTEND_VARIES
            )
        if return_lse:
            assert lse is not None  # allocated where not given (calls.check_lse)
            return out, lse
        return out


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
    num_seqs = check_query_start_loc(query_start_loc, seq_lens)
    check_block_tables(block_tables, seq_lens, spec.block_size)
    softmax_scale, sliding_window, softcap = attention_scalars(
        spec.head_size, int(block_tables.shape[1]) * spec.block_size, softmax_scale, sliding_window, softcap
    )
    if sinks is not None:
        check_sinks(sinks, num_q_heads)
    if slot_mapping is not None:
        check_slot_mapping(slot_mapping)
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
    given = check_bounds((max_query_len, max_seq_len, num_prefills), int(seq_lens.shape[0]))
    lens_read = block_table_values(block_tables, seq_lens, spec.num_blocks, spec.block_size) if validate else None
    if validate and slot_mapping is not None:
        check_slot_values(slot_mapping, spec.num_blocks, spec.block_size)
    max_query_len, max_seq_len, num_prefills, num_tokens = attention_bounds(
        query_start_loc,
        seq_lens,
        None,
        validate,
        given,
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
    plan._queries = Geometry((num_tokens, num_q_heads, spec.head_size), spec.model_dtype, device)

    # The implementations, chosen on stand-ins of this spec's layers (the registry looks at
    # shapes, dtypes, devices and options, not at values).
    reg = _registry.default()
    dtype = spec.model_dtype
    kc, vc, sc = _stand_in_caches(block_tables, spec)
    static = _stand_in(block_tables, (1,), "float32") if mode.per_tensor else None
    stand_in = Attention(
        _stand_in(block_tables, (max(num_tokens or 0, 1), num_q_heads, spec.head_size), dtype),
        kc,
        vc,
        block_tables,
        seq_lens,
        query_start_loc,
        _stand_in(block_tables, (1, num_q_heads, spec.head_size), dtype),
        sc,
        sc,
        static,
        static,
        sinks,
        None,
        mode,
        softmax_scale,
        sliding_window,
        softcap,
        max_query_len,
        max_seq_len,
        num_prefills,
        plan.batch_invariant,
        plan.quantize_query,
        plan.fp8_dots,
    )
    attention_choice = _impl_for(impl, "paged_attention")
    plan.attention_impl = chosen = reg.select(stand_in, "paged_attention", attention_choice)
    meta = _for_impl(chosen, stand_in)
    plan.block_tables, plan.seq_lens, plan.query_start_loc = meta.block_tables, meta.seq_lens, meta.query_start_loc
    plan.sinks = meta.sinks
    plan._meta_extents = tuple(
        (name, getattr(meta, name), memory.byte_extent(getattr(meta, name)))
        for name in ("block_tables", "seq_lens", "query_start_loc", "sinks")
        if getattr(meta, name) is not None
    )
    plan.workspace, plan.workspace_bytes, plan._workspace_extent = None, 0, ()
    if chosen.workspace_bytes is not None:
        # At the bounds: every query row the step may bring (validate=False plans do not read
        # query_start_loc[-1]).
        rows = num_tokens if num_tokens is not None else num_seqs * max_query_len
        sizing = meta.replace(query=_stand_in(meta.block_tables, (rows, num_q_heads, spec.head_size), dtype))
        plan.workspace_bytes = int(chosen.workspace_bytes(sizing, options=chosen.options))
    if workspace is not None:
        _check_workspace(workspace, plan.workspace_bytes, device)
        plan.workspace = workspace
        if chosen.workspace_bytes is not None:
            # The calls run on the implementation made for this buffer (their own table entries).
            plan.attention_impl = attention_choice = chosen.with_options(workspace=workspace)
        plan._workspace_extent = (("workspace", workspace, memory.byte_extent(workspace)),)

    plan.write_impl = plan.slot_mapping = plan._rows = None
    write_choice = _impl_for(impl, "reshape_and_cache")
    if slot_mapping is not None:
        tokens = int(slot_mapping.shape[0])
        plan._rows = Geometry((tokens, spec.num_kv_heads, spec.head_size), dtype, device)
        row = _stand_in(block_tables, (tokens, spec.num_kv_heads, spec.head_size), dtype)
        write = CacheWrite(row, row, kc, vc, slot_mapping, sc, sc, static, static, mode, spec.rounding)
        plan.write_impl = chosen = reg.select(write, "reshape_and_cache", write_choice)
        plan.slot_mapping = _for_impl(chosen, write).slot_mapping
    plan._impl = (write_choice, attention_choice)
    # The caller's index arrays the kernels read through copies (launches.unit_index_strides:
    # a view in another array kind keeps its address): a call's written arrays may not meet
    # them either, as the functional API refuses (SPEC.md section 11).
    callers: dict[str, Array | None] = {
        "block_tables": block_tables,
        "seq_lens": seq_lens,
        "query_start_loc": query_start_loc,
        "sinks": sinks,
        "slot_mapping": slot_mapping,
    }
    plan._given = tuple(
        (name, x, memory.byte_extent(x))
        for name, x in callers.items()
        if x is not None and memory.address(x) != memory.address(getattr(plan, name))
    )
    slots = () if plan.slot_mapping is None else (("slot_mapping", plan.slot_mapping),)
    plan._read_between = (*plan._given, *((name, x, memory.byte_extent(x)) for name, x in slots))
    if workspace is not None:
        # Every attention call writes the workspace: it may hold nothing the step reads, nor a
        # caller's array the plan copied (the caller's bytes would change all the same).
        read = (*plan._meta_extents, *plan._read_between)
        _refuse_overlap("workspace", workspace, memory.byte_extent(workspace), read, "read")
    return plan


def _check_workspace(workspace: Any, need: int, device: Any) -> None:
    require_workspace(workspace)
    if device_of(workspace) != device:
        fail(f"workspace: on {device_of(workspace)}, the plan's tensors are on {device}")
    if workspace.numel() < need:
        fail(f"workspace: the plan's attention calls need {need} bytes, the buffer holds {workspace.numel()}")


def _for_impl(impl: Implementation, record: Any) -> Any:
    """The record as `impl` reads it: every array of its array kind (the stand-ins too, which
    its workspace_bytes reads as it reads a call's arrays), index tensors at unit strides if
    it needs them (one copy now, none per layer)."""
    convert = as_numpy if impl.array_kind == "numpy" else as_torch
    changes = {name: convert(getattr(record, name)) for name in record.ARRAYS if getattr(record, name) is not None}
    record = record.replace(**changes)
    return launches.unit_index_strides(record) if impl.index_strides == "unit" else record
