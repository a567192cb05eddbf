"""Auditing a quantized paged KV cache (`kvzoo.audit`, `kvzoo audit FILE`).

dump: the dump format (a dict; on disk a torch.save file) and its checks. live: the live rows
and the block tables' findings. rows: the checks of each live row. findings: findings from the
row results. replay: attention replayed on every implementation. report: the report, its
table, text and JSON. plot: per-layer scale histograms. core: kvzoo.audit itself.
"""

from .core import audit
from .dump import CacheDump, CacheDumpError, cache_dump, load_cache_dump, read_dump, save_cache_dump
from .report import KINDS, AuditReport, CacheStats, Finding, LayerReport, ReplayResult

__all__ = [
    "KINDS",
    "AuditReport",
    "CacheDump",
    "CacheDumpError",
    "CacheStats",
    "Finding",
    "LayerReport",
    "ReplayResult",
    "audit",
    "cache_dump",
    "load_cache_dump",
    "read_dump",
    "save_cache_dump",
]
