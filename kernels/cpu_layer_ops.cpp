// The small float32 ops of a decoder layer as compiled code: RMSNorm with the residual add
// before it, and rotary position embedding (RoPE) of q and k. Built and loaded by
// kernels/cpu_build.py (flags there: -O3 -march=native -ffp-contract=off -fopenmp).
//
// Why: in torch each of these is five to ten tiny ops (pow, mean, add, rsqrt, mul, cat, neg, ...),
// each a dispatch of a few microseconds; on a one-token SmolLM2 step together more than the
// attention itself (docs/benchmarks.md, 'Compiled kernels').
//
// Batch invariance (docs/architecture.md, 'Batch invariance'): every row is computed on its own in
// one fixed order,
// whatever the number of rows or threads, so a row's result does not depend on its batch.
//  - RMSNorm: h = x (+ residual, one IEEE add per element, as torch's add); the sum of squares
//    runs in 8 float lanes over k ascending (lane l takes k = l mod 8), then a fixed lane tree
//    (0+4, 1+5, 2+6, 3+7; then 0+2, 1+3; then 0+1), then the tail k >= 8 * floor(H / 8)
//    ascending; inv = 1 / sqrt(sum / H + eps); y = w * (h * inv). It differs from torch's
//    mean (another summation order) only in rounding.
//  - SiLU-and-multiply: g / (1 + exp(-g)) * u, exp from one fixed range reduction and
//    polynomial (below) in every lane; within 2 ulp of torch's SiLU, not its bits.
//  - RoPE (transformers' rotate_half form): for j < D/2, out[j] = x[j]*cos[j] - x[j+D/2]*sin[j]
//    and out[j+D/2] = x[j+D/2]*cos[j+D/2] + x[j]*sin[j+D/2], each product rounded before the
//    add (no FMA contraction), which is what torch computes: the same bits.
//  - float -> bfloat16 / float16 (a 16-bit KV cache, --kv-cache-dtype): IEEE round to nearest,
//    ties to even, float16 with its subnormals and overflow to infinity, as torch's
//    ``Tensor.to`` rounds: the same bits for every non-NaN value (a NaN stays a NaN).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif


namespace {

// exp(x) in float: x = n ln2 + r (n = nearest integer of x log2 e, |r| <= ln2 / 2, ln2 in two
// parts), then a degree-7 Taylor polynomial of r in Horner form, times 2^n built from bits;
// inputs are clamped to [-87, 88] (exp(-87) is above the smallest normal float, exp(88) below
// the largest). Written as plain float operations, so GCC vectorises the loops that use it and
// every lane computes the same bits as a scalar call.
inline float exp_fixed(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = std::fmaf(n, -0.693145751953125f, x);
  r = std::fmaf(n, -1.428606765330187e-06f, r);
  float p = 1.0f / 5040.0f;
  p = std::fmaf(p, r, 1.0f / 720.0f);
  p = std::fmaf(p, r, 1.0f / 120.0f);
  p = std::fmaf(p, r, 1.0f / 24.0f);
  p = std::fmaf(p, r, 1.0f / 6.0f);
  p = std::fmaf(p, r, 0.5f);
  p = std::fmaf(p, r, 1.0f);
  p = std::fmaf(p, r, 1.0f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
// exp_fixed in 8 lanes: the same operations (the clamp as max / min, nearbyint as a
// round-to-nearest, fmaf as a vector fma), so the same bits
inline __m256 exp_fixed8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693145751953125f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

void silu_mul_row(const float* g, const float* u, float* y, int64_t n) {
  int64_t k = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 one = _mm256_set1_ps(1.0f);
  for (; k + 8 <= n; k += 8) {
    const __m256 gv = _mm256_loadu_ps(g + k);
    const __m256 e = exp_fixed8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
    _mm256_storeu_ps(y + k, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)),
                                          _mm256_loadu_ps(u + k)));
  }
#endif
  for (; k < n; ++k) y[k] = g[k] / (1.0f + exp_fixed(-g[k])) * u[k];
}

void rms_row(const float* hi, const float* w, float* yi, int64_t H, float eps) {
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

// one token's heads of RoPE: x [heads, D] -> out [heads, D]
void rope_token(const float* x, const float* c, const float* s, float* out, int64_t heads,
                int64_t D) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const float* xi = x + h * D;
    float* oi = out + h * D;
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

// float -> bfloat16 bits: the 16 dropped bits rounded to nearest, ties to even
inline uint16_t float_to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// float -> IEEE binary16 bits, rounded to nearest, ties to even
inline uint16_t float_to_half(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;  // NaN: a quiet NaN
  if (a >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 (65504 + half an ulp): infinity
  if (a >= 0x38800000u)                          // a normal half (>= 2^-14): drop 13 bits,
    return sign | static_cast<uint16_t>(         // rebias the exponent from 127 to 15
                      (a - 0x38000000u + 0xfffu + ((a >> 13) & 1u)) >> 13);
  if (a <= 0x33000000u) return sign;  // <= 2^-25 (half the smallest subnormal): zero
  // a subnormal half: round(|x| * 2^24), i.e. the 24-bit mantissa shifted right by 126 - e
  const int shift = 126 - static_cast<int>(a >> 23);  // 14 .. 24
  const uint32_t m = (a & 0x7fffffu) | 0x800000u;
  uint32_t n = m >> shift;
  const uint32_t rest = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
  if (rest > half || (rest == half && (n & 1u))) ++n;  // n = 1024 is the smallest normal
  return sign | static_cast<uint16_t>(n);
}

// KV storage kinds of the 16-bit caches: 1 bfloat16, 2 float16 (0, float32, is stored as is)
inline void store_kv16(int kind, void* base, int64_t at, const float* x, int64_t n) {
  uint16_t* out = static_cast<uint16_t*>(base) + at;
  if (kind == 1)
    for (int64_t i = 0; i < n; ++i) out[i] = float_to_bf16(x[i]);
  else
    for (int64_t i = 0; i < n; ++i) out[i] = float_to_half(x[i]);
}

}  // namespace

extern "C" {

// x [n] float -> out [n] in KV storage kind 1 (bfloat16) or 2 (float16); 1 for another kind
int specmesh_f32_to_kv16(const float* x, void* out, int64_t n, int kind) {
    if (n < 0 || (kind != 1 && kind != 2)) return 1;
    store_kv16(kind, out, 0, x, n);
    return 0;
}

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
        rms_row(hi, w, yi, H, eps);
    }
    return 0;
}

// x [T, heads, D] read with row stride x_stride (floats between tokens; heads contiguous),
// cos / sin [T, D] contiguous; out [T, heads, D] contiguous.
int specmesh_rope_f32(const float* x, int64_t x_stride, const float* cos, const float* sin,
                      float* out, int64_t T, int64_t heads, int64_t D, int num_threads) {
    if (T < 0 || heads <= 0 || D <= 0 || D % 2 != 0) return 1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T >= 64)
    for (int64_t t = 0; t < T; ++t) {
        rope_token(x + t * x_stride, cos + t * D, sin + t * D, out + t * heads * D, heads, D);
    }
    return 0;
}

// gu [M, 2 * I] (row stride gu_stride: gate in columns [0, I), up in [I, 2 I)) -> y [M, I]
int specmesh_silu_mul_f32(const float* gu, int64_t gu_stride, float* y, int64_t M, int64_t I,
                          int num_threads) {
    if (M < 0 || I <= 0) return 1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M >= 16)
    for (int64_t i = 0; i < M; ++i) silu_mul_row(gu + i * gu_stride, gu + i * gu_stride + I, y + i * I, I);
    return 0;
}

// ---- the decoder stack as one call ---------------------------------------------------------
// Every layer of a float32 Llama whose linear layers are GGUF blocks (kernels/gguf_matmul.cpp)
// over a paged KV cache (kernels/cpu_attention.cpp), for a decode / verify / chunked-prefill
// batch: the same kernels, in the same order, with the same arguments as the engine's layer
// by layer path (engine/model.py), so the same bits, without a Python call per op. The
// products and the attention are called through pointers to the other kernels' entry points (each
// is its own library).
struct SmProduct {  // one GGUF product: fmt 0 = Q4_1, 1 = Q8_0; n output features
  int64_t fmt;
  const float* scale;
  const float* minv;
  const uint8_t* qs;
  int64_t n;
};

struct SmLayer {
  const float* ln1;  // input_layernorm weight [H]
  const float* ln2;  // post_attention_layernorm weight [H]
  SmProduct qkv, o, gate_up, down;
  void* k_cache;  // this layer's keys [num_slots, Hkv, D] (float, or 16-bit: kv_kind)
  void* v_cache;  // and values
};

struct SmPlan {  // kernels/paged_attention_plan.py, as kernels/cpu_attention.py passes it
  const int64_t* block_tables;
  int64_t table_width;
  const int64_t* token_batch;
  const int32_t* token_visible;
  const int32_t* token_path;
  int64_t path_width;
  const int32_t* token_chunk_start;
  int64_t block_size;
};

typedef int (*SmQ41)(const float*, int, int, const float*, const float*, const uint8_t*, int,
                     float*, int);
typedef int (*SmQ80)(const float*, int, int, const float*, const uint8_t*, int, float*, int);
typedef void (*SmAttention)(const void*, const void*, const void*, void*, const int64_t*, int64_t,
                            const int64_t*, const int32_t*, const int32_t*, int64_t,
                            const int32_t*, int64_t, int64_t, int64_t, int64_t, int64_t, double,
                            int);

// h [T, H]: the embeddings in, the last layer's output out. cos / sin [T, D]; slots [T] (cache
// slot of each token's K/V); capture [L] null or [T, H] buffers for layer outputs; kv_kind the
// cache's storage (0 float, 1 bfloat16, 2 float16: K/V rounded as torch's Tensor.to, and
// ``attention`` the entry for that cache). Returns 0, or the failing product's code.
int specmesh_decoder_layers_f32(float* h, int64_t T, int64_t H, const SmLayer* layers,
                                int64_t L, float** capture, const float* cos, const float* sin,
                                const int64_t* slots, int64_t num_heads, int64_t num_kv_heads,
                                int64_t D, int64_t inter, float eps, double scale,
                                const SmPlan* plan, void* q4_1, void* q8_0, void* attention,
                                int kv_kind, int num_threads) {
    if (T <= 0 || H <= 0 || L < 0 || D % 2 != 0 || kv_kind < 0 || kv_kind > 2) return 1;
    const int64_t nq = num_heads * D, nk = num_kv_heads * D, nqkv = nq + 2 * nk;
    std::vector<float> x(T * H), qkv(T * nqkv), q(T * nq), att(T * nq), o(T * H),
        gu(T * 2 * inter), act(T * inter), k16(kv_kind != 0 ? nk : 0);
    const SmQ41 q41 = reinterpret_cast<SmQ41>(q4_1);
    const SmQ80 q80 = reinterpret_cast<SmQ80>(q8_0);
    auto product = [&](const SmProduct& p, const float* in, int64_t k, float* out) {
        const int m = static_cast<int>(T), kk = static_cast<int>(k), n = static_cast<int>(p.n);
        return p.fmt == 0 ? q41(in, m, kk, p.scale, p.minv, p.qs, n, out, num_threads)
                          : q80(in, m, kk, p.scale, p.qs, n, out, num_threads);
    };
    int rc = 0;
    for (int64_t l = 0; l < L; ++l) {
        const SmLayer& ly = layers[l];
        for (int64_t t = 0; t < T; ++t) rms_row(h + t * H, ly.ln1, x.data() + t * H, H, eps);
        if ((rc = product(ly.qkv, x.data(), H, qkv.data())) != 0) return rc;
        for (int64_t t = 0; t < T; ++t) {
            const float* row = qkv.data() + t * nqkv;
            rope_token(row, cos + t * D, sin + t * D, q.data() + t * nq, num_heads, D);
            if (kv_kind == 0) {
                rope_token(row + nq, cos + t * D, sin + t * D,
                           static_cast<float*>(ly.k_cache) + slots[t] * nk, num_kv_heads, D);
                std::memcpy(static_cast<float*>(ly.v_cache) + slots[t] * nk, row + nq + nk,
                            nk * sizeof(float));
            } else {  // the model's K/V rounded into the 16-bit cache
                rope_token(row + nq, cos + t * D, sin + t * D, k16.data(), num_kv_heads, D);
                store_kv16(kv_kind, ly.k_cache, slots[t] * nk, k16.data(), nk);
                store_kv16(kv_kind, ly.v_cache, slots[t] * nk, row + nq + nk, nk);
            }
        }
        reinterpret_cast<SmAttention>(attention)(
            q.data(), ly.k_cache, ly.v_cache, att.data(), plan->block_tables, plan->table_width,
            plan->token_batch, plan->token_visible, plan->token_path, plan->path_width,
            plan->token_chunk_start, T, num_heads, num_kv_heads, D, plan->block_size, scale,
            num_threads);
        if ((rc = product(ly.o, att.data(), nq, o.data())) != 0) return rc;
        for (int64_t t = 0; t < T; ++t) {
            float* hi = h + t * H;
            const float* oi = o.data() + t * H;
            for (int64_t k = 0; k < H; ++k) hi[k] = oi[k] + hi[k];
            rms_row(hi, ly.ln2, x.data() + t * H, H, eps);
        }
        if ((rc = product(ly.gate_up, x.data(), H, gu.data())) != 0) return rc;
        for (int64_t t = 0; t < T; ++t)
            silu_mul_row(gu.data() + t * 2 * inter, gu.data() + t * 2 * inter + inter,
                         act.data() + t * inter, inter);
        if ((rc = product(ly.down, act.data(), inter, o.data())) != 0) return rc;
        for (int64_t i = 0; i < T * H; ++i) h[i] = o[i] + h[i];
        if (capture != nullptr && capture[l] != nullptr)
            std::memcpy(capture[l], h, T * H * sizeof(float));
    }
    return 0;
}

}  // extern "C"
