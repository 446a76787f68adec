// W4A16 GEMM on the artifact layout `lsq4-mma16x16-v1` (docs/artifact-layout.md).
//
//   y[M, N] = x[M, K] @ W_hat^T,   W_hat[n, k] = q[n, k] * s[n, g] + b[n, g],  b = -z * s
//
// x and y are fp16 or bf16 with row strides; the weights are the artifact's tensors as they are on
// disk: qweight int32 [Kp/16, 2*Np] (one 16x16 tile = 32 words, word t = lane t's mma B fragment)
// and qparams fp16 [Kp/gs, Np, 2] = (s, -z*s). No torch headers: plain C entry points at the end,
// loaded with ctypes and launched on the caller's stream.
//
// Per thread block: a BM x BN tile of y over one contiguous slice of k-steps (split-K: blockIdx.z).
// A k-step of BK columns streams through shared memory in a STAGES-deep cp.async pipeline:
//   A  x[m0 : m0+BM, k0 : k0+BK]      16-byte chunks, XOR-swizzled rows, zero-filled past M and K
//   B  qweight[k0/16 : (k0+BK)/16, 2*n0 : 2*(n0+BN)]   copied as is (tile-major, 128 B per tile)
//   Q  qparams[group(s) of the step, n0 : n0+BN]       the (s, b) pairs, one 32-bit word each
// Each warp owns a (BM/WM) x (BN/WN) sub-tile. Per 16-deep k slice it loads its A fragments with
// ldmatrix.x4 and, per 16x16 weight tile, ONE 32-bit shared load: that word is the B fragment of
// both n8 halves. The word becomes four fp16x2 (or bf16x2) registers with lop3 and magic-number
// arithmetic (no per-element shifts or converts), one fma2 per register applies the group's
// (s, b), and two mma.sync.m16n8k16 (fp32 accumulate) per m16 row tile consume them. The
// swapped decode tiles (SWAP, below) use the same word as the A fragment instead, x^T from
// ldmatrix.x2 as B, and apply (s, b) in fp32 after the mma.
//
// Split-K writes fp32 partials to workspace[split, M, Np] (plain stores, each element written by
// exactly one thread) and lsq_reduce_splits sums them in split order 0, 1, ... into y: the
// result is bit-for-bit reproducible. Without split-K the GEMM writes y directly.
//
// lsq_w4a16_dequantize writes W_hat itself (the same bits the GEMM multiplies) for a dense GEMM
// on it: at prefill-sized M, cuBLAS's wgmma kernels on sm_90 outrun mma.sync by more than the
// write costs (the planner weighs it: runtime/kernels/cuda/gemm_plan.py).
//
// The block body is __host__ __device__ and reaches the hardware only through csrc/simt.cuh:
// lsq_emulate_w4a16_gemm runs it on a CPU (cp.async landing at the latest or the earliest point
// the PTX allows, reads checked against the tensors given), which is how the tests check the
// layout, the pipeline and the tails without a GPU.

#include <stdint.h>

#include <atomic>
#include <type_traits>

#include "common.cuh"
#include "simt.cuh"

namespace lsq_gemm {

using namespace lsq_simt;

constexpr int kDtypeBf16 = 1;  // the project's STORAGE_KINDS codes
constexpr int kDtypeFp16 = 2;

// ---------------------------------------------------------------------------------------------
// Tile configurations. X(id, BM, BN, BK, WM, WN, WK, STAGES, MINB, SWAP): a BM x BN output tile
// per block, BK-deep k-steps, WM x WN x WK warps (WK > 1: the warps split each k-step's 16-deep
// slices WK ways and add their partial tiles in shared memory at the end, in a fixed order),
// STAGES shared-memory buffers, MINB = the blocks per SM that __launch_bounds__ asks registers
// for, SWAP = the operands swapped (below). The only table: the host planner reads it through
// lsq_w4a16_config (runtime/kernels/cuda/gemm_plan.py).
//
// At decode (BM <= 16) a block streams its weights through few instructions per word, and the
// SM's issue rate, not HBM, bounds it unless many warps are resident: WK raises the warps per
// output tile without more blocks or a global split, and the decode tiles are compiled per
// group size (below) so that group boundaries are known at compile time.
//
// SWAP (decode tiles only): the weights are the mma's A operand and x^T its B operand, so one
// m16n8k16 covers 16 output columns by 8 rows of x (a packed word is the A fragment of its 16x16
// tile as it is the B fragment of the transposed one: the same 8 elements per lane). BM is then
// 8 or 16 rows of x, one or two mma per word instead of two. The codes enter the mma as 16 + q,
// exact in fp16 and bf16 with no arithmetic after the mask, and the group's (s, b) is applied in
// fp32 to each warp's sums over its run of a group: y += s * sum(x (16 + q)) + (b - 16 s) sum(x),
// with sum(x) from one more mma against a fragment of ones. No per-weight rounding to 16 bits.
#define LSQ_W4A16_CONFIGS(X)                                                                   \
  X(0, 16, 64, 128, 1, 4, 1, 4, 4, 0)   /* decode: narrow N, 9 KB/stage */                   \
  X(1, 16, 128, 128, 1, 4, 1, 4, 4, 0)  /* decode: 14 KB/stage */                            \
  X(2, 16, 256, 64, 1, 8, 1, 4, 2, 0)   /* decode: wide N, 8 warps */                        \
  X(3, 32, 128, 64, 1, 4, 1, 4, 4, 0)   /* M 17..64 */                                       \
  X(4, 64, 128, 64, 2, 2, 1, 4, 2, 0)   /* M 33..256, and prefill of narrow weights */       \
  X(5, 64, 256, 64, 2, 4, 1, 4, 1, 0)   /* prefill */                                        \
  X(6, 128, 128, 64, 2, 4, 1, 4, 1, 0)  /* prefill */                                        \
  X(7, 128, 256, 64, 2, 4, 1, 3, 1, 0)  /* prefill, the largest tile: 64x64 per warp */      \
  X(8, 16, 128, 128, 1, 4, 2, 4, 2, 0)  /* decode: config 1 with 8 warps, k split 2 ways */  \
  X(9, 16, 64, 128, 1, 2, 4, 4, 2, 0)   /* decode: narrow N, 8 warps, k split 4 ways */      \
  X(10, 8, 128, 128, 1, 4, 1, 4, 4, 1)  /* decode, swapped: M <= 8 */                        \
  X(11, 8, 128, 128, 1, 4, 2, 4, 2, 1)  /* decode, swapped: M <= 8, 8 warps, k split 2 */    \
  X(12, 16, 128, 128, 1, 4, 1, 4, 2, 1) /* decode, swapped: M 9..16 */                     \
  X(13, 16, 128, 128, 1, 4, 2, 4, 2, 1) /* decode, swapped: M 9..16, 8 warps, k split 2 */

struct ConfigInfo {
  int block_m, block_n, block_k, warps, warps_m, warps_k, stages, swap;
};

#define LSQ_INFO(id, bm, bn, bk, wm, wn, wk, st, minb, sw) \
  {bm, bn, bk, (wm) * (wn) * (wk), wm, wk, st, sw},
constexpr ConfigInfo kConfigs[] = {LSQ_W4A16_CONFIGS(LSQ_INFO)};
#undef LSQ_INFO
constexpr int kNumConfigs = sizeof(kConfigs) / sizeof(kConfigs[0]);

#define LSQ_ID(id, bm, bn, bk, wm, wn, wk, st, minb, sw) id,
constexpr int kIds[] = {LSQ_W4A16_CONFIGS(LSQ_ID)};
#undef LSQ_ID
constexpr bool ids_in_order(int i = 0) {
  return i == kNumConfigs || (kIds[i] == i && ids_in_order(i + 1));
}
static_assert(ids_in_order(), "config ids are the rows of LSQ_W4A16_CONFIGS, 0, 1, 2, ...");

template <int BM_, int BN_, int BK_, int WM_, int WN_, int WK_, int STAGES_, int MINB_, int SWAP_>
struct Tile {
  static constexpr int BM = BM_, BN = BN_, BK = BK_, WM = WM_, WN = WN_, WK = WK_;
  static constexpr int STAGES = STAGES_, MINB = MINB_;
  static constexpr bool SWAP = SWAP_ != 0;
  static constexpr int THREADS = 32 * WM * WN * WK;
  static constexpr int TM = BM / WM, TN = BN / WN;  // warp tile
  // m16 row tiles (SWAP: n8 tiles of 8 rows of x), 16x16 weight tiles per warp
  static constexpr int MT = SWAP ? BM / 8 : TM / 16, NT = TN / 16;
  static constexpr int KK = BK / 16;                // 16-deep slices per k-step
  static constexpr int KW = KK / WK;                // of them, one warp's (a contiguous run)
  static constexpr int ACC = MT * NT * (SWAP ? 4 : 8);  // fp32 accumulators per thread
  // [m16 tile][weight tile][n8 half][C element]; SWAP: [n8 tile of x's rows][weight tile][C
  // element]
  using Acc = std::conditional_t<SWAP, float[MT][NT][4], float[MT][NT][2][4]>;
  // the partial tiles of warps 1 .. WK-1 along k, in shared memory after the main loop
  static constexpr int REDUCE_BYTES = (WK - 1) * WM * WN * 32 * ACC * 4;
  static constexpr int QROWS = BK / 32;             // most groups one k-step can touch (gs >= 32)
  static constexpr int A_CHUNKS = BM * BK / 8;      // 16-byte chunks per stage
  static constexpr int B_CHUNKS = BK * BN / 32;
  static constexpr int A_STAGE = BM * BK * 2;  // bytes
  static constexpr int B_STAGE = BK * BN / 2;
  static constexpr int Q_STAGE = QROWS * BN * 4;
  static constexpr int SMEM = STAGES * (A_STAGE + B_STAGE + Q_STAGE);

  static_assert(SWAP ? (BM == 8 || BM == 16) && WM == 1 && BK == 128 : BM % (16 * WM) == 0,
                "warp tiles are whole 16x16 tiles (SWAP: 8 or 16 rows, k-steps of whole groups)");
  static_assert(BN % (16 * WN) == 0, "warp tiles are whole 16x16 weight tiles");
  static_assert(BK == 64 || BK == 128, "the A swizzle needs >= 8 chunks per row; gs >= 32");
  static_assert(QROWS * BN / 4 <= THREADS, "one pass loads a stage's qparams");
  static_assert(STAGES >= 2, "a pipeline needs two buffers");
  static_assert(KK % WK == 0 && (KW & (KW - 1)) == 0, "each warp takes a power-of-2 run of slices");
  static_assert(REDUCE_BYTES <= SMEM, "the k-split's partial tiles fit the pipeline's buffers");
  static_assert(A_STAGE % 128 == 0 && B_STAGE % 128 == 0 && Q_STAGE % 16 == 0, "alignment");
};

struct Params {
  const void* x;
  const uint32_t* qweight;
  const uint32_t* qparams;
  void* y;
  float* workspace;
  int64_t ldx, ldy;
  int m, n, k;
  int np, kp;            // padded N (multiple of 64) and K (multiple of gs)
  int gs_log2;           // log2(group size)
  int k_steps;           // ceil(k / BK)
  int steps_per_split;   // k-steps of one split (the last may have fewer, never none)
  int a_vec;             // x is 16-byte aligned with ldx % 8 == 0: cp.async for A
  int y_vec;             // y is 4-byte aligned with ldy even: paired stores
  int y_vec8;            // y is 8-byte aligned with ldy % 4 == 0: the reduction's quad stores
  int splits;            // split_k
  int n_tiles;           // output tiles along N (gridDim.x)
  uint32_t* counters;    // split-K in one launch: per output tile, the splits done (else null)
};

// ---------------------------------------------------------------------------------------------
// Helpers.

LSQ_HD int imin(int a, int b) { return a < b ? a : b; }
LSQ_HD int imax(int a, int b) { return a > b ? a : b; }

template <bool BF16>
LSQ_HD uint32_t fma2(uint32_t a, uint32_t b, uint32_t c) {
  return BF16 ? bfma2(a, b, c) : hfma2(a, b, c);
}

// One packed word -> the 4 registers of its B fragments, as integer codes 0..15 in fp16x2 or
// bf16x2: r[0], r[1] = n8 half 0 {b0,b1}, {b2,b3}; r[2], r[3] = half 1 (docs section 4).
//
// fp16: (w & 0x000F000F) | 0x64006400 is the fp16 pair 1024 + q (nibbles 0 and 4), and minus 1024
// is q. Nibbles 1 and 5 are masked in place with 0x00F000F0: 1024 + 16 q, and one fma by 1/16
// minus 64 gives q (Marlin's trick: one shift per word instead of three). All exact.
// bf16 has 7 mantissa bits, so 16 q would reach the exponent: every nibble pair is shifted down
// to bits 0..3 / 16..19 and OR-ed into 0x4300 (128.0), giving 128 + q exactly; fma(x, 1, -128).
template <bool BF16>
LSQ_HD void int4_codes(uint32_t w, uint32_t (&r)[4]) {
  constexpr uint32_t kLo = 0x000F000Fu;
  if (BF16) {
    constexpr uint32_t kMagic = 0x43004300u;  // bf16 {128, 128}
    constexpr uint32_t kOne = 0x3F803F80u;    // bf16 {1, 1}
    constexpr uint32_t kMinus = 0xC300C300u;  // bf16 {-128, -128}
#pragma unroll
    for (int i = 0; i < 4; ++i) r[i] = fma2<true>(and_or(w >> (4 * i), kLo, kMagic), kOne, kMinus);
  } else {
    constexpr uint32_t kHi = 0x00F000F0u;
    constexpr uint32_t kMagic = 0x64006400u;  // fp16 {1024, 1024}
    constexpr uint32_t kSixteenth = 0x2C002C00u;  // fp16 {1/16, 1/16}
    constexpr uint32_t kMinus64 = 0xD400D400u;    // fp16 {-64, -64}
    const uint32_t w8 = w >> 8;
    r[0] = hsub2(and_or(w, kLo, kMagic), kMagic);
    r[1] = fma2<false>(and_or(w, kHi, kMagic), kSixteenth, kMinus64);
    r[2] = hsub2(and_or(w8, kLo, kMagic), kMagic);
    r[3] = fma2<false>(and_or(w8, kHi, kMagic), kSixteenth, kMinus64);
  }
}

// The swapped operands' codes: one packed word -> the A fragment of its 16x16 tile (rows n,
// columns k) as 16 + q in fp16 or bf16. Each nibble pair is shifted to the top 4 bits of each
// half's mantissa (bits 6..9 fp16, 3..6 bf16) and OR-ed into 16.0: 16 (1 + q / 16) exactly.
// Top bits rather than bits 0..3 keep the constant's share of the mma's sums small (16 against
// q, not 1024 or 128 against q), so the fp32 sums lose at most 4 bits to it, not 10 or 7.
// A fragment order (PTX mma.m16n8k16): row g k-lo, row g+8 k-lo, row g k-hi, row g+8 k-hi, i.e.
// n8 half 0 {b0,b1}, half 1 {b0,b1}, half 0 {b2,b3}, half 1 {b2,b3} of the word as a B fragment
// (nibble pairs 0, 2, 1, 3).
template <bool BF16>
LSQ_HD void offset_codes(uint32_t w, uint32_t (&a)[4]) {
  constexpr int kTop = BF16 ? 3 : 6;  // the nibble's lowest bit in a half
  constexpr uint32_t kMask = 0x000F000Fu << kTop;
  constexpr uint32_t kSixteen = BF16 ? 0x41804180u : 0x4C004C00u;  // {16, 16}
  a[0] = and_or(w << kTop, kMask, kSixteen);                         // nibbles 0, 4
  a[2] = and_or(kTop >= 4 ? w << (kTop - 4) : w >> (4 - kTop), kMask, kSixteen);  // 1, 5
  a[1] = and_or(w >> (8 - kTop), kMask, kSixteen);                  // 2, 6
  a[3] = and_or(w >> (12 - kTop), kMask, kSixteen);                 // 3, 7
}

// 16 + q -> q: the constant the swapped operands' codes carry (offset_codes).
constexpr float kCodeOffset = 16.f;

// A qparams word (fp16 s in the low half, fp16 b = -z*s in the high half) -> (s, s) and (b, b)
// in the activation dtype.
template <bool BF16>
LSQ_HD void group_pair(uint32_t v, uint32_t& s2, uint32_t& b2) {
  if (BF16) {
    const float s = half_to_float(static_cast<uint16_t>(v)), b = half_to_float(v >> 16);
    s2 = pack_bf162(s, s);
    b2 = pack_bf162(b, b);
  } else {
    s2 = prmt(v, v, 0x1010);
    b2 = prmt(v, v, 0x3232);
  }
}

template <bool BF16>
LSQ_HD uint32_t pack2(float lo, float hi) {
  return BF16 ? pack_bf162(lo, hi) : pack_half2(lo, hi);
}

template <bool BF16>
LSQ_HD uint16_t pack1(float v) {
  return BF16 ? float_to_bf16(v) : float_to_half(v);
}

// ---------------------------------------------------------------------------------------------
// The GEMM kernel.

// y[m, n] = sum over s = 0, 1, ..., splits - 1 of workspace[s, m, n], in that order, for the
// 4 columns col .. col + 3 of row m (float4 loads; Np is a multiple of 64).
struct Reduce {
  const float* ws;
  void* y;
  int64_t ldy;
  int m, n, np, splits, y_vec8;
};

template <bool BF16>
LSQ_HD void reduce_at(const Reduce& r, int row, int col) {
  if (col >= r.n) return;
  const int64_t split_stride = (int64_t)r.m * r.np;
  const float* src = r.ws + (int64_t)row * r.np + col;
  // from L2: in the one-launch path other blocks wrote these during this kernel
  float4 acc = load_cg(src);
  for (int s = 1; s < r.splits; ++s) {
    const float4 v = load_cg(src + s * split_stride);
    acc.x += v.x;
    acc.y += v.y;
    acc.z += v.z;
    acc.w += v.w;
  }
  uint16_t* yr = static_cast<uint16_t*>(r.y) + row * r.ldy;
  if (r.y_vec8 && col + 3 < r.n) {
    uint2 out;
    out.x = pack2<BF16>(acc.x, acc.y);
    out.y = pack2<BF16>(acc.z, acc.w);
    *reinterpret_cast<uint2*>(yr + col) = out;
  } else {
    const float v[4] = {acc.x, acc.y, acc.z, acc.w};
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (col + e < r.n) yr[col + e] = pack1<BF16>(v[e]);
  }
}

// The same for quad idx of the row-major [M, Np / 4] grid of quads (the reduction kernel's).
template <bool BF16>
LSQ_HD void reduce_quad(const Reduce& r, int64_t idx) {
  const int quads = r.np / 4;
  if (idx >= (int64_t)r.m * quads) return;
  reduce_at<BF16>(r, (int)(idx / quads), (int)(idx % quads) * 4);
}

// With the k-step's slices split WK ways, the warps along k (warp_k > 0) leave their fp32 tiles in
// shared memory (the pipeline's buffers, free once every copy has landed) and the warp_k = 0 warp
// of the same output tile adds them in order 1, 2, ..., WK - 1: reproducible bits. Returns
// whether this thread holds the sum (and writes the epilogue).
template <class T>
LSQ_HD bool reduce_warps_k(float* acc, int warp_mn, int warp_k, int lane, uint8_t* smem) {
  float* const part = reinterpret_cast<float*>(smem);
  auto at = [&](int wk, int e) {  // lanes adjacent: conflict-free
    return part + (((wk - 1) * (T::WM * T::WN) + warp_mn) * T::ACC + e) * 32 + lane;
  };
  block_sync();  // every warp is past its last read of the pipeline's buffers
  if (warp_k > 0)
#pragma unroll
    for (int e = 0; e < T::ACC; ++e) *at(warp_k, e) = acc[e];
  block_sync();
  if (warp_k > 0) return false;
  for (int wk = 1; wk < T::WK; ++wk)
#pragma unroll
    for (int e = 0; e < T::ACC; ++e) acc[e] += *at(wk, e);
  return true;
}

// Split-K in one launch: the block that finishes an output tile's last split sums the tile's
// partials in split order 0, 1, ... into y, as lsq_reduce_splits would (the same bits, without
// its launch). Arrival is counted per tile in p.counters, which the last block sets back to 0
// for the next launch; the fences order every block's partials before its count and the last
// block's reads after it (the threadFenceReduction pattern of CUDA's samples).
template <class T, bool BF16>
LSQ_HD void finish_split(const Params& p, unsigned bx, unsigned by, int tid, uint8_t* smem) {
  thread_fence();  // this thread's partials are visible to the GPU before the block counts in
  block_sync();    // and every thread's are (the pipeline's buffers are idle: a flag fits)
  uint32_t* const last = reinterpret_cast<uint32_t*>(smem);
  if (tid == 0) {
    thread_fence();
    uint32_t* const counter = p.counters + static_cast<int64_t>(by) * p.n_tiles + bx;
    const bool done = atomic_add(counter, 1u) == static_cast<uint32_t>(p.splits - 1);
    if (done) *counter = 0u;  // no other block of this launch touches it again
    *last = done;
  }
  block_sync();
  if (!*last) return;
  thread_fence();
  const Reduce r{p.workspace, p.y, p.ldy, p.m, p.n, p.np, p.splits, p.y_vec8};
  const int m0 = by * T::BM, n0 = bx * T::BN, rows = imin(T::BM, p.m - m0);
  constexpr int kQuads = T::BN / 4;
  for (int i = tid; i < rows * kQuads; i += T::THREADS) {
    const int col = n0 + (i % kQuads) * 4;  // < n checked in reduce_at
    reduce_at<BF16>(r, m0 + i / kQuads, col);  // no integer division by a run-time value
  }
}

// log2 of the group size: GS when the kernel is compiled for one (32, 64 or 128), else p's.
template <int GS>
LSQ_HD int group_log2(const Params& p) {
  static_assert(GS == 0 || GS == 32 || GS == 64 || GS == 128, "group sizes 32, 64, 128");
  return GS == 32 ? 5 : GS == 64 ? 6 : GS == 128 ? 7 : p.gs_log2;
}

// One thread of block (bx, by, bz) of the grid; one_m_tile: the grid has one row of tiles
// (gridDim.y == 1); split: the grid splits K (gridDim.z > 1). smem: T::SMEM bytes, 128-aligned.
// GS: the group size the kernel is compiled for, or 0 for any (read from p).
// The weight lines of the block's first STAGES - 1 k-steps into L2. The weights are constant
// (no kernel writes them), so this may run before grid_dependency_wait: under programmatic
// dependent launch it overlaps the kernel before this one, and the pipeline's first copies then
// find their lines in L2.
template <class T>
LSQ_HD void prefetch_weights(const Params& p, unsigned bx, unsigned bz, int tid) {
  constexpr int kRowLines = T::BN * 8 / 128;  // 128-byte lines of one qweight row of the tile
  const int n0 = bx * T::BN;
  const int first = static_cast<int>(bz) * p.steps_per_split * (T::BK / 16);  // qweight row
  const int split_rows = imin(p.steps_per_split * (T::BK / 16), p.kp / 16 - first);
  const int rows = imin((T::STAGES - 1) * (T::BK / 16), split_rows);
  for (int i = tid; i < rows * kRowLines; i += T::THREADS) {
    const int r = i / kRowLines, word = 2 * n0 + (i % kRowLines) * 32;
    if (word < 2 * p.np) prefetch_l2(p.qweight + (int64_t)(first + r) * (2 * p.np) + word);
  }
}

template <class T, int GS, bool BF16>
LSQ_HD void gemm_block(const Params p, unsigned bx, unsigned by, unsigned bz, bool one_m_tile,
                       bool split, int tid, uint8_t* smem) {
  prefetch_weights<T>(p, bx, bz, tid);
  grid_dependency_wait();  // then nothing else before it: the grids before may still run
  launch_dependents();
  uint8_t* const a_smem = smem;
  uint8_t* const b_smem = a_smem + T::STAGES * T::A_STAGE;
  uint8_t* const q_smem = b_smem + T::STAGES * T::B_STAGE;

  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int warp_mn = T::WK == 1 ? warp : warp % (T::WM * T::WN);
  const int warp_k = T::WK == 1 ? 0 : warp / (T::WM * T::WN);  // which run of slices
  const int warp_m = warp_mn / T::WN;
  const int warp_n = warp_mn % T::WN;

  const int n0 = bx * T::BN;
  const int m0 = by * T::BM;
  const int step_begin = bz * p.steps_per_split;
  const int steps = imin(p.steps_per_split, p.k_steps - step_begin);  // >= 1 (host checks)

  const int gs_log2 = group_log2<GS>(p);
  const int gs = 1 << gs_log2;
  const int q_rows = T::BK > gs ? T::BK / gs : 1;  // groups per k-step
  const int kt_total = p.kp / 16;                  // qweight rows
  const int groups = p.kp >> gs_log2;              // qparams rows
  // Weights are read once when one row of tiles covers M (decode): do not let them evict x.
  const uint64_t b_policy = l2_policy(one_m_tile);

  // ---- global -> shared, one k-step into one stage ----
  constexpr int A_ITERS = (T::A_CHUNKS + T::THREADS - 1) / T::THREADS;
  constexpr int B_ITERS = (T::B_CHUNKS + T::THREADS - 1) / T::THREADS;
  // Per-thread copy state of a full k-step (k0 + BK <= K: no k bound inside it), fixed for the
  // whole loop: source addresses at k0 = 0 (a row or column past the matrix points at row or
  // column 0 and copies 0 bytes, so every address stays inside the tensor), byte counts and
  // shared-memory offsets. A step then costs one add and one cp.async per 16-byte chunk.
  const uint16_t* a_src[A_ITERS];
  uint32_t a_off[A_ITERS];
  int a_bytes[A_ITERS];
#pragma unroll
  for (int i = 0; i < A_ITERS; ++i) {
    const int c = imin(tid + i * T::THREADS, T::A_CHUNKS - 1);
    const int r = c / (T::BK / 8), cc = c % (T::BK / 8);
    const bool mine = T::A_CHUNKS % T::THREADS == 0 || tid + i * T::THREADS < T::A_CHUNKS;
    const bool ok = mine && m0 + r < p.m;
    a_src[i] = static_cast<const uint16_t*>(p.x) + (ok ? (m0 + r) * p.ldx : 0) + cc * 8;
    a_off[i] = (r * T::BK + ((cc ^ (r & 7)) * 8)) * 2;  // chunk cc of row r sits at cc ^ (r & 7)
    a_bytes[i] = ok ? 16 : 0;
  }
  const uint32_t* b_src[B_ITERS];
  int b_bytes[B_ITERS];
#pragma unroll
  for (int i = 0; i < B_ITERS; ++i) {
    const int c = imin(tid + i * T::THREADS, T::B_CHUNKS - 1);
    const int r = c / (T::BN / 2), cc = c % (T::BN / 2);  // BN/2 chunks per row of tiles
    const bool ok = 2 * n0 + cc * 4 < 2 * p.np;
    b_src[i] = p.qweight + (int64_t)r * (2 * p.np) + (ok ? 2 * n0 + cc * 4 : cc % 8 * 4);
    b_bytes[i] = ok ? 16 : 0;
  }
  const int q_r = tid / (T::BN / 4), q_cc = tid % (T::BN / 4);
  const bool q_on = tid < q_rows * (T::BN / 4);
  const bool q_ok = q_on && n0 + q_cc * 4 < p.np;
  const uint32_t* q_src =
      p.qparams + (int64_t)(q_on ? q_r : 0) * p.np + (q_ok ? n0 + q_cc * 4 : 0);
  const int64_t b_step = (int64_t)(T::BK / 16) * (2 * p.np);  // words per k-step

  auto load_stage = [&](int stage, int step) {
    const int k0 = step * T::BK;
    const SharedAddr a_dst = shared_addr(a_smem + stage * T::A_STAGE);
    const SharedAddr b_dst = shared_addr(b_smem + stage * T::B_STAGE);
    const SharedAddr q_dst = shared_addr(q_smem + stage * T::Q_STAGE);
    if (p.a_vec && k0 + T::BK <= p.k) {  // every k-step but a ragged last one
#pragma unroll
      for (int i = 0; i < A_ITERS; ++i)
        if (T::A_CHUNKS % T::THREADS == 0 || tid + i * T::THREADS < T::A_CHUNKS)
          cp_async16(a_dst + a_off[i], a_src[i] + k0, a_bytes[i]);
#pragma unroll
      for (int i = 0; i < B_ITERS; ++i)
        if (T::B_CHUNKS % T::THREADS == 0 || tid + i * T::THREADS < T::B_CHUNKS)
          cp_async16_hint(b_dst + (tid + i * T::THREADS) * 16, b_src[i] + step * b_step,
                          b_bytes[i], b_policy);
      if (q_on)
        cp_async16(q_dst + (q_r * T::BN + q_cc * 4) * 4,
                   q_src + (int64_t)(k0 >> gs_log2) * p.np, q_ok ? 16 : 0);
      return;
    }
    // The general step: bounds on k, K padding past Kp, and x without 16-byte rows.
#pragma unroll
    for (int i = 0; i < A_ITERS; ++i) {
      const int c = tid + i * T::THREADS;
      if (T::A_CHUNKS % T::THREADS == 0 || c < T::A_CHUNKS) {
        const int r = c / (T::BK / 8), cc = c % (T::BK / 8);
        const int row = m0 + r, kk = k0 + cc * 8;
        const SharedAddr dst = a_dst + a_off[i];
        if (p.a_vec) {
          const int bytes = row < p.m ? imax(0, imin(16, 2 * (p.k - kk))) : 0;
          const void* src = bytes ? static_cast<const uint16_t*>(p.x) + row * p.ldx + kk : p.x;
          cp_async16(dst, src, bytes);
        } else {  // unaligned x or odd row stride: plain loads, still zero-filled
          const uint16_t* xr = static_cast<const uint16_t*>(p.x) + row * p.ldx;
          uint32_t v[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int ka = kk + 2 * e;
            const uint32_t lo = (row < p.m && ka < p.k) ? xr[ka] : 0u;
            const uint32_t hi = (row < p.m && ka + 1 < p.k) ? xr[ka + 1] : 0u;
            v[e] = lo | (hi << 16);
          }
          st_shared_v4(dst, v[0], v[1], v[2], v[3]);
        }
      }
    }
    // B: BK/16 rows of BN/16 tiles, 128 bytes each, copied in the global order; rows past Kp
    // (a k-step longer than the padded K) are zero-filled.
    const int kt0 = k0 / 16;
#pragma unroll
    for (int i = 0; i < B_ITERS; ++i) {
      const int c = tid + i * T::THREADS;
      if (T::B_CHUNKS % T::THREADS == 0 || c < T::B_CHUNKS) {
        const int r = c / (T::BN / 2), cc = c % (T::BN / 2);
        const int kt = kt0 + r, word = 2 * n0 + cc * 4;
        const bool ok = kt < kt_total && word < 2 * p.np;
        const uint32_t* src = ok ? p.qweight + (int64_t)kt * (2 * p.np) + word : p.qweight;
        cp_async16_hint(b_dst + c * 16, src, ok ? 16 : 0, b_policy);
      }
    }
    // Q: the (s, b) words of the step's group(s) for the block's BN columns, 4 per chunk.
    if (q_on) {
      const int g = (k0 >> gs_log2) + q_r, col = n0 + q_cc * 4;
      const bool ok = g < groups && col < p.np;
      const uint32_t* src = ok ? p.qparams + (int64_t)g * p.np + col : p.qparams;
      cp_async16(q_dst + (q_r * T::BN + q_cc * 4) * 4, src, ok ? 16 : 0);
    }
  };

  typename T::Acc acc;
  float* const acc_flat = reinterpret_cast<float*>(&acc);
#pragma unroll
  for (int e = 0; e < T::ACC; ++e) acc_flat[e] = 0.f;

  // ---- shared -> registers -> tensor cores, one stage ----
  const int g_lane = lane >> 2;  // mma groupID: the B column / C row within an 8-block
  auto compute_stage = [&](auto& acc, int stage) {
    const SharedAddr a_base = shared_addr(a_smem + stage * T::A_STAGE);
    const uint32_t* bw = reinterpret_cast<const uint32_t*>(b_smem + stage * T::B_STAGE);
    const uint32_t* qw = reinterpret_cast<const uint32_t*>(q_smem + stage * T::Q_STAGE);
    uint32_t s2[T::NT][2], b2[T::NT][2];
#pragma unroll
    for (int kw = 0; kw < T::KW; ++kw) {
      const int kk = warp_k * T::KW + kw;
      // (s, b) of the group this 16-deep slice lies in: at the warp's first slice, and where a
      // group starts (only at even kw, since gs >= 32; a warp's run of KW slices is a power of
      // 2 long, so it starts on a group boundary or lies inside one group).
      if (kw == 0 || (kw % 2 == 0 && ((kw * 16) & (gs - 1)) == 0)) {
        const int qr = (kk * 16) >> gs_log2;
#pragma unroll
        for (int j = 0; j < T::NT; ++j)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            group_pair<BF16>(qw[qr * T::BN + warp_n * T::TN + j * 16 + h * 8 + g_lane], s2[j][h],
                             b2[j][h]);
      }
      uint32_t a[T::MT][4];
#pragma unroll
      for (int i = 0; i < T::MT; ++i) {
        const int r = warp_m * T::TM + i * 16 + (lane & 15);
        const int c = 2 * kk + (lane >> 4);
        ldmatrix_x4(a[i], a_base + (r * T::BK + ((c ^ (r & 7)) * 8)) * 2);
      }
#pragma unroll
      for (int j = 0; j < T::NT; ++j) {
        const uint32_t w = bw[(kk * (T::BN / 16) + warp_n * T::NT + j) * 32 + lane];
        uint32_t b[4];
        int4_codes<BF16>(w, b);
        b[0] = fma2<BF16>(b[0], s2[j][0], b2[j][0]);
        b[1] = fma2<BF16>(b[1], s2[j][0], b2[j][0]);
        b[2] = fma2<BF16>(b[2], s2[j][1], b2[j][1]);
        b[3] = fma2<BF16>(b[3], s2[j][1], b2[j][1]);
#pragma unroll
        for (int i = 0; i < T::MT; ++i) {
          mma_16816<BF16>(acc[i][j][0], a[i], b[0], b[1]);
          mma_16816<BF16>(acc[i][j][1], a[i], b[2], b[3]);
        }
      }
    }
  };

  // ---- the same with the operands swapped (T::SWAP): the weights' 16x16 tiles as A, x^T as B
  // (8 rows of x per n8 tile), codes 16 + q, each group's (s, b) applied in fp32 at the end of
  // the warp's run of slices inside it ----
  auto swapped_stage = [&](auto& acc, int stage) {
    static_assert(!T::SWAP || GS != 0, "swapped tiles are compiled per group size");
    constexpr int kGroupSlices = GS > 0 ? GS / 16 : T::KW;
    constexpr int kRun = T::KW < kGroupSlices ? T::KW : kGroupSlices;  // slices of a run
    constexpr uint32_t kOnes = BF16 ? 0x3F803F80u : 0x3C003C00u;
    const uint32_t ones[4] = {kOnes, kOnes, kOnes, kOnes};
    const SharedAddr a_base = shared_addr(a_smem + stage * T::A_STAGE);
    const uint32_t* bw = reinterpret_cast<const uint32_t*>(b_smem + stage * T::B_STAGE);
    const uint32_t* qw = reinterpret_cast<const uint32_t*>(q_smem + stage * T::Q_STAGE);
    float part[T::MT][T::NT][4];  // the run's sums of x (16 + q): rows n g, g + 8 by 2 of x's
    float xs[T::MT][4];           // the run's sums of x (every row of the mma the same)
#pragma unroll
    for (int kw = 0; kw < T::KW; ++kw) {
      const int kk = warp_k * T::KW + kw;
      if (kw % kRun == 0) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
#pragma unroll
          for (int i = 0; i < T::MT; ++i) {
            xs[i][e] = 0.f;
#pragma unroll
            for (int j = 0; j < T::NT; ++j) part[i][j][e] = 0.f;
          }
        }
      }
      uint32_t bx[T::MT][2];  // x^T's B fragments: rows 8i .. 8i + 7 of the tile's x
#pragma unroll
      for (int i = 0; i < T::MT; ++i) {
        const int r = i * 8 + (lane & 7);
        const int c = 2 * kk + ((lane >> 3) & 1);
        ldmatrix_x2(bx[i], a_base + (r * T::BK + ((c ^ (r & 7)) * 8)) * 2);
        mma_16816<BF16>(xs[i], ones, bx[i][0], bx[i][1]);
      }
#pragma unroll
      for (int j = 0; j < T::NT; ++j) {
        uint32_t a[4];
        offset_codes<BF16>(bw[(kk * (T::BN / 16) + warp_n * T::NT + j) * 32 + lane], a);
#pragma unroll
        for (int i = 0; i < T::MT; ++i) mma_16816<BF16>(part[i][j], a, bx[i][0], bx[i][1]);
      }
      if (kw % kRun == kRun - 1) {
        const int qr = (kk * 16) >> gs_log2;
#pragma unroll
        for (int j = 0; j < T::NT; ++j) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {  // rows n g (C elements 0, 1) and g + 8 (2, 3)
            const uint32_t v = qw[qr * T::BN + warp_n * T::TN + j * 16 + h * 8 + g_lane];
            const float s = half_to_float(static_cast<uint16_t>(v));
            const float b = fmaf(-kCodeOffset, s, half_to_float(static_cast<uint16_t>(v >> 16)));
#pragma unroll
            for (int i = 0; i < T::MT; ++i) {
#pragma unroll
              for (int e = 0; e < 2; ++e) {  // rows 2t + e of x
                float& out = acc[i][j][2 * h + e];
                out = fmaf(b, xs[i][e], fmaf(s, part[i][j][2 * h + e], out));
              }
            }
          }
        }
      }
    }
  };

  // ---- the pipeline: STAGES - 1 steps in flight while one is computed ----
#pragma unroll
  for (int s = 0; s < T::STAGES - 1; ++s) {
    if (s < steps) load_stage(s, step_begin + s);
    cp_async_commit();
  }
  int read_stage = 0, write_stage = T::STAGES - 1;
  for (int i = 0; i < steps; ++i) {
    cp_async_wait<T::STAGES - 2>();  // step i has landed (this thread's copies) ...
    block_sync();                    // ... everyone's, and everyone is done with step i - 1
    if (i + T::STAGES - 1 < steps) load_stage(write_stage, step_begin + i + T::STAGES - 1);
    cp_async_commit();
    if constexpr (T::SWAP)
      swapped_stage(acc, read_stage);
    else
      compute_stage(acc, read_stage);
    read_stage = read_stage == T::STAGES - 1 ? 0 : read_stage + 1;
    write_stage = write_stage == T::STAGES - 1 ? 0 : write_stage + 1;
  }
  cp_async_wait<0>();
  const bool writer = T::WK == 1 || reduce_warps_k<T>(acc_flat, warp_mn, warp_k, lane, smem);

  // ---- epilogue: fp32 partials to the workspace, or y in the activation dtype ----
  const int tig = lane & 3;
  if constexpr (T::SWAP) {
#pragma unroll
    for (int i = 0; writer && i < T::MT; ++i) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {  // C columns 2t, 2t + 1: rows of x and y
        const int row = m0 + i * 8 + 2 * tig + e;
        if (row >= p.m) continue;
#pragma unroll
        for (int j = 0; j < T::NT; ++j) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {  // C rows g and g + 8: columns of y
            const int col = n0 + warp_n * T::TN + j * 16 + h * 8 + g_lane;
            const float v = acc[i][j][2 * h + e];
            if (split) {
              if (col < p.np) p.workspace[((int64_t)bz * p.m + row) * p.np + col] = v;
            } else if (col < p.n) {
              static_cast<uint16_t*>(p.y)[row * p.ldy + col] = pack1<BF16>(v);
            }
          }
        }
      }
    }
  } else {
#pragma unroll
    for (int i = 0; writer && i < T::MT; ++i) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {  // C rows g and g + 8
        const int row = m0 + warp_m * T::TM + i * 16 + g_lane + half * 8;
        if (row >= p.m) continue;
#pragma unroll
        for (int j = 0; j < T::NT; ++j) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int col = n0 + warp_n * T::TN + j * 16 + h * 8 + 2 * tig;
            const float v0 = acc[i][j][h][2 * half], v1 = acc[i][j][h][2 * half + 1];
            if (split) {
              if (col < p.np) {
                float2* dst = reinterpret_cast<float2*>(
                    p.workspace + ((int64_t)bz * p.m + row) * p.np + col);
                *dst = make_float2(v0, v1);
              }
            } else {
              uint16_t* yr = static_cast<uint16_t*>(p.y) + row * p.ldy;
              if (p.y_vec && col + 1 < p.n) {
                *reinterpret_cast<uint32_t*>(yr + col) = pack2<BF16>(v0, v1);
              } else {
                if (col < p.n) yr[col] = pack1<BF16>(v0);
                if (col + 1 < p.n) yr[col + 1] = pack1<BF16>(v1);
              }
            }
          }
        }
      }
    }
  }
  if (split && p.counters) finish_split<T, BF16>(p, bx, by, tid, smem);
}

template <class T, int GS, bool BF16>
__global__ void __launch_bounds__(T::THREADS, T::MINB) w4a16_gemm_kernel(const Params p) {
  extern __shared__ __align__(128) uint8_t smem[];
  gemm_block<T, GS, BF16>(p, blockIdx.x, blockIdx.y, blockIdx.z, gridDim.y == 1, gridDim.z > 1,
                          threadIdx.x, smem);
}

template <bool BF16>
__global__ void __launch_bounds__(256) lsq_reduce_splits(const Reduce r) {
  grid_dependency_wait();  // nothing before it: the grids before this one may still run
  launch_dependents();
  reduce_quad<BF16>(r, (int64_t)blockIdx.x * blockDim.x + threadIdx.x);
}

// ---------------------------------------------------------------------------------------------
// Dequantization: W_hat[n, k] in the activation dtype, for prefill-sized M where a dense GEMM on
// it (cuBLAS: wgmma on sm_90, which mma.sync cannot match) beats the fused kernel even after
// writing the weights out. Each thread takes one packed word, i.e. one lane's fragment of one
// 16x16 tile, and produces its 8 weights with the GEMM's own int4_codes, group_pair and fma2:
// the same bits the GEMM multiplies, so the two paths differ only in accumulation order.
struct Dequant {
  const uint32_t* qweight;
  const uint32_t* qparams;
  void* w;
  int64_t ldw;
  int n, k, np, kp, gs_log2;
  int w_vec;  // w is 4-byte aligned with ldw even: paired stores
};

LSQ_HD void store_pair(const Dequant& d, uint16_t* row, int kk, uint32_t v) {
  if (d.w_vec && kk + 1 < d.k) {
    *reinterpret_cast<uint32_t*>(row + kk) = v;
  } else {
    if (kk < d.k) row[kk] = static_cast<uint16_t>(v);
    if (kk + 1 < d.k) row[kk + 1] = static_cast<uint16_t>(v >> 16);
  }
}

// Word `word` of qweight row kt (a 16-deep k-slab): tile word >> 5, lane word & 31.
template <bool BF16>
LSQ_HD void dequant_word(const Dequant& d, int kt, int word) {
  if (word >= 2 * d.np) return;
  const int t = word & 31;                       // the lane whose fragment this word is
  const int n_lo = (word >> 5) * 16 + (t >> 2);  // column of n8 half 0 (half 1: + 8)
  const int k0 = kt * 16 + 2 * (t & 3);          // rows k0, k0 + 1 and k0 + 8, k0 + 9
  if (n_lo >= d.n || k0 >= d.k) return;
  const uint32_t* group = d.qparams + (int64_t)((kt * 16) >> d.gs_log2) * d.np;
  uint32_t r[4];
  int4_codes<BF16>(d.qweight[(int64_t)kt * (2 * d.np) + word], r);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int n = n_lo + 8 * h;
    if (n >= d.n) break;
    uint32_t s2, b2;
    group_pair<BF16>(group[n], s2, b2);
    uint16_t* row = static_cast<uint16_t*>(d.w) + n * d.ldw;
    store_pair(d, row, k0, fma2<BF16>(r[2 * h], s2, b2));
    store_pair(d, row, k0 + 8, fma2<BF16>(r[2 * h + 1], s2, b2));
  }
}

template <bool BF16>
__global__ void __launch_bounds__(256) lsq_dequantize_words(const Dequant d) {
  grid_dependency_wait();  // nothing before it: the grids before this one may still run
  launch_dependents();
  dequant_word<BF16>(d, blockIdx.y, blockIdx.x * blockDim.x + threadIdx.x);
}

// ---------------------------------------------------------------------------------------------
// Host side.

// cudaFuncSetAttribute once per (kernel, device): a bit per device (devices >= 64 always call).
template <class Kernel>
cudaError_t allow_smem(Kernel kernel, int bytes, std::atomic<uint64_t>& done) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  const uint64_t bit = dev < 64 ? (uint64_t{1} << dev) : 0;
  if (bit && (done.load(std::memory_order_relaxed) & bit)) return cudaSuccess;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess && bit) done.fetch_or(bit, std::memory_order_relaxed);
  return err;
}

static inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

static inline bool aligned(const void* ptr, uintptr_t bytes) {
  return (reinterpret_cast<uintptr_t>(ptr) % bytes) == 0;
}

// A checked call: the kernel's parameters, its grid and the split-K reduction's.
struct Plan {
  Params p;
  int config, split_k;
  bool bf16;
  unsigned grid_x, grid_y;
  Reduce reduce;
};

// Every check of the entry point; fills the plan. No CUDA call. m == 0 passes (nothing to run).
static int plan_gemm(const void* x, int64_t ldx, const int32_t* qweight, const void* qparams,
                     void* y, int64_t ldy, float* workspace, uint32_t* counters,
                     int64_t counters_len, int64_t m, int64_t n, int64_t k, int32_t group_size,
                     int32_t dtype, int32_t config, int32_t split_k, Plan* plan) {
  LSQ_REQUIRE(config >= 0 && config < kNumConfigs);
  LSQ_REQUIRE(dtype == kDtypeFp16 || dtype == kDtypeBf16);
  LSQ_REQUIRE(group_size == 32 || group_size == 64 || group_size == 128);
  constexpr int64_t kMax = 0x7FFFFFFF;
  LSQ_REQUIRE(m >= 0 && n >= 1 && k >= 1 && m <= kMax && n <= kMax - 64 && k <= kMax - 128);
  LSQ_REQUIRE(ldx >= k && ldy >= n);
  LSQ_REQUIRE(x && qweight && qparams && y);
  LSQ_REQUIRE(aligned(qweight, 16) && aligned(qparams, 16));
  const ConfigInfo& c = kConfigs[config];
  const int64_t k_steps = ceil_div(k, c.block_k);
  LSQ_REQUIRE(split_k >= 1 && split_k <= k_steps && split_k <= 65535);
  const int64_t steps_per_split = ceil_div(k_steps, split_k);
  LSQ_REQUIRE((split_k - 1) * steps_per_split < k_steps);  // no split may be empty
  LSQ_REQUIRE(split_k == 1 || (workspace && aligned(workspace, 16)));
  LSQ_REQUIRE(counters_len >= 0 && (!counters || aligned(counters, 4)));
  const int64_t m_tiles = ceil_div(m, c.block_m);
  LSQ_REQUIRE(m_tiles <= 65535);
  const int64_t n_tiles = ceil_div(n, c.block_n);

  Params& p = plan->p;
  p.x = x;
  p.qweight = reinterpret_cast<const uint32_t*>(qweight);
  p.qparams = static_cast<const uint32_t*>(qparams);
  p.y = y;
  p.workspace = workspace;
  p.ldx = ldx;
  p.ldy = ldy;
  p.m = static_cast<int>(m);
  p.n = static_cast<int>(n);
  p.k = static_cast<int>(k);
  p.np = static_cast<int>(ceil_div(n, 64) * 64);
  p.kp = static_cast<int>(ceil_div(k, group_size) * group_size);
  p.gs_log2 = group_size == 32 ? 5 : group_size == 64 ? 6 : 7;
  p.k_steps = static_cast<int>(k_steps);
  p.steps_per_split = static_cast<int>(steps_per_split);
  p.a_vec = aligned(x, 16) && ldx % 8 == 0;
  p.y_vec = aligned(y, 4) && ldy % 2 == 0;
  p.y_vec8 = aligned(y, 8) && ldy % 4 == 0;
  p.splits = split_k;
  p.n_tiles = static_cast<int>(n_tiles);
  // one launch when the counters cover every output tile; else a second kernel reduces
  p.counters = split_k > 1 && counters && m_tiles * n_tiles <= counters_len ? counters : nullptr;
  plan->config = config;
  plan->split_k = split_k;
  plan->bf16 = dtype == kDtypeBf16;
  plan->grid_x = static_cast<unsigned>(n_tiles);
  plan->grid_y = static_cast<unsigned>(m_tiles);
  plan->reduce = Reduce{workspace, y, ldy, p.m, p.n, p.np, split_k, p.y_vec8};
  return 0;
}

#define LSQ_TILE(id, bm, bn, bk, wm, wn, wk, st, minb, sw) \
  using Tile##id = Tile<bm, bn, bk, wm, wn, wk, st, minb, sw>;
LSQ_W4A16_CONFIGS(LSQ_TILE)
#undef LSQ_TILE

// Decode tiles are compiled per group size (their cost per weight word is the point of them);
// the others read it at run time, where several row tiles share each group's (s, b).
template <class T>
constexpr bool kPerGroupSize = T::BM <= 16;

template <class T, bool BF16, class Runner>
int dispatch_group(const Plan& plan, Runner& runner) {
  if constexpr (!kPerGroupSize<T>) {
    return runner.template run<T, 0, BF16>();
  } else {
    switch (plan.p.gs_log2) {
      case 5:
        return runner.template run<T, 32, BF16>();
      case 6:
        return runner.template run<T, 64, BF16>();
      default:
        return runner.template run<T, 128, BF16>();
    }
  }
}

// Calls runner.template run<Tile, GS, BF16>() for the plan's config, group size and dtype.
template <class Runner>
int dispatch(const Plan& plan, Runner& runner) {
  switch (plan.config) {
#define LSQ_CASE(id, bm, bn, bk, wm, wn, wk, st, minb, sw)                 \
  case id:                                                                 \
    return plan.bf16 ? dispatch_group<Tile##id, true>(plan, runner)        \
                     : dispatch_group<Tile##id, false>(plan, runner);
    LSQ_W4A16_CONFIGS(LSQ_CASE)
#undef LSQ_CASE
    default:
      return static_cast<int>(cudaErrorInvalidValue);
  }
}

struct Launcher {
  const Plan& plan;
  cudaStream_t stream;
  template <class T, int GS, bool BF16>
  int run() {
    static std::atomic<uint64_t> smem_set{0};
    auto kernel = w4a16_gemm_kernel<T, GS, BF16>;
    cudaError_t err = allow_smem(kernel, T::SMEM, smem_set);
    if (err != cudaSuccess) return static_cast<int>(err);
    const dim3 grid(plan.grid_x, plan.grid_y, static_cast<unsigned>(plan.split_k));
    const int status = lsq_launch(kernel, grid, dim3(T::THREADS), T::SMEM, stream, plan.p);
    if (status || plan.split_k == 1 || plan.p.counters) return status;
    const int64_t quads = (int64_t)plan.p.m * (plan.p.np / 4);
    const unsigned blocks = static_cast<unsigned>(ceil_div(quads, 256));
    return lsq_launch(lsq_reduce_splits<BF16>, dim3(blocks), dim3(256), 0, stream, plan.reduce);
  }
};

struct Emulator {
  const Plan& plan;
  const lsq_simt::emulate::Options* options;
  template <class T, int GS, bool BF16>
  int run() {
#ifdef __CUDA_ARCH__
    return 0;
#else
    const Params& p = plan.p;
    const bool one_m_tile = plan.grid_y == 1, split = plan.split_k > 1;
    emulate::run_grid(
        plan.grid_x, plan.grid_y, static_cast<unsigned>(plan.split_k), T::THREADS, T::SMEM,
        [&](unsigned x, unsigned y, unsigned z, int tid, void* smem) {
          gemm_block<T, GS, BF16>(p, x, y, z, one_m_tile, split, tid,
                                  static_cast<uint8_t*>(smem));
        },
        *options);
    if (split && !p.counters)
      for (int64_t q = 0; q < (int64_t)p.m * (p.np / 4); ++q) reduce_quad<BF16>(plan.reduce, q);
    return 0;
#endif
  }
};

// Every check of the dequantization's entry points; fills d. No CUDA call.
static int plan_dequant(const int32_t* qweight, const void* qparams, void* w, int64_t ldw,
                        int64_t n, int64_t k, int32_t group_size, int32_t dtype, Dequant* d) {
  LSQ_REQUIRE(dtype == kDtypeFp16 || dtype == kDtypeBf16);
  LSQ_REQUIRE(group_size == 32 || group_size == 64 || group_size == 128);
  constexpr int64_t kMax = 0x7FFFFFFF;
  LSQ_REQUIRE(n >= 1 && k >= 1 && n <= kMax - 64 && k <= kMax - 128 && ldw >= k);
  LSQ_REQUIRE(qweight && qparams && w && aligned(qweight, 16) && aligned(qparams, 16));
  LSQ_REQUIRE(ceil_div(k, 16) <= 65535);  // qweight rows: the grid's y
  d->qweight = reinterpret_cast<const uint32_t*>(qweight);
  d->qparams = static_cast<const uint32_t*>(qparams);
  d->w = w;
  d->ldw = ldw;
  d->n = static_cast<int>(n);
  d->k = static_cast<int>(k);
  d->np = static_cast<int>(ceil_div(n, 64) * 64);
  d->kp = static_cast<int>(ceil_div(k, group_size) * group_size);
  d->gs_log2 = group_size == 32 ? 5 : group_size == 64 ? 6 : 7;
  d->w_vec = aligned(w, 4) && ldw % 2 == 0;
  return 0;
}

}  // namespace lsq_gemm

extern "C" {

int lsq_w4a16_num_configs(void) { return lsq_gemm::kNumConfigs; }

int lsq_w4a16_config(int32_t id, int32_t* block_m, int32_t* block_n, int32_t* block_k,
                     int32_t* warps, int32_t* warps_m, int32_t* warps_k, int32_t* stages,
                     int32_t* swap_ab) {
  if (id < 0 || id >= lsq_gemm::kNumConfigs) return -1;
  const lsq_gemm::ConfigInfo& c = lsq_gemm::kConfigs[id];
  if (block_m) *block_m = c.block_m;
  if (block_n) *block_n = c.block_n;
  if (block_k) *block_k = c.block_k;
  if (warps) *warps = c.warps;
  if (warps_m) *warps_m = c.warps_m;
  if (warps_k) *warps_k = c.warps_k;
  if (stages) *stages = c.stages;
  if (swap_ab) *swap_ab = c.swap;
  return 0;
}

// Launch y = x @ W_hat^T on `stream`. Every argument is checked before any CUDA call: a bad one
// returns cudaErrorInvalidValue and launches nothing (so this also holds on a machine without a
// GPU). m == 0 launches nothing and returns 0. With split_k > 1 and `counters` (zeros, at least
// one per output tile, counters_len of them, used by one stream at a time) the splits are summed
// in the same launch, by the last block of each tile, which leaves its counter 0 again; without
// them a second kernel sums them. Either way the bits are the same.
int lsq_w4a16_gemm(const void* x, int64_t ldx, const int32_t* qweight, const void* qparams, void* y,
                   int64_t ldy, float* workspace, uint32_t* counters, int64_t counters_len,
                   int64_t m, int64_t n, int64_t k, int32_t group_size, int32_t dtype,
                   int32_t config, int32_t split_k, void* stream) {
  lsq_gemm::Plan plan;
  const int err =
      lsq_gemm::plan_gemm(x, ldx, qweight, qparams, y, ldy, workspace, counters, counters_len, m,
                          n, k, group_size, dtype, config, split_k, &plan);
  if (err || m == 0) return err;
  lsq_gemm::Launcher launcher{plan, static_cast<cudaStream_t>(stream)};
  return lsq_gemm::dispatch(plan, launcher);
}

// w[n, k] = W_hat[n, k] (n < N, k < K) in fp16 or bf16, row stride ldw, on `stream`: the weights
// the GEMM multiplies, bit for bit, for a dense GEMM (prefill-sized M). Same checks and return
// convention as lsq_w4a16_gemm; columns past K and rows past N of w are left untouched.
int lsq_w4a16_dequantize(const int32_t* qweight, const void* qparams, void* w, int64_t ldw,
                         int64_t n, int64_t k, int32_t group_size, int32_t dtype, void* stream) {
  lsq_gemm::Dequant d;
  const int err = lsq_gemm::plan_dequant(qweight, qparams, w, ldw, n, k, group_size, dtype, &d);
  if (err) return err;
  const dim3 grid(static_cast<unsigned>(lsq_gemm::ceil_div(2 * d.np, 256)), d.kp / 16);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (dtype == lsq_gemm::kDtypeBf16)
    return lsq_launch(lsq_gemm::lsq_dequantize_words<true>, grid, dim3(256), 0, s, d);
  return lsq_launch(lsq_gemm::lsq_dequantize_words<false>, grid, dim3(256), 0, s, d);
}

// lsq_w4a16_dequantize on the CPU (host pointers), for tests without a GPU.
int lsq_emulate_w4a16_dequantize(const int32_t* qweight, const void* qparams, void* w,
                                 int64_t ldw, int64_t n, int64_t k, int32_t group_size,
                                 int32_t dtype) {
  lsq_gemm::Dequant d;
  const int err = lsq_gemm::plan_dequant(qweight, qparams, w, ldw, n, k, group_size, dtype, &d);
  if (err) return err;
#ifndef __CUDA_ARCH__
  for (int kt = 0; kt < d.kp / 16; ++kt) {
    for (int word = 0; word < 2 * d.np; ++word) {
      if (dtype == lsq_gemm::kDtypeBf16)
        lsq_gemm::dequant_word<true>(d, kt, word);
      else
        lsq_gemm::dequant_word<false>(d, kt, word);
    }
  }
#endif
  return 0;
}

// The same computation run on the CPU by the SIMT emulator (csrc/simt.cuh), on host pointers:
// for tests without a GPU. Same arguments and checks as lsq_w4a16_gemm; instead of a stream,
// copies_land_at_issue picks when cp.async copies land (0: at their wait, 1: at issue). The
// emulated cp.async refuses to read outside x, qweight and qparams.
int lsq_emulate_w4a16_gemm(const void* x, int64_t ldx, const int32_t* qweight,
                           const void* qparams, void* y, int64_t ldy, float* workspace,
                           uint32_t* counters, int64_t counters_len, int64_t m, int64_t n,
                           int64_t k, int32_t group_size, int32_t dtype, int32_t config,
                           int32_t split_k, int32_t copies_land_at_issue) {
  lsq_gemm::Plan plan;
  const int err =
      lsq_gemm::plan_gemm(x, ldx, qweight, qparams, y, ldy, workspace, counters, counters_len, m,
                          n, k, group_size, dtype, config, split_k, &plan);
  if (err || m == 0) return err;
  const lsq_gemm::Params& p = plan.p;
  auto range = [](const void* begin, int64_t bytes) {
    const uint8_t* b = static_cast<const uint8_t*>(begin);
    return lsq_simt::emulate::Range{b, b + bytes};
  };
  lsq_simt::emulate::Options options;
  options.copies_land_at_issue = copies_land_at_issue != 0;
  options.readable = {range(x, ((m - 1) * ldx + k) * 2),
                      range(qweight, (int64_t)(p.kp / 16) * (2 * p.np) * 4),
                      range(qparams, (int64_t)(p.kp >> p.gs_log2) * p.np * 4)};
  lsq_gemm::Emulator emulator{plan, &options};
  return lsq_gemm::dispatch(plan, emulator);
}

}  // extern "C"
