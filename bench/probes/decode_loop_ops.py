"""Which instructions does a decode key tile spend, per mode? The opcode counts of the whole-tile
loop of each mode's decode kernel at 64 x 16384 (sm_90a SASS, per thread, one 32-key tile of
the 1-warp table tile; bf16's table tile is 64 keys on 4 warps), side by side, compiled offline
as bench/probes/offline_facts.py compiles them (no GPU).

    python bench/probes/decode_loop_ops.py            (CPU: a few minutes)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Compiled, never interpreted: @triton.jit reads this when the kernels module is imported.
os.environ.pop("TRITON_INTERPRET", None)

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import int4_offline_facts  # noqa: E402
import offline_facts  # noqa: E402

from kvzoo.backends.triton import attention_kernels  # noqa: E402

SEQS, CONTEXT = 64, 16384
MODES = ("int8_per_token_head", "fp8_per_token_head", "none")
SHOWN = 24  # opcodes, the int4 tile's most frequent first


def whole_tile_ops(call: attention_kernels.KernelCall):
    """Opcode counts of the call's whole-tile loop (the shortest: masked tiles add the masks)."""
    _, _, sass = offline_facts.assemble(call)
    return min(offline_facts.loop_bodies(sass), key=lambda ops: sum(ops.values()))


def main() -> None:
    attention_kernels._num_sms = lambda device_index: offline_facts.H200_SMS
    columns = {"int4": whole_tile_ops(int4_offline_facts.decode_call(SEQS, CONTEXT))}
    for mode in MODES:
        p = offline_facts.meta_problem(SEQS, 1, CONTEXT, mode)
        cfg = attention_kernels.decode_config(p, False)
        call = attention_kernels.kernel_call(p, "cuda", cfg, per_seq=True, skip_decode=False)
        columns[mode.split("_")[0]] = whole_tile_ops(call)
    print(f"decode {SEQS} x {CONTEXT}, whole-tile loop, SASS instructions per thread")
    print(f"{'opcode':10s}" + "".join(f"{name:>8s}" for name in columns))
    print(f"{'all':10s}" + "".join(f"{sum(ops.values()):8d}" for ops in columns.values()))
    order = sorted(set().union(*columns.values()), key=lambda op: (-columns["int4"].get(op, 0), op))
    for op in order[:SHOWN]:
        print(f"{op:10s}" + "".join(f"{ops.get(op, 0):8d}" for ops in columns.values()))


if __name__ == "__main__":
    main()
