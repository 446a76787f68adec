// SiLU-and-multiply, the gated MLP's middle: out[t, j] = silu(gate_up[t, j]) * gate_up[t, n + j],
// where the fused gate/up GEMM wrote gate and up side by side. As torch computes
// `F.silu(gate) * up` in the activations' dtype: silu(g) = g / (1 + exp(-g)) in fp32, rounded
// to the dtype, then the product in fp32, rounded again. One launch where torch takes two (and
// at batch 1 each kernel's launch and tail cost more than its arithmetic).
//
// Each thread handles kPer elements of one row, kThreads apart (coalesced), loading all of them
// before it computes. The block body is __host__ __device__: simt.cuh runs it on a CPU
// (lsq_emulate_silu_mul) for tests without a GPU.

#include <math.h>
#include <stdint.h>

#include "common.cuh"
#include "simt.cuh"

namespace lsq_silu {

using namespace lsq_simt;

constexpr int kThreads = 256;
constexpr int kPer = 4;
constexpr int kSpan = kThreads * kPer;  // elements of a row per block

struct Params {
  const uint8_t* gate_up;
  uint8_t* out;
  int64_t gu_st, o_st;  // elements between rows
  int n, kind, bytes;
};

LSQ_HD float silu(float g) { return g / (1.f + expf(-g)); }

LSQ_HD void silu_block(const Params& p, unsigned row, unsigned chunk, int tid) {
  const uint8_t* gate = p.gate_up + row * p.gu_st * p.bytes;
  const uint8_t* up = gate + static_cast<int64_t>(p.n) * p.bytes;
  uint8_t* out = p.out + row * p.o_st * p.bytes;
  const int base = static_cast<int>(chunk) * kSpan + tid;
  float g[kPer], u[kPer];
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int i = base + j * kThreads;
    g[j] = i < p.n ? load_as_float(gate, i, p.kind) : 0.f;
    u[j] = i < p.n ? load_as_float(up, i, p.kind) : 0.f;
  }
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int i = base + j * kThreads;
    if (i < p.n) store_from_float(out, i, round_to(silu(g[j]), p.kind) * u[j], p.kind);
  }
}

__global__ void __launch_bounds__(kThreads) silu_kernel(const Params p) {
  grid_dependency_wait();  // nothing before it: the grids before this one may still run
  launch_dependents();
  silu_block(p, blockIdx.x, blockIdx.y, threadIdx.x);
}

static inline bool aligned(const void* ptr, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

static int entry(const void* gate_up, int64_t gate_up_stride, void* out, int64_t out_stride,
                 int64_t rows, int64_t n, int32_t kind, void* stream, bool emulated) {
  LSQ_REQUIRE(kind == LSQ_KIND_FP32 || kind == LSQ_KIND_BF16 || kind == LSQ_KIND_FP16);
  LSQ_REQUIRE(rows >= 0 && rows <= 0x7fffffff && n >= 1 && n <= 65535 * kSpan);
  LSQ_REQUIRE(gate_up_stride >= 2 * n && out_stride >= n);
  if (rows == 0) return 0;
  const int bytes = kind == LSQ_KIND_FP32 ? 4 : 2;
  LSQ_REQUIRE(gate_up && out && aligned(gate_up, bytes) && aligned(out, bytes));
  const Params p{static_cast<const uint8_t*>(gate_up),
                 static_cast<uint8_t*>(out),
                 gate_up_stride,
                 out_stride,
                 static_cast<int>(n),
                 kind,
                 bytes};
  const unsigned chunks = static_cast<unsigned>((n + kSpan - 1) / kSpan);
  if (emulated) {
#ifndef __CUDA_ARCH__
    emulate::run_grid(static_cast<unsigned>(rows), chunks, 1, kThreads, 0,
                      [&](unsigned r, unsigned c, unsigned, int tid, void*) {
                        silu_block(p, r, c, tid);
                      });
#endif
    return 0;
  }
  const dim3 grid(static_cast<unsigned>(rows), chunks);
  return lsq_launch(silu_kernel, grid, dim3(kThreads), 0, static_cast<cudaStream_t>(stream), p);
}

}  // namespace lsq_silu

extern "C" {

// out [rows, n] = silu(gate_up[:, :n]) * gate_up[:, n:2n] (strides in elements between rows;
// one dtype: 0 fp32, 1 bf16, 2 fp16; n <= 65535 * 1024, the grid's y). Returns 0 when launched,
// cudaErrorInvalidValue (1) for bad arguments (before any CUDA call), else the launch's error.
int lsq_silu_mul(const void* gate_up, int64_t gate_up_stride, void* out, int64_t out_stride,
                 int64_t rows, int64_t n, int32_t dtype, void* stream) {
  return lsq_silu::entry(gate_up, gate_up_stride, out, out_stride, rows, n, dtype, stream, false);
}

// lsq_silu_mul run on the CPU by the SIMT emulator, on host pointers.
int lsq_emulate_silu_mul(const void* gate_up, int64_t gate_up_stride, void* out,
                         int64_t out_stride, int64_t rows, int64_t n, int32_t dtype) {
  return lsq_silu::entry(gate_up, gate_up_stride, out, out_stride, rows, n, dtype, nullptr, true);
}

}  // extern "C"
