// The small float32 ops of a decoder layer as compiled code: RMSNorm with the residual add
// before it, and rotary position embedding (RoPE) of q and k. Built and loaded by
// kernels/cpu_build.py (flags there: -O3 -march=native -ffp-contract=off -fopenmp).
//
// Why: in torch each of these is five to ten tiny ops (pow, mean, add, rsqrt, mul, cat, neg,
// ...), each a dispatch of a few microseconds; on a one-token SmolLM2 step that was 2-4 ms of
// a 25 ms forward, more than the attention itself.
//
// Batch invariance (DESIGN.md §11): every row is computed on its own in one fixed order,
// whatever the number of rows or threads, so a row's result does not depend on its batch.
//  - RMSNorm: h = x (+ residual, one IEEE add per element, as torch's add); the sum of squares
//    runs in 8 float lanes over k ascending (lane l takes k = l mod 8), then a fixed lane tree
//    (0+4, 1+5, 2+6, 3+7; then 0+2, 1+3; then 0+1), then the tail k >= 8 * floor(H / 8)
//    ascending; inv = 1 / sqrt(sum / H + eps); y = w * (h * inv). It differs from torch's
//    mean (another summation order) only in rounding.
//  - RoPE (transformers' rotate_half form): for j < D/2, out[j] = x[j]*cos[j] - x[j+D/2]*sin[j]
//    and out[j+D/2] = x[j+D/2]*cos[j+D/2] + x[j]*sin[j+D/2], each product rounded before the
//    add (no FMA contraction), which is what torch computes: the same bits.
#include <cmath>
#include <cstdint>

extern "C" {

// x [M, H] (row stride x_stride), residual [M, H] (row stride res_stride) or null.
// With a residual, h = x + residual is stored to h_out [M, H] (row stride h_stride);
// y [M, H] contiguous = w * (h * inv).
int specmesh_add_rms_norm_f32(const float* x, int64_t x_stride, const float* residual,
                              int64_t res_stride, float* h_out, int64_t h_stride,
                              const float* w, float* y, int64_t M, int64_t H, float eps,
                              int num_threads) {
    if (M < 0 || H <= 0) return 1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M >= 64)
    for (int64_t i = 0; i < M; ++i) {
        const float* xi = x + i * x_stride;
        float* yi = y + i * H;
        const float* hi = xi;
        if (residual != nullptr) {
            const float* ri = residual + i * res_stride;
            float* oi = h_out + i * h_stride;
            for (int64_t k = 0; k < H; ++k) oi[k] = xi[k] + ri[k];
            hi = oi;
        }
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        const int64_t body = H - H % 8;
        for (int64_t k = 0; k < body; k += 8)
            for (int l = 0; l < 8; ++l) acc[l] += hi[k + l] * hi[k + l];
        for (int l = 0; l < 4; ++l) acc[l] += acc[l + 4];
        acc[0] += acc[2];
        acc[1] += acc[3];
        float sum = acc[0] + acc[1];
        for (int64_t k = body; k < H; ++k) sum += hi[k] * hi[k];
        const float inv = 1.0f / std::sqrt(sum / static_cast<float>(H) + eps);
        for (int64_t k = 0; k < H; ++k) yi[k] = w[k] * (hi[k] * inv);
    }
    return 0;
}

// x [T, heads, D] read with row stride x_stride (floats between tokens; heads contiguous),
// cos / sin [T, D] contiguous; out [T, heads, D] contiguous.
int specmesh_rope_f32(const float* x, int64_t x_stride, const float* cos, const float* sin,
                      float* out, int64_t T, int64_t heads, int64_t D, int num_threads) {
    if (T < 0 || heads <= 0 || D <= 0 || D % 2 != 0) return 1;
    const int64_t half = D / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T >= 64)
    for (int64_t t = 0; t < T; ++t) {
        const float* c = cos + t * D;
        const float* s = sin + t * D;
        for (int64_t h = 0; h < heads; ++h) {
            const float* xi = x + t * x_stride + h * D;
            float* oi = out + (t * heads + h) * D;
            for (int64_t j = 0; j < half; ++j) {
                const float a = xi[j] * c[j];
                const float b = xi[j + half] * s[j];
                oi[j] = a - b;
            }
            for (int64_t j = half; j < D; ++j) {
                const float a = xi[j] * c[j];
                const float b = xi[j - half] * s[j];
                oi[j] = a + b;
            }
        }
    }
    return 0;
}

}  // extern "C"
