// Paged attention for the CPU (kernels/cpu_attention.py builds and loads this file).
//
// One work item is one query row and one KV head: it reads the row's visible positions of that
// head from the paged cache through the block table (no gather, no copy, no conversion pass
// over the cache) and computes the attention of the head's G query heads over them, in float
// (double for double inputs). The arithmetic of an item depends only on its row, on how many
// positions it sees and on their K/V: every reduction runs in a fixed order written out here
// (16 explicit lanes, then a fixed tree), products use explicit fma, and exp is a polynomial
// evaluated the same way in every lane. So a row's result does not depend on the batch, on the
// other rows of its request, on padding or on the thread that ran it (batch invariance,
// kernels/paged_attention.py), and a verify row equals the one-token decode step at its
// position bit for bit. Build flags keep it so: -ffp-contract=off, no -ffast-math.
//
// KV storage: the cache's dtype, which is the model's or, for a float32 model, bfloat16 or
// float16 (``--kv-cache-dtype``): 16-bit K/V are converted to float exactly as they are read
// (bfloat16: a shift; float16: F16C / AVX-512 vcvtph2ps where the target has it, else the
// scalar conversion, the same values) and every product and sum stays in float.
//
// Shapes (row-major, contiguous): q, out [T, H, D]; k_cache, v_cache [num_blocks, block_size,
// Hkv, D]; block_tables int64 [B, table_width]; token_batch int64 [T] (the request of a row);
// token_visible int32 [T] (positions the row sees); token_path int32 [T, path_width] and
// token_chunk_start int32 [T] or null (token trees: visible position p >= chunk_start reads
// chunk row token_path[t, p - chunk_start], i.e. position chunk_start + that row).
#include <cmath>
#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int kLanes = 16;

inline float load(const float* p, int64_t i) { return p[i]; }
inline double load(const double* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) {  // bfloat16 -> float, exact
  uint32_t u = static_cast<uint32_t>(p[i]) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// IEEE binary16 storage (a float16 KV cache); uint16_t above is bfloat16
struct Half {
  uint16_t bits;
};

// float16 -> float, exact (every binary16 value is a float): normals and infinities / NaNs by
// moving the fields, subnormals as mantissa * 2^-24 (an exact product)
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0x1fu) {
    u = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112u) << 23) | (man << 13);
  } else {
    float f = static_cast<float>(man) * 5.9604644775390625e-08f;  // 2^-24
    std::memcpy(&u, &f, sizeof u);
    u |= sign;
  }
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline float load(const Half* p, int64_t i) { return half_to_float(p[i].bits); }

inline void store(float* p, int64_t i, float x) { p[i] = x; }
inline void store(double* p, int64_t i, double x) { p[i] = x; }
inline void store(uint16_t* p, int64_t i, float x) {  // float -> bfloat16, round to nearest even
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN stays NaN
    p[i] = static_cast<uint16_t>((u >> 16) | 0x40u);
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  p[i] = static_cast<uint16_t>(u >> 16);
}

inline float fmaa(float a, float b, float c) { return std::fmaf(a, b, c); }
inline double fmaa(double a, double b, double c) { return std::fma(a, b, c); }

// exp(x) for x <= 0 (scores minus their max); 0 below the smallest normal result. Range
// reduction x = n ln2 + r, |r| <= ln2 / 2, then a degree-6 (float) or degree-11 (double)
// Taylor polynomial in Horner form: relative error ~1e-7 (float), ~1e-15 (double).
inline float exp_neg(float x) {
  if (!(x > -87.0f)) return 0.0f;
  float n = std::nearbyint(x * 1.44269504088896341f);
  float r = fmaa(n, -0.693145751953125f, x);
  r = fmaa(n, -1.428606765330187e-06f, r);
  float p = 1.0f / 720.0f;
  p = fmaa(p, r, 1.0f / 120.0f);
  p = fmaa(p, r, 1.0f / 24.0f);
  p = fmaa(p, r, 1.0f / 6.0f);
  p = fmaa(p, r, 0.5f);
  p = fmaa(p, r, 1.0f);
  p = fmaa(p, r, 1.0f);
  uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

inline double exp_neg(double x) {
  if (!(x > -708.0)) return 0.0;
  double n = std::nearbyint(x * 1.4426950408889634);
  double r = fmaa(n, -6.93147180369123816490e-01, x);
  r = fmaa(n, -1.90821492927058770002e-10, r);
  double p = 1.0 / 39916800.0;
  const double c[] = {1.0 / 3628800.0, 1.0 / 362880.0, 1.0 / 40320.0, 1.0 / 5040.0,
                      1.0 / 720.0,     1.0 / 120.0,    1.0 / 24.0,    1.0 / 6.0,
                      0.5,             1.0,            1.0};
  for (double ci : c) p = fmaa(p, r, ci);
  uint64_t bits = static_cast<uint64_t>(static_cast<int64_t>(n) + 1023) << 52;
  double scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// sum of 16 lanes in a fixed tree
template <typename A>
inline A lane_sum(const A* s) {
  A a[8];
  for (int i = 0; i < 8; ++i) a[i] = s[i] + s[i + 8];
  for (int i = 0; i < 4; ++i) a[i] = a[i] + a[i + 4];
  return (a[0] + a[2]) + (a[1] + a[3]);
}

// dot product of q (accumulation type) and k[0:D] in 16 lanes, then the lane tree
template <typename A, typename S>
inline A dot(const A* q, const S* k, int64_t d) {
  A part[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes)
    for (int l = 0; l < kLanes; ++l) part[l] = fmaa(q[i + l], static_cast<A>(load(k, i + l)), part[l]);
  for (int l = 0; i + l < d; ++l) part[l] = fmaa(q[i + l], static_cast<A>(load(k, i + l)), part[l]);
  return lane_sum(part);
}

// the largest of s[0 .. n), n >= 1: 16 running maxima, then the lanes in order (a maximum is
// one of the values whatever the order, so this is the value a serial scan finds; it only
// runs without a chain of dependent compares)
template <typename A>
inline A max_of(const A* s, int64_t n) {
  A m = s[0];
  int64_t i = 1;
  if (n > kLanes) {
    A lane[kLanes];
    for (int l = 0; l < kLanes; ++l) lane[l] = s[1 + l];
    for (i = 1 + kLanes; i + kLanes <= n; i += kLanes)
      for (int l = 0; l < kLanes; ++l) lane[l] = s[i + l] > lane[l] ? s[i + l] : lane[l];
    for (int l = 0; l < kLanes; ++l) m = lane[l] > m ? lane[l] : m;
  }
  for (; i < n; ++i) m = s[i] > m ? s[i] : m;
  return m;
}

// sum of n softmax weights: 16 lanes by position, then the lane tree
template <typename A>
inline A weight_sum(const A* s, int64_t n) {
  A part[kLanes] = {};
  int64_t p = 0;
  for (; p + kLanes <= n; p += kLanes)
    for (int l = 0; l < kLanes; ++l) part[l] += s[p + l];
  for (int l = 0; p + l < n; ++l) part[l] += s[p + l];
  return lane_sum(part);
}

// 16 floats; GCC splits it into what the target has (one AVX-512 register, two AVX2 ones)
typedef float f32x16 __attribute__((vector_size(64)));

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline f32x16 load16(const uint16_t* p) {  // 16 bfloat16 -> float, exact (bits << 16)
#if defined(__AVX512F__)  // one widening load and a shift (GCC's generic form takes ~3x that)
  const __m512i u =
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return reinterpret_cast<f32x16>(_mm512_slli_epi32(u, 16));
#elif defined(__AVX2__)
  const __m256i lo = _mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
  const __m256i hi = _mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8))), 16);
  f32x16 r;
  std::memcpy(&r, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&r) + 32, &hi, 32);
  return r;
#else
  typedef uint32_t u32x16 __attribute__((vector_size(64)));
  typedef uint16_t u16x16 __attribute__((vector_size(32)));
  u16x16 h;
  std::memcpy(&h, p, sizeof h);
  u32x16 u = __builtin_convertvector(h, u32x16) << 16;
  f32x16 v;
  std::memcpy(&v, &u, sizeof v);
  return v;
#endif
}

inline f32x16 load16(const Half* p) {  // 16 float16 -> float, exact
#if defined(__AVX512F__)
  const __m512 r = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return reinterpret_cast<f32x16>(r);
#elif defined(__F16C__)
  const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  f32x16 r;
  std::memcpy(&r, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&r) + 32, &hi, 32);
  return r;
#else
  f32x16 r;
  for (int l = 0; l < kLanes; ++l) r[l] = half_to_float(p[l].bits);
  return r;
#endif
}

inline float hsum(f32x16 v) {  // the lane tree of lane_sum
  float s[kLanes];
  std::memcpy(s, &v, sizeof s);
  return lane_sum(s);
}

// a * b + c rounded once per lane, as std::fmaf: the vector instruction where the target has
// one (GCC leaves the lane loop as 16 scalar calls), the loop elsewhere; the same bits.
inline f32x16 fma16(f32x16 a, f32x16 b, f32x16 c) {
#if defined(__AVX512F__)
  __m512 r = _mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b),
                             reinterpret_cast<__m512>(c));
  return reinterpret_cast<f32x16>(r);
#elif defined(__AVX2__) && defined(__FMA__)
  typedef float f32x8 __attribute__((vector_size(32)));
  f32x8 al, ah, bl, bh, cl, ch;
  std::memcpy(&al, &a, 32); std::memcpy(&ah, reinterpret_cast<char*>(&a) + 32, 32);
  std::memcpy(&bl, &b, 32); std::memcpy(&bh, reinterpret_cast<char*>(&b) + 32, 32);
  std::memcpy(&cl, &c, 32); std::memcpy(&ch, reinterpret_cast<char*>(&c) + 32, 32);
  __m256 lo = _mm256_fmadd_ps(reinterpret_cast<__m256>(al), reinterpret_cast<__m256>(bl),
                              reinterpret_cast<__m256>(cl));
  __m256 hi = _mm256_fmadd_ps(reinterpret_cast<__m256>(ah), reinterpret_cast<__m256>(bh),
                              reinterpret_cast<__m256>(ch));
  f32x16 r;
  std::memcpy(&r, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&r) + 32, &hi, 32);
  return r;
#else
  f32x16 r;
  for (int l = 0; l < kLanes; ++l) r[l] = std::fmaf(a[l], b[l], c[l]);
  return r;
#endif
}

typedef int32_t i32x16 __attribute__((vector_size(64)));

// x in all 16 lanes, as a broadcast instruction (GCC builds `f32x16{} + x` lane by lane through
// general registers on AVX2, which made the value product five times slower than the scores)
inline f32x16 splat16(float x) {
#if defined(__AVX512F__)
  return reinterpret_cast<f32x16>(_mm512_set1_ps(x));
#elif defined(__AVX2__)
  const __m256 h = _mm256_set1_ps(x);
  f32x16 r;
  std::memcpy(&r, &h, 32);
  std::memcpy(reinterpret_cast<char*>(&r) + 32, &h, 32);
  return r;
#else
  f32x16 r;
  for (int l = 0; l < kLanes; ++l) r[l] = x;
  return r;
#endif
}

// Rows are read through the block table, so the hardware sees short strided runs: fetch the
// row kAhead positions ahead (each row is 16 * nc elements) into L2 (prefetcht1): into L1
// (prefetcht0) the requests in flight are capped by L1's few miss buffers, which left a long
// context's attention waiting on memory at a third of the bandwidth the products get
// (docs/benchmarks.md, 'Attention').
constexpr int64_t kAhead = 64;
template <typename S>
inline void prefetch_row(const S* row, int nc) {
  const char* b = reinterpret_cast<const char*>(row);
  for (size_t at = 0; at < 16 * nc * sizeof(S); at += 64) __builtin_prefetch(b + at, 0, 2);
}

// Lane trees of 16 vectors at once: r[j] = hsum(v[j]) for j < 16, with the same additions as
// lane_sum (so a position's score does not depend on whether it was reduced in a block of 16
// or alone).
// the first level of hsum16's tree for v[2j] = a, v[2j + 1] = b: lanes 0-7 the a[i] = s[i] +
// s[i + 8] of a, lanes 8-15 those of b
inline f32x16 hsum_pair(f32x16 a, f32x16 b) {
  return __builtin_shuffle(a, b,
                           i32x16{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}) +
         __builtin_shuffle(a, b,
                           i32x16{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
}
inline f32x16 hsum16_rest(const f32x16* x);

inline f32x16 hsum16(const f32x16* v) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  // the same tree in 8-lane registers (GCC splits the 16-lane shuffles below lane by lane):
  // x = lo + hi (a[i] = s[i] + s[i + 8]); y: a[i] + a[i + 4] of two vectors per register;
  // z: (a0 + a2, a1 + a3) of four; then their sum, lanes put back in order
  __m256 y[8], z[4];
  for (int j = 0; j < 8; ++j) {
    __m256 x0 = _mm256_add_ps(_mm256_loadu_ps(reinterpret_cast<const float*>(&v[2 * j])),
                              _mm256_loadu_ps(reinterpret_cast<const float*>(&v[2 * j]) + 8));
    __m256 x1 = _mm256_add_ps(_mm256_loadu_ps(reinterpret_cast<const float*>(&v[2 * j + 1])),
                              _mm256_loadu_ps(reinterpret_cast<const float*>(&v[2 * j + 1]) + 8));
    y[j] = _mm256_add_ps(_mm256_permute2f128_ps(x0, x1, 0x20), _mm256_permute2f128_ps(x0, x1, 0x31));
  }
  for (int j = 0; j < 4; ++j)  // lanes: b0, b1 of v[4j], v[4j+2] | of v[4j+1], v[4j+3]
    z[j] = _mm256_add_ps(_mm256_shuffle_ps(y[2 * j], y[2 * j + 1], 0x44),
                         _mm256_shuffle_ps(y[2 * j], y[2 * j + 1], 0xEE));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  f32x16 r;
  for (int j = 0; j < 2; ++j) {  // r of v[8j], v[8j+2], v[8j+4], v[8j+6] | v[8j+1], ...
    __m256 t = _mm256_add_ps(_mm256_shuffle_ps(z[2 * j], z[2 * j + 1], 0x88),
                             _mm256_shuffle_ps(z[2 * j], z[2 * j + 1], 0xDD));
    t = _mm256_permutevar8x32_ps(t, order);
    std::memcpy(reinterpret_cast<char*>(&r) + 32 * j, &t, 32);
  }
  return r;
#else
  f32x16 x[8];
  for (int j = 0; j < 8; ++j) x[j] = hsum_pair(v[2 * j], v[2 * j + 1]);
  return hsum16_rest(x);
#endif
}

// hsum16's tree from its first level x[j] = hsum_pair(v[2j], v[2j + 1]) (16-lane form)
inline f32x16 hsum16_rest(const f32x16* x) {
  f32x16 y[4], z[2];
  for (int j = 0; j < 4; ++j)  // four lanes b0..b3 per vector of v[4j..4j+3]
    y[j] = __builtin_shuffle(x[2 * j], x[2 * j + 1],
                             i32x16{0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27}) +
           __builtin_shuffle(x[2 * j], x[2 * j + 1],
                             i32x16{4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31});
  for (int j = 0; j < 2; ++j)  // (b0 + b2, b1 + b3) per vector of v[8j..8j+7]
    z[j] = __builtin_shuffle(y[2 * j], y[2 * j + 1],
                             i32x16{0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29}) +
           __builtin_shuffle(y[2 * j], y[2 * j + 1],
                             i32x16{2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31});
  return __builtin_shuffle(z[0], z[1],
                           i32x16{0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}) +
         __builtin_shuffle(z[0], z[1],
                           i32x16{1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31});
}

// Scores of GB query heads of one row (of one KV head) at positions [a, b) of a split, a a
// multiple of 16, b <= n (the positions the row sees in the split): a 16-lane product over the
// head dimension, chunk by chunk, then the lane tree, 16 positions at a time (hsum16) and the
// rest one by one (hsum, the same additions). ``vfetch`` (or null): the value rows to prefetch
// alongside, so the value phase finds them in cache.
template <typename S, int NC, int GB>
void scores16(const float* qf, const S* const* krow, const S* const* vfetch, int64_t a,
              int64_t b, int64_t n, float* w, int64_t w_stride) {
  f32x16 qv[GB][NC];
  for (int h = 0; h < GB; ++h)
    for (int c = 0; c < NC; ++c) qv[h][c] = load16(qf + (h * NC + c) * 16);
  auto product = [&](int64_t p, f32x16* part, int64_t part_stride) {
    if (p + kAhead < n) {
      prefetch_row(krow[p + kAhead], NC);
      if (vfetch != nullptr) prefetch_row(vfetch[p + kAhead], NC);
    }
    f32x16 k[NC];
    for (int c = 0; c < NC; ++c) k[c] = load16(krow[p] + 16 * c);
    for (int h = 0; h < GB; ++h) {
      f32x16 acc = {};
      for (int c = 0; c < NC; ++c) acc = fma16(qv[h][c], k[c], acc);
      part[h * part_stride] = acc;
    }
  };
  int64_t p = a;
  for (; p + kLanes <= b; p += kLanes) {
#if defined(__AVX2__) && !defined(__AVX512F__)
    f32x16 part[GB][kLanes];
    for (int j = 0; j < kLanes; ++j) product(p + j, &part[0][j], kLanes);
    for (int h = 0; h < GB; ++h) {
      f32x16 r = hsum16(part[h]);
      std::memcpy(w + h * w_stride + p, &r, sizeof r);
    }
#else  // hsum16's first level as each pair of positions is done: half the vectors to keep
    f32x16 x[GB][kLanes / 2];
    for (int j = 0; j < kLanes / 2; ++j) {
      f32x16 even[GB], odd[GB];
      product(p + 2 * j, even, 1);
      product(p + 2 * j + 1, odd, 1);
      for (int h = 0; h < GB; ++h) x[h][j] = hsum_pair(even[h], odd[h]);
    }
    for (int h = 0; h < GB; ++h) {
      f32x16 r = hsum16_rest(x[h]);
      std::memcpy(w + h * w_stride + p, &r, sizeof r);
    }
#endif
  }
  for (; p < b; ++p) {
    f32x16 part[GB];
    product(p, part, 1);
    for (int h = 0; h < GB; ++h) w[h * w_stride + p] = hsum(part[h]);
  }
}

// Value product of GB heads of one row over positions [a, b), position by position in order,
// continuing the running sums in acc (GB x head_dim floats).
template <typename S, int NC, int GB>
void values16(const float* w, int64_t w_stride, const S* const* vrow, int64_t a, int64_t b,
              int64_t n, float* acc_mem) {
  f32x16 acc[GB][NC];
  std::memcpy(acc, acc_mem, sizeof acc);
  for (int64_t p = a; p < b; ++p) {
    if (p + kAhead < n) prefetch_row(vrow[p + kAhead], NC);
    f32x16 v[NC];
    for (int c = 0; c < NC; ++c) v[c] = load16(vrow[p] + 16 * c);
    for (int h = 0; h < GB; ++h) {
      const f32x16 wp = splat16(w[h * w_stride + p]);
      for (int c = 0; c < NC; ++c) acc[h][c] = fma16(wp, v[c], acc[h][c]);
    }
  }
  std::memcpy(acc_mem, acc, sizeof acc);
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define SPECMESH_AVX2_ROWS 1
// 8 K/V values as floats, exact: float as is, bfloat16 shifted, float16 by F16C
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
#if defined(__F16C__)
inline __m256 load8(const Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif
// K/V storage the 8-lane path takes (float16 only with F16C)
template <typename S>
constexpr bool kAvx2Rows = std::is_same<S, float>::value || std::is_same<S, uint16_t>::value
#if defined(__F16C__)
                           || std::is_same<S, Half>::value
#endif
    ;

// K/V on AVX2 (16 ymm registers): one head at a time in 8-lane registers, so a head's query
// (scores) or running sums (values) stay in registers; the K/V rows of a tile come again from
// L1 for the next head. Lane l < 8 of a 16-lane vector is lane l of the low register, lane
// 8 + l that of the high one: each lane sees the same fma sequence as in scores16 / values16
// (16-bit K/V widened exactly as load16 widens them), so the results are the same bits.
template <typename S, int NC>
void scores_avx2(const float* q, const S* const* krow, const S* const* vfetch, int64_t a,
                 int64_t b, int64_t n, float* w, bool fetch) {
  __m256 qv[2 * NC];
  for (int j = 0; j < 2 * NC; ++j) qv[j] = _mm256_loadu_ps(q + 8 * j);
  auto product = [&](int64_t p, f32x16* part) {
    if (fetch && p + kAhead < n) {
      prefetch_row(krow[p + kAhead], NC);
      if (vfetch != nullptr) prefetch_row(vfetch[p + kAhead], NC);
    }
    const S* k = krow[p];
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (int c = 0; c < NC; ++c) {
      lo = _mm256_fmadd_ps(qv[2 * c], load8(k + 16 * c), lo);
      hi = _mm256_fmadd_ps(qv[2 * c + 1], load8(k + 16 * c + 8), hi);
    }
    std::memcpy(part, &lo, 32);
    std::memcpy(reinterpret_cast<char*>(part) + 32, &hi, 32);
  };
  int64_t p = a;
  for (; p + kLanes <= b; p += kLanes) {
    f32x16 part[kLanes];
    for (int j = 0; j < kLanes; ++j) product(p + j, &part[j]);
    const f32x16 r = hsum16(part);
    std::memcpy(w + p, &r, sizeof r);
  }
  for (; p < b; ++p) {
    f32x16 part;
    product(p, &part);
    w[p] = hsum(part);
  }
}

template <typename S, int NC>
void values_avx2(const float* w, const S* const* vrow, int64_t a, int64_t b, int64_t n,
                 float* acc_mem, bool fetch) {
  __m256 acc[2 * NC];
  for (int j = 0; j < 2 * NC; ++j) acc[j] = _mm256_loadu_ps(acc_mem + 8 * j);
  for (int64_t p = a; p < b; ++p) {
    if (fetch && p + kAhead < n) prefetch_row(vrow[p + kAhead], NC);
    const S* v = vrow[p];
    const __m256 wp = _mm256_set1_ps(w[p]);
    for (int j = 0; j < 2 * NC; ++j) acc[j] = _mm256_fmadd_ps(wp, load8(v + 8 * j), acc[j]);
  }
  for (int j = 0; j < 2 * NC; ++j) _mm256_storeu_ps(acc_mem + 8 * j, acc[j]);
}
#endif

// Both phases over a row's G heads in groups of at most 4 (what fits in registers).
template <typename S, int NC>
void scores_row16(const float* qf, int64_t g, const S* const* krow, const S* const* vfetch,
                  int64_t a, int64_t b, int64_t n, float* w, int64_t w_stride) {
#ifdef SPECMESH_AVX2_ROWS
  if constexpr (kAvx2Rows<S>) {
    for (int64_t h = 0; h < g; ++h)
      scores_avx2<S, NC>(qf + h * 16 * NC, krow, vfetch, a, b, n, w + h * w_stride, h == 0);
    return;
  }
#endif
  for (int64_t h = 0; h < g; h += 4) {
    const float* q = qf + h * 16 * NC;
    float* wh = w + h * w_stride;
    const S* const* vf = h == 0 ? vfetch : nullptr;  // once per row
    switch (g - h < 4 ? g - h : 4) {
      case 1: scores16<S, NC, 1>(q, krow, vf, a, b, n, wh, w_stride); break;
      case 2: scores16<S, NC, 2>(q, krow, vf, a, b, n, wh, w_stride); break;
      case 3: scores16<S, NC, 3>(q, krow, vf, a, b, n, wh, w_stride); break;
      default: scores16<S, NC, 4>(q, krow, vf, a, b, n, wh, w_stride); break;
    }
  }
}

template <typename S, int NC>
void values_row16(const float* w, int64_t w_stride, int64_t g, const S* const* vrow, int64_t a,
                  int64_t b, int64_t n, float* acc) {
#ifdef SPECMESH_AVX2_ROWS
  if constexpr (kAvx2Rows<S>) {
    for (int64_t h = 0; h < g; ++h)
      values_avx2<S, NC>(w + h * w_stride, vrow, a, b, n, acc + h * 16 * NC, h == 0);
    return;
  }
#endif
  for (int64_t h = 0; h < g; h += 4) {
    const float* wh = w + h * w_stride;
    float* ah = acc + h * 16 * NC;
    switch (g - h < 4 ? g - h : 4) {
      case 1: values16<S, NC, 1>(wh, w_stride, vrow, a, b, n, ah); break;
      case 2: values16<S, NC, 2>(wh, w_stride, vrow, a, b, n, ah); break;
      case 3: values16<S, NC, 3>(wh, w_stride, vrow, a, b, n, ah); break;
      default: values16<S, NC, 4>(wh, w_stride, vrow, a, b, n, ah); break;
    }
  }
}

// Positions per split of a row: a row that sees more is attended in splits of this many
// positions (work items of their own, so one long row keeps every thread busy), merged in
// order (flash-decoding's rescaling, arXiv 2307.08691 §3.3). The splits depend only on how
// many positions the row sees, never on the thread count; a row with one split takes its
// result unchanged (the merge multiplies by exp(0) = 1 and adds to 0).
constexpr int64_t kSplit = 512;

// Positions per tile: a work item with several rows (a verify chunk) runs every row over one
// tile of positions before the next tile, so each K/V row comes from memory once and from the
// L1 cache for the other rows. A row's arithmetic is that of the row alone.
constexpr int64_t kTile = 64;

// The rows [0, rows) of one work item (float path, head_dim = 16 * NC): row r sees n[r]
// positions of the split, its K/V rows at krow[r][p] / vrow[r][p]; its G heads' queries at
// qf + r * g * 16 * NC. Writes per row and head the max score, the weight sum and the
// unnormalised value product.
template <typename S, int NC>
void attend_rows16(const float* qf, int64_t rows, int64_t g, const S* const* const* krow,
                   const S* const* const* vrow, const int64_t* n, float* w, float* acc,
                   float* max_out, float* den_out) {
  const int64_t d = 16 * NC, w_stride = kSplit;
  int64_t n_max = 0;
  for (int64_t r = 0; r < rows; ++r) n_max = std::max(n_max, n[r]);
  // the first rows of each phase, all at once (the rows ahead are fetched as it runs, values
  // with keys): keys now, values before the softmax, so they arrive while it runs
  const int64_t lead = std::min(kAhead, n_max);
  for (int64_t i = 0; i < lead; ++i) prefetch_row(krow[0][i], NC);
  for (int64_t a = 0; a < n_max; a += kTile)
    for (int64_t r = 0; r < rows; ++r)
      if (a < n[r])  // the values' rows fetched with the first row's keys
        scores_row16<S, NC>(qf + r * g * d, g, krow[r], r == 0 ? vrow[r] : nullptr, a,
                            std::min(a + kTile, n[r]), n[r], w + r * g * w_stride, w_stride);
  for (int64_t i = 0; i < lead; ++i) prefetch_row(vrow[0][i], NC);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < g; ++h) {
      float* s = w + (r * g + h) * w_stride;
      const float m = max_of(s, n[r]);
      for (int64_t i = 0; i < n[r]; ++i) s[i] = exp_neg(s[i] - m);
      max_out[r * g + h] = m;
      den_out[r * g + h] = weight_sum(s, n[r]);
    }
  std::fill(acc, acc + rows * g * d, 0.0f);
  for (int64_t a = 0; a < n_max; a += kTile)
    for (int64_t r = 0; r < rows; ++r)
      if (a < n[r])
        values_row16<S, NC>(w + r * g * w_stride, w_stride, g, vrow[r], a,
                            std::min(a + kTile, n[r]), n[r], acc + r * g * d);
}

// The generic work item (any head_dim, any accumulation type): the same arithmetic in loops.
template <typename S, typename A>
void attend_item(const A* qf, const S* const* krow, const S* const* vrow, int64_t n, int64_t g,
                 int64_t d, A* w, int64_t w_stride, A* acc, A* max_out, A* den_out) {
  for (int64_t p = 0; p < n; ++p)
    for (int64_t h = 0; h < g; ++h) w[h * w_stride + p] = dot(qf + h * d, krow[p], d);
  for (int64_t h = 0; h < g; ++h) {
    A* s = w + h * w_stride;
    const A m = max_of(s, n);
    for (int64_t p = 0; p < n; ++p) s[p] = exp_neg(s[p] - m);
    max_out[h] = m;
    den_out[h] = weight_sum(s, n);
    A* a = acc + h * d;
    std::fill(a, a + d, A(0));
    for (int64_t p = 0; p < n; ++p) {
      const A wp = s[p];
      for (int64_t i = 0; i < d; ++i) a[i] = fmaa(wp, static_cast<A>(load(vrow[p], i)), a[i]);
    }
  }
}


// T: the storage of q and out (the model's dtype), S: the cache's, A: the accumulation type.
template <typename T, typename S, typename A>
void attend(const T* q, const S* k_cache, const S* v_cache, T* out, const int64_t* block_tables,
            int64_t table_width, const int64_t* token_batch, const int32_t* token_visible,
            const int32_t* token_path, int64_t path_width, const int32_t* token_chunk_start,
            int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
            int64_t block_size, double scale, int num_threads) {
  const int64_t g = num_heads / num_kv_heads, d = head_dim, hkv = num_kv_heads;
  std::vector<int64_t> first(num_tokens + 1, 0);  // row t's splits: [first[t], first[t+1])
  for (int64_t t = 0; t < num_tokens; ++t)
    first[t + 1] = first[t] + (token_visible[t] + kSplit - 1) / kSplit;
  // work units: (first row, end row, split) of one request's rows that see that split; a
  // request's rows are consecutive
  struct Unit {
    int64_t begin, end, split;
  };
  std::vector<Unit> units;
  for (int64_t t = 0; t < num_tokens;) {
    int64_t e = t, most = 0;
    while (e < num_tokens && token_batch[e] == token_batch[t]) most = std::max<int64_t>(
        most, token_visible[e++]);
    for (int64_t sp = 0; sp * kSplit < most; ++sp) units.push_back({t, e, sp});
    t = e;
  }
  const int64_t splits = first[num_tokens];
  // per (row split, KV head): its heads' max score, weight sum and unnormalised value product
  std::vector<A> part_max(splits * hkv * g), part_den(splits * hkv * g),
      part_acc(splits * hkv * g * d);
  const A sc = static_cast<A>(scale);
  constexpr bool kFloat = std::is_same<A, float>::value;
  const int64_t num_units = static_cast<int64_t>(units.size());
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<A> qf, w, acc, mx, den;
    std::vector<const S*> krow, vrow;
    std::vector<const S* const*> kr, vr;
    std::vector<int64_t> rows_t, n;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_units * hkv; ++item) {
      const Unit& u = units[item / hkv];
      const int64_t kh = item % hkv, p0 = u.split * kSplit;
      rows_t.clear();
      n.clear();
      for (int64_t t = u.begin; t < u.end; ++t)
        if (token_visible[t] > p0) {
          rows_t.push_back(t);
          n.push_back(std::min<int64_t>(token_visible[t] - p0, kSplit));
        }
      const int64_t rows = static_cast<int64_t>(rows_t.size());
      const int64_t* table = block_tables + token_batch[u.begin] * table_width;
      // where each row's positions p0 + i lie: chains share one list, tree rows differ past
      // their chunk start
      const bool tree = token_chunk_start != nullptr;
      const int64_t lists = tree ? rows : 1;
      krow.resize(lists * kSplit);
      vrow.resize(lists * kSplit);
      for (int64_t l = 0; l < lists; ++l) {
        const int64_t t = rows_t[l];
        const int64_t start = tree ? token_chunk_start[t] : INT64_MAX;
        const int64_t count = tree ? n[l] : *std::max_element(n.begin(), n.end());
        // positions before the chunk start run in order: their block and offset advance
        // without a division per position
        int64_t blk = p0 / block_size, at = p0 % block_size;
        for (int64_t i = 0; i < count; ++i) {
          const int64_t p = p0 + i;
          int64_t off;
          if (p < start) {
            off = ((table[blk] * block_size + at) * hkv + kh) * d;
          } else {
            const int64_t pos = start + token_path[t * path_width + (p - start)];
            off = ((table[pos / block_size] * block_size + pos % block_size) * hkv + kh) * d;
          }
          if (++at == block_size) at = 0, ++blk;
          krow[l * kSplit + i] = k_cache + off;
          vrow[l * kSplit + i] = v_cache + off;
        }
      }
      kr.resize(rows);
      vr.resize(rows);
      for (int64_t r = 0; r < rows; ++r) {
        kr[r] = &krow[(tree ? r : 0) * kSplit];
        vr[r] = &vrow[(tree ? r : 0) * kSplit];
      }
      qf.resize(rows * g * d);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t h = 0; h < g; ++h)
          for (int64_t i = 0; i < d; ++i)
            qf[(r * g + h) * d + i] =
                static_cast<A>(load(q, (rows_t[r] * num_heads + kh * g + h) * d + i)) * sc;
      w.resize(rows * g * kSplit);
      acc.resize(rows * g * d);
      mx.resize(rows * g);
      den.resize(rows * g);
      bool done = false;
      if constexpr (kFloat) {
        if (d == 64 || d == 128) {
          (d == 64 ? attend_rows16<S, 4> : attend_rows16<S, 8>)(
              qf.data(), rows, g, kr.data(), vr.data(), n.data(), w.data(), acc.data(),
              mx.data(), den.data());
          done = true;
        }
      }
      if (!done)
        for (int64_t r = 0; r < rows; ++r)
          attend_item(&qf[r * g * d], kr[r], vr[r], n[r], g, d, &w[r * g * kSplit], kSplit,
                      &acc[r * g * d], &mx[r * g], &den[r * g]);
      for (int64_t r = 0; r < rows; ++r) {  // this split's partial results of each row
        const int64_t at = ((first[rows_t[r]] + u.split) * hkv + kh) * g;
        std::copy(&mx[r * g], &mx[r * g] + g, &part_max[at]);
        std::copy(&den[r * g], &den[r * g] + g, &part_den[at]);
        std::copy(&acc[r * g * d], &acc[r * g * d] + g * d, &part_acc[at * d]);
      }
    }
#pragma omp for schedule(static)
    for (int64_t item = 0; item < num_tokens * hkv; ++item) {  // merge the splits in order
      const int64_t t = item / hkv, kh = item % hkv;
      acc.resize(d);
      for (int64_t h = 0; h < g; ++h) {
        A big = part_max[(first[t] * hkv + kh) * g + h];
        for (int64_t sp = first[t] + 1; sp < first[t + 1]; ++sp)
          big = std::max(big, part_max[(sp * hkv + kh) * g + h]);
        A total = 0;
        A* a = acc.data();
        std::fill(a, a + d, A(0));
        for (int64_t sp = first[t]; sp < first[t + 1]; ++sp) {
          const int64_t at = (sp * hkv + kh) * g + h;
          const A f = exp_neg(part_max[at] - big);
          total = fmaa(f, part_den[at], total);
          const A* pa = &part_acc[at * d];
          for (int64_t i = 0; i < d; ++i) a[i] = fmaa(f, pa[i], a[i]);
        }
        T* o = out + (t * num_heads + kh * g + h) * d;
        for (int64_t i = 0; i < d; ++i) store(o, i, a[i] / total);
      }
    }
  }
}

}  // namespace

#define SPECMESH_ENTRY(name, T, S, A)                                                         \
  extern "C" void name(const void* q, const void* k_cache, const void* v_cache, void* out,     \
                       const int64_t* block_tables, int64_t table_width,                       \
                       const int64_t* token_batch, const int32_t* token_visible,               \
                       const int32_t* token_path, int64_t path_width,                          \
                       const int32_t* token_chunk_start, int64_t num_tokens, int64_t num_heads, \
                       int64_t num_kv_heads, int64_t head_dim, int64_t block_size,             \
                       double scale, int num_threads) {                                        \
    attend<T, S, A>(static_cast<const T*>(q), static_cast<const S*>(k_cache),                  \
                    static_cast<const S*>(v_cache), static_cast<T*>(out), block_tables,        \
                    table_width, token_batch, token_visible, token_path, path_width,           \
                    token_chunk_start, num_tokens, num_heads, num_kv_heads, head_dim,          \
                    block_size, scale, num_threads);                                           \
  }

SPECMESH_ENTRY(specmesh_paged_attention_f32, float, float, float)
SPECMESH_ENTRY(specmesh_paged_attention_bf16, uint16_t, uint16_t, float)
SPECMESH_ENTRY(specmesh_paged_attention_f64, double, double, double)
// a float32 model over a 16-bit KV cache
SPECMESH_ENTRY(specmesh_paged_attention_f32_kv_bf16, float, uint16_t, float)
SPECMESH_ENTRY(specmesh_paged_attention_f32_kv_f16, float, Half, float)
