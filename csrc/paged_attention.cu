// Paged decode attention (flash-decoding) over the project's KV pool: fp16/bf16 values or
// int8/int4 codes with per-token, per-KV-head fp16 (scale, zero), x = code * scale + zero
// (runtime/kv/format.py). One new token per sequence: q [B, H, D] against each sequence's
// context, read through its block table. No torch headers; plain C entry points at the end.
//
// Grid: (partition, KV head x head chunk, sequence), 128 threads (4 warps) per block. A block
// owns one partition (partition_size tokens) of one sequence for one KV head and up to 8 of
// its query heads (GQA: each K/V byte is read once for the whole group; groups above 8 heads
// take more head chunks). The number of partitions comes from the block-table width, never
// from context_lens, so the launch needs no host sync and a CUDA graph can replay it: blocks
// past a sequence's end (or wholly before its sliding window) exit at once, and the merge
// reads only the partitions that hold tokens. With one partition the block normalizes and
// writes the output itself. With several, each block leaves its partial in the workspace and
// counts itself in on its (sequence, head group)'s counter; the last to arrive merges them
// and writes the output (one launch, the GEMM's one-launch split-K pattern). Without counters
// a second kernel merges.
//
// Inside a block each warp walks 16-token tiles (tiles w, w + 4, ...; a pool block holds whole
// tiles since block_size is a multiple of 16) with its own online softmax; the four warps are
// merged through shared memory at the end. Per tile, tensor-core products with the tokens on
// the M side and the group's heads on the N side (n = 8: no padding rows up to 8 heads):
//   S^T [16 tokens x 8 heads]  = K [16 x D] . Q^T [D x 8]          D/16 mma.m16n8k16
//   O^T [D x 8 heads]         += V^T [D x 16 tokens] . P^T [16 x 8]  D/16 mma.m16n8k16
// S^T's accumulator, as fp16 P, is turned into P^T's B fragments by two movmatrix.trans.
//
// No shared memory in the tile loop: each lane loads exactly the bytes of its own fragments,
// with 16-byte (or narrower) vector loads straight into registers. This works because the
// head dimension may be permuted freely: the score is a sum over d, so K and Q only need the
// same permutation, and V's permutation of d is undone when the output is stored. Lane (g, t)
// (g = lane / 4, t = lane % 4) reads
//   K of tokens g and g + 8: D/4 elements of each, chunks t, t + 4, t + 8, ... of the row, so
//     the 4 lanes of a token read its whole row, 4 x 16 contiguous bytes per instruction;
//   V of tokens 2t, 2t + 1, 2t + 8, 2t + 9: D/8 elements of each, chunks g, g + 8, ...;
//   the fp16 (scale, zero) of those tokens.
// Quantized codes become fp16 in registers with byte permutes and magic numbers (no integer to
// float conversion instructions): int8 byte b -> half(0x6400 | b) - 1024; int4 nibbles masked
// into 0x6400 | c (low) or 0x6400 | c << 4 (high, then * 1/16 - 64). All exact.
//   K: the scores use the codes directly, q.k = s * (q . c) + z * sum(q): the mma multiplies
//      fp16 q by exact integer codes, so K is never rounded.
//   V: dequantized to fp16 by one fma2 per token pair, v = c * s + z (rounded once, clamped at
//      the fp16 maximum); then P (fp16) . V as in flash attention. Token pairs are interleaved
//      by byte permutes (the A fragment pairs consecutive tokens of one d).
// A bf16 query on a quantized pool is scaled per head by a power of two into fp16 range
// (exact: bf16's 8 significant bits fit fp16's 11) and the score multiplied back, so all
// quantized pools use fp16 mma; a bf16 pool uses bf16 mma throughout.
//
// Softmax in the log2 domain (scale * log2(e) folded into each head's multiplier), fp32 state
// per head; masked positions are -inf and never produce NaN. Partials for the merge are
// (max, sum, unnormalized output) in fp32.
//
// Everything below up to the entry points is __host__ __device__: simt.cuh runs the same block
// bodies on a CPU (lsq_emulate_paged_decode_attention), which is how the tests check the
// fragment and permutation logic without a GPU.

#include <math.h>
#include <stdint.h>

#include "common.cuh"
#include "simt.cuh"

namespace lsq_pa {

using namespace lsq_simt;

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kTile = 16;  // tokens per warp step (the m of the score mma, the k of P.V)
constexpr int kHeads = 8;  // query heads per block (the n of both mmas)
constexpr int kMinBlocks = 3;  // decode blocks an SM holds at once (its __launch_bounds__)
// The partition planner's model (lsq_paged_decode_partition_size): a block's fixed cost in
// tokens' worth of streaming, and the shortest partition it makes.
constexpr int kBlockTokens = 64;
constexpr int kMinPartition = 256;
constexpr float kLog2e = 1.4426950408889634f;
constexpr uint32_t kMagic = 0x64006400u;      // fp16x2 (1024, 1024)
constexpr uint32_t kSixteenth = 0x2c002c00u;  // fp16x2 (1/16, 1/16)
constexpr uint32_t kMinus64 = 0xd400d400u;    // fp16x2 (-64, -64)
constexpr uint32_t kHalfMax = 0x7bff7bffu;    // fp16x2 (65504, 65504)

struct Params {
  const uint8_t* q;
  int64_t q_sb, q_sh;  // elements
  uint8_t* out;
  int64_t o_sb, o_sh;
  const uint8_t* k;
  const uint8_t* v;
  const uint16_t* ks;
  const uint16_t* kz;
  const uint16_t* vs;
  const uint16_t* vz;
  const int32_t* tables;
  int64_t table_stride;
  const int32_t* lens;
  int max_blocks, num_heads, num_kv_heads, group, chunks, block_size, window;
  int partition_size, num_partitions, head_dim;
  int l2_ahead;      // a warp asks L2 for its tile this many tiles ahead (0: never)
  float scale_log2;  // softmax scale * log2(e)
  float* ws_o;       // [B, H, P, D]
  float* ws_m;       // [B, H, P]
  float* ws_l;       // [B, H, P]
  uint32_t* counters;  // [B, KV heads x chunks]: partitions done (null: the merge kernel)
};

template <bool B>
struct BoolConstant {
  static constexpr bool value = B;
};

LSQ_HD constexpr int vec_width(int bytes) {
  return bytes % 16 == 0 ? 16 : bytes % 8 == 0 ? 8 : bytes % 4 == 0 ? 4 : 2;
}

template <int KIND, bool QBF16, int D>
struct Cfg {
  static constexpr bool kQuant = KIND == LSQ_KIND_INT8 || KIND == LSQ_KIND_INT4;
  static constexpr bool kMmaBf16 = KIND == LSQ_KIND_BF16;
  static constexpr bool kOutBf16 = QBF16;
  static constexpr int kBits = KIND == LSQ_KIND_INT4 ? 4 : KIND == LSQ_KIND_INT8 ? 8 : 16;
  static constexpr int kRowBytes = D * kBits / 8;  // one token of one KV head
  // K: D/4 elements per lane and token, in KCH chunks of KW bytes (EPK elements each)
  static constexpr int kKBytes = D / 4 * kBits / 8;
  static constexpr int KW = vec_width(kKBytes), KCH = kKBytes / KW, KWORDS = kKBytes / 4;
  static constexpr int EPK = KW * 8 / kBits;
  // V: D/8 elements per lane and token, in VCH chunks of VW bytes (EPV elements each)
  static constexpr int kVBytes = D / 8 * kBits / 8;
  static constexpr int VW = vec_width(kVBytes), VCH = kVBytes / VW, VWORDS = (kVBytes + 3) / 4;
  static constexpr int EPV = VW * 8 / kBits;
  static constexpr int kPerUnit = 16 / kBits;  // V elements per 16-bit unit
  static constexpr int KT = D / 16;            // k-steps of the score mma = m-tiles of O^T
  // the next tile's loads are issued before this tile's math when its raw bytes fit 32 words
  static constexpr bool kPrefetch = 2 * KWORDS + 4 * VWORDS <= 32;

  static_assert(D % 16 == 0, "head_dim is a multiple of 16");
  static_assert(kKBytes % 4 == 0 && kVBytes % 2 == 0, "whole words of K, 16-bit units of V");
  static_assert(KCH * KW == kKBytes && VCH * VW == kVBytes, "chunking");
};

// The d of element e of lane t's K slice, and of lane g's V slice.
template <class C>
LSQ_HD int k_dim(int t, int e) {
  return ((e / C::EPK) * 4 + t) * C::EPK + e % C::EPK;
}
template <class C>
LSQ_HD int v_dim(int g, int e) {
  return ((e / C::EPV) * 8 + g) * C::EPV + e % C::EPV;
}

// The K slice elements in fp16x2 register j after conversion (half 0 = low).
template <class C>
LSQ_HD int k_pair(int j, int half) {
  if constexpr (C::kBits == 4) return 8 * (j / 4) + j % 4 + 4 * half;
  return 2 * j + half;
}

template <int D>
struct Smem {
  union {
    float q[kHeads][D];          // the block's query rows (before the tile loop)
    float o[kWarps][kHeads][D];  // each warp's unnormalized output (after it)
  } u;
  float m[kWarps][kHeads];
  float l[kWarps][kHeads];
  float hm[kHeads];    // per head: scale * log2(e) * 2^shift (shift: the bf16 query's scaling)
  float qsum[kHeads];  // per head: the sum of the query as the mma sees it
  float merge_mx[kHeads], merge_sum[kHeads];  // the last block's merge (merge_heads)
  uint32_t last;       // this block is the last of its (sequence, head group) to finish
};

// One tile's raw bytes for one lane. The tile's 4 x 16 fp16 parameters are loaded by the
// warp together, two per lane: lane 8 a + i holds array a's (k_scale, k_zero, v_scale, v_zero)
// tokens 2i and 2i + 1 as an fp16x2 (shuffled out in compute_tile).
template <class C>
struct Raw {
  uint32_t k[2][C::KWORDS];  // tokens g, g + 8
  uint32_t v[4][C::VWORDS];  // tokens 2t, 2t + 1, 2t + 8, 2t + 9
  uint32_t par;              // quantized pools: the lane's two parameters
  bool valid[2];             // tokens g, g + 8 (this lane's score rows)
};

LSQ_HD float load_act(const uint8_t* base, int64_t index, bool bf16) {
  const uint16_t h = reinterpret_cast<const uint16_t*>(base)[index];
  return bf16 ? bf16_to_float(h) : half_to_float(h);
}

LSQ_HD void store_act(uint8_t* base, int64_t index, float x, bool bf16) {
  reinterpret_cast<uint16_t*>(base)[index] = bf16 ? float_to_bf16(x) : float_to_half(x);
}

// Where this lane's bytes of a tile are, relative to the tile's first row (token 0 of the
// tile, this KV head): loop-invariant, so a tile costs one 64-bit base address.
struct LaneMap {
  int32_t k[2], v[4];  // bytes to the first chunk of K tokens g, g + 8 and V tokens 2t.. 2t+9
  int jk[2], jv[4];    // the tokens' positions in the tile
  const uint16_t* par;  // quantized: this lane's parameter array (lane / 8)
  int32_t par_off;      // elements from the tile's first row to its token 2 (lane % 8)
  int jp;               // that token's position in the tile
};

template <class C>
LSQ_HD LaneMap lane_map(const Params& p, int lane) {
  const int g = lane >> 2, t = lane & 3;
  const int32_t row = p.num_kv_heads * C::kRowBytes;  // bytes from one token to the next
  LaneMap m;
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    m.jk[s] = g + 8 * s;
    m.k[s] = m.jk[s] * row + t * C::KW;
  }
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    m.jv[s] = 2 * t + (s & 1) + 8 * (s >> 1);
    m.v[s] = m.jv[s] * row + g * C::VW;
  }
  const int array = lane >> 3;
  m.par = array == 0 ? p.ks : array == 1 ? p.kz : array == 2 ? p.vs : p.vz;
  m.jp = 2 * (lane & 7);
  m.par_off = m.jp * p.num_kv_heads;
  return m;
}

// The tile's K bytes for this lane (and which of its score rows are valid). row0 = the tile's
// first slot * Hkv + KV head. MASKED: some positions fall outside [valid_lo, valid_hi) and are
// not read (zeros); else all are valid.
template <class C, bool MASKED>
LSQ_HD void load_k(const Params& p, int64_t row0, int t0, const LaneMap& lm, int valid_lo,
                   int valid_hi, Raw<C>& raw) {
  const uint8_t* kb = p.k + row0 * C::kRowBytes;
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const int pos = t0 + lm.jk[s];
    const bool ok = !MASKED || (pos >= valid_lo && pos < valid_hi);
    raw.valid[s] = ok;
    const uint8_t* row = kb + lm.k[s];
#pragma unroll
    for (int i = 0; i < C::KCH; ++i) {
      uint32_t* words = &raw.k[s][i * C::KW / 4];
      if (ok) {
        load_global<C::KW>(row + i * 4 * C::KW, words);
      } else {
#pragma unroll
        for (int w = 0; w < C::KW / 4; ++w) words[w] = 0;
      }
    }
  }
}

// The tile's V bytes and (quantized pools) parameters for this lane; as load_k.
template <class C, bool MASKED>
LSQ_HD void load_v(const Params& p, int64_t row0, int t0, const LaneMap& lm, int valid_lo,
                   int valid_hi, Raw<C>& raw) {
  const uint8_t* vb = p.v + row0 * C::kRowBytes;
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const int pos = t0 + lm.jv[s];
    const bool ok = !MASKED || (pos >= valid_lo && pos < valid_hi);
    const uint8_t* row = vb + lm.v[s];
#pragma unroll
    for (int i = 0; i < C::VCH; ++i) {
      if constexpr (C::VW >= 4) {
        uint32_t* words = &raw.v[s][i * C::VW / 4];
        if (ok) {
          load_global<C::VW>(row + i * 8 * C::VW, words);
        } else {
#pragma unroll
          for (int w = 0; w < C::VW / 4; ++w) words[w] = 0;
        }
      } else {  // 2-byte chunks, two to a word
        uint32_t h = 0;
        if (ok) load_global<2>(row + i * 8 * 2, &h);
        if (i % 2 == 0)
          raw.v[s][i / 2] = h;
        else
          raw.v[s][i / 2] |= h << 16;
      }
    }
  }
  if constexpr (C::kQuant) {  // positions outside the range get scale and zero 0: v = 0
    const uint16_t* par = lm.par + row0 + lm.par_off;
    const int pos = t0 + lm.jp;
    const bool ok0 = !MASKED || (pos >= valid_lo && pos < valid_hi);
    const bool ok1 = !MASKED || (pos + 1 >= valid_lo && pos + 1 < valid_hi);
    const uint32_t lo = ok0 ? load_u16(par) : 0u;
    const uint32_t hi = ok1 ? load_u16(par + p.num_kv_heads) : 0u;
    raw.par = lo | (hi << 16);
  }
}

// K slice of one token as D/8 fp16x2 (or bf16x2) registers: register j holds the slice
// elements k_pair(j, 0) (low half) and k_pair(j, 1).
template <class C>
LSQ_HD void convert_k(const uint32_t (&w)[C::KWORDS], uint32_t (&h)[C::KT * 2]) {
  if constexpr (C::kBits == 16) {
#pragma unroll
    for (int j = 0; j < C::KT * 2; ++j) h[j] = w[j];
  } else if constexpr (C::kBits == 8) {
#pragma unroll
    for (int i = 0; i < C::KWORDS; ++i) {
      h[2 * i] = hsub2(prmt(w[i], 0x64646464u, 0x4140), kMagic);
      h[2 * i + 1] = hsub2(prmt(w[i], 0x64646464u, 0x4342), kMagic);
    }
  } else {
#pragma unroll
    for (int i = 0; i < C::KWORDS; ++i) {
      const uint32_t lo = w[i], hi = w[i] >> 8;
      h[4 * i] = hsub2(and_or(lo, 0x000f000fu, kMagic), kMagic);
      h[4 * i + 1] = hfma2(and_or(lo, 0x00f000f0u, kMagic), kSixteenth, kMinus64);
      h[4 * i + 2] = hsub2(and_or(hi, 0x000f000fu, kMagic), kMagic);
      h[4 * i + 3] = hfma2(and_or(hi, 0x00f000f0u, kMagic), kSixteenth, kMinus64);
    }
  }
}

// Element e of the lane's V slice for the token pair pr (tokens 2t, 2t + 1 or 2t + 8, 2t + 9)
// as fp16x2 (bf16x2 for a bf16 pool), the first token in the low half: V^T's A fragment.
// CLAMP: v = c * s + z may exceed the fp16 range (only for saturated values): clamp it.
template <class C, bool CLAMP>
LSQ_HD uint32_t v_operand(const Raw<C>& raw, int e, int pr, uint32_t scale2, uint32_t zero2) {
  const int u = e / C::kPerUnit;  // its 16-bit unit; interleave the pair's units
  const uint32_t x =
      prmt(raw.v[2 * pr][u / 2], raw.v[2 * pr + 1][u / 2], (u & 1) ? 0x7632u : 0x5410u);
  if constexpr (C::kBits == 16) {
    return x;
  } else {
    uint32_t c;
    if constexpr (C::kBits == 8) {  // bytes 0 and 2 (or 1 and 3) into 0x64XX halves
      c = hsub2(prmt(x, 0x64646464u, (e & 1) ? 0x4341u : 0x4240u), kMagic);
    } else {
      const uint32_t y = (e & 2) ? x >> 8 : x;
      c = (e & 1) ? hfma2(and_or(y, 0x00f000f0u, kMagic), kSixteenth, kMinus64)
                  : hsub2(and_or(y, 0x000f000fu, kMagic), kMagic);
    }
    const uint32_t v = hfma2(c, scale2, zero2);
    return CLAMP ? hmin2(v, kHalfMax) : v;
  }
}

// One tile: scores, online softmax, P.V into acc. This lane holds heads 2t and 2t + 1
// (index h = 0, 1) for tokens g and g + 8. k_done() runs once the tile's K bytes and valid
// flags are consumed (after the scores): it may load the next tile's into raw.
template <class C, class KDone>
LSQ_HD void compute_tile(Raw<C>& raw, int lane, const uint32_t (&qb)[C::KT][2],
                         const float (&hm)[2], const float (&qs)[2], float (&m)[2], float (&l)[2],
                         float (&acc)[C::KT][4], KDone&& k_done) {
  const int g = lane >> 2, t = lane & 3;
  // the parameters this lane needs, from the lanes that loaded them (see Raw)
  float ks[2] = {0.f, 0.f}, kz[2] = {0.f, 0.f};
  uint32_t scale2[2] = {0, 0}, zero2[2] = {0, 0};
  if constexpr (C::kQuant) {
#pragma unroll
    for (int s = 0; s < 2; ++s) {  // K of tokens g + 8 s: arrays 0, 1, pair (g + 8 s) / 2
      const int shift = 16 * (g & 1);
      ks[s] = half_to_float(static_cast<uint16_t>(shfl_idx(raw.par, g / 2 + 4 * s) >> shift));
      kz[s] = half_to_float(static_cast<uint16_t>(shfl_idx(raw.par, 8 + g / 2 + 4 * s) >> shift));
    }
#pragma unroll
    for (int pr = 0; pr < 2; ++pr) {  // V of tokens 2t + 8 pr, 2t + 8 pr + 1: pair t + 4 pr
      scale2[pr] = shfl_idx(raw.par, 16 + t + 4 * pr);
      zero2[pr] = shfl_idx(raw.par, 24 + t + 4 * pr);
    }
  }
  // S^T: rows tokens g (c[0], c[1]) and g + 8 (c[2], c[3]), columns heads 2t, 2t + 1
  float c[4] = {0.f, 0.f, 0.f, 0.f};
  {
    uint32_t ka[C::KT * 2], kb[C::KT * 2];
    convert_k<C>(raw.k[0], ka);
    convert_k<C>(raw.k[1], kb);
#pragma unroll
    for (int kt = 0; kt < C::KT; ++kt) {
      const uint32_t a[4] = {ka[2 * kt], kb[2 * kt], ka[2 * kt + 1], kb[2 * kt + 1]};
      mma_16816<C::kMmaBf16>(c, a, qb[kt][0], qb[kt][1]);
    }
  }
  float s[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int row = i >> 1, h = i & 1;
    float x = c[i];
    if constexpr (C::kQuant) x = fmaf(ks[row], x, kz[row] * qs[h]);
    s[i] = raw.valid[row] ? x * hm[h] : -INFINITY;
  }
  k_done();
  // online softmax per head; a head's 16 tokens are spread over the 8 lanes with this t
  float p[4], alphas[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = fmaxf(s[h], s[2 + h]);
    mx = fmaxf(mx, shfl_xor(mx, 4));
    mx = fmaxf(mx, shfl_xor(mx, 8));
    mx = fmaxf(mx, shfl_xor(mx, 16));
    const float m_new = fmaxf(m[h], mx);
    const float m_safe = m_new == -INFINITY ? 0.f : m_new;  // nothing valid yet: all p are 0
    const float alpha = ex2(m[h] - m_safe);
    p[h] = ex2(s[h] - m_safe);
    p[2 + h] = ex2(s[2 + h] - m_safe);
    l[h] = l[h] * alpha + (p[h] + p[2 + h]);
    m[h] = m_new;
    alphas[h] = alpha;
  }
  if (warp_any(alphas[0] != 1.f || alphas[1] != 1.f)) {  // a running max moved: rescale
#pragma unroll
    for (int mt = 0; mt < C::KT; ++mt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][i] *= alphas[i & 1];
  }
  // P^T as the B operand: rows of P (tokens g, g + 8) transposed into columns
  const uint32_t p0 = C::kMmaBf16 ? pack_bf162(p[0], p[1]) : pack_half2(p[0], p[1]);
  const uint32_t p1 = C::kMmaBf16 ? pack_bf162(p[2], p[3]) : pack_half2(p[2], p[3]);
  const uint32_t b0 = movmatrix_trans(p0), b1 = movmatrix_trans(p1);
  // V^T as the A operand: m-tile mt's rows g and g + 8 are slice elements 2 mt and 2 mt + 1
  auto pv = [&](auto clamp) {
    constexpr bool kClamp = decltype(clamp)::value;
#pragma unroll
    for (int mt = 0; mt < C::KT; ++mt) {
      const uint32_t a[4] = {v_operand<C, kClamp>(raw, 2 * mt, 0, scale2[0], zero2[0]),
                             v_operand<C, kClamp>(raw, 2 * mt + 1, 0, scale2[0], zero2[0]),
                             v_operand<C, kClamp>(raw, 2 * mt, 1, scale2[1], zero2[1]),
                             v_operand<C, kClamp>(raw, 2 * mt + 1, 1, scale2[1], zero2[1])};
      mma_16816<C::kMmaBf16>(acc[mt], a, b0, b1);
    }
  };
  if constexpr (C::kQuant) {
    // the largest value a pair can dequantize to, zero + qmax * scale, computed in fp16: a
    // tile only needs the clamp when that overflows (values saturated at 65504)
    constexpr uint32_t kQmax2 = C::kBits == 8 ? 0x5bf85bf8u : 0x4b804b80u;  // 255 or 15
    bool overflow = false;
#pragma unroll
    for (int pr = 0; pr < 2; ++pr) {
      const uint32_t top = hfma2(kQmax2, scale2[pr], zero2[pr]);
      overflow |= (top & 0x7c00u) == 0x7c00u || (top & 0x7c000000u) == 0x7c000000u;  // inf
    }
    if (warp_any(overflow))
      pv(BoolConstant<true>());
    else
      pv(BoolConstant<false>());
  } else {
    pv(BoolConstant<false>());
  }
}

// The partitions [first, used) of a sequence of len tokens that hold valid tokens: those whose
// blocks write a partial (decode_block returns early for the others).
struct Valid {
  int first, used;
};

LSQ_HD Valid valid_partitions(const Params& p, int len) {
  if (len <= 0) return {0, 0};
  const int ps = p.partition_size;
  const int win_lo = p.window > 0 && len > p.window ? len - p.window : 0;
  const int used = (len + ps - 1) / ps;
  return {win_lo / ps, used < p.num_partitions ? used : p.num_partitions};
}

LSQ_HD int context_len(const Params& p, unsigned b) {
  const int64_t capacity = static_cast<int64_t>(p.max_blocks) * p.block_size;
  const int64_t len64 = p.lens[b];
  return static_cast<int>(len64 < capacity ? len64 : capacity);
}

// Whether this block is the last of its (sequence, head group)'s valid partitions to finish:
// it counts itself in on the group's counter, which the last sets back to 0 for the next
// launch. The fences order every block's partials before its count and the last block's reads
// after it (the GEMM's finish_split; CUDA's threadFenceReduction sample).
LSQ_HD bool last_to_finish(const Params& p, int len, int b, unsigned by, int tid, uint32_t& last) {
  thread_fence();  // this thread's partials are visible to the GPU before the block counts in
  block_sync();    // and every thread's are
  if (tid == 0) {
    thread_fence();
    const Valid v = valid_partitions(p, len);
    uint32_t* const counter = p.counters + static_cast<int64_t>(b) * p.num_kv_heads * p.chunks + by;
    const bool done = atomic_add(counter, 1u) == static_cast<uint32_t>(v.used - v.first - 1);
    if (done) *counter = 0u;  // no other block of this launch touches it again
    last = done;
  }
  block_sync();
  if (!last) return false;
  thread_fence();
  return true;
}

// Log-sum-exp merge of heads head0 .. head0 + rows - 1 of sequence b over its partitions (only
// those holding valid tokens), by the whole block of `threads` threads. The partials are read
// from L2 (ld.global.cg: in the one-launch path other blocks wrote them during this kernel), so
// each load is a round trip, and the loops are laid out for none to wait for another:
//   1. one warp a head: its lanes read the partitions' maxima (strided), a butterfly gives the
//      head's max, then the sum of the partitions' weights 2^(m - max) * l the same way;
//   2. each thread takes up to 4 outputs (head, d) and walks the partitions 4 at a time, 32
//      loads in flight, keeping 4 partial sums an output (by partition index mod 4).
// Every output's arithmetic is the same whatever the block and thread layout, so the merge
// kernel (one head a block) and the decode launch's last block (its head group) agree bit for
// bit. mx_sh and sum_sh: shared memory of rows floats each.
template <bool OUT_BF16>
LSQ_HD void merge_heads(const Params& p, unsigned head0, int rows, unsigned b, int tid,
                        int threads, float* mx_sh, float* sum_sh) {
  const Valid v = valid_partitions(p, context_len(p, b));
  const int n = v.used - v.first;
  const int D = p.head_dim;
  const int lane = tid & 31;
  auto first = [&](int row) {  // partial record of (b, head0 + row, partition v.first)
    return ((static_cast<int64_t>(b) * p.num_heads + head0 + row) * p.num_partitions) + v.first;
  };
  for (int row = tid >> 5; row < rows; row += threads >> 5) {  // warp-uniform
    const int64_t at = first(row);
    float mx = -INFINITY;
    for (int q = lane; q < n; q += 32) mx = fmaxf(mx, load_cg_f32(p.ws_m + at + q));
#pragma unroll
    for (int x = 16; x > 0; x >>= 1) mx = fmaxf(mx, shfl_xor(mx, x));
    float sum = 0.f;
    for (int q = lane; q < n; q += 32) {
      const float mq = load_cg_f32(p.ws_m + at + q), lq = load_cg_f32(p.ws_l + at + q);
      if (mq != -INFINITY) sum += ex2(mq - mx) * lq;
    }
#pragma unroll
    for (int x = 16; x > 0; x >>= 1) sum += shfl_xor(sum, x);
    if (lane == 0) mx_sh[row] = mx, sum_sh[row] = sum;
  }
  block_sync();
  constexpr int kItems = 4, kAhead = 4;  // outputs a thread at once, partitions per round
  const int items = rows * D;
  for (int item0 = tid; item0 < items; item0 += kItems * threads) {
    int64_t at[kItems], col[kItems];
    float mx[kItems], acc[kItems][kAhead];
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int item = item0 + j * threads, row = item < items ? item / D : 0;
      at[j] = first(row);
      col[j] = item < items ? item % D : 0;
      mx[j] = mx_sh[row];
#pragma unroll
      for (int u = 0; u < kAhead; ++u) acc[j][u] = 0.f;
    }
    for (int q = 0; q < n; q += kAhead) {
      float mq[kItems][kAhead], oq[kItems][kAhead];
#pragma unroll
      for (int u = 0; u < kAhead; ++u)
#pragma unroll
        for (int j = 0; j < kItems; ++j) {
          const bool in = q + u < n;
          mq[j][u] = in ? load_cg_f32(p.ws_m + at[j] + q + u) : -INFINITY;
          oq[j][u] = in ? load_cg_f32(p.ws_o + (at[j] + q + u) * D + col[j]) : 0.f;
        }
#pragma unroll
      for (int u = 0; u < kAhead; ++u)
#pragma unroll
        for (int j = 0; j < kItems; ++j)
          if (mq[j][u] != -INFINITY) acc[j][u] = fmaf(ex2(mq[j][u] - mx[j]), oq[j][u], acc[j][u]);
    }
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int item = item0 + j * threads;
      if (item >= items) break;
      const int row = item / D;
      const float o = (acc[j][0] + acc[j][1]) + (acc[j][2] + acc[j][3]), sum = sum_sh[row];
      store_act(p.out, b * p.o_sb + (head0 + row) * p.o_sh + col[j],
                sum > 0.f ? fdiv_fast(o, sum) : 0.f, OUT_BF16);
    }
  }
}

// The whole block: stage the query rows, walk this warp's tiles, merge the warps, write.
template <int KIND, bool QBF16, int D>
LSQ_HD void decode_block(const Params& p, unsigned bx, unsigned by, unsigned bz, int tid,
                         Smem<D>& sm) {
  using C = Cfg<KIND, QBF16, D>;
  const int part = static_cast<int>(bx), b = static_cast<int>(bz);
  const int kv_head = static_cast<int>(by) / p.chunks, chunk = static_cast<int>(by) % p.chunks;
  const int head0 = kv_head * p.group + chunk * kHeads;
  const int rows = p.group - chunk * kHeads < kHeads ? p.group - chunk * kHeads : kHeads;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const bool single = p.num_partitions == 1;

  const int len = context_len(p, bz);
  if (len <= 0) {  // an empty sequence (not a valid input): zeros rather than garbage
    if (single || (part == 0 && p.counters))  // else the merge kernel writes them
      for (int i = tid; i < rows * D; i += kThreads)
        store_act(p.out, b * p.o_sb + (head0 + i / D) * p.o_sh + i % D, 0.f, C::kOutBf16);
    return;
  }
  const int win_lo = p.window > 0 && len > p.window ? len - p.window : 0;  // first valid pos
  const int p_lo = part * p.partition_size;
  const int p_hi = p_lo + p.partition_size < len ? p_lo + p.partition_size : len;
  if (p_lo >= len || p_hi <= win_lo) return;  // the merge does not read this partition

  // the query rows, fp32 in shared memory; rows past the group are zero
  for (int i = tid; i < kHeads * D; i += kThreads) {
    const int row = i / D, d = i % D;
    sm.u.q[row][d] =
        row < rows ? load_act(p.q, b * p.q_sb + (head0 + row) * p.q_sh + d, QBF16) : 0.f;
  }
  block_sync();
  for (int row = warp; row < kHeads; row += kWarps) {
    float hm = p.scale_log2, qsum = 0.f;
    if constexpr (C::kQuant) {
      int shift = 0;
      if constexpr (QBF16) {  // into fp16 range by a power of two: max |q| below 2^15
        float mx = 0.f;
        for (int d = lane; d < D; d += 32) mx = fmaxf(mx, fabsf(sm.u.q[row][d]));
#pragma unroll
        for (int o = 16; o >= 1; o >>= 1) mx = fmaxf(mx, shfl_xor(mx, o));
        int e = 0;
        if (mx > 0.f) frexpf(mx, &e);  // mx < 2^e
        shift = e - 15;
      }
      for (int d = lane; d < D; d += 32) {
        const float x = half_to_float(float_to_half(ldexpf(sm.u.q[row][d], -shift)));
        sm.u.q[row][d] = x;
        qsum += x;
      }
#pragma unroll
      for (int o = 16; o >= 1; o >>= 1) qsum += shfl_xor(qsum, o);
      hm = ldexpf(hm, shift);
    }
    if (lane == 0) {
      sm.hm[row] = hm;
      sm.qsum[row] = qsum;
    }
  }
  block_sync();
  // Q^T as the B operand of the score mma (column g = head g), in K's permutation of d
  uint32_t qb[C::KT][2];
#pragma unroll
  for (int kt = 0; kt < C::KT; ++kt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float x0 = sm.u.q[g][k_dim<C>(t, k_pair<C>(2 * kt + half, 0))];
      const float x1 = sm.u.q[g][k_dim<C>(t, k_pair<C>(2 * kt + half, 1))];
      qb[kt][half] = C::kMmaBf16 ? pack_bf162(x0, x1) : pack_half2(x0, x1);
    }
  const float hm[2] = {sm.hm[2 * t], sm.hm[2 * t + 1]};
  const float qs[2] = {sm.qsum[2 * t], sm.qsum[2 * t + 1]};
  block_sync();  // the query rows are dead: their shared memory holds the warps' outputs next

  // this warp's tiles: tile i starts at lo + 16 (warp + 4 i), i < my_tiles
  const int lo = p_lo > (win_lo & ~(kTile - 1)) ? p_lo : (win_lo & ~(kTile - 1));
  const int n_tiles = (p_hi - lo + kTile - 1) / kTile;
  const int my_tiles = n_tiles > warp ? (n_tiles - warp + kWarps - 1) / kWarps : 0;
  const int32_t* table = p.tables + b * p.table_stride;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float acc[C::KT][4];
#pragma unroll
  for (int mt = 0; mt < C::KT; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.f;

  // first rows of the tiles: lane i looks up tile 32 k + i, shuffled out tile by tile
  const LaneMap lm = lane_map<C>(p, lane);
  uint32_t row_lo = 0, row_hi = 0;
  int round = -1;
  auto tile_start = [&](int i) { return lo + kTile * (warp + kWarps * i); };
  // tile i's K bytes (what & 1) and V bytes (what & 2) into raw
  auto fetch = [&](int i, Raw<C>& raw, int what) {
    if (i / 32 != round) {  // warp-uniform
      round = i / 32;
      const int mine = 32 * round + lane;
      if (mine < my_tiles) {
        const int t0 = tile_start(mine);
        const int64_t slot0 =
            static_cast<int64_t>(table[t0 / p.block_size]) * p.block_size + t0 % p.block_size;
        const int64_t row0 = slot0 * p.num_kv_heads + kv_head;
        row_lo = static_cast<uint32_t>(row0), row_hi = static_cast<uint32_t>(row0 >> 32);
      }
    }
    const int64_t row0 = static_cast<int64_t>(
        (static_cast<uint64_t>(shfl_idx(row_hi, i % 32)) << 32) | shfl_idx(row_lo, i % 32));
    const int t0 = tile_start(i);
    if (t0 >= win_lo && t0 + kTile <= p_hi) {  // the whole tile is valid (warp-uniform)
      if (what & 1) load_k<C, false>(p, row0, t0, lm, win_lo, p_hi, raw);
      if (what & 2) load_v<C, false>(p, row0, t0, lm, win_lo, p_hi, raw);
    } else {
      if (what & 1) load_k<C, true>(p, row0, t0, lm, win_lo, p_hi, raw);
      if (what & 2) load_v<C, true>(p, row0, t0, lm, win_lo, p_hi, raw);
    }
  };
  // tile i's K and V lines (and quantization parameters) into L2, where its register loads
  // will find them: bytes in flight that cost no registers. Only tiles of the round whose rows
  // the lanes hold (warp-uniform; a round's first tiles go without).
  auto prefetch = [&](int i) {
    if (i >= my_tiles || i / 32 != round) return;
    const int64_t row0 = static_cast<int64_t>(
        (static_cast<uint64_t>(shfl_idx(row_hi, i % 32)) << 32) | shfl_idx(row_lo, i % 32));
    constexpr int kLines = (C::kRowBytes + 127) / 128;  // 128-byte lines a token's row spans
#pragma unroll
    for (int idx = lane; idx < 2 * kTile * kLines; idx += 32) {
      const int token = (idx / kLines) % kTile, line = idx % kLines;
      const uint8_t* base = idx < kTile * kLines ? p.k : p.v;
      prefetch_l2(base + (row0 + token * p.num_kv_heads) * C::kRowBytes + line * 128);
    }
    if constexpr (C::kQuant) {  // lanes 8a, 8a + 1: array a's (lm.par) tokens 0 and 8
      if ((lane & 7) < 2) prefetch_l2(lm.par + row0 + (lane & 1) * 8 * p.num_kv_heads);
    }
  };
  constexpr int kK = 1, kV = 2, kBoth = 3;
  auto no_early_k = [] {};

  if (my_tiles > 0) {
    Raw<C> a;
    fetch(0, a, kBoth);
    if constexpr (C::kPrefetch) {  // two buffers in turn: tile i + 1 loads during tile i
      Raw<C> b;
      for (int i = 0;; i += 2) {
        if (i + 1 < my_tiles) fetch(i + 1, b, kBoth);
        if (p.l2_ahead) prefetch(i + 1 + p.l2_ahead);
        compute_tile<C>(a, lane, qb, hm, qs, m, l, acc, no_early_k);
        if (i + 1 >= my_tiles) break;
        if (i + 2 < my_tiles) fetch(i + 2, a, kBoth);
        if (p.l2_ahead) prefetch(i + 2 + p.l2_ahead);
        compute_tile<C>(b, lane, qb, hm, qs, m, l, acc, no_early_k);
        if (i + 2 >= my_tiles) break;
      }
    } else {
      // Two tiles' bytes do not fit the registers (16-bit pools at d96, d128), but half of
      // each does: tile i + 1's K loads once tile i's scores are done (during its softmax and
      // P.V) and its V once tile i's P.V is (during tile i + 1's scores), in the registers the
      // finished half used.
      for (int i = 0;;) {
        const bool more = i + 1 < my_tiles;
        compute_tile<C>(a, lane, qb, hm, qs, m, l, acc, [&] {
          if (more) fetch(i + 1, a, kK);
        });
        if (!more) break;
        fetch(++i, a, kV);
        if (p.l2_ahead) prefetch(i + p.l2_ahead);
      }
    }
  }

  // the warps' (max, sum, output) through shared memory, in the true order of d
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += shfl_xor(l[h], 4);
    l[h] += shfl_xor(l[h], 8);
    l[h] += shfl_xor(l[h], 16);
  }
  if (g == 0) {
    sm.m[warp][2 * t] = m[0], sm.l[warp][2 * t] = l[0];
    sm.m[warp][2 * t + 1] = m[1], sm.l[warp][2 * t + 1] = l[1];
  }
#pragma unroll
  for (int mt = 0; mt < C::KT; ++mt)
#pragma unroll
    for (int i = 0; i < 4; ++i)
      sm.u.o[warp][2 * t + (i & 1)][v_dim<C>(g, 2 * mt + (i >> 1))] = acc[mt][i];
  block_sync();
  const int64_t rec = (static_cast<int64_t>(b) * p.num_heads + head0) * p.num_partitions + part;
  for (int i = tid; i < rows * D; i += kThreads) {
    const int row = i / D, d = i % D;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, sm.m[w][row]);
    float sum = 0.f, o = 0.f;
    if (mx != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        if (sm.m[w][row] == -INFINITY) continue;  // a warp without valid tokens
        const float f = ex2(sm.m[w][row] - mx);
        sum += f * sm.l[w][row];
        o += f * sm.u.o[w][row][d];
      }
    }
    if (single) {
      store_act(p.out, b * p.o_sb + (head0 + row) * p.o_sh + d, sum > 0.f ? fdiv_fast(o, sum) : 0.f,
                C::kOutBf16);
    } else {
      const int64_t r = rec + static_cast<int64_t>(row) * p.num_partitions;
      p.ws_o[r * D + d] = o;
      if (d == 0) p.ws_m[r] = mx, p.ws_l[r] = sum;
    }
  }
  if (!single && p.counters && last_to_finish(p, len, b, by, tid, sm.last))
    merge_heads<C::kOutBf16>(p, head0, rows, b, tid, kThreads, sm.merge_mx, sm.merge_sum);
}

template <int KIND, bool QBF16, int D>
__global__ void __launch_bounds__(kThreads, kMinBlocks) decode_kernel(const Params p) {
  grid_dependency_wait();  // nothing before it: the grids before this one may still run
  launch_dependents();
  __shared__ Smem<D> sm;
  decode_block<KIND, QBF16, D>(p, blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x, sm);
}

template <bool OUT_BF16>
__global__ void __launch_bounds__(128) merge_kernel(const Params p) {
  grid_dependency_wait();  // nothing before it: the grids before this one may still run
  launch_dependents();
  __shared__ float mx_sh[1], sum_sh[1];
  merge_heads<OUT_BF16>(p, blockIdx.x, 1, blockIdx.y, threadIdx.x, blockDim.x, mx_sh, sum_sh);
}

// Tiles ahead a warp prefetches into L2 (Params::l2_ahead), for every launch of this process:
// lsq_paged_decode_l2_prefetch sets it (benchmarks time the choices against each other).
static int g_l2_ahead = 2;

struct Plan {
  Params p;
  int kind, d, batch;
  bool qbf16;
  unsigned grid_x, grid_y;
};

static inline bool aligned(const void* ptr, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

static inline int64_t num_partitions(int64_t max_blocks, int64_t block_size,
                                     int64_t partition_size) {
  return (max_blocks * block_size + partition_size - 1) / partition_size;
}

// Every check of the entry point; fills the plan. No CUDA call.
static int plan_decode(const void* q, int64_t q_stride_b, int64_t q_stride_h, void* out,
                       int64_t out_stride_b, int64_t out_stride_h, const void* k_cache,
                       const void* v_cache, const void* k_scale, const void* k_zero,
                       const void* v_scale, const void* v_zero, int32_t kv_kind,
                       int32_t q_dtype, const int32_t* block_tables, int64_t table_stride,
                       int64_t max_blocks, const int32_t* context_lens, int64_t batch,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                       int64_t block_size, int32_t sliding_window, float scale,
                       int64_t partition_size, float* workspace, uint32_t* counters,
                       int64_t counters_len, Plan* plan) {
  constexpr int64_t kIntMax = 0x7fffffff;
  LSQ_REQUIRE(kv_kind >= LSQ_KIND_BF16 && kv_kind <= LSQ_KIND_INT4);
  LSQ_REQUIRE(q_dtype == LSQ_KIND_BF16 || q_dtype == LSQ_KIND_FP16);
  const bool quant = kv_kind == LSQ_KIND_INT8 || kv_kind == LSQ_KIND_INT4;
  LSQ_REQUIRE(quant || q_dtype == kv_kind);
  LSQ_REQUIRE(head_dim == 64 || head_dim == 96 || head_dim == 128);
  LSQ_REQUIRE(batch >= 0 && batch <= 65535);
  LSQ_REQUIRE(num_kv_heads >= 1 && num_heads >= num_kv_heads && num_heads <= 65535);
  LSQ_REQUIRE(num_heads % num_kv_heads == 0);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t chunks = (group + kHeads - 1) / kHeads;
  LSQ_REQUIRE(num_kv_heads * chunks <= 65535);
  LSQ_REQUIRE(block_size >= 16 && block_size % 16 == 0 && block_size <= 65536);
  LSQ_REQUIRE(max_blocks >= 1 && max_blocks <= kIntMax / block_size);
  LSQ_REQUIRE(table_stride >= max_blocks);
  LSQ_REQUIRE(partition_size >= block_size && partition_size % block_size == 0);
  LSQ_REQUIRE(partition_size <= kIntMax);
  LSQ_REQUIRE(sliding_window >= 0);
  LSQ_REQUIRE(isfinite(scale));
  LSQ_REQUIRE(q_stride_b >= 0 && q_stride_h >= 0 && out_stride_b >= 0 && out_stride_h >= 0);
  LSQ_REQUIRE(q && out && k_cache && v_cache && block_tables && context_lens);
  LSQ_REQUIRE(aligned(q, 2) && aligned(out, 2) && aligned(k_cache, 16) && aligned(v_cache, 16));
  LSQ_REQUIRE(aligned(block_tables, 4) && aligned(context_lens, 4));
  if (quant) {
    LSQ_REQUIRE(k_scale && k_zero && v_scale && v_zero);
    LSQ_REQUIRE(aligned(k_scale, 2) && aligned(k_zero, 2) && aligned(v_scale, 2) &&
                aligned(v_zero, 2));
  }
  const int64_t parts = num_partitions(max_blocks, block_size, partition_size);
  if (parts > 1) LSQ_REQUIRE(workspace && aligned(workspace, 4));
  LSQ_REQUIRE(counters_len >= 0 && (!counters || aligned(counters, 4)));

  Params& p = plan->p;
  p.q = static_cast<const uint8_t*>(q);
  p.q_sb = q_stride_b, p.q_sh = q_stride_h;
  p.out = static_cast<uint8_t*>(out);
  p.o_sb = out_stride_b, p.o_sh = out_stride_h;
  p.k = static_cast<const uint8_t*>(k_cache);
  p.v = static_cast<const uint8_t*>(v_cache);
  p.ks = static_cast<const uint16_t*>(k_scale);
  p.kz = static_cast<const uint16_t*>(k_zero);
  p.vs = static_cast<const uint16_t*>(v_scale);
  p.vz = static_cast<const uint16_t*>(v_zero);
  p.tables = block_tables;
  p.table_stride = table_stride;
  p.lens = context_lens;
  p.max_blocks = static_cast<int>(max_blocks);
  p.num_heads = static_cast<int>(num_heads);
  p.num_kv_heads = static_cast<int>(num_kv_heads);
  p.group = static_cast<int>(group);
  p.chunks = static_cast<int>(chunks);
  p.block_size = static_cast<int>(block_size);
  p.window = sliding_window;
  p.partition_size = static_cast<int>(partition_size);
  p.num_partitions = static_cast<int>(parts);
  p.head_dim = static_cast<int>(head_dim);
  p.l2_ahead = g_l2_ahead;
  p.scale_log2 = scale * kLog2e;
  const int64_t rows = batch * num_heads * parts;
  p.ws_o = parts > 1 ? workspace : nullptr;
  p.ws_m = parts > 1 ? workspace + rows * head_dim : nullptr;
  p.ws_l = parts > 1 ? workspace + rows * (head_dim + 1) : nullptr;
  // one launch when the counters cover every (sequence, head group); else the merge kernel
  const bool one_launch = parts > 1 && counters && batch * num_kv_heads * chunks <= counters_len;
  p.counters = one_launch ? counters : nullptr;
  plan->kind = kv_kind;
  plan->d = static_cast<int>(head_dim);
  plan->batch = static_cast<int>(batch);
  plan->qbf16 = q_dtype == LSQ_KIND_BF16;
  plan->grid_x = static_cast<unsigned>(parts);
  plan->grid_y = static_cast<unsigned>(num_kv_heads * chunks);
  return 0;
}

// Calls runner.template run<KIND, QBF16, D>() for the plan's variant.
template <class Runner>
int dispatch(const Plan& plan, Runner& runner) {
#define LSQ_PA_HEAD_DIMS(KIND, QBF16)                            \
  switch (plan.d) {                                              \
    case 64: return runner.template run<KIND, QBF16, 64>();      \
    case 96: return runner.template run<KIND, QBF16, 96>();      \
    case 128: return runner.template run<KIND, QBF16, 128>();    \
    default: return static_cast<int>(cudaErrorInvalidValue);     \
  }
  switch (plan.kind) {
    case LSQ_KIND_BF16: LSQ_PA_HEAD_DIMS(LSQ_KIND_BF16, true)
    case LSQ_KIND_FP16: LSQ_PA_HEAD_DIMS(LSQ_KIND_FP16, false)
    case LSQ_KIND_INT8:
      if (plan.qbf16) LSQ_PA_HEAD_DIMS(LSQ_KIND_INT8, true)
      LSQ_PA_HEAD_DIMS(LSQ_KIND_INT8, false)
    case LSQ_KIND_INT4:
      if (plan.qbf16) LSQ_PA_HEAD_DIMS(LSQ_KIND_INT4, true)
      LSQ_PA_HEAD_DIMS(LSQ_KIND_INT4, false)
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
#undef LSQ_PA_HEAD_DIMS
}

struct Launcher {
  const Plan& plan;
  cudaStream_t stream;
  template <int KIND, bool QBF16, int D>
  int run() {
    const dim3 grid(plan.grid_x, plan.grid_y, static_cast<unsigned>(plan.batch));
    const int err = lsq_launch(decode_kernel<KIND, QBF16, D>, grid, dim3(kThreads), 0, stream,
                               plan.p);
    if (err || plan.p.num_partitions == 1 || plan.p.counters) return err;
    const dim3 merge_grid(static_cast<unsigned>(plan.p.num_heads),
                          static_cast<unsigned>(plan.batch));
    return lsq_launch(merge_kernel<QBF16>, merge_grid, dim3(128), 0, stream, plan.p);
  }
};

struct Emulator {
  const Plan& plan;
  template <int KIND, bool QBF16, int D>
  int run() {
#ifdef __CUDA_ARCH__
    return 0;
#else
    const Params& p = plan.p;
    emulate::Options options;  // the prefetches must stay inside the blocks the tables name
    int32_t top = 0;
    for (int b = 0; b < plan.batch; ++b)
      for (int j = 0; j < p.max_blocks; ++j) {
        const int32_t id = p.tables[b * p.table_stride + j];
        top = id > top ? id : top;
      }
    const int64_t tokens = (static_cast<int64_t>(top) + 1) * p.block_size * p.num_kv_heads;
    const int64_t bytes = tokens * Cfg<KIND, QBF16, D>::kRowBytes;
    options.readable = {{p.k, p.k + bytes}, {p.v, p.v + bytes}};
    for (const uint16_t* par : {p.ks, p.kz, p.vs, p.vz})
      if (par) options.readable.push_back({reinterpret_cast<const uint8_t*>(par),
                                           reinterpret_cast<const uint8_t*>(par + tokens)});
    emulate::run_grid(
        plan.grid_x, plan.grid_y, plan.batch, kThreads, sizeof(Smem<D>),
        [&](unsigned x, unsigned y, unsigned z, int tid, void* smem) {
          decode_block<KIND, QBF16, D>(p, x, y, z, tid, *static_cast<Smem<D>*>(smem));
        },
        options);
    if (p.num_partitions > 1 && !p.counters)
      emulate::run_grid(p.num_heads, plan.batch, 1, 128, 2 * sizeof(float),
                        [&](unsigned x, unsigned y, unsigned, int tid, void* smem) {
                          float* sh = static_cast<float*>(smem);
                          merge_heads<QBF16>(p, x, 1, y, tid, 128, sh, sh + 1);
                        });
    return 0;
#endif
  }
};

}  // namespace lsq_pa

extern "C" {

// Attention of one new token per sequence over its paged context; see the top of this file and
// csrc/README.md. Returns 0 when launched, cudaErrorInvalidValue (1) for bad arguments (checked
// before any CUDA call), else the launch's cudaError_t. Launches on the calling thread's
// current device, on `stream`. With several partitions and `counters` (zeros, at least one per
// sequence and group of up to 8 query heads of a KV head, counters_len of them, used by one
// stream at a time) the partitions are merged in the same launch, by the last block of each
// group, which leaves its counter 0 again; without, or with too few, a second kernel merges.
int lsq_paged_decode_attention(const void* q, int64_t q_stride_b, int64_t q_stride_h, void* out,
                               int64_t out_stride_b, int64_t out_stride_h, const void* k_cache,
                               const void* v_cache, const void* k_scale, const void* k_zero,
                               const void* v_scale, const void* v_zero, int32_t kv_kind,
                               int32_t q_dtype, const int32_t* block_tables,
                               int64_t table_stride, int64_t max_blocks,
                               const int32_t* context_lens, int64_t batch, int64_t num_heads,
                               int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                               int32_t sliding_window, float scale, int64_t partition_size,
                               float* workspace, uint32_t* counters, int64_t counters_len,
                               void* stream) {
  lsq_pa::Plan plan;
  const int err = lsq_pa::plan_decode(
      q, q_stride_b, q_stride_h, out, out_stride_b, out_stride_h, k_cache, v_cache, k_scale,
      k_zero, v_scale, v_zero, kv_kind, q_dtype, block_tables, table_stride, max_blocks,
      context_lens, batch, num_heads, num_kv_heads, head_dim, block_size, sliding_window, scale,
      partition_size, workspace, counters, counters_len, &plan);
  if (err || batch == 0) return err;
  lsq_pa::Launcher launcher{plan, static_cast<cudaStream_t>(stream)};
  return lsq_pa::dispatch(plan, launcher);
}

// Sets how many tiles ahead of its register loads each warp prefetches its K and V into L2 (0:
// no prefetch) for the launches that follow, in this process; tiles < 0 only asks. Returns the
// setting in force before the call. A tuning knob for benchmarks (default 2).
int32_t lsq_paged_decode_l2_prefetch(int32_t tiles) {
  const int32_t before = lsq_pa::g_l2_ahead;
  if (tiles >= 0) lsq_pa::g_l2_ahead = tiles;
  return before;
}

// fp32 floats the workspace needs: batch * num_heads * P * (head_dim + 2) with
// P = ceil(max_blocks * block_size / partition_size) partitions, or 0 when P == 1 (no merge);
// -1 for arguments lsq_paged_decode_attention would refuse.
int64_t lsq_paged_decode_workspace_floats(int64_t batch, int64_t num_heads, int64_t head_dim,
                                          int64_t max_blocks, int64_t block_size,
                                          int64_t partition_size) {
  if (batch < 0 || num_heads < 1 || head_dim < 1 || max_blocks < 1 || block_size < 1 ||
      partition_size < block_size || partition_size % block_size)
    return -1;
  const int64_t parts = lsq_pa::num_partitions(max_blocks, block_size, partition_size);
  return parts > 1 ? batch * num_heads * parts * (head_dim + 2) : 0;
}

// A partition size (tokens, a multiple of block_size) for a launch shape, by a small model of
// the launch: the SMs hold kMinBlocks decode blocks each at once, a block's time grows with its
// tokens (each warp walks its tiles one after another) plus a fixed cost (set-up, the partial's
// write and count), and a wave that is only partly full still takes a block's whole time. So
// the launch costs ceil(blocks / slots) * (size + kBlockTokens), plus the last block's merge
// (a round trip per 4 partitions, each about a tile's time, and 2-4 more for the maxima and
// sums). The size with the least cost wins, the larger on ties; none under 256 tokens (rounded
// up to whole blocks) unless the table is shorter. Before, the size aimed at 4 blocks an SM:
// 1.3 waves of 3 at batch 1 and 32k tokens, 1.45 at batch 8. Depends only on the shape,
// never on context lengths, so a CUDA graph captured with it stays valid. -1 for bad
// arguments.
int64_t lsq_paged_decode_partition_size(int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                                        int64_t max_blocks, int64_t block_size,
                                        int64_t num_sms) {
  if (batch < 1 || num_kv_heads < 1 || num_heads < num_kv_heads || num_heads % num_kv_heads ||
      max_blocks < 1 || block_size < 1 || num_sms < 1)
    return -1;
  const int64_t chunks = (num_heads / num_kv_heads + lsq_pa::kHeads - 1) / lsq_pa::kHeads;
  const int64_t groups = batch * num_kv_heads * chunks;  // blocks a partition
  const int64_t slots = lsq_pa::kMinBlocks * num_sms;
  const int64_t capacity = max_blocks * block_size;
  const int64_t floor = (lsq_pa::kMinPartition + block_size - 1) / block_size * block_size;
  int64_t best = capacity, best_cost = -1;
  for (int64_t parts = 1; parts <= max_blocks; ++parts) {  // fewer partitions first: ties keep
    const int64_t blocks_per = (max_blocks + parts - 1) / parts;  // the shortest size for parts
    if ((max_blocks + blocks_per - 1) / blocks_per != parts) continue;  // no size makes parts
    const int64_t size = blocks_per * block_size;
    if (parts > 1 && size < floor) break;  // sizes only shrink from here
    const int64_t waves = (groups * parts + slots - 1) / slots;
    const int64_t merge = parts > 1 ? lsq_pa::kTile * (parts / 4 + 4) : 0;
    const int64_t cost = waves * (size + lsq_pa::kBlockTokens) + merge;
    if (best_cost < 0 || cost < best_cost) best = size, best_cost = cost;
  }
  return best;
}

// The same computation run on the CPU by the SIMT emulator (csrc/simt.cuh), on host pointers:
// for tests without a GPU. Same arguments and checks as lsq_paged_decode_attention, no stream.
int lsq_emulate_paged_decode_attention(
    const void* q, int64_t q_stride_b, int64_t q_stride_h, void* out, int64_t out_stride_b,
    int64_t out_stride_h, const void* k_cache, const void* v_cache, const void* k_scale,
    const void* k_zero, const void* v_scale, const void* v_zero, int32_t kv_kind,
    int32_t q_dtype, const int32_t* block_tables, int64_t table_stride, int64_t max_blocks,
    const int32_t* context_lens, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, int32_t sliding_window, float scale,
    int64_t partition_size, float* workspace, uint32_t* counters, int64_t counters_len) {
  lsq_pa::Plan plan;
  const int err = lsq_pa::plan_decode(
      q, q_stride_b, q_stride_h, out, out_stride_b, out_stride_h, k_cache, v_cache, k_scale,
      k_zero, v_scale, v_zero, kv_kind, q_dtype, block_tables, table_stride, max_blocks,
      context_lens, batch, num_heads, num_kv_heads, head_dim, block_size, sliding_window, scale,
      partition_size, workspace, counters, counters_len, &plan);
  if (err || batch == 0) return err;
  lsq_pa::Emulator emulator{plan};
  return lsq_pa::dispatch(plan, emulator);
}

}  // extern "C"
