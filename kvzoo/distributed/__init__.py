"""Beyond one process: head-sharded caches, pages that travel with their scales, caches saved.

A per-token-head scale belongs to one token and one KV head, so

- sharding a cache by KV heads needs no communication: each rank writes and attends its heads
  with the ordinary plan, and only outputs are gathered (`shard_spec`, `HeadShard`);
- a set of sequences' pages, codes and scales, is everything needed to read them: they move
  between ranks (`send_pages` / `recv_pages`, over torch.distributed: gloo or NCCL), between
  layouts and between sharding degrees, and to host memory or a file and back
  (`gather_pages`, `Pages.to_host`, `save_pages`, `load_pages`, `place_pages`).

Needs torch (``pip install "kvzoo[dist]"``, which adds safetensors for the files). kvzoo itself
never imports this package; torch.distributed is imported only by the calls that communicate.
"""

from ..arrays import torch as _torch

if _torch is None:
    raise ModuleNotFoundError("kvzoo.distributed needs torch: pip install 'kvzoo[dist]'")

from .pages import (  # noqa: E402
    FORMAT_VERSION,
    CorruptPagesError,
    Pages,
    PagesHeader,
    PagesMismatchError,
    Placement,
    gather_pages,
    place_pages,
)
from .persist import load_pages, pages_header, save_pages  # noqa: E402
from .sharding import HeadShard, shard_spec  # noqa: E402
from .transfer import TransferError, recv_pages, send_pages  # noqa: E402

__all__ = [
    "FORMAT_VERSION",
    "CorruptPagesError",
    "HeadShard",
    "Pages",
    "PagesHeader",
    "PagesMismatchError",
    "Placement",
    "TransferError",
    "gather_pages",
    "load_pages",
    "pages_header",
    "place_pages",
    "recv_pages",
    "save_pages",
    "send_pages",
    "shard_spec",
]
