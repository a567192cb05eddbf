"""Registers the Triton unified paged attention ("triton-cuda", "triton-rocm").

Kernels live in attention_kernels.py (their pieces in attention_tiles.py, their tile tables in
attention_tables.py; int4's in int4_attention.py): each mode's caches go to the family that
formats.py's table names for its format, imported on the first run, so this module loads (and
lists the implementations as unavailable, with the reason) on machines without triton. The
options the kernels take are options.py's, which both import.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from ...capabilities import ALL_OPTIONS, Capabilities
from ...registry import Implementation, Registry
from . import platform
from .formats import kernels, platform_formats
from .options import TritonAttentionOptions

if TYPE_CHECKING:
    from ...problem import Attention

# Largest head size the kernel tiles: a [rows, 256] fp32 accumulator already fills the registers.
MAX_HEAD_SIZE = 256

# Dots take bf16/fp16 operands with fp32 accumulation. Cache codes, bf16 and fp16 queries are
# exact in them; what rounds is P (bf16 in mode "none" with bf16 caches: at most 2^-9 relative
# per probability; fp16 elsewhere, 2^-11), fp32 queries cast to fp16 (2^-12), and in prefill
# the per-key scale ratios folded into fp16 K/V tiles (2^-11 each). The worst case sums to
# under 3e-3 before the output's own rounding (which the conformance suite adds separately);
# bench/gpu_bench.py reports the measured error beside every timing. Staged prefill
# (staging.py) builds the same fp16 operands once per key, so its error is the direct kernel's.
# int4 caches' kernels (int4_attention.py) need no more: their module docstring says why.
ATTENTION_RTOL = 5e-3


def _runner(platform_name: str):
    def run(p: Attention, options: TritonAttentionOptions | None = None) -> None:
        kernels(p.mode, "attention").run(p, platform_name, options=options or TritonAttentionOptions())

    return run


def _preparer(platform_name: str):
    def prepare(p: Attention, options: TritonAttentionOptions | None = None):
        return kernels(p.mode, "attention").prepare(p, platform_name, options=options or TritonAttentionOptions())

    return prepare


def _sizer(platform_name: str):
    def workspace_bytes(p: Attention, options: TritonAttentionOptions | None = None) -> int:
        return kernels(p.mode, "attention").workspace_bytes(
            p, platform_name, options=options or TritonAttentionOptions()
        )

    return workspace_bytes


# Options a platform's kernels are not trusted with yet: ROCm's fp8 dots are untried.
_UNTRIED_OPTIONS = {"rocm": frozenset({"fp8_dots"})}


def register(registry: Registry) -> None:
    for name in platform.PLATFORMS:
        registry.add(
            Implementation(
                name=f"triton-{name}",
                op="paged_attention",
                platform=name,
                modes=platform.PLATFORM_MODES[name, "paged_attention"],
                run=_runner(name),
                prepare=_preparer(name),
                workspace_bytes=_sizer(name),
                array_kind="torch",
                # The kernels step through index tensors one element at a time (rows of
                # block_tables by their stride).
                index_strides="unit",
                devices=platform.devices(),
                priority=platform.priority(),
                unavailable=lambda name=name: list(platform.unavailable_reasons(name)),
                probe=functools.partial(platform.probe, name),
                capabilities=Capabilities(
                    ALL_OPTIONS - _UNTRIED_OPTIONS.get(name, frozenset()),
                    max_head_size=MAX_HEAD_SIZE,
                    formats=platform_formats(name),
                ),
                option_type=TritonAttentionOptions,
                attention_rtol=ATTENTION_RTOL,
                notes="split-KV decode, batch_invariant, fp16 dots on codes, staged prefill",
            )
        )
