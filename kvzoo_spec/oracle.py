"""The oracle: a deliberately plain statement of kvzoo_spec/SPEC.md in code.

It imports nothing from kvzoo and shares no code with kvzoo/backends/numpy_vectorized/kernels.py, so a bug in
either cannot hide behind the other. Every rounding is done by rules written out here:
quantization uses numpy.float32 scalar / elementwise arithmetic (IEEE binary32, round to
nearest even), int8 rounding uses Python's round() (half to even), and the fp8 encoders pick
the nearest code of a table built from the formats' definitions. ml_dtypes is never used to
round; bfloat16 inputs are widened by moving their bits.

Speed is not a goal: loops run per row (and per element where a rule is applied), which is
fast enough for the tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

SCALE_FLOOR = np.float32(1e-6)
CANONICAL_NAN_BITS = 0x7FC00000
_F32_NAN = np.array([CANONICAL_NAN_BITS], dtype=np.uint32).view(np.float32)[0]
_ONE = np.float32(1.0)


# --------------------------------------------------------------------------------------------
# fp8 formats, from their definitions


@dataclass(frozen=True)
class _Fp8Format:
    name: str
    exponent_bits: int
    bias: int
    # What the format spends its top codes on. "fn" (e4m3fn): only S.1111.111 is NaN, no
    # infinities. "fnuz" (e4m3fnuz): only 0x80 is NaN, no -0, no infinities. "ieee" (e5m2):
    # the all-ones exponent is +-Inf with a zero mantissa and NaN otherwise.
    specials: str

    @property
    def mantissa_bits(self) -> int:
        return 7 - self.exponent_bits

    def _fields(self, code: int) -> tuple[bool, int, int]:
        m = self.mantissa_bits
        return bool(code & 0x80), (code & 0x7F) >> m, code & ((1 << m) - 1)

    def _top_exponent(self, code: int) -> bool:
        return self._fields(code)[1] == (1 << self.exponent_bits) - 1

    def is_nan_code(self, code: int) -> bool:
        if self.specials == "fnuz":
            return code == 0x80
        if self.specials == "fn":
            return (code & 0x7F) == 0x7F
        return self._top_exponent(code) and self._fields(code)[2] != 0

    def is_inf_code(self, code: int) -> bool:
        return self.specials == "ieee" and self._top_exponent(code) and self._fields(code)[2] == 0

    @property
    def has_infinities(self) -> bool:
        return self.specials == "ieee"

    def inf_code(self, negative: bool) -> int:
        """The code of +Inf or -Inf (formats with infinities only)."""
        assert self.has_infinities
        return (0x80 if negative else 0) | (((1 << self.exponent_bits) - 1) << self.mantissa_bits)

    def value(self, code: int) -> float:
        """Exact value of one code byte (a Python float, i.e. float64, exact for 8-bit formats)."""
        if self.is_nan_code(code):
            return math.nan
        negative, exponent, mantissa = self._fields(code)
        m = self.mantissa_bits
        if self.is_inf_code(code):
            magnitude = math.inf
        elif exponent == 0:  # subnormal: 0.mm * 2^(1 - bias)
            magnitude = math.ldexp(mantissa, 1 - self.bias - m)
        else:
            magnitude = math.ldexp((1 << m) + mantissa, exponent - self.bias - m)
        return -magnitude if negative else magnitude


E4M3FN = _Fp8Format("float8_e4m3fn", exponent_bits=4, bias=7, specials="fn")
E4M3FNUZ = _Fp8Format("float8_e4m3fnuz", exponent_bits=4, bias=8, specials="fnuz")
E5M2 = _Fp8Format("float8_e5m2", exponent_bits=5, bias=15, specials="ieee")


class _Fp8Encoder:
    """Round-to-nearest-even from a float to an fp8 code by table look-up.

    Positive codes 0x00..max_code have strictly increasing values, so the code index is the
    value order and "even code" is "even mantissa". Midpoints between neighbours need one bit
    more than the format, so they are exact floats and comparing |y| against them is exact:
    below a midpoint rounds down, above rounds up, on it goes to the even code.
    """

    def __init__(self, fmt: _Fp8Format):
        self.fmt = fmt
        # The finite non-negative codes run from 0x00 up to the first NaN or Inf code.
        max_code = max(c for c in range(0x80) if math.isfinite(fmt.value(c)))
        self.magnitudes = np.array([fmt.value(c) for c in range(max_code + 1)], dtype=np.float64)
        assert np.all(np.diff(self.magnitudes) > 0)
        self.midpoints = (self.magnitudes[:-1] + self.magnitudes[1:]) / 2
        self.max_value = float(self.magnitudes[-1])

    def encode(self, y: np.ndarray) -> np.ndarray:
        """Codes of finite float32 values with |y| <= the format's max (the caller clamps)."""
        y64 = np.asarray(y, dtype=np.float64)  # exact widening
        a = np.abs(y64)
        assert np.all(a <= self.max_value), "encode() takes clamped finite values"
        # i = number of midpoints strictly below a: the nearest code unless a is a midpoint.
        i = np.searchsorted(self.midpoints, a, side="left")
        on_midpoint = (i < len(self.midpoints)) & (self.midpoints[np.minimum(i, len(self.midpoints) - 1)] == a)
        i = np.where(on_midpoint & (i % 2 == 1), i + 1, i)
        negative = np.signbit(y64)
        if self.fmt.specials == "fnuz":
            # fnuz has one zero (0x00); 0x80 is its NaN, so a negative zero result is 0x00.
            negative = negative & (i != 0)
        return (i | np.where(negative, 0x80, 0)).astype(np.uint8)

    def decode_table(self) -> np.ndarray:
        """float32 value of every code byte, indexable by the code."""
        return np.array([self.fmt.value(c) for c in range(256)], dtype=np.float32)


_ENCODERS = {f.name: _Fp8Encoder(f) for f in (E4M3FN, E4M3FNUZ, E5M2)}


# --------------------------------------------------------------------------------------------
# modes


@dataclass(frozen=True)
class OracleMode:
    name: str
    granularity: str  # "none" | "per_tensor" | "per_token_head"
    code: str | None  # "int8", an fp8 format name, or None (model dtype)
    qmax: np.float32 = np.float32(0)
    qmin: np.float32 = np.float32(0)
    nan_code: int = 0
    roundings: tuple[str, ...] = ("nearest",)


ORACLE_MODES = {
    m.name: m
    for m in (
        OracleMode("none", "none", None),
        OracleMode("fp8_per_tensor", "per_tensor", "float8_e4m3fn", np.float32(448), np.float32(-448), 0x7F),
        OracleMode(
            "int8_per_token_head",
            "per_token_head",
            "int8",
            np.float32(127),
            np.float32(-128),
            0x00,
            ("nearest", "trunc"),
        ),
        OracleMode("fp8_per_token_head", "per_token_head", "float8_e4m3fn", np.float32(448), np.float32(-448), 0x7F),
        OracleMode(
            "fp8_e4m3fnuz_per_token_head", "per_token_head", "float8_e4m3fnuz", np.float32(224), np.float32(-224), 0x80
        ),
        # vLLM's int8_per_tensor rounds half to even only (no "trunc"), and clamps to [-128, 127].
        OracleMode("int8_per_tensor", "per_tensor", "int8", np.float32(127), np.float32(-128), 0x00),
        OracleMode("fp8_e5m2_per_tensor", "per_tensor", "float8_e5m2", np.float32(57344), np.float32(-57344), 0x7F),
    )
}


def _mode(mode_name: str) -> OracleMode:
    if mode_name not in ORACLE_MODES:
        raise ValueError(f"unknown mode {mode_name!r}; oracle modes: {sorted(ORACLE_MODES)}")
    return ORACLE_MODES[mode_name]


def _check_rounding(mode: OracleMode, rounding: str) -> None:
    if rounding not in ("nearest", "trunc"):
        raise ValueError(f"rounding must be 'nearest' or 'trunc', got {rounding!r}")
    if rounding not in mode.roundings:
        raise ValueError(f"rounding={rounding!r} is not defined for {mode.name} (only {list(mode.roundings)})")


# --------------------------------------------------------------------------------------------
# widening of inputs


def widen_to_float32(x: np.ndarray) -> np.ndarray:
    """Exact widening of a bfloat16 / float16 / float32 array to float32."""
    x = np.asarray(x)
    if x.dtype == np.float32:
        return x.astype(np.float32, copy=True)
    if x.dtype == np.float16:
        return x.astype(np.float32)  # IEEE half -> single is exact, NaN/Inf preserved
    if x.dtype.name == "bfloat16":
        # bfloat16 is the top half of a float32: shifting its bits up is the exact widening.
        bits = np.ascontiguousarray(x).view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32)
    raise TypeError(f"input dtype must be bfloat16, float16 or float32, got {x.dtype}")


# --------------------------------------------------------------------------------------------
# one row


def _encoder(mode: OracleMode) -> _Fp8Encoder:
    if mode.code is None:
        raise ValueError(f"mode {mode.name!r} stores the model dtype: it has no code encoder")
    return _ENCODERS[mode.code]


def _encode_y(y: np.ndarray, mode: OracleMode, rounding: str) -> np.ndarray:
    """Codes of one row of y = x * inv (or x / s): the non-finite rule, the clamp, the rounding."""
    codes = np.empty(y.shape, dtype=np.uint8)
    nan = np.isnan(y)
    codes[nan] = mode.nan_code
    if mode.code == "int8":
        # int8 has no NaN and no infinity: an infinite y is beyond the range like any other and
        # saturates at its end (vLLM's clamp to [-128, 127]).
        rounded = ~nan
    else:
        fmt = _encoder(mode).fmt
        for i in np.flatnonzero(np.isinf(y)):
            codes[i] = fmt.inf_code(bool(y[i] < 0)) if fmt.has_infinities else mode.nan_code
        rounded = np.isfinite(y)
    clamped = np.minimum(np.maximum(y[rounded], mode.qmin), mode.qmax)
    if mode.code == "int8":
        if rounding == "nearest":
            ints = [round(float(v)) for v in clamped]  # Python's round() is half to even
        else:
            ints = [math.trunc(float(v)) for v in clamped]
        codes[rounded] = np.array(ints, dtype=np.int64).astype(np.int8).view(np.uint8)
    else:
        codes[rounded] = _encoder(mode).encode(clamped)
    return codes


def quantize_row(xf: np.ndarray, mode: OracleMode, rounding: str) -> tuple[np.ndarray, np.float32]:
    """Per-token-head quantization of one float32 row: (codes uint8 [D], scale float32)."""
    y, scale = _scaled_row(xf, mode)
    return _encode_y(y, mode, rounding), scale


def _scaled_row(xf: np.ndarray, mode: OracleMode) -> tuple[np.ndarray, np.float32]:
    """(y, scale) of one float32 row: section 3's steps 2-5, y = xf * inv before its encoding."""
    assert xf.dtype == np.float32 and xf.ndim == 1
    with np.errstate(all="ignore"):
        if np.any(np.isnan(xf)):
            absmax = _F32_NAN
        else:
            absmax = np.float32(0)
            for v in np.abs(xf):
                if v > absmax:
                    absmax = v
        q = np.float32(absmax / mode.qmax)
        scale = _F32_NAN if np.isnan(q) else (q if q > SCALE_FLOOR else SCALE_FLOOR)
        inv = np.float32(_ONE / scale)
        y = xf * inv
    return y, np.float32(scale)


def quantize_row_static(xf: np.ndarray, mode: OracleMode, scale: np.float32) -> np.ndarray:
    """Per-tensor quantization of one float32 row with the caller's scale: codes uint8 [D]."""
    with np.errstate(all="ignore"):
        y = xf / scale  # correctly rounded division, elementwise
    return _encode_y(y, mode, "nearest")


def _static_scale(static_scale) -> np.float32:
    s = np.float32(np.asarray(static_scale, dtype=np.float32).reshape(-1)[0])
    if not (np.isfinite(s) and s > 0):
        raise ValueError(f"static scale must be finite and > 0, got {s}")
    return s


def quantize_rows(x: np.ndarray, mode_name: str, *, rounding: str = "nearest", static_scale=None):
    """Quantize rows x [N, D] (float32) -> (codes uint8 [N, D], scales float32 [N]).

    For the per-tensor modes the scales are the static scale repeated (nothing per row is stored).
    """
    mode = _mode(mode_name)
    _check_rounding(mode, rounding)
    if mode.granularity == "none":
        raise ValueError("mode none stores the input unchanged; there is nothing to quantize")
    x = widen_to_float32(x)
    assert x.ndim == 2
    codes = np.empty(x.shape, dtype=np.uint8)
    scales = np.empty(x.shape[0], dtype=np.float32)
    if mode.granularity == "per_tensor":
        s = _static_scale(static_scale)
        for n in range(x.shape[0]):
            codes[n] = quantize_row_static(x[n], mode, s)
            scales[n] = s
    else:
        for n in range(x.shape[0]):
            codes[n], scales[n] = quantize_row(x[n], mode, rounding)
    return codes, scales


def _code_values(codes: np.ndarray, mode: OracleMode) -> np.ndarray:
    if mode.code == "int8":
        return codes.view(np.int8).astype(np.float32)
    return _encoder(mode).decode_table()[codes]


def decode_rows(codes: np.ndarray, scales: np.ndarray, mode_name: str) -> np.ndarray:
    """x̂ = float32(code) * scale, one float32 multiply per element: float32 [N, D]."""
    mode = _mode(mode_name)
    codes = np.asarray(codes, dtype=np.uint8)
    scales = np.asarray(scales, dtype=np.float32)
    with np.errstate(all="ignore"):
        return _code_values(codes, mode) * scales[..., None]


# float32's error in a weight p_k = exp(l_k - m), relative to p_k, as SPEC.md 8.3's check at an
# implementation's own tile allows for it. The model is NumPy's float32 path
# (backends/numpy_vectorized), the one implementation that declares a probability tile:
# - the logit's dot product: _LOGIT_DOT_RTOL of its terms' absolute sum, 16 roundings of 2^-24
#   (tests/test_fp8_dots.py measures NumPy's on its own operands, 4-5 at D = 64-128, and holds
#   it under the 16); the worst-case bound, (D + 4) roundings, would admit slack as large as the
#   tile errors the check exists to find;
# - a softcap's tanh: the logit error times tanh's largest slope over it, plus
#   _SOFTCAP_ROUNDINGS of the cap;
# - exp's argument l - m rounds to within |l - m| roundings of p; exp itself and the products
#   by the V scale, by the tile maximum's reciprocal and by 256: _WEIGHT_ROUNDINGS;
# - a p below float32's normal range keeps only 2^-149 absolutely.
_F32_ROUNDING = 2.0**-24
_F32_SMALLEST = 2.0**-149
_LOGIT_DOT_RTOL = 16 * _F32_ROUNDING
_SOFTCAP_ROUNDINGS = 4
_WEIGHT_ROUNDINGS = 8
_WEIGHT_FLOOR = 2.0**-100  # SPEC.md 8.3's floor of a tile's largest u


def _float32_logit_error(abs_terms: np.ndarray, logits: np.ndarray, softcap: float | None) -> np.ndarray:
    """Each logit's float32 error [L], absolute: abs_terms [L] is softmax_scale * |k| . |q|;
    logits [L] the float64 logits before the softcap."""
    error = _LOGIT_DOT_RTOL * abs_terms
    if softcap is not None:
        # tanh's slope is largest at the error interval's end nearest 0.
        nearest = np.maximum(np.abs(logits) - error, 0.0)
        error = error * (1.0 - np.tanh(nearest / softcap) ** 2) + _SOFTCAP_ROUNDINGS * softcap * _F32_ROUNDING
    return error


def _float32_weight_rtol(logit_error: np.ndarray, shifted: np.ndarray, p: np.ndarray) -> np.ndarray:
    """Each p_k's float32 error relative to it [L], the shift m's error left out (it cancels in
    u / w unless w is at its floor): logit_error from _float32_logit_error, shifted = l - m."""
    with np.errstate(divide="ignore"):
        return logit_error + _F32_ROUNDING * (np.abs(shifted) + _WEIGHT_ROUNDINGS) + _F32_SMALLEST / p


def _fp8_weights(
    p: np.ndarray, v_scales: np.ndarray, tiles: np.ndarray, p_rtol: np.ndarray, shift_rtol: float
) -> tuple[np.ndarray, np.ndarray]:
    """SPEC.md 8.3's weights of one row, as multipliers of the decoded values: per tile, u =
    p * vscale, w = max(max u, 2^-100), code = e4m3fn(u / w * 256) (from float32, as the
    implementations round), the weight code * w / 256 / vscale.

    Also each weight's slack: where float32 could put u / w * 256 on the other side of a
    rounding boundary, the largest weight change the other code makes (0 elsewhere). u / w's
    relative error is p_k's (p_rtol [L]) plus the tile maximum's (at most the tile's largest
    p_rtol); with w at its floor, the maximum's is replaced by the shift's (shift_rtol)."""
    mode = _mode("fp8_per_token_head")
    u = p * v_scales
    out = np.empty_like(p)
    slack = np.zeros_like(p)

    def code_values(x):
        return _code_values(_encode_y(x.astype(np.float32), mode, "nearest"), mode).astype(np.float64)

    for t in np.unique(tiles):
        at = tiles == t
        w = max(u[at].max(), _WEIGHT_FLOOR)
        reach = p_rtol[at] + (p_rtol[at].max() if w > _WEIGHT_FLOOR else shift_rtol)
        with np.errstate(all="ignore"):
            x = u[at] / w * 256.0
            unit = (w / 256.0) / v_scales[at]
            # Rounding is monotone, so the codes at the interval's ends bound every code within.
            # No u exceeds w, so nothing in float32 passes 256.
            low = x * np.exp(-np.minimum(reach, 700.0))
            high = np.where(x > 0, np.minimum(x * np.exp(np.minimum(reach, 700.0)), 256.0), 0.0)
            codes, low_codes, high_codes = code_values(x), code_values(low), code_values(high)
            out[at] = codes * unit
            slack[at] = np.maximum(codes - low_codes, high_codes - codes) * np.abs(unit)
    return out, slack


def fp8_dots_query(x: np.ndarray) -> np.ndarray:
    """SPEC.md 8.3's query rows x [N, D] (float32) as fp8_dots attends with them, in float64:
    (hi + lo) * scale, hi the e4m3fn per-token-head codes of the row (section 3), lo the
    e4m3fn rounding of y - hi with y = x * inv of section 3's step 5."""
    mode = _mode("fp8_per_token_head")
    x = widen_to_float32(x)
    out = np.empty(x.shape, np.float64)
    for n in range(x.shape[0]):
        y, scale = _scaled_row(x[n], mode)
        hi = _code_values(_encode_y(y, mode, "nearest"), mode)
        with np.errstate(all="ignore"):
            residual = y - hi  # exact in float32: a float minus its own rounding
        lo = _code_values(_encode_y(residual, mode, "nearest"), mode)
        out[n] = (hi.astype(np.float64) + lo.astype(np.float64)) * np.float64(scale)
    return out


# --------------------------------------------------------------------------------------------
# the paged cache


def _copy_or_new(cache, shape, dtype):
    if cache is None:
        return np.zeros(shape, dtype=dtype)
    cache = np.array(cache, copy=True)
    assert cache.shape == tuple(shape) and cache.dtype == np.dtype(dtype), (cache.shape, cache.dtype, shape, dtype)
    return cache


def reshape_and_cache(
    key,
    value,
    slot_mapping,
    *,
    mode_name,
    num_blocks,
    block_size,
    rounding="nearest",
    k_scale=None,
    v_scale=None,
    key_cache=None,
    value_cache=None,
    k_scale_cache=None,
    v_scale_cache=None,
):
    """Write key/value [T, H, D] into copies of the caches; return the new caches.

    Returns (key_cache, value_cache, k_scale_cache, v_scale_cache). Code caches are uint8
    [NB, BS, H, D] (raw code bytes; for mode none they have the input's dtype), scale caches
    float32 [NB, BS, H] (None unless the mode is per-token-head). Caches not given start as
    zero bytes. A negative slot skips its token; non-negative slots must not repeat.
    """
    mode = _mode(mode_name)
    _check_rounding(mode, rounding)
    key, value = np.asarray(key), np.asarray(value)
    assert key.ndim == 3 and key.shape == value.shape and key.dtype == value.dtype
    T, H, D = key.shape
    slots = np.asarray(slot_mapping).astype(np.int64)
    assert slots.shape == (T,)
    written = slots[slots >= 0]
    assert len(np.unique(written)) == len(written), "non-negative slots must not repeat"
    assert np.all(written < num_blocks * block_size), "slot out of range"

    shape = (num_blocks, block_size, H, D)
    per_token_head = mode.granularity == "per_token_head"
    code_dtype = key.dtype if mode.granularity == "none" else np.uint8
    caches = [_copy_or_new(key_cache, shape, code_dtype), _copy_or_new(value_cache, shape, code_dtype)]
    scale_caches = [None, None]
    if per_token_head:
        scale_caches = [
            _copy_or_new(k_scale_cache, shape[:3], np.float32),
            _copy_or_new(v_scale_cache, shape[:3], np.float32),
        ]
    static = [None, None]
    if mode.granularity == "per_tensor":
        static = [_static_scale(k_scale), _static_scale(v_scale)]

    for src, cache, scale_cache, s in zip((key, value), caches, scale_caches, static):
        for t in range(T):
            slot = int(slots[t])
            if slot < 0:
                continue
            block, offset = divmod(slot, block_size)
            if mode.granularity == "none":
                cache[block, offset] = src[t]  # a plain copy keeps every bit (NaN payloads too)
                continue
            xf = widen_to_float32(src[t])
            for h in range(H):
                if per_token_head:
                    cache[block, offset, h], scale_cache[block, offset, h] = quantize_row(xf[h], mode, rounding)
                else:
                    cache[block, offset, h] = quantize_row_static(xf[h], mode, s)
    return caches[0], caches[1], scale_caches[0], scale_caches[1]


def decode_cache(codes_cache, scale_cache, mode_name, static_scale=None) -> np.ndarray:
    """Decode a whole cache [NB, BS, H, D] to float32 of the same shape."""
    mode = _mode(mode_name)
    codes_cache = np.asarray(codes_cache)
    if mode.granularity == "none":
        return widen_to_float32(codes_cache)
    NB, BS, H, D = codes_cache.shape
    if mode.granularity == "per_tensor":
        scales = np.full(NB * BS * H, _static_scale(static_scale), dtype=np.float32)
    else:
        scales = np.asarray(scale_cache, dtype=np.float32).reshape(-1)
    rows = decode_rows(codes_cache.reshape(-1, D), scales, mode_name)
    return rows.reshape(NB, BS, H, D)


def gather_dequantize(codes_cache, scale_cache, block_tables, seq_lens, mode_name, static_scale=None) -> np.ndarray:
    """Tokens of each sequence, in order, decoded: float32 [sum(seq_lens), H, D].

    Token i of sequence s lives in block block_tables[s, i // BS] at offset i % BS, and lands
    in output row sum(seq_lens[:s]) + i.
    """
    codes_cache = np.asarray(codes_cache)
    NB, BS, H, D = codes_cache.shape
    block_tables = np.asarray(block_tables)
    rows = []
    for s, n in enumerate(np.asarray(seq_lens).tolist()):
        for i in range(n):
            block = int(block_tables[s, i // BS])
            assert 0 <= block < NB, "block id out of range"
            codes = codes_cache[block, i % BS][None, None]  # a [1, 1, H, D] cache
            scales = None if scale_cache is None else np.asarray(scale_cache)[block, i % BS][None, None]
            rows.append(decode_cache(codes, scales, mode_name, static_scale)[0, 0])
    if not rows:
        return np.zeros((0, H, D), dtype=np.float32)
    return np.stack(rows).astype(np.float32)


# --------------------------------------------------------------------------------------------
# inline page layout


def pack_inline(key_codes, value_codes, k_scales, v_scales, row_bytes=None) -> np.ndarray:
    """The inline page buffer uint8 [NB, 2, BS, H, R] from separate caches (R = row_bytes,
    default D + 4; SPEC.md section 5's table).

    Row (block, kv, offset, head): D code bytes, then the row's float32 scale little-endian,
    then R - (D + 4) zero bytes of padding.
    """
    key_codes, value_codes = np.asarray(key_codes, np.uint8), np.asarray(value_codes, np.uint8)
    NB, BS, H, D = key_codes.shape
    R = D + 4 if row_bytes is None else int(row_bytes)
    if R != D + 4 and (R < D + 4 or R % 16):
        raise ValueError(f"row_bytes: expected {D + 4} or a multiple of 16 over it, got {R}")
    buf = np.zeros((NB, 2, BS, H, R), dtype=np.uint8)
    for kv, (codes, scales) in enumerate(((key_codes, k_scales), (value_codes, v_scales))):
        buf[:, kv, :, :, :D] = codes
        scale_bytes = np.asarray(scales, dtype="<f4").reshape(NB, BS, H, 1).view(np.uint8)
        buf[:, kv, :, :, D : D + 4] = scale_bytes
    return buf


def unpack_inline(buf, head_size=None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Inverse of pack_inline: (key_codes, value_codes, k_scales, v_scales), copies. head_size:
    D of a padded row (default: the row is D + 4 bytes)."""
    buf = np.asarray(buf, dtype=np.uint8)
    D = buf.shape[-1] - 4 if head_size is None else int(head_size)
    out = []
    for kv in range(2):
        out.append(buf[:, kv, :, :, :D].copy())
    for kv in range(2):
        out.append(np.ascontiguousarray(buf[:, kv, :, :, D : D + 4]).view("<f4")[..., 0].astype(np.float32))
    return out[0], out[1], out[2], out[3]


# --------------------------------------------------------------------------------------------
# attention in float64


# --------------------------------------------------------------------------------------------
# Attention's metadata as given, rules broken or not (SPEC.md section 11.1)


def attended_sequences(
    num_tokens, num_blocks, block_size, block_tables, seq_lens, query_start_loc, sliding_window=None
):
    """Per sequence s: (rows, q_len, seq_len, well_formed), read from the metadata as given
    (query_start_loc starting at 0 or above and non-decreasing: the rows are unspecified
    otherwise).

    rows: the query rows s owns, those of [qsl[s], qsl[s+1]) inside [0, num_tokens); q_len:
    qsl[s+1] - qsl[s] as given (the positions follow it, not the rows kept). well_formed: the
    sequence's metadata keeps SPEC.md section 8's rules where a kernel depends on them:
    q_len <= seq_len <= the span of its block-table row, and every entry covering positions
    [0, seq_len) lies in [0, num_blocks). An ill-formed sequence's rows are NaN.
    """
    block_tables = np.asarray(block_tables)
    max_blocks = block_tables.shape[1]
    qsl = [int(x) for x in np.asarray(query_start_loc).tolist()]
    result = []
    for s, seq_len in enumerate(int(x) for x in np.asarray(seq_lens).tolist()):
        begin, end = qsl[s], qsl[s + 1]
        rows = list(range(max(begin, 0), min(end, num_tokens)))
        q_len = end - begin
        well_formed = 0 <= q_len <= seq_len <= max_blocks * block_size
        if well_formed and rows:
            entries = block_tables[s, : -(-seq_len // block_size)]
            well_formed = bool(((entries >= 0) & (entries < num_blocks)).all())
        result.append((rows, q_len, seq_len, well_formed))
    return result


def attention_f64(
    query,
    k_deq,
    v_deq,
    block_tables,
    seq_lens,
    query_start_loc,
    *,
    softmax_scale=None,
    sliding_window=None,
    softcap=None,
    sinks=None,
    return_lse=False,
    fp8_probabilities=None,
    return_slack=False,
):
    """Paged causal attention over decoded caches, in float64: [T, Hq, D].

    query [T, Hq, D] (any float dtype, bfloat16 included); k_deq / v_deq [NB, BS, Hkv, D]
    decoded caches (e.g. decode_cache's output). return_lse=True returns (out, lse) with lse
    float64 [T, Hq]: log(sum_k exp(l_k) + exp(sink_h)) over the row's attended logits
    (SPEC.md section 8.2), computed as m + log(denominator) with the m of the softmax.
    fp8_probabilities=(tile, v_scales [NB, BS, Hkv]): the weights rounded to e4m3 per tile of
    `tile` key positions as fp8_dots defines it (SPEC.md 8.3), for an implementation whose tile
    is that one. With it, return_slack=True appends slack float64 [T, Hq, D] to the return: per
    output element, how far the weights' codes can move it in an implementation that computes
    the weights in float32 (a code may be a neighbour where float32's weight can fall on the
    other side of a rounding boundary; _float32_weight_rtol's error model, not a worst-case bound).
    """
    if return_slack and fp8_probabilities is None:
        raise ValueError("return_slack: defined with fp8_probabilities only")
    query = np.asarray(query)
    q = query.astype(np.float64) if query.dtype == np.float64 else widen_to_float32(query).astype(np.float64)
    k_deq = np.asarray(k_deq, dtype=np.float64)
    v_deq = np.asarray(v_deq, dtype=np.float64)
    T, Hq, D = q.shape
    BS, Hkv = k_deq.shape[1], k_deq.shape[2]
    assert Hq % Hkv == 0, "query heads must be a multiple of kv heads"
    group = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else float(softmax_scale)
    block_tables = np.asarray(block_tables)
    out = np.zeros((T, Hq, D), dtype=np.float64)
    lse = np.full((T, Hq), -np.inf, dtype=np.float64)  # a row with no term keeps log(0)
    slack = None if fp8_probabilities is None else np.zeros((T, Hq, D), dtype=np.float64)
    NB = k_deq.shape[0]

    sequences = attended_sequences(T, NB, BS, block_tables, seq_lens, query_start_loc, sliding_window)
    for s, (rows, q_len, seq_len, well_formed) in enumerate(sequences):
        if not well_formed:
            out[rows] = lse[rows] = np.nan
            continue
        if not rows:
            continue
        first_row = seq_len - q_len - int(np.asarray(query_start_loc)[s])  # position of row 0's token
        # The sequence's keys and values in position order.
        blocks = [int(block_tables[s, i // BS]) for i in range(seq_len)]
        keys = np.array([k_deq[blocks[i], i % BS] for i in range(seq_len)]).reshape(seq_len, Hkv, D)
        vals = np.array([v_deq[blocks[i], i % BS] for i in range(seq_len)]).reshape(seq_len, Hkv, D)
        if fp8_probabilities is not None:
            tile, v_scales = fp8_probabilities
            vsc = np.array([v_scales[blocks[i], i % BS] for i in range(seq_len)], np.float64).reshape(seq_len, Hkv)
        for t in rows:
            p = first_row + t
            lo = 0 if sliding_window is None else max(0, p - int(sliding_window) + 1)
            for h in range(Hq):
                kvh = h // group
                logits = scale * (keys[lo : p + 1, kvh] @ q[t, h])
                if fp8_probabilities is not None:
                    abs_terms = scale * (np.abs(keys[lo : p + 1, kvh]) @ np.abs(q[t, h]))
                    logit_error = _float32_logit_error(abs_terms, logits, softcap)
                if softcap is not None:
                    logits = softcap * np.tanh(logits / softcap)
                m = logits.max()
                if sinks is not None:
                    m = max(m, float(sinks[h]))
                weights = np.exp(logits - m)
                denominator = weights.sum()
                if sinks is not None:
                    denominator += math.exp(float(sinks[h]) - m)
                if fp8_probabilities is not None:
                    p_rtol = _float32_weight_rtol(logit_error, logits - m, weights)
                    # m is the largest logit or the sink (exact): it moves by the largest error.
                    shift_rtol = float(logit_error.max())
                    tiles = np.arange(lo, p + 1) // tile
                    weights, weight_slack = _fp8_weights(weights, vsc[lo : p + 1, kvh], tiles, p_rtol, shift_rtol)
                    slack[t, h] = (weight_slack @ np.abs(vals[lo : p + 1, kvh])) / denominator
                out[t, h] = (weights @ vals[lo : p + 1, kvh]) / denominator
                with np.errstate(all="ignore"):
                    lse[t, h] = m + np.log(denominator)
    result = (out,) + ((lse,) if return_lse else ()) + ((slack,) if return_slack else ())
    return result if len(result) > 1 else out


# --------------------------------------------------------------------------------------------
# int4 per-token-head (SPEC.md section 2's int4 rows). Its rows quantize by a rule of their own (a range
# and a zero point, after a rotation), so these functions stand beside ORACLE_MODES, with their
# own table of modes (INT4_MODES).

INT4_QMAX = 15
# The sign vector of the randomized Hadamard rotation for D <= 512: bit i set means sign -1 for
# element i. For a smaller D the signs are the first D of these (SPEC.md section 3.4).
INT4_RHT_SIGN_BITS_512 = int(
    "75625346365fdb8932d9dff1cfc7869167fc4ca6e46ae22557563834b291e3cc"
    "05dfbc5fcdf467b754503bbeb55b747e9480abc759bbc2937f7fca4e9a8ca6f2",
    16,
)
INT4_MAX_HEAD_SIZE = 512
INT4_MODES = ("int4_per_token_head", "int4_per_token_head_norot")

# Modes storing keys in one mode and values in another (SPEC.md section 2's per-side rows):
# name -> (the keys' mode, the values' mode). Each side is written, decoded and attended by its
# own mode's functions above; the query meets the keys as their mode stores them.
SPLIT_MODES = {
    "k_int8_v_int4": ("int8_per_token_head", "int4_per_token_head"),
    "k_int8_v_int4_norot": ("int8_per_token_head", "int4_per_token_head_norot"),
    "k_fp8_v_int4": ("fp8_per_token_head", "int4_per_token_head"),
    "k_fp8_v_int4_norot": ("fp8_per_token_head", "int4_per_token_head_norot"),
}


def _int4_check_head_size(D: int) -> None:
    if D < 2 or D > INT4_MAX_HEAD_SIZE or D % 2:
        raise ValueError(f"head_size must be even, in [2, {INT4_MAX_HEAD_SIZE}], got {D}")


def int4_rht_signs(D: int) -> np.ndarray:
    """The rotation's D signs as float32 +-1 (SPEC.md 3.4)."""
    _int4_check_head_size(D)
    return np.array([-1.0 if (INT4_RHT_SIGN_BITS_512 >> i) & 1 else 1.0 for i in range(D)], dtype=np.float32)


def int4_rht_blocks(D: int) -> list[tuple[int, int]]:
    """The rotation's Hadamard blocks (offset, size), SPEC.md 3.4: D's binary digits, largest
    block first (D = 96: (0, 64), (64, 32)); a power of two is one block."""
    blocks, offset = [], 0
    for bit in reversed(range(D.bit_length())):
        if (D >> bit) & 1:
            blocks.append((offset, 1 << bit))
            offset += 1 << bit
    return blocks


def int4_rht_block_sizes(D: int) -> np.ndarray:
    """The size of each element's block, float64 [D]: what the inverse divides element i by."""
    return np.concatenate([np.full(size, float(size)) for _, size in int4_rht_blocks(D)])


def int4_fwht(x: np.ndarray) -> np.ndarray:
    """The rotation's Walsh-Hadamard butterflies along the last axis (SPEC.md 3.4): each block of
    int4_rht_blocks transformed alone, unnormalized.

    In a block of size B, stage h = 1, 2, 4, ..., B/2: for every i with (i & h) == 0, (x[i], x[i+h])
    becomes (x[i] + x[i+h], x[i] - x[i+h]), one correctly rounded add / subtract each in the
    array's own dtype (float32 or float64). The operations of one stage are independent of each
    other, so only the stage order matters.
    """
    y = np.array(x, copy=True)
    for offset, size in int4_rht_blocks(y.shape[-1]):
        block = y[..., offset : offset + size].copy()
        h = 1
        while h < size:
            v = block.reshape(*block.shape[:-1], size // (2 * h), 2, h)
            a = v[..., 0, :].copy()
            b = v[..., 1, :].copy()
            with np.errstate(all="ignore"):
                v[..., 0, :] = a + b
                v[..., 1, :] = a - b
            h *= 2
        y[..., offset : offset + size] = block
    return y


def _round_f32_to_bf16_bits(xf: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even; NaN -> 0x7FC0 (sign kept)."""
    bits = np.ascontiguousarray(xf, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = np.isnan(xf)
    rounded = np.where(nan, ((bits >> 16) & 0x8000) | 0x7FC0, rounded)
    return rounded.astype(np.uint16)


def _narrow_like(yf: np.ndarray, dtype) -> np.ndarray:
    """Round float32 values to `dtype` (nearest even) and widen them back, exactly."""
    dtype = np.dtype(dtype)
    if dtype == np.float32:
        return yf.astype(np.float32, copy=True)
    if dtype == np.float16:
        with np.errstate(all="ignore"):
            return yf.astype(np.float16).astype(np.float32)  # IEEE RNE, overflow to +-Inf
    if dtype.name == "bfloat16":
        return (_round_f32_to_bf16_bits(yf).astype(np.uint32) << 16).view(np.float32)
    raise TypeError(f"input dtype must be bfloat16, float16 or float32, got {dtype}")


def int4_rotate(x: np.ndarray) -> np.ndarray:
    """Forward rotation of rows x[..., D] (SPEC.md 3.4): float32 [..., D].

    xf = widen(x); r = fwht(xf * signs) in float32; then r is rounded to x's dtype and widened
    back (bfloat16 / float16 inputs; a no-op for float32).
    """
    x = np.asarray(x)
    xf = widen_to_float32(x)
    D = xf.shape[-1]
    r = int4_fwht((xf * int4_rht_signs(D)).astype(np.float32))
    return _narrow_like(r, x.dtype)


def int4_unrotate(y: np.ndarray) -> np.ndarray:
    """Inverse rotation in float32: fl(fl(fwht(y) * signs) / B), B each element's block size
    (D for a power of two; SPEC.md 3.4)."""
    y = np.asarray(y, dtype=np.float32)
    D = y.shape[-1]
    with np.errstate(all="ignore"):
        blocks = int4_rht_block_sizes(D).astype(np.float32)
        return ((int4_fwht(y) * int4_rht_signs(D)).astype(np.float32) / blocks).astype(np.float32)


def int4_unrotate_f64(y: np.ndarray) -> np.ndarray:
    """Inverse rotation in float64, for references: signs * fwht(y) / B."""
    y = np.asarray(y, dtype=np.float64)
    D = y.shape[-1]
    with np.errstate(all="ignore"):
        return int4_fwht(y) * int4_rht_signs(D).astype(np.float64) / int4_rht_block_sizes(D)


def _int4_round(t: np.float32) -> int:
    """The rounding of SPEC.md 3.5: t < 0 -> 0; else trunc(fl(t + 0.5)), capped at 15."""
    if not t >= 0:  # negative (a NaN never reaches here)
        return 0
    if t >= INT4_QMAX:
        return INT4_QMAX
    return min(INT4_QMAX, int(np.float32(t + np.float32(0.5))))


def int4_quantize_row_f32(r: np.ndarray) -> tuple[np.ndarray, np.uint32]:
    """One float32 row (already rotated, or not: the 'norot' variant) -> (codes 0..15 [D], scale bits)."""
    r = np.asarray(r, dtype=np.float32)
    D = r.shape[0]
    if not np.all(np.isfinite(r)):
        return np.zeros(D, dtype=np.uint8), np.uint32(CANONICAL_NAN_BITS)
    mx = max(float(v) for v in r)
    mn = min(float(v) for v in r)
    hi = np.float32(mx) if mx > 0 else np.float32(0.0)
    lo = np.float32(mn) if mn < 0 else np.float32(0.0)
    with np.errstate(over="ignore"):
        rng = np.float32(hi - lo)
    if not np.isfinite(rng):
        return np.zeros(D, dtype=np.uint8), np.uint32(CANONICAL_NAN_BITS)
    q = np.float32(rng / np.float32(INT4_QMAX))
    scale = q if q > SCALE_FLOOR else SCALE_FLOOR
    zp = _int4_round(np.float32(-lo / scale))
    inv = np.float32(_ONE / scale)
    zpf = np.float32(zp)
    codes = np.empty(D, dtype=np.uint8)
    for i in range(D):
        y = np.float32(np.float32(r[i] * inv) + zpf)
        codes[i] = _int4_round(y)
    bits = (int(np.array([scale], dtype=np.float32).view(np.uint32)[0]) & 0xFFFFFFF0) | zp
    return codes, np.uint32(bits)


def int4_pack(codes: np.ndarray) -> np.ndarray:
    """codes [..., D] in 0..15 -> bytes [..., D/2]: byte j = code[2j] | code[2j+1] << 4."""
    codes = np.asarray(codes, dtype=np.uint8)
    return (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)


def int4_unpack(packed: np.ndarray) -> np.ndarray:
    """bytes [..., D/2] -> codes [..., D] (even element from the low nibble)."""
    packed = np.asarray(packed, dtype=np.uint8)
    codes = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],), dtype=np.uint8)
    codes[..., 0::2] = packed & 0xF
    codes[..., 1::2] = packed >> 4
    return codes


def int4_quantize_rows(x: np.ndarray, mode_name: str = "int4_per_token_head"):
    """Rows x[N, D] (bf16 / fp16 / fp32) -> (packed uint8 [N, D/2], scales float32 [N]).

    The scale's low 4 bits hold the zero point (SPEC.md 3.5, 3.6).
    """
    if mode_name not in INT4_MODES:
        raise ValueError(f"not an int4 mode: {mode_name!r}")
    x = np.asarray(x)
    N, D = x.shape
    _int4_check_head_size(D)
    r = int4_rotate(x) if mode_name == "int4_per_token_head" else widen_to_float32(x)
    codes = np.empty((N, D), dtype=np.uint8)
    bits = np.empty(N, dtype=np.uint32)
    for n in range(N):
        codes[n], bits[n] = int4_quantize_row_f32(r[n])
    return int4_pack(codes), bits.view(np.float32)


def int4_split_scale(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Stored float32 scales -> (scale with the low 4 bits cleared, float32; zero point, int)."""
    bits = np.ascontiguousarray(scales, dtype=np.float32).view(np.uint32)
    return (bits & np.uint32(0xFFFFFFF0)).view(np.float32), (bits & 0xF).astype(np.int64)


def int4_decode_rows(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Decode in the stored (rotated) domain: fl(float32(code - zp) * scale_t), float32 [..., D]."""
    codes = int4_unpack(packed).astype(np.int64)
    s, zp = int4_split_scale(np.asarray(scales, dtype=np.float32))
    with np.errstate(all="ignore"):
        return ((codes - zp[..., None]).astype(np.float32) * s[..., None]).astype(np.float32)


def int4_dequantize_rows_f64(packed, scales, mode_name: str = "int4_per_token_head") -> np.ndarray:
    """Decode and undo the rotation in float64: the rows' values in the model's basis."""
    d = int4_decode_rows(packed, scales).astype(np.float64)
    return int4_unrotate_f64(d) if mode_name == "int4_per_token_head" else d


def int4_reshape_and_cache(key, value, slot_mapping, *, num_blocks, block_size, mode_name: str = "int4_per_token_head"):
    """key/value [T, H, D] -> (key_cache, value_cache uint8 [NB, BS, H, D/2],
    k_scale_cache, v_scale_cache float32 [NB, BS, H]); unwritten bytes 0."""
    key, value = np.asarray(key), np.asarray(value)
    T, H, D = key.shape
    kc = np.zeros((num_blocks, block_size, H, D // 2), dtype=np.uint8)
    vc = np.zeros_like(kc)
    ks = np.zeros((num_blocks, block_size, H), dtype=np.float32)
    vs = np.zeros_like(ks)
    for t, slot in enumerate(np.asarray(slot_mapping).tolist()):
        if slot < 0:
            continue
        b, o = divmod(int(slot), block_size)
        kc[b, o], ks[b, o] = int4_quantize_rows(key[t], mode_name)
        vc[b, o], vs[b, o] = int4_quantize_rows(value[t], mode_name)
    return kc, vc, ks, vs


def int4_attention_f64(
    query,
    key_cache,
    value_cache,
    k_scale_cache,
    v_scale_cache,
    block_tables,
    seq_lens,
    query_start_loc,
    *,
    mode_name: str = "int4_per_token_head",
    softmax_scale=None,
    sliding_window=None,
    softcap=None,
    sinks=None,
):
    """Paged attention over int4 caches (SPEC.md 8.4), in float64, the way kernels compute it.

    The query is rotated (float64 butterfly of its float32 value, each element over its block's
    size B), the logits are taken on the codes with the sum(q)*zp correction, softmax_scale and
    the key scale folded after the dot; values are accumulated as p * v_scale * (code - zp); the
    output is un-rotated (signs * fwht(o) / B). Masking, sinks and softcap are those of SPEC.md section 8.
    """
    rotate = mode_name == "int4_per_token_head"
    query = np.asarray(query)
    q = widen_to_float32(query).astype(np.float64)
    T, Hq, D = q.shape
    _int4_check_head_size(D)
    signs = int4_rht_signs(D).astype(np.float64)
    # q . R^-1 y = (B^-1 R q) . y: each rotated element over its block's size (SPEC.md 8.4).
    qr = int4_fwht(q * signs) / int4_rht_block_sizes(D) if rotate else q
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else float(softmax_scale)
    kcodes = int4_unpack(key_cache).astype(np.float64)
    vcodes = int4_unpack(value_cache).astype(np.float64)
    ks, kzp = int4_split_scale(k_scale_cache)
    vs, vzp = int4_split_scale(v_scale_cache)
    BS, Hkv = kcodes.shape[1], kcodes.shape[2]
    group = Hq // Hkv
    block_tables = np.asarray(block_tables)
    out = np.zeros((T, Hq, D), dtype=np.float64)
    sequences = attended_sequences(T, kcodes.shape[0], BS, block_tables, seq_lens, query_start_loc, sliding_window)
    for s, (rows, q_len, seq_len, well_formed) in enumerate(sequences):
        if not well_formed:
            out[rows] = np.nan
            continue
        first_row = seq_len - q_len - int(np.asarray(query_start_loc)[s])
        where = [(int(block_tables[s, i // BS]), i % BS) for i in range(seq_len)]
        for t in rows:
            p = first_row + t
            lo = 0 if sliding_window is None else max(0, p - int(sliding_window) + 1)
            idx = where[lo : p + 1]
            for h in range(Hq):
                kvh = h // group
                c = np.array([kcodes[b, o, kvh] for b, o in idx])
                zk = np.array([float(kzp[b, o, kvh]) for b, o in idx])
                sk = np.array([float(ks[b, o, kvh]) for b, o in idx])
                with np.errstate(all="ignore"):
                    logits = (c @ qr[t, h] - qr[t, h].sum() * zk) * (scale * sk)
                    if softcap is not None:
                        logits = softcap * np.tanh(logits / softcap)
                    m = logits.max()
                    if sinks is not None:
                        m = max(m, float(sinks[h]))
                    w = np.exp(logits - m)
                    den = w.sum() + (math.exp(float(sinks[h]) - m) if sinks is not None else 0.0)
                    pv = w * np.array([float(vs[b, o, kvh]) for b, o in idx])
                    vc = np.array([vcodes[b, o, kvh] for b, o in idx])
                    zv = np.array([float(vzp[b, o, kvh]) for b, o in idx])
                    o_rot = (pv @ vc - (pv * zv).sum()) / den
                    out[t, h] = int4_unrotate_f64(o_rot) if rotate else o_rot
    return out
