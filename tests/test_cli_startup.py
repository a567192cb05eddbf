"""A lazy `import kvzoo` (issue 39): the package, `kvzoo --help` and `kvzoo list` import none of
torch, numba or triton; the torch ops register where torch is imported; every public name
resolves as before. Asserted on what gets imported, not on wall time (noisy on shared CI
machines): `kvzoo --help` and `kvzoo list` took 2.8-3.2 s before, 0.2-0.3 s after."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import kvzoo

HEAVY = ("torch", "numba", "triton", "ml_dtypes")  # ml_dtypes: most of a second to import here


def _run(code: str) -> str:
    # Without TRITON_INTERPRET (conftest sets it on machines without a GPU): under the
    # interpreter Triton is available, which only torch can confirm.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


_LOADED = f"import json, sys; print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"


def test_import_kvzoo_imports_neither_torch_nor_numba_nor_triton():
    out = _run(f"import kvzoo\n{_LOADED}")
    assert json.loads(out.splitlines()[-1]) == []


def test_torch_first_then_kvzoo_registers_the_ops_on_import():
    out = _run(
        "import sys, torch, kvzoo\n"
        "assert 'kvzoo.torch_ops' in sys.modules\n"
        "print(torch.ops.kvzoo.paged_attention.default, torch.ops.kvzoo.step_write.default)\n"
    )
    assert "kvzoo.paged_attention.default" in out


def test_kvzoo_first_then_torch_registers_the_ops_when_a_name_resolves():
    out = _run(
        "import sys, kvzoo, torch\n"
        "assert 'kvzoo.torch_ops' not in sys.modules\n"
        "kvzoo.paged_attention\n"
        "print(torch.ops.kvzoo.reshape_and_cache.default, torch.ops.kvzoo.step_attention.default)\n"
    )
    assert "kvzoo.reshape_and_cache.default" in out


def test_every_public_name_resolves_and_dir_lists_them():
    assert set(kvzoo.__all__) <= set(dir(kvzoo))
    for name in kvzoo.__all__:
        assert getattr(kvzoo, name) is not None, name
    namespace: dict[str, object] = {}
    exec("from kvzoo import *", namespace)
    assert set(kvzoo.__all__) <= set(namespace)
    assert kvzoo.registry.default() is kvzoo.registry.default()
    assert kvzoo.layout.allocate_separate is kvzoo.allocate_separate  # a submodule, as before
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        kvzoo.no_such_name  # noqa: B018


def _cli(argv: list[str]) -> tuple[str, list[str]]:
    """stdout of `kvzoo ARGV` run in a fresh interpreter, and the heavy modules it imported."""
    out = _run(
        "import contextlib, io, json, sys\n"
        "from kvzoo.cli import main\n"
        "buf = io.StringIO()\n"
        "with contextlib.redirect_stdout(buf):\n"
        "    try:\n"
        f"        main({argv!r})\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print(json.dumps(buf.getvalue()))\n" + _LOADED
    )
    *_, text, loaded = out.splitlines()
    return json.loads(text), json.loads(loaded)


def _gpu_probe_defers() -> bool:
    """Whether a GPU is here, so `kvzoo list` asks torch whether Triton can use it."""
    out = _run(
        "from kvzoo import registry\n"
        "print(any(i.probe is not None and i.probe() is None for i in registry.implementations()))\n"
    )
    return out.split()[-1] == "True"


def test_help_imports_neither_torch_nor_numba_nor_triton():
    text, loaded = _cli(["--help"])
    assert "usage: kvzoo" in text and loaded == []


@pytest.mark.parametrize("argv", [["list"], ["list", "--json"]])
def test_list_imports_neither_torch_nor_numba_nor_triton(argv):
    if _gpu_probe_defers():
        pytest.skip("a GPU is here: kvzoo list asks torch whether Triton can use it")
    text, loaded = _cli(argv)
    assert "numba" in text and "triton-cuda" in text
    assert loaded == []


def test_list_shows_what_selection_sees():
    """The probe (`kvzoo list`, no torch) and unavailable() (selection) agree, per implementation."""
    out = _run(
        "import json\n"
        "from kvzoo import registry\n"
        "impls = registry.implementations()\n"
        "listed = [i.listed_unavailable() for i in impls]\n"
        "full = [i.unavailable() for i in impls]\n"
        "print(json.dumps([listed, full]))\n"
    )
    listed, full = json.loads(out.splitlines()[-1])
    assert listed == full


def test_the_probe_says_a_missing_package_as_selection_does():
    out = _run(
        "import json, sys; sys.modules['triton'] = None\n"
        "from kvzoo import registry\n"
        "impls = [i for i in registry.implementations() if i.probe is not None]\n"
        "listed = [i.listed_unavailable() for i in impls]\n"
        "assert 'torch' not in sys.modules\n"
        "print(json.dumps([listed, [i.unavailable() for i in impls]]))\n"
    )
    listed, full = json.loads(out.splitlines()[-1])
    assert listed == full and all("triton is not installed" in w for why in listed for w in why)


def test_each_public_name_but_registry_has_its_module_in_the_lazy_table():
    assert set(kvzoo._EXPORTS) | {"registry"} == set(kvzoo.__all__)
    for name, module in kvzoo._EXPORTS.items():
        assert getattr(sys.modules[f"kvzoo.{module}"], name) is getattr(kvzoo, name), name
