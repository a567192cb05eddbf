"""Findings of one layer's K or V cache, from the per-row results (kvzoo.auditing.rows).

A finding names one row (token, position, block, slot) with the KV heads it affects; the
detail gives the first affected head's values. Every kind is counted in full; at most `limit`
findings of a kind are kept per layer.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..backends.numpy_vectorized import kernels as vectorized
from ..modes import SCALE_FLOOR
from .live import LiveRows
from .report import Finding
from .rows import (
    _STATUS,
    ROW_KINDS,
    CacheRows,
    RowResults,
    byte_tables,
    encode_reference,
    lifted_codes,
    stored_codec,
)


@dataclass
class Collector:
    """Findings kept (up to `limit` per layer and kind) and counted (all)."""

    limit: int
    findings: list[Finding] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)
    # (layer, cache, kind) -> count, for the per-layer table.
    places: Counter = field(default_factory=Counter)

    def add(
        self, kind: str, layer: int | None, cache: str | None, how_many: int, make: Callable[[int], Finding]
    ) -> None:
        """Count how_many findings of a kind and keep the first ones (make(i) builds the i-th)."""
        if how_many <= 0:
            return
        self.counts[kind] += how_many
        self.places[(layer, cache, kind)] += how_many
        self.findings.extend(make(i) for i in range(min(how_many, self.limit)))

    def one(self, finding: Finding) -> None:
        self.add(finding.kind, finding.layer, finding.cache, 1, lambda _: finding)


def _row_finding(kind: str, layer: int, which: str, live: LiveRows, r: int, heads: np.ndarray, detail: str) -> Finding:
    return Finding(
        kind,
        layer,
        int(live.seq[r]),
        int(live.block[r]),
        int(live.slot[r]),
        detail,
        cache=which,
        heads=tuple(int(h) for h in heads),
        position=int(live.position[r]),
    )


def _word(cache: CacheRows, r_block: int, r_slot: int, head: int) -> str:
    word = np.float32(cache.row_words()[r_block, r_slot, head])
    return f"scale word 0x{int(word.view(np.uint32)):08x} ({float(word):.4g})"


def _status_detail(kind: str, cache: CacheRows, block: int, slot: int, head: int) -> str:
    """What is wrong with one row, in its own numbers."""
    codes = cache.codes[block, slot, head]
    if kind.startswith("scale_"):
        return _word(cache, block, slot, head)
    if kind in ("code_nan", "code_inf"):
        tables = byte_tables(cache.mode.format)
        hit = np.flatnonzero((tables.nan if kind == "code_nan" else tables.inf)[codes])
        return f"{len(hit)} of {codes.shape[-1]} code bytes at elements {hit[:8].tolist()}"
    if kind == "value_nonfinite":
        hit = np.flatnonzero(~np.isfinite(codes.astype(np.float32)))
        return f"{len(hit)} of {codes.shape[-1]} values non-finite, elements {hit[:8].tolist()}"
    if kind == "row_zero":
        return f"all {codes.view(np.uint8).size} bytes are 0"
    # not_encoder_output: what re-encoding its decoded values gives.
    mode = cache.mode
    words = cache.row_words()[block, slot, head][None]
    codec = stored_codec(mode)
    lifted = lifted_codes(codes[None], words, mode, cache.rounding)
    again, again_words = vectorized.quantize_rows(vectorized.decode(lifted, words, codec), codec)
    fmt = mode.code_format
    extreme = fmt.code_values()[fmt.unpack(codes)]
    return (
        f"{_word(cache, block, slot, head)}, codes {float(np.nanmin(extreme)):g} .. {float(np.nanmax(extreme)):g}; "
        f"re-encoded: scale word 0x{int(again_words.view(np.uint32)[0]):08x}, "
        f"{int((fmt.unpack(again) != fmt.unpack(lifted)).sum())} of {fmt.head_size_of(codes.shape[-1])} codes differ"
    )


def static_scale_findings(out: Collector, layer: int, which: str, cache: CacheRows) -> None:
    """A per-tensor scale that is not finite and > 0 (the write refuses one; a dump may hold it)."""
    s = cache.static
    if s is not None and not (np.isfinite(s) and s > 0):
        detail = f"{which[0]}_scale is {float(s)!r}: every code decodes to {float(s)!r} times its value"
        out.one(Finding("static_scale_invalid", layer, None, None, None, detail, cache=which))


def status_findings(out: Collector, layer: int, which: str, cache: CacheRows, live: LiveRows, res: RowResults) -> None:
    for kind in ROW_KINDS:
        hit = res.status == _STATUS[kind]
        rows = np.flatnonzero(hit.any(axis=1))

        def make(i: int, kind: str = kind, rows: np.ndarray = rows, hit: np.ndarray = hit) -> Finding:
            r = int(rows[i])
            heads = np.flatnonzero(hit[r])
            detail = _status_detail(kind, cache, int(live.block[r]), int(live.slot[r]), int(heads[0]))
            return _row_finding(kind, layer, which, live, r, heads, detail)

        out.add(kind, layer, which, len(rows), make)


def reference_findings(
    out: Collector, layer: int, which: str, cache: CacheRows, live: LiveRows, res: RowResults
) -> None:
    rows = np.flatnonzero(res.mismatch.any(axis=1))

    def make(i: int) -> Finding:
        r = int(rows[i])
        heads = np.flatnonzero(res.mismatch[r])
        h = int(heads[0])
        reference = cache.reference_rows()[live.token[r]][None, h : h + 1]
        codes = cache.codes[live.block[r], live.slot[r], h]
        if cache.mode.format is None:
            stored = reference.astype(np.float32)
            decoded = codes.astype(np.float32)
        else:
            stored, _, _ = encode_reference(cache, reference)
            scale = (
                cache.words[live.block[r], live.slot[r], h][None] if cache.words is not None else cache.static_scale()
            )
            with np.errstate(all="ignore"):
                decoded = vectorized.decode(codes[None], scale, stored_codec(cache.mode))[0]
        diff = np.abs(decoded.astype(np.float64) - stored[0, 0])
        e = int(np.nanargmax(diff)) if np.isfinite(diff).any() else 0
        return _row_finding(
            "reference_mismatch",
            layer,
            which,
            live,
            r,
            heads,
            f"token {int(live.token[r])} of the given {which}s: element {e} decodes to {float(decoded[e]):.4g}, "
            f"the reference (as stored) is {float(stored[0, 0, e]):.4g}",
        )

    out.add("reference_mismatch", layer, which, len(rows), make)


def outlier_findings(out: Collector, layer: int, which: str, live: LiveRows, res: RowResults, ratio: float) -> None:
    """Rows whose scale is more than `ratio` times from the median of their head's (over the rows
    with no finding). Rows at the scale floor are left out: the encoder gives it to every row of
    zeros (a padding token's K and V in the first layer, say), whatever its neighbours."""
    if res.scales is None or not len(live):
        return
    scales = res.scales
    usable = (res.status == 0) & (res.scales > SCALE_FLOOR)
    logs = np.where(usable, np.log2(np.where(usable, res.scales, 1).astype(np.float64)), np.nan)
    with np.errstate(all="ignore"):
        median = np.nanmedian(logs, axis=0) if usable.any() else np.full(logs.shape[1], np.nan)
    far = usable & (np.abs(logs - median[None]) > np.log2(ratio))
    rows = np.flatnonzero(far.any(axis=1))

    def make(i: int) -> Finding:
        r = int(rows[i])
        heads = np.flatnonzero(far[r])
        h = int(heads[0])
        s, m = float(scales[r, h]), float(2.0 ** median[h])
        return _row_finding(
            "scale_outlier",
            layer,
            which,
            live,
            r,
            heads,
            f"scale {s:.4g} is {max(s / m, m / s):.3g}x {'above' if s > m else 'below'} the median {m:.4g} of head {h}",
        )

    out.add("scale_outlier", layer, which, len(rows), make)


def duplicate_findings(
    out: Collector, layer: int, which: str, cache: CacheRows, live: LiveRows, res: RowResults
) -> None:
    """Live rows with identical bytes at different positions or heads. Copies at one position and
    head in different sequences (a prefix written twice) are not reported."""
    flat = res.hashes.ravel()
    order = np.argsort(flat, kind="stable")
    sorted_hashes = flat[order]
    same = (sorted_hashes[1:] == sorted_hashes[:-1]) & (sorted_hashes[1:] != 0)
    if not same.any():
        return
    heads = res.hashes.shape[1]
    members: dict[int, list[int]] = {}
    starts = np.flatnonzero(same & ~np.concatenate([[False], same[:-1]]))
    for start in starts.tolist():
        end = start + 1
        while end < len(same) and same[end]:
            end += 1
        group = order[start : end + 1]
        # Equal hashes: equal bytes decide (a colliding pair is dropped).
        for twins in _equal_bytes(cache, live, group // heads, group % heads, group):
            places = {(int(live.position[g // heads]), int(g % heads)) for g in twins}
            if len(places) > 1:
                for g in twins:
                    members[int(g)] = [int(t) for t in twins if t != g]
    found = sorted(members, key=lambda g: (live.seq[g // heads], live.position[g // heads], g % heads))

    def make(i: int) -> Finding:
        g = found[i]
        r, h = g // heads, g % heads
        o = members[g][0]
        other = (
            f"seq {int(live.seq[o // heads])} pos {int(live.position[o // heads])} block {int(live.block[o // heads])}"
        )
        more = f" and {len(members[g]) - 1} more" if len(members[g]) > 1 else ""
        return _row_finding(
            "duplicate_row",
            layer,
            which,
            live,
            r,
            np.array([h]),
            f"same bytes as {other} slot {int(live.slot[o // heads])} head {o % heads}{more}",
        )

    out.add("duplicate_row", layer, which, len(found), make)


def _equal_bytes(cache: CacheRows, live: LiveRows, rows: np.ndarray, heads: np.ndarray, ids: np.ndarray) -> list:
    blocks, slots = live.block[rows], live.slot[rows]
    raw = cache.codes[blocks, slots, heads].view(np.uint8).reshape(len(rows), -1)
    if cache.words is not None:
        raw = np.concatenate([raw, cache.words[blocks, slots, heads].view(np.uint8).reshape(len(rows), -1)], axis=1)
    _, inverse, counts = np.unique(raw, axis=0, return_inverse=True, return_counts=True)
    return [ids[inverse.reshape(-1) == k] for k in np.flatnonzero(counts > 1)]


def stale_findings(out: Collector, layer: int, which: str, cache: CacheRows, stale: tuple[np.ndarray, ...]) -> None:
    """One finding per sequence whose last block holds bytes past its seq_len."""
    seq, block, slot = stale
    if not len(seq):
        return
    raw = cache.codes[block, slot].view(np.uint8).reshape(len(seq), -1)
    held = (raw != 0).any(axis=1)
    if cache.words is not None:
        held |= (cache.words[block, slot].view(np.uint32) != 0).any(axis=1)
    seqs = np.unique(seq[held])

    def make(i: int) -> Finding:
        mine = held & (seq == seqs[i])
        slots = slot[mine]
        return Finding(
            "stale_rows",
            layer,
            int(seqs[i]),
            int(block[mine][0]),
            int(slots[0]),
            f"{len(slots)} rows past seq_len hold bytes (slots {slots[:8].tolist()})",
            cache=which,
        )

    out.add("stale_rows", layer, which, len(seqs), make)
