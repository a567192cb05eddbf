"""Vectorized NumPy implementation of every kvzoo operation (registered as impl "numpy").

Runs anywhere NumPy does; the conformance suite holds it against kvzoo_spec/oracle.py, which
is written independently. Encoding constants arrive as arguments (`Codec`); arrays are NumPy
views of the caller's storage: writes land there.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ...formats import CodeFormat
from ...modes import FP8_DOTS_WEIGHT_FLOOR, FP8_DOTS_WEIGHT_UNIT, rht_block_sizes, rht_blocks, rht_signs

_CANONICAL_NAN = np.array(0x7FC00000, dtype=np.uint32).view(np.float32)
# Query rows per attention chunk: bounds the [heads, rows, keys] score matrix in memory.
_QUERY_CHUNK = 128
# Key positions per tile of fp8_dots' probability scales (SPEC.md 8.3 leaves the tile to each
# implementation, 16 to 256 keys): Triton's prefill tiles hold 64 or 128.
PROBABILITY_TILE = 64


@dataclass(frozen=True)
class Codec:
    """How rows are encoded: granularity "none" | "per_tensor" | "per_token_head"."""

    granularity: str
    format: CodeFormat | None = None
    scale_floor: float = 1e-6
    rounding: str = "nearest"
    # "rht": rows are rotated before quantizing, queries at attention, outputs un-rotated.
    rotation: str | None = None

    @property
    def code_format(self) -> CodeFormat:
        """The format, for the paths that encode or decode (granularity "none" never does)."""
        if self.format is None:
            raise ValueError(f"a codec of granularity {self.granularity!r} has no code format")
        return self.format


def _widen(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32)


def encode(y: np.ndarray, codec: Codec) -> np.ndarray:
    """fp32 values (already divided by the scale) -> code bytes (uint8), clamping semantics."""
    fmt = codec.code_format
    finite = np.isfinite(y)
    with np.errstate(invalid="ignore"):
        clamped = np.clip(np.where(finite, y, 0), np.float32(fmt.qmin), np.float32(fmt.qmax))
    codes = ENCODERS[fmt.name](clamped, codec.rounding)
    inf_pos, inf_neg = (np.uint8(c) for c in fmt.inf_codes)
    special = np.where(np.isnan(y), np.uint8(fmt.nan_code), np.where(y > 0, inf_pos, inf_neg))
    return np.where(finite, codes, special)


def _encode_int8(clamped: np.ndarray, rounding: str) -> np.ndarray:
    integral = np.rint(clamped) if rounding == "nearest" else np.trunc(clamped)
    return integral.astype(np.int8).view(np.uint8)


def _encode_uint4(clamped: np.ndarray, rounding: str) -> np.ndarray:
    # SPEC.md 3.5: round half up through one float32 add (vLLM's (v + 0.5).to(int32)), so
    # 0.5 - 2**-25 gives 1; the clamp to [0, 15] came first, so the result is a code.
    return np.trunc(clamped + np.float32(0.5)).astype(np.uint8)


@functools.cache
def _ml_dtype(name: str) -> type:
    """The ml_dtypes type `name`: ml_dtypes is imported on a first encode, not by registering
    this backend (which `kvzoo list` does; the import takes most of a second on some machines)."""
    import ml_dtypes

    return getattr(ml_dtypes, name)


def _minifloat_encoder(storage: str):
    # ml_dtypes' cast rounds to nearest, ties to even: SPEC.md's rounding of the fp8 formats.
    def encode(clamped: np.ndarray, rounding: str) -> np.ndarray:
        return clamped.astype(_ml_dtype(storage)).view(np.uint8)

    encode.__name__ = f"_cast_to_{storage}"
    return encode


# The formats this backend encodes (kvzoo.formats.FORMATS names): its table, read by the
# registration, so a format missing here is a mode the backend declines.
ENCODERS = {
    "int8": _encode_int8,
    "float8_e4m3fn": _minifloat_encoder("float8_e4m3fn"),
    "float8_e4m3fnuz": _minifloat_encoder("float8_e4m3fnuz"),
    "float8_e5m2": _minifloat_encoder("float8_e5m2"),
    "uint4": _encode_uint4,
}


def _fwht(u: np.ndarray) -> np.ndarray:
    """The unnormalized Walsh-Hadamard butterflies of SPEC.md 3.4 along the last axis, in u's
    dtype: each block of rht_blocks alone, stage h = 1, 2, ..., n/2 turning each pair
    (u[i], u[i + h]), i & h == 0 in the block, into their sum and difference."""
    blocks = rht_blocks(u.shape[-1])
    parts = []
    with np.errstate(over="ignore", invalid="ignore"):
        for offset, n in blocks:
            v = u[..., offset : offset + n]
            h = 1
            while h < n:
                pairs = v.reshape(*v.shape[:-1], n // (2 * h), 2, h)
                low, high = pairs[..., 0, :], pairs[..., 1, :]
                v = np.stack((low + high, low - high), axis=-2).reshape(v.shape)
                h *= 2
            parts.append(v)
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-1)


def rotate_rows(xf: np.ndarray, input_dtype: np.dtype) -> np.ndarray:
    """SPEC.md 3.4's forward rotation of float32 rows: signs, butterfly, then rounded to the
    rows' input dtype and widened back (vLLM's single_rht(x.float()).to(x.dtype))."""
    rotated = _fwht(xf * rht_signs(xf.shape[-1]))
    if input_dtype == np.float32:
        return rotated
    with np.errstate(over="ignore", invalid="ignore"):
        return rotated.astype(input_dtype).astype(np.float32)


def unrotate_rows(y: np.ndarray) -> np.ndarray:
    """SPEC.md 3.4's inverse in float32: butterfly, signs, then / B, each element's block size
    (exact but for subnormals)."""
    d = y.shape[-1]
    with np.errstate(over="ignore", invalid="ignore"):
        return _fwht(y) * rht_signs(d) / rht_block_sizes(d)


def _scaled_rows(xf: np.ndarray, codec: Codec) -> tuple[np.ndarray, np.ndarray]:
    """(y, scales): SPEC.md section 3's steps 2-5 per row (last axis), y = xf * inv before its
    encoding; a NaN row's scale canonical."""
    with np.errstate(all="ignore"):
        absmax = np.max(np.abs(xf), axis=-1)  # NaN propagates, as the spec requires
        scale = np.maximum(absmax / np.float32(codec.code_format.qmax), np.float32(codec.scale_floor))
        inv = np.float32(1.0) / scale
        y = xf * inv[..., None]
    return y, np.where(np.isnan(scale), _CANONICAL_NAN, scale)


def quantize_rows(xf: np.ndarray, codec: Codec) -> tuple[np.ndarray, np.ndarray]:
    """Per-row (last axis) absmax quantization: returns (codes uint8, scales float32)."""
    if codec.code_format.row_zero_point:
        return _quantize_rows_with_zero_point(xf, codec)
    y, scale = _scaled_rows(xf, codec)
    return encode(y, codec), scale


def _quantize_rows_with_zero_point(r: np.ndarray, codec: Codec) -> tuple[np.ndarray, np.ndarray]:
    """SPEC.md 3.5 on (already rotated) float32 rows: the range [min(r, 0), max(r, 0)] over
    qmax - qmin steps, the zero point encoded like a code, codes of fl(fl(r * inv) + zp).
    Returns (packed storage bytes, scale words holding the zero points); a row holding NaN or
    Inf, or whose range overflows, gets codes 0 and the canonical NaN word."""
    fmt = codec.code_format
    with np.errstate(all="ignore"):
        hi = np.maximum(r.max(axis=-1), np.float32(0))
        lo = np.minimum(r.min(axis=-1), np.float32(0))
        span = hi - lo
        poisoned = ~(np.isfinite(r).all(axis=-1) & np.isfinite(span))
        q = span / np.float32(fmt.qmax - fmt.qmin)
        scale = np.where(q > np.float32(codec.scale_floor), q, np.float32(codec.scale_floor))
        zero_point = encode(-lo / scale, codec)
        inv = np.float32(1.0) / scale
        # Two roundings, never one fused multiply-add (SPEC.md section 1).
        y = r * inv[..., None] + zero_point[..., None].astype(np.float32)
        codes = encode(y, codec)
    codes[poisoned] = fmt.nan_code
    words = np.where(poisoned, _CANONICAL_NAN, fmt.scale_words(scale, zero_point))
    return fmt.pack(codes), words


def quantize_static(xf: np.ndarray, scale: np.float32, codec: Codec) -> np.ndarray:
    with np.errstate(all="ignore"):
        return encode(xf / np.float32(scale), codec)


def reshape_and_cache(p, codecs: tuple[Codec, Codec]) -> None:
    """Run a checked CacheWrite record (NumPy arrays) with the codecs of its key and value rows."""
    block_size = p.key_cache.shape[1]
    slots = p.slot_mapping.astype(np.int64)
    # Out-of-range slots only reach here with validation off: skipped, like negative ones.
    keep = (slots >= 0) & (slots < p.key_cache.shape[0] * block_size)
    block, offset = np.divmod(slots[keep], block_size)
    for codec, rows, cache, scale_cache, static in zip(
        codecs,
        (p.key, p.value),
        (p.key_cache, p.value_cache),
        (p.k_scale_cache, p.v_scale_cache),
        (p.k_scale, p.v_scale),
        strict=True,
    ):
        rows = rows[keep]
        if codec.granularity == "none":
            cache[block, offset] = rows
            continue
        xf = _widen(rows)
        if codec.rotation is not None:
            xf = rotate_rows(xf, rows.dtype)
        if codec.granularity == "per_tensor":
            if static is None:
                raise ValueError("a per_tensor codec needs k_scale and v_scale")
            codes = quantize_static(xf, np.float32(static.reshape(-1)[0]), codec)
        else:
            if scale_cache is None:
                raise ValueError("a per_token_head codec needs k_scale_cache and v_scale_cache")
            codes, scales = quantize_rows(xf, codec)
            scale_cache[block, offset] = scales
        cache.view(np.uint8)[block, offset] = codes


def _decode_table(fmt: CodeFormat) -> np.ndarray:
    """float32 value of each code byte (the format's own table: exact in float32)."""
    return fmt.code_values().astype(np.float32)


def decode(codes: np.ndarray, scales: np.ndarray | np.float32, codec: Codec) -> np.ndarray:
    """codes (cache dtype) and per-row scales ([...]) or a scalar -> float32, in the model's
    basis (a rotated mode's rows un-rotated, SPEC.md 3.5)."""
    if codec.granularity == "none":
        return _widen(codes)
    fmt = codec.code_format
    if fmt.row_zero_point:
        values, scale, zero_point = _split_rows(codes, np.asarray(scales), fmt)
        with np.errstate(invalid="ignore", over="ignore"):
            stored = (values - zero_point[..., None]) * scale[..., None]
        return stored if codec.rotation is None else unrotate_rows(stored)
    values = _decode_table(fmt)[codes.view(np.uint8)]
    with np.errstate(invalid="ignore", over="ignore"):
        if np.ndim(scales) == 0:
            return values * np.float32(scales)
        return values * np.asarray(scales)[..., None]


def _split_rows(stored: np.ndarray, words: np.ndarray, fmt: CodeFormat):
    """Packed rows and their scale words as (codes float32 [..., D], scale float32 [...],
    zero point float32 [...]): every value exact."""
    scale, zero_point = fmt.split_scale_words(words)
    return fmt.unpack(stored).astype(np.float32), scale, zero_point.astype(np.float32)


def _token_locations(block_tables, seq_lens, block_size):
    """(block, offset, sequence) of every token of every sequence, in sequence order."""
    seq_lens = seq_lens.astype(np.int64)
    seq_of = np.repeat(np.arange(len(seq_lens)), seq_lens)
    starts = np.concatenate([[0], np.cumsum(seq_lens)[:-1]]).astype(np.int64)
    pos = np.arange(int(seq_lens.sum()), dtype=np.int64) - starts[seq_of]
    block = block_tables[seq_of, pos // block_size].astype(np.int64)
    return block, pos % block_size, seq_of


def _gather_decoded(cache, scale_cache, static, block_tables, seq_lens, codec):
    block, offset, _ = _token_locations(block_tables, seq_lens, cache.shape[1])
    codes = cache[block, offset]
    if codec.granularity == "per_token_head":
        return decode(codes, scale_cache[block, offset], codec)
    if codec.granularity == "per_tensor":
        return decode(codes, np.float32(static.reshape(-1)[0]), codec)
    return decode(codes, None, codec)


def dequantize(p, codec: Codec) -> None:
    """Run a checked Dequantize record (NumPy arrays) with the mode's codec."""
    p.out[...] = _gather_decoded(p.cache, p.scale_cache, p.scale, p.block_tables, p.seq_lens, codec)


# Power-of-two row factors (_unit_rows): the largest exponent whose factor and undo are both
# normal float32.
_MAX_FACTOR_EXPONENT = 126


def _unit_rows(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(q * 2^k, 2^-k) per row (last axis), k chosen from the row's absmax so that the scaled
    row's absmax lies in [0.5, 1) (rows below 2^-126, subnormal ones included, stop at 2^126).
    Exact: a scaled element is rounded only where it falls below float32's normals, at 2^-125
    of the row's absmax or less. Zero rows give k = 0; NaN and Inf stay."""
    _, expo = np.frexp(np.max(np.abs(q), axis=-1, keepdims=True))
    k = np.clip(-expo, -_MAX_FACTOR_EXPONENT, _MAX_FACTOR_EXPONENT)
    return np.ldexp(q, k), np.ldexp(np.float32(1.0), -k)


def _logit_operands(q, k_scales, sm_scale, codec):
    """(query operand, scales) whose q . codes times the scales are the logits, for query rows
    q [Hkv, rows, D] and key scales k_scales [Hkv, 1, L].

    q . codes grows with the query row while the codes' size is fixed (1e36 x 127 x D
    overflows float32 before the key scale could bring it back), so each row is scaled to an
    absmax near 1 by a power of two (exact) and softmax_scale is folded into it; the row's undo
    meets the key scale first, as the logit's own scale, in range wherever the logit is (SPEC.md
    section 11). Mode none keeps q: there q . k is the logit over softmax_scale."""
    if codec.granularity == "none":
        return q, sm_scale
    q, undo = _unit_rows(q)
    if codec.rotation is not None:
        # q . R^-1 y = (R q / B) . y (SPEC.md 8.4); each B a power of two, so / B is exact.
        d = q.shape[-1]
        return _fwht(q * rht_signs(d)) * (sm_scale / rht_block_sizes(d)), undo * k_scales
    return q * sm_scale, undo * k_scales


_WEIGHT_UNIT, _WEIGHT_FLOOR = np.float32(FP8_DOTS_WEIGHT_UNIT), np.float32(FP8_DOTS_WEIGHT_FLOOR)


def fp8_query_terms(q: np.ndarray, codec: Codec) -> np.ndarray:
    """Query rows [..., D] (float32) as fp8_dots attends with them (SPEC.md section 8.3):
    (hi + lo) * scale, hi the codes of the row under `codec` (the e4m3fn per-token-head rule,
    section 3), lo the e4m3 rounding of y - hi, y = q * inv of section 3."""
    y, scale = _scaled_rows(q, codec)
    one = np.float32(1.0)
    with np.errstate(all="ignore"):
        hi = decode(encode(y, codec), one, codec)
        lo = decode(encode(y - hi, codec), one, codec)
        return (hi + lo) * scale[..., None]


def e4m3_weights(weights: np.ndarray, tile: int) -> np.ndarray:
    """weights [..., L] (p_k times the key's V scale, hidden keys 0) as the fp8 P . V operand
    decodes them: per row and tile of `tile` positions, w = max(largest, 2^-100), and
    each weight becomes e4m3(weight / w * 256) * (w / 256)."""
    length = weights.shape[-1]
    tiles = -(-length // tile)
    padded = np.zeros(weights.shape[:-1] + (tiles * tile,), np.float32)
    padded[..., :length] = weights
    padded = padded.reshape(weights.shape[:-1] + (tiles, tile))
    w = np.maximum(padded.max(axis=-1, keepdims=True), _WEIGHT_FLOOR)
    codes = (padded * (np.float32(1.0) / w) * _WEIGHT_UNIT).astype(_ml_dtype("float8_e4m3fn"))
    deq = codes.astype(np.float32) * (w / _WEIGHT_UNIT)
    return deq.reshape(weights.shape[:-1] + (tiles * tile,))[..., :length]


def _well_formed(block_row, seq_len: int, q_len: int, num_blocks: int, block_size: int) -> bool:
    """Whether a sequence's metadata keeps the rules attention reads it by (SPEC.md 11.1)."""
    if not 0 <= q_len <= seq_len <= block_row.shape[0] * block_size:
        return False
    entries = block_row[: -(-seq_len // block_size)]
    return bool(((entries >= 0) & (entries < num_blocks)).all())


def _sequence_kv(cache, scale_cache, static, block_row, seq_len, codec):
    """Codes [L, H, D] as float32, per-key scales [L, H] (ones when not per-token-head) and
    per-key zero points [L, H] (None for formats without them)."""
    block_size = cache.shape[1]
    pos = np.arange(seq_len)
    block = block_row[pos // block_size].astype(np.int64)
    offset = pos % block_size
    raw = cache[block, offset]
    if codec.granularity == "none":
        return _widen(raw), np.ones(raw.shape[:2], np.float32), None
    if codec.format.row_zero_point:
        return _split_rows(raw, scale_cache[block, offset], codec.format)
    values = _decode_table(codec.format)[raw.view(np.uint8)]
    if codec.granularity == "per_tensor":
        return values, np.full(raw.shape[:2], np.float32(static.reshape(-1)[0])), None
    return values, scale_cache[block, offset].astype(np.float32), None


def paged_attention(p, codecs: tuple[Codec, Codec], query_codec: Codec | None = None) -> None:
    """fp32 attention with dot products on the codes and scales applied per key, for a checked
    Attention record p (NumPy arrays) whose key and value rows codecs encoded.

    query_codec: quantize each query row (token, head) with it and attend with the decoded
    rows instead (the quantize_query option). p.lse: float32 [T, Hq] to receive
    each row's log-sum-exp (row max + log of the softmax denominator, the sink's term
    included). fp8_dots (SPEC.md section 8.3; query_codec the cache's): the query rows as two
    e4m3 terms, each row's weights rounded to e4m3 per tile of PROBABILITY_TILE positions.
    """
    query, key_cache, value_cache, block_tables, seq_lens, out, lse = (
        p.query, p.key_cache, p.value_cache, p.block_tables, p.seq_lens, p.out, p.lse,
    )  # fmt: skip
    fp8_dots, sliding_window, softcap = p.fp8_dots, p.sliding_window, p.softcap
    if fp8_dots and query_codec is None:
        raise ValueError("fp8_dots needs query_codec (the cache's codec)")
    key_codec, value_codec = codecs
    num_tokens, num_q_heads = query.shape[:2]
    num_blocks, block_size, num_kv_heads = key_cache.shape[:3]
    group = num_q_heads // num_kv_heads
    sm_scale = np.float32(p.softmax_scale)
    sink = None if p.sinks is None else p.sinks.astype(np.float32).reshape(num_kv_heads, group, 1)
    for s in range(len(seq_lens)):
        # SPEC.md 11.1: the metadata as given, whatever it holds; rows outside the query are
        # neither read nor written, and an ill-formed sequence's rows are NaN.
        q_start, q_end = int(p.query_start_loc[s]), int(p.query_start_loc[s + 1])
        first, last = max(q_start, 0), min(q_end, num_tokens)
        if first >= last:
            continue
        seq_len = int(seq_lens[s])
        if not _well_formed(block_tables[s], seq_len, q_end - q_start, num_blocks, block_size):
            out[first:last] = np.nan
            if lse is not None:
                lse[first:last] = np.nan
            continue
        k_codes, k_scales, k_zero = _sequence_kv(
            key_cache, p.k_scale_cache, p.k_scale, block_tables[s], seq_len, key_codec
        )
        v_codes, v_scales, v_zero = _sequence_kv(
            value_cache, p.v_scale_cache, p.v_scale, block_tables[s], seq_len, value_codec
        )
        # [Hkv, L, D] and [Hkv, 1, L] so each KV head serves its whole query group at once.
        k_codes = k_codes.transpose(1, 2, 0)
        v_codes = v_codes.transpose(1, 0, 2)
        k_scales = k_scales.T[:, None, :]
        v_scales = v_scales.T[:, None, :]
        if k_zero is not None:
            k_zero = k_zero.T[:, None, :]
        if v_zero is not None:
            v_zero = v_zero.T[:, None, :]
        key_pos = np.arange(seq_len)
        for c0 in range(first, last, _QUERY_CHUNK):
            c1 = min(c0 + _QUERY_CHUNK, last)
            q = _widen(query[c0:c1])
            if query_codec is not None:
                q = fp8_query_terms(q, query_codec) if fp8_dots else decode(*quantize_rows(q, query_codec), query_codec)
            q = q.reshape(c1 - c0, num_kv_heads, group, -1).transpose(1, 0, 2, 3)
            q = q.reshape(num_kv_heads, (c1 - c0) * group, -1)
            q_pos = np.repeat(seq_len - (q_end - q_start) + np.arange(c0 - q_start, c1 - q_start), group)
            visible = key_pos[None, :] <= q_pos[:, None]
            if sliding_window is not None:
                visible &= key_pos[None, :] > q_pos[:, None] - sliding_window
            with np.errstate(all="ignore"):
                q, logit_scales = _logit_operands(q, k_scales, sm_scale, key_codec)
                logits = np.matmul(q, k_codes)
                if k_zero is not None:
                    # q . (codes - zp) = q . codes - sum(q) * zp (SPEC.md 8.4)
                    logits = logits - q.sum(axis=-1, keepdims=True) * k_zero
                logits = logits * logit_scales
                if softcap is not None:
                    logits = np.float32(softcap) * np.tanh(logits / np.float32(softcap))
                logits = np.where(visible[None], logits, -np.inf)
                row_max = logits.max(axis=-1, keepdims=True)
                if sink is not None:
                    row_sink = np.tile(sink, (1, c1 - c0, 1))
                    row_max = np.maximum(row_max, row_sink)
                probs = np.exp(logits - row_max)
                denom = probs.sum(axis=-1, keepdims=True)
                if sink is not None:
                    denom = denom + np.exp(row_sink - row_max)
                weights = probs * v_scales
                if fp8_dots:
                    weights = e4m3_weights(weights, PROBABILITY_TILE)
                acc = np.matmul(weights, v_codes)
                if v_zero is not None:
                    acc = acc - (weights * v_zero).sum(axis=-1, keepdims=True)
                acc = acc / denom
                if value_codec.rotation is not None:
                    acc = unrotate_rows(acc)
            acc = acc.reshape(num_kv_heads, c1 - c0, group, -1).transpose(1, 0, 2, 3)
            out[c0:c1] = acc.reshape(c1 - c0, num_q_heads, -1).astype(out.dtype)
            if lse is not None:
                with np.errstate(divide="ignore", invalid="ignore"):
                    # A row with no term has max -inf and sum 0: -inf + log(0) = -inf, as defined.
                    row_lse = (row_max + np.log(denom))[..., 0]
                row_lse = row_lse.reshape(num_kv_heads, c1 - c0, group).transpose(1, 0, 2)
                lse[c0:c1] = row_lse.reshape(c1 - c0, num_q_heads)
