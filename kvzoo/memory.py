"""Where an array's elements lie in memory, and whether two arrays share any byte.

The public operations refuse a written array that overlaps itself or any other array of the
call (kvzoo_spec/SPEC.md section 11): a kernel writing through such a view races with itself
or reads what it has just written. Everything here reads metadata only (addresses, shapes,
strides), never device memory, so it runs with validate=False too.
"""

from __future__ import annotations

from collections.abc import Sequence
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
        # numpy's stub takes only -1 and 0 for max_work; a positive bound is documented and works.
        return bool(np.shares_memory(pa, pb, max_work=_MAX_OVERLAP_WORK))  # type: ignore[arg-type]
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


def check_aliasing(problem: Any) -> None:
    """Refuse a written array that overlaps itself, another written array or an array the call
    reads (SPEC.md section 11). Metadata only: no device read, so it runs unvalidated too."""
    names = problem.array_fields()
    # Runs on every call: each extent is computed once, and only arrays whose extents meet
    # (views of one buffer) go on to the exact test.
    extents = {name: byte_extent(getattr(problem, name)) for name in names}
    for n, name in enumerate(names):
        if name not in problem.WRITTEN:
            continue
        x = getattr(problem, name)
        if self_overlap(x):
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
            if overlap(x, getattr(problem, other)):
                role = "write" if other in problem.WRITTEN else "read"
                fail(
                    f"{name}: shares memory with {other}, which this call also {role}s; pass separate "
                    "(non-overlapping) arrays"
                )


def _strides(x: Any) -> tuple[int, ...]:
    return tuple(x.stride()) if is_torch(x) else tuple(s // x.itemsize for s in x.strides)


def address(x: Any) -> int:
    """The address of x's element 0 (a tensor or a NumPy array)."""
    return x.__array_interface__["data"][0] if type(x) is np.ndarray else x.data_ptr()


def span(x: Any) -> tuple[int, int] | None:
    """[first, end) byte offsets from element 0 that x's elements occupy; None when empty."""
    extent = byte_extent(x)
    if extent is None:
        return None
    start = address(x)
    return extent[0] - start, extent[1] - start


class Placement:
    """Where a checked call's arrays lay relative to each other, for later calls of its metadata.

    Whether two arrays share a byte depends on their metadata and on the distance between
    their addresses alone. A call found clear keeps, per array, the byte span its elements
    occupy from its element 0 (spans: None where absent or empty), the positions of the arrays
    it writes, and for each (written, other) pair whose spans overlapped at the distance they
    stood at then, that distance (the exact test passed there). A later call of the same
    metadata is then clear where every such pair either does not overlap or stands at that
    distance again: `clear` answers from addresses alone, with no exact test.
    """

    __slots__ = ("spans", "written", "meets")

    def __init__(self, arrays: Sequence[Any], written: Sequence[int]) -> None:
        self.spans = tuple(None if x is None else span(x) for x in arrays)
        self.written = tuple(written)
        # A start is None exactly where its span is (a missing array), which the loops skip.
        starts: list[Any] = [None if x is None else address(x) for x in arrays]
        self.meets: dict[tuple[int, int], int] = {}
        for w in self.written:
            mine = self.spans[w]
            if mine is None:
                continue
            for o, theirs in enumerate(self.spans):
                if o == w or theirs is None:
                    continue
                if not (starts[w] + mine[1] <= starts[o] + theirs[0] or starts[o] + theirs[1] <= starts[w] + mine[0]):
                    self.meets[(w, o)] = starts[w] - starts[o]

    def clear(self, arrays: Sequence[Any]) -> bool:
        """Whether the written arrays meet no other array, as in the call this was kept from."""
        # As in __init__: a span is None only where its start is, which the loops skip.
        spans: tuple[Any, ...] = self.spans
        starts = [None if s is None or x is None else address(x) for x, s in zip(arrays, spans)]
        for w in self.written:
            start = starts[w]
            if start is None:
                continue
            w_low, w_high = start + spans[w][0], start + spans[w][1]
            for o, other in enumerate(starts):
                if o == w or other is None:
                    continue
                o_low, o_high = other + spans[o][0], other + spans[o][1]
                if w_high <= o_low or o_high <= w_low:
                    continue
                if self.meets.get((w, o)) != start - other:
                    return False
        return True
