"""Which implementation runs an operation: (operation, quant mode, device) -> implementations.

Backends are plugins, and this module imports none of them itself: `default()` loads the
modules named in BACKEND_MODULES (the built-in ones, kept there as data) and every entry point
of the group ``kvzoo.backends``; `kvzoo check --backend-module MOD` adds one that is not installed.

The plugin contract:

- A backend is a module exposing ``register(registry)``, which calls ``registry.add()`` with one
  `Implementation` per operation it provides (name, op, platform, modes, devices, priority, run).
- An installed distribution announces it with an entry point whose value is that module, or a
  callable taking the registry::

      [project.entry-points."kvzoo.backends"]
      mine = "mypackage.kvzoo_backend"            # or "mypackage.kvzoo_backend:register"

- ``unavailable()`` says why the implementation cannot run on this machine at all (a missing
  package, no GPU); it is still registered, so `kvzoo list` shows the reason. Availability is
  probed once per (op, mode, device) and remembered until the next add()/load()/invalidate().
  An optional ``probe()`` answers the same without importing heavy modules (torch), or None
  where it cannot: `kvzoo list` asks it first (`listed_unavailable`), selection never does.
- ``problem_reasons(problem)`` says why it cannot take one call that its modes and devices
  allow (an option it lacks, a head size it has no kernel for); selection then falls to the next
  implementation by priority, and an error lists every reason if none takes the call.
- A module (or entry point) that fails to import or register is recorded in ``import_errors``,
  never raised: one broken backend must not take the others down.

Once registered, an implementation is listed by `kvzoo list`, chosen by `Registry.select()`
when its priority is highest among those that take a call, and run by the conformance suite
(`kvzoo.conformance.matrix(reg)`, `kvzoo check`).

    >>> import numpy as np, kvzoo
    >>> from kvzoo.registry import Implementation, Registry
    >>> def register(registry: Registry) -> None:
    ...     registry.add(Implementation(
    ...         name="zeros", op="dequantize", platform="any", modes=frozenset({"int8_per_token_head"}),
    ...         run=lambda p: p.out.fill(0.0), priority=5,
    ...         problem_reasons=lambda p: [] if p.cache.shape[-1] <= 256 else ["zeros: head_size > 256"]))
    >>> reg = Registry()
    >>> register(reg)
    >>> [i.name for i in reg.candidates("dequantize", "int8_per_token_head", "cpu")]
    ['zeros']
    >>> float(kvzoo.dequantize(np.ones((1, 2, 1, 4), np.int8), np.ones((1, 2, 1), np.float32),
    ...                        mode="int8_per_token_head", impl=reg.get("dequantize", "zeros")).max())
    0.0
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from .capabilities import Capabilities, required
from .errors import KVZooInputError, did_you_mean
from .modes import MODES, QuantMode, get_kv_quant_mode
from .problem import OPS

# The built-in backends, imported on first use of the default registry. Each has register(reg).
BACKEND_MODULES: tuple[str, ...] = (
    "kvzoo.backends.numpy_vectorized",
    "kvzoo.backends.numba_cpu",
    "kvzoo.backends.triton.write_ops",
    "kvzoo.backends.triton.attention_ops",
)
# Installed distributions add backends under this entry-point group.
ENTRY_POINT_GROUP = "kvzoo.backends"

# The registry's choices: which implementation ran a call (DEBUG), and why a faster one did not (INFO).
log = logging.getLogger(__name__)


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
    # run(problem), or run(problem, options=...) for an implementation with an option_type.
    run: Callable[..., None]
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
    # fp8_dots (SPEC.md 8.3): the key tile its probabilities are rounded per, where that is one
    # fixed tile; the conformance suite then also holds it to the oracle with that tile, at
    # attention_rtol. None: it varies by launch (only the exact-probability bound applies).
    probability_tile: int | None = None
    # How it reads index tensors (slot_mapping, block_tables, seq_lens, query_start_loc, sinks):
    # "any" through their strides; "unit" needs stride 1 along each 1-D tensor and along a
    # block-table row, and the API hands it contiguous copies of others (SPEC.md section 11).
    index_strides: str = "any"
    # What it takes beyond modes and devices: call options, largest head size, input dtypes,
    # and its table of code formats (kvzoo.capabilities). supports() and the conformance
    # suite both decide from it.
    capabilities: Capabilities = field(default_factory=Capabilities)
    # The frozen dataclass of choices it takes with a call (a path to force, a workspace
    # bound), or None; `options` is the instance run receives as run(problem, options=...).
    option_type: type | None = None
    options: Any = None
    # The host-side plan hook: prepare(problem) does once what run(problem) would redo on every
    # call (choosing configs, binding kernel arguments) and returns launch(arrays), which runs a
    # problem equal to this one but for its arrays (problem.operands(), in operand_names()
    # order), each with the dtype, shape, strides, device and 16-byte alignment of the one it
    # replaces; or None for a problem it does not prepare. The engine-step plan prepares once per
    # step and launches per layer; the functional API keeps prepared launches by that signature.
    # Neither asks problem_reasons again for a problem of a signature it has prepared, so an
    # implementation with a prepare hook decides its reasons from the signature alone.
    # A launch may also carry hold(operands, varying): a launch for the calls of one engine-step
    # layer, whose operands are `operands`' objects at every position but those named in
    # `varying` (the call's own arrays); their contents may change between calls (a kept step
    # refills its metadata in place), never their objects. It does once what those objects
    # alone decide (views, records), and returns None where it cannot hold any of it.
    # None: every call goes through run.
    prepare: Callable[..., Callable[[tuple], None] | None] | None = None
    # workspace_bytes(problem, options=...): bytes of the caller-given workspace a call of the
    # problem takes (an option of its option_type named `workspace`); None: it takes none.
    workspace_bytes: Callable[..., int] | None = None
    # A line for `kvzoo list`; informational.
    notes: str = ""
    # unavailable() where it can be told without importing a heavy module (torch, triton), for
    # `kvzoo list` (listed_unavailable); it returns None where only unavailable() can tell.
    # None here: `kvzoo list` asks unavailable(). Selection always asks unavailable().
    probe: Callable[[], list[str] | None] | None = None

    def with_options(self, **choices: Any) -> Implementation:
        """This implementation with typed options set, to pass as impl= with a call::

        impl = registry.get("paged_attention", "triton-cuda").with_options(prefill="direct")
        kvzoo.paged_attention(..., impl=impl)
        """
        if self.option_type is None:
            raise KVZooInputError(f"impl: {self.name} ({self.op}) takes no options, got {sorted(choices)}")
        try:
            options = dataclasses.replace(self.options or self.option_type(), **choices)
        except TypeError as bad:
            names = [f.name for f in dataclasses.fields(self.option_type)]
            raise KVZooInputError(f"impl: {self.name} options are {names}: {bad}") from None
        changes: dict[str, Any] = {"run": functools.partial(self._unwrapped(self.run), options=options)}
        if self.prepare is not None:
            changes["prepare"] = functools.partial(self._unwrapped(self.prepare), options=options)
        return dataclasses.replace(self, options=options, **changes)

    def _unwrapped(self, hook: Callable[..., Any]) -> Callable[..., Any]:
        # Unwrap only the partial an earlier with_options made: a backend's own run may be one too.
        if self.options is not None and isinstance(hook, functools.partial):
            return hook.func
        return hook

    def __post_init__(self) -> None:
        # Every registered mode's format must be in the declared table, so a format the
        # backend lacks is a mode it leaves out, never a KeyError inside its kernel.
        missing = [
            m
            for m in self.modes
            if m in MODES
            and any(
                fmt is not None and fmt.name not in self.capabilities.formats
                for fmt in (MODES[m].key_format, MODES[m].value_format)
            )
        ]
        if missing and self.capabilities.formats:
            raise ValueError(f"{self.name}: registers {sorted(missing)} without their formats in capabilities.formats")

    def supports(self, problem: Any) -> list[str]:
        """Reasons this implementation cannot take `problem`; empty means it can."""
        reasons = list(self.unavailable())
        if problem.mode.name not in self.modes:
            reasons.append(f"{self.name}: mode {problem.mode.name!r} is not one of {sorted(self.modes)}")
        if problem.device not in self.devices:
            reasons.append(f"{self.name}: tensors on device {problem.device!r}, it takes {sorted(self.devices)}")
        if not reasons:
            reasons.extend(self.capabilities.reasons(self.name, required(problem)))
        if not reasons:
            reasons.extend(self.problem_reasons(problem))
        return reasons

    @property
    def available(self) -> bool:
        return not self.unavailable()

    def listed_unavailable(self) -> list[str]:
        """What `kvzoo list` shows: the probe's reasons where it can tell, else unavailable()'s."""
        told = self.probe() if self.probe is not None else None
        return self.unavailable() if told is None else told


def modes_for_formats(formats: Iterable[str], op: str) -> frozenset[str]:
    """The modes a backend can register for op whose table of code formats holds `formats`
    (kvzoo.formats names): those whose formats are in it, each side's where keys and values are
    stored in two (a split mode pairs two one-sided modes), mode "none" having none. dequantize
    reads one cache in one side's mode, so no split mode is one of its modes (kvzoo.calls
    refuses one, naming the sides' modes to pass instead)."""
    table = frozenset(formats)
    return frozenset(
        m.name
        for m in MODES.values()
        if all(f is None or f.name in table for f in (m.key_format, m.value_format))
        and not (op == "dequantize" and m.split)
    )


def prepared_signature(arrays: Iterable[Any]) -> tuple:
    """What a prepared launch is specialised on, per array: dtype, shape, strides, device and
    whether its address is 16-byte aligned (Triton's pointer specialisation); None where absent."""
    # Runs on every prepared call: one loop, tensors first.
    signature: list[tuple[Any, ...] | None] = []
    for a in arrays:
        if a is None:
            signature.append(None)
        elif hasattr(a, "data_ptr"):
            signature.append((a.dtype, a.shape, a.stride(), a.device, a.data_ptr() & 15 == 0))
        else:
            signature.append((a.dtype, a.shape, a.strides, "cpu", a.ctypes.data & 15 == 0))
    return tuple(signature)


class NoImplementationError(KVZooInputError, RuntimeError):
    """No implementation takes the call (or the one named cannot): raised before any write."""


@dataclass
class Registry:
    """A table of implementations. Tests may build their own; `default()` holds the real one."""

    _impls: list[Implementation] = field(default_factory=list)
    import_errors: dict[str, str] = field(default_factory=dict)
    # Sources (module names, entry-point values) already loaded: naming one twice, say as an
    # entry point and as --backend-module, must not fail on its second registration.
    _sources: set[str] = field(default_factory=set, repr=False, compare=False)
    # (op, mode name, device) -> available implementations, highest priority first. Every call
    # through the API selects, so the filter and sort are not redone per call.
    _ranked: dict[tuple[str, str, str], tuple[Implementation, ...]] = field(
        default_factory=dict, repr=False, compare=False
    )
    generation: int = field(default=0, repr=False, compare=False)

    def add(self, impl: Implementation) -> None:
        if impl.op not in OPS:
            raise ValueError(f"op: {impl.op!r} is not one of {OPS}")
        if any(i.name == impl.name and i.op == impl.op for i in self._impls):
            raise ValueError(f"implementation {impl.name!r} of {impl.op!r} is already registered")
        self._impls.append(impl)
        self.invalidate()

    def load(self, modules: Iterable[str]) -> Registry:
        """Import each module and call its register(self); failures go to import_errors."""
        for module_name in modules:
            self._load_source(module_name, functools.partial(importlib.import_module, module_name))
        return self

    def load_entry_points(self, group: str = ENTRY_POINT_GROUP) -> Registry:
        """Load every installed entry point of `group` (a module, or a callable register(registry))."""
        try:
            entry_points = list(importlib.metadata.entry_points(group=group))
        except Exception as exc:  # unreadable metadata of one distribution must not stop kvzoo
            self.import_errors[f"entry points {group}"] = f"{type(exc).__name__}: {exc}"
            return self
        for ep in entry_points:
            self._load_source(ep.value, ep.load)
        return self

    def _load_source(self, source: str, load: Callable[[], Any]) -> None:
        if source in self._sources:
            return
        try:
            target = load()
            register = target.register if isinstance(target, ModuleType) else target
            if not callable(register):
                raise TypeError(f"{source} is neither a module with register(registry) nor a callable")
            register(self)
            self._sources.add(source)
        except Exception as exc:  # a broken backend must not break the others
            self.import_errors[source] = f"{type(exc).__name__}: {exc}"
        self.invalidate()

    def invalidate(self) -> None:
        """Forget remembered availability, e.g. after setting KVZOO_DISABLE_NUMBA in-process."""
        self._ranked.clear()
        # What callers remember from this registry (the functional API's prepared launches)
        # is keyed on this.
        self.generation += 1

    def copy(self) -> Registry:
        """A registry with the same implementations, to load more into without touching this one."""
        return Registry(list(self._impls), dict(self.import_errors), set(self._sources))

    def implementations(self, op: str | None = None, mode: str | QuantMode | None = None) -> list[Implementation]:
        mode_name = None if mode is None else get_kv_quant_mode(mode).name
        return [i for i in self._impls if (op is None or i.op == op) and (mode_name is None or mode_name in i.modes)]

    def get(self, op: str, name: str) -> Implementation:
        for i in self._impls:
            if i.op == op and i.name == name:
                return i
        known = sorted({i.name for i in self._impls if i.op == op})
        raise KVZooInputError(
            f"impl: no implementation named {name!r} for {op}{did_you_mean(name, known)}; registered: {known}"
        )

    def _candidates(self, op: str, mode_name: str, device: str) -> tuple[Implementation, ...]:
        # The one ordering and filter behind candidates(), best() and select().
        key = (op, mode_name, device)
        ranked = self._ranked.get(key)
        if ranked is None:
            found = [i for i in self.implementations(op, mode_name) if device in i.devices and i.available]
            # sorted() is stable: equal priorities keep registration order.
            ranked = self._ranked[key] = tuple(sorted(found, key=lambda i: -i.priority))
        return ranked

    def candidates(self, op: str, mode: str | QuantMode, device: str) -> list[Implementation]:
        """Available implementations of op for mode on device, highest priority first."""
        return list(self._candidates(op, get_kv_quant_mode(mode).name, device))

    def best(self, op: str, mode: str | QuantMode, device: str = "cpu") -> Implementation:
        """The first candidate for (op, mode, device) without looking at a problem.

        What select() picks for a call that every candidate takes; a call that the first one
        declines (problem_reasons) goes to the next. Prefer select(problem, op) to run a call.
        """
        found = self._candidates(op, get_kv_quant_mode(mode).name, device)
        if not found:
            raise NoImplementationError(self._explain(op, mode, device))
        return found[0]

    def select(self, problem: Any, op: str, impl: str | Implementation | None = None) -> Implementation:
        """The implementation to run `problem`: the one named (or given), or the first candidate
        for its mode and device that takes it."""
        if impl is not None:
            chosen = impl if isinstance(impl, Implementation) else self.get(op, impl)
            if chosen.op != op:
                raise ValueError(f"impl: {chosen.name!r} implements {chosen.op}, not {op}")
            reasons = chosen.supports(problem)
            if reasons:
                raise NoImplementationError(f"impl={chosen.name!r} cannot run this {op} call: " + "; ".join(reasons))
            return chosen
        # supports(), not problem_reasons() alone: it is where an implementation's every
        # condition on a call lives, and a candidate's availability may have changed since.
        passed: list[str] = []
        for candidate in self._candidates(op, problem.mode.name, problem.device):
            reasons = candidate.supports(problem)
            if not reasons:
                if passed:
                    # A faster implementation declined this call: it runs on a slower one.
                    log.info("%s (%s on %s): %s, since %s", op, problem.mode.name, problem.device,
                             candidate.name, "; ".join(passed))  # fmt: skip
                elif log.isEnabledFor(logging.DEBUG):
                    log.debug("%s (%s on %s): %s, the first of %s", op, problem.mode.name, problem.device,
                              candidate.name, [c.name for c in self._candidates(op, problem.mode.name, problem.device)])  # fmt: skip
                return candidate
            passed.extend(reasons)
        all_reasons = [
            r for i in sorted(self.implementations(op), key=lambda i: -i.priority) for r in i.supports(problem)
        ]
        raise NoImplementationError(
            f"no implementation of {op} takes this call:\n  " + "\n  ".join(all_reasons) + self._import_note()
        )

    def _explain(self, op: str, mode: Any, device: str) -> str:
        lines = [f"no available implementation of {op} for mode {mode} on {device}:"]
        for i in self.implementations(op):
            why = (
                i.unavailable()
                or ([f"mode not in {sorted(i.modes)}"] if get_kv_quant_mode(mode).name not in i.modes else [])
                or ([f"takes devices {sorted(i.devices)}"] if device not in i.devices else [])
            )
            lines.append(f"  {i.name}: {'; '.join(why) or 'ok'}")
        return "\n".join(lines) + self._import_note()

    def _import_note(self) -> str:
        if not self.import_errors:
            return ""
        return "\n  backends that failed to import: " + "; ".join(f"{m}: {e}" for m, e in self.import_errors.items())


_default: Registry | None = None


def default() -> Registry:
    """The process-wide registry: the built-in BACKEND_MODULES, then installed entry points."""
    global _default
    if _default is None:
        _default = Registry().load(BACKEND_MODULES).load_entry_points()
    return _default


def implementations(op: str | None = None, mode: str | QuantMode | None = None) -> list[Implementation]:
    return default().implementations(op, mode)


def best(op: str, mode: str | QuantMode, device: str = "cpu") -> Implementation:
    """Registry.best() on the default registry: no problem looked at; prefer select()."""
    return default().best(op, mode, device)


def get(op: str, name: str) -> Implementation:
    return default().get(op, name)
