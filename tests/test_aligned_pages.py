"""Aligned inline pages (kvzoo.layout, row_align): the row sizes, what is refused, and that no
implementation writes a padded row's padding (the conformance suite checks the bytes)."""

import numpy as np
import pytest
import torch

import kvzoo
from kvzoo import registry
from kvzoo.inputs import device_for
from kvzoo.layout import inline_row_bytes, inline_views

from support import assert_same_bytes, host_bytes, rng_for


@pytest.mark.parametrize(
    "head_size, row_align, row",
    [(128, None, 132), (128, 16, 144), (128, "pow2", 256), (128, 64, 192), (64, 16, 80), (64, "pow2", 128)]
    + [(80, 16, 96), (96, "pow2", 128), (4, "pow2", 16), (12, 16, 16), (256, "pow2", 512)],
)
def test_row_bytes(head_size, row_align, row):
    assert inline_row_bytes(head_size, row_align) == row
    t = kvzoo.allocate_inline(2, 4, 3, head_size, "int8_per_token_head", device=None, row_align=row_align)
    assert t.buffer.shape == (2, 2, 4, 3, row)
    assert t.key_cache.shape == (2, 4, 3, head_size) and t.k_scale_cache.shape == (2, 4, 3)
    # A page is block_size x H x 2 rows: with "pow2" (and H a power of two) a power of two
    # times the block size.
    assert t.buffer[0].nbytes == 4 * 3 * 2 * row


@pytest.mark.parametrize("last", [131, 133, 140, 128, 112, 100])
def test_a_row_neither_vllms_nor_16_aligned_is_refused(last):
    """D = 128: rows of 132 bytes (vLLM's) or a multiple of 16 from 144 up; anything else
    would put the scale where the buffer's row does not say."""
    buf = np.zeros((2, 2, 4, 1, last), np.uint8)
    with pytest.raises(
        kvzoo.KVZooInputError,
        match=r"buffer: expected uint8 \[num_blocks, 2, block_size, H, row bytes\] "
        r"with row bytes 132 \(head_size \+ 4\) or a multiple of 16 over it \(a padded row\), got "
        rf"\(2, 2, 4, 1, {last}\)",
    ):
        inline_views(buf, 128, "int8_per_token_head")


@pytest.mark.parametrize("row_align", [12, 0, -16, 8, True, "pow3", 16.0])
def test_a_bad_row_align_is_refused(row_align):
    with pytest.raises(kvzoo.KVZooInputError, match="row_align: expected None, 'pow2' or a positive multiple of 16"):
        kvzoo.allocate_inline(2, 4, 1, 64, "int8_per_token_head", row_align=row_align)


def test_row_align_needs_the_inline_layout():
    with pytest.raises(kvzoo.KVZooInputError, match="row_align: pads the inline layout's rows"):
        kvzoo.PagedKVCache(2, 4, 1, 64, "int8_per_token_head", row_align=16)


def _writers():
    # int8, and the e4m3fnuz format that only triton-rocm's own cases run under the interpreter.
    return [
        pytest.param(impl, mode, id=f"{impl.name}-{mode}")
        for impl in registry.default().implementations("reshape_and_cache")
        for mode in ("int8_per_token_head", "fp8_e4m3fnuz_per_token_head")
        if mode in impl.modes
    ]


@pytest.mark.parametrize("impl, mode", _writers())
@pytest.mark.parametrize("row_align", [16, "pow2"])
def test_padding_is_never_written(impl, mode, row_align):
    """A PagedKVCache on an aligned page, the padding random bytes: writes, reads and attention
    on every implementation leave it as it was, and give the unpadded page's numbers."""
    if impl.unavailable():
        pytest.skip("; ".join(impl.unavailable()))
    rng = rng_for("aligned-padding", impl.name, row_align)
    device = device_for(impl)
    nb, bs, h, d = 3, 4, 2, 64
    plain = kvzoo.PagedKVCache(nb, bs, h, d, mode, layout="inline", device=device)
    padded = kvzoo.PagedKVCache(nb, bs, h, d, mode, layout="inline", device=device, row_align=row_align)
    page = padded.tensors.buffer
    pad = page[..., d + 4 :]
    pad.copy_(torch.from_numpy(rng.integers(0, 256, tuple(pad.shape), dtype=np.uint8)))
    padding_before = host_bytes(page[..., d + 4 :])[..., 0].copy()
    tokens = 7
    k, v = (torch.from_numpy(rng.standard_normal((tokens, h, d)).astype(np.float32)).to(device) for _ in range(2))
    slots = torch.from_numpy(rng.permutation(nb * bs)[:tokens]).to(device)
    for cache in (plain, padded):
        cache.write(k, v, slots, impl=impl.name)
    assert_same_bytes(page[..., d + 4 :], padding_before, f"{impl.name} wrote into the padding")
    assert_same_bytes(page[..., : d + 4], plain.tensors.buffer, f"{impl.name} codes and scales")
    tables = torch.arange(nb, device=device)[None].to(torch.int32)
    lens = torch.tensor([nb * bs], dtype=torch.int32, device=device)
    read_impl = impl.name if impl.name in [i.name for i in registry.default().implementations("dequantize")] else None
    for which in ("key", "value"):
        got = padded.read(which, block_tables=tables, seq_lens=lens, impl=read_impl)
        want = plain.read(which, block_tables=tables, seq_lens=lens, impl=read_impl)
        assert torch.equal(torch.as_tensor(got).nan_to_num(7.0), torch.as_tensor(want).nan_to_num(7.0))
    q = torch.from_numpy(rng.standard_normal((2, 4, d)).astype(np.float32)).to(device)
    meta = dict(block_tables=tables.repeat(2, 1), seq_lens=torch.tensor([5, nb * bs], dtype=torch.int32, device=device))
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
    got = padded.attention(q, query_start_loc=qsl, impl=impl.name, **meta)
    want = plain.attention(q, query_start_loc=qsl, impl=impl.name, **meta)
    # Not bitwise: Triton picks its decode tile by the rows' alignment, and so its sum's order.
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert_same_bytes(page[..., d + 4 :], padding_before, f"{impl.name} reads wrote into the padding")


def test_pages_move_between_aligned_and_unaligned_inline_pages():
    """kvzoo.distributed reads and places through the views: the padding stays on each side."""
    from kvzoo.distributed import gather_pages, place_pages

    rng = rng_for("aligned-pages-transfer")
    mode, d = "int8_per_token_head", 16
    spec = kvzoo.CacheSpec(mode, num_blocks=8, block_size=4, num_kv_heads=2, head_size=d, layout="inline")
    src = kvzoo.allocate_inline(8, 4, 2, d, mode, row_align=16)
    src.buffer[..., d + 4 :] = 0xAB
    k, v = (torch.from_numpy(rng.standard_normal((6, 2, d)).astype(np.float32)) for _ in range(2))
    slots = torch.tensor([12, 13, 14, 15, 4, 5])
    kvzoo.reshape_and_cache(
        k,
        v,
        src.key_cache,
        src.value_cache,
        slots,
        mode=mode,
        k_scale_cache=src.k_scale_cache,
        v_scale_cache=src.v_scale_cache,
        impl="numpy",
    )
    pages = gather_pages(src, spec, torch.tensor([[3, 1]]), torch.tensor([6])).to_host()
    for dst in (kvzoo.allocate_inline(8, 4, 2, d, mode, row_align="pow2"), spec.allocate()):
        dst.buffer[..., d + 4 :] = 0xCD
        place_pages(pages, dst, spec, allocate=[6, 0])
        for to, frm in ((6, 3), (0, 1)):
            assert torch.equal(dst.buffer[to, ..., : d + 4], src.buffer[frm, ..., : d + 4])
        assert bool((dst.buffer[..., d + 4 :] == 0xCD).all())
    assert bool((src.buffer[..., d + 4 :] == 0xAB).all())


@pytest.mark.parametrize("row_align", [16, "pow2", 64])
def test_views_of_a_padded_page_read_the_oracles_rows(row_align):
    """SPEC.md section 5's table: kvzoo's views of oracle.pack_inline(row_bytes=R) read the same
    codes and scale bits back, and unpack_inline(head_size=D) inverts it."""
    from kvzoo_spec import oracle

    rng = rng_for("aligned-oracle", row_align)
    nb, bs, h, d = 2, 3, 2, 40
    kc, vc = (rng.integers(0, 256, (nb, bs, h, d)).astype(np.uint8) for _ in range(2))
    ks, vs = (rng.standard_normal((nb, bs, h)).astype(np.float32) for _ in range(2))
    row = inline_row_bytes(d, row_align)
    buf = oracle.pack_inline(kc, vc, ks, vs, row_bytes=row)
    assert buf.shape == (nb, 2, bs, h, row) and not buf[..., d + 4 :].any()
    t = inline_views(buf, d, "int8_per_token_head")
    for got, want in zip((t.key_cache, t.value_cache, t.k_scale_cache, t.v_scale_cache), (kc, vc, ks, vs)):
        assert_same_bytes(got, want.view(got.dtype), "view")
    for got, want in zip(oracle.unpack_inline(buf, head_size=d), (kc, vc, ks, vs)):
        assert_same_bytes(got, want, "unpack_inline")
    with pytest.raises(ValueError, match="row_bytes: expected 44 or a multiple of 16 over it, got 50"):
        oracle.pack_inline(kc, vc, ks, vs, row_bytes=50)


@pytest.mark.parametrize("row_align, want", [(None, 4), (16, 16), ("pow2", 16)])
def test_triton_sees_an_aligned_page_as_16_byte_rows(row_align, want):
    """The alignment the Triton kernels take (decode's tile table, the write's wide-row layout,
    their tl.multiple_of hints) comes from the views' strides: an aligned page gets the separate
    layout's 16-byte path with no kernel change."""
    from kvzoo.backends.triton.alignment import row_align as triton_row_align

    for d in (64, 128):
        t = kvzoo.allocate_inline(4, 16, 8, d, "fp8_per_token_head", row_align=row_align)
        assert triton_row_align(t.key_cache, t.value_cache) == want
        assert (t.value_cache.data_ptr() - t.key_cache.data_ptr()) % 16 == 0
