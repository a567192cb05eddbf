"""Where the host time of an eager decode call goes on a GPU machine: cProfile over repeated
`kvzoo.paged_attention` calls on a shape small enough that the GPU waits on the host.

    python3 bench/eager_profile.py [CALLS]
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_bench import EAGER_DECODE, _attn_call, eager_decode_set  # noqa: E402

MODE = EAGER_DECODE[0]


def main() -> None:
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    s = eager_decode_set()
    for _ in range(100):
        _attn_call(s, MODE)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        _attn_call(s, MODE)
    torch.cuda.synchronize()
    print(f"{(time.perf_counter() - t) / calls * 1e6:.1f} us per eager call (8 x 256 int8 decode), unprofiled")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        _attn_call(s, MODE)
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
