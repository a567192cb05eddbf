"""The executable spec of kvzoo: SPEC.md, a simple oracle, golden vectors, and the vectorized
NumPy implementation. Nothing here imports kvzoo, so the oracle cannot share its bugs."""
