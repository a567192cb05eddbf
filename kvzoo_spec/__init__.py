"""The executable spec of kvzoo: SPEC.md, a plain oracle (oracle.py) and golden vectors.
Nothing here imports kvzoo, so the oracle cannot share its bugs."""
