"""Test helpers: the conformance inputs, re-exported for tests that build their own cases."""

from kvzoo.inputs import *  # noqa: F401,F403
from kvzoo.inputs import SEED, assert_same_bytes, host_bytes, random_bytes, rng_for  # noqa: F401
