"""The records the kernels take: the query, one side (keys or values) of a layer's pages, how
the write encodes a side, the step's metadata, the call's parameters and its outputs, each one
argument.

Plain NamedTuples (a module importable without numba). numba types a namedtuple as a struct of
its fields and reads a field at a constant offset, so a record compiles to the code its fields
passed one by one would, and one compiled signature still serves every layout: each array is a
flat view (strided.py) with its strides beside it. A record holds arrays and scalars only:
numba's parallel loop hands a record to its threads field by field and cannot hand on a tuple
nested in one, so strides travel as int64 arrays (the kernel reads them into registers once
per work item). Fields absent from a call (scales, sinks, lse) hold stand-ins of the same
types, so one signature serves calls with and without them.

Keys and values each come as their own Side, with its own element kind, scales and rotation:
a mode that stores them in two formats (a split mode) is a pairing of two sides, which the
kernels take as they take any other.

The kernels' entry points (write, dequantize, attention) take each record as a plain tuple of
its fields, tuple(record), and name it again on entry (Side(*side)): numba unboxes a tuple
in about half a namedtuple's time, and the launches run per layer and call.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .strided import flat


class Query(NamedTuple):
    rows: np.ndarray  # flat bits: uint16 (bf16, fp16) or uint32 (fp32)
    strides: np.ndarray  # (offset, token, head, element)
    kind: np.int64  # formats.F32 / BF16 / F16


class Rows(NamedTuple):
    """The K and V rows a write stores."""

    kind: np.int64  # formats.F32 / BF16 / F16
    key: np.ndarray  # flat bits: uint16 (bf16, fp16) or uint32 (fp32)
    key_strides: np.ndarray  # (offset, token, head, element)
    value: np.ndarray
    value_strides: np.ndarray


class Side(NamedTuple):
    """One side of a layer's pages, its keys or its values: the stored rows, their scales, and
    the format and rotation they were stored in."""

    kind: np.int64  # the element kind of codes (formats.py): a format's, or the model dtype's
    codes: np.ndarray  # flat: uint8 8-bit codes, int8 uint4 bytes (two codes each), or the model dtype's bits
    strides: np.ndarray  # (offset, block, slot, head, element)
    per_token_head: bool  # scales holds one float32 word per (block, slot, head)
    scales: np.ndarray  # flat uint32 scale words
    scale_strides: np.ndarray  # (offset, block, slot, head)
    tensor_scale: np.float32  # the static scale of a per-tensor side, else 1
    rotated: bool  # rows stored as R x (SPEC.md 3.4): signs holds the rotation's D signs
    signs: np.ndarray  # float32 +-1


class Encoding(NamedTuple):
    """How the write encodes one side's rows: the constants of its format's row (kvzoo.formats)
    and the call's rounding. Mode none's side copies its rows: it reads none of them."""

    trunc: bool
    qmax: np.float32
    qmin: np.float32
    nan_code: np.int32
    inf_pos: np.int32
    inf_neg: np.int32
    floor: np.float32


class Step(NamedTuple):
    """Which keys each query token sees, and the parallel work items (see work_items)."""

    block_tables: np.ndarray  # int64 [num_seqs, max_blocks]
    block_size: np.int64
    num_blocks: np.int64  # block ids outside [0, num_blocks) make a sequence ill-formed (SPEC.md 11.1)
    seq_lens: np.ndarray  # int64 [num_seqs]
    query_start_loc: np.ndarray  # int64 [num_seqs + 1]
    item_seq: np.ndarray  # int64 per work item: its sequence,
    item_first_token: np.ndarray  # its first query token,
    item_num_tokens: np.ndarray  # and its number of query tokens


class Params(NamedTuple):
    num_q_heads: np.int64
    num_kv_heads: np.int64
    head_size: np.int64
    softmax_scale: np.float32
    sliding_window: np.int64  # 0: no window
    softcap: np.float32  # 0: no cap
    has_sinks: bool
    sinks: np.ndarray  # float32 [num_q_heads]


class Outputs(NamedTuple):
    out: np.ndarray  # flat float32
    out_strides: np.ndarray  # (offset, token, head, element)
    has_lse: bool
    lse: np.ndarray  # flat float32
    lse_strides: np.ndarray  # (offset, token, head)


def operand(a: np.ndarray, carrier: type) -> tuple[np.ndarray, np.ndarray]:
    """(flat view of a's memory as carrier, int64 [offset, *strides] in elements)."""
    view, strides = flat(a, carrier)
    return view, np.array(strides, dtype=np.int64)


# Stand-ins for what a call lacks: never read (nor written) by the kernels.
NO_SCALES = (np.empty(1, np.uint32), np.zeros(4, np.int64))
NO_SINKS = np.zeros(1, np.float32)
NO_SIGNS = np.ones(1, np.float32)
NO_SIGNS.flags.writeable = False  # the rotations' signs are read-only too (__init__._signs)
NO_LSE = (np.empty(1, np.float32), np.zeros(3, np.int64))
