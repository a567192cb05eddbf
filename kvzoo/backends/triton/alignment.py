"""What Triton cannot see of a cache's alignment (a plain module: importable without triton).

Triton marks an integer argument divisible by 16 or not at all, so the inline page's rows
(head_size + 4 bytes apart) look byte-aligned to it, and every load and store of them goes one
byte at a time. Kernels take the true alignment as a constexpr and assert it with
tl.multiple_of on their row offsets.
"""

from __future__ import annotations

from typing import Any


def row_align(k: Any, v: Any) -> int:
    """The largest power of two, up to 16, dividing the page, token and head strides of K and V
    (in elements): what every row offset is a multiple of."""
    align = 16
    for stride in (*k.stride()[:3], *v.stride()[:3]):
        while stride % align:
            align //= 2
    return align
