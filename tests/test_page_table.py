"""The transformers integration's PageTable: its decode path against its general path.

A decode step (one real token a row) takes PageTable._plan_decode, a shorter path than the
general plan_step. Two tables driven through the same random histories (prompts with
padding, decode steps, beam reorders that share blocks, crops, resets, refused and rolled-back
steps, sliding windows) must give the same StepLayouts and the same state after every step:
one table takes the decode path where it applies, the other never does.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvzoo.integrations.transformers._pages import PagesFullError, PageTable, StepLayout


def _state(pages: PageTable) -> tuple:
    return (
        pages.positions,
        pages.lens.tolist(),
        None if pages.tables is None else [list(t) for t in pages.tables],
        pages.first_live.tolist(),
        pages.refcount.tolist(),
        list(pages.free),
        pages.capacity,
        pages._real[:, : pages.positions].tolist(),
        pages._seen_real.tolist(),
        pages._gapped.tolist(),
        pages.pending,
    )


def _same_layout(a: StepLayout, b: StepLayout) -> None:
    for field in dataclasses.fields(StepLayout):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            assert isinstance(x, np.ndarray) and isinstance(y, np.ndarray), field.name
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), field.name
        else:
            assert x == y, field.name


class _GeneralOnly(PageTable):
    def _plan_decode(self):  # type: ignore[override]
        return None


def _drive(seed: int, window: int | None, max_num_blocks: int | None, steps: int = 60, resets: bool = True) -> tuple:
    """One random history on both tables; returns how many steps took the decode path and the
    furthest position the decode path planned (past 64 it grows the table's record of which
    positions were real, PageTable._real)."""
    rng = np.random.default_rng(seed)
    block_size = int(rng.choice([1, 2, 4, 16]))
    kwargs = dict(window=window, window_slack=int(rng.integers(0, 5)) if window else 0)
    fast = PageTable(block_size, int(rng.integers(0, 6)), max_num_blocks, **kwargs)
    slow = _GeneralOnly(block_size, fast.capacity, max_num_blocks, **kwargs)
    taken = furthest = 0
    original = fast._plan_decode

    def counting():
        nonlocal taken, furthest
        layout = original()
        if layout is not None:
            taken += 1
            furthest = max(furthest, fast.positions)
        return layout

    fast._plan_decode = counting  # type: ignore[method-assign]
    batch = int(rng.integers(1, 6))
    actions = ["prompt", "decode", "decode", "decode", "reorder", "crop", "rollback"] + ["reset"] * resets
    for _ in range(steps):
        action = rng.choice(actions)
        if fast.tables is None and action != "prompt":
            action = "prompt"
        if action in ("prompt", "decode", "rollback"):
            if action == "prompt":
                q_len = int(rng.integers(1, 9))
                real = rng.random((batch, q_len)) < 0.8
                real[:, -1] = True  # left padding mostly, a hole now and then
                if rng.random() < 0.5:
                    real = np.sort(real, axis=1)
            else:
                real = None
            outcome = []
            for pages in (fast, slow):
                try:
                    outcome.append(
                        pages.plan_step(real if real is None else real.copy(), batch if real is None else None)
                    )
                except PagesFullError as e:
                    outcome.append(str(e))
            if isinstance(outcome[0], str) or isinstance(outcome[1], str):
                assert outcome[0] == outcome[1]
            else:
                _same_layout(outcome[0], outcome[1])
                for pages in (fast, slow):
                    pages.rollback() if action == "rollback" else pages.commit()
        elif action == "reorder":
            # Beam reorders keep the batch; batch_select_indices and repeat_interleave change it.
            rows = batch if rng.random() < 0.5 else int(rng.integers(1, 7))
            index = rng.integers(0, batch, rows)
            fast.reorder(index.copy())
            slow.reorder(index.copy())
            batch = rows
        elif action == "crop":
            count = int(rng.integers(1, 4))
            if fast.crop_refusal(count) is None:
                fast.crop(count)
                slow.crop(count)
        else:
            fast.reset()
            slow.reset()
        assert _state(fast) == _state(slow), action
        fast.check()
    return taken, furthest


@pytest.mark.parametrize("window", [None, 3, 9])
@pytest.mark.parametrize("max_num_blocks", [None, 24])
def test_decode_steps_plan_what_the_general_path_plans(window, max_num_blocks):
    taken = sum(_drive(seed, window, max_num_blocks)[0] for seed in range(12))
    assert taken > 50  # the decode path did run (a suite that never took it would prove nothing)


@pytest.mark.parametrize("window", [None, 9])
def test_long_decode_histories_plan_what_the_general_path_plans(window):
    """Histories without resets run past position 64, where the decode path grows the record of
    real positions (its _record branch)."""
    furthest = max(_drive(seed, window, None, steps=300, resets=False)[1] for seed in range(4))
    assert furthest > 64


def test_decode_step_into_a_shared_block_takes_the_general_path():
    pages = PageTable(block_size=4)
    pages.plan_step(np.ones((2, 6), bool))
    pages.commit()
    pages.reorder(np.array([0, 0]))
    assert pages._plan_decode() is None and not pages.pending  # refused before changing anything
    step = pages.plan_step(None)
    assert step.copies.tolist() == [[1, 3]]
