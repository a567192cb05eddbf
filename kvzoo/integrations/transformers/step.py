"""One forward step's metadata on the device, built once and run by every layer.

A transformers forward pass calls attention once per layer with the same tokens; the block
tables, lengths, query offsets and slots of a page table (kvzoo.integrations.transformers._pages)
are the same for all of its layers. `ForwardStep` moves every table's StepLayout to the device
at once: one host buffer, one copy. On a GPU that buffer is pinned and the copy does not block,
so the host never waits for the GPU to take a step's metadata (a copy from pageable memory
would wait for every kernel queued before it). Each layer's `run_layer` then writes its K/V and
attends through a kvzoo engine-step plan (kvzoo.plan_step), built on the first layer that needs
it and shared by every layer with the same cache geometry and attention parameters (Gemma2's
sliding and global layers get one plan each). The plan is built with validate=False and the
host-side bounds, so no layer reads anything back from the device. Without validation, steps
of one shape (decode: one token a row) keep their metadata buffer and plans across steps
(`KeptMetadata`): a layer's calls then go straight to the launch, as an engine's would.

>>> import numpy as np, torch
>>> from kvzoo.integrations.transformers._pages import PageTable
>>> from kvzoo.integrations.transformers._store import LayerStore
>>> pages = PageTable(block_size=16)
>>> step = ForwardStep({None: pages.plan_step(np.ones((2, 5), bool))}, "cpu")
>>> store = LayerStore("int8_per_token_head", "separate", block_size=16, num_kv_heads=2, head_size=16,
...                    model_dtype=torch.float32, device="cpu")
>>> q, k, v = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16)  # [B, H, Q, D]
>>> tuple(step.run_layer(None, store, q, k, v, softmax_scale=0.25, impl="numpy").shape)  # [B, Q, Hq, D]
(2, 5, 4, 16)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ...plan import StepPlan, plan_step
from ._pages import StepLayout
from ._store import LayerStore

ImplChoice = str | Mapping[str, Any] | None

# Each array starts on a 16-byte boundary of the step's buffer, so its views keep the same
# alignment from step to step (kvzoo's prepared launches are kept per alignment).
_ALIGN = 4  # int32 elements


# A kept step's plans are built with max_seq_len rounded up to this many tokens, so decode
# plans again once per that many tokens (each new plan's first call per layer takes the full
# check, about ten times a bound call's host time).
_SEQ_BOUND_STEP = 256


class TableMetadata:
    """Device views of one table's metadata (StepLayout's docstring gives the shapes; int32) and
    max_seq_len, the bound the table's plans are built with (the step's own, or over it when
    the views are kept across steps; block_tables is then wider than the step's, its extra
    columns 0 and never read, as every length is within the bound)."""

    def __init__(self, arrays: dict[str, torch.Tensor], max_seq_len: int) -> None:
        self.slot_mapping = arrays["slot_mapping"]
        self.block_tables = arrays["block_tables"]
        self.seq_lens = arrays["seq_lens"]
        self.query_start_loc = arrays["query_start_loc"]
        self.copies = (arrays["copy_src"], arrays["copy_dst"]) if "copy_src" in arrays else None
        self.max_seq_len = max_seq_len


def _segments(layout: StepLayout, width: int | None = None) -> dict[str, np.ndarray]:
    """The layout's arrays as they go into the step's buffer; block_tables widened to `width`."""
    tables = layout.block_tables
    if width is not None and width != tables.shape[1]:
        tables = np.zeros((layout.batch, width), np.int32)
        tables[:, : layout.block_tables.shape[1]] = layout.block_tables
    arrays = {
        "slot_mapping": layout.slot_mapping,
        "block_tables": tables,
        "seq_lens": layout.seq_lens,
        "query_start_loc": layout.query_start_loc,
    }
    if len(layout.copies):
        arrays["copy_src"], arrays["copy_dst"] = layout.copies[:, 0], layout.copies[:, 1]
    return arrays


def _pack(
    named: list[tuple[Any, str, np.ndarray]], device: torch.device, into: torch.Tensor | None = None
) -> tuple[torch.Tensor, list[int]]:
    """A pinned host buffer (a plain one on the CPU) holding the arrays, each at an offset of
    a multiple of _ALIGN elements, or `into` (a CPU buffer of the same arrays) refilled; and
    the offsets."""
    offsets, total = [], 0
    for _, _, a in named:
        offsets.append(total)
        total += -(-a.size // _ALIGN) * _ALIGN
    # int64 on the CPU: the CPU kernels index with int64, and take these without a copy.
    dtype = torch.int64 if device.type == "cpu" else torch.int32
    host = into if into is not None else torch.empty(max(total, 1), dtype=dtype, pin_memory=device.type == "cuda")
    flat = host.numpy()
    for (_, _, a), at in zip(named, offsets):
        flat[at : at + a.size] = a.reshape(-1)
    return host, offsets


def _views(
    buffer: torch.Tensor, named: list[tuple[Any, str, np.ndarray]], offsets: list[int]
) -> dict[Any, dict[str, torch.Tensor]]:
    views: dict[Any, dict[str, torch.Tensor]] = {}
    for (key, name, a), at in zip(named, offsets):
        views.setdefault(key, {})[name] = buffer[at : at + a.size].view(a.shape)
    return views


class KeptMetadata:
    """A decode step's metadata kept on the device across forward steps, and the plans built
    on it: a step of the same shape (batch, query length, each table's capacity) whose lengths
    are within the kept bounds copies its arrays into the same device buffer and runs the same
    plans, so each layer's calls take the plan's bound path (kvzoo.plan) instead of a full check
    per layer and step. The plans read the buffer by reference (what kvzoo.plan allows between
    steps: every bound still an upper bound), and the copy is queued on the stream behind the
    previous step's kernels, so those read their own step's metadata."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Drop the buffer and the plans (and the caches objects the plans hold)."""
        self._key: tuple[Any, ...] | None = None
        self._bounds: dict[int | None, tuple[int, int]] = {}  # table: (block-table width, max_seq_len)
        self._buffer: torch.Tensor | None = None
        self.tables: dict[int | None, TableMetadata] = {}
        self.plans: dict[tuple[Any, ...], StepPlan] = {}

    @staticmethod
    def keeps(layouts: Mapping[int | None, StepLayout]) -> bool:
        """Whether steps of these layouts can be kept: no padding row to gather and no
        copy-on-write (both are per-step arrays)."""
        return all(lay.real_rows is None and not len(lay.copies) for lay in layouts.values())

    def load(self, layouts: Mapping[int | None, StepLayout], device: torch.device) -> dict[int | None, TableMetadata]:
        """This step's metadata in the kept buffer (made anew, with new bounds and no plans,
        where the step's shape changed or a length passed its bound); the tables' views."""
        first = next(iter(layouts.values()))
        key = (
            device,
            first.batch,
            first.q_len,
            first.max_query_len,
            first.num_prefills,
            tuple((table, lay.capacity) for table, lay in layouts.items()),
        )
        if key != self._key or any(
            lay.block_tables.shape[1] > self._bounds[t][0] or lay.max_seq_len > self._bounds[t][1]
            for t, lay in layouts.items()
        ):
            self.clear()
            self._key = key
            for t, lay in layouts.items():
                bound = -(-max(lay.max_seq_len, 1) // _SEQ_BOUND_STEP) * _SEQ_BOUND_STEP
                # Every row's blocks cover its length within a block, and a window's rows keep
                # one more (the block their window starts in).
                width = max(lay.block_tables.shape[1], -(-bound // lay.block_size) + 1)
                self._bounds[t] = (width, bound)
        named = [(t, name, a) for t, lay in layouts.items() for name, a in _segments(lay, self._bounds[t][0]).items()]
        on_cpu = device.type == "cpu"
        # On the CPU the kept buffer is refilled where it is: the step before's kernels have all run.
        host, offsets = _pack(named, device, self._buffer if on_cpu else None)
        if self._buffer is None:
            self._buffer = host if on_cpu else host.to(device, non_blocking=True)
            views = _views(self._buffer, named, offsets)
            self.tables = {t: TableMetadata(views[t], self._bounds[t][1]) for t in layouts}
        elif not on_cpu:
            self._buffer.copy_(host, non_blocking=True)
        return self.tables


class ForwardStep:
    """Every table's metadata for one forward step on `device`, the rows the query keeps (None:
    every token is real), and the layers run so far. kept: where a decode step's metadata and
    plans are kept across steps (None, or a step it does not keep: this step's own)."""

    def __init__(
        self,
        layouts: Mapping[int | None, StepLayout],
        device: torch.device | str,
        epoch: int = 0,
        kept: KeptMetadata | None = None,
    ) -> None:
        device = torch.device(device)
        self.epoch = epoch
        self.layouts = dict(layouts)
        first = next(iter(self.layouts.values()))
        self.batch, self.q_len, self.start = first.batch, first.q_len, first.start
        self.done: set[int] = set()  # layer indices that have run this step
        self.real_rows: torch.Tensor | None = None
        self._plans: dict[tuple[Any, ...], StepPlan]
        if kept is not None and KeptMetadata.keeps(self.layouts):
            self.tables = kept.load(self.layouts, device)
            self._plans = kept.plans
            return
        named: list[tuple[Any, str, np.ndarray]] = [
            (key, name, a) for key, layout in self.layouts.items() for name, a in _segments(layout).items()
        ]
        if first.real_rows is not None:
            named.append(("real_rows", "real_rows", first.real_rows))
        host, offsets = _pack(named, device)
        buffer = host.to(device, non_blocking=True) if device.type != "cpu" else host
        views = _views(buffer, named, offsets)
        if first.real_rows is not None:
            self.real_rows = views.pop("real_rows")["real_rows"]
        self.tables = {key: TableMetadata(views[key], lay.max_seq_len) for key, lay in self.layouts.items()}
        self._plans = {}

    def run_layer(
        self,
        table: int | None,
        store: LayerStore,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        softmax_scale: float | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        rounding: str = "nearest",
        impl: ImplChoice = None,
        validate: bool = False,
        fresh_prefill: bool = False,
    ) -> torch.Tensor:
        """Write this step's K/V into `store` (a layer of page table `table`), then attend: query
        [B, Hq, Q, D], key/value [B, Hkv, Q, D] (transformers' layout) -> [B, Q, Hq, D]; padding
        query rows give 0. fresh_prefill: attend with torch SDPA on this step's own K/V where
        that is the same attention (fresh_attention_applies), and over the pages otherwise."""
        meta, lay = self.tables[table], self.layouts[table]
        batch, num_q_heads, q_len, head_size = query.shape
        num_kv_heads = key.shape[1]
        if (batch, q_len) != (lay.batch, lay.q_len):
            raise ValueError(
                f"query: [B={batch}, Q={q_len}] but this step was planned for [B={lay.batch}, Q={lay.q_len}]"
            )
        store.ensure(lay.capacity)
        if meta.copies is not None:
            store.copy_blocks(*meta.copies)
        t = store.tensors
        plan = self._plan(
            meta, lay, store, num_q_heads, softmax_scale, sliding_window, softcap, sinks, rounding, impl, validate
        )
        # [B, H, Q, D] -> [B*Q, H, D]: kvzoo's token-major rows (one copy unless B == 1 or, a
        # view of any strides, Q == 1: the kernels take those).
        rows = batch * q_len
        if q_len == 1:
            # squeeze(2): the view select(2, 0) gives, at about half its dispatcher time
            # (bench/probes/integration_host.py).
            k, v = key.squeeze(2), value.squeeze(2)
        else:
            k = key.transpose(1, 2).reshape(rows, num_kv_heads, head_size)
            v = value.transpose(1, 2).reshape(rows, num_kv_heads, head_size)
        plan.write(k, v, t, k_scale=store.k_scale, v_scale=store.v_scale)
        if fresh_prefill and self.fresh_attention_applies(sliding_window, softcap, sinks):
            return fresh_attention(query, key, value, softmax_scale)
        q = query.squeeze(2) if q_len == 1 else query.transpose(1, 2).reshape(rows, num_q_heads, head_size)
        if self.real_rows is not None:
            q = q.index_select(0, self.real_rows)
        out = plan.attention(q, t, k_scale=store.k_scale, v_scale=store.v_scale, sinks=sinks)
        # (out, lse) only when the lse is asked for; a tensor, as the rows are.
        assert isinstance(out, torch.Tensor)
        if self.real_rows is not None:
            # Padding rows attend nothing; transformers ignores their outputs, so 0 is as good as any.
            full = out.new_zeros(rows, num_q_heads, head_size)
            full[self.real_rows] = out
            out = full
        return out.view(batch, q_len, num_q_heads, head_size)

    def fresh_attention_applies(self, sliding_window: int | None, softcap: float | None, sinks: Any) -> bool:
        """Whether every row attends only this step's own keys (the cache held none of its
        tokens before, and none is padding), causally, with nothing SDPA does not do."""
        return (
            self.start == 0
            and self.q_len > 1
            and self.real_rows is None
            and sliding_window is None
            and softcap is None
            and sinks is None
        )

    def _plan(
        self,
        meta: TableMetadata,
        lay: StepLayout,
        store: LayerStore,
        num_q_heads: int,
        softmax_scale: float | None,
        sliding_window: int | None,
        softcap: float | None,
        sinks: torch.Tensor | None,
        rounding: str,
        impl: ImplChoice,
        validate: bool,
    ) -> StepPlan:
        # A layer finds its plan again by identities (no CacheSpec to hash); a layer new to the
        # step looks it up by value, so the layers of one geometry share a plan.
        options = (num_q_heads, softmax_scale, sliding_window, softcap, sinks is not None, rounding)
        mine = (id(meta), id(store), store.num_blocks, id(impl), *options)
        plan = self._plans.get(mine)
        if plan is not None:
            return plan
        spec = store.spec(rounding)
        impl_key = tuple(sorted(impl.items())) if isinstance(impl, Mapping) else impl
        key = (id(meta), spec, *options, impl_key)
        plan = self._plans.get(key)
        if plan is None:
            plan = plan_step(
                spec,
                block_tables=meta.block_tables,
                seq_lens=meta.seq_lens,
                query_start_loc=meta.query_start_loc,
                slot_mapping=meta.slot_mapping,
                num_q_heads=num_q_heads,
                softmax_scale=softmax_scale,
                sliding_window=sliding_window,
                softcap=softcap,
                sinks=sinks,
                max_query_len=lay.max_query_len,
                max_seq_len=meta.max_seq_len,
                num_prefills=lay.num_prefills,
                validate=validate,
                impl=impl,
            )
            self._plans[key] = plan
        self._plans[mine] = plan
        return plan


def fresh_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, softmax_scale: float | None
) -> torch.Tensor:
    """Causal attention of a step over its own K/V ([B, H, Q, D] each, transformers' layout),
    by torch SDPA: [B, Q, Hq, D]. The numbers are DynamicCache + SDPA's, as exact as the model's
    dtype: the quantized pages are read from the next step on."""
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, is_causal=True, scale=softmax_scale, enable_gqa=query.shape[1] != key.shape[1]
    )
    return out.transpose(1, 2)
