/*
 * A whole decoder layer of a step in one call: RMSNorm, q/k/v (int4 x int8), the q/k norms and
 * bias where the family has them, rotary, the KV write, paged attention (the decoding tokens
 * batched, each prefill chunk in blocks), o, the residual, RMSNorm, gate/up, SiLU x up, down
 * and the residual, in fp32 activations.
 *
 * Why: a batch-1 decode step of a small model is a few hundred small ops, and each op called
 * from Python through torch and ctypes costs microseconds of dispatch that, summed, are a
 * fifth of the step (evals/bench/RESULTS.md, issue 19). The arithmetic is the kernels' own
 * (cpu_qlinear.c, cpu_decode.c), called in the order the Python layer calls them, so the
 * result equals the unfused layer's to float rounding (rotary and SiLU are computed here).
 *
 * The layout of `dims` and `ptrs` is runtime/kernels/cpu_layer.py's (LAYER_DIMS, LAYER_PTRS).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { F32 = 0 };
enum {
    D_HIDDEN, D_HEADS, D_KV_HEADS, D_HEAD_DIM, D_GROUP, D_S_DTYPE, D_WINDOW, D_KIND, D_QMAX,
    D_BLOCK, D_INTER, D_UNPACK, D_COUNT
};
enum { P_IN_NORM, P_POST_NORM, P_QKV_BIAS, P_Q_NORM, P_K_NORM, P_LINEARS, P_COUNT = P_LINEARS + 4 * 5 };
enum { L_QKV, L_O, L_GATE_UP, L_DOWN };

void int4_int8_linear(const void *x, int64_t x_stride, int x_dtype, const uint8_t *codes,
                      const void *scale, const void *offset, int s_dtype, float *out, int64_t m,
                      int64_t n, int64_t k, int64_t gs, int unpack_tiles);
void silu_mul(const float *g, const float *u, float *a, int64_t n);
void rms_norm(const void *x, int64_t x_stride, const void *weight, void *out, int dtype,
              int64_t rows, int64_t dim, float eps);
void kv_write_quantized(const void *k, int64_t k_stride, const void *v, int64_t v_stride,
                        int x_dtype, const int64_t *slots, int64_t tokens, uint8_t *k_codes,
                        uint16_t *k_scale, uint16_t *k_zero, uint8_t *v_codes, uint16_t *v_scale,
                        uint16_t *v_zero, int64_t kv_heads, int64_t head_dim, int qmax);
void decode_attention(const void *q, int64_t q_stride, int q_dtype, void *out, const int64_t *rows,
                      const uint8_t *k, const uint8_t *v, const uint16_t *k_scale,
                      const uint16_t *k_zero, const uint16_t *v_scale, const uint16_t *v_zero,
                      int kind, const int64_t *tables, int64_t table_stride, const int64_t *lens,
                      int64_t window, int64_t batch, int64_t heads, int64_t kv_heads,
                      int64_t head_dim, int64_t block_size, float scale);
void prefill_attention(const void *q, int64_t q_stride, int q_dtype, void *out, int64_t row0,
                       int64_t n, const uint8_t *k, const uint8_t *v, const uint16_t *k_scale,
                       const uint16_t *k_zero, const uint16_t *v_scale, const uint16_t *v_zero,
                       int kind, const int64_t *table, int64_t ctx, int64_t window, int64_t heads,
                       int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale);

/* One linear of the layer: ptrs holds (codes, scale, offset, n, kp) per linear, the two
 * sizes as integers in pointer slots. */
typedef struct {
    const uint8_t *codes;
    const void *scale, *offset;
    int64_t n, kp;
} Lin;

static Lin linear_at(const void *const *ptrs, int which) {
    const void *const *p = ptrs + P_LINEARS + 5 * which;
    Lin l = {p[0], p[1], p[2], (int64_t)(intptr_t)p[3], (int64_t)(intptr_t)p[4]};
    return l;
}

static void run_linear(const float *x, int64_t x_stride, Lin l, const int64_t *dims, float *out,
                       int64_t t) {
    int4_int8_linear(x, x_stride, F32, l.codes, l.scale, l.offset, (int)dims[D_S_DTYPE], out, t,
                     l.n, l.kp, dims[D_GROUP], (int)dims[D_UNPACK]);
}

/* Rows of `width` floats at stride `stride`: the columns past width (the linear's K padding)
 * are zero, as torch's pad gives them. */
static void zero_tail(float *x, int64_t rows, int64_t width, int64_t stride) {
    if (stride > width)
        for (int64_t r = 0; r < rows; r++) memset(x + r * stride + width, 0, sizeof(float) * (size_t)(stride - width));
}

/* The rotate-half convention of runtime/model/rotary.py, each product rounded before the
 * sum as torch's separate ops round them (no contraction into an fma). */
__attribute__((optimize("fp-contract=off"))) static void rotary(float *x, int64_t stride,
                                                                int64_t t, int64_t heads,
                                                                int64_t d, const float *cos,
                                                                const float *sin) {
    int64_t half = d / 2;
    for (int64_t r = 0; r < t; r++)
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + r * stride + h * d;
            const float *c = cos + r * half, *s = sin + r * half;
            for (int64_t i = 0; i < half; i++) {
                float x1 = v[i], x2 = v[i + half];
                float a = x1 * c[i], b = x2 * s[i], e = x2 * c[i], f = x1 * s[i];
                v[i] = a - b;
                v[i + half] = e + f;
            }
        }
}

/* chunks: n_chunks prefill chunks of (first row, tokens, context length, block table address)
 * each; rows, blocks, lens: the `batch` decoding tokens as decode_attention takes them. */
void decode_layer(const float *x, float *out, int64_t t, const void *const *ptrs,
                  const int64_t *dims, const float *fdims, const float *cos, const float *sin,
                  const int64_t *slots, void *const *pool, const int64_t *rows,
                  const int64_t *blocks, int64_t blocks_stride, const int64_t *lens,
                  int64_t batch, const int64_t *chunks, int64_t n_chunks) {
    const int64_t hidden = dims[D_HIDDEN], h = dims[D_HEADS], hkv = dims[D_KV_HEADS];
    const int64_t d = dims[D_HEAD_DIM], inter = dims[D_INTER];
    const float eps = fdims[0], scale = fdims[1];
    const Lin qkv = linear_at(ptrs, L_QKV), o = linear_at(ptrs, L_O);
    const Lin gate_up = linear_at(ptrs, L_GATE_UP), down = linear_at(ptrs, L_DOWN);
    int64_t kp = qkv.kp > o.kp ? qkv.kp : o.kp;
    kp = gate_up.kp > kp ? gate_up.kp : kp;
    kp = down.kp > kp ? down.kp : kp;
    int64_t wide = qkv.n > gate_up.n ? qkv.n : gate_up.n;
    float *in = malloc(sizeof(float) * (size_t)(t * (kp + wide + hidden)));
    float *mid = in + t * kp, *proj = mid + t * wide;

    /* attention half */
    rms_norm(x, hidden, ptrs[P_IN_NORM], in, F32, t, hidden, eps);
    if (qkv.kp > hidden) { /* rms_norm wrote rows of `hidden`: spread them to kp */
        for (int64_t r = t - 1; r > 0; r--) memmove(in + r * qkv.kp, in + r * hidden, sizeof(float) * (size_t)hidden);
        zero_tail(in, t, hidden, qkv.kp);
    }
    run_linear(in, qkv.kp, qkv, dims, mid, t);
    const float *bias = ptrs[P_QKV_BIAS];
    for (int64_t r = 0; bias && r < t; r++)
        for (int64_t i = 0; i < qkv.n; i++) mid[r * qkv.n + i] += bias[i];
    if (ptrs[P_Q_NORM]) { /* per-head RMSNorm of q and of k (Qwen3), in place */
        for (int64_t r = 0; r < t; r++) {
            float *q = mid + r * qkv.n;
            rms_norm(q, d, ptrs[P_Q_NORM], q, F32, h, d, eps);
            rms_norm(q + h * d, d, ptrs[P_K_NORM], q + h * d, F32, hkv, d, eps);
        }
    }
    rotary(mid, qkv.n, t, h + hkv, d, cos, sin);
    const float *k = mid + h * d, *v = mid + (h + hkv) * d;
    int kind = (int)dims[D_KIND];
    if (dims[D_QMAX]) {
        kv_write_quantized(k, qkv.n, v, qkv.n, F32, slots, t, pool[0], pool[2], pool[3], pool[1],
                           pool[4], pool[5], hkv, d, (int)dims[D_QMAX]);
    } else { /* an fp32 pool: the rows as they are */
        for (int64_t r = 0; r < t; r++) {
            if (slots[r] < 0) continue;
            memcpy((float *)pool[0] + slots[r] * hkv * d, k + r * qkv.n, sizeof(float) * (size_t)(hkv * d));
            memcpy((float *)pool[1] + slots[r] * hkv * d, v + r * qkv.n, sizeof(float) * (size_t)(hkv * d));
        }
    }
    if (batch)
        decode_attention(mid, qkv.n, F32, in, rows, pool[0], pool[1], pool[2], pool[3], pool[4],
                         pool[5], kind, blocks, blocks_stride, lens, dims[D_WINDOW], batch, h,
                         hkv, d, dims[D_BLOCK], scale);
    for (int64_t c = 0; c < n_chunks; c++) {
        const int64_t *chunk = chunks + 4 * c;
        prefill_attention(mid, qkv.n, F32, in, chunk[0], chunk[1], pool[0], pool[1], pool[2],
                          pool[3], pool[4], pool[5], kind, (const int64_t *)(intptr_t)chunk[3],
                          chunk[2], dims[D_WINDOW], h, hkv, d, dims[D_BLOCK], scale);
    }
    if (o.kp > h * d) {
        for (int64_t r = t - 1; r > 0; r--) memmove(in + r * o.kp, in + r * h * d, sizeof(float) * (size_t)(h * d));
        zero_tail(in, t, h * d, o.kp);
    }
    run_linear(in, o.kp, o, dims, proj, t);
    for (int64_t i = 0; i < t * hidden; i++) out[i] = x[i] + proj[i];

    /* MLP half */
    rms_norm(out, hidden, ptrs[P_POST_NORM], in, F32, t, hidden, eps);
    if (gate_up.kp > hidden) {
        for (int64_t r = t - 1; r > 0; r--) memmove(in + r * gate_up.kp, in + r * hidden, sizeof(float) * (size_t)hidden);
        zero_tail(in, t, hidden, gate_up.kp);
    }
    run_linear(in, gate_up.kp, gate_up, dims, mid, t);
#pragma omp parallel for schedule(static) if (t * inter >= 65536)
    for (int64_t r = 0; r < t; r++)
        silu_mul(mid + r * gate_up.n, mid + r * gate_up.n + inter, in + r * down.kp, inter);
    zero_tail(in, t, inter, down.kp);
    run_linear(in, down.kp, down, dims, proj, t);
    for (int64_t i = 0; i < t * hidden; i++) out[i] += proj[i];
    free(in);
}

/*
 * Every decoder layer of a step in one call: layer l's decode_layer with its own ptrs[l],
 * dims[l], fdims[l] and pool[l], the layers' outputs in two buffers taken in turn so the last
 * lands in `out`. Why: the Python call per layer (context lookups, argument conversion) was a
 * tenth of a batch-1 step of SmolLM2 on the AVX2 Zen 3.
 */
void decode_layers(const float *x, float *out, int64_t t, int64_t layers,
                   const void *const *const *ptrs, const int64_t *const *dims,
                   const float *const *fdims, const float *cos, const float *sin,
                   const int64_t *slots, void *const *const *pool, const int64_t *rows,
                   const int64_t *blocks, int64_t blocks_stride, const int64_t *lens,
                   int64_t batch, const int64_t *chunks, int64_t n_chunks) {
    float *spare = layers > 1 ? malloc(sizeof(float) * (size_t)(t * dims[0][D_HIDDEN])) : NULL;
    const float *in = x;
    for (int64_t l = 0; l < layers; l++) {
        float *dst = (layers - 1 - l) % 2 == 0 ? out : spare;
        decode_layer(in, dst, t, ptrs[l], dims[l], fdims[l], cos, sin, slots, pool[l], rows,
                     blocks, blocks_stride, lens, batch, chunks, n_chunks);
        in = dst;
    }
    free(spare);
}
