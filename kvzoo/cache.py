"""PagedKVCache: one layer's quantized paged cache as an object (allocate, write, read, attend)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import api
from .layout import KVCacheTensors, RowAlign, allocate_inline, allocate_separate
from .modes import QuantMode, get_kv_quant_mode
from .registry import Implementation
from .validate import fail

if TYPE_CHECKING:
    from .arrays import Array


class PagedKVCache:
    """Codes and scales for one attention layer, in the separate or the inline layout.

    The cache starts zero-filled, so `read()` of a slot never written gives 0.

    Parameters
    ----------
    num_blocks, block_size, num_kv_heads, head_size : int
        The cache holds ``num_blocks * block_size`` slots of ``num_kv_heads`` rows of
        ``head_size`` elements, for K and for V.
    mode : str or QuantMode
        ``"int8_per_token_head"``, ``"fp8_per_token_head"``, ``"int4_per_token_head"``,
        ``"fp8_per_tensor"``, ``"none"``, ... (``kvzoo.MODES``; engine strings such as ``"fp8"``);
        ``"k_int8_v_int4"`` and the other split modes store keys and values in two formats.
    layout : {"separate", "inline"}
        vLLM's separate tensors, or one page buffer with each row's scale after its codes.
    row_align : None, int or "pow2"
        The inline layout only: None keeps vLLM's rows of head_size + 4 bytes; 16 (or another
        multiple of 16) pads each row to a multiple of it, so every row starts on 16 bytes;
        "pow2" pads it to a power of two (``kvzoo.allocate_inline``).
    model_dtype : {"bfloat16", "float16", "float32"}
        The K/V dtype; the cache dtype of mode ``"none"``.
    device : str or None
        ``"cpu"``, ``"cuda"``, ``"cuda:1"``: torch tensors there; None: NumPy arrays (no torch
        needed).
    k_scale, v_scale : float, optional
        A per-tensor mode's static scales.

    Example
    -------
    >>> import numpy as np, kvzoo
    >>> cache = kvzoo.PagedKVCache(8, 16, 2, 64, "int8_per_token_head", device=None)  # NumPy arrays
    >>> rows = np.random.default_rng(0).standard_normal((20, 2, 64)).astype(np.float32)
    >>> cache.write(rows, rows, np.arange(20), impl="numpy")
    >>> cache.read("key", block_tables=np.array([[0, 1]]), seq_lens=np.array([20]), impl="numpy").shape
    (20, 2, 64)
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        mode: str | QuantMode,
        *,
        layout: str = "separate",
        model_dtype: str = "bfloat16",
        device: str | None = "cpu",
        k_scale: float | None = None,
        v_scale: float | None = None,
        row_align: RowAlign = None,
    ) -> None:
        self.mode = get_kv_quant_mode(mode)
        if row_align is not None and layout != "inline":
            fail(f"row_align: pads the inline layout's rows; layout {layout!r} has none (pass layout='inline')")
        if layout == "separate":
            self.tensors: KVCacheTensors = allocate_separate(
                num_blocks,
                block_size,
                num_kv_heads,
                head_size,
                self.mode,
                model_dtype=model_dtype,
                device=device,
            )
        elif layout == "inline":
            self.tensors = allocate_inline(
                num_blocks, block_size, num_kv_heads, head_size, self.mode, device=device, row_align=row_align
            )
        else:
            fail(f"layout: expected 'separate' or 'inline', got {layout!r}")
        self.layout = layout
        self.k_scale, self.v_scale = k_scale, v_scale

    def write(
        self,
        key: Array,
        value: Array,
        slot_mapping: Array,
        *,
        rounding: str = "nearest",
        impl: str | Implementation | None = None,
        validate: bool = True,
        check_finite: bool = False,
    ) -> None:
        """Quantize rows of K and V into their slots (``kvzoo.reshape_and_cache``).

        Parameters
        ----------
        key, value : torch.Tensor or numpy.ndarray
            ``[num_tokens, num_kv_heads, head_size]``, bfloat16, float16 or float32.
        slot_mapping : torch.Tensor or numpy.ndarray
            ``[num_tokens]`` int32 or int64: ``block * block_size + offset`` of each token, negative
            to skip it.
        rounding, impl, validate, check_finite
            As ``kvzoo.reshape_and_cache``.
        """
        api.reshape_and_cache(
            key,
            value,
            self.tensors.key_cache,
            self.tensors.value_cache,
            slot_mapping,
            mode=self.mode,
            rounding=rounding,
            impl=impl,
            validate=validate,
            check_finite=check_finite,
            **self.tensors.scale_arguments(self.k_scale, self.v_scale),
        )

    def read(
        self,
        which: str = "key",
        *,
        block_tables: Array | None = None,
        seq_lens: Array | None = None,
        impl: str | Implementation | None = None,
        validate: bool = True,
    ) -> Array:
        """Decoded float32 keys or values (``kvzoo.dequantize``).

        Parameters
        ----------
        which : {"key", "value"}
            The cache to decode.
        block_tables : torch.Tensor or numpy.ndarray, optional
            ``[num_seqs, max_blocks_per_seq]`` int32/int64, the blocks of each sequence; None
            (with seq_lens None) decodes the whole cache.
        seq_lens : torch.Tensor or numpy.ndarray, optional
            ``[num_seqs]`` int32/int64, each sequence's length; given with block_tables.
        impl, validate
            As ``kvzoo.dequantize``.

        Returns
        -------
        torch.Tensor or numpy.ndarray
            float32, of the cache's kind: ``[num_blocks, block_size, num_kv_heads, head_size]``
            for the whole cache, else the sequences' tokens packed in order,
            ``[sum(seq_lens), num_kv_heads, head_size]``.
        """
        if which not in ("key", "value"):
            fail(f"which: expected 'key' or 'value', got {which!r}")
        t = self.tensors
        cache, scale_cache = (t.key_cache, t.k_scale_cache) if which == "key" else (t.value_cache, t.v_scale_cache)
        scale = self.k_scale if which == "key" else self.v_scale
        return api.dequantize(
            cache,
            scale_cache,
            mode=self.mode.key_side if which == "key" else self.mode.value_side,
            scale=scale,
            block_tables=block_tables,
            seq_lens=seq_lens,
            impl=impl,
            validate=validate,
        )

    def attention(
        self,
        query: Array,
        *,
        block_tables: Array,
        seq_lens: Array,
        query_start_loc: Array,
        softmax_scale: float | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: Array | None = None,
        out: Array | None = None,
        max_query_len: int | None = None,
        max_seq_len: int | None = None,
        num_prefills: int | None = None,
        batch_invariant: bool = False,
        quantize_query: bool = False,
        fp8_dots: bool = False,
        return_lse: bool = False,
        lse: Array | None = None,
        impl: str | Implementation | None = None,
        validate: bool = True,
    ) -> Array | tuple[Array, Array]:
        """Causal paged attention over this cache (``kvzoo.paged_attention``).

        Parameters
        ----------
        query : torch.Tensor or numpy.ndarray
            ``[num_tokens, num_q_heads, head_size]``, bfloat16, float16 or float32 (num_q_heads a
            multiple of the cache's num_kv_heads).
        block_tables : torch.Tensor or numpy.ndarray
            ``[num_seqs, max_blocks_per_seq]`` int32/int64, the cache blocks of each sequence.
        seq_lens : torch.Tensor or numpy.ndarray
            ``[num_seqs]`` int32/int64, each sequence's context, this step's tokens included.
        query_start_loc : torch.Tensor or numpy.ndarray
            ``[num_seqs + 1]`` int32/int64: sequence s owns query rows
            ``query_start_loc[s]:query_start_loc[s+1]``.
        sinks : torch.Tensor or numpy.ndarray, optional
            ``[num_q_heads]`` float32.
        out : torch.Tensor or numpy.ndarray, optional
            A writable ``[num_tokens, num_q_heads, head_size]`` array of the query's dtype.
        lse : torch.Tensor or numpy.ndarray, optional
            A writable float32 ``[num_tokens, num_q_heads]`` array (needs return_lse=True).
        softmax_scale, sliding_window, softcap, max_query_len, max_seq_len, num_prefills
            As ``kvzoo.paged_attention``.
        batch_invariant, quantize_query, fp8_dots, return_lse, impl, validate
            As ``kvzoo.paged_attention``.

        Returns
        -------
        torch.Tensor or numpy.ndarray, or a tuple of two
            out ``[num_tokens, num_q_heads, head_size]`` in the query's dtype, or ``(out, lse)``
            with return_lse (lse float32 ``[num_tokens, num_q_heads]``).
        """
        return api.paged_attention(
            query,
            self.tensors.key_cache,
            self.tensors.value_cache,
            mode=self.mode,
            block_tables=block_tables,
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            softmax_scale=softmax_scale,
            sliding_window=sliding_window,
            softcap=softcap,
            sinks=sinks,
            out=out,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            num_prefills=num_prefills,
            batch_invariant=batch_invariant,
            quantize_query=quantize_query,
            fp8_dots=fp8_dots,
            return_lse=return_lse,
            lse=lse,
            impl=impl,
            validate=validate,
            **self.tensors.scale_arguments(self.k_scale, self.v_scale),
        )
