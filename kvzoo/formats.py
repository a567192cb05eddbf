"""Code formats: what one stored code is, as data every layer asks.

A format says how many bits a code has, how a bit pattern maps to a value, which patterns
are NaN, the range the encoder clamps to, and how codes pack into storage. The API's shape
checks, the layouts' allocation, the conformance inputs and each backend's table of the formats
it implements all read it from here, so adding a format is adding a row (and, in each backend
that takes it, one table entry; a backend without the entry declines the modes that use it).

kvzoo_spec/oracle.py keeps its own, independent definitions; tests/test_formats.py holds the
two against each other.

Adding a format: a CodeFormat row here (bits, so codes_per_byte and storage_width; the bytes
stored for NaN and for +-Inf; zero_point_bits for a zero point carried per row in the scale
word), a QuantMode using it in kvzoo/modes.py, the same definitions written independently in
the oracle, and an entry in the table of each backend that implements it (numpy_vectorized
ENCODERS, numba FORMAT_KINDS, triton formats.FORMATS) with that backend's encoder and
decoder. The API's shapes and dtypes (kvzoo.arrays), the layouts and the conformance inputs
follow from the row; a backend without the entry leaves the mode out (tests/test_formats.py
prints the table). What packing does to the kernels' addressing is each backend's own work.

    >>> from kvzoo.formats import FORMATS
    >>> f = FORMATS["float8_e4m3fn"]
    >>> f.qmax, f.nan_codes, f.storage_width(128)
    (448.0, (127, 255), 128)
    >>> u = FORMATS["uint4"]
    >>> u.codes_per_byte, u.storage_width(128), u.pack(np.array([1, 2], np.uint8)).tolist()
    (2, 64, [33])
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import numpy as np

Kind = Literal["int", "float"]


@dataclass(frozen=True)
class CodeFormat:
    """One code format.

    kind "int": a code is an integer c in [code_min, code_max] of `bits` two's-complement bits
    (unsigned when not `signed`), whose value is c - zero_point. kind "float": a code is an
    IEEE-like minifloat of 1 sign, exponent_bits and mantissa_bits with exponent_bias, decoded
    as ml_dtypes decodes `storage_dtype`.
    """

    name: str
    kind: Kind
    bits: int
    signed: bool
    # dtype of a cache holding these codes (uint8 also accepted, see accepted_dtypes).
    storage_dtype: str
    # The encoder clamps y = x / scale to [qmin, qmax] before rounding; qmax is also the
    # divisor of a per-token-head scale (absmax / qmax).
    qmax: float
    qmin: float
    # Byte stored for y = NaN: the format's NaN, or 0 where it has none (int8: a per-token-head
    # row's scale carries the poison instead).
    nan_code: int
    # Bytes stored for y = +Inf and y = -Inf. Only a static scale lets y be infinite (x / s may
    # overflow; a per-token-head row's y never is), so this is the per-tensor modes' rule: the
    # format's own infinities where it has them, its NaN where it has none (e4m3), and for int8
    # the ends of its range, the saturation of vLLM's clamp.
    inf_codes: tuple[int, int]
    exponent_bits: int = 0
    mantissa_bits: int = 0
    exponent_bias: int = 0
    # Code of the value 0 when it is fixed for the format (code_values() are c - zero_point).
    zero_point: int = 0
    # Formats whose zero moves with the row (uint4): the number of low bits of each row's
    # float32 scale word that hold the row's zero point, the code that stands for 0 in that
    # row. The row's scale is the word with those bits cleared, so it is truncated toward zero
    # by less than 2**zero_point_bits ulp (SPEC.md section 3.5). 0: no per-row zero point.
    # code_values() are then the values at zero point 0; a row decodes as (c - zp) * scale.
    zero_point_bits: int = 0

    @property
    def codes_per_byte(self) -> int:
        return 8 // self.bits

    def storage_width(self, head_size: int) -> int:
        """Elements of storage_dtype that hold one row of head_size codes."""
        return -(-head_size // self.codes_per_byte)

    def head_size_of(self, storage_width: int) -> int:
        """The head size a row of storage_width elements holds (packed formats: the largest)."""
        return storage_width * self.codes_per_byte

    @property
    def row_zero_point(self) -> bool:
        """Whether each row's scale word carries the row's zero point (zero_point_bits)."""
        return self.zero_point_bits > 0

    def split_scale_words(self, words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(scales float32 with the zero-point bits cleared, zero points int64) of float32 scale
        words; formats without a per-row zero point give the words and zeros."""
        bits = np.ascontiguousarray(words, dtype=np.float32).view(np.uint32)
        low = np.uint32((1 << self.zero_point_bits) - 1)
        return (bits & ~low).view(np.float32), (bits & low).astype(np.int64)

    def scale_words(self, scales: np.ndarray, zero_points: np.ndarray) -> np.ndarray:
        """float32 scale words: each scale's bits with the low zero_point_bits replaced by its
        zero point (the inverse of split_scale_words for scales whose low bits are clear)."""
        bits = np.ascontiguousarray(scales, dtype=np.float32).view(np.uint32)
        low = np.uint32((1 << self.zero_point_bits) - 1)
        return ((bits & ~low) | (np.asarray(zero_points).astype(np.uint32) & low)).view(np.float32)

    def pack(self, codes: np.ndarray) -> np.ndarray:
        """Codes [..., D] (one per uint8, unpacked) as storage bytes [..., storage_width(D)]:
        element k * codes_per_byte + j in bits j * bits .. (j + 1) * bits - 1 of byte k (for
        uint4: element 2k in the low nibble). D must be a multiple of codes_per_byte."""
        codes = np.asarray(codes, dtype=np.uint8)
        n = self.codes_per_byte
        if n == 1:
            return codes.copy()
        if codes.shape[-1] % n:
            raise ValueError(f"{self.name}: a row of {codes.shape[-1]} codes does not fill whole bytes")
        # One shift-or per code of a byte (n of them), not a reduction over an axis of length n,
        # which NumPy runs an order of magnitude slower.
        mask = np.uint8((1 << self.bits) - 1)
        packed = codes[..., 0::n] & mask
        for j in range(1, n):
            packed |= (codes[..., j::n] & mask) << np.uint8(j * self.bits)
        return packed

    def unpack(self, stored: np.ndarray) -> np.ndarray:
        """Storage bytes [..., W] as codes [..., head_size_of(W)], one per uint8 (pack's inverse)."""
        stored = np.asarray(stored).view(np.uint8)
        n = self.codes_per_byte
        if n == 1:
            return stored.copy()
        codes = np.empty((*stored.shape[:-1], stored.shape[-1] * n), np.uint8)
        mask = np.uint8((1 << self.bits) - 1)
        for j in range(n):
            codes[..., j::n] = (stored >> np.uint8(j * self.bits)) & mask
        return codes

    @property
    def accepted_dtypes(self) -> tuple[str, ...]:
        """Cache dtypes taken for these codes: the storage dtype, or raw bytes (uint8)."""
        return (self.storage_dtype,) if self.storage_dtype == "uint8" else (self.storage_dtype, "uint8")

    def code_values(self) -> np.ndarray:
        """float64 value of every code 0 .. 2**bits - 1 (as an unsigned bit pattern); NaN codes
        are NaN."""
        return _code_values(self).copy()

    @property
    def nan_codes(self) -> tuple[int, ...]:
        return tuple(int(c) for c in np.flatnonzero(np.isnan(_code_values(self))))

    def representable(self) -> np.ndarray:
        """Sorted distinct finite values in [qmin, qmax] (what a clamped y rounds to)."""
        v = _code_values(self)
        v = v[np.isfinite(v) & (v >= self.qmin) & (v <= self.qmax)]
        return np.unique(v) + 0.0  # + 0.0: the one zero kept is +0

    def midpoints(self) -> np.ndarray:
        """Midpoints of neighbouring representable values: the ties of round-to-nearest."""
        v = self.representable()
        return (v[1:] + v[:-1]) / 2

    def codes_of(self, values: np.ndarray) -> np.ndarray:
        """uint8 code of each value, which must be representable (one code per element,
        unpacked; for the value 0 the code of +0)."""
        table = self.representable()
        v = np.asarray(values, dtype=np.float64)
        i = np.searchsorted(table, v)
        if not np.all((i < len(table)) & (table[np.minimum(i, len(table) - 1)] == v)):
            raise ValueError(f"{self.name}: values not representable in [{self.qmin}, {self.qmax}]")
        return _code_of_value(self)[i]

    def __str__(self) -> str:
        return self.name


@functools.cache
def _code_values(fmt: CodeFormat) -> np.ndarray:
    patterns = np.arange(2**fmt.bits, dtype=np.int64)
    if fmt.kind == "int":
        signed = np.where(patterns >= 2 ** (fmt.bits - 1), patterns - 2**fmt.bits, patterns) if fmt.signed else patterns
        return (signed - fmt.zero_point).astype(np.float64)
    import ml_dtypes  # here, not at the top: importing it takes most of a second on some machines

    return patterns.astype(np.uint8).view(getattr(ml_dtypes, fmt.storage_dtype)).astype(np.float64)


@functools.cache
def _code_of_value(fmt: CodeFormat) -> np.ndarray:
    # Code of each representable() value; the first pattern wins, so +0 (pattern 0) for 0.
    values = _code_values(fmt)
    table = fmt.representable()
    codes = np.empty(len(table), dtype=np.uint8)
    for code in range(len(values) - 1, -1, -1):
        if np.isfinite(values[code]) and fmt.qmin <= values[code] <= fmt.qmax:
            codes[np.searchsorted(table, values[code])] = code
    return codes


INT8 = CodeFormat("int8", "int", 8, True, "int8", qmax=127.0, qmin=-128.0, nan_code=0, inf_codes=(0x7F, 0x80))


def _float8(
    name: str, qmax: float, nan_code: int, inf_codes: tuple[int, int], exponent_bits: int, exponent_bias: int
) -> CodeFormat:
    # What every fp8 format shares: one signed byte of 1 sign, exponent and mantissa bits, stored
    # as its own ml_dtypes type, clamped to a range symmetric about 0.
    return CodeFormat(
        name, "float", 8, True, name, qmax=qmax, qmin=-qmax, nan_code=nan_code, inf_codes=inf_codes,
        exponent_bits=exponent_bits, mantissa_bits=7 - exponent_bits, exponent_bias=exponent_bias,
    )  # fmt: skip


FLOAT8_E4M3FN = _float8(
    "float8_e4m3fn", qmax=448.0, nan_code=0x7F, inf_codes=(0x7F, 0x7F), exponent_bits=4, exponent_bias=7
)
# ROCm MI300's variant: one NaN (0x80, "negative zero"), bias 8, largest finite 240. The clamp
# at 224 follows vLLM, whose ROCm path reported accuracy problems at 240.
FLOAT8_E4M3FNUZ = _float8(
    "float8_e4m3fnuz", qmax=224.0, nan_code=0x80, inf_codes=(0x80, 0x80), exponent_bits=4, exponent_bias=8
)
# IEEE-style: exponent 31 is Inf (mantissa 0) or NaN. The clamp at the largest finite value is
# vLLM's __NV_SATFINITE; 0x7F is the NaN torch's cast stores.
FLOAT8_E5M2 = _float8(
    "float8_e5m2", qmax=57344.0, nan_code=0x7F, inf_codes=(0x7C, 0xFC), exponent_bits=5, exponent_bias=15
)

# Two unsigned 4-bit codes per byte with a per-row zero point in the scale word's low 4 bits
# (vLLM's int4 per-token-head, SPEC.md section 2's int4 rows). No NaN code: a poisoned row stores codes 0
# under a NaN scale word. inf_codes are the ends of the range, as for int8 (no per-tensor mode
# uses this format, so the encoder never meets an infinite y).
UINT4 = CodeFormat(
    "uint4", "int", 4, False, "uint8", qmax=15.0, qmin=0.0, nan_code=0, inf_codes=(15, 0), zero_point_bits=4
)

FORMATS: dict[str, CodeFormat] = {f.name: f for f in (INT8, FLOAT8_E4M3FN, FLOAT8_E4M3FNUZ, FLOAT8_E5M2, UINT4)}
