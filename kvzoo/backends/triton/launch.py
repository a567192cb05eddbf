"""A Triton launch bound once and relaunched with other tensors (the plan's per-layer path).

`kernel[grid](*args)` binds all of a kernel's parameters, computes their specialisation key
and looks the compiled kernel up again on every call; for the attention kernel's many arguments
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

import torch
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

    __slots__ = (
        "_kernel",
        "_grid",
        "_args",
        "_kwargs",
        "_slots",
        "_swaps",
        "_views",
        "_values",
        "_compiled",
        "_launch",
        "_head",
        "_stream",
        "_device",
    )
    # (_args: under the interpreter, the arguments relaunches start from; compiled, only the
    # tensors the bound addresses must keep alive.)

    def __init__(
        self, kernel: Any, grid: tuple[int, int, int], args: Sequence[Any], kwargs: dict[str, Any], slots: Slots
    ) -> None:
        self._kernel, self._grid, self._slots = kernel, tuple(grid), slots
        # The operands a relaunch swaps in (most slots of a launch are unused): (operand, positions).
        self._swaps = tuple((k, positions) for k, positions in enumerate(slots) if positions)
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
            # (it skips them): what JITFunction.run hands it. Tensors go in as their addresses:
            # the launcher asks the driver about every pointer passed as a tensor (to refuse
            # host memory), which costs more than the launch itself. The plan has checked the
            # devices, and self._args keeps the bound tensors alive.
            names = kernel.arg_names[len(self._args) :]
            defaults = {p.name: p.default for p in kernel.params}
            self._values = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in self._args]
            self._values += [self._kwargs.get(n, defaults[n]) for n in names]
            self._launch, self._head = _launcher(compiled)
            self._stream, self._device = driver.active.get_current_stream, driver.active.get_current_device
            # Kept alive: the bound tensors that are not the operands' (stand-ins at unused
            # slots share an operand's storage and are never dereferenced, so they are let go
            # with it: a launch kept for later calls must not hold a caller's cache).
            swapped = {i for positions in slots for i in positions}
            operand_storage = {self._args[i].untyped_storage().data_ptr() for i in swapped}
            self._args = [
                a
                for i, a in enumerate(self._args)
                if isinstance(a, torch.Tensor)
                and i not in swapped
                and a.untyped_storage().data_ptr() not in operand_storage
            ]
        else:
            self._values = self._args

    def relaunch(self, operands: Sequence[Any]) -> None:
        """Launch with `operands` (one per slot, None where the slot is unused) in place."""
        values = self._values.copy()
        compiled = self._compiled
        if compiled is None:
            for positions, x, views in zip(self._slots, operands, self._views):
                for i, dtype in zip(positions, views):
                    values[i] = x if x.dtype == dtype else x.view(dtype)
            self._kernel[self._grid](*values, **self._kwargs)
            return
        for k, positions in self._swaps:
            address = operands[k].data_ptr()
            for i in positions:
                values[i] = address
        stream = self._stream(self._device())
        enter, leave = _active(knobs.runtime.launch_enter_hook), _active(knobs.runtime.launch_exit_hook)
        # A profiler's enter hook wants the launch's metadata; without one it is not built.
        metadata = None if enter is None else compiled.launch_metadata(self._grid, stream, *values)
        grid = self._grid
        self._launch(
            grid[0],
            grid[1],
            grid[2],
            stream,
            compiled.function,
            *self._head,
            compiled.packed_metadata,
            metadata,
            enter,
            leave,
            *values,
        )


def _launcher(compiled: Any) -> tuple[Any, tuple]:
    """(launch, the arguments it takes between the kernel's function and its metadata).

    Triton's CUDA launcher object wraps a compiled C launch in a Python call that allocates
    scratch memory for kernels that use some; for one that uses none the C launch is called
    directly, with the launcher's own cooperative-grid and PDL flags and no scratch (Triton
    3.6's argument order). Any other launcher (ROCm's, a kernel with scratch) is called as is.
    """
    run = compiled.run
    direct = type(run).__name__ == "CudaLauncher" and all(
        getattr(run, name, 1) == 0 for name in ("global_scratch_size", "profile_scratch_size")
    )
    if not direct:
        return run, ()
    return run.launch, (run.launch_cooperative_grid, run.launch_pdl, None, None)


def _active(hook: Any) -> Any:
    # Triton 3.6 keeps hooks in a HookChain that is never None; an empty one is no hook (and
    # handing None spares the launcher a Python call per launch).
    if hook is None or not getattr(hook, "calls", True):
        return None
    return hook


def launch_nothing(operands: Sequence[Any]) -> None:
    """The prepared launch of a problem with no rows: nothing to run."""


def relaunch_all(launches: Sequence[BoundLaunch], operands: Sequence[Any]) -> None:
    for launch in launches:
        launch.relaunch(operands)
