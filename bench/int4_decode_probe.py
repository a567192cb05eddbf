"""Which int4 decode tile is fastest on this GPU (issue 19: 2.8x kvzoo bf16 and 80% of the copy
ceiling at 64 x 16384)? The query rows as the MMA's rows (the tile before 2026-12-05) against
the keys as its rows (int4_attention._int4_tile_keys_as_rows), each at a few depths and register
caps, side by side in one run, with kvzoo's bf16 decode of the same shape as the baseline.

    python3 bench/int4_decode_probe.py [--shapes 64x16384,8x65536,64x4096]       (a CUDA GPU)
    ncu --clock-control none --kernel-name regex:_int4_attention_kernel --launch-skip 3 --launch-count 1 \
        --section WarpStateStats --section SchedulerStats --section Occupancy python3 bench/int4_decode_probe.py --ncu I

Every variant is first checked against float64 attention on the dequantized cache (kvzoo's
dequantize, byte-exact to the oracle; a few sequences) and against the previous tile's output,
then timed with CUDA events (triton.testing.do_bench, median). Bytes counted: K/V codes (D / 2
a row), the scale words, query and output; ceiling: a device-to-device copy in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention_probe import HKV, HQ, D, bench, ceilings, decode_bytes, make  # noqa: E402

import kvzoo  # noqa: E402
from kvzoo.backends.triton import attention_kernels as K  # noqa: E402
from kvzoo.backends.triton import int4_attention as I4  # noqa: E402

# (label, changes to the table's config, int4_attention.FOLD_WEIGHTS); None: the table as it is.
VARIANTS = (
    ("query rows as MMA rows (before)", dict(keys_as_rows=False), False),
    ("keys as rows (table)", None, False),
    ("keys as rows, 3 stages", dict(num_stages=3), False),
    ("keys as rows, 3 stages, cap 168", dict(num_stages=3, maxnreg=168), False),
    ("keys as rows, 64 keys, 2 warps", dict(block_n=64, num_warps=2), False),
    ("keys as rows, weights folded", None, True),
    ("query rows, 16 keys", dict(keys_as_rows=False, block_n=16), False),
    ("keys as rows, 16 keys", dict(block_n=16), False),
    ("keys as rows, 16 keys, cap 128", dict(block_n=16, maxnreg=128), False),
    ("keys as rows, 16 keys, 8 stages, cap 128", dict(block_n=16, num_stages=8, maxnreg=128), False),
)


def launch(p, cfg):
    K._launch(I4.kernel_call(p, "cuda", cfg, per_seq=True, skip_decode=False))


def reference(p, seqs) -> dict[int, torch.Tensor]:
    """float64 attention of each decode sequence in seqs on the dequantized (model-basis) cache."""
    out = {}
    for s in seqs:
        bt, sl = p.block_tables[s : s + 1], p.seq_lens[s : s + 1]
        k = kvzoo.dequantize(p.key_cache, p.k_scale_cache, mode=p.mode, block_tables=bt, seq_lens=sl)
        v = kvzoo.dequantize(p.value_cache, p.v_scale_cache, mode=p.mode, block_tables=bt, seq_lens=sl)
        k = k.to(torch.float64).repeat_interleave(HQ // HKV, dim=1)
        v = v.to(torch.float64).repeat_interleave(HQ // HKV, dim=1)
        q = p.query[s].to(torch.float64)  # [HQ, D]
        w = torch.softmax(torch.einsum("hd,khd->hk", q, k) * p.softmax_scale, dim=-1)
        out[s] = torch.einsum("hk,khd->hd", w, v)
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.norm(a.double() - b.double()) / torch.linalg.norm(b.double()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="64x16384,8x65536,64x4096")
    ap.add_argument("--only", help="comma list of VARIANTS indices (default: all)")
    ap.add_argument("--rounds", type=int, default=1, help="time the variants round-robin this many times")
    ap.add_argument("--ncu", type=int, metavar="I", help="only launch VARIANTS[I] at 64 x 16384 four times")
    args = ap.parse_args()
    if args.ncu is not None:
        p = make(64, 1, 16384, "int4_per_token_head")
        table = I4.decode_config(p, False)
        label, change, I4.FOLD_WEIGHTS = VARIANTS[args.ncu]
        cfg = dataclasses.replace(table, **change) if change else table
        print(label, cfg)
        for _ in range(4):
            launch(p, cfg)
        torch.cuda.synchronize()
        return
    copy_bw, _ = ceilings()
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    print(f"copy ceiling {copy_bw:.0f} GB/s")
    chosen = [int(i) for i in args.only.split(",")] if args.only else range(len(VARIANTS))
    failed = []
    rows = []
    for shape in args.shapes.split(","):
        S, L = (int(x) for x in shape.split("x"))
        bf = make(S, 1, L, "none")
        bf_ms = bench(lambda bf=bf: K.run(bf, "cuda"))
        rows.append((f"{shape} bf16 (kvzoo)", bf_ms, decode_bytes(bf) / bf_ms / 1e6, None, None))
        del bf
        torch.cuda.empty_cache()
        for mode in ("int4_per_token_head", "int4_per_token_head_norot"):
            p = make(S, 1, L, mode)
            nbytes = 2 * S * L * HKV * (D // 2 + 4) + 2 * p.query.numel() * p.query.element_size()
            seqs = [0, S - 1]
            ref = reference(p, seqs)
            table = I4.decode_config(p, False)
            before = None
            checked = []
            for index in chosen:
                label, change, I4.FOLD_WEIGHTS = VARIANTS[index]
                cfg = dataclasses.replace(table, **change) if change else table
                # A split holds whole tiles (AttentionConfig.split_keys).
                cfg = dataclasses.replace(cfg, split_keys=-(-cfg.split_keys // cfg.block_n) * cfg.block_n)
                p.out.fill_(float("nan"))
                try:
                    launch(p, cfg)
                    torch.cuda.synchronize()
                except Exception as exc:  # one bad config must not cost the call
                    print(f"{shape} {mode} {label}: FAILED {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                    failed.append(f"{shape} {mode} {label}")
                    continue
                e = max(rel(p.out[s], ref[s]) for s in seqs)
                unwritten = bool(torch.isnan(p.out).any())
                if before is None:
                    before = p.out.clone()
                # The kernel's own tolerance plus the bf16 output's rounding.
                if unwritten or not e < I4.ATTENTION_RTOL + 2**-8 or not math.isfinite(e):
                    failed.append(f"{shape} {mode} {label}: err {e:.1e} unwritten {unwritten}")
                checked.append((label, cfg, I4.FOLD_WEIGHTS, e, rel(p.out, before)))
            # Round-robin, so a change of the board's clock or power state falls on every variant.
            times = {label: [] for label, *_ in checked}
            for _ in range(args.rounds):
                for label, cfg, I4.FOLD_WEIGHTS, _, _ in checked:
                    times[label].append(bench(lambda p=p, cfg=cfg: launch(p, cfg)))
            tag = "rot" if mode == "int4_per_token_head" else "norot"
            for label, _, _, e, d_before in checked:
                ms = statistics.median(times[label])
                spread = f"{min(times[label]) * 1e3:.1f}-{max(times[label]) * 1e3:.1f}"
                rows.append((f"{shape} {tag} {label}", ms, nbytes / ms / 1e6, e, d_before))
                print(
                    f"{rows[-1][0]:58s} {ms * 1e3:8.1f} us ({spread})  err {e:.1e}  vs before {d_before:.1e}",
                    flush=True,
                )
            I4.FOLD_WEIGHTS = False
            del p, before
            torch.cuda.empty_cache()
    print()
    print(f"{'case':58s} {'us':>8s} {'GB/s':>6s} {'% copy':>6s} {'err':>8s}")
    base = {}
    for name, ms, gbs, e, _ in rows:
        shape = name.split()[0]
        if "bf16" in name:
            base[shape] = ms
        speed = f"{base[shape] / ms:5.2f}x bf16" if shape in base and "bf16" not in name else ""
        es = f"{e:.1e}" if e is not None else ""
        print(f"{name:58s} {ms * 1e3:8.1f} {gbs:6.0f} {100 * gbs / copy_bw:6.1f} {es:>8s} {speed}")
    if failed:
        print("FAILED:", *failed, sep="\n  ")
        sys.exit(1)


if __name__ == "__main__":
    main()
