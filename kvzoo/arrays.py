"""Zero-copy views between torch tensors and NumPy arrays, and dtype names shared by both.

Backends receive arrays of one kind (NumPy for the CPU backends, torch for Triton); these
views let a write through the backend's array land in the caller's storage.
"""

from __future__ import annotations

import warnings
from typing import Any, TypeAlias, TypeGuard, TypeVar

import ml_dtypes
import numpy as np

from .formats import FORMATS

try:
    import torch
except ImportError:  # torch is optional for NumPy-only users
    torch = None  # type: ignore[assignment]

# What kvzoo's calls take for an array argument: a NumPy array, or a torch tensor (CPU or GPU).
# A string, so that it names torch.Tensor without importing torch where it is not installed.
Array: TypeAlias = "torch.Tensor | np.ndarray"
# One of the two, the same for every use in a signature (an array made like another is of its kind).
ArrayT = TypeVar("ArrayT", bound="torch.Tensor | np.ndarray")

# Canonical dtype names used across kvzoo (errors, problems, registry checks).
_NUMPY_DTYPES: dict[str, Any] = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8),
    "int16": np.dtype(np.int16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "float64": np.dtype(np.float64),
    # Every code format's storage dtype (the float8 ones are ml_dtypes types).
    **{f.storage_dtype: np.dtype(getattr(ml_dtypes, f.storage_dtype)) for f in FORMATS.values() if f.kind == "float"},
}
# dtypes NumPy has only through ml_dtypes, which torch.from_numpy / .numpy() cannot take: they
# cross between the two as same-width integers.
_THROUGH_CARRIER = frozenset({"bfloat16", *(f.storage_dtype for f in FORMATS.values() if f.kind == "float")})
# Same-width unsigned/signed ints used to move dtypes NumPy and torch do not share.
_CARRIER = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


# These run dozens of times per call (argument checks), where eager callers pay for them.
# type[Any]: an isinstance check against them leaves the argument's type open (torch.Tensor or
# np.ndarray, by which tuple), where tuple[type, ...] would narrow it to object.
_TENSOR: tuple[type[Any], ...] = (torch.Tensor,) if torch is not None else ()
_ARRAY: tuple[type[Any], ...] = (np.ndarray, *_TENSOR)
_TORCH_DTYPE_NAMES: dict[Any, str] = {}
_NUMPY_DTYPE_NAMES: dict[Any, str] = {}


def require_torch(what: str, alternative: str = "") -> Any:
    """The torch module, or an error saying in one line that `what` needs it and how to get it
    (kvzoo itself runs without torch: NumPy arrays and the NumPy implementation)."""
    if torch is None:
        from .errors import KVZooInputError

        raise KVZooInputError(
            f"{what} needs torch, which is not installed: pip install 'kvzoo[cpu]' (CPU) or 'kvzoo[triton]' (GPU)"
            + (f"; {alternative}" if alternative else "")
        )
    return torch


def is_torch(x: object) -> TypeGuard[torch.Tensor]:
    return isinstance(x, _TENSOR)


def is_array(x: Any) -> bool:
    return isinstance(x, _ARRAY)


def dtype_name(x: Any) -> str:
    """Canonical name of an array's dtype ("bfloat16", "float8_e4m3fn", ...)."""
    if isinstance(x, _TENSOR):
        name = _TORCH_DTYPE_NAMES.get(x.dtype)
        if name is None:
            name = _TORCH_DTYPE_NAMES[x.dtype] = str(x.dtype).removeprefix("torch.")
        return name
    # np.dtype.name is computed in Python on every read (about 2.5 us): named once per dtype.
    name = _NUMPY_DTYPE_NAMES.get(x.dtype)
    if name is None:
        name = _NUMPY_DTYPE_NAMES[x.dtype] = np.dtype(x.dtype).name
    return name


def numpy_dtype(name: str) -> np.dtype:
    return _NUMPY_DTYPES[name]


def torch_dtype(name: str) -> Any:
    return getattr(torch, name)


def device_type(x: Any) -> str:
    """'cpu', 'cuda' (also ROCm tensors, which torch calls cuda) for a torch tensor or array."""
    return x.device.type if is_torch(x) else "cpu"


CPU_DEVICE: Any = "cpu" if torch is None else torch.device("cpu")


def device_of(x: Any) -> Any:
    """What one call's arrays must share: a tensor's torch.device (its index included), and the
    CPU's for a NumPy array, so a NumPy array and a CPU tensor compare equal."""
    return x.device if is_torch(x) else CPU_DEVICE


def as_numpy(x: Any) -> np.ndarray:
    """A NumPy view of a CPU tensor or array (no copy; strides kept)."""
    if isinstance(x, np.ndarray):
        return x
    if not is_torch(x):
        return np.asarray(x)
    if x.device.type != "cpu":
        raise ValueError(f"expected a CPU tensor for a NumPy backend, got device {x.device}")
    name = dtype_name(x)
    if name in _THROUGH_CARRIER:
        carrier = _CARRIER[x.element_size()]
        return x.view(torch_dtype(carrier)).numpy().view(numpy_dtype(name))
    return x.numpy()


def as_torch(x: Any) -> torch.Tensor:
    """A torch view of a NumPy array or tensor (no copy; strides kept)."""
    if is_torch(x):
        return x
    x = np.asarray(x)
    if any(s < 0 for s in x.strides):
        # torch has no negative strides. Only arrays a call reads get here (the API refuses
        # written ones with negative strides), so a copy loses nothing.
        x = x.copy()  # not ascontiguousarray: a negative stride on a length-1 dim stays there
    if not x.flags.writeable:
        # Likewise read-only: only read arrays get here. torch would warn that it cannot
        # mark the tensor read-only; nothing writes through it.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return _from_numpy(x)
    return _from_numpy(x)


def _from_numpy(x: np.ndarray) -> torch.Tensor:
    name = x.dtype.name
    if name in _THROUGH_CARRIER:
        carrier = _CARRIER[x.dtype.itemsize]
        return torch.from_numpy(x.view(numpy_dtype(carrier))).view(torch_dtype(name))
    return torch.from_numpy(x)


def same_kind_empty(like: ArrayT, shape: tuple[int, ...], dtype: str) -> ArrayT:
    """An uninitialised array of the same kind (and device) as `like`."""
    made: Any  # like's kind, ArrayT (which mypy does not narrow by the kind of like)
    if is_torch(like):
        made = torch.empty(shape, dtype=torch_dtype(dtype), device=like.device)
    else:
        made = np.empty(shape, dtype=numpy_dtype(dtype))
    return made
