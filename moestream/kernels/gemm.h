// Dot-product tiles and the row-block GEMM (C = A . B^T) shared by moestream's CPU kernels
// (fused_moe_cpu.cpp: the MoE layer's projections; linear_cpu.cpp: decode-sized dense
// linears). Each dot product sums in an order that depends only on its length K (SIMD lanes
// over k, a fixed reduction tree, then the scalar tail), never on the rows, tiling or threads.
//
// SIMD: AVX-512F (+ AVX512_BF16's dot-product instruction for bf16), AVX2 + FMA, or scalar,
// chosen by the compiler flags (-march=native: one build per CPU).
#pragma once

#include <ATen/ATen.h>

#include <immintrin.h>

#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace moestream_gemm {

using bf16 = at::BFloat16;

inline float to_f(float v) { return v; }
inline float to_f(bf16 v) { return static_cast<float>(v); }
// Round a float32 value to the compute dtype's precision (round to nearest even, as torch).
template <typename T> inline float round_to(float v) { return static_cast<float>(static_cast<T>(v)); }
template <typename T> inline T cast(float v) { return static_cast<T>(v); }

// Tiles of dot products computed together: 4 rows x 4 columns, or one row x 16 columns for
// the rows left over (decode: mostly one or two rows per expert). Either way 16 accumulators.
constexpr int64_t ROW_TILE = 4;
constexpr int64_t COL_CHUNK = 32;  // output columns per parallel work item (a multiple of 4 and 16)

// ---- dot products: 16 at a time, C[r][c] = sum_k A[r][k] * B[c][k] over a tile of rows x columns ----
// A rows are zero-padded to `kpad` (a multiple of the vector step); B rows are read up to K and
// their tail past the last full vector is summed in scalar code after the vector reduction.

#if defined(__AVX512F__)
constexpr int64_t STEP_F32 = 16;
#if defined(__AVX512BF16__)
constexpr int64_t STEP_BF16 = 32;
#else
constexpr int64_t STEP_BF16 = 16;
#endif
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t STEP_F32 = 8;
constexpr int64_t STEP_BF16 = 8;
#else
constexpr int64_t STEP_F32 = 1;
constexpr int64_t STEP_BF16 = 1;
#endif

template <typename T> constexpr int64_t step_of() { return std::is_same<T, float>::value ? STEP_F32 : STEP_BF16; }

#if defined(__AVX512F__)
using vec = __m512;
inline vec vzero() { return _mm512_setzero_ps(); }
template <typename T>
inline vec load_f(const T* p) { return load16(p); }
#elif defined(__AVX2__) && defined(__FMA__)
using vec = __m256;
inline vec vzero() { return _mm256_setzero_ps(); }
inline float vsum(vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline vec load_f(const float* p) { return _mm256_loadu_ps(p); }
inline vec load_f(const bf16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

template <typename T, int R, int C>
inline void dot_tile(const T* A, int64_t lda, const T* const* B, const T* const* next, int64_t K,
                     float* out /* [R][C] */) {
  static_assert(R * C <= 16, "a tile is at most 16 dot products");
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  constexpr int64_t S = step_of<T>();
  const int64_t kv = K / S * S;  // the vectorized part of k
  vec acc[16];  // R * C used; the rest stay zero for the reduction
  for (int i = 0; i < 16; ++i) acc[i] = vzero();
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if constexpr (std::is_same<T, bf16>::value) {
    for (int64_t k = 0; k < kv; k += S) {
      __m512bh b[C];
      for (int c = 0; c < C; ++c) b[c] = (__m512bh)_mm512_loadu_si512(B[c] + k);
      if (next != nullptr)
        for (int c = 0; c < C; ++c) _mm_prefetch(reinterpret_cast<const char*>(next[c] + k), _MM_HINT_T0);
      for (int r = 0; r < R; ++r) {
        __m512bh a = (__m512bh)_mm512_loadu_si512(A + r * lda + k);
        for (int c = 0; c < C; ++c) acc[r * C + c] = _mm512_dpbf16_ps(acc[r * C + c], a, b[c]);
      }
    }
  } else
#endif
  {
    for (int64_t k = 0; k < kv; k += S) {
      vec b[C];
      for (int c = 0; c < C; ++c) b[c] = load_f(B[c] + k);
      if (next != nullptr)
        for (int c = 0; c < C; ++c) _mm_prefetch(reinterpret_cast<const char*>(next[c] + k), _MM_HINT_T0);
      for (int r = 0; r < R; ++r) {
        vec a = load_f(A + r * lda + k);
#if defined(__AVX512F__)
        for (int c = 0; c < C; ++c) acc[r * C + c] = _mm512_fmadd_ps(a, b[c], acc[r * C + c]);
#else
        for (int c = 0; c < C; ++c) acc[r * C + c] = _mm256_fmadd_ps(a, b[c], acc[r * C + c]);
#endif
      }
    }
  }
#if defined(__AVX512F__)
  alignas(64) float sums[16];
  _mm512_store_ps(sums, reduce16(acc));
  for (int i = 0; i < R * C; ++i) out[i] = sums[4 * (i % 4) + i / 4];  // reduce16 leaves vector i in lane 4(i%4) + i/4
#else
  for (int i = 0; i < R * C; ++i) out[i] = vsum(acc[i]);
#endif
#else
  const int64_t kv = 0;  // no SIMD: all of k in the scalar loop below
  for (int i = 0; i < R * C; ++i) out[i] = 0.f;
#endif
  for (int64_t k = kv; k < K; ++k)  // the tail, in scalar code (all of k without SIMD)
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) out[r * C + c] += to_f(A[r * lda + k]) * to_f(B[c][k]);
}

// One tile shape's pass: rows [r0, r1) in groups of R, columns [j0, j1) in groups of C.
template <typename T, int R, int C>
void tiles(const T* A, int64_t lda, int64_t r0, int64_t r1, const T* B, int64_t N, int64_t K, int64_t j0, int64_t j1,
           float* Cm, int64_t ldc) {
  float tile[16];
  for (int64_t r = r0; r < r1; r += R) {
    for (int64_t j = j0; j < j1; j += C) {
      const int64_t cn = std::min<int64_t>(C, j1 - j);
      const T* cols[C];
      const T* ahead[C];  // the next tile's columns, prefetched during this one (the first row group only)
      for (int64_t c = 0; c < C; ++c) cols[c] = B + (j + std::min(c, cn - 1)) * K;  // edge: repeat the last
      const bool more = r == r0 && j + C < N;  // into the next work item's columns too
      for (int64_t c = 0; c < C; ++c) ahead[c] = B + std::min(j + C + c, N - 1) * K;
      dot_tile<T, R, C>(A + r * lda, lda, cols, more ? ahead : nullptr, K, tile);
      for (int64_t i = 0; i < R; ++i)
        for (int64_t c = 0; c < cn; ++c) Cm[(r + i) * ldc + j + c] = tile[i * C + c];
    }
  }
}

// C[r][j] (float32, ldc) for r < n, j in [j0, j1): rows of A (lda) against rows B[j] (K long, N rows).
// Rows in tiles of ROW_TILE x 4 columns; the 1-3 rows left over in one tile of 1 x 16, 2 x 8
// or 3 x 5 (each weight row is read once per tile). Every dot product sums alike whichever
// tile it falls in.
template <typename T>
void gemm_nt(const T* A, int64_t lda, int64_t n, const T* B, int64_t N, int64_t K, int64_t j0, int64_t j1, float* C,
             int64_t ldc) {
  const int64_t full = n / ROW_TILE * ROW_TILE;
  tiles<T, ROW_TILE, 4>(A, lda, 0, full, B, N, K, j0, j1, C, ldc);
  switch (n - full) {
    case 1: tiles<T, 1, 16>(A, lda, full, n, B, N, K, j0, j1, C, ldc); break;
    case 2: tiles<T, 2, 8>(A, lda, full, n, B, N, K, j0, j1, C, ldc); break;
    case 3: tiles<T, 3, 5>(A, lda, full, n, B, N, K, j0, j1, C, ldc); break;
    default: break;
  }
}

}  // namespace moestream_gemm
