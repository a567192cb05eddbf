"""A throwaway out-of-tree backend: kvzoo's NumPy implementation under another name.

Not installed: tests put this directory on sys.path, and either name the module to
`kvzoo --backend-module` or give it an entry point through a dist-info made at test time.
Its priority is above every built-in's, so selection prefers it wherever it is loaded.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from typing import Any

from kvzoo.registry import Registry

NAME = "plugin-numpy"
PRIORITY = 1000
# Calls per operation, so a test can see that selection ran this backend, not the built-in.
CALLS: Counter[str] = Counter()


def _counted(op: str, run: Callable[[Any], None]) -> Callable[[Any], None]:
    def counted_run(problem: Any) -> None:
        CALLS[op] += 1
        run(problem)

    return counted_run


def register(registry: Registry) -> None:
    # The built-in records come from a scratch registry, through the same contract.
    reference = Registry().load(["kvzoo.backends.numpy_vectorized"])
    for impl in reference.implementations():
        registry.add(dataclasses.replace(impl, name=NAME, priority=PRIORITY, run=_counted(impl.op, impl.run)))
