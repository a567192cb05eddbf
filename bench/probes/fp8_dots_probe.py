"""fp8_dots' compiled prefill kernel against the float64 oracle, per config (issue 20, target 2).

    python3 bench/probes/fp8_dots_probe.py

Runs attention_kernels.run directly on 2 prefills and a decode at head size 128, under each
listed tile, and prints each sequence's relative error against oracle.attention_f64 on the
two-term query with exact probabilities (SPEC.md 8.3: about 1e-2 or less is right, ~1 or nan
is a wrong kernel, as the first kernel gave on wgmma tiles). Its times are
attention_probe.py --sections fp8dots.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvzoo import samples  # noqa: E402
from kvzoo.backends.triton import attention_kernels as K  # noqa: E402
from kvzoo.inputs import host_float32, rng_for  # noqa: E402


def main() -> None:
    s = samples.paged_sample(
        rng_for("fp8_dots_probe"),
        "fp8_per_token_head",
        q_lens=[300, 1, 200],
        seq_lens=[300, 700, 500],
        block_size=16,
        num_q_heads=32,
        num_kv_heads=8,
        head_size=128,
        query_dtype="bfloat16",
        device="cuda",
    )
    p = s.attention_record(fp8_dots=True)
    ref = s.reference(fp8_dots=True)
    qsl = s.qsl
    C = K.AttentionConfig
    # The table's tile and its neighbours (wgmma), and a 16-row 1-warp tile (mma.sync).
    for cfg in (
        C(32, 128, 8, 3, 0, True),
        C(16, 128, 4, 3, 0, True),
        C(16, 64, 4, 2, 0, True),
        C(4, 32, 1, 2, 0, True),
    ):
        p.out.fill_(float("nan"))
        K.run(p, "cuda", prefill=cfg)
        torch.cuda.synchronize()
        o = host_float32(p.out).astype(np.float64)
        errs = [np.linalg.norm(o[a:b] - ref[a:b]) / np.linalg.norm(ref[a:b]) for a, b in zip(qsl[:-1], qsl[1:])]
        rows = cfg.block_q * 4
        print(
            f"{rows} rows x {cfg.block_n} keys, {cfg.num_warps} warps, {cfg.num_stages} stages: "
            + " ".join(f"{e:.1e}" for e in errs),
            flush=True,
        )


if __name__ == "__main__":
    main()
