"""Test helpers: the conformance inputs, re-exported for tests that build their own cases."""

from kvzoo.conformance.inputs import *  # noqa: F401,F403
from kvzoo.conformance.inputs import SEED, assert_same_bytes, host_bytes, random_bytes, rng_for  # noqa: F401
