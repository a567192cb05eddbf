"""kvzoo.audit: defects planted in caches written by every implementation are found at their place.

Each registered reshape_and_cache implementation that takes a mode, layout and rounding writes a
small two-layer cache of fresh random K/V (the session seed); the audit of it must find nothing,
and after planting every defect the mode can hold (a NaN scale, an fp8 NaN code, a never-written
slot, an out-of-range block id, a block shared with a partly filled tail, a row overwritten with
another row's bytes, codes of another write, stale bytes, a scale outlier) it must report exactly
those: each kind at its (layer, seq, block, slot), K or V, and heads. A new backend is covered
with no edit here. Triton runs under its interpreter: the caches are small.
"""

from __future__ import annotations

import importlib.util
import json
import warnings
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

import kvzoo
from kvzoo import api, registry
from kvzoo.arrays import as_numpy
from kvzoo.auditing import CacheDumpError, audit, cache_dump, load_cache_dump, read_dump, save_cache_dump
from kvzoo.auditing.rows import stored_codec
from kvzoo.backends.numpy_vectorized import kernels as vectorized
from kvzoo.capabilities import Requirements
from kvzoo.cli import main
from kvzoo.conformance.checks import declared_reasons
from kvzoo.inputs import device_for
from kvzoo.modes import MODES
from kvzoo.registry import Implementation, Registry

from support import SEED, rng_for

NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE, LAYERS = 12, 4, 2, 16, 2
# Sequence lengths (2 + 1 + 2 + 1 + 2 + 1 blocks of NUM_BLOCKS): what the defects need, no more
# (the Triton interpreter takes about 40 ms a token).
LENS = (6, 4, 5, 1, 6, 2)
DTYPE = "float32"


def _writers() -> list:
    params = []
    for impl in registry.default().implementations("reshape_and_cache"):
        if not impl.available:
            continue
        for mode_name in sorted(impl.modes):
            mode = MODES[mode_name]
            if mode.split:
                continue  # the audit refuses split modes (test below)
            for layout in mode.layouts:
                for rounding in mode.roundings:
                    options = {"inline_layout"} if layout == "inline" else set()
                    options |= {"trunc_rounding"} if rounding == "trunc" else set()
                    if declared_reasons(impl, mode_name, Requirements(HEAD_SIZE, DTYPE, frozenset(options))):
                        continue
                    params.append(
                        pytest.param(
                            impl, mode_name, layout, rounding, id=f"{impl.name}-{mode_name}-{layout}-{rounding}"
                        )
                    )
    return params


@dataclass
class Written:
    """A cache written by one implementation: its tensors, tables and where each token went."""

    mode: kvzoo.QuantMode
    layout: str
    rounding: str
    layers: list
    tables: np.ndarray
    lens: np.ndarray
    statics: list | None  # the per-tensor k_scale of each layer (v_scale: v_statics)
    v_statics: list | None
    keys: list = field(default_factory=list)
    values: list = field(default_factory=list)

    def place(self, seq: int, pos: int) -> tuple[int, int]:
        return int(self.tables[seq, pos // BLOCK_SIZE]), pos % BLOCK_SIZE

    def dump(self, with_reference: bool = False) -> dict:
        return cache_dump(
            self.layers,
            mode=self.mode,
            block_tables=torch.from_numpy(self.tables),
            seq_lens=torch.from_numpy(self.lens),
            rounding=self.rounding,
            k_scales=self.statics,
            v_scales=self.v_statics,
            keys=self.keys if with_reference else None,
            values=self.values if with_reference else None,
        )

    def codes(self, layer: int, which: str) -> np.ndarray:
        t = self.layers[layer]
        return as_numpy(t.key_cache if which == "key" else t.value_cache).view(np.uint8)

    def words(self, layer: int, which: str) -> np.ndarray:
        t = self.layers[layer]
        return as_numpy(t.k_scale_cache if which == "key" else t.v_scale_cache)


def write_cache(
    impl: Implementation, mode_name: str, layout: str, rounding: str, rng: np.random.Generator, row_align=None
) -> Written:
    mode = MODES[mode_name]
    device = device_for(impl)
    tables = np.full((len(LENS), 3), -1, np.int32)
    free = rng.permutation(NUM_BLOCKS).tolist()
    for s, n in enumerate(LENS):
        for i in range(-(-n // BLOCK_SIZE)):
            tables[s, i] = free.pop()
    lens = np.array(LENS, np.int32)
    slots = np.array(
        [tables[s, p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for s, n in enumerate(LENS) for p in range(n)]
    )
    tokens = len(slots)
    if layout == "inline":
        t = kvzoo.allocate_inline(NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE, mode, device=device, row_align=row_align)
    else:
        t = kvzoo.allocate_separate(NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE, mode, model_dtype=DTYPE, device=device)
    # Rows of a few sizes, never zero: a scale outlier is 1024x, far beyond their spread.
    k, v = (
        (rng.standard_normal((tokens, HEADS, HEAD_SIZE)) * rng.uniform(0.5, 2.0, (tokens, 1, 1))).astype(np.float32)
        for _ in range(2)
    )
    static = float(np.float32(max(np.abs(k).max(), np.abs(v).max()) / mode.qmax)) if mode.per_tensor else None
    api.reshape_and_cache(
        torch.from_numpy(k).to(device),
        torch.from_numpy(v).to(device),
        t.key_cache,
        t.value_cache,
        torch.from_numpy(slots).to(device),
        mode=mode,
        k_scale_cache=t.k_scale_cache,
        v_scale_cache=t.v_scale_cache,
        k_scale=static,
        v_scale=static,
        rounding=rounding,
        impl=impl,
    )
    # One write (the interpreter's time), every layer a copy of its pages: the defects planted in
    # one layer must be reported in that layer only.
    layers = [t] + [_copy(t, mode) for _ in range(LAYERS - 1)]
    statics = None if static is None else [static] * LAYERS
    keys, values = [torch.from_numpy(k)] * LAYERS, [torch.from_numpy(v)] * LAYERS
    return Written(
        mode, layout, rounding, layers, tables, lens, statics, None if statics is None else list(statics), keys, values
    )


def _copy(t: kvzoo.KVCacheTensors, mode: kvzoo.QuantMode) -> kvzoo.KVCacheTensors:
    if t.buffer is not None:
        return kvzoo.inline_views(t.buffer.clone(), t.key_cache.shape[-1], mode)
    return kvzoo.KVCacheTensors(
        *(None if x is None else x.clone() for x in (t.key_cache, t.value_cache, t.k_scale_cache, t.v_scale_cache))
    )


def _found(report) -> set:
    return {(f.kind, f.layer, f.seq, f.block, f.slot, f.cache, f.heads) for f in report.findings}


def plant_defects(w: Written, rng: np.random.Generator) -> set:
    """Plant every defect the mode can hold (in place); returns the findings expected."""
    mode, fmt = w.mode, w.mode.format
    expected = set()
    per_row = mode.per_token_head

    # A NaN scale (per-token-head), a NaN static scale (per-tensor) or a NaN value (none).
    b, o = w.place(0, 2)
    if per_row:
        w.words(1, "key")[b, o, 1] = np.nan
        expected.add(("scale_nan", 1, 0, b, o, "key", (1,)))
    elif mode.per_tensor:
        w.statics[1] = float("nan")
        expected.add(("static_scale_invalid", 1, None, None, None, "key", ()))
    else:
        as_numpy(w.layers[1].key_cache)[b, o, 1, 3] = np.nan
        expected.add(("value_nonfinite", 1, 0, b, o, "key", (1,)))

    # An fp8 NaN code in a row whose scale is fine.
    if fmt is not None and fmt.nan_codes:
        b, o = w.place(2, 1)
        w.codes(0, "value")[b, o, 0, 5] = fmt.nan_code
        expected.add(("code_nan", 0, 2, b, o, "value", (0,)))

    # A slot inside seq_lens never written: every byte of it zero, as allocated.
    b, o = w.place(1, 3)
    w.codes(1, "value")[b, o] = 0
    if per_row:
        w.words(1, "value")[b, o] = 0
    expected.add(("scale_zero" if per_row else "row_zero", 1, 1, b, o, "value", (0, 1)))

    # A row's codes re-encoded at half its values under its own scale: another write's codes.
    if per_row:
        b, o = w.place(2, 4)
        codes, words = w.codes(1, "value")[b, o, 1], w.words(1, "value")[b, o, 1]
        codec = stored_codec(mode)
        scale, zero_point = fmt.split_scale_words(words[None])
        x = vectorized.decode(codes[None], words[None], codec)
        y = (x * np.float32(0.5) / scale[:, None] + zero_point[:, None].astype(np.float32)).astype(np.float32)
        w.codes(1, "value")[b, o, 1] = fmt.pack(vectorized.encode(y, codec))[0]
        expected.add(("not_encoder_output", 1, 2, b, o, "value", (1,)))

    # A scale 1024 times its neighbours' (a power of two: codes and zero point bits unchanged).
    if per_row:
        b, o = w.place(4, 3)
        w.words(0, "value")[b, o, 0] *= np.float32(1024)
        expected.add(("scale_outlier", 0, 4, b, o, "value", (0,)))

    # A row overwritten with another row's bytes (codes and scale): both places are reported.
    (b1, o1), (b2, o2) = w.place(0, 5), w.place(1, 1)
    w.codes(0, "key")[b2, o2, 1] = w.codes(0, "key")[b1, o1, 0]
    if per_row:
        w.words(0, "key")[b2, o2, 1] = w.words(0, "key")[b1, o1, 0]
    expected |= {("duplicate_row", 0, 0, b1, o1, "key", (0,)), ("duplicate_row", 0, 1, b2, o2, "key", (1,))}

    # Stale bytes past seq_len in sequence 0's last block (6 tokens: slots 2 and 3 of its second block unused).
    b = int(w.tables[0, 1])
    w.codes(0, "key")[b, 2] = rng.integers(1, 256, w.codes(0, "key")[b, 2].shape, dtype=np.uint8)
    expected.add(("stale_rows", 0, 0, b, 2, "key", ()))

    # A block id out of range in sequence 3's live table.
    w.tables[3, 0] = NUM_BLOCKS + 5
    expected.add(("block_out_of_range", None, 3, NUM_BLOCKS + 5, None, None, ()))

    # Sequence 5 (2 tokens) reads sequence 4's partly filled last block (2 of 4): both write there next.
    shared = int(w.tables[4, 1])
    w.tables[5, 0] = shared
    expected |= {
        ("block_shared_partial", None, 4, shared, 2, None, ()),
        ("block_shared_partial", None, 5, shared, 2, None, ()),
    }
    return expected


@pytest.mark.parametrize("impl, mode_name, layout, rounding", _writers())
def test_planted_defects_are_found_at_their_place(impl, mode_name, layout, rounding):
    rng = rng_for("audit", impl.name, mode_name, layout, rounding)
    w = write_cache(impl, mode_name, layout, rounding, rng)
    clean = audit(w.dump(), workers=1)
    assert not clean.findings and not clean.counts, f"clean cache (seed {SEED}): {clean.format_text()}"
    expected = plant_defects(w, rng)
    report = audit(w.dump(), workers=1)
    found = _found(report)
    assert found == expected, (
        f"seed {SEED}\nmissing: {sorted(expected - found, key=str)}\nunexpected: {sorted(found - expected, key=str)}\n"
        + report.format_text()
    )
    assert sum(report.counts.values()) == len(expected)
    assert report.ok is False


def _numpy_cache(mode_name: str, layout: str = "separate", rounding: str = "nearest") -> Written:
    impl = registry.get("reshape_and_cache", "numpy")
    return write_cache(impl, mode_name, layout, rounding, rng_for("audit-numpy", mode_name, layout, rounding))


@pytest.mark.parametrize("mode_name", ["int8_per_token_head", "int4_per_token_head", "fp8_per_tensor", "none"])
def test_reference_kv_measures_the_cache_and_finds_a_swapped_row(mode_name):
    w = _numpy_cache(mode_name)
    report = audit(w.dump(with_reference=True), workers=1)
    assert not report.counts, report.format_text()
    for layer in report.layers:
        for stats in (layer.key, layer.value):
            assert stats.reference_exact == 1.0  # kvzoo's own bytes
            bound = 0.0 if mode_name == "none" else 0.1
            assert stats.reference_error <= bound and (mode_name == "none" or stats.reference_error > 0)
    # The value row of sequence 1, position 2 holds position 3's now.
    (b1, o1), (b2, o2) = w.place(1, 3), w.place(1, 2)
    w.codes(1, "value")[b2, o2] = w.codes(1, "value")[b1, o1]
    if w.mode.per_token_head:
        w.words(1, "value")[b2, o2] = w.words(1, "value")[b1, o1]
    report = audit(w.dump(with_reference=True), workers=1)
    mismatches = {
        (f.layer, f.seq, f.block, f.slot, f.cache, f.heads) for f in report.findings if f.kind == "reference_mismatch"
    }
    assert mismatches == {(1, 1, b2, o2, "value", (0, 1))}, report.format_text()


def test_report_json_schema_and_text():
    w = _numpy_cache("fp8_per_token_head")
    plant_defects(w, rng_for("audit-json"))
    report = audit(w.dump(), workers=2)
    doc = json.loads(json.dumps(report.to_json(), allow_nan=False))
    assert set(doc) == {"findings", "layers", "replay", "summary"}
    for f in doc["findings"]:
        assert {"kind", "severity", "layer", "seq", "block", "slot", "detail"} <= set(f)
        assert f["severity"] in ("error", "warning")
    assert [layer["layer"] for layer in doc["layers"]] == [0, 1]
    assert doc["summary"]["errors"] == report.errors > 0 and doc["summary"]["ok"] is False
    text = report.format_text()
    assert "ERROR scale_nan x1" in text and "layer  kv  rows" in text


def test_limit_keeps_counts():
    w = _numpy_cache("int8_per_token_head")
    w.words(0, "key")[...] = np.nan  # every row, live or not
    report = audit(w.dump(), max_findings=3, workers=1)
    live_rows = sum(LENS)
    assert report.counts["scale_nan"] == live_rows
    assert sum(f.kind == "scale_nan" for f in report.findings) == 3
    assert report.layers[0].key.errors == live_rows


def test_dump_file_round_trip_and_cli(tmp_path, capsys):
    w = _numpy_cache("int8_per_token_head", layout="inline")
    clean_path = tmp_path / "clean.pt"
    save_cache_dump(clean_path, w.dump())
    assert set(load_cache_dump(clean_path)["layers"][0]) == {"buffer"}  # the page itself
    assert main(["audit", str(clean_path), "--write-impl", "numpy"]) == 0
    expected = plant_defects(w, rng_for("audit-cli"))
    bad_path = tmp_path / "bad.pt"
    save_cache_dump(bad_path, w.dump())
    assert _found(audit(bad_path)) == expected
    capsys.readouterr()
    assert main(["audit", str(bad_path), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert {(f["kind"], f["layer"], f["seq"], f["block"], f["slot"]) for f in doc["findings"]} == {
        e[:5] for e in expected
    }
    plots = tmp_path / "plots"
    if importlib.util.find_spec("matplotlib") is None:
        # matplotlib is the [plots] extra, not [test]: without it the flag is refused up front.
        assert main(["audit", str(bad_path), "--plot", str(plots)]) == 2
        assert "kvzoo[plots]" in capsys.readouterr().err
        assert not plots.exists()
    else:
        assert main(["audit", str(bad_path), "--json", "--plot", str(plots)]) == 1
        assert sorted(p.name for p in plots.iterdir()) == ["layer_000.png", "layer_001.png"]


def _broken(dump: dict, where, value) -> dict:
    out = {**dump, "layers": [dict(layer) for layer in dump["layers"]]}
    target = out if where[0] is None else out["layers"][where[0]]
    if value is None:
        del target[where[1]]
    else:
        target[where[1]] = value
    return out


@pytest.mark.parametrize(
    "where, value, message",
    [
        ((None, "block_tables"), None, "missing key 'block_tables'"),
        ((None, "mode"), "int7", "mode: unknown kv-cache quantization mode 'int7'"),
        ((1, "k_scale_cache"), None, "layers[1]: missing key 'k_scale_cache'"),
        (
            (0, "v_scale_cache"),
            torch.zeros(NUM_BLOCKS, BLOCK_SIZE, HEADS, dtype=torch.float16),
            "layers[0]['v_scale_cache']: expected dtype float32",
        ),
        (
            (0, "key_cache"),
            torch.zeros(NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE, dtype=torch.float32),
            "expected dtype int8 or uint8",
        ),
        (
            (1, "value_cache"),
            torch.zeros(NUM_BLOCKS, BLOCK_SIZE, HEADS, 8, dtype=torch.int8),
            "layers[1]['value_cache']: expected int8 [12, 4, 2, 16] like key_cache",
        ),
        ((None, "seq_lens"), torch.zeros(3, dtype=torch.int32), "seq_lens: expected shape [6]"),
        ((None, "block_size"), 8, "block_size is 8 but the cache's second dim is 4"),
    ],
)
def test_unreadable_dumps_name_what_is_wrong(tmp_path, capsys, where, value, message):
    dump = _broken(_numpy_cache("int8_per_token_head").dump(), where, value)
    with pytest.raises(CacheDumpError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        audit(dump)
    path = tmp_path / "dump.pt"
    torch.save(dump, path)
    assert main(["audit", str(path)]) == 2
    assert message in capsys.readouterr().err


def test_unreadable_files_exit_2(tmp_path, capsys):
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a torch file")
    assert main(["audit", str(junk)]) == 2
    assert "not a readable torch.save file" in capsys.readouterr().err
    assert main(["audit", str(tmp_path / "missing.pt")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_tensors_are_audited_in_place():
    """A CPU cache's tensors are read where they are (no copy): a defect written after the dump
    dict was built is still seen."""
    w = _numpy_cache("fp8_per_token_head", layout="inline")
    dump = w.dump()
    b, o = w.place(0, 0)
    w.words(0, "key")[b, o, 0] = -1.0
    assert _found(audit(dump, workers=1)) == {("scale_negative", 0, 0, b, o, "key", (0,))}


# ---------------------------------------------------------------------------------------------
# replay


def test_replay_passes_on_every_available_implementation():
    w = _numpy_cache("int8_per_token_head")
    # Triton's kernels under the interpreter take seconds here: the CPU implementations only.
    cpu = [i.name for i in registry.default().implementations("paged_attention") if i.platform in ("any", "cpu")]
    report = audit(w.dump(), replay=2, replay_impls=cpu, seed=SEED, workers=1)
    ran = [r for r in report.replay if r.skipped is None]
    assert {r.impl for r in ran} >= {"numpy"} and all(not r.failed for r in ran), report.format_text()
    assert all(r.rows == sum(min(2, n) for n in LENS) for r in ran)
    assert report.ok


@pytest.mark.parametrize("row_align", [16, "pow2"])
def test_an_aligned_inline_page_is_audited_and_replayed(row_align, tmp_path):
    """Rows of 32 bytes (20 of data): the dump says its head size, the audit finds every planted
    defect at its place, and the CPU implementations replay attention on the padded page."""
    impl = registry.get("reshape_and_cache", "numpy")
    rng = rng_for("audit-aligned", row_align)
    w = write_cache(impl, "int8_per_token_head", "inline", "nearest", rng, row_align=row_align)
    assert w.layers[0].buffer.shape[-1] == 32
    dump = w.dump()
    assert dump["head_size"] == HEAD_SIZE
    path = tmp_path / "aligned.pt"
    save_cache_dump(path, dump)
    cpu = [i.name for i in registry.default().implementations("paged_attention") if i.platform in ("any", "cpu")]
    clean = audit(load_cache_dump(path), replay=2, replay_impls=cpu, seed=SEED, workers=1)
    ran = [r for r in clean.replay if r.skipped is None]
    assert {r.impl for r in ran} >= {"numpy"} and all(not r.failed for r in ran), clean.format_text()
    assert clean.ok and not clean.findings, clean.format_text()
    expected = plant_defects(w, rng)
    report = audit(w.dump(), workers=1)
    assert _found(report) == expected, report.format_text()


@pytest.mark.parametrize("mode_name", [name for name, m in MODES.items() if m.split])
def test_a_split_mode_dump_is_refused_naming_the_mode(mode_name):
    dump = _numpy_cache("int8_per_token_head").dump()
    with pytest.raises(CacheDumpError, match=f"^mode: '{mode_name}' stores keys and values in two formats"):
        read_dump({**dump, "mode": mode_name})


def test_an_aligned_inline_dump_is_refused_without_a_fitting_head_size():
    w = _numpy_cache("int8_per_token_head", "inline")
    dump = w.dump()
    assert "head_size" not in dump  # vLLM's page: the row tells it
    page = dump["layers"][0]["buffer"]
    odd = torch.zeros((*page.shape[:-1], 24), dtype=torch.uint8)  # neither 20 nor 16-aligned
    with pytest.raises(
        CacheDumpError, match=r"layers\[0\]\['buffer'\].*row bytes 20 \(head_size \+ 4\) or a multiple of 16"
    ):
        read_dump({**dump, "head_size": HEAD_SIZE, "layers": [{"buffer": odd}]})
    with pytest.raises(CacheDumpError, match="head_size: only an inline dump"):
        read_dump({**_numpy_cache("int8_per_token_head").dump(), "head_size": HEAD_SIZE})


def _broken_attention(reg: Registry) -> None:
    numpy_attention = registry.get("paged_attention", "numpy")

    def run(p):
        numpy_attention.run(p)
        p.out[0] *= 1.01  # the first replayed row is 1% off

    reg.add(Implementation(name="broken", op="paged_attention", platform="any", modes=numpy_attention.modes, run=run))


def test_replay_finds_a_broken_implementation():
    reg = Registry()
    _broken_attention(reg)
    w = _numpy_cache("fp8_per_token_head")
    report = audit(w.dump(), replay=3, seed=SEED, registry=reg, workers=1)
    wrong = [f for f in report.findings if f.kind == "replay_mismatch"]
    assert [(f.layer, f.seq) for f in wrong] == [(0, 0), (1, 0)], report.format_text()
    assert "broken: relative error" in wrong[0].detail


# ---------------------------------------------------------------------------------------------
# transformers: KVZooCache.audit() after generate()


def test_kvzoo_cache_audit_after_generate(mode="int8_per_token_head"):
    pytest.importorskip("transformers")
    import transformers
    from test_transformers_integration import CACHE_ARG, tiny_config

    from kvzoo.integrations.transformers import KVZooCache, use_kvzoo_attention

    torch.manual_seed(int(rng_for("audit-llama").integers(2**31)))
    model = use_kvzoo_attention(transformers.LlamaForCausalLM(tiny_config()).eval())
    ids = torch.randint(1, 128, (2, 7), generator=torch.Generator().manual_seed(SEED % 2**31))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # row 0 left-padded: its padding gets no slot
    cache = KVZooCache(model.config, mode=mode, block_size=4, impl="numpy")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.generate(
            ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, **{CACHE_ARG: cache}
        )
    report = cache.audit(replay=1, replay_impls=["numpy"], seed=SEED)
    print("\n" + report.table())
    assert report.ok and not report.counts, report.format_text()
    assert [layer.key.rows for layer in report.layers] == [int(cache.pages.lens.sum()) * 2] * 2
    # Rolling back three tokens leaves their bytes in the last blocks: counted as stale, not errors.
    cache.crop(-3)
    report = cache.audit()
    assert report.ok and set(report.counts) == {"stale_rows"}, report.format_text()


# ---------------------------------------------------------------------------------------------
# each detector is what finds its defect: with it disabled, the planted test above would fail


def _without_status(kind: str):
    from kvzoo.auditing import rows

    mark = rows.mark
    return lambda mp: mp.setattr(rows, "mark", lambda status, k, hit: None if k == kind else mark(status, k, hit))


def _without(module: str, name: str, replacement):
    import importlib

    return lambda mp: mp.setattr(importlib.import_module(module), name, replacement)


_DETECTORS = {
    "scale_nan": ("int8_per_token_head", _without_status("scale_nan")),
    "scale_zero": ("int4_per_token_head", _without_status("scale_zero")),
    "code_nan": ("fp8_per_token_head", _without_status("code_nan")),
    "value_nonfinite": ("none", _without_status("value_nonfinite")),
    "row_zero": ("int8_per_tensor", _without_status("row_zero")),
    "not_encoder_output": ("int4_per_token_head_norot", _without_status("not_encoder_output")),
    "static_scale_invalid": (
        "fp8_per_tensor",
        _without("kvzoo.auditing.findings", "static_scale_findings", lambda *a: None),
    ),
    "scale_outlier": ("fp8_per_token_head", _without("kvzoo.auditing.findings", "outlier_findings", lambda *a: None)),
    "duplicate_row": ("none", _without("kvzoo.auditing.findings", "duplicate_findings", lambda *a: None)),
    "stale_rows": ("int8_per_token_head", _without("kvzoo.auditing.findings", "stale_findings", lambda *a: None)),
    "block_shared_partial": (
        "int8_per_token_head",
        _without("kvzoo.auditing.live", "_sharing_findings", lambda *a: []),
    ),
}


@pytest.mark.parametrize("kind", sorted(_DETECTORS))
def test_each_planted_defect_needs_its_detector(kind, monkeypatch):
    mode_name, disable = _DETECTORS[kind]
    w = _numpy_cache(mode_name)
    expected = plant_defects(w, rng_for("audit-mutant", kind))
    assert kind in {e[0] for e in expected}
    disable(monkeypatch)
    found = _found(audit(w.dump(), workers=1))
    assert kind not in {f[0] for f in found}


def _cpu_writers() -> list[str]:
    return [
        i.name
        for i in registry.default().implementations("reshape_and_cache")
        if i.available and i.platform in ("any", "cpu")
    ]


@pytest.mark.parametrize(
    "mode_name, rounding",
    # The audit reads one-format caches (a split mode's sides are these modes).
    [(m.name, r) for m in MODES.values() if m.per_token_head and not m.split for r in m.roundings],
)
@pytest.mark.parametrize("dist", ["normal", "outliers", "tiny", "midpoints"])
def test_every_encoder_output_round_trips(mode_name, rounding, dist):
    """The round trip holds every row an encoder writes, the rounding midpoints (int4's zero
    point ties among them) and rows at the scale floor included; the rows of the conformance
    suite's distributions, in every input dtype, re-quantized by every CPU implementation; and
    each finds the same random rows foreign."""
    from kvzoo.auditing.rows import requantizer, round_trip_fails
    from kvzoo.backends.numpy_vectorized import codec as numpy_codec
    from kvzoo.inputs import make_rows

    mode = MODES[mode_name]
    rng = rng_for("audit-round-trip", mode_name, rounding, dist)
    for dtype in ("bfloat16", "float16", "float32"):
        x = make_rows(mode, dist, dtype, (4096, 64), rng)
        rows = x.astype(kvzoo.arrays.numpy_dtype(dtype))
        xf = rows.astype(np.float32)
        if mode.rotation:
            xf = vectorized.rotate_rows(xf, rows.dtype)
        codes, words = vectorized.quantize_rows(xf, numpy_codec(mode, rounding))
        # A row holding an infinity (a float16 outlier) is stored with scale +Inf (SPEC.md 4): an
        # error of its own kind, scale_inf, which the round trip never sees.
        finite = np.isfinite(words)
        garbage = rng.integers(0, 256, codes.shape, dtype=np.uint8)
        garbage_found = []
        for impl in _cpu_writers():
            again = requantizer(mode, impl)
            fails = round_trip_fails(codes[finite], words[finite], mode, rounding, requantize=again)
            assert not fails.any(), f"{impl}: {int(fails.sum())} rows (seed {SEED}), first {np.flatnonzero(fails)[:4]}"
            garbage_found.append(round_trip_fails(garbage[finite], words[finite], mode, rounding, requantize=again))
        assert all(np.array_equal(g, garbage_found[0]) for g in garbage_found)


def test_readme_audit_example_runs(tmp_path, monkeypatch, capsys):
    import re
    from pathlib import Path

    blocks = re.findall(r"```python\n(.*?)```", (Path(__file__).parents[1] / "README.md").read_text(), flags=re.S)
    plan = next(b for b in blocks if "plan_step" in b)
    example = next(b for b in blocks if "kvzoo.audit(" in b)
    monkeypatch.chdir(tmp_path)
    scope: dict = {"torch": torch, "kvzoo": kvzoo}
    exec(compile(plan, "README.md", "exec"), scope)
    exec(compile(example, "README.md", "exec"), scope)
    assert scope["report"].ok and not scope["report"].counts
    assert "layer  kv  rows" in capsys.readouterr().out
    assert main(["audit", str(tmp_path / "cache.pt")]) == 0


@pytest.mark.parametrize(
    "tables, lens, expected",
    [
        ([], [], {}),  # no sequence
        ([[0, 1], [2, 3]], [0, 0], {}),  # nothing live
        ([[0, 1]], [-3], {"seq_len_out_of_range": 1}),
        ([[0, 1]], [9], {"seq_len_out_of_range": 1}),  # checked up to the 8 the row holds
        ([[0, 0]], [8], {"block_repeated": 1}),
    ],
)
def test_table_edge_cases(tables, lens, expected):
    w = _numpy_cache("fp8_per_token_head")
    dump = {
        **w.dump(),
        "block_tables": torch.tensor(tables, dtype=torch.int32).reshape(len(tables), 2),
        "seq_lens": torch.tensor(lens, dtype=torch.int32),
    }
    report = audit(dump, replay=1, replay_impls=["numpy"], workers=2)
    assert {k: n for k, n in report.counts.items() if not k.startswith("scale_")} == expected, report.format_text()
