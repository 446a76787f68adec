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

// The launch's own error (a bad configuration, a missing architecture), without a sync.
static inline int lsq_launch_status() { return (int)cudaGetLastError(); }
