"""The conformance suite as a library: cases, inputs and checks shared by tests/ and `kvzoo check`."""

from .checks import Check, NotApplicable, matrix
from .inputs import SEED

__all__ = ["Check", "NotApplicable", "SEED", "matrix"]
