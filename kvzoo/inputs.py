"""Seeded fresh inputs, value distributions, poisoning and byte comparisons: what the
conformance suite, the sample problems (kvzoo.samples), the tests and bench/ draw from.

Every run draws new inputs: the session seed is random unless KVZOO_SEED is set; it is printed
(pytest header, `kvzoo check`) so a failure can be replayed.
"""

from __future__ import annotations

import os
import secrets
import zlib
from typing import Any

import ml_dtypes
import numpy as np
import torch

from .arrays import as_numpy, as_torch, numpy_dtype, torch_dtype
from .modes import QuantMode, rht_block_sizes, rht_blocks, rht_signs

SEED = int(os.environ.get("KVZOO_SEED", secrets.randbits(32)))

DISTRIBUTIONS = ("normal", "outliers", "tiny", "midpoints", "specials")
INPUT_DTYPES = ("bfloat16", "float16", "float32")

_DTYPE_LIMITS = {  # (largest finite, smallest subnormal)
    "float32": (float(np.finfo(np.float32).max), float(np.finfo(np.float32).smallest_subnormal)),
    "float16": (65504.0, 2.0**-24),
    "bfloat16": (float(ml_dtypes.finfo(ml_dtypes.bfloat16).max), 2.0**-133),
}


def rng_for(*key: Any) -> np.random.Generator:
    """A generator seeded by the session seed and a stable hash of the test's key."""
    return np.random.default_rng([SEED, zlib.crc32(repr(key).encode())])


def midpoint_targets(mode: QuantMode, rng: np.random.Generator, n: int) -> np.ndarray:
    """Values of y = x / scale lying exactly halfway between two codes (and beside them)."""
    assert mode.format is not None  # a mode with codes
    mids = rng.choice(mode.format.midpoints(), n)
    nudge = rng.choice([0.0, 0.0, 1.0, -1.0], n)
    mids32 = mids.astype(np.float32)
    toward = np.where(nudge > 0, np.float32(np.inf), np.float32(-np.inf))
    return np.where(nudge == 0, mids32, np.nextafter(mids32, toward))


def make_rows(
    mode: QuantMode,
    dist: str,
    dtype: str,
    shape: tuple[int, ...],
    rng: np.random.Generator,
    static_scale: float | None = None,
) -> np.ndarray:
    """float32 values (exactly representable in dtype after a cast) with a given character."""
    *lead, d = shape
    rows = int(np.prod(lead)) if lead else 1
    if dist == "normal":
        x = rng.standard_normal((rows, d)) * rng.choice([0.05, 1.0, 30.0])
    elif dist == "outliers":
        x = rng.standard_t(2.0, (rows, d))
        channels = rng.choice(d, size=max(1, d // 16), replace=False)
        x[:, channels] *= rng.uniform(20, 200)
    elif dist == "tiny":
        # absmax / QMAX below the scale floor, down to the input dtype's subnormals.
        x = rng.standard_normal((rows, d)) * rng.choice([1e-5, 1e-7, 1e-4])
    elif dist == "midpoints":
        x = _midpoint_rows(mode, rng, rows, d, static_scale)
    elif dist == "specials":
        x = _special_rows(dtype, rng, rows, d)
    else:
        raise ValueError(dist)
    x = x.astype(np.float32).reshape(shape)
    return to_dtype_exact(x, dtype)


def _midpoint_rows(mode, rng, rows, d, static_scale):
    if mode.code_dtype is None:
        return rng.standard_normal((rows, d))
    if mode.format.row_zero_point:
        return _zero_point_midpoint_rows(mode, rng, rows, d)
    y = midpoint_targets(mode, rng, rows * d).reshape(rows, d).astype(np.float64)
    if mode.per_tensor:
        return y * static_scale
    # A row whose absmax is QMAX * 2^k has scale exactly 2^k, so x / scale lands on y.
    power = 2.0 ** rng.integers(-3, 3, (rows, 1))
    y[:, 0] = mode.qmax * rng.choice([-1, 1], rows)
    return y * power


def _zero_point_midpoint_rows(mode, rng, rows, d):
    """Rows whose y = r / scale + zp land on the rounding midpoints (and beside them) for a
    format with a per-row zero point (SPEC.md 3.5): r spans exactly [-zp, qmax - qmin - zp]
    times 2^k, so scale is 2^k and zp comes out as drawn; for float32 inputs of a rotated mode
    the row given is the exact inverse rotation of that, so that the rotation gives it back."""
    fmt = mode.format
    steps = fmt.qmax - fmt.qmin
    zero_points = rng.integers(0, int(steps) + 1, (rows, 1)).astype(np.float64)
    power = 2.0 ** rng.integers(-3, 3, (rows, 1))
    y = midpoint_targets(mode, rng, rows * d).reshape(rows, d).astype(np.float64)
    # A nudged target's r rounds to the input dtype: it then lands beside the midpoint, where
    # the float32 add of zp decides (0.5 - 2^-25 with zp 0 gives code 1, SPEC.md 3.5).
    r = (y - zero_points) * power
    r[:, 0] = -zero_points[:, 0] * power[:, 0]
    r[:, 1 % d] = (steps - zero_points[:, 0]) * power[:, 0]
    if mode.rotation is None:
        return r
    # R^-1 r = s * (H r) / B, exact in float32: sums of a few significant bits over a power of two.
    h = np.zeros((d, d))
    for offset, n in rht_blocks(d):
        block = np.array([[1.0]])
        while block.shape[0] < n:
            block = np.block([[block, block], [block, -block]])
        h[offset : offset + n, offset : offset + n] = block
    return (r @ h.T) * rht_signs(d).astype(np.float64) / rht_block_sizes(d)


def _special_rows(dtype, rng, rows, d):
    big, sub = _DTYPE_LIMITS[dtype]
    x = rng.standard_normal((rows, d))
    for r in range(rows):
        kind = rng.integers(0, 8)
        pos = rng.integers(0, d, size=max(1, d // 8))
        if kind == 0:
            x[r, pos] = np.nan
        elif kind == 1:
            x[r, pos] = np.inf
        elif kind == 2:
            x[r, pos] = -np.inf
        elif kind == 3:
            x[r] = rng.choice([0.0, -0.0], d)
        elif kind == 4:
            x[r] = rng.integers(-3, 4, d) * sub  # subnormals and signed zeros
        elif kind == 5:
            x[r, pos] = big * rng.choice([-1, 1], len(pos))
        elif kind == 6:
            x[r] = rng.choice([0.0, -0.0], d)
            x[r, pos] = rng.integers(-3, 4, len(pos)) * sub
        # kind 7: an ordinary row between the special ones
    return x


def to_dtype_exact(x32: np.ndarray, dtype: str) -> np.ndarray:
    """Round float32 values to dtype and widen back, so rows are exact in the input dtype."""
    with np.errstate(over="ignore"):
        return x32.astype(numpy_dtype(dtype)).astype(np.float32)


def tensor(values32: np.ndarray, dtype: str, device: str, kind: str = "torch") -> Any:
    """values (float32, exactly representable) as a tensor/array of dtype on device."""
    t = torch.from_numpy(np.ascontiguousarray(values32)).to(torch_dtype(dtype))
    if kind == "numpy":
        return as_numpy(t)
    return t.to(device)


def random_bytes(rng: np.random.Generator, shape: tuple[int, ...], dtype: str, device: str, kind: str) -> Any:
    """Poison: an array of dtype filled with random bytes (never zeros)."""
    itemsize = numpy_dtype(dtype).itemsize
    raw = rng.integers(1, 256, size=(*shape, itemsize), dtype=np.uint8)
    arr = raw.view(numpy_dtype(dtype)).reshape(shape)
    if kind == "numpy":
        return arr
    return as_torch(arr).to(device)


def host_bytes(x: Any) -> np.ndarray:
    """Element bytes of an array in logical order, as uint8 [..., itemsize]."""
    a = as_numpy(x.detach().cpu()) if isinstance(x, torch.Tensor) else np.asarray(x)
    a = np.ascontiguousarray(a)
    return a.view(np.uint8).reshape(*a.shape, a.dtype.itemsize) if a.ndim else a.view(np.uint8)


def host_float32(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().float().cpu().numpy()
    return np.asarray(x).astype(np.float32)


def assert_same_bytes(actual: Any, expected: Any, what: str) -> None:
    """Raw-byte equality with a report of the first differing elements."""
    a, e = host_bytes(actual), host_bytes(expected)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != expected {e.shape}"
    diff = np.any(a != e, axis=-1) if a.ndim > 1 else a != e
    if diff.any():
        where = np.argwhere(diff)[:5]
        shown = "; ".join(
            f"{tuple(int(i) for i in w)}: got {a[tuple(w)].tobytes().hex()} want {e[tuple(w)].tobytes().hex()}"
            for w in where
        )
        raise AssertionError(f"{what}: {int(diff.sum())} of {diff.size} elements differ (seed {SEED}); {shown}")


def device_for(impl: Any) -> str:
    return "cuda" if "cuda" in impl.devices else "cpu"
