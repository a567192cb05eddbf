"""Host-side page bookkeeping for one cache: block tables, lengths, reference counts.

All layers of a decoder see the same tokens, so one PageTable serves them all: each layer
owns its own code and scale tensors, indexed by the same block ids. Nothing here touches a
device or imports torch; the cache turns a StepLayout into device tensors once per forward
step (kvzoo.integrations.transformers.step).

Sequences are *compacted*: a padding token (attention_mask == 0) gets no slot, so row b's
kvzoo sequence holds only its real tokens, in order. kvzoo's causal rule over the compacted
sequence is then exactly "causal and not padding" over the positions: a real query token's
compacted index is the count of real tokens before it, and it attends all of those.

Blocks are reference-counted so that beam search (`reorder`) shares whole blocks between
beams; a shared block that is only partly filled is copied before a row appends to it
(copy-on-write), and the copies a step needs are listed in its StepLayout for every layer
to apply before writing.

>>> import numpy as np
>>> pages = PageTable(block_size=4)
>>> step = pages.plan_step(np.array([[False, True, True], [True, True, True]]))  # row 0 left-padded
>>> step.seq_lens.tolist(), step.query_start_loc.tolist(), step.slot_mapping.tolist()
([2, 3], [0, 2, 5], [-1, 0, 1, 4, 5, 6])
>>> pages.reorder(np.array([1, 1]))      # both rows continue row 1 (beam search); block 0 is freed
>>> pages.plan_step(None).copies.tolist()   # row 0 copies the block it shares into block 0
[[1, 0]]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class PagesFullError(RuntimeError):
    """The cache needs more blocks than its max_num_blocks."""


@dataclass(frozen=True)
class StepLayout:
    """Where one forward step's tokens go; host arrays, shared by every layer.

    batch B rows of q_len Q tokens each, flattened b-major (row b's tokens are b*Q .. b*Q+Q-1):
    slot_mapping [B*Q] int64, the slot of each token, -1 for padding (kvzoo skips it).
    real_rows [n_real] int64, the flat indices of the real tokens in order, or None when every
        token is real (then the query rows need no gather).
    block_tables [B, max_blocks] int32, seq_lens [B] int32 (real tokens, this step's included),
    query_start_loc [B + 1] int32 (offsets of each row's real tokens among the real rows).
    copies [n, 2] int64 (source block, destination block): copy-on-write, before any write.
    gapped: some row has a padding token after one of its real tokens (a sliding window then
        counts compacted tokens, not positions, so it is refused).
    """

    start: int
    batch: int
    q_len: int
    slot_mapping: np.ndarray
    real_rows: np.ndarray | None
    block_tables: np.ndarray
    seq_lens: np.ndarray
    query_start_loc: np.ndarray
    copies: np.ndarray
    max_query_len: int
    max_seq_len: int
    num_prefills: int
    capacity: int
    gapped: bool


class PageTable:
    """Block allocator and per-row block tables (host side), grown on demand.

    block_size: tokens per block. num_blocks: blocks available before the first growth;
    the pool doubles when it runs out (layers grow their tensors to `capacity` lazily).
    max_num_blocks: a hard ceiling (None: none), PagesFullError past it.
    """

    def __init__(self, block_size: int, num_blocks: int = 0, max_num_blocks: int | None = None) -> None:
        if block_size < 1 or num_blocks < 0:
            raise ValueError(f"block_size must be >= 1 and num_blocks >= 0, got {block_size}, {num_blocks}")
        self.block_size = block_size
        self.max_num_blocks = max_num_blocks
        self.capacity = 0
        self.refcount = np.zeros(0, np.int32)
        self.free: list[int] = []
        self._add_blocks(num_blocks)
        # Counter of changes made outside a forward step (reorder, crop, reset): a step
        # planned before one of them is stale.
        self.epoch = 0
        self._clear_rows()

    # -- rows --------------------------------------------------------------------------

    def _clear_rows(self) -> None:
        self.tables: list[list[int]] | None = None
        self.lens = np.zeros(0, np.int64)
        self.positions = 0  # positions seen per row, padding included (HF's sequence length)
        self._real = np.zeros((0, 0), bool)  # [B, >= positions]: was position p of row b real
        self._seen_real = np.zeros(0, bool)
        self._gapped = np.zeros(0, bool)

    @property
    def batch_size(self) -> int | None:
        return None if self.tables is None else len(self.tables)

    def blocks_in_use(self) -> int:
        return int(self.capacity - len(self.free))

    # -- blocks ------------------------------------------------------------------------

    def _add_blocks(self, count: int) -> None:
        if count <= 0:
            return
        new_capacity = self.capacity + count
        if self.max_num_blocks is not None and new_capacity > self.max_num_blocks:
            raise PagesFullError(
                f"the KV cache needs {new_capacity} blocks of {self.block_size} tokens; max_num_blocks is "
                f"{self.max_num_blocks}"
            )
        # Lowest ids first: pop() takes from the end.
        self.free.extend(range(new_capacity - 1, self.capacity - 1, -1))
        self.refcount = np.concatenate([self.refcount, np.zeros(count, np.int32)])
        self.capacity = new_capacity

    def _alloc(self) -> int:
        if not self.free:
            # Doubling keeps growth (and each layer's copy into bigger tensors) amortised O(1).
            grow = max(self.capacity, 16)
            if self.max_num_blocks is not None:
                grow = max(1, min(grow, self.max_num_blocks - self.capacity))
            self._add_blocks(grow)
        block = self.free.pop()
        self.refcount[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            self.free.append(block)

    # -- a forward step ----------------------------------------------------------------

    def plan_step(self, real: np.ndarray | None, batch: int | None = None, q_len: int | None = None) -> StepLayout:
        """Place one step's tokens: real [B, Q] bool (True = attend), or None for all real
        (then batch and q_len give the shape, defaulting to the current batch and 1)."""
        if real is not None:
            real = np.asarray(real, dtype=bool)
            if real.ndim != 2:
                raise ValueError(f"real: expected [batch, q_len], got shape {real.shape}")
            batch, q_len = real.shape
        else:
            batch = self.batch_size if batch is None else batch
            q_len = 1 if q_len is None else q_len
            if batch is None:
                raise ValueError("batch: the first step of a cache needs its batch size")
        if self.tables is None:
            self.tables = [[] for _ in range(batch)]
            self.lens = np.zeros(batch, np.int64)
            self._real = np.zeros((batch, max(64, q_len)), bool)
            self._seen_real = np.zeros(batch, bool)
            self._gapped = np.zeros(batch, bool)
        elif batch != len(self.tables):
            raise ValueError(
                f"batch: this step has {batch} rows but the cache holds {len(self.tables)}; change the batch "
                "through reorder_cache / batch_select_indices / batch_repeat_interleave"
            )
        flags = np.ones((batch, q_len), bool) if real is None else real
        start = self.positions
        self._record(flags)
        n_new = flags.sum(axis=1).astype(np.int64)
        bs = self.block_size
        slots = np.full(batch * q_len, -1, np.int64)
        copies: list[tuple[int, int]] = []
        for b, table in enumerate(self.tables):
            old, count = int(self.lens[b]), int(n_new[b])
            if count == 0:
                continue
            if old % bs and self.refcount[table[-1]] > 1:
                # The row appends into a block another row also reads: give it its own copy.
                src, dst = table[-1], self._alloc()
                self._release(src)
                copies.append((src, dst))
                table[-1] = dst
            new = old + count
            while len(table) * bs < new:
                table.append(self._alloc())
            pos = np.arange(old, new)
            row_slots = np.asarray(table, np.int64)[pos // bs] * bs + pos % bs
            if real is None:
                slots[b * q_len : (b + 1) * q_len] = row_slots
            else:
                slots[b * q_len + np.flatnonzero(flags[b])] = row_slots
            self.lens[b] = new
        widest = max((len(t) for t in self.tables), default=0)
        tables = np.zeros((batch, max(widest, 1)), np.int32)
        for b, table in enumerate(self.tables):
            tables[b, : len(table)] = table
        qsl = np.concatenate([[0], np.cumsum(n_new)]).astype(np.int32)
        all_real = bool(flags.all())
        return StepLayout(
            start=start,
            batch=batch,
            q_len=q_len,
            slot_mapping=slots,
            real_rows=None if all_real else np.flatnonzero(flags.reshape(-1)).astype(np.int64),
            block_tables=tables,
            seq_lens=self.lens.astype(np.int32),
            query_start_loc=qsl,
            copies=np.asarray(copies, np.int64).reshape(-1, 2),
            max_query_len=int(n_new.max()) if batch else 0,
            max_seq_len=int(self.lens.max()) if batch else 0,
            num_prefills=int((n_new > 1).sum()),
            capacity=self.capacity,
            gapped=bool(self._gapped.any()),
        )

    def _record(self, flags: np.ndarray) -> None:
        batch, q_len = flags.shape
        end = self.positions + q_len
        if end > self._real.shape[1]:
            grown = np.zeros((batch, max(end, 2 * self._real.shape[1])), bool)
            grown[:, : self.positions] = self._real[:, : self.positions]
            self._real = grown
        self._real[:, self.positions : end] = flags
        self.positions = end
        # A padding position after a real one, in this step or since the row's first real token.
        after_real = np.logical_or.accumulate(flags, axis=1) | self._seen_real[:, None]
        self._gapped |= (after_real & ~flags).any(axis=1)
        self._seen_real |= flags.any(axis=1)

    # -- changes between steps ---------------------------------------------------------

    def reorder(self, index: np.ndarray) -> None:
        """Row i becomes old row index[i] (beam search, batch selection or repetition).
        Blocks are shared by reference, never copied here."""
        if self.tables is None:
            return
        index = np.asarray(index, np.int64).reshape(-1)
        if index.size and (index.min() < 0 or index.max() >= len(self.tables)):
            raise IndexError(f"index: rows {index.tolist()[:8]} out of range for a batch of {len(self.tables)}")
        tables = [list(self.tables[i]) for i in index.tolist()]
        # Take the new references before dropping the old ones, so no shared block is freed
        # on the way. (A row never holds one block twice, so fancy-index += is exact.)
        for table in tables:
            if table:
                self.refcount[table] += 1
        for table in self.tables:
            for block in table:
                self._release(block)
        self.tables = tables
        self.lens = self.lens[index]
        self._real = self._real[index]
        self._seen_real = self._seen_real[index]
        self._gapped = self._gapped[index]
        self.epoch += 1

    def crop(self, count: int) -> None:
        """Forget the last `count` positions of every row (assisted decoding's rollback)."""
        if count <= 0 or self.tables is None:
            return
        count = min(count, self.positions)
        keep = self.positions - count
        self.lens -= self._real[:, keep : self.positions].sum(axis=1)
        bs = self.block_size
        for b, table in enumerate(self.tables):
            needed = -(-int(self.lens[b]) // bs)
            for block in table[needed:]:
                self._release(block)
            del table[needed:]
        self.positions = keep
        flags = self._real[:, :keep]
        self._seen_real = flags.any(axis=1)
        after_real = np.logical_or.accumulate(flags, axis=1) if keep else flags
        self._gapped = (after_real & ~flags).any(axis=1)
        self.epoch += 1

    def reset(self) -> None:
        """Drop every row; the pool keeps its capacity (the layers keep their tensors)."""
        if self.tables is not None:
            for table in self.tables:
                for block in table:
                    self._release(block)
        self._clear_rows()
        self.epoch += 1

    def check(self) -> None:
        """Invariants, for tests: reference counts match the tables, free blocks are unused."""
        counts = np.zeros(self.capacity, np.int64)
        for table in self.tables or []:
            np.add.at(counts, np.asarray(table, np.int64), 1)
        assert (counts == self.refcount).all(), "refcounts disagree with the block tables"
        assert sorted(self.free) == sorted(np.flatnonzero(counts == 0).tolist()), "free list disagrees"
        for b, table in enumerate(self.tables or []):
            assert len(table) == -(-int(self.lens[b]) // self.block_size), f"row {b}: table length"
            assert int(self.lens[b]) == int(self._real[b, : self.positions].sum()), f"row {b}: length"
