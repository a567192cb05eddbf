"""Is each attention table config (kvzoo/backends/triton/attention_kernels.py) still the fastest of
its neighbours on this GPU? Issue 5's attention shapes, on one GPU; also the shared inputs,
reference and ceilings (bench/attention_inputs.py).

    python3 bench/probes/attention_probe.py [--sections decode,split,prefill,short,int4,fp8dots] [--quick]
    ncu --clock-control none --kernel-name regex:_attention_kernel --launch-skip 3 --launch-count 1 \
        --section WarpStateStats --section SchedulerStats --section Occupancy \
        --section MemoryWorkloadAnalysis python3 bench/probes/attention_probe.py --ncu int8_per_token_head

Checks every variant's output against a float64 reference on a few sequences, then times it
with CUDA events (triton.testing.do_bench, median) and prints one table. Bytes counted for
decode: K/V codes + scales + query + output; FLOPs for prefill: 4 * D per visible (q, k) pair
per query head. Ceilings measured in the same run: device-to-device copy (read + write) and
an 8192^3 bf16 matmul. --ncu MODE[+qq] launches the table's 64 x 16384 decode four times and
nothing else (three warm-ups, then the one Nsight Compute profiles). Inputs come from
kvzoo.samples, drawn from the session seed (printed; KVZOO_SEED replays it).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attention_inputs import (  # noqa: E402
    DEV,
    HKV,
    HQ,
    D,
    bench,
    ceilings,
    decode_bytes,
    err,
    graph_ms,
    make,
    prefill_flops,
)

from kvzoo.backends.triton import attention_kernels as K  # noqa: E402
from kvzoo.backends.triton import attention_tables as AT  # noqa: E402
from kvzoo.inputs import SEED  # noqa: E402

ROWS: list[str] = []


def row(name, ms, gbs=None, copy_bw=None, tflops=None, mm=None, e=None, note=""):
    parts = [f"{name:44s}", f"{ms * 1e3:9.1f} us"]
    parts.append(f"{gbs:7.0f} GB/s {100 * gbs / copy_bw:5.1f}%" if gbs else " " * 19)
    parts.append(f"{tflops:6.1f} TF/s {100 * tflops / mm:5.1f}%" if tflops else " " * 18)
    parts.append(f"err {e:.1e}" if e is not None else "")
    parts.append(note)
    line = " | ".join(parts)
    ROWS.append(line)
    print(line, flush=True)


def run_variant(name, p, launch, copy_bw, seqs, flops=None, mm=None, timer=None):
    p.out.fill_(float("nan"))
    try:
        launch()
        torch.cuda.synchronize()
    except Exception as exc:  # keep going: one bad config must not cost the whole call
        row(name, 0.0, note=f"FAILED {type(exc).__name__}: {str(exc)[:120]}")
        return None
    nan = bool(torch.isnan(p.out).any())
    e = err(p, seqs)
    ms = (timer or bench)(launch)
    if flops:
        row(name, ms, tflops=flops / ms / 1e9, mm=mm, e=e, note="UNWRITTEN" if nan else "")
    else:
        row(name, ms, gbs=decode_bytes(p) / ms / 1e6, copy_bw=copy_bw, e=e, note="UNWRITTEN" if nan else "")
    return ms


def decode_tiles(label, p, table, tiles, copy_bw, seqs, timer=None, keep_split=True):
    """One run_variant per (block_n, warps, stages) in tiles: the table's config with that tile,
    its split (keep_split; rounded up to the tile) or none."""
    for bn, w, st in tiles:
        sk = -(-table.split_keys // bn) * bn if keep_split else 0
        cfg = dataclasses.replace(table, block_n=bn, num_warps=w, num_stages=st, split_keys=sk)
        run_variant(
            f"{label} bn{bn} w{w} s{st}" + (f" sk{sk}" if keep_split else ""),
            p,
            lambda cfg=cfg, p=p: K.run(p, "cuda", decode=cfg),
            copy_bw,
            seqs,
            timer=timer,
        )


def sdpa_decode(num_seqs, seq_len, copy_bw):
    q = torch.randn(num_seqs, HQ, 1, D, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(num_seqs, HKV, seq_len, D, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    fn = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
    ms = bench(fn)
    b = 2 * k.numel() * 2 + 2 * q.numel() * 2
    row(f"sdpa decode {num_seqs}x{seq_len} bf16 contiguous", ms, gbs=b / ms / 1e6, copy_bw=copy_bw)
    return ms


def sdpa_prefill(num_seqs, seq_len, mm):
    q = torch.randn(num_seqs, HQ, seq_len, D, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(num_seqs, HKV, seq_len, D, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    flops = prefill_flops(num_seqs, seq_len)
    best = None
    for tag, fn in (
        ("gqa", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)),
        (
            "expanded",
            lambda: F.scaled_dot_product_attention(
                q, k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1), is_causal=True
            ),
        ),
    ):
        ms = bench(fn)
        row(f"sdpa prefill {num_seqs}x{seq_len} causal {tag}", ms, tflops=flops / ms / 1e9, mm=mm)
        best = ms if best is None else min(best, ms)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="decode,split,prefill")
    ap.add_argument("--quick", action="store_true", help="time the table's configs only")
    ap.add_argument("--ncu", metavar="MODE", help="only launch the 64 x 16384 decode of MODE[+qq], for Nsight Compute")
    args = ap.parse_args()
    if args.ncu:
        p = make(64, 1, 16384, args.ncu.removesuffix("+qq"), quantize_query=args.ncu.endswith("+qq"))
        print("config", K.decode_config(p, False))
        for _ in range(4):
            K.run(p, DEV)
        torch.cuda.synchronize()
        return
    sections = set(args.sections.split(","))
    quick = args.quick  # the table's choice only, no variants
    torch.manual_seed(0)
    copy_bw, mm = ceilings()
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} seed {SEED}")
    row("ceiling: d2d copy 2 GiB (read+write)", 0.0, gbs=copy_bw, copy_bw=copy_bw)
    row("ceiling: bf16 matmul 8192^3", 0.0, tflops=mm, mm=mm)
    C = K.AttentionConfig

    if "decode" in sections:
        S, L = 64, 16384
        sdpa_decode(S, L, copy_bw)
        for mode, variants in (
            ("none", [(64, 4, 2), (128, 4, 2)]),
            # The deeper multi-warp tiles: the one-wave rows' (attention_tables.ONE_WAVE_DECODE_TILES) on a full grid.
            (
                "int8_per_token_head",
                [(128, 4, 2), (64, 2, 2), (128, 2, 2), (32, 1, 2), (64, 1, 2), (64, 1, 3), (64, 2, 4), (128, 4, 3)],
            ),
            ("fp8_per_token_head", [(128, 4, 2), (64, 2, 2), (64, 1, 2), (64, 2, 4), (128, 4, 3)]),
            # quantize_query: QK^T on int8 codes (err is against the unquantized query).
            ("int8_per_token_head+qq", [(128, 4, 2), (64, 4, 2), (64, 2, 2), (128, 2, 2), (32, 1, 2), (64, 1, 2)]),
        ):
            mode, qq = mode.split("+")[0], mode.endswith("+qq")
            p = make(S, 1, L, mode, quantize_query=qq)
            mode = mode + ("+qq" if qq else "")
            table = K.decode_config(p, False)
            row(f"-- decode {S}x{L} {mode}: table {table}", 0.0)
            run_variant(f"{mode[:4]}{' qq' * qq} TABLE", p, lambda p=p: K.run(p, "cuda"), copy_bw, [0, S - 1])
            unsplit = dataclasses.replace(table, split_keys=0)
            run_variant(f"{mode} table unsplit", p, lambda c=unsplit, p=p: K.run(p, "cuda", decode=c), copy_bw, [0])
            decode_tiles(f"{mode[:4]}{' qq' * qq}", p, table, [] if quick else variants, copy_bw, [S - 1])
            inv = dataclasses.replace(p, batch_invariant=True)
            run_variant(f"{mode} batch_invariant (table)", inv, lambda inv=inv: K.run(inv, "cuda"), copy_bw, [1])
            del p, inv
            torch.cuda.empty_cache()

    if "short" in sections:
        # Small batches of short sequences: fewer programs than SMs and no split (the host_cost
        # shape is 8 x 256); timed from CUDA graphs, the kernel alone.
        for S, L in ((8, 256), (8, 1024), (4, 2000), (16, 512), (32, 256)):
            for mode in ("int8_per_token_head", "fp8_per_token_head"):
                p = make(S, 1, L, mode)
                table = K.decode_config(p, False)
                row(f"-- decode {S}x{L} {mode}: table {table}", 0.0)
                run_variant(f"{mode[:4]} {S}x{L} TABLE", p, lambda p=p: K.run(p, "cuda"), copy_bw, [0], timer=graph_ms)
                variants = [(32, 1, 5), (64, 2, 4), (128, 4, 3), (128, 4, 2), (128, 8, 3), (256, 4, 3)]
                label = f"{mode[:4]} {S}x{L}"
                decode_tiles(label, p, table, [] if quick else variants, copy_bw, [S - 1], graph_ms, keep_split=False)
                del p
                torch.cuda.empty_cache()

    if "int4" in sections:
        # int4's decode tiles (int4_attention.TILES) against the table's: the register cap the
        # offline SASS chose, other tiles and depths; err is relative to the table's output, not
        # to float64.
        from kvzoo.backends.triton import int4_attention as I4

        table_tiles = I4.TILES[128]
        variants = [
            ((32, 1, 5), 168),
            ((64, 1, 5), 168),
            ((64, 2, 4), None),
            ((64, 2, 4), 128),
            ((32, 2, 5), 128),
            ((128, 4, 3), None),
            ((32, 1, 4), 168),
            ((32, 1, 6), 168),
        ]
        for S, L in ((64, 16384), (8, 65536)):
            for mode in ("int4_per_token_head", "int4_per_token_head_norot"):
                p = make(S, 1, L, mode)
                nbytes = 2 * S * L * HKV * (D // 2 + 4) + 2 * p.query.numel() * p.query.element_size()
                row(f"-- decode {S}x{L} {mode}: table {I4.decode_config(p, False)}", 0.0)
                I4.run(p)
                want = p.out.double().clone()
                ms = bench(lambda p=p: I4.run(p))
                label = f"int4 {S}x{L} {'norot' if mode.endswith('norot') else 'rotated'}"
                row(f"{label} TABLE", ms, gbs=nbytes / ms / 1e6, copy_bw=copy_bw)
                for (bn, w, st), cap in [] if quick else variants:
                    I4.TILES[128] = I4.Int4Tiles(AT.DecodeTile(bn, w, st, ()), table_tiles.prefill, cap)
                    try:
                        p.out.fill_(float("nan"))
                        I4.run(p)
                        e = float(torch.linalg.norm(p.out.double() - want) / torch.linalg.norm(want))
                        ms = bench(lambda p=p: I4.run(p))
                        row(f"{label} bn{bn} w{w} s{st} cap{cap}", ms, gbs=nbytes / ms / 1e6, copy_bw=copy_bw, e=e)
                    except Exception as exc:  # one bad config must not cost the whole call
                        failed = f"FAILED {type(exc).__name__}: {str(exc)[:100]}"
                        row(f"{label} bn{bn} w{w} s{st} cap{cap}", 0.0, note=failed)
                    finally:
                        I4.TILES[128] = table_tiles
                del p
                torch.cuda.empty_cache()

    if "split" in sections:
        S, L = 8, 65536
        sdpa_decode(S, L, copy_bw)
        for mode in ("none", "int8_per_token_head", "fp8_per_token_head", "int8_per_token_head+qq"):
            mode, qq = mode.split("+")[0], mode.endswith("+qq")
            p = make(S, 1, L, mode, quantize_query=qq)
            table = K.decode_config(p, False)
            row(f"-- decode {S}x{L} {mode}{' qq' * qq}: table {table}", 0.0)
            run_variant(f"{mode[:4]}{' qq' * qq} TABLE", p, lambda p=p: K.run(p, "cuda"), copy_bw, [0, S - 1])
            if mode.startswith("int8") and not quick:
                cfg = dataclasses.replace(table, block_n=64, num_warps=1, split_keys=4096)
                run_variant(
                    f"{mode[:4]} bn64 w1 sk4096", p, lambda cfg=cfg, p=p: K.run(p, "cuda", decode=cfg), copy_bw, [0]
                )
            decode_tiles(
                mode[:4], p, table, [] if quick or qq or mode == "none" else [(64, 2, 4), (128, 4, 3)], copy_bw, [0]
            )
            del p
            torch.cuda.empty_cache()

    if "prefill" in sections:
        S, L = 4, 4096
        flops = prefill_flops(S, L)
        sdpa_prefill(S, L, mm)
        for mode in ("none", "int8_per_token_head", "fp8_per_token_head", "int8_per_token_head+qq"):
            mode, qq = mode.split("+")[0], mode.endswith("+qq")
            p = make(S, L, L, mode, quantize_query=qq)
            table = K.prefill_config(p)
            row(f"-- prefill {S}x{L} {mode}{' qq' * qq}: table {table}", 0.0)
            run_variant(
                f"{mode[:4]}{' qq' * qq} TABLE", p, lambda p=p: K.run(p, "cuda"), copy_bw, [1], flops=flops, mm=mm
            )
            for cfg in (
                []
                if quick
                else (
                    C(16, 128, 4, 2, 0, True),
                    C(32, 128, 8, 3, 0, True),
                    C(16, 64, 4, 3, 0, True),
                    C(32, 128, 8, 2, 0, True),
                )
            ):
                run_variant(
                    f"{mode[:4]}{' qq' * qq} bq{cfg.block_q} bn{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}",
                    p,
                    lambda cfg=cfg, p=p: K.run(p, "cuda", prefill=cfg),
                    copy_bw,
                    [1],
                    flops=flops,
                    mm=mm,
                )
            del p
            torch.cuda.empty_cache()

    if "fp8dots" in sections:
        # fp8_dots (SPEC.md 8.3): both dots on e4m3 operands, against SDPA bf16 and the default
        # (staged fp16) path on the same fp8 cache; errors against the unquantized query.
        S, L = 4, 4096
        flops = prefill_flops(S, L)
        sdpa_prefill(S, L, mm)
        base = make(S, L, L, "fp8_per_token_head")
        run_variant("fp8 default TABLE", base, lambda: K.run(base, "cuda"), copy_bw, [1, 3], flops=flops, mm=mm)
        p = dataclasses.replace(base, fp8_dots=True)
        row(f"-- prefill {S}x{L} fp8 fp8_dots: table {K.prefill_config(p)}", 0.0)
        run_variant("fp8 fp8_dots TABLE", p, lambda: K.run(p, "cuda"), copy_bw, [1, 3], flops=flops, mm=mm)
        for cfg in (
            []
            if quick
            else (
                C(16, 128, 4, 3, 0, True),
                C(16, 128, 4, 2, 0, True),
                C(32, 128, 8, 2, 0, True),
                C(32, 64, 4, 3, 0, True),
                C(16, 64, 4, 3, 0, True),
                C(32, 128, 8, 3, 0, True),
            )
        ):
            run_variant(
                f"fp8_dots bq{cfg.block_q} bn{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}",
                p,
                lambda cfg=cfg: K.run(p, "cuda", prefill=cfg),
                copy_bw,
                [1],
                flops=flops,
                mm=mm,
            )
        del base, p
        torch.cuda.empty_cache()
        base = make(64, 1, 16384, "fp8_per_token_head")
        run_variant("decode 64x16384 fp8 default", base, lambda: K.run(base, "cuda"), copy_bw, [0, 63])
        p = dataclasses.replace(base, fp8_dots=True)
        run_variant("decode 64x16384 fp8 fp8_dots", p, lambda: K.run(p, "cuda"), copy_bw, [0, 63])
        del base, p
        torch.cuda.empty_cache()

    print("\n# summary")
    for line in ROWS:
        print(line)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"# wall {time.time() - t0:.0f} s")
