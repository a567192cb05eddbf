"""What does kvzoo reach on the GPU, in a page a user reads in two minutes? Writes bench/RESULTS.md
and its plots (bench/plots/*.png) from a benchmark run's JSON: every figure on the page is read
from the run, and the words around the figures say why.

    OUT=/tmp/run python3 bench/gpu_bench.py                       # on the GPU: /tmp/run/bench.json
    OUT=/tmp/run python3 bench/host_cost.py                       # optional: /tmp/run/host_cost.json
    python bench/real_model.py --json /tmp/run/real_model.json    # optional, CPU: the real-model table
    python bench/scaleout_transfer.py --json /tmp/run/scaleout_transfer.json   # optional: scale-out
    python bench/audit_speed.py --json /tmp/run/audit_speed.json  # optional, CPU: kvzoo.audit's rate
    python3 bench/e2e_transformers.py --json /tmp/run/e2e_transformers.json  # optional, GPU: end to end
    python bench/report.py /tmp/run                               # writes bench/RESULTS.md, bench/plots/

RUN is a folder holding bench.json (and, when present, host_cost.json, real_model.json,
scaleout_transfer.json, audit_speed*.json and e2e_transformers*.json) or a bench.json itself;
--scaleout, --audit-speed and --e2e name those JSONs elsewhere. --out and --plots write
elsewhere; --no-plots leaves matplotlib out (the plots need `pip install "kvzoo[plots]"`). The
JSON shapes read here are the ones the scripts above write; a section whose JSON is absent says
where its last figures are instead.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
KVZOO = "triton-cuda"
EAGER = KVZOO + " (eager)"
QUANTIZED = ("int8", "fp8")
# How each variant of gpu_bench.py's case names reads on the page (the benchmark's model dtype is bf16).
VARIANT_LABEL = {
    "none": "bf16",
    "int8": "int8",
    "fp8": "fp8",
    "int8 qk-int8": "int8 quantize_query",
    "int8 direct": "int8 direct kernel",
    "fp8 direct": "fp8 direct kernel",
    "int8 inline": "int8 inline page",
    "fp8 inline": "fp8 inline page",
    "int4": "int4 (rotated)",
    "int4 direct": "int4 direct kernel",
    "int8 per-tensor": "int8 per-tensor",
    "fp8 per-tensor": "fp8 per-tensor",
    "fp8-e5m2 per-tensor": "fp8 e5m2 per-tensor",
}
# gpu_bench.py's per-tensor variants (one static scale a cache), reported in a line of their own,
# by the name each gets there.
PER_TENSOR = {"int8 per-tensor": "int8", "fp8 per-tensor": "fp8 e4m3", "fp8-e5m2 per-tensor": "fp8 e5m2"}
# Issue 5's smallest write size with a bandwidth target; smaller writes are launch-bound.
WRITE_TARGET_TOKENS = 4096
# Issue 5's decode contexts: the main shape's, and the split-KV shape's (few long sequences).
DECODE_CONTEXT, SPLIT_CONTEXT = 16384, 65536
# Issue 5's launch-bound writes, reported in microseconds: 1 to this many tokens.
SMALL_WRITE_TOKENS = 16
ARCHIVE = "archive/RESULTS-history.md"


# ---------------------------------------------------------------------------------------------
# the run, read


@dataclass(frozen=True)
class Row:
    op: str  # write, decode, prefill, mixed
    shape: str  # as gpu_bench.py names it: "T=32768", "64x16384", "4x1024chunk+60dec"
    variant: str  # none, int8, fp8, "int8 qk-int8", "int8 direct", "sdpa-bf16", "bf16", "copy of int8 bytes"
    impl: str
    time_us: float
    metric: float | None
    unit: str
    pct: float | None
    check: str
    how: str

    @property
    def kvzoo(self) -> bool:
        return self.impl == KVZOO

    @property
    def error(self) -> float | None:
        found = re.search(r"err ([0-9.eE+-]+)", self.check)
        return float(found.group(1)) if found else None

    @property
    def moved(self) -> float | None:
        """Bytes the row counts as moved (GB/s rows only)."""
        return self.metric * 1e9 * self.time_us * 1e-6 if self.unit == "GB/s" and self.metric else None


def parse_case(case: str) -> tuple[str, str, str]:
    """gpu_bench.py's case name as (op, shape, variant)."""
    op, shape, *rest = case.split()
    if rest[:1] == ["causal"]:
        rest = rest[1:]
    return op, shape, " ".join(rest)


def numbers(shape: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", shape)]


def size_of(shape: str) -> int:
    """Tokens written, keys read or query tokens: what makes one shape of an op bigger than another."""
    n = numbers(shape)
    return n[0] * (n[1] if len(n) > 1 else 1)


@dataclass
class Run:
    info: dict
    ceilings: dict
    rows: list[Row]
    failed: list[str] = field(default_factory=list)
    host_cost: dict | None = None
    real_model: dict | None = None
    scaleout: dict | None = None
    # real_model.py --ablate runs (real_model_ablate*.json beside bench.json), by file name.
    ablations: list[dict] = field(default_factory=list)
    # audit_speed.py runs (audit_speed*.json beside bench.json, or --audit-speed).
    audit_speeds: list[dict] = field(default_factory=list)
    # e2e_transformers.py runs (e2e_transformers*.json beside bench.json, or --e2e).
    e2e: list[dict] = field(default_factory=list)

    @property
    def dry(self) -> bool:
        return self.info.get("gpu", "").startswith("cpu")

    def find(self, op: str, shape: str, variant: str, impl: str | None = None) -> Row | None:
        for r in self.rows:
            if (r.op, r.shape, r.variant) == (op, shape, variant) and (impl is None or r.impl == impl):
                return r
        return None

    def kvzoo(self, op: str, shape: str, variant: str) -> Row | None:
        return self.find(op, shape, variant, KVZOO)

    def shapes(self, op: str) -> list[str]:
        """The shapes kvzoo's rows of the op have (its eager rows aside), smallest first."""
        seen = {r.shape for r in self.rows if r.op == op and r.kvzoo}
        return sorted(seen, key=size_of)

    def largest(self, op: str) -> str | None:
        shapes = self.shapes(op)
        return shapes[-1] if shapes else None

    def with_context(self, op: str, context: int) -> str | None:
        return next((s for s in self.shapes(op) if len(numbers(s)) > 1 and numbers(s)[1] == context), None)

    def write_shape(self, tokens: int) -> str | None:
        return next((s for s in self.shapes("write") if numbers(s)[0] == tokens), None)

    def eager_decode(self) -> Row | None:
        return next((r for r in self.rows if r.op == "decode" and r.impl == EAGER), None)


def load(
    source: Path,
    host_cost: Path | None = None,
    real_model: Path | None = None,
    scaleout: Path | None = None,
    audit_speed: list[Path] | None = None,
    e2e: list[Path] | None = None,
) -> Run:
    """The run in `source` (a folder holding bench.json, or the file), with the optional JSONs
    found beside it unless given."""
    folder = source if source.is_dir() else source.parent
    bench = source / "bench.json" if source.is_dir() else source
    data = json.loads(bench.read_text())
    rows, failed = [], []
    for r in data["rows"]:
        if r.get("error"):
            failed.append(f"{r['case']} ({r['impl']}): {r['error']}")
            continue
        if r.get("time_us") is None:
            continue
        op, shape, variant = parse_case(r["case"])
        rows.append(
            Row(
                op,
                shape,
                variant,
                r["impl"],
                r["time_us"],
                r.get("metric"),
                r.get("unit", ""),
                r.get("pct"),
                r.get("check", ""),
                r.get("how", ""),
            )
        )
    run = Run(data["info"], data["ceilings"], rows, failed)
    for attr, given, name in (
        ("host_cost", host_cost, "host_cost.json"),
        ("real_model", real_model, "real_model.json"),
        ("scaleout", scaleout, "scaleout_transfer.json"),
    ):
        path = given or folder / name
        if path.exists():
            setattr(run, attr, json.loads(path.read_text()))
    run.ablations = [json.loads(p.read_text()) for p in sorted(folder.glob("real_model_ablate*.json"))]
    paths = audit_speed if audit_speed else sorted(folder.glob("audit_speed*.json"))
    run.audit_speeds = [json.loads(Path(p).read_text()) for p in paths]
    paths = e2e if e2e else sorted(folder.glob("e2e_transformers*.json"))
    run.e2e = [json.loads(Path(p).read_text()) for p in paths]
    return run


# ---------------------------------------------------------------------------------------------
# words around the figures


def span(values: Iterable[float], spec: str = ".1f") -> str:
    """'lo-hi', or one figure when both print the same."""
    vals = sorted(values)
    lo, hi = format(vals[0], spec), format(vals[-1], spec)
    return lo if lo == hi else f"{lo} to {hi}" if "e" in spec else f"{lo}-{hi}"


def versus(alt_us: float, us: float) -> str:
    """An alternative's time against kvzoo's, from the alternative's side."""
    r = alt_us / us
    return f"{r:.2f}x slower" if r >= 1 else f"{1 / r:.2f}x faster"


def us(t: float) -> str:
    return f"{t:.1f} us"


def label(op: str, shape: str) -> str:
    n = numbers(shape)
    if op == "write":
        return f"write {n[0]} tokens"
    if op == "decode":
        return f"decode {n[0]} x {n[1]}"
    if op == "prefill":
        return f"prefill {n[0]} x {n[1]} causal"
    if op == "mixed":
        return f"mixed batch ({n[0]} x {n[1]} chunks + {n[2]} decodes)"
    return f"{op} {shape}"


def _alternatives(run: Run, row: Row) -> str:
    parts = []
    if row.op == "write":
        index_copy = run.find("write", row.shape, "bf16", "torch index_copy_")
        copy = run.find("write", row.shape, "copy of int8 bytes")
        if index_copy:
            parts.append(f"bf16 `index_copy_` {us(index_copy.time_us)} ({versus(index_copy.time_us, row.time_us)})")
        if copy:
            parts.append(f"a plain copy of the same bytes {us(copy.time_us)} ({copy.pct:.1f}% of limit)")
        return "; ".join(parts) or "-"
    bf16 = run.kvzoo(row.op, row.shape, "none")
    if bf16 and row.variant != "none":
        parts.append(f"kvzoo bf16 {versus(bf16.time_us, row.time_us)}")
    sdpa = run.find(row.op, row.shape, "sdpa-bf16")
    if sdpa:
        parts.append(f"torch SDPA on contiguous bf16 {us(sdpa.time_us)} ({versus(sdpa.time_us, row.time_us)})")
    return "; ".join(parts) or "-"


# (op, which shape, variants): the rows of the page's table. "largest" is the op's biggest shape;
# an int is the write of that many tokens or the decode at that context.
HEADLINE: tuple[tuple[str, str | int, tuple[str, ...]], ...] = (
    ("write", "largest", QUANTIZED),
    ("write", WRITE_TARGET_TOKENS, ("int8",)),
    ("decode", "largest", ("none", *QUANTIZED)),
    ("decode", SPLIT_CONTEXT, ("int8",)),
    ("prefill", "largest", ("none", *QUANTIZED)),
    ("mixed", "largest", ("int8",)),
)


def headline_rows(run: Run) -> list[Row]:
    picked: list[Row] = []
    for op, which, variants in HEADLINE:
        if which == "largest":
            shape = run.largest(op)
        elif op == "write":
            shape = run.write_shape(which)
        else:
            shape = run.with_context(op, which)
        for v in variants:
            row = run.kvzoo(op, shape, v) if shape else None
            if row and row not in picked:
                picked.append(row)
    return picked


def _pct(row: Row) -> str:
    return "-" if row.pct is None else f"{row.pct:.1f}"


def table(run: Run) -> list[str]:
    out = ["| what | kvzoo | % of limit | what a user would pick instead |", "|---|---|---|---|"]
    for row in headline_rows(run):
        out.append(
            f"| {label(row.op, row.shape)}, {VARIANT_LABEL.get(row.variant, row.variant)} | "
            f"{us(row.time_us)} | {_pct(row)} | {_alternatives(run, row)} |"
        )
    eager = run.eager_decode()
    if eager:
        n = numbers(eager.shape)
        out.append(
            f"| eager API call, decode {n[0]} x {n[1]}, {eager.variant} | {us(eager.time_us)} | - | host time "
            "dominates: the plan's per-layer calls, or a CUDA graph of the step (host time below) |"
        )
    return out


def _writes(run: Run) -> str | None:
    big = run.largest("write")
    rows = [r for v in QUANTIZED if (r := run.kvzoo("write", big, v))] if big else []
    if not rows:
        return None
    copy = run.find("write", big, "copy of int8 bytes")
    text = f"**Writes** of {numbers(big)[0]} tokens stream at {span(r.pct for r in rows)}% of the copy ceiling" + (
        f" (a plain copy of the same bytes: {copy.pct:.1f}%)." if copy else "."
    )
    small = run.write_shape(WRITE_TARGET_TOKENS)
    w, c = (
        (run.kvzoo("write", small, "int8"), run.find("write", small, "copy of int8 bytes")) if small else (None, None)
    )
    if w and c and small != big:
        text += (
            f" At {WRITE_TARGET_TOKENS} tokens the int8 write reaches {w.pct:.1f}% and a plain copy of the same "
            f"bytes {c.pct:.1f}%: a transfer that small stays under the ceiling's rate; the kernel's own "
            "share is the gap to the copy."
        )
    graph = [
        r
        for r in run.rows
        if r.op == "write" and r.kvzoo and numbers(r.shape)[0] <= SMALL_WRITE_TOKENS and r.how == "graph"
    ]
    eager = [r for r in run.rows if r.op == "write" and r.impl == EAGER]
    if graph:
        text += f" A CUDA graph replays a write of 1-{SMALL_WRITE_TOKENS} tokens in {span(r.time_us for r in graph)} us"
        text += f"; an eager API call takes {span((r.time_us for r in eager), '.0f')} us." if eager else "."
    return text


def _decode(run: Run) -> str | None:
    shapes = run.shapes("decode")
    quant = [r for s in shapes for v in QUANTIZED if (r := run.kvzoo("decode", s, v))]
    bf16 = [r for s in shapes if (r := run.kvzoo("decode", s, "none"))]
    if not quant:
        return None
    text = (
        f"**Quantized decode** streams at {span(r.pct for r in quant)}% of the copy ceiling "
        f"({', '.join(label('decode', s).removeprefix('decode ') for s in shapes)}). Each tile is a dependent "
        "chain of conversions, dots and softmax, so the kernel slows with the SM clock, and the board's power "
        "cap lowers the clock under sustained load: `bench/sustained.py` measures it at full clock and under "
        "the cap ([docs/hardware.md](../docs/hardware.md))."
    )
    if bf16:
        text += (
            f" bf16 decode is bound by DRAM and reads at {span(r.pct for r in bf16)}% of the copy ceiling "
            "(a pure read streams faster than a copy, which the ceiling counts as read + write)."
        )
    pairs = [(q, b) for s in shapes if (q := run.kvzoo("decode", s, "int8")) and (b := run.kvzoo("decode", s, "none"))]
    if pairs and all(q.moved and b.moved for q, b in pairs):
        text += (
            f" int8 moves {span((q.moved / b.moved for q, b in pairs), '.3f')}x bf16's bytes, so at bf16's "
            f"rate it would run {span((b.moved / q.moved for q, b in pairs), '.2f')}x faster than kvzoo bf16; "
            f"it runs {span((b.time_us / q.time_us for q, b in pairs), '.2f')}x."
        )
    return text


def _prefill(run: Run) -> str | None:
    big = run.largest("prefill")
    rows = [r for v in ("none", *QUANTIZED) if (r := run.kvzoo("prefill", big, v))] if big else []
    if not rows:
        return None
    sdpa = run.find("prefill", big, "sdpa-bf16")
    text = f"**Prefill** reaches {span(r.pct for r in rows)}% of the bf16 matmul rate" + (
        f", against SDPA's {sdpa.pct:.1f}%." if sdpa else "."
    )
    direct = [
        (d, s)
        for v in QUANTIZED
        if (d := run.kvzoo("prefill", big, v + " direct")) and (s := run.kvzoo("prefill", big, v))
    ]
    if direct:
        text += (
            " Quantized prefill converts each key's codes once into an fp16 workspace (staging.py) and then "
            f"runs like bf16; the direct kernel, converting in every query tile, takes "
            f"{span((d.time_us / s.time_us for d, s in direct), '.2f')}x as long."
        )
    text += (
        " How much of the gap to SDPA is Triton's own code generation: `bench/probes/flash_bound.py` times a plain "
        f"Triton flash kernel on contiguous bf16 on this shape (last figures in [the archive]({ARCHIVE}))."
    )
    mixed = run.largest("mixed")
    pairs = [
        (q, b)
        for v in QUANTIZED
        if mixed and (q := run.kvzoo("mixed", mixed, v)) and (b := run.kvzoo("mixed", mixed, "none"))
    ]
    if pairs:
        text += (
            f" The {label('mixed', mixed)} runs at {span((b.time_us / q.time_us for q, b in pairs), '.2f')}x "
            "kvzoo bf16's speed with int8 and fp8 caches."
        )
    return text


def _quantize_query(run: Run) -> str | None:
    pairs = [
        (q, d)
        for r in run.rows
        if r.kvzoo and r.variant == "int8 qk-int8"
        for q, d in [(r, run.kvzoo(r.op, r.shape, "int8"))]
        if d
    ]
    if not pairs:
        return None
    by_op = "; ".join(
        f"{op} {span((d.time_us / q.time_us for q, d in pairs if q.op == op), '.2f')}x"
        for op in dict.fromkeys(q.op for q, _ in pairs)
    )
    errs = [q.error for q, _ in pairs if q.error is not None]
    return (
        "**`quantize_query=True`** (QK^T on int8 codes) runs at this multiple of the default int8 path's speed: "
        f"{by_op}" + (f"; its error is {span(errs, '.1e')}." if errs else ".")
    )


def _per_tensor(run: Run) -> str | None:
    parts = []
    for op in ("write", "decode"):
        shapes = [s for s in run.shapes(op) if any(run.kvzoo(op, s, v) for v in PER_TENSOR)]
        if not shapes:
            continue
        shape = shapes[-1]  # the largest: gpu_bench.py times them at one shape an op
        rows = [r for v in PER_TENSOR if (r := run.kvzoo(op, shape, v))]
        figures = ", ".join(f"{PER_TENSOR[r.variant]} {us(r.time_us)} ({_pct(r)}%)" for r in rows)
        per_token = run.kvzoo(op, shape, "int8")
        versus_int8 = f"; per-token-head int8 {us(per_token.time_us)}" if per_token else ""
        parts.append(f"{label(op, shape)}: {figures}{versus_int8}")
    if not parts:
        return None
    return (
        "**Per-tensor modes** (one static scale a cache: vLLM's int8_per_tensor and its fp8 e4m3 and e5m2 "
        "kv-cache dtypes), time and % of the copy ceiling: " + "; ".join(parts) + "."
    )


def _host(run: Run) -> str | None:
    eager = run.eager_decode()
    if not eager:
        return None
    n = numbers(eager.shape)
    return (
        f"**Host time**: an eager API call (decode {n[0]} x {n[1]}, {eager.variant}) takes {us(eager.time_us)}, "
        "almost all of it on the host (argument checks, Triton's launcher); a CUDA graph of the step removes it."
    )


def prose(run: Run) -> list[str]:
    return [f"- {p}" for p in (f(run) for f in (_writes, _decode, _prefill, _quantize_query, _per_tensor, _host)) if p]


def accuracy(run: Run) -> str | None:
    plain = [r.error for r in run.rows if r.kvzoo and r.error is not None and "qk-int8" not in r.variant]
    qq = [r.error for r in run.rows if r.kvzoo and r.error is not None and "qk-int8" in r.variant]
    if not plain:
        return None
    return (
        "Accuracy, each attention row against float32 torch attention on the same cache (relative error, bf16 "
        f"output rounding included): {span(plain, '.1e')}"
        + (f"; with `quantize_query=True` {span(qq, '.1e')}." if qq else ".")
    )


# ---------------------------------------------------------------------------------------------
# issue 5's targets


@dataclass(frozen=True)
class Target:
    issue: int
    text: str
    measure: Callable[[Run], tuple[str, bool | None] | None]  # (figure, met) or None: not in this run


def _pct_at(run: Run, shape: str | None, variants: Iterable[str], floor: float):
    rows = [r for v in variants if shape and (r := run.kvzoo("decode", shape, v))]
    if not rows:
        return None
    return ", ".join(f"{r.variant} {r.pct:.1f}%" for r in rows), all(r.pct >= floor for r in rows)


def _ratio_target(run: Run, op: str, fast: str, slow: Callable[[str], Row | None], floor: float, strict=False):
    found = [(s, f.time_us, b.time_us) for s in run.shapes(op) if (f := run.kvzoo(op, s, fast)) and (b := slow(s))]
    if not found:
        return None
    figure = ", ".join(f"{b / f:.2f}x at {label(op, s).removeprefix(op + ' ')}" for s, f, b in found)
    return figure, all((b / f > floor) if strict else (b / f >= floor) for _, f, b in found)


def _writes_target(run: Run):
    rows = [
        r
        for s in run.shapes("write")
        if numbers(s)[0] >= WRITE_TARGET_TOKENS
        for v in QUANTIZED
        if (r := run.kvzoo("write", s, v))
    ]
    if not rows:
        return None
    return f"{span(r.pct for r in rows)}%", all(r.pct >= 75 for r in rows)


def _small_writes(run: Run):
    rows = [r for r in run.rows if r.op == "write" and r.kvzoo and numbers(r.shape)[0] <= SMALL_WRITE_TOKENS]
    return (f"{span(r.time_us for r in rows)} us ({', '.join(sorted({r.how for r in rows}))})", None) if rows else None


def _prefill_vs_bf16(run: Run):
    big = run.largest("prefill")
    b = run.kvzoo("prefill", big, "none") if big else None
    rows = [r for v in QUANTIZED if b and (r := run.kvzoo("prefill", big, v))]
    if not rows:
        return None
    return (
        ", ".join(f"{r.variant} {b.time_us / r.time_us:.2f}x" for r in rows),
        all(r.time_us <= 1.1 * b.time_us for r in rows),
    )


def _prefill_vs_sdpa(run: Run):
    big = run.largest("prefill")
    sdpa = run.find("prefill", big, "sdpa-bf16") if big else None
    rows = [r for v in QUANTIZED if sdpa and (r := run.kvzoo("prefill", big, v))]
    if not rows:
        return None
    return (
        ", ".join(f"{r.variant} {sdpa.time_us / r.time_us:.2f}x" for r in rows),
        all(sdpa.time_us / r.time_us >= 0.6 for r in rows),
    )


def _decode_pct(run: Run, floor: float):
    rows = [
        (s, r)
        for c in (DECODE_CONTEXT, SPLIT_CONTEXT)
        if (s := run.with_context("decode", c))
        for v in QUANTIZED
        if (r := run.kvzoo("decode", s, v))
    ]
    if not rows:
        return None
    figure = ", ".join(f"{r.variant} {r.pct:.1f}% at {label('decode', s).removeprefix('decode ')}" for s, r in rows)
    return figure, all(r.pct >= floor for _, r in rows)


def _int8_vs_bf16(floor: float):
    return lambda run: _ratio_target(run, "decode", "int8", lambda s: run.kvzoo("decode", s, "none"), floor)


def _vs_sdpa(variant: str, floor: float, strict: bool = False):
    return lambda run: _ratio_target(
        run, "decode", variant, lambda s: run.find("decode", s, "sdpa-bf16"), floor, strict
    )


def _inline_vs_separate(run: Run):
    """Decode on the inline page against the separate layout, per quantized mode and shape."""
    figures, ratios = [], []
    for shape in run.shapes("decode"):
        for mode in QUANTIZED:
            inline, separate = run.kvzoo("decode", shape, f"{mode} inline"), run.kvzoo("decode", shape, mode)
            if inline and separate:
                ratios.append(separate.time_us / inline.time_us)
                figures.append(f"{mode} {ratios[-1]:.2f}x at {shape}")
    return ("; ".join(figures), min(ratios) >= 0.95) if ratios else None


def _inline_writes(run: Run):
    """Writes to the inline page against the separate layout, per quantized mode and size."""
    figures, ratios = [], []
    for shape in run.shapes("write"):
        for mode in QUANTIZED:
            inline, separate = run.kvzoo("write", shape, f"{mode} inline"), run.kvzoo("write", shape, mode)
            if inline and separate:
                ratios.append(separate.time_us / inline.time_us)
                figures.append(f"{mode} {ratios[-1]:.2f}x at {shape}")
    return ("; ".join(figures), min(ratios) >= 0.95) if ratios else None


def _int4_at(run: Run, op: str, shape: str | None, floor: float):
    """int4 against kvzoo's bf16 (decode) at one shape: (figure, met)."""
    i, b = (run.kvzoo(op, shape, v) if shape else None for v in ("int4", "none"))
    return (f"{b.time_us / i.time_us:.2f}x at {shape}", b.time_us / i.time_us >= floor) if i and b else None


def _int4_prefill(run: Run):
    big = run.largest("prefill")
    i, q = (run.kvzoo("prefill", big, v) if big else None for v in ("int4", "int8"))
    return (f"{i.time_us / q.time_us:.2f}x int8's time", i.time_us <= 1.1 * q.time_us) if i and q else None


def _int4_write(run: Run):
    rows = [r for s in run.shapes("write") if (r := run.kvzoo("write", s, "int4"))]
    return (", ".join(f"{r.pct:.1f}% at {r.shape}" for r in rows), all(r.pct >= 80 for r in rows)) if rows else None


def _fp8_dots_prefill(run: Run):
    """fp8_dots prefill against torch SDPA bf16 at the largest prefill, with its error."""
    big = run.largest("prefill")
    f, sdpa = (run.find("prefill", big, v) if big else None for v in ("fp8 fp8-dots", "sdpa-bf16"))
    if not (f and sdpa and f.error is not None):
        return None
    ratio = sdpa.time_us / f.time_us
    return f"{ratio:.2f}x at {big}, error {f.error:.1e}", ratio >= 1.2 and f.error <= 3e-2


# What the issues ask of these rows (figures the issues fix, not measurements).
TARGETS = (
    Target(
        5,
        f"int8/fp8 decode at {DECODE_CONTEXT} context >= 85% of the copy ceiling",
        lambda run: _pct_at(run, run.with_context("decode", DECODE_CONTEXT), QUANTIZED, 85),
    ),
    Target(5, "int8 decode >= 1.8x kvzoo bf16", _int8_vs_bf16(1.8)),
    Target(5, "bf16 decode >= 0.95x torch SDPA", _vs_sdpa("none", 0.95)),
    Target(5, "int8 decode faster than torch SDPA", _vs_sdpa("int8", 1.0, strict=True)),
    Target(5, "fp8 decode faster than torch SDPA", _vs_sdpa("fp8", 1.0, strict=True)),
    Target(
        5,
        f"split-KV decode at {SPLIT_CONTEXT} context >= 85%",
        lambda run: _pct_at(run, run.with_context("decode", SPLIT_CONTEXT), ("none", *QUANTIZED), 85),
    ),
    Target(5, f"int8/fp8 writes of >= {WRITE_TARGET_TOKENS} tokens >= 75% of the copy ceiling", _writes_target),
    Target(5, f"writes of 1-{SMALL_WRITE_TOKENS} tokens: one launch, time reported", _small_writes),
    Target(5, "int8/fp8 prefill within 10% of kvzoo bf16 (speed against it)", _prefill_vs_bf16),
    Target(5, "int8/fp8 prefill >= 60% of torch SDPA's TFLOP/s (speed against it)", _prefill_vs_sdpa),
    Target(
        20,
        f"int8/fp8 decode at {DECODE_CONTEXT} and {SPLIT_CONTEXT} context >= 90% of the copy ceiling",
        lambda run: _decode_pct(run, 90),
    ),
    Target(20, "int8 decode >= 1.75x kvzoo bf16", _int8_vs_bf16(1.75)),
    Target(20, "decode on the inline page >= 0.95x the separate layout's speed", _inline_vs_separate),
    Target(20, "writes to the inline page >= 0.95x the separate layout's speed", _inline_writes),
    Target(20, "fp8_dots prefill >= 1.2x torch SDPA bf16, error <= 3e-2", _fp8_dots_prefill),
    Target(
        19,
        f"int4 decode at 64x{DECODE_CONTEXT} >= 2.8x kvzoo bf16",
        lambda run: _int4_at(run, "decode", run.with_context("decode", DECODE_CONTEXT), 2.8),
    ),
    Target(
        19,
        f"int4 decode at {DECODE_CONTEXT} context >= 80% of the copy ceiling (its own bytes)",
        lambda run: _pct_at(run, run.with_context("decode", DECODE_CONTEXT), ("int4",), 80),
    ),
    Target(19, "int4 prefill within 10% of int8's", _int4_prefill),
    Target(19, "int4 writes >= 80% of the copy ceiling", _int4_write),
)


def targets(run: Run) -> list[str]:
    out = ["| issue | target | this run | met? |", "|---|---|---|---|"]
    for t in TARGETS:
        got = t.measure(run)
        figure, met = got if got else ("not in this run", None)
        out.append(f"| {t.issue} | {t.text} | {figure} | {'-' if met is None else 'yes' if met else '**no**'} |")
    return out


# ---------------------------------------------------------------------------------------------
# the optional runs


def host_cost_section(run: Run) -> list[str]:
    hc = run.host_cost
    if hc is None:
        return [
            "**Host time per layer call**: not part of this run (`OUT=DIR python3 bench/host_cost.py` writes "
            f"DIR/host_cost.json); the last figures are in [the archive]({ARCHIVE})."
        ]
    info = hc.get("info", {})
    rows = hc.get("rows", [])
    null = next((r for r in rows if r["row"].startswith("null op")), None)
    groups: dict[str, list[dict]] = {}
    for r in rows:
        if r is not null:
            group, _, call = r["row"].partition(": ")
            groups.setdefault(group, []).append({**r, "call": call})
    where = ", ".join(str(info[k]) for k in ("date", "device") if info.get(k))
    impls = [f"{op} {info[k]}" for op, k in (("write", "write_impl"), ("attention", "attention_impl")) if info.get(k)]
    where += "".join(f", {i}" for i in impls)
    head = (
        f"**Host time per layer call** ({where}, commit {info.get('commit', 'unknown')}, "
        f"`{info.get('command', 'python3 bench/host_cost.py')}`: {info.get('case', '')}, median of "
        f"{info.get('calls', '?')} calls per row, each followed by a synchronisation, rows round-robin"
        + (f"; the null op, `{null['row']}`, takes {us(null['synchronised_us'])}" if null else "")
        + "). "
        "Microseconds above the null op, per call synchronised (the issue's measure) and per call over "
        "32 calls back to back (what a step of 32 layers sees, with warm caches):"
    )
    out = [head, ""]
    write, attention = groups.pop("write", []), groups.pop("attention", [])
    if write or attention:
        out += [
            "| call | write, synchronised | write, back to back | attention, synchronised | attention, back to back |",
            "|---|---|---|---|---|",
        ]
        for i in range(max(len(write), len(attention))):
            w = write[i] if i < len(write) else None
            a = attention[i] if i < len(attention) else None
            name = " / ".join(dict.fromkeys(x["call"] for x in (w, a) if x))
            out.append(
                f"| {name} | {_above(w)} | {_above(w, 'back_to_back_above_null_us')} | {_above(a)} | "
                f"{_above(a, 'back_to_back_above_null_us')} |"
            )
    for group, entries in groups.items():
        out += ["", f"{group}: " + "; ".join(f"`{e['call']}` {us(e['above_null_us'])}" for e in entries) + "."]
    return out


def _above(entry: dict | None, key: str = "above_null_us") -> str:
    # (JSON from before the back-to-back column lacks its key.)
    return "-" if entry is None or key not in entry else f"{entry[key]:.1f}"


def ablation_section(run: Run) -> list[str]:
    """What bounds a format on the real model (real_model.py --ablate): each row against its own
    group's unquantized row (kvzoo's real kernels, or a DynamicCache reading rounded K/V)."""
    out: list[str] = []
    for ab in run.ablations:
        rows = ab.get("ablation", {}).get("rows", {})
        out += [
            "",
            f"**What bounds fp8 on the real model** (`{ab.get('command', 'python bench/real_model.py --ablate')}`; "
            f"{ab.get('text', '')}). Perplexity change against the same group's unquantized row; the interval "
            "is a paired bootstrap over chunks:",
            "",
            "| row | what | change | 95% interval |",
            "|---|---|---|---|",
        ]
        for name, r in rows.items():
            if not r.get("delta"):
                continue
            interval = r.get("interval")
            shown = f"[{100 * interval[0]:+.2f}%, {100 * interval[1]:+.2f}%]" if interval else "-"
            out.append(f"| {name} | {r.get('what', '')} | {100 * r['delta']:+.3f}% | {shown} |")
        out += [f"- {check}" for check in ab.get("ablation", {}).get("checks", [])]
    return out


def _gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _scaleout_cell(row: dict, key: str, raw: str | None = None) -> str:
    if key + "_s" not in row:  # a --transfer-only run
        return "-"
    kvzoo_s, raw_s = row[key + "_s"], row["raw_" + (raw or key) + "_s"]
    rate = f"{_gbps(row['bytes'], kvzoo_s):.2f} GB/s"
    if key.startswith("send") and "pages" in row:
        rate += f", {row['pages'] / kvzoo_s:,.0f} pages/s"
    return f"{kvzoo_s * 1e3:.1f} / {raw_s * 1e3:.1f} ms ({rate})"


def scaleout_table(result: dict, rows: list[dict] | None = None) -> list[str]:
    """bench/scaleout_transfer.py's rows (all, or those given): each operation's time against the
    raw tensor's, and its rate."""
    rows = result["rows"] if rows is None else rows
    out = [
        "| mode | tokens | bytes/token/layer (x bf16) | transfer / raw send | transfer, workspace kept / raw send "
        "| save / raw save | load + place / raw load | offload + back / raw copies |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        per_token = r["bytes_per_token_layer"]
        out.append(
            f"| {r['mode']} | {r['tokens']} | {per_token:.0f} ({per_token / r['bf16_bytes_per_token_layer']:.3f}x) "
            f"| {_scaleout_cell(r, 'send')} | {_scaleout_cell(r, 'send_workspace', 'send')} "
            f"| {_scaleout_cell(r, 'save')} | {_scaleout_cell(r, 'load')} | {_scaleout_cell(r, 'offload')} |"
        )
    copies = "; ".join(
        f"{r['mode']} {r['tokens']}: gather {r['gather_s'] * 1e3:.1f}, place {r['place_s'] * 1e3:.1f}"
        for r in rows
        if "gather_s" in r
    )
    link = result["link"]
    if copies:
        out += ["", f"The copies a raw tensor does not make, alone (ms): {copies}."]
    return out + [
        "",
        f"Link: one raw message of {link['bytes'] / 2**20:.0f} MiB in {link['seconds'] * 1e3:.1f} ms, "
        f"{_gbps(link['bytes'], link['seconds']):.2f} GB/s.",
    ]


def scaleout_section(run: Run) -> list[str]:
    so = run.scaleout
    if so is None:
        return [
            "**Scale-out** (page transfer, page files and offload against one raw tensor of the same bytes): not "
            "part of this run (`python bench/scaleout_transfer.py --json DIR/scaleout_transfer.json`); the last "
            f"figures are in [the archive]({ARCHIVE})."
        ]
    i = so["info"]
    largest = max(r["tokens"] for r in so["rows"])
    return [
        f"**Scale-out** ({i['date']}, {i['machine']}, torch {i['torch']}, {i['backend']}, commit {i['commit']}, "
        f"`{i['command']}`, load average {i.get('load_average') or 0:.1f} at the start): kvzoo.distributed's page "
        "transfer, page files and host offload against moving or saving the same bytes as one raw tensor, "
        f"medians (kvzoo / raw, and kvzoo's rate) at {largest} tokens (every size: the run's JSON, and the archive):",
        "",
        *scaleout_table(so, [r for r in so["rows"] if r["tokens"] == largest]),
    ]


def real_model_section(run: Run) -> list[str]:
    rm = run.real_model
    if rm is None or not rm.get("formats"):
        return [
            "**A real model** (perplexity per cache format, CPU): not part of this run (`python "
            "bench/real_model.py --json DIR/real_model.json`); the last table is in "
            f"[the archive]({ARCHIVE})."
        ]
    about = "; ".join(str(rm[k]) for k in ("model", "text", "versions", "machine") if rm.get(k))
    first = next(iter(rm["formats"]))
    out = [
        f"**A real model** (`{rm.get('command', 'python bench/real_model.py')}`): {about}.",
        "",
        f"| cache | perplexity | vs {first} | KV bytes/token |",
        "|---|---|---|---|",
    ]
    for name, r in rm["formats"].items():
        delta = r.get("delta")
        shown = "-" if delta is None or delta == 0 else f"{100 * delta:+.3f}%"
        out.append(f"| {name} | {r['ppl']:.4f} | {shown} | {r.get('bytes_per_token', float('nan')):,.0f} |")
    speeds = rm.get("decode_tokens_per_s") or {}
    if speeds:
        out += ["", "CPU decode, tokens/s: " + ", ".join(f"{k} {v:.1f}" for k, v in speeds.items()) + "."]
    return out


def audit_section(run: Run) -> list[str]:
    """kvzoo.audit's rate on a large cache (bench/audit_speed.py), against np.copy of the same bytes."""
    if not run.audit_speeds:
        return [
            "**Auditing a cache** (`kvzoo audit`, CPU): not part of this run (`python bench/audit_speed.py --json "
            "DIR/audit_speed.json`); the last figures are in the README (Auditing a cache)."
        ]
    first = run.audit_speeds[0]
    out = [
        f"**Auditing a cache** (`kvzoo.audit`, {first['date']}, commit {first['commit']}; {first['machine']}): "
        "the median of the runs (CPU time: all threads' seconds, which a loaded machine stretches less than the "
        "wall time), against np.copy of the same bytes (a read and a write of each, the physical limit; the "
        "audit decodes, re-quantizes and compares each element, a few dozen float32 operations).",
        "",
        "| cache | command | audit | its CPU time | rate | np.copy | audit / copy rate |",
        "|---|---|---|---|---|---|---|",
    ]
    for a in run.audit_speeds:
        gib, median, copy = a["bytes"] / 2**30, a["audit_median_s"], a["copy_median_s"]
        out.append(
            f"| {gib:.2f} GiB {a['mode']}, {a['layout']}, {a['live_rows']:,} live rows | `{a['command'].strip()}` | "
            f"{median:.1f} s ({', '.join(f'{t:.1f}' for t in a['audit_seconds'])}) | "
            f"{', '.join(f'{t:.1f}' for t in a.get('audit_cpu_s', []))} s | "
            f"{a['bytes'] / median / 1e6:,.0f} MB/s | {copy:.2f} s | {100 * copy / median:.2f}% |"
        )
    return out


# ---------------------------------------------------------------------------------------------
# end to end in transformers (bench/e2e_transformers.py)

E2E_BASE, E2E_STATIC = "dynamic", "static-compiled"
# bench/e2e_transformers.py's GPU model is Llama-3-8B's shape: an untied embedding table of 128256
# x 4096 in bf16, of which a decode step reads one row a sequence. A JSON from before the run
# recorded weights_read_per_step gets it subtracted from weights_bytes, and the page says so.
E2E_EMBEDDING = (128256, 4096, 2)
E2E_EMBEDDING_BYTES = E2E_EMBEDDING[0] * E2E_EMBEDDING[1] * E2E_EMBEDDING[2]
E2E_LABEL = {
    "dynamic": "DynamicCache + SDPA",
    "static-compiled": "StaticCache + SDPA, compiled",
    "quanto-int4": "QuantizedCache quanto int4",
    "hqq-int4": "QuantizedCache hqq int4",
}


def e2e_label(cache: str) -> str:
    """How a cache of e2e_transformers.py reads on the page: kvzoo-int8 'KVZooCache int8', kvzoo-int8-compiled
    'KVZooStaticCache int8, compiled', kvzoo-int8-kernels 'KVZooCache int8, kvzoo prefill'."""
    if cache in E2E_LABEL:
        return E2E_LABEL[cache]
    parts = cache.split("-")
    if parts[0] != "kvzoo" or len(parts) not in (2, 3):
        return cache
    if len(parts) == 2:
        return f"KVZooCache {parts[1]}"
    if parts[2] == "compiled":
        return f"KVZooStaticCache {parts[1]}, compiled"
    return f"KVZooCache {parts[1]}, kvzoo prefill" if parts[2] == "kernels" else cache


@dataclass
class E2EShape:
    """One shape of an e2e_transformers.py run: its rows and the environment of the JSON they came from."""

    shape: str
    env: dict
    rows: list[dict]

    @property
    def batch(self) -> int:
        return numbers(self.shape)[0]

    @property
    def context(self) -> int:
        return numbers(self.shape)[1]

    def ok(self, cache: str) -> dict | None:
        return next((r for r in self.rows if r["cache"] == cache and r.get("status") == "ok"), None)

    @property
    def weights_read(self) -> int | None:
        """Bytes of weights a decode step reads: the run's own figure, or its weights less the
        Llama-3-8B embedding table (see weights_assumed)."""
        if self.env.get("weights_read_per_step") is not None:
            return int(self.env["weights_read_per_step"])
        weights = self.env.get("weights_bytes")
        return None if weights is None else int(weights) - E2E_EMBEDDING_BYTES

    @property
    def weights_assumed(self) -> bool:
        return self.env.get("weights_read_per_step") is None and self.env.get("weights_bytes") is not None

    def floor_ms(self, row: dict) -> float | None:
        """The step's physical limit: the weights it reads and the cache's KV over the copy rate."""
        rate, weights, kv = self.env.get("copy_bytes_per_s"), self.weights_read, row.get("kv_bytes_floor")
        return (weights + kv) / rate * 1e3 if rate and weights is not None and kv else None


def e2e_shapes(run: Run) -> list[E2EShape]:
    """Every (JSON, shape) of the run's e2e_transformers.py JSONs, by context, then batch."""
    found = []
    for data in run.e2e:
        for shape in dict.fromkeys(r["shape"] for r in data["rows"]):
            found.append(E2EShape(shape, data["environment"], [r for r in data["rows"] if r["shape"] == shape]))
    return sorted(found, key=lambda s: (s.context, s.batch))


def _gib(nbytes: float) -> float:
    return nbytes / 2**30


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def e2e_table(group: E2EShape) -> list[str]:
    base = group.ok(E2E_BASE)
    out = [
        "| cache | KV held GiB | held vs DynamicCache | peak GiB | prefill ms | decode step ms (min-max) | tokens/s "
        "| decode speed vs DynamicCache | largest batch | step floor ms (step / floor) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in group.rows:
        name = e2e_label(r["cache"])
        if r.get("status") != "ok":
            out.append(f"| {name} | did not run: {_cell(str(r.get('status')))} |" + " |" * 8)
            continue
        held = f"{r['held_bytes'] / base['held_bytes']:.2f}x" if base and base["held_bytes"] else "-"
        speed = f"{base['decode_ms'] / r['decode_ms']:.2f}x" if base and r["decode_ms"] else "-"
        lo, hi = r["decode_spread"]
        floor = group.floor_ms(r)
        floor_cell = f"{floor:.2f} ({r['decode_ms'] / floor:.2f}x)" if floor else "-"
        out.append(
            f"| {name} | {_gib(r['held_bytes']):.2f} | {held} | {_gib(r['peak_bytes']):.1f} | {r['prefill_ms']:.1f} "
            f"| {r['decode_ms']:.2f} ({lo:.2f}-{hi:.2f}) | {r['tokens_per_s']:,.0f} | {speed} "
            f"| {r['largest_batch']:,} | {floor_cell} |"
        )
    return out


def _e2e_header(group: E2EShape) -> str:
    env = group.env
    versions = ", ".join(f"{k} {env[k]}" for k in ("torch", "transformers") if env.get(k))
    weights = group.weights_read
    bits = [
        f"{env.get('new_tokens', '?')} tokens generated a row after a prompt of {group.context}",
        f"{env.get('device', '?')}, {env.get('date', '?')}, commit {env.get('commit', 'unknown')}"
        + (f", {versions}" if versions else ""),
        f"`{env.get('command', 'python bench/e2e_transformers.py')}`",
    ]
    if env.get("rounds"):
        bits.append(f"{env['rounds']} round" + ("s" if env["rounds"] != 1 else ""))
    if env.get("copy_bytes_per_s") and weights is not None:
        bits.append(
            f"copy rate {env['copy_bytes_per_s'] / 1e9:,.0f} GB/s, weights read a step {weights / 1e9:.3f} GB"
            + (" (assumed: see above)" if group.weights_assumed else "")
        )
    return f"**{group.batch} x {group.context}** (" + "; ".join(bits) + "):"


# Issue 46's targets, on the shapes it names.
E2E_SHORT, E2E_LONG = "16x4096", "8x32768"


def _e2e_pairs(run: Run, shape: str, cache: str, base: str) -> list[tuple[str, dict, dict]]:
    """(where, the cache's row, the base's row) from each JSON measuring both at the shape: a
    ratio is only taken within one run. where names the run's commit when several JSONs hold
    the shape (empty otherwise)."""
    groups = [g for g in e2e_shapes(run) if g.shape == shape]
    pairs = [(g, r, b) for g in groups if (r := g.ok(cache)) and (b := g.ok(base))]
    several = len(groups) > 1
    return [(f" ({g.env.get('commit', '?')})" if several else "", r, b) for g, r, b in pairs]


def _e2e_verdict(figures: list[str], checks: list[bool], missing: list[str]) -> tuple[str, bool | None] | None:
    """A target's cell and verdict: not measured without a figure; no if any figure misses (in
    any run); yes only if every cache it names was measured."""
    if not checks:
        return None
    figure = ", ".join(figures + [f"{m} not measured" for m in missing])
    return figure, (False if not all(checks) else None if missing else True)


def _e2e_against(run: Run, shape: str, caches: Iterable[str], base: str, ratio, floor: float, spec: str = ".2f"):
    """ratio(row, base_row) >= floor for each cache at the shape, in every run that measured both."""
    figures, checks, missing = [], [], []
    for cache in caches:
        pairs = _e2e_pairs(run, shape, cache, base)
        if not pairs:
            missing.append(e2e_label(cache))
        for where, r, b in pairs:
            value = ratio(r, b)
            figures.append(f"{e2e_label(cache)} {value:{spec}}x{where}")
            checks.append(value >= floor)
    return _e2e_verdict(figures, checks, missing)


def _e2e_at_most(run: Run, caches: Iterable[str], key: str, ceiling: float, shapes: Iterable[str]):
    """row[key] / dynamic's <= ceiling for each cache at each shape, in every run that measured both."""
    figures, checks, missing = [], [], []
    shapes = list(shapes)
    for shape in shapes:
        at = f" at {label('decode', shape).removeprefix('decode ')}" if len(shapes) > 1 else ""
        for cache in caches:
            pairs = _e2e_pairs(run, shape, cache, E2E_BASE)
            if not pairs:
                missing.append(e2e_label(cache) + at)
            for where, r, b in pairs:
                value = r[key] / b[key]
                figures.append(f"{e2e_label(cache)} {value:.3f}x{at}{where}")
                checks.append(value <= ceiling)
    return _e2e_verdict(figures, checks, missing)


def _e2e_prefill(run: Run):
    """Every kvzoo cache's prefill at the long shape against DynamicCache's."""
    group = next((g for g in e2e_shapes(run) if g.shape == E2E_LONG), None)
    caches = [r["cache"] for r in group.rows if r["cache"].startswith("kvzoo")] if group else []
    return _e2e_at_most(run, caches, "prefill_ms", 1.05, [E2E_LONG]) if caches else None


def _speed(r: dict, b: dict) -> float:
    return b["decode_ms"] / r["decode_ms"]


def _batch(r: dict, b: dict) -> float:
    return r["largest_batch"] / b["largest_batch"]


E2E_TARGETS = (
    (
        "int8/fp8 eager decode (KVZooCache) no slower than DynamicCache at 16 x 4096 (speed against it)",
        lambda run: _e2e_against(run, E2E_SHORT, ("kvzoo-int8", "kvzoo-fp8"), E2E_BASE, _speed, 1.0),
    ),
    (
        "int8/fp8 eager decode (KVZooCache) >= 1.1x DynamicCache's speed at 8 x 32768",
        lambda run: _e2e_against(run, E2E_LONG, ("kvzoo-int8", "kvzoo-fp8"), E2E_BASE, _speed, 1.1),
    ),
    (
        "int8 compiled decode (KVZooStaticCache) >= 1.3x StaticCache + compiled's speed at 8 x 32768",
        lambda run: _e2e_against(run, E2E_LONG, ("kvzoo-int8-compiled",), E2E_STATIC, _speed, 1.3),
    ),
    ("prefill at 8 x 32768 <= 1.05x DynamicCache's time, every kvzoo cache run", _e2e_prefill),
    (
        "largest batch at 8 x 32768 >= 1.8x DynamicCache's with int8",
        lambda run: _e2e_against(run, E2E_LONG, ("kvzoo-int8",), E2E_BASE, _batch, 1.8),
    ),
    (
        "largest batch at 8 x 32768 >= 3x DynamicCache's with int4",
        lambda run: _e2e_against(run, E2E_LONG, ("kvzoo-int4",), E2E_BASE, _batch, 3.0),
    ),
    (
        "KV held with int8/fp8 <= 0.55x DynamicCache's (about 0.52x)",
        lambda run: _e2e_at_most(run, ("kvzoo-int8", "kvzoo-fp8"), "held_bytes", 0.55, (E2E_SHORT, E2E_LONG)),
    ),
    (
        "KV held with int4 <= 0.29x DynamicCache's (about 0.27x)",
        lambda run: _e2e_at_most(run, ("kvzoo-int4",), "held_bytes", 0.29, (E2E_SHORT, E2E_LONG)),
    ),
)


def e2e_targets(run: Run) -> list[str]:
    out = ["| issue | target | this run | met? |", "|---|---|---|---|"]
    for text, measure in E2E_TARGETS:
        got = measure(run)
        figure, met = got if got else ("not measured", None)
        out.append(f"| 46 | {text} | {figure} | {'-' if met is None else 'yes' if met else '**no**'} |")
    return out


def _e2e_why(run: Run) -> str | None:
    """Why eager decode misses: the same cache compiled, against its floor; and the bf16 compiled baseline."""
    parts = []
    for g in e2e_shapes(run):
        for r in g.rows:
            compiled = r["cache"].startswith("kvzoo") and r["cache"].endswith("-compiled") and r.get("status") == "ok"
            eager = g.ok(r["cache"].removesuffix("-compiled")) if compiled else None
            floor = g.floor_ms(r)
            if not (eager and floor):
                continue
            parts.append(
                f"at {g.batch} x {g.context} {e2e_label(eager['cache'])}'s eager step takes {eager['decode_ms']:.2f} ms "
                f"({eager['decode_ms'] / floor:.2f}x its floor of {floor:.2f} ms) and the same format in "
                f"KVZooStaticCache, its step compiled into one CUDA graph, {r['decode_ms']:.2f} ms "
                f"({r['decode_ms'] / floor:.2f}x)"
            )
    eager_rows = [
        (g, r, f)
        for g in e2e_shapes(run)
        for r in g.rows
        if r.get("status") == "ok" and not r["cache"].endswith("-compiled") and r["cache"] != E2E_STATIC
        if (f := g.floor_ms(r))
    ]
    if not parts and not eager_rows:
        return None
    text = "Why: eager decode in transformers is bound by the host, not by the bytes the cache reads"
    if eager_rows:
        text += (
            f": every eager step here takes {span((r['decode_ms'] / f for _, r, f in eager_rows), '.1f')}x its "
            "floor, DynamicCache's included"
        )
    if not parts:
        text += "."
    else:
        text += "; " + "; ".join(parts) + "."
        text += (
            " The difference is the host's work between the GPU's kernels (Python, one launch per operation), "
            "which the graph's replay does without; `bench/probes/e2e_host_profile.py` profiles an eager step."
        )
    for g in e2e_shapes(run):
        s, b = g.ok(E2E_STATIC), g.ok(E2E_BASE)
        floor = g.floor_ms(s) if s else None
        if s and b and floor:
            text += (
                f" StaticCache + compiled decode (bf16) measured {s['decode_ms']:.2f} ms a step at {g.batch} x "
                f"{g.context}, {s['decode_ms'] / b['decode_ms']:.2f}x DynamicCache's eager step and "
                f"{s['decode_ms'] / floor:.2f}x its floor: the figure as measured, not explained here."
            )
    return text


# Round medians further apart than this: the host changed speed between generates.
E2E_SPLIT_ROUNDS = 1.4


def _e2e_split_rounds(run: Run) -> list[str]:
    """A line for each shape whose rounds split in two (a row's slowest round median over
    E2E_SPLIT_ROUNDS times its fastest): there the pooled medians' ratio rests on how many rounds
    fell in each half, so each row's fastest round is set against DynamicCache's fastest too."""
    lines = []
    groups = e2e_shapes(run)
    for g in groups:
        rounds = {r["cache"]: r.get("decode_rounds") or [] for r in g.rows if r.get("status") == "ok"}
        base = rounds.get(E2E_BASE)
        if not base or not any(len(v) > 1 and max(v) > E2E_SPLIT_ROUNDS * min(v) for v in rounds.values()):
            continue
        fastest = ", ".join(
            f"{e2e_label(cache)} {min(base) / min(v):.2f}x" for cache, v in rounds.items() if v and cache != E2E_BASE
        )
        several = sum(other.shape == g.shape for other in groups) > 1
        where = f" in the run of commit {g.env.get('commit', '?')}" if several else ""
        lines.append(
            f"At {g.batch} x {g.context}{where} the rounds split in two (each row's round medians in brackets above): the "
            "host's speed changed between generates, so the ratios of the pooled medians depend on how many rounds "
            f"fell in the fast half. Each row's fastest round against DynamicCache's fastest ({min(base):.2f} ms): "
            f"{fastest}."
        )
    return lines


def e2e_section(run: Run, plot: str | None = None) -> list[str]:
    groups = e2e_shapes(run)
    if not groups:
        return [
            "**End to end in transformers** (memory, prefill, decode step, tokens/s and largest batch against "
            "DynamicCache, StaticCache + compiled decode and QuantizedCache): not part of this run (`python3 "
            "bench/e2e_transformers.py --json DIR/e2e_transformers.json` on the GPU)."
        ]
    out = [
        "**End to end in transformers** (`bench/e2e_transformers.py`: greedy `generate()` on a Llama-3-8B-shaped "
        "decoder with random bf16 weights, every row the same length; each cache warmed by one generate, then "
        "measured: over the rounds the run names, each a generate of every cache in turn, or, in runs that name "
        "none, one generate). KV held: what the cache holds after its first measured generate (allocated now, less "
        "before the cache); peak: the allocator's peak during it; prefill: the first forward (median over "
        "rounds); decode step: the median of the measured steps, CUDA events between them, with the fastest and "
        "slowest step (one generate) or round's median (rounds); the largest batch at this context whose cache fits "
        "beside the weights and 4 GiB of headroom. The step floor is what a decode step must read, every weight "
        "but the embedding table and the cache's KV, over the run's measured copy rate.",
    ]
    if any(g.weights_assumed for g in groups):
        rows, hidden, width = E2E_EMBEDDING
        out[0] += (
            " Runs from before e2e_transformers.py recorded weights_read_per_step: their weights read a step are "
            f"weights_bytes less Llama-3-8B's embedding table ({rows} x {hidden} in bf16, "
            f"{E2E_EMBEDDING_BYTES:,} bytes), an assumption; their own step_floor_ms (an older, 2x too high floor) "
            "is not shown."
        )
    for g in groups:
        out += ["", _e2e_header(g), "", *e2e_table(g)]
    out += ["", *e2e_targets(run)]
    for line in _e2e_split_rounds(run):
        out += ["", line]
    why = _e2e_why(run)
    if why:
        out += ["", why]
    if plot:
        out += ["", f"![decode step and KV held per cache, against the step floor]({plot})"]
    return out


# ---------------------------------------------------------------------------------------------
# the page


def _timed_how(run: Run) -> str:
    hows = sorted({r.how for r in headline_rows(run)})
    if hows == ["graph"]:
        return "Times are medians of CUDA-graph replays over rotated input sets (together larger than L2)."
    return f"Times are medians over rotated input sets, timed as: {', '.join(hows)}."


def page(run: Run, plots: dict[str, str] | None) -> str:
    i, c = run.info, run.ceilings
    out = [
        "# kvzoo results",
        "",
        "<!-- Generated by bench/report.py from the JSON of a bench/gpu_bench.py run: edit report.py, "
        "not this page. -->",
        "Regenerate on the GPU: `OUT=/tmp/run python3 bench/gpu_bench.py && OUT=/tmp/run python3 "
        "bench/host_cost.py`, then `python bench/report.py /tmp/run` (bench/report.py's docstring has the "
        "optional real-model run).",
        "",
    ]
    if run.dry:
        out += [
            "**DRY RUN**: these figures come from `gpu_bench.py --dry-run` on CPU under the Triton interpreter "
            "at toy sizes. They check the scripts, and say nothing about speed.",
            "",
        ]
    out += [
        f"What kvzoo reaches on one {i.get('gpu', '?')}, measured {i.get('date', '?')} at commit "
        f"{i.get('commit', 'unknown')} (torch {i.get('torch', '?')}, triton {i.get('triton', '?')}) with "
        f"`{i.get('command', 'python3 bench/gpu_bench.py')}`. {_timed_how(run)} Every row was checked before it "
        "was timed: write bytes equal the NumPy reference, attention error against float32 torch on the same "
        f"cache. The ceilings come from the same run: device copy {c['copy_GBps']:,.0f} GB/s (read + write) and "
        f'bf16 matmul {c["matmul_TFLOPs"]:,.0f} TFLOP/s. "% of limit" is bytes moved over the copy ceiling, or '
        "FLOPs over the matmul rate. The hardware facts the kernels rely on are in "
        f"[docs/hardware.md](../docs/hardware.md); every earlier run is in [{ARCHIVE}]({ARCHIVE}).",
        "",
    ]
    out += table(run)
    out += ["", "How far each kernel is from its limit, and why:", *prose(run)]
    if run.failed:
        out += ["", "Failed in this run (no figure): " + "; ".join(run.failed) + "."]
    acc = accuracy(run)
    if acc:
        out += ["", acc]
    out += ["", *targets(run)]
    if plots:
        out += [
            "",
            f"![achieved bandwidth and TFLOP/s against the measured ceilings]({plots['ceilings']})",
            "",
            f"![kvzoo against the alternatives, per case]({plots['alternatives']})",
        ]
    out += ["", *e2e_section(run, plots.get("e2e") if plots else None)]
    out += ["", *host_cost_section(run), "", *real_model_section(run), *ablation_section(run)]
    out += ["", *scaleout_section(run)]
    out += ["", *audit_section(run)]
    out += [
        "",
        "Not measured here: ROCm (the `triton-rocm` kernels are checked only under the Triton interpreter). "
        "CPU backends: `pytest bench/bench_cpu.py --benchmark-only`, or `python bench/bench_cpu.py` for a "
        "markdown table (last figures in the archive).",
    ]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------
# plots


# The alternatives' rows, by their variant in gpu_bench.py's case names.
ALTERNATIVE_LABEL = {
    "bf16": "torch index_copy_ (bf16)",
    "copy of int8 bytes": "torch copy_ of the int8 bytes",
    "sdpa-bf16": "torch SDPA (contiguous bf16)",
}
COLOURS = {
    "none": "#4c72b0",
    "int8": "#dd8452",
    "fp8": "#55a868",
    "int8 qk-int8": "#c44e52",
    "int8 direct": "#8172b3",
    "fp8 direct": "#937860",
}
OTHER = "#8c8c8c"


def _provider(r: Row) -> str:
    return VARIANT_LABEL.get(r.variant, r.variant) if r.kvzoo else ALTERNATIVE_LABEL.get(r.variant, r.impl)


def _plotted_shapes(run: Run, op: str) -> list[str]:
    shapes = run.shapes(op)
    if op == "write":  # launch-bound below the target size: their bandwidth says nothing
        big = [s for s in shapes if numbers(s)[0] >= WRITE_TARGET_TOKENS]
        return big or shapes[-1:]
    return shapes


def plot_ceilings(run: Run, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("GB/s", "copy_GBps", "device copy", ("write", "decode")),
        ("TFLOP/s", "matmul_TFLOPs", "bf16 matmul", ("prefill", "mixed")),
    )
    per_panel = [
        [
            r
            for op in ops
            for s in _plotted_shapes(run, op)
            for r in run.rows
            if r.op == op and r.shape == s and r.unit == unit and r.impl != EAGER and r.metric is not None
        ]
        for unit, _, _, ops in panels
    ]
    height = max(3.0, 0.28 * max(len(r) for r in per_panel) + 1.5)
    fig, axes = plt.subplots(1, 2, figsize=(13, height))
    for ax, (unit, key, name, _), rows in zip(axes, panels, per_panel):
        ceiling = run.ceilings[key]
        labels = [f"{label(r.op, r.shape)}, {_provider(r)}" for r in rows]
        colours = [COLOURS.get(r.variant, OTHER) if r.kvzoo else OTHER for r in rows]
        y = range(len(rows))
        ax.barh(list(y), [r.metric for r in rows], color=colours)
        ax.axvline(ceiling, color="black", linestyle="--", linewidth=1)
        ax.text(
            ceiling,
            1.01,
            f"{name}: {ceiling:,.0f} {unit}",
            transform=ax.get_xaxis_transform(),
            fontsize=8,
            ha="right",
            va="bottom",
        )
        for yi, r in zip(y, rows):
            ax.text(r.metric, yi, f" {r.pct:.0f}%", va="center", fontsize=7)
        ax.set_yticks(list(y), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel(f"achieved {unit} (kvzoo in colour, alternatives in grey)")
    fig.suptitle(
        f"kvzoo on {run.info.get('gpu', '?')}, commit {run.info.get('commit', 'unknown')}: achieved "
        "rate against the measured ceilings",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_alternatives(run: Run, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = []  # (case label, [(provider, time_us, colour)])
    for op in ("write", "decode", "prefill", "mixed"):
        for s in _plotted_shapes(run, op):
            rows = [r for r in run.rows if r.op == op and r.shape == s and r.impl != EAGER]
            rows.sort(key=lambda r: (not r.kvzoo, list(COLOURS).index(r.variant) if r.variant in COLOURS else 0))
            bars = [(_provider(r), r.time_us, COLOURS.get(r.variant, OTHER) if r.kvzoo else OTHER) for r in rows]
            base = run.kvzoo(op, s, "none")
            if bars and base:
                groups.append((label(op, s), bars, base.time_us))
    fig, axes = plt.subplots(
        len(groups), 1, figsize=(9, 1.2 + 1.1 * sum(len(b) for _, b, _ in groups) * 0.28), squeeze=False
    )
    for ax, (name, bars, base) in zip(axes[:, 0], groups):
        speed = [base / t for _, t, _ in bars]
        y = range(len(bars))
        ax.barh(list(y), speed, color=[c for *_, c in bars])
        ax.axvline(1.0, color="black", linewidth=0.8)
        for yi, (_, t, _), s in zip(y, bars, speed):
            ax.text(s, yi, f" {t:,.1f} us", va="center", fontsize=7)
        ax.set_yticks(list(y), [p for p, *_ in bars], fontsize=7)
        ax.invert_yaxis()
        ax.set_title(name, fontsize=8, loc="left")
        ax.set_xlim(0, max(speed) * 1.35)
    axes[-1, 0].set_xlabel("speed relative to kvzoo bf16 on the same case (> 1: faster); time per call beside each bar")
    fig.suptitle(f"kvzoo against the alternatives, {run.info.get('gpu', '?')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_e2e(run: Run, path: Path) -> None:
    """Per shape of the e2e runs: the decode step per cache (min-max as a whisker) against its floor,
    and the KV each cache holds against the bytes its KV needs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = e2e_shapes(run)
    most = max(len(g.rows) for g in groups)
    fig, axes = plt.subplots(len(groups), 2, figsize=(12, 1.0 + len(groups) * (0.9 + 0.32 * most)), squeeze=False)
    for (step_ax, held_ax), g in zip(axes, groups):
        names = [e2e_label(r["cache"]) + ("" if r.get("status") == "ok" else " (did not run)") for r in g.rows]
        y = list(range(len(g.rows)))
        ok = [r.get("status") == "ok" for r in g.rows]
        colours = [COLOURS["int8"] if r["cache"].startswith("kvzoo") else OTHER for r in g.rows]
        steps = [r["decode_ms"] if good else 0.0 for r, good in zip(g.rows, ok)]
        whiskers = [
            [s - r["decode_spread"][0] if good else 0.0 for r, s, good in zip(g.rows, steps, ok)],
            [r["decode_spread"][1] - s if good else 0.0 for r, s, good in zip(g.rows, steps, ok)],
        ]
        step_ax.barh(y, steps, xerr=whiskers, color=colours, error_kw={"linewidth": 0.8, "capsize": 2})
        held = [_gib(r["held_bytes"]) if good else 0.0 for r, good in zip(g.rows, ok)]
        held_ax.barh(y, held, color=colours)
        for yi, r, good in zip(y, g.rows, ok):
            floor = g.floor_ms(r) if good else None
            if floor:
                step_ax.plot([floor, floor], [yi - 0.4, yi + 0.4], color="black", linewidth=1.5)
            if good and r.get("kv_bytes_floor"):
                kv = _gib(r["kv_bytes_floor"])
                held_ax.plot([kv, kv], [yi - 0.4, yi + 0.4], color="black", linewidth=1.5)
            if good:
                step_ax.text(r["decode_spread"][1], yi, f" {r['decode_ms']:.2f} ms", va="center", fontsize=7)
                held_ax.text(_gib(r["held_bytes"]), yi, f" {_gib(r['held_bytes']):.2f}", va="center", fontsize=7)
        for ax in (step_ax, held_ax):
            ax.set_yticks(y, names, fontsize=7)
            ax.invert_yaxis()
            ax.set_xlim(0, ax.get_xlim()[1] * 1.15)
        step_ax.set_title(
            f"{g.batch} x {g.context}: decode step, ms (median, min-max; black line: the step floor)",
            fontsize=8,
            loc="left",
        )
        held_ax.set_title(
            f"{g.batch} x {g.context}: KV held, GiB (black line: the KV's own bytes)", fontsize=8, loc="left"
        )
    envs = {(g.env.get("device", "?"), g.env.get("commit", "unknown")) for g in groups}
    fig.suptitle(
        "kvzoo in transformers' generate(), "
        + "; ".join(f"{device}, commit {commit}" for device, commit in sorted(envs))
        + " (kvzoo in colour, the others in grey)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(run: Run, folder: Path, page_path: Path) -> dict[str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    made = {}
    for name, draw in (("ceilings", plot_ceilings), ("alternatives", plot_alternatives)):
        target = folder / f"{name}.png"
        draw(run, target)
        made[name] = Path(_relative(target, page_path.parent)).as_posix()
    if e2e_shapes(run):
        target = folder / "e2e.png"
        plot_e2e(run, target)
        made["e2e"] = Path(_relative(target, page_path.parent)).as_posix()
    return made


def _relative(target: Path, start: Path) -> str:
    return os.path.relpath(target.resolve(), start.resolve())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "run", type=Path, help="a folder holding bench.json (and host_cost.json, real_model.json), or a bench.json"
    )
    ap.add_argument("--host-cost", type=Path, help="host_cost.json (default: beside bench.json)")
    ap.add_argument("--real-model", type=Path, help="real_model.py's --json output (default: beside bench.json)")
    ap.add_argument("--scaleout", type=Path, help="scaleout_transfer.py's --json output (default: beside bench.json)")
    ap.add_argument(
        "--audit-speed",
        type=Path,
        action="append",
        help="audit_speed.py's --json output (repeatable; default: audit_speed*.json beside bench.json)",
    )
    ap.add_argument(
        "--e2e",
        type=Path,
        nargs="+",
        action="extend",
        help="e2e_transformers.py's --json outputs (default: e2e_transformers*.json beside bench.json)",
    )
    ap.add_argument("--out", type=Path, default=HERE / "RESULTS.md", help="the page (default bench/RESULTS.md)")
    ap.add_argument("--plots", type=Path, default=HERE / "plots", help="the plots' folder (default bench/plots)")
    ap.add_argument("--no-plots", action="store_true", help="the page without plots (no matplotlib needed)")
    args = ap.parse_args(argv)
    run = load(args.run, args.host_cost, args.real_model, args.scaleout, args.audit_speed, args.e2e)
    plots = None
    if not args.no_plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print('report: the plots need matplotlib (pip install "kvzoo[plots]"), or pass --no-plots', file=sys.stderr)
            return 2
        plots = write_plots(run, args.plots, args.out)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(page(run, plots))
    print(f"wrote {args.out}" + (f" and {len(plots)} plots in {args.plots}" if plots else ""))
    if run.dry:
        print("report: a --dry-run's figures; do not commit this page", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
