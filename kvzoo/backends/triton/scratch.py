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

# Each array starts this many bytes apart in the buffer, a multiple of what the buffer's own
# start must be (START_ALIGN: the kernels' 16-byte vector accesses; torch's CUDA allocations
# start at multiples of 512, its CPU ones of 64).
ALIGN = 256
START_ALIGN = 16

Need = tuple[tuple[int, ...], torch.dtype]


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def bytes_needed(arrays: Iterable[Need]) -> int:
    """Bytes of a buffer that holds `arrays` ((shape, dtype) each), each at an aligned offset."""
    return sum(_aligned(math.prod(shape) * dtype.itemsize) for shape, dtype in arrays)


def check_buffer(workspace: torch.Tensor) -> None:
    """A caller's workspace: a contiguous 1-D uint8 torch tensor starting at a START_ALIGN boundary."""
    if not isinstance(workspace, torch.Tensor):
        fail(f"workspace: expected a torch.Tensor of dtype uint8, got {type(workspace).__name__}")
    if workspace.dtype != torch.uint8 or workspace.dim() != 1 or not workspace.is_contiguous():
        fail(
            f"workspace: expected a contiguous 1-D uint8 tensor, got dtype {workspace.dtype} "
            f"shape {tuple(workspace.shape)} strides {workspace.stride()}"
        )
    if workspace.data_ptr() % START_ALIGN:
        fail(f"workspace: must start at a multiple of {START_ALIGN} bytes (torch's allocations do)")
    if workspace.requires_grad:
        fail("workspace: requires_grad is set; the kernels write it")


class Scratch:
    """Where one call's own arrays come from, in the order `take` is asked for them."""

    def __init__(self, device: torch.device, workspace: torch.Tensor | None, arrays: Sequence[Need], problem=None):
        # Checked before the call launches anything: a refused call writes nothing.
        need = bytes_needed(arrays)
        if workspace is not None and need:
            check_buffer(workspace)
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


__all__ = ["ALIGN", "Scratch", "bytes_needed", "check_buffer"]
