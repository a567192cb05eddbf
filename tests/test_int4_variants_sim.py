"""bench/probes/int4_variants_sim.py's simulated int4 rounding against the oracle: the probe's figures
for the variants kvzoo does not build yet are only as good as its per-row case is kvzoo's own."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvzoo_spec.oracle import int4_decode_rows, int4_quantize_rows, int4_unrotate

from support import SEED

_PATH = Path(__file__).resolve().parents[1] / "bench" / "probes" / "int4_variants_sim.py"


@pytest.fixture(scope="module")
def probe():
    offline = os.environ.get("HF_HUB_OFFLINE")  # real_model, which the probe imports, sets it
    spec = importlib.util.spec_from_file_location("int4_variants_sim", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)
    if offline is None:
        os.environ.pop("HF_HUB_OFFLINE", None)


def _rows(rng: np.random.Generator, count: int, head_size: int) -> np.ndarray:
    x = rng.standard_normal((count, head_size)).astype(np.float32)
    x[::5, rng.integers(0, head_size)] *= 20  # an outlier channel in some rows
    x[1::7] = np.abs(x[1::7])  # rows of one sign: the range widened to contain 0
    return x


@pytest.mark.parametrize("mode,rotate", [("int4_per_token_head", True), ("int4_per_token_head_norot", False)])
def test_one_group_a_row_is_kvzoos_int4(probe, mode, rotate):
    x = _rows(np.random.default_rng(SEED), 512, 64)
    simulated = probe.rounding(64, 64, rotate)(torch.from_numpy(x), 0).numpy()
    decoded = int4_decode_rows(*int4_quantize_rows(x, mode))
    exact = int4_unrotate(decoded) if rotate else decoded
    # Not bit for bit (x / scale against x * (1 / scale), the rotation's float32 order): a code may
    # move by one step where a value sits at a rounding midpoint; nowhere by more.
    step = (x.max(1, keepdims=True).clip(0) - x.min(1, keepdims=True).clip(None, 0)) / 15
    if rotate:
        step = step * 8  # the rotated row's range is at most sqrt(64) times larger
    assert np.all(np.abs(simulated - exact) <= step * 1.001)
    # Elsewhere they agree to float32 rounding (the rotated rows' matmul order differs from the butterfly's).
    assert np.mean(np.abs(simulated - exact) > step * 1e-3) < 0.01
    assert np.mean(np.abs(simulated - exact)) < 0.05 * np.mean(np.abs(exact - x))


def test_smaller_groups_and_the_rotation_lower_the_error(probe):
    x = torch.from_numpy(_rows(np.random.default_rng(SEED + 1), 512, 64))

    def rms(group: int, rotate: bool) -> float:
        return float((probe.rounding(64, group, rotate)(x, 0) - x).pow(2).mean().sqrt())

    assert rms(16, False) < rms(32, False) < rms(64, False)
    assert rms(64, True) < rms(64, False)
