"""Triton kernels for CUDA and ROCm GPUs (and CPU tensors under TRITON_INTERPRET=1).

write_ops / attention_ops register the implementations; the kernels live in *_kernels.py and
are imported only when a kernel first runs, so a machine without triton still lists them.
"""
