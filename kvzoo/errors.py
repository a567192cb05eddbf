"""The one error kvzoo raises for bad arguments (kvzoo_spec/SPEC.md section 11)."""

from __future__ import annotations


class KVZooInputError(ValueError):
    """A public call got an argument it cannot take; nothing was written."""


def fail(message: str) -> None:
    raise KVZooInputError(message)
