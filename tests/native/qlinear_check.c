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
    uint8_t *codes = malloc(n * k), *packed = malloc(n * k / 2);
    double *xd = malloc(sizeof(double) * m * k), *want = malloc(sizeof(double) * m * n);
    for (int64_t i = 0; i < m * k; i++) x[i] = (float)(uniform() * 8 - 4);
    for (int64_t i = 0; i < n * k; i++) codes[i] = (uint8_t)(uniform() * 16);
    for (int64_t i = 0; i < n * groups; i++) {
        scale[i] = (float)(uniform() / 50 + 1e-3);
        offset[i] = -8 * scale[i] * (float)(1 + 0.2 * (uniform() - 0.5));
    }
    for (int64_t j = 0; j < n; j++) /* chunks of 32: byte b holds element b and b + 16 */
        for (int64_t c = 0; c < k; c += 32)
            for (int b = 0; b < 16; b++)
                packed[j * k / 2 + c / 2 + b] =
                    (uint8_t)(codes[j * k + c + b] | (codes[j * k + c + b + 16] << 4));
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
    int4_int8_linear(x, x_stride, 0, packed, scale, offset, 0, out, m, n, k, gs, unpack);
    char what[64];
    snprintf(what, sizeof what, "int4 m=%ld n=%ld k=%ld gs=%ld", (long)m, (long)n, (long)k, (long)gs);
    int bad = compare(what, out, want, m * n);
    free(x), free(scale), free(offset), free(out), free(codes), free(packed), free(xd), free(want);
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
    int8_int8_linear(x, k, 0, codes, scale, out, m, n, k);
    char what[64];
    snprintf(what, sizeof what, "int8 m=%ld n=%ld k=%ld", (long)m, (long)n, (long)k);
    int bad = compare(what, out, want, m * n);
    free(x), free(scale), free(out), free(codes), free(xd), free(want);
    return bad;
}

int main(void) {
    int bad = check_int4(1, 70, 128, 32, 0) + check_int4(5, 33, 192, 64, 0) +
              check_int4(5, 33, 192, 64, 1) + check_int4(9, 64, 256, 128, 1) +
              check_int4(1, 64, 576, 64, 0) +
              check_int8(1, 50, 64) + check_int8(6, 77, 160);
    printf("%s %s\n", isa_path(), bad ? "FAILED" : "ok");
    return bad != 0;
}
