// SIMD helpers shared by moestream's CPU kernels.
#pragma once

#include <immintrin.h>

#include <c10/util/BFloat16.h>

#include <type_traits>

#if defined(__AVX512F__)
// 16 values as float32: loaded, or bf16 widened (exact: the bits shifted into the high half).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// The 16 horizontal sums of v[0..15] as one vector, each by the same tree: lanes l + (l + 8),
// then + 4, then + 2, then + 1 (the order of _mm512_reduce_add_ps). Three levels of
// transposing adds (shuffle two vectors' halves, add) and a last pair of in-lane shuffles.
inline __m512 reduce16(const __m512* v) {
  __m512 s1[8], s2[4], s3[2];
  for (int i = 0; i < 8; ++i) {  // [a lo256, b lo256] + [a hi256, b hi256]
    const __m512 a = v[2 * i], b = v[2 * i + 1];
    s1[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  // s1[i] = [A'(0..3) A'(4..7) B'(0..3) B'(4..7)], A' = a lo + a hi; add the 128-bit quarters
  for (int i = 0; i < 4; ++i) {
    const __m512 a = s1[2 * i], b = s1[2 * i + 1];  // -> [A0+A1, B0+B1, C0+C1, D0+D1]
    s2[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  }
  // s2[i]: four groups of 4 lanes (one per input vector); lanes 0 + 2 and 1 + 3 of each group
  for (int i = 0; i < 2; ++i) {
    const __m512 a = s2[2 * i], b = s2[2 * i + 1];
    s3[i] = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
  }
  // s3[i], per 128-bit lane: [P(0+2), P(1+3), Q(0+2), Q(1+3)]; then (0+2) + (1+3)
  return _mm512_add_ps(_mm512_shuffle_ps(s3[0], s3[1], 0x88), _mm512_shuffle_ps(s3[0], s3[1], 0xDD));
}

// exp(x) for 16 lanes: x = n ln2 + r (n = round(x / ln2), ln2 split in two for exactness),
// e^r by its degree-7 Taylor polynomial on |r| <= ln2 / 2 (error below 1e-7 relative), times
// 2^n through scalef. Inputs at or below -88 give 0 or a subnormal, as expf; no NaN input is
// expected (the callers pass finite scores minus their maximum).
// In place: r[i][j] -> r[j][i] for a 16 x 16 float32 matrix held as 16 rows (unpack, then
// 128-bit lane shuffles: 64 shuffles where 256 scalar moves would do).
inline void transpose16x16(__m512* r) {
  __m512 a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // b[4i + j], lane L: column 4L + j of rows 4i..4i+3
    b[4 * i] = _mm512_shuffle_ps(a[4 * i], a[4 * i + 2], 0x44);
    b[4 * i + 1] = _mm512_shuffle_ps(a[4 * i], a[4 * i + 2], 0xEE);
    b[4 * i + 2] = _mm512_shuffle_ps(a[4 * i + 1], a[4 * i + 3], 0x44);
    b[4 * i + 3] = _mm512_shuffle_ps(a[4 * i + 1], a[4 * i + 3], 0xEE);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512 c0 = _mm512_shuffle_f32x4(b[j], b[4 + j], 0x88), c1 = _mm512_shuffle_f32x4(b[j], b[4 + j], 0xDD);
    const __m512 c2 = _mm512_shuffle_f32x4(b[8 + j], b[12 + j], 0x88);
    const __m512 c3 = _mm512_shuffle_f32x4(b[8 + j], b[12 + j], 0xDD);
    r[j] = _mm512_shuffle_f32x4(c0, c2, 0x88);
    r[4 + j] = _mm512_shuffle_f32x4(c1, c3, 0x88);
    r[8 + j] = _mm512_shuffle_f32x4(c0, c2, 0xDD);
    r[12 + j] = _mm512_shuffle_f32x4(c1, c3, 0xDD);
  }
}

inline __m512 exp512(__m512 x) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 ln2_hi = _mm512_set1_ps(0.693359375f), ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, ln2_hi, x);
  r = _mm512_fnmadd_ps(n, ln2_lo, r);
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
#endif

#if defined(__AVX512F__)
// float32 -> bf16 bits, round to nearest even, as c10::BFloat16 rounds (keeping denormals,
// which vcvtneps2bf16 would flush; a NaN becomes c10's 0x7FC0). rne_add: v's bits plus the
// rounding increment, the bf16 bits then in the high half of each lane.
inline __m512i rne_add(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), lsb);
}
inline __mmask16 nan_lanes(__m512 v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q); }
// to_bf16_bits32: the bits in the low half of each 32-bit lane (the high half zero).
inline __m512i to_bf16_bits32(__m512 v) {
  return _mm512_mask_mov_epi32(_mm512_srli_epi32(rne_add(v), 16), nan_lanes(v), _mm512_set1_epi32(0x7FC0));
}
inline __m256i to_bf16_bits(__m512 v) { return _mm512_cvtepi32_epi16(to_bf16_bits32(v)); }
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16_bits(v));
}

// v rounded to the compute dtype's precision (bf16: to nearest even, back as float32): the
// bits to_bf16_bits32 gives, kept in the high half (no narrowing and widening, no shifts).
template <typename T>
inline __m512 round16(__m512 v) {
  if constexpr (std::is_same<T, float>::value) return v;
  const __m512i r = _mm512_and_si512(rne_add(v), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  return _mm512_castsi512_ps(_mm512_mask_mov_epi32(r, nan_lanes(v), _mm512_set1_epi32(0x7FC00000)));
}
#endif
