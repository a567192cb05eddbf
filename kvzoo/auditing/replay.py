"""--replay: attention on the audited pages by every implementation, against the float64 oracle.

For each layer, N positions of each sequence are replayed as decode rows (the token at
position p attends positions 0..p through the sequence's own block table) with random float32
queries, two query heads per KV head. Each implementation's output is held to SPEC.md section
8's tolerance policy (kvzoo.samples: the oracle's attention and the implementation's declared
tolerance), each replayed row a sequence of its own. Only the blocks the replayed rows read are
copied out (a compact cache of the same layout), so the oracle's float64 copy stays small.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import api, samples
from .. import registry as _registry
from ..arrays import as_torch, numpy_dtype
from ..capabilities import Requirements
from ..conformance.checks import declared_reasons
from ..inputs import device_for
from ..layout import inline_views
from .dump import CacheDump, LayerPages
from .findings import Collector
from .report import Finding, ReplayResult

# Query heads per KV head in the replayed queries: GQA, as models run.
QUERY_GROUP = 2
QUERY_DTYPE = "float32"


def _positions(dump: CacheDump, usable: np.ndarray, lens: np.ndarray, per_seq: int, rng: np.random.Generator):
    """(seq, position) int64 [n] pairs: up to per_seq distinct positions of each usable sequence."""
    seqs, positions = [], []
    for s in np.flatnonzero(usable & (lens > 0)).tolist():
        chosen = np.sort(rng.choice(int(lens[s]), size=min(per_seq, int(lens[s])), replace=False))
        seqs += [s] * len(chosen)
        positions += chosen.tolist()
    return np.array(seqs, np.int64), np.array(positions, np.int64)


def _compact(dump: CacheDump, pages: LayerPages, tables: np.ndarray, lens: np.ndarray) -> tuple[dict[str, Any], Any]:
    """The blocks the rows read, renumbered: (the caches as kvzoo's calls take them, the tables)."""
    used_entries = np.arange(tables.shape[1])[None, :] < -(-lens[:, None] // dump.block_size)
    used = np.unique(tables[used_entries])
    compact_tables = np.where(used_entries, np.searchsorted(used, tables), 0).astype(np.int32)
    mode = dump.mode
    if pages.buffer is not None:
        views = inline_views(np.ascontiguousarray(pages.buffer[used]), pages.head_size, mode)
        caches = {
            "key_cache": views.key_cache,
            "value_cache": views.value_cache,
            "k_scale_cache": views.k_scale_cache,
            "v_scale_cache": views.v_scale_cache,
        }
    else:
        code_dtype = None if mode.code_dtype is None else numpy_dtype(mode.code_dtype)
        as_stored = (lambda a: a) if code_dtype is None else (lambda a: a.view(code_dtype))
        caches = {
            "key_cache": as_stored(np.ascontiguousarray(pages.key_cache[used])),
            "value_cache": as_stored(np.ascontiguousarray(pages.value_cache[used])),
        }
        if pages.k_scale_cache is not None and pages.v_scale_cache is not None:
            caches["k_scale_cache"] = np.ascontiguousarray(pages.k_scale_cache[used])
            caches["v_scale_cache"] = np.ascontiguousarray(pages.v_scale_cache[used])
    if mode.per_tensor:
        if pages.k_scale is None or pages.v_scale is None:
            raise ValueError(f"mode {mode.name!r} replays with static scales, and the dump's layer has none")
        caches["k_scale"], caches["v_scale"] = float(pages.k_scale), float(pages.v_scale)
    return caches, compact_tables


def _host_codes(a: np.ndarray, mode: Any) -> np.ndarray:
    return np.ascontiguousarray(a) if mode.code_dtype is None else np.ascontiguousarray(a).view(np.uint8)


def _row_errors(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Relative Frobenius error of each query row (SPEC.md 8's policy, each row a sequence);
    NaN where the reference is poisoned (not compared), +Inf where the output is non-finite
    but the reference is not, or finite where it is not."""
    got = got.astype(np.float64)
    poisoned = ~np.isfinite(ref)
    wrong_poison = (np.isfinite(got) & poisoned).any(axis=(1, 2)) | (~np.isfinite(got) & ~poisoned).any(axis=(1, 2))
    got, clean_ref = np.where(poisoned, 0.0, got), np.where(poisoned, 0.0, ref)
    err = np.linalg.norm((got - clean_ref).reshape(len(got), -1), axis=1) / np.maximum(
        np.linalg.norm(clean_ref.reshape(len(ref), -1), axis=1), 1e-30
    )
    err = np.where(poisoned.all(axis=(1, 2)), np.nan, err)
    return np.where(wrong_poison, np.inf, err)


def _on(x: Any, impl: _registry.Implementation, device: str) -> Any:
    if x is None or isinstance(x, float):
        return x
    if impl.array_kind == "numpy" and device == "cpu":
        return x
    return as_torch(x).to(device)


def replay_attention(
    dump: CacheDump,
    usable: np.ndarray,
    lens: np.ndarray,
    per_seq: int,
    seed: int | None,
    impl_names: Sequence[str] | None,
    registry: _registry.Registry | None,
    out: Collector,
) -> list[ReplayResult]:
    """Replay per_seq positions of each usable sequence on every layer and implementation; adds a
    replay_mismatch finding per row an implementation gets wrong."""
    reg = registry or _registry.default()
    rng = np.random.default_rng(seed)
    mode = dump.mode
    impls = [i for i in reg.implementations("paged_attention", mode) if impl_names is None or i.name in impl_names]
    if impl_names is not None:
        unknown = sorted(set(impl_names) - {i.name for i in impls})
        if unknown:
            raise ValueError(f"replay_impls: no paged_attention implementation {unknown} for mode {mode.name!r}")
    seqs, positions = _positions(dump, usable, lens, per_seq, rng)
    results: list[ReplayResult] = []
    if not len(seqs):
        return results
    seq_lens = (positions + 1).astype(np.int32)
    qsl = np.arange(len(seqs) + 1, dtype=np.int32)
    for layer, pages in enumerate(dump.layers):
        caches, tables = _compact(dump, pages, dump.block_tables[seqs], seq_lens.astype(np.int64))
        heads, d = pages.num_kv_heads, pages.head_size
        query = rng.standard_normal((len(seqs), heads * QUERY_GROUP, d)).astype(np.float32)
        ref = samples.oracle_attention(
            mode,
            query,
            _host_codes(caches["key_cache"], mode),
            _host_codes(caches["value_cache"], mode),
            tables,
            seq_lens,
            qsl,
            k_scales=caches.get("k_scale_cache"),
            v_scales=caches.get("v_scale_cache"),
            k_static=caches.get("k_scale"),
            v_static=caches.get("v_scale"),
        )
        need = Requirements(d, QUERY_DTYPE, frozenset({"inline_layout"} if dump.layout == "inline" else ()))
        batch = (query, caches, tables, seq_lens, qsl, ref)
        for impl in impls:
            results.append(_replay_one(impl, mode, need, layer, batch, seqs, positions, out))
    return results


def _replay_one(impl, mode, need, layer, batch, seqs, positions, out: Collector) -> ReplayResult:
    """One implementation on one layer's replayed rows."""
    query, caches, tables, seq_lens, qsl, ref = batch
    why = list(impl.unavailable()) or declared_reasons(impl, mode.name, need)
    device = device_for(impl)
    if not why and device != "cpu":
        import torch

        if not torch.cuda.is_available():
            why = [f"{impl.name}: takes {device} tensors, and there is no GPU here"]
    if why:
        return ReplayResult(layer, impl.name, 0, None, None, skipped="; ".join(why))
    tolerance = samples.attention_tolerance(impl, QUERY_DTYPE)
    place = {k: _on(v, impl, device) for k, v in caches.items()}
    try:
        got = api.paged_attention(
            _on(query, impl, device),
            place.pop("key_cache"),
            place.pop("value_cache"),
            mode=mode,
            block_tables=_on(tables, impl, device),
            seq_lens=_on(seq_lens, impl, device),
            query_start_loc=_on(qsl, impl, device),
            impl=impl,
            **place,
        )
    except _registry.NoImplementationError as refusal:
        return ReplayResult(layer, impl.name, 0, None, tolerance, skipped=str(refusal))
    except Exception as crash:  # an implementation that fails on valid pages is what the replay looks for
        detail = f"{impl.name} raised {type(crash).__name__}: {str(crash)[:200]}"
        out.one(Finding("replay_mismatch", layer, int(seqs[0]), None, None, detail, position=int(positions[0])))
        return ReplayResult(layer, impl.name, len(seqs), None, tolerance)
    assert not isinstance(got, tuple)  # (out, lse) only when the lse is asked for
    got = got.detach().cpu().numpy() if hasattr(got, "detach") else np.asarray(got)
    errors = _row_errors(got, ref)
    wrong = np.flatnonzero(errors > tolerance)

    def make(i: int) -> Finding:
        r = int(wrong[i])
        return Finding(
            "replay_mismatch",
            layer,
            int(seqs[r]),
            None,
            None,
            f"{impl.name}: relative error {errors[r]:.3g} against the float64 oracle, its tolerance {tolerance:.3g}",
            position=int(positions[r]),
        )

    out.add("replay_mismatch", layer, None, len(wrong), make)
    compared = errors[~np.isnan(errors)]
    return ReplayResult(layer, impl.name, len(seqs), float(compared.max()) if compared.size else None, tolerance)
