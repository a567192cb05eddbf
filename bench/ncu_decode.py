"""One decode launch per mode for Nsight Compute (64 x 16384, the issue-5 decode shape).

    ncu --clock-control none --kernel-name regex:_attention_kernel --launch-skip 3 --launch-count 1 \
        --section WarpStateStats --section SchedulerStats --section Occupancy \
        --section MemoryWorkloadAnalysis python3 bench/ncu_decode.py int8_per_token_head

Each mode runs four times (three warm-ups, then the one profiled); the probe's inputs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention_probe import make  # noqa: E402

from kvzoo.backends.triton import attention_kernels as K  # noqa: E402

mode = sys.argv[1] if len(sys.argv) > 1 else "int8_per_token_head"
qq = mode.endswith("+qq")
p = make(64, 1, 16384, mode.split("+")[0], quantize_query=qq)
print("config", K.decode_config(p, False))
for _ in range(4):
    K.run(p, "cuda")
torch.cuda.synchronize()
