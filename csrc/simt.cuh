// Portable SIMT primitives for the paged-attention and KV-write kernels, and a host emulator
// that runs the very same kernel bodies on a CPU.
//
// Each primitive has two implementations: on the device (__CUDA_ARCH__) the PTX instruction it
// names; on the host a bit-exact or numerically equivalent emulation. A kernel body written as a
// __host__ __device__ function of (block index, thread index, shared memory) then runs either
// as a real kernel or under emulate::run_grid, which executes every thread of a block as a
// fiber (ucontext) and implements the warp collectives (shuffles, mma.sync) and __syncthreads
// as barriers between those fibers. Warp collectives must be reached by all 32 lanes of a warp
// and block barriers by all threads of the block (warp-uniform and block-uniform control flow),
// as on the GPU; the emulator aborts with a message on a deadlock instead of hanging.
//
// The emulation exists for tests without a GPU (the index math of mma fragments, the bit tricks,
// the rounding of the KV quantizer); it is not fast, and it is never used for serving.
#pragma once

#include <stdint.h>
#include <string.h>

#include "common.cuh"

#ifndef __CUDA_ARCH__
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <ucontext.h>

#include <functional>
#include <memory>
#endif
#include <vector>

#define LSQ_HD __host__ __device__ __forceinline__

namespace lsq_simt {

LSQ_HD uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

LSQ_HD float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// ---------------------------------------------------------------------------------------------
// Host emulator (fibers): its options, declared for the device pass too so that host entry
// points may name them.
namespace emulate {

struct Range {
  const uint8_t* begin;
  const uint8_t* end;
};

// What a run checks beyond the PTX semantics it emulates.
struct Options {
  // When cp.async copies reach shared memory: at cp.async.wait_group (the latest the PTX
  // allows, so a stage read before its wait sees stale bytes) or at issue (the earliest, so a
  // copy into a stage another warp still reads overwrites it). A correct pipeline gives the
  // same bits either way.
  bool copies_land_at_issue = false;
  // Global memory the kernel may read with cp.async (every byte a copy names, zero-filled or
  // not): the tensors it was given. Empty: not checked.
  std::vector<Range> readable;
};

}  // namespace emulate

// ---------------------------------------------------------------------------------------------
// The emulator itself. Declared first: the host side of the collectives below calls it.
#ifndef __CUDA_ARCH__
namespace emulate {

struct Barrier {
  int count = 0;
  unsigned generation = 0;
};

// A cp.async in flight: its shared-memory destination and the 16 bytes it will write.
struct PendingCopy {
  uint8_t* dst;
  uint8_t bytes[16];
};

// A thread's cp.async state: committed groups, oldest first, and the group still open.
struct CopyQueue {
  std::vector<std::vector<PendingCopy>> committed;
  std::vector<PendingCopy> open;
};

struct Block {
  int threads = 0;
  int current = 0;       // the running fiber = thread index
  long idle_yields = 0;  // yields since a barrier last opened: a deadlock detector
  ucontext_t main_context;
  std::vector<ucontext_t> context;
  std::vector<char> done;
  Barrier block_barrier;
  std::vector<Barrier> warp_barrier;
  std::vector<uint32_t> exchange;  // 8 words per thread for the collectives
  std::vector<CopyQueue> copies;   // per thread
  uint8_t* shared_begin = nullptr;
  uint8_t* shared_end = nullptr;
  const Options* options = nullptr;
  const std::function<void(int)>* body = nullptr;
};

inline Block*& current_block() {
  static thread_local Block* block = nullptr;
  return block;
}

inline void fail(const char* what) {
  fprintf(stderr, "lsq emulator: %s\n", what);
  abort();
}

// Switch to the next unfinished fiber (round robin); back here when someone switches back.
inline void yield() {
  Block& b = *current_block();
  const int me = b.current;
  for (int k = 1; k <= b.threads; ++k) {
    const int next = (me + k) % b.threads;
    if (b.done[next]) continue;
    if (next == me) return;
    b.current = next;
    swapcontext(&b.context[me], &b.context[next]);
    return;
  }
}

inline void wait(Barrier& bar, int participants) {
  Block& b = *current_block();
  const unsigned generation = bar.generation;
  if (++bar.count == participants) {
    bar.count = 0;
    ++bar.generation;
    b.idle_yields = 0;
    return;
  }
  while (bar.generation == generation) {
    if (++b.idle_yields > 50000000L) fail("deadlock: a barrier that not every thread reaches");
    yield();
  }
}

inline void warp_wait() {
  Block& b = *current_block();
  wait(b.warp_barrier[b.current >> 5], 32);
}

inline uint32_t* exchange_slot(int thread) { return &current_block()->exchange[8 * thread]; }

inline int thread_index() { return current_block()->current; }

inline void fiber_entry() {
  Block& b = *current_block();
  const int me = b.current;
  (*b.body)(me);
  const CopyQueue& q = b.copies[me];
  if (!q.open.empty() || !q.committed.empty())
    fail("a thread exits with cp.async copies not waited for");
  b.done[me] = 1;  // returns to main_context (uc_link)
}

inline void require_shared(const void* p, size_t bytes, size_t align, const char* what) {
  const Block& b = *current_block();
  const uint8_t* u = static_cast<const uint8_t*>(p);
  if (u < b.shared_begin || u + bytes > b.shared_end) fail(what);
  if (reinterpret_cast<uintptr_t>(p) % align) fail(what);
}

// A cp.async of 16 bytes: src_bytes (0..16) read from src now (global memory does not change
// while a kernel runs), the rest zero-filled; it lands at issue or at the wait (Options).
inline void async_copy(void* dst, const void* src, int src_bytes) {
  Block& b = *current_block();
  require_shared(dst, 16, 16, "cp.async: destination not 16-byte aligned shared memory");
  if (src_bytes < 0 || src_bytes > 16) fail("cp.async: src-size outside 0..16");
  if (reinterpret_cast<uintptr_t>(src) % 16) fail("cp.async: source not 16-byte aligned");
  const uint8_t* s = static_cast<const uint8_t*>(src);
  const std::vector<Range>& readable = b.options->readable;
  bool inside = readable.empty();
  for (const Range& r : readable)
    inside |= s >= r.begin && s + (src_bytes > 0 ? src_bytes : 1) <= r.end;
  if (!inside) fail("cp.async: source outside the tensors the kernel was given");
  PendingCopy c;
  c.dst = static_cast<uint8_t*>(dst);
  memset(c.bytes, 0, 16);
  memcpy(c.bytes, src, static_cast<size_t>(src_bytes));
  if (b.options->copies_land_at_issue)
    memcpy(c.dst, c.bytes, 16);
  else
    b.copies[b.current].open.push_back(c);
}

inline void commit_copies() {
  CopyQueue& q = current_block()->copies[current_block()->current];
  q.committed.push_back(std::move(q.open));
  q.open.clear();
}

// cp.async.wait_group n: every committed group but the n most recent has landed.
inline void land_copies(int n) {
  CopyQueue& q = current_block()->copies[current_block()->current];
  while (q.committed.size() > static_cast<size_t>(n)) {
    for (const PendingCopy& c : q.committed.front()) memcpy(c.dst, c.bytes, 16);
    q.committed.erase(q.committed.begin());
  }
}

// Run body(block_x, block_y, block_z, thread, shared) for every thread of every block of the
// grid, one block at a time. `shared` is shared_bytes per block, filled with 0xff bytes (a NaN
// in fp16, bf16 and fp32) as a GPU's is not cleared: a read of shared memory nobody wrote shows.
inline void run_grid(unsigned gx, unsigned gy, unsigned gz, int threads, size_t shared_bytes,
                     const std::function<void(unsigned, unsigned, unsigned, int, void*)>& body,
                     const Options& options = Options()) {
  if (threads <= 0 || threads % 32) fail("blocks must be whole warps");
  constexpr size_t kStack = 256 * 1024;
  std::vector<std::unique_ptr<char[]>> stacks(threads);
  for (auto& s : stacks) s.reset(new char[kStack]);
  // 128-byte aligned, as the GPU's dynamic shared memory
  std::vector<unsigned char> storage(shared_bytes + 128);
  uint8_t* shared = storage.data() + (128 - reinterpret_cast<uintptr_t>(storage.data()) % 128);
  for (unsigned z = 0; z < gz; ++z)
    for (unsigned y = 0; y < gy; ++y)
      for (unsigned x = 0; x < gx; ++x) {
        Block b;
        b.threads = threads;
        b.context.resize(threads);
        b.done.assign(threads, 0);
        b.warp_barrier.resize(threads / 32);
        b.exchange.assign(8 * static_cast<size_t>(threads), 0);
        b.copies.resize(threads);
        b.shared_begin = shared;
        b.shared_end = shared + shared_bytes;
        b.options = &options;
        memset(shared, 0xff, shared_bytes);
        void* smem = shared;
        const std::function<void(int)> per_thread = [&](int t) { body(x, y, z, t, smem); };
        b.body = &per_thread;
        current_block() = &b;
        for (int t = 0; t < threads; ++t) {
          getcontext(&b.context[t]);
          b.context[t].uc_stack.ss_sp = stacks[t].get();
          b.context[t].uc_stack.ss_size = kStack;
          b.context[t].uc_link = &b.main_context;
          makecontext(&b.context[t], fiber_entry, 0);
        }
        for (;;) {
          int next = -1;
          for (int t = 0; t < threads && next < 0; ++t)
            if (!b.done[t]) next = t;
          if (next < 0) break;
          b.current = next;
          swapcontext(&b.main_context, &b.context[next]);
        }
        current_block() = nullptr;
      }
}

// The bits of x rounded to nearest even in a 16-bit IEEE format of P significant bits and
// exponents EMIN..EMAX (fp16: 11, -14, 15; bf16: 8, -126, 127), computed exactly from a double.
template <int P, int EMIN, int EMAX>
inline uint16_t round_from_double(double x) {
  constexpr int M = P - 1;  // stored mantissa bits
  constexpr uint16_t kInf = static_cast<uint16_t>((2 * EMAX + 1) << M);
  const uint16_t sign = signbit(x) ? 0x8000 : 0;
  const double a = fabs(x);
  if (isnan(a)) return kInf | (1 << (M - 1));
  if (isinf(a)) return sign | kInf;
  if (a < ldexp(1.0, EMIN)) {  // subnormal (or zero): a multiple of 2^(EMIN - M)
    const double n = nearbyint(ldexp(a, M - EMIN));  // ties to even in the default mode
    return sign | static_cast<uint16_t>(n);  // n == 2^M is the smallest normal: still right
  }
  int e;
  frexp(a, &e);  // a = m * 2^e, m in [0.5, 1): the exponent of a is e - 1
  double n = nearbyint(ldexp(a, P - e));  // 2^M <= n <= 2^P
  int exponent = e - 1;
  if (n >= ldexp(1.0, P)) {
    n = ldexp(1.0, M);
    ++exponent;
  }
  if (exponent > EMAX) return sign | kInf;
  return sign | static_cast<uint16_t>(((exponent + EMAX) << M) | (static_cast<int>(n) - (1 << M)));
}

inline uint16_t half_from_double(double x) { return round_from_double<11, -14, 15>(x); }
inline uint16_t bf16_from_double(double x) { return round_from_double<8, -126, 127>(x); }

// Exact: every fp16 value is a float. Bit manipulation, since the emulated mma converts 128
// operands per lane and ldexp there took a sixth of the emulator's time.
inline double double_from_half(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact
    const float v = static_cast<float>(mantissa) * 0x1p-24f;
    return sign ? -static_cast<double>(v) : static_cast<double>(v);
  }
  const uint32_t biased = exponent == 31 ? 255 : exponent + 112;  // inf and NaN stay so
  return static_cast<double>(bits_float(sign | (biased << 23) | (mantissa << 13)));
}

}  // namespace emulate
#endif  // !__CUDA_ARCH__

// ---------------------------------------------------------------------------------------------
// Conversions. fp16 and bf16 values travel as their bit patterns (uint16_t), pairs as uint32_t
// with the lower-indexed element in the low half (the layout of mma fragments).

LSQ_HD float half_to_float(uint16_t h) {
#ifdef __CUDA_ARCH__
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#else
  return static_cast<float>(emulate::double_from_half(h));
#endif
}

LSQ_HD uint16_t float_to_half(float f) {  // round to nearest even
#ifdef __CUDA_ARCH__
  uint16_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#else
  return emulate::half_from_double(f);
#endif
}

LSQ_HD float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

LSQ_HD uint16_t float_to_bf16(float f) {  // round to nearest even, as torch
#ifdef __CUDA_ARCH__
  uint16_t h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#else
  uint32_t bits = float_bits(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
#endif
}

// Element i of a row of activations of kind LSQ_KIND_FP32, _BF16 or _FP16, as a float.
LSQ_HD float load_as_float(const void* row, int64_t i, int kind) {
  if (kind == LSQ_KIND_FP32) return static_cast<const float*>(row)[i];
  const uint16_t h = static_cast<const uint16_t*>(row)[i];
  return kind == LSQ_KIND_BF16 ? bf16_to_float(h) : half_to_float(h);
}

// v stored as element i of such a row, rounded to nearest even.
LSQ_HD void store_from_float(void* row, int64_t i, float v, int kind) {
  if (kind == LSQ_KIND_FP32)
    static_cast<float*>(row)[i] = v;
  else
    static_cast<uint16_t*>(row)[i] = kind == LSQ_KIND_BF16 ? float_to_bf16(v) : float_to_half(v);
}

// v rounded to such a row's dtype (exact for fp32): what a torch op in that dtype stores.
LSQ_HD float round_to(float v, int kind) {
  if (kind == LSQ_KIND_BF16) return bf16_to_float(float_to_bf16(v));
  if (kind == LSQ_KIND_FP16) return half_to_float(float_to_half(v));
  return v;
}

LSQ_HD uint32_t pack_half2(float lo, float hi) {
#ifdef __CUDA_ARCH__
  uint32_t r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));  // first source: high half
  return r;
#else
  return static_cast<uint32_t>(float_to_half(lo)) |
         (static_cast<uint32_t>(float_to_half(hi)) << 16);
#endif
}

LSQ_HD uint32_t pack_bf162(float lo, float hi) {
#ifdef __CUDA_ARCH__
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return static_cast<uint32_t>(float_to_bf16(lo)) |
         (static_cast<uint32_t>(float_to_bf16(hi)) << 16);
#endif
}

// ---------------------------------------------------------------------------------------------
// Integer and fp16x2 arithmetic.

// PRMT: byte k of the result is byte (selector nibble k) of the 8-byte value {b, a} (a = bytes
// 0..3). Only the plain selector mode (nibble values 0..7) is used.
LSQ_HD uint32_t prmt(uint32_t a, uint32_t b, uint32_t selector) {
#ifdef __CUDA_ARCH__
  uint32_t r;  // inline PTX: one PRMT, whatever the compiler makes of the masks around it
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(selector));
  return r;
#else
  const uint64_t both = (static_cast<uint64_t>(b) << 32) | a;
  uint32_t r = 0;
  for (int k = 0; k < 4; ++k) {
    const int index = (selector >> (4 * k)) & 7;
    r |= static_cast<uint32_t>((both >> (8 * index)) & 0xff) << (8 * k);
  }
  return r;
#endif
}

// (a & mask) | bits in one LOP3 (plain C gets an AND and an OR when both are immediates).
LSQ_HD uint32_t and_or(uint32_t a, uint32_t mask, uint32_t bits) {
#ifdef __CUDA_ARCH__
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(a), "r"(mask), "r"(bits));
  return r;
#else
  return (a & mask) | bits;
#endif
}

#ifndef __CUDA_ARCH__
namespace emulate {
template <bool BF16 = false>
inline uint32_t half2_op(uint32_t a, uint32_t b, uint32_t c, int op) {
  auto value = [](uint32_t word, int k) {
    const uint16_t h = static_cast<uint16_t>(word >> (16 * k));
    return BF16 ? static_cast<double>(bits_float(static_cast<uint32_t>(h) << 16))
                : double_from_half(h);
  };
  uint32_t r = 0;
  for (int k = 0; k < 2; ++k) {
    const double x = value(a, k), y = value(b, k), z = value(c, k);
    // x * y + z is exact in a double for 16-bit operands of the magnitudes used here
    const double v = op == 0 ? x - y : op == 1 ? x * y + z : (x < y ? x : y);
    r |= static_cast<uint32_t>(BF16 ? bf16_from_double(v) : half_from_double(v)) << (16 * k);
  }
  return r;
}
}  // namespace emulate
#endif

LSQ_HD uint32_t hsub2(uint32_t a, uint32_t b) {  // a - b, each half rounded once
#ifdef __CUDA_ARCH__
  uint32_t r;
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
#else
  return emulate::half2_op(a, b, 0, 0);
#endif
}

LSQ_HD uint32_t hfma2(uint32_t a, uint32_t b, uint32_t c) {  // a * b + c, rounded once
#ifdef __CUDA_ARCH__
  uint32_t r;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
#else
  return emulate::half2_op(a, b, c, 1);
#endif
}

LSQ_HD uint32_t bfma2(uint32_t a, uint32_t b, uint32_t c) {  // bf16x2 a * b + c, rounded once
#ifdef __CUDA_ARCH__
  uint32_t r;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
#else
  return emulate::half2_op<true>(a, b, c, 1);
#endif
}

LSQ_HD uint32_t hmin2(uint32_t a, uint32_t b) {
#ifdef __CUDA_ARCH__
  uint32_t r;
  asm("min.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
#else
  return emulate::half2_op(a, b, 0, 2);
#endif
}

// 2^x; +0 for -inf (the MUFU instruction: about 2 ulp, denormal results flushed to 0).
LSQ_HD float ex2(float x) {
#ifdef __CUDA_ARCH__
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
#else
  return exp2f(x);
#endif
}

// IEEE round-to-nearest arithmetic that the compiler may not contract or approximate.
LSQ_HD float fsub_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  volatile float r = a - b;
  return r;
#endif
}

LSQ_HD float fadd_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  volatile float r = a + b;
  return r;
#endif
}

LSQ_HD float fmul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  volatile float r = a * b;
  return r;
#endif
}

// a / b to about 2 ulp (no IEEE slow path, so no subroutine call); b in [2^-126, 2^126].
LSQ_HD float fdiv_fast(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdividef(a, b);
#else
  return a / b;
#endif
}

// A seed for Newton iterations towards 1 / x (x normal, positive). The device instruction is
// a table-based approximation of about 20 bits; the host stand-in keeps only 8 (bf16), so
// the emulated callers prove that their iterations converge from a worse start.
LSQ_HD double rcp_approx(double x) {
#ifdef __CUDA_ARCH__
  double r;
  asm("rcp.approx.ftz.f64 %0, %1;" : "=d"(r) : "d"(x));
  return r;
#else
  return static_cast<double>(bf16_to_float(float_to_bf16(static_cast<float>(1.0 / x))));
#endif
}

LSQ_HD float rint_even(float x) {  // round half to even
#ifdef __CUDA_ARCH__
  return rintf(x);
#else
  return nearbyintf(x);
#endif
}

// ---------------------------------------------------------------------------------------------
// Global loads through the read-only path: W bytes (16, 8, 4 or 2) at p, aligned to W, into
// words[0 .. max(W / 4, 1)); a 2-byte load fills the low half of words[0] (high half 0).

template <int W>
LSQ_HD void load_global(const void* p, uint32_t* words) {
#ifdef __CUDA_ARCH__
  if constexpr (W == 16) {
    const uint4 v = __ldg(static_cast<const uint4*>(p));
    words[0] = v.x, words[1] = v.y, words[2] = v.z, words[3] = v.w;
  } else if constexpr (W == 8) {
    const uint2 v = __ldg(static_cast<const uint2*>(p));
    words[0] = v.x, words[1] = v.y;
  } else if constexpr (W == 4) {
    words[0] = __ldg(static_cast<const unsigned int*>(p));
  } else {
    static_assert(W == 2, "load widths are 16, 8, 4 or 2 bytes");
    words[0] = __ldg(static_cast<const unsigned short*>(p));
  }
#else
  static_assert(W == 16 || W == 8 || W == 4 || W == 2, "load widths are 16, 8, 4 or 2 bytes");
  if (reinterpret_cast<uintptr_t>(p) % W) emulate::fail("misaligned vector load");
  if constexpr (W >= 4) {
    memcpy(words, p, W);
  } else {
    uint16_t h;
    memcpy(&h, p, 2);
    words[0] = h;
  }
#endif
}

// A hint to bring the 128-byte line holding p into L2 (prefetch.global.L2): it blocks nothing
// and fills no register, so a warp can ask for bytes further ahead than its registers hold.
// The emulator checks that p lies in the tensors the kernel was given (Options::readable, when
// set): a hint to a wrong address is a bug in the index math that would otherwise never show.
LSQ_HD void prefetch_l2(const void* p) {
#ifdef __CUDA_ARCH__
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#else
  const emulate::Block& b = *emulate::current_block();
  const uint8_t* u = static_cast<const uint8_t*>(p);
  bool inside = b.options->readable.empty();
  for (const emulate::Range& r : b.options->readable) inside |= u >= r.begin && u < r.end;
  if (!inside) emulate::fail("prefetch: address outside the tensors the kernel was given");
#endif
}

LSQ_HD uint16_t load_u16(const uint16_t* p) {
#ifdef __CUDA_ARCH__
  return __ldg(reinterpret_cast<const unsigned short*>(p));
#else
  return *p;
#endif
}

// ---------------------------------------------------------------------------------------------
// Asynchronous copies global -> shared (sm_80 cp.async) and shared-memory stores.

// A shared-memory address: 32 bits in the shared window on the device (what the instructions
// take, so address arithmetic stays 32-bit), a pointer into the block's buffer on the host.
#ifdef __CUDA_ARCH__
using SharedAddr = uint32_t;
#else
using SharedAddr = uint8_t*;
#endif

LSQ_HD SharedAddr shared_addr(void* p) {
#ifdef __CUDA_ARCH__
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
#else
  return static_cast<uint8_t*>(p);
#endif
}

// An L2 cache policy for cp_async16_hint: evict first (data read once) or normal.
LSQ_HD uint64_t l2_policy(bool evict_first) {
#ifdef __CUDA_ARCH__
  uint64_t policy;
  if (evict_first)
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  else
    asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(policy));
  return policy;
#else
  return evict_first ? 1 : 0;  // a hint only: the emulated copy ignores it
#endif
}

// 16 bytes to shared dst: src_bytes (0..16) from global src, the rest zero-filled. Lands by
// the cp_async_wait that covers its commit group.
LSQ_HD void cp_async16(SharedAddr dst, const void* src, int src_bytes) {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
#else
  emulate::async_copy(dst, src, src_bytes);
#endif
}

LSQ_HD void cp_async16_hint(SharedAddr dst, const void* src, int src_bytes, uint64_t policy) {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;" ::"r"(dst),
               "l"(src), "r"(src_bytes), "l"(policy)
               : "memory");
#else
  (void)policy;
  emulate::async_copy(dst, src, src_bytes);
#endif
}

LSQ_HD void cp_async_commit() {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.commit_group;" ::: "memory");
#else
  emulate::commit_copies();
#endif
}

// Wait until at most N of this thread's committed groups are still in flight.
template <int N>
LSQ_HD void cp_async_wait() {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#else
  emulate::land_copies(N);
#endif
}

// One 16-byte store to shared memory (dst 16-byte aligned).
LSQ_HD void st_shared_v4(SharedAddr dst, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
#ifdef __CUDA_ARCH__
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(dst), "r"(a), "r"(b), "r"(c),
               "r"(d)
               : "memory");
#else
  emulate::require_shared(dst, 16, 16, "st.shared.v4: not 16-byte aligned shared memory");
  const uint32_t v[4] = {a, b, c, d};
  memcpy(dst, v, 16);
#endif
}

// A fence making this thread's global stores visible to the whole GPU before its later ones
// (__threadfence); the emulator runs blocks one after another, so there it has nothing to do.
LSQ_HD void thread_fence() {
#ifdef __CUDA_ARCH__
  __threadfence();
#endif
}

// A float4 load that bypasses L1 (ld.global.cg): data other blocks wrote during this kernel.
LSQ_HD float4 load_cg(const float* address) {
#ifdef __CUDA_ARCH__
  return __ldcg(reinterpret_cast<const float4*>(address));
#else
  return *reinterpret_cast<const float4*>(address);
#endif
}

// The scalar form of load_cg.
LSQ_HD float load_cg_f32(const float* address) {
#ifdef __CUDA_ARCH__
  return __ldcg(address);
#else
  return *address;
#endif
}

// *address += v, atomically over the GPU; returns the old value.
LSQ_HD uint32_t atomic_add(uint32_t* address, uint32_t v) {
#ifdef __CUDA_ARCH__
  return atomicAdd(address, v);
#else
  const uint32_t old = *address;
  *address = old + v;
  return old;
#endif
}

// ---------------------------------------------------------------------------------------------
// Programmatic dependent launch (common.cuh's lsq_launch). Both are no-ops before sm_90, and on
// the host, where the emulator runs one grid at a time anyway.

// Waits until the grids this one depends on have completed and their writes are visible.
LSQ_HD void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next kernel of the stream (if launched with programmatic serialization) start once
// every block of this grid has called it or exited; it still waits for this grid's completion.
LSQ_HD void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// ---------------------------------------------------------------------------------------------
// Collectives. All lanes of the warp (all threads of the block for block_sync) take part.

LSQ_HD void block_sync() {
#ifdef __CUDA_ARCH__
  __syncthreads();
#else
  emulate::Block& b = *emulate::current_block();
  emulate::wait(b.block_barrier, b.threads);
#endif
}

LSQ_HD uint32_t shfl_idx(uint32_t v, int src_lane) {
#ifdef __CUDA_ARCH__
  return __shfl_sync(0xffffffffu, v, src_lane);
#else
  const int me = emulate::thread_index();
  emulate::exchange_slot(me)[0] = v;
  emulate::warp_wait();
  const uint32_t r = emulate::exchange_slot((me & ~31) | (src_lane & 31))[0];
  emulate::warp_wait();
  return r;
#endif
}

// Whether any lane of the warp has pred set (__any_sync).
LSQ_HD bool warp_any(bool pred) {
#ifdef __CUDA_ARCH__
  return __any_sync(0xffffffffu, pred);
#else
  const int me = emulate::thread_index();
  emulate::exchange_slot(me)[0] = pred ? 1u : 0u;
  emulate::warp_wait();
  bool any = false;
  for (int lane = 0; lane < 32; ++lane) any |= emulate::exchange_slot((me & ~31) | lane)[0] != 0;
  emulate::warp_wait();
  return any;
#endif
}

LSQ_HD float shfl_xor(float v, int lane_mask) {
#ifdef __CUDA_ARCH__
  return __shfl_xor_sync(0xffffffffu, v, lane_mask);
#else
  const int me = emulate::thread_index();
  emulate::exchange_slot(me)[0] = float_bits(v);
  emulate::warp_wait();
  const uint32_t r = emulate::exchange_slot(me ^ (lane_mask & 31))[0];
  emulate::warp_wait();
  return bits_float(r);
#endif
}

// The transpose of the warp's 8x8 matrix of 16-bit elements, whose row g, columns 2t..2t+1
// lane (g, t) holds (low half first); returns row g, columns 2t..2t+1 of the transpose.
LSQ_HD uint32_t movmatrix_trans(uint32_t x) {
#ifdef __CUDA_ARCH__
  uint32_t r;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
  return r;
#else
  const int me = emulate::thread_index();
  emulate::exchange_slot(me)[0] = x;
  emulate::warp_wait();
  const int warp0 = me & ~31, lane = me & 31, g = lane >> 2, t = lane & 3;
  uint32_t r = 0;
  for (int k = 0; k < 2; ++k) {  // element (g, 2t + k) of the transpose = (2t + k, g)
    const uint32_t word = emulate::exchange_slot(warp0 + (2 * t + k) * 4 + g / 2)[0];
    r |= ((word >> (16 * (g % 2))) & 0xffffu) << (16 * k);
  }
  emulate::warp_wait();
  return r;
#endif
}

#ifndef __CUDA_ARCH__
namespace emulate {
// ldmatrix with `count` 8x8 matrices (ldmatrix_x4, ldmatrix_x2): lane 8j + i gives the address
// of row i of matrix j (lanes from 8 count on give none); register j of lane (g, t) receives
// row g, elements 2t..2t+1 of matrix j.
inline void ldmatrix(uint32_t* r, int count, SharedAddr row) {
  const int me = thread_index(), warp0 = me & ~31, lane = me & 31;
  if (lane < 8 * count)
    require_shared(row, 16, 16, "ldmatrix: row not 16-byte aligned shared memory");
  const uintptr_t mine = reinterpret_cast<uintptr_t>(row);
  exchange_slot(me)[0] = static_cast<uint32_t>(mine);
  exchange_slot(me)[1] = static_cast<uint32_t>(static_cast<uint64_t>(mine) >> 32);
  warp_wait();
  for (int j = 0; j < count; ++j) {
    const uint32_t* src = exchange_slot(warp0 + 8 * j + lane / 4);
    const uintptr_t at = static_cast<uintptr_t>(src[0] | (static_cast<uint64_t>(src[1]) << 32));
    memcpy(&r[j], reinterpret_cast<const uint8_t*>(at) + 4 * (lane % 4), 4);
  }
  warp_wait();
}
}  // namespace emulate
#endif

// ldmatrix.x4: four 8x8 matrices of 16-bit elements from shared memory. Lane 8j + i gives the
// address of row i of matrix j (16 bytes, 16-byte aligned); register j of lane (g, t) receives
// row g, elements 2t..2t+1 of matrix j (g = lane / 4, t = lane % 4), the fragment layout of mma.
LSQ_HD void ldmatrix_x4(uint32_t (&r)[4], SharedAddr row) {
#ifdef __CUDA_ARCH__
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(row));
#else
  emulate::ldmatrix(r, 4, row);
#endif
}

// ldmatrix.x2: two 8x8 matrices; lanes 0..15 give the row addresses (the other lanes' are
// ignored); register j as in ldmatrix_x4.
LSQ_HD void ldmatrix_x2(uint32_t (&r)[2], SharedAddr row) {
#ifdef __CUDA_ARCH__
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(row));
#else
  emulate::ldmatrix(r, 2, row);
#endif
}

// d = a * b + c for the warp's m16n8k16 tile, fp32 accumulation; a and b fp16 (BF16 = false)
// or bf16. Fragments as PTX defines them for mma.m16n8k16.row.col (g = lane / 4, t = lane % 4):
//   a[0] (row g, k 2t..2t+1)  a[1] (row g+8, k 2t..)  a[2] (row g, k 2t+8..)
//   a[3] (row g+8, k 2t+8..)
//   b[0] (k 2t..2t+1, col g)  b[1] (k 2t+8.., col g)
//   c[0], c[1] (row g, col 2t, 2t+1)  c[2], c[3] (row g+8, col 2t, 2t+1)
template <bool BF16>
LSQ_HD void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#ifdef __CUDA_ARCH__
  if constexpr (BF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#else
  const int me = emulate::thread_index();
  uint32_t* mine = emulate::exchange_slot(me);
  for (int i = 0; i < 4; ++i) mine[i] = a[i];
  mine[4] = b0, mine[5] = b1;
  emulate::warp_wait();
  const int warp0 = me & ~31, lane = me & 31, g = lane >> 2, t = lane & 3;
  auto element = [](uint32_t word, int high) {
    const uint16_t h = static_cast<uint16_t>(word >> (16 * high));
    return BF16 ? static_cast<double>(bf16_to_float(h)) : emulate::double_from_half(h);
  };
  auto a_at = [&](int row, int k) {  // A[row][k] from the lane that holds it
    const uint32_t* src = emulate::exchange_slot(warp0 + (row % 8) * 4 + (k % 8) / 2);
    return element(src[(row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)], k % 2);
  };
  auto b_at = [&](int k, int col) {
    const uint32_t* src = emulate::exchange_slot(warp0 + col * 4 + (k % 8) / 2);
    return element(src[4 + (k >= 8 ? 1 : 0)], k % 2);
  };
  float d[4];
  for (int i = 0; i < 4; ++i) {
    const int row = g + (i >= 2 ? 8 : 0), col = 2 * t + (i % 2);
    double sum = 0;  // products of 16-bit floats are exact; the sum is rounded once here
    for (int k = 0; k < 16; ++k) sum += a_at(row, k) * b_at(k, col);
    d[i] = static_cast<float>(static_cast<double>(c[i]) + sum);
  }
  emulate::warp_wait();
  for (int i = 0; i < 4; ++i) c[i] = d[i];
#endif
}

}  // namespace lsq_simt
