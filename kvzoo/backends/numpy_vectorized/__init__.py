"""Registers the vectorized NumPy implementation (kernels.py) for every mode (platform "any")."""

from __future__ import annotations

from ...capabilities import ALL_OPTIONS, Capabilities
from ...modes import QuantMode
from ...problem import Attention, CacheWrite, Dequantize
from ...registry import Implementation, Registry, modes_for_formats
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


def sides(mode: QuantMode, rounding: str = "nearest") -> tuple[vectorized.Codec, vectorized.Codec]:
    """The codecs of the key rows and of the value rows (one codec twice unless mode is split)."""
    return codec(mode.key_side, rounding), codec(mode.value_side, rounding)


def _reshape_and_cache(p: CacheWrite) -> None:
    vectorized.reshape_and_cache(p, sides(_mode(p), p.rounding))


def _dequantize(p: Dequantize) -> None:
    vectorized.dequantize(p, codec(_mode(p)))


def _paged_attention(p: Attention) -> None:
    mode = _mode(p)
    # A quantized query takes the keys' rule (quantize_query: int8 keys; fp8_dots: e4m3fn).
    vectorized.paged_attention(p, sides(mode), codec(mode.key_side) if p.quantizes_query else None)


def _mode(p: CacheWrite | Dequantize | Attention) -> QuantMode:
    # A checked record's mode is a QuantMode (kvzoo.calls parsed the one given).
    assert isinstance(p.mode, QuantMode)
    return p.mode


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
                # The modes whose formats (each side's) kernels.py encodes.
                modes=modes_for_formats(vectorized.ENCODERS, op),
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
