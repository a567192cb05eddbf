"""An out-of-tree backend (tests/plugin_fixture) reaches kvzoo through its plugin contract.

Installed, it is announced by an entry point of group kvzoo.backends in real distribution
metadata (a dist-info made here on sys.path); not installed, `--backend-module` names it.
Either way it must be listed, chosen when its priority is highest, and conformance-checked.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kvzoo
from kvzoo import cli, registry
from kvzoo.conformance import NotApplicable, matrix
from kvzoo.conformance.checks import runs_something

PLUGIN_DIR = Path(__file__).resolve().parent / "plugin_fixture"
PLUGIN = "kvzoo_plugin_fixture"
NAME = "plugin-numpy"


def _dist_info(root: Path, entries: dict[str, str]) -> Path:
    """Metadata of an installed distribution whose entry points are `entries` (name -> value)."""
    info = root / "kvzoo_plugin_fixture-0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvzoo-plugin-fixture\nVersion: 0.0\n")
    lines = [f"{name} = {value}" for name, value in entries.items()]
    (info / "entry_points.txt").write_text("[kvzoo.backends]\n" + "\n".join(lines) + "\n")
    return root


def _install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, entries: dict[str, str]) -> registry.Registry:
    """The default registry as a process with the fixture installed would build it."""
    monkeypatch.syspath_prepend(str(PLUGIN_DIR))
    monkeypatch.syspath_prepend(str(_dist_info(tmp_path, entries)))
    # A fresh default, put back afterwards: other tests must not meet a priority-1000 backend.
    monkeypatch.setattr(registry, "_default", None)
    return registry.default()


@pytest.fixture
def plugin_module(monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGIN_DIR))
    module = __import__(PLUGIN)
    module.CALLS.clear()
    return module


def _write(impl=None) -> np.ndarray:
    key = np.random.default_rng(0).standard_normal((3, 1, 16)).astype(np.float32)
    cache = kvzoo.PagedKVCache(1, 4, 1, 16, "int8_per_token_head", device=None)
    cache.write(key, key, np.arange(3), impl=impl)
    return cache.read("key")


@pytest.mark.parametrize("value", [PLUGIN, f"{PLUGIN}:register"], ids=["module", "callable"])
def test_installed_plugin_is_listed_and_chosen(value, tmp_path, monkeypatch, capsys, plugin_module):
    reg = _install(tmp_path, monkeypatch, {"fixture": value})
    assert not reg.import_errors, reg.import_errors
    assert {i.op for i in reg.implementations() if i.name == NAME} == set(kvzoo.registry.OPS)

    assert cli.main(["list"]) == 0
    assert any(line.startswith(NAME) for line in capsys.readouterr().out.splitlines())

    for op in kvzoo.registry.OPS:
        assert reg.candidates(op, "int8_per_token_head", "cpu")[0].name == NAME
    got = _write()  # impl=None: the registry's choice
    assert plugin_module.CALLS["reshape_and_cache"] == 1
    assert np.array_equal(got, _write(impl="numpy"))


def test_plugin_below_the_builtins_is_not_chosen(monkeypatch, plugin_module):
    monkeypatch.setattr(plugin_module, "PRIORITY", -1)
    reg = registry.Registry().load((*registry.BACKEND_MODULES, PLUGIN))
    names = [i.name for i in reg.candidates("reshape_and_cache", "int8_per_token_head", "cpu")]
    assert names[-1] == NAME and len(names) > 1


def test_broken_entry_points_are_recorded_not_raised(tmp_path, monkeypatch, capsys):
    reg = _install(
        tmp_path,
        monkeypatch,
        {
            "fixture": PLUGIN,
            "missing": "kvzoo_plugin_does_not_exist",
            "not_callable": f"{PLUGIN}:NAME",
        },
    )
    assert NAME in {i.name for i in reg.implementations()}
    assert "ModuleNotFoundError" in reg.import_errors["kvzoo_plugin_does_not_exist"]
    assert "TypeError" in reg.import_errors[f"{PLUGIN}:NAME"]
    assert cli.main(["list"]) == 0
    assert "backend kvzoo_plugin_does_not_exist failed to import" in capsys.readouterr().out


def test_installed_plugin_passes_the_conformance_matrix(tmp_path, monkeypatch, plugin_module):
    checks = [c for c in matrix(_install(tmp_path, monkeypatch, {"fixture": PLUGIN})) if c.impl.name == NAME]
    assert {c.op for c in checks} == {"reshape_and_cache", "dequantize", "paged_attention", "golden"}
    for op in ("reshape_and_cache", "dequantize", "paged_attention"):
        ran, declined = runs_something([c for c in checks if c.op == op])
        assert ran, declined[:2]
    for check in checks:
        try:
            check.run()
        except NotApplicable:
            pass
    assert plugin_module.CALLS["paged_attention"] > 0


def test_entry_point_found_by_a_fresh_process(tmp_path):
    """No monkeypatching: real metadata on PYTHONPATH, the `kvzoo` command as a user runs it."""
    path = os.pathsep.join([str(_dist_info(tmp_path, {"fixture": PLUGIN})), str(PLUGIN_DIR)])
    env = {**os.environ, "PYTHONPATH": path + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        [sys.executable, "-m", "kvzoo.cli", "list"], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert any(line.startswith(NAME) for line in done.stdout.splitlines()), done.stdout


def test_backend_module_is_listed_and_checked_without_installing(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGIN_DIR))
    assert cli.main(["list", "--backend-module", PLUGIN]) == 0
    assert any(line.startswith(NAME) for line in capsys.readouterr().out.splitlines())

    # Repeatable; naming a built-in module again is harmless.
    assert (
        cli.main(
            [
                "check",
                "--backend-module",
                PLUGIN,
                "--backend-module",
                "kvzoo.backends.numpy_vectorized",
                "--impl",
                NAME,
                "--op",
                "reshape_and_cache",
                "-q",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert NAME in out and " 0 failed" in out
    # It was loaded for that command only.
    assert NAME not in {i.name for i in registry.default().implementations()}
    assert cli.main(["check", "--impl", NAME, "-q"]) == 2


@pytest.mark.parametrize("command", ["list", "check"])
def test_backend_module_that_fails_to_load_exits_2_naming_it(command, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGIN_DIR))
    assert cli.main([command, "--backend-module", PLUGIN, "--backend-module", "kvzoo_plugin_nosuch"]) == 2
    err = capsys.readouterr().err
    assert "--backend-module kvzoo_plugin_nosuch could not be loaded" in err
    assert f"--backend-module {PLUGIN} " not in err
