"""What a new user meets first: the README example, `kvzoo check` on a wrong name, the numba notice."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import kvzoo
from kvzoo import cli

README = Path(__file__).resolve().parent.parent / "README.md"


def _readme_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README.md has no python example"
    return blocks[0]


def test_readme_example_runs_and_reads_no_garbage():
    scope: dict = {}
    exec(compile(_readme_example(), "README.md", "exec"), scope)
    keys, out = scope["keys"], scope["out"]
    assert out.shape == (40, 32, 128) and bool(torch.isfinite(out.float()).all())
    assert bool(torch.isfinite(keys).all()), "unwritten slots must read back as 0, not uninitialised scales"
    flat = keys.reshape(-1, 8, 128)
    assert bool((flat[40:] == 0).all()) and bool((flat[:40] != 0).any())


@pytest.mark.parametrize("layout", ["separate", "inline"])
def test_new_cache_is_zero_filled(layout):
    cache = kvzoo.PagedKVCache(3, 4, 2, 8, "fp8_per_token_head", layout=layout, device=None)
    for which in ("key", "value"):
        decoded = cache.read(which)
        assert isinstance(decoded, np.ndarray) and not np.any(decoded)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["check", "--impl", "nosuch"], ["nosuch", "registered"]),
        (["check", "--impl", "numba", "--impl", "nosuch2"], ["nosuch2"]),
        (["check", "--backend-module", "nosuch_module"], ["--backend-module nosuch_module", "could not be loaded"]),
        (["list", "--backend-module", "nosuch_module"], ["nosuch_module", "register(registry)"]),
    ],
)
def test_check_refuses_an_unknown_impl_or_backend_module(argv, words, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def test_check_refuses_an_unavailable_impl(capsys, monkeypatch):
    monkeypatch.setenv("KVZOO_DISABLE_NUMBA", "1")
    assert cli.main(["check", "--impl", "numba", "-q"]) == 2
    assert "KVZOO_DISABLE_NUMBA" in capsys.readouterr().err


def test_check_fails_when_nothing_ran(capsys, monkeypatch):
    # A matrix that runs no check verifies nothing: that is not a pass.
    import kvzoo.conformance

    monkeypatch.setattr(kvzoo.conformance, "matrix", lambda reg=None: [])
    assert cli.main(["check", "-q"]) == 1
    assert "no check ran" in capsys.readouterr().err


def test_numba_notice_when_a_compile_starts_and_not_from_a_warm_cache(tmp_path):
    # Fresh processes on an empty cache directory: the first compiles and says so once, before
    # it sits; the second loads what the first cached and says nothing. Without logging set up,
    # Python's last-resort handler prints a WARNING record.
    script = (
        "import numpy as np, kvzoo\n"
        "kvzoo.dequantize(np.ones((1, 1, 1, 4), np.int8), np.ones((1, 1, 1), np.float32),"
        " mode='int8_per_token_head', impl='numba')\n"
    )
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba-cache")}

    def run(code: str) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, env=env)
        assert done.returncode == 0, done.stderr
        return done

    # The application's logging takes it (a record of the "kvzoo" logger, nothing printed besides).
    capture = (
        "import logging\n"
        "class Keep(logging.Handler):\n"
        "    def emit(self, record): print('RECORD', record.levelname, record.getMessage())\n"
        "logging.getLogger('kvzoo').addHandler(Keep())\n"
        "logging.getLogger('kvzoo').propagate = False\n"
    )
    cold = run(capture + script)
    assert "compiling" not in cold.stderr, cold.stderr
    notices = [line for line in cold.stdout.splitlines() if "compiling the numba CPU kernels" in line]
    assert len(notices) == 1 and notices[0].startswith("RECORD WARNING"), cold.stdout
    assert "kvzoo warmup" in notices[0] and "KVZOO_DISABLE_NUMBA" in notices[0]
    assert list((tmp_path / "numba-cache").rglob("*.nbi")), "the compile left no cache index"
    warm = run(capture + script)
    assert "compiling" not in warm.stdout + warm.stderr


def test_list_fits_100_columns_and_shows_priority(capsys):
    assert cli.main(["list"]) == 0
    text = capsys.readouterr().out
    assert max(len(line) for line in text.splitlines()) <= 100
    assert "prio" in text.splitlines()[0]


def test_check_filters_by_mode(capsys):
    assert cli.main(["check", "--impl", "numpy", "--op", "dequantize", "--mode", "fp8", "-q"]) == 0
    out = capsys.readouterr().out
    assert " 0 failed" in out and "numpy" in out


def test_check_fails_when_an_implementation_declines_every_case(capsys, monkeypatch):
    import kvzoo.conformance
    from kvzoo import registry
    from kvzoo.conformance.checks import matrix

    reg = registry.Registry()
    reg.add(
        registry.Implementation(
            "refuses-all",
            "paged_attention",
            "any",
            frozenset(kvzoo.MODES),
            run=lambda p: None,
            problem_reasons=lambda p: ["refuses-all: takes nothing"],
        )
    )
    monkeypatch.setattr(kvzoo.conformance, "matrix", lambda r=None: matrix(reg))
    assert cli.main(["check", "-q"]) == 1
    # Its declarations take every case, so each refusal is a failure that names it.
    out = capsys.readouterr().out
    assert "refuses-all" in out and f"\n0 passed, {len(matrix(reg))} failed" in out


def test_readme_plan_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    plan_blocks = [b for b in blocks if "plan_step" in b]
    assert plan_blocks, "README.md shows no plan_step example"
    import kvzoo

    scope: dict = {"torch": torch, "kvzoo": kvzoo}
    exec(compile(plan_blocks[0], "README.md", "exec"), scope)
    assert tuple(scope["out"].shape) == (25, 4, 64) and bool(torch.isfinite(scope["out"]).all())


def test_readme_step_ops_example_runs_after_the_plan_example():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    plan_block = next(b for b in blocks if "plan_step" in b)
    ops_block = next(b for b in blocks if "step_plans" in b)
    import kvzoo

    scope: dict = {"torch": torch, "kvzoo": kvzoo}
    exec(compile(plan_block, "README.md", "exec"), scope)
    exec(compile(ops_block, "README.md", "exec"), scope)
    out, lse = scope["out"], scope["lse"]
    assert tuple(out.shape) == (25, 4, 64) and tuple(lse.shape) == (25, 4)
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all())


def test_list_and_check_speak_json(capsys):
    import json

    assert cli.main(["list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    names = {(i["name"], i["op"]) for i in listed["implementations"]}
    assert ("numpy", "paged_attention") in names
    assert all(i["available"] == (not i["unavailable"]) for i in listed["implementations"])
    argv = ["check", "--impl", "numpy", "--op", "dequantize", "--mode", "int8_per_token_head", "--json", "-q"]
    assert cli.main([*argv, "--seed", "12345"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["seed"] == 12345 and first["failed"] == 0 and first["passed"] > 0
    assert first["by_implementation"][0]["implementation"] == "numpy"


def test_a_mistyped_name_gets_a_suggestion(capsys):
    assert cli.main(["check", "--impl", "numbaa", "-q"]) == 2
    assert "did you mean 'numba'" in capsys.readouterr().err
    assert cli.main(["check", "--impl", "numpy", "--mode", "int8_per_tokenhead", "-q"]) == 2
    assert "did you mean 'int8_per_token_head'" in capsys.readouterr().err


def test_every_readme_python_block_runs_on_its_own(tmp_path, monkeypatch):
    """Each ```python block of the README, alone in a fresh namespace (in a scratch directory:
    some write files), as a new user pastes it."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 5
    monkeypatch.chdir(tmp_path)
    for n, block in enumerate(blocks):
        try:
            exec(compile(block, f"README.md python block {n}", "exec"), {"__name__": "__readme__"})
        except ImportError as missing:  # an optional extra (safetensors for kvzoo.distributed)
            pytest.skip(f"README block {n} needs an extra not installed here: {missing}")


def test_readme_lists_every_module_once():
    """README's "Where things live" names every module under kvzoo/, one table row each, and no
    module that is gone."""
    text = README.read_text()
    section = text[text.index("## Where things live") :]
    section = section[: section.index("\n## ", 1)]
    listed = re.findall(r"^\| `(kvzoo/[\w/]+\.py)` \|", section, flags=re.M)
    package = Path(kvzoo.__file__).resolve().parent
    modules = sorted(f"kvzoo/{p.relative_to(package).as_posix()}" for p in package.rglob("*.py"))
    assert len(listed) == len(set(listed)), f"listed twice: {sorted({m for m in listed if listed.count(m) > 1})}"
    assert sorted(listed) == modules, (
        f"missing from README: {sorted(set(modules) - set(listed))}; gone: {sorted(set(listed) - set(modules))}"
    )


@pytest.mark.parametrize(
    "argv, named", [(["--dtypes", "bfloat16,int8"], "--dtypes 'bfloat16,int8'"), (["--jobs", "0"], "--jobs 0")]
)
def test_warmup_refuses_a_bad_argument_naming_it_before_compiling(argv, named, capsys, monkeypatch):
    from kvzoo import warmup
    from kvzoo.backends import numba_cpu
    from kvzoo.cli import main

    if numba_cpu.unavailable():
        pytest.skip("numba: " + "; ".join(numba_cpu.unavailable()))
    monkeypatch.setattr(warmup, "run_every_signature", lambda **kw: pytest.fail("compiled after a bad argument"))
    assert main(["warmup", *argv]) == 2
    assert named in capsys.readouterr().err


def test_warmup_groups_cover_every_input_dtype_once():
    from kvzoo.warmup import CARRIER_GROUPS, INPUT_DTYPES

    flat = [dtype for group in CARRIER_GROUPS for dtype in group]
    assert sorted(flat) == sorted(INPUT_DTYPES)
    # One element width per group: the width is what the kernels' signatures follow.
    widths = [{torch.empty(0, dtype=getattr(torch, d)).element_size() for d in group} for group in CARRIER_GROUPS]
    assert all(len(w) == 1 for w in widths) and len({w.pop() for w in widths}) == len(CARRIER_GROUPS)
