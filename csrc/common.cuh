// Shared by the csrc kernels: the storage-kind codes and the error convention of the C entry
// points. Kept minimal on purpose (any .cu file may include it); everything here is in the
// global namespace with an LSQ_ prefix.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

// runtime.kv.format.STORAGE_KINDS: what a KV pool stores (an unquantized pool by its dtype, else
// its codes). Activation dtypes passed to the entry points use the same numbers.
enum LsqKind : int32_t {
  LSQ_KIND_FP32 = 0,
  LSQ_KIND_BF16 = 1,
  LSQ_KIND_FP16 = 2,
  LSQ_KIND_INT8 = 3,
  LSQ_KIND_INT4 = 4,
};

// Entry points return a cudaError_t as int: 0 = launched. Bad arguments are refused with
// cudaErrorInvalidValue (1) before any CUDA call, so a host without a GPU can test them.
#define LSQ_REQUIRE(cond)                           \
  do {                                              \
    if (!(cond)) return (int)cudaErrorInvalidValue; \
  } while (0)

// Programmatic dependent launch (sm_90+): a kernel launched with it may start while the kernel
// before it in the stream finishes, so its launch and set-up overlap that kernel's tail; it
// must not touch memory the earlier kernels write or read before lsq_simt::grid_dependency_wait()
// (griddepcontrol.wait: returns once they have completed and their writes are visible). Every
// csrc kernel waits first thing (the GEMM after an L2 prefetch of its constant weights) and
// then lets its own dependents launch; a kernel before ours
// that never signals (torch's) simply lets ours launch when it completes. Decode steps, where a
// layer's ten kernels are nearly all csrc ones, gain a launch latency at most kernel
// boundaries. lsq_programmatic_launch (launch.cu) turns it off process-wide (for A/B timing).
bool lsq_pdl_active();  // on, and the current device is sm_90 or newer

// kernel<<<grid, block, smem, stream>>>(args...), with programmatic dependent launch where
// lsq_pdl_active(); returns the launch's own error (a bad configuration, a missing
// architecture) as an int, without a sync, and clears it, so that torch's next launch check
// does not report it as its own.
template <typename... Params, typename... Args>
int lsq_launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
               cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  if (lsq_pdl_active()) {
    attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[0].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = attribute;
    config.numAttrs = 1;
  }
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, static_cast<Args&&>(args)...);
  const cudaError_t last = cudaGetLastError();
  return (int)(err != cudaSuccess ? err : last);
}
