"""Test session set-up.

Without a GPU the Triton kernels run under the Triton interpreter on CPU tensors; the
variable must be set before triton decorates any kernel, hence here, before kvzoo loads.
The README's test command spreads the run over the CPUs with pytest-xdist (`-n auto`).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from support import SEED  # noqa: E402

# pytest-xdist's workers start after this module loads and inherit the environment: one seed for
# the whole run, so the header's replay line holds for every worker's failures.
os.environ.setdefault("KVZOO_SEED", str(SEED))


def pytest_report_header(config):
    return f"kvzoo: random seed {SEED} (replay with KVZOO_SEED={SEED}); TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}"
