"""What one decoder layer's KV-cache work costs on the CPU through kvzoo, against what a
transformers user runs instead (DynamicCache + torch SDPA), and how much of kvzoo's time is
its kernels.

    python bench/cpu_layer_cost.py [--context 256] [--calls 300] [--threads 1]

One decode step (batch 1) of a SmolLM2-135M-shaped layer (9 query heads, 3 KV heads, head 64,
float32) over `context` cached tokens. Rows, timed round-robin in one process, median of
`calls` calls each (a call: the layer's cache write, then its attention):

- kvzoo, transformers integration: ForwardStep.run_layer, what `attn_implementation=
  "kvzoo_paged"` runs per layer (plan_step once per step, then plan.write + plan.attention);
- kvzoo, the plan's calls: plan.write + plan.attention on torch CPU tensors;
- kvzoo, prepared launches: the launches the layer's calls are bound to, alone (kernels,
  their records, the step's work items), what the calls above cost at the least;
- DynamicCache + SDPA: transformers' DynamicCache layer update (torch.cat) and
  scaled_dot_product_attention with GQA;
- the floor: a Python call of an empty function with the same arguments.

Inputs are fresh random rows each run (torch.randn); nothing is checked here (the
conformance suite and tests/test_prepared_launch.py hold the launches to the bytes).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvzoo  # noqa: E402
from kvzoo.integrations.transformers._pages import PageTable  # noqa: E402
from kvzoo.integrations.transformers._store import LayerStore  # noqa: E402
from kvzoo.integrations.transformers.step import ForwardStep  # noqa: E402

HQ, HKV, D, BLOCK = 9, 3, 64, 16
MODE = "int8_per_token_head"


def _timed(fn, calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1, help="torch and Numba threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    try:
        import numba

        numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    except ImportError:
        pass

    # The integration: a prompt of `context` tokens, then one decode step planned.
    pages = PageTable(block_size=BLOCK)
    store = LayerStore(
        MODE, "separate", block_size=BLOCK, num_kv_heads=HKV, head_size=D, model_dtype=torch.float32, device="cpu"
    )
    prompt = ForwardStep({None: pages.plan_step(np.ones((1, args.context), bool))}, "cpu")
    q, k, v = (torch.randn(1, h, args.context, D) for h in (HQ, HKV, HKV))
    prompt.run_layer(None, store, q, k, v, softmax_scale=D**-0.5)
    pages.commit()
    step = ForwardStep({None: pages.plan_step(np.ones((1, 1), bool))}, "cpu")
    q, k, v = (torch.randn(1, h, 1, D) for h in (HQ, HKV, HKV))
    step.run_layer(None, store, q, k, v, softmax_scale=D**-0.5)  # plans and prepares
    plan = next(iter(step._plans.values()))
    caches = store.tensors
    q_rows, k_rows, v_rows = (
        q.transpose(1, 2).reshape(1, HQ, D),
        k.transpose(1, 2).reshape(1, HKV, D),
        v.transpose(1, 2).reshape(1, HKV, D),
    )
    out = torch.empty_like(q_rows)
    plan.write(k_rows, v_rows, caches)
    plan.attention(q_rows, caches, out=out)
    # The launches the layer's calls are bound to (the plan keeps them per layer), with the
    # operands the plan hands them.
    held = plan._layers[id(caches)]
    launches = None
    if held.write is None or held.attention is None:
        print(f"the plan bound no prepared write and attention launch ({plan.write_impl.name}): row left out")
    else:
        launches, write_ops, attend_ops = _bound(held, k_rows, v_rows, q_rows, out)

    # What a transformers user runs instead: DynamicCache's layer update, then SDPA with GQA.
    dyn = __import__("transformers").DynamicCache()
    kk, vv = torch.randn(1, HKV, args.context, D), torch.randn(1, HKV, args.context, D)
    dyn.update(kk, vv, 0)

    def dynamic():
        keys, values = dyn.update(k, v, 0)
        F.scaled_dot_product_attention(q, keys, values, enable_gqa=True, scale=D**-0.5)
        dyn.crop(-1)  # the same context every call

    def empty(*a, **kw):
        return None

    rows = {
        "kvzoo, transformers integration (run_layer)": lambda: step.run_layer(
            None, store, q, k, v, softmax_scale=D**-0.5
        ),
        "kvzoo, the plan's calls (plan.write + plan.attention)": lambda: (
            plan.write(k_rows, v_rows, caches),
            plan.attention(q_rows, caches, out=out),
        ),
    }
    if launches is not None:
        rows["kvzoo, prepared launches alone"] = lambda: (launches[0](write_ops), launches[1](attend_ops))
    rows["DynamicCache update + torch SDPA"] = dynamic
    rows["floor: an empty Python call"] = lambda: empty(store, q, k, v, softmax_scale=D**-0.5)
    for fn in rows.values():  # warm
        for _ in range(20):
            fn()
    times = {name: [] for name in rows}
    per_round = max(1, args.calls // 10)
    for _ in range(10):
        for name, fn in rows.items():
            times[name] += _timed(fn, per_round)
    impl = plan.write_impl.name, plan.attention_impl.name
    print(
        f"kvzoo {kvzoo.__version__}, torch {torch.__version__}, impls {impl}, mode {MODE}, decode of 1 sequence, "
        f"context {args.context}, Hq {HQ}, Hkv {HKV}, D {D}, float32, {args.threads} thread(s); "
        f"median of {10 * per_round} calls each, round-robin\n"
    )
    base = statistics.median(times["DynamicCache update + torch SDPA"])
    print("| per layer (write + attention) | us | vs DynamicCache + SDPA |\n|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med * 1e6:.1f} | {med / base:.2f}x |")
    return 0


def _bound(held, k_rows, v_rows, q_rows, out):
    """The layer's bound write and attention launches, and their operands as the plan hands
    them: the call's own arrays (as the implementation takes them) beside the layer's and the
    plan's, in CacheWrite's and Attention's operand order."""
    write, attend = held.write, held.attention

    def kind(x):
        return x if write.convert is None else write.convert(x)

    write_ops = (kind(k_rows), kind(v_rows), *write.fixed)
    attend_ops = (kind(q_rows), *attend.fixed, kind(out), *attend.tail, None)
    return (write.launch, attend.launch), write_ops, attend_ops


if __name__ == "__main__":
    sys.exit(main())
