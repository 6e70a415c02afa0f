/* LoCo's sender on a CPU, compiled on the machine that runs it (fsdp_ext/kernels/cpu_native.py).
 *
 * quantize_ef_reference's arithmetic, group by group in one pass over cache-resident buffers,
 * every operation the reference's IEEE fp32 operation in its order: compiled without FMA
 * contraction or fast-math, so each value rounds exactly as there (tests/test_codec_cpu.py
 * checks the bits against the reference). The absmaxes are taken on the bits (|v| orders
 * like its bits, and NaN's bits top Inf's, as amax propagates NaN), which vectorises.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define ERROR_QMAX 127.0f

/* the codes of quantize_ef._ERROR_KINDS, which the caller passes */
enum { ERROR_NONE = 0, ERROR_INT8 = 1, ERROR_BF16 = 2, ERROR_FP32 = 3 };

static inline float from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* fp32 -> bf16, round to nearest even, NaN -> 0x7FC0: torch's conversion */
static inline uint16_t to_bf16(float f) {
    if (f != f) return 0x7FC0;
    uint32_t u = to_bits(f);
    return (uint16_t)((u + (((u >> 16) & 1) + 0x7FFF)) >> 16);
}

static inline uint32_t abs_bits_max(const float *restrict v, int64_t n) {
    uint32_t top = 0;
    for (int64_t j = 0; j < n; j++) {
        uint32_t a = to_bits(v[j]) & 0x7FFFFFFFu;
        top = a > top ? a : top;
    }
    return top;
}

/* rows [num_rows, n] (unit column stride, fp32 or bf16) -> codes [num_rows, groups * bytes per
 * group] and scales [num_rows, groups] (unit column strides); error (flat, groups * group_size
 * per row) updated in place. h, e, q: work buffers of group_size floats each. */
void quantize_rows(const void *rows, int rows_bf16, int64_t num_rows, int64_t n,
                   int64_t row_stride, uint8_t *codes, int64_t codes_stride, float *scales,
                   int64_t scales_stride, void *error, int error_kind, float *error_scales,
                   int64_t group_size, int bits, float beta, float one_minus_beta,
                   float *restrict h, float *restrict e, float *restrict q) {
    const int64_t groups = (n + group_size - 1) / group_size;
    const float q_max = bits == 4 ? 7.0f : 127.0f, q_min = -q_max - 1.0f;
    const int64_t per_group = bits == 4 ? group_size / 2 : group_size;
    for (int64_t w = 0; w < num_rows; w++) {
        for (int64_t g = 0; g < groups; g++) {
            const int64_t lo = g * group_size, k = n - lo < group_size ? n - lo : group_size;
            const int64_t eg = w * groups + g, e0 = eg * group_size;
            if (rows_bf16) {
                const uint16_t *x = (const uint16_t *)rows + w * row_stride + lo;
                for (int64_t j = 0; j < k; j++) h[j] = from_bits((uint32_t)x[j] << 16);
            } else {
                memcpy(h, (const float *)rows + w * row_stride + lo, k * sizeof(float));
            }
            for (int64_t j = k; j < group_size; j++) h[j] = 0.0f; /* the reference's padding */
            if (error_kind == ERROR_INT8) {
                const int8_t *er = (const int8_t *)error + e0;
                const float s = error_scales[eg];
                for (int64_t j = 0; j < group_size; j++) e[j] = (float)er[j] * s;
            } else if (error_kind == ERROR_BF16) {
                const uint16_t *er = (const uint16_t *)error + e0;
                for (int64_t j = 0; j < group_size; j++) e[j] = from_bits((uint32_t)er[j] << 16);
            } else if (error_kind == ERROR_FP32) {
                memcpy(e, (const float *)error + e0, group_size * sizeof(float));
            }
            if (error_kind != ERROR_NONE)
                for (int64_t j = 0; j < group_size; j++) h[j] = h[j] + e[j];

            const uint32_t top = abs_bits_max(h, group_size);
            const int bad = top >= 0x7F800000u; /* a NaN or Inf in the group */
            const float scale = from_bits(top) / q_max;
            const float safe = scale > 0.0f ? scale : 1.0f;
            for (int64_t j = 0; j < group_size; j++) {
                float v = floorf(h[j] / safe + 0.5f);
                v = v < q_min ? q_min : v;
                q[j] = v > q_max ? q_max : v;
            }
            if (bad) memset(q, 0, group_size * sizeof(float));
            scales[w * scales_stride + g] = bad ? NAN : scale;
            uint8_t *out = codes + w * codes_stride + g * per_group;
            if (bits == 4)
                for (int64_t j = 0; j < per_group; j++)
                    out[j] = (uint8_t)((int)(q[2 * j] + 8.0f) | ((int)(q[2 * j + 1] + 8.0f) << 4));
            else
                for (int64_t j = 0; j < group_size; j++) out[j] = (uint8_t)(int)(q[j] + 128.0f);
            if (error_kind == ERROR_NONE) continue;

            for (int64_t j = 0; j < group_size; j++) {
                const float residual = h[j] - q[j] * scale;
                e[j] = beta * e[j] + one_minus_beta * residual;
            }
            if (bad) memset(e, 0, group_size * sizeof(float));
            if (error_kind == ERROR_FP32) {
                memcpy((float *)error + e0, e, group_size * sizeof(float));
            } else if (error_kind == ERROR_BF16) {
                uint16_t *er = (uint16_t *)error + e0;
                for (int64_t j = 0; j < group_size; j++) er[j] = to_bf16(e[j]);
            } else {
                const float es = from_bits(abs_bits_max(e, group_size)) / ERROR_QMAX;
                const float safe_e = es > 0.0f ? es : 1.0f;
                int8_t *er = (int8_t *)error + e0;
                for (int64_t j = 0; j < group_size; j++) {
                    float v = floorf(e[j] / safe_e + 0.5f);
                    v = v < -ERROR_QMAX ? -ERROR_QMAX : v;
                    v = v > ERROR_QMAX ? ERROR_QMAX : v;
                    er[j] = (int8_t)(int32_t)v;
                }
                error_scales[eg] = es;
            }
        }
    }
}
