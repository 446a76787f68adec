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
// With rotary (lsq_rotary_kv_write) the same launch first rotates K (rotate-half, the cos and sin
// of each token's position given as [tokens, D/2] tables in the activations' dtype) and also
// rotates the query heads into q_out: what apply_rotary, then kv_write, did in eight kernels.
// Each product and each sum is rounded to the activations' dtype as torch's elementwise ops
// round them, so the fused result is bit for bit the unfused one.
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
  // rotary: q [T, q_heads, D] rotated into q_out; cos == nullptr: no rotary, q_heads == 0
  const uint8_t* q;
  uint8_t* q_out;
  int64_t q_st, q_sh, qo_st, qo_sh;  // elements
  const uint8_t* cos;
  const uint8_t* sin;
  int64_t rope_st;  // elements between tokens' rows of cos and sin
  int q_heads;
  int per_token;  // items of one token: K and V of each KV head, then each query head
};

// The rotary arguments of lsq_rotary_kv_write, as given.
struct Rope {
  const void* q;
  int64_t q_st, q_sh;
  void* q_out;
  int64_t qo_st, qo_sh;
  int64_t heads;
  const void* cos;
  const void* sin;
  int64_t stride;
};

// x * c - y * s (first half) or x * c + y * s (second half) as apply_rotary's torch ops give it:
// x1 * cos - x2 * sin and x2 * cos + x1 * sin, each product and the sum rounded to the dtype.
LSQ_HD float rotate(float x, float y, float c, float s, bool first_half, int dtype) {
  const float a = round_to(fmul_rn(x, c), dtype), b = round_to(fmul_rn(y, s), dtype);
  return round_to(first_half ? fsub_rn(a, b) : fadd_rn(a, b), dtype);
}

// One head's row of K (or V, or a query head) as the quantizer reads it: rotated or as given.
struct Row {
  const uint8_t* x;
  const uint8_t* cos;  // nullptr: no rotary
  const uint8_t* sin;
  int dtype, half;

  LSQ_HD float at(int d) const {
    const float v = load_as_float(x, d, dtype);
    if (cos == nullptr) return v;
    const bool first = d < half;
    const int i = first ? d : d - half;
    const float partner = load_as_float(x, first ? d + half : d - half, dtype);
    const float c = load_as_float(cos, i, dtype), s = load_as_float(sin, i, dtype);
    return rotate(v, partner, c, s, first, dtype);
  }
};

// A query head rotated into q_out: each lane owns pairs (i, i + D/2), read before either is
// written, so q_out may be q itself.
LSQ_HD void rotate_query(const Params& p, int64_t token, int head, int lane) {
  const int bytes = p.in_dtype == LSQ_KIND_FP32 ? 4 : 2;
  const uint8_t* src = p.q + (token * p.q_st + head * p.q_sh) * bytes;
  uint8_t* dst = p.q_out + (token * p.qo_st + head * p.qo_sh) * bytes;
  const uint8_t* cs = p.cos + token * p.rope_st * bytes;
  const uint8_t* sn = p.sin + token * p.rope_st * bytes;
  const int half = p.head_dim / 2, dt = p.in_dtype;
  for (int i = lane; i < half; i += 32) {
    const float x1 = load_as_float(src, i, dt), x2 = load_as_float(src, i + half, dt);
    const float c = load_as_float(cs, i, dt), s = load_as_float(sn, i, dt);
    store_from_float(dst, i, rotate(x1, x2, c, s, true, dt), dt);
    store_from_float(dst, i + half, rotate(x2, x1, c, s, false, dt), dt);
  }
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
  const int64_t token = static_cast<int>(item) / p.per_token;  // 32-bit: items < 2^31
  const int within = static_cast<int>(item) % p.per_token;
  if (within >= 2 * p.heads) return rotate_query(p, token, within - 2 * p.heads, lane);
  const int side = within & 1, head = within >> 1;
  const int64_t slot = static_cast<int64_t>(static_cast<const Slot*>(p.slots)[token]);
  if (slot < 0) return;  // padding
  const int D = p.head_dim;
  const int in_bytes = p.in_dtype == LSQ_KIND_FP32 ? 4 : 2;
  const uint8_t* src = side ? p.v + (token * p.v_st + head * p.v_sh) * in_bytes
                            : p.k + (token * p.k_st + head * p.k_sh) * in_bytes;
  const bool rotary = !side && p.cos != nullptr;  // V is never rotated
  const Row x{src, rotary ? p.cos + token * p.rope_st * in_bytes : nullptr,
              rotary ? p.sin + token * p.rope_st * in_bytes : nullptr, p.in_dtype, D / 2};
  const int64_t row = slot * p.heads + head;
  uint8_t* cache = side ? p.v_cache : p.k_cache;

  if (p.kind == LSQ_KIND_FP16 || p.kind == LSQ_KIND_BF16) {
    uint16_t* dst = reinterpret_cast<uint16_t*>(cache) + row * D;
    for (int d = lane; d < D; d += 32) {
      uint16_t h;
      if (p.in_dtype == p.kind && !rotary)
        h = reinterpret_cast<const uint16_t*>(src)[d];  // same dtype: the bits as they are
      else if (p.kind == LSQ_KIND_FP16)
        h = float_to_half(x.at(d));
      else
        h = float_to_bf16(x.at(d));
      dst[d] = h;
    }
    return;
  }

  float lo = INFINITY, hi = -INFINITY;
  for (int d = lane; d < D; d += 32) {
    const float x_d = fminf(fmaxf(x.at(d), -kFp16Max), kFp16Max);
    lo = fminf(lo, x_d);
    hi = fmaxf(hi, x_d);
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
      const uint32_t c0 = code_of(x.at(2 * i), q);
      const uint32_t c1 = code_of(x.at(2 * i + 1), q);
      dst[i] = static_cast<uint8_t>(c0 | (c1 << 4));
    }
  } else {
    uint8_t* dst = cache + row * D;
    for (int d = lane; d < D; d += 32)
      dst[d] = static_cast<uint8_t>(code_of(x.at(d), q));
  }
  if (lane == 0) {
    (side ? p.v_scale : p.k_scale)[row] = q.scale;
    (side ? p.v_zero : p.k_zero)[row] = q.zero;
  }
}

template <typename Slot>
__global__ void __launch_bounds__(kThreads) write_kernel(const Params p) {
  grid_dependency_wait();  // nothing before it: the grids before this one may still run
  launch_dependents();
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
                      int64_t block_size, int slot_bytes, const Rope* rope, Params* p,
                      int64_t* blocks) {
  LSQ_REQUIRE(in_dtype == LSQ_KIND_FP32 || in_dtype == LSQ_KIND_BF16 ||
              in_dtype == LSQ_KIND_FP16);
  LSQ_REQUIRE(kv_kind >= LSQ_KIND_BF16 && kv_kind <= LSQ_KIND_INT4);
  const bool quant = kv_kind == LSQ_KIND_INT8 || kv_kind == LSQ_KIND_INT4;
  LSQ_REQUIRE(num_kv_heads >= 1 && num_kv_heads <= 65535 && block_size >= 1);
  LSQ_REQUIRE(head_dim >= 1 && head_dim <= 65536);
  LSQ_REQUIRE(kv_kind != LSQ_KIND_INT4 || head_dim % 2 == 0);  // int4 packs pairs
  const int64_t q_heads = rope ? rope->heads : 0;
  LSQ_REQUIRE(q_heads >= 0 && q_heads <= 65535);
  LSQ_REQUIRE(num_tokens >= 0 && num_tokens * (num_kv_heads * 2 + q_heads) <= 0x7fffffff);
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
  if (rope) {
    LSQ_REQUIRE(head_dim % 2 == 0 && rope->cos && rope->sin && rope->stride >= head_dim / 2);
    LSQ_REQUIRE(aligned(rope->cos, in_bytes) && aligned(rope->sin, in_bytes));
    LSQ_REQUIRE(rope->q_st >= 0 && rope->q_sh >= 0 && rope->qo_st >= 0 && rope->qo_sh >= 0);
    LSQ_REQUIRE(q_heads == 0 || (rope->q && rope->q_out && aligned(rope->q, in_bytes) &&
                                 aligned(rope->q_out, in_bytes)));
  }
  p->q = static_cast<const uint8_t*>(rope ? rope->q : nullptr);
  p->q_out = static_cast<uint8_t*>(rope ? rope->q_out : nullptr);
  p->q_st = rope ? rope->q_st : 0, p->q_sh = rope ? rope->q_sh : 0;
  p->qo_st = rope ? rope->qo_st : 0, p->qo_sh = rope ? rope->qo_sh : 0;
  p->cos = static_cast<const uint8_t*>(rope ? rope->cos : nullptr);
  p->sin = static_cast<const uint8_t*>(rope ? rope->sin : nullptr);
  p->rope_st = rope ? rope->stride : 0;
  p->q_heads = static_cast<int>(q_heads);
  p->per_token = static_cast<int>(num_kv_heads * 2 + q_heads);
  p->k = static_cast<const uint8_t*>(k);
  p->v = static_cast<const uint8_t*>(v);
  p->k_st = k_stride_t, p->k_sh = k_stride_h, p->v_st = v_stride_t, p->v_sh = v_stride_h;
  p->in_dtype = in_dtype;
  p->slots = slot_mapping;
  p->items = num_tokens * p->per_token;
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
                bool emulated, const Rope* rope = nullptr) {
  Params p;
  int64_t blocks = 0;
  const int err = plan_write(k, k_stride_t, k_stride_h, v, v_stride_t, v_stride_h, in_dtype,
                             slot_mapping, num_tokens, k_cache, v_cache, k_scale, k_zero,
                             v_scale, v_zero, kv_kind, num_kv_heads, head_dim, block_size,
                             sizeof(Slot), rope, &p, &blocks);
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
  return lsq_launch(write_kernel<Slot>, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), 0,
                    static_cast<cudaStream_t>(stream), p);
}

// lsq_rotary_kv_write and its emulated twin: the slots' width told, as the emulator's entry is.
static int rotary_entry(const Rope& rope, const void* k, int64_t k_stride_t, int64_t k_stride_h,
                        const void* v, int64_t v_stride_t, int64_t v_stride_h, int32_t in_dtype,
                        const void* slot_mapping, int32_t slot_bytes, int64_t num_tokens,
                        void* k_cache, void* v_cache, void* k_scale, void* k_zero, void* v_scale,
                        void* v_zero, int32_t kv_kind, int64_t num_kv_heads, int64_t head_dim,
                        int64_t block_size, void* stream, bool emulated) {
  if (slot_bytes == 8)
    return write_entry<int64_t>(k, k_stride_t, k_stride_h, v, v_stride_t, v_stride_h, in_dtype,
                                slot_mapping, num_tokens, k_cache, v_cache, k_scale, k_zero,
                                v_scale, v_zero, kv_kind, num_kv_heads, head_dim, block_size,
                                stream, emulated, &rope);
  if (slot_bytes == 4)
    return write_entry<int32_t>(k, k_stride_t, k_stride_h, v, v_stride_t, v_stride_h, in_dtype,
                                slot_mapping, num_tokens, k_cache, v_cache, k_scale, k_zero,
                                v_scale, v_zero, kv_kind, num_kv_heads, head_dim, block_size,
                                stream, emulated, &rope);
  return static_cast<int>(cudaErrorInvalidValue);
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

// Rotary (rotate-half) and KV write in one launch: q [num_tokens, num_heads, head_dim] rotated
// into q_out (may be q), k rotated and written with v as lsq_kv_write writes them. cos and sin
// are [num_tokens, head_dim / 2] rows (rope_stride elements apart) of each token's position,
// in in_dtype. Bit for bit what apply_rotary's torch ops in that dtype and then lsq_kv_write
// give. slot_bytes: 8 (int64 slots) or 4 (int32).
int lsq_rotary_kv_write(const void* q, int64_t q_stride_t, int64_t q_stride_h, void* q_out,
                        int64_t qo_stride_t, int64_t qo_stride_h, int64_t num_heads,
                        const void* cos, const void* sin, int64_t rope_stride, const void* k,
                        int64_t k_stride_t, int64_t k_stride_h, const void* v,
                        int64_t v_stride_t, int64_t v_stride_h, int32_t in_dtype,
                        const void* slot_mapping, int32_t slot_bytes, int64_t num_tokens,
                        void* k_cache, void* v_cache, void* k_scale, void* k_zero,
                        void* v_scale, void* v_zero, int32_t kv_kind, int64_t num_kv_heads,
                        int64_t head_dim, int64_t block_size, void* stream) {
  const lsq_kvw::Rope rope{q, q_stride_t, q_stride_h, q_out, qo_stride_t, qo_stride_h,
                           num_heads, cos, sin, rope_stride};
  return lsq_kvw::rotary_entry(rope, k, k_stride_t, k_stride_h, v, v_stride_t, v_stride_h,
                               in_dtype, slot_mapping, slot_bytes, num_tokens, k_cache, v_cache,
                               k_scale, k_zero, v_scale, v_zero, kv_kind, num_kv_heads,
                               head_dim, block_size, stream, false);
}

// lsq_rotary_kv_write run on the CPU by the SIMT emulator, on host pointers.
int lsq_emulate_rotary_kv_write(const void* q, int64_t q_stride_t, int64_t q_stride_h,
                                void* q_out, int64_t qo_stride_t, int64_t qo_stride_h,
                                int64_t num_heads, const void* cos, const void* sin,
                                int64_t rope_stride, const void* k, int64_t k_stride_t,
                                int64_t k_stride_h, const void* v, int64_t v_stride_t,
                                int64_t v_stride_h, int32_t in_dtype, const void* slot_mapping,
                                int32_t slot_bytes, int64_t num_tokens, void* k_cache,
                                void* v_cache, void* k_scale, void* k_zero, void* v_scale,
                                void* v_zero, int32_t kv_kind, int64_t num_kv_heads,
                                int64_t head_dim, int64_t block_size) {
  const lsq_kvw::Rope rope{q, q_stride_t, q_stride_h, q_out, qo_stride_t, qo_stride_h,
                           num_heads, cos, sin, rope_stride};
  return lsq_kvw::rotary_entry(rope, k, k_stride_t, k_stride_h, v, v_stride_t, v_stride_h,
                               in_dtype, slot_mapping, slot_bytes, num_tokens, k_cache, v_cache,
                               k_scale, k_zero, v_scale, v_zero, kv_kind, num_kv_heads,
                               head_dim, block_size, nullptr, true);
}

}  // extern "C"
