"""The KV pool: its format (spec, quantization, the storage codes the C and Triton kernels
share) and the pool itself. A leaf: engine and kernels import it, it imports neither."""
