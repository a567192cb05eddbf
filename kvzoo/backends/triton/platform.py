"""Where the Triton kernels can run on this machine."""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import sys

from .formats import platform_modes

PLATFORMS = ("cuda", "rocm")
OPS = ("reshape_and_cache", "dequantize", "paged_attention")
# Modes each platform's kernels register for each op, from the backend's format table (formats.py).
PLATFORM_MODES: dict[tuple[str, str], frozenset[str]] = {
    (p, op): platform_modes(p, op) for p in PLATFORMS for op in OPS
}

PRIORITY_GPU = 100
# Under the interpreter the kernels are checked, not used: any CPU backend is preferred.
PRIORITY_INTERPRETED = 1


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def build_target() -> str:
    """The GPU platform this process's torch builds for: "rocm" under a ROCm torch, else "cuda"
    (the interpreter included, which runs the kernels a CUDA build compiles)."""
    import torch

    return "rocm" if torch.version.hip is not None else "cuda"


def _missing(platform: str, package: str | None) -> tuple[str, ...]:
    return (f"triton-{platform}: {package} is not installed (pip install triton torch)",)


def _no_gpu(platform: str) -> tuple[str, ...]:
    what = "ROCm" if platform == "rocm" else "CUDA"
    return (
        f"triton-{platform}: no {what} GPU here (set TRITON_INTERPRET=1 to run the kernels on "
        "CPU tensors under the Triton interpreter)",
    )


@functools.cache
def unavailable_reasons(platform: str) -> tuple[str, ...]:
    try:
        import torch
        import triton  # noqa: F401
    except ImportError as exc:
        return _missing(platform, exc.name)
    if interpreted():
        return ()
    if torch.cuda.is_available() and platform == build_target():
        return ()
    return _no_gpu(platform)


def _cuda_devices() -> int:
    """GPUs the CUDA driver reports (libcuda: cuInit, cuDeviceGetCount; CUDA_VISIBLE_DEVICES
    applies), 0 where there is no driver or it fails to start: then torch sees none either."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def probe(platform: str) -> list[str] | None:
    """unavailable_reasons(platform) where it can be told without importing torch or triton (for
    `kvzoo list`, which this keeps to a fraction of a second), else None, for the full check.

    Told: torch or triton is not installed, or no GPU of the platform is here (no CUDA device
    from the driver, no /dev/kfd for ROCm, which every ROCm GPU needs): torch would see none.
    Not told: a GPU is here (whether torch takes it, and is built for this platform, needs
    torch), the interpreter is on, or torch is imported already (the full check is cheap then)."""
    if sys.modules.get("torch") is not None or interpreted():
        return None
    for package in ("torch", "triton"):  # unavailable_reasons' order of imports
        # find_spec answers None for an entry None in sys.modules (a package blocked, as tests do).
        if importlib.util.find_spec(package) is None:
            return list(_missing(platform, package))
    present = os.path.exists("/dev/kfd") if platform == "rocm" else _cuda_devices() > 0
    return None if present else list(_no_gpu(platform))


def devices() -> frozenset[str]:
    return frozenset({"cpu"}) if interpreted() else frozenset({"cuda"})


def priority() -> int:
    return PRIORITY_INTERPRETED if interpreted() else PRIORITY_GPU
