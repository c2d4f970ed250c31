// A MoE layer's routed experts in one call on CPU: gate_up, gated activation, down and the
// weighted combine of every active expert (moestream/kernels/fused_moe.py loads and calls it).
//
// Shapes (T tokens, H hidden, I expert intermediate, P (token, expert) pairs, n_e rows of expert e):
//   x             [T, H]       float32 or bfloat16 (the "compute dtype")
//   gate_up[e]    [2I, H]      compute dtype, contiguous (gate rows then up rows, or interleaved)
//   down[e]       [H, I]       compute dtype, contiguous
//   gate_up_bias  [] or [2I] per expert;  down_bias  [] or [H] per expert (compute dtype)
//   token_of      [P] int64    the token of each pair, grouped by expert in the order of gate_up
//   pair_weight   [P] float32  its routing weight
//   counts        [E_active]   pairs per expert (sum = P)
//   out           [T, H] float32, accumulated in place: out[t] += w * y
//
// The arithmetic follows moestream's PyTorch path op for op (expert_swiglu + weighted_sum):
// each projection accumulates in float32 and is rounded to the compute dtype, a bias is added
// and rounded again, the activation is computed in float32 and rounded per op as torch rounds
// bf16 pointwise ops, and y is upcast, multiplied by its weight and added (no fused
// multiply-add) in expert order. Each dot product's summation order depends only on its length
// (SIMD lanes over k, then a fixed tree), never on the number of rows, the tiling or the
// threads, so an expert's output is the same whatever the batch around it.
//
// SIMD: AVX-512F (+ AVX512_BF16's dot-product instruction for bf16), AVX2 + FMA, or scalar,
// chosen by the compiler flags (-march=native: one build per CPU).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "simd.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

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

inline float sigmoid(float v) { return 1.f / (1.f + std::exp(-v)); }

// One pair's gated activation: h [2I] (float32 values at the compute dtype's precision) -> a [I].
template <typename T>
void activation(const float* h, int64_t I, int64_t act, float alpha, float limit, T* a) {
  if (act == 0) {  // SwiGLU: silu(gate) * up, gate = h[:I], up = h[I:]
    for (int64_t i = 0; i < I; ++i) {
      const float g = h[i];
      const float s = round_to<T>(g / (1.f + std::exp(-g)));
      a[i] = cast<T>(s * h[I + i]);
    }
  } else {  // swigluoai: gate = h[0::2] clamped above, up = h[1::2] clamped; (up + 1) * gate * sigmoid(alpha * gate)
    for (int64_t i = 0; i < I; ++i) {
      // clamps that pass a NaN through, as torch.clamp does (std::fmin would not)
      const float g = h[2 * i] > limit ? limit : h[2 * i];
      const float u = h[2 * i + 1] > limit ? limit : (h[2 * i + 1] < -limit ? -limit : h[2 * i + 1]);
      const float sg = round_to<T>(sigmoid(round_to<T>(g * alpha)));
      const float gs = round_to<T>(g * sg);
      a[i] = cast<T>(round_to<T>(u + 1.f) * gs);
    }
  }
}

// One projection of every expert's rows: out[p] (float32 [P, N], values at the compute
// dtype's precision) = round(A[p] . W_e) (+ bias_e, rounded again) for the pairs p of expert
// e, A [P, K] grouped by expert (start[e], counts[e]), W_e [N, K]. Work items: (expert,
// COL_CHUNK columns).
template <typename T>
void project(const T* A, int64_t K, const std::vector<const T*>& W, const std::vector<const T*>* bias, int64_t N,
             const std::vector<int64_t>& start, const std::vector<int64_t>& counts, float* out) {
  const int64_t E = static_cast<int64_t>(counts.size());
  const int64_t chunks = (N + COL_CHUNK - 1) / COL_CHUNK;
  at::parallel_for(0, E * chunks, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t e = i / chunks, j0 = i % chunks * COL_CHUNK, j1 = std::min(j0 + COL_CHUNK, N);
      if (counts[e] == 0) continue;
      gemm_nt<T>(A + start[e] * K, K, counts[e], W[e], N, K, j0, j1, out + start[e] * N, N);
      for (int64_t p = start[e]; p < start[e] + counts[e]; ++p)
        for (int64_t j = j0; j < j1; ++j) {
          float v = round_to<T>(out[p * N + j]);
          if (bias != nullptr) v = round_to<T>(v + to_f((*bias)[e][j]));
          out[p * N + j] = v;
        }
    }
  });
}

template <typename T>
void fused_moe_impl(const at::Tensor& x, at::TensorList gate_up, at::TensorList down,
                    at::TensorList gate_up_bias, at::TensorList down_bias,
                    const at::Tensor& token_of, const at::Tensor& pair_weight, const std::vector<int64_t>& counts,
                    int64_t act, float alpha, float limit, const at::Tensor& out) {
  const int64_t E = static_cast<int64_t>(counts.size());
  const int64_t H = x.size(1);
  const int64_t I2 = gate_up[0].size(0), I = I2 / 2;
  const bool bias = !gate_up_bias.empty();
  std::vector<int64_t> start(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) start[e + 1] = start[e] + counts[e];
  const int64_t P = start[E];
  if (P == 0) return;
  const int64_t* tok = token_of.data_ptr<int64_t>();
  const float* w = pair_weight.data_ptr<float>();
  const T* xd = x.data_ptr<T>();
  float* od = out.data_ptr<float>();
  std::vector<const T*> w1(E), w2(E), b1(E, nullptr), b2(E, nullptr);
  for (int64_t e = 0; e < E; ++e) {
    w1[e] = gate_up[e].data_ptr<T>();
    w2[e] = down[e].data_ptr<T>();
    if (bias) {
      b1[e] = gate_up_bias[e].data_ptr<T>();
      b2[e] = down_bias[e].data_ptr<T>();
    }
  }
  const int64_t ldx = x.stride(0);
  // 1. gate_up of every pair: h [P, 2I] float32, then the activation into a [P, I] (compute dtype)
  at::Tensor xs = at::empty({P, H}, x.options());  // the pairs' token rows, grouped by expert
  T* xsd = xs.data_ptr<T>();
  at::parallel_for(0, P, 64, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) std::memcpy(xsd + p * H, xd + tok[p] * ldx, H * sizeof(T));
  });
  at::Tensor h = at::empty({P, I2}, x.options().dtype(at::kFloat));
  float* hd = h.data_ptr<float>();
  project<T>(xsd, H, w1, bias ? &b1 : nullptr, I2, start, counts, hd);
  at::Tensor a = at::empty({P, I}, x.options());
  T* ad = a.data_ptr<T>();
  at::parallel_for(0, P, 16, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) activation<T>(hd + p * I2, I, act, alpha, limit, ad + p * I);
  });
  // 2. down: y [P, H] float32 (values at the compute dtype's precision)
  at::Tensor y = at::empty({P, H}, x.options().dtype(at::kFloat));
  float* yd = y.data_ptr<float>();
  project<T>(ad, I, w2, bias ? &b2 : nullptr, H, start, counts, yd);
  // 3. combine, experts in order: out[t] += y * w (a product, then a sum: no fused multiply-add)
  const int64_t ldo = out.stride(0);
  at::parallel_for(0, H, 64, [&](int64_t c0, int64_t c1) {
    for (int64_t p = 0; p < P; ++p) {
      float* o = od + tok[p] * ldo;
      const float* yp = yd + p * H;
      const float wp = w[p];
      for (int64_t c = c0; c < c1; ++c) {
        volatile float prod = yp[c] * wp;  // rounded on its own, as torch's multiply then index_add_
        o[c] += prod;
      }
    }
  });
}

void fused_moe(const at::Tensor& x, at::TensorList gate_up, at::TensorList down, at::TensorList gate_up_bias,
               at::TensorList down_bias,
               const at::Tensor& token_of, const at::Tensor& pair_weight, at::IntArrayRef counts, int64_t act,
               double alpha, double limit, const at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "fused_moe: x must be [T, H] with contiguous rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "fused_moe: x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == x.size(0) &&
                  out.size(1) == x.size(1) && out.stride(1) == 1,
              "fused_moe: out must be float32 [T, H] with contiguous rows");
  const int64_t E = static_cast<int64_t>(counts.size());
  TORCH_CHECK(E > 0 && static_cast<int64_t>(gate_up.size()) == E && static_cast<int64_t>(down.size()) == E,
              "fused_moe: one gate_up and one down per count");
  TORCH_CHECK(gate_up_bias.size() == down_bias.size() && (gate_up_bias.empty() || (int64_t)gate_up_bias.size() == E),
              "fused_moe: biases for every expert or for none");
  TORCH_CHECK(act == 0 || act == 1, "fused_moe: act must be 0 (silu) or 1 (swigluoai)");
  const int64_t H = x.size(1), I2 = gate_up[0].size(0);
  TORCH_CHECK(I2 % 2 == 0, "fused_moe: gate_up must have 2I rows");
  for (int64_t e = 0; e < E; ++e) {
    TORCH_CHECK(gate_up[e].scalar_type() == x.scalar_type() && down[e].scalar_type() == x.scalar_type(),
                "fused_moe: expert weights must be in x's dtype");
    TORCH_CHECK(gate_up[e].is_contiguous() && gate_up[e].dim() == 2 && gate_up[e].size(0) == I2 &&
                    gate_up[e].size(1) == H,
                "fused_moe: gate_up[", e, "] must be a contiguous [2I, H]");
    TORCH_CHECK(down[e].is_contiguous() && down[e].dim() == 2 && down[e].size(0) == H && down[e].size(1) == I2 / 2,
                "fused_moe: down[", e, "] must be a contiguous [H, I]");
    if (!gate_up_bias.empty())
      TORCH_CHECK(gate_up_bias[e].is_contiguous() && gate_up_bias[e].numel() == I2 && down_bias[e].is_contiguous() &&
                      down_bias[e].numel() == H && gate_up_bias[e].scalar_type() == x.scalar_type() &&
                      down_bias[e].scalar_type() == x.scalar_type(),
                  "fused_moe: bias ", e, " must be contiguous [2I] and [H] in x's dtype");
  }
  int64_t P = 0;
  for (auto c : counts) {
    TORCH_CHECK(c >= 0, "fused_moe: negative count");
    P += c;
  }
  TORCH_CHECK(token_of.scalar_type() == at::kLong && token_of.is_contiguous() && token_of.numel() == P,
              "fused_moe: token_of must be contiguous int64 [sum(counts)]");
  TORCH_CHECK(pair_weight.scalar_type() == at::kFloat && pair_weight.is_contiguous() && pair_weight.numel() == P,
              "fused_moe: pair_weight must be contiguous float32 [sum(counts)]");
  const int64_t* tok = token_of.data_ptr<int64_t>();
  for (int64_t p = 0; p < P; ++p)
    TORCH_CHECK(tok[p] >= 0 && tok[p] < x.size(0), "fused_moe: token_of[", p, "] = ", tok[p], " is not a row of x");
  std::vector<int64_t> cv(counts.begin(), counts.end());
  if (x.scalar_type() == at::kFloat)
    fused_moe_impl<float>(x, gate_up, down, gate_up_bias, down_bias, token_of, pair_weight, cv, act, (float)alpha,
                          (float)limit, out);
  else
    fused_moe_impl<bf16>(x, gate_up, down, gate_up_bias, down_bias, token_of, pair_weight, cv, act, (float)alpha,
                         (float)limit, out);
}

// The instruction set this build uses (for the log and the tests).
std::string isa() {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return "avx512+bf16";
#elif defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "scalar";
#endif
}

// How many threads at::parallel_for runs this build's regions on: one work item per thread of
// torch's count, each noting its thread. 1 when the build lacks OpenMP (the regions then run
// serially whatever torch's thread count), so the tests can tell.
int64_t parallel_threads() {
  const int64_t n = at::get_num_threads();
  std::vector<int64_t> seen(n, 0);
  at::parallel_for(0, n, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) seen[i] = at::get_thread_num();
  });
  std::vector<bool> used(n, false);
  int64_t count = 0;
  for (int64_t t : seen)
    if (t >= 0 && t < n && !used[t]) used[t] = true, ++count;
  return count;
}

}  // namespace

TORCH_LIBRARY(moestream_cpu, m) {
  m.def("fused_moe(Tensor x, Tensor[] gate_up, Tensor[] down, Tensor[] gate_up_bias, Tensor[] down_bias, "
        "Tensor token_of, Tensor pair_weight, int[] counts, int act, float alpha, float limit, Tensor(a!) out) -> ()");
  m.def("isa() -> str", &isa);
  m.def("parallel_threads() -> int", &parallel_threads);
}

TORCH_LIBRARY_IMPL(moestream_cpu, CPU, m) { m.impl("fused_moe", &fused_moe); }
