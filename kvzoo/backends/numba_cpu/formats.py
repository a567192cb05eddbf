"""Element kinds the kernels dispatch on (a plain module: importable without numba)."""

F32, BF16, F16, I8, E4M3FN, E4M3FNUZ = 0, 1, 2, 3, 4, 5
