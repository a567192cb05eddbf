"""The Triton int4 write (issue 19) on a GPU, in one call: its bytes against the NumPy
reference on fresh random inputs, then its variants timed side by side with the int8 write
and a device copy of the same bytes.

    PYTHONPATH=. python3 bench/probes/int4_write_probe.py                 (GPU: about 2 minutes)
    PYTHONPATH=. python3 bench/probes/int4_write_probe.py --interpret-smoke   (CPU: the checks, tiny)

Correctness: every shape of CHECK_TOKENS x CHECK_HEAD_SIZES x dtype x int4 mode (the
32768-token rows in bf16 only, for the reference's time), the two-row tiles that
int4_write.MIN_TILE_ROWS guards, and each timed variant at its own shape: caches of random
bytes, slots at random with some skipped, every written row equal to the NumPy
implementation's bytes and every other byte unchanged. A difference in the table's launch stops the run
(exit 1); a variant that differs is reported, left out of the timing, and the run exits 1.

Timing (as bench/gpu_bench.py): CUDA-graph replays of the write over input sets rotated past
the L2, median over REPS replays. Variants (VARIANTS, int4_write._write_call's options): the
table's launch; its byte stores instead of int32 words; 64- and 128-row tiles; and the kernel
as committed at git HEAD, when this is a git checkout whose int4_write.py differs (its source
read by `git show`), so old and new run in one process. --quick checks only the variants, at a
small size; --launch-once launches each variant once, for ncu. Each row gives
us, GB/s, % of the 1 GiB copy ceiling (gpu_bench's, issue 19's target: 80%) and % of a copy of
the same bytes; the int8 write of the same shape runs beside it.

Prints a table; writes $OUT/int4_write_probe.json when OUT is set.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

if "--interpret-smoke" in sys.argv:
    # Before any kernel module is imported: @triton.jit reads it when it decorates.
    os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import kvzoo  # noqa: E402
from kvzoo.backends.triton import int4_write  # noqa: E402
from kvzoo.inputs import make_rows  # noqa: E402
from kvzoo.modes import MODES, SCALE_FLOOR  # noqa: E402
from kvzoo.problem import CacheWrite  # noqa: E402

INT4 = ("int4_per_token_head", "int4_per_token_head_norot")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
BLOCK = 16
HEADS = 8
CHECK_TOKENS = (1, 3, 16, 4096, 32768)
CHECK_HEAD_SIZES = (64, 128, 256)
# The reference takes seconds a shape at 32768 tokens: those in one dtype only.
FULL_CHECK_MAX_TOKENS = 4096
DISTS = ("normal", "outliers", "midpoints", "specials", "tiny")
# Timed shapes (tokens, heads, D, dtype) and modes.
TIMED = ((32768, 8, 128, "bfloat16"), (4096, 8, 128, "bfloat16"))
TIMED_EXTRA = ((32768, 8, 128, "float16"),)  # rotated mode, table launch only
# (name, _write_call options); "HEAD" is the committed kernel, when git can show it.
VARIANTS = (
    ("table", {}),
    ("table, byte stores", {"pack_words": False}),
    ("64 rows w2", {"tile": (8, 8, 2)}),
    ("128 rows w4", {"tile": (16, 8, 4)}),
)
# Tried and not kept (branch int4-write-lanes, docs/int4_write_notes.md): a row over 2 or 4
# lanes, and the rotated rows' max and min on bf16x2 words.
ROTATE_BYTES = 256 << 20  # input sets per timing exceed this (H200 L2: 50 MB)
MAX_SETS = 8
REPS = 40
WARM_S = 0.2


# ---------------------------------------------------------------------------------------------
# problems


def _rows(rng, mode, dtype, shape, device, dist=None):
    if dist is None and shape[0] * shape[1] > 4096:
        # Timing sets: drawn on the device (make_rows' variety is for the checks).
        x = torch.randn(shape, device=device, dtype=torch.float32) * float(rng.choice([0.05, 1.0, 30.0]))
        return x.to(DTYPES[dtype])
    dist = dist or str(rng.choice(DISTS))
    return torch.from_numpy(make_rows(MODES[mode], dist, dtype, shape, rng)).to(DTYPES[dtype]).to(device)


def _poison(rng, shape, dtype, device):
    raw = torch.from_numpy(
        rng.integers(1, 256, size=shape + (torch.empty((), dtype=dtype).element_size(),), dtype=np.uint8)
    )
    return raw.view(dtype).reshape(shape).to(device)


def make_problem(rng, mode, tokens, heads, d, dtype, device, skip=True, dist=None):
    """A CacheWrite with random rows, random slots (every fifth skipped) and caches of random
    bytes."""
    blocks = 2 * max(1, -(-tokens // BLOCK))
    key = _rows(rng, mode, dtype, (tokens, heads, d), device, dist)
    value = _rows(rng, mode, dtype, (tokens, heads, d), device, dist)
    slots = torch.from_numpy(rng.permutation(blocks * BLOCK)[:tokens].astype(np.int64))
    if skip and tokens > 1:
        slots[::5] = -1
    shape = (blocks, BLOCK, heads)
    return CacheWrite(
        mode=MODES[mode],
        key=key,
        value=value,
        key_cache=_poison(rng, shape + (d // 2,), torch.uint8, device),
        value_cache=_poison(rng, shape + (d // 2,), torch.uint8, device),
        slot_mapping=slots.to(device),
        k_scale_cache=_poison(rng, shape, torch.float32, device),
        v_scale_cache=_poison(rng, shape, torch.float32, device),
    )


def _caches(p):
    return (p.key_cache, p.value_cache, p.k_scale_cache, p.v_scale_cache)


def check(p, launch, label: str, max_tokens: int | None = None) -> None:
    """launch(p) writes what the NumPy implementation writes, and nothing else; max_tokens:
    the reference runs on that many tokens at random (the rest only may not be wrong there)."""
    before = [c.clone() for c in _caches(p)]
    launch(p)
    if p.key.is_cuda:
        torch.cuda.synchronize()
    T, H, D = p.key.shape
    slots = p.slot_mapping.cpu()
    pick = torch.arange(T)
    if max_tokens is not None and T > max_tokens:
        pick = torch.from_numpy(np.sort(np.random.default_rng().permutation(T)[:max_tokens]))
    pick = pick[slots[pick] >= 0]
    n = len(pick)
    ref = kvzoo.allocate_separate(max(1, -(-n // BLOCK)), BLOCK, H, D, p.mode, model_dtype=str(p.key.dtype)[6:])
    if n:
        kvzoo.reshape_and_cache(
            p.key[pick].cpu(),
            p.value[pick].cpu(),
            ref.key_cache,
            ref.value_cache,
            torch.arange(n),
            mode=p.mode,
            k_scale_cache=ref.k_scale_cache,
            v_scale_cache=ref.v_scale_cache,
            impl="numpy",
        )
    written = slots[slots >= 0]
    untouched = torch.ones(p.key_cache.shape[0] * BLOCK, dtype=torch.bool)
    untouched[written] = False
    for got, old, want, name in zip(
        _caches(p),
        before,
        (ref.key_cache, ref.value_cache, ref.k_scale_cache, ref.v_scale_cache),
        ("K", "V", "K words", "V words"),
    ):
        g = got.cpu().contiguous().view(torch.uint8).reshape(untouched.shape[0], -1)
        o = old.cpu().contiguous().view(torch.uint8).reshape(untouched.shape[0], -1)
        w = want.contiguous().view(torch.uint8).reshape(-1, g.shape[1])[:n]
        bad_written = int((g[slots[pick]] != w).any(1).sum())
        bad_other = int((g[untouched] != o[untouched]).any(1).sum())
        if bad_written or bad_other:
            raise AssertionError(
                f"{label}: {name}: {bad_written} rows differ from NumPy, {bad_other} unwritten rows changed"
            )


# ---------------------------------------------------------------------------------------------
# launches


def launcher(module, **options):
    """p -> the module's int4 write of p with these _write_call options."""

    def launch(p):
        grid, args, kwargs, _ = module._write_call(p, float(SCALE_FLOOR), **options)
        module._int4_write_kernel[grid](*args, **kwargs)

    return launch


def head_module():
    """int4_write.py as committed at git HEAD, imported beside the working tree's, or None."""
    rel = "kvzoo/backends/triton/int4_write.py"
    try:
        src = subprocess.run(
            ["git", "show", f"HEAD:{rel}"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None, None
    if src == (ROOT / rel).read_text():
        return None, commit.strip()  # nothing changed: the table row is HEAD
    path = Path(tempfile.mkdtemp()) / "_int4_write_head.py"
    path.write_text(src)  # @triton.jit reads the source back from the file
    name = "kvzoo.backends.triton._int4_write_head"  # its relative imports resolve beside int4_write
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module, commit.strip()


def int8_launcher():
    def launch(p):
        kvzoo.reshape_and_cache(
            p.key,
            p.value,
            p.key_cache,
            p.value_cache,
            p.slot_mapping,
            mode="int8_per_token_head",
            k_scale_cache=p.k_scale_cache,
            v_scale_cache=p.v_scale_cache,
            impl="triton-cuda",
            validate=False,
        )

    return launch


def int8_problem(rng, tokens, heads, d, dtype, device):
    blocks = 2 * max(1, -(-tokens // BLOCK))
    shape = (blocks, BLOCK, heads)
    slots = torch.from_numpy(rng.permutation(blocks * BLOCK)[:tokens].astype(np.int64)).to(device)
    return CacheWrite(
        mode=MODES["int8_per_token_head"],
        key=_rows(rng, "int8_per_token_head", dtype, (tokens, heads, d), device),
        value=_rows(rng, "int8_per_token_head", dtype, (tokens, heads, d), device),
        key_cache=torch.zeros(shape + (d,), dtype=torch.int8, device=device),
        value_cache=torch.zeros(shape + (d,), dtype=torch.int8, device=device),
        slot_mapping=slots,
        k_scale_cache=torch.zeros(shape, dtype=torch.float32, device=device),
        v_scale_cache=torch.zeros(shape, dtype=torch.float32, device=device),
    )


def write_bytes(tokens, heads, d, dtype, code_bytes):
    """Bytes a write moves: K and V rows read, their codes and scale words written, slots read
    (gpu_bench._write_bytes for this shape)."""
    elem = DTYPES[dtype].itemsize
    return tokens * heads * 2 * (d * elem + code_bytes + 4) + tokens * 8


# ---------------------------------------------------------------------------------------------
# timing


def measure(run_set, n_sets: int, reps: int = REPS) -> float:
    """Median seconds a call of run_set(i), i over n_sets input sets, from CUDA-graph replays."""
    for i in range(n_sets):
        run_set(i)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(n_sets):
            run_set(i)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(n_sets):
            run_set(i)
    until = time.perf_counter() + WARM_S
    while time.perf_counter() < until:
        g.replay()
        torch.cuda.synchronize()
    events = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        events.append((a, b))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in events) / 1e3 / n_sets


def copy_ceiling() -> float:
    """GB/s (read + written) of a 1 GiB device copy, gpu_bench.ceilings' measure."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(30):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        times.append((a, b))
    torch.cuda.synchronize()
    t = statistics.median(a.elapsed_time(b) for a, b in times) / 1e3
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n / t / 1e9


def same_bytes_copy(nbytes: int) -> float:
    sets = max(1, min(MAX_SETS, math.ceil(ROTATE_BYTES / nbytes)))
    src = [torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda").random_() for _ in range(sets)]
    dst = [torch.empty_like(x) for x in src]
    t = measure(lambda i: dst[i].copy_(src[i]), sets)
    src.clear()
    dst.clear()
    torch.cuda.empty_cache()
    return t


# ---------------------------------------------------------------------------------------------


def run_checks(rng, device, smoke: bool, timed_variants, grid: bool = True) -> tuple[int, set[str]]:
    """Checks the table's launch on the grid of shapes (any difference raises) and each timed
    variant at its own shape: (problems checked, the names of the variants that differed)."""
    failed: set[str] = set()
    launch = launcher(int4_write)
    tokens = (1, 3, 16, 37) if smoke else CHECK_TOKENS
    head_sizes = (64, 128) if smoke else CHECK_HEAD_SIZES
    n = 0
    for mode in INT4 if grid else ():
        for T in tokens:
            for d in head_sizes:
                for dtype in DTYPES:
                    if T > FULL_CHECK_MAX_TOKENS and (dtype != "bfloat16" or d != 128):
                        continue
                    heads = 2 if smoke else HEADS
                    p = make_problem(rng, mode, T, heads, d, dtype, device)
                    check(p, launch, f"{mode} T={T} H={heads} D={d} {dtype}")
                    n += 1
        # The tiles int4_write.MIN_TILE_ROWS guards: two rows (one token of two heads, two of
        # one) of 16-bit rows at head size 64, every distribution.
        for tokens_, heads in ((1, 2), (2, 1)):
            for dtype in ("bfloat16", "float16"):
                for dist in DISTS:
                    p = make_problem(rng, mode, tokens_, heads, 64, dtype, device, skip=False, dist=dist)
                    check(p, launch, f"{mode} two-row tile T={tokens_} H={heads} D=64 {dtype} {dist}")
                    n += 1
    for name, variant in timed_variants:
        for T, H, d, dtype in ((37, 3, 128, "bfloat16"),) if smoke else TIMED[:1]:
            for mode in INT4:
                p = make_problem(rng, mode, T, H, d, dtype, device)
                try:
                    check(p, variant, f"variant {name}: {mode} T={T} {dtype}", max_tokens=2048)
                except AssertionError as e:
                    # A wrong variant is reported and left out of the timing; the rest still run.
                    print(f"FAILED {e}")
                    failed.add(name)
                n += 1
    return n, failed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--interpret-smoke", action="store_true", help="CPU, TRITON_INTERPRET=1: the checks at tiny sizes")
    ap.add_argument("--no-timing", action="store_true", help="the checks only")
    ap.add_argument("--quick", action="store_true", help="the variants' checks only (small), then the timing")
    ap.add_argument(
        "--launch-once", action="store_true", help="each variant once at the first timed shape, for a profiler"
    )
    args = ap.parse_args()
    smoke = args.interpret_smoke
    # NumPy's casts of a poisoned row's NaN (the reference, and the interpreter) warn each time.
    warnings.filterwarnings("ignore", category=RuntimeWarning)
    device = "cpu" if smoke else "cuda"
    seed = int.from_bytes(os.urandom(8), "little")
    rng = np.random.default_rng(seed)
    print(f"seed {seed}  torch {torch.__version__}  triton {__import__('triton').__version__}  device {device}")
    if not smoke:
        print(torch.cuda.get_device_name())
    head, commit = head_module()
    variants = [(name, launcher(int4_write, **opts)) for name, opts in VARIANTS]
    if head is not None:
        variants.append((f"HEAD {commit}", launcher(head)))
    else:
        print(f"no HEAD variant ({'unchanged at ' + commit if commit else 'not a git checkout'})")
    if args.launch_once:
        T, H, d, dtype = TIMED[0]
        for mode in INT4:
            p = make_problem(rng, mode, T, H, d, dtype, "cuda", skip=False)
            for _, v in variants:
                v(p)
        torch.cuda.synchronize()
        return 0
    t0 = time.perf_counter()
    n, failed = run_checks(rng, device, smoke or args.quick, variants, grid=not args.quick)
    variants = [(name, v) for name, v in variants if name not in failed]
    print(
        f"checks: {n} problems ({time.perf_counter() - t0:.0f} s): every written byte the NumPy implementation's"
        + (f" but in variants {sorted(failed)}, left out of the timing" if failed else "")
    )
    result = {"seed": seed, "checks": n, "failed_variants": sorted(failed), "rows": []}
    if not smoke and not args.no_timing:
        result["copy_ceiling_GBps"] = ceil = copy_ceiling()
        print(f"copy ceiling {ceil:,.0f} GB/s (1 GiB, read + written)")
        head_line = f"{'variant':<22} {'mode':<10} {'shape':<22} {'us':>8} {'GB/s':>8} {'%ceil':>6} {'%copy':>6}"
        print(head_line + "\n" + "-" * len(head_line))
        timed = [(s, mode, variants) for s in TIMED for mode in INT4]
        timed += [(s, INT4[0], variants[:1]) for s in TIMED_EXTRA]
        copies, int8_done = {}, set()
        for (T, H, d, dtype), mode, vs in timed:
            nbytes = write_bytes(T, H, d, dtype, d // 2)
            sets = max(1, min(MAX_SETS, math.ceil(ROTATE_BYTES / nbytes)))
            problems = [make_problem(rng, mode, T, H, d, dtype, "cuda", skip=False) for _ in range(sets)]
            shape = f"T={T} H={H} D={d} {dtype[:4]}"
            if nbytes not in copies:
                copies[nbytes] = same_bytes_copy(nbytes)
            rows = [(name, mode, v, problems, nbytes) for name, v in vs]
            if (T, H, d, dtype) not in int8_done:
                int8_done.add((T, H, d, dtype))
                p8 = [int8_problem(rng, T, H, d, dtype, "cuda") for _ in range(sets)]
                rows.append(("int8 write", "int8", int8_launcher(), p8, write_bytes(T, H, d, dtype, d)))
            for name, mode_, v, ps, nb in rows:
                t = measure(lambda i, v=v, ps=ps: v(ps[i]), len(ps))
                gbs = nb / t / 1e9
                pct, pct_copy = 100 * gbs / ceil, 100 * copies[nbytes] / t
                mode_s = {"int4_per_token_head": "int4", "int4_per_token_head_norot": "int4 norot"}.get(mode_, mode_)
                print(
                    f"{name:<22} {mode_s:<10} {shape:<22} {t * 1e6:8.2f} {gbs:8,.0f} {pct:6.1f} {pct_copy:6.1f}",
                    flush=True,
                )
                result["rows"].append(
                    dict(
                        variant=name,
                        mode=mode_,
                        shape=shape,
                        us=t * 1e6,
                        GBps=gbs,
                        pct_ceiling=pct,
                        pct_same_bytes_copy=pct_copy,
                    )
                )
            print(f"{'copy of those bytes':<22} {'':<10} {shape:<22} {copies[nbytes] * 1e6:8.2f}")
            del problems, rows
            torch.cuda.empty_cache()
    out = os.environ.get("OUT")
    if out:
        Path(out, "int4_write_probe.json").write_text(json.dumps(result, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
