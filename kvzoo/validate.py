"""The rules about one argument: kvzoo's vocabulary of checks.

Each rule raises KVZooInputError before anything is written, with a message that names the
argument and what was expected. Which rule applies to which argument of which operation is
kvzoo.calls' business; the rules here know nothing of operations. Only host_ints and
check_static_value read device memory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

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


def require_array(name: str, x: Any, fake: bool = False) -> None:
    """A tensor or array kvzoo can address: on the CPU or a GPU, not tracking gradients, in
    native byte order (kvzoo_spec/SPEC.md section 11). fake: a traced call's tensors, which
    may stand on the meta device."""
    if is_torch(x):
        if x.device.type not in _DEVICE_TYPES and not fake:
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


def require_ndim(name: str, x: Any, ndim: int, layout: str, fake: bool = False) -> None:
    require_array(name, x, fake)
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


def check_static(name: str, value: Any, like: Any) -> None:
    """A per-tensor scale's metadata: a one-element float32 array on like's device, or a real
    number whose float32 value is finite and > 0."""
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
    else:
        float32_scalar(name, value)


def static_array(value: Any, like: Any) -> Any:
    """A checked static scale as a float32 [1] array of like's kind and device."""
    if is_array(value):
        return value.reshape(1)
    array = same_kind_empty(like, (1,), "float32")
    # A NumPy scalar (np.float32) is a number here; a torch tensor takes it as a Python float.
    array[0] = float(value)
    return array


def check_static_value(name: str, array: Any) -> None:
    """A static scale's value (read from the device): finite and > 0."""
    s = float(host_ints(array)[0])
    if not (np.isfinite(s) and s > 0):  # a float32 already
        fail(f"{name}: expected a finite scale > 0, got {s}")


def static_scale(name: str, value: Any, like: Any, *, validate: bool) -> Any:
    """A per-tensor scale as a float32 [1] array of the same kind and device as `like`."""
    check_static(name, value, like)
    array = static_array(value, like)
    if validate:
        check_static_value(name, array)
    return array


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
