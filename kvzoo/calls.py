"""How a call record (kvzoo.problem) checks itself, in two tiers, and forms its arrays.

- metadata, `check(record)`: types, shapes, dtypes, strides, devices, flags and host scalars.
  A function of the call's signature alone (kvzoo.launches.signature), so kvzoo.launches keeps
  its verdict per signature. It reads no device value, and runs on the fake tensors of a traced
  torch op too (fake=True: no device type, no value, no int() of a size).
- values, `check_values(record, ...)`: what is read from the device (slots, block ids,
  lengths, offsets, a static scale's value), once per call, or once per step for a plan. Only
  with validate=True, but for the lengths and offsets a call reads to size its work: those are
  checked whatever validate says.

Between the two, `arrays(record, facts)` forms each call's arrays as the checked record holds
them: caches of raw bytes viewed as codes, static scales given as numbers made float32 [1]
arrays, and out (and lse) allocated where the caller passed none.

A plan's calls check their own arrays against what the plan fixes (a Geometry: the rows'
shape and dtype, the device); a functional call's arrays are checked against one another.
Every refusal raises KVZooInputError naming the argument, before anything is written.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from .arrays import Array, ArrayT, as_torch, device_of, dtype_name, is_array, is_torch, same_kind_empty
from .errors import fail
from .modes import MODES, ROUNDINGS, QuantMode, get_kv_quant_mode
from .problem import Attention, CacheWrite, Dequantize
from .validate import (
    FLOAT_INPUTS,
    INDEX_DTYPES,
    INT32_MAX,
    as_code_storage,
    check_static,
    check_static_value,
    code_dtypes,
    float32_scalar,
    forbid,
    host_ints,
    int_scalar,
    normal_float32_scalar,
    require_dtype,
    require_finite,
    require_ndim,
    require_no_negative_strides,
    require_same_device,
    require_shape,
    require_sizes,
    require_writable,
    static_array,
)

# The layouts error messages name, each spelled here once.
ROWS = "[num_tokens, num_kv_heads, head_size]"
QUERY_ROWS = "[num_tokens, num_q_heads, head_size]"
CACHE = "[num_blocks, block_size, num_kv_heads, head_size]"
SCALES = "[num_blocks, block_size, num_kv_heads]"


class Geometry(NamedTuple):
    """What a plan fixes of its calls' own rows: their shape (num_tokens None: as they come),
    their dtype (the CacheSpec's model_dtype) and the device of the plan's tensors."""

    rows: tuple[int | None, int, int]
    dtype: str
    device: Any

    def check(self, name: str, x: Array, layout: str) -> None:
        num_tokens, heads, head_size = self.rows
        shape = (x.shape[0] if num_tokens is None else num_tokens, heads, head_size)
        require_shape(name, x, shape, layout)
        if dtype_name(x) != self.dtype:
            fail(f"{name}: expected dtype {self.dtype} (the CacheSpec's model_dtype), got {dtype_name(x)}")
        if device_of(x) != self.device:
            fail(f"{name}: on {device_of(x)}, the plan's tensors are on {self.device}")


class Facts(NamedTuple):
    """What a record's metadata check concluded, for every call of its signature.

    host: the checked record's fields after its arrays (attention's bounds as given: the
    values tier fills in the ones read). views: (position, side's mode) of caches given as raw
    bytes, viewed as that side's codes on each call. statics: positions of static scales given as numbers.
    allocate: (position, shape, dtype) of the outputs made on each call, like the array at
    position `like`. table: (num_blocks, block_size), what slots and block ids are checked
    against. empty: nothing to run (no query rows). whole: dequantize's whole cache."""

    host: tuple
    views: tuple[tuple[int, QuantMode], ...] = ()
    statics: tuple[int, ...] = ()
    allocate: tuple[tuple[int, tuple, str], ...] = ()
    like: int = 0
    table: tuple[int, int] = (0, 0)
    empty: bool = False
    whole: bool = False


# ------------------------------------------------------------------------------------------
# The parts of a call more than one operation (or the plan) checks


def cache_dtypes(mode: QuantMode, model_dtype: str) -> tuple[str, ...]:
    return (model_dtype,) if mode.code_dtype is None else code_dtypes(mode)


def check_caches(
    mode: QuantMode,
    named: tuple[tuple[str, Array], ...],
    shape: tuple,
    dtypes: tuple[str, ...],
    layout: str,
    *,
    written: bool = False,
    fake: bool = False,
    source: str = "",
) -> None:
    """The code caches (key_cache, value_cache or cache): shape, dtype and strides. source:
    where the expected shape comes from, for the message (a plan's CacheSpec)."""
    for name, cache in named:
        require_ndim(name, cache, 4, CACHE, fake)
        if tuple(cache.shape) != tuple(shape):
            fail(f"{name}: expected shape {tuple(shape)} {layout}{source}, got {tuple(cache.shape)}")
        require_dtype(name, cache, dtypes)
        if written:
            require_writable(name, cache)
        else:
            require_no_negative_strides(name, cache)


def check_scale_caches(
    mode: QuantMode,
    named: tuple[tuple[str, Array | None], ...],
    shape: tuple,
    *,
    written: bool = False,
    fake: bool = False,
    source: str = "",
    absent: str = "pass None",
) -> None:
    """The float32 scale caches of a per-token-head mode (a scale per row), absent otherwise."""
    for name, sc in named:
        if not mode.per_token_head:
            if sc is not None:
                fail(
                    f"{name}: not used by mode {mode.name!r} (only per-token-head modes keep a scale per row); {absent}"
                )
            continue
        if sc is None:
            fail(f"{name}: required for per-token-head mode {mode.name!r} (float32 {tuple(shape)})")
        require_ndim(name, sc, 3, SCALES, fake)
        require_dtype(name, sc, ("float32",))
        if tuple(sc.shape) != tuple(shape):
            fail(f"{name}: expected shape {tuple(shape)} {SCALES}{source}, got {tuple(sc.shape)}")
        if written:
            require_writable(name, sc)
        else:
            require_no_negative_strides(name, sc)


def check_statics(mode: QuantMode, named: tuple[tuple[str, Any, int], ...], like: Array) -> tuple[int, ...]:
    """The static scales of a per-tensor mode (None otherwise); returns the positions of those
    given as numbers, which each call makes arrays of."""
    numbers = []
    for name, value, at in named:
        if mode.per_tensor:
            check_static(name, value, like)
            if not is_array(value):
                numbers.append(at)
        else:
            forbid(name, value, mode, "only the per-tensor modes take a static scale")
    return tuple(numbers)


def check_rounding(mode: QuantMode, rounding: str) -> None:
    if rounding not in ROUNDINGS:
        fail(f"rounding: expected one of {list(ROUNDINGS)}, got {rounding!r}")
    if rounding not in mode.roundings:
        takers = [m.name for m in MODES.values() if rounding in m.roundings]
        fail(
            f"rounding: mode {mode.name!r} defines {list(mode.roundings)}, not {rounding!r} "
            f"(modes with {rounding!r}: {takers})"
        )


def check_query_options(mode: QuantMode, quantize_query: bool, fp8_dots: bool) -> None:
    """The options that quantize the query change what is computed, each for one format's caches
    (SPEC.md 8.1, 8.3), and exclude each other."""
    from .formats import FLOAT8_E4M3FN, INT8

    if quantize_query and fp8_dots:
        fail("fp8_dots: cannot be combined with quantize_query (each defines the query's own rounding)")
    if quantize_query and not (mode.format is INT8 and mode.per_token_head):
        fail(f"quantize_query: needs an int8 per-token-head cache mode, got mode {mode.name!r}")
    if fp8_dots and not (mode.key_format is mode.value_format is FLOAT8_E4M3FN and mode.per_token_head):
        fail(f"fp8_dots: needs an fp8 e4m3fn per-token-head cache mode (fp8_per_token_head), got mode {mode.name!r}")


def check_slot_mapping(slot_mapping: Array, num_tokens: Any = None, fake: bool = False) -> None:
    """slot_mapping's shape and dtype; num_tokens None: any length."""
    require_ndim("slot_mapping", slot_mapping, 1, "[num_tokens]", fake)
    require_dtype("slot_mapping", slot_mapping, INDEX_DTYPES)
    if num_tokens is not None:
        require_shape("slot_mapping", slot_mapping, (num_tokens,), "[num_tokens]")


def check_slot_values(slot_mapping: Array, num_blocks: int, block_size: int) -> None:
    """Slots in range and none repeated: reads slot_mapping on the host (a GPU synchronisation)."""
    if int(slot_mapping.shape[0]) == 0:
        return
    slots = host_ints(slot_mapping).astype(np.int64)
    capacity = num_blocks * block_size
    if slots.max() >= capacity:
        fail(
            f"slot_mapping: slot {int(slots.max())} is out of range; the cache holds {capacity} slots "
            f"({num_blocks} blocks x {block_size})"
        )
    used = np.sort(slots[slots >= 0])
    if (used[1:] == used[:-1]).any():
        fail("slot_mapping: a non-negative slot appears more than once; each slot takes one token")


def check_query_start_loc(query_start_loc: Array, seq_lens: Array, fake: bool = False) -> Any:
    """Shapes of seq_lens and query_start_loc; returns num_seqs."""
    require_ndim("seq_lens", seq_lens, 1, "[num_seqs]", fake)
    require_ndim("query_start_loc", query_start_loc, 1, "[num_seqs + 1]", fake)
    require_dtype("query_start_loc", query_start_loc, INDEX_DTYPES)
    num_seqs = seq_lens.shape[0]
    require_shape("query_start_loc", query_start_loc, (num_seqs + 1,), "[num_seqs + 1]")
    return num_seqs


def check_block_tables(block_tables: Array, seq_lens: Array, block_size: Any, fake: bool = False) -> None:
    """block_tables and seq_lens: shapes and dtypes, and positions the kernels' int32 holds."""
    require_ndim("block_tables", block_tables, 2, "[num_seqs, max_blocks_per_seq]", fake)
    require_dtype("block_tables", block_tables, INDEX_DTYPES)
    require_ndim("seq_lens", seq_lens, 1, "[num_seqs]", fake)
    require_dtype("seq_lens", seq_lens, INDEX_DTYPES)
    num_seqs, max_blocks = block_tables.shape
    require_shape("seq_lens", seq_lens, (num_seqs,), "[num_seqs] (one per block_tables row)")
    if max_blocks * block_size > INT32_MAX:
        fail(
            f"block_tables: {max_blocks} blocks per sequence x block_size {block_size} is more positions than "
            f"the kernels' int32 ({INT32_MAX})"
        )


def block_table_values(block_tables: Array, seq_lens: Array, num_blocks: int, block_size: int) -> np.ndarray | None:
    """Block ids in range for the blocks each sequence uses (reads both on the host); returns
    seq_lens as read (int64), or None for no sequences."""
    num_seqs, max_blocks = int(block_tables.shape[0]), int(block_tables.shape[1])
    if num_seqs == 0:
        return None
    lens = read_seq_lens(seq_lens, max_blocks, block_size)
    table = host_ints(block_tables).astype(np.int64)
    used = np.arange(max_blocks)[None, :] < -(-lens[:, None] // block_size)
    ids = table[used]
    if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
        bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
        fail(f"block_tables: block id {bad} is out of range [0, {num_blocks}) for the blocks a sequence uses")
    return lens


def read_seq_lens(seq_lens: Array, max_blocks: int, block_size: int, already: np.ndarray | None = None) -> np.ndarray:
    """seq_lens on the host (int64), checked to be lengths the block tables' rows hold: a
    length read sizes or places rows whatever validate says. `already`: the lengths
    block_table_values read and checked, returned as they are (one read a call)."""
    if already is not None:
        return already
    lens = host_ints(seq_lens).astype(np.int64)
    if not lens.size:
        return lens
    if lens.min() < 0:
        fail(f"seq_lens: expected lengths >= 0, got {int(lens.min())}")
    if lens.max() > max_blocks * block_size:
        fail(
            f"seq_lens: length {int(lens.max())} needs more than the {max_blocks} blocks of "
            f"block_tables x block_size {block_size}"
        )
    return lens


def check_sinks(sinks: Array, num_q_heads: Any, fake: bool = False) -> None:
    require_ndim("sinks", sinks, 1, "[num_q_heads]", fake)
    require_dtype("sinks", sinks, ("float32",))
    require_shape("sinks", sinks, (num_q_heads,), "[num_q_heads]")


def _symbolic(x: Any) -> bool:
    # A traced call's host scalar that torch made a graph input (SymInt, SymFloat): its value
    # is the real call's to check.
    return type(x).__name__ in ("SymInt", "SymFloat", "SymBool")


def attention_scalars(
    head_size: Any, max_positions: Any, softmax_scale: Any, sliding_window: Any, softcap: Any, fake: bool = False
) -> tuple[float, int | None, float | None]:
    """(softmax_scale, sliding_window, softcap) as implementations receive them.

    max_positions is max_blocks_per_seq * block_size, the longest sequence the tables hold."""
    if fake and any(_symbolic(x) for x in (softmax_scale, sliding_window, softcap)):
        return softmax_scale, sliding_window, softcap
    if sliding_window is not None:
        sliding_window = int_scalar("sliding_window", sliding_window, 1)
        # A window no shorter than the longest sequence the tables can hold masks nothing.
        if sliding_window >= max_positions:
            sliding_window = None
    if softcap is not None:
        softcap = normal_float32_scalar("softcap", softcap)
    softmax_scale = (
        1.0 / math.sqrt(head_size) if softmax_scale is None else float32_scalar("softmax_scale", softmax_scale)
    )
    return float(softmax_scale), sliding_window, softcap


_BOUNDS = ("max_query_len", "max_seq_len", "num_prefills")


def check_bounds(given: tuple, num_seqs: Any, fake: bool = False) -> tuple:
    """The bounds given as host scalars (max_query_len, max_seq_len, num_prefills; None where
    not given), each an int in range."""
    if fake and any(_symbolic(x) for x in given):
        return given
    highs = ((INT32_MAX, ""), (INT32_MAX, ""), (num_seqs, "num_seqs"))
    return tuple(
        None if bound is None else int_scalar(name, bound, 0, high, high_name)
        for name, bound, (high, high_name) in zip(_BOUNDS, given, highs)
    )


def attention_bounds(
    query_start_loc: Array,
    seq_lens: Array,
    num_tokens: int | None,
    read: bool,
    given: tuple,
    *,
    table: tuple[int, int],
    keep_given: bool = False,
    lens_read: np.ndarray | None = None,
) -> tuple[int, int, int | None, int | None]:
    """(max_query_len, max_seq_len, num_prefills, num_tokens): the kernels' host-side bounds.

    given: the bounds given (checked as scalars; None where not given). The device values are
    read (one synchronisation) when `read` or when max_query_len or max_seq_len is not given,
    and values read are checked whatever validate says: the read is paid for, and a bad offset
    or length would put rows out of bounds. The bounds returned are then the ones read, or with
    keep_given the given ones where given, each checked to cover what was read (a plan keeps
    them: its CUDA graph replays under them after in-place updates). table: (max_blocks_per_seq,
    block_size), what a length may reach. num_tokens None takes the number of query tokens from
    query_start_loc[-1] when the values are read (None when they are not). lens_read: seq_lens
    as block_table_values read them, so a validated call reads them once."""
    if not read and given[0] is not None and given[1] is not None:
        return given[0], given[1], given[2], num_tokens
    num_seqs = int(seq_lens.shape[0])
    qsl = host_ints(query_start_loc).astype(np.int64)
    lens = read_seq_lens(seq_lens, *table, lens_read)
    q_lens = np.diff(qsl)
    expected = int(qsl[-1]) if num_tokens is None else num_tokens
    if qsl[0] != 0 or qsl[-1] != expected or (q_lens < 0).any():
        fail(
            f"query_start_loc: expected non-decreasing offsets from 0 to num_tokens={expected}, "
            f"got {qsl.tolist()[:8]}{'...' if len(qsl) > 8 else ''}"
        )
    if (q_lens > lens).any():
        s = int(np.argmax(q_lens > lens))
        fail(
            f"seq_lens: sequence {s} has {int(q_lens[s])} query tokens but seq_lens[{s}]="
            f"{int(lens[s])}; the context includes this step's tokens"
        )
    read_bounds = [int(q_lens.max()) if num_seqs else 0, int(lens.max()) if num_seqs else 0, int((q_lens > 1).sum())]
    if keep_given:
        for n, (name, bound) in enumerate(zip(_BOUNDS, given)):
            if bound is None:
                continue
            if bound < read_bounds[n]:
                fail(
                    f"{name}: {bound} is below this step's {read_bounds[n]} (read from the metadata); a bound the "
                    "plan keeps must cover it"
                )
            read_bounds[n] = bound
    return read_bounds[0], read_bounds[1], read_bounds[2], expected


def lse_output(lse: ArrayT | None, return_lse: bool, like: ArrayT, num_tokens: Any, num_q_heads: Any) -> ArrayT | None:
    """The array attention writes the log-sum-exp into: None without return_lse, the caller's
    (checked like out: shape, float32, writable) or a new one of like's kind and device."""
    if not check_lse(lse, return_lse, num_tokens, num_q_heads):
        return lse
    return same_kind_empty(like, (num_tokens, num_q_heads), "float32")


def check_lse(lse: Array | None, return_lse: bool, num_tokens: Any, num_q_heads: Any, fake: bool = False) -> bool:
    """lse's rules; returns whether one is to be allocated."""
    if not return_lse:
        if lse is not None:
            fail(
                "lse: given without return_lse=True; pass return_lse=True to have it written (and returned beside out)"
            )
        return False
    if lse is None:
        return True
    shape = (num_tokens, num_q_heads)
    require_ndim("lse", lse, 2, "[num_tokens, num_q_heads]", fake)
    require_shape("lse", lse, shape, "[num_tokens, num_q_heads]")
    require_dtype("lse", lse, ("float32",))
    require_writable("lse", lse)
    return False


def _code_views(named: tuple[tuple[int, Array, QuantMode], ...]) -> tuple[tuple[int, QuantMode], ...]:
    """(position, side's mode) of the caches stored as raw bytes (uint8), which each call views
    as the codes of its side."""
    return tuple(
        (at, side) for at, x, side in named if side.code_dtype not in (None, "uint8") and dtype_name(x) == "uint8"
    )


def _check_kv_caches(
    mode: QuantMode,
    key_cache: Array,
    value_cache: Array,
    num_kv_heads: int | None,
    head_size: int,
    dtypes: Callable[[QuantMode], tuple[str, ...]],
    layout: str,
    *,
    written: bool = False,
    fake: bool = False,
) -> tuple[int, int, int]:
    """key_cache 4-d, then key_cache and value_cache each against its side's mode (a split mode
    stores them in two formats, so in two widths and dtypes), [num_blocks, block_size,
    num_kv_heads] (None: key_cache's own) before the rows: that leading shape."""
    require_ndim("key_cache", key_cache, 4, CACHE, fake)
    num_blocks, block_size = key_cache.shape[:2]
    leading = (num_blocks, block_size, key_cache.shape[2] if num_kv_heads is None else num_kv_heads)
    named = (("key_cache", key_cache), ("value_cache", value_cache))
    for (name, cache), side in zip(named, (mode.key_side, mode.value_side), strict=True):
        shape = (*leading, side.cache_width(head_size))
        check_caches(side, ((name, cache),), shape, dtypes(side), layout, written=written, fake=fake)
    return leading


# ------------------------------------------------------------------------------------------
# The metadata tier


def _check_write(r: CacheWrite, geometry: Geometry | None, fake: bool) -> Facts:
    mode = get_kv_quant_mode(r.mode)
    key, value, key_cache, value_cache = r.key, r.value, r.key_cache, r.value_cache
    require_ndim("key", key, 3, ROWS, fake)
    if geometry is not None:
        geometry.check("key", key, ROWS)
    require_ndim("value", value, 3, ROWS, fake)
    require_dtype("key", key, FLOAT_INPUTS)
    require_shape("value", value, tuple(key.shape), "(same as key)")
    require_dtype("value", value, (dtype_name(key),))
    num_tokens, num_kv_heads, head_size = key.shape
    shape = _check_kv_caches(
        mode,
        key_cache,
        value_cache,
        num_kv_heads,
        head_size,
        lambda side: cache_dtypes(side, dtype_name(key)),
        "[num_blocks, block_size, num_kv_heads, cache width of head_size]",
        written=True,
        fake=fake,
    )
    num_blocks, block_size = shape[:2]
    require_sizes(
        "key_cache", num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size
    )
    check_slot_mapping(r.slot_mapping, num_tokens, fake)
    check_rounding(mode, r.rounding)
    require_same_device(
        {
            "key": key,
            "value": value,
            "key_cache": key_cache,
            "value_cache": value_cache,
            "slot_mapping": r.slot_mapping,
            "k_scale_cache": r.k_scale_cache,
            "v_scale_cache": r.v_scale_cache,
        }
    )
    scales = (("k_scale_cache", r.k_scale_cache), ("v_scale_cache", r.v_scale_cache))
    check_scale_caches(mode, scales, shape, written=True, fake=fake)
    statics = check_statics(mode, (("k_scale", r.k_scale, 7), ("v_scale", r.v_scale, 8)), key_cache)
    return Facts(
        host=(mode, r.rounding),
        views=_code_views(((2, key_cache, mode.key_side), (3, value_cache, mode.value_side))),
        statics=statics,
        like=2,
        table=(num_blocks, block_size),
    )


def _check_attention(r: Attention, geometry: Geometry | None, fake: bool) -> Facts:
    mode = get_kv_quant_mode(r.mode)
    check_query_options(mode, r.quantize_query, r.fp8_dots)
    query, key_cache, value_cache = r.query, r.key_cache, r.value_cache
    require_ndim("query", query, 3, QUERY_ROWS, fake)
    if geometry is not None:
        geometry.check("query", query, QUERY_ROWS)
    require_dtype("query", query, FLOAT_INPUTS)
    num_tokens, num_q_heads, head_size = query.shape
    shape = _check_kv_caches(
        mode,
        key_cache,
        value_cache,
        None,
        head_size,
        lambda side: FLOAT_INPUTS if side.code_dtype is None else code_dtypes(side),
        "[num_blocks, block_size, num_kv_heads, cache width of head_size(query)]",
        fake=fake,
    )
    num_blocks, block_size, num_kv_heads = shape
    if mode.code_dtype is None:
        require_dtype("value_cache", value_cache, (dtype_name(key_cache),))
    require_sizes(
        "key_cache", num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size
    )
    require_sizes("query", num_q_heads=num_q_heads)
    if num_q_heads % num_kv_heads:
        fail(f"query: num_q_heads {num_q_heads} must be a multiple of the cache's num_kv_heads {num_kv_heads}")
    num_seqs = check_query_start_loc(r.query_start_loc, r.seq_lens, fake)
    require_ndim("block_tables", r.block_tables, 2, "[num_seqs, max_blocks_per_seq]", fake)
    softmax_scale, sliding_window, softcap = attention_scalars(
        head_size, r.block_tables.shape[1] * block_size, r.softmax_scale, r.sliding_window, r.softcap, fake
    )
    if r.sinks is not None:
        check_sinks(r.sinks, num_q_heads, fake)
    allocate = []
    if r.out is None:
        allocate.append((6, tuple(query.shape), dtype_name(query)))
    else:
        require_ndim("out", r.out, 3, QUERY_ROWS, fake)
        require_shape("out", r.out, tuple(query.shape), "(same as query)")
        require_dtype("out", r.out, (dtype_name(query),))
        require_writable("out", r.out)
    if check_lse(r.lse, r.return_lse, num_tokens, num_q_heads, fake):
        allocate.append((12, (num_tokens, num_q_heads), "float32"))
    require_same_device(
        {
            "query": query,
            "key_cache": key_cache,
            "value_cache": value_cache,
            "block_tables": r.block_tables,
            "seq_lens": r.seq_lens,
            "query_start_loc": r.query_start_loc,
            "k_scale_cache": r.k_scale_cache,
            "v_scale_cache": r.v_scale_cache,
            "sinks": r.sinks,
            "out": r.out,
            "lse": r.lse,
        }
    )
    check_scale_caches(
        mode, (("k_scale_cache", r.k_scale_cache), ("v_scale_cache", r.v_scale_cache)), shape[:3], fake=fake
    )
    statics = check_statics(mode, (("k_scale", r.k_scale, 9), ("v_scale", r.v_scale, 10)), key_cache)
    check_block_tables(r.block_tables, r.seq_lens, block_size, fake)
    bounds = check_bounds((r.max_query_len, r.max_seq_len, r.num_prefills), num_seqs, fake)
    host = (
        mode,
        softmax_scale,
        sliding_window,
        softcap,
        *bounds,
        bool(r.batch_invariant),
        bool(r.quantize_query),
        bool(r.fp8_dots),
        bool(r.return_lse),
    )
    return Facts(
        host=host,
        views=_code_views(((1, key_cache, mode.key_side), (2, value_cache, mode.value_side))),
        statics=statics,
        allocate=tuple(allocate),
        like=1,
        table=(num_blocks, block_size),
        empty=not num_tokens,
    )


def _check_dequantize(r: Dequantize, geometry: Geometry | None, fake: bool) -> Facts:
    mode = get_kv_quant_mode(r.mode)
    if mode.split:
        fail(
            f"mode: {mode.name!r} stores keys and values in two modes and dequantize reads one cache; "
            f"pass the side's mode ({mode.key_side.name!r} for its keys, {mode.value_side.name!r} for its values)"
        )
    cache = r.cache
    require_ndim("cache", cache, 4, CACHE, fake)
    require_dtype("cache", cache, FLOAT_INPUTS if mode.code_dtype is None else code_dtypes(mode))
    require_no_negative_strides("cache", cache)
    num_blocks, block_size, num_heads, width = cache.shape
    head_size = mode.head_size_of(width)
    refusal = mode.head_size_refusal(head_size)
    if refusal:
        # The other operations meet this in mode.cache_width(head_size); here the cache is
        # all there is to tell the head size by.
        fail(f"cache: its rows of {width} elements hold a head size the mode does not take: {refusal}")
    require_sizes("cache", num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_heads, head_size=head_size)
    check_scale_caches(mode, (("scale_cache", r.scale_cache),), (num_blocks, block_size, num_heads), fake=fake)
    statics = check_statics(mode, (("scale", r.scale, 6),), cache)
    whole = r.block_tables is None
    if whole:
        if r.seq_lens is not None:
            fail("seq_lens: given without block_tables; pass both or neither")
    elif r.seq_lens is None:
        fail("seq_lens: required with block_tables")
    require_same_device(
        {"cache": cache, "scale_cache": r.scale_cache, "block_tables": r.block_tables, "seq_lens": r.seq_lens}
    )
    if r.block_tables is not None and r.seq_lens is not None:  # not whole: both given (checked above)
        check_block_tables(r.block_tables, r.seq_lens, block_size, fake)
    return Facts(
        host=(mode,),
        views=_code_views(((0, cache, mode),)),
        statics=statics,
        table=(num_blocks, block_size),
        whole=whole,
    )


def check_layer_rows(
    rows: tuple[str, Array],
    other: tuple[str, Array] | None,
    key_cache: Array,
    value_cache: Array,
    k_scale_cache: Array | None,
    v_scale_cache: Array | None,
    fake: bool = False,
) -> None:
    """What a call of a plan's layer (the step ops: kvzoo.torch_ops) can be checked for without
    its plan: rows ([num_tokens, heads, head_size]) and the second array that must match them
    (value, or out), beside the layer's caches and scale caches as every mode has them."""
    (name, x), layout = rows, (ROWS if rows[0] == "key" else QUERY_ROWS)
    require_ndim(name, x, 3, layout, fake)
    if other is not None:
        o_name, o = other
        require_ndim(o_name, o, 3, layout, fake)
        require_shape(o_name, o, tuple(x.shape), f"(same as {name})")
        require_dtype(o_name, o, (dtype_name(x),))
    require_ndim("key_cache", key_cache, 4, CACHE, fake)
    require_ndim("value_cache", value_cache, 4, CACHE, fake)
    require_shape("value_cache", value_cache, tuple(key_cache.shape), "(same as key_cache)")
    if name == "key" and key_cache.shape[2] != x.shape[1]:
        # head_size is not compared: a packed mode's cache rows need not be head_size wide.
        fail(f"key_cache: expected num_kv_heads {x.shape[1]} (key's), got shape {tuple(key_cache.shape)}")
    for s_name, sc in (("k_scale_cache", k_scale_cache), ("v_scale_cache", v_scale_cache)):
        if sc is not None:
            require_shape(s_name, sc, tuple(key_cache.shape[:3]), SCALES)


_CHECKS: dict[type, Callable[[Any, Geometry | None, bool], Facts]] = {
    CacheWrite: _check_write,
    Attention: _check_attention,
    Dequantize: _check_dequantize,
}


def check(record: Any, geometry: Geometry | None = None, fake: bool = False) -> Facts:
    """The metadata tier: every check of the record's signature (no device value read)."""
    return _CHECKS[type(record)](record, geometry, fake)


# ------------------------------------------------------------------------------------------
# A call's arrays, then the values tier


def arrays(record: Any, facts: Facts) -> tuple:
    """The record's arrays as its checked record holds them, in operand order."""
    given = record[: len(record.ARRAYS)]
    if not (facts.views or facts.statics or facts.allocate):
        return given
    operands = list(given)
    for at, side in facts.views:
        operands[at] = as_code_storage(operands[at], side)
    like = operands[facts.like]
    for at in facts.statics:
        # The signature holds a number's type, not its value: each call's is checked here.
        float32_scalar(record.ARRAYS[at], operands[at])
        operands[at] = static_array(operands[at], like)
    for at, shape, dtype in facts.allocate:
        operands[at] = same_kind_empty(record[0], shape, dtype)
    return tuple(operands)


def check_values(
    record: Any, facts: Facts, operands: tuple, validate: bool, check_finite: bool = False
) -> tuple[tuple, tuple]:
    """The values tier: (the checked record's host fields, its arrays), the bounds and the
    arrays that follow from the values (dequantize's) filled in."""
    if isinstance(record, Attention):
        return _attention_values(facts, operands, validate)
    if validate:
        for at in _given_statics(record, facts):
            check_static_value(record.ARRAYS[at], operands[at])
    if isinstance(record, CacheWrite):
        if validate:
            check_slot_values(operands[4], *facts.table)
        if check_finite:
            require_finite("key", operands[0])
            require_finite("value", operands[1])
        return facts.host, operands
    return facts.host, _dequantize_values(facts, operands)


def _given_statics(record: Any, facts: Facts) -> tuple[int, ...]:
    # Static scales given as arrays, whose values only the device holds (numbers were checked
    # with the metadata).
    if not facts.host[0].per_tensor:
        return ()
    return tuple(at for at, name in enumerate(record.ARRAYS) if name in _STATICS and at not in facts.statics)


_STATICS = ("k_scale", "v_scale", "scale")


def _attention_values(facts: Facts, operands: tuple, validate: bool) -> tuple[tuple, tuple]:
    query, _, _, block_tables, seq_lens, query_start_loc = operands[:6]
    num_blocks, block_size = facts.table
    lens_read = None
    if validate:
        for at, name in ((9, "k_scale"), (10, "v_scale")):
            if facts.host[0].per_tensor and at not in facts.statics:
                check_static_value(name, operands[at])
        lens_read = block_table_values(block_tables, seq_lens, num_blocks, block_size)
    host = facts.host
    bounds = attention_bounds(
        query_start_loc,
        seq_lens,
        int(query.shape[0]),
        validate,
        host[4:7],
        table=(int(block_tables.shape[1]), block_size),
        lens_read=lens_read,
    )
    if bounds[:3] != host[4:7]:
        host = (*host[:4], *bounds[:3], *host[7:])
    return host, operands


def _dequantize_values(facts: Facts, operands: tuple) -> tuple:
    cache, block_tables, seq_lens = operands[:3]
    num_blocks, block_size = facts.table
    if facts.whole:
        block_tables = _index_like(cache, np.arange(num_blocks, dtype=np.int32)[None, :])
        seq_lens = _index_like(cache, np.array([num_blocks * block_size], dtype=np.int32))
        check_block_tables(block_tables, seq_lens, block_size)
    # The lengths are read to size out whatever validate says (a negative one would place a
    # sequence's rows before out's first), so they and the block ids they cover (a kernel would
    # read outside the cache for one out of range) are checked whatever it says: one read more
    # in an operation that syncs anyway.
    lens_read = block_table_values(block_tables, seq_lens, num_blocks, block_size)
    lens = read_seq_lens(seq_lens, int(block_tables.shape[1]), block_size, lens_read)
    cu = np.concatenate([[0], np.cumsum(lens)])
    mode = facts.host[0]
    num_heads, head_size = int(cache.shape[2]), mode.head_size_of(int(cache.shape[3]))
    out = same_kind_empty(cache, (int(cu[-1]), num_heads, head_size), "float32")
    return (cache, block_tables, seq_lens, _index_like(cache, cu.astype(np.int64)), out, *operands[5:])


def _index_like(like: Any, values: np.ndarray) -> Any:
    if is_torch(like):
        return as_torch(values).to(like.device)
    return values
