"""`kvzoo audit --plot DIR`: one PNG per layer, histograms of its live rows' scales (K and V).

Per-token-head modes: the decoded scale of each live (token, head) row (int4: the scale word
with its zero point cleared). Per-tensor modes and mode none have no per-row scale: the histogram
is of each row's largest |decoded value| instead. matplotlib is an optional dependency
(`pip install "kvzoo[plots]"`); it is drawn without pyplot, so no global backend is changed.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..backends.numpy_vectorized import kernels as vectorized
from .dump import CacheDump
from .live import live_rows, table_findings
from .rows import stored_codec

MISSING = 'kvzoo audit --plot needs matplotlib: pip install "kvzoo[plots]" (or matplotlib>=3.7)'


def require_matplotlib() -> None:
    """Raise ImportError with the install line when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError(MISSING) from None


def _row_values(dump: CacheDump, codes: np.ndarray, words: np.ndarray | None, static) -> tuple[np.ndarray, str]:
    mode = dump.mode
    if mode.per_token_head:
        if words is None:
            raise ValueError(f"mode {mode.name!r} keeps a scale word per row, but none were given")
        scales, _ = mode.code_format.split_scale_words(words)
        return scales.ravel(), "scale"
    with np.errstate(all="ignore"):
        if mode.format is None:
            decoded = codes.astype(np.float32)
        else:
            decoded = vectorized.decode(codes, static, stored_codec(mode))
        return np.abs(decoded).max(axis=-1).ravel(), "row absmax"


def scale_histograms(dump: CacheDump, directory: str | os.PathLike[str], bins: int = 60) -> list[Path]:
    """Write DIR/layer_NNN.png for every layer; returns the paths written.

    Parameters
    ----------
    dump : CacheDump
        The checked dump (kvzoo.auditing.read_dump).
    directory : path
        Created if missing.
    bins : int
        Histogram bins over log10 of the values.
    """
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    _, usable, lens = table_findings(dump)
    live = live_rows(dump, usable, lens)
    written = []
    for i, pages in enumerate(dump.layers):
        fig = Figure(figsize=(10, 3.6))
        FigureCanvasAgg(fig)
        for j, which in enumerate(("key", "value")):
            codes, words, static, _ = pages.cache(which)
            values, what = _row_values(
                dump,
                codes[live.block, live.slot],
                None if words is None else words[live.block, live.slot],
                static,
            )
            ax = fig.add_subplot(1, 2, j + 1)
            good = values[np.isfinite(values) & (values > 0)]
            if good.size:
                ax.hist(np.log10(good), bins=bins, color="C0" if which == "key" else "C1")
                ax.axvline(np.log10(np.median(good)), color="k", lw=0.8, ls="--", label="median")
                ax.legend(loc="upper right", fontsize=8)
            bad = values.size - good.size
            ax.set_title(f"layer {i} {which}: {good.size} rows" + (f", {bad} zero or non-finite" if bad else ""))
            ax.set_xlabel(f"log10 {what}")
            ax.set_ylabel("rows (token x head)")
        fig.suptitle(f"{dump.mode.name}, {dump.layout} layout")
        fig.tight_layout()
        path = out / f"layer_{i:03d}.png"
        fig.savefig(path, dpi=80)
        written.append(path)
    return written
