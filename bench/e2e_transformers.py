#!/usr/bin/env python3
"""What a transformers user gets from kvzoo's caches, end to end: generate() on a decoder.

    python bench/e2e_transformers.py                      # GPU: the Llama-3-8B-shaped model below
    python bench/e2e_transformers.py --smoke              # CPU: a tiny model, every cache that runs there
    options: --shapes 16x4096,8x32768  --caches dynamic,kvzoo-int8,...  --new-tokens 33  --layers 8
             --json PATH  --only-memory

The model: Llama-3-8B's shape (hidden 4096, 32 query / 8 KV heads of 128, MLP 14336, vocabulary
128256), 8 layers, bf16, random weights (the figures do not depend on them); greedy generate()
of --new-tokens tokens after a random prompt, every row the same length (no padding). Caches:

    dynamic               DynamicCache + SDPA (transformers' default)
    static-compiled       StaticCache + SDPA, decode compiled by generate (CUDA graphs)
    kvzoo-<mode>          KVZooCache (prefill_attention="auto"), eager
    kvzoo-<mode>-kernels  KVZooCache with prefill_attention="kvzoo": the prefill on kvzoo's kernels
    kvzoo-<mode>-compiled KVZooStaticCache, decode compiled by generate (CUDA graphs)
    quanto-int4, hqq-int4 transformers' QuantizedCache (4 bits), eager, where the backend imports

Each cache is warmed by one generate with the same shapes (kernels, compiled graphs), then
measured over --rounds generates, interleaved with the other caches' (A, B, C, A, B, C, ...: the
host's speed drifts within a run, and eager decode is bound by the host). Reported: the memory
the cache holds after its first measured generate (allocator figures: allocated now, less
what was allocated before the cache existed) and the peak during it, the prefill (the first
forward, median over rounds) and the median decode step over every round, timed by CUDA events
recorded between steps (no host synchronisation added), tokens per second of decode, and the
largest batch at this context
whose cache would fit: (GPU memory - weights - 4 GiB of headroom) / the cache's measured bytes
per row. The physical limit of a decode step is printed too: the bytes it must read (every weight
but the embedding table, of which a step reads one row a sequence, and the cache's KV) over the
GPU's measured copy bandwidth (bytes read plus written per second: HBM serves that total whatever
the mix, so a step that only reads streams at about the same rate).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import transformers  # noqa: E402
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList  # noqa: E402
from transformers.generation import utils as _generation_utils  # noqa: E402

import kvzoo  # noqa: E402
from kvzoo.integrations.transformers import KVZooCache, KVZooStaticCache, use_kvzoo_attention  # noqa: E402

# transformers 5.25 renamed generate's past_key_values to cache (the old name warns).
CACHE_ARG = "cache" if "cache" in getattr(_generation_utils, "ALL_CACHE_NAMES", ()) else "past_key_values"
MODES = {"none": "none", "int8": "int8_per_token_head", "fp8": "fp8_per_token_head", "int4": "int4_per_token_head"}
GPU_CACHES = (
    "dynamic",
    "static-compiled",
    "kvzoo-int8",
    "kvzoo-fp8",
    "kvzoo-int4",
    "kvzoo-int8-kernels",
    "kvzoo-int8-compiled",
    "kvzoo-int4-compiled",
    "quanto-int4",
    "hqq-int4",
)
SMOKE_CACHES = ("dynamic", "kvzoo-int8", "kvzoo-int4", "kvzoo-int8-kernels", "kvzoo-int8-compiled")
HEADROOM = 4 << 30


@dataclass
class Row:
    shape: str
    cache: str
    status: str = "ok"
    held_bytes: int = 0
    reserved_bytes: int = 0
    peak_bytes: int = 0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    decode_spread: tuple[float, float] = (0.0, 0.0)
    decode_rounds: list[float] = field(default_factory=list)
    tokens_per_s: float = 0.0
    largest_batch: int = 0
    kv_bytes_floor: int = 0
    step_floor_ms: float = 0.0
    notes: list[str] = field(default_factory=list)


def llama_config(smoke: bool, layers: int) -> transformers.LlamaConfig:
    if smoke:
        return transformers.LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=512,
        )
    return transformers.LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        rope_theta=500000.0,
    )


def make_model(config, device: torch.device, dtype: torch.dtype):
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM._from_config(config, dtype=dtype)
    model.eval()
    model.generation_config.eos_token_id = None  # every row generates every token
    model.generation_config.pad_token_id = 0
    return model


class StepClock(LogitsProcessor):
    """A mark after every forward of generate (the processor runs between them): CUDA events on
    a GPU, recorded in the stream without waiting for it; the host clock on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def __call__(self, input_ids, scores):
        self.mark()
        return scores

    def intervals_ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _allocated(device: torch.device) -> tuple[int, int]:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    # On the CPU: every live tensor's storage, counted once.
    held = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
                held[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
        except Exception:  # noqa: BLE001 (objects that are tensors in name only)
            continue
    return sum(held.values()), 0


def _compile_config(device: torch.device):
    if device.type == "cuda":
        return None  # generate's own: inductor with CUDA graphs
    from transformers import CompileConfig

    config = CompileConfig(backend="aot_eager", fullgraph=True, mode=None)
    config._compile_all_devices = True
    return config


def make_cache(name: str, model, batch: int, length: int, impl: str | None):
    """(cache or None, generate kwargs, attention implementation) of a cache name."""
    if name == "dynamic":
        return DynamicCache(config=model.config), {}, "sdpa"
    if name == "static-compiled":
        kwargs = {"cache_implementation": "static"}
        config = _compile_config(model.device)
        if config is not None:
            kwargs["compile_config"] = config
        return None, kwargs, "sdpa"
    if name in ("quanto-int4", "hqq-int4"):
        from transformers import QuantizedCache

        backend = name.split("-")[0]
        if backend == "quanto" and model.device.type == "cuda":
            _quanto_unpack_as_torch_ops()
        return QuantizedCache(backend=backend, config=model.config, nbits=4), {}, "sdpa"
    parts = name.split("-")
    mode = MODES[parts[1]]
    if parts[-1] == "compiled":
        cache = KVZooStaticCache(model.config, max_batch_size=batch, max_cache_len=length, mode=mode, impl=impl)
        config = _compile_config(model.device)
        return cache, ({"compile_config": config} if config is not None else {}), "kvzoo_paged"
    prefill = "kvzoo" if parts[-1] == "kernels" else "auto"
    cache = KVZooCache(model.config, mode=mode, max_cache_len=length, impl=impl, prefill_attention=prefill)
    return cache, {}, "kvzoo_paged"


def _quanto_unpack_as_torch_ops() -> None:
    """optimum-quanto unpacks int4 on CUDA with an extension it compiles at first use (nvcc,
    minutes, with its matmul kernels): torch ops serve instead (the row's note). Its own Python
    unpack cannot: with torch 2.11 and 2.13 its registration decorator leaves the name None."""
    import types

    from optimum.quanto.library.extensions.extension import get_extension

    get_extension("quanto_cuda")._lib = types.SimpleNamespace(unpack=unpack_bits)


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """quanto's packed layout: value i of a byte is its bits [i * bits, (i + 1) * bits), and the
    values are stacked along dim 0, low bits first."""
    mask = (1 << bits) - 1
    return torch.cat([(packed >> (bits * i)) & mask for i in range(8 // bits)]).to(torch.uint8)


def generate_once(model, ids, name: str, new_tokens: int, impl: str | None, cache=None):
    """One generate() with cache `name` (a fresh one unless `cache` is given): (clock, cache)."""
    device = ids.device
    batch, prompt = ids.shape
    made, kwargs, attention = make_cache(name, model, batch, prompt + new_tokens, impl)
    cache = cache if cache is not None else made
    if attention == "kvzoo_paged":
        use_kvzoo_attention(model)
    else:
        model.set_attn_implementation(attention)
    clock = StepClock(device)
    if cache is not None:
        kwargs.pop("cache_implementation", None)  # a StaticCache generate made before, used again
        kwargs[CACHE_ARG] = cache
    with torch.no_grad():
        clock.mark()
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            logits_processor=LogitsProcessorList([clock]),
            return_dict_in_generate=True,
            **kwargs,
        )
    assert out.sequences.shape == (batch, prompt + new_tokens), out.sequences.shape
    # The cache generate used (the one it made, for static-compiled), kept for the memory figure.
    used = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    del out
    return clock, cache if cache is not None else used


class Case:
    """One cache at one shape, measured over rounds: warmed once (kernels, compiled graphs, CUDA
    graphs), then one measured generate a round. The first measured round gives the memory
    figures; every round gives its decode steps. A compiled cache stays allocated from its
    warm-up to the end of its shape's rounds (its graphs read its addresses): the other caches'
    held and peak figures are counted from a baseline that includes it, but the GPU has that
    much less room meanwhile."""

    def __init__(self, model, shape: str, name: str, new_tokens: int, impl: str | None) -> None:
        self.model, self.name, self.new_tokens, self.impl = model, name, new_tokens, impl
        self.row = Row(shape, name)
        batch, prompt = (int(x) for x in shape.split("x"))
        gen = torch.Generator().manual_seed(batch * 1000003 + prompt)
        self.ids = torch.randint(1, model.config.vocab_size, (batch, prompt), generator=gen).to(model.device)
        self.reuse = None
        self.warm = False
        self.steps: list[float] = []
        self.prefills: list[float] = []

    def measure(self, weights: int, total: int) -> None:
        """One more measured generate (the warm-up first, on the first call); a failure is the
        row's status, and ends the case."""
        if self.row.status != "ok":
            return
        device, row, batch = self.model.device, self.row, self.ids.shape[0]
        try:
            if not self.warm:
                # The compiled caches are used again after reset (a new one would need graphs of
                # its own addresses).
                _, warm = generate_once(self.model, self.ids, self.name, self.new_tokens, self.impl)
                if self.name.endswith("-compiled") and warm is not None:
                    self.reuse = warm
                del warm
                self.warm = True
            if self.reuse is not None:
                self.reuse.reset()
            _free(device)
            first = not self.steps
            before, reserved_before = _allocated(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            clock, cache = generate_once(self.model, self.ids, self.name, self.new_tokens, self.impl, cache=self.reuse)
            _free(device)
            if first:
                after, reserved_after = _allocated(device)
                row.held_bytes = after - before + (0 if self.reuse is None else _cache_bytes(self.reuse))
                row.reserved_bytes = reserved_after - reserved_before
                row.peak_bytes = (torch.cuda.max_memory_allocated() - before) if device.type == "cuda" else 0
                if cache is not None and hasattr(cache, "nbytes") and self.reuse is None and cache.nbytes:
                    row.notes.append(f"pages {cache.nbytes / 2**30:.2f} GiB")
                if self.name == "quanto-int4" and device.type == "cuda":
                    row.notes.append("quanto's int4 unpack as torch ops (its CUDA extension is not built)")
                per_row = row.held_bytes / batch
                if total and per_row > 0:
                    row.largest_batch = int((total - weights - HEADROOM) // per_row)
            steps = clock.intervals_ms()
            self.prefills.append(steps[0])
            self.steps.extend(steps[1:])
            row.decode_rounds.append(statistics.median(steps[1:]))
            row.prefill_ms = statistics.median(self.prefills)
            row.decode_ms = statistics.median(self.steps)
            # Over rounds the slowest and fastest round; within one generate its slowest and fastest step.
            spread = row.decode_rounds if len(row.decode_rounds) > 1 else self.steps
            row.decode_spread = (min(spread), max(spread))
            row.tokens_per_s = batch * len(self.steps) / (sum(self.steps) / 1e3)
            del cache, clock
        except Exception as exc:  # noqa: BLE001 (a cache that cannot run here is a row that says why)
            row.status = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            self.reuse = None
        finally:
            _free(device)

    def close(self) -> Row:
        self.reuse = None
        _free(self.model.device)
        return self.row


def _cache_bytes(cache) -> int:
    """A reused cache existed before the measured run: what it holds is counted from it (kvzoo's
    report their pages; another cache, the storages of its layers' tensors)."""
    if hasattr(cache, "nbytes"):
        return int(cache.nbytes)
    storages = {}
    for layer in getattr(cache, "layers", []):
        for value in vars(layer).values():
            if isinstance(value, torch.Tensor):
                storages[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
    return sum(storages.values())


def kv_floor(model, shape: str, mode: str | None) -> int:
    """Bytes a cache of this shape must hold: bf16 K and V, or the mode's codes and scales."""
    batch, prompt = (int(x) for x in shape.split("x"))
    c = model.config
    per_token_head = 2 * c.head_dim  # bf16
    if mode not in (None, "none"):
        m = kvzoo.get_kv_quant_mode(mode)
        # Every quantized mode's codes are bytes (int4: two a byte, cache_width counts the bytes).
        per_token_head = m.cache_width(c.head_dim) + (4 if m.per_token_head else 0)
    return batch * prompt * c.num_hidden_layers * c.num_key_value_heads * 2 * per_token_head


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read plus written per second of a 1 GiB device copy (median of 10)."""
    if device.type != "cuda":
        return 0.0
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * (1 << 30) / statistics.median(times[2:])


def environment(device: torch.device) -> dict:
    # KVZOO_BENCH_COMMIT names the commit where the checkout's .git is not the tree's own (a
    # working tree copied to another machine), as in gpu_bench.py and host_cost.py.
    commit = (
        os.environ.get("KVZOO_BENCH_COMMIT")
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE.parent
        ).stdout.strip()
    )
    env = {
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "kvzoo": kvzoo.__version__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "command": " ".join(["python"] + sys.argv),
    }
    return env


def print_table(rows: list[Row], env: dict) -> None:
    print(f"\n{env['device']}, torch {env['torch']}, transformers {env['transformers']}, kvzoo {env['commit']}")
    by_shape: dict[str, list[Row]] = {}
    for r in rows:
        by_shape.setdefault(r.shape, []).append(r)
    for shape, group in by_shape.items():
        base = next((r for r in group if r.cache == "dynamic" and r.status == "ok"), None)
        print(
            f"\n{shape} (+new tokens): held / peak GiB, prefill ms, decode step ms (median of every round's steps; "
            "in brackets the fastest and slowest round's median), tokens/s, x dynamic"
        )
        print(
            "| cache | held GiB | peak GiB | prefill ms | decode ms | tok/s | largest batch | "
            "held vs dynamic | decode speed vs dynamic | step floor ms |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in group:
            if r.status != "ok":
                print(f"| {r.cache} | {r.status} |||||||||")
                continue
            ratio = f"{r.held_bytes / base.held_bytes:.2f}x" if base and base.held_bytes else "-"
            speed = f"{base.decode_ms / r.decode_ms:.2f}x" if base else "-"
            print(
                f"| {r.cache} | {r.held_bytes / 2**30:.3f} | {r.peak_bytes / 2**30:.2f} | {r.prefill_ms:.1f} | "
                f"{r.decode_ms:.2f} ({r.decode_spread[0]:.2f}-{r.decode_spread[1]:.2f}) | {r.tokens_per_s:.0f} | "
                f"{r.largest_batch} | {ratio} | {speed} | {r.step_floor_ms:.2f} |"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, a tiny model, a short prompt (CI)")
    parser.add_argument("--shapes", default=None, help="batch x prompt, comma-separated")
    parser.add_argument("--caches", default=None, help="comma-separated names (see the module docstring)")
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--json", default=None, help="write the rows and the environment here")
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="measured generates of every cache, interleaved (cache A, B, ..., then A, B, ... again): the "
        "host's speed drifts within a run, so every cache meets the same drift (default 3 on a GPU, 1 smoke)",
    )
    args = parser.parse_args(argv)

    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    smoke = args.smoke or device.type == "cpu"
    shapes = (args.shapes or ("2x48" if smoke else "16x4096,8x32768")).split(",")
    caches = (args.caches or ",".join(SMOKE_CACHES if smoke else GPU_CACHES)).split(",")
    new_tokens = args.new_tokens or (6 if smoke else 33)
    impl = "numpy" if device.type == "cpu" else None
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    if device.type == "cpu":
        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    model = make_model(llama_config(smoke, args.layers), device, dtype)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    tied = embedding is model.get_output_embeddings().weight  # then the LM head reads all of it
    weights_read = weights - (0 if tied else embedding.numel() * embedding.element_size())
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
    bandwidth = copy_bandwidth(device)
    env = environment(device)
    env.update(
        weights_bytes=weights,
        weights_read_per_step=weights_read,
        total_memory=total,
        copy_bytes_per_s=bandwidth,
        new_tokens=new_tokens,
    )
    rounds = args.rounds or (1 if smoke else 3)
    env["rounds"] = rounds
    rows: list[Row] = []
    for shape in shapes:
        cases = [Case(model, shape, name, new_tokens, impl) for name in caches]
        for _ in range(rounds):
            for case in cases:
                case.measure(weights, total)
        for case in cases:
            name, row = case.name, case.close()
            mode = None if name in ("dynamic", "static-compiled") else MODES.get(name.split("-")[1])
            if mode is not None or name in ("dynamic", "static-compiled"):
                row.kv_bytes_floor = kv_floor(model, shape, mode)
                if bandwidth:
                    row.step_floor_ms = (weights_read + row.kv_bytes_floor) / bandwidth * 1e3
            rows.append(row)
            print(f"{shape} {name}: {row.status}, decode {row.decode_ms:.2f} ms, held {row.held_bytes / 2**30:.3f} GiB",
                  flush=True)  # fmt: skip
            if args.json:  # after every shape: a run stopped part way keeps the shapes it measured
                Path(args.json).write_text(
                    json.dumps({"environment": env, "rows": [asdict(r) for r in rows]}, indent=1)
                )
    print_table(rows, env)
    return 0 if all(r.status == "ok" or r.cache in ("quanto-int4", "hqq-int4") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
