"""The inputs of each operation, as one record per call.

The public API validates the user's arguments and builds one of these; the registry asks each
implementation whether it takes the problem; the chosen implementation receives it with its
arrays converted to the kind it works on (NumPy or torch; see Implementation.array_kind).
All array fields are views of the caller's storage: writes land in the caller's cache.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from .modes import QuantMode

Array = Any  # torch.Tensor or numpy.ndarray

OPS: tuple[str, ...] = ("reshape_and_cache", "dequantize", "paged_attention")


@functools.cache
def _array_field_names(cls: type) -> tuple[str, ...]:
    # Array fields are the ones annotated Array (possibly | None); the rest are host values.
    return tuple(f.name for f in dataclasses.fields(cls) if str(f.type).startswith("Array"))


@functools.cache
def _host_field_names(cls: type) -> tuple[str, ...]:
    array_fields = _array_field_names(cls)
    return tuple(f.name for f in dataclasses.fields(cls) if f.name not in array_fields)


@dataclass(frozen=True)
class _Problem:
    mode: QuantMode
    # Array fields the operation writes, and its index tensors (kvzoo_spec/SPEC.md section 11:
    # written arrays may alias nothing; index tensors may have any strides).
    WRITTEN: ClassVar[tuple[str, ...]] = ()
    INDICES: ClassVar[tuple[str, ...]] = ()

    @property
    def device(self) -> str:
        from .arrays import device_type

        return device_type(self._device_array())

    def _device_array(self) -> Array:
        raise NotImplementedError

    def array_fields(self) -> tuple[str, ...]:
        """Names of the fields that hold arrays (leaving out optional ones that are None)."""
        return tuple(n for n in _array_field_names(type(self)) if getattr(self, n) is not None)

    @classmethod
    def operand_names(cls) -> tuple[str, ...]:
        """Every array field, absent ones included, in declaration order: the order a prepared
        launch (Implementation.prepare) takes a problem's arrays in."""
        return _array_field_names(cls)

    def operands(self) -> tuple[Array | None, ...]:
        return tuple(getattr(self, name) for name in _array_field_names(type(self)))

    @classmethod
    def host_field_names(cls) -> tuple[str, ...]:
        return _host_field_names(cls)

    def host_fields(self) -> tuple:
        """The values of every field that is not an array (mode, bounds, options)."""
        return tuple(getattr(self, name) for name in _host_field_names(type(self)))

    def replace(self, **changes: Any) -> _Problem:
        return dataclasses.replace(self, **changes)

    def map_arrays(self, convert: Callable[[Array], Array]) -> _Problem:
        """The same problem with every array field passed through `convert` (self when that
        changes nothing: the common case, paid on every call)."""
        from .arrays import is_array

        changes = {}
        for name in _array_field_names(type(self)):
            value = getattr(self, name)
            if is_array(value) and (converted := convert(value)) is not value:
                changes[name] = converted
        return dataclasses.replace(self, **changes) if changes else self


@dataclass(frozen=True)
class CacheWrite(_Problem):
    """reshape_and_cache: quantize key/value rows [T, Hkv, D] into slots of the paged cache.

    key_cache / value_cache: [num_blocks, block_size, Hkv, D] (codes, or model dtype for
    mode none), any strides. k_scale_cache / v_scale_cache: [num_blocks, block_size, Hkv]
    float32 for per-token-head modes, else None. k_scale / v_scale: float32 [1] arrays for
    the per-tensor modes, else None. slot_mapping: [T] int32/int64; negative means skip.
    """

    key: Array
    value: Array
    key_cache: Array
    value_cache: Array
    slot_mapping: Array
    k_scale_cache: Array | None = None
    v_scale_cache: Array | None = None
    k_scale: Array | None = None
    v_scale: Array | None = None
    rounding: str = "nearest"

    WRITTEN = ("key_cache", "value_cache", "k_scale_cache", "v_scale_cache")
    INDICES = ("slot_mapping",)

    def _device_array(self) -> Array:
        return self.key_cache

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


@dataclass(frozen=True)
class Dequantize(_Problem):
    """dequantize: gather the tokens of sequences and decode them to float32.

    cache: [num_blocks, block_size, H, D]; scale_cache: [num_blocks, block_size, H] float32
    (per-token-head) or None; scale: float32 [1] (per-tensor) or None.
    block_tables: [S, max_blocks] int32; seq_lens: [S] int32; cu_seq_lens: [S+1] int32/64,
    the prefix sums of seq_lens (token offsets of each sequence in `out`).
    out: [total_tokens, H, D] float32, written by the implementation.
    """

    cache: Array
    block_tables: Array
    seq_lens: Array
    cu_seq_lens: Array
    out: Array
    scale_cache: Array | None = None
    scale: Array | None = None

    WRITTEN = ("out",)
    INDICES = ("block_tables", "seq_lens", "cu_seq_lens")

    def _device_array(self) -> Array:
        return self.cache

    @property
    def head_size(self) -> int:
        return int(self.out.shape[2])


@dataclass(frozen=True)
class Attention(_Problem):
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

    query: Array
    key_cache: Array
    value_cache: Array
    block_tables: Array
    seq_lens: Array
    query_start_loc: Array
    out: Array
    max_query_len: int
    max_seq_len: int
    softmax_scale: float
    k_scale_cache: Array | None = None
    v_scale_cache: Array | None = None
    k_scale: Array | None = None
    v_scale: Array | None = None
    sliding_window: int | None = None
    softcap: float | None = None
    sinks: Array | None = None
    # Bits of one sequence's output must not depend on the rest of the batch.
    batch_invariant: bool = False
    # int8 caches only: each query row (token, head) is replaced by its int8 per-token-head
    # round trip before QK^T (SPEC.md section 8.1), so QK^T can run on int8 tensor cores.
    quantize_query: bool = False
    # fp8 e4m3 per-token-head caches only: the query rows and the probabilities quantized to
    # e4m3, so both dot products can run on fp8 tensor cores (SPEC.md section 8.3).
    fp8_dots: bool = False
    num_prefills: int | None = None
    lse: Array | None = None

    WRITTEN = ("out", "lse")
    INDICES = ("block_tables", "seq_lens", "query_start_loc", "sinks")

    def _device_array(self) -> Array:
        return self.query

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
