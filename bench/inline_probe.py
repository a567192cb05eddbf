"""Decode on the inline page against the separate layout, side by side in one process, on
gpu_bench.py's decode shapes and checks: the inline page at its table row
(attention_tables.UNALIGNED_DECODE_TILES) and at the other tiles timed for that row, the
separate layout at its own (DECODE_TILES).

    PYTHONPATH=. python3 bench/inline_probe.py [--shapes 64x16384,8x65536] [--tiles 32:1:2,64:1:1]
    OUT=DIR ...                                                    (also DIR/inline_probe.json)
    PYTHONPATH=. python bench/inline_probe.py --dry-run            (CPU, Triton interpreter: checks the script)

Each variant is checked against float32 torch attention on its own cache (gpu_bench's check)
before it is timed. The separate layout is timed first and last, so a drift of the clock under
the power cap shows as a difference between its two figures; ratios use the faster.
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
from kvzoo.backends.triton.attention_tables import NOT_TIMED, DecodeTile  # noqa: E402

# The tiles the table row was chosen from besides its own (block_n:warps:stages).
OTHER_TILES = "32:1:5,32:1:1,32:1:3,16:1:2,64:1:1,64:1:2,128:4:1"


def _time(variant: str, tile: tuple[int, int, int] | None, q_lens, seq_lens, ceil) -> dict:
    table = attention_kernels.UNALIGNED_DECODE_TILES
    kept = dict(table)
    if tile is not None:
        for key in table:
            table[key] = DecodeTile(*tile, NOT_TIMED)
    # The tile is chosen at launch preparation: forget prepared and recalled launches so it is
    # chosen again.
    recall.forget()
    api._PREPARED.clear()
    try:
        rng = gb.rng_for("inline_probe", variant, len(seq_lens))
        nbytes = gb._attn_bytes(variant, q_lens, seq_lens)
        n = gb.n_sets_for(nbytes)
        sets = [gb._attn_set(variant, q_lens, seq_lens, rng) for _ in range(n)]
        check = gb._check_attention(sets[0], variant, q_lens, seq_lens)
        t, how = gb.measure(lambda i: gb._attn_call(sets[i], variant), n, 20)
        sets.clear()
        gb.free()
    finally:
        table.update(kept)
    pct = 100 * nbytes / t / 1e9 / ceil["copy_GBps"]
    return {"us": t * 1e6, "pct": pct, "check": check, "how": how}


def _tiles(text: str) -> list[tuple[int, int, int]]:
    return [tuple(int(x) for x in t.split(":")) for t in text.split(",") if t]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="64x4096,64x16384,8x65536")
    ap.add_argument("--modes", default="int8_per_token_head,fp8_per_token_head")
    ap.add_argument("--tiles", default=OTHER_TILES, help="other inline tiles, block_n:warps:stages, comma list")
    ap.add_argument("--dry-run", action="store_true", help="toy sizes on CPU (gpu_bench reads the flag)")
    args = ap.parse_args()
    if args.dry_run:
        args.shapes, args.tiles = "2x40", "64:1:1"
    ceil = gb.ceilings(quick=True)
    print(f"copy ceiling {ceil['copy_GBps']:.0f} GB/s; commit {gb._commit()}")
    rows = []
    for shape in args.shapes.split(","):
        batch, ctx = map(int, shape.split("x"))
        q_lens, seq_lens = [1] * batch, [ctx] * batch
        for mode in args.modes.split(","):
            first = _time(mode, None, q_lens, seq_lens, ceil)
            inline = [("inline, table row", None)] + [(f"inline {t}", t) for t in _tiles(args.tiles)]
            got = [(name, _time(mode + gb.INLINE, t, q_lens, seq_lens, ceil)) for name, t in inline]
            last = _time(mode, None, q_lens, seq_lens, ceil)
            base = min(first["us"], last["us"])
            print(f"{shape:>9} {mode:<22} separate          {first['us']:8.1f} / {last['us']:.1f} us  {first['check']}")
            for name, r in got:
                rows.append(
                    dict(shape=shape, mode=mode, variant=name, vs_separate=base / r["us"], separate_us=base, **r)
                )
                print(
                    f"{shape:>9} {mode:<22} {name:<17} {r['us']:8.1f} us  {r['pct']:5.1f}% of copy  "
                    f"{base / r['us']:5.2f}x separate's speed  {r['check']}"
                )
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        info = {"commit": gb._commit(), "command": "python3 bench/inline_probe.py " + " ".join(sys.argv[1:])}
        Path(out, "inline_probe.json").write_text(json.dumps({"info": info, "ceilings": ceil, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
