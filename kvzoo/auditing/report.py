"""What an audit found: findings, the per-layer table, the replay, and how they are printed.

Each finding kind has one severity and one line saying what it means (KINDS): the text
report prints that line once per kind, so a reader does not need this module to act on it.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

ERROR, WARNING = "error", "warning"

# kind -> (severity, what it means and where to look).
KINDS: dict[str, tuple[str, str]] = {
    "block_out_of_range": (
        ERROR,
        "a block table entry a live token reads is outside [0, num_blocks): the engine's block "
        "tables are corrupt or stale (the sequence's rows are not checked)",
    ),
    "block_repeated": (
        ERROR,
        "one sequence's live block table names the same block twice: its later tokens overwrote earlier ones",
    ),
    "seq_len_out_of_range": (
        ERROR,
        "seq_lens is negative or longer than the sequence's block table row holds (checked up to what it holds)",
    ),
    "static_scale_invalid": (
        ERROR,
        "a per-tensor scale that is not finite and > 0: every code of the cache decodes wrong",
    ),
    "scale_nan": (
        ERROR,
        "a live row's scale is NaN: K/V held a NaN or an Inf when written (SPEC.md section 4), or the word was "
        "overwritten; attention of every query reading it is NaN",
    ),
    "scale_inf": (
        ERROR,
        "a live row's scale is +Inf: K/V held an infinity when written (SPEC.md section 4; the row reads back as "
        "NaN), or the word was overwritten",
    ),
    "scale_negative": (ERROR, "a live row's scale is negative: no write stores that; the word was overwritten"),
    "scale_subnormal": (
        ERROR,
        "a live row's scale is subnormal, below the scale floor 1e-6 every write keeps: the word was overwritten",
    ),
    "code_nan": (
        ERROR,
        "a live row with a finite scale holds an fp8 NaN code: a NaN input under a per-tensor scale, or overwritten "
        "bytes; the output element reading it is NaN",
    ),
    "code_inf": (ERROR, "a live row holds an e5m2 infinity: x / static scale overflowed (the scale is too small)"),
    "value_nonfinite": (ERROR, "a live row of an unquantized cache holds NaN or Inf"),
    "not_encoder_output": (
        ERROR,
        "the row's codes and scale are not what the mode's encoder writes for any input (decoded and "
        "re-quantized, the bytes differ): corrupted bytes, or codes and scale of two different writes",
    ),
    "reference_mismatch": (
        ERROR,
        "the row decodes more than one code step away from the K/V given with the dump: it holds another "
        "token's data, or a write went wrong",
    ),
    "replay_mismatch": (
        ERROR,
        "an implementation's attention on this cache is outside its declared tolerance of the float64 oracle: "
        "a kernel bug on these pages",
    ),
    "scale_zero": (
        WARNING,
        "a live row's scale is exactly 0: the slot was never written (kvzoo and vLLM never store 0), or zeroed",
    ),
    "row_zero": (WARNING, "every byte of a live row is 0: most likely a slot never written"),
    "block_shared_partial": (
        WARNING,
        "a block in the live part of two sequences' tables is partly filled by one of them, which writes its next "
        "token into it; fine if the engine copies on write (vLLM, KVZooCache), a corruption otherwise",
    ),
    "scale_outlier": (
        WARNING,
        "a live row's scale is far from the median of its layer, cache and head (--outlier-ratio; rows at the "
        "scale floor, rows of zeros, left out): an attention sink token, or a row written from the wrong data",
    ),
    "duplicate_row": (
        WARNING,
        "live K rows at different positions or heads hold identical bytes: a write that went to the wrong slot "
        "(or, legitimately, a repeated token in a model without rotary positions); V is not compared, as a "
        "repeated token's V rows are equal in the first layer",
    ),
    "stale_rows": (
        WARNING,
        "rows past seq_len in a sequence's last, partly filled block hold bytes (a reused block); harmless while "
        "the writes overwrite them, counted here",
    ),
}


@dataclass(frozen=True)
class Finding:
    """One thing wrong at one place.

    layer: None for what is not a layer's (block tables). seq: the sequence (block_tables row)
    reading the place, the first one where several do. block: the block id. slot: the row's
    offset within the block (0 .. block_size - 1). cache: "key" or "value" for a row's finding.
    heads: the KV heads of that row affected. position: the token's position in `seq`.
    """

    kind: str
    layer: int | None
    seq: int | None
    block: int | None
    slot: int | None
    detail: str
    cache: str | None = None
    heads: tuple[int, ...] = ()
    position: int | None = None

    @property
    def severity(self) -> str:
        return KINDS[self.kind][0]

    @property
    def place(self) -> tuple[int | None, int | None, int | None, int | None]:
        return (self.layer, self.seq, self.block, self.slot)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "severity": self.severity,
            "layer": self.layer,
            "seq": self.seq,
            "block": self.block,
            "slot": self.slot,
            "detail": self.detail,
            "cache": self.cache,
            "heads": list(self.heads),
            "position": self.position,
        }

    def where(self) -> str:
        parts = [
            f"{name} {value}"
            for name, value in (
                ("layer", self.layer),
                ("seq", self.seq),
                ("pos", self.position),
                ("block", self.block),
                ("slot", self.slot),
            )
            if value is not None
        ]
        if self.cache is not None:
            parts.append(self.cache[0].upper() + (" head " + ",".join(map(str, self.heads)) if self.heads else ""))
        return " ".join(parts)


@dataclass(frozen=True)
class CacheStats:
    """One layer's K or V over its live rows (token, head).

    scale_*: of the finite, positive per-row scales (per-token-head modes; the static scale for
    per-tensor modes; None for mode none). absmax: the largest finite |decoded value|.
    saturation: the fraction of codes at the clamp (the format's largest magnitude, or an end of
    int4's range). implied_error: the relative RMS error the codes' spacing implies (half a step
    each way, uniform), sqrt(sum(step^2) / 12) / ||decoded||. reference_error: relative RMS error
    against the K/V given with the dump; reference_exact: the fraction of rows whose bytes are
    exactly kvzoo's encoding of them. errors, warnings: findings in these rows (all, shown or not).
    """

    rows: int
    scale_min: float | None = None
    scale_median: float | None = None
    scale_max: float | None = None
    absmax: float | None = None
    saturation: float | None = None
    implied_error: float | None = None
    reference_error: float | None = None
    reference_exact: float | None = None
    errors: int = 0
    warnings: int = 0


@dataclass(frozen=True)
class LayerReport:
    layer: int
    num_kv_heads: int
    head_size: int
    key: CacheStats
    value: CacheStats


@dataclass(frozen=True)
class ReplayResult:
    """One implementation's attention replayed on one layer: the largest relative error (SPEC.md
    section 8's per-sequence Frobenius norm, each replayed row a sequence) against the float64
    oracle, over `rows` query rows; skipped says why it did not run."""

    layer: int
    impl: str
    rows: int
    max_error: float | None
    tolerance: float | None
    skipped: str | None = None

    @property
    def failed(self) -> bool:
        if self.skipped is not None:
            return False
        if self.max_error is None:
            return True
        if self.tolerance is None:
            raise ValueError(f"layer {self.layer}, {self.impl}: a replay that ran needs a tolerance")
        return self.max_error > self.tolerance


def _json_number(x: Any) -> Any:
    # JSON has no NaN or Infinity: strict readers refuse them.
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


@dataclass
class AuditReport:
    """Everything kvzoo.audit found about one cache.

    findings: the findings kept (at most `max_findings` per layer and kind; `counts` has them
    all). layers: the per-layer table. replay: per layer and implementation, when asked for.
    """

    mode: str
    layout: str
    rounding: str
    block_size: int
    num_blocks: int
    num_seqs: int
    live_tokens: int
    nbytes: int
    seconds: float
    findings: list[Finding]
    layers: list[LayerReport]
    counts: Counter = field(default_factory=Counter)
    replay: list[ReplayResult] = field(default_factory=list)

    @property
    def errors(self) -> int:
        return sum(n for kind, n in self.counts.items() if KINDS[kind][0] == ERROR)

    @property
    def warnings(self) -> int:
        return sum(n for kind, n in self.counts.items() if KINDS[kind][0] == WARNING)

    @property
    def ok(self) -> bool:
        """No error found (warnings allowed)."""
        return self.errors == 0

    def summary(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "errors": self.errors,
            "warnings": self.warnings,
            "counts": {kind: n for kind, n in sorted(self.counts.items())},
            "mode": self.mode,
            "layout": self.layout,
            "rounding": self.rounding,
            "block_size": self.block_size,
            "num_blocks": self.num_blocks,
            "num_layers": len(self.layers),
            "num_seqs": self.num_seqs,
            "live_tokens": self.live_tokens,
            "bytes": self.nbytes,
            "seconds": round(self.seconds, 3),
        }

    def to_json(self) -> dict[str, Any]:
        """{"findings": [...], "layers": [...], "replay": [...], "summary": {...}}, strict JSON
        (a non-finite number is null)."""

        def stats(s: CacheStats) -> dict[str, Any]:
            return {k: _json_number(v) for k, v in asdict(s).items()}

        return {
            "findings": [f.to_json() for f in self.findings],
            "layers": [
                {
                    "layer": r.layer,
                    "num_kv_heads": r.num_kv_heads,
                    "head_size": r.head_size,
                    "key": stats(r.key),
                    "value": stats(r.value),
                }
                for r in self.layers
            ],
            "replay": [{k: _json_number(v) for k, v in asdict(r).items()} for r in self.replay],
            "summary": self.summary(),
        }

    def table(self) -> str:
        """The per-layer table, one line per layer and cache."""
        refs = any(s.reference_error is not None for r in self.layers for s in (r.key, r.value))
        head = ["layer", "kv", "rows", "scale min", "median", "max", "absmax", "sat %", "implied %"]
        head += ["ref err %", "exact %"] if refs else []
        head += ["errors", "warnings"]
        rows = [head]
        for r in self.layers:
            for name, s in (("K", r.key), ("V", r.value)):
                row = [str(r.layer), name, str(s.rows)]
                row += [_g(s.scale_min), _g(s.scale_median), _g(s.scale_max), _g(s.absmax)]
                row += [_pct(s.saturation), _pct(s.implied_error)]
                row += [_pct(s.reference_error), _pct(s.reference_exact)] if refs else []
                row += [str(s.errors), str(s.warnings)]
                rows.append(row)
        return _columns(rows)

    def format_text(self, shown_per_kind: int = 5) -> str:
        """The report a person reads: what was audited, the table, each kind of finding with what
        it means and its first places, the replay, and the verdict."""
        lines = [
            f"kvzoo audit: mode {self.mode} ({self.layout} layout, rounding {self.rounding}), "
            f"{len(self.layers)} layers, {self.num_blocks} blocks of {self.block_size}, {self.num_seqs} sequences, "
            f"{self.live_tokens} live tokens; {self.nbytes / 2**20:.1f} MiB read in {self.seconds:.2f} s",
            "",
            self.table(),
        ]
        by_kind: dict[str, list[Finding]] = {}
        for f in self.findings:
            by_kind.setdefault(f.kind, []).append(f)
        for kind in sorted(self.counts, key=lambda k: (KINDS[k][0] != ERROR, k)):
            severity, meaning = KINDS[kind]
            lines += ["", f"{severity.upper()} {kind} x{self.counts[kind]}: {meaning}"]
            for f in by_kind.get(kind, [])[:shown_per_kind]:
                lines.append(f"  {f.where()}: {f.detail}")
            hidden = self.counts[kind] - min(len(by_kind.get(kind, [])), shown_per_kind)
            if hidden > 0:
                lines.append(f"  ... and {hidden} more (--json lists up to --max-findings per layer)")
        if self.replay:
            lines += ["", "replay (relative error against the float64 oracle, per replayed query row):"]
            rows = [["layer", "impl", "rows", "max error", "tolerance", "verdict"]]
            for r in self.replay:
                verdict = f"skipped: {r.skipped}" if r.skipped else ("FAIL" if r.failed else "ok")
                rows.append([str(r.layer), r.impl, str(r.rows), _g(r.max_error), _g(r.tolerance), verdict])
            lines.append(_columns(rows))
        verdict = "no errors" if self.ok else f"{self.errors} errors"
        lines += ["", f"{verdict}, {self.warnings} warnings"]
        return "\n".join(lines)


def _g(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.3g}"


def _columns(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for n, row in enumerate(rows):
        out.append("  ".join(c.rjust(w) if n and c[:1].isdigit() else c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)
