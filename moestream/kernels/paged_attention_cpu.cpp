// Decode attention over a paged KV cache on CPU, reading each request's keys and values in
// place through its block table (moestream/kernels/paged_attention.py loads and calls it).
// One query token per request; grouped-query attention; an optional first visible position
// per request (a sliding window).
//
// Shapes (b requests, Hq query heads, Hk KV heads, D head dim, Dv value dim, bs block size):
//   q             [b, Hq, D]            float32 or bfloat16 (the compute dtype)
//   k_cache       [N, bs, Hk, D]        compute dtype; any strides with the last dim contiguous
//   v_cache       [N, bs, Hk, Dv]       compute dtype; the same
//   block_tables  [b, W] int32          physical block of each request's logical block
//   seq_lens      [b] int64             context length, the query's own token included
//   starts        [b] int64             first key position the query sees (0 without a window)
//   out           [b, Hq, Dv]           compute dtype, written
//
// For each request and query head h (KV head h / (Hq / Hk)): s_p = scale * q . k_p for the
// positions p in [start, seq_len), w = softmax(s) in float32, out = sum_p w_p v_p rounded to
// the compute dtype. The dot products run in float32 in a fixed order (SIMD lanes over D,
// then a fixed tree), the softmax subtracts the maximum (exp: `exp512`, a polynomial, with
// AVX-512) and sums its terms in 16 lanes (position p in lane p % 16, then a fixed tree), and
// the values are summed in position order (AVX-512: accumulators in registers, each value row
// widened once for its query heads), so a request's output does not depend on the other
// requests of the batch. Key and value rows are located block by block, once per request.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using bf16 = at::BFloat16;

inline float to_f(float v) { return v; }
inline float to_f(bf16 v) { return static_cast<float>(v); }

// dot(a[0:D], b[0:D]) in float32, b in the compute dtype, a already float32 (the path
// without AVX-512; with it, `dot16`).
template <typename T>
inline float dot(const float* a, const T* b, int64_t D) {
  float s = 0.f;
  for (int64_t d = 0; d < D; ++d) s += a[d] * to_f(b[d]);
  return s;
}

#if defined(__AVX512F__)
// out[i] = q[0:D] . k[i][0:D] for 16 key rows (float32): lanes over D, then the transposing
// reduction (`reduce16`), then the scalar tail of D.
template <typename T>
inline void dot16(const float* q, const T* const* k, int64_t D, float* out) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    const __m512 qv = _mm512_loadu_ps(q + d);
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_fmadd_ps(qv, load16(k[i] + d), acc[i]);
  }
  alignas(64) float sums[16];
  _mm512_store_ps(sums, reduce16(acc));
  for (int i = 0; i < 16; ++i) out[i] = sums[4 * (i % 4) + i / 4];
  for (; d < D; ++d)
    for (int i = 0; i < 16; ++i) out[i] += q[d] * to_f(k[i][d]);
}
#endif

// acc[0:D] += w * v[0:D] (float32 accumulators, v in the compute dtype).
template <typename T>
inline void axpy(float* acc, float w, const T* v, int64_t D) {
  int64_t d = 0;
#if defined(__AVX512F__)
  const __m512 wv = _mm512_set1_ps(w);
  for (; d + 16 <= D; d += 16) {
    _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(wv, load16(v + d), _mm512_loadu_ps(acc + d)));
  }
#endif
  for (; d < D; ++d) acc[d] += w * to_f(v[d]);
}

#if defined(__AVX512F__)
// acc[h][0:16 NV] += s[h][p] v_p for the HC heads of one pass, over positions [lo, hi): the
// accumulators stay in registers and each value row is widened once for the pass's heads.
// Each lane still adds its products in position order (what `axpy` per position does).
template <typename T, int NV, int HC>
inline void accumulate_values(const float* scores, int64_t npad, int64_t lo, int64_t hi, const T* const* rows,
                              float* acc, int64_t Dv) {
  __m512 a[HC][NV];
  for (int h = 0; h < HC; ++h)
    for (int j = 0; j < NV; ++j) a[h][j] = _mm512_loadu_ps(acc + h * Dv + 16 * j);
  for (int64_t p = lo; p < hi; ++p) {
    const T* vp = rows[p - lo];
    __m512 v[NV];
    for (int j = 0; j < NV; ++j) v[j] = load16(vp + 16 * j);
    for (int h = 0; h < HC; ++h) {
      const __m512 w = _mm512_set1_ps(scores[h * npad + (p - lo)]);
      for (int j = 0; j < NV; ++j) a[h][j] = _mm512_fmadd_ps(w, v[j], a[h][j]);
    }
  }
  for (int h = 0; h < HC; ++h)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc + h * Dv + 16 * j, a[h][j]);
}

// `accumulate_values` for `group` heads of Dv = 16 NV values, in passes of as many heads as
// keep 8 accumulators; false when Dv is not a width it has.
template <typename T>
inline bool accumulate_values_all(const float* scores, int64_t npad, int64_t lo, int64_t hi, const T* const* rows,
                                  float* acc, int64_t Dv, int64_t group) {
  int64_t h = 0;
  switch (Dv) {
    case 64:
      for (; h + 2 <= group; h += 2) accumulate_values<T, 4, 2>(scores + h * npad, npad, lo, hi, rows, acc + h * Dv, Dv);
      for (; h < group; ++h) accumulate_values<T, 4, 1>(scores + h * npad, npad, lo, hi, rows, acc + h * Dv, Dv);
      return true;
    case 128:
      for (; h < group; ++h) accumulate_values<T, 8, 1>(scores + h * npad, npad, lo, hi, rows, acc + h * Dv, Dv);
      return true;
    case 32:
      for (; h + 4 <= group; h += 4) accumulate_values<T, 2, 4>(scores + h * npad, npad, lo, hi, rows, acc + h * Dv, Dv);
      for (; h < group; ++h) accumulate_values<T, 2, 1>(scores + h * npad, npad, lo, hi, rows, acc + h * Dv, Dv);
      return true;
    default:
      return false;
  }
}
#endif

template <typename T>
void decode_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& starts, double scale,
                 const at::Tensor& out) {
  const int64_t b = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), Hk = k_cache.size(2), Dv = v_cache.size(3);
  const int64_t group = Hq / Hk;
  const int64_t W = block_tables.size(1);
  const T* qd = q.data_ptr<T>();
  const T* kd = k_cache.data_ptr<T>();
  const T* vd = v_cache.data_ptr<T>();
  T* od = out.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* first = starts.data_ptr<int64_t>();
  const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1), ks2 = k_cache.stride(2);
  const int64_t vs0 = v_cache.stride(0), vs1 = v_cache.stride(1), vs2 = v_cache.stride(2);
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const int64_t bts = block_tables.stride(0);
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, b * Hk, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> qf(group * D), scores, acc(group * Dv), inv(group);
    std::vector<const T*> krows, vrows;
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t r = item / Hk, g = item % Hk;
      const int64_t lo = first[r], hi = lens[r], n = hi - lo;
      if (n <= 0) continue;
      for (int64_t h = 0; h < group; ++h)
        for (int64_t d = 0; d < D; ++d) qf[h * D + d] = to_f(qd[r * qs0 + (g * group + h) * qs1 + d]);
      const int64_t npad = (n + 15) / 16 * 16;  // scores padded to whole vectors
      scores.assign(group * npad, 0.f);
      // the key and value row of each position, block by block (no division per position)
      krows.resize(npad), vrows.resize(n);
      for (int64_t p = lo; p < hi;) {
        const int64_t i = p / bs, end = std::min(hi, (i + 1) * bs);
        const T* kb = kd + tables[r * bts + i] * ks0 + g * ks2;
        const T* vb = vd + tables[r * bts + i] * vs0 + g * vs2;
        for (int64_t o = p - i * bs; p < end; ++p, ++o) krows[p - lo] = kb + o * ks1, vrows[p - lo] = vb + o * vs1;
      }
      for (int64_t i = n; i < npad; ++i) krows[i] = krows[n - 1];  // past the end: the last row again (ignored)
#if defined(__AVX512F__)
      for (int64_t p0 = lo; p0 < hi; p0 += 16) {  // 16 key rows at a time, read for every query head
        const T* const* kp = krows.data() + (p0 - lo);
        float sc16[16];
        for (int64_t h = 0; h < group; ++h) {
          dot16<T>(qf.data() + h * D, kp, D, sc16);
          for (int64_t i = 0; i < 16 && p0 + i < hi; ++i) scores[h * npad + (p0 + i - lo)] = sc16[i] * sc;
        }
      }
#else
      for (int64_t p = lo; p < hi; ++p) {  // each key row is read once for the group's query heads
        const T* kp = krows[p - lo];
        for (int64_t h = 0; h < group; ++h) scores[h * npad + (p - lo)] = dot<T>(qf.data() + h * D, kp, D) * sc;
      }
#endif
      for (int64_t h = 0; h < group; ++h) {
        float* s = scores.data() + h * npad;
        float m = -std::numeric_limits<float>::infinity(), sum = 0.f;
#if defined(__AVX512F__)
        int64_t p = 0;
        __m512 mx = _mm512_set1_ps(m);
        for (; p + 16 <= n; p += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + p));
        m = _mm512_reduce_max_ps(mx);
        for (; p < n; ++p) m = std::max(m, s[p]);
        const __m512 mv = _mm512_set1_ps(m);
        for (p = 0; p < npad; p += 16) _mm512_storeu_ps(s + p, exp512(_mm512_sub_ps(_mm512_loadu_ps(s + p), mv)));
        __m512 sv = _mm512_setzero_ps();  // lane i sums positions i, i + 16, ... in order; then a fixed tree
        for (p = 0; p + 16 <= n; p += 16) sv = _mm512_add_ps(sv, _mm512_loadu_ps(s + p));
        if (p < n) sv = _mm512_add_ps(sv, _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << (n - p)) - 1), s + p));
        sum = _mm512_reduce_add_ps(sv);
#else
        for (int64_t p = 0; p < n; ++p) m = std::max(m, s[p]);
        for (int64_t p = 0; p < n; ++p) s[p] = std::exp(s[p] - m);
        for (int64_t p = 0; p < n; ++p) sum += s[p];  // in position order
#endif
        inv[h] = 1.f / sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      bool done = false;
#if defined(__AVX512F__)
      done = accumulate_values_all<T>(scores.data(), npad, lo, hi, vrows.data(), acc.data(), Dv, group);
#endif
      for (int64_t p = lo; p < hi && !done; ++p)
        for (int64_t h = 0; h < group; ++h) axpy<T>(acc.data() + h * Dv, scores[h * npad + (p - lo)], vrows[p - lo], Dv);
      for (int64_t h = 0; h < group; ++h)
        for (int64_t d = 0; d < Dv; ++d)
          od[r * os0 + (g * group + h) * os1 + d] = static_cast<T>(acc[h * Dv + d] * inv[h]);
    }
  });
}

void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& starts,
                            double scale, const at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "paged_decode_attention: q must be [b, Hq, D] with contiguous rows");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "paged_decode_attention: q must be float32 or bfloat16, got ", q.scalar_type());
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "paged_decode_attention: caches must be [N, bs, Hk, D] with a contiguous last dim");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type() &&
                  out.scalar_type() == q.scalar_type(),
              "paged_decode_attention: q, caches and out must share a dtype");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(2) == 0 &&
                  v_cache.size(2) == k_cache.size(2) && v_cache.size(1) == k_cache.size(1),
              "paged_decode_attention: head counts or dims do not match");
  TORCH_CHECK(out.dim() == 3 && out.size(0) == q.size(0) && out.size(1) == q.size(1) &&
                  out.size(2) == v_cache.size(3) && out.stride(2) == 1,
              "paged_decode_attention: out must be [b, Hq, Dv]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.stride(1) == 1 &&
                  block_tables.size(0) == q.size(0),
              "paged_decode_attention: block_tables must be int32 [b, W]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && starts.scalar_type() == at::kLong && seq_lens.is_contiguous() &&
                  starts.is_contiguous() && seq_lens.numel() == q.size(0) && starts.numel() == q.size(0),
              "paged_decode_attention: seq_lens and starts must be contiguous int64 [b]");
  const int64_t cap = block_tables.size(1) * k_cache.size(1);
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* first = starts.data_ptr<int64_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t bs = k_cache.size(1), num_blocks = std::min(k_cache.size(0), v_cache.size(0));
  for (int64_t r = 0; r < q.size(0); ++r) {
    TORCH_CHECK(lens[r] <= cap, "paged_decode_attention: a context of ", lens[r], " tokens exceeds its block table");
    TORCH_CHECK(first[r] >= 0 && first[r] < lens[r], "paged_decode_attention: request ", r, " sees no key (start ",
                first[r], ", context ", lens[r], ")");
    for (int64_t i = first[r] / bs; i * bs < lens[r]; ++i) {  // every block the query reads
      const int32_t blk = tables[r * block_tables.stride(0) + i];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "paged_decode_attention: request ", r, " reads block ", blk,
                  " of a cache of ", num_blocks);
    }
  }
  if (q.scalar_type() == at::kFloat)
    decode_impl<float>(q, k_cache, v_cache, block_tables, seq_lens, starts, scale, out);
  else
    decode_impl<bf16>(q, k_cache, v_cache, block_tables, seq_lens, starts, scale, out);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moestream_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor starts, float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(moestream_cpu, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
