"""Registers the vectorized NumPy implementation (kernels.py) for every mode (platform "any")."""

from __future__ import annotations

from ...capabilities import ALL_OPTIONS, Capabilities
from ...modes import MODES, QuantMode
from ...problem import Attention, CacheWrite, Dequantize
from ...registry import Implementation, Registry
from . import kernels as vectorized

NAME = "numpy"
PRIORITY = 10


def codec(mode: QuantMode, rounding: str = "nearest") -> vectorized.Codec:
    return vectorized.Codec(
        granularity=mode.granularity,
        format=mode.format,
        scale_floor=float(mode.scale_floor),
        rounding=rounding,
        rotation=mode.rotation,
    )


def _reshape_and_cache(p: CacheWrite) -> None:
    vectorized.reshape_and_cache(p, codec(_mode(p), p.rounding))


def _dequantize(p: Dequantize) -> None:
    vectorized.dequantize(p, codec(_mode(p)))


def _paged_attention(p: Attention) -> None:
    mode = _mode(p)
    vectorized.paged_attention(p, codec(mode), codec(mode) if p.quantizes_query else None)


def _mode(p: CacheWrite | Dequantize | Attention) -> QuantMode:
    # A checked record's mode is a QuantMode (kvzoo.calls parsed the one given).
    assert isinstance(p.mode, QuantMode)
    return p.mode


# Modes whose format kernels.py encodes (mode "none" has none).
_MODES = frozenset(m.name for m in MODES.values() if m.format is None or m.format.name in vectorized.ENCODERS)


def register(registry: Registry) -> None:
    for op, run in (
        ("reshape_and_cache", _reshape_and_cache),
        ("dequantize", _dequantize),
        ("paged_attention", _paged_attention),
    ):
        registry.add(
            Implementation(
                name=NAME,
                op=op,
                platform="any",
                modes=_MODES,
                run=run,
                array_kind="numpy",
                devices=frozenset({"cpu"}),
                priority=PRIORITY,
                attention_rtol=1e-5,
                probability_tile=vectorized.PROBABILITY_TILE,
                capabilities=Capabilities(
                    ALL_OPTIONS, formats={f: enc.__name__ for f, enc in vectorized.ENCODERS.items()}
                ),
            )
        )
