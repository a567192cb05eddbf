"""Decode speed at full clock and under the GPU's power cap.

On the H200 the quantized decode takes the board to its 700 W cap within a second of
back-to-back launches; the SM clock then drops (1.6-1.7 GHz on average against 1.98), and a
kernel bound by its instruction latency slows with it, while the bf16 decode, bound by DRAM,
keeps its speed. So a decode figure depends on how long the GPU has been busy, and
gpu_bench.py's sit between these two ends:

- burst: the first replays after two idle seconds (median of 30 CUDA-graph replays);
- sustained: the group's problems (and config variants) replayed in turn, blocks of 25
  replays for 8 s; each one's median over the last half, with the SM clock and board power
  sampled meanwhile.

Every run is checked against float64 attention first.

    python3 bench/sustained.py
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

from attention_probe import ceilings, decode_bytes, err, make  # noqa: E402

from kvzoo.backends.triton import attention_kernels as K  # noqa: E402

# Groups replayed together: (sequences, context, mode, {label: changes to the table's config}).
TABLE = {"table": {}}
GROUPS = [
    [(64, 16384, "int8_per_token_head", TABLE), (64, 16384, "fp8_per_token_head", TABLE), (64, 16384, "none", TABLE)],
    [(8, 65536, "int8_per_token_head", TABLE), (8, 65536, "fp8_per_token_head", TABLE), (8, 65536, "none", TABLE)],
    [(64, 4096, "int8_per_token_head", TABLE), (64, 4096, "fp8_per_token_head", TABLE), (64, 4096, "none", TABLE)],
]
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


def main() -> None:
    copy_bw, _ = ceilings()
    print(f"copy ceiling {copy_bw:.0f} GB/s; burst = first 30 replays after 2 s idle; sustained = last "
          f"{SUSTAIN_S / 2:.0f} s of {SUSTAIN_S:.0f} s with the group interleaved (CUDA-graph medians, us)")
    for group in GROUPS:
        runs = {}  # label -> (graph, bytes, err, problem): the graph reads the problem's tensors, keep them
        for seqs, ctx, mode, variants in group:
            p = make(seqs, 1, ctx, mode)
            table = K.decode_config(p, False)
            for name, change in variants.items():
                cfg = dataclasses.replace(table, **change)
                p.out.fill_(float("nan"))
                K.run(p, "cuda", decode=cfg)
                e = err(p, [0, seqs - 1])
                label = f"{seqs}x{ctx} {mode} {name}"
                runs[label] = (graph_of(lambda cfg=cfg, p=p: K.run(p, "cuda", decode=cfg)), decode_bytes(p), e, p)
        burst = {}
        for label, (g, *_) in runs.items():
            torch.cuda.synchronize()
            time.sleep(2.0)
            burst[label] = statistics.median(us(timed_replays(g, 30)))
        log = tempfile.NamedTemporaryFile("w+", suffix=".csv")
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                "-lms", "200"], stdout=log)
        blocks: dict[str, list] = {label: [] for label in runs}
        start = time.time()
        while time.time() - start < SUSTAIN_S:
            for label, (g, *_) in runs.items():
                blocks[label].append((time.time() - start, timed_replays(g, BLOCK)))
            torch.cuda.synchronize()
        smi.terminate()
        smi.wait()
        samples = [tuple(float(x) for x in line.split(",")) for line in Path(log.name).read_text().splitlines() if line]
        late = samples[len(samples) // 2:]
        clock = statistics.mean(s[0] for s in late) if late else float("nan")
        power = statistics.mean(s[1] for s in late) if late else float("nan")
        print(f"group: SM clock {clock:.0f} MHz, board {power:.0f} W over the sustained half")
        for label, (_, b, e, _) in runs.items():
            tail = [t for when, block in blocks[label] if when >= SUSTAIN_S / 2 for t in us(block)]
            sustained = statistics.median(tail)
            print(f"  {label:40s} burst {burst[label]:7.1f} us ({100 * b / burst[label] / 1e3 / copy_bw:5.1f}% of copy)"
                  f"  sustained {sustained:7.1f} us ({100 * b / sustained / 1e3 / copy_bw:5.1f}%)  err {e:.1e}",
                  flush=True)
        del runs, blocks
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
