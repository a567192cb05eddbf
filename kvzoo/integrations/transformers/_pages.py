"""Host-side page bookkeeping for a group of layers: block tables, lengths, reference counts.

The layers of a decoder see the same tokens; layers that keep the same keys (every full-attention
layer, or every layer of one sliding window) share one PageTable, and each owns its own code and
scale tensors indexed by the table's block ids. Nothing here touches a device or imports torch;
the cache turns each step's StepLayouts into device tensors once (kvzoo.integrations.transformers.step).

Sequences are *compacted*: a padding token (attention_mask == 0) gets no slot, so row b's
kvzoo sequence holds only its real tokens, in order. kvzoo's causal rule over the compacted
sequence is then exactly "causal and not padding" over the positions: a real query token's
compacted index is the count of real tokens before it, and it attends all of those.

Blocks are reference-counted so that beam search (`reorder`) shares whole blocks between
beams; a shared block that is only partly filled is copied before a row appends to it
(copy-on-write), and the copies a step needs are listed in its StepLayout for every layer
to apply before writing.

Memory: the pool grows to what a step needs, by at least GROWTH of itself (so a decode loop
regrows a layer's tensors once per GROWTH of its size, not once per block), never past
max_num_blocks; `reserve` sizes it ahead. A sliding-window table (`window`) releases the
blocks that lie wholly before every row's window (less `window_slack` tokens kept for crop),
so its layers hold their window, not the whole sequence.

A step is a transaction: `plan_step` checks that the pool can take the step before it changes
anything, and keeps what `rollback` needs to put every row back; `commit` forgets it.

>>> import numpy as np
>>> pages = PageTable(block_size=4)
>>> step = pages.plan_step(np.array([[False, True, True], [True, True, True]]))  # row 0 left-padded
>>> step.seq_lens.tolist(), step.query_start_loc.tolist(), step.slot_mapping.tolist()
([2, 3], [0, 2, 5], [-1, 0, 1, 4, 5, 6])
>>> pages.commit()
>>> pages.reorder(np.array([1, 1]))      # both rows continue row 1 (beam search); block 0 is freed
>>> pages.plan_step(None).copies.tolist()   # row 0 copies the block it shares into block 0
[[1, 0]]
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# The pool grows by at least this fraction of itself: the cache holds at most this much more
# than its tokens need (and a partly filled block per row), and a long generation regrows its
# tensors O(log) times.
GROWTH = 1 / 32
# A step of at most this many tokens a row (and no padding) computes its slots one by one
# (decode steps into a block another row shares, and speculative steps of 2-4 tokens).
_FEW_TOKENS = 4


class PagesFullError(RuntimeError):
    """The cache needs more blocks than its max_num_blocks."""


@dataclass(frozen=True)
class StepLayout:
    """Where one forward step's tokens go; host arrays, shared by every layer of a table.

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
    block_size: int
    gapped: bool


@dataclass
class _Undo:
    """What a planned step changed, to put back (rollback)."""

    positions: int
    lens: np.ndarray
    seen_real: np.ndarray
    gapped: np.ndarray
    # Each row's table length before the step, or None where only the rows listed in `grown`
    # took one entry more (a decode step: the rest are as they were).
    table_lens: list[int] | None
    cow: list[tuple[int, int, int]]  # (row, source block, destination block)
    allocated: list[int]
    was_first: bool
    grown: list[int] = field(default_factory=list)


class PageTable:
    """Block allocator and per-row block tables (host side), grown on demand.

    block_size: tokens per block. num_blocks: blocks allocated up front. max_num_blocks: a
    hard ceiling (None: none), PagesFullError past it. window: the sliding window of the
    layers this table serves (None: full attention), whose blocks wholly before every row's
    window (less window_slack tokens) are released.
    """

    def __init__(
        self,
        block_size: int,
        num_blocks: int = 0,
        max_num_blocks: int | None = None,
        *,
        window: int | None = None,
        window_slack: int = 0,
    ) -> None:
        if block_size < 1 or num_blocks < 0:
            raise ValueError(f"block_size must be >= 1 and num_blocks >= 0, got {block_size}, {num_blocks}")
        if max_num_blocks is not None and max_num_blocks < num_blocks:
            raise ValueError(f"max_num_blocks ({max_num_blocks}) is below num_blocks ({num_blocks})")
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1 or None, got {window}")
        self.block_size = block_size
        self.max_num_blocks = max_num_blocks
        self.window, self.window_slack = window, max(0, int(window_slack))
        self.capacity = 0
        self.refcount = np.zeros(0, np.int32)
        self.free: list[int] = []
        self._add_blocks(num_blocks)
        # Counter of changes made outside a forward step (reorder, crop, reset): a step
        # planned before one of them is stale.
        self.epoch = 0
        self._undo: _Undo | None = None
        self._clear_rows()

    # -- rows --------------------------------------------------------------------------

    def _clear_rows(self) -> None:
        self.tables: list[list[int]] | None = None
        # Per row, the first table entry that holds a block (a sliding window released the
        # ones before it; they keep their old, valid ids, which no key the row attends reads).
        self.first_live = np.zeros(0, np.int64)
        self.lens = np.zeros(0, np.int64)
        self.positions = 0  # positions seen per row, padding included (HF's sequence length)
        self._real = np.zeros((0, 0), bool)  # [B, >= positions]: was position p of row b real
        self._seen_real: np.ndarray = np.zeros(0, bool)
        self._gapped: np.ndarray = np.zeros(0, bool)
        self._forget_mirror()

    def _forget_mirror(self) -> None:
        """Drop the block tables' array copy (some row changed other than by appending)."""
        # The tables as a [B, width] int32 array and how many entries of each row it holds:
        # a decode step appends, so only the rows' new blocks are copied in (the lists of a
        # 32K context run to thousands of entries a row).
        self._mirror: np.ndarray | None = None
        self._mirrored: list[int] = []

    def _block_tables(self, batch: int, widest: int | None = None) -> np.ndarray:
        """[batch, widest row (at least 1)] int32 of the rows' tables, zero-padded; widest: the
        longest row's length where the caller knows it (at least that: a smaller one would cut rows
        short)."""
        rows = self._rows
        if widest is None:
            widest = max(max((len(t) for t in rows), default=0), 1)
        mirror = self._mirror
        if mirror is None or mirror.shape[0] != batch:
            mirror, self._mirrored = np.zeros((batch, widest), np.int32), [0] * batch
        elif mirror.shape[1] < widest:
            grown = np.zeros((batch, max(widest, 2 * mirror.shape[1])), np.int32)
            grown[:, : mirror.shape[1]] = mirror
            mirror = grown
        for b, table in enumerate(rows):
            held = self._mirrored[b]
            if len(table) > held:
                mirror[b, held : len(table)] = table[held:]
                self._mirrored[b] = len(table)
        self._mirror = mirror
        return mirror[:, :widest].copy()

    @property
    def batch_size(self) -> int | None:
        return None if self.tables is None else len(self.tables)

    def blocks_in_use(self) -> int:
        return int(self.capacity - len(self.free))

    @property
    def _rows(self) -> list[list[int]]:
        """The block tables, for the paths that run once a step has set the batch."""
        if self.tables is None:
            raise ValueError("the cache holds no sequences yet: its first step sets the batch size")
        return self.tables

    def live_blocks(self, row: int) -> list[int]:
        return self._rows[row][int(self.first_live[row]) :]

    # -- blocks ------------------------------------------------------------------------

    def _add_blocks(self, count: int) -> None:
        if count <= 0:
            return
        new_capacity = self.capacity + count
        # Lowest ids first: pop() takes from the end.
        self.free.extend(range(new_capacity - 1, self.capacity - 1, -1))
        self.refcount = np.concatenate([self.refcount, np.zeros(count, np.int32)])
        self.capacity = new_capacity

    def _ensure_free(self, count: int) -> None:
        """At least `count` free blocks, growing the pool by at least GROWTH of itself; refused
        (nothing changed) past max_num_blocks."""
        deficit = count - len(self.free)
        if deficit <= 0:
            return
        needed = self.capacity + deficit
        if self.max_num_blocks is not None and needed > self.max_num_blocks:
            raise PagesFullError(
                f"the KV cache needs {needed} blocks of {self.block_size} tokens; max_num_blocks is "
                f"{self.max_num_blocks} (nothing was written: the step was refused whole)"
            )
        target = max(needed, self.capacity + int(np.ceil(self.capacity * GROWTH)))
        if self.max_num_blocks is not None:
            target = min(target, self.max_num_blocks)
        self._add_blocks(target - self.capacity)

    def reserve(self, num_blocks: int) -> None:
        """Hold at least num_blocks blocks in all (in use or free), e.g. batch x the blocks of
        the longest sequence a generation will reach, so it never regrows."""
        if num_blocks > self.capacity:
            if self.max_num_blocks is not None and num_blocks > self.max_num_blocks:
                raise PagesFullError(f"reserve: {num_blocks} blocks asked for; max_num_blocks is {self.max_num_blocks}")
            self._add_blocks(num_blocks - self.capacity)

    def _alloc(self) -> int:
        block = self.free.pop()
        self.refcount[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            self.free.append(block)

    # -- a forward step ----------------------------------------------------------------

    def _window_keep(self, length: int) -> int:
        """First table entry a row of `length` real tokens must keep for its next step (its
        next token attends `window` keys back, and crop may reach window_slack further)."""
        if self.window is None:
            return 0
        return max(0, length - self.window - self.window_slack) // self.block_size

    def _release_outside_window(self) -> None:
        # Idempotent on committed state (the rows' lengths decide it), so it stays outside the
        # step's transaction: a rolled-back step leaves these blocks released, as the next
        # attempt would release them again.
        if self.window is None or self.tables is None:
            return
        for b, table in enumerate(self.tables):
            keep = min(self._window_keep(int(self.lens[b])), max(len(table) - 1, 0))
            for i in range(int(self.first_live[b]), keep):
                self._release(table[i])
            self.first_live[b] = max(int(self.first_live[b]), keep)

    def plan_step(self, real: np.ndarray | None, batch: int | None = None, q_len: int | None = None) -> StepLayout:
        """Place one step's tokens: real [B, Q] bool (True = attend), or None for all real
        (then batch and q_len give the shape, defaulting to the current batch and 1). Refused
        whole, with nothing changed, when the pool cannot take it; otherwise rollback() undoes
        it until commit()."""
        if self._undo is not None:
            raise RuntimeError("plan_step: the previous step is neither committed nor rolled back")
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
        first = self.tables is None
        if real is None and q_len == 1 and not first and batch == len(self._rows):
            decode = self._plan_decode()
            if decode is not None:
                return decode
        if self.tables is not None and batch != len(self.tables):
            raise ValueError(
                f"batch: this step has {batch} rows but the cache holds {len(self.tables)}; change the batch "
                "through reorder_cache / batch_select_indices / batch_repeat_interleave"
            )
        flags = np.ones((batch, q_len), bool) if real is None else real
        n_new = flags.sum(axis=1).astype(np.int64)
        bs = self.block_size
        tables: list[list[int]] = [[] for _ in range(batch)] if self.tables is None else self.tables
        lens = np.zeros(batch, np.int64) if first else self.lens
        # Every block the step takes, counted before anything changes: a refusal changes nothing.
        # A copy-on-write leaves its source with one reader fewer, as the loop below will.
        needed, copied = 0, dict[int, int]()
        # Python ints in the per-row loops (a NumPy scalar costs more than the arithmetic).
        counts = n_new.tolist()
        for table, old, count in zip(tables, lens.tolist(), counts):
            if count:
                needed += max(0, -(-(old + count) // bs) - len(table))
                if old % bs and self.refcount[table[-1]] - copied.get(table[-1], 0) > 1:
                    copied[table[-1]] = copied.get(table[-1], 0) + 1
                    needed += 1
        self._ensure_free(needed)

        if first:
            self.tables, self.lens = tables, lens
            self.first_live = np.zeros(batch, np.int64)
            self._real = np.zeros((batch, max(64, q_len)), bool)
            self._seen_real = np.zeros(batch, bool)
            self._gapped = np.zeros(batch, bool)
        undo = _Undo(
            positions=self.positions,
            lens=self.lens.copy(),
            seen_real=self._seen_real.copy(),
            gapped=self._gapped.copy(),
            table_lens=[len(t) for t in self._rows],
            cow=[],
            allocated=[],
            was_first=first,
        )
        start = self.positions
        self._record(flags)
        slots = np.full(batch * q_len, -1, np.int64)
        few = real is None and q_len <= _FEW_TOKENS  # every row's slots one by one
        listed: list[int] = []
        copies: list[tuple[int, int]] = []
        lens_now = self.lens.tolist()
        for b, table in enumerate(self._rows):
            old, count = lens_now[b], counts[b]
            if count == 0:
                continue
            if old % bs and self.refcount[table[-1]] > 1:
                # The row appends into a block another row also reads: give it its own copy.
                src, dst = table[-1], self._alloc()
                self._release(src)
                copies.append((src, dst))
                undo.cow.append((b, src, dst))
                table[-1] = dst
                self._forget_mirror()
            new = old + count
            while len(table) * bs < new:
                block = self._alloc()
                undo.allocated.append(block)
                table.append(block)
            if few:
                listed.extend(table[p // bs] * bs + p % bs for p in range(old, new))
            else:
                pos = np.arange(old, new)
                row_slots = np.asarray(table, np.int64)[pos // bs] * bs + pos % bs
                if real is None:
                    slots[b * q_len : (b + 1) * q_len] = row_slots
                else:
                    slots[b * q_len + np.flatnonzero(flags[b])] = row_slots
            lens_now[b] = new
        if few:
            slots = np.asarray(listed, np.int64)
        self.lens = np.asarray(lens_now, np.int64)
        self._undo = undo
        block_tables = self._block_tables(batch)
        qsl = np.concatenate([[0], np.cumsum(n_new)]).astype(np.int32)
        return StepLayout(
            start=start,
            batch=batch,
            q_len=q_len,
            slot_mapping=slots,
            real_rows=None if flags.all() else np.flatnonzero(flags.reshape(-1)).astype(np.int64),
            block_tables=block_tables,
            seq_lens=self.lens.astype(np.int32),
            query_start_loc=qsl,
            copies=np.asarray(copies, np.int64).reshape(-1, 2),
            max_query_len=int(n_new.max()) if batch else 0,
            max_seq_len=int(self.lens.max()) if batch else 0,
            num_prefills=int((n_new > 1).sum()),
            capacity=self.capacity,
            block_size=self.block_size,
            gapped=bool(self._gapped.any()),
        )

    def _plan_decode(self) -> StepLayout | None:
        """plan_step of one real token a row (generate's decode step), or None where a row
        appends into a block another row shares (the general path copies it first). The same
        layout and bookkeeping as the general path, without its per-token arrays: this runs
        once per generated token, and each NumPy call it skips is host time the GPU waits for."""
        rows, bs = self._rows, self.block_size
        lens = self.lens.tolist()
        refcount = self.refcount
        needed = 0
        for table, old in zip(rows, lens):
            if old % bs == 0:
                needed += 1
            elif refcount[table[-1]] > 1:
                return None
        self._ensure_free(needed)
        batch, start = len(rows), self.positions
        undo = _Undo(
            positions=start,
            lens=self.lens,  # replaced below, never changed in place while a step is pending
            seen_real=self._seen_real,
            gapped=self._gapped,
            table_lens=None,
            cow=[],
            allocated=[],
            was_first=False,
        )
        if start >= self._real.shape[1]:
            self._record(np.ones((batch, 1), bool))
        else:
            # _record of an all-real column: no padding, so nothing is gapped and every row has
            # seen a real token.
            self._real[:, start] = True
            self.positions = start + 1
            self._seen_real = np.ones(batch, bool)
        slots = []
        for b, (table, old) in enumerate(zip(rows, lens)):
            offset = old % bs
            if offset == 0:
                block = self._alloc()
                undo.allocated.append(block)
                undo.grown.append(b)
                table.append(block)
                slots.append(block * bs)
            else:
                slots.append(table[-1] * bs + offset)
        self.lens = np.asarray(lens, np.int64) + 1
        self._undo = undo
        seq_lens = self.lens.astype(np.int32)
        max_seq_len = int(seq_lens.max()) if batch else 0
        return StepLayout(
            start=start,
            batch=batch,
            q_len=1,
            slot_mapping=np.asarray(slots, np.int64),
            real_rows=None,
            # A row's table holds a block per block_size tokens (PageTable.check).
            block_tables=self._block_tables(batch, max(-(-max_seq_len // bs), 1)),
            seq_lens=seq_lens,
            query_start_loc=np.arange(batch + 1, dtype=np.int32),
            copies=np.zeros((0, 2), np.int64),
            max_query_len=1 if batch else 0,
            max_seq_len=max_seq_len,
            num_prefills=0,
            capacity=self.capacity,
            block_size=bs,
            gapped=bool(self._gapped.any()),
        )

    def commit(self) -> None:
        """The planned step ran on every layer: keep it (and release what left the windows)."""
        self._undo = None
        self._release_outside_window()

    def rollback(self) -> None:
        """Put every row back as it was before the planned step (nothing if none is pending).
        The pool keeps any growth: only block ownership and lengths are undone."""
        undo, self._undo = self._undo, None
        if undo is None:
            return
        self._forget_mirror()
        for block in reversed(undo.allocated):
            self._release(block)
        for b, src, dst in reversed(undo.cow):
            self._rows[b][-1] = src
            self.refcount[src] += 1
            self._release(dst)
        if undo.was_first:
            self._clear_rows()
            return
        if undo.table_lens is None:
            for b in undo.grown:
                self._rows[b].pop()
        else:
            for b, n in enumerate(undo.table_lens):
                del self._rows[b][n:]
        self.positions, self.lens = undo.positions, undo.lens
        self._seen_real, self._gapped = undo.seen_real, undo.gapped

    @property
    def pending(self) -> bool:
        """Whether a planned step awaits commit or rollback."""
        return self._undo is not None

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
        self._gapped = self._gapped | (after_real & ~flags).any(axis=1)
        self._seen_real = self._seen_real | flags.any(axis=1)

    # -- changes between steps ---------------------------------------------------------

    def _between_steps(self, what: str) -> None:
        if self._undo is not None:
            raise RuntimeError(f"{what}: a planned step is neither committed nor rolled back")

    def reorder(self, index: np.ndarray) -> None:
        """Row i becomes old row index[i] (beam search, batch selection or repetition).
        Blocks are shared by reference, never copied here."""
        self._between_steps("reorder")
        if self.tables is None:
            return
        index = np.asarray(index, np.int64).reshape(-1)
        if index.size and (index.min() < 0 or index.max() >= len(self.tables)):
            raise IndexError(f"index: rows {index.tolist()[:8]} out of range for a batch of {len(self.tables)}")
        tables = [list(self.tables[i]) for i in index.tolist()]
        first_live = self.first_live[index]
        # Take the new references before dropping the old ones, so no shared block is freed
        # on the way. (A row never holds one block twice, so fancy-index += is exact.)
        for table, live in zip(tables, first_live.tolist()):
            if len(table) > live:
                self.refcount[table[live:]] += 1
        for b in range(len(self.tables)):
            for block in self.live_blocks(b):
                self._release(block)
        self.tables, self.first_live = tables, first_live
        self._forget_mirror()
        self.lens = self.lens[index]
        self._real = self._real[index]
        self._seen_real = self._seen_real[index]
        self._gapped = self._gapped[index]
        self.epoch += 1

    def crop_refusal(self, count: int) -> str | None:
        """Why crop(count) cannot be done (a sliding window released what it would need), or None."""
        if count <= 0 or self.tables is None or self.window is None:
            return None
        keep = self.positions - min(count, self.positions)
        lens = self.lens - self._real[:, keep : self.positions].sum(axis=1)
        for b, length in enumerate(lens.tolist()):
            need_from = max(0, length - self.window + 1) // self.block_size
            if need_from < int(self.first_live[b]):
                return (
                    f"row {b} would attend keys from position {max(0, length - self.window + 1)}, which its "
                    f"sliding window (window {self.window} + window_slack {self.window_slack}) already released"
                )
        return None

    def crop(self, count: int) -> None:
        """Forget the last `count` positions of every row (assisted decoding's rollback)."""
        self._between_steps("crop")
        if count <= 0 or self.tables is None:
            return
        refusal = self.crop_refusal(count)
        if refusal:
            raise ValueError(f"crop: {refusal}")
        self._forget_mirror()
        count = min(count, self.positions)
        keep = self.positions - count
        self.lens -= self._real[:, keep : self.positions].sum(axis=1)
        bs = self.block_size
        for b, table in enumerate(self.tables):
            needed = max(-(-int(self.lens[b]) // bs), int(self.first_live[b]))
            for block in table[max(needed, int(self.first_live[b])) :]:
                self._release(block)
            del table[needed:]
        self.positions = keep
        flags = self._real[:, :keep]
        # asarray: NumPy's stubs allow a reduction over axis 1 to be a scalar.
        self._seen_real = np.asarray(flags.any(axis=1))
        after_real = np.logical_or.accumulate(flags, axis=1) if keep else flags
        self._gapped = np.asarray((after_real & ~flags).any(axis=1))
        self.epoch += 1

    def reset(self) -> None:
        """Drop every row; the pool keeps its capacity (the layers keep their tensors)."""
        self.rollback()
        if self.tables is not None:
            for b in range(len(self.tables)):
                for block in self.live_blocks(b):
                    self._release(block)
        self._clear_rows()
        self.epoch += 1

    def check(self) -> None:
        """Invariants, for tests: reference counts match the tables, free blocks are unused."""
        counts = np.zeros(self.capacity, np.int64)
        for b in range(len(self.tables or [])):
            np.add.at(counts, np.asarray(self.live_blocks(b), np.int64), 1)
        assert (counts == self.refcount).all(), "refcounts disagree with the block tables"
        assert sorted(self.free) == sorted(np.flatnonzero(counts == 0).tolist()), "free list disagrees"
        for b, table in enumerate(self.tables or []):
            assert len(table) == -(-int(self.lens[b]) // self.block_size), f"row {b}: table length"
            assert int(self.lens[b]) == int(self._real[b, : self.positions].sum()), f"row {b}: length"
            assert all(0 <= x < self.capacity for x in table), f"row {b}: an entry outside the pool"
