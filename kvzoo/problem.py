"""The call records: one per operation (CacheWrite, Attention, Dequantize), holding a call's
arguments once, from the public call to the implementation that runs it.

A record's fields are the operation's arrays, in the order a prepared launch takes them
(`operand_names()`), then its mode and options. The public API fills one from its arguments
as given, where None may stand for a default, a mode for its name, a float for a static scale
and raw bytes (uint8) for a cache; kvzoo.calls checks it and returns it normalised: every
default filled in, a QuantMode, arrays throughout, caches viewed as their codes. That checked
record is what the registry asks each implementation about and what the chosen one receives,
with its arrays converted to the kind it works on (NumPy or torch; Implementation.array_kind).
All array fields are views of the caller's storage: writes land in the caller's cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from .modes import QuantMode

if TYPE_CHECKING:  # kvzoo.arrays imports torch where installed; this module does not
    from .arrays import Array

OPS: tuple[str, ...] = ("reshape_and_cache", "dequantize", "paged_attention")


if TYPE_CHECKING:  # a record is a tuple: its NamedTuple comes first in its bases
    _Tuple = tuple[Any, ...]
else:
    _Tuple = object


class _Record(_Tuple):
    """What every record answers about itself (the fields are its NamedTuple's)."""

    __slots__ = ()
    # The operation, its array fields in operand order, the ones it writes and its index tensors
    # (kvzoo_spec/SPEC.md section 11: written arrays may alias nothing; index tensors may have
    # any strides). The arrays are the record's first len(ARRAYS) fields.
    OP: str
    ARRAYS: tuple[str, ...]
    WRITTEN: tuple[str, ...]
    INDICES: tuple[str, ...]

    if TYPE_CHECKING:
        # What each record's NamedTuple gives it besides the tuple: _fields is Any because
        # each types its own as a tuple of its length, which no one declaration here matches.
        _fields: ClassVar[Any]
        _replace: Callable[..., Any]

    @property
    def device(self) -> str:
        from .arrays import device_type

        return device_type(getattr(self, self.ARRAYS[0]))

    def array_fields(self) -> tuple[str, ...]:
        """Names of the fields that hold arrays (leaving out optional ones that are None)."""
        return tuple(n for n, x in zip(self.ARRAYS, self) if x is not None)

    @classmethod
    def operand_names(cls) -> tuple[str, ...]:
        """Every array field, absent ones included, in declaration order: the order a prepared
        launch (Implementation.prepare) takes a record's arrays in."""
        return cls.ARRAYS

    def operands(self) -> tuple[Array | None, ...]:
        return self[: len(self.ARRAYS)]

    @classmethod
    def host_field_names(cls) -> tuple[str, ...]:
        return cls._fields[len(cls.ARRAYS) :]

    def host_fields(self) -> tuple:
        """The values of every field that is not an array (mode, bounds, options)."""
        return self[len(self.ARRAYS) :]

    def replace(self, **changes: Any) -> Any:
        return self._replace(**changes)

    def with_operands(self, operands: tuple) -> Any:
        """The same record with these arrays (in operand order)."""
        return tuple.__new__(type(self), (*operands, *self[len(self.ARRAYS) :]))

    def map_arrays(self, convert: Callable[[Array], Array]) -> Any:
        """The same record with every array field passed through `convert` (self when that
        changes nothing: the common case, paid on every call)."""
        from .arrays import is_array

        arrays = self[: len(self.ARRAYS)]
        converted = tuple(convert(x) if is_array(x) else x for x in arrays)
        if all(a is b for a, b in zip(arrays, converted)):
            return self
        return self.with_operands(converted)


class _CacheWrite(NamedTuple):
    key: Array
    value: Array
    key_cache: Array
    value_cache: Array
    slot_mapping: Array
    k_scale_cache: Array | None = None
    v_scale_cache: Array | None = None
    k_scale: Array | float | None = None
    v_scale: Array | float | None = None
    mode: QuantMode | str | None = None
    rounding: str = "nearest"


class CacheWrite(_CacheWrite, _Record):
    """reshape_and_cache: quantize key/value rows [T, Hkv, D] into slots of the paged cache.

    key_cache / value_cache: [num_blocks, block_size, Hkv, D] (codes, or model dtype for
    mode none), any strides. k_scale_cache / v_scale_cache: [num_blocks, block_size, Hkv]
    float32 for per-token-head modes, else None. k_scale / v_scale: float32 [1] arrays for
    the per-tensor modes, else None. slot_mapping: [T] int32/int64; negative means skip.
    """

    __slots__ = ()
    OP = "reshape_and_cache"
    ARRAYS = _CacheWrite._fields[:9]
    WRITTEN = ("key_cache", "value_cache", "k_scale_cache", "v_scale_cache")
    INDICES = ("slot_mapping",)

    @property
    def device(self) -> str:
        from .arrays import device_type

        return device_type(self.key_cache)

    @property
    def num_tokens(self) -> int:
        return int(self.key.shape[0])

    @property
    def num_kv_heads(self) -> int:
        return int(self.key.shape[1])

    @property
    def head_size(self) -> int:
        return int(self.key.shape[2])

    @property
    def block_size(self) -> int:
        return int(self.key_cache.shape[1])


class _Dequantize(NamedTuple):
    cache: Array
    block_tables: Array | None = None
    seq_lens: Array | None = None
    cu_seq_lens: Array | None = None
    out: Array | None = None
    scale_cache: Array | None = None
    scale: Array | float | None = None
    mode: QuantMode | str | None = None


class Dequantize(_Dequantize, _Record):
    """dequantize: gather the tokens of sequences and decode them to float32.

    cache: [num_blocks, block_size, H, D]; scale_cache: [num_blocks, block_size, H] float32
    (per-token-head) or None; scale: float32 [1] (per-tensor) or None.
    block_tables: [S, max_blocks] int32; seq_lens: [S] int32; cu_seq_lens: [S+1] int32/64,
    the prefix sums of seq_lens (token offsets of each sequence in `out`).
    out: [total_tokens, H, D] float32, written by the implementation.
    As called, block_tables and seq_lens None mean the whole cache; the check fills in the
    rest (cu_seq_lens and out follow from the lengths).
    """

    __slots__ = ()
    OP = "dequantize"
    ARRAYS = _Dequantize._fields[:7]
    WRITTEN = ("out",)
    INDICES = ("block_tables", "seq_lens", "cu_seq_lens")

    @property
    def head_size(self) -> int:
        assert self.out is not None  # a checked record's (kvzoo.calls allocates out)
        return int(self.out.shape[2])


class _Attention(NamedTuple):
    query: Array
    key_cache: Array
    value_cache: Array
    block_tables: Array
    seq_lens: Array
    query_start_loc: Array
    out: Array | None = None
    k_scale_cache: Array | None = None
    v_scale_cache: Array | None = None
    k_scale: Array | float | None = None
    v_scale: Array | float | None = None
    sinks: Array | None = None
    lse: Array | None = None
    mode: QuantMode | str | None = None
    softmax_scale: float | None = None
    sliding_window: int | None = None
    softcap: float | None = None
    max_query_len: int | None = None
    max_seq_len: int | None = None
    num_prefills: int | None = None
    # Bits of one sequence's output must not depend on the rest of the batch.
    batch_invariant: bool = False
    # int8 caches only: each query row (token, head) is replaced by its int8 per-token-head
    # round trip before QK^T (SPEC.md section 8.1), so QK^T can run on int8 tensor cores.
    quantize_query: bool = False
    # fp8 e4m3 per-token-head caches only: the query rows and the probabilities quantized to
    # e4m3, so both dot products can run on fp8 tensor cores (SPEC.md section 8.3).
    fp8_dots: bool = False
    # As called: whether lse is written (allocated when not given). Checked: lse is not None.
    return_lse: bool = False


class Attention(_Attention, _Record):
    """paged_attention over a varlen batch mixing prefill and decode.

    query: [T, Hq, D]; key_cache / value_cache: [num_blocks, block_size, Hkv, D];
    k_scale_cache / v_scale_cache: [num_blocks, block_size, Hkv] float32 (per-token-head);
    k_scale / v_scale: float32 [1] (per-tensor); block_tables: [S, max_blocks] int32;
    seq_lens: [S] int32 (context length including this step's query tokens);
    query_start_loc: [S+1] int32; sinks: [Hq] float32 or None; out: [T, Hq, D].
    lse: [T, Hq] float32 or None: when given, the implementation also writes each row's
    natural-log log-sum-exp of its logits, the sink's included (SPEC.md section 8.2).
    max_query_len / max_seq_len: host-side bounds (kernels size their grids from them).
    num_prefills: host-side count of sequences with more than one query token, or None when
    unknown (a bound on what a backend may stage per prefill sequence).
    Query token j of sequence s sits at position seq_lens[s] - q_len + j and attends to
    keys at positions p <= that (and > that - sliding_window when a window is set).
    """

    __slots__ = ()
    OP = "paged_attention"
    ARRAYS = _Attention._fields[:13]
    WRITTEN = ("out", "lse")
    INDICES = ("block_tables", "seq_lens", "query_start_loc", "sinks")

    @property
    def quantizes_query(self) -> bool:
        """quantize_query or fp8_dots: the query meets the cache's codes as codes of its own
        (SPEC.md 8.1, 8.3), so the dots take the codes as loaded, never fp16 operands."""
        return self.quantize_query or self.fp8_dots

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_q_heads(self) -> int:
        return int(self.query.shape[1])

    @property
    def num_kv_heads(self) -> int:
        return int(self.key_cache.shape[2])

    @property
    def head_size(self) -> int:
        return int(self.query.shape[2])

    @property
    def block_size(self) -> int:
        return int(self.key_cache.shape[1])


RECORDS: dict[str, type] = {r.OP: r for r in (CacheWrite, Dequantize, Attention)}
