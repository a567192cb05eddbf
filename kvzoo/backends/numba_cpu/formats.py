"""Element kinds the kernels dispatch on, and the backend's table of code formats (a plain
module: importable without numba)."""

F32, BF16, F16, I8, E4M3FN, E4M3FNUZ, E5M2, U4 = 0, 1, 2, 3, 4, 5, 6, 7

# The backend's table: kvzoo.formats name -> the element kind its kernels dispatch on. A
# format missing here is a mode the registration leaves out (a declared refusal).
FORMAT_KINDS = {
    "int8": I8,
    "float8_e4m3fn": E4M3FN,
    "float8_e4m3fnuz": E4M3FNUZ,
    "float8_e5m2": E5M2,
    "uint4": U4,
}
