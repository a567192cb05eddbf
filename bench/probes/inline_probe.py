"""Decode and writes on the inline page against the separate layout, side by side in one
process, on gpu_bench.py's shapes and checks: decode on the inline page at its table row
(attention_tables.UNALIGNED_DECODE_TILES) and at the other tiles timed for that row, the
separate layout at its own (DECODE_TILES); writes with and without wide_rows' layout, at one
warp a program, and at four heads a program. --row-align 16 (or pow2) adds the aligned inline
page (rows padded to 16 bytes: the separate layout's tiles and write path) to decode and writes.

    PYTHONPATH=. python3 bench/probes/inline_probe.py [--shapes 64x16384,8x65536] [--tiles 32:1:2,64:1:1]
        [--write-tokens 4096,32768] [--row-align 16]  (--shapes "": writes only; --write-tokens "": decode only)
    OUT=DIR ...                                                    (also DIR/inline_probe.json)
    PYTHONPATH=. python bench/probes/inline_probe.py --dry-run            (CPU, Triton interpreter: checks the script)

Each variant is checked against float32 torch attention on its own cache (gpu_bench's check)
before it is timed. The separate layout is timed first and last, so a drift of the clock under
the power cap shows as a difference between its two figures; ratios use the faster.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/
import gpu_bench as gb  # noqa: E402

from kvzoo import launches  # noqa: E402
from kvzoo.backends.triton import attention_kernels, wide_rows, write_kernels  # noqa: E402
from kvzoo.backends.triton.attention_tables import NOT_TIMED, DecodeTile  # noqa: E402

# The tiles the table row was chosen from besides its own (block_n:warps:stages).
OTHER_TILES = "32:1:5,32:1:1,32:1:3,16:1:2,64:1:1,64:1:2,128:4:1"


def _forget() -> None:
    # Tiles, warps and wide copies are chosen at launch preparation: forget prepared and
    # recalled launches so they are chosen again.
    launches.forget()


def _time(variant: str, tile: tuple[int, int, int] | None, q_lens, seq_lens, ceil, row_align=None) -> dict:
    table = attention_kernels.UNALIGNED_DECODE_TILES
    kept = dict(table)
    if tile is not None:
        for key in table:
            table[key] = DecodeTile(*tile, NOT_TIMED)
    gb.INLINE_ROW_ALIGN = row_align
    _forget()
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
        gb.INLINE_ROW_ALIGN = None
    pct = 100 * nbytes / t / 1e9 / ceil["copy_GBps"]
    return {"us": t * 1e6, "pct": pct, "check": check, "how": how}


def _time_write(
    mode: str,
    tokens: int,
    ceil,
    wide: bool = True,
    warps: int | None = None,
    tile_elements: int | None = None,
    row_align=None,
) -> dict:
    """A write of `tokens` rows as gpu_bench times it; warps: every program's, instead of the
    kernel's rule; tile_elements: write_kernels._TILE_ELEMENTS (fewer heads a program)."""
    rule, tile, enabled = write_kernels._write_warps, write_kernels._TILE_ELEMENTS, wide_rows.ENABLED
    wide_rows.ENABLED = wide
    write_kernels._TILE_ELEMENTS = tile_elements or tile
    if warps is not None:
        write_kernels._write_warps = lambda *a, **k: warps
    gb.INLINE_ROW_ALIGN = row_align
    _forget()
    try:
        nbytes = gb._write_bytes(tokens, mode)
        rng = gb.rng_for("inline_probe", "write", tokens, mode)
        sets = [gb._write_set(tokens, mode, rng) for _ in range(gb.n_sets_for(nbytes))]
        check = gb._check_write(sets[0])
        t, how = gb.measure(lambda i: gb._write_call(sets[i]), len(sets), 50)
        sets.clear()
        gb.free()
    finally:
        write_kernels._write_warps, write_kernels._TILE_ELEMENTS = rule, tile
        wide_rows.ENABLED = enabled
        gb.INLINE_ROW_ALIGN = None
    return {"us": t * 1e6, "pct": 100 * nbytes / t / 1e9 / ceil["copy_GBps"], "check": check, "how": how}


def _side_by_side(shape: str, mode: str, time_separate, variants, rows: list) -> None:
    """Time the separate layout, each inline variant (name, its timing call), and the separate
    layout again; print them and add them to rows."""
    first = time_separate()
    got = [(name, timed()) for name, timed in variants]
    last = time_separate()
    base = min(first["us"], last["us"])
    print(f"{shape:>9} {mode:<22} separate             {first['us']:8.1f} / {last['us']:.1f} us  {first['check']}")
    for name, r in got:
        rows.append(dict(shape=shape, mode=mode, variant=name, vs_separate=base / r["us"], separate_us=base, **r))
        print(
            f"{shape:>9} {mode:<22} {name:<20} {r['us']:8.1f} us  {r['pct']:5.1f}% of copy  "
            f"{base / r['us']:5.2f}x separate's speed  {r['check']}"
        )


def _writes(tokens_list, modes, ceil, rows: list, row_align=None) -> None:
    options: tuple[tuple[str, dict], ...] = (
        ("inline write", {}),
        ("inline write, narrow", {"wide": False}),
        ("inline write, 1 warp", {"warps": 1}),
        ("inline write, 4 heads a program", {"tile_elements": 512}),
    )
    if row_align is not None:
        options += ((f"aligned inline write (row_align={row_align})", {"row_align": row_align}),)
    for tokens in tokens_list:
        for mode in modes:
            variants = [
                (name, functools.partial(_time_write, mode + gb.INLINE, tokens, ceil, **kw)) for name, kw in options
            ]
            _side_by_side(f"T={tokens}", mode, functools.partial(_time_write, mode, tokens, ceil), variants, rows)


def _tiles(text: str) -> list[tuple[int, int, int]]:
    return [tuple(int(x) for x in t.split(":")) for t in text.split(",") if t]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="64x4096,64x16384,8x65536")
    ap.add_argument("--modes", default="int8_per_token_head,fp8_per_token_head")
    ap.add_argument("--tiles", default=OTHER_TILES, help="other inline tiles, block_n:warps:stages, comma list")
    ap.add_argument("--write-tokens", default="4096,32768", help="write sizes, comma list (empty: none)")
    ap.add_argument("--row-align", default="", help="also the aligned inline page: 16, 32, ... or pow2 (empty: not)")
    ap.add_argument("--dry-run", action="store_true", help="toy sizes on CPU (gpu_bench reads the flag)")
    args = ap.parse_args()
    row_align = None if not args.row_align else args.row_align if args.row_align == "pow2" else int(args.row_align)
    if args.dry_run:
        args.shapes, args.tiles, args.write_tokens = "2x40", "64:1:1", "40"
    ceil = gb.ceilings(quick=True)
    print(f"copy ceiling {ceil['copy_GBps']:.0f} GB/s; commit {gb._commit()}")
    rows = []
    for shape in [s for s in args.shapes.split(",") if s]:
        batch, ctx = map(int, shape.split("x"))
        q_lens, seq_lens = [1] * batch, [ctx] * batch
        for mode in args.modes.split(","):
            inline = [("inline, table row", None)] + [(f"inline {t}", t) for t in _tiles(args.tiles)]
            variants = [
                (name, functools.partial(_time, mode + gb.INLINE, t, q_lens, seq_lens, ceil)) for name, t in inline
            ]
            if row_align is not None:
                aligned = functools.partial(_time, mode + gb.INLINE, None, q_lens, seq_lens, ceil, row_align)
                variants.append((f"aligned inline (row_align={row_align})", aligned))
            _side_by_side(shape, mode, functools.partial(_time, mode, None, q_lens, seq_lens, ceil), variants, rows)
    _writes([int(t) for t in args.write_tokens.split(",") if t], args.modes.split(","), ceil, rows, row_align)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        info = {"commit": gb._commit(), "command": "python3 bench/probes/inline_probe.py " + " ".join(sys.argv[1:])}
        Path(out, "inline_probe.json").write_text(json.dumps({"info": info, "ceilings": ceil, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
