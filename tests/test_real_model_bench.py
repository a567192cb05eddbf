"""bench/real_model.py's pure helpers for --ablate: the e4m3 simulation against the oracle, and the
paired chunk bootstrap. No model is loaded."""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from support import SEED

_PATH = Path(__file__).resolve().parents[1] / "bench" / "real_model.py"


@pytest.fixture(scope="module")
def bench():
    offline = os.environ.get("HF_HUB_OFFLINE")  # the script sets it; leave other tests' environment alone
    spec = importlib.util.spec_from_file_location("real_model_bench", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)
    if offline is None:
        os.environ.pop("HF_HUB_OFFLINE", None)


def _hard_rows(rng: np.random.Generator) -> np.ndarray:
    """Rows whose scale is exactly 1 (absmax 448), so y = x and ties and subnormals are hit on purpose,
    plus random rows spanning many binades (outlier-like channels, zeros, tiny values)."""
    ties = np.array(
        [
            0.53125,
            0.59375,
            1.5 * 2.0**-9,
            2.5 * 2.0**-9,
            2.0**-10,
            0.75 * 2.0**-9,
            240.0 + 8.0,
            416.0,
            -0.53125,
            -(2.0**-12),
            0.0,
            -0.0,
        ]
    )
    crafted = np.zeros((2, 64), np.float32)
    crafted[:, : len(ties)] = ties
    crafted[:, -1] = 448.0
    crafted[1] *= -1
    random = rng.standard_normal((300, 64)).astype(np.float32)
    random *= np.exp2(rng.integers(-20, 12, size=(300, 64))).astype(np.float32)
    random[::7, rng.integers(0, 64)] *= 100  # an outlier channel in some rows
    random[::11] = 0
    return np.concatenate([crafted, random])


def test_e4m3_simulation_is_the_oracle_bit_for_bit(bench):
    x = torch.from_numpy(_hard_rows(np.random.default_rng(SEED))).reshape(-1, 2, 1, 64)  # [B, H, Q, D]-like
    simulated, _ = bench.fake_quant_fp(x)
    exact = bench.oracle_fp8(x)
    assert torch.equal(simulated.view(torch.int32), exact.view(torch.int32))


def test_round_minifloat_ties_to_even_and_subnormal_spacing(bench):
    y = torch.tensor([1 + 1 / 32, 1 + 3 / 32, 2.0**-8 * 1.5, 2.0**-12, 3.0 * 2.0**-20])
    four = bench.round_minifloat(y, 4).tolist()
    assert four[:2] == [1.0, 1.125]
    assert four[2] == 2.0**-8 * 1.5  # spacing 2^-10 below 2^-6 with 4 bits: representable
    assert four[3] == 0.0  # 2^-12 is under half the smallest spacing 2^-10
    assert bench.round_minifloat(y, 4, emin=None)[4].item() == 3.0 * 2.0**-20  # no underflow without subnormals
    assert bench.round_minifloat(torch.tensor([448.0, 300.0]), 2).tolist() == [448.0, 320.0]


def test_paired_interval(bench):
    tokens = np.full(20, 100.0)
    base = np.random.default_rng(SEED).uniform(200, 300, 20)
    assert bench.paired_interval(base, base, tokens) == (0.0, 0.0, 0.0)
    point, lo, hi = bench.paired_interval(base + 1.0, base, tokens)  # 0.01 nats per token everywhere
    assert point == pytest.approx(math.expm1(0.01)) and lo == pytest.approx(point) and hi == pytest.approx(point)
    noisy = base + np.where(np.arange(20) % 2, 3.0, -1.0)
    point, lo, hi = bench.paired_interval(noisy, base, tokens)
    assert lo < point < hi and point == pytest.approx(math.expm1(0.01))
