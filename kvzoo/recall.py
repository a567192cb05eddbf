"""What an unvalidated functional call remembers of the calls it has checked.

With validate=False, every check kvzoo makes of a call is a function of its arguments'
metadata alone: each array's type, dtype, shape, strides, device, gradient flag, writability
and 16-byte alignment, and the host scalars. A call whose metadata equals one already checked
passes the same checks with the same result, and the registry would choose the same
implementation; only the addresses differ, and what depends on them (whether a written array
meets another) is checked again on every call. So the API keeps, per metadata, what the
checked call resolved (the chosen implementation and its prepared launch), and a later call
of the same metadata goes from its arguments to the launch.

Remembered only where nothing of the call depends on device data (validate=False, the
attention bounds given as host ints, no check_finite) and where the checked call handed the
implementation the caller's own arrays (no uint8 cache viewed as codes, no static scale made
from a float, no index tensor copied): then the operands a later call hands on are its
arguments, as given. Anything else, and any metadata not met before, takes the full path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import memory

try:
    import torch
except ImportError:  # NumPy-only installs
    torch = None

_TENSOR = None if torch is None else torch.Tensor

# Kept per metadata, the oldest let go first (an engine meets a handful of shapes per model).
_MAX_ENTRIES = 256


def put_bounded(table: dict, key: Any, value: Any, limit: int) -> None:
    """table[key] = value, first letting go of the oldest entries while the table is full: a
    new signature costs one entry, not every launch prepared so far (a table cleared when full
    made a later layer of an engine re-prepare all of its launches at once)."""
    if key not in table:
        while len(table) >= limit:
            del table[next(iter(table))]
    table[key] = value


_SCALARS = (bool, int, float, str)


def call_key(values: Sequence[Any]) -> tuple | None:
    """Everything kvzoo's unvalidated checks read of a call's arguments (arrays and host
    scalars), or None when that cannot be told from metadata (a tensor subclass, an object of
    another kind). Runs on every unvalidated call: one loop, no call per argument."""
    keys = []
    for x in values:
        t = type(x)
        if t is _TENSOR:
            try:
                aligned = x.data_ptr() & 15 == 0
            except RuntimeError:  # no storage (a sparse tensor): the checked path refuses it by name
                return None
            # is_neg: a lazily negated view's memory is not its values (validate.require_array).
            keys.append((x.dtype, x.shape, x.stride(), x.device, x.requires_grad, aligned, x.is_neg()))
        elif x is None:
            keys.append(None)
        elif t in _SCALARS:
            # The type too: 1, 1.0 and True are equal keys but not equal arguments.
            keys.append((t, x))
        elif t is np.ndarray:
            address = x.__array_interface__["data"][0]
            keys.append((t, x.dtype, x.shape, x.strides, x.flags.writeable, address & 15 == 0))
        else:
            return None
    return tuple(keys)


def address(x: Any) -> int:
    """The address of x's element 0 (a tensor or a NumPy array)."""
    return x.data_ptr() if type(x) is _TENSOR else x.__array_interface__["data"][0]


def span(x: Any) -> tuple[int, int] | None:
    """[first, end) byte offsets from element 0 that x's elements occupy; None when empty."""
    extent = memory.byte_extent(x)
    if extent is None:
        return None
    start = address(x)
    return extent[0] - start, extent[1] - start


@dataclass(frozen=True)
class Resolved:
    """What a checked call resolved to, for later calls of its metadata.

    spans: per operand, its [first, end) byte offsets (None: absent or empty); written: the
    positions of the operands the call writes; meets: pairs (written, other) whose extents
    overlapped in the checked call and were found disjoint element by element, with the
    distance between their addresses then (the exact test depends on that and the metadata
    alone); launch: the implementation's prepared launch, or None to call run(problem) with a
    problem of the operands and host: the checked problem's fields that are not arrays.
    """

    held: Any
    chosen: Any
    launch: Any
    spans: tuple[tuple[int, int] | None, ...]
    written: tuple[int, ...]
    meets: dict[tuple[int, int], int]
    host: dict[str, Any]

    def disjoint(self, operands: Sequence[Any]) -> bool:
        """Whether the written operands meet no other operand, as in the checked call."""
        starts = [None if s is None or x is None else address(x) for x, s in zip(operands, self.spans)]
        for w in self.written:
            start = starts[w]
            if start is None:
                continue
            w_low, w_high = start + self.spans[w][0], start + self.spans[w][1]
            for o, other in enumerate(starts):
                if o == w or other is None:
                    continue
                o_low, o_high = other + self.spans[o][0], other + self.spans[o][1]
                if w_high <= o_low or o_high <= w_low:
                    continue
                if self.meets.get((w, o)) != start - other:
                    return False
        return True


_ENTRIES: dict[tuple, Resolved] = {}


def lookup(key: tuple | None, held: Any) -> Resolved | None:
    if key is None:
        return None
    entry = _ENTRIES.get(key)
    return entry if entry is not None and entry.held is held else None


def remember(
    key: tuple | None,
    held: Any,
    chosen: Any,
    launch: Any,
    operands: Sequence[Any],
    written: Sequence[int],
    host: dict[str, Any],
) -> None:
    """Keep what a checked call resolved to (operands: what its implementation was handed,
    which are the caller's own arrays; only their metadata is kept)."""
    if key is None:
        return
    spans = tuple(None if x is None else span(x) for x in operands)
    starts = [None if x is None else address(x) for x in operands]
    meets = {}
    for w in written:
        if spans[w] is None:
            continue
        for o, theirs in enumerate(spans):
            if o == w or theirs is None:
                continue
            # The checked call found these disjoint element by element (it would have refused
            # them otherwise): where their extents overlap, keep the distance that was tested.
            if not (
                starts[w] + spans[w][1] <= starts[o] + theirs[0] or starts[o] + theirs[1] <= starts[w] + spans[w][0]
            ):
                meets[(w, o)] = starts[w] - starts[o]
    put_bounded(_ENTRIES, key, Resolved(held, chosen, launch, spans, tuple(written), meets, host), _MAX_ENTRIES)


def forget() -> None:
    _ENTRIES.clear()
