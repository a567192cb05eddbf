"""The Triton backend's table of code formats (a plain module: importable without triton).

Kernels dispatch on the constexpr CODE; FORMAT_CODES maps each kvzoo.formats name the kernels
implement to it. A format missing here, or from a platform's set, is a mode the registration
leaves out for that platform: a declared refusal, never a KeyError inside a launch.
"""

from __future__ import annotations

from ...modes import MODES

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
# Packed rows with a zero point in the scale word: their own kernels (int4_write.py,
# int4_attention.py), to which write_kernels and attention_ops hand the modes using it.
CODE_UINT4 = 6

FORMAT_CODES: dict[str, int] = {
    "int8": CODE_INT8,
    "float8_e4m3fn": CODE_E4M3FN,
    "float8_e4m3fnuz": CODE_E4M3FNUZ,
    "float8_e5m2": CODE_E5M2,
    "uint4": CODE_UINT4,
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
    return CODE_COPY if mode.format is None else FORMAT_CODES[mode.format.name]


def platform_formats(platform: str) -> dict[str, int]:
    """The format table of one platform's kernels (name -> CODE)."""
    return {name: code for name, code in FORMAT_CODES.items() if name in PLATFORM_FORMATS[platform]}


def packed_rows(mode) -> bool:
    """Whether `mode` stores uint4 rows, which the int4 kernels take."""
    return mode.format is not None and FORMAT_CODES.get(mode.format.name) == CODE_UINT4


def platform_modes(platform: str) -> frozenset[str]:
    formats = PLATFORM_FORMATS[platform] & FORMAT_CODES.keys()
    return frozenset(m.name for m in MODES.values() if m.format is None or m.format.name in formats)
