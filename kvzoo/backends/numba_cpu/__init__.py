"""Numba CPU backend: reshape_and_cache, dequantize and paged attention, every mode.

Registered as "numba" (platform "cpu"). Kernels (kernels.py) compile on first use and are
cached on disk (numba cache=True), so later processes load them instead of compiling.

Setting the environment variable KVZOO_DISABLE_NUMBA=1 makes the backend report itself
unavailable (as if numba were not installed), so the registry falls back to NumPy; tests use it.
The first use on a machine compiles for about a minute (each input dtype once): a one-line
notice says so, and `kvzoo warmup` (warmup() here) compiles everything ahead.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from ...capabilities import ALL_OPTIONS, Capabilities
from ...modes import MODES, rht_signs
from ...registry import Implementation, modes_for_formats
from .formats import FORMAT_KINDS, U4
from .records import NO_LSE, NO_SCALES, NO_SIGNS, NO_SINKS, Encoding, Params, Side, Step, operand
from .strided import KINDS, flat, flat_view, stride_problem

NAME = "numba"
PRIORITY = 50
DISABLE_ENV = "KVZOO_DISABLE_NUMBA"
# Compiling every kernel (`kvzoo warmup` on a cold cache) is minutes of LLVM work per signature
# family, so a small, shared machine is the case to quote; a first call compiles only its own
# signatures. (The figure behind it: bench/archive/RESULTS-history.md.)
COMPILE_ESTIMATE = "up to about 10 minutes on a busy 2-core machine"
log = logging.getLogger(__name__)
# Query tokens per attention work item in prefill: rows = tokens x group, about 64 rows keeps
# each decoded K/V tile reused across many dot products while leaving enough items to share.
_PREFILL_ROWS = 64
# fp32 dot products and online softmax over up to ~100K keys: measured ~1e-6; bound loosely.
ATTENTION_RTOL = 2e-5


def _modes(op: str) -> frozenset[str]:
    """The modes registered for op: those whose formats are in the backend's table, each side's
    (the kernels take keys and values each in its own format, so a split mode is a pairing of
    sides they take). The kernels rotate uint4 rows only: a mode rotating another format's rows
    is left out."""
    return frozenset(
        name
        for name in modes_for_formats(FORMAT_KINDS, op)
        if all(
            side.rotation is None or FORMAT_KINDS[side.code_format.name] == U4
            for side in (MODES[name].key_side, MODES[name].value_side)
        )
    )


@functools.cache
def _numba_installed() -> bool:
    # find_spec walks sys.path (about 36 us): once per process, since selection asks per call.
    return importlib.util.find_spec("numba") is not None


def unavailable() -> list[str]:
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return [f"numba: disabled by {DISABLE_ENV}={os.environ[DISABLE_ENV]}"]
    # A None entry in sys.modules blocks the import (tests fake an uninstalled numba so): a
    # dictionary look-up, seen before the cached path walk could answer for it.
    if sys.modules.get("numba", True) is None or not _numba_installed():
        return ["numba: not installed (pip install numba)"]
    return []


_announced = False


def _announce_compile() -> None:
    global _announced
    if _announced:
        return
    _announced = True
    # A warning, so Python's last-resort handler shows it where the application set up no
    # logging: a first call that sits for minutes must say why.
    log.warning(
        "compiling the numba CPU kernels: the first use on this machine takes %s (cached on disk "
        "after that). `kvzoo warmup` compiles them ahead; %s=1 uses NumPy instead.",
        COMPILE_ESTIMATE,
        DISABLE_ENV,
    )


def _listen_for_compiles(kernels_module: str) -> None:
    """Announce the first compile of a kvzoo kernel when it starts.

    Numba broadcasts "numba:compile" (numba.core.event, its documented listener API) only when a
    signature is neither compiled in this process nor found in the on-disk cache, so a warm cache
    stays silent without kvzoo predicting where Numba keeps its files."""
    from numba.core import event

    class CompileNotice(event.Listener):
        def on_start(self, ev: event.Event) -> None:
            dispatcher = ev.data.get("dispatcher") if isinstance(ev.data, dict) else None
            if getattr(getattr(dispatcher, "py_func", None), "__module__", None) == kernels_module:
                _announce_compile()

        def on_end(self, ev: event.Event) -> None:
            pass

    event.register("numba:compile", CompileNotice())


@functools.cache
def _kernels() -> Any:
    from . import kernels

    _listen_for_compiles(kernels.__name__)
    return kernels


def _f32(x: Any) -> np.float32:
    return np.float32(np.asarray(x).reshape(-1)[0])


def _strided_reasons(problem: Any, names: tuple[str, ...]) -> list[str]:
    # kvzoo.arrays (torch, ml_dtypes) where a call needs it: registering, and `kvzoo list`, import this module.
    from ...arrays import dtype_name

    reasons = []
    for name in names:
        a = getattr(problem, name)
        if a is None:
            continue
        # torch strides count elements, so only NumPy views can be misaligned.
        why = stride_problem(name, a) if isinstance(a, np.ndarray) else None
        if why:
            reasons.append(why)
        elif dtype_name(a) not in KINDS:
            reasons.append(f"numba: {name} dtype {dtype_name(a)} is not supported")
    return reasons


@functools.cache
def _signs(head_size: int) -> np.ndarray:
    # Read-only like NO_SIGNS whatever rht_signs returns: numba types read-only arrays apart,
    # and one type keeps one compiled attention signature for the rotated and unrotated modes.
    signs = rht_signs(head_size).view()
    signs.flags.writeable = False
    return signs


def _rotation(mode: Any, head_size: int) -> tuple[bool, np.ndarray]:
    """(whether the side's rows are stored rotated, the rotation's signs) for its Side."""
    if mode.rotation is None:
        return False, NO_SIGNS
    if mode.rotation != "rht":
        raise NotImplementedError(f"numba: rotation {mode.rotation!r}")
    return True, _signs(head_size)


def _positions(p: Any) -> dict[str, int]:
    """Each operand's position in p's operand order, the order a prepared launch is handed."""
    return {name: i for i, name in enumerate(type(p).operand_names())}


_UNIT = np.float32(1.0)
# Each side's operands in a write's or attention's record: its pages, their per-row scales and
# its static scale; a dequantize reads one side, under names of its own.
_KEYS = ("key_cache", "k_scale_cache", "k_scale")
_VALUES = ("value_cache", "v_scale_cache", "v_scale")
_ONE_SIDE = ("cache", "scale_cache", "scale")


def _side(p: Any, mode: Any, names: tuple[str, str, str]) -> Callable[[tuple], tuple]:
    """One side of p's pages (stored in the one-sided mode `mode`; operands names: its pages,
    scale cache, static scale) as the kernels' record, a Side as a plain tuple (records.py), for
    any problem of p's signature: a function of the call's operands (p's operand order). What
    the signature fixes (kind, carrier, strides, the rotation) is worked out once, here.
    Per-token-head sides give a flat uint32 view of their scale cache, per-tensor ones their
    static scale, read per call; the other stays a stand-in the kernels never touch."""
    at = _positions(p)
    pages, scale_cache, static = (at[n] for n in names)
    kind, carrier = _cache_kind(mode, getattr(p, names[0]))
    kind_code = np.int64(kind)
    strides = operand(getattr(p, names[0]), carrier)[1]
    per_token_head = mode.per_token_head
    rotation = _rotation(mode, p.head_size)
    if per_token_head:
        scale_strides = operand(getattr(p, names[1]), np.uint32)[1]
    elif mode.code_dtype is not None and not mode.per_tensor:
        # The write stores a row's scale for every side that is not per tensor: handed the
        # shared stand-in, such a side would write into it from every thread.
        raise NotImplementedError(f"numba: mode {mode.name!r} has neither per-row nor static scales")
    else:
        scale_strides = NO_SCALES[1]

    def side(operands: tuple) -> tuple:
        scales = flat_view(operands[scale_cache], np.uint32) if per_token_head else NO_SCALES[0]
        tensor_scale = _f32(operands[static]) if mode.per_tensor else _UNIT
        codes = flat_view(operands[pages], carrier)
        return tuple(Side(kind_code, codes, strides, per_token_head, scales, scale_strides, tensor_scale, *rotation))

    return side


def _sides(p: Any) -> Callable[[tuple], tuple[tuple, tuple]]:
    """The key and the value side of a write or attention problem (_side), each in its own
    side's mode: a split mode pairs two."""
    keys, values = _side(p, p.mode.key_side, _KEYS), _side(p, p.mode.value_side, _VALUES)
    return lambda operands: (keys(operands), values(operands))


def _encoding(mode: Any, rounding: str) -> tuple:
    """How the write encodes a side stored in the one-sided mode `mode` (its format's row): an
    Encoding as a plain tuple (records.py)."""
    inf_pos, inf_neg = mode.inf_codes
    encoding = Encoding(
        rounding == "trunc", np.float32(mode.qmax), np.float32(mode.qmin), np.int32(mode.nan_code),
        np.int32(inf_pos), np.int32(inf_neg), np.float32(mode.scale_floor),
    )  # fmt: skip
    return tuple(encoding)


# ----------------------------------------------------------------------------------------------
# reshape_and_cache
# ----------------------------------------------------------------------------------------------

_WRITE_ARRAYS = ("key", "value", "key_cache", "value_cache", "k_scale_cache", "v_scale_cache")


def _nothing(operands: tuple) -> None:
    return None


def prepare_reshape_and_cache(p: Any) -> Callable[[tuple], None]:
    """The launch of p's write for every problem of its signature and host fields
    (Implementation.prepare): element kinds, strides and each side's constants are worked out
    once; a call makes its arrays' flat views and runs the kernel."""
    if p.num_tokens == 0:
        return _nothing
    from ...arrays import dtype_name

    k = _kernels()
    at = _positions(p)
    kind_code, carrier = KINDS[dtype_name(p.key)]
    kind = np.int64(kind_code)
    key_strides, value_strides = operand(p.key, carrier)[1], operand(p.value, carrier)[1]
    at_key, at_value = at["key"], at["value"]
    sides = _sides(p)
    encodings = (_encoding(p.mode.key_side, p.rounding), _encoding(p.mode.value_side, p.rounding))
    sizes = (
        np.int64(p.key_cache.shape[0] * p.block_size),
        np.int64(p.block_size),
        np.int64(p.num_kv_heads),
        np.int64(p.head_size),
    )

    def rows(operands: tuple) -> tuple:
        # Rows' fields, as the kernel takes a record (records.py): built per call, so directly.
        key, value = flat_view(operands[at_key], carrier), flat_view(operands[at_value], carrier)
        return kind, key, key_strides, value, value_strides

    def fixed(operands: tuple) -> tuple:
        slots = np.ascontiguousarray(operands[at["slot_mapping"]], dtype=np.int64)
        return (*sides(operands), *encodings, slots, *sizes)

    return _write_launch(at, rows, fixed, lambda r, f: k.write(r, *f))


def _write_launch(
    at: dict[str, int],
    rows: Callable[[tuple], tuple],
    fixed: Callable[[tuple], tuple],
    kernel: Callable[[tuple, tuple], None],
) -> Callable[[tuple], None]:
    """A write's launch: the kernel on the call's rows (views and strides) and on the rest of
    its arguments (fixed(operands)), with the hold hook
    (Implementation.prepare) that works out the rest once for a layer whose rows alone change."""

    def launch(operands: tuple) -> None:
        kernel(rows(operands), fixed(operands))

    def hold(operands: tuple, varying: tuple[str, ...]) -> Callable[[tuple], None] | None:
        if not set(varying) <= {"key", "value"}:
            return None
        # A converted slot mapping would not see the caller refill its own.
        slot_mapping = operands[at["slot_mapping"]]
        if np.ascontiguousarray(slot_mapping, dtype=np.int64) is not slot_mapping:
            return None
        args = fixed(operands)
        return lambda operands: kernel(rows(operands), args)

    launch.hold = hold  # type: ignore[attr-defined]
    return launch


def run_reshape_and_cache(p: Any) -> None:
    prepare_reshape_and_cache(p)(p.operands())


def write_reasons(p: Any) -> list[str]:
    # Mode none's equal key/cache dtypes are checked once, in kvzoo.api.
    return _strided_reasons(p, _WRITE_ARRAYS)


# ----------------------------------------------------------------------------------------------
# dequantize
# ----------------------------------------------------------------------------------------------


def _cache_kind(mode: Any, cache: np.ndarray) -> tuple[int, type]:
    """(element kind, carrier) of a cache. uint4 bytes travel as int8, 8-bit codes as uint8:
    the carrier is part of the compiled signature, so each kernel compiles the uint4 paths only
    where a uint4 cache can reach them, and the 8-bit ones only where 8-bit codes can."""
    if mode.code_dtype is None:
        return KINDS[np.dtype(cache.dtype).name]
    kind = FORMAT_KINDS[mode.format.name]
    return kind, (np.int8 if kind == U4 else np.uint8)


def run_dequantize(p: Any) -> None:
    k = _kernels()
    if p.out.size == 0:
        return
    out, ost = flat(p.out, np.float32)
    k.dequantize(
        _side(p, p.mode, _ONE_SIDE)(p.operands()),
        np.ascontiguousarray(p.block_tables, dtype=np.int64),
        np.ascontiguousarray(p.cu_seq_lens, dtype=np.int64),
        out,
        ost,
        np.int64(p.cache.shape[2]),
        np.int64(p.head_size),
        np.int64(p.cache.shape[1]),
    )


def dequantize_reasons(p: Any) -> list[str]:
    from ...arrays import dtype_name

    reasons = _strided_reasons(p, ("cache", "scale_cache", "out"))
    if dtype_name(p.out) != "float32":
        reasons.append(f"numba: dequantize writes float32, out is {dtype_name(p.out)}")
    return reasons


# ----------------------------------------------------------------------------------------------
# paged_attention
# ----------------------------------------------------------------------------------------------


def work_items(query_start_loc: np.ndarray, block_tokens: int, costs_from: np.ndarray, num_tokens: int):
    """Query blocks (seq, first token, count), heaviest first, so no thread is left with the
    last long causal block while the other idles. Only rows in [0, num_tokens) are placed,
    whatever query_start_loc says (SPEC.md 11.1)."""
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    if qsl.size > 1 and qsl[0] >= 0 and qsl[-1] <= num_tokens:
        # A decode step: one item a sequence (what the general form below gives).
        items = _kernels().decode_work_items(qsl, np.asarray(costs_from, dtype=np.int64))
        if items is not None:
            return items
    qlens = qsl[1:] - qsl[:-1]
    begin = np.clip(qsl[:-1], 0, num_tokens)
    end = np.maximum(np.clip(qsl[1:], 0, num_tokens), begin)
    nblk = -(-(end - begin) // block_tokens)
    seq = np.repeat(np.arange(qlens.shape[0], dtype=np.int64), nblk)
    first = np.concatenate([[0], np.cumsum(nblk)[:-1]]).astype(np.int64) if len(nblk) else nblk
    within = np.arange(seq.shape[0], dtype=np.int64) - np.repeat(first, nblk)
    t0 = begin[seq] + within * block_tokens
    nq = np.minimum(block_tokens, end[seq] - t0)
    # Keys a block reads ~ its last query position; rows ~ nq.
    ctx = np.asarray(costs_from, dtype=np.int64)[seq] - (qsl[seq + 1] - t0 - nq)
    order = np.argsort(-(ctx * nq), kind="stable")
    return seq[order], t0[order], nq[order]


def prepare_paged_attention(p: Any) -> Callable[[tuple], None]:
    """The launch of p's attention for every problem of its signature and host fields
    (Implementation.prepare): element kinds, strides and the parameters are worked out once; a
    call makes its arrays' flat views, reads its metadata (the work items follow the lengths)
    and runs the kernel."""
    if p.query.shape[0] == 0:
        return _nothing
    from ...arrays import dtype_name

    k = _kernels()
    at = _positions(p)
    q_kind, q_carrier = KINDS[dtype_name(p.query)]
    query_kind = np.int64(q_kind)
    q_strides = operand(p.query, q_carrier)[1]
    sides = _sides(p)
    geometry = (np.int64(p.block_size), np.int64(p.key_cache.shape[0]))
    group = p.num_q_heads // p.num_kv_heads
    block_tokens = 1 if p.max_query_len <= 1 else max(1, _PREFILL_ROWS // group)
    scalars = (
        np.int64(p.num_q_heads),
        np.int64(p.num_kv_heads),
        np.int64(p.head_size),
        np.float32(p.softmax_scale),
        np.int64(p.sliding_window or 0),
        np.float32(p.softcap or 0.0),
    )
    has_sinks, has_lse = p.sinks is not None, p.lse is not None
    direct = dtype_name(p.out) == "float32"
    out_shape = p.out.shape
    num_tokens = int(out_shape[0])
    out_strides = operand(p.out if direct else np.empty(out_shape, np.float32), np.float32)[1]
    lse_strides = operand(p.lse, np.float32)[1] if has_lse else NO_LSE[1]

    def metadata(operands: tuple) -> tuple[np.ndarray, ...]:
        return tuple(np.ascontiguousarray(operands[at[name]], dtype=np.int64) for name in _METADATA)

    def params(operands: tuple) -> Params:
        sinks = np.ascontiguousarray(operands[at["sinks"]], dtype=np.float32) if has_sinks else NO_SINKS
        return Params(*scalars, has_sinks, sinks)

    def attend(operands: tuple, paged: tuple[tuple, tuple], tables: tuple, call_params: Params) -> None:
        block_tables, seq_lens, qsl = tables
        step = Step(block_tables, *geometry, seq_lens, qsl, *work_items(qsl, block_tokens, seq_lens, num_tokens))
        out = operands[at["out"]]
        out32 = out if direct else np.empty(out_shape, np.float32)
        lse = flat_view(operands[at["lse"]], np.float32) if has_lse else NO_LSE[0]
        # Query's and Outputs' fields, as the kernel takes a record (records.py): built per
        # call, so directly.
        query = flat_view(operands[at["query"]], q_carrier), q_strides, query_kind
        outputs = flat_view(out32, np.float32), out_strides, has_lse, lse, lse_strides
        k.attention(query, *paged, tuple(step), tuple(call_params), outputs)
        if not direct:
            _copy_owned_rows(out, out32, qsl, step)

    def launch(operands: tuple) -> None:
        attend(operands, sides(operands), metadata(operands), params(operands))

    def hold(operands: tuple, varying: tuple[str, ...]) -> Callable[[tuple], None] | None:
        # The cache's record and the parameters once; the metadata's arrays only where they are
        # the caller's own (a converted copy would not see the caller refill them); the work
        # items follow the lengths, so every call makes its own.
        if not set(varying) <= {"query", "out", "lse"}:
            return None
        tables = metadata(operands)
        if any(mine is not operands[at[name]] for mine, name in zip(tables, _METADATA)):
            return None
        paged, call_params = sides(operands), params(operands)
        if has_sinks and call_params.sinks is not operands[at["sinks"]]:
            return None
        return lambda operands: attend(operands, paged, tables, call_params)

    launch.hold = hold  # type: ignore[attr-defined]
    return launch


_METADATA = ("block_tables", "seq_lens", "query_start_loc")


def _copy_owned_rows(out: np.ndarray, out32: np.ndarray, qsl: np.ndarray, step: Step) -> None:
    """out's rows from the kernel's float32 ones: all of them where the offsets cover the query
    (every call the API checked), else only the rows the work items computed, so a row no
    sequence owns keeps its bytes (SPEC.md 11.1)."""
    if qsl.size and qsl[0] == 0 and qsl[-1] == out.shape[0]:
        out[...] = out32
        return
    counts = step.item_num_tokens
    firsts = np.repeat(step.item_first_token - np.cumsum(counts) + counts, counts)
    rows = firsts + np.arange(int(counts.sum()), dtype=np.int64)
    out[rows] = out32[rows]


def run_paged_attention(p: Any) -> None:
    prepare_paged_attention(p)(p.operands())


def attention_reasons(p: Any) -> list[str]:
    return _strided_reasons(p, ("query", "key_cache", "value_cache", "k_scale_cache", "v_scale_cache", "out", "lse"))


# ----------------------------------------------------------------------------------------------


def register(registry: Any) -> None:
    def add(op: str, run: Callable[[Any], None], **fields: Any) -> None:
        registry.add(
            Implementation(
                name=NAME,
                op=op,
                platform="cpu",
                modes=_modes(op),
                run=run,
                array_kind="numpy",
                devices=frozenset({"cpu"}),
                priority=PRIORITY,
                unavailable=unavailable,
                **{"capabilities": Capabilities(formats=FORMAT_KINDS), **fields},
            )
        )

    add(
        "reshape_and_cache",
        run_reshape_and_cache,
        prepare=prepare_reshape_and_cache,
        problem_reasons=write_reasons,
        notes="rounding=trunc, inline_layout, any strides; parallel over tokens x heads",
    )
    add("dequantize", run_dequantize, problem_reasons=dequantize_reasons, notes="inline_layout, any strides")
    add(
        "paged_attention",
        run_paged_attention,
        prepare=prepare_paged_attention,
        problem_reasons=attention_reasons,
        attention_rtol=ATTENTION_RTOL,
        notes="varlen, causal, GQA/MQA, sliding window, softcap, sinks; batch invariant",
        # quantize_query and fp8_dots are not implemented here: impl "numpy" runs them on the CPU.
        capabilities=Capabilities(ALL_OPTIONS - {"quantize_query", "fp8_dots"}, formats=FORMAT_KINDS),
    )
