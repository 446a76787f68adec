/*
 * Self-check of runtime/kernels/cpu_qlinear.c for targets this machine cannot run Python on
 * (ARM, under qemu-user): the kernels against a plain double-precision reference of the same
 * quantization, over shapes that cover every tile. Prints the ISA path and "ok", or the first
 * mismatch, and exits non-zero on one. Built and run by tests/test_cpu_dispatch.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *isa_path(void);
void int4_int8_linear(const void *x, int64_t x_stride, int x_dtype, const uint8_t *codes,
                      const void *scale, const void *offset, int s_dtype, float *out, int64_t m,
                      int64_t n, int64_t k, int64_t gs, int unpack_tiles);
void int8_int8_linear(const void *x, int64_t x_stride, int x_dtype, const int8_t *codes,
                      const float *scale, float *out, int64_t m, int64_t n, int64_t k);

static uint64_t state = 88172645463325252ull;
static double uniform(void) { /* xorshift64: the same inputs on every target */
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    return (double)(state >> 11) / 9007199254740992.0;
}

/* The kernels' tiled layouts (cpu_qlinear.c's header): columns in tiles of 8, n padded. */
static int64_t padded(int64_t n) { return (n + 7) / 8 * 8; }

/* [n, groups] per-column values into [n / 8, groups, 8], zeros past n */
static float *tiled_params(const float *v, int64_t n, int64_t groups) {
    float *t = calloc((size_t)(padded(n) * groups), sizeof(float));
    for (int64_t j = 0; j < n; j++)
        for (int64_t g = 0; g < groups; g++) t[(j / 8) * groups * 8 + g * 8 + j % 8] = v[j * groups + g];
    return t;
}

/* x quantized per group as the kernel does, dequantized: q * step */
static void dequantized_rows(const float *x, int64_t m, int64_t k, int64_t gs, double *out) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t g = 0; g < k / gs; g++) {
            const float *v = x + r * k + g * gs;
            float amax = 0.f;
            for (int64_t i = 0; i < gs; i++) amax = fmaxf(amax, fabsf(v[i]));
            float inv = amax > 0.f ? 127.f / amax : 0.f;
            for (int64_t i = 0; i < gs; i++)
                out[r * k + g * gs + i] = (double)rintf(v[i] * inv) * (double)(amax / 127.f);
        }
}

static int compare(const char *what, const float *got, const double *want, int64_t count) {
    double top = 0, worst = 0; /* plain comparisons: GCC 12 for aarch64 fails on fmax loops */
    for (int64_t i = 0; i < count; i++) {
        double a = fabs(want[i]), e = fabs(got[i] - want[i]);
        if (a > top) top = a;
        if (e > worst) worst = e;
    }
    if (worst > 1e-5 * top) {
        printf("MISMATCH %s: max error %g of %g\n", what, worst, top);
        return 1;
    }
    return 0;
}

static int check_int4(int64_t m, int64_t n, int64_t k, int64_t gs, int unpack) {
    int64_t groups = k / gs;
    float *x = malloc(sizeof(float) * m * k), *scale = malloc(sizeof(float) * n * groups);
    float *offset = malloc(sizeof(float) * n * groups), *out = malloc(sizeof(float) * m * n);
    uint8_t *codes = malloc(n * k), *packed = calloc((size_t)(padded(n) * k / 2), 1);
    double *xd = malloc(sizeof(double) * m * k), *want = malloc(sizeof(double) * m * n);
    for (int64_t i = 0; i < m * k; i++) x[i] = (float)(uniform() * 8 - 4);
    for (int64_t i = 0; i < n * k; i++) codes[i] = (uint8_t)(uniform() * 16);
    for (int64_t i = 0; i < n * groups; i++) {
        scale[i] = (float)(uniform() / 50 + 1e-3);
        offset[i] = -8 * scale[i] * (float)(1 + 0.2 * (uniform() - 0.5));
    }
    /* chunks of 32: byte b holds element b and b + 16; a tile's 8 columns' chunks of the same
     * inputs together, 128 bytes, in pairs (c, c + 4) */
    for (int64_t j = 0; j < n; j++)
        for (int64_t c = 0; c < k; c += 32) {
            uint8_t *chunk = packed + (j / 8) * 8 * (k / 2) + (c / 32) * 128 + (j % 4) * 32 + (j % 8 / 4) * 16;
            for (int b = 0; b < 16; b++)
                chunk[b] = (uint8_t)(codes[j * k + c + b] | (codes[j * k + c + b + 16] << 4));
        }
    float *tscale = tiled_params(scale, n, groups), *toffset = tiled_params(offset, n, groups);
    dequantized_rows(x, m, k, gs, xd);
    for (int64_t r = 0; r < m; r++)
        for (int64_t j = 0; j < n; j++) {
            double s = 0;
            for (int64_t i = 0; i < k; i++)
                s += xd[r * k + i] * (codes[j * k + i] * (double)scale[j * groups + i / gs] +
                                      offset[j * groups + i / gs]);
            want[r * n + j] = s;
        }
    int64_t x_stride = k;
    int4_int8_linear(x, x_stride, 0, packed, tscale, toffset, 0, out, m, n, k, gs, unpack);
    char what[64];
    snprintf(what, sizeof what, "int4 m=%ld n=%ld k=%ld gs=%ld", (long)m, (long)n, (long)k, (long)gs);
    int bad = compare(what, out, want, m * n);
    free(x), free(scale), free(offset), free(out), free(codes), free(packed), free(xd), free(want);
    free(tscale), free(toffset);
    return bad;
}

static int check_int8(int64_t m, int64_t n, int64_t k) {
    float *x = malloc(sizeof(float) * m * k), *scale = malloc(sizeof(float) * n * k / 32);
    float *out = malloc(sizeof(float) * m * n);
    int8_t *codes = malloc(n * k);
    double *xd = malloc(sizeof(double) * m * k), *want = malloc(sizeof(double) * m * n);
    for (int64_t i = 0; i < m * k; i++) x[i] = (float)(uniform() * 6 - 3);
    for (int64_t i = 0; i < n * k; i++) codes[i] = (int8_t)(uniform() * 255 - 127);
    codes[0] = 127, codes[1] = -127;
    for (int64_t i = 0; i < n * k / 32; i++) scale[i] = (float)(uniform() / 100);
    dequantized_rows(x, m, k, 32, xd);
    for (int64_t r = 0; r < m; r++)
        for (int64_t j = 0; j < n; j++) {
            double s = 0;
            for (int64_t i = 0; i < k; i++)
                s += xd[r * k + i] * codes[j * k + i] * (double)scale[j * k / 32 + i / 32];
            want[r * n + j] = s;
        }
    int8_t *tcodes = calloc((size_t)(padded(n) * k), 1); /* 32-byte chunks, column order */
    for (int64_t j = 0; j < n; j++)
        for (int64_t c = 0; c < k; c += 32)
            for (int b = 0; b < 32; b++)
                tcodes[(j / 8) * 8 * k + (c / 32) * 256 + (j % 8) * 32 + b] = codes[j * k + c + b];
    float *tscale = tiled_params(scale, n, k / 32);
    int8_int8_linear(x, k, 0, tcodes, tscale, out, m, n, k);
    free(tcodes), free(tscale);
    char what[64];
    snprintf(what, sizeof what, "int8 m=%ld n=%ld k=%ld", (long)m, (long)n, (long)k);
    int bad = compare(what, out, want, m * n);
    free(x), free(scale), free(out), free(codes), free(xd), free(want);
    return bad;
}

/* The unpacked path (prefill panels where the ISA has them) on m rows against each row alone
 * on the packed path: the same bits, as the dispatch's switching between them assumes. */
static int check_same_bits(int64_t m, int64_t n, int64_t k, int64_t gs) {
    int64_t groups = k / gs, pn = padded(n);
    float *x = malloc(sizeof(float) * m * k), *out = malloc(sizeof(float) * m * n);
    float *alone = malloc(sizeof(float) * n), *scale = calloc((size_t)(pn * groups), sizeof(float));
    float *offset = calloc((size_t)(pn * groups), sizeof(float));
    uint8_t *packed = malloc((size_t)(pn * k / 2));
    for (int64_t i = 0; i < m * k; i++) x[i] = (float)(uniform() * 8 - 4);
    for (int64_t i = 0; i < pn * k / 2; i++) packed[i] = (uint8_t)(uniform() * 256);
    for (int64_t i = 0; i < n * groups; i++) { /* the tiled layout's zeros past n stay */
        int64_t at = (i / groups / 8) * groups * 8 + (i % groups) * 8 + i / groups % 8;
        scale[at] = (float)(uniform() / 50 + 1e-3);
        offset[at] = -8 * scale[at] * (float)(1 + 0.2 * (uniform() - 0.5));
    }
    int4_int8_linear(x, k, 0, packed, scale, offset, 0, out, m, n, k, gs, 1);
    int bad = 0;
    for (int64_t r = 0; r < m && !bad; r++) {
        int4_int8_linear(x + r * k, k, 0, packed, scale, offset, 0, alone, 1, n, k, gs, 0);
        if (memcmp(alone, out + r * n, sizeof(float) * (size_t)n)) {
            printf("MISMATCH bits m=%ld n=%ld k=%ld gs=%ld: row %ld alone differs from the batch\n",
                   (long)m, (long)n, (long)k, (long)gs, (long)r);
            bad = 1;
        }
    }
    free(x), free(out), free(alone), free(scale), free(offset), free(packed);
    return bad;
}

int main(void) {
    int bad = check_int4(1, 70, 128, 32, 0) + check_int4(5, 33, 192, 64, 0) +
              check_int4(5, 33, 192, 64, 1) + check_int4(9, 64, 256, 128, 1) +
              check_int4(1, 64, 576, 64, 0) +
              check_int4(6, 40, 96, 32, 1) + check_int4(7, 24, 256, 64, 1) +
              check_same_bits(7, 40, 192, 64) + check_same_bits(13, 24, 128, 32) +
              check_same_bits(5, 8, 256, 128) + check_int8(1, 50, 64) + check_int8(6, 77, 160);
    printf("%s %s\n", isa_path(), bad ? "FAILED" : "ok");
    return bad != 0;
}
