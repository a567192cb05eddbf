"""Argument checks shared by the public operations.

Every check raises before anything is written, with a message that names the argument and
what was expected. Checks that must read device memory (slot and block id ranges, sequence
bookkeeping) run only when the caller asks for validation, so a validated-off call performs no
host synchronisation and can be captured in a CUDA graph.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import memory
from .arrays import (
    as_numpy,
    device_of,
    device_type,
    dtype_name,
    is_array,
    is_torch,
    numpy_dtype,
    same_kind_empty,
    torch,
    torch_dtype,
)
from .errors import fail
from .formats import FLOAT8_E4M3FN, INT8
from .modes import QuantMode

FLOAT_INPUTS = ("float32", "float16", "bfloat16")
INDEX_DTYPES = ("int32", "int64")


_DEVICE_TYPES = ("cpu", "cuda")


# Where a caller's workspace must start: the kernels' 16-byte vector accesses (torch's CUDA
# allocations start at multiples of 512, its CPU ones of 64).
WORKSPACE_ALIGN = 16


def require_workspace(workspace: Any) -> None:
    """A caller's workspace: a writable, contiguous 1-D uint8 torch tensor starting at a
    WORKSPACE_ALIGN boundary, without requires_grad."""
    if torch is None or not isinstance(workspace, torch.Tensor):
        fail(f"workspace: expected a torch.Tensor of dtype uint8, got {type(workspace).__name__}")
    if workspace.dtype != torch.uint8 or workspace.dim() != 1 or not workspace.is_contiguous():
        fail(
            f"workspace: expected a contiguous 1-D uint8 tensor, got dtype {workspace.dtype} "
            f"shape {tuple(workspace.shape)} strides {workspace.stride()}"
        )
    if workspace.data_ptr() % WORKSPACE_ALIGN:
        fail(f"workspace: must start at a multiple of {WORKSPACE_ALIGN} bytes (torch's allocations do)")
    if workspace.requires_grad:
        fail("workspace: requires_grad is set; the kernels write it")
    require_writable("workspace", workspace)


def require_array(name: str, x: Any) -> None:
    """A tensor or array kvzoo can address: on the CPU or a GPU, not tracking gradients, in
    native byte order (kvzoo_spec/SPEC.md section 11)."""
    if is_torch(x):
        if x.device.type not in _DEVICE_TYPES:
            fail(
                f"{name}: on device {x.device}; kvzoo runs on {' and '.join(_DEVICE_TYPES)} tensors "
                "(ROCm tensors are cuda in torch)"
            )
        if x.requires_grad:
            fail(
                f"{name}: requires_grad=True; kvzoo's operations are not differentiable "
                f"(pass {name}.detach(), or call under torch.no_grad())"
            )
        if x.layout != torch.strided:
            fail(f"{name}: layout {x.layout}; kvzoo addresses strided tensors (pass {name}.to_dense())")
        # Lazy views (conj().imag, torch._neg_view) whose values are not their memory's: a
        # kernel reads the memory.
        if x.is_neg() or x.is_conj():
            fail(
                f"{name}: a lazily negated or conjugated view (is_neg() or is_conj()); its values are "
                f"not its memory's, which the kernels read (pass {name}.resolve_neg().resolve_conj())"
            )
    elif isinstance(x, np.ndarray):
        if not x.dtype.isnative:
            fail(
                f"{name}: byte order {x.dtype.str!r} is not this machine's; expected native order "
                f"(convert with {name}.astype({name}.dtype.newbyteorder('=')))"
            )
    else:
        fail(f"{name}: expected a torch.Tensor or numpy.ndarray, got {type(x).__name__}")


def require_writable(name: str, x: Any) -> None:
    """An array the call writes: writeable, and no negative strides (checked before any write)."""
    if isinstance(x, np.ndarray) and not x.flags.writeable:
        fail(f"{name}: the NumPy array is read-only, and this call writes it (pass a writeable array)")
    require_no_negative_strides(name, x)


def require_ndim(name: str, x: Any, ndim: int, layout: str) -> None:
    require_array(name, x)
    if len(x.shape) != ndim:
        fail(f"{name}: expected {ndim} dimensions {layout}, got shape {tuple(x.shape)}")


def require_dtype(name: str, x: Any, allowed: Sequence[str]) -> None:
    if dtype_name(x) not in allowed:
        fail(f"{name}: expected dtype in {list(allowed)}, got {dtype_name(x)}")


def require_shape(name: str, x: Any, expected: tuple[int, ...], layout: str) -> None:
    # torch.Size compares equal to a tuple of ints, as NumPy shapes are.
    if tuple(x.shape) != tuple(expected):
        fail(f"{name}: expected shape {tuple(expected)} {layout}, got {tuple(x.shape)}")


def require_same_device(named: dict[str, Any]) -> str:
    arrays = [(n, x) for n, x in named.items() if is_array(x)]
    first = arrays[0][1]
    key = device_of(first)
    if any(device_of(x) != key for _, x in arrays):
        listing = ", ".join(f"{n} on {device_of(x)}" for n, x in arrays)
        fail(f"all tensors must be on one device; got {listing}")
    return device_type(first)


def require_no_negative_strides(name: str, x: Any) -> None:
    if is_torch(x):  # torch has no negative strides
        return
    strides = x.strides
    if min(strides, default=0) < 0:
        fail(f"{name}: negative strides are not supported (got strides {tuple(strides)})")


def code_dtypes(mode: QuantMode) -> tuple[str, ...]:
    """Cache dtypes accepted for a quantized mode: the code dtype or raw bytes (vLLM keeps
    fp8 caches as uint8)."""
    assert mode.format is not None
    return mode.format.accepted_dtypes


def as_code_storage(x: Any, mode: QuantMode) -> Any:
    """A cache of raw bytes (uint8) viewed as the mode's code dtype, so that no implementation
    ever meets uint8 storage (SPEC.md section 11); other caches as they are."""
    if mode.code_dtype is None or dtype_name(x) != "uint8":
        return x
    if is_torch(x):
        return x.view(torch_dtype(mode.code_dtype))
    return x.view(numpy_dtype(mode.code_dtype))


# Largest value of the kernels' int32 positions, slots and lengths.
INT32_MAX = 2**31 - 1
_FLOAT32_TINY = float(np.finfo(np.float32).tiny)


def _real(name: str, value: Any, expected: str) -> float:
    # bool is an int to Python, never a scale or a length to a caller.
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        fail(f"{name}: expected {expected}, got {value!r} ({type(value).__name__})")
    try:
        return float(value)
    except OverflowError:  # an int beyond any float
        fail(f"{name}: expected {expected}, got an int of {int(value).bit_length()} bits, beyond any float")


def float32_scalar(name: str, value: Any, *, smallest: float = 0.0) -> float:
    """A real number whose float32 value is finite and > 0 (and >= smallest), returned as given.
    Checked in float32, the precision the kernels use: 1e39 is +Inf there and 1e-50 is 0."""
    expected = "a finite float > 0" if not smallest else f"a finite float >= {smallest:g}"
    number = _real(name, value, expected)
    with np.errstate(over="ignore"):
        as_f32 = float(np.float32(number))
    if not (math.isfinite(as_f32) and as_f32 > 0 and as_f32 >= smallest):
        fail(
            f"{name}: expected {expected} in float32 (the precision the kernels use), got {value!r}"
            + ("" if math.isnan(number) else f" (float32 {as_f32:g})")
        )
    return number


def normal_float32_scalar(name: str, value: Any) -> float:
    return float32_scalar(name, value, smallest=_FLOAT32_TINY)


def int_scalar(name: str, value: Any, low: int, high: int | None = None, high_name: str = "") -> int:
    """An integer (Python or NumPy, not bool, not float) in [low, high]."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        fail(f"{name}: expected an int, got {value!r} ({type(value).__name__})")
    number = int(value)
    if number < low or (high is not None and number > high):
        bound = f"in [{low}, {high_name + '=' if high_name else ''}{high}]" if high is not None else f">= {low}"
        fail(f"{name}: expected an int {bound}, got {number}")
    return number


def host_ints(x: Any) -> np.ndarray:
    """Values of a small index tensor on the host (synchronises a GPU tensor)."""
    if is_torch(x):
        return as_numpy(x.detach().to("cpu"))
    return np.asarray(x)


def static_scale(name: str, value: Any, like: Any, *, validate: bool) -> Any:
    """A per-tensor scale as a float32 [1] array of the same kind and device as `like`."""
    if value is None:
        fail(
            f"{name}: required for the per-tensor modes (fp8_per_tensor, int8_per_tensor, fp8_e5m2_per_tensor): "
            "the caller's static scale"
        )
    if is_array(value):
        require_array(name, value)
        if int(np.prod(value.shape)) != 1:
            fail(f"{name}: expected one element, got shape {tuple(value.shape)}")
        require_dtype(name, value, ("float32",))
        if device_of(value) != device_of(like):
            fail(f"{name}: on {device_of(value)}, expected {device_of(like)} like the cache")
        array = value.reshape(1)
    else:
        number = float32_scalar(name, value)
        array = same_kind_empty(like, (1,), "float32")
        array[0] = number
    if validate:
        s = float(host_ints(array)[0])
        if not (np.isfinite(s) and s > 0):  # a float32 already
            fail(f"{name}: expected a finite scale > 0, got {s}")
    return array


def check_query_options(mode: QuantMode, quantize_query: bool, fp8_dots: bool) -> None:
    """The options that quantize the query change what is computed, each for one format's caches
    (SPEC.md 8.1, 8.3), and exclude each other."""
    if quantize_query and fp8_dots:
        fail("fp8_dots: cannot be combined with quantize_query (each defines the query's own rounding)")
    if quantize_query and not (mode.format is INT8 and mode.per_token_head):
        fail(f"quantize_query: needs an int8 per-token-head cache mode, got mode {mode.name!r}")
    if fp8_dots and not (mode.format is FLOAT8_E4M3FN and mode.per_token_head):
        fail(f"fp8_dots: needs an fp8 e4m3fn per-token-head cache mode (fp8_per_token_head), got mode {mode.name!r}")


def forbid(name: str, value: Any, mode: QuantMode, why: str) -> None:
    if value is not None:
        fail(f"{name}: not used by mode {mode.name!r} ({why}); pass None")


def require_finite(name: str, x: Any) -> None:
    """Raise if x holds NaN or ±Inf, naming the first bad (token, head)."""
    a = x.detach().float().cpu().numpy() if is_torch(x) else np.asarray(x, dtype=np.float32)
    bad = ~np.isfinite(a)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        fail(f"{name}: holds {int(bad.sum())} non-finite values (first at index {where}: {a[where]})")


def require_sizes(name: str, **sizes: int) -> None:
    """Every named dimension of `name` at least 1 (a cache of no heads or no blocks holds nothing)."""
    for dim, size in sizes.items():
        if size < 1:
            fail(f"{name}: {dim} must be at least 1, got {size}")
    if "num_blocks" in sizes and sizes["num_blocks"] * sizes["block_size"] > INT32_MAX:
        fail(
            f"{name}: {sizes['num_blocks']} blocks x block_size {sizes['block_size']} is more slots than the "
            f"kernels' int32 ({INT32_MAX})"
        )


def check_aliasing(problem: Any) -> None:
    """Refuse a written array that overlaps itself, another written array or an array the call
    reads (SPEC.md section 11). Metadata only: no device read, so it runs unvalidated too."""
    names = problem.array_fields()
    # Runs on every call: each extent is computed once, and only arrays whose extents meet
    # (views of one buffer) go on to the exact test.
    extents = {name: memory.byte_extent(getattr(problem, name)) for name in names}
    for n, name in enumerate(names):
        if name not in problem.WRITTEN:
            continue
        x = getattr(problem, name)
        if memory.self_overlap(x):
            fail(
                f"{name}: elements overlap one another (a stride-0 or overlapping view, strides "
                f"{_strides(x)} for shape {tuple(x.shape)}); a written array needs one address per element"
            )
        mine = extents[name]
        if mine is None:
            continue
        for m, other in enumerate(names):
            # A pair of written arrays is tested once, from the first of the two.
            if other == name or (other in problem.WRITTEN and m < n):
                continue
            theirs = extents[other]
            if theirs is None or mine[1] <= theirs[0] or theirs[1] <= mine[0]:
                continue
            if memory.overlap(x, getattr(problem, other)):
                role = "write" if other in problem.WRITTEN else "read"
                fail(
                    f"{name}: shares memory with {other}, which this call also {role}s; pass separate "
                    "(non-overlapping) arrays"
                )


def _strides(x: Any) -> tuple[int, ...]:
    return tuple(x.stride()) if is_torch(x) else tuple(s // x.itemsize for s in x.strides)


def _unit_strided(x: Any) -> bool:
    strides = _strides(x)
    # A block table may step any distance between rows; along a row (and along a 1-D tensor)
    # the kernels step by one element.
    return len(x.shape) == 0 or x.shape[-1] <= 1 or strides[-1] == 1


def unit_index_strides(problem: Any) -> Any:
    """The problem with every index tensor that is not unit-strided replaced by a contiguous
    copy, for implementations declaring index_strides="unit" (SPEC.md section 11)."""
    changes = {}
    for name in problem.INDICES:
        x = getattr(problem, name)
        if x is not None and not _unit_strided(x):
            changes[name] = x.contiguous() if is_torch(x) else np.ascontiguousarray(x)
    return problem.replace(**changes) if changes else problem
