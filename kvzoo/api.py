"""The public operations: validate, build the problem record, let the registry pick, run.

Inputs may be torch tensors (CPU or GPU) or NumPy arrays (CPU); strided views (K and V
sliced out of a fused QKV projection, caches viewed out of an inline-layout buffer) are taken
as they are, never copied.

With validate=False a call whose arguments' metadata (dtypes, shapes, strides, devices, flags,
host scalars) equals one already checked goes straight to the launch that call resolved to,
checking only what its new addresses change (kvzoo/recall.py): an engine's layers pay the full
checks once per shape.

The check helpers here (check_block_tables, check_slot_values, attention_bounds, ...) are
shared with kvzoo.plan, which runs the ones that read device values once per engine step
instead of once per layer.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import memory, recall
from . import registry as _registry
from .arrays import as_numpy, as_torch, dtype_name, is_torch, same_kind_empty
from .capabilities import shares_buffer
from .modes import MODES, ROUNDINGS, QuantMode, get_kv_quant_mode
from .problem import Attention, CacheWrite, Dequantize
from .validate import (
    FLOAT_INPUTS,
    INDEX_DTYPES,
    INT32_MAX,
    as_code_storage,
    check_aliasing,
    check_query_options,
    code_dtypes,
    fail,
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
    static_scale,
    unit_index_strides,
)

Array = Any


# What a functional call chose and prepared, by everything that choice depends on: the op, the
# implementation asked for, the registry (and its generation), the problem's host fields and
# its arrays' signature (dtypes, shapes, strides, devices, alignment). A call of a signature
# met before skips the registry's selection and the implementation's per-call set-up
# (Implementation.prepare); its arguments are still checked in full. The oldest entry goes
# when full (recall.put_bounded): an engine meets a handful of signatures per model.
_PREPARED: dict[tuple, tuple[Any, _registry.Implementation, Any, bool]] = {}
_MAX_PREPARED = 256


def _run(op: str, problem: Any, impl: str | _registry.Implementation | None) -> tuple[Any, Any, bool]:
    """Check aliasing, choose, prepare (or recall both) and run; returns (the implementation
    chosen, its prepared launch or None, whether it took the problem's arrays as given)."""
    check_aliasing(problem)
    workspace = _workspace_of(impl)
    if workspace is not None:
        # The caller's buffer is written by the call: it must meet none of the call's arrays
        # (checked on every call, which is therefore never recalled).
        memory.refuse_shared("workspace", workspace, problem)
    reg = _registry.default()
    # The object the entry was made for: a key's id() cannot be reused while it is held here.
    held = impl if isinstance(impl, _registry.Implementation) else reg
    operands = problem.operands()
    key = (
        op,
        id(held),
        impl if isinstance(impl, str) else None,
        reg.generation,
        problem.host_fields(),
        _registry.prepared_signature(operands),
    )
    entry = _PREPARED.get(key)
    if entry is not None and entry[0] is held:
        _, chosen, launch, as_given = entry
        if not as_given:
            problem = _for_chosen(chosen, problem)
            operands = problem.operands()
        if launch is not None:
            launch(operands)
        else:
            chosen.run(problem)
        return chosen, launch, as_given
    chosen = reg.select(problem, op, impl)
    given = problem
    problem = _for_chosen(chosen, problem)
    launch = chosen.prepare(problem) if chosen.prepare is not None else None
    # as_given: the chosen implementation takes these arrays as they come (its array kind, unit
    # strides already), which the signature decides for every later call of the key.
    recall.put_bounded(_PREPARED, key, (held, chosen, launch, problem is given), _MAX_PREPARED)
    if launch is not None:
        launch(problem.operands())
    else:
        chosen.run(problem)
    return chosen, launch, problem is given


def _workspace_of(impl: Any) -> Any:
    """The workspace an Implementation was given with its options (TritonAttentionOptions)."""
    if not isinstance(impl, _registry.Implementation):
        return None
    return getattr(impl.options, "workspace", None)


def _recall_key(op: str, impl: Any, values: tuple) -> tuple[tuple | None, Any]:
    """(the key kvzoo.recall keeps this unvalidated call's resolution under, the object the
    entry is for: the Implementation asked for, else the registry)."""
    reg = _registry.default()
    held = impl if isinstance(impl, _registry.Implementation) else reg
    key = recall.call_key(values) if _workspace_of(impl) is None else None
    if key is None:
        return None, held
    return (op, id(held), impl if isinstance(impl, str) else None, reg.generation, key), held


def _mode_key(mode: Any) -> Any:
    # A mode as its name when it is kvzoo's own object (equal names then parse to it); any
    # other object is left for call_key to decline.
    if isinstance(mode, QuantMode) and MODES.get(mode.name) is mode:
        return mode.name
    return mode


def _recalled(entry: recall.Resolved, problem_type: type, operands: tuple) -> bool:
    """Run a recalled call with these operands; False (nothing run) when its written arrays
    meet another where the checked call's did not, which the full path then decides."""
    if not entry.disjoint(operands):
        return False
    if entry.launch is not None:
        entry.launch(operands)
    else:
        entry.chosen.run(problem_type(**dict(zip(problem_type.operand_names(), operands)), **entry.host))
    return True


def _remember(key: tuple | None, held: Any, resolved: tuple, problem: Any, given: tuple) -> None:
    """Keep a checked call's resolution where its implementation was handed the caller's own
    arrays (given, in operand order): then a later call's arguments are its operands."""
    chosen, launch, as_given = resolved
    if key is None or not as_given or not all(a is b for a, b in zip(problem.operands(), given)):
        return
    names = problem.operand_names()
    written = tuple(names.index(n) for n in problem.WRITTEN)
    host = {n: getattr(problem, n) for n in problem.host_field_names()}
    recall.remember(key, held, chosen, launch, given, written, host)


def _for_chosen(chosen: _registry.Implementation, problem: Any) -> Any:
    """The problem as `chosen` takes it: its array kind, and contiguous copies of index tensors
    it cannot step through (a copy of given shape has the same strides every time, and an
    allocation's alignment, so the signature of what it is handed follows from the caller's)."""
    convert = as_numpy if chosen.array_kind == "numpy" else as_torch
    problem = problem.map_arrays(convert)
    if chosen.index_strides == "unit":
        problem = unit_index_strides(problem)
    return problem


def cache_dtypes(mode: QuantMode, model_dtype: str) -> tuple[str, ...]:
    return (model_dtype,) if mode.code_dtype is None else code_dtypes(mode)


def check_scale_inputs(mode, like, named_caches, cache_shape3, named_static, validate, written=False):
    """Checks scale caches / static scales against the mode; returns static scales as arrays."""
    for name, sc in named_caches.items():
        if mode.per_token_head:
            if sc is None:
                fail(f"{name}: required for per-token-head mode {mode.name!r} (float32 {cache_shape3})")
            require_ndim(name, sc, 3, "[num_blocks, block_size, num_kv_heads]")
            require_dtype(name, sc, ("float32",))
            require_shape(name, sc, cache_shape3, "[num_blocks, block_size, num_kv_heads]")
            require_no_negative_strides(name, sc)
            if written:
                require_writable(name, sc)
        else:
            forbid(name, sc, mode, "only per-token-head modes keep a scale per row")
    statics = {}
    for name, s in named_static.items():
        if mode.per_tensor:
            statics[name] = static_scale(name, s, like, validate=validate)
        else:
            forbid(name, s, mode, "only fp8_per_tensor takes a static scale")
            statics[name] = None
    return statics


def check_rounding(mode: QuantMode, rounding: str) -> None:
    if rounding not in ROUNDINGS:
        fail(f"rounding: expected one of {list(ROUNDINGS)}, got {rounding!r}")
    if rounding not in mode.roundings:
        takers = [m.name for m in MODES.values() if rounding in m.roundings]
        fail(
            f"rounding: mode {mode.name!r} defines {list(mode.roundings)}, not {rounding!r} "
            f"(modes with {rounding!r}: {takers})"
        )


def check_slot_mapping_shape(slot_mapping: Array, num_tokens: int) -> None:
    require_ndim("slot_mapping", slot_mapping, 1, "[num_tokens]")
    require_dtype("slot_mapping", slot_mapping, INDEX_DTYPES)
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


def reshape_and_cache(
    key: Array,
    value: Array,
    key_cache: Array,
    value_cache: Array,
    slot_mapping: Array,
    *,
    mode: str | QuantMode,
    k_scale_cache: Array | None = None,
    v_scale_cache: Array | None = None,
    k_scale: Array | float | None = None,
    v_scale: Array | float | None = None,
    rounding: str = "nearest",
    impl: str | _registry.Implementation | None = None,
    validate: bool = True,
    check_finite: bool = False,
) -> None:
    """Quantize key/value rows [num_tokens, num_kv_heads, head_size] into their cache slots.

    slot_mapping[t] = block * block_size + offset; a negative slot skips token t. With
    validate=False no device value is read on the host (CUDA-graph safe); a negative slot is
    still skipped. check_finite=True raises instead of storing NaN/Inf rows.
    """
    memo = held = None
    if not validate and not check_finite:
        # Arguments in CacheWrite's operand order, then the host scalars.
        given = (key, value, key_cache, value_cache, slot_mapping, k_scale_cache, v_scale_cache, k_scale, v_scale)
        shared = (shares_buffer(key_cache, k_scale_cache), shares_buffer(value_cache, v_scale_cache))
        memo, held = _recall_key("reshape_and_cache", impl, (*given, _mode_key(mode), rounding, *shared))
        entry = recall.lookup(memo, held)
        if entry is not None and _recalled(entry, CacheWrite, given):
            return
    mode = get_kv_quant_mode(mode)
    require_ndim("key", key, 3, "[num_tokens, num_kv_heads, head_size]")
    require_ndim("value", value, 3, "[num_tokens, num_kv_heads, head_size]")
    require_dtype("key", key, FLOAT_INPUTS)
    require_shape("value", value, tuple(key.shape), "(same as key)")
    require_dtype("value", value, (dtype_name(key),))
    num_tokens, num_kv_heads, head_size = (int(s) for s in key.shape)
    require_ndim("key_cache", key_cache, 4, "[num_blocks, block_size, num_kv_heads, head_size]")
    num_blocks, block_size = int(key_cache.shape[0]), int(key_cache.shape[1])
    cache_shape = (num_blocks, block_size, num_kv_heads, mode.cache_width(head_size))
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        require_ndim(name, cache, 4, "[num_blocks, block_size, num_kv_heads, head_size]")
        require_shape(name, cache, cache_shape, "[num_blocks, block_size, num_kv_heads, cache width of head_size]")
        require_dtype(name, cache, cache_dtypes(mode, dtype_name(key)))
        require_writable(name, cache)
    require_sizes(
        "key_cache", num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size
    )
    key_cache, value_cache = as_code_storage(key_cache, mode), as_code_storage(value_cache, mode)
    check_slot_mapping_shape(slot_mapping, num_tokens)
    check_rounding(mode, rounding)
    require_same_device(
        {
            "key": key,
            "value": value,
            "key_cache": key_cache,
            "value_cache": value_cache,
            "slot_mapping": slot_mapping,
            "k_scale_cache": k_scale_cache,
            "v_scale_cache": v_scale_cache,
        }
    )
    statics = check_scale_inputs(
        mode,
        key_cache,
        {"k_scale_cache": k_scale_cache, "v_scale_cache": v_scale_cache},
        cache_shape[:3],
        {"k_scale": k_scale, "v_scale": v_scale},
        validate,
        written=True,
    )
    if validate:
        check_slot_values(slot_mapping, num_blocks, block_size)
    if check_finite:
        require_finite("key", key)
        require_finite("value", value)
    problem = CacheWrite(
        mode=mode,
        key=key,
        value=value,
        key_cache=key_cache,
        value_cache=value_cache,
        slot_mapping=slot_mapping,
        k_scale_cache=k_scale_cache,
        v_scale_cache=v_scale_cache,
        k_scale=statics["k_scale"],
        v_scale=statics["v_scale"],
        rounding=rounding,
    )
    resolved = _run("reshape_and_cache", problem, impl)
    if memo is not None:
        _remember(memo, held, resolved, problem, given)


def check_block_tables(block_tables, seq_lens, num_blocks, block_size, validate) -> np.ndarray | None:
    """Shapes and dtypes; with validate the values too. Returns seq_lens as read (int64), or
    None where they were not read."""
    require_ndim("block_tables", block_tables, 2, "[num_seqs, max_blocks_per_seq]")
    require_dtype("block_tables", block_tables, INDEX_DTYPES)
    require_ndim("seq_lens", seq_lens, 1, "[num_seqs]")
    require_dtype("seq_lens", seq_lens, INDEX_DTYPES)
    num_seqs, max_blocks = int(block_tables.shape[0]), int(block_tables.shape[1])
    require_shape("seq_lens", seq_lens, (num_seqs,), "[num_seqs] (one per block_tables row)")
    if max_blocks * block_size > INT32_MAX:
        fail(
            f"block_tables: {max_blocks} blocks per sequence x block_size {block_size} is more positions than "
            f"the kernels' int32 ({INT32_MAX})"
        )
    if not validate or num_seqs == 0:
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
    check_block_tables read and checked, returned as they are (one read a call)."""
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


def dequantize(
    cache: Array,
    scale_cache: Array | None = None,
    *,
    mode: str | QuantMode,
    scale: Array | float | None = None,
    block_tables: Array | None = None,
    seq_lens: Array | None = None,
    impl: str | _registry.Implementation | None = None,
    validate: bool = True,
) -> Array:
    """Decode cache codes to float32.

    Without block_tables: the whole cache, shape [num_blocks, block_size, H, D].
    With block_tables and seq_lens: the tokens of each sequence, packed in order,
    shape [sum(seq_lens), H, D].
    """
    mode = get_kv_quant_mode(mode)
    require_ndim("cache", cache, 4, "[num_blocks, block_size, num_kv_heads, head_size]")
    require_dtype("cache", cache, FLOAT_INPUTS if mode.code_dtype is None else code_dtypes(mode))
    require_no_negative_strides("cache", cache)
    num_blocks, block_size, num_heads, width = (int(s) for s in cache.shape)
    head_size = mode.head_size_of(width)
    refusal = mode.head_size_refusal(head_size)
    if refusal:
        # The other operations meet this in mode.cache_width(head_size); here the cache is
        # all there is to tell the head size by.
        fail(f"cache: its rows of {width} elements hold a head size the mode does not take: {refusal}")
    require_sizes("cache", num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_heads, head_size=head_size)
    cache = as_code_storage(cache, mode)
    statics = check_scale_inputs(
        mode,
        cache,
        {"scale_cache": scale_cache},
        (num_blocks, block_size, num_heads),
        {"scale": scale},
        validate,
    )
    whole_cache = block_tables is None
    if whole_cache:
        if seq_lens is not None:
            fail("seq_lens: given without block_tables; pass both or neither")
        block_tables = _index_like(cache, np.arange(num_blocks, dtype=np.int32)[None, :])
        seq_lens = _index_like(cache, np.array([num_blocks * block_size], dtype=np.int32))
    elif seq_lens is None:
        fail("seq_lens: required with block_tables")
    require_same_device(
        {"cache": cache, "scale_cache": scale_cache, "block_tables": block_tables, "seq_lens": seq_lens}
    )
    # The lengths are read to size out whatever validate says (a negative one would place a
    # sequence's rows before out's first), so they and the block ids they cover (a kernel would
    # read outside the cache for one out of range) are checked whatever it says: one read more
    # in an operation that syncs anyway.
    lens_read = check_block_tables(block_tables, seq_lens, num_blocks, block_size, validate=True)
    lens = read_seq_lens(seq_lens, int(block_tables.shape[1]), block_size, lens_read)
    cu = np.concatenate([[0], np.cumsum(lens)])
    total = int(cu[-1])
    out = same_kind_empty(cache, (total, num_heads, head_size), "float32")
    problem = Dequantize(
        mode=mode,
        cache=cache,
        block_tables=block_tables,
        seq_lens=seq_lens,
        cu_seq_lens=_index_like(cache, cu.astype(np.int64)),
        out=out,
        scale_cache=scale_cache,
        scale=statics["scale"],
    )
    _run("dequantize", problem, impl)
    return out.reshape(num_blocks, block_size, num_heads, head_size) if whole_cache else out


def _index_like(like: Any, values: np.ndarray) -> Any:
    if is_torch(like):
        return as_torch(values).to(like.device)
    return values


def check_query_start_loc_shape(query_start_loc: Array, seq_lens: Array) -> int:
    """Shapes of seq_lens and query_start_loc; returns num_seqs."""
    require_ndim("seq_lens", seq_lens, 1, "[num_seqs]")
    require_ndim("query_start_loc", query_start_loc, 1, "[num_seqs + 1]")
    require_dtype("query_start_loc", query_start_loc, INDEX_DTYPES)
    num_seqs = int(seq_lens.shape[0])
    require_shape("query_start_loc", query_start_loc, (num_seqs + 1,), "[num_seqs + 1]")
    return num_seqs


def check_sinks(sinks: Array, num_q_heads: int) -> None:
    require_ndim("sinks", sinks, 1, "[num_q_heads]")
    require_dtype("sinks", sinks, ("float32",))
    require_shape("sinks", sinks, (num_q_heads,), "[num_q_heads]")


def attention_scalars(
    head_size: int,
    max_positions: int,
    softmax_scale: Any,
    sliding_window: Any,
    softcap: Any,
) -> tuple[float, int | None, float | None]:
    """(softmax_scale, sliding_window, softcap) as implementations receive them.

    max_positions is max_blocks_per_seq * block_size, the longest sequence the tables hold."""
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


def attention_bounds(
    query_start_loc: Array,
    seq_lens: Array,
    num_tokens: int | None,
    validate: bool,
    max_query_len: Any = None,
    max_seq_len: Any = None,
    num_prefills: Any = None,
    *,
    table: tuple[int, int],
    keep_given: bool = False,
    lens_read: np.ndarray | None = None,
) -> tuple[int, int, int | None, int | None]:
    """(max_query_len, max_seq_len, num_prefills, num_tokens): the kernels' host-side bounds.

    Given bounds are checked as scalars. The device values are read (one synchronisation) when
    validating or when max_query_len or max_seq_len is not given, and values read are checked
    whatever validate says: the read is paid for, and a bad offset or length would put rows out
    of bounds. The bounds returned are then the ones read, or with keep_given the given ones
    where given, each checked to cover what was read (a plan keeps them: its CUDA graph replays
    under them after in-place updates). table: (max_blocks_per_seq, block_size), what a length
    may reach. num_tokens None takes the number of query tokens from query_start_loc[-1] when the
    values are read (None when they are not). lens_read: seq_lens as check_block_tables read them,
    so a validated call reads them once."""
    num_seqs = int(seq_lens.shape[0])
    given = {}
    for name, bound, high, high_name in (
        ("max_query_len", max_query_len, INT32_MAX, ""),
        ("max_seq_len", max_seq_len, INT32_MAX, ""),
        ("num_prefills", num_prefills, num_seqs, "num_seqs"),
    ):
        if bound is not None:
            given[name] = int_scalar(name, bound, 0, high, high_name)
    if not validate and max_query_len is not None and max_seq_len is not None:
        return given["max_query_len"], given["max_seq_len"], given.get("num_prefills"), num_tokens
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
    read = {
        "max_query_len": int(q_lens.max()) if num_seqs else 0,
        "max_seq_len": int(lens.max()) if num_seqs else 0,
        "num_prefills": int((q_lens > 1).sum()),
    }
    if keep_given:
        for name, bound in given.items():
            if bound < read[name]:
                fail(
                    f"{name}: {bound} is below this step's {read[name]} (read from the metadata); a bound the "
                    "plan keeps must cover it"
                )
        read.update(given)
    return read["max_query_len"], read["max_seq_len"], read["num_prefills"], expected


def paged_attention(
    query: Array,
    key_cache: Array,
    value_cache: Array,
    *,
    mode: str | QuantMode,
    block_tables: Array,
    seq_lens: Array,
    query_start_loc: Array,
    k_scale_cache: Array | None = None,
    v_scale_cache: Array | None = None,
    k_scale: Array | float | None = None,
    v_scale: Array | float | None = None,
    softmax_scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: Array | None = None,
    out: Array | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_prefills: int | None = None,
    batch_invariant: bool = False,
    quantize_query: bool = False,
    fp8_dots: bool = False,
    return_lse: bool = False,
    lse: Array | None = None,
    impl: str | _registry.Implementation | None = None,
    validate: bool = True,
) -> Array | tuple[Array, Array]:
    """Causal attention of a varlen batch (prefill chunks and decodes) over the paged cache.

    Sequence s owns query rows query_start_loc[s]:query_start_loc[s+1]; its context is
    seq_lens[s] tokens (this step's included), found through block_tables[s]. Returns `out`
    ([num_tokens, num_q_heads, head_size], query dtype). Pass max_query_len and max_seq_len
    (host ints) together with validate=False to avoid every host synchronisation; num_prefills
    (host int: sequences with more than one query token, as engines count them) then keeps the
    GPU's staged quantized prefill from sizing its workspace for every sequence. Otherwise
    all three are computed from the device values.

    quantize_query=True (int8 per-token-head caches only) quantizes each query row to int8
    the way the cache's rows are, so QK^T runs on int8 codes (int8 tensor cores on the GPU):
    faster, with the query's rounding added to the error (SPEC.md section 8.1).

    fp8_dots=True (fp8_per_token_head caches only) takes each query row as two e4m3 terms and
    rounds each row's probabilities to e4m3 per key tile, so both QK^T and P.V run on the fp8
    codes as stored (SPEC.md section 8.3): 0.4-1.2% relative error on the conformance samples.
    On the H200 it is slower than the default path today (README, known limits).

    return_lse=True returns (out, lse) instead: lse[t, h] (float32 [num_tokens, num_q_heads])
    is the natural log of sum_k exp(l_k) over the logits the row attends to (scaled and
    softcapped), plus exp(sinks[h]) when sinks are given (SPEC.md section 8.2). Partial
    results over disjoint parts of a context combine exactly with kvzoo.merge_attention_states
    (give sinks to one part only). lse: a writable float32 array to write it into (allocated
    when None); it needs return_lse=True, so that the return type follows that flag alone.
    """
    memo = held = None
    if not validate and max_query_len is not None and max_seq_len is not None:
        scalars = (_mode_key(mode), softmax_scale, sliding_window, softcap, max_query_len, max_seq_len, num_prefills)
        # Whether a cache and its scales share a buffer (the inline page) is an option the
        # registry chooses by, and no metadata of either tells it.
        flags = (batch_invariant, quantize_query, fp8_dots, return_lse, shares_buffer(key_cache, k_scale_cache))
        given = (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out)
        given += (k_scale_cache, v_scale_cache, k_scale, v_scale, sinks, lse)  # Attention's operand order
        memo, held = _recall_key("paged_attention", impl, (*given, *scalars, *flags))
        entry = recall.lookup(memo, held)
        if entry is not None:
            shape = tuple(query.shape)
            mine = (
                same_kind_empty(query, shape, dtype_name(query)) if out is None else out,
                same_kind_empty(query, shape[:2], "float32") if return_lse and lse is None else lse,
            )
            if _recalled(entry, Attention, (*given[:6], mine[0], *given[7:12], mine[1])):
                return mine if return_lse else mine[0]
    mode = get_kv_quant_mode(mode)
    check_query_options(mode, quantize_query, fp8_dots)
    require_ndim("query", query, 3, "[num_tokens, num_q_heads, head_size]")
    require_dtype("query", query, FLOAT_INPUTS)
    num_tokens, num_q_heads, head_size = (int(s) for s in query.shape)
    require_ndim("key_cache", key_cache, 4, "[num_blocks, block_size, num_kv_heads, head_size]")
    num_blocks, block_size, num_kv_heads = (int(s) for s in key_cache.shape[:3])
    cache_shape = (num_blocks, block_size, num_kv_heads, mode.cache_width(head_size))
    cache_dtypes = FLOAT_INPUTS if mode.code_dtype is None else code_dtypes(mode)
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        require_ndim(name, cache, 4, "[num_blocks, block_size, num_kv_heads, head_size]")
        require_shape(
            name, cache, cache_shape, "[num_blocks, block_size, num_kv_heads, cache width of head_size(query)]"
        )
        require_dtype(name, cache, cache_dtypes)
        require_no_negative_strides(name, cache)
    if mode.code_dtype is None:
        require_dtype("value_cache", value_cache, (dtype_name(key_cache),))
    require_sizes(
        "key_cache", num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size
    )
    require_sizes("query", num_q_heads=num_q_heads)
    if num_q_heads % num_kv_heads:
        fail(f"query: num_q_heads {num_q_heads} must be a multiple of the cache's num_kv_heads {num_kv_heads}")
    key_cache, value_cache = as_code_storage(key_cache, mode), as_code_storage(value_cache, mode)
    check_query_start_loc_shape(query_start_loc, seq_lens)
    require_ndim("block_tables", block_tables, 2, "[num_seqs, max_blocks_per_seq]")
    softmax_scale, sliding_window, softcap = attention_scalars(
        head_size, int(block_tables.shape[1]) * block_size, softmax_scale, sliding_window, softcap
    )
    if sinks is not None:
        check_sinks(sinks, num_q_heads)
    if out is None:
        out = same_kind_empty(query, tuple(query.shape), dtype_name(query))
    else:
        require_ndim("out", out, 3, "[num_tokens, num_q_heads, head_size]")
        require_shape("out", out, tuple(query.shape), "(same as query)")
        require_dtype("out", out, (dtype_name(query),))
        require_writable("out", out)
    lse = lse_output(lse, return_lse, query, num_tokens, num_q_heads)
    require_same_device(
        {
            "query": query,
            "key_cache": key_cache,
            "value_cache": value_cache,
            "block_tables": block_tables,
            "seq_lens": seq_lens,
            "query_start_loc": query_start_loc,
            "k_scale_cache": k_scale_cache,
            "v_scale_cache": v_scale_cache,
            "sinks": sinks,
            "out": out,
            "lse": lse,
        }
    )
    statics = check_scale_inputs(
        mode,
        key_cache,
        {"k_scale_cache": k_scale_cache, "v_scale_cache": v_scale_cache},
        cache_shape[:3],
        {"k_scale": k_scale, "v_scale": v_scale},
        validate,
    )
    lens_read = check_block_tables(block_tables, seq_lens, num_blocks, block_size, validate)
    max_query_len, max_seq_len, num_prefills, _ = attention_bounds(
        query_start_loc,
        seq_lens,
        num_tokens,
        validate,
        max_query_len,
        max_seq_len,
        num_prefills,
        table=(int(block_tables.shape[1]), block_size),
        lens_read=lens_read,
    )
    problem = Attention(
        mode=mode,
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        out=out,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        softmax_scale=softmax_scale,
        k_scale_cache=k_scale_cache,
        v_scale_cache=v_scale_cache,
        k_scale=statics["k_scale"],
        v_scale=statics["v_scale"],
        sliding_window=sliding_window,
        softcap=softcap,
        sinks=sinks,
        batch_invariant=bool(batch_invariant),
        quantize_query=bool(quantize_query),
        fp8_dots=bool(fp8_dots),
        num_prefills=num_prefills,
        lse=lse,
    )
    if num_tokens:
        resolved = _run("paged_attention", problem, impl)
        if memo is not None:
            _remember(memo, held, resolved, problem, (*given[:6], out, *given[7:12], lse))
    return (out, lse) if return_lse else out


def lse_output(lse: Array | None, return_lse: bool, like: Array, num_tokens: int, num_q_heads: int) -> Array | None:
    """The array attention writes the log-sum-exp into: None without return_lse, the caller's
    (checked like out: shape, float32, writable) or a new one of like's kind and device."""
    if not return_lse:
        if lse is not None:
            fail(
                "lse: given without return_lse=True; pass return_lse=True to have it written (and returned beside out)"
            )
        return None
    shape = (num_tokens, num_q_heads)
    if lse is None:
        return same_kind_empty(like, shape, "float32")
    require_ndim("lse", lse, 2, "[num_tokens, num_q_heads]")
    require_shape("lse", lse, shape, "[num_tokens, num_q_heads]")
    require_dtype("lse", lse, ("float32",))
    require_writable("lse", lse)
    return lse
