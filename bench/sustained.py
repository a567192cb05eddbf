"""How fast are decode and prefill at full clock, and once the GPU's power cap has lowered it?

    python3 bench/sustained.py [decode] [prefill]       (on the GPU)

On the H200 the quantized decode takes the board to its 700 W cap within a second of
back-to-back launches; the SM clock then drops (1.6-1.7 GHz on average against 1.98), and a
kernel bound by its instruction latency slows with it, while the bf16 decode, bound by DRAM,
keeps its speed. So a decode figure depends on how long the GPU has been busy, and
gpu_bench.py's sit between these two ends:

- burst: the first replays after two idle seconds (median of 30 CUDA-graph replays);
- sustained: the group's problems (and config variants) replayed in turn, blocks of 25
  replays for 8 s; each one's median over the last half, with the SM clock and board power
  sampled meanwhile.

Prefill groups add torch SDPA (cuDNN, bf16, contiguous K/V) to the same rotation, so the
prefill-vs-SDPA ratio is read at both ends too. Every kvzoo run is checked against float64
attention first. Inputs: bench/attention_inputs.py's `make` (kvzoo.samples, session seed).
"""

from __future__ import annotations

import dataclasses
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention_inputs import HKV, HQ, D, ceilings, decode_bytes, err, make, prefill_flops  # noqa: E402

from kvzoo.backends.triton import attention_kernels as K  # noqa: E402

# Groups replayed together: (sequences, context, mode, {label: changes to the table's config}).
TABLE = {"table": {}}
GROUPS = [
    [(64, 16384, "int8_per_token_head", TABLE), (64, 16384, "fp8_per_token_head", TABLE), (64, 16384, "none", TABLE)],
    [(8, 65536, "int8_per_token_head", TABLE), (8, 65536, "fp8_per_token_head", TABLE), (8, 65536, "none", TABLE)],
    [(64, 4096, "int8_per_token_head", TABLE), (64, 4096, "fp8_per_token_head", TABLE), (64, 4096, "none", TABLE)],
]
# Prefill groups: (sequences, causal length, modes); torch SDPA on contiguous bf16 joins each.
PREFILL_GROUPS = [(4, 4096, ("int8_per_token_head", "fp8_per_token_head", "none"))]
SUSTAIN_S = 8.0
BLOCK = 25


def graph_of(fn) -> torch.cuda.CUDAGraph:
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


def timed_replays(g: torch.cuda.CUDAGraph, n: int) -> list[tuple]:
    events = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        events.append((a, b))
    return events


def us(events) -> list[float]:
    torch.cuda.synchronize()
    return [a.elapsed_time(b) * 1e3 for a, b in events]


def decode_runs(group) -> dict:
    """label -> (callable, amount, unit, err, problem); the callable's tensors live in `problem`."""
    runs = {}
    for seqs, ctx, mode, variants in group:
        p = make(seqs, 1, ctx, mode)
        table = K.decode_config(p, False)
        for name, change in variants.items():
            cfg = dataclasses.replace(table, **change)
            p.out.fill_(float("nan"))
            K.run(p, "cuda", decode=cfg)
            runs[f"decode {seqs}x{ctx} {mode} {name}"] = (
                lambda cfg=cfg, p=p: K.run(p, "cuda", decode=cfg),
                decode_bytes(p),
                "bytes",
                err(p, [0, seqs - 1]),
                p,
            )
    return runs


def prefill_runs(seqs: int, length: int, modes) -> dict:
    runs = {}
    for mode in modes:
        p = dataclasses.replace(make(seqs, length, length, mode), num_prefills=seqs)
        p.out.fill_(float("nan"))
        K.run(p, "cuda")
        runs[f"prefill {seqs}x{length} {mode}"] = (
            lambda p=p: K.run(p, "cuda"),
            prefill_flops(seqs, length),
            "flops",
            err(p, [0, seqs - 1]),
            p,
        )
    q = torch.randn(seqs, HQ, length, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(seqs, HKV, length, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    # Not checked here: gpu_bench.py times the same call; err is nan.
    runs[f"prefill {seqs}x{length} torch sdpa bf16"] = (
        lambda: sdpa(q, k, v, is_causal=True, enable_gqa=True),
        prefill_flops(seqs, length),
        "flops",
        float("nan"),
        (q, k, v),
    )
    return runs


def measure_group(runs: dict, copy_bw: float) -> None:
    graphs = {label: graph_of(fn) for label, (fn, *_) in runs.items()}
    burst = {}
    for label, g in graphs.items():
        torch.cuda.synchronize()
        time.sleep(2.0)
        burst[label] = statistics.median(us(timed_replays(g, 30)))
    log = tempfile.NamedTemporaryFile("w+", suffix=".csv")
    smi = subprocess.Popen(
        ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "200"], stdout=log
    )
    blocks: dict[str, list] = {label: [] for label in graphs}
    start = time.time()
    while time.time() - start < SUSTAIN_S:
        for label, g in graphs.items():
            blocks[label].append((time.time() - start, timed_replays(g, BLOCK)))
        torch.cuda.synchronize()
    smi.terminate()
    smi.wait()
    samples = [tuple(float(x) for x in line.split(",")) for line in Path(log.name).read_text().splitlines() if line]
    late = samples[len(samples) // 2 :]
    clock = statistics.mean(s[0] for s in late) if late else float("nan")
    power = statistics.mean(s[1] for s in late) if late else float("nan")
    print(f"group: SM clock {clock:.0f} MHz, board {power:.0f} W over the sustained half")

    def rate(amount, unit, t_us):
        if unit == "bytes":
            return f"{100 * amount / t_us / 1e3 / copy_bw:5.1f}% of copy"
        return f"{amount / t_us / 1e6:5.1f} TFLOP/s"

    sustained = {
        label: statistics.median([t for when, block in blocks[label] if when >= SUSTAIN_S / 2 for t in us(block)])
        for label in runs
    }
    sdpa = next((label for label in runs if "sdpa" in label), None)
    for label, (_, amount, unit, e, _) in runs.items():
        vs_sdpa = ""
        if sdpa is not None and label != sdpa:
            vs_sdpa = (
                f"  vs sdpa {burst[sdpa] / burst[label]:.2f}x burst,"
                f" {sustained[sdpa] / sustained[label]:.2f}x sustained"
            )
        print(
            f"  {label:46s} burst {burst[label]:7.1f} us ({rate(amount, unit, burst[label])})"
            f"  sustained {sustained[label]:7.1f} us ({rate(amount, unit, sustained[label])})"
            f"  err {e:.1e}{vs_sdpa}",
            flush=True,
        )


def main() -> None:
    copy_bw, _ = ceilings()
    print(
        f"copy ceiling {copy_bw:.0f} GB/s; burst = first 30 replays after 2 s idle; sustained = last "
        f"{SUSTAIN_S / 2:.0f} s of {SUSTAIN_S:.0f} s with the group interleaved (CUDA-graph medians, us)"
    )
    groups = [("decode", lambda g=g: decode_runs(g)) for g in GROUPS]
    groups += [("prefill", lambda g=g: prefill_runs(*g)) for g in PREFILL_GROUPS]
    wanted = sys.argv[1:] or ["decode", "prefill"]
    for kind, build in groups:
        if kind not in wanted:
            continue
        runs = build()
        measure_group(runs, copy_bw)
        del runs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
