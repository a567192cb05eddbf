"""Flat views: any strided array as (1-D contiguous view of its memory, offset, strides).

Kernels index flat[offset + i0*s0 + i1*s1 + ...] with strides in elements. Passing memory this
way keeps the number of compiled specializations small (one array type per element width,
whatever the layout) and writes land in the caller's storage.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ...formats import FORMATS
from .formats import BF16, F16, F32, FORMAT_KINDS, I8

# dtype name -> (element kind, unsigned carrier dtype the kernels receive): the model dtypes,
# and the storage dtype of every format in the backend's table. A cache's kind comes from its
# mode's format (FORMAT_KINDS), not from here: one storage dtype (uint8) holds several formats.
KINDS: dict[str, tuple[int, type]] = {
    **{FORMATS[name].storage_dtype: (kind, np.uint8) for name, kind in FORMAT_KINDS.items()},
    "uint8": (I8, np.uint8),
    "float32": (F32, np.uint32),
    "bfloat16": (BF16, np.uint16),
    "float16": (F16, np.uint16),
}


def stride_problem(name: str, a: np.ndarray) -> str | None:
    """Why `a` cannot be passed as a flat view, or None."""
    if any(s % a.itemsize for s in a.strides):
        return f"numba: {name} has strides {a.strides} that are not multiples of its itemsize {a.itemsize}"
    return None


def flat(a: np.ndarray, carrier: type | None = None) -> tuple[np.ndarray, tuple[int, ...]]:
    """(flat view, (offset, *strides)) with offset/strides counted in elements.

    carrier reinterprets the elements (same width), e.g. bfloat16 -> uint16.
    """
    itemsize = a.itemsize
    strides = tuple(s // itemsize for s in a.strides)
    if a.size == 0:
        empty = np.empty(1, dtype=carrier or a.dtype)
        return empty, (0, *strides)
    if a.flags.c_contiguous:
        # The common case, a few times cheaper than the general one below (as_strided alone
        # costs microseconds per call); the same memory, offset 0 and the same strides.
        base = a.reshape(-1)
        return (base if carrier is None or base.dtype == np.dtype(carrier) else base.view(carrier)), (0, *strides)
    # Start the flat view at the lowest-addressed element so negative strides work too.
    low = a[tuple(slice(n - 1, n) if s < 0 else slice(0, 1) for n, s in zip(a.shape, strides))]
    offset = sum((n - 1) * -s for n, s in zip(a.shape, strides) if s < 0)
    extent = 1 + sum((n - 1) * abs(s) for n, s in zip(a.shape, strides))
    if carrier is not None and low.dtype != np.dtype(carrier):
        # Before as_strided: it rebuilds the array from its typestr, which NumPy cannot read
        # back for ml_dtypes' float8_e5m2 ('<f1').
        low = low.view(carrier)
    base = as_strided(low, shape=(extent,), strides=(itemsize,))
    return base, (offset, *strides)


def flat_view(a: np.ndarray, carrier: type) -> np.ndarray:
    """flat(a, carrier)'s view alone: what a prepared launch needs per call, the strides being
    its signature's. The contiguous case skips flat's stride arithmetic."""
    if a.flags.c_contiguous and a.size:
        return a.reshape(-1).view(carrier)
    return flat(a, carrier)[0]
