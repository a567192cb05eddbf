"""The conformance suite (kvzoo/conformance): every registered implementation x every case.

Implementations come from the registry at collection time, so registering a backend puts it
under this suite with no test edits. `kvzoo check` runs the same matrix outside pytest.
"""

import pytest

from kvzoo import registry
from kvzoo.capabilities import Capabilities
from kvzoo.conformance import NotApplicable, matrix
from kvzoo.conformance.cases import attention_cases, dequant_cases, write_cases
from kvzoo.conformance.checks import GOLDEN_FILES, declared_reasons, runs_something
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
    """Its declarations take every case, so each refusal is a failure naming it, not a skip."""
    reg = registry.Registry()
    reg.add(
        registry.Implementation(
            "refuses-all",
            "paged_attention",
            "any",
            frozenset(MODES),
            run=lambda p: None,
            problem_reasons=lambda p: ["refuses-all: takes nothing"],
        )
    )
    checks = [c for c in matrix(reg) if c.op == "paged_attention"]
    assert checks
    for check in checks[:8]:
        with pytest.raises(AssertionError, match="refuses-all declares it takes this case but refused"):
            check.run()


def test_a_backend_declaring_nothing_it_can_run_fails_the_every_impl_check():
    reg = registry.Registry()
    reg.add(
        registry.Implementation(
            "declares-no-options",
            "paged_attention",
            "any",
            frozenset({"int8_per_token_head"}),
            run=lambda p: None,
            capabilities=Capabilities(options=frozenset(), max_head_size=1),
        )
    )
    checks = [c for c in matrix(reg) if c.op == "paged_attention"]
    ran, declined = runs_something(checks)
    assert not ran and len(declined) == len(checks)
    assert any("head_size 64 is over its largest, 1" in d for d in declined)


# Cases the built-in backends leave out by declaration, and why; any other declared skip of an
# available implementation (or one of these disappearing) fails here.
_D512 = ("head_size 512 is over its largest", lambda case_id: "-D512-" in case_id)
_FP8_DOTS = ("does not take fp8_dots", lambda case_id: "fp8dots" in case_id)
EXPECTED_DECLINES = {
    ("numba", "paged_attention"): [("does not take quantize_query", lambda case_id: "qint8" in case_id), _FP8_DOTS],
    # int4 takes head sizes up to 512; the Triton attention tiles up to 256. fp8_dots is not
    # trusted to ROCm yet (attention_ops._UNTRIED_OPTIONS).
    ("triton-cuda", "paged_attention"): [_D512],
    ("triton-rocm", "paged_attention"): [_D512, _FP8_DOTS],
}


@pytest.mark.parametrize("impl_name, op", IMPL_OPS, ids=[f"{i}-{o}" for i, o in IMPL_OPS])
def test_declared_skips_are_exactly_the_expected_ones(impl_name, op):
    impl = registry.default().get(op, impl_name)
    if impl.unavailable():
        pytest.skip("; ".join(impl.unavailable()))
    declines = EXPECTED_DECLINES.get((impl_name, op), [])
    cases = {"reshape_and_cache": write_cases, "dequantize": dequant_cases, "paged_attention": attention_cases}[op]()
    for case in cases:
        why = declared_reasons(impl, case.mode, case.requirements())
        if case.mode not in impl.modes:
            continue  # a mode the platform has no format for (formats test covers the table)
        reasons = [reason for reason, expected in declines if expected(case.id)]
        if reasons:
            assert why and all(any(r in w for w in why) for r in reasons), (case.id, why)
        else:
            assert not why, (case.id, why)
