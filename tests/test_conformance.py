"""The conformance suite (kvzoo/conformance): every registered implementation x every case.

Implementations come from the registry at collection time, so registering a backend puts it
under this suite with no test edits. `kvzoo check` runs the same matrix outside pytest.
"""

import pytest

from kvzoo import registry
from kvzoo.conformance import NotApplicable, matrix
from kvzoo.conformance.checks import GOLDEN_FILES, runs_something
from kvzoo.modes import MODES

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


IMPL_OPS = sorted({(c.impl.name, c.op) for c in CHECKS if c.op != "golden"})


@pytest.mark.parametrize("impl_name, op", IMPL_OPS, ids=[f"{i}-{o}" for i, o in IMPL_OPS])
def test_every_available_implementation_passes_a_check(impl_name, op):
    checks = [c for c in CHECKS if c.impl.name == impl_name and c.op == op]
    if checks[0].impl.unavailable():
        pytest.skip("; ".join(checks[0].impl.unavailable()))
    ran, declined = runs_something(checks)
    assert ran, f"{impl_name} declined all {len(checks)} {op} checks, e.g. {declined[:2]}"


def test_a_backend_that_declines_everything_fails_the_suite():
    reg = registry.Registry()
    reg.add(registry.Implementation(
        "refuses-all", "paged_attention", "any", frozenset(MODES), run=lambda p: None,
        problem_reasons=lambda p: ["refuses-all: takes nothing"],
    ))
    checks = [c for c in matrix(reg) if c.op == "paged_attention"]
    ran, declined = runs_something(checks)
    assert not ran and len(declined) == len(checks) and "refuses-all" in declined[0]
