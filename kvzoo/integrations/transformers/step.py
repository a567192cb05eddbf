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
host-side bounds, so no layer reads anything back from the device.

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


class TableMetadata:
    """Device views of one table's StepLayout (its docstring gives the shapes); int32."""

    def __init__(self, layout: StepLayout, arrays: dict[str, torch.Tensor]) -> None:
        self.layout = layout
        self.slot_mapping = arrays["slot_mapping"]
        self.block_tables = arrays["block_tables"]
        self.seq_lens = arrays["seq_lens"]
        self.query_start_loc = arrays["query_start_loc"]
        self.copies = (arrays["copy_src"], arrays["copy_dst"]) if len(layout.copies) else None


def _segments(layout: StepLayout) -> dict[str, np.ndarray]:
    arrays = {
        "slot_mapping": layout.slot_mapping,
        "block_tables": layout.block_tables,
        "seq_lens": layout.seq_lens,
        "query_start_loc": layout.query_start_loc,
    }
    if len(layout.copies):
        arrays["copy_src"], arrays["copy_dst"] = layout.copies[:, 0], layout.copies[:, 1]
    return arrays


class ForwardStep:
    """Every table's metadata for one forward step on `device`, the rows the query keeps (None:
    every token is real), and the layers run so far."""

    def __init__(self, layouts: Mapping[int | None, StepLayout], device: torch.device | str, epoch: int = 0) -> None:
        device = torch.device(device)
        self.epoch = epoch
        self.layouts = dict(layouts)
        first = next(iter(self.layouts.values()))
        self.batch, self.q_len, self.start = first.batch, first.q_len, first.start
        named: list[tuple[int | None, str, np.ndarray]] = [
            (key, name, a) for key, layout in self.layouts.items() for name, a in _segments(layout).items()
        ]
        if first.real_rows is not None:
            named.append((None, "real_rows", first.real_rows))
        offsets, total = [], 0
        for _, _, a in named:
            offsets.append(total)
            total += -(-a.size // _ALIGN) * _ALIGN
        host = torch.empty(max(total, 1), dtype=torch.int32, pin_memory=device.type == "cuda")
        flat = host.numpy()
        for (_, _, a), at in zip(named, offsets):
            flat[at : at + a.size] = a.reshape(-1)
        buffer = host.to(device, non_blocking=True) if device.type != "cpu" else host
        views: dict[int | None, dict[str, torch.Tensor]] = {key: {} for key in self.layouts}
        self.real_rows = None
        for (key, name, a), at in zip(named, offsets):
            view = buffer[at : at + a.size].view(a.shape)
            if name == "real_rows":
                self.real_rows = view
            else:
                views[key][name] = view
        self.tables = {key: TableMetadata(layout, views[key]) for key, layout in self.layouts.items()}
        self.done: set[int] = set()  # layer indices that have run this step
        self._plans: dict[tuple[Any, ...], StepPlan] = {}

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
        meta = self.tables[table]
        lay = meta.layout
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
            meta, store, num_q_heads, softmax_scale, sliding_window, softcap, sinks, rounding, impl, validate
        )
        # [B, H, Q, D] -> [B*Q, H, D]: kvzoo's token-major rows (one copy unless B == 1).
        rows = batch * q_len
        k = key.transpose(1, 2).reshape(rows, num_kv_heads, head_size)
        v = value.transpose(1, 2).reshape(rows, num_kv_heads, head_size)
        plan.write(k, v, t, k_scale=store.k_scale, v_scale=store.v_scale)
        if fresh_prefill and self.fresh_attention_applies(sliding_window, softcap, sinks):
            return fresh_attention(query, key, value, softmax_scale)
        q = query.transpose(1, 2).reshape(rows, num_q_heads, head_size)
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
        spec = store.spec(rounding)
        impl_key = tuple(sorted(impl.items())) if isinstance(impl, Mapping) else impl
        key = (id(meta), spec, num_q_heads, softmax_scale, sliding_window, softcap, sinks is not None, impl_key)
        plan = self._plans.get(key)
        if plan is None:
            lay = meta.layout
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
                max_seq_len=lay.max_seq_len,
                num_prefills=lay.num_prefills,
                validate=validate,
                impl=impl,
            )
            self._plans[key] = plan
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
