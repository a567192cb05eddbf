"""One table: a call's signature -> what its checks concluded, the implementation chosen for it,
and the launches it prepared. `run(record)` is the one path every call takes: the functional
API's (a one-shot plan), a plan's layers' and the torch ops'.

A signature is everything kvzoo's metadata checks read of a call (kvzoo.calls): each array's
type, dtype, shape, strides, device, gradient flag, lazy negation, writability and 16-byte
alignment (Triton specialises its pointers on it), each host scalar with its type, and whether
a cache shares its buffer with its scales (the inline page, an option the registry chooses
by). The checks are a function of it, and so is the registry's choice: a call of a signature
met before skips both and forms its arrays as the first call did. What its addresses decide
is asked again on every call: whether an array it writes meets another (memory.Placement
answers that from the addresses alone, where the arrays stand as they stood before). A launch
is kept per signature and host fields (attention's bounds), which a prepared launch
(Implementation.prepare) is bound to.

An entry is kept for the object the call names (an Implementation, or the default registry,
and its generation), held weakly: an implementation made for one workspace takes its entries
with it when it goes. A call whose signature cannot be told from metadata (a tensor subclass,
an argument of another type) is checked in full every time and kept nowhere.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
from cachetools import FIFOCache

from . import memory
from . import registry as _registry
from .arrays import as_numpy, as_torch, is_torch, torch
from .calls import Facts, Geometry, arrays, check, check_values
from .capabilities import shares_buffer
from .modes import MODES, QuantMode
from .problem import Attention, CacheWrite, Dequantize

_TENSOR = None if torch is None else torch.Tensor
_SCALARS = (bool, int, float, str)

_RecordType = type[CacheWrite] | type[Attention] | type[Dequantize]

# Per record type, the (cache, scale cache) operand positions whose buffer sharing is part of
# the signature: no metadata of either tells the inline page from separate tensors.
_SHARED: dict[_RecordType, tuple[tuple[int, int], ...]] = {
    CacheWrite: ((2, 5), (3, 6)),
    Attention: ((1, 7),),
    Dequantize: ((0, 5),),
}


def signature(values: Any, shared: tuple = (), arrays: int = 0) -> tuple | None:
    """Everything kvzoo's metadata checks read of these values (a record, or any tuple of
    arrays and host scalars), or None when that cannot be told from metadata (a tensor
    subclass, an object of another kind). A number among the first `arrays` values (a static
    scale given as a float) is told by its type: each call checks its value (calls.arrays).
    Runs on every call: one loop, no call per value."""
    keys: list[Any] = []
    for n, x in enumerate(values):
        t = type(x)
        if t is _TENSOR:
            try:
                aligned = x.data_ptr() & 15 == 0
            except RuntimeError:  # no storage (a sparse tensor): the checks refuse it by name
                return None
            # is_neg: a lazily negated view's memory is not its values (validate.require_array).
            keys.append((x.dtype, x.shape, x.stride(), x.device, x.requires_grad, aligned, x.is_neg()))
        elif x is None:
            keys.append(None)
        elif t in _SCALARS:
            # The type too: 1, 1.0 and True are equal keys but not equal arguments.
            keys.append((t, x) if n >= arrays else t)
        elif t is np.ndarray:
            address = x.__array_interface__["data"][0]
            keys.append((t, x.dtype, x.shape, x.strides, x.flags.writeable, address & 15 == 0))
        elif t is QuantMode and MODES.get(x.name) is x:
            # kvzoo's own modes, by name (equal names parse to them); another object declines.
            # (`... is x` narrows x to MODES.get's QuantMode | None for mypy: x.name was just read.)
            keys.append(x.name)  # type: ignore[union-attr]
        else:
            return None
    for cache, scales in shared:
        keys.append(shares_buffer(values[cache], values[scales]))
    return tuple(keys)


class Adapter:
    """How the chosen implementation takes a call's arrays: its array kind (NumPy views of CPU
    tensors, torch views of NumPy arrays) and, for one that steps through index tensors at
    unit stride, contiguous copies of those that are not (SPEC.md section 11). Decided by the
    signature, done per call."""

    __slots__ = ("convert", "convert_at", "copy_at")

    def __init__(self, chosen: _registry.Implementation, record: Any) -> None:
        numpy_kind = chosen.array_kind == "numpy"
        self.convert = as_numpy if numpy_kind else as_torch
        operands = record.operands()
        self.convert_at = tuple(n for n, x in enumerate(operands) if x is not None and is_torch(x) == numpy_kind)
        self.copy_at = ()
        if chosen.index_strides == "unit":
            names = type(record).ARRAYS
            self.copy_at = tuple(
                names.index(name)
                for name in record.INDICES
                if getattr(record, name) is not None and not _unit_strided(getattr(record, name))
            )

    def __call__(self, operands: tuple) -> tuple:
        if not self.convert_at and not self.copy_at:
            return operands
        adapted = list(operands)
        convert = self.convert
        for at in self.convert_at:
            adapted[at] = convert(adapted[at])
        for at in self.copy_at:
            x = adapted[at]
            adapted[at] = x.contiguous() if is_torch(x) else np.ascontiguousarray(x)
        return tuple(adapted)


def _unit_strided(x: Any) -> bool:
    strides = x.stride() if is_torch(x) else tuple(s // x.itemsize for s in x.strides)
    # A block table may step any distance between rows; along a row (and along a 1-D tensor)
    # the kernels step by one element.
    return len(x.shape) == 0 or x.shape[-1] <= 1 or strides[-1] == 1


def unit_index_strides(record: Any) -> Any:
    """The record with every index tensor that is not unit-strided replaced by a contiguous
    copy, for implementations declaring index_strides="unit" (SPEC.md section 11)."""
    changes = {}
    for name in record.INDICES:
        x = getattr(record, name)
        if x is not None and not _unit_strided(x):
            changes[name] = x.contiguous() if is_torch(x) else np.ascontiguousarray(x)
    return record.replace(**changes) if changes else record


class Resolved:
    """A signature's entry: what its metadata check concluded (facts), the implementation
    chosen (None: the one the call names, `held`), how that takes the arrays (adapt), where
    the first call's arrays stood (placement), and its launches by host fields (None: the
    implementation prepares none, and runs the record)."""

    __slots__ = ("held", "facts", "chosen", "adapt", "placement", "launches")

    def __init__(
        self,
        held: _registry.Implementation | _registry.Registry,
        facts: Facts,
        chosen: _registry.Implementation,
        adapt: Adapter,
        placement: memory.Placement,
    ) -> None:
        self.held = weakref.ref(held)
        self.facts, self.adapt, self.placement = facts, adapt, placement
        # The implementation the call named is reached through `held`: held here, it would
        # keep itself (and the workspace it was made for) alive.
        self.chosen = None if chosen is held else chosen
        self.launches: FIFOCache[tuple, Any] = FIFOCache(maxsize=_MAX_LAUNCHES)


# Signatures kept, the oldest let go first (an engine meets a handful per model), and launches
# per signature (attention's bounds change with each decode step). First in, first out: a full
# table lets go of its oldest entry for a new one, not of every launch prepared so far (a table
# cleared when full made a later layer of an engine re-prepare all of its launches at once).
_MAX_ENTRIES = 256
_MAX_LAUNCHES = 16
_TABLE: FIFOCache[tuple, Resolved] = FIFOCache(maxsize=_MAX_ENTRIES)
_WATCHED: set[int] = set()
_MISSING = object()


def _drop(held_id: int) -> None:
    _WATCHED.discard(held_id)
    for key in [k for k in _TABLE if k[1] == held_id]:
        del _TABLE[key]


def lookup(key: tuple, held: Any) -> Resolved | None:
    """The entry kept under key for the object held (None when there is none)."""
    entry = _TABLE.get(key)
    return entry if entry is not None and entry.held() is held else None


def forget() -> None:
    """Let go of every entry (tests; an entry never outlives what it was made for anyway)."""
    _TABLE.clear()


def run(
    record: Any,
    impl: str | _registry.Implementation | None = None,
    validate: bool = True,
    *,
    geometry: Geometry | None = None,
    check_finite: bool = False,
) -> tuple[tuple, tuple | None, Resolved | None, Any]:
    """Check, choose, prepare (or recall all three) and run one call record.

    Returns (its arrays as checked, as the implementation took them, the signature's entry,
    the launch run or None); the last three None where nothing ran (no query rows)."""
    reg = _registry.default()
    named = impl if isinstance(impl, _registry.Implementation) else None  # the call names one
    held = reg if named is None else named
    shared, width = _LAYOUT[type(record)]
    sig = signature(record, shared, width)
    key = entry = None
    if sig is not None:
        key = (record.OP, id(held), impl if isinstance(impl, str) else None, reg.generation, geometry, sig)
        entry = lookup(key, held)
    facts = entry.facts if entry is not None else check(record, geometry)
    operands = arrays(record, facts)
    host, operands = check_values(record, facts, operands, validate, check_finite)
    if facts.empty:
        return operands, None, None, None
    workspace = None if named is None else getattr(named.options, "workspace", None)
    placed = operands if workspace is None else (*operands, workspace)
    checked = None
    if entry is None or not entry.placement.clear(placed):
        checked = tuple.__new__(type(record), (*operands, *host))
        memory.check_aliasing(checked)
        if workspace is not None:
            # The caller's buffer is written by the call: it must meet none of its arrays.
            memory.refuse_shared("workspace", workspace, checked)
    if entry is None:
        chosen = reg.select(checked, record.OP, impl)
        written = _WRITTEN[type(record)] + ((width,) if workspace is not None else ())
        entry = Resolved(held, facts, chosen, Adapter(chosen, checked), memory.Placement(placed, written))
        if key is not None:
            if held is not reg and id(held) not in _WATCHED:
                _WATCHED.add(id(held))
                weakref.finalize(held, _drop, id(held))
            _TABLE[key] = entry
    # The registry's entries keep what it chose; a named implementation's is the one named.
    picked = entry.chosen if entry.chosen is not None else named
    assert picked is not None
    chosen = picked
    adapted = entry.adapt(operands)
    # The mode is the signature's: the launch is told by the rest (attention's bounds).
    bounds = host[1:]
    launch = entry.launches.get(bounds, _MISSING)
    if launch is _MISSING:
        if chosen.prepare is None:
            launch = None
        else:
            launch = chosen.prepare(tuple.__new__(type(record), (*adapted, *host)))
        entry.launches[bounds] = launch
    if launch is not None:
        launch(adapted)
    else:
        chosen.run(tuple.__new__(type(record), (*adapted, *host)))
    return operands, adapted, entry, launch


# Per record type: its (cache, scale cache) pairs whose buffer sharing the signature holds,
# its number of arrays, and the positions of those it writes.
_LAYOUT: dict[_RecordType, tuple[tuple[tuple[int, int], ...], int]] = {
    cls: (_SHARED[cls], len(cls.ARRAYS)) for cls in _SHARED
}
_WRITTEN: dict[_RecordType, tuple[int, ...]] = {cls: tuple(cls.ARRAYS.index(n) for n in cls.WRITTEN) for cls in _SHARED}
