"""Test session set-up.

Without a GPU the Triton kernels run under the Triton interpreter on CPU tensors; the
variable must be set before triton decorates any kernel, hence here, before kvzoo loads.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from support import SEED  # noqa: E402


def pytest_report_header(config):
    return f"kvzoo: random seed {SEED} (replay with KVZOO_SEED={SEED}); TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}"
