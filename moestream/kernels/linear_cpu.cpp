// A dense linear layer on CPU in moestream's fixed summation order
// (moestream/kernels/linear.py loads and calls it):
//
//   x       [M, K]  float32 or bfloat16, contiguous rows
//   weight  [N, K]  x's dtype, contiguous (unpacked)
//   out     [M, N]  x's dtype, contiguous: out[m][n] = round(sum_k x[m][k] * weight[n][k])
//
// Each output accumulates in float32 and is rounded once to the dtype, as torch's CPU matmul
// rounds. Work items are COL_CHUNK output columns over all M rows, so the weight streams from
// memory once whatever M (a work item's columns stay in cache across its row tiles), and a
// row's result does not depend on M or the threads (gemm.h's fixed order).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "amx.h"
#include "gemm.h"

#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using namespace moestream_gemm;

template <typename T>
void linear_impl(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0), ldx = x.stride(0);
  const T* xd = x.data_ptr<T>();
  const T* wd = weight.data_ptr<T>();
  T* od = out.data_ptr<T>();
  const int64_t chunks = (N + COL_CHUNK - 1) / COL_CHUNK;
  at::parallel_for(0, chunks, 8, [&](int64_t c0, int64_t c1) {
    std::vector<float> acc(M * COL_CHUNK);
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t j0 = c * COL_CHUNK, n = std::min(N, j0 + COL_CHUNK) - j0;
      gemm_nt<T>(xd, ldx, M, wd + j0 * K, n, K, 0, n, acc.data(), COL_CHUNK);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t j = 0; j < n; ++j) od[m * N + j0 + j] = cast<T>(acc[m * COL_CHUNK + j]);
    }
  });
}

// ---- the blocked layout (float32): weight [N, K] stored as [ceil(N / 16), K / 16, 16, 16] (zero
// rows pad N), so that a block of 16 output columns streams from memory as one contiguous run
// instead of 16 rows read side by side. Each dot product is summed exactly as dot_tile sums it
// (same vectors, same order, same reduction), so the results equal `linear` on the unpacked
// weight bit for bit. AVX-512 builds only (`blocked_step` is 0 elsewhere); bf16 weights take
// the VNNI layout below instead.

int64_t blocked_step(at::ScalarType dtype) {
#if defined(__AVX512F__)
  if (dtype == at::kFloat) return STEP_F32;
#endif
  (void)dtype;
  return 0;
}

#if defined(__AVX512F__)
constexpr int64_t BLOCK = 16;  // output columns per block

// out[r][c] (R x C, row-major) for rows A[0..R) against columns c0..c0+C of one block
// `ahead`: the next block, prefetched k-step by k-step (a tile narrower than the block reads
// only part of each k-step's run, which the hardware prefetcher does not follow), or nullptr.
template <int R, int C>
inline void blocked_tile(const float* A, int64_t lda, const float* blk, int64_t c0, int64_t kb, const float* ahead,
                         float* out) {
  static_assert(R * C <= 16, "a tile is at most 16 dot products");
  constexpr int64_t S = STEP_F32;  // 16 floats: one 64-byte line
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kb; ++k) {
    const float* base = blk + (k * BLOCK + c0) * S;
    if (ahead != nullptr)
      for (int64_t c = 0; c < BLOCK; ++c)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + (k * BLOCK + c) * S), _MM_HINT_T0);
    __m512 b[C];
    for (int c = 0; c < C; ++c) b[c] = _mm512_loadu_ps(base + c * S);
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_loadu_ps(A + r * lda + k * S);
      for (int c = 0; c < C; ++c) acc[r * C + c] = _mm512_fmadd_ps(a, b[c], acc[r * C + c]);
    }
  }
  alignas(64) float sums[16];
  _mm512_store_ps(sums, reduce16(acc));
  for (int i = 0; i < R * C; ++i) out[i] = sums[4 * (i % 4) + i / 4];
}

// rows [r, r + R) of one block, in column groups of C, into od
template <int R, int C>
inline void blocked_rows(const float* xd, int64_t ldx, int64_t r, const float* blk, int64_t kb, int64_t j0,
                         int64_t ncols, const float* ahead, float* od, int64_t N) {
  float tile[16];
  for (int64_t c0 = 0; c0 < ncols; c0 += C) {
    blocked_tile<R, C>(xd + r * ldx, ldx, blk, c0, kb, C < BLOCK && c0 == 0 ? ahead : nullptr, tile);
    for (int i = 0; i < R; ++i)
      for (int64_t c = 0; c < C && c0 + c < ncols; ++c) od[(r + i) * N + j0 + c0 + c] = tile[i * C + c];
  }
}

void linear_blocked_impl(const at::Tensor& x, const at::Tensor& packed, int64_t N, const at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), ldx = x.stride(0), kb = K / STEP_F32;
  const int64_t nb = packed.size(0), block_elems = kb * BLOCK * STEP_F32;
  const float* xd = x.data_ptr<float>();
  const float* wd = packed.data_ptr<float>();
  float* od = out.data_ptr<float>();
  at::parallel_for(0, nb, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* blk = wd + b * block_elems;
      const float* next = b + 1 < nb ? blk + block_elems : nullptr;  // prefetched by the first row group
      const int64_t j0 = b * BLOCK, ncols = std::min(BLOCK, N - j0);
      int64_t r = 0;
      for (; r + ROW_TILE <= M; r += ROW_TILE)
        blocked_rows<4, 4>(xd, ldx, r, blk, kb, j0, ncols, r == 0 ? next : nullptr, od, N);
      const float* ahead = r == 0 ? next : nullptr;
      switch (M - r) {
        case 1: blocked_rows<1, 16>(xd, ldx, r, blk, kb, j0, ncols, ahead, od, N); break;
        case 2: blocked_rows<2, 8>(xd, ldx, r, blk, kb, j0, ncols, ahead, od, N); break;
        case 3: blocked_rows<3, 4>(xd, ldx, r, blk, kb, j0, ncols, ahead, od, N); break;
        default: break;
      }
    }
  });
}
#endif

void linear_blocked(const at::Tensor& x, const at::Tensor& packed, int64_t N, const at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "linear_blocked: x must be [M, K] with contiguous rows");
  const int64_t S = blocked_step(x.scalar_type());
  TORCH_CHECK(S > 0, "linear_blocked: no blocked kernel for ", x.scalar_type(),
              " in this build (float32, AVX-512 only)");
  const int64_t K = x.size(1);
  TORCH_CHECK(packed.scalar_type() == x.scalar_type() && packed.is_contiguous() && packed.dim() == 4 &&
                  packed.size(0) == (N + 15) / 16 && packed.size(1) * S == K && packed.size(2) == 16 &&
                  packed.size(3) == S,
              "linear_blocked: packed must be a contiguous [ceil(N / 16), K / ", S, ", 16, ", S,
              "] in x's dtype (pack_blocked's layout), got ", packed.sizes());
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == x.size(0) && out.size(1) == N,
              "linear_blocked: out must be a contiguous [M, N] in x's dtype");
  if (x.size(0) == 0 || N == 0) return;
#if defined(__AVX512F__)
  linear_blocked_impl(x, packed, N, out);
#endif
}

// ---- the VNNI layout for bf16 (AVX512_BF16): weight [N, K] stored as [ceil(N / 128), K / 2, 8,
// 16, 2] (zero rows pad N): for each pair of k, 128 outputs' two values side by side, 512
// contiguous bytes. A tile keeps R rows x 128 outputs of float32 accumulators; each k pair
// broadcasts a row's two x values and `vdpbf16ps` adds both products into 16 outputs at once,
// so no sum is reduced across lanes (the layout oneDNN's bf16 kernels use). Each output
// accumulates its k pairs in order from 0, whatever the rows, tiles or threads; the sums are
// not `linear`'s (a different order), but a row's result does not depend on the batch.

bool has_vnni_bf16() {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// A bf16 output value, stored as bf16 or (out_float32) as a float32 holding the same value.
inline void store_out(bf16* p, float v) { *p = cast<bf16>(v); }
inline void store_out(float* p, float v) { *p = round_to<bf16>(v); }
#if defined(__AVX512F__)
// 16 such values (bf16 bits stored once, or float32 rounded to bf16's precision)
inline void store_rounded(bf16* p, __m512 v) { store16(p, v); }
inline void store_rounded(float* p, __m512 v) { store16(p, round16<bf16>(v)); }
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
constexpr int64_t VNNI_COLS = 128;  // outputs per super-block: 8 vectors of 16

template <int R>
inline void vnni_tile(const bf16* A, int64_t lda, const bf16* sb, int64_t pairs, float* out /* [R][128] */) {
  __m512 acc[R][8];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 8; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const bf16* line = sb + p * 2 * VNNI_COLS;
    __m512bh a[R];
    for (int r = 0; r < R; ++r) {
      int32_t two;
      std::memcpy(&two, A + r * lda + 2 * p, sizeof(two));
      a[r] = (__m512bh)_mm512_set1_epi32(two);
    }
    for (int c = 0; c < 8; ++c) {
      const __m512bh w = (__m512bh)_mm512_loadu_si512(line + c * 32);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a[r], w);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 8; ++c) _mm512_storeu_ps(out + r * VNNI_COLS + c * 16, acc[r][c]);
}

// bias: float32 [N] or nullptr, added to the float32 sums before the one rounding (as oneDNN's bias)
template <int R, typename O>
inline void vnni_rows(const bf16* xd, int64_t ldx, int64_t r, const bf16* sb, int64_t pairs, int64_t j0,
                      int64_t ncols, const float* bias, O* od, int64_t N) {
  alignas(64) float tile[R * VNNI_COLS];
  vnni_tile<R>(xd + r * ldx, ldx, sb, pairs, tile);
  for (int i = 0; i < R; ++i)
    for (int64_t c = 0; c < ncols; ++c)
      store_out(od + (r + i) * N + j0 + c,
                bias != nullptr ? tile[i * VNNI_COLS + c] + bias[j0 + c] : tile[i * VNNI_COLS + c]);
}

constexpr int64_t VNNI_ROW_CHUNK = 48;  // rows per work item (a multiple of the 3-row tile)

template <typename O>
void linear_vnni_impl(const at::Tensor& x, const at::Tensor& packed, int64_t N, const float* bias,
                      const at::Tensor& out) {
  const int64_t M = x.size(0), ldx = x.stride(0), pairs = x.size(1) / 2, nsb = packed.size(0);
  const int64_t sb_elems = pairs * 2 * VNNI_COLS, chunks = (M + VNNI_ROW_CHUNK - 1) / VNNI_ROW_CHUNK;
  const bf16* xd = x.data_ptr<bf16>();
  const bf16* wd = packed.data_ptr<bf16>();
  O* od = out.data_ptr<O>();
  // work items: (super-block, chunk of rows), super-block major, so that a narrow weight
  // (few super-blocks) still spreads a prefill's rows over the threads
  at::parallel_for(0, nsb * chunks, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / chunks, r0 = i % chunks * VNNI_ROW_CHUNK, r1 = std::min(M, r0 + VNNI_ROW_CHUNK);
      const bf16* sb = wd + b * sb_elems;
      const int64_t j0 = b * VNNI_COLS, ncols = std::min(VNNI_COLS, N - j0);
      int64_t r = r0;
      for (; r + 3 <= r1; r += 3) vnni_rows<3, O>(xd, ldx, r, sb, pairs, j0, ncols, bias, od, N);
      if (r1 - r == 2) vnni_rows<2, O>(xd, ldx, r, sb, pairs, j0, ncols, bias, od, N);
      if (r1 - r == 1) vnni_rows<1, O>(xd, ldx, r, sb, pairs, j0, ncols, bias, od, N);
    }
  });
}

#if defined(MOESTREAM_AMX)
// The same layout through AMX tiles. A pass computes 32 rows x 32 outputs in four C tiles: two
// A tiles (16 rows x 32 k each, read from x in place) times two B tiles (16 pairs of one
// 16-output group, stride 512 bytes in the layout), so each tile loaded serves two products.
// A work item is a super-block's 128 outputs over up to AMX_ROW_CHUNK rows, taken 32 outputs
// at a time across all its rows: those outputs' weights (32 x K bf16: 32 KiB at K = 512) stay
// in L1 while the rows stream from L2 (one A tile against four B tiles, the weights streaming
// from L2, was measured slower; so was writing a pass's outputs during the next pass's
// steps). Needs K a multiple of 32 (whole A tiles). Each output adds its k pairs in order, as
// TDPBF16PS adds them, whatever the rows around it: a row's result does not depend on M.
constexpr int64_t AMX_ROW_CHUNK = 256;  // rows per work item (a multiple of the 32-row pass)

template <typename O>
void linear_vnni_amx_impl(const at::Tensor& x, const at::Tensor& packed, int64_t N, const float* bias,
                          const at::Tensor& out) {
  using moestream_amx::configure;
  using moestream_amx::TileShape;
  const int64_t M = x.size(0), ldx = x.stride(0), pairs = x.size(1) / 2, nsb = packed.size(0);
  const int64_t sb_elems = pairs * 2 * VNNI_COLS, chunks = (M + AMX_ROW_CHUNK - 1) / AMX_ROW_CHUNK;
  const int64_t line = 2 * VNNI_COLS;  // elements per pair: 128 outputs x 2
  const bf16* xd = x.data_ptr<bf16>();
  const bf16* wd = packed.data_ptr<bf16>();
  O* od = out.data_ptr<O>();
  at::parallel_for(0, nsb * chunks, 1, [&](int64_t i0, int64_t i1) {
    alignas(64) float buf[4][16 * 16];
    int64_t shape = -1;  // the rows the tiles are configured for (m1 * 17 + m2)
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / chunks, r0 = i % chunks * AMX_ROW_CHUNK, r1 = std::min(M, r0 + AMX_ROW_CHUNK);
      const bf16* sb = wd + b * sb_elems;
      const int64_t j0 = b * VNNI_COLS, ncols = std::min(VNNI_COLS, N - j0);
      for (int64_t g = 0; g * 32 < ncols; ++g) {  // 32 outputs: groups 2g and 2g + 1
        const bf16* b0 = sb + g * 64;
        for (int64_t rb = r0; rb < r1; rb += 32) {
          const int64_t m1 = std::min<int64_t>(16, r1 - rb), m2 = std::min<int64_t>(16, std::max<int64_t>(0, r1 - rb - 16));
          if (m1 * 17 + m2 != shape) {
            const int a1 = static_cast<int>(m1), a2 = static_cast<int>(m2);
            if (m2 > 0)
              configure({TileShape{0, a1, 64}, {1, a2, 64}, {2, 16, 64}, {3, 16, 64}, {4, a1, 64}, {5, a1, 64},
                         {6, a2, 64}, {7, a2, 64}});
            else
              configure({TileShape{0, a1, 64}, {2, 16, 64}, {3, 16, 64}, {4, a1, 64}, {5, a1, 64}});
            shape = m1 * 17 + m2;
          }
          const bf16* a = xd + rb * ldx;
          _tile_zero(4);
          _tile_zero(5);
          if (m2 > 0) {
            _tile_zero(6);
            _tile_zero(7);
          }
          for (int64_t q = 0; q < pairs / 16; ++q) {
            const bf16* bq = b0 + q * 16 * line;
            _tile_loadd(2, bq, line * 2);
            _tile_loadd(3, bq + 32, line * 2);
            _tile_loadd(0, a + 32 * q, ldx * 2);
            _tile_dpbf16ps(4, 0, 2);
            _tile_dpbf16ps(5, 0, 3);
            if (m2 > 0) {  // the second 16 rows (tiles 1, 6, 7 are configured only then)
              _tile_loadd(1, a + 16 * ldx + 32 * q, ldx * 2);
              _tile_dpbf16ps(6, 1, 2);
              _tile_dpbf16ps(7, 1, 3);
            }
          }
          _tile_stored(4, buf[0], 64);
          _tile_stored(5, buf[1], 64);
          if (m2 > 0) {
            _tile_stored(6, buf[2], 64);
            _tile_stored(7, buf[3], 64);
          }
          const int64_t c32 = j0 + g * 32;
          if (std::is_same<O, bf16>::value && c32 + 32 <= j0 + ncols) {
            // both tiles' 32 outputs of a row as one 64-byte store: each value's bf16 bits (the
            // same rounding), the two tiles' halves interleaved back into column order
            const __m512i idx = _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32, 30,
                                                 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
            const __m512 b0 = bias != nullptr ? _mm512_loadu_ps(bias + c32) : _mm512_setzero_ps();
            const __m512 b1 = bias != nullptr ? _mm512_loadu_ps(bias + c32 + 16) : _mm512_setzero_ps();
            for (int64_t half = 0; half < (m2 > 0 ? 2 : 1); ++half) {
              const float* t0 = buf[2 * half];
              const float* t1 = buf[2 * half + 1];
              const int64_t m = half == 0 ? m1 : m2, rr = rb + 16 * half;
              for (int64_t r = 0; r < m; ++r) {
                __m512 v0 = _mm512_load_ps(t0 + r * 16), v1 = _mm512_load_ps(t1 + r * 16);
                if (bias != nullptr) v0 = _mm512_add_ps(v0, b0), v1 = _mm512_add_ps(v1, b1);
                const __m512i w = _mm512_permutex2var_epi16(to_bf16_bits32(v0), idx, to_bf16_bits32(v1));
                _mm512_storeu_si512(reinterpret_cast<void*>(od + (rr + r) * N + c32), w);
              }
            }
            continue;
          }
          for (int64_t tile = 0; tile < (m2 > 0 ? 4 : 2); ++tile) {
            const int64_t m = tile < 2 ? m1 : m2, rr = rb + 16 * (tile / 2);
            const int64_t c0 = j0 + g * 32 + 16 * (tile % 2), cn = std::min<int64_t>(16, j0 + ncols - c0);
            if (cn <= 0) continue;
            const float* t = buf[tile];
            for (int64_t r = 0; r < m; ++r) {
              if (cn == 16) {  // 16 at a time: the same additions and rounding
                __m512 v = _mm512_load_ps(t + r * 16);
                if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + c0));
                store_rounded(od + (rr + r) * N + c0, v);
              } else {
                for (int64_t c = 0; c < cn; ++c)
                  store_out(od + (rr + r) * N + c0 + c, bias != nullptr ? t[r * 16 + c] + bias[c0 + c] : t[r * 16 + c]);
              }
            }
          }
        }
      }
    }
    _tile_release();
  });
}
#endif
#endif

bool has_amx() { return moestream_amx::available(); }

void linear_vnni(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias,
                 bool amx, const at::Tensor& out) {
  TORCH_CHECK(has_vnni_bf16(), "linear_vnni: this build has no AVX512_BF16");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16,
              "linear_vnni: x must be a bfloat16 [M, K] with contiguous rows");
  const int64_t K = x.size(1);
  TORCH_CHECK(K % 2 == 0 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() && packed.dim() == 5 &&
                  packed.size(0) == (N + 127) / 128 && packed.size(1) * 2 == K && packed.size(2) == 8 &&
                  packed.size(3) == 16 && packed.size(4) == 2,
              "linear_vnni: packed must be a contiguous bfloat16 [ceil(N / 128), K / 2, 8, 16, 2] (pack_vnni's "
              "layout), got ", packed.sizes());
  TORCH_CHECK((out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat) && out.is_contiguous() &&
                  out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == N,
              "linear_vnni: out must be a contiguous bfloat16 or float32 [M, N]");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == N && bias->is_floating_point()),
              "linear_vnni: bias must be a float [", N, "]");
  if (x.size(0) == 0 || N == 0) return;
  const at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  TORCH_CHECK(!amx || (has_amx() && K % 32 == 0), "linear_vnni: AMX needs AMX-BF16 and K a multiple of 32");
  const float* bd = b.defined() ? b.data_ptr<float>() : nullptr;
  const bool f32 = out.scalar_type() == at::kFloat;
#if defined(MOESTREAM_AMX)
  if (amx) return f32 ? linear_vnni_amx_impl<float>(x, packed, N, bd, out)
                      : linear_vnni_amx_impl<bf16>(x, packed, N, bd, out);
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if (f32)
    linear_vnni_impl<float>(x, packed, N, bd, out);
  else
    linear_vnni_impl<bf16>(x, packed, N, bd, out);
#endif
  (void)f32;
}

void linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "linear: x must be [M, K] with contiguous rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "linear: x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.dim() == 2 && weight.is_contiguous() &&
                  weight.size(1) == x.size(1) && weight.layout() == at::kStrided,
              "linear: weight must be a contiguous [N, K] strided tensor in x's dtype");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == x.size(0) && out.size(1) == weight.size(0),
              "linear: out must be a contiguous [M, N] in x's dtype");
  if (x.size(0) == 0 || weight.size(0) == 0) return;
  if (x.scalar_type() == at::kFloat)
    linear_impl<float>(x, weight, out);
  else
    linear_impl<at::BFloat16>(x, weight, out);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moestream_cpu, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor(a!) out) -> ()");
  m.def("linear_blocked(Tensor x, Tensor packed, int N, Tensor(a!) out) -> ()");
  m.def("blocked_step(ScalarType dtype) -> int", &blocked_step);
  m.def("linear_vnni(Tensor x, Tensor packed, int N, Tensor? bias, bool amx, Tensor(a!) out) -> ()");
  m.def("has_amx() -> bool", &has_amx);
  m.def("has_vnni_bf16() -> bool", &has_vnni_bf16);
}

TORCH_LIBRARY_IMPL(moestream_cpu, CPU, m) {
  m.impl("linear", &linear);
  m.impl("linear_blocked", &linear_blocked);
  m.impl("linear_vnni", &linear_vnni);
}
