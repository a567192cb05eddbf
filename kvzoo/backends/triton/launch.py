"""A Triton launch bound once and relaunched with other tensors (the plan's per-layer path).

`kernel[grid](*args)` binds all of a kernel's parameters, computes their specialisation key
and looks the compiled kernel up again on every call; for the 70-parameter attention kernel
that is most of an eager call's host time (bench/host_cost.py). The layers of one engine step
differ only in their tensors, so a plan binds each launch once and each layer swaps its own
tensors into the argument list and calls the compiled kernel's launcher directly.

What stays the caller's to guarantee: each new tensor has the dtype, shape, strides and
16-byte alignment of the one it replaces (Triton specialises on alignment and on integer
values such as strides, so any other tensor would need another compiled kernel). kvzoo's plan
keys its bound launches on exactly those (kvzoo/plan.py), and falls back to a full launch
for anything else.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from triton import knobs
from triton.runtime import driver

from .platform import interpreted

# Positions in a launch's positional arguments that one named operand fills ((), unused).
Slots = tuple[tuple[int, ...], ...]


class BoundLaunch:
    """One kernel launch, compiled and bound: relaunch(operands) swaps the operand tensors in.

    kernel: a @triton.jit function; grid, args, kwargs: the launch as `kernel[grid](*args,
    **kwargs)` would make it (constexprs and launch options in kwargs); slots: for each
    operand, the positions of args it fills (pointer arguments only).
    """

    __slots__ = ("_kernel", "_grid", "_args", "_kwargs", "_slots", "_views", "_values", "_compiled", "_launch")

    def __init__(self, kernel: Any, grid: tuple[int, int, int], args: Sequence[Any], kwargs: dict[str, Any],
                 slots: Slots) -> None:
        self._kernel, self._grid, self._slots = kernel, tuple(grid), slots
        self._args, self._kwargs = list(args), dict(kwargs)
        # The interpreter reads a tensor through its dtype: an operand viewed for the kernel
        # (bf16 rows as int16 bits, fp8 codes as bytes) is viewed the same way on relaunch.
        self._views = tuple(tuple(self._args[i].dtype for i in positions) for positions in slots)
        self._compiled = None
        if not interpreted():
            compiled = kernel.warmup(*self._args, grid=self._grid, **self._kwargs)
            if hasattr(compiled, "result"):  # compiled asynchronously
                compiled = compiled.result()
            self._compiled = compiled
            # The launcher takes every parameter in signature order, constexprs included
            # (it skips them): what JITFunction.run hands it.
            names = kernel.arg_names[len(self._args):]
            defaults = {p.name: p.default for p in kernel.params}
            self._values = self._args + [self._kwargs.get(n, defaults[n]) for n in names]
            self._launch = compiled.run
        else:
            self._values = self._args

    def relaunch(self, operands: Sequence[Any]) -> None:
        """Launch with `operands` (one per slot, None where the slot is unused) in place."""
        values = self._values.copy()
        compiled = self._compiled
        for positions, x, views in zip(self._slots, operands, self._views):
            for i, dtype in zip(positions, views):
                # The compiled launcher reads only the address, which a view does not change.
                values[i] = x if compiled is not None or x.dtype == dtype else x.view(dtype)
        if compiled is None:
            self._kernel[self._grid](*values, **self._kwargs)
            return
        device = driver.active.get_current_device()
        stream = driver.active.get_current_stream(device)
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        # A profiler's enter hook wants the launch's metadata; without one it is not built.
        metadata = None if enter is None else compiled.launch_metadata(self._grid, stream, *values)
        grid = self._grid
        self._launch(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata, metadata,
                     enter, leave, *values)


def relaunch_all(launches: Sequence[BoundLaunch], operands: Sequence[Any]) -> None:
    for launch in launches:
        launch.relaunch(operands)
