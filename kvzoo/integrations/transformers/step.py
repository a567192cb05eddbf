"""One forward step's metadata on the device, built once and run by every layer.

A transformers forward pass calls attention once per layer with the same tokens; the block
tables, lengths, query offsets and slots are the same for all of them. `ForwardStep.build`
moves a StepLayout (kvzoo.integrations.transformers._pages) to the device once; each layer's
`run_layer` then writes its K/V and attends through a kvzoo engine-step plan
(kvzoo.plan_step), built on the first layer that needs it and shared by every layer with the
same cache geometry and attention parameters (Gemma2's sliding and global layers get one plan
each). The plan is built with validate=False and the host-side bounds, so no layer reads
anything back from the device.

>>> import numpy as np, torch
>>> from kvzoo.integrations.transformers._pages import PageTable
>>> from kvzoo.integrations.transformers._store import LayerStore
>>> pages = PageTable(block_size=16)
>>> step = ForwardStep.build(pages.plan_step(np.ones((2, 5), bool)), "cpu", epoch=0)
>>> store = LayerStore("int8_per_token_head", "separate", block_size=16, num_kv_heads=2, head_size=16,
...                    model_dtype=torch.float32, device="cpu")
>>> q, k, v = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16)  # [B, H, Q, D]
>>> tuple(step.run_layer(store, q, k, v, softmax_scale=0.25, impl="numpy").shape)  # [B, Q, Hq, D]
(2, 5, 4, 16)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ...plan import StepPlan, plan_step
from ._pages import StepLayout
from ._store import LayerStore

ImplChoice = str | Mapping[str, Any] | None


class ForwardStep:
    """Device copies of a StepLayout (see its docstring for shapes), plus the layers run so far."""

    def __init__(self, layout: StepLayout, device: torch.device | str, epoch: int) -> None:
        def put(a: Any) -> torch.Tensor:
            return torch.from_numpy(a).to(device)

        self.layout, self.epoch = layout, epoch
        self.slot_mapping = put(layout.slot_mapping)
        self.block_tables = put(layout.block_tables)
        self.seq_lens = put(layout.seq_lens)
        self.query_start_loc = put(layout.query_start_loc)
        self.real_rows = None if layout.real_rows is None else put(layout.real_rows)
        self.copies = None
        if len(layout.copies):
            self.copies = (put(layout.copies[:, 0].copy()), put(layout.copies[:, 1].copy()))
        self.done: set[int] = set()  # layer indices that have run this step
        self._plans: dict[tuple[Any, ...], StepPlan] = {}

    @classmethod
    def build(cls, layout: StepLayout, device: torch.device | str, epoch: int) -> ForwardStep:
        return cls(layout, device, epoch)

    def run_layer(
        self,
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
    ) -> torch.Tensor:
        """Write this step's K/V into `store`, then attend: query [B, Hq, Q, D], key/value
        [B, Hkv, Q, D] (transformers' layout) -> [B, Q, Hq, D]; padding query rows give 0."""
        lay = self.layout
        batch, num_q_heads, q_len, head_size = query.shape
        num_kv_heads = key.shape[1]
        if (batch, q_len) != (lay.batch, lay.q_len):
            raise ValueError(
                f"query: [B={batch}, Q={q_len}] but this step was planned for [B={lay.batch}, Q={lay.q_len}]"
            )
        store.ensure(lay.capacity)
        if self.copies is not None:
            store.copy_blocks(*self.copies)
        t = store.tensors
        plan = self._plan(store, num_q_heads, softmax_scale, sliding_window, softcap, sinks, rounding, impl, validate)
        # [B, H, Q, D] -> [B*Q, H, D]: kvzoo's token-major rows (one copy unless B == 1).
        rows = batch * q_len
        k = key.transpose(1, 2).reshape(rows, num_kv_heads, head_size)
        v = value.transpose(1, 2).reshape(rows, num_kv_heads, head_size)
        plan.write(k, v, t, k_scale=store.k_scale, v_scale=store.v_scale)
        q = query.transpose(1, 2).reshape(rows, num_q_heads, head_size)
        if self.real_rows is not None:
            q = q.index_select(0, self.real_rows)
        out = plan.attention(q, t, k_scale=store.k_scale, v_scale=store.v_scale, sinks=sinks)
        if self.real_rows is not None:
            # Padding rows attend nothing; transformers ignores their outputs, so 0 is as good as any.
            full = out.new_zeros(rows, num_q_heads, head_size)
            full.index_copy_(0, self.real_rows, out)
            out = full
        return out.view(batch, q_len, num_q_heads, head_size)

    def _plan(
        self,
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
        key = (spec, num_q_heads, softmax_scale, sliding_window, softcap, sinks is not None, impl_key, validate)
        plan = self._plans.get(key)
        if plan is None:
            lay = self.layout
            plan = plan_step(
                spec,
                block_tables=self.block_tables,
                seq_lens=self.seq_lens,
                query_start_loc=self.query_start_loc,
                slot_mapping=self.slot_mapping,
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
