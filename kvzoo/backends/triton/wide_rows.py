"""A wide tile layout for the write over rows Triton sees only 4-byte aligned (the inline page's).

Triton's coalescing pass gives every load of one tile shape in a kernel the widest per-thread
run any memory op of that shape allows (a store keeps its own alignment's width). The inline
page's rows are head_size + 4 bytes apart, so the write's code stores go 4 bytes at a time and,
left alone, the write ran its bf16 input loads, row scales and encoding 8 elements a thread
(a 16-byte load of bf16), against the separate layout's 16, where the 16-byte code stores
allow that. A load of the same shape that Triton can see is 16-byte aligned, in a branch no
program takes, puts them at 16 as on the separate layout; either way the codes reach the
4-byte store layout through shared memory. 9-11% fewer instructions (sm_90a: `python
bench/probes/offline_facts.py write`).

Measured on the H200 (bench/probes/inline_probe.py; bench/archive/RESULTS-history.md, 2026-12-04):
the inline write at 32768 tokens ran at 0.82-0.87x the separate layout's speed without,
0.91-0.93x with. Decode does not take it: there the widened loads are the cache's own, each
warp-wide 4-byte copy then touched four rows, 4 bytes of every 16, instead of one row's 128
contiguous bytes, and the inline decode fell from 0.77-0.80x to 0.68-0.71x of the separate
layout's speed with 28-33% fewer instructions in its loop.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Off: the write's 8-element layout (bench/probes/inline_probe.py's "narrow" variant).
ENABLED = True

# Grid dimension 1 of a CUDA launch has at most 65535 programs, so no program takes the branch
# (and LLVM, which knows it from ctaid.y's range, deletes it: it costs nothing at run time).
_NEVER_PROGRAM = tl.constexpr(65535)


@triton.jit
def widen_tile_layout(aligned_ptr, sink_ptr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Give every [ROWS, COLS] load in the kernel the layout of a 16-byte run of aligned_ptr's
    elements a thread. aligned_ptr: 16-byte aligned, of the kernel's 1-byte codes; sink_ptr:
    any pointer (the store keeps the load from being removed before the coalescing pass sees
    it). Both are masked off as well as branched around: were the branch ever taken, nothing
    would be read or written."""
    never = tl.program_id(1) > _NEVER_PROGRAM
    if never:
        offsets = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
        tile = tl.load(aligned_ptr + offsets, mask=never, other=0)
        tl.store(sink_ptr, tl.sum(tl.sum(tile.to(tl.float32), axis=1), axis=0), mask=never)


def wanted(*, quantized: bool, whole_rows: bool, element_size: int, row_align: int, platform: str) -> bool:
    """Whether a write takes widen_tile_layout: quantized 1-byte codes in whole power-of-two
    rows (no column mask), rows row_align elements apart that are 4 to 15 bytes aligned (the
    inline page's; 16-byte rows are wide already), on CUDA. What was timed, and nothing else."""
    aligned = row_align * element_size
    return ENABLED and quantized and whole_rows and element_size == 1 and 4 <= aligned < 16 and platform == "cuda"
