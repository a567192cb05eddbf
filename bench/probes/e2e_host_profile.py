#!/usr/bin/env python3
"""Where an eager decode step of transformers' generate() spends host time, per cache.

The end-to-end benchmark (bench/e2e_transformers.py) shows eager decode bound by the host: the
compiled kvzoo step is 3x faster than the eager one on the same GPU work. This probe runs the
same model and generate() and reports, per cache: the host wall time per decode step (marks
between forwards), the GPU-event time per step, the launches and the host API calls per step
(torch.profiler), and the Python functions that cost the most host time (cProfile; its own
overhead inflates Python-heavy code, so read the shares, not the absolute figures).

    python bench/probes/e2e_host_profile.py --shape 8x4096 --caches dynamic,kvzoo-int8
    python bench/probes/e2e_host_profile.py --smoke      # CPU, tiny model
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import e2e_transformers as e2e  # noqa: E402


class WallMarks(e2e.StepClock):
    """Host perf_counter marks beside the CUDA events of StepClock."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.wall: list[float] = []

    def mark(self) -> None:
        self.wall.append(time.perf_counter())
        super().mark()


WAITS: list[float] = []
PHASES: dict[str, list[float]] = {}


def _wrap_timed(owner, name: str, times: list[float]) -> None:
    """owner.name replaced by a call that appends its host milliseconds to `times`."""
    inner = getattr(owner, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            times.append((time.perf_counter() - start) * 1e3)

    setattr(owner, name, timed)


def _time_stop_checks() -> None:
    """generate() reads a tensor back at every step's stop check: the host waits there for the
    GPU, so that wait is how far the GPU runs behind the host (0: the step is bound by the host)."""
    from transformers.generation import utils

    check = getattr(utils, "StopCheck", None)
    if check is not None:
        _wrap_timed(check, "__call__", WAITS)


def _time_phases() -> None:
    """Host time in kvzoo's parts of an eager step (plain perf_counter around each, no profiler):
    the step's metadata (ForwardStep), the plan (plan_step), and each layer's write and attention
    calls, so the step's host time splits into kvzoo's and the model's."""
    from kvzoo import plan as plan_module
    from kvzoo.integrations.transformers import _pages as pages_module
    from kvzoo.integrations.transformers import attention as attention_module
    from kvzoo.integrations.transformers import cache as cache_module
    from kvzoo.integrations.transformers import step as step_module

    for owner, name, label in (
        (pages_module.PageTable, "plan_step", "PageTable.plan_step (the step's slots and block tables)"),
        (step_module.ForwardStep, "__init__", "ForwardStep (metadata to the device)"),
        (step_module, "plan_step", "kvzoo.plan_step (a new plan)"),
        (plan_module.StepPlan, "write", "plan.write"),
        (plan_module.StepPlan, "attention", "plan.attention"),
        (cache_module.KVZooLayer, "update", "KVZooLayer.update"),
        (cache_module.KVZooLayer, "attend", "KVZooLayer.attend (all of the above but update)"),
        (attention_module, "kvzoo_paged_attention", "kvzoo_paged_attention (attend and its checks)"),
    ):
        _wrap_timed(owner, name, PHASES.setdefault(label, []))


def _allocator_counts(device: torch.device) -> dict[str, int]:
    """Device and pinned-host allocations that went to the driver (cudaMalloc, cudaHostAlloc):
    both can stall the host, and neither shows as a synchronisation."""
    if device.type != "cuda":
        return {}
    counts = {}
    stats = torch.cuda.memory_stats()
    for key in ("num_device_alloc", "num_device_free", "num_alloc_retries", "segment.all.allocated"):
        if key in stats:
            counts[key] = int(stats[key])
    host = getattr(torch.cuda, "host_memory_stats", None)
    if host is not None:
        for key, value in host().items():
            if key.startswith("num_host_alloc") or key.startswith("num_host_free"):
                counts["host." + key] = int(value)
    return counts


def one_generate(model, ids, name: str, new_tokens: int, impl, profile: str | None):
    made, kwargs, attention = e2e.make_cache(name, model, ids.shape[0], ids.shape[1] + new_tokens, impl)
    if attention == "kvzoo_paged":
        e2e.use_kvzoo_attention(model)
    else:
        model.set_attn_implementation(attention)
    if made is not None:
        kwargs[e2e.CACHE_ARG] = made
    clock = WallMarks(model.device)
    prof = None
    if profile == "cprofile":
        prof = cProfile.Profile()
    elif profile == "torch":
        acts = [torch.profiler.ProfilerActivity.CPU]
        if model.device.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        prof = torch.profiler.profile(activities=acts)
    with torch.no_grad():
        if prof is not None:
            prof.__enter__() if profile == "torch" else prof.enable()
        clock.mark()
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            logits_processor=e2e.LogitsProcessorList([clock]),
            **kwargs,
        )
        if prof is not None:
            prof.__exit__(None, None, None) if profile == "torch" else prof.disable()
    gpu = clock.intervals_ms()
    wall = [(b - a) * 1e3 for a, b in zip(clock.wall, clock.wall[1:])]
    return gpu, wall, prof


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="8x4096")
    ap.add_argument("--caches", default="dynamic,kvzoo-int8,kvzoo-fp8")
    ap.add_argument("--new-tokens", type=int, default=17)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--top", type=int, default=22)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--impl", default=None, help="kvzoo implementation (default: the registry's; numpy with --smoke)")
    args = ap.parse_args()
    _time_stop_checks()
    _time_phases()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    impl = args.impl or ("numpy" if args.smoke else None)
    model = e2e.make_model(e2e.llama_config(args.smoke, args.layers), device, dtype)
    batch, prompt = (int(x) for x in args.shape.split("x"))
    if args.smoke:
        batch, prompt = 2, 48
    ids = torch.randint(1, model.config.vocab_size, (batch, prompt), device=device)
    summary = []
    for name in args.caches.split(","):
        one_generate(model, ids, name, args.new_tokens, impl, None)  # compile, warm
        WAITS.clear()
        for times in PHASES.values():
            times.clear()
        before = _allocator_counts(device)
        gpu, wall, _ = one_generate(model, ids, name, args.new_tokens, impl, None)
        after = _allocator_counts(device)
        waits = list(WAITS)
        steps = args.new_tokens
        # Per part: the median call (the prefill's few calls do not move it) times its calls a step.
        phases = {k: (statistics.median(v), len(v) / (steps + 1)) for k, v in PHASES.items() if v}
        _, _, tprof = one_generate(model, ids, name, 4, impl, "torch")
        events = tprof.key_averages()
        launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
        syncs = sum(e.count for e in events if "Synchronize" in e.key)
        on_gpu = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
        kernels = Counter({e.key: e.count for e in on_gpu})
        busy = Counter({e.key: e.self_device_time_total / 1e3 for e in on_gpu})  # ms over the 4-token run
        _, _, cprof = one_generate(model, ids, name, args.new_tokens, impl, "cprofile")
        row = (name, statistics.median(wall[1:]), statistics.median(gpu[1:]), launches / 4, syncs)
        summary.append(row)
        print(f"\n=== {name}: host wall/step {row[1]:.2f} ms, GPU-event/step {row[2]:.2f} ms, "
              f"launches/step (4-token generate, prefill included) {row[3]:.0f}, synchronize calls {syncs}")  # fmt: skip
        print(f"  GPU busy over the 4-token generate (prefill included): {sum(busy.values()):.2f} ms; by kernel:")
        for k, ms in busy.most_common(10):
            print(f"    {ms:8.2f} ms  x{kernels[k]:<4} {k[:110]}")
        # Host time by operator (self time: the op's own, not its children's), a 4-token
        # generate: which host ops one cache makes slower or more numerous than another's.
        on_host = sorted(
            (e for e in events if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA),
            key=lambda e: e.self_cpu_time_total,
            reverse=True,
        )
        print("  host self time by op over the 4-token generate (ms, calls):")
        for e in on_host[: args.top]:
            print(f"    {e.self_cpu_time_total / 1e3:8.2f} ms  x{e.count:<5} {e.key[:100]}")
        wait = statistics.median(waits[1:]) if len(waits) > 1 else float("nan")
        print(f"  host waits in generate's stop check (no profiler): {wait:.2f} ms/step")
        if phases:
            print("  host time of kvzoo's parts: median ms a call x calls a step (prefill included in the count)")
            for label, (ms, calls) in phases.items():
                print(f"    {ms:7.3f} x {calls:4.1f}  {label}")
        moved = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
        print(f"  allocator calls to the driver during the generate: {moved or 'none'}")
        out = io.StringIO()
        stats = pstats.Stats(cprof, stream=out)
        stats.sort_stats("tottime").print_stats(args.top)
        text = out.getvalue()
        print(text[text.find("ncalls") :].rstrip())
    print("\n| cache | host wall ms/step | GPU ms/step | launches per step |")
    print("|---|---|---|---|")
    for name, wall_ms, gpu_ms, launches, _ in summary:
        print(f"| {name} | {wall_ms:.2f} | {gpu_ms:.2f} | {launches:.0f} |")


if __name__ == "__main__":
    main()
