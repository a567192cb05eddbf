"""How fast are the CPU backends? The Numba backend against the NumPy reference and torch CPU.

    pytest bench/bench_cpu.py --benchmark-only        # pytest-benchmark tables, one per group
    python bench/bench_cpu.py [--quick]               # side-by-side medians, ratios, markdown

The script form measures every provider of a case in the same process, one after the other,
and prints a markdown section (the last ones are in bench/archive/RESULTS-history.md). All calls go through the public API
(kvzoo.reshape_and_cache / paged_attention / dequantize with impl=...), so argument validation
is part of the time. Shapes are those of issue 3. Inputs come from kvzoo.samples, drawn from
the session seed (KVZOO_SEED replays it).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import kvzoo  # noqa: E402
from kvzoo import samples  # noqa: E402
from kvzoo.inputs import rng_for  # noqa: E402

BLOCK = 16
QUANT_MODES = ("int8_per_token_head", "fp8_per_token_head")


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------


@dataclass
class WriteCase:
    key: torch.Tensor
    value: torch.Tensor
    slots: torch.Tensor
    mode: str
    cache: object

    @property
    def bytes_moved(self) -> int:
        t, h, d = self.key.shape
        read = 2 * t * h * d * self.key.element_size()
        written = 2 * t * h * (d * 1 + 4)  # codes + float32 scale per row
        return read + written


def write_case(mode: str, tokens: int = 4096, heads: int = 8, head_size: int = 128) -> WriteCase:
    # Every slot of a zeroed cache, in random order.
    w = samples.write_sample(
        rng_for("bench_cpu", "write", mode, tokens, heads, head_size),
        mode,
        num_tokens=tokens,
        num_kv_heads=heads,
        head_size=head_size,
        block_size=BLOCK,
        num_blocks=tokens // BLOCK,
        poison=False,
    )
    return WriteCase(w.key, w.value, w.slot_mapping, mode, w.caches)


def run_write(case: WriteCase, impl: str) -> None:
    c = case.cache
    kvzoo.reshape_and_cache(
        case.key,
        case.value,
        c.key_cache,
        c.value_cache,
        case.slots,
        mode=case.mode,
        k_scale_cache=c.k_scale_cache,
        v_scale_cache=c.v_scale_cache,
        impl=impl,
    )


@dataclass
class AttnCase:
    mode: str
    query: torch.Tensor
    cache: object
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    num_seqs: int
    context: int
    causal: bool

    @property
    def flops(self) -> float:
        """2 matmuls x 2 flops per MAC over the (query, visible key) pairs of every head."""
        t, hq, d = self.query.shape
        q_len = t // self.num_seqs
        pairs = sum(self.context - q_len + j + 1 for j in range(q_len)) * self.num_seqs
        return 4.0 * pairs * hq * d


def attn_case(mode: str, num_seqs: int, context: int, q_len: int, hq=32, hkv=8, head_size=128) -> AttnCase:
    # fill="torch": the caches (tens of millions of codes here) are drawn by torch in chunks, far
    # faster and lighter than the host fill's float64 temporaries. Tables exactly cover each
    # sequence's pages (_torch_dequantize reads whole rows).
    s = samples.paged_sample(
        rng_for("bench_cpu", "attention", mode, num_seqs, context, q_len, hq, hkv, head_size),
        mode,
        q_lens=[q_len] * num_seqs,
        seq_lens=[context] * num_seqs,
        block_size=BLOCK,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_size=head_size,
        query_dtype="bfloat16",
        device="cpu",
        spare_blocks=0,
        spare_columns=0,
        fill="torch",
    )
    return AttnCase(
        mode, s.query, s.caches, s.block_tables, s.seq_lens, s.query_start_loc, num_seqs, context, q_len > 1
    )


def run_attention(case: AttnCase, impl: str) -> torch.Tensor:
    c = case.cache
    return kvzoo.paged_attention(
        case.query,
        c.key_cache,
        c.value_cache,
        mode=case.mode,
        block_tables=case.block_tables,
        seq_lens=case.seq_lens,
        query_start_loc=case.query_start_loc,
        k_scale_cache=c.k_scale_cache,
        v_scale_cache=c.v_scale_cache,
        impl=impl,
    )


def _torch_dequantize(codes: torch.Tensor, scales: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """What a torch user does without kvzoo: gather pages, codes -> fp32, times the row scale.
    Returns [S, H, L, D] fp32."""
    s, nb = block_tables.shape
    pages = codes[block_tables.long()].float() * scales[block_tables.long()].unsqueeze(-1)
    return pages.reshape(s, nb * codes.shape[1], codes.shape[2], codes.shape[3]).transpose(1, 2)


def run_torch_sdpa(case: AttnCase, dequantize: bool = True, kv=None) -> torch.Tensor:
    """torch CPU scaled_dot_product_attention on the dequantized fp32 cache."""
    c = case.cache
    if dequantize:
        k = _torch_dequantize(c.key_cache, c.k_scale_cache, case.block_tables)
        v = _torch_dequantize(c.value_cache, c.v_scale_cache, case.block_tables)
    else:
        k, v = kv
    s = case.num_seqs
    q = case.query.float().reshape(s, -1, *case.query.shape[1:]).transpose(1, 2)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=case.causal, enable_gqa=True)
    return out.transpose(1, 2).reshape(case.query.shape).bfloat16()


def memcpy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Best of numpy (one thread) and torch (all threads) copy, in GB/s counting read + write."""
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = 0.0
    for copy in (lambda: np.copyto(dst, src), lambda: torch.from_numpy(dst).copy_(torch.from_numpy(src))):
        copy()
        t = median_time(copy, repeats)
        best = max(best, 2 * nbytes / t / 1e9)
    return best


# ----------------------------------------------------------------------------------------------
# pytest-benchmark entry points
# ----------------------------------------------------------------------------------------------


def _bench(benchmark, fn: Callable[[], object], rounds: int) -> None:
    benchmark.pedantic(fn, rounds=rounds, warmup_rounds=1, iterations=1)


try:
    import pytest

    @pytest.mark.parametrize("impl", ["numba", "numpy"])
    @pytest.mark.parametrize("mode", QUANT_MODES)
    def test_write(benchmark, impl, mode):
        benchmark.group = f"reshape_and_cache 4096x8x128 bf16 {mode}"
        case = write_case(mode)
        _bench(benchmark, lambda: run_write(case, impl), 20 if impl == "numba" else 3)

    @pytest.mark.parametrize("impl", ["numba", "numpy", "torch_sdpa"])
    @pytest.mark.parametrize("mode", QUANT_MODES)
    def test_decode(benchmark, impl, mode):
        benchmark.group = f"decode 16x4096 32/8 D128 {mode}"
        case = attn_case(mode, 16, 4096, 1)
        fn = (lambda: run_torch_sdpa(case)) if impl == "torch_sdpa" else (lambda: run_attention(case, impl))
        _bench(benchmark, fn, 10 if impl != "numpy" else 2)

    @pytest.mark.parametrize("impl", ["numba", "torch_sdpa"])
    @pytest.mark.parametrize("mode", QUANT_MODES)
    def test_prefill(benchmark, impl, mode):
        benchmark.group = f"prefill 1x2048 32/8 D128 {mode}"
        case = attn_case(mode, 1, 2048, 2048)
        fn = (lambda: run_torch_sdpa(case)) if impl == "torch_sdpa" else (lambda: run_attention(case, impl))
        _bench(benchmark, fn, 3)

except ImportError:  # pragma: no cover - the script form needs no pytest
    pass


# ----------------------------------------------------------------------------------------------
# Script: side-by-side medians and ratios
# ----------------------------------------------------------------------------------------------


def _times(fn: Callable[[], object], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def median_time(fn: Callable[[], object], repeats: int) -> float:
    return statistics.median(_times(fn, repeats))


class Timing(float):
    """A median (the float value) that also carries the best run, printed as 'median (best)'.

    On a shared 2-core machine other processes steal whole cores; the best run shows what the
    code does uncontended, the median what a user saw during the run."""

    best: float

    def fmt(self, unit: float = 1e3, digits: int = 1) -> str:
        return f"{self * unit:.{digits}f} ({self.best * unit:.{digits}f})"


def timed(fn: Callable[[], object], repeats: int) -> Timing:
    fn()  # warm-up (compiles or loads cached kernels)
    times = _times(fn, repeats)
    out = Timing(statistics.median(times))
    out.best = min(times)
    return out


def _ratio(slow: Timing, fast: Timing) -> str:
    return f"{slow / fast:.1f}x ({slow.best / fast.best:.1f}x)"


_COLD_SNIPPET = """
import sys, time
t0 = time.perf_counter()
sys.path.insert(0, {root!r})
sys.path.insert(0, {bench!r})
import bench_cpu as b
t_import = time.perf_counter() - t0
t = time.perf_counter()
w = b.write_case('int8_per_token_head', 64, 2, 128)
b.run_write(w, 'numba')
a = b.attn_case('int8_per_token_head', 2, 64, 1)
b.run_attention(a, 'numba')
p = b.attn_case('int8_per_token_head', 1, 64, 16)
b.run_attention(p, 'numba')
print(f'{{t_import:.2f}} {{time.perf_counter() - t:.2f}}')
"""


def compile_times() -> tuple[tuple[float, float], tuple[float, float]]:
    """(import s, first calls s) for a process with an empty numba cache, then for a second
    process that finds the first one's cache on disk."""
    code = _COLD_SNIPPET.format(root=str(ROOT), bench=str(Path(__file__).parent))
    results = []
    with tempfile.TemporaryDirectory() as cache_dir:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir)
        for _ in range(2):
            out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
            imp, first = map(float, out.stdout.split()[-2:])
            results.append((imp, first))
    return results[0], results[1]


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except Exception:
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer repeats (for a smoke run)")
    parser.add_argument("--skip-compile", action="store_true")
    args = parser.parse_args()
    fast, slow = (3, 1) if args.quick else (21, 5)

    lines = []
    say = lines.append
    load = os.getloadavg()
    say(
        f"Measured {datetime.date.today().isoformat()} on {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, numba threads {_numba_threads()}, torch threads {torch.get_num_threads()}, "
        f"commit {_commit()}, load average before the run {load[0]:.2f}."
    )
    say(
        "Command: `python bench/bench_cpu.py`. Each cell: median (best) of repeated calls through the "
        "public API (validation included); all providers timed in the same process one after the other; "
        "ratios are median/median (best/best)."
    )
    say("")

    bw = memcpy_bandwidth()
    say(f"Measured memory copy bandwidth (read + write): **{bw:.1f} GB/s**.")
    say("")

    say("### reshape_and_cache, 4096 tokens x 8 KV heads x 128, bf16 in")
    say("")
    say("| mode | numba ms | numpy ms | numba speedup | numba GB/s | % of copy bandwidth |")
    say("|---|---|---|---|---|---|")
    for mode in QUANT_MODES:
        case = write_case(mode)
        t_nb = timed(lambda case=case: run_write(case, "numba"), fast)
        t_np = timed(lambda case=case: run_write(case, "numpy"), slow)
        gbs = case.bytes_moved / t_nb / 1e9
        gbs_best = case.bytes_moved / t_nb.best / 1e9
        say(
            f"| {mode} | {t_nb.fmt(digits=2)} | {t_np.fmt()} | {_ratio(t_np, t_nb)} | {gbs:.2f} ({gbs_best:.2f}) "
            f"| {100 * gbs / bw:.0f}% ({100 * gbs_best / bw:.0f}%) |"
        )
    say("")

    say("### Decode attention, 16 sequences x 4096 context, 32 query / 8 KV heads, head 128")
    say("")
    say(
        "torch = gather + dequantize to fp32 in torch ops, then torch CPU "
        "`scaled_dot_product_attention` (GQA); the dequantize is counted."
    )
    say("")
    say("| mode | numba ms | numpy ms | torch ms | vs numpy | vs torch | numba GB/s of K/V codes |")
    say("|---|---|---|---|---|---|---|")
    for mode in QUANT_MODES:
        case = attn_case(mode, 16, 4096, 1)
        t_nb = timed(lambda case=case: run_attention(case, "numba"), fast)
        t_np = timed(lambda case=case: run_attention(case, "numpy"), slow)
        t_th = timed(lambda case=case: run_torch_sdpa(case), max(slow, 5))
        kv_bytes = 2 * case.cache.key_cache.numel() + 2 * 4 * case.cache.k_scale_cache.numel()
        say(
            f"| {mode} | {t_nb.fmt()} | {t_np.fmt(digits=0)} | {t_th.fmt(digits=0)} | {_ratio(t_np, t_nb)} | "
            f"{_ratio(t_th, t_nb)} | {kv_bytes / t_nb / 1e9:.2f} ({kv_bytes / t_nb.best / 1e9:.2f}) |"
        )
    say("")

    say("### Prefill attention, 1 x 2048 tokens (causal), 32 query / 8 KV heads, head 128")
    say("")
    say("| mode | numba ms | numba GFLOP/s | torch SDPA + dequant ms | torch SDPA only ms | torch SDPA GFLOP/s |")
    say("|---|---|---|---|---|---|")
    for mode in QUANT_MODES:
        case = attn_case(mode, 1, 2048, 2048)
        t_nb = timed(lambda case=case: run_attention(case, "numba"), slow)
        t_th = timed(lambda case=case: run_torch_sdpa(case), slow)
        c = case.cache
        kv = (
            _torch_dequantize(c.key_cache, c.k_scale_cache, case.block_tables),
            _torch_dequantize(c.value_cache, c.v_scale_cache, case.block_tables),
        )
        t_sdpa = timed(lambda case=case, kv=kv: run_torch_sdpa(case, dequantize=False, kv=kv), slow)
        f = case.flops
        say(
            f"| {mode} | {t_nb.fmt(digits=0)} | {f / t_nb / 1e9:.1f} ({f / t_nb.best / 1e9:.1f}) | "
            f"{t_th.fmt(digits=0)} | {t_sdpa.fmt(digits=0)} | {f / t_sdpa / 1e9:.1f} ({f / t_sdpa.best / 1e9:.1f}) |"
        )
    say("")

    if not args.skip_compile:
        (cold_imp, cold_first), (warm_imp, warm_first) = compile_times()
        say("### Compile time (first calls of write + decode + prefill, small shapes, int8)")
        say("")
        say("| process | import kvzoo s | first calls s |")
        say("|---|---|---|")
        say(f"| first (empty numba cache: compiles) | {cold_imp:.2f} | {cold_first:.2f} |")
        say(f"| second (loads the on-disk cache) | {warm_imp:.2f} | {warm_first:.2f} |")
        say("")
    print("\n".join(lines))


def _numba_threads() -> int:
    try:
        import numba

        return numba.get_num_threads()
    except ImportError:
        return 0


if __name__ == "__main__":
    main()
