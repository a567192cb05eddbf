"""Pages saved to and loaded from safetensors files.

A file holds one `Pages`: per layer the tensors ``layers.{l}.k.codes`` and ``layers.{l}.v.codes``
(uint8 [num_pages, block_size, heads, code bytes of a row]: the codes' bytes, whatever their
dtype) and, for the per-token-head modes, ``layers.{l}.k.scales`` and ``layers.{l}.v.scales``
(float32 [num_pages, block_size, heads]). The metadata holds the PagesHeader as JSON (format
version, mode, cache dtype, block size, head size, the model's KV heads, layers, the sequences'
lengths and page tables, the blocks the pages came from, static scales, the layout they were
read from), a CRC-32 of every tensor's bytes, and a CRC-32 of the header and that table.

Loading reads the whole file and checks all of it (version, header checksum, the tensors'
names, shapes, dtypes and checksums) before it returns any page, so a truncated or altered file
is refused, never half-loaded; `place_pages` then refuses pages that do not fit the cache
before it writes. A file is written under a temporary name and renamed into place, so an
interrupted save leaves no partial file at the path.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from ..arrays import as_numpy, torch
from ..errors import fail
from .pages import CorruptPagesError, Pages, PagesHeader, empty_layer

__all__ = ["load_pages", "pages_header", "save_pages"]

_FORMAT = "kvzoo.pages"
_HEADER_KEY, _CRC_KEY, _HEADER_CRC_KEY, _FORMAT_KEY = "kvzoo.header", "kvzoo.crc32", "kvzoo.header_crc32", "format"
# safetensors' names of the dtypes a pages file holds.
_DTYPES = {"uint8": "U8", "float32": "F32"}
# A safetensors header longer than this is not one of ours (or not a safetensors file).
_MAX_HEADER = 1 << 30


def _safetensors_numpy() -> Any:
    try:
        import safetensors.numpy
    except ImportError:
        raise ModuleNotFoundError(
            "kvzoo.distributed's page files need safetensors: pip install 'kvzoo[dist]' (or pip install safetensors)"
        ) from None
    return safetensors.numpy


def _file_tensors(pages: Pages) -> dict[str, np.ndarray]:
    """The file's tensors, as NumPy views of the host pages (codes as their bytes)."""
    out = {}
    for layer in range(pages.header.num_layers):
        for name, _, _, _ in pages.header.pieces():
            view = pages.piece(layer, name)
            if name.endswith("codes"):
                view = view.view(torch.uint8) if view.element_size() == 1 else _as_bytes(view)
            out[f"layers.{layer}.{name}"] = as_numpy(view)
    return out


def _as_bytes(x: Any) -> Any:
    # A 2- or 4-byte element's bytes along the last axis: [..., W] -> [..., W * itemsize].
    return x.contiguous().view(torch.uint8)


def _crc(array: np.ndarray) -> int:
    # .data, not memoryview(array): NumPy's stubs make an array a Buffer only from Python 3.12.
    return zlib.crc32(np.ascontiguousarray(array).data.cast("B"))


def _header_crc(header_json: str, crcs_json: str) -> str:
    return str(zlib.crc32(f"{header_json}\n{crcs_json}".encode()))


def save_pages(path: str | os.PathLike, pages: Pages) -> int:
    """Write pages to a safetensors file (module docstring: its tensors and metadata).

    Parameters
    ----------
    path : str or os.PathLike
        The file to write (replaced if it exists, atomically).
    pages : Pages
        From `gather_pages` (any device: they are copied to the host first).

    Returns
    -------
    int
        The file's size in bytes.

    Examples
    --------
    >>> import os, tempfile, torch, kvzoo
    >>> from kvzoo.distributed import gather_pages, load_pages, place_pages, save_pages
    >>> spec = kvzoo.CacheSpec("fp8_per_token_head", num_blocks=4, block_size=8, num_kv_heads=2,
    ...                        head_size=16, model_dtype="float32")
    >>> cache = spec.allocate()
    >>> kvzoo.reshape_and_cache(torch.randn(10, 2, 16), torch.randn(10, 2, 16), cache.key_cache,
    ...                         cache.value_cache, torch.arange(10), mode=spec.mode,
    ...                         k_scale_cache=cache.k_scale_cache, v_scale_cache=cache.v_scale_cache)
    >>> path = os.path.join(tempfile.mkdtemp(), "cache.safetensors")
    >>> size = save_pages(path, gather_pages(cache, spec))          # the whole cache
    >>> restored = spec.allocate()
    >>> _ = place_pages(load_pages(path), restored, spec)          # back to the same blocks
    >>> bool((restored.key_cache.view(torch.uint8) == cache.key_cache.view(torch.uint8)).all())
    True
    """
    if not isinstance(pages, Pages):
        fail(f"pages: expected kvzoo.distributed.Pages, got {type(pages).__name__}")
    st = _safetensors_numpy()
    host = pages if pages.device.type == "cpu" else pages.to("cpu")
    tensors = _file_tensors(host)
    header_json = pages.header.to_json()
    crcs_json = json.dumps({name: _crc(a) for name, a in tensors.items()}, separators=(",", ":"))
    metadata = {
        _FORMAT_KEY: _FORMAT,
        _HEADER_KEY: header_json,
        _CRC_KEY: crcs_json,
        _HEADER_CRC_KEY: _header_crc(header_json, crcs_json),
    }
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    os.close(fd)
    try:
        st.save_file(tensors, tmp, metadata=metadata)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path.stat().st_size


def _metadata(data: bytes, what: str) -> dict[str, str]:
    """The safetensors metadata of a file's bytes, read as safetensors lays it out: an 8-byte
    little-endian header length, then the JSON header with "__metadata__"."""
    if len(data) < 8:
        raise CorruptPagesError(f"{what}: {len(data)} bytes, shorter than a safetensors header")
    (size,) = struct.unpack("<Q", data[:8])
    if size > min(_MAX_HEADER, len(data) - 8):
        raise CorruptPagesError(
            f"{what}: a header of {size} bytes in a file of {len(data)}: truncated or not safetensors"
        )
    try:
        meta = json.loads(data[8 : 8 + size]).get("__metadata__")
    except (ValueError, UnicodeDecodeError, AttributeError) as exc:
        raise CorruptPagesError(f"{what}: the safetensors header is not valid JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get(_FORMAT_KEY) != _FORMAT:
        raise CorruptPagesError(f"{what}: not a kvzoo pages file (no {_FORMAT_KEY!r}: {_FORMAT!r} in its metadata)")
    for key in (_HEADER_KEY, _CRC_KEY, _HEADER_CRC_KEY):
        if not isinstance(meta.get(key), str):
            raise CorruptPagesError(f"{what}: metadata {key!r} missing")
    return meta


def _header_of(meta: dict[str, str], what: str) -> PagesHeader:
    # from_json checks the version before the checksum: another version may check otherwise.
    header_json, crcs_json = meta[_HEADER_KEY], meta[_CRC_KEY]
    try:
        header = PagesHeader.from_json(header_json)
    except CorruptPagesError as exc:
        raise CorruptPagesError(f"{what}: {exc}") from None
    if _header_crc(header_json, crcs_json) != meta[_HEADER_CRC_KEY]:
        raise CorruptPagesError(f"{what}: the header's checksum does not match (the file was altered)")
    return header


def pages_header(path: str | os.PathLike) -> PagesHeader:
    """The header of a pages file (mode, heads, sequences, ...), reading only its first bytes;
    `load_pages` checks the rest."""
    what = str(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) == 8:
            (size,) = struct.unpack("<Q", head)
            head += f.read(min(size, _MAX_HEADER))
    return _header_of(_metadata(head, what), what)


def load_pages(path: str | os.PathLike, *, device: Any = "cpu") -> Pages:
    """Read and check a pages file written by `save_pages`.

    Parameters
    ----------
    path : str or os.PathLike
    device : str or torch.device
        Where the returned pages are (default the CPU; `place_pages` copies them to the cache).

    Returns
    -------
    Pages
        Put them into a cache with `place_pages`, which refuses pages of another mode, head
        size, block size or KV heads, naming the field.

    Raises
    ------
    PagesMismatchError
        The file is of another format version.
    CorruptPagesError
        The file is truncated, altered, or not a pages file; nothing is returned.
    """
    _safetensors_numpy()
    from safetensors import safe_open

    what = str(path)
    with open(path, "rb") as f:
        total = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) == 8:
            head += f.read(min(struct.unpack("<Q", head)[0], _MAX_HEADER))
        meta = _metadata(head, what)
        header = _header_of(meta, what)
        try:
            # safetensors' own check of the layout (offsets, sizes, the file's length).
            with safe_open(str(path), framework="numpy") as checked:
                names = set(checked.keys())
        except Exception as exc:  # its error type varies by version
            raise CorruptPagesError(f"{what}: safetensors cannot read it ({exc})") from None
        entries = json.loads(head[8:])
        data_start = len(head)
        crcs = json.loads(meta[_CRC_KEY])
        host = Pages(header, [empty_layer(header, "cpu") for _ in range(header.num_layers)])
        expected = _file_tensors(host)
        if names != set(expected) or set(crcs) != set(expected):
            odd = sorted(set(expected) ^ names) or sorted(set(expected) ^ set(crcs))
            raise CorruptPagesError(f"{what}: tensors {odd[:6]} missing or unexpected for its header")
        end = max((entries[name]["data_offsets"][1] for name in expected), default=0)
        if total != data_start + end:
            raise CorruptPagesError(f"{what}: {total} bytes, its header makes it {data_start + end}")
        for name, target in expected.items():
            entry = entries[name]
            begin, stop = (int(v) for v in entry["data_offsets"])
            if entry["dtype"] != _DTYPES[target.dtype.name] or tuple(entry["shape"]) != target.shape:
                raise CorruptPagesError(
                    f"{what}: {name} is {entry['dtype']} {entry['shape']}, its header makes it "
                    f"{_DTYPES[target.dtype.name]} {list(target.shape)}"
                )
            # Straight into the pages' own buffer: the file's bytes are read once.
            f.seek(data_start + begin)
            if stop - begin != target.nbytes or f.readinto(target.data.cast("B")) != target.nbytes:
                raise CorruptPagesError(f"{what}: {name} is shorter than its shape")
            if _crc(target) != crcs[name]:
                raise CorruptPagesError(f"{what}: {name} does not match its checksum (the file was altered)")
    return host if torch.device(device).type == "cpu" else host.to(device)
