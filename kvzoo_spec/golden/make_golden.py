"""Generate (or, with --check, verify) the golden vectors in this folder from the oracle.

    python kvzoo_spec/golden/make_golden.py           # rewrite every file
    python kvzoo_spec/golden/make_golden.py --check   # fail unless regenerating gives the same bytes

The file format is described in kvzoo_spec/SPEC.md §9. Each file draws from its own generator,
seeded from its name, so adding a file never changes another. The .npz files are written
uncompressed with fixed zip metadata, so the same arrays always give the same bytes.
"""

from __future__ import annotations

import io
import json
import sys
import zipfile
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvzoo_spec import oracle  # noqa: E402

D_ROWS = 16
DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}
QUANT_MODES = (
    "fp8_per_tensor",
    "int8_per_token_head",
    "fp8_per_token_head",
    "fp8_e4m3fnuz_per_token_head",
    "int8_per_tensor",
    "fp8_e5m2_per_tensor",
)
PER_TOKEN_HEAD = tuple(m for m in QUANT_MODES if oracle.ORACLE_MODES[m].granularity == "per_token_head")
# SPEC.md section 2's int4 rows: rows and cache files (no inline page is defined for int4).
INT4_MODES = oracle.INT4_MODES
# A few significant bits, not a power of two: x / s and x * (1/s) differ for many x, and
# x = midpoint * s is exact in every input dtype.
STATIC_SCALE = np.float32(0.375)
STATIC_V_SCALE = np.float32(0.0123)


def roundings(mode: str) -> tuple[str, ...]:
    return ("nearest",) if mode in INT4_MODES else oracle.ORACLE_MODES[mode].roundings


# --------------------------------------------------------------------------------------------
# bits and files


def bits(a: np.ndarray) -> np.ndarray:
    """Raw bits of a float array (uint16 for 2-byte dtypes, uint32 for float32)."""
    a = np.ascontiguousarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32).copy()


def decoded_bits(a: np.ndarray) -> np.ndarray:
    """float32 bits with every NaN made canonical: decode may produce any NaN."""
    b = bits(a.astype(np.float32))
    b[np.isnan(a)] = oracle.CANONICAL_NAN_BITS
    return b


def from_bits(b: np.ndarray, dtype_name: str) -> np.ndarray:
    return np.ascontiguousarray(b).view(DTYPES[dtype_name])


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """An uncompressed .npz with fixed timestamps: identical arrays give identical bytes."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as zf:
        for name in sorted(arrays):
            payload = io.BytesIO()
            np.lib.format.write_array(payload, np.asarray(arrays[name]), allow_pickle=False)
            info = zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            zf.writestr(info, payload.getvalue())
    return out.getvalue()


def meta(**fields) -> np.ndarray:
    return np.array(json.dumps(fields, sort_keys=True))


def rng_for(name: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(name.encode()))


# --------------------------------------------------------------------------------------------
# input rows


def neighbours(v: np.ndarray) -> np.ndarray:
    """The adjacent representable values (toward and away from zero) of nonzero finite v."""
    b = bits(v)
    one = b.dtype.type(1)
    return np.concatenate([(b - one).view(v.dtype), (b + one).view(v.dtype)])


def pack_rows(values: np.ndarray, anchor, dtype) -> list[np.ndarray]:
    """Rows of D values each led by `anchor`, the row's largest magnitude (fixes its scale)."""
    per_row = D_ROWS - 1
    rows = []
    for start in range(0, len(values), per_row):
        chunk = values[start : start + per_row]
        chunk = np.concatenate([chunk, np.resize(chunk, per_row - len(chunk))])
        rows.append(np.concatenate([np.array([anchor], dtype=dtype), chunk.astype(dtype)]))
    return rows


def midpoints_of(mode_name: str) -> np.ndarray:
    """Positive rounding midpoints of the mode's code values that lie inside its clamp range
    (int8 per tensor: and 127.5, whose negative is one)."""
    mode = oracle.ORACLE_MODES[mode_name]
    if mode.code == "int8":
        # A static scale can put y anywhere, -127.5 (a tie that rounds to -128) too.
        top = 128 if mode.granularity == "per_tensor" else 127
        return np.arange(0, top, dtype=np.float64) + 0.5
    mids = oracle._ENCODERS[mode.code].midpoints
    return mids[mids < float(mode.qmax)]


def below_qmax(mode_name: str) -> float:
    """The largest code value below QMAX."""
    mode = oracle.ORACLE_MODES[mode_name]
    if mode.code == "int8":
        return float(mode.qmax) - 1
    magnitudes = oracle._ENCODERS[mode.code].magnitudes
    return float(magnitudes[magnitudes < float(mode.qmax)].max())


def midpoint_rows(mode_name: str, dtype) -> list[np.ndarray]:
    """Rows whose y values land exactly on every midpoint, and on their neighbours.

    Per-token-head: the anchor QMAX * 2^-4 makes the scale exactly 2^-4, so y = x * 2^4 is
    exact. Per-tensor: x = midpoint * STATIC_SCALE is exact and x / s gives the midpoint back.
    """
    mode = oracle.ORACLE_MODES[mode_name]
    mids = midpoints_of(mode_name)
    mids = np.concatenate([mids, -mids])
    factor = float(STATIC_SCALE) if mode.granularity == "per_tensor" else 2.0**-4
    x = (mids * factor).astype(dtype)
    exact = x.astype(np.float64) == mids * factor
    # bfloat16 (8 significant bits) cannot hold int8's upper midpoints times a static scale of
    # 2 significant bits; every other case is exact, and those keep all their midpoints.
    assert exact.all() or (mode.granularity == "per_tensor" and mode.code == "int8"), "midpoints must be exact"
    x = x[exact]
    x = np.concatenate([x, neighbours(x)])
    return pack_rows(x, float(mode.qmax) * factor, dtype)


def special_rows(mode_name: str, dtype, rng: np.random.Generator) -> list[np.ndarray]:
    mode = oracle.ORACLE_MODES[mode_name]
    info = ml_dtypes.finfo(dtype) if dtype is ml_dtypes.bfloat16 else np.finfo(dtype)
    big, tiny, sub = float(info.max), float(info.smallest_normal), float(info.smallest_subnormal)
    D = D_ROWS

    def normal(scale=1.0):
        return rng.standard_normal(D) * scale

    rows = [normal() for _ in range(6)]
    rows += [rng.standard_t(2, D) * 3 for _ in range(3)]
    outlier = normal()
    outlier[[1, 7]] *= 100
    rows.append(outlier)
    rows += [normal(1e-3), normal(1e-30) if big > 1e30 else normal(1e-6)]
    # Around the floor: absmax / QMAX just below, at, and just above SCALE_FLOOR.
    at_floor = float(mode.qmax) * 1e-6
    for f in (0.5, 0.999, 1.0, 1.001, 2.0):
        r = rng.uniform(-1, 1, D) * at_floor * f
        r[3] = -at_floor * f
        rows.append(r)
    rows += [np.zeros(D), -np.zeros(D), np.where(rng.random(D) < 0.5, 0.0, -0.0)]
    r = normal()
    r[5] = np.nan
    rows += [r, np.full(D, np.nan)]
    for infs in ([np.inf], [-np.inf], [np.inf, -np.inf], [np.inf, np.nan]):
        r = normal()
        r[: len(infs)] = infs
        rng.shuffle(r)
        rows.append(r)
    r = normal()
    r[0] = -0.0
    rows.append(r)
    # Subnormals of the input dtype, alone and inside a normal row.
    rows.append(np.array([sub, -sub, tiny - sub, -(tiny - sub)] + list(rng.integers(-40, 40, D - 4) * sub)))
    r = normal()
    r[2:6] = [sub, -sub, 3 * sub, -(tiny - sub)]
    rows.append(r)
    # The largest finite values of the dtype.
    rows.append(np.array([big, -big] + list(rng.uniform(-big, big, D - 2))))
    rows.append(np.array([big] * 4 + [-big] * 4 + list(rng.uniform(-big, big, D - 8))))
    # Beyond the clamp (per-tensor: |x / s| > QMAX, the midpoint past QMAX, where rounding
    # without the clamp would leave the range, and x / s overflowing float32).
    if mode.granularity == "per_tensor":
        s, q = float(STATIC_SCALE), float(mode.qmax)
        past = q + (q - below_qmax(mode_name)) / 2
        over = [(q + 1) * s, -(q + 1) * s, past * s, 1000 * s, -1e4 * s, q * s, (q - 1) * s]
        rows.append(np.array(over + list(normal())[: D - len(over)]))
    out = [np.asarray(r, dtype=np.float64).astype(dtype) for r in rows]
    return out + midpoint_rows(mode_name, dtype)


# --------------------------------------------------------------------------------------------
# int4 rows (SPEC.md section 2's int4 rows, 3.5)


def int4_decoded(packed: np.ndarray, scales: np.ndarray, mode_name: str) -> np.ndarray:
    """What dequantize returns: the stored-domain decode, un-rotated in float32 (SPEC.md 3.4, 3.5)."""
    decoded = oracle.int4_decode_rows(packed, scales)
    return oracle.int4_unrotate(decoded) if mode_name == "int4_per_token_head" else decoded


def int4_stored_midpoint_rows(dtype, with_neighbours: bool) -> list[np.ndarray]:
    """Stored-domain rows r whose y = r / scale + zp land on every midpoint n + 1/2 of the
    codes (with_neighbours: and on their neighbours in the input dtype): r[0] = -zp * 2^-4 and
    r[1] = (15 - zp) * 2^-4 make the scale exactly 2^-4 and the zero point zp. One row has zp 0
    and y = 0.5 - 2^-25 (float32), which the float32 add of 0.5 rounds up to code 1."""
    step = 2.0**-4
    rows = []
    for zp in (0, 3, 8, 15):
        mids = (np.arange(15) + 0.5 - zp) * step
        x = mids.astype(dtype)
        assert np.all(x.astype(np.float64) == mids), "int4 midpoints must be exact"
        values = np.concatenate([x, neighbours(x[x != 0])]) if with_neighbours else x
        for start in range(0, len(values), D_ROWS - 2):
            chunk = values[start : start + D_ROWS - 2]
            chunk = np.concatenate([chunk, np.resize(chunk, D_ROWS - 2 - len(chunk))])
            rows.append(np.concatenate([np.array([-zp * step, (15 - zp) * step], dtype=dtype), chunk]))
    if dtype is np.float32:
        r = np.zeros(D_ROWS, np.float32)
        r[1], r[2:] = 15.0, np.float32(0.5 - 2.0**-25)
        rows.append(r)
    return rows


def int4_special_rows(mode_name: str, dtype, rng: np.random.Generator) -> list[np.ndarray]:
    info = ml_dtypes.finfo(dtype) if dtype is ml_dtypes.bfloat16 else np.finfo(dtype)
    big, tiny, sub = float(info.max), float(info.smallest_normal), float(info.smallest_subnormal)
    D = D_ROWS

    def normal(scale=1.0):
        return rng.standard_normal(D) * scale

    rows = [normal() for _ in range(6)] + [rng.standard_t(2, D) * 3 for _ in range(3)]
    outlier = normal()
    outlier[[1, 7]] *= 100
    rows += [outlier, normal(1e-3), normal(1e-30) if big > 1e30 else normal(1e-6)]
    # Around the scale floor: range / 15 just below, at and above SCALE_FLOOR.
    for f in (0.25, 0.5, 1.0, 2.0, 4.0):
        rows.append(rng.uniform(-0.5, 0.5, D) * 15e-6 * f)
    rows += [np.zeros(D), -np.zeros(D), np.where(rng.random(D) < 0.5, 0.0, -0.0)]
    r = normal()
    r[5] = np.nan
    rows += [r, np.full(D, np.nan)]
    for infs in ([np.inf], [-np.inf], [np.inf, -np.inf], [np.inf, np.nan]):
        r = normal()
        r[: len(infs)] = infs
        rng.shuffle(r)
        rows.append(r)
    # Rows of one sign (kvzoo's range holds 0, SPEC.md 3.6), constant rows, and e_0 (which the
    # rotation makes constant).
    rows += [np.linspace(1.0, 2.0, D), -np.linspace(0.5, 3.0, D), np.full(D, 2.5), np.eye(D)[0] * 3]
    # Subnormals of the input dtype, alone and inside a normal row.
    rows.append(np.array([sub, -sub, tiny - sub, -(tiny - sub)] + list(rng.integers(-40, 40, D - 4) * sub)))
    r = normal()
    r[2:6] = [sub, -sub, 3 * sub, -(tiny - sub)]
    rows.append(r)
    # The largest finite values: max - min overflows float32 (or, rotated, the butterfly
    # does); a float16 row whose rotation overflows float16 when narrowed.
    rows.append(np.array([big, -big] + list(rng.uniform(-1, 1, D - 2))))
    rows.append(np.array([big] + list(rng.uniform(0, 1, D - 1))))
    rows.append(10000.0 * oracle.int4_rht_signs(D).astype(np.float64))
    out = [np.asarray(r, dtype=np.float64).astype(dtype) for r in rows]
    if mode_name != "int4_per_token_head":
        return out + int4_stored_midpoint_rows(dtype, with_neighbours=True)
    # The rows whose rotation gives the midpoint rows back: R^T r / D, exact in float32 and
    # float16 (sums of a few bits over a power of two); bfloat16 keeps those it holds. (The
    # neighbours of a midpoint do not survive the rotation: their inverse is not exact.)
    back = [oracle.int4_unrotate_f64(r.astype(np.float64)) for r in int4_stored_midpoint_rows(dtype, False)]
    return out + [b.astype(dtype) for b in back if np.all(b.astype(dtype).astype(np.float64) == b)]


def build_int4_rows_file(mode_name: str, dtype_name: str) -> tuple[str, dict]:
    name = f"rows-{mode_name}-nearest-{dtype_name}.npz"
    dtype = DTYPES[dtype_name]
    x = np.stack(int4_special_rows(mode_name, dtype, rng_for(name)))
    packed, scales = oracle.int4_quantize_rows(x, mode_name)
    arrays = {
        "meta": meta(kind="rows", mode=mode_name, rounding="nearest", dtype=dtype_name, static_scale_bits=None),
        "x": bits(x),
        "codes": packed,
        "scales": bits(scales),
        "decoded": decoded_bits(int4_decoded(packed, scales, mode_name)),
    }
    return name, arrays


def build_rows_file(mode_name: str, rounding: str, dtype_name: str) -> tuple[str, dict]:
    if mode_name in INT4_MODES:
        return build_int4_rows_file(mode_name, dtype_name)
    name = f"rows-{mode_name}-{rounding}-{dtype_name}.npz"
    dtype = DTYPES[dtype_name]
    x = np.stack(special_rows(mode_name, dtype, rng_for(name)))
    per_tensor = oracle.ORACLE_MODES[mode_name].granularity == "per_tensor"
    static = STATIC_SCALE if per_tensor else None
    codes, scales = oracle.quantize_rows(x, mode_name, rounding=rounding, static_scale=static)
    decoded = oracle.decode_rows(codes, scales, mode_name)
    arrays = {
        "meta": meta(
            kind="rows",
            mode=mode_name,
            rounding=rounding,
            dtype=dtype_name,
            static_scale_bits=int(bits(np.array([static]))[0]) if per_tensor else None,
        ),
        "x": bits(x),
        "codes": codes,
        "scales": bits(scales),
        "decoded": decoded_bits(decoded),
    }
    return name, arrays


# --------------------------------------------------------------------------------------------
# cache writes, gathers, inline pages


def cache_inputs(rng, dtype, T, H, D):
    key = rng.standard_normal((T, H, D))
    value = rng.standard_normal((T, H, D)) * 0.1
    key[1, 0, 3] = np.nan
    key[2, H - 1, :] = 0.0
    value[3, 0, 0] = -np.inf
    value[4, 0, 1:4] = 1e-7
    return key.astype(dtype), value.astype(dtype)


def int4_write(key, value, slots, block_size, mode_name, caches, scale_caches):
    """The oracle's int4 rows written into copies of the caches at their slots."""
    caches = [c.copy() for c in caches]
    scale_caches = [c.copy() for c in scale_caches]
    for rows, cache, scale_cache in zip((key, value), caches, scale_caches):
        for t, slot in enumerate(slots.tolist()):
            if slot >= 0:
                block, offset = divmod(slot, block_size)
                cache[block, offset], scale_cache[block, offset] = oracle.int4_quantize_rows(rows[t], mode_name)
    return caches[0], caches[1], scale_caches[0], scale_caches[1]


def int4_gather(cache, scale_cache, block_tables, seq_lens, mode_name):
    decoded = int4_decoded(cache, scale_cache, mode_name)
    bs = cache.shape[1]
    rows = [decoded[block_tables[s, i // bs], i % bs] for s, n in enumerate(seq_lens.tolist()) for i in range(n)]
    return np.stack(rows)


def granularity(mode_name: str) -> str:
    return "per_token_head" if mode_name in INT4_MODES else oracle.ORACLE_MODES[mode_name].granularity


def build_cache_file(mode_name: str, rounding: str, dtype_name: str) -> tuple[str, dict]:
    name = f"cache-{mode_name}-{rounding}-{dtype_name}.npz"
    rng = rng_for(name)
    dtype = DTYPES[dtype_name]
    NB, BS, H, D, T = 4, 4, 2, 16, 12
    int4 = mode_name in INT4_MODES
    g = granularity(mode_name)
    key, value = cache_inputs(rng, dtype, T, H, D)
    slots = rng.permutation(NB * BS)[:T].astype(np.int64)
    slots[[0, 7]] = -1
    shape = (NB, BS, H, D // 2 if int4 else D)  # int4: two codes a byte
    if g == "none":
        code_dtype = np.dtype(dtype)
        before = [
            rng.integers(0, 2 ** (8 * code_dtype.itemsize), shape).astype(bits(key).dtype).view(dtype) for _ in range(2)
        ]
    else:
        before = [rng.integers(0, 256, shape).astype(np.uint8) for _ in range(2)]
    scale_before = [None, None]
    if g == "per_token_head":
        scale_before = [rng.integers(0, 2**32, shape[:3]).astype(np.uint32).view(np.float32) for _ in range(2)]
    statics = (STATIC_SCALE, STATIC_V_SCALE) if g == "per_tensor" else (None, None)
    if int4:
        after = int4_write(key, value, slots, BS, mode_name, before, scale_before)
    else:
        after = oracle.reshape_and_cache(
            key,
            value,
            slots,
            mode_name=mode_name,
            num_blocks=NB,
            block_size=BS,
            rounding=rounding,
            k_scale=statics[0],
            v_scale=statics[1],
            key_cache=before[0],
            value_cache=before[1],
            k_scale_cache=scale_before[0],
            v_scale_cache=scale_before[1],
        )
    seq_lens = np.array([5, 1, 9, 0], dtype=np.int32)
    block_tables = np.full((4, 3), -1, dtype=np.int32)
    for s, n in enumerate(seq_lens):
        used = -(-int(n) // BS)
        block_tables[s, :used] = rng.choice(NB, used, replace=False)
    gathered = [
        int4_gather(after[i], after[i + 2], block_tables, seq_lens, mode_name)
        if int4
        else oracle.gather_dequantize(after[i], after[i + 2], block_tables, seq_lens, mode_name, statics[i])
        for i in range(2)
    ]
    arrays = {
        "meta": meta(
            kind="cache",
            mode=mode_name,
            rounding=rounding,
            dtype=dtype_name,
            num_blocks=NB,
            block_size=BS,
            k_scale_bits=None if statics[0] is None else int(bits(np.array([statics[0]]))[0]),
            v_scale_bits=None if statics[1] is None else int(bits(np.array([statics[1]]))[0]),
        ),
        "key": bits(key),
        "value": bits(value),
        "slot_mapping": slots,
        "block_tables": block_tables,
        "seq_lens": seq_lens,
        "key_gathered": decoded_bits(gathered[0]),
        "value_gathered": decoded_bits(gathered[1]),
    }
    for i, which in enumerate(("key_cache", "value_cache")):
        arrays[which + "_before"] = before[i] if g != "none" else bits(before[i])
        arrays[which] = after[i] if g != "none" else bits(after[i])
    if g == "per_token_head":
        for i, which in enumerate(("k_scale_cache", "v_scale_cache")):
            arrays[which + "_before"] = bits(scale_before[i])
            arrays[which] = bits(after[i + 2])
    return name, arrays


def build_inline_file(mode_name: str) -> tuple[str, dict]:
    name = f"inline-{mode_name}.npz"
    rng = rng_for(name)
    NB, BS, H, D, T = 3, 2, 2, 8, 5
    key, value = cache_inputs(rng, ml_dtypes.bfloat16, T, H, D)
    slots = np.array([4, 0, -1, 3, 5], dtype=np.int64)
    buf_before = rng.integers(0, 256, (NB, 2, BS, H, D + 4)).astype(np.uint8)
    kc, vc, ks, vs = oracle.unpack_inline(buf_before)
    after = oracle.reshape_and_cache(
        key,
        value,
        slots,
        mode_name=mode_name,
        num_blocks=NB,
        block_size=BS,
        key_cache=kc,
        value_cache=vc,
        k_scale_cache=ks,
        v_scale_cache=vs,
    )
    arrays = {
        "meta": meta(
            kind="inline",
            mode=mode_name,
            rounding="nearest",
            dtype="bfloat16",
            num_blocks=NB,
            block_size=BS,
            num_kv_heads=H,
            head_size=D,
        ),
        "key": bits(key),
        "value": bits(value),
        "slot_mapping": slots,
        "buf_before": buf_before,
        "buf": oracle.pack_inline(*after),
    }
    return name, arrays


# --------------------------------------------------------------------------------------------


def build_all() -> dict[str, bytes]:
    files = []
    for mode_name in QUANT_MODES + INT4_MODES:
        for rounding in roundings(mode_name):
            for dtype_name in DTYPES:
                files.append(build_rows_file(mode_name, rounding, dtype_name))
    for mode_name in ("none",) + QUANT_MODES + INT4_MODES:
        for rounding in roundings(mode_name):
            for dtype_name in DTYPES:
                files.append(build_cache_file(mode_name, rounding, dtype_name))
    for mode_name in PER_TOKEN_HEAD:
        files.append(build_inline_file(mode_name))
    return {name: npz_bytes(arrays) for name, arrays in files}


def check(folder: Path = HERE) -> list[str]:
    """Differences between the files on disk and a fresh generation (empty list: identical)."""
    fresh = build_all()
    on_disk = {p.name for p in folder.glob("*.npz")}
    problems = [f"missing: {n}" for n in sorted(set(fresh) - on_disk)]
    problems += [f"not generated by this script: {n}" for n in sorted(on_disk - set(fresh))]
    problems += [f"differs: {n}" for n in sorted(set(fresh) & on_disk) if (folder / n).read_bytes() != fresh[n]]
    return problems


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        problems = check()
        for p in problems:
            print(p)
        print("golden vectors: " + ("MISMATCH" if problems else "identical"))
        return 1 if problems else 0
    if argv:
        print(__doc__)
        return 2
    for old in HERE.glob("*.npz"):
        old.unlink()
    files = build_all()
    for name, data in files.items():
        (HERE / name).write_bytes(data)
    print(f"wrote {len(files)} files, {sum(map(len, files.values()))} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
