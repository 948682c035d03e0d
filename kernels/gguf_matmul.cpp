/* y[M, N] = x[M, K] @ W[N, K]^T in float32, W held in a GGUF block format and dequantized
 * on the fly (block of 32 weights along K):
 *   Q4_1: w = d * q + m  (q: 4-bit, 0..15; d, m: the block's f16 scale and min, held as f32)
 *   Q8_0: w = d * q      (q: int8; d: the block's f16 scale, held as f32)
 * Both products are exact in float32 (d has an 11-bit significand, q at most 8 bits), and the
 * one addition of Q4_1 rounds once, as gguf-py's dequantization does, so every weight equals
 * the dequantized float32 weight bit for bit.
 *
 * Row invariance: y[i, n] is one accumulation over k in a fixed order (8 lanes of k mod 8,
 * k ascending, then a fixed lane reduction), whatever M, whichever tile or thread: a row's
 * result does not depend on the other rows of the call (docs/architecture.md, 'Batch invariance').
 *
 * Needs AVX2 and FMA (x86-64 since 2013); elsewhere the build fails and the engine keeps its
 * dense float32 weights (kernels/gguf_matmul.py).
 *
 * Layout (repacked at load, kernels/gguf_matmul.py): scale[N][KB], minv[N][KB] (Q4_1 only),
 * qs[N][KB][16] (Q4_1: byte j holds q[j] low, q[j + 16] high, as in GGUF) or
 * qs[N][KB][32] (Q8_0, int8), KB = K / 32.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "the GGUF matmul kernel needs AVX2 and FMA"
#endif

#define TILE_MAX 64

static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    __m128 s = _mm_add_ps(lo, hi);                       /* l0+l4 .. l3+l7 */
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));             /* (0+4)+(2+6), (1+5)+(3+7) */
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* the 32 weights of block b of a Q4_1 row, expanded into w[0..3] (8 lanes each) */
static inline void block_q4_1(const float *d, const float *m, const uint8_t *qs, int b,
                              __m256 w[4]) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m128i raw = _mm_loadu_si128((const __m128i *)(qs + 16 * b));
    __m128i lo = _mm_and_si128(raw, mask);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    __m256 vd = _mm256_set1_ps(d[b]), vm = _mm256_set1_ps(m[b]);
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), vd, vm);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), vd, vm);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), vd, vm);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), vd, vm);
}

static inline void block_q8_0(const float *d, const int8_t *qs, int b, __m256 w[4]) {
    __m256 vd = _mm256_set1_ps(d[b]);
    const int8_t *q = qs + 32 * b;
    for (int j = 0; j < 4; j++)
        w[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_loadl_epi64((const __m128i *)(q + 8 * j)))), vd);
}

/* a weight row's kb blocks expanded into w[0 .. 32 kb) */
template <int FMT>
static void dequant_row(const float *d, const float *m, const uint8_t *qs, int kb, float *w) {
    for (int b = 0; b < kb; b++) {
        __m256 v[4];
        if (FMT == 0) block_q4_1(d, m, qs, b, v);
        else block_q8_0(d, (const int8_t *)qs, b, v);
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(w + 32 * b + 8 * j, v[j]);
    }
}

/* y[i .. i + R, n0 + j .. n0 + j + C] from R rows of x and C expanded weight rows of w:
 * R * C accumulators, one per output element, k ascending in steps of 8, then hsum8 */
template <int R, int C>
static inline void micro(const float *x, int K, const float *w, float *y, int N) {
    __m256 acc[R][C];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    for (int k = 0; k < K; k += 8) {
        __m256 wv[C];
        for (int c = 0; c < C; c++) wv[c] = _mm256_loadu_ps(w + (size_t)c * K + k);
        for (int r = 0; r < R; r++) {
            __m256 xv = _mm256_loadu_ps(x + (size_t)r * K + k);
            for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) y[(size_t)r * N + c] = hsum8(acc[r][c]);
}

template <int R>
static inline void micro_row(const float *x, int K, const float *w, int nt, float *y, int N) {
    int j = 0;
    for (; j + 3 < nt; j += 4) micro<R, 4>(x, K, w + (size_t)j * K, y + j, N);
    for (; j < nt; j++) micro<R, 1>(x, K, w + (size_t)j * K, y + j, N);
}

/* y[i, n0 + j] for rows i of x and the nt expanded weight rows w[j], three rows of x by four
 * weight rows at a time (12 accumulators in registers) */
static void tile_dot(const float *x, int M, int K, const float *w, int nt, float *y, int N, int n0) {
    int i = 0;
    for (; i + 2 < M; i += 3) micro_row<3>(x + (size_t)i * K, K, w, nt, y + (size_t)i * N + n0, N);
    for (; i < M; i++) micro_row<1>(x + (size_t)i * K, K, w, nt, y + (size_t)i * N + n0, N);
}

#define FUSED_ROWS 8
#define PREFETCH_GROUPS 2 /* weight-row groups a thread asks for ahead of its product */

/* y[0 .. ROWS, n .. n + NB] for NB weight rows from n, ROWS <= FUSED_ROWS: each block is
 * expanded in registers and used by every row at once (no weight buffer); NB weight rows at a
 * time give the out-of-order core NB * ROWS independent accumulation chains. Per (i, n) the
 * accumulation is the same as tile_dot's: one 8-lane accumulator, k ascending in steps of 8,
 * then hsum8. */
template <int FMT, int ROWS, int NB>
static inline void fused_rows(const float *x, int K, const float *scale, const float *minv,
                              const uint8_t *qs, int n, float *y, int N) {
    const int kb = K / 32, qbytes = FMT == 0 ? 16 : 32;
    __m256 acc[ROWS][NB];
    for (int r = 0; r < ROWS; r++)
        for (int j = 0; j < NB; j++) acc[r][j] = _mm256_setzero_ps();
    for (int b = 0; b < kb; b++) {
        const float *xb = x + 32 * b;
        for (int j = 0; j < NB; j++) {
            const size_t row = (size_t)(n + j);
            __m256 w[4];
            if (FMT == 0)
                block_q4_1(scale + row * kb, minv + row * kb, qs + row * kb * qbytes, b, w);
            else
                block_q8_0(scale + row * kb, (const int8_t *)(qs + row * kb * qbytes), b, w);
            for (int r = 0; r < ROWS; r++) {
                const float *xr = xb + (size_t)r * K;
                acc[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xr), w[0], acc[r][j]);
                acc[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), w[1], acc[r][j]);
                acc[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), w[2], acc[r][j]);
                acc[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), w[3], acc[r][j]);
            }
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int j = 0; j < NB; j++) y[(size_t)r * N + n + j] = hsum8(acc[r][j]);
}

/* ask for weight row n's blocks (scales, mins, quants) ahead of their use: the rows come from
 * memory once per product, and the hardware prefetcher alone leaves the core waiting on them */
static inline void prefetch_row(int fmt, const float *scale, const float *minv,
                                const uint8_t *qs, int kb, size_t n) {
    const int qbytes = fmt == 0 ? 16 : 32;
    const char *q = (const char *)(qs + n * kb * qbytes);
    for (int at = 0; at < kb * qbytes; at += 64) _mm_prefetch(q + at, _MM_HINT_T0);
    const char *d = (const char *)(scale + n * kb);
    for (int at = 0; at < kb * 4; at += 64) _mm_prefetch(d + at, _MM_HINT_T0);
    if (fmt == 0) {
        const char *m = (const char *)(minv + n * kb);
        for (int at = 0; at < kb * 4; at += 64) _mm_prefetch(m + at, _MM_HINT_T0);
    }
}

/* rows i .. i + ROWS of y for every weight row, NB at a time, the last N % NB one by one */
template <int FMT, int ROWS>
static void fused_block(const float *x, int K, const float *scale, const float *minv,
                        const uint8_t *qs, int N, float *y, int num_threads) {
    constexpr int NB = ROWS == 1 ? 4 : (ROWS <= 4 ? 2 : 1);
    const int groups = N / NB;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int g = 0; g < groups; g++) {
        for (int j = 0; j < NB; j++)  /* the group PREFETCH_GROUPS ahead */
            if ((g + PREFETCH_GROUPS) * NB + j < N)
                prefetch_row(FMT, scale, minv, qs, K / 32, (size_t)((g + PREFETCH_GROUPS) * NB + j));
        fused_rows<FMT, ROWS, NB>(x, K, scale, minv, qs, g * NB, y, N);
    }
    for (int n = groups * NB; n < N; n++)
        fused_rows<FMT, ROWS, 1>(x, K, scale, minv, qs, n, y, N);
}

template <int FMT>
static void fused_matmul(const float *x, int M, int K, const float *scale, const float *minv,
                         const uint8_t *qs, int N, float *y, int num_threads) {
    for (int i = 0; i < M; i += FUSED_ROWS) {
        const float *xi = x + (size_t)i * K;
        float *yi = y + (size_t)i * N;
        switch (M - i < FUSED_ROWS ? M - i : FUSED_ROWS) {
            case 1: fused_block<FMT, 1>(xi, K, scale, minv, qs, N, yi, num_threads); break;
            case 2: fused_block<FMT, 2>(xi, K, scale, minv, qs, N, yi, num_threads); break;
            case 3: fused_block<FMT, 3>(xi, K, scale, minv, qs, N, yi, num_threads); break;
            case 4: fused_block<FMT, 4>(xi, K, scale, minv, qs, N, yi, num_threads); break;
            case 5: fused_block<FMT, 5>(xi, K, scale, minv, qs, N, yi, num_threads); break;
            case 6: fused_block<FMT, 6>(xi, K, scale, minv, qs, N, yi, num_threads); break;
            case 7: fused_block<FMT, 7>(xi, K, scale, minv, qs, N, yi, num_threads); break;
            default: fused_block<FMT, 8>(xi, K, scale, minv, qs, N, yi, num_threads); break;
        }
    }
}

/* fmt 0: Q4_1 (scale, minv, qs of 16 bytes per block); fmt 1: Q8_0 (scale, qs of 32).
 * Up to FUSED_ROWS rows expand each block in registers; more rows expand a tile of weight rows
 * once into a buffer and reuse it for every row (the same per-element accumulation). */
static int matmul(int fmt, const float *x, int M, int K, const float *scale, const float *minv,
                  const uint8_t *qs, int N, float *y, int num_threads) {
    if (K % 32 != 0 || M < 0 || N < 0) return -1;
    if (M <= FUSED_ROWS) {
        if (fmt == 0) fused_matmul<0>(x, M, K, scale, minv, qs, N, y, num_threads);
        else fused_matmul<1>(x, M, K, scale, minv, qs, N, y, num_threads);
        return 0;
    }
    const int kb = K / 32, qbytes = fmt == 0 ? 16 : 32;
    const int tile = TILE_MAX;
    const int ntiles = (N + tile - 1) / tile;
    int err = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *w = (float *)aligned_alloc(64, sizeof(float) * (size_t)tile * K);
        if (w == NULL) {
#pragma omp atomic write
            err = -2;
        } else {
#pragma omp for schedule(static)
            for (int t = 0; t < ntiles; t++) {
                int n0 = t * tile, nt = N - n0 < tile ? N - n0 : tile;
                for (int j = 0; j < nt; j++) {
                    size_t n = (size_t)(n0 + j);
                    if (fmt == 0)
                        dequant_row<0>(scale + n * kb, minv + n * kb, qs + n * kb * qbytes, kb,
                                       w + (size_t)j * K);
                    else
                        dequant_row<1>(scale + n * kb, NULL, qs + n * kb * qbytes, kb,
                                       w + (size_t)j * K);
                }
                tile_dot(x, M, K, w, nt, y, N, n0);
            }
            free(w);
        }
    }
    return err;
}

extern "C" {

int specmesh_q4_1_matmul(const float *x, int M, int K, const float *scale, const float *minv,
                         const uint8_t *qs, int N, float *y, int num_threads) {
    return matmul(0, x, M, K, scale, minv, qs, N, y, num_threads);
}

int specmesh_q8_0_matmul(const float *x, int M, int K, const float *scale, const int8_t *qs,
                         int N, float *y, int num_threads) {
    return matmul(1, x, M, K, scale, NULL, (const uint8_t *)qs, N, y, num_threads);
}

/* the dequantized weights W[N, K] (float32), for checks against a loaded model */
int specmesh_gguf_dequant(int fmt, const float *scale, const float *minv, const uint8_t *qs,
                          int N, int K, float *w) {
    if (K % 32 != 0) return -1;
    const int kb = K / 32, qbytes = fmt == 0 ? 16 : 32;
    for (size_t n = 0; n < (size_t)N; n++) {
        if (fmt == 0)
            dequant_row<0>(scale + n * kb, minv + n * kb, qs + n * kb * qbytes, kb, w + n * K);
        else
            dequant_row<1>(scale + n * kb, NULL, qs + n * kb * qbytes, kb, w + n * K);
    }
    return 0;
}

}  /* extern "C" */
