"""The conformance suite as a library: cases, inputs and checks shared by tests/ and `kvzoo check`."""

from ..inputs import SEED
from .checks import Check, NotApplicable, matrix

__all__ = ["Check", "NotApplicable", "SEED", "matrix"]
