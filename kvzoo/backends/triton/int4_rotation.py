"""The int4 modes' Hadamard rotation for the Triton kernels (SPEC.md section 3.4), and the
nibble layout of their rows (SPEC.md 5.3).

`fwht` is the butterfly of SPEC.md 3.4 on a register tile [ROWS, D]: stage h = 1, 2, ..., D/2 in that
order, each element of a pair one rounded add or subtract of the previous stage's values, so
its float32 result is the oracle's bit for bit (tests/test_triton_int4.py holds it to
oracle.int4_fwht). A stage is a reshape that puts each pair's two elements on an axis of size 2,
a split, one add and one subtract, and a join back: the compiler keeps the pairs a thread holds
in registers and moves the rest between lanes, with no arithmetic beyond the D adds a stage has.

The signs are applied as their float32 sign bits XORed into the values: exact for every value,
NaN and -0 included.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...modes import RHT_MAX_HEAD_SIZE, RHT_SIGN_BITS

# The sign table as 32-bit words (bit i of word w: element 32 w + i), signed as Triton's int32.
_SIGN_WORDS = tuple(
    ((RHT_SIGN_BITS >> (32 * w)) & 0xFFFFFFFF) - ((RHT_SIGN_BITS >> (32 * w + 31)) & 1) * (1 << 32)
    for w in range(RHT_MAX_HEAD_SIZE // 32)
)


@triton.constexpr_function
def log2(n):
    return n.bit_length() - 1


@triton.constexpr_function
def padded(n):
    """The power of two a head of n elements is tiled in (n itself for a power of two)."""
    return 1 << (n - 1).bit_length()


@triton.constexpr_function
def top_block(n):
    """The largest of the rotation's blocks for a head of n (SPEC.md 3.4): n for a power of two."""
    return 1 << (n.bit_length() - 1)


@triton.constexpr_function
def _masked(n, stage):
    """Whether butterfly stage 2^stage leaves some of a head of n alone: the elements of
    its blocks no larger than 2^stage (never for a power of two, one block)."""
    return (1 << stage) >= (n & -n)


@triton.constexpr_function
def _has_block(n, k):
    return (n >> k) & 1 == 1


@triton.constexpr_function
def _sign_word(w):
    return _SIGN_WORDS[w]


@triton.jit
def sign_bits(d, D: tl.constexpr):
    """The float32 sign bit (0 or 0x80000000, int32) of the sign of each element index in d
    (int32, < D; the indices of a tile padded past a smaller head read the table on, which only
    ever flips the padding's zeros). Compile-time constants wherever the compiler knows d (a
    register's column of a tile whose rows a thread holds whole), so the flip folds into the
    butterfly's first adds."""
    word = tl.zeros_like(d)
    for w in tl.static_range(triton.cdiv(D, 32)):
        word = tl.where((d >> 5) == w, _sign_word(w), word)
    return ((word >> (d & 31)) & 1) << 31


@triton.jit
def _stage(x, ROWS: tl.constexpr, D: tl.constexpr, STAGE: tl.constexpr):
    H: tl.constexpr = 1 << STAGE
    pairs = tl.permute(tl.reshape(x, [ROWS, D // (2 * H), 2, H]), [0, 1, 3, 2])
    a, b = tl.split(pairs)
    return tl.reshape(tl.permute(tl.join(a + b, a - b), [0, 1, 3, 2]), [ROWS, D])


@triton.jit
def fwht(x, ROWS: tl.constexpr, W: tl.constexpr, N: tl.constexpr):
    """The unnormalized Walsh-Hadamard transforms of the rotation of a head of N elements (its
    blocks, SPEC.md 3.4) on each row of x [ROWS, W], as the butterflies of SPEC.md 3.4 in x's
    dtype. W > N (a tile padded to a power of two, or for the dots): a row's first N stay
    their own (for a power of two N, each block of N elements of the tile is transformed
    alone), and zero padding stays zero. A head that is no power of two runs the full-width
    butterfly of its largest block, where a stage changes element d only where (N ^ d) >= 2h:
    d's block is larger than the stage; a power of two is never masked, so its code is the
    unmasked butterfly's."""
    for stage in tl.static_range(log2(N)):
        if _masked(N, stage):
            d = tl.arange(0, W)[None, :]
            x = tl.where((N ^ d) >= (2 << stage), _stage(x, ROWS, W, stage), x)
        else:
            x = _stage(x, ROWS, W, stage)
    return x


@triton.jit
def per_block(W: tl.constexpr, N: tl.constexpr, NUM: tl.constexpr):
    """NUM / B as float32 [1, W], B the size of element d's rotation block for a head of N
    elements (the largest power of two <= N ^ d; SPEC.md 3.4), for N no power of two (padding:
    any of them). Exact wherever NUM is a power of two."""
    d = tl.arange(0, W)[None, :]
    f = tl.full([1, W], NUM, tl.float32)
    for k in tl.static_range(log2(N) + 1):
        if _has_block(N, k):
            f = tl.where((N ^ d) >= (1 << k), NUM / (1 << k), f)
    return f


@triton.jit
def over_blocks(x, W: tl.constexpr, N: tl.constexpr):
    """x [ROWS, W] / B, each element over its rotation block's size (SPEC.md 3.4's inverse),
    exactly: the multiply by 1 / B, a power of two, is the division's one rounding."""
    if (N & (N - 1)) == 0:
        return x * (1.0 / N)
    else:
        return x * per_block(W, N, 1.0)


@triton.jit
def flip_signs(x, D: tl.constexpr):
    """x * s for the rows of a float32 tile [ROWS, D], exactly: the sign bits XORed in."""
    d = tl.arange(0, D)[None, :]
    return (x.to(tl.int32, bitcast=True) ^ sign_bits(d, D)).to(tl.float32, bitcast=True)


@triton.jit
def unpack_nibbles(packed):
    """Bytes [..., D/2] (int32 0..255) -> (codes of the even elements, of the odd elements),
    each [..., D/2] int32: element 2j is byte j's low nibble, 2j + 1 its high one."""
    return packed & 0xF, (packed >> 4) & 0xF


@triton.jit
def interleave(even, odd, ROWS: tl.constexpr, D: tl.constexpr):
    """Tiles of the even and the odd elements [ROWS, D/2] -> the rows [ROWS, D] in order."""
    return tl.reshape(tl.join(even, odd), [ROWS, D])


@triton.jit
def deinterleave(x, ROWS: tl.constexpr, D: tl.constexpr):
    """Rows [ROWS, D] -> (their even elements, their odd elements), each [ROWS, D/2]."""
    return tl.split(tl.reshape(x, [ROWS, D // 2, 2]))
