"""The Numba attention's two ways of reading K/V give the same bytes.

Decode-sized items (few query rows, contiguous head dim) decode codes inside the q.k and p.v
loops; other items decode each tile into a buffer first. A cache whose head dim is strided
takes the second way on the same values, so the outputs must match exactly.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvzoo
from kvzoo.layout import allocate_separate

from support import rng_for

pytest.importorskip("numba")


def _strided_copy(a: np.ndarray) -> np.ndarray:
    """The same values as a, in memory with the head dim (last axis) not contiguous."""
    t = np.empty(a.shape[:-2] + (a.shape[-1], a.shape[-2]), a.dtype)
    view = np.swapaxes(t, -1, -2)
    view[...] = a
    return view


@pytest.mark.parametrize(
    "mode",
    [
        "int8_per_token_head",
        "fp8_per_token_head",
        "fp8_e4m3fnuz_per_token_head",
        "int4_per_token_head",
        "int4_per_token_head_norot",
        "k_int8_v_int4",
        "k_fp8_v_int4_norot",
    ],
)
@pytest.mark.parametrize("hq,hkv", [(4, 1), (8, 2), (3, 1), (8, 1)])
def test_fused_and_tile_paths_match(mode, hq, hkv):
    rng = rng_for("numba fused and tile paths", mode, hq, hkv)
    bs, d, seqs = 16, 64, 3
    per_seq = 6
    blocks = seqs * per_seq
    cache = allocate_separate(blocks, bs, hkv, d, mode, device=None)
    for a in (cache.key_cache, cache.value_cache, cache.k_scale_cache, cache.v_scale_cache):
        a.view(np.uint8)[...] = rng.integers(0, 256, a.view(np.uint8).shape, dtype=np.uint8)
    tokens = blocks * bs
    key = rng.standard_normal((tokens, hkv, d)).astype(np.float32) * 3
    value = rng.standard_normal((tokens, hkv, d)).astype(np.float32)
    key[5, 0, 7] = np.nan  # a poisoned row: shows the same way in both
    kvzoo.reshape_and_cache(
        key,
        value,
        cache.key_cache,
        cache.value_cache,
        np.arange(tokens),
        mode=mode,
        k_scale_cache=cache.k_scale_cache,
        v_scale_cache=cache.v_scale_cache,
    )
    block_tables = rng.permutation(blocks).astype(np.int32).reshape(seqs, per_seq)
    seq_lens = rng.integers(1, per_seq * bs + 1, seqs).astype(np.int32)
    qsl = np.arange(seqs + 1, dtype=np.int32)
    query = rng.standard_normal((seqs, hq, d)).astype(np.float32)
    window = int(rng.integers(1, 60)) if rng.random() < 0.5 else None
    outs = []
    for kc, vc in (
        (cache.key_cache, cache.value_cache),
        (_strided_copy(cache.key_cache), _strided_copy(cache.value_cache)),
    ):
        out = np.full((seqs, hq, d), np.nan, np.float32)
        kvzoo.paged_attention(
            query,
            kc,
            vc,
            mode=mode,
            block_tables=block_tables,
            seq_lens=seq_lens,
            query_start_loc=qsl,
            k_scale_cache=cache.k_scale_cache,
            v_scale_cache=cache.v_scale_cache,
            sliding_window=window,
            out=out,
            impl="numba",
        )
        outs.append(out)
    assert outs[0].tobytes() == outs[1].tobytes()
    assert np.isfinite(outs[0]).any()


def test_tile_products_relax_rounding_like_the_fused_ones():
    # The decoded-tile q.k and p.v are their own compiled functions (one copy of the loops, not
    # one per kind), and so are uint4's: they must carry the same flags as _scores / _accumulate,
    # no more.
    from kvzoo.backends.numba_cpu import kernels

    for scores in (kernels._scores_tile, kernels._scores_u4):
        assert scores.targetoptions["fastmath"] == kernels._scores.targetoptions["fastmath"]
    for accumulate in (kernels._accumulate_tile, kernels._accumulate_u4):
        assert accumulate.targetoptions["fastmath"] == kernels._accumulate.targetoptions["fastmath"]
