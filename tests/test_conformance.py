"""The conformance suite (kvzoo/conformance): every registered implementation x every case.

Implementations come from the registry at collection time, so registering a backend puts it
under this suite with no test edits. `kvzoo check` runs the same matrix outside pytest.
"""

import pytest

from kvzoo.conformance import NotApplicable, matrix
from kvzoo.conformance.checks import GOLDEN_FILES

CHECKS = matrix()


def test_matrix_covers_every_operation():
    assert {c.op for c in CHECKS} == {"reshape_and_cache", "dequantize", "paged_attention", "golden"}
    kinds = {p.name.split("-")[0] for p in GOLDEN_FILES}
    assert kinds == {"rows", "cache", "inline"} and len(GOLDEN_FILES) >= 30


@pytest.mark.parametrize("check", [pytest.param(c, id=f"{c.op}-{c.id}") for c in CHECKS])
def test_conformance(check):
    try:
        check.run()
    except NotApplicable as why:
        pytest.skip(str(why))
