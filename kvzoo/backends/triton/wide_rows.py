"""Wide tiles over rows Triton sees only 4-byte aligned (the inline page's), for the write.

Triton's coalescing pass gives every load of one tile shape in a kernel the widest per-thread
run any memory op of that shape allows (a store keeps its own alignment's width). The inline
page's rows are head_size + 4 bytes apart, so the write's code stores go 4 bytes at a time, and
left alone the whole kernel (the bf16 input loads, the row scales, the encoding) ran in that
4-element layout. A load of the same shape that Triton can see is 16-byte aligned, behind a
branch no program takes, puts the loads and the arithmetic in runs of 16 elements a thread,
as on the separate layout; the codes then reach the 4-byte store layout through shared memory.
9-11% fewer instructions (sm_90a).

Measured on the H200 (bench/inline_probe.py; bench/archive/RESULTS-history.md, 2026-12-04):
the inline write at 32768 tokens ran at 0.83-0.85x the separate layout's speed without, 0.91x
with. Decode does not take it: there the widened loads are the cache's own, each warp-wide
4-byte copy then touched four rows, 4 bytes of every 16, instead of one row's 128 contiguous
bytes, and the inline decode fell from 0.78x to 0.70x of the separate layout's speed with 28%
fewer instructions in its loop.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Off: the stores as they were before this module (bench/inline_probe.py times both in one run).
ENABLED = True

# Grid dimension 1 of a CUDA launch has at most 65535 programs, so no program takes the branch.
_NEVER_PROGRAM = tl.constexpr(65535)


@triton.jit
def widen_row_copies(codes_ptr, sink_ptr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Give the kernel's [ROWS, COLS] loads runs of 16 bytes of codes_ptr's element type a thread.
    sink_ptr: any pointer the kernel writes (the branch never runs; its store keeps the load
    from being removed before the coalescing pass sees it)."""
    if tl.program_id(1) > _NEVER_PROGRAM:
        tile = tl.load(codes_ptr + tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :])
        tl.store(sink_ptr, tl.sum(tl.sum(tile.to(tl.float32), axis=1), axis=0))


def wanted(row_align_bytes: int, platform: str) -> bool:
    """Whether a launch over rows row_align_bytes aligned takes widen_row_copies: 4 to 15 bytes
    (the inline page's rows) on CUDA, where it was measured; 16-byte rows are wide already."""
    return ENABLED and platform == "cuda" and 4 <= row_align_bytes < 16
