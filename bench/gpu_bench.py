"""How close do kvzoo's Triton kernels come to this GPU's measured ceilings, and to what a user
would run instead (torch SDPA, index_copy_, kvzoo's own bf16 cache)? Issue 5's cases; the JSON
it writes is what bench/report.py turns into bench/RESULTS.md.

    python3 bench/gpu_bench.py [--quick] [--cases write,decode,prefill]     (on the GPU, ~60 s)
    OUT=DIR python3 bench/gpu_bench.py && python bench/report.py DIR        (and regenerate RESULTS.md)
    OUT=DIR python bench/gpu_bench.py --dry-run                             (CPU: checks the script; its figures mean nothing)

1. Measures the ceilings here: device-to-device copy bandwidth (bytes read + written) and
   bf16 matmul TFLOP/s on random data.
2. For every case, first checks kvzoo's output (cache bytes against the NumPy reference;
   attention against a float32 torch reference on the same cache, float64 for int4's packed
   rows, which it decodes and un-rotates itself), then times it. Inputs come
   from kvzoo.samples, drawn from the session seed (printed; KVZOO_SEED replays it).
3. Times with CUDA events, median over repetitions. Each timed unit runs the op once on each of
   several input sets (different tensors, together larger than L2) so caches do not flatter;
   the unit is captured in a CUDA graph when possible (kernel time without Python overhead;
   "eager" in the table when capture failed). Reported time is per call. The quantized
   decode rows also depend on how long the GPU has been busy before them: under sustained load
   the board's power cap lowers the SM clock, which slows them and not the bf16 rows
   (bench/sustained.py measures both ends).
4. Prints one table: case, time, GB/s or TFLOP/s, % of the measured ceiling, and the ratio of
   each alternative's time to kvzoo's (> 1: kvzoo is faster).

Writes every row to $OUT/bench.json when OUT is set, with the GPU, versions, date, commit and
command (KVZOO_BENCH_COMMIT names the commit where the checkout's .git is not the tree's own).
A case whose implementation is missing or fails prints an error row; the rest still run.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

# --dry-run: the same script on CPU tensors under the Triton interpreter at toy sizes, to check
# the script itself without a GPU. Must be decided before triton decorates any kernel.
DRY = "--dry-run" in sys.argv
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")
DEVICE = "cpu" if DRY else "cuda"

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kvzoo  # noqa: E402
from kvzoo import samples  # noqa: E402
from kvzoo.inputs import SEED, rng_for  # noqa: E402

IMPL = "triton-cuda"
HQ, HKV, D, BLOCK = 32, 8, 128, 16
MODES = ("none", "int8_per_token_head", "fp8_per_token_head")
# Attention also times the quantize_query option on the int8 cache, and prefill the quantized
# modes with staging off ("variant" = mode[+qq][+direct]).
QQ = "+qq"
DIRECT = "+direct"
# Prefill also runs the fp8 cache with fp8_dots (SPEC.md 8.3: both dots on e4m3 operands).
FP8D = "+fp8dots"
# Decode also reads the inline page (vLLM's engine layout: each row's scale after its codes).
INLINE = "+inline"
ATTN_VARIANTS = MODES + ("int8_per_token_head" + QQ,)
# int4 (issue 19): written at 32768 tokens only, read by every attention case (its prefill also
# direct, as the other quantized modes'), beside the rows above.
INT4 = "int4_per_token_head"
INT4_WRITE_TOKENS = 32768
# The inline page is written at these sizes too (issue 20: at the separate layout's speed).
INLINE_WRITE_TOKENS = (4096, 32768)
DECODE_VARIANTS = ATTN_VARIANTS + ("int8_per_token_head" + INLINE, "fp8_per_token_head" + INLINE, INT4)
# The per-tensor modes (one static scale a cache, as vLLM's int8_per_tensor and fp8/fp8_e5m2
# kv-cache dtypes): written at 32768 tokens and read at 64 x 16384 only.
PER_TENSOR = ("int8_per_tensor", "fp8_per_tensor", "fp8_e5m2_per_tensor")
PER_TENSOR_WRITE_TOKENS, PER_TENSOR_DECODE_CONTEXT = 32768, 16384
# Their static scales: not 1, so no product by the scale can be skipped unseen.
STATIC_SCALES = (0.0857, 0.0347)
PREFILL_VARIANTS = ATTN_VARIANTS + (
    "int8_per_token_head" + DIRECT,
    "fp8_per_token_head" + DIRECT,
    "fp8_per_token_head" + FP8D,
    INT4,
    INT4 + DIRECT,
)
SHORT = {
    "none": "none",
    "int8_per_token_head": "int8",
    "fp8_per_token_head": "fp8",
    "int8_per_token_head" + QQ: "int8 qk-int8",
    "int8_per_token_head" + DIRECT: "int8 direct",
    "fp8_per_token_head" + DIRECT: "fp8 direct",
    "fp8_per_token_head" + FP8D: "fp8 fp8-dots",
    "int8_per_token_head" + INLINE: "int8 inline",
    "fp8_per_token_head" + INLINE: "fp8 inline",
    INT4: "int4",
    INT4 + DIRECT: "int4 direct",
    "int8_per_tensor": "int8 per-tensor",
    "fp8_per_tensor": "fp8 per-tensor",
    "fp8_e5m2_per_tensor": "fp8-e5m2 per-tensor",
}
# Input sets per timed unit are sized so together they exceed this (H200 L2 is 50 MB).
ROTATE_BYTES = 256 << 20
# Seconds of untimed replays before each timing. Each kvzoo row's host-side check leaves the
# GPU idle for a moment, and timing straight after it ran slow (H200, same call: bf16 decode
# 64 x 4096 268.7 us against 244.5 with the warm-up; bench/archive/RESULTS-history.md).
WARM_S = 0.2
MAX_SETS = 8
ATTN_RTOL = 2e-2  # bf16 output vs a float32 reference on the same cache (raw query, also for +qq)


# Rows of the "+inline" variants' pages (kvzoo.allocate_inline's row_align): None is vLLM's
# head_size + 4; bench/probes/inline_probe.py --row-align sets it for its aligned-page variants.
INLINE_ROW_ALIGN: int | str | None = None


def _variant(variant: str) -> tuple[str, bool]:
    """(cache mode, quantize_query) of an attention variant name (fp8_dots: FP8D in it)."""
    return variant.removesuffix(DIRECT).removesuffix(INLINE).removesuffix(QQ).removesuffix(FP8D), QQ in variant


@functools.cache
def _impl_for(variant: str, impl: str):
    """The implementation a variant runs: "+direct" forces the direct prefill kernel on the
    codes, as before staging, through the Triton backend's typed options."""
    if not variant.endswith(DIRECT):
        return impl
    return kvzoo.registry.get("paged_attention", impl).with_options(prefill="direct")


@dataclass
class Row:
    case: str
    impl: str
    time_us: float | None = None
    metric: float | None = None  # GB/s or TFLOP/s
    unit: str = ""
    pct: float | None = None
    ratios: dict[str, float] = field(default_factory=dict)
    check: str = ""
    how: str = ""
    error: str = ""


ROWS: list[Row] = []


def add_row(row: Row) -> Row:
    """Records a row and prints it at once, so a run cut short still shows what it measured."""
    ROWS.append(row)
    shown = row.error or f"{_fmt(row.time_us, '.2f')} us  {_fmt(row.metric, ',.1f')} {row.unit}  {row.check}  {row.how}"
    print(f"  [{row.case} | {row.impl}] {shown}", flush=True)
    return row


# ---------------------------------------------------------------------------------------------
# timing


def _events():
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def sync() -> None:
    if not DRY:
        torch.cuda.synchronize()


def free() -> None:
    if not DRY:
        torch.cuda.empty_cache()


def _warm(step) -> None:
    """Runs step (synchronised) for WARM_S seconds, untimed."""
    until = time.perf_counter() + WARM_S
    while time.perf_counter() < until:
        step()
        sync()


def measure(run_set, n_sets: int, reps: int, graph: bool = True) -> tuple[float, str]:
    """Median seconds per call of run_set(i), i cycling over n_sets input sets."""
    for i in range(n_sets):  # compile, autotune, allocator warm-up
        run_set(i)
    sync()
    if DRY:
        times = []
        for r in range(reps):
            t = time.perf_counter()
            run_set(r % n_sets)
            times.append(time.perf_counter() - t)
        return statistics.median(times), "cpu-dry"
    if graph:
        try:
            g = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for i in range(n_sets):
                    run_set(i)
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(g):
                for i in range(n_sets):
                    run_set(i)
            g.replay()
            torch.cuda.synchronize()
            _warm(g.replay)
            times = []
            for _ in range(reps):
                a, b = _events()
                a.record()
                g.replay()
                b.record()
                times.append((a, b))
            torch.cuda.synchronize()
            return statistics.median(a.elapsed_time(b) for a, b in times) / 1e3 / n_sets, "graph"
        except Exception:  # not capturable (host sync inside): fall back to eager launches
            torch.cuda.synchronize()
            free()
    _warm(lambda: run_set(0))
    times = []
    for r in range(reps * n_sets):
        a, b = _events()
        a.record()
        run_set(r % n_sets)
        b.record()
        times.append((a, b))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in times) / 1e3, "eager"


def n_sets_for(bytes_per_call: int) -> int:
    if DRY:  # the sets outrun a GPU's L2; on the CPU each costs the interpreter a warm-up call
        return 1
    return max(1, min(MAX_SETS, math.ceil(ROTATE_BYTES / max(1, bytes_per_call))))


def ceilings(quick: bool) -> dict[str, float]:
    n = (1 << 20) if DRY else (512 << 20) if quick else (1 << 30)
    bufs = [
        torch.empty(n, dtype=torch.uint8, device=DEVICE).random_(),
        torch.empty(n, dtype=torch.uint8, device=DEVICE),
    ]
    t, _ = measure(lambda i: bufs[1].copy_(bufs[0]), 1, 10 if quick else 30, graph=False)
    copy_gbs = 2 * n / t / 1e9
    bufs.clear()
    m = 256 if DRY else 8192
    a = torch.randn(m, m, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=DEVICE, dtype=torch.bfloat16)
    t, _ = measure(lambda i: a @ b, 1, 10 if quick else 30, graph=False)
    tflops = 2 * m**3 / t / 1e12
    print(f"ceilings: copy {copy_gbs:,.0f} GB/s (read+write), bf16 matmul {tflops:,.0f} TFLOP/s")
    return {"copy_GBps": copy_gbs, "matmul_TFLOPs": tflops}


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def print_table() -> None:
    head = f"{'case':<34} {'impl':<18} {'time us':>10} {'achieved':>14} {'%ceil':>6}  {'ratios (alt time / kvzoo time)':<40} {'check':<14} how"
    print("\n" + head + "\n" + "-" * len(head))
    for r in ROWS:
        if r.error:
            print(f"{r.case:<34} {r.impl:<18} ERROR: {r.error}")
            continue
        ratios = " ".join(f"{k}={v:.2f}x" for k, v in r.ratios.items())
        ach = f"{_fmt(r.metric, ',.1f')} {r.unit}"
        print(
            f"{r.case:<34} {r.impl:<18} {_fmt(r.time_us, '10.2f'):>10} {ach:>14} {_fmt(r.pct, '5.1f'):>6}  "
            f"{ratios:<40} {r.check:<14} {r.how}"
        )


def attempt(case: str, impl: str, fn, *args):
    """fn(*args); a failure becomes an error row for (case, impl) and the run goes on."""
    try:
        return fn(*args)
    except Exception as exc:  # a missing or broken implementation must not stop the run
        msg = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
        add_row(Row(case, impl, error=msg))
        if os.environ.get("KVZOO_BENCH_TRACE"):
            traceback.print_exc()
        free()
        return None


# ---------------------------------------------------------------------------------------------
# reshape_and_cache


def _write_set(tokens: int, mode: str, rng: np.random.Generator):
    # vLLM-like slots: each sequence's tokens fill its blocks in order, blocks placed at random.
    # Zeroed caches: _check_write poisons the one set it checks.
    w = samples.write_sample(
        rng,
        _variant(mode)[0],
        num_tokens=tokens,
        num_kv_heads=HKV,
        head_size=D,
        block_size=BLOCK,
        dtype="bfloat16",
        device=DEVICE,
        slot_order="paged",
        num_blocks=2 * -(-tokens // BLOCK),
        poison=False,
        static_scale=STATIC_SCALES[0],
    )
    caches = w.caches
    if mode.endswith(INLINE):
        caches = kvzoo.allocate_inline(
            *w.caches.key_cache.shape[:3], D, _variant(mode)[0], device=DEVICE, row_align=INLINE_ROW_ALIGN
        )
    static = None if w.static_scale is None else float(w.static_scale)
    return dict(
        key=w.key,
        value=w.value,
        slots=w.slot_mapping,
        cache=caches,
        mode=_variant(mode)[0],
        static=static,
        static_on_device=_on_device(static),
    )


def _on_device(scale: float | None) -> torch.Tensor | None:
    """A static scale as an engine holds it, a float32 [1] tensor on the GPU: given as a float,
    every call copies it there, which a CUDA graph cannot capture (the per-tensor rows of the
    first run, on an H100 on 2026-12-05, were timed eager)."""
    return None if scale is None else torch.tensor([scale], dtype=torch.float32, device=DEVICE)


def _write_call(s, impl=IMPL):
    c = s["cache"]
    kvzoo.reshape_and_cache(
        s["key"],
        s["value"],
        c.key_cache,
        c.value_cache,
        s["slots"],
        mode=s["mode"],
        k_scale_cache=c.k_scale_cache,
        v_scale_cache=c.v_scale_cache,
        k_scale=s["static_on_device"],
        v_scale=s["static_on_device"],
        impl=impl,
        validate=False,
    )


def _check_write(s) -> str:
    """Rows written at the first slots equal the NumPy reference's bytes."""
    c = s["cache"]
    # Poison: an unwritten byte cannot pass (the inline page's views share one byte buffer).
    for t in (c.key_cache, c.value_cache, c.k_scale_cache, c.v_scale_cache) if c.buffer is None else (c.buffer,):
        if t is not None:
            t.view(torch.uint8).fill_(0x55)
    _write_call(s)
    n = min(int(s["key"].shape[0]), 1024)
    m = kvzoo.get_kv_quant_mode(s["mode"])
    ref = kvzoo.allocate_separate(-(-n // BLOCK), BLOCK, HKV, D, m, model_dtype="bfloat16", device="cpu")
    kvzoo.reshape_and_cache(
        s["key"][:n].cpu(),
        s["value"][:n].cpu(),
        ref.key_cache,
        ref.value_cache,
        torch.arange(n),
        mode=s["mode"],
        k_scale_cache=ref.k_scale_cache,
        v_scale_cache=ref.v_scale_cache,
        k_scale=s["static"],
        v_scale=s["static"],
        impl="numpy",
    )
    slots = s["slots"][:n]
    pairs = [(c.key_cache, ref.key_cache), (c.value_cache, ref.value_cache)]
    if m.per_token_head:
        pairs += [(c.k_scale_cache, ref.k_scale_cache), (c.v_scale_cache, ref.v_scale_cache)]
    for got, want in pairs:
        g = (
            got.flatten(0, 1)[slots].cpu().view(torch.uint8)
            if got.element_size() == 1
            else got.flatten(0, 1)[slots].cpu().contiguous().view(torch.uint8)
        )
        w = want.flatten(0, 1)[:n].contiguous().view(torch.uint8)
        if not torch.equal(g, w):
            bad = int((g != w).sum())
            raise AssertionError(f"cache bytes differ from the NumPy reference ({bad} bytes)")
    return "bytes ok"


def _row_bytes(mode: str) -> int:
    """Bytes of one cached row's codes (a packed mode's own: int4 holds D / 2)."""
    m = kvzoo.get_kv_quant_mode(mode)
    return m.cache_width(D) * (2 if m.code_dtype is None else 1)


def _write_bytes(tokens: int, mode: str) -> int:
    mode = _variant(mode)[0]
    m = kvzoo.get_kv_quant_mode(mode)
    nbytes = tokens * HKV * 2 * (2 * D + _row_bytes(mode)) + tokens * 8  # K+V read and written, slots
    if m.per_token_head:
        nbytes += tokens * HKV * 4 * 2
    return nbytes


def _index_copy_call(s) -> None:
    """The plain torch alternative: bf16 rows into the paged cache by index_copy_."""
    c = s["cache"]
    c.key_cache.view(-1, HKV, D).index_copy_(0, s["slots"], s["key"])
    c.value_cache.view(-1, HKV, D).index_copy_(0, s["slots"], s["value"])


def _write_case(ceil, tokens: int, mode: str, reps: int, times: dict, rows: dict) -> None:
    case = f"write T={tokens} {SHORT[mode]}"
    nbytes = _write_bytes(tokens, mode)
    rng = rng_for("gpu_bench", "write", tokens, mode)
    sets = [_write_set(tokens, mode, rng) for _ in range(n_sets_for(nbytes))]
    check = _check_write(sets[0])
    t, how = measure(lambda i: _write_call(sets[i]), len(sets), reps)
    times[mode] = t
    gbs = nbytes / t / 1e9
    rows[mode] = add_row(Row(case, IMPL, t * 1e6, gbs, "GB/s", 100 * gbs / ceil["copy_GBps"], check=check, how=how))
    if tokens <= 16 and not DRY:
        # What a caller sees per eager call, Python API overhead included.
        t_e, _ = measure(lambda i: _write_call(sets[i]), len(sets), reps, graph=False)
        add_row(
            Row(
                case,
                IMPL + " (eager)",
                t_e * 1e6,
                nbytes / t_e / 1e9,
                "GB/s",
                100 * nbytes / t_e / 1e9 / ceil["copy_GBps"],
                how="eager API call",
            )
        )
    if mode == "none":
        t_alt, how_alt = measure(lambda i: _index_copy_call(sets[i]), len(sets), reps)
        times["index_copy"] = t_alt
        alt_gbs = nbytes / t_alt / 1e9
        add_row(
            Row(
                f"write T={tokens} bf16",
                "torch index_copy_",
                t_alt * 1e6,
                alt_gbs,
                "GB/s",
                100 * alt_gbs / ceil["copy_GBps"],
                how=how_alt,
            )
        )
    sets.clear()
    free()


def _same_size_copy(ceil, tokens: int, reps: int, times: dict) -> None:
    """A plain device copy moving the int8 write's bytes: what a transfer of that size reaches
    (small transfers stay under the 1 GiB copy ceiling), the ceiling's practical value there."""
    nbytes = _write_bytes(tokens, "int8_per_token_head")
    sets = n_sets_for(nbytes)
    src = [torch.empty(nbytes // 2, dtype=torch.uint8, device=DEVICE).random_() for _ in range(sets)]
    dst = [torch.empty_like(x) for x in src]
    t, how = measure(lambda i: dst[i].copy_(src[i]), sets, reps)
    times["copy"] = t
    gbs = nbytes / t / 1e9
    add_row(
        Row(
            f"write T={tokens} copy of int8 bytes",
            "torch copy_",
            t * 1e6,
            gbs,
            "GB/s",
            100 * gbs / ceil["copy_GBps"],
            how=how,
        )
    )
    free()


def bench_write(ceil, quick: bool) -> None:
    sizes = (1, 16, 40) if DRY else (1, 16, 256, 4096, 32768)
    reps = 2 if DRY else 10 if quick else 50
    for tokens in sizes:
        times: dict[str, float] = {}
        rows: dict[str, Row] = {}
        # A dry run writes each extra mode once, at its largest size (each case costs the
        # interpreter seconds).
        largest = tokens == sizes[-1]
        extra = (INT4,) if tokens == INT4_WRITE_TOKENS or (DRY and largest) else ()
        extra += PER_TENSOR if tokens == PER_TENSOR_WRITE_TOKENS or (DRY and largest) else ()
        if tokens in INLINE_WRITE_TOKENS or (DRY and largest):
            extra += tuple(m + INLINE for m in MODES if m != "none")
        for mode in MODES + extra:
            attempt(f"write T={tokens} {SHORT[mode]}", IMPL, _write_case, ceil, tokens, mode, reps, times, rows)
        attempt(f"write T={tokens} copy", "torch copy_", _same_size_copy, ceil, tokens, reps, times)
        for mode, row in rows.items():
            if mode != "none" and "none" in times:
                row.ratios["vs none"] = times["none"] / times[mode]
            if mode.endswith(INLINE) and _variant(mode)[0] in times:
                row.ratios["vs separate"] = times[_variant(mode)[0]] / times[mode]
            if "index_copy" in times:
                row.ratios["vs index_copy"] = times["index_copy"] / times[mode]
            if mode != "none" and "copy" in times:
                row.ratios["vs copy"] = times["copy"] / times[mode]


# ---------------------------------------------------------------------------------------------
# attention: inputs from kvzoo.samples, and a float32 torch reference


def _decoded(cache, scales, mode, table_row, n, static=None):
    """float32 [n, Hkv, D] of one sequence's first n tokens, decoded with torch (int4: float64,
    in the model's basis); static: a per-tensor mode's scale."""
    pos = torch.arange(n, device=DEVICE)
    blk = table_row[pos // BLOCK].long()
    off = pos % BLOCK
    raw = cache[blk, off]
    m = kvzoo.get_kv_quant_mode(mode)
    if m.format is not None and m.format.row_zero_point:
        return _decoded_int4(raw, scales[blk, off], m)
    x = raw.float()
    if m.per_token_head:
        x = x * scales[blk, off][..., None]
    if static is not None:
        x = x * static
    return x


def _ref_attention(q, k, v, q_pos, scale):
    """q [n, Hq, D] float32 at positions q_pos; k/v [L, Hkv, D] float32; causal.

    Not the float64 oracle (kvzoo.samples.oracle_attention), which decodes the whole cache on
    the host and loops over tokens and heads in Python: at these shapes (caches of GBs,
    contexts of 64K) that takes hours. This checks a few rows on the GPU instead, against
    ATTN_RTOL; the conformance suite holds the kernels to their declared tolerance."""
    group = HQ // HKV
    kk = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
    vv = v.repeat_interleave(group, dim=1).transpose(0, 1)
    logits = torch.einsum("nhd,hld->hnl", q, kk) * scale
    mask = torch.arange(k.shape[0], device=DEVICE)[None, :] <= q_pos[:, None]
    logits = logits.masked_fill(~mask[None], float("-inf"))
    p = torch.softmax(logits, dim=-1)
    return torch.einsum("hnl,hld->nhd", p, vv)


def _decoded_int4(raw, words, m):
    """SPEC.md 3.5's decode of packed rows [n, Hkv, D / 2] and their scale words in float64,
    then R^T / D (SPEC.md 3.4) for the rotated mode: the rows attention reads, in the model's basis."""
    codes = torch.stack((raw & 0xF, raw >> 4), dim=-1).flatten(-2).double()
    bits = words.view(torch.int32)
    zp = (bits & 0xF).double()
    scale = (bits & ~0xF).view(torch.float32).double()
    x = (codes - zp[..., None]) * scale[..., None]
    if m.rotation is None:
        return x
    h = torch.ones((1, 1), dtype=torch.float64, device=DEVICE)
    while h.shape[0] < D:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    signs = torch.from_numpy(kvzoo.modes.rht_signs(D)).double().to(DEVICE)
    return (x @ h) * signs / D


@dataclass
class AttnSet:
    query: torch.Tensor
    cache: object
    table: torch.Tensor
    seq_lens: torch.Tensor
    qsl: torch.Tensor
    out: torch.Tensor
    max_q: int
    max_s: int
    num_prefills: int
    k_scale: torch.Tensor | None  # a per-tensor mode's static scales (_on_device)
    v_scale: torch.Tensor | None


def _attn_set(variant, q_lens, seq_lens, rng: np.random.Generator) -> AttnSet:
    # fill="torch": caches of GBs and the query are drawn on the GPU, by a generator seeded from rng.
    s = samples.paged_sample(
        rng,
        _variant(variant)[0],
        q_lens=q_lens,
        seq_lens=seq_lens,
        block_size=BLOCK,
        num_q_heads=HQ,
        num_kv_heads=HKV,
        head_size=D,
        query_dtype="bfloat16",
        device=DEVICE,
        spare_blocks=0,
        spare_columns=0,
        fill="torch",
        static_scales=STATIC_SCALES,
    )
    b = s.batch
    caches = s.caches
    if variant.endswith(INLINE):
        # The same codes and scales copied into an inline page (drawn separate: the device fill
        # builds separate caches only).
        caches = kvzoo.allocate_inline(
            *s.caches.key_cache.shape[:3], D, _variant(variant)[0], device=DEVICE, row_align=INLINE_ROW_ALIGN
        )
        for name in ("key_cache", "value_cache", "k_scale_cache", "v_scale_cache"):
            getattr(caches, name).copy_(getattr(s.caches, name))
    return AttnSet(
        s.query,
        caches,
        s.block_tables,
        s.seq_lens,
        s.query_start_loc,
        torch.empty_like(s.query),
        b.max_query_len,
        b.max_seq_len,
        b.num_prefills,
        _on_device(None if s.k_scale is None else float(s.k_scale)),
        _on_device(None if s.v_scale is None else float(s.v_scale)),
    )


def _attn_call(s: AttnSet, variant: str, impl: str = IMPL):
    c = s.cache
    mode, quantize_query = _variant(variant)
    kvzoo.paged_attention(
        s.query,
        c.key_cache,
        c.value_cache,
        mode=mode,
        block_tables=s.table,
        seq_lens=s.seq_lens,
        query_start_loc=s.qsl,
        k_scale_cache=c.k_scale_cache,
        v_scale_cache=c.v_scale_cache,
        k_scale=s.k_scale,
        v_scale=s.v_scale,
        softmax_scale=1 / math.sqrt(D),
        out=s.out,
        max_query_len=s.max_q,
        max_seq_len=s.max_s,
        num_prefills=s.num_prefills,
        quantize_query=quantize_query,
        fp8_dots=FP8D in variant,
        impl=_impl_for(variant, impl),
        validate=False,
    )


def _check_attention(s: AttnSet, variant: str, q_lens, seq_lens, max_rows: int = 32) -> str:
    """Relative error of the last query rows of the first and last sequences vs float32 torch
    attention with the query as given (so +qq rows show what quantizing the query costs)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    _attn_call(s, variant)
    mode = _variant(variant)[0]
    sync()
    worst = 0.0
    starts = np.concatenate([[0], np.cumsum(q_lens)])
    for seq in sorted({0, len(seq_lens) - 1}):
        n, ql = seq_lens[seq], q_lens[seq]
        k = _decoded(s.cache.key_cache, s.cache.k_scale_cache, mode, s.table[seq], n, s.k_scale)
        v = _decoded(s.cache.value_cache, s.cache.v_scale_cache, mode, s.table[seq], n, s.v_scale)
        rows = min(ql, max_rows)
        q0 = int(starts[seq]) + ql - rows
        q = s.query[q0 : q0 + rows].to(k.dtype)  # int4's rows come decoded in float64
        q_pos = torch.arange(n - rows, n, device=DEVICE)
        ref = _ref_attention(q, k, v, q_pos, 1 / math.sqrt(D))
        got = s.out[q0 : q0 + rows].to(k.dtype)
        err = float((got - ref).norm() / ref.norm())
        worst = max(worst, err)
    if not worst <= ATTN_RTOL:
        raise AssertionError(f"attention rel. error {worst:.2e} > {ATTN_RTOL}")
    return f"err {worst:.1e}"


def _attn_bytes(variant, q_lens, seq_lens) -> int:
    mode = _variant(variant)[0]
    m = kvzoo.get_kv_quant_mode(mode)
    keys = sum(seq_lens)
    b = keys * HKV * _row_bytes(mode) * 2 + sum(q_lens) * HQ * D * 2 * 2  # K+V, query + out
    if m.per_token_head:
        b += keys * HKV * 4 * 2
    return b + sum(-(-n // BLOCK) for n in seq_lens) * 4


def _attn_flops(q_lens, seq_lens) -> int:
    """QK^T and PV multiply-adds over the causal (visible) keys, 2 flops each."""
    total = 0
    for ql, n in zip(q_lens, seq_lens):
        first = n - ql  # query j sees first + j + 1 keys
        visible = ql * first + ql * (ql + 1) // 2
        total += 4 * HQ * D * visible
    return total


def _sdpa_decode(batch, ctx, reps):
    """torch SDPA on contiguous bf16 K/V: the query group of a KV head as 4 query rows."""
    group = HQ // HKV
    k = torch.randn(batch, HKV, ctx, D, device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(batch, HKV, group, D, device=DEVICE, dtype=torch.bfloat16)
    sets = n_sets_for(2 * k.numel() * 2)
    ks = [k] + [torch.randn_like(k) for _ in range(sets - 1)]
    vs = [v] + [torch.randn_like(v) for _ in range(sets - 1)]
    f = torch.nn.functional.scaled_dot_product_attention
    t, how = measure(lambda i: f(q, ks[i], vs[i]), sets, reps)
    return t, how


def _sdpa_prefill(batch, length, reps):
    q = torch.randn(batch, HQ, length, D, device=DEVICE, dtype=torch.bfloat16)
    k = torch.randn(batch, HKV, length, D, device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    f = torch.nn.functional.scaled_dot_product_attention
    try:
        f(q, k, v, is_causal=True, enable_gqa=True)
        call = lambda i: f(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
    except Exception:  # older torch: expand the KV heads
        group = HQ // HKV
        ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        call = lambda i: f(q, ke, ve, is_causal=True)  # noqa: E731
    return measure(call, 1, reps)


def _attention_mode(case, mode, q_lens, seq_lens, ceil, reps, kind, times, rows) -> None:
    nbytes = _attn_bytes(mode, q_lens, seq_lens)
    rng = rng_for("gpu_bench", "attention", mode, len(seq_lens), sum(q_lens))
    n = n_sets_for(nbytes)
    sets = [_attn_set(mode, q_lens, seq_lens, rng) for _ in range(n)]
    check = _check_attention(sets[0], mode, q_lens, seq_lens)
    t, how = measure(lambda i: _attn_call(sets[i], mode), n, reps)
    times[mode] = t
    if kind == "bw":
        val, unit = nbytes / t / 1e9, "GB/s"
        pct = 100 * val / ceil["copy_GBps"]
    else:
        val, unit = _attn_flops(q_lens, seq_lens) / t / 1e12, "TFLOP/s"
        pct = 100 * val / ceil["matmul_TFLOPs"]
    rows[mode] = add_row(Row(case, IMPL, t * 1e6, val, unit, pct, check=check, how=how))
    sets.clear()
    free()


def _attention_sdpa(case, sdpa, q_lens, seq_lens, ceil, kind, times) -> None:
    t, how = sdpa()
    times["sdpa"] = t
    if kind == "bw":
        val = _attn_bytes("none", q_lens, seq_lens) / t / 1e9
        add_row(Row(case, "torch sdpa", t * 1e6, val, "GB/s", 100 * val / ceil["copy_GBps"], how=how))
    else:
        val = _attn_flops(q_lens, seq_lens) / t / 1e12
        add_row(Row(case, "torch sdpa", t * 1e6, val, "TFLOP/s", 100 * val / ceil["matmul_TFLOPs"], how=how))
    free()


def _attention_cases(case_prefix, q_lens, seq_lens, ceil, reps, kind, sdpa, variants=ATTN_VARIANTS):
    """Times every mode on one shape (and SDPA when given); kind 'bw' reports GB/s, 'flops' TFLOP/s."""
    times: dict[str, float] = {}
    rows: dict[str, Row] = {}
    for mode in variants:
        case = f"{case_prefix} {SHORT[mode]}"
        attempt(case, IMPL, _attention_mode, case, mode, q_lens, seq_lens, ceil, reps, kind, times, rows)
    if sdpa is not None:
        case = f"{case_prefix} sdpa-bf16"
        attempt(case, "torch sdpa", _attention_sdpa, case, sdpa, q_lens, seq_lens, ceil, kind, times)
    for mode, row in rows.items():
        if mode != "none" and "none" in times:
            row.ratios["vs none"] = times["none"] / times[mode]
        if "sdpa" in times:
            row.ratios["vs sdpa"] = times["sdpa"] / times[mode]


# A decode small enough that the GPU waits on the host: eager calls measure host time.
EAGER_DECODE = ("int8_per_token_head", [1] * 8, [256] * 8)


def eager_decode_set() -> AttnSet:
    mode, q_lens, seq_lens = EAGER_DECODE
    return _attn_set(mode, q_lens, seq_lens, rng_for("gpu_bench", "eager decode"))


def _decode_eager(ceil) -> None:
    """Wall time per eager API call on EAGER_DECODE: what an engine that does not capture CUDA
    graphs pays per layer, launch included."""
    mode, q_lens, seq_lens = EAGER_DECODE
    s = eager_decode_set()
    for _ in range(50):
        _attn_call(s, mode)
    sync()
    calls = 1000
    t0 = time.perf_counter()
    for _ in range(calls):
        _attn_call(s, mode)
    sync()
    t = (time.perf_counter() - t0) / calls
    gbs = _attn_bytes(mode, q_lens, seq_lens) / t / 1e9
    add_row(
        Row(
            "decode 8x256 int8",
            IMPL + " (eager)",
            t * 1e6,
            gbs,
            "GB/s",
            100 * gbs / ceil["copy_GBps"],
            how="eager API call",
        )
    )


def bench_decode(ceil, quick: bool) -> None:
    reps = 2 if DRY else 5 if quick else 20
    shapes = ((2, 40),) if DRY else ((64, 4096), (64, 16384), (8, 65536))
    for batch, ctx in shapes:
        q_lens, seq_lens = [1] * batch, [ctx] * batch
        _attention_cases(
            f"decode {batch}x{ctx}",
            q_lens,
            seq_lens,
            ceil,
            reps,
            "bw",
            lambda b=batch, c=ctx: _sdpa_decode(b, c, reps),
            DECODE_VARIANTS + (PER_TENSOR if ctx == PER_TENSOR_DECODE_CONTEXT or DRY else ()),
        )
    if not DRY:
        attempt("decode 8x256 int8", IMPL + " (eager)", _decode_eager, ceil)


def bench_prefill(ceil, quick: bool) -> None:
    reps = 2 if DRY else 5 if quick else 15
    batch, length = (2, 24) if DRY else (4, 4096)
    _attention_cases(
        f"prefill {batch}x{length} causal",
        [length] * batch,
        [length] * batch,
        ceil,
        reps,
        "flops",
        lambda: _sdpa_prefill(batch, length, reps),
        PREFILL_VARIANTS,
    )
    # Mixed batch: 4 prefill chunks of 1024 on 3072 tokens of context, plus 60 decodes at 4096.
    q_lens, seq_lens = ([8] * 2 + [1] * 2, [30] * 4) if DRY else ([1024] * 4 + [1] * 60, [4096] * 64)
    chunks = sum(q > 1 for q in q_lens)
    label = f"mixed {chunks}x{q_lens[0]}chunk+{len(q_lens) - chunks}dec"
    _attention_cases(label, q_lens, seq_lens, ceil, reps, "flops", None, PREFILL_VARIANTS)


def _commit() -> str:
    """HEAD's short hash, with "+uncommitted" when tracked files differ from it."""
    named = os.environ.get("KVZOO_BENCH_COMMIT")
    if named:
        return named
    root = str(Path(__file__).resolve().parents[1])
    try:
        head = subprocess.run(
            ["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+uncommitted" if changed else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and a smaller copy ceiling probe")
    ap.add_argument("--cases", default="write,decode,prefill", help="comma list of write,decode,prefill")
    ap.add_argument("--dry-run", action="store_true", help="toy sizes on CPU under the Triton interpreter")
    args = ap.parse_args()
    if not DRY and not torch.cuda.is_available():
        print("no CUDA GPU: this benchmark runs on the GPU only (--dry-run checks the script on CPU)", file=sys.stderr)
        return 2
    wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
    t0 = time.time()
    info = {
        "gpu": "cpu (dry run)" if DRY else torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "quick": args.quick,
        "cases": wanted,
        "seed": SEED,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": _commit(),
        "command": " ".join(["python3", "bench/gpu_bench.py", *sys.argv[1:]]),
    }
    print(" ".join(f"{k}={v}" for k, v in info.items()))
    ceil = ceilings(args.quick)
    benches = {"write": bench_write, "decode": bench_decode, "prefill": bench_prefill}
    for name in wanted:
        if name not in benches:
            print(f"unknown case group {name!r}; known: {sorted(benches)}", file=sys.stderr)
            continue
        attempt(name, "-", benches[name], ceil, args.quick)
    print_table()
    print(f"\n(total {time.time() - t0:.0f} s; ratios are alternative time / kvzoo time, > 1 means kvzoo is faster)")
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        with open(Path(out_dir) / "bench.json", "w") as f:
            json.dump({"info": info, "ceilings": ceil, "rows": [r.__dict__ for r in ROWS]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
