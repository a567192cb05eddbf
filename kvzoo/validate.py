"""Argument checks shared by the public operations.

Every check raises before anything is written, with a message that names the argument and
what was expected. Checks that must read device memory (slot and block id ranges, sequence
bookkeeping) run only when the caller asks for validation, so a validated-off call performs no
host synchronisation and can be captured in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .arrays import as_numpy, device_type, dtype_name, is_array, is_torch, same_kind_empty, torch
from .modes import QuantMode

FLOAT_INPUTS = ("float32", "float16", "bfloat16")
INDEX_DTYPES = ("int32", "int64")


class KVZooInputError(ValueError):
    """A public call got an argument it cannot take; nothing was written."""


def fail(message: str) -> None:
    raise KVZooInputError(message)


def require_array(name: str, x: Any) -> None:
    if not is_array(x):
        fail(f"{name}: expected a torch.Tensor or numpy.ndarray, got {type(x).__name__}")


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
    key = _device_key(first)
    if any(_device_key(x) != key for _, x in arrays):
        listing = ", ".join(f"{n} on {_device_key(x)}" for n, x in arrays)
        fail(f"all tensors must be on one device; got {listing}")
    return device_type(first)


def _device_key(x: Any) -> Any:
    # torch.device compares equal to torch.device, and "cpu" to a CPU device.
    return x.device if is_torch(x) else _CPU


_CPU = "cpu" if torch is None else torch.device("cpu")


def require_no_negative_strides(name: str, x: Any) -> None:
    strides = x.stride() if is_torch(x) else x.strides
    if any(s < 0 for s in strides):
        fail(f"{name}: negative strides are not supported (got strides {tuple(strides)})")


def code_dtypes(mode: QuantMode) -> tuple[str, ...]:
    """Cache dtypes accepted for a quantized mode: the code dtype or raw bytes (vLLM keeps
    fp8 caches as uint8)."""
    assert mode.code_dtype is not None
    return (mode.code_dtype, "uint8")


def host_ints(x: Any) -> np.ndarray:
    """Values of a small index tensor on the host (synchronises a GPU tensor)."""
    if is_torch(x):
        return as_numpy(x.detach().to("cpu"))
    return np.asarray(x)


def static_scale(name: str, value: Any, like: Any, *, validate: bool) -> Any:
    """A per-tensor scale as a float32 [1] array of the same kind and device as `like`."""
    if value is None:
        fail(f"{name}: required for fp8_per_tensor (the caller's static scale)")
    if is_array(value):
        if int(np.prod(value.shape)) != 1:
            fail(f"{name}: expected one element, got shape {tuple(value.shape)}")
        require_dtype(name, value, ("float32",))
        if device_type(value) != device_type(like):
            fail(f"{name}: on {device_type(value)}, expected {device_type(like)} like the cache")
        array = value.reshape(1)
    else:
        try:
            number = float(value)
        except (TypeError, ValueError):
            fail(f"{name}: expected a positive float or float32 [1] tensor, got {type(value).__name__}")
        array = same_kind_empty(like, (1,), "float32")
        array[0] = number
    if validate:
        s = float(host_ints(array)[0])
        if not (np.isfinite(s) and s > 0):
            fail(f"{name}: expected a finite scale > 0, got {s}")
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
