"""bench/e2e_transformers.py in its CPU smoke mode: every row runs, and what it reports of memory
is what the caches hold (the GPU figures in bench/RESULTS.md come from the same code)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

BENCH = Path(__file__).resolve().parents[1] / "bench" / "e2e_transformers.py"


def _bench():
    spec = importlib.util.spec_from_file_location("e2e_transformers", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_smoke_run_reports_every_cache(tmp_path):
    bench = _bench()
    out = tmp_path / "e2e.json"
    caches = "dynamic,kvzoo-int8,kvzoo-int4,kvzoo-int8-kernels"
    assert bench.main(["--smoke", "--caches", caches, "--rounds", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {r["cache"]: r for r in report["rows"]}
    assert sorted(rows) == sorted(caches.split(","))
    assert all(r["status"] == "ok" and r["decode_ms"] > 0 and r["prefill_ms"] > 0 for r in rows.values())
    # Two interleaved rounds a cache, the spread their medians' range.
    assert all(len(r["decode_rounds"]) == 2 for r in rows.values())
    assert all(r["decode_spread"] == [min(r["decode_rounds"]), max(r["decode_rounds"])] for r in rows.values())
    # The smoke model is float32 with heads of 16: int8 keeps (16 + 4) of 64 bytes a row, int4 (8 + 4).
    held = {name: r["held_bytes"] for name, r in rows.items()}
    assert 0 < held["kvzoo-int4"] < held["kvzoo-int8"] < 0.4 * held["dynamic"], held
    assert {"date", "commit", "device", "torch", "transformers", "command"} <= set(report["environment"])


@pytest.mark.parametrize("bits", [2, 4])
def test_quanto_unpack_stand_in_splits_each_byte_low_bits_first(bits):
    """The GPU rows of transformers' quanto cache unpack with bench's stand-in (quanto's own is
    None under torch 2.11): every byte's values, low bits first, stacked along dim 0."""
    import torch

    bench = _bench()
    packed = torch.randint(0, 256, (7, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(bits))
    out = bench.unpack_bits(packed, bits)
    per_byte = 8 // bits
    assert out.dtype == torch.uint8 and out.shape == (7 * per_byte, 3)
    for i in range(per_byte):
        for r, c in [(0, 0), (3, 1), (6, 2)]:
            byte = int(packed[r, c])
            assert int(out[i * 7 + r, c]) == (byte >> (bits * i)) % (1 << bits)
    rebuilt = sum(out[i * 7 : (i + 1) * 7].int() << (bits * i) for i in range(per_byte))
    assert torch.equal(rebuilt, packed.int())
