"""kvzoo.audit: read a paged cache and say what is wrong with it."""

from __future__ import annotations

import math
import os
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .. import registry as _registry
from . import findings as found
from .dump import CacheDump, load_cache_dump, read_dump
from .live import LiveRows, live_rows, stale_slots, table_findings
from .report import ERROR, KINDS, WARNING, AuditReport, CacheStats, Finding, LayerReport
from .rows import CacheRows, Requantizer, RowResults, check_rows, chunks, requantizer

CACHES = ("key", "value")


def _as_dump(source: str | os.PathLike[str] | Mapping[str, Any] | CacheDump) -> CacheDump:
    if isinstance(source, CacheDump):
        return source
    if isinstance(source, (str, os.PathLike)):
        source = load_cache_dump(source)
    return read_dump(source)


def _cache_rows(dump: CacheDump, requantize: Requantizer | None) -> list[tuple[int, str, CacheRows]]:
    out = []
    for i, layer in enumerate(dump.layers):
        for which in CACHES:
            codes, words, static, reference = layer.cache(which)
            # Rotary positions make every position's K row differ; V rows of one token repeated
            # are equal in the first layer (its V depends on the token alone): V is not compared.
            hashed = which == "key"
            rows = CacheRows(
                dump.mode, dump.rounding, codes, words, static, reference, layer.head_size, hashed, requantize
            )
            out.append((i, which, rows))
    return out


def _check_all(caches: list[tuple[int, str, CacheRows]], live: LiveRows, workers: int) -> list[RowResults]:
    """check_rows over every cache and chunk, on `workers` threads."""
    tasks = []
    for n, (_, _, cache) in enumerate(caches):
        for part in chunks(len(live), cache.codes.shape[2], cache.head_size):
            tasks.append((n, cache, part))

    def run(task: tuple[int, CacheRows, slice]) -> RowResults:
        return check_rows(task[1], live, task[2])

    if workers > 1 and len(tasks) > 1:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            results = list(pool.map(run, tasks))
    else:
        results = [run(t) for t in tasks]
    per_cache: list[list[RowResults]] = [[] for _ in caches]
    for (n, _, _), result in zip(tasks, results):
        per_cache[n].append(result)
    return [RowResults.join(parts) for parts in per_cache]


def _stats(cache: CacheRows, res: RowResults, places: Counter, layer: int, which: str) -> CacheStats:
    sums = res.sums
    mine: Counter[str] = Counter()
    for (at, kind_cache, kind), n in places.items():
        if at == layer and kind_cache == which:
            mine[KINDS[kind][0]] += n
    rows = int(res.status.size)
    finite = None
    if res.scales is not None:
        s = res.scales[res.status == 0]
        finite = s[np.isfinite(s) & (s > 0)]
    elif cache.static is not None:
        finite = np.array([cache.static], np.float32)

    def ratio(num: str, den: str, root: bool = False) -> float | None:
        if num not in sums or not sums.get(den):
            return None
        value = sums[num] / sums[den]
        return math.sqrt(value) if root else value

    per_element = cache.mode.format is not None and sums.get("elements")
    return CacheStats(
        rows=rows,
        scale_min=float(finite.min()) if finite is not None and finite.size else None,
        scale_median=float(np.median(finite)) if finite is not None and finite.size else None,
        scale_max=float(finite.max()) if finite is not None and finite.size else None,
        absmax=sums.get("absmax") if sums.get("elements") else None,
        saturation=sums["clamp"] / sums["elements"] if per_element else None,
        implied_error=math.sqrt(sums["step2"] / 12 / sums["value2"]) if per_element and sums.get("value2") else None,
        reference_error=ratio("ref_diff2", "ref_value2", root=True),
        reference_exact=ratio("ref_exact", "ref_rows"),
        errors=mine[ERROR],
        warnings=mine[WARNING],
    )


def audit(
    source: str | os.PathLike[str] | Mapping[str, Any] | CacheDump,
    *,
    replay: int = 0,
    replay_impls: Sequence[str] | None = None,
    seed: int | None = None,
    outlier_ratio: float = 100.0,
    max_findings: int = 100,
    workers: int | None = None,
    impl: str | None = None,
    registry: _registry.Registry | None = None,
) -> AuditReport:
    """Audit a quantized paged KV cache: what is wrong with it, where, and how it reads.

    Parameters
    ----------
    source : path, dict or CacheDump
        A dump file (kvzoo.save_cache_dump, or torch.save of the documented dict), the dict
        itself (tensors on any device or NumPy arrays; CPU ones are read in place), or a
        CacheDump. The dict's keys are in kvzoo.auditing.dump and the README.
    replay : int
        Query rows per sequence and layer to replay through attention on every available
        implementation of the registry, against the float64 oracle (0: none).
    replay_impls : sequence of str, optional
        Only these implementations in the replay.
    seed : int, optional
        Seed of the replay's positions and queries (random when None).
    outlier_ratio : float
        A live row's scale this many times above or below its head's median is a warning.
    max_findings : int
        Findings kept per layer, cache and kind (all are counted in report.counts).
    workers : int, optional
        Threads (default: the CPUs).
    impl : str, optional
        The write implementation that re-quantizes the rows in the round trip ("numpy",
        "numba": byte for byte the same); default the registry's fastest on the CPU.
    registry : Registry, optional
        The implementations the replay runs and impl is chosen from (default: kvzoo's).

    Returns
    -------
    AuditReport
        findings (kind, severity, layer, seq, block, slot, detail), the per-layer table, the
        replay, and the counts; report.ok is False when an error was found.

    Raises
    ------
    CacheDumpError
        When the source is not a readable dump (a missing key, a wrong dtype, a shape that does
        not fit the mode).
    """
    if not (isinstance(outlier_ratio, (int, float)) and outlier_ratio > 1):
        raise ValueError(f"outlier_ratio: expected a number > 1, got {outlier_ratio!r}")
    if not (isinstance(max_findings, int) and max_findings >= 0):
        raise ValueError(f"max_findings: expected an int >= 0, got {max_findings!r}")
    if not (isinstance(replay, int) and replay >= 0):
        raise ValueError(f"replay: expected an int >= 0 (query rows per sequence), got {replay!r}")
    start = time.perf_counter()
    dump = _as_dump(source)
    out = found.Collector(max_findings)
    tables, usable, lens = table_findings(dump)
    for f in tables:
        out.one(f)
    live = live_rows(dump, usable, lens)
    requantize = requantizer(dump.mode, impl, registry) if dump.mode.per_token_head else None
    caches = _cache_rows(dump, requantize)
    for layer, which, cache in caches:
        found.static_scale_findings(out, layer, which, cache)
    results = _check_all(caches, live, workers or os.cpu_count() or 1)
    stale = stale_slots(dump, live, usable, lens)
    for (layer, which, cache), res in zip(caches, results):
        found.status_findings(out, layer, which, cache, live, res)
        if cache.reference is not None:
            found.reference_findings(out, layer, which, cache, live, res)
        found.outlier_findings(out, layer, which, live, res, float(outlier_ratio))
        if cache.hash_rows:
            found.duplicate_findings(out, layer, which, cache, live, res)
        found.stale_findings(out, layer, which, cache, stale)
    replayed = []
    if replay:
        from .replay import replay_attention

        replayed = replay_attention(dump, usable, lens, replay, seed, replay_impls, registry, out)
    layers = []
    by_layer = {(layer, which): (cache, res) for (layer, which, cache), res in zip(caches, results)}
    for i, pages in enumerate(dump.layers):
        stats = {which: _stats(*by_layer[(i, which)], out.places, i, which) for which in CACHES}
        layers.append(LayerReport(i, pages.num_kv_heads, pages.head_size, stats["key"], stats["value"]))
    out.findings.sort(key=_order)
    nbytes = sum(_nbytes(pages) for pages in dump.layers)
    return AuditReport(
        mode=dump.mode.name,
        layout=dump.layout,
        rounding=dump.rounding,
        block_size=dump.block_size,
        num_blocks=dump.num_blocks,
        num_seqs=dump.num_seqs,
        live_tokens=int(np.clip(dump.seq_lens, 0, None).sum()),
        nbytes=nbytes,
        seconds=time.perf_counter() - start,
        findings=out.findings,
        layers=layers,
        counts=out.counts,
        replay=replayed,
    )


def _order(f: Finding) -> tuple:
    none_first = lambda x: -1 if x is None else x  # noqa: E731
    return (none_first(f.layer), none_first(f.seq), none_first(f.position), f.kind, f.cache or "", f.heads)


def _nbytes(pages: Any) -> int:
    if pages.buffer is not None:
        return int(pages.buffer.nbytes)
    arrays = (pages.key_cache, pages.value_cache, pages.k_scale_cache, pages.v_scale_cache)
    return sum(int(a.size * a.itemsize) for a in arrays if a is not None)
