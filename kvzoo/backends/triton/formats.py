"""The Triton backend's table of code formats (a plain module: importable without triton).

FORMATS maps each kvzoo.formats name the kernels implement to its row: the constexpr CODE the
kernels dispatch on, and the kernel family that takes caches of it. A format missing here, or
from a platform's set, is a mode the registration leaves out for that platform: a declared
refusal, never a KeyError inside a launch.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import NamedTuple

from ...modes import MODES
from ...registry import modes_for_formats

CODE_COPY = 0  # mode "none": rows are copied as bits
CODE_INT8 = 1
CODE_E4M3FN = 2
CODE_E4M3FNUZ = 3
# e4m3fn through the GPU's own cvt.rn.satfinite.e4m3x2.f32 (one instruction per two codes):
# RNE that saturates at +-448, so after the clamp the same bytes as CODE_E4M3FN's integer
# rounding (the conformance suite checks it on the GPU). sm_90+ only, never under the
# interpreter. An encoder-only code: caches and decoders see CODE_E4M3FN.
CODE_E4M3FN_CVT = 4
CODE_E5M2 = 5
# Packed rows with a zero point in the scale word (the INT4 family's).
CODE_UINT4 = 6


class Family(NamedTuple):
    """A kernel family: the modules of this package whose kernels take a format's caches, each
    with the entry points the registration calls. `attention`: run, prepare, workspace_bytes
    (attention_ops.py); `write`: reshape_and_cache, prepare_write, dequantize (write_ops.py).
    byte_keys: whether its kernels also take keys of one byte a code beside their own values
    (a split mode's pairing, its KEY_CODE), so that a split mode is data to them."""

    attention: str
    write: str
    byte_keys: bool = False


# Rows of one code or element a byte and mode "none": one set of kernels, dispatching on CODE.
PAGED = Family("attention_kernels", "write_kernels")
# Two codes a byte, rotated in the kernels, a zero point in the scale word: kernels of their own.
INT4 = Family("int4_attention", "int4_write", byte_keys=True)


class Format(NamedTuple):
    code: int
    family: Family


FORMATS: dict[str, Format] = {
    "int8": Format(CODE_INT8, PAGED),
    "float8_e4m3fn": Format(CODE_E4M3FN, PAGED),
    "float8_e4m3fnuz": Format(CODE_E4M3FNUZ, PAGED),
    "float8_e5m2": Format(CODE_E5M2, PAGED),
    "uint4": Format(CODE_UINT4, INT4),
}

# fp8 is e4m3fn on CUDA GPUs and e4m3fnuz on ROCm's MI300. e5m2 is an OCP format of NVIDIA's
# (sm_89+ convert it in hardware, every generation through fp16): MI300's own e5m2 is the fnuz
# variant, and vLLM's ROCm paged attention declines fp8_e5m2.
PLATFORM_FORMATS: dict[str, frozenset[str]] = {
    "cuda": frozenset({"int8", "float8_e4m3fn", "float8_e5m2", "uint4"}),
    "rocm": frozenset({"int8", "float8_e4m3fnuz", "uint4"}),
}


def code_of(mode) -> int:
    """The kernels' CODE for a mode's format."""
    return CODE_COPY if mode.format is None else FORMATS[mode.format.name].code


def platform_formats(platform: str) -> dict[str, int]:
    """The format table of one platform's kernels (name -> CODE)."""
    return {name: row.code for name, row in FORMATS.items() if name in PLATFORM_FORMATS[platform]}


def family_of(mode) -> Family:
    """The kernel family that takes `mode`'s caches (PAGED for mode "none"): its value side's, which
    for a split mode is one whose kernels take byte keys (platform_modes registers no other)."""
    return PAGED if mode.value_format is None else FORMATS[mode.value_format.name].family


def kernels(mode, part: str) -> ModuleType:
    """The module of `part` ("attention" or "write") of `mode`'s family, imported on first use:
    registering imports no triton."""
    return _module(getattr(family_of(mode), part))


@functools.cache
def _module(name: str) -> ModuleType:
    return importlib.import_module(f"{__package__}.{name}")


def platform_modes(platform: str, op: str) -> frozenset[str]:
    """The modes a platform's kernels register for op: those whose formats (each side's) its
    table holds; a split mode where its value side's family takes the keys' bytes (no other
    pairing has kernels: a declared refusal, not a failure inside a launch)."""
    modes = modes_for_formats(PLATFORM_FORMATS[platform] & FORMATS.keys(), op)
    return frozenset(name for name in modes if not MODES[name].split or _paired(MODES[name]))


def _paired(mode) -> bool:
    key = mode.key_format
    return family_of(mode).byte_keys and key is not None and FORMATS[key.name].family is PAGED
