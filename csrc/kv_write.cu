// Fused KV quantize-and-write: the new tokens' K and V [T, Hkv, D] into their pool slots,
// bit-identical to runtime.kv.format.quantize_kv (and LayerKV.write) for int8/int4 pools, a
// converted store for fp16/bf16 pools. No torch headers; plain C entry points at the end.
//
// One warp per (token, KV head, K or V): 4 per 128-thread block. Slots < 0 are padding and
// skipped (nothing written). The pool is [num_blocks, block_size, Hkv, Dc] contiguous, so a
// slot's row is simply slot * Hkv + head.
//
// The quantizer, every step an exactly rounded operation, as in the reference:
//   x = clamp(float(x), -65504, 65504); lo = min(x), hi = max(x) (warp shuffles; exact)
//   zero  = fp16(lo) rounded to nearest even, then one fp16 step down if it exceeds lo
//   step  = max((hi - zero) / qmax, 2^-24), the difference and the quotient rounded to fp32
//           (the subtraction by __fsub_rn, the quotient as quotient() below explains)
//   scale = fp16(step) rounded to nearest even, then one fp16 step up if it is below step
//   code  = clamp(rint((x - zero) / scale), 0, qmax), rint rounding half to even
// int4 packs element 2i in the low nibble and 2i + 1 in the high one. An fp16/bf16 pool gets
// x converted with round-to-nearest-even, as torch's .to() does.
//
// The block body is __host__ __device__: simt.cuh runs it on a CPU (lsq_emulate_kv_write),
// which the tests compare bit for bit with the reference without a GPU.

#include <math.h>
#include <stdint.h>

#include "common.cuh"
#include "simt.cuh"

namespace lsq_kvw {

using namespace lsq_simt;

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr float kFp16Max = 65504.f;
constexpr float kFp16Tiny = 5.9604644775390625e-08f;  // 2^-24, the smallest fp16 subnormal

struct Params {
  const uint8_t* k;
  const uint8_t* v;
  int64_t k_st, k_sh, v_st, v_sh;  // elements
  int in_dtype;                    // LSQ_KIND_FP32 / BF16 / FP16
  const void* slots;
  int64_t items;  // tokens * heads * 2
  uint8_t* k_cache;
  uint8_t* v_cache;
  uint16_t* k_scale;
  uint16_t* k_zero;
  uint16_t* v_scale;
  uint16_t* v_zero;
  int kind;
  int heads, head_dim;
};

LSQ_HD float load_input(const uint8_t* row, int64_t i, int dtype) {
  if (dtype == LSQ_KIND_FP32) return reinterpret_cast<const float*>(row)[i];
  const uint16_t h = reinterpret_cast<const uint16_t*>(row)[i];
  return dtype == LSQ_KIND_BF16 ? bf16_to_float(h) : half_to_float(h);
}

// The next fp16 towards -inf of a finite h (torch.nextafter(h, -65504) for h > -65504).
LSQ_HD uint16_t fp16_down(uint16_t h) {
  if ((h & 0x7fff) == 0) return 0x8001;  // +-0 -> -2^-24
  return (h & 0x8000) ? h + 1 : h - 1;
}

// RN_fp32(a / b) for a >= 0 and the quantizer's divisors b (qmax, or an fp16 scale: at most 11
// significant bits), from a double reciprocal of b, because the IEEE fp32 division has a slow
// path that ptxas compiles to a subroutine call (with a spilled register on sm_90). Exact:
// three Newton steps take any seed better than 2^-8 to 1 / b within about 2^-52, so
// a * inv is a / b within 2^-51. A quotient that is an fp32 value rounds back to it. Any other
// lies at least 2^-37 (relative) from every fp32 rounding boundary: a boundary M (a midpoint
// between floats) has a 25-bit odd part, so b * M, with at most 36 significant bits, is never
// the 24-bit a, and differs from it by at least a's magnitude times 2^-37. So the double
// product rounds to fp32 as the exact quotient does. Quotients below 2^-126 (subnormal in
// fp32) may not, but they only ever become code 0 or are raised to 2^-24 by the clamp.
LSQ_HD double reciprocal(double b) {
  double y = rcp_approx(b);
#pragma unroll
  for (int i = 0; i < 3; ++i) y = fma(y, fma(-b, y, 1.0), y);
  return y;
}

LSQ_HD float quotient(float a, double inv) {
  return static_cast<float>(static_cast<double>(a) * inv);
}

struct Quantizer {
  uint16_t zero, scale;  // fp16 bits
  float zero_f;
  double inv_scale;  // 1 / scale
  float qmax;
};

LSQ_HD Quantizer make_quantizer(float lo, float hi, int qmax) {
  Quantizer q;
  q.qmax = static_cast<float>(qmax);
  q.zero = float_to_half(lo);
  if (half_to_float(q.zero) > lo) q.zero = fp16_down(q.zero);
  q.zero_f = half_to_float(q.zero);
  const double inv_qmax = qmax == 15 ? 1.0 / 15.0 : 1.0 / 255.0;  // constants, RN doubles
  const float step = fmaxf(quotient(fsub_rn(hi, q.zero_f), inv_qmax), kFp16Tiny);
  q.scale = float_to_half(step);
  if (half_to_float(q.scale) < step) q.scale = static_cast<uint16_t>(q.scale + 1);  // positive
  q.inv_scale = reciprocal(half_to_float(q.scale));
  return q;
}

LSQ_HD uint32_t code_of(float x, const Quantizer& q) {
  x = fminf(fmaxf(x, -kFp16Max), kFp16Max);
  const float r = rint_even(quotient(fsub_rn(x, q.zero_f), q.inv_scale));
  return static_cast<uint32_t>(fminf(fmaxf(r, 0.f), q.qmax));
}

template <typename Slot>
LSQ_HD void write_block(const Params& p, unsigned block, int tid) {
  const int warp = tid >> 5, lane = tid & 31;
  const int64_t item = static_cast<int64_t>(block) * kWarps + warp;
  if (item >= p.items) return;  // warp-uniform, and the block has no barrier
  const int side = static_cast<int>(item & 1), pair = static_cast<int>(item >> 1);
  const int64_t token = pair / p.heads;  // 32-bit division: items < 2^31
  const int head = pair % p.heads;
  const int64_t slot = static_cast<int64_t>(static_cast<const Slot*>(p.slots)[token]);
  if (slot < 0) return;  // padding
  const int D = p.head_dim;
  const int in_bytes = p.in_dtype == LSQ_KIND_FP32 ? 4 : 2;
  const uint8_t* src = side ? p.v + (token * p.v_st + head * p.v_sh) * in_bytes
                            : p.k + (token * p.k_st + head * p.k_sh) * in_bytes;
  const int64_t row = slot * p.heads + head;
  uint8_t* cache = side ? p.v_cache : p.k_cache;

  if (p.kind == LSQ_KIND_FP16 || p.kind == LSQ_KIND_BF16) {
    uint16_t* dst = reinterpret_cast<uint16_t*>(cache) + row * D;
    for (int d = lane; d < D; d += 32) {
      uint16_t h;
      if (p.in_dtype == p.kind)
        h = reinterpret_cast<const uint16_t*>(src)[d];  // same dtype: the bits as they are
      else if (p.kind == LSQ_KIND_FP16)
        h = float_to_half(load_input(src, d, p.in_dtype));
      else
        h = float_to_bf16(load_input(src, d, p.in_dtype));
      dst[d] = h;
    }
    return;
  }

  float lo = INFINITY, hi = -INFINITY;
  for (int d = lane; d < D; d += 32) {
    const float x = fminf(fmaxf(load_input(src, d, p.in_dtype), -kFp16Max), kFp16Max);
    lo = fminf(lo, x);
    hi = fmaxf(hi, x);
  }
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1) {
    lo = fminf(lo, shfl_xor(lo, o));
    hi = fmaxf(hi, shfl_xor(hi, o));
  }
  const bool int4 = p.kind == LSQ_KIND_INT4;
  const Quantizer q = make_quantizer(lo, hi, int4 ? 15 : 255);
  if (int4) {
    uint8_t* dst = cache + row * (D / 2);
    for (int i = lane; i < D / 2; i += 32) {
      const uint32_t c0 = code_of(load_input(src, 2 * i, p.in_dtype), q);
      const uint32_t c1 = code_of(load_input(src, 2 * i + 1, p.in_dtype), q);
      dst[i] = static_cast<uint8_t>(c0 | (c1 << 4));
    }
  } else {
    uint8_t* dst = cache + row * D;
    for (int d = lane; d < D; d += 32)
      dst[d] = static_cast<uint8_t>(code_of(load_input(src, d, p.in_dtype), q));
  }
  if (lane == 0) {
    (side ? p.v_scale : p.k_scale)[row] = q.scale;
    (side ? p.v_zero : p.k_zero)[row] = q.zero;
  }
}

template <typename Slot>
__global__ void __launch_bounds__(kThreads) write_kernel(const Params p) {
  write_block<Slot>(p, blockIdx.x, threadIdx.x);
}

static inline bool aligned(const void* ptr, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

// Every check of the entry points; fills the parameters. No CUDA call.
static int plan_write(const void* k, int64_t k_stride_t, int64_t k_stride_h, const void* v,
                      int64_t v_stride_t, int64_t v_stride_h, int32_t in_dtype,
                      const void* slot_mapping, int64_t num_tokens, void* k_cache,
                      void* v_cache, void* k_scale, void* k_zero, void* v_scale, void* v_zero,
                      int32_t kv_kind, int64_t num_kv_heads, int64_t head_dim,
                      int64_t block_size, int slot_bytes, Params* p, int64_t* blocks) {
  LSQ_REQUIRE(in_dtype == LSQ_KIND_FP32 || in_dtype == LSQ_KIND_BF16 ||
              in_dtype == LSQ_KIND_FP16);
  LSQ_REQUIRE(kv_kind >= LSQ_KIND_BF16 && kv_kind <= LSQ_KIND_INT4);
  const bool quant = kv_kind == LSQ_KIND_INT8 || kv_kind == LSQ_KIND_INT4;
  LSQ_REQUIRE(num_kv_heads >= 1 && num_kv_heads <= 65535 && block_size >= 1);
  LSQ_REQUIRE(head_dim >= 1 && head_dim <= 65536);
  LSQ_REQUIRE(kv_kind != LSQ_KIND_INT4 || head_dim % 2 == 0);  // int4 packs pairs
  LSQ_REQUIRE(num_tokens >= 0 && num_tokens * num_kv_heads * 2 <= 0x7fffffff);
  LSQ_REQUIRE(k_stride_t >= 0 && k_stride_h >= 0 && v_stride_t >= 0 && v_stride_h >= 0);
  if (num_tokens == 0) return 0;
  const int in_bytes = in_dtype == LSQ_KIND_FP32 ? 4 : 2;
  LSQ_REQUIRE(k && v && slot_mapping && k_cache && v_cache);
  LSQ_REQUIRE(aligned(k, in_bytes) && aligned(v, in_bytes) && aligned(slot_mapping, slot_bytes));
  LSQ_REQUIRE(quant || (aligned(k_cache, 2) && aligned(v_cache, 2)));
  if (quant) {
    LSQ_REQUIRE(k_scale && k_zero && v_scale && v_zero);
    LSQ_REQUIRE(aligned(k_scale, 2) && aligned(k_zero, 2) && aligned(v_scale, 2) &&
                aligned(v_zero, 2));
  }
  p->k = static_cast<const uint8_t*>(k);
  p->v = static_cast<const uint8_t*>(v);
  p->k_st = k_stride_t, p->k_sh = k_stride_h, p->v_st = v_stride_t, p->v_sh = v_stride_h;
  p->in_dtype = in_dtype;
  p->slots = slot_mapping;
  p->items = num_tokens * num_kv_heads * 2;
  p->k_cache = static_cast<uint8_t*>(k_cache);
  p->v_cache = static_cast<uint8_t*>(v_cache);
  p->k_scale = static_cast<uint16_t*>(k_scale);
  p->k_zero = static_cast<uint16_t*>(k_zero);
  p->v_scale = static_cast<uint16_t*>(v_scale);
  p->v_zero = static_cast<uint16_t*>(v_zero);
  p->kind = kv_kind;
  p->heads = static_cast<int>(num_kv_heads);
  p->head_dim = static_cast<int>(head_dim);
  *blocks = (p->items + kWarps - 1) / kWarps;
  return 0;
}

template <typename Slot>
int write_entry(const void* k, int64_t k_stride_t, int64_t k_stride_h, const void* v,
                int64_t v_stride_t, int64_t v_stride_h, int32_t in_dtype,
                const void* slot_mapping, int64_t num_tokens, void* k_cache, void* v_cache,
                void* k_scale, void* k_zero, void* v_scale, void* v_zero, int32_t kv_kind,
                int64_t num_kv_heads, int64_t head_dim, int64_t block_size, void* stream,
                bool emulated) {
  Params p;
  int64_t blocks = 0;
  const int err = plan_write(k, k_stride_t, k_stride_h, v, v_stride_t, v_stride_h, in_dtype,
                             slot_mapping, num_tokens, k_cache, v_cache, k_scale, k_zero,
                             v_scale, v_zero, kv_kind, num_kv_heads, head_dim, block_size,
                             sizeof(Slot), &p, &blocks);
  if (err || num_tokens == 0) return err;
  if (emulated) {
#ifndef __CUDA_ARCH__
    emulate::run_grid(static_cast<unsigned>(blocks), 1, 1, kThreads, 0,
                      [&](unsigned x, unsigned, unsigned, int tid, void*) {
                        write_block<Slot>(p, x, tid);
                      });
#endif
    return 0;
  }
  write_kernel<Slot>
      <<<static_cast<unsigned>(blocks), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  return lsq_launch_status();
}

}  // namespace lsq_kvw

extern "C" {

// Quantize (or convert) and store k, v [num_tokens, num_kv_heads, head_dim] (last dim
// contiguous, strides in elements) at slot_mapping[num_tokens] (int64; < 0: skipped). Returns
// 0 when launched (or nothing to do), cudaErrorInvalidValue (1) for bad arguments (checked
// before any CUDA call), else the launch's cudaError_t. Slots are not checked against the pool
// (its size is not an argument): the caller hands out valid slots.
int lsq_kv_write(const void* k, int64_t k_stride_t, int64_t k_stride_h, const void* v,
                 int64_t v_stride_t, int64_t v_stride_h, int32_t in_dtype,
                 const int64_t* slot_mapping, int64_t num_tokens, void* k_cache, void* v_cache,
                 void* k_scale, void* k_zero, void* v_scale, void* v_zero, int32_t kv_kind,
                 int64_t num_kv_heads, int64_t head_dim, int64_t block_size, void* stream) {
  return lsq_kvw::write_entry<int64_t>(k, k_stride_t, k_stride_h, v, v_stride_t, v_stride_h,
                                       in_dtype, slot_mapping, num_tokens, k_cache, v_cache,
                                       k_scale, k_zero, v_scale, v_zero, kv_kind, num_kv_heads,
                                       head_dim, block_size, stream, false);
}

// The same with int32 slots (the CUDA-graph path's static slot buffer).
int lsq_kv_write_i32(const void* k, int64_t k_stride_t, int64_t k_stride_h, const void* v,
                     int64_t v_stride_t, int64_t v_stride_h, int32_t in_dtype,
                     const int32_t* slot_mapping, int64_t num_tokens, void* k_cache,
                     void* v_cache, void* k_scale, void* k_zero, void* v_scale, void* v_zero,
                     int32_t kv_kind, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                     void* stream) {
  return lsq_kvw::write_entry<int32_t>(k, k_stride_t, k_stride_h, v, v_stride_t, v_stride_h,
                                       in_dtype, slot_mapping, num_tokens, k_cache, v_cache,
                                       k_scale, k_zero, v_scale, v_zero, kv_kind, num_kv_heads,
                                       head_dim, block_size, stream, false);
}

// lsq_kv_write run on the CPU by the SIMT emulator (csrc/simt.cuh), on host pointers: for tests
// without a GPU. slot_bytes: 8 (int64 slots) or 4 (int32).
int lsq_emulate_kv_write(const void* k, int64_t k_stride_t, int64_t k_stride_h, const void* v,
                         int64_t v_stride_t, int64_t v_stride_h, int32_t in_dtype,
                         const void* slot_mapping, int32_t slot_bytes, int64_t num_tokens,
                         void* k_cache, void* v_cache, void* k_scale, void* k_zero,
                         void* v_scale, void* v_zero, int32_t kv_kind, int64_t num_kv_heads,
                         int64_t head_dim, int64_t block_size) {
  if (slot_bytes == 8)
    return lsq_kvw::write_entry<int64_t>(k, k_stride_t, k_stride_h, v, v_stride_t, v_stride_h,
                                         in_dtype, slot_mapping, num_tokens, k_cache, v_cache,
                                         k_scale, k_zero, v_scale, v_zero, kv_kind,
                                         num_kv_heads, head_dim, block_size, nullptr, true);
  if (slot_bytes == 4)
    return lsq_kvw::write_entry<int32_t>(k, k_stride_t, k_stride_h, v, v_stride_t, v_stride_h,
                                         in_dtype, slot_mapping, num_tokens, k_cache, v_cache,
                                         k_scale, k_zero, v_scale, v_zero, kv_kind,
                                         num_kv_heads, head_dim, block_size, nullptr, true);
  return static_cast<int>(cudaErrorInvalidValue);
}

}  // extern "C"
