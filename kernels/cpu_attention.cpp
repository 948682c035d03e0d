// Paged attention for the CPU (kernels/cpu_attention.py builds and loads this file).
//
// One work item is one query row and one KV head: it reads the row's visible positions of that
// head from the paged cache through the block table (no gather, no copy, no dtype conversion
// of the cache) and computes the attention of the head's G query heads over them, in float
// (double for double inputs). The arithmetic of an item depends only on its row, on how many
// positions it sees and on their K/V: every reduction runs in a fixed order written out here
// (16 explicit lanes, then a fixed tree), products use explicit fma, and exp is a polynomial
// evaluated the same way in every lane. So a row's result does not depend on the batch, on the
// other rows of its request, on padding or on the thread that ran it (batch invariance,
// kernels/paged_attention.py), and a verify row equals the one-token decode step at its
// position bit for bit. Build flags keep it so: -ffp-contract=off, no -ffast-math.
//
// Shapes (row-major, contiguous): q, out [T, H, D]; k_cache, v_cache [num_blocks, block_size,
// Hkv, D]; block_tables int64 [B, table_width]; token_batch int64 [T] (the request of a row);
// token_visible int32 [T] (positions the row sees); token_path int32 [T, path_width] and
// token_chunk_start int32 [T] or null (token trees: visible position p >= chunk_start reads
// chunk row token_path[t, p - chunk_start], i.e. position chunk_start + that row).
#include <cmath>
#include <algorithm>
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
inline f32x16 load16(const uint16_t* p) {  // 16 bfloat16 -> float, exact
  typedef uint32_t u32x16 __attribute__((vector_size(64)));
  typedef uint16_t u16x16 __attribute__((vector_size(32)));
  u16x16 h;
  std::memcpy(&h, p, sizeof h);
  u32x16 u = __builtin_convertvector(h, u32x16) << 16;
  f32x16 v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

inline float hsum(f32x16 v) {  // the lane tree of lane_sum
  float s[kLanes];
  std::memcpy(s, &v, sizeof s);
  return lane_sum(s);
}

inline f32x16 fma16(f32x16 a, f32x16 b, f32x16 c) {
  f32x16 r;
  for (int l = 0; l < kLanes; ++l) r[l] = std::fmaf(a[l], b[l], c[l]);
  return r;
}

typedef int32_t i32x16 __attribute__((vector_size(64)));

// Rows are read through the block table, so the hardware sees short strided runs: fetch the
// row kAhead positions ahead (each row is 16 * nc elements).
constexpr int64_t kAhead = 32;
template <typename S>
inline void prefetch_row(const S* row, int nc) {
  const char* b = reinterpret_cast<const char*>(row);
  for (size_t at = 0; at < 16 * nc * sizeof(S); at += 64) __builtin_prefetch(b + at);
}

// Lane trees of 16 vectors at once: r[j] = hsum(v[j]) for j < 16, with the same additions as
// lane_sum (so a position's score does not depend on whether it was reduced in a block of 16
// or alone).
inline f32x16 hsum16(const f32x16* v) {
  f32x16 x[8], y[4], z[2];
  for (int j = 0; j < 8; ++j)  // lanes 0-7: a of v[2j], lanes 8-15: a of v[2j+1]
    x[j] = __builtin_shuffle(v[2 * j], v[2 * j + 1],
                             i32x16{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}) +
           __builtin_shuffle(v[2 * j], v[2 * j + 1],
                             i32x16{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
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

// GB query heads (of one KV head) of one work item, float path with head_dim = 16 * NC
// (float32 and bfloat16 caches): the scores position by position (a 16-lane product over the
// head dimension, chunk by chunk, then the lane tree), softmax weights, and the value product
// position by position in order.
template <typename S, int NC, int GB>
void attend_heads16(const float* qf, const S* const* krow, const S* const* vrow, int64_t n,
                    float* w, int64_t w_stride, float* acc_out, float* max_out, float* den_out) {
  f32x16 qv[GB][NC];
  for (int h = 0; h < GB; ++h)
    for (int c = 0; c < NC; ++c) qv[h][c] = load16(qf + (h * NC + c) * 16);
  auto product = [&](int64_t p, f32x16* part, int64_t part_stride) {
    if (p + kAhead < n) prefetch_row(krow[p + kAhead], NC);
    f32x16 k[NC];
    for (int c = 0; c < NC; ++c) k[c] = load16(krow[p] + 16 * c);
    for (int h = 0; h < GB; ++h) {
      f32x16 acc = {};
      for (int c = 0; c < NC; ++c) acc = fma16(qv[h][c], k[c], acc);
      part[h * part_stride] = acc;
    }
  };
  int64_t p = 0;
  for (; p + kLanes <= n; p += kLanes) {  // scores, 16 positions at a time
    f32x16 part[GB][kLanes];
    for (int j = 0; j < kLanes; ++j) product(p + j, &part[0][j], kLanes);
    for (int h = 0; h < GB; ++h) {
      f32x16 r = hsum16(part[h]);
      std::memcpy(w + h * w_stride + p, &r, sizeof r);
    }
  }
  for (; p < n; ++p) {
    f32x16 part[GB];
    product(p, part, 1);
    for (int h = 0; h < GB; ++h) w[h * w_stride + p] = hsum(part[h]);
  }
  for (int h = 0; h < GB; ++h) {
    float* s = w + h * w_stride;
    float m = s[0];
    for (int64_t i = 1; i < n; ++i) m = s[i] > m ? s[i] : m;
    for (int64_t i = 0; i < n; ++i) s[i] = exp_neg(s[i] - m);
    max_out[h] = m;
    den_out[h] = weight_sum(s, n);
  }
  f32x16 acc[GB][NC] = {};
  for (p = 0; p < n; ++p) {
    if (p + kAhead < n) prefetch_row(vrow[p + kAhead], NC);
    f32x16 v[NC];
    for (int c = 0; c < NC; ++c) v[c] = load16(vrow[p] + 16 * c);
    for (int h = 0; h < GB; ++h) {
      const f32x16 wp = f32x16{} + w[h * w_stride + p];
      for (int c = 0; c < NC; ++c) acc[h][c] = fma16(wp, v[c], acc[h][c]);
    }
  }
  std::memcpy(acc_out, acc, sizeof acc);
}

// One work item of the float path with head_dim = 16 * NC: its G query heads in groups of
// at most 4 (what fits in registers).
template <typename S, int NC>
void attend_item16(const float* qf, const S* const* krow, const S* const* vrow, int64_t n,
                   int64_t g, float* w, int64_t w_stride, float* acc_out, float* max_out,
                   float* den_out) {
  for (int64_t h = 0; h < g; h += 4) {
    const float* q = qf + h * 16 * NC;
    float* wh = w + h * w_stride;
    float *a = acc_out + h * 16 * NC, *m = max_out + h, *l = den_out + h;
    switch (g - h < 4 ? g - h : 4) {
      case 1: attend_heads16<S, NC, 1>(q, krow, vrow, n, wh, w_stride, a, m, l); break;
      case 2: attend_heads16<S, NC, 2>(q, krow, vrow, n, wh, w_stride, a, m, l); break;
      case 3: attend_heads16<S, NC, 3>(q, krow, vrow, n, wh, w_stride, a, m, l); break;
      default: attend_heads16<S, NC, 4>(q, krow, vrow, n, wh, w_stride, a, m, l); break;
    }
  }
}

// The generic work item (any head_dim, any accumulation type): the same arithmetic in loops.
template <typename S, typename A>
void attend_item(const A* qf, const S* const* krow, const S* const* vrow, int64_t n, int64_t g,
                 int64_t d, A* w, int64_t w_stride, A* acc, A* max_out, A* den_out) {
  for (int64_t p = 0; p < n; ++p)
    for (int64_t h = 0; h < g; ++h) w[h * w_stride + p] = dot(qf + h * d, krow[p], d);
  for (int64_t h = 0; h < g; ++h) {
    A* s = w + h * w_stride;
    A m = s[0];
    for (int64_t p = 1; p < n; ++p) m = s[p] > m ? s[p] : m;
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

// Positions per split of a row: a row that sees more is attended in splits of this many
// positions (work items of their own, so one long row keeps every thread busy), merged in
// order (flash-decoding's rescaling, arXiv 2307.08691 §3.3). The splits depend only on how
// many positions the row sees, never on the thread count; a row with one split takes its
// result unchanged (the merge multiplies by exp(0) = 1 and adds to 0).
constexpr int64_t kSplit = 512;

template <typename S, typename A>
void attend(const S* q, const S* k_cache, const S* v_cache, S* out, const int64_t* block_tables,
            int64_t table_width, const int64_t* token_batch, const int32_t* token_visible,
            const int32_t* token_path, int64_t path_width, const int32_t* token_chunk_start,
            int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
            int64_t block_size, double scale, int num_threads) {
  const int64_t g = num_heads / num_kv_heads, d = head_dim, hkv = num_kv_heads;
  std::vector<int64_t> first(num_tokens + 1, 0);  // row t's splits: [first[t], first[t+1])
  for (int64_t t = 0; t < num_tokens; ++t)
    first[t + 1] = first[t] + (token_visible[t] + kSplit - 1) / kSplit;
  const int64_t splits = first[num_tokens];
  // per (split, KV head): its heads' max score, weight sum and unnormalised value product
  std::vector<A> part_max(splits * hkv * g), part_den(splits * hkv * g),
      part_acc(splits * hkv * g * d);
  const A sc = static_cast<A>(scale);
  constexpr bool kFloat = std::is_same<A, float>::value;
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<A> qf(g * d), w(g * kSplit);
    std::vector<const S*> krow(kSplit), vrow(kSplit);
#pragma omp for schedule(static)
    for (int64_t item = 0; item < splits * hkv; ++item) {
      const int64_t sp = item / hkv, kh = item % hkv;
      const int64_t t = std::upper_bound(first.begin(), first.end(), sp) - first.begin() - 1;
      const int64_t p0 = (sp - first[t]) * kSplit;
      const int64_t n = std::min<int64_t>(token_visible[t] - p0, kSplit);
      const int64_t* table = block_tables + token_batch[t] * table_width;
      const int64_t start = token_chunk_start ? token_chunk_start[t] : token_visible[t];
      for (int64_t i = 0; i < n; ++i) {  // where position p0 + i's K/V lie
        const int64_t p = p0 + i;
        int64_t pos = p < start ? p : start + token_path[t * path_width + (p - start)];
        int64_t off = ((table[pos / block_size] * block_size + pos % block_size) * hkv + kh) * d;
        krow[i] = k_cache + off;
        vrow[i] = v_cache + off;
      }
      for (int64_t h = 0; h < g; ++h)
        for (int64_t i = 0; i < d; ++i)
          qf[h * d + i] = static_cast<A>(load(q, (t * num_heads + kh * g + h) * d + i)) * sc;
      A* m = &part_max[item * g];
      A* l = &part_den[item * g];
      A* acc = &part_acc[item * g * d];
      if constexpr (kFloat) {
        if (d == 64)
          attend_item16<S, 4>(qf.data(), krow.data(), vrow.data(), n, g, w.data(), kSplit, acc,
                              m, l);
        else if (d == 128)
          attend_item16<S, 8>(qf.data(), krow.data(), vrow.data(), n, g, w.data(), kSplit, acc,
                              m, l);
        else
          attend_item(qf.data(), krow.data(), vrow.data(), n, g, d, w.data(), kSplit, acc, m,
                      l);
      } else {
        attend_item(qf.data(), krow.data(), vrow.data(), n, g, d, w.data(), kSplit, acc, m, l);
      }
    }
#pragma omp for schedule(static)
    for (int64_t item = 0; item < num_tokens * hkv; ++item) {  // merge the splits in order
      const int64_t t = item / hkv, kh = item % hkv;
      for (int64_t h = 0; h < g; ++h) {
        A big = part_max[(first[t] * hkv + kh) * g + h];
        for (int64_t sp = first[t] + 1; sp < first[t + 1]; ++sp)
          big = std::max(big, part_max[(sp * hkv + kh) * g + h]);
        A den = 0;
        A* a = &qf[0];  // this thread's scratch, d values
        std::fill(a, a + d, A(0));
        for (int64_t sp = first[t]; sp < first[t + 1]; ++sp) {
          const int64_t at = (sp * hkv + kh) * g + h;
          const A f = exp_neg(part_max[at] - big);
          den = fmaa(f, part_den[at], den);
          const A* pa = &part_acc[at * d];
          for (int64_t i = 0; i < d; ++i) a[i] = fmaa(f, pa[i], a[i]);
        }
        S* o = out + (t * num_heads + kh * g + h) * d;
        for (int64_t i = 0; i < d; ++i) store(o, i, a[i] / den);
      }
    }
  }
}

}  // namespace

#define SPECMESH_ENTRY(name, S, A)                                                            \
  extern "C" void name(const void* q, const void* k_cache, const void* v_cache, void* out,     \
                       const int64_t* block_tables, int64_t table_width,                       \
                       const int64_t* token_batch, const int32_t* token_visible,               \
                       const int32_t* token_path, int64_t path_width,                          \
                       const int32_t* token_chunk_start, int64_t num_tokens, int64_t num_heads, \
                       int64_t num_kv_heads, int64_t head_dim, int64_t block_size,             \
                       double scale, int num_threads) {                                        \
    attend<S, A>(static_cast<const S*>(q), static_cast<const S*>(k_cache),                     \
                 static_cast<const S*>(v_cache), static_cast<S*>(out), block_tables,           \
                 table_width, token_batch, token_visible, token_path, path_width,              \
                 token_chunk_start, num_tokens, num_heads, num_kv_heads, head_dim, block_size, \
                 scale, num_threads);                                                          \
  }

SPECMESH_ENTRY(specmesh_paged_attention_f32, float, float)
SPECMESH_ENTRY(specmesh_paged_attention_bf16, uint16_t, float)
SPECMESH_ENTRY(specmesh_paged_attention_f64, double, double)
