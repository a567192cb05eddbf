"""The conformance samples, described once (OpInfo style) and run on every implementation.

Each operation has a list of cases; kvzoo.conformance.checks crosses them with every
registered implementation of that operation, so a new backend is covered by registering it.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..capabilities import Requirements
from ..modes import MODES

if TYPE_CHECKING:
    from ..samples import Kind

HEAD_SIZES = (64, 80, 96, 128, 256, 67)
MODE_NAMES = tuple(MODES)
# Head sizes that are no power of two for the modes whose int4 rows are rotated (SPEC.md 3.4's
# blocks): the rotation's own cases (_block_rotation_*), at the sizes models use (80 = 64 + 16,
# 96 = 64 + 32, 192 = 128 + 64), the smallest of two blocks (6) and the most blocks (510).
BLOCK_HEAD_SIZES = (80, 96, 192, 6, 510)


def head_size_for(mode: str, head_size: int) -> int:
    """The head size a case of `mode` uses where the others use head_size: the nearest one the
    mode takes, a power of two for the int4 modes (vLLM's sizes; the rotation's other sizes
    have cases of their own, BLOCK_HEAD_SIZES), so each mode meets the suite's shapes as far as
    it can."""
    rule = MODES[mode].head_sizes
    if rule.multiple > 1:
        rule = dataclasses.replace(rule, power_of_two=True)
    return rule.closest(head_size)


def _block_rotated(mode: str) -> bool:
    """Whether a side of `mode` is rotated and takes head sizes that are no power of two."""
    m = MODES[mode]
    return not m.head_sizes.power_of_two and any(side.rotation for side in (m.key_side, m.value_side))


# The fields of a case that are its sample's keywords (the rest are the call's, or the id's).
_WRITE_SAMPLE_FIELDS = (
    "num_tokens",
    "num_kv_heads",
    "head_size",
    "block_size",
    "dtype",
    "dist",
    "layout",
    "row_align",
    "negative_slots",
    "wild_slots",
    "strided",
)
_ATTENTION_SAMPLE_FIELDS = (
    "batch",
    "block_size",
    "num_q_heads",
    "num_kv_heads",
    "head_size",
    "query_dtype",
    "layout",
    "row_align",
    "sinks",
    "poison",
)


def _inline(mode: str) -> bool:
    return "inline" in MODES[mode].layouts


def _case_id(parts: list[str], flags: tuple[tuple[str, object], ...], row_align: int | str | None) -> str:
    """A case's id: its parts, then the name of each flag that is on, then the aligned inline
    page's part (kvzoo.layout.allocate_inline's row_align)."""
    aligned = [] if row_align is None else [f"row{row_align}"]
    return "-".join(parts + [name for name, on in flags if on] + aligned)


@dataclass(frozen=True)
class WriteCase:
    mode: str
    dtype: str = "bfloat16"
    dist: str = "normal"
    num_tokens: int = 9
    num_kv_heads: int = 2
    head_size: int = 64
    block_size: int = 16
    rounding: str = "nearest"
    layout: str = "separate"
    negative_slots: bool = True
    strided: bool = False
    kind: Kind = "torch"  # "numpy": pass NumPy arrays instead of torch tensors
    # validate=False with slots past the cache's end: skipped, nothing written out of bounds.
    wild_slots: bool = False
    row_align: int | str | None = None  # the inline page's rows padded (allocate_inline)

    @property
    def id(self) -> str:
        return _case_id(
            [self.mode, self.dtype, self.dist, f"T{self.num_tokens}", f"H{self.num_kv_heads}", f"D{self.head_size}"]
            + [f"B{self.block_size}"],
            (
                ("trunc", self.rounding == "trunc"),
                ("inline", self.layout == "inline"),
                ("strided", self.strided),
                ("numpy", self.kind == "numpy"),
                ("wild", self.wild_slots),
            ),
            self.row_align,
        )

    def requirements(self) -> Requirements:
        options = {"trunc_rounding"} if self.rounding == "trunc" else set()
        if self.layout == "inline":
            options.add("inline_layout")
        return Requirements(self.head_size, self.dtype, frozenset(options))

    def sample_args(self) -> dict[str, Any]:
        """The fields samples.write_sample draws this case's sample by, as its keywords."""
        return {name: getattr(self, name) for name in _WRITE_SAMPLE_FIELDS}


def write_cases() -> list[WriteCase]:
    cases = []
    # Every mode x rounding x input dtype x distribution, at a small shape that varies.
    shapes = itertools.cycle([(64, 16, 2), (80, 1, 3), (96, 32, 1), (128, 16, 4), (256, 16, 2), (67, 32, 2)])
    for mode in MODE_NAMES:
        for rounding in MODES[mode].roundings:
            for dtype in ("bfloat16", "float16", "float32"):
                for dist in ("normal", "outliers", "tiny", "midpoints", "specials"):
                    d, bs, h = next(shapes)
                    d = head_size_for(mode, d)
                    cases.append(
                        WriteCase(
                            mode,
                            dtype,
                            dist,
                            num_tokens=7,
                            num_kv_heads=h,
                            head_size=d,
                            block_size=bs,
                            rounding=rounding,
                            layout="inline" if _inline(mode) and d % 4 == 0 and dist == "normal" else "separate",
                            strided=dist in ("outliers", "specials"),
                            kind="numpy" if dist == "tiny" else "torch",
                        )
                    )
    # Edge sizes.
    for mode in MODE_NAMES:
        cases.append(WriteCase(mode, num_tokens=0))
        cases.append(WriteCase(mode, num_tokens=1, negative_slots=False))
        cases.append(WriteCase(mode, num_tokens=64, num_kv_heads=16, head_size=128, block_size=16))
        cases.append(
            WriteCase(
                mode, num_tokens=40, num_kv_heads=1, head_size=head_size_for(mode, 67), block_size=1, strided=True
            )
        )
        cases.append(WriteCase(mode, num_tokens=20, block_size=4, wild_slots=True))
        if _inline(mode):
            # Aligned pages (rows of 144 and 128 bytes for 132 and 84 of data), the padding
            # poisoned: the write must leave every padding byte as it was.
            cases.append(WriteCase(mode, num_tokens=40, num_kv_heads=3, head_size=128, layout="inline", row_align=16))
            cases.append(
                WriteCase(
                    mode,
                    "float32",
                    num_tokens=11,
                    head_size=80,
                    block_size=4,
                    layout="inline",
                    strided=True,
                    kind="numpy",
                    row_align="pow2",
                )
            )
        # A mode with bounds on its head sizes meets both ends of them, in every input dtype
        # (int4: D = 2 and the rotation's largest, 512).
        rule = MODES[mode].head_sizes
        if rule.highest is not None:
            for d, dtype in itertools.product((rule.lowest, rule.highest), ("bfloat16", "float16", "float32")):
                dist = "specials" if d == rule.lowest else "normal"
                cases.append(WriteCase(mode, dtype, dist, num_tokens=5, num_kv_heads=2, head_size=d, block_size=4))
    # The rotation's blocks (SPEC.md 3.4), every distribution and input dtype among them.
    for mode in filter(_block_rotated, MODE_NAMES):
        for d, dtype, dist, heads in zip(
            BLOCK_HEAD_SIZES,
            ("bfloat16", "float16", "float32", "bfloat16", "float32"),
            ("normal", "specials", "midpoints", "outliers", "tiny"),
            (3, 2, 1, 4, 1),
        ):
            cases.append(
                WriteCase(
                    mode, dtype, dist, num_tokens=7, num_kv_heads=heads, head_size=d, block_size=4, strided=d == 96
                )
            )
    return cases


@dataclass(frozen=True)
class DequantCase:
    mode: str
    head_size: int = 64
    num_kv_heads: int = 2
    block_size: int = 16
    whole_cache: bool = False
    layout: str = "separate"
    row_align: int | str | None = None

    @property
    def id(self) -> str:
        return _case_id(
            [self.mode, f"D{self.head_size}", f"H{self.num_kv_heads}", f"B{self.block_size}"],
            (("whole", self.whole_cache), ("inline", self.layout == "inline")),
            self.row_align,
        )

    def requirements(self) -> Requirements:
        return Requirements(self.head_size, None, frozenset({"inline_layout"} if self.layout == "inline" else ()))


def dequant_cases() -> list[DequantCase]:
    cases = []
    for mode in MODE_NAMES:
        if MODES[mode].split:
            continue  # dequantize reads one cache, in one side's mode: those modes' cases
        cases.append(DequantCase(mode))
        cases.append(
            DequantCase(mode, head_size=head_size_for(mode, 67), num_kv_heads=3, block_size=32, whole_cache=True)
        )
        if _inline(mode):
            cases.append(DequantCase(mode, head_size=128, block_size=1, layout="inline"))
            cases.append(DequantCase(mode, head_size=128, block_size=1, layout="inline", row_align=16))
            cases.append(
                DequantCase(
                    mode,
                    head_size=96,
                    num_kv_heads=3,
                    block_size=16,
                    whole_cache=True,
                    layout="inline",
                    row_align="pow2",
                )
            )
        rule = MODES[mode].head_sizes
        if rule.highest is not None:
            cases.append(DequantCase(mode, head_size=rule.lowest, block_size=4))
            cases.append(DequantCase(mode, head_size=rule.highest, num_kv_heads=1, block_size=4, whole_cache=True))
        if _block_rotated(mode):
            cases.append(DequantCase(mode, head_size=80, num_kv_heads=3, block_size=4))
            cases.append(DequantCase(mode, head_size=96, num_kv_heads=1, block_size=16, whole_cache=True))
    return cases


@dataclass(frozen=True)
class AttentionCase:
    mode: str
    batch: str = "mixed"  # "decode" | "prefill" | "mixed" | "long" (prefills of 128+ tokens)
    num_q_heads: int = 8
    num_kv_heads: int = 2
    head_size: int = 64
    block_size: int = 16
    query_dtype: str = "bfloat16"
    sliding_window: int | None = None
    softcap: float | None = None
    sinks: bool = False
    layout: str = "separate"
    # A NaN/Inf-poisoned key in sequence 0 (a decode in "decode" and "mixed" batches).
    poison: bool = False
    quantize_query: bool = False  # SPEC.md section 8.1 (int8 caches)
    fp8_dots: bool = False  # SPEC.md section 8.3 (fp8 e4m3fn caches)
    row_align: int | str | None = None  # the inline page's rows padded (allocate_inline)

    @property
    def id(self) -> str:
        return _case_id(
            [self.mode, self.batch, f"Hq{self.num_q_heads}", f"Hkv{self.num_kv_heads}", f"D{self.head_size}"]
            + [f"B{self.block_size}", self.query_dtype],
            (
                (f"win{self.sliding_window}", self.sliding_window),
                (f"cap{self.softcap or 0:g}", self.softcap),
                ("sinks", self.sinks),
                ("inline", self.layout == "inline"),
                ("poison", self.poison),
                ("qint8", self.quantize_query),
                ("fp8dots", self.fp8_dots),
            ),
            self.row_align,
        )

    def sample_args(self) -> dict[str, Any]:
        """The fields samples.paged_sample draws this case's sample by, as its keywords."""
        return {name: getattr(self, name) for name in _ATTENTION_SAMPLE_FIELDS}

    def requirements(self) -> Requirements:
        options = {
            name
            for name, on in (
                ("sliding_window", self.sliding_window is not None),
                ("softcap", self.softcap is not None),
                ("sinks", self.sinks),
                ("inline_layout", self.layout == "inline"),
                ("quantize_query", self.quantize_query),
                ("fp8_dots", self.fp8_dots),
            )
            if on
        }
        return Requirements(self.head_size, self.query_dtype, frozenset(options))


# Every softmax option at once, one set of values for each case that takes them all, so their ids
# (win19-cap30-sinks, which tests name) move together.
_EVERY_SOFTMAX_OPTION: dict[str, Any] = dict(sliding_window=19, softcap=30.0, sinks=True)


def _every_softmax_option_case(mode: str, **more: Any) -> AttentionCase:
    """The mixed batch with every softmax option at once, GQA of 8 (16 query heads on 2 KV heads)
    at head size 96 or the mode's nearest; more: what one use adds (its query dtype, its dots)."""
    return AttentionCase(
        mode,
        "mixed",
        num_q_heads=16,
        num_kv_heads=2,
        head_size=head_size_for(mode, 96),
        **_EVERY_SOFTMAX_OPTION,
        **more,
    )


def attention_cases() -> list[AttentionCase]:
    cases = []
    for mode in MODE_NAMES:
        for batch in ("decode", "prefill", "mixed", "long"):
            cases.append(AttentionCase(mode, batch))
        cases.append(AttentionCase(mode, "decode", num_q_heads=8, num_kv_heads=1, head_size=128))  # MQA
        cases.append(
            AttentionCase(
                mode,
                "mixed",
                num_q_heads=2,
                num_kv_heads=2,
                head_size=head_size_for(mode, 80),
                block_size=32,
                query_dtype="float16",
            )
        )
        cases.append(_every_softmax_option_case(mode))
        if _inline(mode):
            # vLLM's rows, then aligned pages: rows of 144 bytes (16-byte aligned, 132 of data)
            # and of 128 (a power of two, 68 of data), padding all ones (NaN were it read as a
            # scale). In the decode case slots are a multiple of 16 bytes apart, so each KV
            # head's rows share one offset from 16-byte alignment (0, 4, 8 and 12 bytes on
            # vLLM's page): every offset a 4-byte row load meets.
            for mixed_align, decode_align in ((None, None), (16, "pow2")):
                cases.append(AttentionCase(mode, "mixed", head_size=128, layout="inline", row_align=mixed_align))
                cases.append(
                    AttentionCase(
                        mode,
                        "decode",
                        num_q_heads=16,
                        num_kv_heads=4,
                        head_size=64,
                        layout="inline",
                        **_EVERY_SOFTMAX_OPTION,
                        poison=MODES[mode].holds_nan,
                        row_align=decode_align,
                    )
                )
        if MODES[mode].holds_nan:
            cases.append(AttentionCase(mode, "decode", poison=True))
        rule = MODES[mode].head_sizes
        if rule.highest is not None:
            cases.append(AttentionCase(mode, "decode", num_q_heads=4, head_size=rule.highest, query_dtype="float32"))
            cases.append(AttentionCase(mode, "prefill", num_q_heads=2, head_size=rule.lowest, block_size=4))
        if _block_rotated(mode):
            # The rotation's blocks at attention: the query's and the output's (SPEC.md 8.4).
            cases.append(
                AttentionCase(mode, "mixed", num_q_heads=2, num_kv_heads=2, head_size=80, query_dtype="float16")
            )
            cases.append(dataclasses.replace(_every_softmax_option_case(mode), head_size=96))
            cases.append(AttentionCase(mode, "decode", num_q_heads=4, head_size=192, query_dtype="float32"))
            cases.append(AttentionCase(mode, "prefill", num_q_heads=2, head_size=6, block_size=4))
    cases.append(AttentionCase("int8_per_token_head", "mixed", head_size=256, query_dtype="float32"))
    # The options that change what the dots take (SPEC.md 8.1, 8.3), each on its format's caches.
    for mode, option, batches in (
        ("int8_per_token_head", "quantize_query", ("decode", "prefill", "mixed")),
        ("fp8_per_token_head", "fp8_dots", ("decode", "prefill", "mixed", "long")),
    ):
        on: dict[str, Any] = {option: True}
        cases += [AttentionCase(mode, batch, **on) for batch in batches]
        cases.append(_every_softmax_option_case(mode, query_dtype="float32", **on))
        cases.append(AttentionCase(mode, "decode", poison=True, **on))
    # quantize_query rounds the query as int8 keys are: split modes with int8 keys take it too.
    cases.append(AttentionCase("k_int8_v_int4", "mixed", quantize_query=True))
    cases.append(AttentionCase("fp8_per_token_head", "mixed", head_size=128, layout="inline", fp8_dots=True))
    cases.append(
        AttentionCase("fp8_per_token_head", "mixed", head_size=128, layout="inline", fp8_dots=True, row_align=16)
    )
    # float32 queries hold the probability tile (SPEC.md 8.3) to attention_rtol: at bf16's
    # 3.9e-3 a declared tile of 32 or 128 passed the cases above, while long float32 rows
    # catch either.
    cases.append(AttentionCase("fp8_per_token_head", "long", query_dtype="float32", fp8_dots=True))
    cases.append(AttentionCase("fp8_per_token_head", "prefill", head_size=67, block_size=1))
    cases.append(AttentionCase("none", "decode", head_size=67, sinks=True, query_dtype="float16"))
    return cases
