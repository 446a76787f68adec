// RMSNorm with the residual add before it, in one launch: x_out = x + delta (rounded to the
// dtype, as torch's add), out = x_out * rsqrt(mean(x_out^2) + eps) * weight (fp32 inside,
// rounded once). A decoder layer adds each sublayer's output to the residual stream and
// normalizes the sum for the next sublayer; in torch that is two kernels per sublayer, and at
// batch 1 on an H200 every kernel of a decode step costs microseconds of launch and tail
// whatever its size. Without delta it is the plain norm (the first layer's input norm).
//
// One 256-thread block per row; each thread loads 8 elements of the row before it uses any (a
// decode step has one row, so its latency is the kernel's), sums their squares in fp32, and the
// block adds the warps' sums in a fixed order: the same bits on every run. The block body is
// __host__ __device__: simt.cuh runs it on a CPU (lsq_emulate_add_rms_norm) for tests without
// a GPU.

#include <math.h>
#include <stdint.h>

#include "common.cuh"
#include "simt.cuh"

namespace lsq_rms {

using namespace lsq_simt;

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kBatch = 8;  // elements a thread loads before it uses any

struct Params {
  const uint8_t* x;
  const uint8_t* delta;  // nullptr: no residual add
  uint8_t* x_out;
  uint8_t* out;
  const uint8_t* weight;
  int64_t x_st, d_st, xo_st, o_st;  // elements between rows
  int n, kind, bytes;
  float eps;
};

LSQ_HD float rsqrt(float v) {
#ifdef __CUDA_ARCH__
  return rsqrtf(v);
#else
  return 1.f / sqrtf(v);
#endif
}

// The row's sum of squares of x (+ delta), storing x + delta when there is a delta.
LSQ_HD float sum_squares(const Params& p, const uint8_t* x, const uint8_t* delta,
                         uint8_t* x_out, int tid) {
  float ss = 0.f;
  for (int base = tid; base < p.n; base += kThreads * kBatch) {
    float v[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int i = base + j * kThreads;
      v[j] = i < p.n ? load_as_float(x, i, p.kind) : 0.f;
    }
    if (delta != nullptr) {
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int i = base + j * kThreads;
        if (i < p.n) v[j] = round_to(fadd_rn(v[j], load_as_float(delta, i, p.kind)), p.kind);
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int i = base + j * kThreads;
        if (i < p.n) store_from_float(x_out, i, v[j], p.kind);
      }
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) ss += v[j] * v[j];
  }
  return ss;
}

// The block's total of each thread's value, in a fixed order, known to every thread.
LSQ_HD float block_sum(float v, float* partial, int tid) {
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1) v += shfl_xor(v, o);
  if ((tid & 31) == 0) partial[tid >> 5] = v;
  block_sync();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total += partial[w];
  return total;
}

LSQ_HD void norm_block(const Params& p, unsigned row, int tid, float* partial) {
  const uint8_t* x = p.x + row * p.x_st * p.bytes;
  const uint8_t* delta = p.delta ? p.delta + row * p.d_st * p.bytes : nullptr;
  uint8_t* x_out = p.x_out ? p.x_out + row * p.xo_st * p.bytes : nullptr;
  const float ss = block_sum(sum_squares(p, x, delta, x_out, tid), partial, tid);
  const float rstd = rsqrt(ss / static_cast<float>(p.n) + p.eps);
  // the sum as stored (each thread rereads only what it wrote: no barrier needed)
  const uint8_t* s = delta ? x_out : x;
  uint8_t* out = p.out + row * p.o_st * p.bytes;
  for (int base = tid; base < p.n; base += kThreads * kBatch) {
    float v[kBatch], w[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int i = base + j * kThreads;
      v[j] = i < p.n ? load_as_float(s, i, p.kind) : 0.f;
      w[j] = i < p.n ? load_as_float(p.weight, i, p.kind) : 0.f;
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int i = base + j * kThreads;
      if (i < p.n) store_from_float(out, i, v[j] * rstd * w[j], p.kind);
    }
  }
}

__global__ void __launch_bounds__(kThreads) norm_kernel(const Params p) {
  grid_dependency_wait();  // nothing before it: the grids before this one may still run
  launch_dependents();
  __shared__ float partial[kWarps];
  norm_block(p, blockIdx.x, threadIdx.x, partial);
}

static inline bool aligned(const void* ptr, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

static int entry(const void* x, int64_t x_stride, const void* delta, int64_t delta_stride,
                 void* x_out, int64_t x_out_stride, const void* weight, void* out,
                 int64_t out_stride, int64_t rows, int64_t n, int32_t kind, float eps,
                 void* stream, bool emulated) {
  LSQ_REQUIRE(kind == LSQ_KIND_FP32 || kind == LSQ_KIND_BF16 || kind == LSQ_KIND_FP16);
  LSQ_REQUIRE(rows >= 0 && rows <= 0x7fffffff && n >= 1 && n <= 0x7fffffff);
  LSQ_REQUIRE(x_stride >= n && out_stride >= n && eps >= 0.f);
  LSQ_REQUIRE(delta == nullptr || (delta_stride >= n && x_out_stride >= n));
  if (rows == 0) return 0;
  const int bytes = kind == LSQ_KIND_FP32 ? 4 : 2;
  LSQ_REQUIRE(x && weight && out && aligned(x, bytes) && aligned(weight, bytes));
  LSQ_REQUIRE(aligned(out, bytes));
  LSQ_REQUIRE(delta == nullptr || (x_out && aligned(delta, bytes) && aligned(x_out, bytes)));
  const Params p{static_cast<const uint8_t*>(x),
                 static_cast<const uint8_t*>(delta),
                 static_cast<uint8_t*>(delta ? x_out : nullptr),
                 static_cast<uint8_t*>(out),
                 static_cast<const uint8_t*>(weight),
                 x_stride,
                 delta_stride,
                 x_out_stride,
                 out_stride,
                 static_cast<int>(n),
                 kind,
                 bytes,
                 eps};
  if (emulated) {
#ifndef __CUDA_ARCH__
    emulate::run_grid(static_cast<unsigned>(rows), 1, 1, kThreads, kWarps * sizeof(float),
                      [&](unsigned r, unsigned, unsigned, int tid, void* smem) {
                        norm_block(p, r, tid, static_cast<float*>(smem));
                      });
#endif
    return 0;
  }
  return lsq_launch(norm_kernel, dim3(static_cast<unsigned>(rows)), dim3(kThreads), 0,
                    static_cast<cudaStream_t>(stream), p);
}

}  // namespace lsq_rms

extern "C" {

// x_out = x + delta and out = rms_norm(x_out) * weight over rows of n elements (strides in
// elements between rows; every tensor of one dtype: 0 fp32, 1 bf16, 2 fp16). delta NULL: out =
// rms_norm(x) * weight and x_out is not written. x_out may be x. Returns 0 when launched,
// cudaErrorInvalidValue (1) for bad arguments (before any CUDA call), else the launch's error.
int lsq_add_rms_norm(const void* x, int64_t x_stride, const void* delta, int64_t delta_stride,
                     void* x_out, int64_t x_out_stride, const void* weight, void* out,
                     int64_t out_stride, int64_t rows, int64_t n, int32_t dtype, float eps,
                     void* stream) {
  return lsq_rms::entry(x, x_stride, delta, delta_stride, x_out, x_out_stride, weight, out,
                        out_stride, rows, n, dtype, eps, stream, false);
}

// lsq_add_rms_norm run on the CPU by the SIMT emulator, on host pointers.
int lsq_emulate_add_rms_norm(const void* x, int64_t x_stride, const void* delta,
                             int64_t delta_stride, void* x_out, int64_t x_out_stride,
                             const void* weight, void* out, int64_t out_stride, int64_t rows,
                             int64_t n, int32_t dtype, float eps) {
  return lsq_rms::entry(x, x_stride, delta, delta_stride, x_out, x_out_stride, weight, out,
                        out_stride, rows, n, dtype, eps, nullptr, true);
}

}  // extern "C"
