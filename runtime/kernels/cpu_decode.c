/*
 * CPU decode kernels: paged attention for single-token queries, the quantized KV write,
 * RMSNorm, and the GEMV of the logits over a dense lm_head for decode-sized batches (int4
 * linears are cpu_int4.c's).
 *
 * Why C: on a CPU a decode step of a small model is dominated by per-op overhead, not by
 * arithmetic. The torch formulation of attention and the KV write alone costs some 30 tensor
 * ops per layer (gathers, widening copies, masks, the rounding rules of the KV quantizer);
 * here each is one call that reads the paged pool in place. runtime/kernels/native.py
 * compiles this file once per machine with the system C compiler and loads it with ctypes (no
 * torch headers, so the build takes a second and does not depend on torch's ABI).
 *
 * Layouts are those of runtime/kv/format.py: codes [blocks, block_size, kv_heads, Dc],
 * fp16 scale and zero [blocks, block_size, kv_heads], x = code * scale + zero.
 * The quantizer reproduces quantize_kv bit for bit (the tests compare them).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

enum { F32 = 0, BF16 = 1, F16 = 2, INT8 = 3, INT4 = 4 };

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline float f16_to_f32(uint16_t h) {
    _Float16 v;
    memcpy(&v, &h, 2);
    return (float)v;
}

static inline uint16_t f32_to_f16(float f) {
    _Float16 v = (_Float16)f;
    uint16_t h;
    memcpy(&h, &v, 2);
    return h;
}

/* Next fp16 towards -inf (up = 0) or +inf (up = 1); inputs are finite. */
static inline uint16_t f16_step(uint16_t h, int up) {
    int negative = h >> 15;
    if ((h & 0x7fff) == 0) return up ? 0x0001 : 0x8001;
    return (uint16_t)((negative != up) ? h + 1 : h - 1);
}

static void load_row(const void *src, int dtype, int64_t n, float *dst) {
    if (dtype == F32) {
        memcpy(dst, src, (size_t)n * 4);
    } else if (dtype == BF16) {
        const uint16_t *s = src;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    } else {
        const uint16_t *s = src;
        for (int64_t i = 0; i < n; i++) dst[i] = f16_to_f32(s[i]);
    }
}

static void store_row(const float *src, int dtype, int64_t n, void *dst) {
    if (dtype == F32) {
        memcpy(dst, src, (size_t)n * 4);
    } else if (dtype == BF16) {
        uint16_t *d = dst;
        for (int64_t i = 0; i < n; i++) d[i] = f32_to_bf16(src[i]);
    } else {
        uint16_t *d = dst;
        for (int64_t i = 0; i < n; i++) d[i] = f32_to_f16(src[i]);
    }
}

/* One stored K or V row widened to fp32 codes (quantized: the raw codes, unscaled). */
static inline void widen(const uint8_t *row, int kind, int64_t d, float *restrict out) {
    switch (kind) {
    case F32:
        memcpy(out, row, (size_t)d * 4);
        break;
    case BF16: {
        const uint16_t *s = (const uint16_t *)row;
#pragma omp simd
        for (int64_t i = 0; i < d; i++) out[i] = bf16_to_f32(s[i]);
        break;
    }
    case F16: {
        const _Float16 *s = (const _Float16 *)row;
#pragma omp simd
        for (int64_t i = 0; i < d; i++) out[i] = (float)s[i];
        break;
    }
    case INT8: {
        int64_t i = 0;
#if defined(__AVX2__) /* GCC widens u8 through scalar or 16-bit steps otherwise */
        for (; i + 8 <= d; i += 8)
            _mm256_storeu_ps(out + i, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                          _mm_loadl_epi64((const __m128i *)(row + i)))));
#endif
        for (; i < d; i++) out[i] = (float)row[i];
        break;
    }
    default: { /* INT4: element 2i in the low nibble, 2i + 1 in the high one */
        int64_t i = 0;
#if defined(__AVX2__)
        for (; i + 8 <= d / 2; i += 8) {
            __m128i b = _mm_loadl_epi64((const __m128i *)(row + i)), m = _mm_set1_epi8(15);
            __m128i c = _mm_unpacklo_epi8(_mm_and_si128(b, m), _mm_and_si128(_mm_srli_epi16(b, 4), m));
            _mm256_storeu_ps(out + 2 * i, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c)));
            _mm256_storeu_ps(out + 2 * i + 8,
                             _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(c, 8))));
        }
#endif
        for (; i < d / 2; i++) {
            out[2 * i] = (float)(row[i] & 0xf);
            out[2 * i + 1] = (float)(row[i] >> 4);
        }
    }
    }
}

typedef struct {
    const uint8_t *k, *v;                           /* codes of one layer */
    const uint16_t *k_scale, *k_zero, *v_scale, *v_zero; /* NULL when unquantized */
    int kind;
    int64_t kv_heads, head_dim, block_size, row_bytes; /* row_bytes: one head of one token */
} Pool;

/* The pool slots of positions [start, len), walking the block table (no division per token). */
static void fill_slots(const int64_t *table, int64_t start, int64_t len, int64_t block_size,
                       int64_t *slots) {
    int64_t block = start / block_size, offset = start % block_size;
    for (int64_t t = 0; t < len - start; t++) {
        slots[t] = table[block] * block_size + offset;
        if (++offset == block_size) {
            offset = 0;
            block++;
        }
    }
}

/* fp32 vectors of the machine's own SIMD width in the compiler's vector extension (GCC and
 * clang): 16 lanes with AVX-512, 8 with AVX, 4 elsewhere (SSE, NEON). A vector wider than the
 * machine's registers is lowered through the stack, several times slower (measured: 6x for
 * decode attention on AVX2 with 16 lanes). Plain C reduction loops would be summed lane by
 * lane without reassociation flags, which the quantizer's exactness rules out for this file.
 * LITESERVE_CPU_ISA=avx512-emulated takes AVX-512's width on AVX2, to test that build's code. */
#if defined(__AVX512F__) || defined(LITESERVE_EMULATE_AVX512)
#define LANES 16
#elif defined(__AVX__)
#define LANES 8
#else
#define LANES 4
#endif
typedef float vf __attribute__((vector_size(LANES * 4)));
typedef uint16_t vu16 __attribute__((vector_size(LANES * 2)));
typedef uint32_t vu32 __attribute__((vector_size(LANES * 4)));
typedef _Float16 vh __attribute__((vector_size(LANES * 2)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

static inline vf loadv(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float hsum(vf v) {
#if LANES == 16
    v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
#elif LANES == 8
    v4 b = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
#else
    v4 b = v;
#endif
    return (b[0] + b[2]) + (b[1] + b[3]);
}

static inline float dot(const float *restrict a, const float *restrict b, int64_t d) {
    vf acc = {0};
    float tail = 0.f;
    int64_t i = 0;
    for (; i + LANES <= d; i += LANES) acc += loadv(a + i) * loadv(b + i);
    for (; i < d; i++) tail += a[i] * b[i];
    return hsum(acc) + tail;
}

static inline float sum(const float *a, int64_t n) {
    vf acc = {0};
    float tail = 0.f;
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) acc += loadv(a + i);
    for (; i < n; i++) tail += a[i];
    return hsum(acc) + tail;
}

/* e^x for x <= 0 (softmax after subtracting the max), in plain arithmetic so the loop
 * vectorizes (libm's expf is a call per element): Cody-Waite reduction by ln 2 and Cephes'
 * degree-6 polynomial, within 2 ulp; below -87 (under fp32's normal range) it returns
 * e^-87 ~ 1.6e-38 instead of a denormal, which no sum of probabilities can tell apart. */
static inline float exp_nonpositive(float x) {
    x = x > -87.f ? x : -87.f;
    float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f; /* round(x / ln 2) */
    float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23; /* 2^n, n >= -126 */
    float two_n;
    memcpy(&two_n, &bits, 4);
    return p * two_n;
}

typedef int32_t vi __attribute__((vector_size(LANES * 4)));

/* exp_nonpositive on a vector, the same arithmetic lane by lane (GCC does not vectorize the
 * scalar one: its bit cast goes through memory). */
static inline vf vexp_nonpositive(vf x) {
    vi low = x > -87.f;
    x = (vf)((low & (vi)x) | (~low & (vi)(x * 0.f - 87.f)));
    vf n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
    vf r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    vf p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    return p * (vf)bits;
}

/* a[i] = silu(g[i]) * u[i], the gated MLP's activation, with e^-|g| from vexp_nonpositive:
 * libm's expf is a call per element, and a 128-token prefill of SmolLM2 makes 200k of them a
 * layer. sigmoid(g) = 1 / (1 + e^-g) for g >= 0 and e^g / (1 + e^g) below, so the exponent
 * is never positive. */
void silu_mul(const float *g, const float *u, float *a, int64_t n) {
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        vf x = loadv(g + i), one = x * 0.f + 1.f;
        vi neg = x < 0.f;
        vf e = vexp_nonpositive((vf)((vi)x | (vi)(one * -0.f))); /* -|x|: the sign bit set */
        vf num = (vf)((neg & (vi)e) | (~neg & (vi)one));
        vf r = x * num / (one + e) * loadv(u + i);
        memcpy(a + i, &r, sizeof r);
    }
    for (; i < n; i++) {
        float x = g[i], e = exp_nonpositive(-fabsf(x));
        a[i] = x * (x < 0.f ? e : 1.f) / (1.f + e) * u[i];
    }
}

/* Softmax of s[a, b) in place, vector by vector (the max, the exponentials and their sum; a
 * scalar max and exp were a third of decode attention). */
static void softmax(float *s, int64_t a, int64_t b) {
    float *v = s + a;
    int64_t n = b - a, i = 0;
    vf mv = (vf){0} - INFINITY;
    for (; i + LANES <= n; i += LANES) {
        vf x = loadv(v + i);
        vi more = x > mv;
        mv = (vf)((more & (vi)x) | (~more & (vi)mv));
    }
    float m = -INFINITY;
    for (int j = 0; j < LANES; j++) m = mv[j] > m ? mv[j] : m;
    for (int64_t j = i; j < n; j++) m = v[j] > m ? v[j] : m;
    vf acc = {0};
    float tail = 0.f;
    for (i = 0; i + LANES <= n; i += LANES) {
        vf e = vexp_nonpositive(loadv(v + i) - m);
        memcpy(v + i, &e, sizeof e);
        acc += e;
    }
    for (int64_t j = i; j < n; j++) {
        v[j] = exp_nonpositive(v[j] - m);
        tail += v[j];
    }
    float inv = n > 0 ? 1.f / (hsum(acc) + tail) : 0.f;
    for (i = 0; i < n; i++) v[i] *= inv;
}

/* out[i] += sum_t w[t] * rows[t][i]: 4 * LANES outputs at a time in four independent register
 * accumulators (one would wait on its own FMA latency every token). */
static inline void accumulate(float *restrict out, const float *restrict w,
                              const float *restrict rows, int64_t m, int64_t d) {
    int64_t i = 0;
    for (; i + 4 * LANES <= d; i += 4 * LANES) {
        vf a0 = loadv(out + i), a1 = loadv(out + i + LANES), a2 = loadv(out + i + 2 * LANES),
           a3 = loadv(out + i + 3 * LANES);
        for (int64_t t = 0; t < m; t++) {
            const float *r = rows + t * d + i;
            a0 += w[t] * loadv(r);
            a1 += w[t] * loadv(r + LANES);
            a2 += w[t] * loadv(r + 2 * LANES);
            a3 += w[t] * loadv(r + 3 * LANES);
        }
        memcpy(out + i, &a0, sizeof a0);
        memcpy(out + i + LANES, &a1, sizeof a1);
        memcpy(out + i + 2 * LANES, &a2, sizeof a2);
        memcpy(out + i + 3 * LANES, &a3, sizeof a3);
    }
    for (; i + LANES <= d; i += LANES) {
        vf acc = loadv(out + i);
        for (int64_t t = 0; t < m; t++) acc += w[t] * loadv(rows + t * d + i);
        memcpy(out + i, &acc, sizeof acc);
    }
    for (; i < d; i++)
        for (int64_t t = 0; t < m; t++) out[i] += w[t] * rows[t * d + i];
}

enum { TILE = 64 }; /* tokens widened at a time: a tile of fp32 rows stays in L1/L2 */
enum { QT = 4 };    /* queries a micro-tile: QT x 2 vectors of accumulators, no spills */

/* o[j] += sum_t w[j][t] v_t for QT queries (w: row stride TILE) over m rows v [m][d]: each
 * value vector loaded once for QT queries. */
static inline void pv_tile(const float *restrict w, const float *restrict v, int64_t m,
                           int64_t d, float *restrict o) {
    int64_t i0 = 0;
    for (; i0 + 2 * LANES <= d; i0 += 2 * LANES) {
        vf a[QT][2];
        for (int j = 0; j < QT; j++) a[j][0] = loadv(o + j * d + i0), a[j][1] = loadv(o + j * d + i0 + LANES);
        for (int64_t t = 0; t < m; t++) {
            vf v0 = loadv(v + t * d + i0), v1 = loadv(v + t * d + i0 + LANES);
            for (int j = 0; j < QT; j++) {
                float x = w[j * TILE + t];
                a[j][0] += x * v0;
                a[j][1] += x * v1;
            }
        }
        for (int j = 0; j < QT; j++) {
            memcpy(o + j * d + i0, &a[j][0], sizeof(vf));
            memcpy(o + j * d + i0 + LANES, &a[j][1], sizeof(vf));
        }
    }
    for (; i0 + LANES <= d; i0 += LANES) /* accumulate()'s steps, so the same sums */
        for (int j = 0; j < QT; j++) {
            vf a = loadv(o + j * d + i0);
            for (int64_t t = 0; t < m; t++) a += w[j * TILE + t] * loadv(v + t * d + i0);
            memcpy(o + j * d + i0, &a, sizeof a);
        }
    for (; i0 < d; i0++)
        for (int j = 0; j < QT; j++)
            for (int64_t t = 0; t < m; t++) o[j * d + i0] += w[j * TILE + t] * v[t * d + i0];
}

enum { PREFETCH = 16 }; /* rows ahead: a row's line comes from DRAM or L3 in time for it */

/* Ask for the K and V rows of a slot ahead of their use: a token's rows of one head are
 * row_bytes apart from the other heads' and its blocks are scattered, so the hardware
 * prefetcher does not see the walk, and waiting on each row's line was 70% of decode
 * attention once the weights streaming through each step had evicted the pool. */
static inline void prefetch_slot(const Pool *p, int64_t slot, int64_t kvh) {
    int64_t at = (slot * p->kv_heads + kvh) * p->row_bytes;
    for (int64_t b = 0; b < p->row_bytes; b += 64) {
        __builtin_prefetch(p->k + at + b);
        __builtin_prefetch(p->v + at + b);
    }
}

/* Widen the stored rows of `m` slots into `tile` [m, d]; quantized: their scale and zero.
 * `ahead`: slots valid past slots[m - 1], to prefetch (K loads pass theirs; V's then hit). */
static void load_tile(const Pool *p, const uint8_t *codes, const uint16_t *scales,
                      const uint16_t *zeros, const int64_t *slots, int64_t m, int64_t ahead,
                      int64_t kvh, float *tile, float *scale, float *zero) {
    for (int64_t t = 0; t < m; t++) {
        if (codes == p->k && t + PREFETCH < m + ahead) prefetch_slot(p, slots[t + PREFETCH], kvh);
        int64_t idx = slots[t] * p->kv_heads + kvh;
        widen(codes + idx * p->row_bytes, p->kind, p->head_dim, tile + t * p->head_dim);
        scale[t] = scales ? f16_to_f32(scales[idx]) : 1.f;
        zero[t] = zeros ? f16_to_f32(zeros[idx]) : 0.f;
    }
}

static inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

/* qsum[g] = sum(q_g) (the zero's term of q.k for quantized keys), pz[g] = 0 (its term of p.v,
 * summed over the value tiles). */
static void query_sums(const float *q, int64_t group, int64_t d, float *qsum, float *pz) {
    for (int64_t g = 0; g < group; g++) {
        float s = 0.f;
        for (int64_t i = 0; i < d; i++) s += q[g * d + i];
        qsum[g] = s;
        pz[g] = 0.f;
    }
}

/* Raw q.c of `group` queries over a tile's m keys (row stride `stride`) to scores: for codes
 * k = c * s + z, q.k = s (q.c) + z sum(q), times the softmax scale. */
static void key_scores(float *scores, int64_t stride, int64_t group, int64_t m, const float *qsum,
                       const float *ts, const float *tz, float scale) {
    for (int64_t g = 0; g < group; g++) {
        float *restrict sg = scores + g * stride, qs = qsum[g];
        for (int64_t t = 0; t < m; t++) sg[t] = (sg[t] * ts[t] + qs * tz[t]) * scale;
    }
}

/* The scalar tail of a dot product, one compiled copy: inlined into each query count of
 * qk_rows_g it was vectorized differently, and a query's bits depended on its place among
 * the G (prefill's rows against decode's). */
static __attribute__((noinline)) float tail_dot(const float *a, const float *b, int64_t n) {
    float tail = 0.f;
    for (int64_t j = 0; j < n; j++) tail += a[j] * b[j];
    return tail;
}

/* s[g * stride + t] = q_g . k_t for G <= 4 queries q [G, d] and m key rows keys [m, d]: each
 * key vector is loaded once for all G queries, each query with its own accumulator. */
static inline __attribute__((always_inline)) void qk_rows_g(const float *restrict q, int64_t d,
                                                            int G, const float *restrict keys,
                                                            int64_t m, float *restrict s,
                                                            int64_t stride) {
    for (int64_t t = 0; t < m; t++) {
        const float *k = keys + t * d;
        vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}; /* named: an array went through the stack */
        int64_t i = 0;
        for (; i + LANES <= d; i += LANES) {
            vf kv = loadv(k + i);
            a0 += loadv(q + i) * kv;
            if (G > 1) a1 += loadv(q + d + i) * kv;
            if (G > 2) a2 += loadv(q + 2 * d + i) * kv;
            if (G > 3) a3 += loadv(q + 3 * d + i) * kv;
        }
        vf a[4] = {a0, a1, a2, a3};
        for (int g = 0; g < G; g++) s[g * stride + t] = hsum(a[g]) + tail_dot(q + g * d + i, k + i, d - i);
    }
}

/* qk_rows_g for any number of queries, four at a time. */
static void qk_rows(const float *q, int64_t d, int64_t group, const float *keys, int64_t m,
                    float *s, int64_t stride) {
    for (int64_t g0 = 0; g0 < group; g0 += 4) {
        const float *qg = q + g0 * d;
        float *sg = s + g0 * stride;
        switch (group - g0 < 4 ? group - g0 : 4) {
        case 1: qk_rows_g(qg, d, 1, keys, m, sg, stride); break;
        case 2: qk_rows_g(qg, d, 2, keys, m, sg, stride); break;
        case 3: qk_rows_g(qg, d, 3, keys, m, sg, stride); break;
        default: qk_rows_g(qg, d, 4, keys, m, sg, stride);
        }
    }
}

/* Floats of scratch attend() needs. */
static size_t attend_floats(int64_t group, int64_t n, int64_t d) {
    int64_t gp = round_up(group, QT), np = round_up(n, TILE);
    return (size_t)(gp * (np + 2 * d + TILE) + TILE * (d + 2) + np);
}

/* Attention of a block of prefill tokens' query heads, `group` queries [group, head_dim]
 * sharing KV head `kvh`, over the n slots given, query g seeing slots [lo[g], hi[g]) only.
 * Every query gets the bits attend_rows() gives it as a decoding token: a preempted request's
 * KV is recomputed by prefill and a prefix-cache hit leaves its last token to decode, so any
 * difference changed greedy output. Hence the scores by qk_rows (decode's dot products, not
 * a transposed key tile's), and each query's sum of p z over tiles starting at its own first
 * key, as decode's tiles do; values go QT queries at a time through pv_tile, whose sums run
 * in accumulate()'s order (the weights outside [lo, hi) are zeros, which add nothing).
 * scratch: attend_floats(group, n, head_dim). */
static void attend(const Pool *p, const float *q, int64_t group, const int64_t *slots, int64_t n,
                   const int64_t *lo, const int64_t *hi, int64_t kvh, float scale, float *scratch,
                   float *out) {
    const int64_t d = p->head_dim, gp = round_up(group, QT), np = round_up(n, TILE);
    float *scores = scratch, *qp = scores + gp * np, *op = qp + gp * d, *w = op + gp * d,
          *tile = w + gp * TILE, *ts = tile + TILE * d, *tz = ts + TILE, *zeros = tz + TILE;
    float qsum[gp], pz[gp];
    memcpy(qp, q, sizeof(float) * (size_t)(group * d));
    memset(qp + group * d, 0, sizeof(float) * (size_t)((gp - group) * d));
    query_sums(qp, gp, d, qsum, pz);
    /* scores: q . k, where for codes k = c * s + z gives s (q . c) + z sum(q) */
    for (int64_t t0 = 0; t0 < n; t0 += TILE) {
        int64_t m = n - t0 < TILE ? n - t0 : TILE;
        load_tile(p, p->k, p->k_scale, p->k_zero, slots + t0, m, n - t0 - m, kvh, tile, ts, tz);
        qk_rows(qp, d, group, tile, m, scores + t0, np);
        key_scores(scores + t0, np, group, m, qsum, ts, tz, scale);
    }
    for (int64_t g = 0; g < gp; g++) { /* softmax in place; zeros where g does not see */
        int64_t a = g >= group ? 0 : lo[g], b = g >= group ? 0 : hi[g];
        float *sg = scores + g * np;
        softmax(sg, a, b);
        memset(sg, 0, sizeof(float) * (size_t)a);
        memset(sg + b, 0, sizeof(float) * (size_t)(np - b));
    }
    /* out = sum_t p_t v_t, where for codes v = c * s + z: sum (p s) c + sum p z */
    memset(op, 0, sizeof(float) * (size_t)(gp * d));
    for (int64_t t0 = 0; t0 < n; t0 += TILE) {
        int64_t m = n - t0 < TILE ? n - t0 : TILE;
        load_tile(p, p->v, p->v_scale, p->v_zero, slots + t0, m, 0, kvh, tile, ts, tz);
        memcpy(zeros + t0, tz, sizeof(float) * (size_t)m);
        for (int64_t g = 0; g < gp; g++) {
            const float *pg = scores + g * np + t0;
            for (int64_t t = 0; t < m; t++) w[g * TILE + t] = pg[t] * ts[t];
        }
        for (int64_t g0 = 0; g0 < gp; g0 += QT) pv_tile(w + g0 * TILE, tile, m, d, op + g0 * d);
    }
    for (int64_t g = 0; g < group; g++) {
        const float *sg = scores + g * np;
        for (int64_t t0 = lo[g]; t0 < hi[g]; t0 += TILE)
            pz[g] += dot(sg + t0, zeros + t0, hi[g] - t0 < TILE ? hi[g] - t0 : TILE);
        for (int64_t i = 0; i < d; i++) out[g * d + i] = op[g * d + i] + pz[g];
    }
}

/* Attention of the `group` query heads of one decoding token sharing KV head `kvh` over the n
 * slots given, a key or value row at a time: with 1-4 queries this beats attend()'s query tiles
 * (padding and the transposed K tile cost more than they save: 5.3 against 7.0 ms for 8
 * sequences of 150 tokens, 30 layers, same process). scratch: group * n + TILE * (head_dim +
 * group + 2) floats. */
static void attend_rows(const Pool *p, const float *q, int64_t group, const int64_t *slots, int64_t n,
                   int64_t kvh, float scale, float *scratch, float *out) {
    const int64_t d = p->head_dim;
    float *scores = scratch, *tile = scores + group * n, *w = tile + TILE * d,
          *ts = w + group * TILE, *tz = ts + TILE;
    float qsum[group], pz[group];
    query_sums(q, group, d, qsum, pz);
    /* scores: q . k, where for codes k = c * s + z gives s (q . c) + z sum(q) */
    for (int64_t t0 = 0; t0 < n; t0 += TILE) {
        int64_t m = n - t0 < TILE ? n - t0 : TILE;
        load_tile(p, p->k, p->k_scale, p->k_zero, slots + t0, m, n - t0 - m, kvh, tile, ts, tz);
        qk_rows(q, d, group, tile, m, scores + t0, n);
        key_scores(scores + t0, n, group, m, qsum, ts, tz, scale);
    }
    for (int64_t g = 0; g < group; g++) softmax(scores + g * n, 0, n);
    /* out = sum_t p_t v_t, where for codes v = c * s + z: sum (p s) c + sum p z */
    memset(out, 0, (size_t)(group * d) * sizeof(float));
    for (int64_t t0 = 0; t0 < n; t0 += TILE) {
        int64_t m = n - t0 < TILE ? n - t0 : TILE;
        load_tile(p, p->v, p->v_scale, p->v_zero, slots + t0, m, 0, kvh, tile, ts, tz);
        for (int64_t g = 0; g < group; g++) {
            const float *pg = scores + g * n + t0;
            for (int64_t t = 0; t < m; t++) w[g * TILE + t] = pg[t] * ts[t];
            pz[g] += dot(pg, tz, m);
            accumulate(out + g * d, w + g * TILE, tile, m, d);
        }
    }
    for (int64_t g = 0; g < group; g++)
        for (int64_t i = 0; i < d; i++) out[g * d + i] += pz[g];
}

/*
 * q: rows `rows[b]` of a [T, heads, head_dim] tensor (token stride q_stride elements, heads
 * contiguous) in q_dtype; out: the same rows of a contiguous [T, heads, head_dim] tensor in
 * q_dtype. tables: [B, table_stride] block ids; lens: tokens in each sequence's KV.
 * window > 0 keeps only the last `window` positions.
 */
void decode_attention(const void *q, int64_t q_stride, int q_dtype, void *out, const int64_t *rows,
                      const uint8_t *k, const uint8_t *v, const uint16_t *k_scale,
                      const uint16_t *k_zero, const uint16_t *v_scale, const uint16_t *v_zero,
                      int kind, const int64_t *tables, int64_t table_stride, const int64_t *lens,
                      int64_t window, int64_t batch, int64_t heads, int64_t kv_heads,
                      int64_t head_dim, int64_t block_size, float scale) {
    int64_t code_dim = kind == INT4 ? head_dim / 2 : head_dim;
    int64_t elem = kind == F32 ? 4 : (kind == BF16 || kind == F16) ? 2 : 1;
    Pool p = {k, v, k_scale, k_zero, v_scale, v_zero, kind, kv_heads, head_dim, block_size,
              code_dim * elem};
    int64_t group = heads / kv_heads, q_elem = q_dtype == F32 ? 4 : 2, longest = 0, work = 0;
    for (int64_t b = 0; b < batch; b++) {
        longest = lens[b] > longest ? lens[b] : longest;
        work += lens[b];
    }
    /* a parallel region costs more than the whole of a short single sequence */
#pragma omp parallel for collapse(2) schedule(dynamic, 1) if (work * kv_heads >= 256)
    for (int64_t b = 0; b < batch; b++) {
        for (int64_t h = 0; h < kv_heads; h++) {
            int64_t len = lens[b], start = (window > 0 && len > window) ? len - window : 0;
            size_t floats = (size_t)(group * (longest + 2 * head_dim) + TILE * (head_dim + group + 2));
            float *scratch = malloc(sizeof(float) * (floats + 1) + sizeof(int64_t) * (size_t)longest);
            float *qf = scratch, *o = qf + group * head_dim, *work_area = o + group * head_dim;
            int64_t *slots = (int64_t *)(scratch + floats + (floats & 1));
            const uint8_t *qrow = (const uint8_t *)q + (rows[b] * q_stride + h * group * head_dim) * q_elem;
            load_row(qrow, q_dtype, group * head_dim, qf);
            fill_slots(tables + b * table_stride, start, len, block_size, slots);
            attend_rows(&p, qf, group, slots, len - start, h, scale, work_area, o);
            uint8_t *orow = (uint8_t *)out + (rows[b] * heads + h * group) * head_dim * q_elem;
            store_row(o, q_dtype, group * head_dim, orow);
            free(scratch);
        }
    }
}

/*
 * Quantize and store K and V rows [T, kv_heads, head_dim] (token strides k_stride, v_stride
 * elements; heads contiguous) at `slots` (negative: padding, skipped). qmax 255 (int8) or 15
 * (int4, two codes a byte). The rounding rules are quantize_kv's: zero = fp16(min) rounded
 * towards -inf, scale = fp16((max - zero) / qmax) rounded towards +inf and at least the
 * smallest fp16 subnormal, code = clamp(rint((x - zero) / scale), 0, qmax).
 */
/* fminf(fmaxf(x, lo), hi) for lo < hi, NaN giving lo as fmaxf does, without the libm calls
 * GCC emits for them when NaNs are possible (60 ms of a 512-token prefill on AVX2). */
static inline float clampf(float x, float lo, float hi) { return x > hi ? hi : (x >= lo ? x : lo); }

static void quantize_row(const float *x, int64_t d, int qmax, uint8_t *codes, uint16_t *scale,
                         uint16_t *zero) {
    const float big = 65504.f, tiny = 5.9604644775390625e-08f;
    float lo = INFINITY, hi = -INFINITY;
    for (int64_t i = 0; i < d; i++) {
        float c = clampf(x[i], -big, big);
        lo = c < lo ? c : lo;
        hi = c > hi ? c : hi;
    }
    uint16_t z = f32_to_f16(lo);
    if (f16_to_f32(z) > lo) z = f16_step(z, 0);
    float zf = f16_to_f32(z), step = fmaxf((hi - zf) / (float)qmax, tiny);
    uint16_t s = f32_to_f16(step);
    if (f16_to_f32(s) < step) s = f16_step(s, 1);
    float sf = f16_to_f32(s);
    uint8_t q[d];
    for (int64_t i = 0; i < d; i++) {
        float c = clampf(x[i], -big, big);
        float r = rintf((c - zf) / sf);
        q[i] = (uint8_t)clampf(r, 0.f, (float)qmax);
    }
    if (qmax == 15)
        for (int64_t i = 0; i < d / 2; i++) codes[i] = q[2 * i] | (uint8_t)(q[2 * i + 1] << 4);
    else
        memcpy(codes, q, (size_t)d);
    *scale = s;
    *zero = z;
}

void kv_write_quantized(const void *k, int64_t k_stride, const void *v, int64_t v_stride,
                        int x_dtype, const int64_t *slots, int64_t tokens, uint8_t *k_codes,
                        uint16_t *k_scale, uint16_t *k_zero, uint8_t *v_codes, uint16_t *v_scale,
                        uint16_t *v_zero, int64_t kv_heads, int64_t head_dim, int qmax) {
    int64_t x_elem = x_dtype == F32 ? 4 : 2, code_dim = qmax == 15 ? head_dim / 2 : head_dim;
    float x[head_dim];
    for (int64_t t = 0; t < tokens; t++) {
        if (slots[t] < 0) continue;
        for (int64_t h = 0; h < kv_heads; h++) {
            int64_t at = slots[t] * kv_heads + h;
            load_row((const uint8_t *)k + (t * k_stride + h * head_dim) * x_elem, x_dtype,
                     head_dim, x);
            quantize_row(x, head_dim, qmax, k_codes + at * code_dim, k_scale + at, k_zero + at);
            load_row((const uint8_t *)v + (t * v_stride + h * head_dim) * x_elem, x_dtype,
                     head_dim, x);
            quantize_row(x, head_dim, qmax, v_codes + at * code_dim, v_scale + at, v_zero + at);
        }
    }
}

/*
 * RMSNorm of rows [rows, dim] (row stride x_stride elements) into a contiguous `out`, all in
 * `dtype`: fp32 mean of squares, x * rsqrt(mean + eps) * weight in fp32, rounded once. One call instead of torch's dispatch, which at decode
 * sizes costs several times the arithmetic.
 */
void rms_norm(const void *x, int64_t x_stride, const void *weight, void *out, int dtype,
              int64_t rows, int64_t dim, float eps) {
    int64_t elem = dtype == F32 ? 4 : 2;
    float w[dim], v[dim];
    load_row(weight, dtype, dim, w);
    for (int64_t r = 0; r < rows; r++) {
        load_row((const uint8_t *)x + r * x_stride * elem, dtype, dim, v);
        float ms = dot(v, v, dim) / (float)dim, inv = 1.f / sqrtf(ms + eps);
        for (int64_t i = 0; i < dim; i++) v[i] = v[i] * inv;
        for (int64_t i = 0; i < dim; i++) v[i] *= w[i];
        store_row(v, dtype, dim, (uint8_t *)out + r * dim * elem);
    }
}

static inline vf loadv_bf16(const uint16_t *p) {
    vu16 h;
    memcpy(&h, p, sizeof h);
    vu32 bits = __builtin_convertvector(h, vu32) << 16;
    vf f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float load_scalar(const void *p, int dtype, int64_t i) {
    if (dtype == F32) return ((const float *)p)[i];
    uint16_t h = ((const uint16_t *)p)[i];
    return dtype == BF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

enum { LINEAR_ROWS = 4 }; /* activation rows sharing each loaded weight chunk */

static inline vf loadv_f16(const uint16_t *p) {
    vh h;
    memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, vf);
}

static inline vf loadv_weight(const void *w, int w_dtype, int64_t i) {
    if (w_dtype == F32) return loadv((const float *)w + i);
    const uint16_t *h = (const uint16_t *)w + i;
    return w_dtype == BF16 ? loadv_bf16(h) : loadv_f16(h);
}

/* out[r] (r < m <= LINEAR_ROWS) = xf[r] . w_row, the weight row read once for all rows. */
static inline __attribute__((always_inline)) void dot_rows(const float *xf, int64_t m, const void *w_row, int w_dtype,
                            int64_t k, float *out, int64_t out_stride) {
    vf acc[LINEAR_ROWS] = {{0}};
    float tail[LINEAR_ROWS] = {0};
    int64_t i = 0;
    for (; i + LANES <= k; i += LANES) {
        vf wv = loadv_weight(w_row, w_dtype, i);
        for (int64_t r = 0; r < m; r++) acc[r] += wv * loadv(xf + r * k + i);
    }
    for (; i < k; i++) {
        float wi = load_scalar(w_row, w_dtype, i);
        for (int64_t r = 0; r < m; r++) tail[r] += wi * xf[r * k + i];
    }
    for (int64_t r = 0; r < m; r++) out[r * out_stride] = hsum(acc[r]) + tail[r];
}

/*
 * out [m, n] fp32 = x [m, k] (x_dtype, row stride x_stride) @ w [n, k]^T (fp32, bf16 or
 * fp16, contiguous), accumulated in fp32. For the logits of decode-sized batches: a GEMV streams
 * the weight once, where the BLAS path at one to a few rows reaches a third of the bandwidth.
 */
void dense_linear(const void *x, int64_t x_stride, int x_dtype, const void *w, int w_dtype,
                  float *out, int64_t m, int64_t n, int64_t k) {
    int64_t x_elem = x_dtype == F32 ? 4 : 2, w_elem = w_dtype == F32 ? 4 : 2;
    float *xf = malloc(sizeof(float) * (size_t)(m * k));
    for (int64_t r = 0; r < m; r++)
        load_row((const uint8_t *)x + r * x_stride * x_elem, x_dtype, k, xf + r * k);
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < n; j++)
        for (int64_t r0 = 0; r0 < m; r0 += LINEAR_ROWS) {
            const void *wr = (const uint8_t *)w + j * k * w_elem;
            const float *xr = xf + r0 * k;
            float *o = out + r0 * n + j;
            switch (m - r0) { /* a constant count: the per-row sums become registers */
            case 1:
                dot_rows(xr, 1, wr, w_dtype, k, o, n);
                break;
            case 2:
                dot_rows(xr, 2, wr, w_dtype, k, o, n);
                break;
            case 3:
                dot_rows(xr, 3, wr, w_dtype, k, o, n);
                break;
            default:
                dot_rows(xr, 4, wr, w_dtype, k, o, n);
            }
        }
    free(xf);
}

enum { QB = 16 }; /* prefill tokens a block: each K/V tile is widened once for all of them */

/*
 * Causal attention of one sequence's n newest tokens, rows [row0, row0 + n) of q and out (laid
 * out as in decode_attention), over its ctx tokens in the pool (table: its block ids): the
 * prefill path. Tokens go QB at a time per KV head, their group * QB query heads attending
 * together over the keys the block's last token sees, each token's own causal (and window)
 * bounds applied to the scores, so each K/V row is widened once a block instead of once a
 * token.
 */
void prefill_attention(const void *q, int64_t q_stride, int q_dtype, void *out, int64_t row0,
                       int64_t n, const uint8_t *k, const uint8_t *v, const uint16_t *k_scale,
                       const uint16_t *k_zero, const uint16_t *v_scale, const uint16_t *v_zero,
                       int kind, const int64_t *table, int64_t ctx, int64_t window, int64_t heads,
                       int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale) {
    int64_t code_dim = kind == INT4 ? head_dim / 2 : head_dim;
    int64_t elem = kind == F32 ? 4 : (kind == BF16 || kind == F16) ? 2 : 1;
    Pool p = {k, v, k_scale, k_zero, v_scale, v_zero, kind, kv_heads, head_dim, block_size,
              code_dim * elem};
    int64_t group = heads / kv_heads, q_elem = q_dtype == F32 ? 4 : 2, blocks = (n + QB - 1) / QB;
#pragma omp parallel for collapse(2) schedule(dynamic, 1) if (n * ctx * kv_heads >= 4096)
    for (int64_t b = 0; b < blocks; b++) {
        for (int64_t h = 0; h < kv_heads; h++) {
            int64_t r0 = b * QB, rows = n - r0 < QB ? n - r0 : QB, nq = rows * group;
            int64_t first = ctx - n + r0, last = first + rows - 1; /* the block's positions */
            int64_t start = window > 0 && first + 1 > window ? first + 1 - window : 0;
            int64_t len = last + 1 - start; /* keys [start, last] */
            size_t floats = (size_t)(2 * nq * head_dim) + attend_floats(nq, len, head_dim);
            float *scratch = malloc(sizeof(float) * (floats + 1) + sizeof(int64_t) * (size_t)(len + 2 * nq));
            float *qf = scratch, *o = qf + nq * head_dim, *work_area = o + nq * head_dim;
            int64_t *slots = (int64_t *)(scratch + floats + (floats & 1)), *lo = slots + len, *hi = lo + nq;
            for (int64_t i = 0; i < rows; i++) {
                const uint8_t *qrow = (const uint8_t *)q + ((row0 + r0 + i) * q_stride + h * group * head_dim) * q_elem;
                load_row(qrow, q_dtype, group * head_dim, qf + i * group * head_dim);
                int64_t pos = first + i, from = window > 0 && pos + 1 > window ? pos + 1 - window : 0;
                for (int64_t g = 0; g < group; g++) {
                    lo[i * group + g] = from - start;
                    hi[i * group + g] = pos + 1 - start;
                }
            }
            fill_slots(table, start, last + 1, block_size, slots);
            attend(&p, qf, nq, slots, len, lo, hi, h, scale, work_area, o);
            for (int64_t i = 0; i < rows; i++) {
                uint8_t *orow = (uint8_t *)out + ((row0 + r0 + i) * heads + h * group) * head_dim * q_elem;
                store_row(o + i * group * head_dim, q_dtype, group * head_dim, orow);
            }
            free(scratch);
        }
    }
}
