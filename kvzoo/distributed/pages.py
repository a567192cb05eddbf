"""Pages: a set of sequences' cache blocks (codes and scales) apart from any cache.

What the scale-out operations move (`kvzoo.distributed.transfer`), store
(`kvzoo.distributed.persist`) and offload. A per-token-head scale belongs to one token and one
KV head, so the blocks of a set of sequences, restricted to some KV heads, carry everything
needed to read them: no side tensor, no calibration shared between the two ends.

A `Pages` holds, per layer, one flat byte buffer: the K codes, V codes, K scales and V scales of
its pages in the separate layout's order (SPEC.md section 5, `[page, offset in block, head,
...]`), each piece starting at a multiple of `ALIGN` bytes, the gaps zero. Pages read from an
inline page buffer and placed into separate tensors (or the other way) keep every code and
scale byte: both layouts are views (kvzoo.layout), and only integer views of them are copied,
so no float conversion can touch a NaN payload.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, NoReturn

import numpy as np

from ..arrays import as_torch, device_of, dtype_name, is_array, numpy_dtype, torch
from ..cache import PagedKVCache
from ..errors import KVZooInputError, fail
from ..layout import KVCacheTensors
from ..modes import MODES, get_kv_quant_mode
from ..plan import CacheSpec, _layer_of
from ..validate import float32_scalar, host_ints, int_scalar, require_array

__all__ = [
    "FORMAT_VERSION",
    "CorruptPagesError",
    "Pages",
    "PagesHeader",
    "PagesMismatchError",
    "Placement",
    "gather_pages",
    "place_pages",
]

# Version of PagesHeader and of the flat layout it implies: what a file's metadata and a
# transfer's header carry, checked before anything else is read.
FORMAT_VERSION = 1
# Every piece of a layer's buffer starts at a multiple of this: its typed views are aligned
# for any element width, and a buffer is a whole number of int64 words (its checksum's unit).
ALIGN = 16

PIECES = ("k.codes", "v.codes", "k.scales", "v.scales")
# Integer views of 1-, 2- and 4-byte elements: the pages are copied as bits, never as floats.
_RAW = {1: "uint8", 2: "int16", 4: "int32"}


class PagesMismatchError(KVZooInputError):
    """Pages that do not fit a cache (mode, head size, block size, KV heads, layers, static
    scales, format version); raised before anything is written."""


class CorruptPagesError(ValueError):
    """Stored pages that cannot be trusted (a truncated or altered file, a checksum that does
    not match); nothing was loaded or written."""


@dataclass(frozen=True)
class PagesHeader:
    """What a set of pages is: everything but the bytes.

    Attributes
    ----------
    version : int
        FORMAT_VERSION of the writer.
    mode : str
        The kvzoo mode name of the codes (``kvzoo.MODES``).
    cache_dtype : str
        dtype of the code caches the pages were read from: the mode's code dtype, or the
        model dtype for mode ``"none"``.
    block_size, head_size : int
        Tokens per page; elements per K/V row.
    kv_heads : tuple of int
        ``(start, stop)``: the model's KV heads the pages hold.
    total_kv_heads : int
        The model's KV heads (all ranks of a head-sharded cache together).
    num_layers, num_pages : int
        Layers, and pages (blocks) per layer.
    seq_lens : tuple of int
        Tokens of each sequence.
    page_tables : tuple of tuple of int
        Per sequence, the indices of its pages in order (``ceil(seq_len / block_size)`` each);
        sequences sharing a block (a common prefix) share its page.
    source_blocks : tuple of int
        The block id each page was read from (where `place_pages` puts it without an allocator).
    static_scales : tuple of (int, int), or None
        Per layer, the float32 bits of (k_scale, v_scale) for the per-tensor modes, else None.
    seq_ids : tuple, or None
        The caller's names of the sequences (ints or strs), carried through.
    layout : str
        The layout the pages were read from ("separate" or "inline"); the pages themselves are
        layout-free.
    """

    version: int
    mode: str
    cache_dtype: str
    block_size: int
    head_size: int
    kv_heads: tuple[int, int]
    total_kv_heads: int
    num_layers: int
    num_pages: int
    seq_lens: tuple[int, ...]
    page_tables: tuple[tuple[int, ...], ...]
    source_blocks: tuple[int, ...]
    static_scales: tuple[tuple[int, int], ...] | None
    seq_ids: tuple[int | str, ...] | None
    layout: str

    @property
    def num_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    def pieces(self) -> tuple[tuple[str, int, tuple[int, ...], str], ...]:
        """(name, byte offset, shape, integer dtype) of each piece of one layer's buffer."""
        mode = get_kv_quant_mode(self.mode)
        rows = (self.num_pages, self.block_size, self.num_heads)
        code_shape = (*rows, mode.cache_width(self.head_size))
        code_raw = _RAW[numpy_dtype(self.cache_dtype).itemsize]
        layout: list[tuple[str, tuple[int, ...], str]] = [
            ("k.codes", code_shape, code_raw),
            ("v.codes", code_shape, code_raw),
        ]
        if mode.per_token_head:
            layout += [("k.scales", rows, "int32"), ("v.scales", rows, "int32")]
        out, offset = [], 0
        for name, shape, raw in layout:
            out.append((name, offset, shape, raw))
            offset += _aligned(int(np.prod(shape)) * numpy_dtype(raw).itemsize)
        return tuple(out)

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer's buffer (a multiple of ALIGN)."""
        name, offset, shape, raw = self.pieces()[-1]
        return offset + _aligned(int(np.prod(shape)) * numpy_dtype(raw).itemsize)

    def with_heads(self, start: int, stop: int) -> PagesHeader:
        """The header of the same pages restricted to the model's KV heads [start, stop)."""
        return replace(self, kv_heads=(int(start), int(stop)))

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> PagesHeader:
        """Parse and check a header; a header of another FORMAT_VERSION is refused first (its
        other fields may mean something else), anything malformed raises CorruptPagesError."""
        try:
            raw = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise CorruptPagesError(f"pages header: not JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise CorruptPagesError(f"pages header: expected a JSON object, got {type(raw).__name__}")
        version = raw.get("version")
        if version != FORMAT_VERSION:
            raise PagesMismatchError(
                f"version: the pages are of format version {version!r}; this kvzoo reads version {FORMAT_VERSION}"
            )
        names = {f.name for f in fields(cls)}
        if set(raw) != names:
            raise CorruptPagesError(
                f"pages header: fields {sorted(set(raw) ^ names)} missing or unexpected (format version {version})"
            )
        try:
            header = cls(
                version=version,
                mode=_text(raw["mode"]),
                cache_dtype=_text(raw["cache_dtype"]),
                block_size=_count(raw["block_size"], 1),
                head_size=_count(raw["head_size"], 1),
                kv_heads=_pair(raw["kv_heads"]),
                total_kv_heads=_count(raw["total_kv_heads"], 1),
                num_layers=_count(raw["num_layers"], 1),
                num_pages=_count(raw["num_pages"], 0),
                seq_lens=tuple(_count(n, 0) for n in _list(raw["seq_lens"])),
                page_tables=tuple(tuple(_count(i, 0) for i in _list(row)) for row in _list(raw["page_tables"])),
                source_blocks=tuple(_count(b, 0) for b in _list(raw["source_blocks"])),
                static_scales=None
                if raw["static_scales"] is None
                else tuple(_pair(p) for p in _list(raw["static_scales"])),
                seq_ids=None if raw["seq_ids"] is None else tuple(_seq_id(s) for s in _list(raw["seq_ids"])),
                layout=_text(raw["layout"]),
            )
        except (TypeError, ValueError) as exc:
            raise CorruptPagesError(f"pages header: {exc}") from None
        header._check_consistent()
        return header

    def _check_consistent(self) -> None:
        def bad(what: str) -> NoReturn:
            raise CorruptPagesError(f"pages header: {what}")

        mode = MODES.get(self.mode)
        if mode is None:
            bad(f"unknown mode {self.mode!r}")
        if self.cache_dtype not in _CACHE_DTYPES:
            bad(f"unknown cache dtype {self.cache_dtype!r}")
        refusal = mode.head_size_refusal(self.head_size)
        if refusal:
            bad(refusal)
        start, stop = self.kv_heads
        if not 0 <= start < stop <= self.total_kv_heads:
            bad(f"kv_heads {self.kv_heads} outside [0, {self.total_kv_heads})")
        if len(self.page_tables) != len(self.seq_lens):
            bad(f"{len(self.page_tables)} page tables for {len(self.seq_lens)} sequences")
        for s, (row, n) in enumerate(zip(self.page_tables, self.seq_lens)):
            if len(row) != -(-n // self.block_size) or any(i >= self.num_pages for i in row):
                bad(f"sequence {s}: {len(row)} pages (some beyond {self.num_pages}) for {n} tokens")
        if len(self.source_blocks) != self.num_pages:
            bad(f"{len(self.source_blocks)} source blocks for {self.num_pages} pages")
        if (self.static_scales is not None) != mode.per_tensor or (
            self.static_scales is not None and len(self.static_scales) != self.num_layers
        ):
            bad(f"static scales {self.static_scales} for {self.num_layers} layers of mode {self.mode!r}")
        if self.seq_ids is not None and len(self.seq_ids) != len(self.seq_lens):
            bad(f"{len(self.seq_ids)} seq_ids for {len(self.seq_lens)} sequences")


_NO_DEVICE = "spec: kvzoo.distributed moves torch tensors; build the CacheSpec with a device ('cpu', 'cuda')"
_NO_ROWS = "rows: required with block_tables (the row each sequence's blocks go to)"
_CACHE_DTYPES = ("bfloat16", "float16", "float32", "int8", "uint8", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2")


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _text(x: Any) -> str:
    if not isinstance(x, str):
        raise TypeError(f"expected a string, got {x!r}")
    return x


def _list(x: Any) -> list:
    if not isinstance(x, list):
        raise TypeError(f"expected a list, got {type(x).__name__}")
    return x


def _count(x: Any, low: int) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < low:
        raise ValueError(f"expected an int >= {low}, got {x!r}")
    return x


def _pair(x: Any) -> tuple[int, int]:
    items = _list(x)
    if len(items) != 2:
        raise ValueError(f"expected a pair, got {x!r}")
    return (_count(items[0], 0), _count(items[1], 0))


def _seq_id(x: Any) -> int | str:
    if isinstance(x, bool) or not isinstance(x, (int, str)):
        raise TypeError(f"a sequence id is an int or a str, got {x!r}")
    return x


# ------------------------------------------------------------------------------------------
# The caches at either end.


@dataclass
class _Caches:
    """Layers of one cache as integer views, and where their KV heads sit in the model's."""

    spec: CacheSpec
    kv_heads: tuple[int, int]
    total_kv_heads: int
    layers: list[dict[str, Any]]  # piece name -> integer view [num_blocks, block_size, heads(, width)]
    static_scales: list[tuple[int, int] | None]
    device: Any  # the caches' torch.device (its index included)


def local_spec(spec: Any) -> tuple[CacheSpec, tuple[int, int], int]:
    """(the caches' own CacheSpec, their KV heads in the model's numbering, the model's KV heads)
    of a CacheSpec (all heads) or a kvzoo.distributed.HeadShard (its rank's)."""
    from .sharding import HeadShard

    if isinstance(spec, HeadShard):
        heads = spec.kv_heads
        _refuse_split(spec.spec)
        return spec.spec, (heads.start, heads.stop), spec.full.num_kv_heads
    if not isinstance(spec, CacheSpec):
        fail(f"spec: expected a kvzoo.CacheSpec or kvzoo.distributed.HeadShard, got {type(spec).__name__}")
    _refuse_split(spec)
    return spec, (0, spec.num_kv_heads), spec.num_kv_heads


def _refuse_split(spec: CacheSpec) -> None:
    # A pages buffer's header names one cache dtype and one row width for K and V.
    if spec.mode.split:
        fail(
            f"spec: mode {spec.mode.name!r} stores keys and values in two formats; kvzoo.distributed "
            "moves pages of one-format modes only (not yet split ones)"
        )


def caches_of(layers: Any, spec: Any, static_scales: Any, *, written: bool) -> _Caches:
    """Check one cache's layers against its spec and take integer views of them."""
    spec, heads, total = local_spec(spec)
    if spec.device is None:
        fail(_NO_DEVICE)
    if isinstance(layers, (KVCacheTensors, PagedKVCache)):
        layers = [layers]
    if not isinstance(layers, Sequence) or not layers:
        fail(f"layers: expected a KVCacheTensors, a PagedKVCache or a non-empty list of them, got {layers!r}")
    mode = spec.mode
    given = _static_scales_arg(static_scales, len(layers), mode)
    views, scales, device = [], [], None
    for n, item in enumerate(layers):
        own: tuple[float | None, float | None] = (None, None)
        tensors = item
        if isinstance(item, PagedKVCache):
            tensors, own = item.tensors, (item.k_scale, item.v_scale)
            if item.mode != mode:
                fail(f"layers[{n}]: a PagedKVCache of mode {item.mode.name!r}; the spec's is {mode.name!r}")
        if not isinstance(tensors, KVCacheTensors):
            fail(f"layers[{n}]: expected a KVCacheTensors or PagedKVCache, got {type(tensors).__name__}")
        if device is None:
            device = _device_of_caches(tensors.key_cache, spec)
        layer = _layer_of(tensors, spec, device)
        if written:
            layer.check_written()
        arrays = [None if a is None else as_torch(a) for a in layer.arrays]
        views.append({name: _raw(a) for name, a in zip(PIECES, arrays) if a is not None})
        scale = given[n] if given is not None else None
        if scale is None and mode.per_tensor and own != (None, None):
            scale = _scale_bits(f"layers[{n}].k_scale", own[0]), _scale_bits(f"layers[{n}].v_scale", own[1])
        scales.append(scale)
    return _Caches(spec, heads, total, views, scales, device)


def _device_of_caches(key_cache: Any, spec: CacheSpec) -> Any:
    require_array("key_cache", key_cache)
    if spec.device is None:
        fail(_NO_DEVICE)
    device, want = device_of(key_cache), torch.device(spec.device)
    if device.type != want.type or (want.index is not None and device != want):
        fail(f"key_cache: on {device}, the CacheSpec's device is {spec.device}")
    return device


def _raw(x: Any) -> Any:
    return x.view(getattr(torch, _RAW[x.element_size()]))


def _static_scales_arg(value: Any, num_layers: int, mode: Any) -> list[tuple[int, int]] | None:
    if value is None:
        return None
    if not mode.per_tensor:
        fail(f"static_scales: mode {mode.name!r} has no static scales (only the per-tensor modes do)")
    if not isinstance(value, Sequence) or len(value) != num_layers:
        fail(f"static_scales: expected one (k_scale, v_scale) pair per layer ({num_layers}), got {value!r}")
    out = []
    for n, pair in enumerate(value):
        if not isinstance(pair, Sequence) or len(pair) != 2:
            fail(f"static_scales[{n}]: expected a (k_scale, v_scale) pair, got {pair!r}")
        out.append((_scale_bits(f"static_scales[{n}][0]", pair[0]), _scale_bits(f"static_scales[{n}][1]", pair[1])))
    return out


def _scale_bits(name: str, value: Any) -> int:
    if is_array(value):
        require_array(name, value)
        values = host_ints(value).reshape(-1)
        if values.size != 1 or dtype_name(value) != "float32":
            fail(f"{name}: expected a float32 array of one element, got {dtype_name(value)} {tuple(value.shape)}")
        value = float(values[0])
    number = float32_scalar(name, value)
    return int(np.float32(number).view(np.uint32))


def _bits_scale(bits: int) -> float:
    return float(np.uint32(bits).view(np.float32))


# ------------------------------------------------------------------------------------------
# Reading pages out of a cache.


@dataclass
class Source:
    """What gather_pages and send_pages read: checked caches, the header of all their heads,
    and the block ids of the pages (int64, on the caches' device)."""

    caches: _Caches
    header: PagesHeader
    blocks: Any


def source_of(
    layers: Any,
    spec: Any,
    block_tables: Any,
    seq_lens: Any,
    seq_ids: Any,
    static_scales: Any,
) -> Source:
    caches = caches_of(layers, spec, static_scales, written=False)
    local = caches.spec
    mode = local.mode
    if mode.per_tensor and any(s is None for s in caches.static_scales):
        fail(
            f"static_scales: mode {mode.name!r} reads its pages with static scales; pass static_scales=[(k_scale, "
            "v_scale), ...] (one pair per layer), or PagedKVCache layers that hold theirs"
        )
    if (block_tables is None) != (seq_lens is None):
        fail("block_tables, seq_lens: give both (a set of sequences) or neither (the whole cache)")
    if block_tables is None:
        blocks = list(range(local.num_blocks))
        lens: list[int] = []
        tables: list[tuple[int, ...]] = []
    else:
        from ..calls import block_table_values, check_block_tables

        require_array("block_tables", block_tables)
        require_array("seq_lens", seq_lens)
        check_block_tables(block_tables, seq_lens, local.block_size)
        read = block_table_values(block_tables, seq_lens, local.num_blocks, local.block_size)
        lens = [int(n) for n in (read if read is not None else [])]
        table = host_ints(block_tables)
        # A block several sequences share (a common prefix) becomes one page they share.
        page_of: dict[int, int] = {}
        tables = []
        for s, n in enumerate(lens):
            row = [int(b) for b in table[s, : -(-n // local.block_size)]]
            tables.append(tuple(page_of.setdefault(b, len(page_of)) for b in row))
        blocks = list(page_of)
    if seq_ids is not None:
        if not isinstance(seq_ids, Sequence) or isinstance(seq_ids, str) or len(seq_ids) != len(lens):
            fail(f"seq_ids: expected one int or str per sequence ({len(lens)}), got {seq_ids!r}")
        for n, s in enumerate(seq_ids):
            if isinstance(s, bool) or not isinstance(s, (int, str)):
                fail(f"seq_ids[{n}]: expected an int or a str, got {s!r}")
        seq_ids = tuple(seq_ids)
    header = PagesHeader(
        version=FORMAT_VERSION,
        mode=mode.name,
        cache_dtype=mode.code_dtype or local.model_dtype,
        block_size=local.block_size,
        head_size=local.head_size,
        kv_heads=caches.kv_heads,
        total_kv_heads=caches.total_kv_heads,
        num_layers=len(caches.layers),
        num_pages=len(blocks),
        seq_lens=tuple(lens),
        page_tables=tuple(tables),
        source_blocks=tuple(blocks),
        static_scales=tuple(s for s in caches.static_scales if s is not None) if mode.per_tensor else None,
        seq_ids=seq_ids,
        layout=local.layout,
    )
    index = torch.tensor(blocks, dtype=torch.int64, device=caches.device)
    return Source(caches, header, index)


def gather_layer(source: Source, layer: int, header: PagesHeader, out: Any) -> None:
    """Copy one layer's pages, for header's KV heads, into `out` (a flat uint8 buffer of
    header.layer_bytes whose gaps are already zero)."""
    start, stop = header.kv_heads
    first = start - source.caches.kv_heads[0]
    heads = slice(first, first + stop - start)
    views = source.caches.layers[layer]
    for name, offset, shape, raw in header.pieces():
        piece = _piece(out, offset, shape, raw)
        torch.index_select(views[name][:, :, heads], 0, source.blocks, out=piece)


def _widest(dst: Any, src: Any) -> tuple[Any, Any]:
    """dst and src viewed through the widest integer elements both rows divide into: a CPU
    index_copy_ moves one element at a time, so 8-byte elements copy 8x faster than bytes."""
    for wide in (torch.int64, torch.int32, torch.int16):
        if wide.itemsize <= dst.element_size():
            break
        try:
            return dst.view(wide), src.view(wide)
        except RuntimeError:  # a row, a stride or an offset that the wider element does not divide
            continue
    return dst, src


def _piece(flat: Any, offset: int, shape: tuple[int, ...], raw: str) -> Any:
    count = int(np.prod(shape)) * numpy_dtype(raw).itemsize
    return flat[offset : offset + count].view(getattr(torch, raw)).view(shape)


class Pages:
    """A set of sequences' pages, per layer one flat uint8 buffer; see the module docstring.

    Built by `gather_pages`, `kvzoo.distributed.load_pages` and `recv_pages`' staging; placed
    into a cache by `place_pages`.

    Attributes
    ----------
    header : PagesHeader
    layers : tuple of torch.Tensor
        One contiguous uint8 tensor of ``header.layer_bytes`` per layer, all on one device.
    """

    __slots__ = ("header", "layers")

    def __init__(self, header: PagesHeader, layers: Sequence[Any]) -> None:
        if len(layers) != header.num_layers or any(
            tuple(t.shape) != (header.layer_bytes,) or t.dtype != torch.uint8 for t in layers
        ):
            fail(
                f"layers: expected {header.num_layers} uint8 tensors of {header.layer_bytes} bytes, got "
                f"{[(tuple(t.shape), t.dtype) for t in layers]}"
            )
        self.header = header
        self.layers = tuple(layers)

    def __repr__(self) -> str:
        h = self.header
        return (
            f"Pages({h.mode}, {len(h.seq_lens)} sequences, {h.num_pages} pages x {h.num_layers} layers, "
            f"kv_heads {h.kv_heads} of {h.total_kv_heads}, {self.nbytes} bytes on {self.device})"
        )

    @property
    def nbytes(self) -> int:
        return self.header.layer_bytes * self.header.num_layers

    @property
    def device(self) -> Any:
        return self.layers[0].device

    @property
    def pinned(self) -> bool:
        """Whether the buffers are in page-locked host memory (possible only where CUDA is)."""
        return self.layers[0].is_pinned()

    def piece(self, layer: int, name: str) -> Any:
        """A typed view of one piece: "k.codes" / "v.codes" [num_pages, block_size, heads, width]
        of the cache dtype, "k.scales" / "v.scales" float32 [num_pages, block_size, heads]."""
        for piece_name, offset, shape, raw in self.header.pieces():
            if piece_name == name:
                view = _piece(self.layers[layer], offset, shape, raw)
                kind = "float32" if name.endswith("scales") else self.header.cache_dtype
                return view.view(getattr(torch, kind))
        fail(f"name: expected one of {[p[0] for p in self.header.pieces()]}, got {name!r}")
        return None

    def to(self, device: Any, *, pin: bool = False) -> Pages:
        """A copy on `device` (pinned host memory with pin=True, which needs CUDA)."""
        device = torch.device(device)
        out = []
        for t in self.layers:
            dst = torch.empty(t.shape, dtype=torch.uint8, device=device, pin_memory=pin and device.type == "cpu")
            dst.copy_(t, non_blocking=pin or t.is_pinned())
            out.append(dst)
        if any(t.is_cuda for t in (*self.layers, *out)):
            torch.cuda.synchronize()
        return Pages(self.header, out)

    def to_host(self) -> Pages:
        """Offload: a copy in host memory, page-locked where CUDA is available (so copies back to
        the GPU run at full speed and asynchronously); on a machine without CUDA a plain copy."""
        return self.to("cpu", pin=torch.cuda.is_available())


def empty_layer(header: PagesHeader, device: Any) -> Any:
    """A layer buffer whose gaps between pieces are zero (the pieces are overwritten)."""
    return zero_gaps(torch.empty(header.layer_bytes, dtype=torch.uint8, device=device), header)


def zero_gaps(flat: Any, header: PagesHeader) -> Any:
    """Zero the bytes of a layer buffer between its pieces (a few per piece), so that no byte a
    buffer held before is sent or stored."""
    end = 0
    for _, offset, shape, raw in header.pieces():
        flat[end:offset].zero_()
        end = offset + int(np.prod(shape)) * numpy_dtype(raw).itemsize
    flat[end:].zero_()
    return flat


def gather_pages(
    layers: Any,
    spec: Any,
    block_tables: Any = None,
    seq_lens: Any = None,
    *,
    seq_ids: Sequence[int | str] | None = None,
    static_scales: Sequence[tuple[float, float]] | None = None,
) -> Pages:
    """Copy a set of sequences' pages (or the whole cache) out of a cache, on its device.

    Parameters
    ----------
    layers : KVCacheTensors, PagedKVCache, or a list of them (one per layer)
        The caches, all of `spec`.
    spec : kvzoo.CacheSpec or kvzoo.distributed.HeadShard
        What every layer's caches look like (a HeadShard: this rank's heads of a head-sharded
        cache, recorded in the pages as the model's KV heads they are).
    block_tables : array [num_seqs, max_blocks_per_seq] int32/int64, optional
        The sequences' blocks (only the first ``ceil(seq_lens[s] / block_size)`` of a row are
        read). With `seq_lens`; both None: every block of the cache, in block order.
    seq_lens : array [num_seqs] int32/int64, optional
    seq_ids : sequence of int or str, optional
        Names carried with the pages (one per sequence).
    static_scales : sequence of (k_scale, v_scale), optional
        Per layer; required for the per-tensor modes unless `layers` are PagedKVCache objects
        holding their scales. Recorded, so the receiving end can check its own.

    Returns
    -------
    Pages
        On the caches' device. ``.to_host()`` offloads them; `place_pages` puts them back.

    Examples
    --------
    >>> import torch, kvzoo
    >>> from kvzoo.distributed import gather_pages, place_pages
    >>> spec = kvzoo.CacheSpec("int8_per_token_head", num_blocks=8, block_size=4, num_kv_heads=2,
    ...                        head_size=16, model_dtype="float32")
    >>> cache = spec.allocate()
    >>> kvzoo.reshape_and_cache(torch.randn(6, 2, 16), torch.randn(6, 2, 16), cache.key_cache,
    ...                         cache.value_cache, torch.tensor([12, 13, 14, 15, 4, 5]), mode=spec.mode,
    ...                         k_scale_cache=cache.k_scale_cache, v_scale_cache=cache.v_scale_cache)
    >>> pages = gather_pages(cache, spec, torch.tensor([[3, 1]]), torch.tensor([6])).to_host()
    >>> pages.header.num_pages, pages.header.source_blocks, pages.nbytes   # 2 pages: 2 x 4 x 2 rows
    (2, (3, 1), 640)
    >>> other = kvzoo.CacheSpec("int8_per_token_head", num_blocks=8, block_size=4, num_kv_heads=2,
    ...                         head_size=16, layout="inline", model_dtype="float32")
    >>> placed = place_pages(pages, other.allocate(), other, allocate=[6, 0])
    >>> placed.block_tables.tolist(), placed.seq_lens.tolist()
    ([[6, 0]], [6])
    """
    source = source_of(layers, spec, block_tables, seq_lens, seq_ids, static_scales)
    header = source.header
    device = source.blocks.device
    out = []
    for layer in range(header.num_layers):
        flat = empty_layer(header, device)
        gather_layer(source, layer, header, flat)
        out.append(flat)
    return Pages(header, out)


# ------------------------------------------------------------------------------------------
# Placing pages into a cache.


@dataclass(frozen=True)
class Placement:
    """Where `place_pages` (or `recv_pages`) put the pages.

    Attributes
    ----------
    block_tables : torch.Tensor
        int32 [num_seqs, max pages of a sequence], the sequences' new block table rows (-1 past
        each sequence's pages), on the cache's device.
    seq_lens : torch.Tensor
        int32 [num_seqs], on the cache's device.
    block_ids : torch.Tensor
        int64 [num_pages]: the block each page went to.
    seq_ids : tuple or None
        As the pages carried them.
    static_scales : tuple of (float, float), or None
        Per layer, the (k_scale, v_scale) the pages were written with (per-tensor modes).
    """

    block_tables: Any
    seq_lens: Any
    block_ids: Any
    seq_ids: tuple[int | str, ...] | None
    static_scales: tuple[tuple[float, float], ...] | None


def check_fit(header: PagesHeader, caches: _Caches) -> str | None:
    """Why pages of `header` cannot go into `caches` (naming what differs), or None."""
    spec = caches.spec
    want = [
        ("mode", header.mode, spec.mode.name),
        ("head_size", header.head_size, spec.head_size),
        ("block_size", header.block_size, spec.block_size),
        ("total_kv_heads", header.total_kv_heads, caches.total_kv_heads),
        ("num_layers", header.num_layers, len(caches.layers)),
    ]
    if spec.mode.code_dtype is None:
        want.append(("model_dtype", header.cache_dtype, spec.model_dtype))
    for name, theirs, ours in want:
        if theirs != ours:
            return f"{name}: the pages have {theirs!r}, the cache {ours!r}"
    start, stop = caches.kv_heads
    if not header.kv_heads[0] <= start < stop <= header.kv_heads[1]:
        return f"kv_heads: the pages hold the model's KV heads {list(header.kv_heads)}, the cache needs {[start, stop]}"
    if header.static_scales is not None:
        for n, (theirs, ours) in enumerate(zip(header.static_scales, caches.static_scales)):
            if ours is not None and theirs != ours:
                return (
                    f"static_scales[{n}]: the pages were written with (k_scale, v_scale) = "
                    f"{tuple(_bits_scale(b) for b in theirs)}, the cache reads with {tuple(_bits_scale(b) for b in ours)}"
                )
    if header.num_pages > spec.num_blocks:
        return f"num_blocks: {header.num_pages} pages, the cache has {spec.num_blocks} blocks"
    return None


@dataclass
class TableArgs:
    """The receiving engine's own block table and lengths, written only with the pages."""

    block_tables: Any
    rows: list[int] | None
    seq_lens: Any

    def check(self) -> None:
        if self.block_tables is None:
            if self.rows is not None or self.seq_lens is not None:
                fail("rows, seq_lens: they say where in block_tables the sequences go; pass block_tables too")
            return
        from ..validate import INDEX_DTYPES, require_dtype, require_ndim, require_writable

        require_ndim("block_tables", self.block_tables, 2, "[max_seqs, max_blocks_per_seq]")
        require_dtype("block_tables", self.block_tables, INDEX_DTYPES)
        require_writable("block_tables", self.block_tables)
        if self.rows is None:
            fail(_NO_ROWS)
        num_rows = int(self.block_tables.shape[0])
        self.rows = [int_scalar(f"rows[{n}]", r, 0, num_rows - 1) for n, r in enumerate(self.rows)]
        if len(set(self.rows)) != len(self.rows):
            fail(f"rows: expected distinct rows, got {self.rows}")
        if self.seq_lens is not None:
            require_ndim("seq_lens", self.seq_lens, 1, "[max_seqs]")
            require_dtype("seq_lens", self.seq_lens, INDEX_DTYPES)
            require_writable("seq_lens", self.seq_lens)
            if int(self.seq_lens.shape[0]) != num_rows:
                fail(f"seq_lens: expected {num_rows} entries (one per block_tables row), got {self.seq_lens.shape[0]}")

    def refusal(self, header: PagesHeader) -> str | None:
        if self.block_tables is None:
            return None
        if self.rows is None:
            fail(_NO_ROWS)
        if len(self.rows) != len(header.seq_lens):
            return f"rows: {len(self.rows)} rows for the pages' {len(header.seq_lens)} sequences"
        width = int(self.block_tables.shape[1])
        longest = max((len(row) for row in header.page_tables), default=0)
        if longest > width:
            return f"block_tables: a sequence of the pages needs {longest} blocks, the table rows hold {width}"
        return None


Allocator = Callable[[int], Sequence[int]] | Sequence[int] | Any


def check_allocate(allocate: Any) -> None:
    if allocate is None or callable(allocate) or is_array(allocate) or isinstance(allocate, Sequence):
        return
    fail(f"allocate: expected a callable n -> n block ids, or a sequence of free block ids, got {allocate!r}")


def allocated_blocks(allocate: Any, header: PagesHeader, num_blocks: int) -> list[int]:
    """The block each page goes to, checked (distinct, in range) before anything is written."""
    n = header.num_pages
    if allocate is None:
        ids = list(header.source_blocks)
        what = "the pages' own blocks (no allocate given)"
    else:
        given = allocate(n) if callable(allocate) else allocate
        values = host_ints(given).reshape(-1) if is_array(given) else np.asarray(list(given))
        if not callable(allocate):
            if values.size < n:
                fail(f"allocate: {values.size} free blocks given, the pages need {n}")
            values = values[:n]
        if values.size != n or (values.size and not np.issubdtype(values.dtype, np.integer)):
            fail(f"allocate: expected {n} integer block ids, got {given!r}")
        ids = [int(b) for b in values]
        what = "allocate"
    if any(not 0 <= b < num_blocks for b in ids):
        fail(f"{what}: block ids must be in [0, {num_blocks}), got {ids}")
    if len(set(ids)) != len(ids):
        fail(f"{what}: block ids must be distinct, got {ids}")
    return ids


def place_pages(
    pages: Pages,
    layers: Any,
    spec: Any,
    *,
    allocate: Allocator = None,
    block_tables: Any = None,
    rows: Sequence[int] | None = None,
    seq_lens: Any = None,
    static_scales: Sequence[tuple[float, float]] | None = None,
) -> Placement:
    """Copy pages into a cache's blocks (either layout), byte for byte, and say where they went.

    Everything is checked before the first write: the pages' mode, head size, block size, KV
    heads, layer count, model dtype (mode none) and static scales against the cache, and the
    block ids `allocate` gives.

    Parameters
    ----------
    pages : Pages
        On any device (host pages are copied to the cache's device).
    layers : KVCacheTensors, PagedKVCache, or a list of them
        The receiving caches, one per layer of the pages.
    spec : kvzoo.CacheSpec or kvzoo.distributed.HeadShard
        The receiving caches' spec. A HeadShard takes its rank's heads out of pages that hold
        more (a whole-model file restored into one rank of a head-sharded cache).
    allocate : callable or sequence of int, optional
        ``allocate(n)`` returns n distinct free block ids, or a sequence of free block ids of
        which the first n are taken. Called once, after the checks. None: every page goes back
        to the block it was read from (``header.source_blocks``).
    block_tables : tensor [max_seqs, max_blocks_per_seq] int32/int64, optional
        The engine's block table: sequence s's blocks are written to row ``rows[s]`` (its first
        entries; the rest of the row is left as it is).
    rows : sequence of int, optional
        One row per sequence of the pages, with `block_tables`.
    seq_lens : tensor [max_seqs] int32/int64, optional
        The engine's lengths, written at ``rows`` likewise.
    static_scales : sequence of (k_scale, v_scale), optional
        The receiving caches' static scales (per-tensor modes), which must be the pages' own bit
        for bit; None takes the pages' (returned in the Placement).

    Returns
    -------
    Placement

    Raises
    ------
    PagesMismatchError
        The pages do not fit the cache (the message names the field).
    kvzoo.KVZooInputError
        A bad argument (`allocate`'s ids, the table arguments).
    """
    if not isinstance(pages, Pages):
        fail(f"pages: expected kvzoo.distributed.Pages, got {type(pages).__name__}")
    caches = caches_of(layers, spec, static_scales, written=True)
    tables = TableArgs(block_tables, None if rows is None else list(rows), seq_lens)
    tables.check()
    check_allocate(allocate)
    return commit(pages, caches, tables, allocate)


def commit(pages: Pages, caches: _Caches, tables: TableArgs, allocate: Any) -> Placement:
    """place_pages after its argument checks (recv_pages makes them before it receives)."""
    header = pages.header
    refusal = check_fit(header, caches) or tables.refusal(header)
    if refusal:
        raise PagesMismatchError(refusal)
    spec = caches.spec
    ids = allocated_blocks(allocate, header, spec.num_blocks)
    device = caches.device
    index = torch.tensor(ids, dtype=torch.int64, device=device)
    start = caches.kv_heads[0] - header.kv_heads[0]
    heads = slice(start, start + spec.num_kv_heads)
    for layer, views in enumerate(caches.layers):
        flat = pages.layers[layer].to(device, non_blocking=pages.layers[layer].is_pinned())
        for name, offset, shape, raw in header.pieces():
            dst, src = _widest(views[name], _piece(flat, offset, shape, raw)[:, :, heads])
            dst.index_copy_(0, index, src)
    width = max((len(row) for row in header.page_tables), default=0)
    table = np.full((len(header.seq_lens), width), -1, dtype=np.int32)
    for s, row in enumerate(header.page_tables):
        table[s, : len(row)] = [ids[i] for i in row]
    lens = np.asarray(header.seq_lens, dtype=np.int32)
    if tables.block_tables is not None:
        if tables.rows is None:
            fail(_NO_ROWS)
        engine = as_torch(tables.block_tables)
        for s, r in enumerate(tables.rows):
            row = header.page_tables[s]
            engine[r, : len(row)] = torch.as_tensor(table[s, : len(row)], device=engine.device, dtype=engine.dtype)
        if tables.seq_lens is not None:
            engine_lens = as_torch(tables.seq_lens)
            engine_lens[tables.rows] = torch.as_tensor(lens, device=engine_lens.device, dtype=engine_lens.dtype)
    return Placement(
        block_tables=torch.as_tensor(table, device=device),
        seq_lens=torch.as_tensor(lens, device=device),
        block_ids=index,
        seq_ids=header.seq_ids,
        static_scales=None
        if header.static_scales is None
        else tuple((_bits_scale(k), _bits_scale(v)) for k, v in header.static_scales),
    )
