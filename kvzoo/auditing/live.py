"""Which rows of the pages are live, read from the block tables, and what is wrong with the tables.

A (block, slot) row is live when some sequence's first seq_lens[s] tokens map to it (SPEC.md
section 7: token i of sequence s is at block block_tables[s, i // block_size], offset
i % block_size). Only the first ceil(seq_lens[s] / block_size) entries of a table row are read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .dump import CacheDump
from .report import Finding


@dataclass(frozen=True)
class LiveRows:
    """The live rows, one per (block, slot), sorted by (block, slot).

    block, slot: int64 [R]. seq: the first sequence reading it; position: its position there;
    token: its index in the packed order of all sequences' tokens (sum(seq_lens[:seq]) +
    position), where the K/V given with a dump keep it. readers: how many sequences read it.
    """

    block: np.ndarray
    slot: np.ndarray
    seq: np.ndarray
    position: np.ndarray
    token: np.ndarray
    readers: np.ndarray

    def __len__(self) -> int:
        return int(self.block.shape[0])


def live_rows(dump: CacheDump, usable: np.ndarray, lens: np.ndarray) -> LiveRows:
    """The live rows of the sequences marked usable, with lengths `lens` (int64 [S], clamped to
    what their table rows hold)."""
    bs = dump.block_size
    counts = np.where(usable, lens, 0)
    seq = np.repeat(np.arange(dump.num_seqs, dtype=np.int64), counts)
    packed_start = np.concatenate([[0], np.cumsum(np.clip(dump.seq_lens, 0, None))[:-1]]).astype(np.int64)
    run_start = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    position = np.arange(int(counts.sum()), dtype=np.int64) - run_start[seq]
    block = dump.block_tables[seq, position // bs] if len(seq) else np.zeros(0, np.int64)
    where = block * bs + position % bs
    # np.unique's index is the first occurrence: the lowest sequence reading a row.
    rows, first, readers = np.unique(where, return_index=True, return_counts=True)
    return LiveRows(
        block=rows // bs,
        slot=rows % bs,
        seq=seq[first],
        position=position[first],
        token=packed_start[seq[first]] + position[first],
        readers=readers,
    )


def table_findings(dump: CacheDump) -> tuple[list[Finding], np.ndarray, np.ndarray]:
    """Findings about seq_lens and the block tables, and (usable, lens): which sequences' rows
    can be checked (every live table entry in range) and their lengths as the tables hold them."""
    bs, nb = dump.block_size, dump.num_blocks
    num_seqs, max_blocks = dump.block_tables.shape
    findings: list[Finding] = []
    lens = dump.seq_lens.copy()
    for s in np.flatnonzero((lens < 0) | (lens > max_blocks * bs)).tolist():
        findings.append(
            Finding(
                "seq_len_out_of_range",
                None,
                s,
                None,
                None,
                f"seq_lens[{s}] = {int(lens[s])}, but its table row holds 0 .. {max_blocks * bs} tokens "
                f"({max_blocks} blocks of {bs})",
            )
        )
    lens = np.clip(lens, 0, max_blocks * bs)
    used = -(-lens // bs)
    live_entry = np.arange(max_blocks)[None, :] < used[:, None]
    bad = live_entry & ((dump.block_tables < 0) | (dump.block_tables >= nb))
    for s, i in np.argwhere(bad).tolist():
        block = int(dump.block_tables[s, i])
        findings.append(
            Finding(
                "block_out_of_range",
                None,
                s,
                block,
                None,
                f"block_tables[{s}, {i}] = {block} (tokens {i * bs} .. {min((i + 1) * bs, int(lens[s])) - 1}); "
                f"blocks are 0 .. {nb - 1}",
            )
        )
    usable = ~bad.any(axis=1)
    findings += _sharing_findings(dump, lens, used, usable)
    return findings, usable, lens


def _sharing_findings(dump: CacheDump, lens: np.ndarray, used: np.ndarray, usable: np.ndarray) -> list[Finding]:
    bs = dump.block_size
    findings: list[Finding] = []
    # One sequence naming a block twice: ids of its live entries, sorted per row.
    readers: dict[int, list[int]] = {}
    for s in np.flatnonzero(usable & (used > 0)).tolist():
        ids = dump.block_tables[s, : used[s]]
        values, first, counts = np.unique(ids, return_index=True, return_counts=True)
        for block, i in zip(values[counts > 1].tolist(), first[counts > 1].tolist()):
            again = np.flatnonzero(ids == block)[1:].tolist()
            findings.append(
                Finding(
                    "block_repeated",
                    None,
                    s,
                    block,
                    None,
                    f"block {block} is entry {i} and again entries {again} of sequence {s}'s table",
                )
            )
        for block in values.tolist():
            readers.setdefault(block, []).append(s)
    # A sequence whose last block is partly filled writes its next token there: a problem when
    # another sequence reads the block too.
    for s in np.flatnonzero(usable & (lens % bs != 0)).tolist():
        tail = int(dump.block_tables[s, used[s] - 1])
        others = [r for r in readers.get(tail, []) if r != s]
        if others:
            filled = int(lens[s] % bs)
            findings.append(
                Finding(
                    "block_shared_partial",
                    None,
                    s,
                    tail,
                    filled,
                    f"sequence {s} holds {filled} of {bs} slots of its last block {tail} and writes its next token "
                    f"at slot {filled}; sequences {others} also read block {tail}",
                    position=int(lens[s]),
                )
            )
    return findings


def stale_slots(dump: CacheDump, live: LiveRows, usable: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, ...]:
    """(seq, block, slot) int64 [m]: in each usable sequence's partly filled last block, the
    slots past its seq_len that no sequence reads, where stale bytes are looked for."""
    bs = dump.block_size
    partial = np.flatnonzero(usable & (lens % bs != 0))
    free = bs - lens[partial] % bs
    seq = np.repeat(partial, free)
    slot = np.arange(int(free.sum()), dtype=np.int64) - np.repeat(np.cumsum(free) - free, free)
    slot += np.repeat(lens[partial] % bs, free)
    block = dump.block_tables[seq, (lens[seq] - 1) // bs] if len(seq) else np.zeros(0, np.int64)
    keys = live.block * bs + live.slot  # sorted (live_rows' order)
    candidates = block * bs + slot
    read = np.isin(candidates, keys, assume_unique=False)
    return seq[~read], block[~read], slot[~read]
