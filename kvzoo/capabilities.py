"""What an implementation declares it takes, and what a call asks for.

Each Implementation carries a Capabilities record. `Implementation.supports()` compares it with
what a problem requires (`required`), and the conformance suite compares it with what a case
requires before running it: a case outside the declaration is skipped with the reason, a
refusal of a case inside it is a failure. `problem_reasons` is left for what truly depends on
the call (a NumPy view whose strides are not a multiple of its itemsize, say).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# Options a call may ask for, and the operations that have them.
OPTIONS: dict[str, tuple[str, ...]] = {
    "trunc_rounding": ("reshape_and_cache",),  # rounding="trunc" (int8 modes)
    "inline_layout": ("reshape_and_cache", "dequantize", "paged_attention"),  # codes and scales in one page buffer
    "quantize_query": ("paged_attention",),
    "fp8_dots": ("paged_attention",),  # both dot products on fp8 operands (SPEC.md section 8.3)
    "batch_invariant": ("paged_attention",),
    "sinks": ("paged_attention",),
    "softcap": ("paged_attention",),
    "sliding_window": ("paged_attention",),
    "return_lse": ("paged_attention",),  # writes the rows' log-sum-exp too (SPEC.md section 8.2)
}
ALL_OPTIONS = frozenset(OPTIONS)
# Options that add an output are declared explicitly, never by default: a backend written
# before one existed would otherwise be chosen for it and leave that output unwritten.
OPT_IN_OPTIONS = frozenset({"return_lse"})
DEFAULT_OPTIONS = ALL_OPTIONS - OPT_IN_OPTIONS
INPUT_DTYPES = frozenset({"bfloat16", "float16", "float32"})


@dataclass(frozen=True)
class Capabilities:
    """What one implementation takes beyond its modes and devices (Implementation fields)."""

    # Default: every option but the opt-in ones (OPT_IN_OPTIONS), which a backend names itself.
    options: frozenset[str] = DEFAULT_OPTIONS
    # Largest head_size it takes; None: any the API accepts.
    max_head_size: int | None = None
    # Dtypes of K/V rows (write) and of the query (attention).
    input_dtypes: frozenset[str] = INPUT_DTYPES
    # The backend's table of code formats: kvzoo.formats name -> its own code for it (shown
    # by tests/test_formats.py). Empty: not declared (a third-party backend may leave it).
    formats: Mapping[str, object] = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        unknown = set(self.options) - ALL_OPTIONS
        if unknown:
            raise ValueError(f"options: unknown {sorted(unknown)}; known: {sorted(ALL_OPTIONS)}")

    def reasons(self, name: str, need: Requirements) -> list[str]:
        """Why an implementation declaring this cannot take what `need` asks; [] when it can."""
        why = [f"{name}: does not take {opt}" for opt in sorted(need.options - self.options)]
        if self.max_head_size is not None and need.head_size > self.max_head_size:
            why.append(f"{name}: head_size {need.head_size} is over its largest, {self.max_head_size}")
        if need.input_dtype is not None and need.input_dtype not in self.input_dtypes:
            why.append(f"{name}: input dtype {need.input_dtype} is not one of {sorted(self.input_dtypes)}")
        return why


@dataclass(frozen=True)
class Requirements:
    """What one call (or one conformance case) asks of an implementation."""

    head_size: int
    input_dtype: str | None = None
    options: frozenset[str] = field(default_factory=frozenset)


def shares_buffer(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return False
    # kvzoo.arrays (torch, ml_dtypes) on first use: the registry, and `kvzoo list`, import this module.
    from .arrays import is_torch

    if is_torch(a):
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()

    def root(x: Any) -> Any:
        while getattr(x, "base", None) is not None:
            x = x.base
        return x

    return root(a) is root(b)


# Options a call asks for without a field of that name: how to tell them from its record. Any
# other option is the record's field of its name, asked for when it is set (not None, not False):
# a new option is a record field (kvzoo.problem) and its name in OPTIONS.
DERIVED: dict[str, Any] = {
    "trunc_rounding": lambda p: getattr(p, "rounding", "nearest") == "trunc",
    "inline_layout": lambda p: (
        shares_buffer(p.key_cache, getattr(p, "k_scale_cache", None))
        if hasattr(p, "key_cache")
        else shares_buffer(getattr(p, "cache", None), getattr(p, "scale_cache", None))
    ),
    "return_lse": lambda p: getattr(p, "lse", None) is not None,
}


def required(problem: Any) -> Requirements:
    """The Requirements of a checked record (kvzoo.problem): the options its fields ask for."""
    from .arrays import dtype_name

    options = set()
    for name in OPTIONS:
        rule = DERIVED.get(name)
        if rule is not None:
            if rule(problem):
                options.add(name)
        else:
            value = getattr(problem, name, None)
            if value is not None and value is not False:
                options.add(name)
    if hasattr(problem, "query"):
        input_dtype = dtype_name(problem.query)
    elif hasattr(problem, "key"):
        input_dtype = dtype_name(problem.key)
    else:
        input_dtype = None
    return Requirements(head_size=problem.head_size, input_dtype=input_dtype, options=frozenset(options))
