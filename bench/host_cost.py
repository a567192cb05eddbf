"""How much host time does one layer's write and attention cost an engine, and how far is it
from the floor? The plan's per-layer calls beside the functional API, Triton's own launch of the
same kernel, kvzoo's bound relaunch of it, and the same kernel replayed from a CUDA graph.

Every row is one call followed by a synchronisation (torch.cuda.synchronize on a GPU), timed
`--calls` times round-robin with the other rows (so drift in the machine's state hits every
row alike); medians are reported. "returns" is the time until the call returns (the host's
own cost: the GPU runs behind it); "synchronised" adds the wait for the GPU, so it includes the
kernel's run, and "above null op" subtracts a call that only allocates an empty tensor and
synchronises. "back to back" is what an engine's step sees: 32 calls in a row (as 32 layers
make them), then one synchronisation, per call; a call right after a synchronisation runs
several times slower on the same host (cold caches after the wait), which the first columns
include and this one does not. The CUDA-graph replay row is the floor of "synchronised": launch latency and
the kernel itself with no host work per kernel. Writes the rows to $OUT/host_cost.json when
OUT is set.

    python bench/host_cost.py                    GPU: int8 decode 8 x 256 (Hq 32, Hkv 8, D 128), Triton
    python bench/host_cost.py --quick            CPU smoke run: tiny shapes, the registry's CPU choice (numba)
    python bench/host_cost.py --impl numpy       force an implementation (on CPU, triton-cuda runs interpreted)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():
    # The Triton kernels run on CPU tensors under the interpreter; set before triton loads.
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvzoo  # noqa: E402

# Targets on the H200's host (issue 16): per-layer plan calls, functional validate=False.
PLAN_TARGET_US, FUNCTIONAL_TARGET_US = 25.0, 60.0


@dataclasses.dataclass
class Shape:
    seqs: int
    seq_len: int
    num_q_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int


GPU_SHAPE = Shape(8, 256, 32, 8, 128, 16)
QUICK_SHAPE = Shape(4, 32, 4, 2, 64, 16)


def sync_for(device: str) -> Callable[[], None]:
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


class _Recorder:
    """Stands in for a Triton kernel object: records each launch's grid and arguments, and
    launches it, so the same launch can be replayed bare."""

    def __init__(self, kernel, calls: list) -> None:
        self.kernel, self.calls = kernel, calls

    def __getattr__(self, name):
        # The host code reads the kernel's signature (arg_names, params) to place arguments.
        return getattr(self.kernel, name)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((self.kernel, grid, args, kwargs))
            return self.kernel[grid](*args, **kwargs)

        return launch


def bare_triton(impl, problem, module_name: str, kernel_names: tuple[str, ...]) -> Callable[[], None] | None:
    """The Triton launches impl.run(problem) makes, replayed with the same arguments (no
    kvzoo code at all: Triton's launcher alone)."""
    if not impl.name.startswith("triton"):
        return None
    import importlib

    module = importlib.import_module(module_name)
    calls: list = []
    saved = {name: getattr(module, name) for name in kernel_names}
    try:
        for name, kernel in saved.items():
            setattr(module, name, _Recorder(kernel, calls))
        impl.run(problem)
    finally:
        for name, kernel in saved.items():
            setattr(module, name, kernel)

    def launch() -> None:
        for kernel, grid, args, kwargs in calls:
            kernel[grid](*args, **kwargs)

    return launch


def bound_relaunch(new_plan: Callable[..., Any], attr: str, call: Callable[[Any], None]) -> Callable[[], None] | None:
    """The launch a plan's implementation prepares for `call(plan)`, with the call's operands:
    kvzoo's relaunch and Triton's launcher alone (None where the implementation prepares
    none). The plan is given an implementation object of its own, so its first call prepares:
    one that has run the call already (kvzoo.launches keeps launches per signature) would not."""
    impl = getattr(new_plan(), attr)
    if impl.prepare is None:
        return None
    seen = []

    def prepare(problem, **kw):
        launch = impl.prepare(problem, **kw)
        return None if launch is None else (lambda operands: seen.append((launch, operands)))

    call(new_plan(**{attr: dataclasses.replace(impl, prepare=prepare)}))
    if not seen:
        return None
    launch, operands = seen[0]
    return lambda: launch(operands)


def graph_replay(call: Callable[[], None], device: str) -> Callable[[], None] | None:
    """`call` captured in a CUDA graph (after it ran once eagerly): its replay."""
    if device != "cuda":
        return None
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph.replay


def recorded_problem(new_plan: Callable[..., Any], attr: str, call: Callable[[Any], None]):
    """The problem record a plan hands its implementation, caught by a plan given an
    implementation object that records instead of running."""
    seen = []
    impl = getattr(new_plan(), attr)
    call(new_plan(**{attr: dataclasses.replace(impl, run=seen.append, prepare=None)}))
    return seen[0]


def build(shape: Shape, mode: str, device: str, impl: str | None):
    g = torch.Generator().manual_seed(4)
    blocks_per_seq = -(-shape.seq_len // shape.block_size)
    num_blocks = shape.seqs * blocks_per_seq
    spec = kvzoo.CacheSpec(
        mode,
        num_blocks=num_blocks,
        block_size=shape.block_size,
        num_kv_heads=shape.num_kv_heads,
        head_size=shape.head_size,
        model_dtype="bfloat16",
        device=device,
    )
    caches = spec.allocate()
    table = torch.randperm(num_blocks, generator=g).to(torch.int32).view(shape.seqs, blocks_per_seq)
    seq_lens = torch.full((shape.seqs,), shape.seq_len, dtype=torch.int32)
    pos = seq_lens.long() - 1  # one decode token per sequence, at its last position
    slots = table[torch.arange(shape.seqs), pos // shape.block_size].long() * shape.block_size + pos % shape.block_size

    def rows(heads):
        return torch.randn(shape.seqs, heads, shape.head_size, generator=g).to(torch.bfloat16).to(device)

    meta = dict(
        block_tables=table.to(device),
        seq_lens=seq_lens.to(device),
        query_start_loc=torch.arange(shape.seqs + 1, dtype=torch.int32, device=device),
    )
    s = dict(
        spec=spec,
        caches=caches,
        meta=meta,
        slot_mapping=slots.to(torch.int32).to(device),
        key=rows(shape.num_kv_heads),
        value=rows(shape.num_kv_heads),
        query=rows(shape.num_q_heads),
    )
    s["out"] = torch.empty_like(s["query"])
    s["plan_args"] = dict(**meta, slot_mapping=s["slot_mapping"], num_q_heads=shape.num_q_heads, impl=impl)
    s["bounds"] = dict(max_query_len=1, max_seq_len=shape.seq_len, num_prefills=0)
    return s


def calls(s: dict, impl: str | None, device: str) -> tuple[dict[str, Callable[[], None]], object]:
    spec, c, meta = s["spec"], s["caches"], s["meta"]
    key, value, query, out, slots = s["key"], s["value"], s["query"], s["out"], s["slot_mapping"]
    mode = spec.mode
    ops = {"write_impl": "reshape_and_cache", "attention_impl": "paged_attention"}

    def new_plan(**given):
        """A plan of the bench's step; given: write_impl or attention_impl, an Implementation
        object the plan runs that operation on (the other is the bench's choice)."""
        args = dict(s["plan_args"])
        if given:
            args["impl"] = {op: given.get(attr, impl) for attr, op in ops.items()}
        return kvzoo.plan_step(spec, **args)

    plan = new_plan()
    scales = dict(k_scale_cache=c.k_scale_cache, v_scale_cache=c.v_scale_cache)

    def write(validate):
        return lambda: kvzoo.reshape_and_cache(
            key, value, c.key_cache, c.value_cache, slots, mode=mode, **scales, impl=impl, validate=validate
        )

    def attend(validate):
        bounds = {} if validate else s["bounds"]
        return lambda: kvzoo.paged_attention(
            query,
            c.key_cache,
            c.value_cache,
            mode=mode,
            **meta,
            **scales,
            out=out,
            impl=impl,
            validate=validate,
            **bounds,
        )

    plan_write = lambda: plan.write(key, value, c)
    plan_attention = lambda: plan.attention(query, c, out=out)
    write_problem = recorded_problem(new_plan, "write_impl", lambda p: p.write(key, value, c))
    attention_problem = recorded_problem(new_plan, "attention_impl", lambda p: p.attention(query, c, out=out))
    w_impl, a_impl = plan.write_impl, plan.attention_impl
    rows: dict[str, Callable[[], None] | None] = {
        "null op (torch.empty(0) + sync)": lambda: torch.empty(0, device=device),
        "write: CUDA-graph replay of the plan's call": graph_replay(plan_write, device),
        "write: bound relaunch (kvzoo's prepared launch)": bound_relaunch(
            new_plan, "write_impl", lambda p: p.write(key, value, c)
        ),
        "write: Triton launch (kernel[grid](...))": bare_triton(
            w_impl, write_problem, "kvzoo.backends.triton.write_kernels", ("_reshape_and_cache_kernel",)
        ),
        "write: impl.run(problem)": lambda: w_impl.run(write_problem),
        "write: plan.write": plan_write,
        "write: reshape_and_cache validate=False": write(False),
        "write: reshape_and_cache validate=True": write(True),
        "attention: CUDA-graph replay of the plan's call": graph_replay(plan_attention, device),
        "attention: bound relaunch (kvzoo's prepared launch)": bound_relaunch(
            new_plan, "attention_impl", lambda p: p.attention(query, c, out=out)
        ),
        "attention: Triton launch (kernel[grid](...))": bare_triton(
            a_impl,
            attention_problem,
            "kvzoo.backends.triton.attention_kernels",
            ("_attention_kernel", "_merge_splits_kernel"),
        ),
        "attention: impl.run(problem)": lambda: a_impl.run(attention_problem),
        "attention: plan.attention": plan_attention,
        "attention: paged_attention validate=False": attend(False),
        "attention: paged_attention validate=True": attend(True),
        "step: plan_step validate=False": lambda: kvzoo.plan_step(
            spec, **s["plan_args"], validate=False, **s["bounds"]
        ),
        "step: plan_step validate=True": lambda: kvzoo.plan_step(spec, **s["plan_args"]),
    }
    return {k: v for k, v in rows.items() if v is not None}, plan


def measure(
    rows: dict[str, Callable[[], None]], sync: Callable[[], None], calls_each: int, warmup: int, burst: int = 32
) -> dict[str, tuple[float, float, float]]:
    """Per row, medians of: us until one call returns, us until the GPU is done with it, and us
    per call over `burst` calls made back to back (then one synchronisation)."""
    for fn in rows.values():
        for _ in range(warmup):
            fn()
        sync()
    returns: dict[str, list[float]] = {name: [] for name in rows}
    done: dict[str, list[float]] = {name: [] for name in rows}
    in_a_row: dict[str, list[float]] = {name: [] for name in rows}
    clock = time.perf_counter
    gc.collect()
    gc.disable()  # a collection inside one timed call would land on whichever row it hit
    try:
        for n in range(calls_each):
            for name, fn in rows.items():
                t0 = clock()
                fn()
                t1 = clock()
                sync()
                t2 = clock()
                returns[name].append(t1 - t0)
                done[name].append(t2 - t0)
                if n % 4 == 0:  # a quarter as many bursts, each of `burst` calls
                    t0 = clock()
                    for _ in range(burst):
                        fn()
                    t1 = clock()
                    sync()
                    in_a_row[name].append((t1 - t0) / burst)
    finally:
        gc.enable()
    med = statistics.median
    return {name: (med(returns[name]) * 1e6, med(done[name]) * 1e6, med(in_a_row[name]) * 1e6) for name in rows}


def _commit() -> str:
    # KVZOO_BENCH_COMMIT names the commit where the checkout's .git is not the tree's own (as
    # bench/gpu_bench.py reads it).
    import subprocess

    if os.environ.get("KVZOO_BENCH_COMMIT"):
        return os.environ["KVZOO_BENCH_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes and few calls (CPU smoke test)")
    ap.add_argument("--impl", default=None, help="force an implementation (default: the registry's choice)")
    ap.add_argument("--mode", default="int8_per_token_head")
    ap.add_argument("--calls", type=int, default=None, help="timed calls per row (default 200; --quick 20)")
    ap.add_argument("--cpu", action="store_true", help="CPU tensors even where a GPU is present")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    shape = QUICK_SHAPE if args.quick else GPU_SHAPE
    calls_each = args.calls or (20 if args.quick else 200)
    s = build(shape, args.mode, device, args.impl)
    rows, plan = calls(s, args.impl, device)
    medians = measure(rows, sync_for(device), calls_each, 3 if args.quick else 20)
    null_returns, null, null_in_a_row = medians["null op (torch.empty(0) + sync)"]
    where = (
        torch.cuda.get_device_name()
        if device == "cuda"
        else f"CPU, TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}"
    )
    case = (
        f"{args.mode} decode {shape.seqs} x {shape.seq_len}, Hq {shape.num_q_heads}, Hkv {shape.num_kv_heads}, "
        f"D {shape.head_size}, block {shape.block_size}"
    )
    print(
        f"host_cost: {device} ({where}); write {plan.write_impl.name}, attention {plan.attention_impl.name}; "
        f"{case}; median of {calls_each} calls per row"
    )
    print(f"torch {torch.__version__}, Python {sys.version.split()[0]}, commit {_commit()}")
    width = max(len(n) for n in medians)
    print(
        f"{'row (us per call)':{width}s}  {'returns':>8s}  {'synchronised':>12s}  {'above null op':>13s}  "
        f"{'back to back':>12s}  {'above null op':>13s}"
    )
    for name, (back, us, row) in medians.items():
        print(f"{name:{width}s}  {back:8.1f}  {us:12.1f}  {us - null:13.1f}  {row:12.1f}  {row - null_in_a_row:13.1f}")
    for column, base, label in ((1, null, "synchronised"), (2, null_in_a_row, "back to back")):
        above = {n: medians[n][column] - base for n in medians}
        worst_plan = max(above["write: plan.write"], above["attention: plan.attention"])
        worst_functional = max(
            above["write: reshape_and_cache validate=False"], above["attention: paged_attention validate=False"]
        )
        print(
            f"{label}: plan per-layer, worst of write/attention, {worst_plan:.1f} us above the null op "
            f"(H200 target <= {PLAN_TARGET_US:g}); functional validate=False {worst_functional:.1f} us "
            f"(target <= {FUNCTIONAL_TARGET_US:g})"
        )
    out_dir = os.environ.get("OUT")
    if out_dir:
        import json

        info = dict(
            device=where,
            torch=torch.__version__,
            python=sys.version.split()[0],
            commit=_commit(),
            command="python3 bench/host_cost.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            case=case,
            calls=calls_each,
            write_impl=plan.write_impl.name,
            attention_impl=plan.attention_impl.name,
            date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        )
        rows_out = [
            dict(
                row=n,
                returns_us=b,
                synchronised_us=u,
                above_null_us=u - null,
                back_to_back_us=r,
                back_to_back_above_null_us=r - null_in_a_row,
            )
            for n, (b, u, r) in medians.items()
        ]
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        with open(Path(out_dir) / "host_cost.json", "w") as f:
            json.dump(dict(info=info, null_returns_us=null_returns, rows=rows_out), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
