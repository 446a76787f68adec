"""Triton GPU kernels: the W4A16 GEMM on the artifact's packed layout, paged attention over
fp16/int8/int4 KV, and the KV write. Tested on the CPU under ``TRITON_INTERPRET=1``."""
