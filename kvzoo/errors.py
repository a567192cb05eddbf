"""The one error kvzoo raises for bad arguments (kvzoo_spec/SPEC.md section 11)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import NoReturn


class KVZooInputError(ValueError):
    """A public call got an argument it cannot take; nothing was written."""


def fail(message: str) -> NoReturn:
    raise KVZooInputError(message)


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the nearest of choices to a mistyped name, or ''."""
    close = difflib.get_close_matches(str(name).strip().lower(), sorted(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
