"""Where an array's elements lie in memory, and whether two arrays share any byte.

The public operations refuse a written array that overlaps itself or any other array of the
call (kvzoo_spec/SPEC.md section 11): a kernel writing through such a view races with itself
or reads what it has just written. Everything here reads metadata only (addresses, shapes,
strides), never device memory, so it runs with validate=False too.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .arrays import is_torch
from .errors import fail

# np.shares_memory solves a small integer program; layouts kvzoo meets (separate tensors,
# inline pages, slices) take a few steps. Past this many, overlap is assumed, not proven away.
_MAX_OVERLAP_WORK = 100_000


class _Addresses:
    """An array's address, shape and byte strides, in the form NumPy's overlap solver reads.

    NumPy never dereferences it: np.shares_memory only looks at the numbers, so device
    pointers are as good as host ones."""

    def __init__(self, pointer: int, shape: tuple[int, ...], byte_strides: tuple[int, ...], itemsize: int):
        self.__array_interface__ = {
            "data": (pointer, True),
            "shape": shape,
            "strides": byte_strides,
            "typestr": f"|V{itemsize}",
            "version": 3,
        }


def layout(x: Any) -> tuple[int, tuple[int, ...], tuple[int, ...], int]:
    """(address of element 0, shape, strides in bytes, itemsize) of a tensor or array."""
    if is_torch(x):
        itemsize = x.element_size()
        return x.data_ptr(), tuple(x.shape), tuple(s * itemsize for s in x.stride()), itemsize
    return int(x.__array_interface__["data"][0]), tuple(x.shape), tuple(x.strides), x.itemsize


def byte_extent(x: Any) -> tuple[int, int] | None:
    """[first, end) bytes any element of x occupies; None for an empty array."""
    # Runs for every array of every call: loops, not generators, and contiguous tensors
    # answered from their byte count.
    if is_torch(x):
        if x.numel() == 0:
            return None
        pointer = x.data_ptr()
        if x.is_contiguous():
            return pointer, pointer + x.nbytes
        itemsize, shape, strides = x.element_size(), x.shape, x.stride()
    else:
        if x.size == 0:
            return None
        pointer, itemsize, shape = int(x.__array_interface__["data"][0]), 1, x.shape
        strides = x.strides
    low = high = 0
    for n, s in zip(shape, strides):
        if s > 0:
            high += (n - 1) * s
        else:
            low += (n - 1) * s
    return pointer + low * itemsize, pointer + high * itemsize + (x.element_size() if is_torch(x) else x.itemsize)


def _same_memory_space(a: Any, b: Any) -> bool:
    # Host and device addresses, or two devices' addresses, never refer to the same bytes.
    da = a.device if is_torch(a) else "cpu"
    db = b.device if is_torch(b) else "cpu"
    return str(da) == str(db)


def overlap(a: Any, b: Any) -> bool:
    """Whether some byte belongs to an element of a and to an element of b."""
    if not _same_memory_space(a, b):
        return False
    ea, eb = byte_extent(a), byte_extent(b)
    if ea is None or eb is None or ea[1] <= eb[0] or eb[1] <= ea[0]:
        return False
    # The extents meet (views of one buffer, such as the inline page's four tensors): ask
    # which bytes the strides actually reach.
    pa, pb = np.asarray(_Addresses(*layout(a))), np.asarray(_Addresses(*layout(b)))
    try:
        return bool(np.shares_memory(pa, pb, max_work=_MAX_OVERLAP_WORK))
    except np.exceptions.TooHardError:
        return True


def refuse_shared(name: str, buffer: Any, problem: Any) -> None:
    """Refuse a buffer the call writes for itself (a workspace) sharing a byte with any of the
    problem's arrays."""
    for other, x in zip(problem.operand_names(), problem.operands()):
        if x is not None and overlap(buffer, x):
            fail(f"{name}: shares memory with {other}; pass a buffer of its own")


def self_overlap(x: Any) -> bool:
    """Whether two elements of x may share a byte: true unless its dimensions nest (sorted by
    stride, each stride spans all smaller dimensions), which every layout kvzoo allocates does.
    A stride-0 (broadcast) dimension of more than one element always overlaps."""
    if x.is_contiguous() if is_torch(x) else x.flags.c_contiguous:
        return False
    _, shape, strides, itemsize = layout(x)
    span = itemsize
    for n, s in sorted(((n, abs(s)) for n, s in zip(shape, strides) if n > 1), key=lambda d: d[1]):
        if s < span:
            return True
        span = s * (n - 1) + span
    return False
