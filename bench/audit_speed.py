"""How fast does `kvzoo.audit` read a large cache on this machine's CPUs, against copying the same bytes?

Issue 40 asks for a 1 GiB cache in under a minute on two cores. This builds a cache of about
--gib GiB (32 layers, 8 KV heads, head size 128, blocks of 16, every block live in 64 sequences
of whole and partly filled blocks), written by the registry's reshape_and_cache from random
bfloat16 K/V (one layer written, the others copies of its pages: the audit's work does not
depend on the bytes), and times kvzoo.audit on it (median of --runs). The physical limit it is
set against is np.copy of the same arrays (one pass that reads and writes every byte, median of
5), timed in the same process. The audit reads every live byte once into chunks and does a few
dozen float32 operations per element (decode, re-quantize, compare), so its rate is a fraction
of the copy's.

    python bench/audit_speed.py                         # 1 GiB, int8_per_token_head, separate layout
    python bench/audit_speed.py --mode fp8_per_token_head --layout inline --gib 0.25
    python bench/audit_speed.py --json /tmp/run/audit_speed.json    # for bench/report.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

import kvzoo
from kvzoo.arrays import as_numpy

LAYERS, HEADS, HEAD_SIZE, BLOCK_SIZE, SEQS = 32, 8, 128, 16, 64


def build(gib: float, mode_name: str, layout: str, seed: int) -> tuple[dict, int]:
    """(the dump dict, its bytes) of a cache of about `gib` GiB."""
    mode = kvzoo.get_kv_quant_mode(mode_name)
    width = mode.cache_width(HEAD_SIZE) + (4 if mode.per_token_head else 0)
    per_block = 2 * BLOCK_SIZE * HEADS * width * (1 if mode.format else 2)
    num_blocks = max(SEQS, int(gib * 2**30 / (LAYERS * per_block)))
    rng = np.random.default_rng(seed)
    # Every block in use: sequences of whole blocks, most ending part way into their last.
    blocks_per_seq = np.full(SEQS, num_blocks // SEQS)
    blocks_per_seq[: num_blocks % SEQS] += 1
    lens = blocks_per_seq * BLOCK_SIZE - rng.integers(0, BLOCK_SIZE, SEQS)
    order = rng.permutation(num_blocks)
    tables = np.full((SEQS, blocks_per_seq.max()), -1, np.int32)
    start = 0
    for s, n in enumerate(blocks_per_seq):
        tables[s, :n] = order[start : start + n]
        start += n
    slots = np.concatenate(
        [tables[s, p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for s, n in enumerate(lens) for p in [np.arange(n)]]
    )
    if layout == "inline":
        first = kvzoo.allocate_inline(num_blocks, BLOCK_SIZE, HEADS, HEAD_SIZE, mode)
    else:
        first = kvzoo.allocate_separate(num_blocks, BLOCK_SIZE, HEADS, HEAD_SIZE, mode)
    gen = torch.Generator().manual_seed(seed)
    static = 0.02 if mode.per_tensor else None
    for lo in range(0, len(slots), 4096):
        part = torch.from_numpy(slots[lo : lo + 4096])
        k, v = (torch.randn(len(part), HEADS, HEAD_SIZE, generator=gen).to(torch.bfloat16) for _ in range(2))
        kvzoo.reshape_and_cache(
            k,
            v,
            first.key_cache,
            first.value_cache,
            part,
            mode=mode,
            k_scale_cache=first.k_scale_cache,
            v_scale_cache=first.v_scale_cache,
            k_scale=static,
            v_scale=static,
        )
    layers = [first]
    for _ in range(LAYERS - 1):
        if first.buffer is not None:
            layers.append(kvzoo.inline_views(first.buffer.clone(), HEAD_SIZE, mode))
        else:
            layers.append(
                kvzoo.KVCacheTensors(
                    *(
                        None if t is None else t.clone()
                        for t in (first.key_cache, first.value_cache, first.k_scale_cache, first.v_scale_cache)
                    )
                )
            )
    statics = [static] * LAYERS if static else None
    dump = kvzoo.cache_dump(
        layers, mode=mode, block_tables=tables, seq_lens=lens.astype(np.int32), k_scales=statics, v_scales=statics
    )
    arrays = [
        a
        for t in layers
        for a in (
            (t.buffer,) if t.buffer is not None else (t.key_cache, t.value_cache, t.k_scale_cache, t.v_scale_cache)
        )
        if a is not None
    ]
    return dump, arrays


def copy_seconds(arrays: list) -> float:
    """Median of 5 np.copy passes over every array (read + write of each byte once)."""
    host = [as_numpy(a) for a in arrays]
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for a in host:
            np.copy(a)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="cache size in GiB (default 1)")
    ap.add_argument("--mode", default="int8_per_token_head")
    ap.add_argument("--layout", default="separate", choices=["separate", "inline"])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=None, help="audit threads (default: the CPUs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="also write the figures as JSON")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    dump, arrays = build(args.gib, args.mode, args.layout, args.seed)
    nbytes = sum(int(a.numel() * a.element_size()) for a in arrays)
    built = time.perf_counter() - t0
    copy = copy_seconds(arrays)
    times, cpu, report = [], [], None
    for _ in range(args.runs):
        t0, c0 = time.perf_counter(), time.process_time()
        report = kvzoo.audit(dump, workers=args.workers)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    median = float(np.median(times))
    rows = sum(layer.key.rows + layer.value.rows for layer in report.layers)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
    ).stdout.strip()
    facts = {
        "command": "python bench/audit_speed.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit or "unknown",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end",
        "mode": args.mode,
        "layout": args.layout,
        "bytes": nbytes,
        "live_rows": rows,
        "workers": args.workers or os.cpu_count(),
        "audit_seconds": times,
        "audit_median_s": median,
        # CPU seconds of all the process's threads: on a loaded machine wall time exceeds
        # cpu / workers by the time the threads waited for a core.
        "audit_cpu_s": cpu,
        "copy_median_s": copy,
        "findings": dict(report.counts),
    }
    print(
        f"kvzoo.audit of {nbytes / 2**30:.2f} GiB ({args.mode}, {args.layout}; {LAYERS} layers, "
        f"{dump['block_tables'].shape[0]} sequences, {rows:,} live rows; built in {built:.0f} s): median "
        f"{median:.1f} s of {args.runs} ({', '.join(f'{t:.1f}' for t in times)}; CPU time "
        f"{', '.join(f'{t:.1f}' for t in cpu)} s), {nbytes / median / 1e6:,.0f} MB/s; "
        f"np.copy of the same bytes {copy:.2f} s ({nbytes / copy / 1e9:.2f} GB/s): the audit at "
        f"{100 * copy / median:.1f}% of the copy's rate. Findings: {dict(report.counts) or 'none'}. "
        f"{facts['machine']}; {facts['date']}, commit {facts['commit']}."
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(facts, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
