"""The conformance suite must fail an implementation that changes a single byte.

Mutants wrap the NumPy implementation and corrupt one code, one scale bit, or one channel of
the attention output (by three times the check's tolerance); each registered in a fresh
registry must fail the same checks the real backends pass.
"""

from __future__ import annotations

import dataclasses
from unittest import mock

import numpy as np
import pytest

from kvzoo.arrays import dtype_name
from kvzoo.backends import numpy_vectorized
from kvzoo.backends.numpy_vectorized import kernels as numpy_kernels
from kvzoo.conformance import NotApplicable, matrix
from kvzoo.conformance.cases import BLOCK_HEAD_SIZES
from kvzoo.registry import Registry
from kvzoo.samples import attention_tolerance


def _reference(op: str):
    reg = Registry()
    numpy_vectorized.register(reg)
    return reg.get(op, "numpy")


def _target_slot(problem, last: bool) -> int:
    """A slot the write kept (the first or last), else slot 0: a draw with every slot negative
    (0.3^7 for 7 tokens) writes nothing, and a mutant that then changed nothing would escape."""
    slots = np.asarray(problem.slot_mapping).astype(np.int64)
    capacity = problem.key_cache.shape[0] * problem.key_cache.shape[1]
    kept = slots[(slots >= 0) & (slots < capacity)]
    return int(kept[-1 if last else 0]) if kept.size else 0


def _flip_one_code(problem):
    _reference("reshape_and_cache").run(problem)
    block, offset = divmod(_target_slot(problem, last=True), problem.key_cache.shape[1])
    problem.value_cache.view(np.uint8)[block, offset, 0, 0] ^= 0x01


def _nudge_one_scale(problem):
    _reference("reshape_and_cache").run(problem)
    if problem.k_scale_cache is not None:
        block, offset = divmod(_target_slot(problem, last=False), problem.key_cache.shape[1])
        problem.k_scale_cache.view(np.uint32)[block, offset, 0] ^= 0x1


def _perturb_attention(problem):
    """Adds three times the tolerance the check holds this output to, of each row's norm, to the
    row's channel 0: every sequence is then off by at least twice its tolerance (three, less the
    implementation's own error, within one), by construction, as long as the oracle's slack on
    fp8_dots rows stays under that margin. A factor of 1.05 on channel 0 was about
    0.05 / sqrt(D) of a row, and escaped one check in a hundred at D = 128 (tolerance 3.9e-3)."""
    reference = _reference("paged_attention")
    reference.run(problem)
    tol = attention_tolerance(reference, dtype_name(problem.out), problem.fp8_dots)
    out = problem.out.astype(np.float64)
    norms = np.linalg.norm(out, axis=-1)
    out[..., 0] += 3 * tol * np.where(norms > 0, norms, 1.0)
    problem.out[...] = out.astype(problem.out.dtype)


MUTANTS = {
    "flipped code": ("reshape_and_cache", _flip_one_code, lambda c: "-T0-" not in c.case_id),
    "scale off by one ulp": (
        "reshape_and_cache",
        _nudge_one_scale,
        lambda c: "per_token_head" in c.case_id and "-T0-" not in c.case_id,
    ),
    "attention 3x its tolerance off in one channel": ("paged_attention", _perturb_attention, lambda c: True),
}


@pytest.mark.parametrize("name", list(MUTANTS))
def test_mutant_fails_conformance(name):
    op, run, applies = MUTANTS[name]
    reg = Registry()
    reg.add(dataclasses.replace(_reference(op), name="mutant", run=run))
    checks = [c for c in matrix(reg, ops=(op,)) if applies(c)]
    assert checks
    escaped, caught = [], 0
    for check in checks[::7]:  # a spread sample keeps this fast
        try:
            check.run()
        except AssertionError:
            caught += 1
            continue
        except NotApplicable:
            continue
        escaped.append(check.id)
    assert not escaped, f"{name} passed checks it must fail: {escaped}"
    assert caught, f"{name}: no sampled check applied, so nothing was shown"


_FWHT = numpy_kernels._fwht


def _unmasked_fwht(u):
    """The rotation a backend gets by padding a head to a power of two and running one
    butterfly over it, without SPEC.md 3.4's blocks: the same as theirs for a power of two."""
    d = u.shape[-1]
    pad = np.zeros((*u.shape[:-1], (1 << (d - 1).bit_length()) - d), u.dtype)
    return _FWHT(np.concatenate([u, pad], axis=-1))[..., :d]


@pytest.mark.parametrize("op", ["reshape_and_cache", "dequantize", "paged_attention"])
def test_a_rotation_without_the_blocks_fails_every_block_case(op):
    # The block cases tell it from the rotation (each of them but the special values', whose rows
    # are mostly poisoned, zero or below the scale floor), and the power-of-two cases do not.
    def run(problem):
        with mock.patch.object(numpy_kernels, "_fwht", _unmasked_fwht):
            _reference(op).run(problem)

    reg = Registry()
    reg.add(dataclasses.replace(_reference(op), name="mutant", run=run))
    blocks = tuple(f"-D{d}-" for d in BLOCK_HEAD_SIZES)
    checks = [c for c in matrix(reg, ops=(op,)) if c.case_id.startswith(("int4_per_token_head-", "k_"))]
    block_checks = [c for c in checks if any(b in c.case_id + "-" for b in blocks) and "-specials-" not in c.case_id]
    assert block_checks
    escaped = []
    for check in block_checks:
        try:
            check.run()
        except AssertionError:
            continue
        escaped.append(check.id)
    assert not escaped, f"passed checks it must fail: {escaped}"
    for check in [c for c in checks if "-D64-" in c.case_id][:3]:
        check.run()
