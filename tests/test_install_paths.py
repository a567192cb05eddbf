"""Every install path a user takes, each in a fresh virtual environment (slow: `pytest -m install`,
or `tox -e install`; not in the default run, which installs from the clone).

- a wheel and an sdist built from this tree, installed with the `[cpu]` extra (torch, numba):
  `kvzoo check` runs the NumPy implementation's matrix from each;
- the plain wheel, NumPy only: `kvzoo list` works, the NumPy implementation writes, reads and
  attends on NumPy arrays, and what needs torch says so in one line (exit status 2).

torch is installed as `torch==2.13.0`, the CPU build these machines carry (README's note).
"""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

import pytest

pytestmark = pytest.mark.install

ROOT = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"


def _run(*cmd: str | Path, cwd: Path | None = None, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=1800)
    if check and done.returncode:
        raise AssertionError(f"{' '.join(map(str, cmd))} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> dict[str, Path]:
    """The wheel and the sdist, built by setuptools' PEP 517 hooks from this tree."""
    out = tmp_path_factory.mktemp("dist")
    # The directory is read once: setuptools' hooks rewrite sys.argv while they run.
    hooks = "import sys; from setuptools import build_meta as b; d = sys.argv[1]; b.build_wheel(d); b.build_sdist(d)"
    _run(sys.executable, "-c", hooks, out, cwd=ROOT)
    (wheel,), (sdist,) = out.glob("kvzoo-*.whl"), out.glob("kvzoo-*.tar.gz")
    return {"wheel": wheel, "sdist": sdist}


def _fresh_venv(where: Path) -> Path:
    venv.create(where, with_pip=True)
    return where / "bin"


@pytest.mark.parametrize("kind", ["wheel", "sdist"])
def test_a_built_package_installs_and_checks(artifacts, kind, tmp_path):
    bin_ = _fresh_venv(tmp_path / "venv")
    _run(bin_ / "python", "-m", "pip", "install", "-q", TORCH, f"{artifacts[kind]}[cpu]")
    done = _run(bin_ / "kvzoo", "check", "--impl", "numpy", "-q", cwd=tmp_path)
    assert " 0 failed" in done.stdout and " passed" in done.stdout, done.stdout
    assert (tmp_path / "venv").exists() and not list(tmp_path.glob("kvzoo"))  # ran from the install, not a tree


def test_numpy_only_install_works_and_says_what_needs_torch(artifacts, tmp_path):
    bin_ = _fresh_venv(tmp_path / "venv")
    _run(bin_ / "python", "-m", "pip", "install", "-q", artifacts["wheel"])
    assert _run(bin_ / "python", "-c", "import torch", check=False).returncode != 0
    assert "numpy" in _run(bin_ / "kvzoo", "list", cwd=tmp_path).stdout
    example = (
        "import numpy as np, kvzoo\n"
        "c = kvzoo.PagedKVCache(4, 16, 2, 64, 'int8_per_token_head', device=None)\n"
        "rows = np.random.default_rng(0).standard_normal((20, 2, 64)).astype(np.float32)\n"
        "c.write(rows, rows, np.arange(20))\n"
        "i = lambda *v: np.array(v, np.int32)\n"
        "out = c.attention(rows[:1].repeat(2, 1), block_tables=i([0, 1]).reshape(1, 2), seq_lens=i(20),"
        " query_start_loc=i(0, 1))\n"
        "print(out.shape, c.read('key', block_tables=i([0, 1]).reshape(1, 2), seq_lens=i(20)).shape)\n"
    )
    assert _run(bin_ / "python", "-c", example, cwd=tmp_path).stdout.strip() == "(1, 4, 64) (20, 2, 64)"
    for argv in (["check"], ["warmup"]):
        done = _run(bin_ / "kvzoo", *argv, cwd=tmp_path, check=False)
        assert done.returncode != 0 and done.stderr.count("\n") <= 2, (argv, done.stderr)
        assert "pip install" in done.stderr, (argv, done.stderr)
    done = _run(bin_ / "python", "-c", "import kvzoo; kvzoo.PagedKVCache(4, 16, 2, 64, 'int8_per_token_head')",
                cwd=tmp_path, check=False)  # fmt: skip
    assert "needs torch" in done.stderr and "device=None" in done.stderr, done.stderr
