/*
 * Quantized weights x int8 activations: the CPU backend's int4 linears for every row count,
 * and the int8 lm_head.
 *
 * Why: the artifact's weights are 4-bit codes with a (scale, offset) pair per group of
 * gs in {32, 64, 128} inputs, W[j, i] = c * s + b. Widening codes to floats and multiplying in
 * fp32 costs several instructions per weight on a CPU without a fast int4 path (AVX2, NEON),
 * which is where the fp32 engine spent two thirds of a decode step. llama.cpp's answer, used
 * here too: quantize each activation row to int8 per group on the fly (d = max|x| / 127,
 * q = round(x / d)), then
 *
 *     x . W[j] ~= sum_g s_g d_g (q_g . c_g) + b_g d_g sum(q_g)
 *
 * where q_g . c_g is an integer dot product: AVX2 `vpmaddubsw` + `vpmaddwd` (u8 x s8 pairs,
 * at most 2 * 15 * 127, so no saturation), one `vpdpbusd` with AVX-512-VNNI or AVX-VNNI, and
 * `sdot` on ARM. The group sums stay in int32; each group adds one float multiply-add. The
 * offset term uses the quantized sum, d_g sum(q_g), so the quantization error is weighted by
 * (c - z) centred codes and not by c alone.
 *
 * Every output is computed in the same order whatever tile it falls in: the integer partials
 * of a group are reduced exactly to one int32, then one fmaf per group in group order, the
 * offsets likewise. A row's result therefore does not depend on how many rows share the call
 * or where it sits among them: a sequence's tokens do not change with the batch it shares.
 *
 * Codes: chunks of 32 elements, 16 bytes, byte i of a chunk holding element i (low nibble) and
 * i + 16 (high), so one 16-byte load unpacks into the chunk's 32 codes in order. Columns come
 * in tiles of 8 (n padded to 8), and a tile stores its 8 columns' chunks of the same 32 inputs
 * together, 128 bytes, in pairs (c, c + 4): the decode tile streams one contiguous run of
 * memory instead of 8 (one pointer, one hardware prefetch stream, no register pressure from
 * 8 row pointers: with them GCC spilled the accumulators), and one 32-byte load gives two
 * columns' codes. Scales and offsets, [n / 8, k / gs, 8] in s_dtype, are tiled alike: a
 * group's 8 columns are one vector load. runtime/kernels/cpu.py lays them out (tile_codes,
 * tile_params, tile_head) and reads them back.
 * Rows go a few at a time over each weight column tile while it is in L1, so the weights are
 * read from memory once per pass whatever m is (decode and prefill alike); a pass takes as many
 * rows as keep their activations in L2. On x86 int4 tiles are 8 columns by up to 3 rows
 * (tile_r8: each unpacked weight register meets three rows' activations, which quantize_row
 * then lays out doubled so they are memory operands of the multiply), or, where the dispatch
 * unpacks (prefill), 4 rows by 16 columns of an outer product over a panel unpacked once per
 * call (unpack_panel), whose full blocks of 16 rows go to the tile unit where the CPU has AMX
 * (amx_tile); the int8 head goes a row at a time over 8 columns, and on AMX from 16 rows its
 * full 16-column panels go to the tile unit too (head_panel). ARM with sdot has the
 * same panels; elsewhere, and for the other tiles off x86, RB rows by CB columns.
 *
 * The lm_head (dense in the artifact) is quantized at load to int8 per 32 inputs, symmetric,
 * as llama.cpp's Q8_0 stores it: the same tiles with 32-byte weight chunks (in column order
 * within a tile), the s8 x s8 dot
 * done on x86 as |w| (u8) x sign(x, w) (s8), llama.cpp's trick, since the x86 instructions
 * multiply unsigned by signed bytes. It reads a quarter of the fp32 head's bytes.
 *
 * The ISA path is chosen when this file is compiled (runtime/kernels/isa.py picks the target);
 * isa_path() names it for the start-up log. The portable C path is the reference for the
 * others and what runs on any other CPU.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#endif

enum { F32 = 0, BF16 = 1, F16 = 2 };

static inline float load_scalar(const void *p, int dtype, int64_t i) {
    if (dtype == F32) return ((const float *)p)[i];
    uint16_t h = ((const uint16_t *)p)[i];
    if (dtype == BF16) {
        uint32_t bits = (uint32_t)h << 16;
        float f;
        memcpy(&f, &bits, 4);
        return f;
    }
    _Float16 v;
    memcpy(&v, &h, 2);
    return (float)v;
}

/* ---- one ISA's primitives: W (32 codes), X (32 int8 activations), I (int32 partial sums,
 * reduced exactly to one int32 per group by isum) ---- */
#if defined(__AVX2__)
typedef __m256i W;
typedef __m256i X;
typedef __m256i I;
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
#define PATH "avx512-vnni-amx" /* prefill panels on the tile unit where the OS grants it */
#else
#define PATH "avx512-vnni"
#endif
static inline I idot(I acc, W w, X x) { return _mm256_dpbusd_epi32(acc, w, x); }
#elif defined(__AVXVNNI__)
#define PATH "avx-vnni"
static inline I idot(I acc, W w, X x) { return _mm256_dpbusd_avx_epi32(acc, w, x); }
#elif defined(LITESERVE_EMULATE_AVX512)
#define PATH "avx512-vnni-emulated"
/* vpdpbusd's exact sums from AVX2, for LITESERVE_CPU_ISA=avx512-emulated (kernels/isa.py): the
 * VNNI tiles' code runs and is tested on a machine without VNNI. Even and odd bytes widened to
 * int16 (u8 zero-, s8 sign-extended); each vpmaddwd adds two products per int32 lane. */
static inline I idot(I acc, W w, X x) {
    __m256i we = _mm256_and_si256(w, _mm256_set1_epi16(0xff)), wo = _mm256_srli_epi16(w, 8);
    __m256i xe = _mm256_srai_epi16(_mm256_slli_epi16(x, 8), 8), xo = _mm256_srai_epi16(x, 8);
    __m256i even = _mm256_madd_epi16(we, xe), odd = _mm256_madd_epi16(wo, xo);
    return _mm256_add_epi32(acc, _mm256_add_epi32(even, odd));
}
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) || defined(__AVXVNNI__) ||                   \
    defined(LITESERVE_EMULATE_AVX512)
#define HAVE_VNNI
static inline I pfinish(I p) { return p; }
#else
#define PATH "avx2"
/* Pair sums of u8 x s8 in int16 lanes, added across the chunks of a group before one widening
 * to int32: each pair is at most 2 * 15 * 127 = 3810, so 8 chunks (gs <= 256) cannot
 * overflow; an int8 x int8 pair (2 * 127 * 127) fits once, and its groups are one chunk. */
static inline I idot(I acc, W w, X x) { return _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, x)); }
static inline I pfinish(I p) { return _mm256_madd_epi16(p, _mm256_set1_epi16(1)); }
#endif
static inline I idot8(I acc, W w, X x) { /* both signed: |w| x sign(x, w) */
    return idot(acc, _mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}
static inline W load_w8(const int8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline W load_w(const uint8_t *p) {
    __m128i b = _mm_loadu_si128((const __m128i *)p), m = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
}
static inline X load_x(const int8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline I izero(void) { return _mm256_setzero_si256(); }
static inline int32_t isum(I v) { /* exact: the order of integer adds does not matter */
    __m128i a = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    a = _mm_add_epi32(a, _mm_shuffle_epi32(a, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(a, _mm_shuffle_epi32(a, 0xb1)));
}

#elif defined(__ARM_NEON)
typedef int8x16x2_t W;
typedef int8x16x2_t X;
typedef int32x4_t I;
static inline W load_w(const uint8_t *p) {
    uint8x16_t b = vld1q_u8(p);
    W w = {{vreinterpretq_s8_u8(vandq_u8(b, vdupq_n_u8(15))), vreinterpretq_s8_u8(vshrq_n_u8(b, 4))}};
    return w;
}
static inline X load_x(const int8_t *p) { return vld1q_s8_x2(p); }
static inline W load_w8(const int8_t *p) { return vld1q_s8_x2(p); }
#if defined(__ARM_FEATURE_DOTPROD)
#define PATH "neon-dotprod"
static inline I idot(I acc, W w, X x) {
    return vdotq_s32(vdotq_s32(acc, w.val[0], x.val[0]), w.val[1], x.val[1]);
}
#else
#define PATH "neon"
static inline I idot(I acc, W w, X x) {
    int16x8_t p = vmull_s8(vget_low_s8(w.val[0]), vget_low_s8(x.val[0]));
    p = vmlal_s8(p, vget_high_s8(w.val[0]), vget_high_s8(x.val[0]));
    int16x8_t q = vmull_s8(vget_low_s8(w.val[1]), vget_low_s8(x.val[1]));
    q = vmlal_s8(q, vget_high_s8(w.val[1]), vget_high_s8(x.val[1]));
    return vpadalq_s16(vpadalq_s16(acc, p), q); /* |p| <= 2 * 15 * 127: fits int16 */
}
#endif
static inline I idot8(I acc, W w, X x) { return idot(acc, w, x); } /* sdot is signed */
static inline I pfinish(I p) { return p; }
static inline I izero(void) { return vdupq_n_s32(0); }
static inline int32_t isum(I v) { return vaddvq_s32(v); }

#else /* portable C: the reference the SIMD paths are tested against */
#define PATH "scalar"
typedef struct { int8_t v[32]; } W;
typedef W X;
typedef int32_t I;
static inline W load_w(const uint8_t *p) {
    W w;
    for (int i = 0; i < 16; i++) {
        w.v[i] = (int8_t)(p[i] & 15);
        w.v[i + 16] = (int8_t)(p[i] >> 4);
    }
    return w;
}
static inline X load_x(const int8_t *p) {
    X x;
    memcpy(x.v, p, 32);
    return x;
}
static inline W load_w8(const int8_t *p) { return load_x(p); }
static inline I idot(I acc, W w, X x) {
    for (int i = 0; i < 32; i++) acc += (int32_t)w.v[i] * x.v[i];
    return acc;
}
static inline I idot8(I acc, W w, X x) { return idot(acc, w, x); }
static inline I pfinish(I p) { return p; }
static inline I izero(void) { return 0; }
static inline int32_t isum(I v) { return v; }
#endif

const char *isa_path(void) { return PATH; }

/* row and column tiles; one row: more columns; x86 int4: WIDE_RB rows over 8 columns */
/* WIDE_RB: 4, 6 and 8 rows measured 0.8-0.95x of 3 at 8-128 rows (each row's activations are
 * two loads a chunk, which more rows do not share) */
enum { RB = 4, CB = 2, DECODE_CB = 8, WIDE_RB = 3, L2_ACTIVATIONS = 96 * 1024 };
/* prefill panels (unpacked int4, x86 and ARM with sdot): PANEL_RB rows by 16 columns, see
 * unpack_panel */
enum { PANEL_COLS = 16, PANEL_RB = 4, AMX_ROWS = 16 /* AMX's tile rows */ };
#if defined(__AVX2__) || defined(__ARM_FEATURE_DOTPROD)
#define HAVE_PANELS
#endif

#if defined(__AVX2__)
/* One group's codes (gs a multiple of 32) in vectors: the same operations as the scalar loop
 * below on every element (max is exact and order-free; v * inv rounded half to even), so the
 * same bits. Returns the codes' sum. */
static inline int32_t quantize_group(const float *v, int64_t gs, float inv, int8_t *q, int doubled) {
    const __m256 scale = _mm256_set1_ps(inv);
    __m256i total = _mm256_setzero_si256();
    for (int64_t i = 0; i < gs; i += 32) {
        __m256i c[4];
        for (int j = 0; j < 4; j++)
            c[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(v + i + 8 * j), scale),
                                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        for (int j = 0; j < 4; j++) total = _mm256_add_epi32(total, c[j]);
        /* packs work per 128-bit half: (0 1 | 2 3) words, then bytes, then the dwords in order */
        __m256i w01 = _mm256_packs_epi32(c[0], c[1]), w23 = _mm256_packs_epi32(c[2], c[3]);
        __m256i b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23),
                                                _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        if (doubled) { /* each 16 twice */
            __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
            _mm256_storeu_si256((__m256i *)(q + 2 * i), _mm256_set_m128i(lo, lo));
            _mm256_storeu_si256((__m256i *)(q + 2 * i + 32), _mm256_set_m128i(hi, hi));
        } else {
            _mm256_storeu_si256((__m256i *)(q + i), b);
        }
    }
    return isum(total);
}

/* NaN if the group holds one (max_ps alone skips them), as the scalar loop below */
static inline float group_amax(const float *v, int64_t gs) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 m = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (int64_t i = 0; i < gs; i += 8) {
        __m256 a = _mm256_loadu_ps(v + i);
        m = _mm256_max_ps(_mm256_andnot_ps(sign, a), m);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
    }
    if (_mm256_movemask_ps(nan)) return NAN;
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}
#endif

/* Groups whose largest activation is below this quantize to zero codes: 127 / amax would
 * overflow to inf near FLT_MIN, and what they add to an output is below 1e-30 anyway. */
#define AMAX_TINY 1e-30f

/*
 * Row r of x [m, k] (row stride x_stride, x_dtype), per group g: q int8 [k], d [groups] the
 * step, xs [groups] = d * sum(q) over the group. `row`: k floats of scratch. The max is a plain
 * compare, not fmaxf (a libm call per element where NaNs are possible). `doubled`: q [2k], each
 * 16 codes written twice in a row (the layout tile_r8 reads).
 */
static void quantize_row(const void *x, int64_t x_stride, int x_dtype, int64_t r, int64_t k,
                         int64_t gs, float *row, int8_t *q, float *d, float *xs, int doubled) {
    const uint8_t *src = (const uint8_t *)x + r * x_stride * (x_dtype == F32 ? 4 : 2);
    if (x_dtype == F32) row = (float *)src; /* read in place */
    else for (int64_t i = 0; i < k; i++) row[i] = load_scalar(src, x_dtype, i);
    for (int64_t g = 0; g < k / gs; g++) {
        const float *v = row + g * gs;
#if defined(__AVX2__)
        float amax = group_amax(v, gs);
#else
        float amax = 0.f;
        for (int64_t i = 0; i < gs; i++) { /* a NaN sticks: no compare with it is true */
            float a = fabsf(v[i]);
            amax = a > amax || a != a ? a : amax;
        }
#endif
        if (!(amax <= FLT_MAX)) {
            /* a NaN or an infinity: the group's outputs are NaN (as float math makes them
             * NaN or +-inf), not what converting them to int32 (undefined in C, and
             * different per ISA) made of them: finite garbage */
            memset(q + (doubled ? 2 : 1) * g * gs, 0, (size_t)((doubled ? 2 : 1) * gs));
            d[g] = xs[g] = NAN;
            continue;
        }
        float step = amax / 127.f, inv = amax >= AMAX_TINY ? 127.f / amax : 0.f;
        int32_t total = 0;
#if defined(__AVX2__)
        total = quantize_group(v, gs, inv, q + (doubled ? 2 : 1) * g * gs, doubled);
#else
        for (int64_t i = 0; i < gs; i++) {
            int32_t c = (int32_t)rintf(v[i] * inv);
            int64_t at = g * gs + i;
            if (doubled) {
                at = 2 * at - at % 16;
                q[at + 16] = (int8_t)c;
            }
            q[at] = (int8_t)c;
            total += c;
        }
#endif
        d[g] = step;
        xs[g] = step * (float)total;
    }
}

/* How a weight's chunk of 32 codes is stored. */
enum { PACKED4 = 0, SIGNED8 = 1, UNPACKED4 = 2 };

/* Weights: int4 codes (16 bytes a chunk, offsets per group: PACKED4, or a tile's codes
 * unpacked one a byte: UNPACKED4) or int8 (32 bytes, no offsets: SIGNED8). */
typedef struct {
    const uint8_t *codes;
    const void *scale, *offset; /* [n, groups]; offset NULL for int8 */
    int s_dtype, form;
    int64_t groups, gs, k;
    int64_t first; /* UNPACKED4: the column codes[0] holds */
} Weights;

/* Where column j's first chunk (inputs 0..31) starts: in the tiled codes (see the header), or
 * in an unpacked tile's buffer (one code a byte, a column's codes in order). */
static inline const uint8_t *column_at(const Weights *w, int64_t j) {
    if (w->form == UNPACKED4) return w->codes + (j - w->first) * w->k;
    const uint8_t *tile = w->codes + (j / 8) * 8 * (w->form == PACKED4 ? w->k / 2 : w->k);
    if (w->form == PACKED4) return tile + (j % 4) * 32 + (j % 8 / 4) * 16;
    return tile + (j % 8) * 32;
}

/* Bytes from one chunk of a column to its next: a tile's chunk of 8 columns, or 32 codes. */
static inline int64_t chunk_step(const Weights *w) {
    return w->form == PACKED4 ? 128 : w->form == SIGNED8 ? 256 : 32;
}

/* The chunk of inputs [i, i + 32) of the column at `col` (column_at). */
static inline W chunk(const Weights *w, const uint8_t *col, int64_t i) {
    const uint8_t *p = col + (i / 32) * chunk_step(w);
    return w->form == PACKED4 ? load_w(p) : load_w8((const int8_t *)p);
}

/* Column j's scale (or offset) of group g in the tiled [n / 8, groups, 8] layout. */
static inline float param(const void *p, const Weights *w, int64_t j, int64_t g) {
    return load_scalar(p, w->s_dtype, (j / 8) * w->groups * 8 + g * 8 + j % 8);
}

/* out[r, j0 + c] for r < rows <= RB, c < cols <= DECODE_CB: the tile's weight chunks are
 * loaded once for all its rows. */
static inline __attribute__((always_inline)) void tile(const int8_t *q, const float *d,
                                                       const float *xs, int rows, int cols,
                                                       const Weights *w, int64_t j0, float *out,
                                                       int64_t n) {
    const int64_t groups = w->groups, gs = w->gs, k = w->k;
    float acc[RB][DECODE_CB] = {{0}};
    const uint8_t *col[DECODE_CB];
    for (int c = 0; c < cols; c++) col[c] = column_at(w, j0 + c);
    for (int64_t g = 0; g < groups; g++) {
        I part[RB][DECODE_CB];
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < cols; c++) part[r][c] = izero();
        for (int64_t i = g * gs; i < (g + 1) * gs; i += 32) {
            W wc[DECODE_CB];
            for (int c = 0; c < cols; c++) wc[c] = chunk(w, col[c], i);
            for (int r = 0; r < rows; r++) {
                X x = load_x(q + r * k + i);
                for (int c = 0; c < cols; c++)
                    part[r][c] = w->form == SIGNED8 ? idot8(part[r][c], wc[c], x)
                                                    : idot(part[r][c], wc[c], x);
            }
        }
        for (int c = 0; c < cols; c++) {
            float s = param(w->scale, w, j0 + c, g);
            for (int r = 0; r < rows; r++)
                acc[r][c] = fmaf((float)isum(pfinish(part[r][c])), s * d[r * groups + g], acc[r][c]);
        }
    }
    for (int c = 0; c < cols; c++) {
        float bias[RB] = {0};
        for (int64_t g = 0; w->offset && g < groups; g++) {
            float b = param(w->offset, w, j0 + c, g);
            for (int r = 0; r < rows; r++) bias[r] = fmaf(b, xs[r * groups + g], bias[r]);
        }
        for (int r = 0; r < rows; r++) out[r * n + j0 + c] = acc[r][c] + bias[r];
    }
}

#if defined(__AVX2__)
/* Eight int32 vectors reduced to one int32 each, lane i from p[i]: hadd twice, then the two
 * 128-bit halves. Exact, so the same sums as isum's. */
static inline __m256i reduce8(const I p[8]) {
    __m256i h01 = _mm256_hadd_epi32(pfinish(p[0]), pfinish(p[1]));
    __m256i h23 = _mm256_hadd_epi32(pfinish(p[2]), pfinish(p[3]));
    __m256i h45 = _mm256_hadd_epi32(pfinish(p[4]), pfinish(p[5]));
    __m256i h67 = _mm256_hadd_epi32(pfinish(p[6]), pfinish(p[7]));
    __m256i a = _mm256_hadd_epi32(h01, h23), b = _mm256_hadd_epi32(h45, h67);
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20),
                            _mm256_permute2x128_si256(a, b, 0x31));
}

/* A group's 8 tiled scales (or offsets) from p[i], as floats. */
static inline __m256 load8(const void *p, int dtype, int64_t i) {
    if (dtype == F32) return _mm256_loadu_ps((const float *)p + i);
    __m128i v = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    if (dtype == F16) return _mm256_cvtph_ps(v);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

/* R <= 3 rows' int32 sums of one group's inputs [i0, i0 + gs) over the 8 columns of an int4
 * tile, lane c of out[r] for column c. Each 32-byte weight load is a pair (pr, pr + 4) of
 * columns' chunks: its low nibbles meet the chunk's first 16 activations, its high nibbles the
 * last 16. `doubled` activations (quantize_row) hold each 16 twice, so they are plain memory
 * operands of the multiply. A pair at a time over the whole group: only R accumulators live
 * (with all four pairs' 12 at once, GCC spilled them to the stack every chunk). Without VNNI
 * the u8 x s8 products gather 4 to an int16 lane per chunk (at most 4 * 15 * 127 = 7620), so
 * at most 4 chunks (128 inputs) before the lanes widen to int32. Lane l of pair pr's low half
 * is column pr's inputs 4l..4l+3 and 16+4l..16+4l+3 of each chunk, of its high half column
 * pr + 4's; the horizontal adds put the lanes in column order. */
static inline __attribute__((always_inline)) void pair_sums(const int8_t *q, int64_t qs, int rows,
                                                            const uint8_t *tile, int64_t i0,
                                                            int64_t gs, int pr, I s[WIDE_RB]) {
    const __m256i low = _mm256_set1_epi8(15);
    for (int r = 0; r < rows; r++) s[r] = _mm256_setzero_si256();
    for (int64_t i1 = i0; i1 < i0 + gs; i1 += 128) {
        I p[WIDE_RB];
        for (int r = 0; r < rows; r++) p[r] = izero();
        for (int64_t i = i1; i < i1 + 128 && i < i0 + gs; i += 32) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(tile + (i / 32) * 128 + 32 * pr));
            __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            const int8_t *x = q + 2 * i;
            for (int r = 0; r < rows; r++)
                p[r] = idot(idot(p[r], lo, load_x(x + r * qs)), hi, load_x(x + r * qs + 32));
        }
        for (int r = 0; r < rows; r++) s[r] = _mm256_add_epi32(s[r], pfinish(p[r]));
    }
}

static inline __attribute__((always_inline)) void group_sums4(const int8_t *q, int64_t qs, int rows,
                                                              const uint8_t *tile, int64_t i0,
                                                              int64_t gs, __m256i out[WIDE_RB]) {
    I a[WIDE_RB], b[WIDE_RB], h01[WIDE_RB];
    pair_sums(q, qs, rows, tile, i0, gs, 0, a);
    pair_sums(q, qs, rows, tile, i0, gs, 1, b);
    for (int r = 0; r < rows; r++) h01[r] = _mm256_hadd_epi32(a[r], b[r]);
    pair_sums(q, qs, rows, tile, i0, gs, 2, a);
    pair_sums(q, qs, rows, tile, i0, gs, 3, b);
    for (int r = 0; r < rows; r++) out[r] = _mm256_hadd_epi32(h01[r], _mm256_hadd_epi32(a[r], b[r]));
}

/* The same for 8 columns of int8 codes (32-byte chunks in column order), one int32 each. */
static inline __m256i group_sums8(const int8_t *q, const uint8_t *tile, int64_t i0, int64_t gs) {
    I p[8];
    for (int c = 0; c < 8; c++) p[c] = izero();
    for (int64_t i = i0; i < i0 + gs; i += 32) {
        X x = load_x(q + i);
        const int8_t *b = (const int8_t *)tile + (i / 32) * 256;
        for (int c = 0; c < 8; c++) p[c] = idot8(p[c], load_w8(b + 32 * c), x);
    }
    return reduce8(p);
}

/* Rows r < R <= 3 of doubled activations (row stride qs bytes) over the 8 columns of packed
 * int4 tile j0 / 8, lane c: per row the same group-wise order as tile()'s (the integer sums are
 * exact, so the same bits), so a row's result does not depend on the rows beside it. x86's int4
 * tile for every row count: each unpacked weight register meets up to three rows. */
static inline __attribute__((always_inline)) void tile_r8(const int8_t *q, int64_t qs, int rows,
                                                          const float *d, const float *xs,
                                                          const Weights *w, int64_t j0, int cols,
                                                          float *out, int64_t n, int64_t gs) {
    const int64_t groups = w->groups, at = j0 * groups; /* the tile's params */
    __m256 acc[WIDE_RB], bias[WIDE_RB];
    for (int r = 0; r < rows; r++) acc[r] = bias[r] = _mm256_setzero_ps();
    const uint8_t *tile = w->codes + j0 * (w->k / 2);
    for (int64_t g = 0; g < groups; g++) {
        __m256i sums[WIDE_RB];
        group_sums4(q, qs, rows, tile, g * gs, gs, sums);
        __m256 s = load8(w->scale, w->s_dtype, at + g * 8), b = load8(w->offset, w->s_dtype, at + g * 8);
        for (int r = 0; r < rows; r++) {
            __m256 sd = _mm256_mul_ps(s, _mm256_set1_ps(d[r * groups + g]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), sd, acc[r]);
            bias[r] = _mm256_fmadd_ps(b, _mm256_set1_ps(xs[r * groups + g]), bias[r]);
        }
    }
    for (int r = 0; r < rows; r++) { /* a last tile of n % 8 columns: its codes are padded */
        float lanes[8];
        _mm256_storeu_ps(cols == 8 ? out + r * n + j0 : lanes, _mm256_add_ps(acc[r], bias[r]));
        if (cols < 8) memcpy(out + r * n + j0, lanes, sizeof(float) * (size_t)cols);
    }
}

/* One row (decode) over the 8 columns of an int8 tile j0 / 8 (the lm_head), lane c: tile()'s
 * order, as tile_r8's. */
static void tile18(const int8_t *q, const float *d, const Weights *w, int64_t j0, float *out) {
    const int64_t groups = w->groups, gs = w->gs, at = j0 * groups;
    __m256 acc = _mm256_setzero_ps();
    const uint8_t *tile = w->codes + j0 * w->k;
    for (int64_t g = 0; g < groups; g++) {
        __m256i sums = group_sums8(q, tile, g * gs, gs);
        __m256 sd = _mm256_mul_ps(load8(w->scale, w->s_dtype, at + g * 8), _mm256_set1_ps(d[g]));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), sd, acc);
    }
    _mm256_storeu_ps(out + j0, _mm256_add_ps(acc, _mm256_setzero_ps()));
}

/* The full 4 x 2 tile of prefill-sized batches on x86. Each group's eight (row, column) int32
 * partials are reduced across lanes together (reduce8), so the group's scales meet all eight
 * sums in one convert and one multiply-add on one register: per-pair flushes of 8-lane
 * vectors cost more than the integer dots themselves at group 64. Lane 2r + c; the scales,
 * offsets and activation steps come laid out per lane (lane_patterns), each group's 16
 * floats: [s or d per lane, offset or activation sum per lane]. */
static void tile42(const int8_t *q, const Weights *w, int64_t j0, const float *rowpat,
                   const float *colpat, float *out, int64_t n) {
    const int64_t groups = w->groups, gs = w->gs, k = w->k;
    __m256 acc = _mm256_setzero_ps(), bias = _mm256_setzero_ps();
    const uint8_t *col0 = column_at(w, j0), *col1 = column_at(w, j0 + 1);
    for (int64_t g = 0; g < groups; g++) {
        I p[8];
        for (int i = 0; i < 8; i++) p[i] = izero();
        for (int64_t i = g * gs; i < (g + 1) * gs; i += 32) {
            W w0 = chunk(w, col0, i), w1 = chunk(w, col1, i);
            for (int r = 0; r < 4; r++) {
                X x = load_x(q + r * k + i);
                if (w->form == SIGNED8) {
                    p[2 * r] = idot8(p[2 * r], w0, x);
                    p[2 * r + 1] = idot8(p[2 * r + 1], w1, x);
                } else {
                    p[2 * r] = idot(p[2 * r], w0, x);
                    p[2 * r + 1] = idot(p[2 * r + 1], w1, x);
                }
            }
        }
        __m256i sums = reduce8(p);
        const float *rp = rowpat + g * 16, *cp = colpat + g * 16;
        __m256 sd = _mm256_mul_ps(_mm256_loadu_ps(cp), _mm256_loadu_ps(rp));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), sd, acc);
        bias = _mm256_fmadd_ps(_mm256_loadu_ps(cp + 8), _mm256_loadu_ps(rp + 8), bias);
    }
    float total[8];
    _mm256_storeu_ps(total, _mm256_add_ps(acc, bias));
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 2; c++) out[r * n + j0 + c] = total[2 * r + c];
}
#endif

#if defined(__AVX2__)
/*
 * Prefill panels (x86, the dispatch's "int8-unpacked" path): 16 columns' codes unpacked once per
 * call into a panel whose 32-byte vectors hold 8 columns' codes of 4 consecutive inputs (lane c
 * = column c), so the multiply's other operand is 4 activation bytes broadcast to every lane.
 * The tile is an outer product, PANEL_RB rows x 16 columns: each weight load meets every row of
 * the tile and each broadcast both column vectors, and the lanes already are columns (no
 * horizontal reduction per group: the dot tiles above spend a third of their work there).
 * Same bits as the dot tiles: exact int32 group sums, then the same float operations per
 * (row, column) in group order.
 */
/* Columns [j0, j0 + 16) of the tiled packed codes into `panel` ([k / 4][16][4] bytes): per
 * chunk of 32 inputs and tile of 8 columns, the four (c, c + 4) pair loads split into nibbles
 * are two 4 x 4 transposes of 32-bit units within each 128-bit half. A missing second tile (n
 * ends at j0 + 8) is zeros. */
static void unpack_panel(const Weights *w, int64_t j0, int64_t n, uint8_t *panel) {
    const __m256i low = _mm256_set1_epi8(15);
    const int64_t k = w->k;
    for (int v = 0; v < 2; v++) {
        if (j0 + 8 * v >= n) {
            for (int64_t i = 0; i < k / 4; i++)
                _mm256_storeu_si256((__m256i *)(panel + i * 64 + 32 * v), _mm256_setzero_si256());
            continue;
        }
        const uint8_t *tile = w->codes + (j0 + 8 * v) * (k / 2);
        for (int64_t i = 0; i < k; i += 32) {
            __m256i lo[4], hi[4];
            for (int pr = 0; pr < 4; pr++) {
                __m256i b = _mm256_loadu_si256((const __m256i *)(tile + (i / 32) * 128 + 32 * pr));
                lo[pr] = _mm256_and_si256(b, low);
                hi[pr] = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
            }
            for (int h = 0; h < 2; h++) { /* inputs i..i+15 (low nibbles), i+16..i+31 (high) */
                const __m256i *a = h ? hi : lo;
                __m256i t0 = _mm256_unpacklo_epi32(a[0], a[1]), t1 = _mm256_unpackhi_epi32(a[0], a[1]);
                __m256i t2 = _mm256_unpacklo_epi32(a[2], a[3]), t3 = _mm256_unpackhi_epi32(a[2], a[3]);
                uint8_t *dst = panel + (i / 4 + 4 * h) * 64 + 32 * v;
                _mm256_storeu_si256((__m256i *)dst, _mm256_unpacklo_epi64(t0, t2));
                _mm256_storeu_si256((__m256i *)(dst + 64), _mm256_unpackhi_epi64(t0, t2));
                _mm256_storeu_si256((__m256i *)(dst + 128), _mm256_unpacklo_epi64(t1, t3));
                _mm256_storeu_si256((__m256i *)(dst + 192), _mm256_unpackhi_epi64(t1, t3));
            }
        }
    }
}

#if defined(HAVE_VNNI)
/* One step of 4 inputs: the panel's two column vectors at `wp` against row r's 4 activation
 * bytes at `xr`, into the row's two accumulators. */
#define PANEL_STEP(a0, a1, xr)                                                                 \
    do {                                                                                       \
        int32_t four_;                                                                         \
        memcpy(&four_, (xr), 4);                                                               \
        X x_ = _mm256_set1_epi32(four_);                                                       \
        *a0 = idot(*a0, w0, x_);                                                               \
        *a1 = idot(*a1, w1, x_);                                                               \
    } while (0)

/* A chunk of 32 inputs (8 steps of 4) of four rows over a panel's two column vectors. */
static inline __attribute__((always_inline)) void panel_chunk(const uint8_t *wp, const int8_t *x0,
                                                              const int8_t *x1, const int8_t *x2,
                                                              const int8_t *x3, I *p00, I *p01,
                                                              I *p10, I *p11, I *p20, I *p21,
                                                              I *p30, I *p31) {
    for (int s = 0; s < 8; s++) {
        W w0 = _mm256_loadu_si256((const __m256i *)(wp + 64 * s));
        W w1 = _mm256_loadu_si256((const __m256i *)(wp + 64 * s + 32));
        PANEL_STEP(p00, p01, x0 + 4 * s);
        PANEL_STEP(p10, p11, x1 + 4 * s);
        PANEL_STEP(p20, p21, x2 + 4 * s);
        PANEL_STEP(p30, p31, x3 + 4 * s);
    }
}
#undef PANEL_STEP
#else
/* The same without VNNI, in assembly: from intrinsics GCC 12 reassociated the int16 adds into
 * trees whose products all lived at once (on the stack) or, kept in order, copied the eight
 * accumulators between registers every step: 34 instructions a step where 22 do. */
#define PANEL_ROW(X, A0, A1)                                                                   \
    "vpbroadcastd " X ", %%ymm10\n\t"                                                          \
    "vpmaddubsw %%ymm10, %%ymm8, %%ymm11\n\t"                                                  \
    "vpaddw %%ymm11, %[" A0 "], %[" A0 "]\n\t"                                                 \
    "vpmaddubsw %%ymm10, %%ymm9, %%ymm12\n\t"                                                  \
    "vpaddw %%ymm12, %[" A1 "], %[" A1 "]\n\t"
#define PANEL_STEP(S)                                                                          \
    "vmovdqu " #S "*64(%[wp]), %%ymm8\n\t"                                                     \
    "vmovdqu " #S "*64+32(%[wp]), %%ymm9\n\t"                                                  \
    PANEL_ROW(#S "*4(%[x0])", "a00", "a01") PANEL_ROW(#S "*4(%[x1])", "a10", "a11")            \
    PANEL_ROW(#S "*4(%[x2])", "a20", "a21") PANEL_ROW(#S "*4(%[x3])", "a30", "a31")
static inline __attribute__((always_inline)) void panel_chunk(const uint8_t *wp, const int8_t *x0,
                                                              const int8_t *x1, const int8_t *x2,
                                                              const int8_t *x3, I *p00, I *p01,
                                                              I *p10, I *p11, I *p20, I *p21,
                                                              I *p30, I *p31) {
    __asm__(PANEL_STEP(0) PANEL_STEP(1) PANEL_STEP(2) PANEL_STEP(3) PANEL_STEP(4) PANEL_STEP(5)
                PANEL_STEP(6) PANEL_STEP(7)
            : [a00] "+x"(*p00), [a01] "+x"(*p01), [a10] "+x"(*p10), [a11] "+x"(*p11),
              [a20] "+x"(*p20), [a21] "+x"(*p21), [a30] "+x"(*p30), [a31] "+x"(*p31)
            : [wp] "r"(wp), [x0] "r"(x0), [x1] "r"(x1), [x2] "r"(x2), [x3] "r"(x3),
              "m"(*(const uint8_t(*)[512])wp), "m"(*(const int8_t(*)[32])x0),
              "m"(*(const int8_t(*)[32])x1), "m"(*(const int8_t(*)[32])x2),
              "m"(*(const int8_t(*)[32])x3)
            : "xmm8", "xmm9", "xmm10", "xmm11", "xmm12");
}
#undef PANEL_STEP
#undef PANEL_ROW
#endif

/* PANEL_RB = 4 rows of plain activations (row stride qs; fewer real rows repeat the first,
 * whose results are dropped) over a panel's 16 columns [j0, j0 + cols). Per chunk of 32
 * inputs the u8 x s8 pairs gather in int16 lanes (8 steps of at most 2 * 15 * 127: no
 * overflow), then widen into the group's int32 sums. The accumulators are eight named
 * variables that panel_chunk updates in place (registers throughout, see its comment). */
static inline __attribute__((always_inline)) void panel_tile(const int8_t *q, int64_t qs, int rows,
                                                             const float *d, const float *xs,
                                                             const Weights *w, const uint8_t *panel,
                                                             int64_t j0, int cols, float *out,
                                                             int64_t n, int64_t gs) {
    const int64_t groups = w->groups;
    /* the second tile's params: its own, or (past n) the first's, computed and dropped */
    const int64_t at[2] = {j0 * groups, (j0 + 8 < n ? j0 + 8 : j0) * groups};
    const int8_t *x0 = q, *x1 = rows > 1 ? q + qs : q, *x2 = rows > 2 ? q + 2 * qs : q,
                 *x3 = rows > 3 ? q + 3 * qs : q;
    __m256 acc[PANEL_RB][2], bias[PANEL_RB][2];
    for (int r = 0; r < PANEL_RB; r++)
        for (int v = 0; v < 2; v++) acc[r][v] = bias[r][v] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m256i sums[PANEL_RB][2];
        for (int r = 0; r < PANEL_RB; r++) sums[r][0] = sums[r][1] = _mm256_setzero_si256();
        for (int64_t i1 = g * gs; i1 < (g + 1) * gs; i1 += 32) {
            I p00 = izero(), p01 = izero(), p10 = izero(), p11 = izero();
            I p20 = izero(), p21 = izero(), p30 = izero(), p31 = izero();
            panel_chunk(panel + i1 * 16, x0 + i1, x1 + i1, x2 + i1, x3 + i1, &p00, &p01, &p10, &p11,
                        &p20, &p21, &p30, &p31);
            const I p[PANEL_RB][2] = {{p00, p01}, {p10, p11}, {p20, p21}, {p30, p31}};
            for (int r = 0; r < PANEL_RB; r++)
                for (int v = 0; v < 2; v++) sums[r][v] = _mm256_add_epi32(sums[r][v], pfinish(p[r][v]));
        }
        __m256 sc[2], off[2];
        for (int v = 0; v < 2; v++) {
            sc[v] = load8(w->scale, w->s_dtype, at[v] + g * 8);
            off[v] = load8(w->offset, w->s_dtype, at[v] + g * 8);
        }
        for (int r = 0; r < rows; r++) {
            __m256 dr = _mm256_set1_ps(d[r * groups + g]), xr = _mm256_set1_ps(xs[r * groups + g]);
            for (int v = 0; v < 2; v++) {
                acc[r][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][v]), _mm256_mul_ps(sc[v], dr), acc[r][v]);
                bias[r][v] = _mm256_fmadd_ps(off[v], xr, bias[r][v]);
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        float lanes[PANEL_COLS];
        for (int v = 0; v < 2; v++) _mm256_storeu_ps(lanes + 8 * v, _mm256_add_ps(acc[r][v], bias[r][v]));
        memcpy(out + r * n + j0, lanes, sizeof(float) * (size_t)cols);
    }
}

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512F__)
/*
 * Prefill panels on AMX (Intel Xeon since Sapphire Rapids). The panel is already the layout of
 * the tile multiply's second operand (a 64-byte row: 4 consecutive inputs of 16 columns), and
 * the quantized activation rows are its first, loaded in place at their stride: one TDPBSUD
 * (signed activations x unsigned codes) makes a 16 x 16 block of exact int32 sums of 64
 * inputs, the work of 32 vpdpbusd. The float steps after it are panel_tile's, per (row,
 * column) in group order, so the outputs are the same bits (the 16-lane vectors only hold
 * more columns). A panel's sums of every group go to memory first, then each row takes its
 * groups with its two accumulators in registers: interleaved with the tile multiplies, the
 * float steps of 16 rows at a time left them on the stack.
 */
#define HAVE_AMX
#include <sys/syscall.h>
#include <unistd.h>

/* Linux gives a process AMX's 8 KB of tile state only once it asks for it; a kernel that
 * refuses (before 5.16) leaves the VNNI panels. Asked once per process. */
static int amx_usable(void) {
    static int state; /* 0 not asked yet, 1 granted, -1 refused */
    int s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (s == 0) {
        s = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0 ? 1 : -1;
        __atomic_store_n(&state, s, __ATOMIC_RELEASE);
    }
    return s > 0;
}

/* Tiles 0: the sums (16 rows x 16 int32), 1: 16 activation rows of kc bytes, 2: kc / 4 rows
 * of the panel. Tile state is per thread: each OpenMP thread configures its own. */
static void amx_configure(int64_t kc) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } __attribute__((packed)) cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    cfg.rows[0] = AMX_ROWS, cfg.colsb[0] = 4 * PANEL_COLS;
    cfg.rows[1] = AMX_ROWS, cfg.colsb[1] = (uint16_t)kc;
    cfg.rows[2] = (uint8_t)(kc / 4), cfg.colsb[2] = 4 * PANEL_COLS;
    _tile_loadconfig(&cfg);
}

/* A panel's scales and offsets (the int8 head has none), 16 columns contiguous per group
 * ([groups][2][16] floats), in panel_tile's lanes (the second tile past n repeats the first's,
 * computed and dropped). */
static void amx_params(const Weights *w, int64_t j0, int64_t n, float *params) {
    const int64_t at[2] = {j0 * w->groups, (j0 + 8 < n ? j0 + 8 : j0) * w->groups};
    for (int64_t g = 0; g < w->groups; g++)
        for (int v = 0; v < 2; v++) {
            _mm256_storeu_ps(params + g * 32 + 8 * v, load8(w->scale, w->s_dtype, at[v] + g * 8));
            if (w->offset)
                _mm256_storeu_ps(params + g * 32 + 16 + 8 * v, load8(w->offset, w->s_dtype, at[v] + g * 8));
        }
}

/* The int8 head's 16 columns [j0, j0 + 16) (j0 a multiple of 16) in the panel layout, a
 * 32-bit unit (4 inputs) of each column gathered from its 8-column tile per 64-byte row. */
static void head_panel(const Weights *w, int64_t j0, uint8_t *panel) {
    const int64_t k = w->k;
    int32_t at[PANEL_COLS];
    for (int c = 0; c < PANEL_COLS; c++) at[c] = (int32_t)((c / 8) * 8 * k + (c % 8) * 32);
    const __m512i columns = _mm512_loadu_si512(at);
    const uint8_t *tiles = w->codes + j0 * k;
    for (int64_t u = 0; u < k / 4; u++)
        _mm512_storeu_si512(panel + u * 64,
                            _mm512_i32gather_epi32(columns, tiles + (u / 8) * 256 + (u % 8) * 4, 1));
}

/* AMX_ROWS rows (row stride qs) over a panel's 16 columns [j0, j0 + cols); sums: groups x
 * 16 x 16 int32 of scratch; kc: the inputs a tile multiply takes (64, or 32 where gs is not a
 * multiple of 64), as amx_configure set it. The int8 head (signed codes, no offsets) takes
 * tile18's steps, which are the same with its bias left at zero. */
static inline __attribute__((always_inline)) void amx_tile(
    const int8_t *q, int64_t qs, const float *d, const float *xs, const Weights *w,
    const uint8_t *panel, const float *params, int32_t *sums, int cols, float *out, int64_t n,
    int64_t j0, int64_t kc) {
    const int64_t groups = w->groups, gs = w->gs;
    const int head = w->form == SIGNED8;
    for (int64_t g = 0; g < groups; g++) {
        _tile_zero(0);
        for (int64_t i1 = g * gs; i1 < (g + 1) * gs; i1 += kc) {
            _tile_loadd(1, q + i1, qs);
            _tile_loadd(2, panel + i1 * PANEL_COLS, 4 * PANEL_COLS);
            if (head) _tile_dpbssd(0, 1, 2);
            else _tile_dpbsud(0, 1, 2);
        }
        _tile_stored(0, sums + g * AMX_ROWS * PANEL_COLS, 4 * PANEL_COLS);
    }
    const __mmask16 keep = (__mmask16)((1u << cols) - 1);
    for (int r = 0; r < AMX_ROWS; r++) {
        __m512 acc = _mm512_setzero_ps(), bias = _mm512_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            __m512 dr = _mm512_set1_ps(d[r * groups + g]), xr = _mm512_set1_ps(xs[r * groups + g]);
            __m512i s = _mm512_loadu_si512(sums + (g * AMX_ROWS + r) * PANEL_COLS);
            __m512 sc = _mm512_loadu_ps(params + g * 32);
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(sc, dr), acc);
            if (!head) /* the head's params hold no offsets: not read */
                bias = _mm512_fmadd_ps(_mm512_loadu_ps(params + g * 32 + 16), xr, bias);
        }
        _mm512_mask_storeu_ps(out + r * n + j0, keep, _mm512_add_ps(acc, bias));
    }
}
#endif

#elif defined(__ARM_FEATURE_DOTPROD)
/*
 * Prefill panels on ARM: the x86 panel's layout ([k / 4][16][4] bytes: 4 columns' codes of 4
 * consecutive inputs per 16-byte vector) and its outer product, with `sdot` by lane: one
 * instruction multiplies a vector of 4 columns by 4 activation bytes of one row taken from a
 * lane of a 16-byte activation load, into int32 lanes that are columns. 16 accumulators
 * (4 rows x 4 column vectors), 4 weight and 4 activation registers: 24 of the 32. Same bits as
 * the dot tiles (exact int32 group sums, the same float operations per output).
 */
/* Columns [j0, j0 + 16) of the tiled packed codes into `panel`, a code a byte; a column whose
 * tile does not exist (n ends at j0 + 8) is zeros. Once per call and 16 columns: plain C. */
static void unpack_panel(const Weights *w, int64_t j0, int64_t n, uint8_t *panel) {
    const int64_t k = w->k;
    for (int c = 0; c < PANEL_COLS; c++) {
        if (j0 + c / 8 * 8 >= n) {
            for (int64_t i = 0; i < k; i++) panel[(i / 4) * 64 + c * 4 + i % 4] = 0;
            continue;
        }
        const uint8_t *col = column_at(w, j0 + c);
        for (int64_t i = 0; i < k; i += 32) {
            const uint8_t *src = col + (i / 32) * chunk_step(w);
            for (int b = 0; b < 16; b++) {
                panel[((i + b) / 4) * 64 + c * 4 + b % 4] = src[b] & 15;
                panel[((i + 16 + b) / 4) * 64 + c * 4 + b % 4] = src[b] >> 4;
            }
        }
    }
}

/* Four columns' params of group g starting at tiled index `at` (4 consecutive lanes). */
static inline float32x4_t load4(const void *p, int dtype, int64_t at) {
    float v[4];
    for (int l = 0; l < 4; l++) v[l] = load_scalar(p, dtype, at + l);
    return vld1q_f32(v);
}

/* One step of 4 inputs (lane L of the rows' 16-byte activation vectors) over the panel's 4
 * column vectors at `wp`. */
#define PANEL_STEP(L, wp)                                                                      \
    do {                                                                                       \
        const int8x16_t w_[4] = {vld1q_s8((const int8_t *)(wp)),                               \
                                 vld1q_s8((const int8_t *)(wp) + 16),                          \
                                 vld1q_s8((const int8_t *)(wp) + 32),                          \
                                 vld1q_s8((const int8_t *)(wp) + 48)};                         \
        for (int r_ = 0; r_ < PANEL_RB; r_++)                                                  \
            for (int v_ = 0; v_ < 4; v_++)                                                     \
                sums[r_][v_] = vdotq_laneq_s32(sums[r_][v_], w_[v_], xv[r_], L);               \
    } while (0)

/* PANEL_RB = 4 rows (row stride qs; fewer real rows repeat the first, whose results are
 * dropped) over a panel's 16 columns [j0, j0 + cols). */
static inline __attribute__((always_inline)) void panel_tile(const int8_t *q, int64_t qs, int rows,
                                                             const float *d, const float *xs,
                                                             const Weights *w, const uint8_t *panel,
                                                             int64_t j0, int cols, float *out,
                                                             int64_t n, int64_t gs) {
    const int64_t groups = w->groups;
    /* the second tile's params: its own, or (past n) the first's, computed and dropped */
    const int64_t at[2] = {j0 * groups, (j0 + 8 < n ? j0 + 8 : j0) * groups};
    const int8_t *x[PANEL_RB] = {q, rows > 1 ? q + qs : q, rows > 2 ? q + 2 * qs : q,
                                 rows > 3 ? q + 3 * qs : q};
    float32x4_t acc[PANEL_RB][4], bias[PANEL_RB][4];
    for (int r = 0; r < PANEL_RB; r++)
        for (int v = 0; v < 4; v++) acc[r][v] = bias[r][v] = vdupq_n_f32(0.f);
    for (int64_t g = 0; g < groups; g++) {
        int32x4_t sums[PANEL_RB][4];
        for (int r = 0; r < PANEL_RB; r++)
            for (int v = 0; v < 4; v++) sums[r][v] = vdupq_n_s32(0);
        for (int64_t i = g * gs; i < (g + 1) * gs; i += 16) {
            int8x16_t xv[PANEL_RB];
            for (int r = 0; r < PANEL_RB; r++) xv[r] = vld1q_s8(x[r] + i);
            const uint8_t *wp = panel + i * 16;
            PANEL_STEP(0, wp);
            PANEL_STEP(1, wp + 64);
            PANEL_STEP(2, wp + 128);
            PANEL_STEP(3, wp + 192);
        }
        float32x4_t sc[4], off[4];
        for (int v = 0; v < 4; v++) {
            int64_t p = at[v / 2] + g * 8 + (v % 2) * 4;
            sc[v] = load4(w->scale, w->s_dtype, p);
            off[v] = load4(w->offset, w->s_dtype, p);
        }
        for (int r = 0; r < rows; r++) {
            float32x4_t dr = vdupq_n_f32(d[r * groups + g]), xr = vdupq_n_f32(xs[r * groups + g]);
            for (int v = 0; v < 4; v++) {
                acc[r][v] = vfmaq_f32(acc[r][v], vcvtq_f32_s32(sums[r][v]), vmulq_f32(sc[v], dr));
                bias[r][v] = vfmaq_f32(bias[r][v], off[v], xr);
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        float lanes[PANEL_COLS];
        for (int v = 0; v < 4; v++) vst1q_f32(lanes + 4 * v, vaddq_f32(acc[r][v], bias[r][v]));
        memcpy(out + r * n + j0, lanes, sizeof(float) * (size_t)cols);
    }
}
#undef PANEL_STEP
#endif

#if defined(HAVE_PANELS)
static void run_panel(const int8_t *q, int64_t qs, const float *d, const float *xs, int rows,
                      int cols, const Weights *w, const uint8_t *panel, int64_t j0, float *out,
                      int64_t n) {
    /* constant row counts and group sizes: registers for the accumulators, loops unrolled */
#define PANEL(R)                                                                               \
    switch (w->gs) {                                                                           \
    case 32: panel_tile(q, qs, R, d, xs, w, panel, j0, cols, out, n, 32); break;               \
    case 64: panel_tile(q, qs, R, d, xs, w, panel, j0, cols, out, n, 64); break;               \
    case 128: panel_tile(q, qs, R, d, xs, w, panel, j0, cols, out, n, 128); break;             \
    default: panel_tile(q, qs, R, d, xs, w, panel, j0, cols, out, n, w->gs);                   \
    }
    switch (rows) {
    case 1: PANEL(1) break;
    case 2: PANEL(2) break;
    case 3: PANEL(3) break;
    default: PANEL(PANEL_RB)
    }
#undef PANEL
}
#endif

/* A constant (rows, cols) per case, so the accumulators become registers. q: row stride qs
 * bytes (doubled where w is packed int4 on x86, see qlinear). */
static void run_tile(const int8_t *q, int64_t qs, const float *d, const float *xs, int rows,
                     int cols, const Weights *w, int64_t j0, const float *rowpat,
                     const float *colpat, float *out, int64_t n) {
#if defined(__AVX2__)
    if (w->form == PACKED4) { /* qlinear's wide tiles */
        /* constant row counts and group sizes: registers for the accumulators, loops unrolled */
#define TILE_R8(R)                                                                             \
    switch (w->gs) {                                                                           \
    case 32: tile_r8(q, qs, R, d, xs, w, j0, cols, out, n, 32); break;                         \
    case 64: tile_r8(q, qs, R, d, xs, w, j0, cols, out, n, 64); break;                         \
    case 128: tile_r8(q, qs, R, d, xs, w, j0, cols, out, n, 128); break;                       \
    default: tile_r8(q, qs, R, d, xs, w, j0, cols, out, n, w->gs);                             \
    }
        if (rows == 1) TILE_R8(1)
        else if (rows == 2) TILE_R8(2)
        else TILE_R8(3)
#undef TILE_R8
        return;
    }
#endif
    switch (rows * 16 + cols) {
#if defined(__AVX2__)
    case 1 * 16 + 8: tile18(q, d, w, j0, out); break;
    case 4 * 16 + 2: tile42(q, w, j0, rowpat, colpat, out, n); break;
#else
    case 1 * 16 + 8: tile(q, d, xs, 1, 8, w, j0, out, n); break;
    case 4 * 16 + 2: tile(q, d, xs, 4, 2, w, j0, out, n); break;
#endif
    case 3 * 16 + 2: tile(q, d, xs, 3, 2, w, j0, out, n); break;
    case 2 * 16 + 2: tile(q, d, xs, 2, 2, w, j0, out, n); break;
    case 1 * 16 + 2: tile(q, d, xs, 1, 2, w, j0, out, n); break;
    default: /* the last columns of an odd n */
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < cols; c++)
                tile(q + r * w->k, d + r * w->groups, xs + r * w->groups, 1, 1, w, j0 + c,
                     out + r * n, n);
    }
}

/* Columns [j0, j0 + cols) of packed int4 codes, one code a byte, in order, into buf. */
static void unpack_tile(const Weights *w, int64_t j0, int cols, uint8_t *buf) {
    for (int c = 0; c < cols; c++) {
        uint8_t *dst = buf + c * w->k;
        const uint8_t *col = column_at(w, j0 + c);
        for (int64_t i = 0; i < w->k; i += 32) {
            const uint8_t *src = col + (i / 32) * chunk_step(w);
            for (int b = 0; b < 16; b++) {
                dst[i + b] = src[b] & 15;
                dst[i + b + 16] = src[b] >> 4;
            }
        }
    }
}

#if defined(__AVX2__)
/* tile42's lanes: for rows r0..r0+3, per group [d0 d0 d1 d1 d2 d2 d3 d3 | xs0 xs0 ... xs3]; for
 * columns j0, j0+1, per group [s0 s1 s0 s1 ... | b0 b1 b0 b1 ...]. */
static void row_pattern(const float *d, const float *xs, int64_t groups, float *pat) {
    for (int64_t g = 0; g < groups; g++)
        for (int lane = 0; lane < 8; lane++) {
            pat[g * 16 + lane] = d[(lane / 2) * groups + g];
            pat[g * 16 + 8 + lane] = xs[(lane / 2) * groups + g];
        }
}

static void column_pattern(const Weights *w, int64_t j0, float *pat) {
    for (int64_t g = 0; g < w->groups; g++)
        for (int lane = 0; lane < 8; lane++) {
            int64_t j = j0 + lane % 2;
            pat[g * 16 + lane] = param(w->scale, w, j, g);
            pat[g * 16 + 8 + lane] = w->offset ? param(w->offset, w, j, g) : 0.f;
        }
}
#endif

static void qlinear(const void *x, int64_t x_stride, int x_dtype, const Weights *w, float *out,
                    int64_t m, int64_t n, int unpack_tiles) {
    int64_t k = w->k, groups = w->groups;
    float *d = malloc(sizeof(float) * (size_t)(2 * m * groups)), *xs = d + m * groups;
    /* unpack_tiles: many row tiles over each column tile unpack its int4 codes once instead of
     * once per row tile. Whether that beats re-reading the packed codes from L1 depends on the
     * row count and the machine (at 8 rows it cost 2.3x here), so the caller's measured
     * dispatch decides (runtime/kernels/cpu.py, the "int8-unpacked" path). */
    int unpack = unpack_tiles && w->form == PACKED4 && m > RB, wide = 0, panel = 0;
#if defined(HAVE_PANELS)
    panel = unpack; /* unpacked int4: the outer-product panels */
#endif
#if defined(HAVE_AMX)
    /* full blocks of AMX_ROWS rows on the tile unit (the panels, the int8 head's full 16-column
     * panels), kc inputs a tile multiply */
    int amx = (panel || w->form == SIGNED8) && m >= AMX_ROWS && amx_usable();
    int64_t kc = w->gs % 64 == 0 ? 64 : 32;
#else
    int amx = 0;
#endif
#if defined(__AVX2__)
    /* packed int4: tile_r8 at every row count; the int8 head one row at a time over 8-column
     * tiles (tile18 while the tile is in L1: tile42's per-lane scale patterns, built per column
     * pair and group of 32, cost more than its dots at 8 rows) */
    wide = (w->form == PACKED4 && !unpack) || w->form == SIGNED8;
#endif
    int doubled = wide && w->form == PACKED4;
    int64_t rb = panel ? PANEL_RB : !wide ? RB : doubled ? WIDE_RB : 1;
    int64_t cols = panel ? PANEL_COLS : m == 1 || wide ? DECODE_CB : CB;
    int64_t tiles = (n + cols - 1) / cols, qs = doubled ? 2 * k : k;
    /* Rows a pass over the weights takes: their activations stay in L2 while the weights stream
     * past (one pass over all m rows at 128 ran at 0.6x the rate of 64 on a Zen 3; 512 KB L2) */
    int64_t step = amx ? AMX_ROWS : rb, mc = wide || panel ? (L2_ACTIVATIONS / qs) / step * step : m;
    mc = mc < step ? step : mc;
    /* the head's columns in full 16-column panels go to the tile unit, the rest to its tiles */
    int64_t head_panels = amx && !panel ? n / PANEL_COLS : 0;
    int8_t *q = malloc((size_t)(m * qs));
    float *rowpat = NULL; /* tile42's per-lane activation steps and sums, per full row tile */
#if defined(__AVX2__)
    if (!wide && !panel) rowpat = malloc(sizeof(float) * (size_t)((m / RB) * groups * 16 + 1));
#endif
#pragma omp parallel if (n * k * (m < 8 ? m : 8) >= 65536)
    {
        float *row = malloc(sizeof(float) * (size_t)k);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++)
            quantize_row(x, x_stride, x_dtype, r, k, w->gs, row, q + r * qs, d + r * groups,
                         xs + r * groups, doubled);
        free(row);
#if defined(__AVX2__)
        if (rowpat) { /* every thread sees the same rowpat: all meet the loop's barrier or none */
#pragma omp for schedule(static)
            for (int64_t rt = 0; rt < m / RB; rt++)
                row_pattern(d + rt * RB * groups, xs + rt * RB * groups, groups, rowpat + rt * groups * 16);
        }
#endif
        uint8_t *buf = unpack || amx ? malloc((size_t)((unpack ? cols : PANEL_COLS) * k)) : NULL;
        float *colpat = NULL; /* tile42's per-lane scales and offsets of this column tile */
#if defined(__AVX2__)
        colpat = m >= RB && !wide && !panel ? malloc(sizeof(float) * (size_t)(groups * 16)) : NULL;
#endif
        /* no barrier between passes: each writes its own rows and reads what the quantize loop's
         * barrier has finished (a barrier costs microseconds, a batch-1 linear tens of them) */
#if defined(HAVE_AMX)
        float *params = amx ? malloc(sizeof(float) * (size_t)(groups * 32)) : NULL;
        int32_t *sums = amx ? malloc(sizeof(int32_t) * (size_t)(groups * AMX_ROWS * PANEL_COLS)) : NULL;
        if (amx) amx_configure(kc);
#endif
#if defined(HAVE_PANELS)
        for (int64_t m0 = 0; panel && m0 < m; m0 += mc) {
#pragma omp for schedule(static) nowait
            for (int64_t t = 0; t < tiles; t++) {
                int64_t j0 = t * cols, end = m < m0 + mc ? m : m0 + mc;
                int c = (int)(n - j0 < cols ? n - j0 : cols);
                unpack_panel(w, j0, n, buf);
                int64_t r0 = m0;
#if defined(HAVE_AMX)
                if (amx) amx_params(w, j0, n, params);
                for (; amx && end - r0 >= AMX_ROWS; r0 += AMX_ROWS)
                    amx_tile(q + r0 * qs, qs, d + r0 * groups, xs + r0 * groups, w, buf, params,
                             sums, c, out + r0 * n, n, j0, kc);
#endif
                for (; r0 < end; r0 += PANEL_RB) {
                    int rows = (int)(end - r0 < PANEL_RB ? end - r0 : PANEL_RB);
                    run_panel(q + r0 * qs, qs, d + r0 * groups, xs + r0 * groups, rows, c, w, buf,
                              j0, out + r0 * n, n);
                }
            }
        }
#endif
        for (int64_t m0 = 0; !panel && m0 < m; m0 += mc) {
#if defined(HAVE_AMX)
#pragma omp for schedule(static) nowait
        for (int64_t t = 0; t < head_panels; t++) {
            int64_t j0 = t * PANEL_COLS, end = m < m0 + mc ? m : m0 + mc, r0 = m0;
            head_panel(w, j0, buf);
            amx_params(w, j0, n, params);
            for (; end - r0 >= AMX_ROWS; r0 += AMX_ROWS)
                amx_tile(q + r0 * qs, qs, d + r0 * groups, xs + r0 * groups, w, buf, params, sums,
                         PANEL_COLS, out + r0 * n, n, j0, kc);
            for (; r0 < end; r0++) /* the pass's last rows: tile18, a row at a time */
                for (int64_t j = j0; j < j0 + PANEL_COLS; j += DECODE_CB)
                    run_tile(q + r0 * qs, qs, d + r0 * groups, xs + r0 * groups, 1, DECODE_CB, w,
                             j, NULL, NULL, out + r0 * n, n);
        }
#endif
#pragma omp for schedule(static) nowait
        for (int64_t t = head_panels * (PANEL_COLS / DECODE_CB); t < tiles; t++) {
            int64_t j0 = t * cols;
            int c = (int)(n - j0 < cols ? n - j0 : cols);
            Weights tw = *w;
            if (unpack) {
                unpack_tile(w, j0, c, buf);
                tw.codes = buf, tw.form = UNPACKED4, tw.first = j0;
            }
#if defined(__AVX2__)
            if (colpat && c == CB) column_pattern(w, j0, colpat);
#endif
            for (int64_t r0 = m0; r0 < m && r0 < m0 + mc; r0 += rb) {
                int rows = (int)(m - r0 < rb ? m - r0 : rb);
                const float *rp = rowpat && rows == RB ? rowpat + (r0 / RB) * groups * 16 : NULL;
                run_tile(q + r0 * qs, qs, d + r0 * groups, xs + r0 * groups, rows, c, &tw, j0, rp,
                         colpat, out + r0 * n, n);
            }
        }
        }
#if defined(HAVE_AMX)
        if (amx) _tile_release();
        free(params);
        free(sums);
#endif
        free(buf);
        free(colpat);
    }
    free(rowpat);
    free(q);
    free(d);
}

/*
 * out [m, n] fp32 = x [m, k] (row stride x_stride, x_dtype) @ W^T, W int4 as above; k a
 * multiple of gs, gs a multiple of 32. unpack_tiles: see qlinear (the same bits either way).
 */
void int4_int8_linear(const void *x, int64_t x_stride, int x_dtype, const uint8_t *codes,
                      const void *scale, const void *offset, int s_dtype, float *out, int64_t m,
                      int64_t n, int64_t k, int64_t gs, int unpack_tiles) {
    Weights w = {codes, scale, offset, s_dtype, PACKED4, k / gs, gs, k, 0};
    qlinear(x, x_stride, x_dtype, &w, out, m, n, unpack_tiles);
}

/*
 * out [m, n] fp32 = x [m, k] @ W^T for int8 W [n, k] with an fp32 scale per 32 inputs
 * (scale [n, k / 32]); k a multiple of 32.
 */
void int8_int8_linear(const void *x, int64_t x_stride, int x_dtype, const int8_t *codes,
                      const float *scale, float *out, int64_t m, int64_t n, int64_t k) {
    Weights w = {(const uint8_t *)codes, scale, NULL, F32, SIGNED8, k / 32, 32, k, 0};
    qlinear(x, x_stride, x_dtype, &w, out, m, n, 0);
}
