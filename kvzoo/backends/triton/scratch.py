"""The arrays an attention call uses for itself: split-KV partials and staged prefill's
workspace. By default each call takes them from torch's stream-ordered allocator (so calls on
different streams never share them); a caller that gives a byte buffer once
(TritonAttentionOptions.workspace, or kvzoo.plan_step(workspace=...)) has every call carve them
from it instead: no allocation per call, memory the engine sized and placed. Such a buffer
serves one call at a time, so calls that may run concurrently (other streams) need their own.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from ... import memory
from ...errors import fail
from ...validate import require_workspace

# Each array starts this many bytes apart in the buffer, a multiple of what the buffer's own
# start must be (validate.WORKSPACE_ALIGN).
ALIGN = 256

Need = tuple[tuple[int, ...], torch.dtype]


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def bytes_needed(arrays: Iterable[Need]) -> int:
    """Bytes of a buffer that holds `arrays` ((shape, dtype) each), each at an aligned offset."""
    return sum(_aligned(math.prod(shape) * dtype.itemsize) for shape, dtype in arrays)


class Scratch:
    """Where one call's own arrays come from, in the order `take` is asked for them."""

    def __init__(self, device: torch.device, workspace: torch.Tensor | None, arrays: Sequence[Need], problem=None):
        # Checked before the call launches anything: a refused call writes nothing.
        need = bytes_needed(arrays)
        if workspace is not None and need:
            require_workspace(workspace)
            if workspace.device != device:
                fail(f"workspace: on {workspace.device}, the call's tensors are on {device}")
            if workspace.numel() < need:
                fail(f"workspace: this call needs {need} bytes, the buffer holds {workspace.numel()}")
            if problem is not None:
                memory.refuse_shared("workspace", workspace, problem)
        self.device, self.workspace, self.used = device, workspace, 0

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, fill: float | None = None) -> torch.Tensor:
        if self.workspace is None:
            out = torch.empty(shape, dtype=dtype, device=self.device)
        else:
            nbytes = math.prod(shape) * dtype.itemsize
            start, self.used = self.used, self.used + _aligned(nbytes)
            out = self.workspace[start : start + nbytes].view(dtype).view(shape)
        if fill is not None:
            # TritonAttentionOptions.workspace_fill poisons what a call takes, so a test can see
            # what the kernels write and what they read.
            out.fill_(fill)
        return out


__all__ = ["ALIGN", "Scratch", "bytes_needed"]
