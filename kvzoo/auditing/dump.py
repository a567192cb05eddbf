"""The cache dump: a paged cache and its metadata as one dict, on disk a `torch.save` file.

The dict (README, "Auditing a cache") is what `kvzoo audit FILE` reads and what an engine's
tensors can be written into by hand::

    {"mode": str, "layout": "separate" | "inline", "block_size": int,
     "block_tables": int [S, M], "seq_lens": int [S],
     "layers": [{"key_cache", "value_cache", "k_scale_cache", "v_scale_cache"}, ...]}

Scale caches appear exactly for the per-token-head modes; the per-tensor modes give each layer
"k_scale" and "v_scale" (one float32 each). An inline layer gives "buffer" instead: vLLM's page,
uint8 [num_blocks, 2, block_size, num_kv_heads, head_size + 4], or an aligned page (rows padded
to a multiple of 16 bytes: kvzoo.allocate_inline's row_align), which needs "head_size" (an int)
in the dict: a padded row's length does not tell it. Optional: "rounding" ("trunc"
for vLLM's old int8 store; "nearest" when absent) and, per layer, "key" / "value": the
unquantized K/V of the live tokens, [sum(seq_lens), num_kv_heads, head_size] in sequence order
(what dequantize returns), to measure the cache against.

`read_dump` checks a dict and returns a `CacheDump` of NumPy views: a CPU tensor or array is
read in place (a GPU tensor is copied to the host), so an engine's tensors are audited without
copies. Every refusal is a `CacheDumpError` naming the key, what was expected and what was found.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from ..arrays import as_numpy, as_torch, dtype_name, is_array, is_torch, torch
from ..errors import KVZooInputError
from ..layout import SCALE_BYTES, KVCacheTensors, inline_views
from ..modes import QuantMode, get_kv_quant_mode
from ..validate import FLOAT_INPUTS, INDEX_DTYPES

LAYOUTS = ("separate", "inline")
_SCALE_CACHES = ("k_scale_cache", "v_scale_cache")
_STATIC_SCALES = ("k_scale", "v_scale")
_REFERENCES = ("key", "value")


class CacheDumpError(KVZooInputError):
    """A cache dump (file or dict) that cannot be read as one: a missing key, a wrong dtype, a
    shape that does not fit the mode or the other tensors. The message names the key."""


@dataclass(frozen=True)
class LayerPages:
    """One layer of a dump, as host arrays.

    key_cache / value_cache: uint8 [num_blocks, block_size, H, W] code bytes (W the mode's cache
    width), or the model dtype's values for mode none. k_scale_cache / v_scale_cache: float32
    [num_blocks, block_size, H] scale words (per-token-head modes), else None. k_scale /
    v_scale: the per-tensor modes' static scales (float32), else None. key / value: the
    reference K/V [sum(seq_lens), H, D] (float), or None. buffer: the inline page, or None.
    """

    key_cache: np.ndarray
    value_cache: np.ndarray
    k_scale_cache: np.ndarray | None
    v_scale_cache: np.ndarray | None
    k_scale: np.float32 | None
    v_scale: np.float32 | None
    head_size: int
    key: np.ndarray | None = None
    value: np.ndarray | None = None
    buffer: np.ndarray | None = None

    @property
    def num_kv_heads(self) -> int:
        return int(self.key_cache.shape[2])

    def cache(self, which: str) -> tuple[np.ndarray, np.ndarray | None, np.float32 | None, np.ndarray | None]:
        """(codes, scale words, static scale, reference) of "key" or "value"."""
        if which == "key":
            return self.key_cache, self.k_scale_cache, self.k_scale, self.key
        return self.value_cache, self.v_scale_cache, self.v_scale, self.value


@dataclass(frozen=True)
class CacheDump:
    """A checked dump: the mode, the geometry, the block tables and every layer's pages.

    block_tables: int64 [S, M]; seq_lens: int64 [S] (as given: values are the audit's to judge).
    """

    mode: QuantMode
    layout: str
    rounding: str
    block_size: int
    num_blocks: int
    block_tables: np.ndarray
    seq_lens: np.ndarray
    layers: tuple[LayerPages, ...]

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])


def _fail(message: str) -> NoReturn:
    raise CacheDumpError(message)


def _host(name: str, value: Any) -> np.ndarray:
    """A NumPy view of a CPU tensor or array (a GPU tensor copied to the host)."""
    if not is_array(value):
        _fail(f"{name}: expected a tensor or array, got {type(value).__name__}")
    if is_torch(value):
        value = value.detach()
        if value.device.type != "cpu":
            value = value.to("cpu")
        if value.layout is not torch.strided:
            _fail(f"{name}: expected a dense (strided) tensor, got layout {value.layout}")
        if value.is_neg() or value.is_conj():
            value = value.resolve_neg().resolve_conj()
    return as_numpy(value)


def _shape_text(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def _require(name: str, array: np.ndarray, dtypes: Sequence[str], shape: Sequence[int] | None, layout: str) -> None:
    got = dtype_name(array)
    if got not in dtypes:
        _fail(f"{name}: expected dtype {' or '.join(dtypes)} {layout}, got {got} {_shape_text(array.shape)}")
    if shape is not None and tuple(array.shape) != tuple(shape):
        _fail(f"{name}: expected shape {_shape_text(shape)} {layout}, got {_shape_text(array.shape)}")


def _key(source: Mapping[str, Any], key: str, where: str, expected: str) -> Any:
    if key not in source:
        found = ", ".join(repr(k) for k in source) or "none"
        _fail(f"{where}: missing key {key!r} ({expected}); keys found: {found}")
    return source[key]


def _int(name: str, value: Any, low: int) -> int:
    if is_array(value):
        value = _host(name, value)
        if value.size != 1 or value.dtype.kind not in "iu":
            _fail(f"{name}: expected an int, got a {dtype_name(value)} array of shape {_shape_text(value.shape)}")
        value = value.reshape(-1)[0]
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        _fail(f"{name}: expected an int, got {value!r} ({type(value).__name__})")
    if int(value) < low:
        _fail(f"{name}: expected an int >= {low}, got {int(value)}")
    return int(value)


def _static(name: str, value: Any) -> np.float32:
    """A per-tensor scale (a number or a one-element float32 array), not judged here: the audit
    reports a scale that is not finite and > 0."""
    if is_array(value):
        array = _host(name, value)
        if array.size != 1:
            _fail(f"{name}: expected one float32 scale, got shape {_shape_text(array.shape)}")
        _require(name, array, ("float32",), None, "(the static scale)")
        return np.float32(array.reshape(-1)[0])
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        _fail(f"{name}: expected a float or a one-element float32 tensor, got {type(value).__name__}")
    with np.errstate(over="ignore"):
        return np.float32(value)


def _layer(
    index: int,
    raw: Any,
    mode: QuantMode,
    layout: str,
    block_size: int,
    num_blocks: int | None,
    num_tokens: int,
    inline_head_size: int | None = None,
) -> LayerPages:
    where = f"layers[{index}]"
    if not isinstance(raw, Mapping):
        _fail(f"{where}: expected a dict of the layer's tensors, got {type(raw).__name__}")
    if layout == "inline":
        buffer = _host(f"{where}['buffer']", _key(raw, "buffer", where, "the inline page, uint8"))
        page = "[num_blocks, 2, block_size, num_kv_heads, head_size + 4]"
        _require(f"{where}['buffer']", buffer, ("uint8",), None, page)
        if buffer.ndim != 5 or buffer.shape[1] != 2 or buffer.shape[2] != block_size:
            _fail(
                f"{where}['buffer']: expected shape {page} with block_size {block_size}, "
                f"got {_shape_text(buffer.shape)}"
            )
        # Given, it admits a padded row; absent, the row is vLLM's head_size + 4 bytes.
        head_size = int(buffer.shape[-1]) - SCALE_BYTES if inline_head_size is None else inline_head_size
        if inline_head_size is None and (head_size < SCALE_BYTES or head_size % SCALE_BYTES):
            _fail(
                f"{where}['buffer']: its rows of {buffer.shape[-1]} bytes hold no head size (a multiple of 4 "
                "code bytes, then the 4-byte scale)"
            )
        try:
            views = inline_views(buffer, head_size, mode)
        except KVZooInputError as bad:
            _fail(f"{where}['buffer']: {bad}")
        key_cache, value_cache = views.key_cache.view(np.uint8), views.value_cache.view(np.uint8)
        k_words, v_words = views.k_scale_cache, views.v_scale_cache
        for name in ("key_cache", "value_cache", *_SCALE_CACHES):
            if name in raw:
                got = _host(f"{where}[{name!r}]", raw[name])
                mine = {
                    "key_cache": key_cache,
                    "value_cache": value_cache,
                    "k_scale_cache": k_words,
                    "v_scale_cache": v_words,
                }[name]
                if (
                    got.shape != mine.shape
                    or got.view(np.uint8).tobytes() != np.ascontiguousarray(mine).view(np.uint8).tobytes()
                ):
                    _fail(
                        f"{where}[{name!r}]: differs from the same view of {where}['buffer']; an inline layer's "
                        "page is its buffer: leave the copies out, or take them from the buffer"
                    )
        statics: tuple[Any, Any] = (None, None)
    else:
        buffer = None
        layout_text = "[num_blocks, block_size, num_kv_heads, cache width]"
        caches = []
        for name in ("key_cache", "value_cache"):
            array = _host(f"{where}[{name!r}]", _key(raw, name, where, f"the codes, {layout_text}"))
            if array.ndim != 4:
                _fail(f"{where}[{name!r}]: expected 4 dims {layout_text}, got {_shape_text(array.shape)}")
            dtypes = FLOAT_INPUTS if mode.format is None else mode.format.accepted_dtypes
            _require(f"{where}[{name!r}]", array, dtypes, None, f"for mode {mode.name!r}")
            caches.append(array)
        key_cache, value_cache = caches
        if value_cache.shape != key_cache.shape or dtype_name(value_cache) != dtype_name(key_cache):
            _fail(
                f"{where}['value_cache']: expected {dtype_name(key_cache)} {_shape_text(key_cache.shape)} like "
                f"key_cache, got {dtype_name(value_cache)} {_shape_text(value_cache.shape)}"
            )
        if key_cache.shape[1] != block_size:
            _fail(
                f"{where}['key_cache']: block_size is {block_size} but the cache's second dim is {key_cache.shape[1]}"
            )
        head_size = mode.head_size_of(int(key_cache.shape[3]))
        refusal = mode.head_size_refusal(head_size)
        if refusal:
            _fail(f"{where}['key_cache']: its rows of {key_cache.shape[3]} elements: {refusal}")
        if mode.format is not None:
            key_cache, value_cache = key_cache.view(np.uint8), value_cache.view(np.uint8)
        k_words = v_words = None
        if mode.per_token_head:
            shape3 = tuple(key_cache.shape[:3])
            k_words, v_words = (
                _host(f"{where}[{n!r}]", _key(raw, n, where, "float32 [num_blocks, block_size, num_kv_heads]"))
                for n in _SCALE_CACHES
            )
            for n, words in zip(_SCALE_CACHES, (k_words, v_words)):
                _require(f"{where}[{n!r}]", words, ("float32",), shape3, "[num_blocks, block_size, num_kv_heads]")
        else:
            for n in _SCALE_CACHES:
                if n in raw:
                    _fail(
                        f"{where}[{n!r}]: mode {mode.name!r} keeps no scale per row; a dump with scale caches "
                        "is of a per-token-head mode (is 'mode' right?)"
                    )
        statics = (None, None)
        if mode.per_tensor:
            k_static, v_static = (
                _static(f"{where}[{n!r}]", _key(raw, n, where, f"mode {mode.name!r}'s static scale, float32"))
                for n in _STATIC_SCALES
            )
            statics = (k_static, v_static)
    if num_blocks is not None and key_cache.shape[0] != num_blocks:
        _fail(
            f"{where}: {key_cache.shape[0]} blocks, but layers[0] has {num_blocks} (the block tables index every "
            "layer alike)"
        )
    references: list[np.ndarray | None] = []
    for name in _REFERENCES:
        if raw.get(name) is None:
            references.append(None)
            continue
        ref = _host(f"{where}[{name!r}]", raw[name])
        shape = (num_tokens, int(key_cache.shape[2]), head_size)
        _require(f"{where}[{name!r}]", ref, FLOAT_INPUTS, shape, "[sum(seq_lens), num_kv_heads, head_size]")
        references.append(ref)
    return LayerPages(
        key_cache,
        value_cache,
        k_words,
        v_words,
        statics[0],
        statics[1],
        head_size,
        key=references[0],
        value=references[1],
        buffer=buffer,
    )


def read_dump(source: Mapping[str, Any]) -> CacheDump:
    """Check a dump dict and return it as host arrays (views of CPU tensors, no copies).

    Parameters
    ----------
    source : dict
        The documented dump (module docstring): tensors (any device) or NumPy arrays.

    Returns
    -------
    CacheDump

    Raises
    ------
    CacheDumpError
        Naming the key that is missing, of the wrong dtype, or of a shape that does not fit.
    """
    if not isinstance(source, Mapping):
        _fail(
            f"the dump: expected a dict with keys mode, layout, block_size, block_tables, seq_lens, layers; "
            f"got {type(source).__name__}"
        )
    where = "the dump"
    mode_name = _key(source, "mode", where, "a kvzoo mode or engine string, e.g. 'int8_per_token_head'")
    if not isinstance(mode_name, str):
        _fail(f"mode: expected a str, got {type(mode_name).__name__}")
    try:
        mode = get_kv_quant_mode(mode_name)
    except KVZooInputError as bad:
        _fail(str(bad))
    if mode.split:
        _fail(
            f"mode: {mode.name!r} stores keys and values in two formats; the audit reads one-format caches only (not yet split ones)"
        )
    layout = _key(source, "layout", where, "'separate' or 'inline'")
    if layout not in LAYOUTS:
        _fail(f"layout: expected 'separate' or 'inline', got {layout!r}")
    if layout == "inline" and mode.inline_refusal():
        _fail(f"layout: {mode.inline_refusal()}")
    rounding = source.get("rounding", "nearest")
    if rounding not in mode.roundings:
        _fail(f"rounding: mode {mode.name!r} defines {list(mode.roundings)}, got {rounding!r}")
    block_size = _int("block_size", _key(source, "block_size", where, "tokens per block, an int"), 1)
    tables = _host("block_tables", _key(source, "block_tables", where, "int [num_seqs, max_blocks_per_seq]"))
    if tables.ndim != 2:
        _fail(f"block_tables: expected 2 dims [num_seqs, max_blocks_per_seq], got {_shape_text(tables.shape)}")
    _require("block_tables", tables, INDEX_DTYPES, None, "[num_seqs, max_blocks_per_seq]")
    lens = _host("seq_lens", _key(source, "seq_lens", where, "int [num_seqs]"))
    _require("seq_lens", lens, INDEX_DTYPES, (tables.shape[0],), "[num_seqs] (one per block_tables row)")
    raw_layers = _key(source, "layers", where, "a list with one dict of tensors per layer")
    if not isinstance(raw_layers, Sequence) or isinstance(raw_layers, (str, bytes)) or not raw_layers:
        _fail(f"layers: expected a non-empty list of per-layer dicts, got {type(raw_layers).__name__}")
    lens64 = lens.astype(np.int64)
    num_tokens = int(np.clip(lens64, 0, None).sum())
    head_size = source.get("head_size")
    if head_size is not None:
        if layout != "inline":
            _fail("head_size: only an inline dump takes it (its padded rows' head size); leave it out")
        head_size = _int("head_size", head_size, 1)
    layers: list[LayerPages] = []
    for i, raw in enumerate(raw_layers):
        num_blocks = int(layers[0].key_cache.shape[0]) if layers else None
        layers.append(_layer(i, raw, mode, layout, block_size, num_blocks, num_tokens, head_size))
    return CacheDump(
        mode=mode,
        layout=layout,
        rounding=rounding,
        block_size=block_size,
        num_blocks=int(layers[0].key_cache.shape[0]),
        block_tables=tables.astype(np.int64),
        seq_lens=lens64,
        layers=tuple(layers),
    )


def cache_dump(
    layers: Sequence[KVCacheTensors],
    *,
    mode: str | QuantMode,
    block_tables: Any,
    seq_lens: Any,
    rounding: str = "nearest",
    k_scales: Sequence[Any] | None = None,
    v_scales: Sequence[Any] | None = None,
    keys: Sequence[Any] | None = None,
    values: Sequence[Any] | None = None,
) -> dict[str, Any]:
    """The dump dict of kvzoo cache tensors, holding the tensors themselves (no copies).

    Parameters
    ----------
    layers : sequence of KVCacheTensors
        One per layer (kvzoo.allocate_separate / allocate_inline / CacheSpec.allocate); an
        inline layer is taken as its buffer.
    mode : str or QuantMode
    block_tables : int tensor or array [num_seqs, max_blocks_per_seq]
    seq_lens : int tensor or array [num_seqs]
    rounding : str
        "trunc" for caches written with int8's truncating store.
    k_scales, v_scales : sequence, optional
        The per-tensor modes' static scales, one per layer (floats or float32 [1] tensors).
    keys, values : sequence, optional
        Per layer, the unquantized K/V of the live tokens, [sum(seq_lens), H, D].

    Returns
    -------
    dict
        The documented dump (kvzoo.auditing.dump), for kvzoo.audit or save_cache_dump.
    """
    mode = get_kv_quant_mode(mode)
    out_layers = []
    padded = False
    for i, tensors in enumerate(layers):
        if tensors.buffer is not None:
            layer: dict[str, Any] = {"buffer": tensors.buffer}
            padded |= int(tensors.buffer.shape[-1]) != int(tensors.key_cache.shape[-1]) + SCALE_BYTES
        else:
            layer = {"key_cache": tensors.key_cache, "value_cache": tensors.value_cache}
            if tensors.k_scale_cache is not None:
                layer.update(k_scale_cache=tensors.k_scale_cache, v_scale_cache=tensors.v_scale_cache)
        for name, given in (("k_scale", k_scales), ("v_scale", v_scales), ("key", keys), ("value", values)):
            if given is not None and given[i] is not None:
                layer[name] = given[i]
        out_layers.append(layer)
    dump = {
        "mode": mode.name,
        "layout": "inline" if layers and layers[0].buffer is not None else "separate",
        "rounding": rounding,
        "block_size": int(layers[0].key_cache.shape[1]) if layers else 0,
        "block_tables": block_tables,
        "seq_lens": seq_lens,
        "layers": out_layers,
    }
    if padded:
        # Inline codes are one byte each: the key view's width is the head size.
        dump["head_size"] = int(layers[0].key_cache.shape[-1])
    return dump


def _torch(what: str) -> Any:
    if torch is None:
        raise ImportError(f"{what}: dump files are torch.save files; install torch (pip install torch)")
    return torch


def _saveable(value: Any) -> Any:
    """A host torch tensor holding only its own elements: torch.save writes a view's whole
    storage, so a slice of a larger buffer is copied out first."""
    if isinstance(value, Mapping):
        return {k: _saveable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_saveable(v) for v in value]
    if isinstance(value, np.ndarray):
        value = as_torch(np.ascontiguousarray(value))
    if is_torch(value):
        value = value.detach().to("cpu")
        if not value.is_contiguous() or value.untyped_storage().nbytes() != value.numel() * value.element_size():
            value = value.contiguous().clone()
    return value


def save_cache_dump(path: str | os.PathLike[str], dump: Mapping[str, Any]) -> None:
    """Write a dump dict (e.g. cache_dump(...)) to `path` with torch.save, tensors on the host.

    The dict is checked first (read_dump), so a file written here always reads back.
    """
    read_dump(dump)
    _torch("save_cache_dump").save(_saveable(dict(dump)), os.fspath(path))


def load_cache_dump(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a dump file written by save_cache_dump or by hand with torch.save.

    Loaded with torch.load(weights_only=True): a file is data, and one that needs more than
    tensors, numbers, strings, lists and dicts is refused. Raises CacheDumpError when the file
    cannot be read (not checked further: read_dump does that).
    """
    path = os.fspath(path)
    load = _torch("load_cache_dump").load
    if not os.path.exists(path):
        _fail(f"{path}: no such file")
    try:
        return load(path, map_location="cpu", weights_only=True)
    except Exception as bad:  # what torch raises for a foreign or damaged file varies by version
        _fail(f"{path}: not a readable torch.save file of tensors ({type(bad).__name__}: {str(bad)[:300]})")
