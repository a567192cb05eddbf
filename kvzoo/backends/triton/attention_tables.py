"""The attention's tile tables: fixed rows keyed by the problem's shape class, never tuned per call,
each with the runs that chose it (a plain module: importable without triton).

A row for head size 128 is the best of the variants timed on one H200; its `chosen_by` names
each command and the commit it ran at, whose figures bench/archive/RESULTS-history.md keeps
under that commit (attention_probe.py, kernel_facts.py and staging_sweep.py print them again
from the current tree). Rows for head sizes 64 and 256 were not timed (`NOT_TIMED`): 64 takes
128's row; 256, whose rows are twice as wide, smaller key tiles or the multi-warp decode tile
128 had before. The tests check every row for correctness.

Adding a format: its codes map to a CacheCodes kind in attention_kernels._cache_codes (a new
kind needs rows in DECODE_TILES and SPLIT_RULES for every head size); prefill keys on how the
tile's K operand is made, which a format's conversion picks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class CacheCodes(enum.Enum):
    """What a decode tile reads from the cache: the decode and split tables' key."""

    MODEL_DTYPE = "model dtype"  # mode none: bf16 / fp16 / fp32 rows
    INT8 = "int8 codes"
    FP8 = "fp8 codes"


class KOperand(enum.Enum):
    """What a prefill tile's K dot takes: the prefill table's key."""

    AS_STORED = "16-bit rows as stored"  # mode none's cache, and staged prefill's fp16 workspace
    CONVERTED = "codes converted to fp16"
    INT8_CODES = "int8 codes as loaded"  # quantize_query: q's int8 codes meet them in an int8 dot
    FP8_CODES = "e4m3 codes as loaded"  # fp8_dots: q's and P's e4m3 codes meet them in fp8 dots


@dataclass(frozen=True)
class Run:
    """One H200 run that chose (part of) a row: the command, the commit, what it settled."""

    command: str
    commit: str
    settled: str


@dataclass(frozen=True)
class DecodeTile:
    """One query token x the group's heads per tile."""

    block_n: int
    num_warps: int
    num_stages: int
    chosen_by: tuple[Run, ...]


@dataclass(frozen=True)
class PrefillTile:
    rows: int  # query tokens x padded group
    block_n: int
    num_warps: int
    num_stages: int
    chosen_by: tuple[Run, ...]


@dataclass(frozen=True)
class SplitRule:
    """Split-KV decode: a grid under `below` programs per SM leaves SMs idle or its last wave
    ragged, so each sequence is split until the grid reaches about `target` per SM."""

    below: int
    target: int
    chosen_by: tuple[Run, ...]


# Quantized decode is bound by the latency of each tile's dependent chain (conversion, two dots,
# softmax), not by bytes: small tiles on one warp keep more programs resident. So it slows with
# the SM clock, which the board's power cap lowers under sustained load (bench/sustained.py).
# Their 5 stages are what gives the K/V copies two buffers: the page lookup takes a stage of
# its own, and below 5 Triton 3.6 keeps one buffer and waits for each copy right after issuing
# it. The bf16 tile, bound by DRAM, is slower with 5 and keeps 2.
_BF16_DECODE = (
    Run("python3 bench/probes/attention_probe.py", "df065dd", "64-key tiles on 4 warps"),
    Run("python3 bench/probes/kernel_facts.py 5", "29d1091", "2 stages: 5 were slower"),
)
_INT8_DECODE = (
    Run("python3 bench/probes/attention_probe.py", "df065dd", "32-key tiles on 1 warp (adopted in 1ac5c5e)"),
    Run("python3 bench/probes/kernel_facts.py 5", "29d1091", "5 stages, so the K/V copies get two buffers"),
)
_FP8_DECODE = (Run("python3 bench/probes/kernel_facts.py 9", "ff1fc21", "int8's tile: 32 keys, 1 warp, 5 stages"),)
_BF16_PREFILL = (
    Run(
        "python3 bench/probes/attention_probe.py",
        "df065dd",
        "128 rows x 128 keys on 8 warps, 3 stages (adopted in 1ac5c5e)",
    ),
)
_CODES_PREFILL = (
    Run("python3 bench/probes/attention_probe.py", "df065dd", "128 rows x 128 keys on 8 warps, 2 stages"),
)
_INT8_DOT_PREFILL = (
    Run("python3 bench/probes/kernel_facts.py 2", "046e6fb", "64 rows x 128 keys on 4 warps, 3 stages"),
)
NOT_TIMED = (Run("", "", "set from the head-128 rows and their history; checked for correctness only"),)

DECODE_TILES: dict[tuple[int, CacheCodes], DecodeTile] = {
    (64, CacheCodes.MODEL_DTYPE): DecodeTile(64, 4, 2, NOT_TIMED),
    (128, CacheCodes.MODEL_DTYPE): DecodeTile(64, 4, 2, _BF16_DECODE),
    (256, CacheCodes.MODEL_DTYPE): DecodeTile(32, 4, 2, NOT_TIMED),
    (64, CacheCodes.INT8): DecodeTile(32, 1, 5, NOT_TIMED),
    (128, CacheCodes.INT8): DecodeTile(32, 1, 5, _INT8_DECODE),
    (256, CacheCodes.INT8): DecodeTile(64, 4, 2, NOT_TIMED),
    (64, CacheCodes.FP8): DecodeTile(32, 1, 5, NOT_TIMED),
    (128, CacheCodes.FP8): DecodeTile(32, 1, 5, _FP8_DECODE),
    (256, CacheCodes.FP8): DecodeTile(64, 4, 2, NOT_TIMED),
}

# Rows not 16-byte aligned (the inline page: each row head_size + 4 bytes after the last) load in
# 4-byte copies, each with its own address, so a tile carries more instructions: at the aligned
# rows' 5 stages the 32-key tile spills, and 2 stages keep it in registers.
_UNALIGNED_DECODE = (
    Run(
        "python3 bench/probes/inline_probe.py",
        "dffca5d",
        "32-key tiles on 1 warp, 2 stages: int8 0.76-0.79x, fp8 0.77-0.80x of the separate layout's speed",
    ),
)
UNALIGNED_DECODE_TILES: dict[tuple[int, CacheCodes], DecodeTile] = {
    (64, CacheCodes.INT8): DecodeTile(32, 1, 2, NOT_TIMED),
    (128, CacheCodes.INT8): DecodeTile(32, 1, 2, _UNALIGNED_DECODE),
    (64, CacheCodes.FP8): DecodeTile(32, 1, 2, NOT_TIMED),
    (128, CacheCodes.FP8): DecodeTile(32, 1, 2, _UNALIGNED_DECODE),
}

# A decode grid of fewer programs than SMs whose context needs no split (a small batch of short
# sequences: each program alone on its SM, a handful of tiles each): the 1-warp tile's
# latency chain is then the whole kernel, and a wider tile on more warps runs it in fewer steps.
_ONE_WAVE_DECODE = (
    Run(
        "python3 bench/probes/attention_probe.py --sections short",
        "39f41c7",
        "128-key tiles on 4 warps: 1.6-1.9x the 1-warp tile at 8 x 256, 8 x 1024, 4 x 2000, 16 x 512",
    ),
)
ONE_WAVE_DECODE_TILES: dict[tuple[int, CacheCodes], DecodeTile] = {
    (64, CacheCodes.INT8): DecodeTile(128, 4, 3, NOT_TIMED),
    (128, CacheCodes.INT8): DecodeTile(128, 4, 3, _ONE_WAVE_DECODE),
    (64, CacheCodes.FP8): DecodeTile(128, 4, 3, NOT_TIMED),
    (128, CacheCodes.FP8): DecodeTile(128, 4, 3, _ONE_WAVE_DECODE),
}

PREFILL_TILES: dict[tuple[int, KOperand], PrefillTile] = {
    (64, KOperand.AS_STORED): PrefillTile(128, 128, 8, 3, NOT_TIMED),
    (128, KOperand.AS_STORED): PrefillTile(128, 128, 8, 3, _BF16_PREFILL),
    (256, KOperand.AS_STORED): PrefillTile(64, 32, 4, 2, NOT_TIMED),
    (64, KOperand.CONVERTED): PrefillTile(128, 128, 8, 2, NOT_TIMED),
    (128, KOperand.CONVERTED): PrefillTile(128, 128, 8, 2, _CODES_PREFILL),
    (256, KOperand.CONVERTED): PrefillTile(64, 32, 8, 2, NOT_TIMED),
    # The int8 dot wants a smaller tile than the converted codes' one.
    (64, KOperand.INT8_CODES): PrefillTile(64, 128, 4, 3, NOT_TIMED),
    (128, KOperand.INT8_CODES): PrefillTile(64, 128, 4, 3, _INT8_DOT_PREFILL),
    (256, KOperand.INT8_CODES): PrefillTile(64, 32, 8, 2, NOT_TIMED),
    (64, KOperand.FP8_CODES): PrefillTile(128, 128, 8, 3, NOT_TIMED),
    (128, KOperand.FP8_CODES): PrefillTile(128, 128, 8, 3, NOT_TIMED),
    (256, KOperand.FP8_CODES): PrefillTile(64, 64, 8, 2, NOT_TIMED),
}

# Staged prefill runs the AS_STORED tile on its workspace, its query blocks longest first: under
# a causal mask a sequence's later blocks see more keys, and the GPU starts programs in grid
# order, so the longest run first and the last wave holds short ones. That pays on the
# workspace's short tiles and not on the paged cache's, whose tiles keep grid order.
STAGED_PREFILL = (
    Run("python3 bench/probes/staging_sweep.py", "404f0e1", "longest first on the workspace"),
    Run("python3 bench/gpu_bench.py --cases decode,prefill", "6dbf199", "grid order on the paged cache"),
    Run(
        "python3 bench/probes/staging_sweep.py 8x1024 4x4096",
        "cb14094",
        "the AS_STORED tile: 64-key tiles at 3 or 4 stages were slower",
    ),
)

# The quantized 1-warp tiles need more programs per SM than the bf16 ones to hide their latency,
# so they split sooner and further.
SPLIT_RULES: dict[CacheCodes, SplitRule] = {
    CacheCodes.MODEL_DTYPE: SplitRule(
        2,
        8,
        (
            Run(
                "python3 bench/probes/attention_probe.py",
                "df065dd",
                "8 x 65536 in 16 splits, 64 x 16384 unsplit (adopted in 1ac5c5e)",
            ),
        ),
    ),
    CacheCodes.INT8: SplitRule(
        8, 16, (Run("python3 bench/probes/kernel_facts.py 5", "29d1091", "16 programs per SM"),)
    ),
    CacheCodes.FP8: SplitRule(8, 16, (Run("python3 bench/probes/kernel_facts.py 9", "ff1fc21", "int8's rule"),)),
}
