"""Page transfer between ranks (prefill to decode) over torch.distributed point-to-point.

One transfer moves a set of sequences' pages, every layer, from the sender's cache into blocks
the receiver allocates, over gloo (CPU tensors) or NCCL (CUDA tensors); kvzoo adds no transport.
Per transfer, between the two ranks, in order:

1. sender -> receiver: the pages' header (PagesHeader as JSON: mode, head size, block size,
   the model's KV heads the sender holds, layers, sequences and their page tables, static
   scales, format version).
2. receiver -> sender: accept, with the KV heads it wants (its own: a decode rank of a
   head-sharded cache takes its part of a prefill rank's heads), or refuse, naming what does
   not fit. Nothing more is sent after a refusal, and both sides raise.
3. sender -> receiver: one message per layer (the layer's pages for those heads, gathered from
   the cache while the previous layer is on the wire), then the layers' checksums.
4. The receiver stages every message apart from its cache (fresh tensors, or the caller's
   `workspace`); only when all arrived and the checksums match does it allocate blocks and copy the pages into its cache (either layout: the pages
   are layout-free, kvzoo.distributed.pages) and write its block tables. Then:
5. receiver -> sender: committed (the sender may free its blocks), or why not.

A sender that dies, or any message that does not arrive within `timeout`, raises TransferError
on the other side with the cache, block tables and allocator untouched. The two ranks'
point-to-point stream is then out of step (gloo closes the pair on a timeout; an NCCL receive
may still be posted): destroy the group and build a new one before the next transfer between
them (on NCCL, ``group.abort()`` first).
"""

from __future__ import annotations

import json
import math
import time
import warnings
from datetime import timedelta
from typing import Any

from ..arrays import torch
from ..errors import fail
from ..validate import int_scalar, require_workspace
from .pages import (
    Allocator,
    CorruptPagesError,
    Pages,
    PagesHeader,
    PagesMismatchError,
    Placement,
    TableArgs,
    caches_of,
    check_allocate,
    check_fit,
    commit,
    gather_layer,
    source_of,
    zero_gaps,
)

__all__ = ["TransferError", "recv_pages", "send_pages"]

# First word of every control message: a stream that is out of step is caught on the next one.
MAGIC = 0x6B767A6F6F  # "kvzoo"
_HEADER, _REPLY, _DONE = 1, 2, 3
_KINDS = {_HEADER: "header", _REPLY: "reply", _DONE: "commit notice"}
# A control message longer than this is not one (a stream out of step, or a foreign sender).
_MAX_JSON = 1 << 30
NOTHING_WRITTEN = "Nothing was written to the cache, the block tables or the allocator."


class TransferError(RuntimeError):
    """A page transfer that did not complete: the peer refused the pages (the message names
    what does not fit), died, or did not answer in time. On the receiving side nothing was
    written. The two ranks' point-to-point stream is out of step afterwards (module docstring)."""


class _Rejected(TransferError):
    """Refused after every message of the transfer arrived (the pages fail their checksums)."""


def _timeout_arg(timeout: Any) -> float:
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not (math.isfinite(timeout) and timeout > 0)
    ):
        fail(f"timeout: expected a finite number of seconds > 0, got {timeout!r}")
    return float(timeout)


class _Wire:
    """Point-to-point messages with one peer, each awaited against one deadline."""

    def __init__(self, who: str, group: Any, peer: int, caches_device: Any, timeout: float) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            fail("group: torch.distributed is not initialised (call torch.distributed.init_process_group)")
        self.dist, self.who, self.group, self.peer, self.timeout = dist, who, group, peer, timeout
        name = "dst" if who == "send_pages" else "src"
        if peer == dist.get_rank() or not 0 <= peer < dist.get_world_size():
            fail(f"{name}: expected another rank of the group, got {peer}")
        if group is not None and peer not in dist.get_process_group_ranks(group):
            fail(f"{name}: rank {peer} is not in the group (its ranks: {dist.get_process_group_ranks(group)})")
        # NCCL moves CUDA tensors only; gloo CPU ones (a CUDA cache's pages go through the host).
        nccl = "nccl" in str(dist.get_backend(group)).lower()
        self.device = caches_device if nccl and caches_device.type == "cuda" else torch.device("cpu")
        self.caches_device = caches_device
        self.deadline = time.monotonic() + timeout

    def check_workspace(self, workspace: Any) -> None:
        if workspace is not None and self.device != self.caches_device:
            fail(
                f"workspace: the pages travel through {self.device} ({self.dist.get_backend(self.group)}) and the "
                f"caches are on {self.caches_device}; a workspace serves where both are on one device"
            )

    def isend(self, t: Any, what: str) -> Any:
        return self._post(self.dist.isend, t, f"sending {what}", dst=self.peer)

    def irecv(self, t: Any, what: str) -> Any:
        return self._post(self.dist.irecv, t, f"receiving {what}", src=self.peer)

    def _post(self, op: Any, t: Any, what: str, **peer: int) -> Any:
        # gloo refuses to post on a pair whose peer is gone, before there is a work to wait on.
        try:
            return op(t, group=self.group, **peer)
        except Exception as exc:
            raise TransferError(f"{self.who}: {what} with rank {self.peer} failed: {exc}") from exc

    def wait(self, work: Any, what: str) -> None:
        late = TransferError(
            f"{self.who}: {what} did not complete with rank {self.peer} within the timeout of {self.timeout:g} s"
        )
        try:
            if self.device.type == "cpu":
                # gloo's wait takes a timeout and raises at once when the peer's connection closes.
                remaining = self.deadline - time.monotonic()
                if remaining <= 0:
                    raise late
                work.wait(timeout=timedelta(seconds=remaining))
                return
            # An NCCL wait with a timeout would leave the current stream waiting on a receive
            # that may never come: poll its completion from the host instead.
            pause = 1e-5
            while not work.is_completed():
                if time.monotonic() > self.deadline:
                    raise late
                time.sleep(pause)
                pause = min(2 * pause, 2e-3)
            work.wait()
        except TransferError:
            raise
        except Exception as exc:  # the backend's own (RuntimeError, DistBackendError, ...)
            raise TransferError(f"{self.who}: {what} with rank {self.peer} failed: {exc}") from exc

    def send(self, t: Any, what: str) -> None:
        self.wait(self.isend(t, what), f"sending {what}")

    def recv(self, t: Any, what: str) -> None:
        self.wait(self.irecv(t, what), f"receiving {what}")

    def send_json(self, kind: int, text: str) -> None:
        data = text.encode()
        self.send(torch.tensor([MAGIC, kind, len(data)], dtype=torch.int64, device=self.device), _KINDS[kind])
        if data:
            body = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
            self.send(body, _KINDS[kind])

    def recv_json(self, kind: int) -> str:
        what = _KINDS[kind]
        head = torch.empty(3, dtype=torch.int64, device=self.device)
        self.recv(head, what)
        magic, got, size = (int(v) for v in head.cpu())
        if magic != MAGIC or got != kind or not 0 <= size <= _MAX_JSON:
            raise TransferError(
                f"{self.who}: expected the {what} from rank {self.peer}, got words {[magic, got, size]}: the two "
                "ranks' messages are out of step (an earlier transfer between them failed?); rebuild the group"
            )
        if not size:
            return ""
        body = torch.empty(size, dtype=torch.uint8, device=self.device)
        self.recv(body, what)
        return bytes(body.cpu().numpy()).decode(errors="replace")


def _workspace_arg(workspace: Any, device: Any) -> None:
    if workspace is not None:
        require_workspace(workspace)
        if workspace.device != device:
            fail(f"workspace: on {workspace.device}, the caches are on {device}")


def _buffers(workspace: Any, size: int, count: int, device: Any) -> list[Any]:
    """count buffers of size bytes: slices of the caller's workspace when it holds them."""
    if workspace is not None and workspace.numel() >= size * count:
        return [workspace[i * size : (i + 1) * size] for i in range(count)]
    return [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(count)]


def _checksum(flat: Any) -> Any:
    # Integer words, so the sum is exact (mod 2^64) in any order, on either device.
    return flat.view(torch.int64).sum()


def send_pages(
    layers: Any,
    spec: Any,
    block_tables: Any,
    seq_lens: Any,
    *,
    dst: int,
    group: Any = None,
    seq_ids: Any = None,
    static_scales: Any = None,
    timeout: float = 300.0,
    workspace: Any = None,
) -> int:
    """Send a set of sequences' pages (every layer) to another rank; returns when it placed them.

    The receiver calls `recv_pages` with ``src`` this rank. The sender's caches are only read:
    free their blocks once this returns.

    Parameters
    ----------
    layers : KVCacheTensors, PagedKVCache, or a list of them (one per layer)
        The caches, all of `spec`, on the CPU (gloo) or a GPU (NCCL; over gloo the pages go
        through host memory).
    spec : kvzoo.CacheSpec or kvzoo.distributed.HeadShard
        The caches' spec (a HeadShard: this rank holds its heads of a head-sharded cache).
    block_tables : array [num_seqs, max_blocks_per_seq] int32/int64
        The sequences' blocks (the first ``ceil(seq_lens[s] / block_size)`` of each row).
    seq_lens : array [num_seqs] int32/int64
        Their lengths in tokens.
    dst : int
        The receiving rank (its rank in the default group, as torch.distributed.send takes it).
    group : torch.distributed.ProcessGroup, optional
        The group to send over (default: the default group).
    seq_ids : sequence of int or str, optional
        Names handed to the receiver with the pages (its `Placement.seq_ids`).
    static_scales : sequence of (k_scale, v_scale), optional
        Per layer, for the per-tensor modes (unless the layers are PagedKVCache objects holding
        theirs); the receiver checks its own against them.
    timeout : float
        Seconds the whole transfer may take on this side, waiting for the receiver included.
    workspace : torch.Tensor, optional
        A contiguous 1-D uint8 tensor on the caches' device that the pages are gathered into
        (two layers' worth, ``2 * PagesHeader.layer_bytes``, a layer gathered while the one
        before it is on the wire) when it holds them; fresh memory otherwise. An engine that
        keeps one avoids allocating (and, on a CPU, first touching) that memory per transfer.

    Returns
    -------
    int
        Bytes of pages sent (every layer).

    Raises
    ------
    TransferError
        The receiver refused the pages (the message says why), died, or did not answer in time.
    kvzoo.KVZooInputError
        A bad argument, before anything is sent.

    Examples
    --------
    Prefill on rank 0, decode on rank 1 (each process runs its branch)::

        if rank == 0:
            send_pages(layers, spec, block_tables, seq_lens, dst=1)
            # free the sequences' blocks here
        else:
            placed = recv_pages(layers, spec, src=0, allocate=free_blocks)
            # decode with placed.block_tables, placed.seq_lens

    One prefill rank to two decode ranks holding half the heads each (``shard_spec`` on the
    decode ranks): rank 0 calls ``send_pages(..., dst=1)`` then ``send_pages(..., dst=2)``;
    each decode rank calls ``recv_pages(layers, shard, src=0, ...)`` and receives its heads.
    """
    source = source_of(layers, spec, block_tables, seq_lens, seq_ids, static_scales)
    if not source.header.num_pages:
        fail("block_tables, seq_lens: the sequences hold no token; there are no pages to send")
    _workspace_arg(workspace, source.caches.device)
    dst = int_scalar("dst", dst, 0)
    wire = _Wire("send_pages", group, dst, source.caches.device, _timeout_arg(timeout))
    wire.check_workspace(workspace)
    header = source.header
    wire.send_json(_HEADER, header.to_json())
    reply = _parse(wire, wire.recv_json(_REPLY))
    if not reply.get("accept"):
        raise TransferError(f"send_pages: rank {dst} refused the pages: {reply.get('error')}")
    heads = reply.get("kv_heads")
    if not (
        isinstance(heads, list) and len(heads) == 2 and header.kv_heads[0] <= heads[0] < heads[1] <= header.kv_heads[1]
    ):
        raise TransferError(
            f"send_pages: rank {dst} asked for KV heads {heads}; this rank holds {list(header.kv_heads)}"
        )
    sent = header.with_heads(*heads)
    nbytes = _send_layers(wire, source, sent, workspace)
    done = _parse(wire, wire.recv_json(_DONE))
    if not done.get("committed"):
        raise TransferError(f"send_pages: rank {dst} received the pages but did not place them: {done.get('error')}")
    return nbytes


def _parse(wire: _Wire, text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise TransferError(f"{wire.who}: rank {wire.peer} sent a malformed message: {text[:200]!r}")
    return value


def _send_layers(wire: _Wire, source: Any, header: PagesHeader, workspace: Any) -> int:
    layers = header.num_layers
    # Two buffers: a layer is gathered while the one before it is on the wire.
    buffers = _buffers(workspace, header.layer_bytes, min(2, layers), source.blocks.device)
    for flat in buffers:
        zero_gaps(flat, header)
    works: list[Any] = []
    sums = []
    for layer in range(layers):
        if layer >= 2:
            wire.wait(works[layer - 2], f"sending layer {layer - 2}'s pages")
        flat = buffers[layer % 2]
        gather_layer(source, layer, header, flat)
        sums.append(_checksum(flat))
        works.append(wire.isend(flat.to(wire.device), f"layer {layer}'s pages"))
    for layer in range(max(0, layers - 2), layers):
        wire.wait(works[layer], f"sending layer {layer}'s pages")
    wire.send(torch.stack(sums).to(wire.device), "the checksums")
    return header.layer_bytes * layers


def recv_pages(
    layers: Any,
    spec: Any,
    *,
    src: int,
    allocate: Allocator,
    group: Any = None,
    block_tables: Any = None,
    rows: Any = None,
    seq_lens: Any = None,
    static_scales: Any = None,
    timeout: float = 300.0,
    workspace: Any = None,
) -> Placement:
    """Receive pages another rank sends with `send_pages`, into blocks this rank allocates.

    The pages are staged in fresh tensors; only when every layer and the checksums arrived and
    match are blocks allocated and the pages copied into the caches (byte for byte, whatever
    layout either side has), and the block tables written. A failure before that leaves the
    caches, `block_tables`, `seq_lens` and the allocator untouched.

    Parameters
    ----------
    layers : KVCacheTensors, PagedKVCache, or a list of them
        The receiving caches, one per layer of the sender's.
    spec : kvzoo.CacheSpec or kvzoo.distributed.HeadShard
        Their spec: mode, head size, block size and the model's KV heads must be the
        sender's (a HeadShard receives its rank's part of the sender's heads).
    src : int
        The sending rank.
    allocate : callable or sequence of int
        ``allocate(n)`` -> n distinct free block ids, or free block ids of which the first n
        are taken; used only once the pages arrived.
    group : torch.distributed.ProcessGroup, optional
    block_tables, rows, seq_lens : optional
        The engine's block table [max_seqs, max_blocks] and lengths [max_seqs] (int32/int64)
        and the row of each received sequence: written on commit (see `place_pages`).
    static_scales : sequence of (k_scale, v_scale), optional
        Per layer (per-tensor modes): refused unless the sender's are the same bits.
    timeout : float
        Seconds the whole transfer may take on this side, waiting for the sender included.
    workspace : torch.Tensor, optional
        A contiguous 1-D uint8 tensor on the caches' device that the pages are staged in when it
        holds them (``num_layers * PagesHeader.layer_bytes``); fresh memory otherwise. After a
        failed transfer over NCCL a receive may still be posted into it: abort the group before
        using it again.

    Returns
    -------
    Placement
        The sequences' new block table rows [num_seqs, pages] int32, their lengths, the blocks
        used, the sender's seq_ids and static scales.

    Raises
    ------
    TransferError
        Refused (naming what does not fit), the sender died or was too slow, or a checksum did
        not match; nothing was written.
    kvzoo.KVZooInputError
        A bad argument, before anything is received.
    """
    caches = caches_of(layers, spec, static_scales, written=True)
    tables = TableArgs(block_tables, None if rows is None else list(rows), seq_lens)
    tables.check()
    if allocate is None:
        fail("allocate: required (a callable n -> n free block ids, or a sequence of free block ids)")
    check_allocate(allocate)
    _workspace_arg(workspace, caches.device)
    src = int_scalar("src", src, 0)
    wire = _Wire("recv_pages", group, src, caches.device, _timeout_arg(timeout))
    wire.check_workspace(workspace)
    try:
        pages = _receive(wire, caches, tables, workspace)
    except TransferError as exc:
        if isinstance(exc, _Rejected):
            # Every message arrived: the sender waits for the outcome and can be told.
            _notify(wire, {"committed": False, "error": str(exc)})
        raise TransferError(f"{str(exc).rstrip('. ')}. {NOTHING_WRITTEN}") from exc
    try:
        placement = commit(pages, caches, tables, allocate)
    except Exception as exc:
        _notify(wire, {"committed": False, "error": f"{type(exc).__name__}: {exc}"})
        raise
    _notify(wire, {"committed": True})
    return placement


def _receive(wire: _Wire, caches: Any, tables: TableArgs, workspace: Any) -> Pages:
    text = wire.recv_json(_HEADER)
    try:
        header = PagesHeader.from_json(text)
        refusal = check_fit(header, caches) or tables.refusal(header)
    except (CorruptPagesError, PagesMismatchError) as exc:
        refusal = str(exc)
    if refusal:
        wire.send_json(_REPLY, json.dumps({"accept": False, "error": refusal}))
        raise TransferError(f"recv_pages: refused the pages of rank {wire.peer}: {refusal}.")
    wire.send_json(_REPLY, json.dumps({"accept": True, "kv_heads": list(caches.kv_heads)}))
    header = header.with_heads(*caches.kv_heads)
    count = header.num_layers
    staged = _buffers(workspace, header.layer_bytes, count, wire.device)
    trailer = torch.empty(count, dtype=torch.int64, device=wire.device)
    works = [wire.irecv(t, f"layer {layer}'s pages") for layer, t in enumerate(staged)]
    last = wire.irecv(trailer, "the checksums")
    for layer, work in enumerate(works):
        wire.wait(work, f"receiving layer {layer}'s pages (message {layer + 1} of {count})")
    wire.wait(last, "receiving the checksums")
    sums = torch.stack([_checksum(t) for t in staged])
    bad = (sums != trailer).nonzero().reshape(-1).tolist()
    if bad:
        raise _Rejected(f"recv_pages: the pages of layers {bad} from rank {wire.peer} do not match their checksums.")
    device = caches.device
    return Pages(header, [t if t.device == device else t.to(device) for t in staged])


def _notify(wire: _Wire, message: dict) -> None:
    # After the commit the pages are this rank's whatever becomes of the sender: a notice it
    # can no longer receive is not this side's failure.
    try:
        wire.send_json(_DONE, json.dumps(message))
    except TransferError as exc:
        warnings.warn(f"recv_pages: could not tell rank {wire.peer} the outcome: {exc}", RuntimeWarning, stacklevel=3)
