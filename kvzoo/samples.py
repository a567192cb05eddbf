"""Random paged problems, built in one place: attention samples, write samples, the oracle's answer.

The conformance suite, the backend tests and bench/ all draw their inputs here, so what "a
random paged batch" means (scattered pages, realistic codes, sequences ending mid-block) is
decided once. Every draw comes from the NumPy Generator the caller passes: seed it with
kvzoo.inputs.rng_for, which derives it from the session seed, and a failure replays
with KVZOO_SEED. The only torch generator (fill="torch", for caches too big to draw on the host)
is seeded from that Generator too.

    >>> from kvzoo.inputs import rng_for
    >>> s = paged_sample(rng_for("doc"), "int8_per_token_head", batch="decode", num_q_heads=4,
    ...                  num_kv_heads=2, head_size=16, block_size=4)
    >>> ref = s.reference()                    # float64 oracle on the same quantized cache
    >>> tuple(ref.shape) == tuple(s.query.shape)
    True
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from kvzoo_spec import oracle

from .arrays import as_numpy, as_torch, is_torch, numpy_dtype, torch_dtype
from .inputs import SEED, assert_same_bytes, make_rows, random_bytes, tensor
from .layout import (
    SCALE_BYTES,
    KVCacheTensors,
    RowAlign,
    allocate_inline,
    allocate_separate,
    inline_row_bytes,
    inline_views,
)
from .modes import QuantMode, get_kv_quant_mode

if TYPE_CHECKING:
    from .problem import Attention

Kind = Literal["torch", "numpy"]
Size = Literal["medium", "small"]
Fill = Literal["host", "torch"]

BATCH_KINDS = ("decode", "prefill", "mixed", "long")
# The output dtype's own rounding, allowed on top of an implementation's attention_rtol.
OUT_ROUNDOFF = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 0.0}
# SPEC.md 8.1: quantize_query replaces each query row by its int8 per-token-head round trip
# (fp8_dots by its two e4m3 terms, 8.3: oracle.fp8_dots_query).
QUERY_ROUND_TRIP_MODE = "int8_per_token_head"
# SPEC.md 8.3: fp8_dots' reference keeps the probabilities exact; their e4m3 rounding (3
# mantissa bits, so up to 2^-4 relative per weight) is allowed on top of attention_rtol.
FP8_DOTS_RTOL = 3e-2


# ---------------------------------------------------------------------------------------------
# batches


@dataclass
class Batch:
    """A varlen batch on the host: lengths and scattered block tables (int64)."""

    q_lens: np.ndarray
    seq_lens: np.ndarray
    tables: np.ndarray  # [S, max_blocks]; entries past a sequence's blocks hold other valid ids
    num_blocks: int
    block_size: int

    @property
    def qsl(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.q_lens)]).astype(np.int64)

    @property
    def num_tokens(self) -> int:
        return int(self.q_lens.sum())

    @property
    def max_query_len(self) -> int:
        return int(self.q_lens.max(initial=0))

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens.max(initial=0))

    @property
    def num_prefills(self) -> int:
        return int((self.q_lens > 1).sum())


# (exclusive upper bound of a sequence's length, number of sequences) of the uniform batch kinds,
# keyed by whether the size is "small".
_UNIFORM_LENS = {False: {"decode": (70, 4), "prefill": (40, 3)}, True: {"decode": (14, 3), "prefill": (10, 2)}}


def draw_lens(rng: np.random.Generator, batch: str = "mixed", size: Size = "medium") -> tuple[np.ndarray, np.ndarray]:
    """(q_lens, seq_lens) int64 of a batch kind; some sequences end mid-block.

    "medium" is the conformance suite's; "small" keeps pages few for the guarded battery, whose
    every case compares whole buffers byte by byte (no "long" there)."""
    if batch in ("decode", "prefill"):
        # n sequences of 1 to high - 1 tokens: decode one query token each, prefill all of them.
        high, n = _UNIFORM_LENS[size == "small"][batch]
        seq_lens = rng.integers(1, high, n)
        q_lens = np.ones(n, np.int64) if batch == "decode" else seq_lens.copy()
    elif size == "small":
        if batch != "mixed":
            raise ValueError(f"batch {batch!r}: small batches are decode, prefill or mixed")
        seq_lens = np.array([rng.integers(1, 12), rng.integers(6, 14), rng.integers(1, 8)])
        q_lens = np.array([1, rng.integers(2, 5), seq_lens[2]])
    elif batch == "long":
        # Prompt-sized query runs (an implementation may take another path for them, as the
        # Triton backend's staged prefill does), next to a decode.
        seq_lens = np.array([rng.integers(128, 150), rng.integers(150, 200), rng.integers(1, 70)])
        q_lens = np.array([seq_lens[0], rng.integers(128, 140), 1])
    elif batch == "mixed":  # two decodes, a prefill chunk on top of earlier context, a fresh prefill
        seq_lens = np.array([rng.integers(1, 70), rng.integers(20, 50), rng.integers(1, 30), rng.integers(2, 60)])
        q_lens = np.array([1, rng.integers(5, 13), seq_lens[2], 1])
    else:
        raise ValueError(f"batch {batch!r}: expected one of {BATCH_KINDS}")
    return q_lens.astype(np.int64), seq_lens.astype(np.int64)


def scattered_tables(
    rng: np.random.Generator,
    seq_lens: Any,
    block_size: int,
    *,
    spare_blocks: int = 3,
    spare_columns: int = 1,
    num_blocks: int | None = None,
) -> tuple[np.ndarray, int]:
    """(block tables int64 [S, max_blocks], num_blocks): each sequence's pages are a slice of one
    random permutation of the blocks, so no two sequences share a page and consecutive pages
    are rarely neighbours. Entries past a sequence's last page hold random valid ids: a kernel
    that reads them gets plausible wrong pages, not an out-of-range fault."""
    seq_lens = np.asarray(seq_lens, np.int64)
    blocks = -(-seq_lens // block_size)
    needed = int(blocks.sum())
    if num_blocks is None:
        num_blocks = needed + spare_blocks
    if num_blocks < needed:
        raise ValueError(f"num_blocks {num_blocks} < the {needed} blocks the sequences fill")
    max_blocks = max(1, int(blocks.max(initial=0)) + spare_columns)
    order = rng.permutation(num_blocks)
    tables = rng.integers(0, max(1, num_blocks), (len(seq_lens), max_blocks))
    start = 0
    for s, n in enumerate(blocks):
        tables[s, :n] = order[start : start + n]
        start += n
    return tables.astype(np.int64), num_blocks


def draw_batch(
    rng: np.random.Generator,
    batch: str = "mixed",
    *,
    block_size: int = 16,
    size: Size = "medium",
    q_lens: Any = None,
    seq_lens: Any = None,
    spare_blocks: int = 3,
    spare_columns: int = 1,
    num_blocks: int | None = None,
) -> Batch:
    """Lengths (given, or drawn by batch kind) and scattered tables."""
    if (q_lens is None) != (seq_lens is None):
        raise ValueError("give both q_lens and seq_lens, or neither")
    if q_lens is None:
        q_lens, seq_lens = draw_lens(rng, batch, size)
    q_lens, seq_lens = np.asarray(q_lens, np.int64), np.asarray(seq_lens, np.int64)
    if q_lens.shape != seq_lens.shape or (q_lens > seq_lens).any() or (q_lens < 0).any():
        raise ValueError(f"need 0 <= q_lens <= seq_lens, got {q_lens.tolist()} and {seq_lens.tolist()}")
    tables, num_blocks = scattered_tables(
        rng, seq_lens, block_size, spare_blocks=spare_blocks, spare_columns=spare_columns, num_blocks=num_blocks
    )
    return Batch(q_lens, seq_lens, tables, num_blocks, block_size)


# ---------------------------------------------------------------------------------------------
# cache contents


# Per-row scales fill_quantized draws: with its codes (about +-qmax / 3 for int8) rows decode to
# values of about 0.1 to 2.
ROW_SCALES = (0.002, 0.05)
# Codes of a format with a per-row zero point are drawn around it with this spread (in codes).
_ZERO_POINT_SPREAD = 2.5


def row_scale_range(mode: QuantMode, head_size: int) -> tuple[float, float]:
    """The range of the per-row scales fill_quantized draws for mode's rows of head_size: for a
    format with a per-row zero point, ROW_SCALES widened by int8's code spread over its own,
    and by sqrt(head_size) for a rotated mode (whose stored rows are sqrt(D) times the model's,
    SPEC.md 3.4), so that its rows decode to values of the same size."""
    if mode.format is None or not mode.format.row_zero_point:
        return ROW_SCALES
    factor = (127 / 3) / _ZERO_POINT_SPREAD * (math.sqrt(head_size) if mode.rotation else 1.0)
    return ROW_SCALES[0] * factor, ROW_SCALES[1] * factor


def _fill_with_zero_points(mode: QuantMode, rng: np.random.Generator, shape: tuple[int, ...]):
    """fill_quantized for a format whose rows carry a zero point in the scale word: each row's
    codes spread around its own zero point (so every row's range holds 0, as an encoder's does),
    packed; scale words with the zero point in their low bits."""
    fmt = mode.format
    zero_points = rng.integers(3, int(fmt.qmax) - 2, shape[:3])
    y = zero_points[..., None] + rng.standard_normal(shape) * _ZERO_POINT_SPREAD
    codes = np.clip(np.rint(y), fmt.qmin, fmt.qmax).astype(np.uint8)
    scales = rng.uniform(*row_scale_range(mode, shape[-1]), shape[:3]).astype(np.float32)
    return fmt.pack(codes), fmt.scale_words(scales, zero_points)


def fill_quantized(mode: QuantMode, rng: np.random.Generator, shape: tuple[int, ...], model_dtype: str):
    """Random but realistic cache contents: (codes uint8 or model-dtype values, float32 per-row
    scales or None) of caches of rows shape [..., head_size] (the codes packed to the mode's
    cache width). Only representable codes: never a NaN code."""
    fmt = mode.format
    if fmt is None:
        return rng.standard_normal(shape).astype(np.float32).astype(numpy_dtype(model_dtype)), None
    if fmt.row_zero_point:
        return _fill_with_zero_points(mode, rng, shape)
    # Values spread over the format's range as rows scaled by absmax / qmax are, snapped to codes.
    values = fmt.representable()
    y = np.clip(rng.standard_normal(shape) * fmt.qmax / 3, fmt.qmin, fmt.qmax)
    i = np.clip(np.searchsorted(values, y), 1, len(values) - 1)
    nearer_below = (y - values[i - 1]) < (values[i] - y)
    codes = fmt.codes_of(np.where(nearer_below, values[i - 1], values[i]))
    if not mode.per_token_head:
        return codes, None
    scales = rng.uniform(*ROW_SCALES, shape[:3]).astype(np.float32)
    return codes, scales


def unit_static_scale(rng: np.random.Generator, mode: QuantMode | None = None) -> float:
    """A per-tensor scale that makes fill_quantized's codes (about +-qmax / 3: +-150 for e4m3fn,
    the default) decode to order 1."""
    unit = 448.0 if mode is None else float(mode.qmax)
    return float(np.float32(rng.uniform(0.004, 0.02) * (448.0 / unit)))


def wide_static_scale(rng: np.random.Generator, mode: QuantMode | None = None) -> np.float32:
    """A per-tensor scale anywhere in [1/16, 32) with a random mantissa (for e4m3fn, the default;
    times 448 / qmax for another format, so its codes decode to the same sizes): the conformance
    suite's, so scales that are not powers of two and span decades are checked."""
    unit = 448.0 if mode is None else float(mode.qmax)
    return np.float32(2.0 ** rng.integers(-4, 5) * rng.uniform(1.0, 2.0) * (448.0 / unit))


def _one_static(rng: np.random.Generator, spec: Any, mode: QuantMode | None = None) -> np.float32:
    if spec == "unit":
        return np.float32(unit_static_scale(rng, mode))
    if spec == "wide":
        return wide_static_scale(rng, mode)
    return np.float32(spec)


def _static_pair(mode: QuantMode, rng: np.random.Generator, spec: Any) -> tuple[Any, Any]:
    """(k, v) per-tensor scales by spec ("unit", "wide" or a pair of values); None for other modes."""
    if not mode.per_tensor:
        return None, None
    if isinstance(spec, str):
        return _one_static(rng, spec, mode), _one_static(rng, spec, mode)
    return np.float32(spec[0]), np.float32(spec[1])


_TORCH_CHUNK = 1 << 22  # elements per step: bounds the float32 temporaries of a multi-GB cache


def _fill_torch(mode: QuantMode, caches: KVCacheTensors, gen: Any) -> None:
    """fill_quantized's distribution drawn in place by torch ops on the caches' device (the
    dtype cast snaps to representable codes), for caches too big to draw on the host: each
    side's codes and scales by its own mode."""
    for side, cache, scales in (
        (mode.key_side, caches.key_cache, caches.k_scale_cache),
        (mode.value_side, caches.value_cache, caches.v_scale_cache),
    ):
        if side.format is not None and side.format.row_zero_point:
            _fill_torch_with_zero_points(side, cache, scales, gen)
        else:
            _fill_torch_codes(side, cache, scales, gen)


def _fill_torch_codes(mode: QuantMode, cache: Any, scales: Any, gen: Any) -> None:
    """One side's codes (or model-dtype values) and per-row scales, fill_quantized's way."""
    import torch

    fmt = mode.format
    if fmt is not None:
        values = fmt.representable()
        half_tiny = float(values[values > 0].min()) / 2
    if not cache.is_contiguous():
        raise ValueError("fill='torch' takes contiguous caches")
    flat = cache.view(-1, cache.shape[-1])
    rows = max(1, _TORCH_CHUNK // flat.shape[1])
    for i in range(0, flat.shape[0], rows):
        part = flat[i : i + rows]
        x = torch.randn(part.shape, device=part.device, generator=gen)
        if fmt is None:
            part.copy_(x.to(part.dtype))
            continue
        y = (x * (fmt.qmax / 3)).clamp_(fmt.qmin, fmt.qmax)
        if fmt.kind == "int":
            y = y.round()
        else:  # the cast rounds to nearest even; what rounds to zero is +0, as fill_quantized's
            y = torch.where(y.abs() <= half_tiny, torch.zeros_like(y), y)
        part.copy_(y.to(part.dtype))
    if scales is not None:
        scales.uniform_(0.002, 0.05, generator=gen)


def _fill_torch_with_zero_points(mode: QuantMode, cache: Any, words: Any, gen: Any) -> None:
    """One side's packed codes and scale words, _fill_with_zero_points' way."""
    import torch

    fmt = mode.format
    per_byte, bits = fmt.codes_per_byte, fmt.bits
    low = (1 << fmt.zero_point_bits) - 1
    lowest, highest = row_scale_range(mode, fmt.head_size_of(cache.shape[-1]))
    if not (cache.is_contiguous() and words.is_contiguous()):
        raise ValueError("fill='torch' takes contiguous caches")
    flat, flat_words = cache.view(-1, cache.shape[-1]), words.view(torch.int32).view(-1)
    rows = max(1, _TORCH_CHUNK // (flat.shape[1] * per_byte))
    for i in range(0, flat.shape[0], rows):
        part, part_words = flat[i : i + rows], flat_words[i : i + rows]
        zero_points = torch.randint(3, int(fmt.qmax) - 2, (part.shape[0], 1), device=part.device, generator=gen)
        y = torch.randn((*part.shape, per_byte), device=part.device, generator=gen) * _ZERO_POINT_SPREAD
        codes = (y + zero_points[..., None]).round_().clamp_(fmt.qmin, fmt.qmax).to(torch.int32)
        shifts = torch.arange(per_byte, device=part.device, dtype=torch.int32) * bits
        part.copy_((codes << shifts).sum(-1).to(part.dtype))
        scales = torch.empty(part.shape[0], device=part.device).uniform_(lowest, highest, generator=gen)
        part_words.copy_((scales.view(torch.int32) & ~low) | zero_points[:, 0].to(torch.int32))


def torch_generator(rng: np.random.Generator, device: str) -> Any:
    """A torch generator on device, seeded by one draw of rng (so it replays with it)."""
    import torch

    return torch.Generator(device=device).manual_seed(int(rng.integers(0, 2**62)))


def _place(host: np.ndarray, dtype: str | None, kind: str, device: str) -> Any:
    """A copy of a host array (codes as uint8, or values) as dtype on kind/device, bits
    unchanged. Never a view: a call that writes to it must not change the host copy."""
    a = host if dtype is None else host.view(numpy_dtype(dtype))
    if kind == "numpy":
        return a.copy()
    return as_torch(np.ascontiguousarray(a)).to(device, copy=True)


def _index(values: np.ndarray, kind: str, device: str, dtype: str = "int32") -> Any:
    a = np.ascontiguousarray(values).astype(numpy_dtype(dtype))
    return a if kind == "numpy" else as_torch(a).to(device)


def host_codes(cache: Any, mode: str | QuantMode) -> np.ndarray:
    """A live cache (torch on any device, or NumPy; any strides) as the oracle reads it: uint8
    codes, or model-dtype values for mode none. A copy."""
    mode = get_kv_quant_mode(mode)
    a = as_numpy(cache.detach().cpu()) if is_torch(cache) else np.asarray(cache)
    a = np.ascontiguousarray(a)
    return a.copy() if mode.code_dtype is None else a.view(np.uint8).copy()


def host_scales(x: Any) -> np.ndarray | None:
    if x is None:
        return None
    return np.ascontiguousarray(as_numpy(x.detach().cpu()) if is_torch(x) else np.asarray(x), dtype=np.float32)


def _scalar(x: Any) -> float | None:
    if x is None:
        return None
    a = as_numpy(x.detach().cpu()) if is_torch(x) else np.asarray(x)
    return float(np.asarray(a, np.float32).reshape(-1)[0])


# ---------------------------------------------------------------------------------------------
# the oracle's answer and the tolerance it is held to


def _one_side(mode: str | QuantMode) -> QuantMode:
    """The mode of one cache; a split mode names two (its key_side and value_side)."""
    mode = get_kv_quant_mode(mode)
    if mode.split:
        raise ValueError(f"{mode.name} stores keys and values in two modes: pass the cache's side's mode")
    return mode


def _in_int4_oracle(mode: QuantMode) -> bool:
    # The oracle keeps its int4 functions beside ORACLE_MODES (SPEC.md 10), with their own
    # table of the modes they take.
    return mode.name in oracle.INT4_MODES


def oracle_decoded_cache(
    mode: str | QuantMode, codes: np.ndarray, scales: Any = None, static: Any = None
) -> np.ndarray:
    """float32 [NB, BS, H, D]: the oracle's decode of a whole host cache (uint8 codes, or
    model-dtype values for mode none), bit for bit what dequantize returns (SPEC.md sections 7
    and 3.5: a rotated mode's rows un-rotated in float32)."""
    mode = _one_side(mode)
    if not _in_int4_oracle(mode):
        return oracle.decode_cache(codes, host_scales(scales), mode.name, _scalar(static))
    decoded = oracle.int4_decode_rows(np.asarray(codes, np.uint8), host_scales(scales))
    return oracle.int4_unrotate(decoded) if mode.rotation else decoded


def oracle_gathered(
    mode: str | QuantMode, codes: np.ndarray, scales: Any, block_tables: Any, seq_lens: Any, static: Any = None
) -> np.ndarray:
    """float32 [sum(seq_lens), H, D]: the oracle's dequantize of each sequence's tokens in order."""
    mode = _one_side(mode)
    if not _in_int4_oracle(mode):
        return oracle.gather_dequantize(codes, host_scales(scales), block_tables, seq_lens, mode.name, _scalar(static))
    # Each row decodes alone, so gathering the decoded rows is decoding the gathered ones.
    decoded = oracle_decoded_cache(mode, codes, scales)
    tables, block_size = np.asarray(block_tables), decoded.shape[1]
    rows = [
        decoded[int(tables[s, i // block_size]), i % block_size]
        for s, n in enumerate(np.asarray(seq_lens).tolist())
        for i in range(n)
    ]
    return np.stack(rows) if rows else np.zeros((0, *decoded.shape[2:]), np.float32)


def oracle_model_values(mode: str | QuantMode, codes: np.ndarray, scales: Any = None, static: Any = None) -> np.ndarray:
    """[NB, BS, H, D]: the values a host cache stands for in the model's basis, as the oracle's
    attention reads them (float64 for int4, whose un-rotation the reference does in float64;
    the float32 decode otherwise)."""
    mode = _one_side(mode)
    if not _in_int4_oracle(mode):
        return oracle_decoded_cache(mode, codes, scales, static)
    return oracle.int4_dequantize_rows_f64(np.asarray(codes, np.uint8), host_scales(scales), mode.name)


def oracle_write(
    mode: str | QuantMode,
    key: np.ndarray,
    value: np.ndarray,
    slot_mapping: np.ndarray,
    *,
    num_blocks: int,
    block_size: int,
    rounding: str = "nearest",
    k_scale: Any = None,
    v_scale: Any = None,
    key_cache: np.ndarray | None = None,
    value_cache: np.ndarray | None = None,
    k_scale_cache: np.ndarray | None = None,
    v_scale_cache: np.ndarray | None = None,
) -> tuple[Any, Any, Any, Any]:
    """The oracle's reshape_and_cache onto copies of host caches (key, value in their input
    dtype: a rotated mode rounds its rotated rows to it): (key_cache, value_cache,
    k_scale_cache, v_scale_cache) as uint8 codes and float32 scale words."""
    mode = get_kv_quant_mode(mode)
    if mode.split:
        # Each side is written by its own mode's rule (SPEC.md section 2's per-side rows).
        geometry = dict(num_blocks=num_blocks, block_size=block_size, rounding=rounding)
        keys = oracle_write(
            mode.key_side, key, key, slot_mapping, key_cache=key_cache, k_scale_cache=k_scale_cache, **geometry
        )
        values = oracle_write(
            mode.value_side, value, value, slot_mapping, key_cache=value_cache, k_scale_cache=v_scale_cache, **geometry
        )
        return keys[0], values[0], keys[2], values[2]
    if not _in_int4_oracle(mode):
        return oracle.reshape_and_cache(
            key,
            value,
            slot_mapping,
            mode_name=mode.name,
            num_blocks=num_blocks,
            block_size=block_size,
            rounding=rounding,
            k_scale=k_scale,
            v_scale=v_scale,
            key_cache=key_cache,
            value_cache=value_cache,
            k_scale_cache=k_scale_cache,
            v_scale_cache=v_scale_cache,
        )
    if rounding != "nearest":
        raise ValueError(f"rounding {rounding!r}: {mode.name} has one rounding, 'nearest'")
    num_kv_heads, head_size = np.asarray(key).shape[1:]
    shape = (num_blocks, block_size, num_kv_heads)
    out = []
    for rows, cache, words in ((key, key_cache, k_scale_cache), (value, value_cache, v_scale_cache)):
        cache = (
            np.zeros((*shape, mode.cache_width(head_size)), np.uint8) if cache is None else np.array(cache, np.uint8)
        )
        words = np.zeros(shape, np.float32) if words is None else np.array(words, np.float32)
        for t, slot in enumerate(np.asarray(slot_mapping).tolist()):
            if slot >= 0:
                block, offset = divmod(int(slot), block_size)
                cache[block, offset], words[block, offset] = oracle.int4_quantize_rows(np.asarray(rows)[t], mode.name)
        out += [cache, words]
    return out[0], out[2], out[1], out[3]


def oracle_attention(
    mode: str | QuantMode,
    query: Any,
    key_codes: np.ndarray,
    value_codes: np.ndarray,
    block_tables: Any,
    seq_lens: Any,
    query_start_loc: Any,
    *,
    k_scales: Any = None,
    v_scales: Any = None,
    k_static: Any = None,
    v_static: Any = None,
    quantize_query: bool = False,
    fp8_dots: bool = False,
    probability_tile: int | None = None,
    softmax_scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: Any = None,
    return_slack: bool = False,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """float64 [T, Hq, D]: kvzoo_spec's attention_f64 on the oracle-decoded caches (int4:
    int4_attention_f64 on the codes, SPEC.md 8.4). With probability_tile, return_slack=True
    returns (out, slack): attention_f64's bound on what float32 weights may move each element.

    key_codes / value_codes: host uint8 codes (model-dtype values for mode none), e.g.
    host_codes() of a live cache; query: any array in its own dtype."""
    mode = get_kv_quant_mode(mode)
    host = lambda x: None if x is None else np.asarray(as_numpy(x.cpu()) if is_torch(x) else x)  # noqa: E731
    q = as_numpy(query.detach().cpu()) if is_torch(query) else np.asarray(query)
    options = dict(softmax_scale=softmax_scale, sliding_window=sliding_window, softcap=softcap, sinks=host(sinks))
    if mode.split:
        if fp8_dots:
            raise ValueError(f"fp8_dots: defined for e4m3fn keys and values, not {mode.name}")
        # Each side decoded by its own mode, in the model's basis (a rotated side un-rotated in
        # float64); the query meets the keys as they are, so it is rotated only where they are.
        k_deq = oracle_model_values(mode.key_side, key_codes, k_scales)
        v_deq = oracle_model_values(mode.value_side, value_codes, v_scales)
        if quantize_query:
            q = _round_tripped_query(q)
        return oracle.attention_f64(
            q, k_deq, v_deq, host(block_tables), host(seq_lens), host(query_start_loc), **options
        )
    if _in_int4_oracle(mode):
        if quantize_query:
            raise ValueError(f"quantize_query: defined for int8 per-token-head caches, not {mode.name}")
        # SPEC.md 8.4's reference: logits on the codes of the rotated query, output un-rotated.
        return oracle.int4_attention_f64(
            q,
            key_codes,
            value_codes,
            host_scales(k_scales),
            host_scales(v_scales),
            host(block_tables),
            host(seq_lens),
            host(query_start_loc),
            mode_name=mode.name,
            **options,
        )
    k_deq = oracle.decode_cache(key_codes, host_scales(k_scales), mode.name, _scalar(k_static))
    v_deq = oracle.decode_cache(value_codes, host_scales(v_scales), mode.name, _scalar(v_static))
    if quantize_query:
        q = _round_tripped_query(q)
    if fp8_dots:
        q = oracle.fp8_dots_query(q.reshape(-1, q.shape[-1])).reshape(q.shape)
        if probability_tile is not None:
            # SPEC.md 8.3 in full: the weights rounded per tile too (the implementation's tile).
            options["fp8_probabilities"] = (probability_tile, host_scales(v_scales))
    return oracle.attention_f64(
        q, k_deq, v_deq, host(block_tables), host(seq_lens), host(query_start_loc), return_slack=return_slack, **options
    )


def _round_tripped_query(q: np.ndarray) -> np.ndarray:
    """The query as quantize_query attends with it (SPEC.md 8.1): each row int8-quantized and decoded."""
    rows = oracle.widen_to_float32(q).reshape(-1, q.shape[-1])
    codes, scales = oracle.quantize_rows(rows, QUERY_ROUND_TRIP_MODE)
    return oracle.decode_rows(codes, scales, QUERY_ROUND_TRIP_MODE).reshape(q.shape)


def attention_tolerance(impl: Any, out_dtype: str, fp8_dots: bool = False) -> float:
    """Relative error per sequence an implementation is held to: its declared attention_rtol
    plus the output dtype's rounding (bf16 keeps 8 significant bits), plus the probabilities'
    e4m3 rounding under fp8_dots."""
    return impl.attention_rtol + OUT_ROUNDOFF[out_dtype] + (FP8_DOTS_RTOL if fp8_dots else 0.0)


def assert_attention_close(
    impl: Any,
    got: Any,
    ref: np.ndarray,
    query_start_loc: Any,
    out_dtype: str,
    what: str = "",
    fp8_dots: bool = False,
    slack: np.ndarray | None = None,
) -> None:
    """Output against the oracle (SPEC.md section 8): non-finite exactly where a poisoned key
    makes ref non-finite, and elsewhere a relative Frobenius error within
    attention_tolerance, per sequence, so one short sequence cannot hide in a long one's norm.
    slack [T, Hq, D]: an absolute allowance per element on top (the oracle's bound on rounding
    flips it cannot decide, attention_f64's return_slack); its norm adds to the sequence's."""
    got = np.asarray(got, np.float64)
    poisoned = ~np.isfinite(ref)
    assert not np.isfinite(got[poisoned]).any(), f"{impl.name}{what}: a poisoned key gave finite output"
    unwritten = ~np.isfinite(got) & ~poisoned
    assert not unwritten.any(), f"{impl.name}{what}: {int(unwritten.sum())} output elements not finite/unwritten"
    got, ref = np.where(poisoned, 0.0, got), np.where(poisoned, 0.0, ref)
    if slack is not None:  # a poisoned row's slack is as non-finite as its reference: not compared
        slack = np.where(poisoned, 0.0, np.asarray(slack, np.float64))
    tol = attention_tolerance(impl, out_dtype, fp8_dots)
    qsl = np.asarray(query_start_loc, np.int64)
    for s in range(len(qsl) - 1):
        rows = slice(int(qsl[s]), int(qsl[s + 1]))
        if rows.stop == rows.start:
            continue
        scale = max(np.linalg.norm(ref[rows]), 1e-30)
        err = np.linalg.norm(got[rows] - ref[rows]) / scale
        allowed = tol if slack is None else tol + np.linalg.norm(slack[rows]) / scale
        of_slack = "" if slack is None else f" ({allowed - tol:.1e} of it the oracle's slack)"
        assert math.isfinite(err) and err <= allowed, (
            f"{impl.name}{what}: sequence {s} relative error {err:.3e} > {allowed:.1e}{of_slack} (seed {SEED})"
        )


# ---------------------------------------------------------------------------------------------
# attention samples


@dataclass
class PagedSample:
    """One paged-attention problem: the arrays the API takes (on `kind`/`device`) and, unless
    filled by torch, the host copies the oracle reads, taken before any call could touch them."""

    mode: QuantMode
    batch: Batch
    layout: str
    kind: str
    device: str
    query_dtype: str
    query: Any
    caches: KVCacheTensors
    block_tables: Any  # int32, like seq_lens and query_start_loc
    seq_lens: Any
    query_start_loc: Any
    sinks: Any | None
    k_scale: Any | None  # per-tensor scales (np.float32), else None
    v_scale: Any | None
    # Host copies (None with fill="torch").
    query_host: np.ndarray | None
    key_codes: np.ndarray | None
    value_codes: np.ndarray | None
    k_scales: np.ndarray | None
    v_scales: np.ndarray | None
    sinks_host: np.ndarray | None

    @property
    def qsl(self) -> np.ndarray:
        return self.batch.qsl

    def api_kwargs(self) -> dict[str, Any]:
        """Everything api.paged_attention takes besides query, caches, options and out."""
        return dict(
            mode=self.mode.name,
            block_tables=self.block_tables,
            seq_lens=self.seq_lens,
            query_start_loc=self.query_start_loc,
            k_scale_cache=self.caches.k_scale_cache,
            v_scale_cache=self.caches.v_scale_cache,
            k_scale=None if self.k_scale is None else float(self.k_scale),
            v_scale=None if self.v_scale is None else float(self.v_scale),
            sinks=self.sinks,
        )

    def attention_record(self, **options: Any) -> Attention:
        """The sample as a checked-call record (kvzoo.problem.Attention): its query, caches,
        tables and lengths, a NaN-filled out, the batch's bounds, softmax scale 1/sqrt(head_size)
        and the per-row scale caches; options (sinks, static scales, out, the attention's call
        options, or any bound given otherwise) are passed on and win."""
        from .problem import Attention

        c = self.caches
        fields: dict[str, Any] = dict(
            mode=self.mode,
            query=self.query,
            key_cache=c.key_cache,
            value_cache=c.value_cache,
            block_tables=self.block_tables,
            seq_lens=self.seq_lens,
            query_start_loc=self.query_start_loc,
            out=self.new_out(),
            max_query_len=self.batch.max_query_len,
            max_seq_len=self.batch.max_seq_len,
            softmax_scale=1.0 / math.sqrt(self.query.shape[-1]),
            k_scale_cache=c.k_scale_cache,
            v_scale_cache=c.v_scale_cache,
        )
        fields.update(options)
        return Attention(**fields)

    def new_out(self) -> Any:
        """An output like the query, NaN-filled so an unwritten element shows."""
        if self.kind == "numpy":
            return np.full(self.query.shape, np.nan, self.query.dtype)
        import torch

        return torch.full_like(self.query, float("nan"))

    def reference(self, **options: Any) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """The float64 oracle on the cache as built (sinks as drawn): oracle_attention with its
        keyword options (quantize_query, fp8_dots, probability_tile, softmax_scale,
        sliding_window, softcap, return_slack)."""
        if self.key_codes is None:
            raise ValueError(
                "a sample filled by torch keeps no host copies: pass host_codes() of its caches to oracle_attention"
            )
        return oracle_attention(
            self.mode,
            self.query_host,
            self.key_codes,
            self.value_codes,
            self.batch.tables,
            self.batch.seq_lens,
            self.batch.qsl,
            k_scales=self.k_scales,
            v_scales=self.v_scales,
            k_static=self.k_scale,
            v_static=self.v_scale,
            sinks=self.sinks_host,
            **options,
        )


def _placed_caches(
    mode: QuantMode,
    host: tuple[Any, Any, Any, Any],
    shape: tuple[int, int, int, int],
    layout: str,
    kind: str,
    device: str,
    row_align: RowAlign = None,
) -> KVCacheTensors:
    """Host (codes, codes, scales, scales) as caches of layout on kind/device, bits unchanged."""
    kc, vc, ks, vs = host
    if layout == "separate":
        return KVCacheTensors(
            *(
                None if a is None else _place(a, dt, kind, device)
                for a, dt in ((kc, mode.key_side.code_dtype), (vc, mode.value_side.code_dtype), (ks, None), (vs, None))
            )
        )
    caches = allocate_inline(*shape, mode, device=None if kind == "numpy" else device, row_align=row_align)
    if row_align is not None:
        # All-ones padding (NaN as a scale or an fp8 code): a kernel that read it would show.
        caches.buffer[..., shape[-1] + SCALE_BYTES :] = 255
    for dst, src in ((caches.key_cache, kc), (caches.value_cache, vc)):
        if kind == "numpy":
            dst.view(np.uint8)[...] = src
        else:
            dst.view(torch_dtype("uint8")).copy_(as_torch(src))
    for dst, src in ((caches.k_scale_cache, ks), (caches.v_scale_cache, vs)):
        dst[...] = src if kind == "numpy" else as_torch(src).to(device)
    return caches


def paged_sample(
    rng: np.random.Generator,
    mode: str | QuantMode,
    *,
    batch: str = "mixed",
    q_lens: Any = None,
    seq_lens: Any = None,
    size: Size = "medium",
    block_size: int = 16,
    num_q_heads: int = 8,
    num_kv_heads: int = 2,
    head_size: int = 64,
    query_dtype: str = "bfloat16",
    cache_dtype: str | None = None,
    layout: str = "separate",
    kind: Kind = "torch",
    device: str = "cpu",
    row_align: RowAlign = None,
    sinks: bool = False,
    poison: bool = False,
    static_scales: Any = "unit",
    spare_blocks: int = 3,
    spare_columns: int = 1,
    num_blocks: int | None = None,
    fill: Fill = "host",
) -> PagedSample:
    """A random paged-attention problem.

    Lengths are given (q_lens, seq_lens) or drawn by `batch` kind; block tables scatter pages
    (scattered_tables); caches hold fill_quantized's codes and scales in `layout` ("separate"
    or "inline", its rows padded as row_align asks: allocate_inline); cache_dtype is mode none's cache dtype (default: the query's). static_scales:
    "unit", "wide" (wide_static_scale) or a (k, v) pair, per-tensor modes only. poison: the key
    that sequence 0's last query attends to, in KV head 0, is NaN (its scale, its code or its
    value), so every output row of that head group must come out non-finite (SPEC.md section
    8) and no other. fill="torch": caches and query drawn on the device by torch ops from a
    generator seeded by rng, with no host copies (for shapes of GBs).
    """
    mode = get_kv_quant_mode(mode)
    cache_dtype = cache_dtype or query_dtype
    if layout not in ("separate", "inline"):
        raise ValueError(f"layout {layout!r}: expected 'separate' or 'inline'")
    if poison and not mode.holds_nan:
        raise ValueError(f"poison: mode {mode.name!r} has no code that decodes to NaN and no per-row scale")
    if fill == "torch" and (kind != "torch" or layout != "separate" or poison):
        raise ValueError("fill='torch' builds separate torch caches without poison")
    b = draw_batch(
        rng,
        batch,
        block_size=block_size,
        size=size,
        q_lens=q_lens,
        seq_lens=seq_lens,
        spare_blocks=spare_blocks,
        spare_columns=spare_columns,
        num_blocks=num_blocks,
    )
    shape = (b.num_blocks, block_size, num_kv_heads, head_size)
    host = fill == "host"
    if host:
        (kc, ks), (vc, vs) = (
            fill_quantized(side, rng, shape, cache_dtype) for side in (mode.key_side, mode.value_side)
        )
    static = _static_pair(mode, rng, static_scales)
    if poison:
        pos = int(b.seq_lens[0]) - 1
        block, off = int(b.tables[0, pos // block_size]), pos % block_size
        if mode.per_token_head:
            ks[block, off, 0] = np.nan
        elif mode.per_tensor:
            kc[block, off, 0, 0] = mode.nan_code
        else:
            kc[block, off, 0, 0] = np.nan

    if host:
        caches = _placed_caches(mode, (kc, vc, ks, vs), shape, layout, kind, device, row_align)
        q32 = rng.standard_normal((b.num_tokens, num_q_heads, head_size)).astype(np.float32)
        query = tensor(q32, query_dtype, device, kind)
    else:
        import torch

        caches = allocate_separate(*shape, mode, model_dtype=cache_dtype, device=device)
        gen = torch_generator(rng, device)
        _fill_torch(mode, caches, gen)
        query = torch.randn((b.num_tokens, num_q_heads, head_size), device=device, generator=gen)
        query = query.to(torch_dtype(query_dtype))
    sinks_host = (rng.standard_normal(num_q_heads) * 2).astype(np.float32) if sinks else None
    return PagedSample(
        mode=mode,
        batch=b,
        layout=layout,
        kind=kind,
        device=device,
        query_dtype=query_dtype,
        query=query,
        caches=caches,
        block_tables=_index(b.tables, kind, device),
        seq_lens=_index(b.seq_lens, kind, device),
        query_start_loc=_index(b.qsl, kind, device),
        sinks=None if sinks_host is None else _place(sinks_host, None, kind, device),
        k_scale=static[0],
        v_scale=static[1],
        query_host=np.array(as_numpy(query.cpu()) if is_torch(query) else query) if host else None,
        key_codes=kc if host else None,
        value_codes=vc if host else None,
        k_scales=ks if host else None,
        v_scales=vs if host else None,
        sinks_host=sinks_host,
    )


# ---------------------------------------------------------------------------------------------
# write samples


def poisoned_caches(
    rng: np.random.Generator,
    mode: str | QuantMode,
    shape: tuple[int, int, int, int],
    *,
    model_dtype: str = "bfloat16",
    layout: str = "separate",
    kind: Kind = "torch",
    device: str = "cpu",
    row_align: RowAlign = None,
) -> KVCacheTensors:
    """Caches of random bytes (never zero bytes, NaN codes included) in layout: a slot a write
    leaves alone, or an unwritten byte of a written one, keeps a value no encoder produces
    by accident."""
    mode = get_kv_quant_mode(mode)
    nb, bs, h, d = shape
    if layout == "inline":
        buf = random_bytes(rng, (nb, 2, bs, h, inline_row_bytes(d, row_align)), "uint8", device, kind)
        return inline_views(buf, d, mode)
    kc, vc = (
        random_bytes(rng, (nb, bs, h, side.cache_width(d)), side.code_dtype or model_dtype, device, kind)
        for side in (mode.key_side, mode.value_side)
    )
    if mode.per_token_head:
        ks, vs = (random_bytes(rng, shape[:3], "float32", device, kind) for _ in range(2))
        return KVCacheTensors(kc, vc, ks, vs)
    return KVCacheTensors(kc, vc)


def _rows_on(values32: np.ndarray, dtype: str, device: str, kind: str, strided: bool, slot: int) -> Any:
    """K or V rows as an array, or as a view into a fused QKV-like buffer (strided=True):
    offset start, head and row strides that are not the row's size."""
    if not strided:
        return tensor(values32, dtype, device, kind)
    t, h, d = values32.shape
    fused = np.zeros((t, 3 * h + 1, d + 3), np.float32)
    fused[:, 1 + slot * h : 1 + (slot + 1) * h, 2 : 2 + d] = values32
    full = tensor(fused, dtype, device, kind)
    return full[:, 1 + slot * h : 1 + (slot + 1) * h, 2 : 2 + d]


def _clone(x: Any) -> Any:
    return x.clone() if is_torch(x) else x.copy()


@dataclass
class WriteSample:
    """One reshape_and_cache problem: rows, slots and caches on `kind`/`device`, plus the host
    values the oracle reads and a snapshot of the guard blocks past the cache's end."""

    mode: QuantMode
    dtype: str
    key32: np.ndarray  # float32, exactly representable in dtype
    value32: np.ndarray
    key: Any
    value: Any
    slots: np.ndarray  # int64 as handed over (wild ones included)
    oracle_slots: np.ndarray  # wild slots as -1: what a correct write does with them
    slot_mapping: Any
    caches: KVCacheTensors  # the num_blocks blocks the API is given
    padded: KVCacheTensors  # the same memory with guard_blocks more after it
    guard: tuple[Any, ...]  # copies of padded's guard blocks (None for absent caches)
    num_blocks: int
    block_size: int
    static_scale: np.float32 | None

    def cache_arrays(self, of: KVCacheTensors | None = None) -> tuple[Any, Any, Any, Any]:
        c = of or self.caches
        return c.key_cache, c.value_cache, c.k_scale_cache, c.v_scale_cache

    def api_kwargs(self) -> dict[str, Any]:
        """Everything api.reshape_and_cache takes besides the five positional arrays."""
        s = None if self.static_scale is None else float(self.static_scale)
        return dict(
            mode=self.mode.name,
            k_scale_cache=self.caches.k_scale_cache,
            v_scale_cache=self.caches.v_scale_cache,
            k_scale=s,
            v_scale=s,
        )

    def assert_guard_unchanged(self, what: str) -> None:
        for got, want in zip(self.cache_arrays(self.padded), self.guard):
            if want is not None:
                assert_same_bytes(got[self.num_blocks :], want, f"{what} wrote past the end of the cache")


def write_slots(
    rng: np.random.Generator,
    num_tokens: int,
    num_blocks: int,
    block_size: int,
    *,
    order: Literal["random", "paged"] = "random",
    negative: bool = False,
    wild: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """(slots as handed over, slots as a correct write treats them) int64 [num_tokens].

    order "random": distinct slots anywhere; "paged": vLLM-like, tokens filling random blocks
    in order. negative: about 30% skipped with negative ids. wild: about 40% past the cache's
    end (what validate=False must skip like negative ones): up to two blocks past it. From 3
    tokens on, each kind asked for is there (at least one negative id stays negative, and one
    other slot is wild): a draw without it would not test what the caller asked for."""
    capacity = num_blocks * block_size
    if order == "paged":
        blocks = rng.permutation(num_blocks)[: -(-num_tokens // block_size)]
        slots = (blocks[:, None] * block_size + np.arange(block_size)[None, :]).reshape(-1)[:num_tokens]
    else:
        slots = rng.permutation(capacity)[:num_tokens]
    slots = slots.astype(np.int64)
    assured = num_tokens >= 3
    if negative and num_tokens:
        skip = rng.random(num_tokens) < 0.3
        if assured and not skip.any():
            skip[rng.integers(num_tokens)] = True
        slots[skip] = -rng.integers(1, 5, int(skip.sum()))
    oracle_slots = slots
    if wild and num_tokens:
        far = rng.random(num_tokens) < 0.4
        if assured:
            kept = np.flatnonzero(slots < 0)[:1]  # one negative id stays negative
            far[kept] = False
            if not far.any():
                others = np.setdiff1d(np.arange(num_tokens), kept)
                far[others[rng.integers(others.size)]] = True
        slots = slots.copy()
        slots[far] = capacity + rng.integers(0, 2 * block_size, int(far.sum()))
        oracle_slots = np.where(far, -1, slots)
    return slots, oracle_slots


def write_sample(
    rng: np.random.Generator,
    mode: str | QuantMode,
    *,
    num_tokens: int,
    num_kv_heads: int = 2,
    head_size: int = 64,
    block_size: int = 16,
    dtype: str = "bfloat16",
    dist: str = "normal",
    layout: str = "separate",
    kind: Kind = "torch",
    device: str = "cpu",
    row_align: RowAlign = None,
    slot_order: Literal["random", "paged"] = "random",
    negative_slots: bool = False,
    wild_slots: bool = False,
    strided: bool = False,
    num_blocks: int | None = None,
    guard_blocks: int = 0,
    poison: bool = True,
    static_scale: Any = "unit",
    index_dtype: str = "int64",
    key32: np.ndarray | None = None,
    value32: np.ndarray | None = None,
) -> WriteSample:
    """A random reshape_and_cache problem.

    Rows come from kvzoo.inputs.make_rows by `dist` (or are given as float32
    key32/value32, exactly representable in dtype), as plain arrays or (strided) views into a
    fused QKV-like buffer; slots from write_slots; the caches hold random bytes (poison) or
    zeros, with guard_blocks more blocks after the num_blocks given to the API (default
    max(1, blocks needed) + 2); an inline page's rows padded as row_align asks. static_scale: "unit", "wide" or a value, per-tensor modes only.
    """
    mode = get_kv_quant_mode(mode)
    T, H, D, BS = num_tokens, num_kv_heads, head_size, block_size
    if num_blocks is None:
        num_blocks = max(1, -(-T // BS)) + 2
    static = _one_static(rng, static_scale, mode) if mode.per_tensor else None
    k32 = make_rows(mode, dist, dtype, (T, H, D), rng, static) if key32 is None else np.asarray(key32, np.float32)
    v32 = make_rows(mode, dist, dtype, (T, H, D), rng, static) if value32 is None else np.asarray(value32, np.float32)
    slots, oracle_slots = write_slots(
        rng, T, num_blocks, BS, order=slot_order, negative=negative_slots, wild=wild_slots
    )
    shape = (num_blocks + guard_blocks, BS, H, D)
    if poison:
        padded = poisoned_caches(
            rng, mode, shape, model_dtype=dtype, layout=layout, kind=kind, device=device, row_align=row_align
        )
    elif layout == "inline":
        padded = allocate_inline(*shape, mode, device=None if kind == "numpy" else device, row_align=row_align)
    else:
        padded = allocate_separate(*shape, mode, model_dtype=dtype, device=None if kind == "numpy" else device)
    arrays = (padded.key_cache, padded.value_cache, padded.k_scale_cache, padded.v_scale_cache)
    guard = tuple(None if c is None else _clone(c[num_blocks:]) for c in arrays)
    buffer = None if padded.buffer is None else padded.buffer[:num_blocks]
    caches = KVCacheTensors(*(None if c is None else c[:num_blocks] for c in arrays), buffer=buffer)
    slot_mapping = _index(slots, kind, device, index_dtype)
    return WriteSample(
        mode=mode,
        dtype=dtype,
        key32=k32,
        value32=v32,
        key=_rows_on(k32, dtype, device, kind, strided, 0),
        value=_rows_on(v32, dtype, device, kind, strided, 1),
        slots=slots,
        oracle_slots=oracle_slots,
        slot_mapping=slot_mapping,
        caches=caches,
        padded=padded,
        guard=guard,
        num_blocks=num_blocks,
        block_size=BS,
        static_scale=static,
    )


__all__ = [
    "BATCH_KINDS",
    "OUT_ROUNDOFF",
    "Batch",
    "PagedSample",
    "WriteSample",
    "assert_attention_close",
    "attention_tolerance",
    "draw_batch",
    "draw_lens",
    "fill_quantized",
    "host_codes",
    "host_scales",
    "oracle_attention",
    "oracle_decoded_cache",
    "oracle_gathered",
    "oracle_model_values",
    "oracle_write",
    "row_scale_range",
    "paged_sample",
    "poisoned_caches",
    "scattered_tables",
    "torch_generator",
    "unit_static_scale",
    "wide_static_scale",
    "write_sample",
    "write_slots",
]
