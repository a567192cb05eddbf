"""Where the Triton kernels can run on this machine."""

from __future__ import annotations

import functools
import os

from .formats import platform_modes

PLATFORMS = ("cuda", "rocm")
# Modes each platform's kernels register, from the backend's format table (formats.py).
PLATFORM_MODES: dict[str, frozenset[str]] = {p: platform_modes(p) for p in PLATFORMS}

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


@functools.cache
def unavailable_reasons(platform: str) -> tuple[str, ...]:
    try:
        import torch
        import triton  # noqa: F401
    except ImportError as exc:
        return (f"triton-{platform}: {exc.name} is not installed (pip install triton torch)",)
    if interpreted():
        return ()
    if torch.cuda.is_available() and platform == build_target():
        return ()
    what = "ROCm" if platform == "rocm" else "CUDA"
    return (
        f"triton-{platform}: no {what} GPU here (set TRITON_INTERPRET=1 to run the kernels on "
        "CPU tensors under the Triton interpreter)",
    )


def devices() -> frozenset[str]:
    return frozenset({"cpu"}) if interpreted() else frozenset({"cuda"})


def priority() -> int:
    return PRIORITY_INTERPRETED if interpreted() else PRIORITY_GPU
