"""The options the Triton attention takes with a call (`impl.with_options(...)`), in a module of
their own: the registration (attention_ops.py) and both kernel families (attention_kernels.py,
int4_attention.py) read them, and none of those imports another for them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ...errors import fail


@dataclass(frozen=True)
class TritonAttentionOptions:
    """Choices the Triton attention takes with a call: `impl.with_options(prefill="direct")`.

    prefill: "auto" stages a quantized prefill through an fp16 workspace where that measured
    faster (staging.py), "direct" always tiles over the codes themselves.
    stage_max_bytes: the largest workspace a call may allocate; above it prefill stays direct.
    workspace_fill: a value the staged workspace is filled with before the gather (a test of
    what the gather writes and what the kernel reads); None leaves it uninitialised.
    workspace: a contiguous 1-D uint8 CUDA tensor every call carves its own arrays from (split
    partials, staged prefill's workspace; scratch.py) instead of allocating them, of at least
    `workspace_bytes(problem)` bytes (a call refuses a smaller one before it writes anything).
    It serves one call at a time: calls that may overlap (other streams) need their own.
    """

    prefill: Literal["auto", "direct"] = "auto"
    stage_max_bytes: int = 1 << 30
    workspace_fill: float | None = None
    # Compared by identity: a tensor's == is elementwise.
    workspace: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        # kvzoo.validate imports kvzoo.arrays (torch): not on registering, which `kvzoo list` does.
        from ...validate import int_scalar, require_workspace

        if self.prefill not in ("auto", "direct"):
            fail(f"prefill: expected 'auto' or 'direct', got {self.prefill!r}")
        int_scalar("stage_max_bytes", self.stage_max_bytes, -1)
        if self.workspace is not None:
            require_workspace(self.workspace)
