"""Registers the Triton cache-write and dequantize kernels ("triton-cuda", "triton-rocm").

Nothing here imports triton: the kernels (write_kernels.py; int4's in int4_write.py, the
family formats.py's table names for each format) are imported on first run, so a machine
without triton or a GPU still lists these implementations, with the reason they are unavailable.
"""

from __future__ import annotations

import functools
from typing import Any

from ...capabilities import Capabilities
from ...modes import SCALE_FLOOR
from ...registry import Implementation, Registry
from . import platform
from .formats import kernels, platform_formats


def _run_write(p: Any) -> None:
    kernels(p.mode, "write").reshape_and_cache(p, float(SCALE_FLOOR))


def _prepare_write(p: Any):
    return kernels(p.mode, "write").prepare_write(p, float(SCALE_FLOOR))


def _run_dequantize(p: Any) -> None:
    kernels(p.mode, "write").dequantize(p)


def register(registry: Registry) -> None:
    for plat in platform.PLATFORMS:
        name = f"triton-{plat}"

        def unavailable(plat: str = plat) -> list[str]:
            return list(platform.unavailable_reasons(plat))

        # Input dtypes and mode none's equal dtypes are checked once, in kvzoo.api; these
        # kernels take every call that passes there.
        for op, run, prepare in (
            ("reshape_and_cache", _run_write, _prepare_write),
            ("dequantize", _run_dequantize, None),
        ):
            registry.add(
                Implementation(
                    name=name,
                    op=op,
                    platform=plat,
                    modes=platform.PLATFORM_MODES[plat, op],
                    run=run,
                    prepare=prepare,
                    array_kind="torch",
                    # The kernels step through index tensors one element at a time.
                    index_strides="unit",
                    devices=platform.devices(),
                    priority=platform.priority(),
                    unavailable=unavailable,
                    probe=functools.partial(platform.probe, plat),
                    capabilities=Capabilities(formats=platform_formats(plat)),
                    notes="rounding=trunc (int8), inline_layout, any strides",
                )
            )
