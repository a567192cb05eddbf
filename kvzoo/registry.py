"""Which implementation runs an operation: (operation, quant mode, platform) -> implementations.

Backends are plugins: each backend module exposes `register(registry)` and adds
`Implementation` records; this module knows no backend by name. A backend whose dependency
is missing (no numba, no triton, no GPU) still registers, with `unavailable()` saying why;
one whose module fails to import is recorded under `import_errors`, never raised.

    >>> from kvzoo import registry
    >>> [i.name for i in registry.implementations("paged_attention")]
    >>> registry.best("reshape_and_cache", "int8_per_token_head", "cpu").name
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .errors import KVZooInputError
from .modes import QuantMode, get_kv_quant_mode
from .problem import OPS

# Backend modules, imported on first use of the default registry. Each has register(reg).
BACKEND_MODULES: tuple[str, ...] = (
    "kvzoo.backends.numpy_vectorized",
    "kvzoo.backends.numba_cpu",
    "kvzoo.backends.triton.write_ops",
    "kvzoo.backends.triton.attention_ops",
)


def _nothing_missing() -> list[str]:
    return []


def _takes_any_problem(problem: Any) -> list[str]:
    return []


@dataclass(frozen=True)
class Implementation:
    """One backend's implementation of one operation.

    run(problem) executes a validated problem whose arrays are of kind `array_kind`
    ("numpy": NumPy views, "torch": torch tensors) and writes its outputs in place.
    """

    name: str
    op: str
    platform: str  # "any" (NumPy), "cpu" (Numba), "cuda" / "rocm" (Triton)
    modes: frozenset[str]
    run: Callable[[Any], None]
    array_kind: str = "numpy"
    # Device types of the tensors it accepts ("cpu", "cuda").
    devices: frozenset[str] = frozenset({"cpu"})
    # Higher runs first when several take a problem.
    priority: int = 0
    # Why it cannot run on this machine at all (missing package, no GPU); [] when it can.
    unavailable: Callable[[], list[str]] = _nothing_missing
    # Why it cannot take this problem (beyond mode and device); [] when it can. It sees the
    # caller's arrays (torch tensors or NumPy arrays): read dtypes with kvzoo.arrays.dtype_name.
    problem_reasons: Callable[[Any], list[str]] = _takes_any_problem
    # Largest ||out - ref|| / ||ref|| against a float64 reference on the same quantized cache
    # (attention only): reflects the precision of its dot products.
    attention_rtol: float = 1e-5
    # How it reads index tensors (slot_mapping, block_tables, seq_lens, query_start_loc, sinks):
    # "any" through their strides; "unit" needs stride 1 along each 1-D tensor and along a
    # block-table row, and the API hands it contiguous copies of others (SPEC.md section 11).
    index_strides: str = "any"
    # Options it honours exactly (e.g. "rounding=trunc", "inline_layout"); informational.
    notes: str = ""

    def supports(self, problem: Any) -> list[str]:
        """Reasons this implementation cannot take `problem`; empty means it can."""
        reasons = list(self.unavailable())
        if problem.mode.name not in self.modes:
            reasons.append(f"{self.name}: mode {problem.mode.name!r} is not one of {sorted(self.modes)}")
        if problem.device not in self.devices:
            reasons.append(
                f"{self.name}: tensors on device {problem.device!r}, it takes {sorted(self.devices)}"
            )
        if not reasons:
            reasons.extend(self.problem_reasons(problem))
        return reasons

    @property
    def available(self) -> bool:
        return not self.unavailable()


class NoImplementationError(KVZooInputError, RuntimeError):
    """No implementation takes the call (or the one named cannot): raised before any write."""


@dataclass
class Registry:
    """A table of implementations. Tests may build their own; `default()` holds the real one."""

    _impls: list[Implementation] = field(default_factory=list)
    import_errors: dict[str, str] = field(default_factory=dict)

    def add(self, impl: Implementation) -> None:
        if impl.op not in OPS:
            raise ValueError(f"op: {impl.op!r} is not one of {OPS}")
        if any(i.name == impl.name and i.op == impl.op for i in self._impls):
            raise ValueError(f"implementation {impl.name!r} of {impl.op!r} is already registered")
        self._impls.append(impl)

    def load(self, modules: Iterable[str]) -> Registry:
        for module_name in modules:
            try:
                importlib.import_module(module_name).register(self)
            except Exception as exc:  # a broken backend must not break the others
                self.import_errors[module_name] = f"{type(exc).__name__}: {exc}"
        return self

    def implementations(self, op: str | None = None, mode: str | QuantMode | None = None) -> list[Implementation]:
        mode_name = None if mode is None else get_kv_quant_mode(mode).name
        return [
            i
            for i in self._impls
            if (op is None or i.op == op) and (mode_name is None or mode_name in i.modes)
        ]

    def get(self, op: str, name: str) -> Implementation:
        for i in self._impls:
            if i.op == op and i.name == name:
                return i
        known = sorted({i.name for i in self._impls if i.op == op})
        raise KVZooInputError(f"impl: no implementation named {name!r} for {op}; registered: {known}")

    def candidates(self, op: str, mode: str | QuantMode, device: str) -> list[Implementation]:
        """Available implementations of op for mode on device, fastest first."""
        mode_name = get_kv_quant_mode(mode).name
        found = [
            i
            for i in self.implementations(op, mode_name)
            if device in i.devices and i.available
        ]
        return sorted(found, key=lambda i: -i.priority)

    def best(self, op: str, mode: str | QuantMode, device: str = "cpu") -> Implementation:
        found = self.candidates(op, mode, device)
        if not found:
            raise NoImplementationError(self._explain(op, mode, device))
        return found[0]

    def select(self, problem: Any, op: str, impl: str | Implementation | None = None) -> Implementation:
        """The implementation to run `problem`: the one named (or given), or the fastest that takes it."""
        if impl is not None:
            chosen = impl if isinstance(impl, Implementation) else self.get(op, impl)
            if chosen.op != op:
                raise ValueError(f"impl: {chosen.name!r} implements {chosen.op}, not {op}")
            reasons = chosen.supports(problem)
            if reasons:
                raise NoImplementationError(
                    f"impl={chosen.name!r} cannot run this {op} call: " + "; ".join(reasons)
                )
            return chosen
        all_reasons: list[str] = []
        for candidate in sorted(self.implementations(op), key=lambda i: -i.priority):
            reasons = candidate.supports(problem)
            if not reasons:
                return candidate
            all_reasons.extend(reasons)
        raise NoImplementationError(
            f"no implementation of {op} takes this call:\n  " + "\n  ".join(all_reasons)
            + self._import_note()
        )

    def _explain(self, op: str, mode: Any, device: str) -> str:
        lines = [f"no available implementation of {op} for mode {mode} on {device}:"]
        for i in self.implementations(op):
            why = i.unavailable() or (
                [f"mode not in {sorted(i.modes)}"] if get_kv_quant_mode(mode).name not in i.modes else []
            ) or ([f"takes devices {sorted(i.devices)}"] if device not in i.devices else [])
            lines.append(f"  {i.name}: {'; '.join(why) or 'ok'}")
        return "\n".join(lines) + self._import_note()

    def _import_note(self) -> str:
        if not self.import_errors:
            return ""
        return "\n  backends that failed to import: " + "; ".join(
            f"{m}: {e}" for m, e in self.import_errors.items()
        )


_default: Registry | None = None


def default() -> Registry:
    """The process-wide registry with every backend in BACKEND_MODULES loaded."""
    global _default
    if _default is None:
        _default = Registry().load(BACKEND_MODULES)
    return _default


def implementations(op: str | None = None, mode: str | QuantMode | None = None) -> list[Implementation]:
    return default().implementations(op, mode)


def best(op: str, mode: str | QuantMode, device: str = "cpu") -> Implementation:
    return default().best(op, mode, device)


def get(op: str, name: str) -> Implementation:
    return default().get(op, name)
