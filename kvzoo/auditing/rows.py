"""The checks of each live row (one token, one KV head) of one layer's K or V cache.

A row is decoded (NumPy's kernels) and re-quantized by a write implementation (Numba's or
NumPy's: the conformance suite holds both byte for byte to the oracle), in the stored domain:
an int4 row is re-quantized as it is stored (rotated), not rotated again. A row the encoder wrote comes back
to the same bytes; one whose bytes are corrupted, or whose codes and scale come from two
different writes, usually does not. Two encoder rules are not fixed points of that round trip,
and the check allows for them (lifted_codes). How much of random damage it sees depends on the
format: codes alone say little (most random int8 / fp8 rows that reach the clamp pass, and
almost every int4 row does), the scale word much more.

Rows are processed in chunks, on a thread pool (NumPy releases the GIL in its loops), so
that temporaries stay small however large the cache; a compiled write runs one call at a time
(Requantizer).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from dataclasses import dataclass, field

import numpy as np

from .. import api
from .. import registry as _registry
from ..backends.numpy_vectorized import codec as numpy_codec
from ..backends.numpy_vectorized import kernels as vectorized
from ..formats import CodeFormat
from ..modes import MODES, QuantMode
from .live import LiveRows

# Per-row findings, in the order they are decided: a row gets the first that applies.
ROW_KINDS = (
    "scale_nan",
    "scale_inf",
    "scale_zero",
    "scale_negative",
    "scale_subnormal",
    "code_nan",
    "code_inf",
    "value_nonfinite",
    "row_zero",
    "not_encoder_output",
)
_STATUS = {kind: i + 1 for i, kind in enumerate(ROW_KINDS)}
# Elements of one chunk of rows: its float32 temporaries (about ten of this size) stay in the
# CPU caches, which measured 1.5x faster than 2M-element chunks.
CHUNK_ELEMENTS = 1 << 18
_TINY = np.float32(np.finfo(np.float32).tiny)
# A reference row may sit this many code steps from what the cache decodes to: one step for an
# encoder that rounds the other way at a boundary (vLLM's FMA, SPEC.md 3.6), and a half more
# for a scale one ulp apart.
REFERENCE_STEPS = 1.5


@dataclass(frozen=True)
class ByteTables:
    """What each of the 256 bytes of a format's storage holds (codes_per_byte codes)."""

    nan: np.ndarray  # bool: the byte holds a NaN code
    inf: np.ndarray  # bool: the byte holds an infinity
    clamp: np.ndarray  # uint8: codes in the byte at the clamp (largest magnitude, or an end of an unsigned range)
    step2: np.ndarray  # float64: sum of its codes' squared spacing (the distance between neighbouring values)
    step: np.ndarray  # float32: the largest spacing among its codes (a one-code byte: its code's)
    low: np.ndarray  # uint8: the smallest code (as an unsigned pattern) in the byte
    high: np.ndarray  # uint8: the largest
    magnitude: np.ndarray  # float32: the largest |value| of its codes (NaN codes: NaN)


@functools.cache
def byte_tables(fmt: CodeFormat) -> ByteTables:
    values = fmt.code_values()  # one per code pattern
    table = fmt.representable()
    inner = np.clip(np.nan_to_num(values, nan=0.0, posinf=fmt.qmax, neginf=fmt.qmin), fmt.qmin, fmt.qmax)
    i = np.searchsorted(table, inner)
    i = np.clip(i, 1, len(table) - 2) if len(table) > 2 else np.zeros_like(i)
    # The spacing around a value: half the distance from its lower to its upper neighbour (the
    # width of the inputs rounding to it); at the ends, the neighbouring step.
    step = np.where(len(table) > 2, (table[np.minimum(i + 1, len(table) - 1)] - table[i - 1]) / 2, 1.0)
    finite = np.isfinite(values)
    step = np.where(finite, step, 0.0)
    at_clamp = finite & ((values >= fmt.qmax) | (values <= (fmt.qmin if not fmt.signed else -fmt.qmax)))
    codes = fmt.unpack(np.arange(256, dtype=np.uint8)[:, None])  # [256, codes_per_byte]
    return ByteTables(
        nan=np.isnan(values)[codes].any(axis=1),
        inf=np.isinf(values)[codes].any(axis=1),
        clamp=at_clamp[codes].sum(axis=1).astype(np.uint8),
        step2=(step[codes] ** 2).sum(axis=1),
        step=step[codes].max(axis=1).astype(np.float32),
        low=codes.min(axis=1),
        high=codes.max(axis=1),
        magnitude=np.abs(values)[codes].max(axis=1).astype(np.float32),
    )


def stored_mode(mode: QuantMode) -> QuantMode:
    """The mode whose rows are `mode`'s rows as stored: itself, or a rotated mode's unrotated twin."""
    if mode.rotation is None:
        return mode
    return next(
        m
        for m in MODES.values()
        if m.format is mode.format and m.granularity == mode.granularity and m.rotation is None
    )


# One compiled write at a time: such an implementation parallelises each call itself, and Numba's
# default threading layer refuses parallel calls from several threads at once.
_COMPILED = threading.Lock()


@dataclass(frozen=True)
class Requantizer:
    """Re-quantizes float32 rows [m, D] as stored, to nearest: (codes uint8 [m, W], scale words
    float32 [m]). impl None: the NumPy implementation's kernels, called directly; else that CPU
    implementation of reshape_and_cache through kvzoo's API, byte for byte the same (the
    conformance suite holds both to the oracle). Numba's made whole audits 1.6-1.9x faster."""

    mode: QuantMode
    impl: _registry.Implementation | None = None

    def __call__(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        stored = stored_mode(self.mode)
        if self.impl is None:
            with np.errstate(all="ignore"):
                return vectorized.quantize_rows(rows, stored_codec(self.mode))
        m, d = rows.shape
        width = stored.cache_width(d)
        key = np.ascontiguousarray(rows).reshape(m, 1, d)
        codes = [np.empty((m, 1, 1, width), np.uint8) for _ in range(2)]
        words = [np.empty((m, 1, 1), np.float32) for _ in range(2)]
        with _COMPILED:
            # K and V are both the rows (read arrays may alias); V's bytes go unused.
            api.reshape_and_cache(
                key,
                key,
                codes[0],
                codes[1],
                np.arange(m, dtype=np.int64),
                mode=stored,
                k_scale_cache=words[0],
                v_scale_cache=words[1],
                impl=self.impl,
                validate=False,
            )
        return codes[0].reshape(m, width), words[0].reshape(m)


def requantizer(mode: QuantMode, impl: str | None = None, registry: _registry.Registry | None = None) -> Requantizer:
    """The Requantizer of the write implementation named `impl` ("numpy": NumPy's kernels), or of
    the registry's fastest CPU write of the stored mode."""
    reg = registry or _registry.default()
    stored = stored_mode(mode)
    if impl is None:
        found = reg.candidates("reshape_and_cache", stored, "cpu")
        chosen = found[0] if found else None
    else:
        chosen = reg.get("reshape_and_cache", impl)
        why = list(chosen.unavailable())
        if stored.name not in chosen.modes or "cpu" not in chosen.devices:
            why.append(f"{impl} does not write {stored.name} on the CPU")
        if why:
            raise ValueError(f"impl: {impl!r} cannot re-quantize the rows here: {'; '.join(why)}")
    return Requantizer(mode, None if chosen is None or chosen.name == "numpy" else chosen)


@dataclass(frozen=True)
class CacheRows:
    """One layer's K or V: the pages and what the audit needs to read them."""

    mode: QuantMode
    rounding: str
    codes: np.ndarray  # uint8 [NB, BS, H, W], or the model dtype for mode none
    words: np.ndarray | None  # float32 [NB, BS, H] scale words (per-token-head)
    static: np.float32 | None  # the per-tensor scale
    reference: np.ndarray | None  # [tokens, H, D] K or V given with the dump
    head_size: int
    # Hash rows for duplicate_row (K only: kvzoo.auditing.core says why).
    hash_rows: bool = False
    # What re-quantizes rows in the round trip (None: NumPy's kernels).
    requantize: Requantizer | None = None

    def row_words(self) -> np.ndarray:
        """The per-row scale words, for the checks that run only on per-token-head modes."""
        if self.words is None:
            raise ValueError(f"mode {self.mode.name!r} keeps no per-row scale words")
        return self.words

    def static_scale(self) -> np.float32:
        """The per-tensor scale, for the checks that run only on per-tensor modes."""
        if self.static is None:
            raise ValueError(f"mode {self.mode.name!r} has no per-tensor scale")
        return self.static

    def reference_rows(self) -> np.ndarray:
        """The reference K or V, for the checks that run only when the dump gave one."""
        if self.reference is None:
            raise ValueError("the dump holds no reference rows for this cache")
        return self.reference


@dataclass
class RowResults:
    """Per live row and head (arrays [R, H]) and sums over the rows without a finding."""

    status: np.ndarray  # int8: 0, or 1 + index in ROW_KINDS
    mismatch: np.ndarray  # bool: reference_mismatch
    hashes: np.ndarray  # uint64: row bytes' hash, 0 for rows never compared (constant rows)
    scales: np.ndarray | None  # float32: the decoded scale (zero point bits cleared)
    sums: dict[str, float] = field(default_factory=dict)

    @classmethod
    def join(cls, parts: list[RowResults]) -> RowResults:
        sums: dict[str, float] = {}
        for p in parts:
            for k, v in p.sums.items():
                sums[k] = max(sums.get(k, 0.0), v) if k == "absmax" else sums.get(k, 0.0) + v
        return cls(
            status=np.concatenate([p.status for p in parts]),
            mismatch=np.concatenate([p.mismatch for p in parts]),
            hashes=np.concatenate([p.hashes for p in parts]),
            scales=None if parts[0].scales is None else np.concatenate([p.scales for p in parts]),
            sums=sums,
        )


def chunks(num_rows: int, num_heads: int, head_size: int) -> list[slice]:
    step = max(1, CHUNK_ELEMENTS // max(1, num_heads * head_size))
    return [slice(lo, min(lo + step, num_rows)) for lo in range(0, num_rows, step)] or [slice(0, 0)]


def stored_codec(mode: QuantMode, rounding: str = "nearest") -> vectorized.Codec:
    """The NumPy implementation's codec for rows as stored: a rotated mode's rows without the
    rotation (its codes hold the rotated row)."""
    return dataclasses.replace(numpy_codec(mode, rounding), rotation=None)


def lifted_codes(codes: np.ndarray, words: np.ndarray, mode: QuantMode, rounding: str) -> np.ndarray:
    """Codes [m, W] of rows the round trip then holds to round-to-nearest's fixed point.

    Rows an encoder writes whose own decode re-quantizes differently, lifted to one that does
    not: int8 "trunc" lands a row's largest element on 126 when absmax * inv falls just under
    127 (SPEC.md section 3): 126 is lifted to 127. int4 (SPEC.md 3.5) puts the ends of a row's
    range at y = zp - t and 15 - t + zp, where t = -lo / scale and zp rounds t half up through a
    float32 add; where t's fraction is within rounding of 1/2 an end lands one code inside,
    on 1 (zp rounded up) or on 14 (rounded down, with r * inv rounded below 8.5): 1 is lowered
    to 0 where the zero point is above 0, and 14 lifted to 15 where it is below 15. Other rows
    are returned as they are.
    """
    fmt = mode.code_format
    tables = byte_tables(fmt)
    if rounding == "trunc":
        lift = tables.magnitude[codes].max(axis=-1) == 126
        if lift.any():
            rows = codes[lift]
            signed = rows.view(np.int8)
            top = np.abs(signed.astype(np.int16)) == 126
            codes = codes.copy()
            codes[lift] = np.where(top, np.where(signed > 0, 127, -127).astype(np.int8).view(np.uint8), rows)
    if fmt.row_zero_point:
        _, zero_points = fmt.split_scale_words(words)
        low, high = int(fmt.qmin), int(fmt.qmax)
        up = (tables.low[codes].min(axis=-1) == low + 1) & (zero_points > low)
        down = (tables.high[codes].max(axis=-1) == high - 1) & (zero_points < high)
        lift = up | down
        if lift.any():
            unpacked = fmt.unpack(codes[lift])
            unpacked = np.where(up[lift][:, None] & (unpacked == low + 1), np.uint8(low), unpacked)
            unpacked = np.where(down[lift][:, None] & (unpacked == high - 1), np.uint8(high), unpacked)
            codes = codes.copy()
            codes[lift] = fmt.pack(unpacked)
    return codes


def round_trip_fails(
    codes: np.ndarray,
    words: np.ndarray,
    mode: QuantMode,
    rounding: str,
    decoded: np.ndarray | None = None,
    requantize: Requantizer | None = None,
) -> np.ndarray:
    """bool [m]: rows (codes uint8 [m, W], scale words float32 [m]) of a per-token-head mode
    that no input encodes to: decoded, re-quantized to nearest, their bytes differ. decoded:
    their stored-domain decode (float32 [m, D]) where the caller has it already; requantize:
    what re-quantizes them (default NumPy's kernels)."""
    if not len(codes):
        return np.zeros(0, bool)
    codec = stored_codec(mode)
    lifted = lifted_codes(codes, words, mode, rounding)
    if decoded is None:
        decoded = vectorized.decode(lifted, words, codec)
    elif lifted is not codes:
        changed = (lifted != codes).any(axis=-1)
        decoded = decoded.copy()
        decoded[changed] = vectorized.decode(lifted[changed], words[changed], codec)
    again, again_words = (requantize or Requantizer(mode))(decoded)
    return (again != lifted).any(axis=-1) | (again_words.view(np.uint32) != words.view(np.uint32))


def _hash_rows(raw: np.ndarray, words: np.ndarray | None) -> np.ndarray:
    """uint64 [n, H]: a hash of each row's bytes (and scale word); 0 for a row whose bytes are
    all equal (zeros, a constant row), which says nothing about where it came from."""
    n, h, width = raw.shape
    padded = np.zeros((n, h, -(-width // 8) * 8), np.uint8)
    padded[..., :width] = raw
    lanes = padded.view(np.uint64)
    # Odd multipliers per lane; the sum wraps modulo 2^64, as intended.
    mult = (np.arange(1, lanes.shape[-1] + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)) | np.uint64(1)
    with np.errstate(over="ignore"):
        acc = (lanes * mult).sum(axis=-1, dtype=np.uint64)
        if words is not None:
            acc ^= words.view(np.uint32).astype(np.uint64) * np.uint64(0xC2B2AE3D27D4EB4F)
        acc ^= acc >> np.uint64(31)
        acc *= np.uint64(0xBF58476D1CE4E5B9)
        acc ^= acc >> np.uint64(29)
    constant = (raw == raw[..., :1]).all(axis=-1)
    acc[constant] = 0
    acc[(acc == 0) & ~constant] = 1
    return acc


def check_rows(cache: CacheRows, live: LiveRows, rows: slice) -> RowResults:
    """Check live rows `rows` (a slice of `live`) of one cache: statuses, reference mismatches,
    hashes, the scales, and the sums behind the per-layer table."""
    mode, fmt = cache.mode, cache.mode.format
    block, slot = live.block[rows], live.slot[rows]
    codes = cache.codes[block, slot]  # [n, H, W]
    n, heads = codes.shape[:2]
    status = np.zeros((n, heads), np.int8)
    words = scales = None
    if fmt is None:
        raw = codes.view(np.uint8).reshape(n, heads, -1)
        decoded = codes.astype(np.float32)
        mark(status, "value_nonfinite", ~np.isfinite(decoded).all(axis=-1))
    else:
        raw = codes
        tables = byte_tables(fmt)
        if mode.per_token_head:
            words = cache.row_words()[block, slot]
            scales, _ = fmt.split_scale_words(words)
            _scale_status(status, scales)
        with np.errstate(all="ignore"):
            decoded = vectorized.decode(codes, cache.static_scale() if words is None else words, stored_codec(mode))
        if tables.nan.any():
            mark(status, "code_nan", tables.nan[codes].any(axis=-1))
        if tables.inf.any():
            mark(status, "code_inf", tables.inf[codes].any(axis=-1))
        if mode.per_token_head:
            _mark_round_trip(status, codes, words, decoded, cache)
    if not mode.per_token_head:
        mark(status, "row_zero", (raw == 0).all(axis=-1))
    sums = _sums(cache, status, codes, scales, decoded)
    mismatch = np.zeros((n, heads), bool)
    if cache.reference is not None:
        mismatch = _against_reference(cache, live.token[rows], codes, words, decoded, sums)
    hashes = _hash_rows(raw, words) if cache.hash_rows else np.zeros((n, heads), np.uint64)
    return RowResults(status=status, mismatch=mismatch, hashes=hashes, scales=scales, sums=sums)


def _mark_round_trip(status, codes, words, decoded, cache: CacheRows) -> None:
    """not_encoder_output for the rows without a finding yet (all of them, usually: no gather)."""
    n, heads, width = codes.shape
    check = status == 0
    args = (cache.mode, cache.rounding)
    if check.all():
        flat = decoded.reshape(n * heads, decoded.shape[-1])
        fails = round_trip_fails(codes.reshape(-1, width), words.reshape(-1), *args, flat, cache.requantize)
        fails = fails.reshape(n, heads)
    else:
        fails = np.zeros((n, heads), bool)
        fails[check] = round_trip_fails(codes[check], words[check], *args, decoded[check], cache.requantize)
    mark(status, "not_encoder_output", fails)


def _sums(cache: CacheRows, status, codes, scales, decoded) -> dict[str, float]:
    """The per-layer table's sums over the rows with no finding: per row in float32 (one pass
    each), then over rows in float64."""
    fmt = cache.mode.format
    clean = status == 0
    sums = {"rows": float(clean.sum()), "elements": float(clean.sum()) * decoded.shape[-1]}
    with np.errstate(all="ignore"):
        value2 = np.einsum("...d,...d->...", decoded, decoded)
        largest = np.maximum(decoded.max(axis=-1), -decoded.min(axis=-1))
    sums["value2"] = float(value2[clean].sum(dtype=np.float64))
    sums["absmax"] = float(largest[clean].max()) if clean.any() else 0.0
    if fmt is None:
        return sums
    tables = byte_tables(fmt)
    sums["clamp"] = float(np.add.reduce(tables.clamp[codes], axis=-1, dtype=np.int64)[clean].sum())
    row_scale = scales if scales is not None else np.float32(cache.static)
    if np.all(tables.step2 == tables.step2[0]):
        step2 = np.full(codes.shape[:2], tables.step2[0] * codes.shape[-1])
    else:
        step2 = np.add.reduce(tables.step2.astype(np.float32)[codes], axis=-1, dtype=np.float64)
    scale2 = np.broadcast_to(np.asarray(row_scale, np.float64) ** 2, step2.shape)
    sums["step2"] = float((step2 * scale2)[clean].sum())
    return sums


def mark(status: np.ndarray, kind: str, hit: np.ndarray) -> None:
    """Give `kind` to the rows in `hit` that have no finding yet (a row keeps its first)."""
    status[(status == 0) & hit] = _STATUS[kind]


def _scale_status(status: np.ndarray, scales: np.ndarray) -> None:
    for kind, hit in (
        ("scale_nan", np.isnan(scales)),
        ("scale_inf", np.isinf(scales)),
        ("scale_zero", scales == 0),
        ("scale_negative", scales < 0),
        ("scale_subnormal", np.abs(scales) < _TINY),
    ):
        mark(status, kind, hit)


def encode_reference(cache: CacheRows, reference: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(rows as stored float32 [n, H, D], the encoder's codes, its scale words or None) of
    reference rows [n, H, D]: rotated where the mode rotates, in the reference's dtype as a write
    rotates them (SPEC.md 3.4)."""
    mode = cache.mode
    xf = reference.astype(np.float32)
    if mode.rotation is not None:
        xf = vectorized.rotate_rows(xf, reference.dtype)
    codec = stored_codec(mode, cache.rounding)
    if mode.per_token_head:
        codes, words = vectorized.quantize_rows(xf, codec)
        return xf, codes, words
    return xf, vectorized.quantize_static(xf, cache.static_scale(), codec), None


def _against_reference(
    cache: CacheRows,
    tokens: np.ndarray,
    codes: np.ndarray,
    words: np.ndarray | None,
    decoded: np.ndarray,
    sums: dict[str, float],
) -> np.ndarray:
    """bool [n, H]: rows more than REFERENCE_STEPS code steps from kvzoo's encoding of the
    reference; adds the reference error sums."""
    mode, fmt = cache.mode, cache.mode.format
    reference = cache.reference_rows()[tokens]
    if fmt is None:
        # Mode none stores the bits it is given: compare in the cache's dtype.
        expected = reference.astype(cache.codes.dtype).astype(np.float32)
        same = (decoded == expected) | (np.isnan(decoded) & np.isnan(expected))
        stored, expected_decoded, exact = expected, expected, same.all(axis=-1)
        mismatch = ~exact
    else:
        stored, ref_codes, ref_words = encode_reference(cache, reference)
        codec = stored_codec(mode)
        with np.errstate(all="ignore"):
            if ref_words is not None:
                ref_scale, _ = fmt.split_scale_words(ref_words)
                expected_decoded = vectorized.decode(ref_codes, ref_words, codec)
            else:
                ref_scale = np.full(ref_codes.shape[:2], cache.static_scale(), np.float32)
                expected_decoded = vectorized.decode(ref_codes, cache.static_scale(), codec)
            tables = byte_tables(fmt)
            if fmt.codes_per_byte == 1:
                step = tables.step[ref_codes] * ref_scale[..., None]
            else:
                step = np.broadcast_to(ref_scale[..., None], expected_decoded.shape)
            far = np.abs(decoded - expected_decoded) > REFERENCE_STEPS * step
        nan_differs = np.isnan(decoded) != np.isnan(expected_decoded)
        mismatch = (far | nan_differs).any(axis=-1)
        exact = (ref_codes == codes).all(axis=-1)
        if ref_words is not None and words is not None:
            exact &= ref_words.view(np.uint32) == words.view(np.uint32)
    finite = np.isfinite(decoded).all(axis=-1) & np.isfinite(stored).all(axis=-1)
    diff = (decoded[finite] - stored[finite]).astype(np.float64)
    sums["ref_diff2"] = float((diff**2).sum())
    sums["ref_value2"] = float((stored[finite].astype(np.float64) ** 2).sum())
    sums["ref_rows"] = float(exact.size)
    sums["ref_exact"] = float(exact.sum())
    return mismatch
