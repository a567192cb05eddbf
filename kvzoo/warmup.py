"""`kvzoo warmup`: every Numba kernel once per mode and input dtype on tiny inputs, through the
public API, so that each compiled signature is on disk before a user's first real call. Here,
above the API it calls, not in the backend the API calls."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from . import api
from .arrays import numpy_dtype
from .layout import allocate_separate
from .modes import MODES

_BLOCKS, _BLOCK_SIZE, _HEADS, _HEAD_SIZE, _TOKENS = 2, 4, 1, 8, 3
INPUT_DTYPES = ("bfloat16", "float16", "float32")
# The modes the compiled backend takes: every one. A split mode (keys and values in two formats)
# pairs two sides whose row functions the one-sided modes compile; its write and attention
# kernels are signatures of their own.
COMPILED_MODES = tuple(MODES.values())
STEPS = len(COMPILED_MODES) * len(INPUT_DTYPES)
# The kernels take an input's bits through one unsigned carrier per element width, so the dtypes
# of one width share every compiled signature and those of another share none: each group
# compiles apart from the others (in a process of its own) without repeating their work.
CARRIER_GROUPS = (("bfloat16", "float16"), ("float32",))


def run_every_signature(
    impl: str = "numba", progress: Callable[[str], None] | None = None, dtypes: tuple[str, ...] = INPUT_DTYPES
) -> int:
    """The number of calls made (each op x mode x input dtype, of the given input dtypes).
    progress, if given, is called with the mode and dtype about to compile (a first compile
    takes minutes: say what is going on)."""
    rng = np.random.default_rng(0)
    calls = 0
    for mode in COMPILED_MODES:
        static = 0.5 if mode.per_tensor else None
        for dtype in dtypes:
            if progress is not None:
                progress(f"{mode.name} {dtype}")
            rows = rng.standard_normal((_TOKENS, _HEADS, _HEAD_SIZE)).astype(np.float32).astype(numpy_dtype(dtype))
            t = allocate_separate(_BLOCKS, _BLOCK_SIZE, _HEADS, _HEAD_SIZE, mode, model_dtype=dtype, device=None)
            api.reshape_and_cache(
                rows,
                rows.copy(),
                t.key_cache,
                t.value_cache,
                np.arange(_TOKENS),
                mode=mode,
                impl=impl,
                k_scale_cache=t.k_scale_cache,
                v_scale_cache=t.v_scale_cache,
                k_scale=static,
                v_scale=static,
            )
            # dequantize reads one cache in one side's mode (a split mode's keys: its key side's).
            api.dequantize(t.key_cache, t.k_scale_cache, mode=mode.key_side, scale=static, impl=impl)
            api.paged_attention(
                rows,
                t.key_cache,
                t.value_cache,
                mode=mode,
                impl=impl,
                block_tables=np.array([[0]], np.int32),
                seq_lens=np.array([_TOKENS], np.int32),
                query_start_loc=np.array([0, _TOKENS], np.int32),
                k_scale_cache=t.k_scale_cache,
                v_scale_cache=t.v_scale_cache,
                k_scale=static,
                v_scale=static,
            )
            calls += 3
    return calls
