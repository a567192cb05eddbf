"""kvzoo.memory: which arrays share bytes, decided from addresses and strides alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvzoo
from kvzoo import memory


def test_inline_page_views_do_not_overlap_but_share_one_extent():
    t = kvzoo.allocate_inline(5, 4, 3, 8, "int8_per_token_head")
    views = {"k": t.key_cache, "v": t.value_cache, "ks": t.k_scale_cache, "vs": t.v_scale_cache}
    for a in views:
        assert not memory.self_overlap(views[a]), a
        for b in views:
            if a != b:
                ea, eb = memory.byte_extent(views[a]), memory.byte_extent(views[b])
                assert ea[0] < eb[1] and eb[0] < ea[1], "the test needs interleaved views"
                assert not memory.overlap(views[a], views[b]), (a, b)


def test_overlap_is_found_at_one_shared_byte():
    buf = torch.zeros(64, dtype=torch.uint8)
    codes = buf[:32]
    for start in range(0, 32):
        assert memory.overlap(codes, buf[start : start + 4]), start
        assert memory.overlap(codes, buf[start::32]), start
    assert memory.overlap(codes, buf[28:32].view(torch.float32))
    assert not memory.overlap(codes, buf[32:36].view(torch.float32))
    # Every other byte: two interleaved views share nothing; shifted by 2 they share all.
    assert not memory.overlap(buf[0::2], buf[1::2])
    assert memory.overlap(buf[0::2], buf[2::2])


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.zeros(1, 4).expand(3, 4),
        lambda: torch.zeros(10).as_strided((3, 4), (2, 1)),
        lambda: np.broadcast_to(np.zeros(4, np.float32), (2, 4)),
    ],
)
def test_self_overlap(make):
    assert memory.self_overlap(make())


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.zeros(3, 4),
        lambda: torch.zeros(4, 3).T,
        lambda: torch.zeros(6, 8)[::2, 1:5],
        lambda: torch.zeros(1, 4).expand(1, 4),  # a stride-0 dimension of one element is fine
        lambda: np.zeros((3, 4))[:, ::-1],
    ],
)
def test_no_self_overlap(make):
    assert not memory.self_overlap(make())


def test_host_and_device_addresses_never_overlap():
    a = torch.zeros(4)
    meta = torch.empty(4, device="meta")
    assert not memory.overlap(a, meta)
    assert memory.byte_extent(torch.zeros(0, 3)) is None
