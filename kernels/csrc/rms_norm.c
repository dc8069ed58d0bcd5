/* RMSNorm of bf16 rows as the Hugging Face models compute it, in one pass per row instead of
 * torch's seven small ops (a decode step norms two rows per layer):
 *     y = bf16(w * bf16(x * rsqrt(mean(x^2) + eps)))    (x, w bf16; sums in float32)
 * Rounding is to nearest even, as torch's; only the order of the sum of squares differs.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "exported.h"

/* x [rows, dim] (row stride ldx), weight [dim], out [rows, dim] (row stride ldo) */
int mox_rms_norm_bf16(const uint16_t *x, int64_t ldx, const uint16_t *weight, uint16_t *out,
                      int64_t ldo, int64_t rows, int64_t dim, float eps) {
    if (rows < 1 || dim < 1)
        return -1;
    #pragma omp parallel for schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * ldx;
        uint16_t *yr = out + r * ldo;
        float sum = 0.0f;
        for (int64_t i = 0; i < dim; i++) {
            float v = bf16_to_f32(xr[i]);
            sum += v * v;
        }
        float scale = 1.0f / sqrtf(sum / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) {
            float normed = bf16_to_f32(f32_to_bf16(bf16_to_f32(xr[i]) * scale));
            yr[i] = f32_to_bf16(bf16_to_f32(weight[i]) * normed);
        }
    }
    return 0;
}
