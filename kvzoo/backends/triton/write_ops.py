"""Registers the Triton cache-write and dequantize kernels ("triton-cuda", "triton-rocm").

Nothing here imports triton: the kernels (write_kernels.py) are imported on first run, so a
machine without triton or a GPU still lists these implementations, with the reason they are
unavailable.
"""

from __future__ import annotations

from typing import Any

from ...modes import SCALE_FLOOR
from ...registry import Implementation, Registry
from . import platform

_INPUT_DTYPES = ("float32", "float16", "bfloat16")


def _dtype(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


def _write_reasons(name: str):
    def reasons(p: Any) -> list[str]:
        out = []
        for what in ("key", "value"):
            dt = _dtype(getattr(p, what))
            if dt not in _INPUT_DTYPES:
                out.append(f"{name}: {what} dtype {dt} is not one of {list(_INPUT_DTYPES)}")
        if p.mode.code_dtype is None:
            for rows, cache in (("key", "key_cache"), ("value", "value_cache")):
                a, b = _dtype(getattr(p, rows)), _dtype(getattr(p, cache))
                if a != b:
                    out.append(f"{name}: mode none copies bits, so {cache} dtype {b} must equal {rows} dtype {a}")
        return out

    return reasons


def _dequant_reasons(name: str):
    def reasons(p: Any) -> list[str]:
        if p.mode.code_dtype is None and _dtype(p.cache) not in _INPUT_DTYPES:
            return [f"{name}: cache dtype {_dtype(p.cache)} is not one of {list(_INPUT_DTYPES)}"]
        return []

    return reasons


def _run_write(p: Any) -> None:
    from . import write_kernels

    write_kernels.reshape_and_cache(p, float(SCALE_FLOOR))


def _run_dequantize(p: Any) -> None:
    from . import write_kernels

    write_kernels.dequantize(p)


def register(registry: Registry) -> None:
    for plat in platform.PLATFORMS:
        name = f"triton-{plat}"

        def unavailable(plat: str = plat) -> list[str]:
            return list(platform.unavailable_reasons(plat))

        for op, run, reasons in (
            ("reshape_and_cache", _run_write, _write_reasons(name)),
            ("dequantize", _run_dequantize, _dequant_reasons(name)),
        ):
            registry.add(
                Implementation(
                    name=name,
                    op=op,
                    platform=plat,
                    modes=platform.PLATFORM_MODES[plat],
                    run=run,
                    array_kind="torch",
                    devices=platform.devices(),
                    priority=platform.priority(),
                    unavailable=unavailable,
                    problem_reasons=reasons,
                    notes="rounding=trunc (int8), inline_layout, any strides",
                )
            )
