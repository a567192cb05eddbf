"""Decode on the inline page against the separate layout, and the inline page's two read paths
(aligned windows: attention_tiles.shifted_tile; the rows' own 4-byte alignment: paged_tile)
side by side in one process, on gpu_bench.py's decode shapes and checks.

    PYTHONPATH=. python3 bench/inline_probe.py [--shapes 64x16384,8x65536]     (on the GPU)
    OUT=DIR ...                                                                (also DIR/inline_probe.json)
    PYTHONPATH=. python bench/inline_probe.py --dry-run      (CPU, Triton interpreter: checks the script)

Each variant is checked against float32 torch attention on its own cache (gpu_bench's check)
before it is timed, and timed twice, in the order A B C C B A, so a drift of the clock under
the power cap shows as a difference between a variant's two figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench as gb  # noqa: E402

from kvzoo import api, recall  # noqa: E402
from kvzoo.backends.triton import attention_kernels  # noqa: E402

_WINDOWS = attention_kernels.shifted_rows


def _four_byte_rows(*args, **kwargs) -> bool:
    return False


def _time(variant: str, read_path, q_lens, seq_lens, ceil) -> dict:
    # The choice is made at launch preparation: forget prepared and recalled launches so it is
    # made again.
    taken: list[bool] = []

    def spy(*args, **kwargs) -> bool:
        taken.append(read_path(*args, **kwargs))
        return taken[-1]

    attention_kernels.shifted_rows = spy
    recall.forget()
    api._PREPARED.clear()
    rng = gb.rng_for("inline_probe", variant, len(seq_lens))
    nbytes = gb._attn_bytes(variant, q_lens, seq_lens)
    n = gb.n_sets_for(nbytes)
    sets = [gb._attn_set(variant, q_lens, seq_lens, rng) for _ in range(n)]
    check = gb._check_attention(sets[0], variant, q_lens, seq_lens)
    t, how = gb.measure(lambda i: gb._attn_call(sets[i], variant), n, 20)
    sets.clear()
    gb.free()
    attention_kernels.shifted_rows = _WINDOWS
    pct = 100 * nbytes / t / 1e9 / ceil["copy_GBps"]
    return {"us": t * 1e6, "pct": pct, "check": check, "how": how, "windows": any(taken), "prepared": len(taken)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="64x4096,64x16384,8x65536")
    ap.add_argument("--modes", default="int8_per_token_head,fp8_per_token_head")
    ap.add_argument("--dry-run", action="store_true", help="toy sizes on CPU (gpu_bench reads the flag)")
    args = ap.parse_args()
    if args.dry_run:
        args.shapes = "2x40"
    ceil = gb.ceilings(quick=True)
    print(f"copy ceiling {ceil['copy_GBps']:.0f} GB/s; commit {gb._commit()}")
    rows = []
    for shape in args.shapes.split(","):
        batch, ctx = map(int, shape.split("x"))
        q_lens, seq_lens = [1] * batch, [ctx] * batch
        for mode in args.modes.split(","):
            variants = [
                ("separate", mode, _WINDOWS),
                ("inline windows", mode + gb.INLINE, _WINDOWS),
                ("inline 4-byte", mode + gb.INLINE, _four_byte_rows),
            ]
            got: dict[str, list] = {name: [] for name, _, _ in variants}
            for name, variant, path in variants + variants[::-1]:
                got[name].append(_time(variant, path, q_lens, seq_lens, ceil))
            base = min(r["us"] for r in got["separate"])
            for name, results in got.items():
                best = min(r["us"] for r in results)
                row = dict(shape=shape, mode=mode, variant=name, runs=results, best_us=best, vs_separate=base / best)
                rows.append(row)
                figures = " / ".join(f"{r['us']:.1f}" for r in results)
                pct = max(r["pct"] for r in results)
                print(
                    f"{shape:>9} {mode:<22} {name:<15} {figures:>17} us  {pct:5.1f}% of copy  "
                    f"{base / best:5.2f}x separate's speed  {results[0]['check']}  windows {results[0]['windows']}"
                )
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        info = {"commit": gb._commit(), "command": "python3 bench/inline_probe.py " + " ".join(sys.argv[1:])}
        Path(out, "inline_probe.json").write_text(json.dumps({"info": info, "ceilings": ceil, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
