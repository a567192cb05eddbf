"""Test session set-up.

Without a GPU the Triton kernels run under the Triton interpreter on CPU tensors; the
variable must be set before triton decorates any kernel, hence here, before kvzoo loads.
The README's test command spreads the run over the CPUs with pytest-xdist (`-n auto`).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from support import SEED  # noqa: E402

# pytest-xdist's workers start after this module loads and inherit the environment: one seed for
# the whole run, so the header's replay line holds for every worker's failures.
os.environ.setdefault("KVZOO_SEED", str(SEED))


def pytest_configure(config):
    # xdist's workers compile the numba kernels each time a test first needs one, both workers
    # the same ones at once: on a clean clone that is minutes of the run. The controller compiles
    # them first instead, each input-dtype width in its own process (`kvzoo warmup -j`), so the
    # workers load every signature the warmup covers from numba's disk cache.
    workers = getattr(config.option, "numprocesses", None) or 0
    if hasattr(config, "workerinput") or workers < 2 or os.environ.get("KVZOO_DISABLE_NUMBA"):
        return
    from kvzoo.backends import numba_cpu

    if numba_cpu.unavailable():
        return
    import subprocess
    import sys

    subprocess.run([sys.executable, "-m", "kvzoo.cli", "warmup", "--jobs", str(workers)], check=True)


def pytest_report_header(config):
    return f"kvzoo: random seed {SEED} (replay with KVZOO_SEED={SEED}); TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}"


# Under the interpreter both Triton platforms run the same kernel source on the CPU; what is
# triton-rocm's own is its format table (e4m3fnuz) and the tile tables its fp8 cases reach. The
# default run keeps those and the every-implementation check, and leaves the cases triton-cuda
# already runs through the same kernels to --all-platforms (about 1,070 cases, a fifth of the run).
ALWAYS_RUN = {"test_every_available_implementation_passes_a_check"}


# Likewise a long-sequence Triton case (the split decode, the long prefill: the interpreter's
# slowest, 2-3 s each) whose float32 twin runs leaves its bfloat16 twin to --all-platforms: the
# same kernel on the same lengths, the bfloat16 loads running in every other case. Not mode
# "none", whose cache is stored in the query's dtype (a bfloat16 cache is its own case). About
# 25 cases, 80 s of one core: test_attention_extremes' and one fp8-dots conformance case.
def pytest_addoption(parser):
    parser.addoption(
        "--all-platforms",
        action="store_true",
        help="under the Triton interpreter, also run triton-rocm's cases in formats triton-cuda shares, "
        "and the bfloat16 twins of the long-sequence Triton cases",
    )


def _interpreted_twin(item, own_modes: tuple[str, ...]) -> bool:
    ident = getattr(getattr(item, "callspec", None), "id", "")
    return (
        "triton-rocm" in ident and item.originalname not in ALWAYS_RUN and not any(mode in ident for mode in own_modes)
    )


def _test_of(item) -> tuple[str, str]:
    """(the test function's node id, the parameters' id)."""
    return item.nodeid.split("[")[0], getattr(getattr(item, "callspec", None), "id", "")


def _long_bfloat16_twin(item, idents: set[tuple[str, str]]) -> bool:
    test, ident = _test_of(item)
    return (
        "triton" in ident
        and "-long-" in f"-{ident}-"
        and "bfloat16" in ident
        and "-none-" not in f"-{ident}-"
        and (test, ident.replace("bfloat16", "float32")) in idents
    )


# Last: after -k, -m and --deselect, so a twin is left out only where its float32 twin still runs.
@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    if config.getoption("--all-platforms") or os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return
    from kvzoo.backends.triton.formats import PLATFORM_FORMATS
    from kvzoo.modes import MODES

    own_formats = PLATFORM_FORMATS["rocm"] - PLATFORM_FORMATS["cuda"]
    own_modes = tuple(m.name for m in MODES.values() if m.format is not None and m.format.name in own_formats)
    assert own_modes, "triton-rocm has no format of its own any more: revisit the twin rule"
    idents = {_test_of(item) for item in items}
    kept, twins = [], []
    for item in items:
        twin = _interpreted_twin(item, own_modes) or _long_bfloat16_twin(item, idents)
        (twins if twin else kept).append(item)
    if twins:
        config.hook.pytest_deselected(items=twins)
        items[:] = kept
