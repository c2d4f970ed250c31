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
// fused_moe_int takes the expert matrices as weight-only integers instead (IntMatrix below),
// dequantized a work item's rows at a time into a scratch, then the same dot products.
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
// chosen by the compiler flags (-march=native: one build per CPU). bf16 with `amx` (AMX-BF16
// builds; a projection whose K and N are multiples of 32): its dot products through AMX tiles
// (amx_cols32), each output still summing its k pairs in order whatever the rows around it.
// SwiGLU on AMX (H and I multiples of 32) runs in two passes, the activation in gate_up's
// epilogue and the combine in down's (amx_swiglu_group): the same ops, the same bits.
// The SwiGLU, roundings and combine run 16 lanes at a time with AVX-512 (exp as exp512, within
// 1e-7 of expf). Experts run in groups of about GROUP_PAIRS pairs, one after another.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx.h"
#include "gemm.h"

namespace {

using namespace moestream_gemm;


inline float sigmoid(float v) { return 1.f / (1.f + std::exp(-v)); }

#if defined(__AVX512F__)
// SwiGLU for 16 lanes: silu(g) rounded to the compute dtype, times u (to be rounded by the
// caller's store); g and u already at the dtype's precision. exp512: within 1e-7 of expf.
template <typename T>
inline __m512 silu_mul16(__m512 g, __m512 u) {
  const __m512 one = _mm512_set1_ps(1.f);
  return _mm512_mul_ps(round16<T>(_mm512_div_ps(g, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))))), u);
}
#endif

// One pair's gated activation: h [2I] (float32 values at the compute dtype's precision) -> a [I].
template <typename T>
void activation(const float* h, int64_t I, int64_t act, float alpha, float limit, T* a) {
  if (act == 0) {  // SwiGLU: silu(gate) * up, gate = h[:I], up = h[I:]
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= I; i += 16)  // 16 at a time, the same ops and roundings
      store16(a + i, silu_mul16<T>(_mm512_loadu_ps(h + i), _mm512_loadu_ps(h + I + i)));
#endif
    for (; i < I; ++i) {
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

// An expert matrix [N, K] stored as integers, weight-only quantized (compressed-tensors'
// int-quantized / pack-quantized layouts): value q of row n, column k, then
// W[n][k] = (q - zero[n][g]) * scale[n][g] in float32, g = k / group_size, rounded once to the
// compute dtype -- the dequantization moestream's PyTorch path does (quantization/
// compressed_tensors.py, then .to(dtype)), so a dequantized row equals that path's row bit for bit.
//   bits 8: one byte per value, read as int8 after XOR with `flip` (0 for int8 storage,
//           0x80 for pack-quantized's unsigned bytes offset by 128);
//   bits 4: two values per byte, low nibble first, each minus 8 (pack-quantized int4).
// A matrix may come in `blocks` row blocks of equal height (gate and up stored apart).
struct IntMatrix {
  const uint8_t* q[2];
  int64_t ldq[2];  // bytes per row
  const float* scale[2];  // [rows, G]
  const float* zero[2];  // [rows, G], or null (symmetric)
  int64_t block_rows;
  int64_t group_size;  // columns per scale (K: one scale per row)
  int64_t groups;  // G = ceil(K / group_size)
};

struct IntFormat {
  int64_t bits, flip;
};

#if defined(__AVX512F__)
// 16 consecutive values from column k (k even for 4 bits) as int32 lanes.
inline __m512i load_q16(const uint8_t* row, int64_t k, const IntFormat& f) {
  if (f.bits == 8) {
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k));
    b = _mm_xor_si128(b, _mm_set1_epi8(static_cast<char>(f.flip)));
    return _mm512_cvtepi8_epi32(b);
  }
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k / 2));
  const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0F));
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
  const __m512i v = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));  // low nibble first
  return _mm512_sub_epi32(v, _mm512_set1_epi32(8));
}
#endif

inline int32_t q_at(const uint8_t* row, int64_t k, const IntFormat& f) {
  if (f.bits == 8) return static_cast<int8_t>(row[k] ^ static_cast<uint8_t>(f.flip));
  const uint8_t b = row[k / 2];
  return static_cast<int32_t>((k & 1) ? (b >> 4) : (b & 0x0F)) - 8;
}

// Rows [r0, r1) of `m` dequantized into dst [(r1 - r0), K] of the compute dtype.
template <typename T>
void dequant_rows(const IntMatrix& m, const IntFormat& f, int64_t r0, int64_t r1, int64_t K, T* dst) {
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t b = r / m.block_rows, rr = r % m.block_rows;
    const uint8_t* row = m.q[b] + rr * m.ldq[b];
    const float* sc = m.scale[b] + rr * m.groups;
    const float* zp = m.zero[b] != nullptr ? m.zero[b] + rr * m.groups : nullptr;
    T* out = dst + (r - r0) * K;
    for (int64_t g = 0; g < m.groups; ++g) {
      const int64_t k0 = g * m.group_size, k1 = std::min(K, k0 + m.group_size);
      const float s = sc[g], z = zp != nullptr ? zp[g] : 0.f;
      int64_t k = k0;
#if defined(__AVX512F__)
      if (f.bits == 8 || k0 % 2 == 0) {
        const __m512 vs = _mm512_set1_ps(s), vz = _mm512_set1_ps(z);
        for (; k + 16 <= k1; k += 16) {
          __m512 q = _mm512_cvtepi32_ps(load_q16(row, k, f));
          if (zp != nullptr) q = _mm512_sub_ps(q, vz);
          store16(out + k, _mm512_mul_ps(q, vs));  // (q - z) * s: two roundings, as torch
        }
      }
#endif
      for (; k < k1; ++k) {
        out[k] = cast<T>((static_cast<float>(q_at(row, k, f)) - z) * s);  // no contraction: -ffp-contract=off
      }
    }
  }
}

// Where project reads expert e's weight rows: dense [N, K] in the compute dtype, or integers
// dequantized a work item's rows at a time into a scratch that stays in cache.
template <typename T>
struct Weights {
  const std::vector<const T*>* dense = nullptr;
  const std::vector<IntMatrix>* ints = nullptr;
  IntFormat format{};
};

#if defined(MOESTREAM_AMX)
// The rows of A [P, K] (grouped by expert) as AMX B operands: expert e's rows in blocks of
// 16, a block [K / 2 pairs][16 rows][2] bf16, the first of expert e's at first[e] (rows past
// an expert's count are left unset: a tile configured for m rows never reads them).
// `tok`: when given, row r is A's row tok[r] (row stride K) instead of row r.
at::Tensor pack_row_pairs(const bf16* A, int64_t K, const std::vector<int64_t>& start,
                          const std::vector<int64_t>& counts, std::vector<int64_t>& first,
                          const int64_t* tok = nullptr, int64_t lda = 0) {
  const int64_t E = static_cast<int64_t>(counts.size());
  first.assign(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) first[e + 1] = first[e] + (counts[e] + 15) / 16;
  at::Tensor packed = at::empty({std::max<int64_t>(first[E], 1) * 16 * K}, at::kBFloat16);
  bf16* pd = packed.data_ptr<bf16>();
  std::vector<int64_t> expert_of(first[E]);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t b = first[e]; b < first[e + 1]; ++b) expert_of[b] = e;
  at::parallel_for(0, first[E], 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t e = expert_of[b], r0 = start[e] + (b - first[e]) * 16;
      const int64_t m = std::min<int64_t>(16, start[e] + counts[e] - r0);
      int32_t* dst = reinterpret_cast<int32_t*>(pd + b * 16 * K);  // one int32 = one pair
      // 16 pairs of the 16 rows at a time, transposed as floats (the bits move unchanged);
      // rows past m repeat row 0 (never read)
      const float* src[16];
      for (int64_t t = 0; t < 16; ++t) {
        const int64_t r = r0 + (t < m ? t : 0);
        src[t] = reinterpret_cast<const float*>(A + (tok != nullptr ? tok[r] * lda : r * K));
      }
      for (int64_t k = 0; k < K / 2; k += 16) {
        __m512 v[16];
        for (int t = 0; t < 16; ++t) v[t] = _mm512_loadu_ps(src[t] + k);
        transpose16x16(v);
        for (int j = 0; j < 16; ++j) _mm512_storeu_ps(reinterpret_cast<float*>(dst + (k + j) * 16), v[j]);
      }
    }
  });
  return packed;
}

// The next work item's weights, asked into L2 a slice per k step of this one (its first row
// block would otherwise wait on memory: a prefill layer's experts are read once, from DRAM):
// two blocks of 16 rows of K values at r0 and r1, row stride ld; r0 null: nothing.
struct Ahead {
  const bf16* r0 = nullptr;
  const bf16* r1 = nullptr;
  int64_t ld = 0;
};

// Work items of fewer rows ask for nothing ahead: their k steps are too few to spread the
// next item's lines over, and the hardware's prefetch keeps up there (decode: 64 tokens of
// `medium`, 8 rows an expert, read 24.0 GB/s with it against 24.8 without).
constexpr int64_t AHEAD_MIN_ROWS = 64;

// The first work item after i, before end, whose expert has rows (items: expert i / chunks);
// -1 when none.
inline int64_t next_item(int64_t i, int64_t end, const std::vector<int64_t>& counts, int64_t chunks) {
  for (int64_t n = i + 1; n < end; ++n)
    if (counts[n / chunks] > 0) return n;
  return -1;
}

// The n rows of one expert (their blocks at xb) against 32 weight rows, 16 at a0 and 16 at a1
// (row stride ldw): the weights are the A tiles (16 rows x 32 k each), the rows the B tiles, so
// a C tile [16 weight rows, m rows] holds outputs transposed. Rows go 32 at a time (two B
// tiles, four C tiles: each weight tile loaded serves both), the weights read in place.
// (Copying them first into contiguous tiles, against the 16 rows' 4 KiB stride at K = 2048,
// was measured slower: past 32 rows they come from L2 either way.)
// The epilogue comes in `units` pieces, unit(buf, rb, m1, m2, u) for u < units, and a 32-row
// block's pieces run during the next block's k steps (the last block's after its own), so the
// vector units write one block's outputs while the tiles compute the next (run after each
// block, the epilogues took ~40% of a prefill layer). buf holds the C tiles as stored: buf[0]
// = a0's rows x rows rb..rb+m1, buf[1] = a1's x the same rows, buf[2] and buf[3] the same for
// rows rb+16..rb+16+m2 (m2 = 0: absent); row c of a tile holds weight row c's outputs for the
// tile's rows, one per lane (lanes past m hold stale values). `shape`: the row counts the
// thread's tiles are configured for (-1: none yet).
template <typename Unit>
void amx_rows(const bf16* xb, int64_t n, int64_t K, const bf16* a0, const bf16* a1, int64_t ldw, int64_t& shape,
              int64_t units, Unit&& unit, const Ahead& ahead = Ahead{}) {
  alignas(64) float buf[2][4][16 * 16];
  int64_t prev_rb = -1, prev_m1 = 0, prev_m2 = 0, flip = 0;
  const int64_t steps = K / 32, per_step = (units + steps - 1) / steps;
  // the lines to prefetch (32 rows of K bf16), spread over every k step of every row block
  const int64_t row_lines = (K * 2 + 63) / 64, lines = ahead.r0 != nullptr ? 32 * row_lines : 0;
  const int64_t total = (n + 31) / 32 * steps;
  int64_t done = 0, step = 0;
  for (int64_t rb = 0; rb < n; rb += 32) {
    const int64_t m1 = std::min<int64_t>(16, n - rb), m2 = std::min<int64_t>(16, std::max<int64_t>(0, n - rb - 16));
    if (m1 * 17 + m2 != shape) {
      const int c1 = static_cast<int>(m1 * 4), c2 = static_cast<int>(m2 * 4);
      using moestream_amx::TileShape;
      if (m2 > 0)
        moestream_amx::configure({TileShape{0, 16, 64}, {1, 16, 64}, {2, 16, c1}, {3, 16, c2}, {4, 16, c1},
                                  {5, 16, c1}, {6, 16, c2}, {7, 16, c2}});
      else
        moestream_amx::configure({TileShape{0, 16, 64}, {1, 16, 64}, {2, 16, c1}, {4, 16, c1}, {5, 16, c1}});
      shape = m1 * 17 + m2;
    }
    const bf16* b1 = xb + rb * K;  // blocks rb / 16 and rb / 16 + 1, 16 * K elements each
    const bf16* b2 = b1 + 16 * K;
    _tile_zero(4);
    _tile_zero(5);
    if (m2 > 0) {
      _tile_zero(6);
      _tile_zero(7);
    }
    const float (*pb)[256] = buf[flip ^ 1];
    for (int64_t q = 0; q < steps; ++q) {
      _tile_loadd(0, a0 + 32 * q, ldw * 2);
      _tile_loadd(1, a1 + 32 * q, ldw * 2);
      _tile_loadd(2, b1 + q * 512, 64);
      _tile_dpbf16ps(4, 0, 2);
      _tile_dpbf16ps(5, 1, 2);
      if (m2 > 0) {  // the second row block (tiles 3, 6, 7 are configured only then)
        _tile_loadd(3, b2 + q * 512, 64);
        _tile_dpbf16ps(6, 0, 3);
        _tile_dpbf16ps(7, 1, 3);
      }
      if (prev_rb >= 0)
        for (int64_t u = q * per_step; u < std::min(units, (q + 1) * per_step); ++u) unit(pb, prev_rb, prev_m1, prev_m2, u);
      for (const int64_t until = lines * ++step / total; done < until; ++done) {
        const int64_t row = done / row_lines;
        const bf16* base = (row < 16 ? ahead.r0 : ahead.r1) + (row % 16) * ahead.ld;
        _mm_prefetch(reinterpret_cast<const char*>(base) + (done % row_lines) * 64, _MM_HINT_T1);
      }
    }
    _tile_stored(4, buf[flip][0], 64);
    _tile_stored(5, buf[flip][1], 64);
    if (m2 > 0) {
      _tile_stored(6, buf[flip][2], 64);
      _tile_stored(7, buf[flip][3], 64);
    }
    prev_rb = rb, prev_m1 = m1, prev_m2 = m2, flip ^= 1;
  }
  if (prev_rb >= 0)
    for (int64_t u = 0; u < units; ++u) unit(buf[flip ^ 1], prev_rb, prev_m1, prev_m2, u);
}

// The 16 rows' outputs of C tile `tile` (buf as amx_rows gives it) in v[t] (16 outputs of row t),
// transposed in registers, rounded to bf16 (and `bias`'s 16 values, when given, added and
// rounded again), as `project` rounds the other paths' outputs.
inline void tile_rows(const float (*buf)[256], int64_t tile, const bf16* bias, __m512* v) {
  for (int c = 0; c < 16; ++c) v[c] = _mm512_load_ps(buf[tile] + c * 16);
  transpose16x16(v);
  const __m512 b = bias != nullptr ? load16(bias) : _mm512_setzero_ps();
  for (int t = 0; t < 16; ++t) {
    v[t] = round16<bf16>(v[t]);
    if (bias != nullptr) v[t] = round16<bf16>(_mm512_add_ps(v[t], b));
  }
}

// out[p][j] (float32, row stride ldo) for the n rows of one expert (their blocks at xb) and
// 32 consecutive weight rows W (row stride ldw): the outputs rounded to bf16 (and `bias`'s 32
// values, when given, added and rounded again), as `project` rounds the other paths' outputs.
void amx_cols32(const bf16* xb, int64_t n, int64_t K, const bf16* W, int64_t ldw, const bf16* bias, float* out,
                int64_t ldo, int64_t& shape, const Ahead& ahead) {
  amx_rows(xb, n, K, W, W + 16 * ldw, ldw, shape, 4,
                      [&](const float (*buf)[256], int64_t rb, int64_t m1, int64_t m2, int64_t tile) {
                        // C tile [16 columns][m rows] transposed in registers into the rows' outputs
                        if (tile >= 2 && m2 == 0) return;
                        const int64_t m = tile < 2 ? m1 : m2, r0 = rb + 16 * (tile / 2), c0 = 16 * (tile % 2);
                        __m512 v[16];
                        tile_rows(buf, tile, bias != nullptr ? bias + c0 : nullptr, v);
                        for (int64_t t = 0; t < m; ++t) _mm512_storeu_ps(out + (r0 + t) * ldo + c0, v[t]);
                      }, ahead);
}
#endif

constexpr int64_t ITEM_COST = 8;  // a work item's fixed cost, in rows (its 32 weight rows streamed)

// Boundaries [b_0 = 0, ..., b_n = E * chunks] of n contiguous ranges of work items (item i:
// expert i / chunks) with about equal sums of ITEM_COST + counts[expert] over their items.
std::vector<int64_t> balanced_ranges(const std::vector<int64_t>& counts, int64_t chunks, int64_t n) {
  const int64_t E = static_cast<int64_t>(counts.size());
  int64_t total = 0;
  for (int64_t e = 0; e < E; ++e) total += counts[e] > 0 ? chunks * (ITEM_COST + counts[e]) : 0;
  n = std::max<int64_t>(1, std::min(n, E * chunks));
  std::vector<int64_t> bounds{0};
  int64_t acc = 0;
  for (int64_t i = 0; i < E * chunks && static_cast<int64_t>(bounds.size()) < n; ++i) {
    const int64_t c = counts[i / chunks];
    acc += c > 0 ? ITEM_COST + c : 0;
    if (acc * n >= total * static_cast<int64_t>(bounds.size())) bounds.push_back(i + 1);
  }
  while (static_cast<int64_t>(bounds.size()) < n) bounds.push_back(E * chunks);
  bounds.push_back(E * chunks);
  return bounds;
}

// One projection of every expert's rows: out[p] (float32 [P, N], values at the compute
// dtype's precision) = round(A[p] . W_e) (+ bias_e, rounded again) for the pairs p of expert
// e, A [P, K] grouped by expert (start[e], counts[e]), W_e [N, K]. Work items: (expert,
// COL_CHUNK columns). A dot product sums the same whether its row was read in place or
// dequantized into the scratch (its order depends only on K). amx (bf16, K and N multiples of
// 32): the dot products through AMX tiles (amx_cols32) instead of gemm.h's, each as
// batch-invariant.
template <typename T>
void project(const T* A, int64_t K, const Weights<T>& W, const std::vector<const T*>* bias, int64_t N,
             const std::vector<int64_t>& start, const std::vector<int64_t>& counts, bool amx, float* out) {
  const int64_t E = static_cast<int64_t>(counts.size());
  const int64_t chunks = (N + COL_CHUNK - 1) / COL_CHUNK;
#if defined(MOESTREAM_AMX)
  static_assert(COL_CHUNK == 32, "amx_cols32 computes 32 columns");
  amx = amx && std::is_same<T, bf16>::value && K % 32 == 0 && N % 32 == 0;
  std::vector<int64_t> first;
  at::Tensor pairs;
  if (amx) pairs = pack_row_pairs(reinterpret_cast<const bf16*>(A), K, start, counts, first);
#else
  amx = false;
#endif
  // Work items in expert-major order, split into one contiguous range per thread of about equal
  // cost (a work item's cost: its weight rows streamed plus its rows computed, ITEM_COST + rows),
  // since routing is uneven and an equal count of items left one thread idle half the time.
  const std::vector<int64_t> bounds = balanced_ranges(counts, chunks, at::get_num_threads());
  at::parallel_for(0, static_cast<int64_t>(bounds.size()) - 1, 1, [&](int64_t t0, int64_t t1) {
    std::vector<T> scratch(W.ints != nullptr ? COL_CHUNK * K : 0);
    int64_t shape = -1;
    for (int64_t i = bounds[t0]; i < bounds[t1]; ++i) {
      const int64_t e = i / chunks, j0 = i % chunks * COL_CHUNK, j1 = std::min(j0 + COL_CHUNK, N);
      if (counts[e] == 0) continue;
      const T* rows = W.ints != nullptr ? nullptr : (*W.dense)[e] + j0 * K;
      if (W.ints != nullptr) {
        dequant_rows<T>((*W.ints)[e], W.format, j0, j1, K, scratch.data());
        rows = scratch.data();
      }
#if defined(MOESTREAM_AMX)
      if (amx) {
        const bf16* b = bias != nullptr ? reinterpret_cast<const bf16*>((*bias)[e]) + j0 : nullptr;
        Ahead ahead;  // the thread's next work item's 32 weight rows (dense weights only)
        const int64_t n = counts[e] >= AHEAD_MIN_ROWS && W.dense != nullptr ? next_item(i, bounds[t1], counts, chunks) : -1;
        if (n >= 0) {
          const bf16* r = reinterpret_cast<const bf16*>((*W.dense)[n / chunks]) + n % chunks * COL_CHUNK * K;
          ahead = Ahead{r, r + 16 * K, K};
        }
        amx_cols32(pairs.data_ptr<bf16>() + first[e] * 16 * K, counts[e], K, reinterpret_cast<const bf16*>(rows), K,
                   b, out + start[e] * N + j0, N, shape, ahead);
        continue;  // rounded (and biased) there
      } else
#endif
      if (W.ints != nullptr) {
        gemm_nt<T>(A + start[e] * K, K, counts[e], rows, j1 - j0, K, 0, j1 - j0, out + start[e] * N + j0, N);
      } else {  // read in place, prefetching into the next work item's columns
        gemm_nt<T>(A + start[e] * K, K, counts[e], (*W.dense)[e], N, K, j0, j1, out + start[e] * N, N);
      }
      if (std::is_same<T, float>::value && bias == nullptr) continue;  // float32: already at its precision
      for (int64_t p = start[e]; p < start[e] + counts[e]; ++p) {
        int64_t j = j0;
#if defined(__AVX512F__)
        for (; j + 16 <= j1; j += 16) {
          __m512 v = round16<T>(_mm512_loadu_ps(out + p * N + j));
          if (bias != nullptr) v = round16<T>(_mm512_add_ps(v, load16((*bias)[e] + j)));
          _mm512_storeu_ps(out + p * N + j, v);
        }
#endif
        for (; j < j1; ++j) {
          float v = round_to<T>(out[p * N + j]);
          if (bias != nullptr) v = round_to<T>(v + to_f((*bias)[e][j]));
          out[p * N + j] = v;
        }
      }
    }
#if defined(MOESTREAM_AMX)
    if (shape >= 0) _tile_release();
#endif
  });
}

#if defined(MOESTREAM_AMX)
// SwiGLU's a = silu(g) * u for 16 rows at once: g and u (16 lanes, one per row) as the C tiles
// hold them, rounded to bf16, each bias (when given) added and rounded again, then the
// activation's ops and roundings as `activation` does them; returns a's bf16 bits, one per
// 32-bit lane.
inline __m512i swiglu16(const float* g_acc, const float* u_acc, const bf16* g_bias, const bf16* u_bias) {
  __m512 g = round16<bf16>(_mm512_load_ps(g_acc)), u = round16<bf16>(_mm512_load_ps(u_acc));
  if (g_bias != nullptr) {
    g = round16<bf16>(_mm512_add_ps(g, _mm512_set1_ps(static_cast<float>(*g_bias))));
    u = round16<bf16>(_mm512_add_ps(u, _mm512_set1_ps(static_cast<float>(*u_bias))));
  }
  return to_bf16_bits32(silu_mul16<bf16>(g, u));
}

// One group's experts, bf16 SwiGLU (gate rows then up rows) on AMX, in two passes instead of
// project / activation / project / combine, with the same ops and roundings (the outputs are
// theirs bit for bit):
// 1. gate_up + activation: work items (expert, 16 of I): the 16 gate rows j0.. and the 16 up
//    rows I + j0.. are one amx_rows pass, so a C tile pair holds g and u of the same 16
//    columns and rows; the epilogue writes a = silu(g) * u straight into down's packed row
//    pairs (no [n, 2I] float32 buffer, no activation pass, no second packing).
// 2. down + combine: each thread owns a range of H's 32-column chunks and runs every expert
//    over them in expert order, so its epilogue adds w * y into out (a product, then a sum) in
//    the order the combine did (no [n, H] buffer, no combine pass).
// Needs H and I multiples of 32. x's rows are packed in place through tok (no gather).
void amx_swiglu_group(const bf16* xd, int64_t ldx, const int64_t* tok, const float* w, const Weights<bf16>& W1,
                      const Weights<bf16>& W2, const std::vector<const bf16*>* b1,
                      const std::vector<const bf16*>* b2, int64_t H, int64_t I, const std::vector<int64_t>& start,
                      const std::vector<int64_t>& counts, float* od, int64_t ldo) {
  const int64_t E = static_cast<int64_t>(counts.size());
  std::vector<int64_t> first;
  const at::Tensor xp = pack_row_pairs(xd, H, start, counts, first, tok, ldx);
  const at::Tensor ap = at::empty({std::max<int64_t>(first[E], 1) * 16 * I}, at::kBFloat16);
  const bf16* xpd = xp.data_ptr<bf16>();
  bf16* apd = ap.data_ptr<bf16>();
  const int64_t chunks1 = I / 16;
  const std::vector<int64_t> bounds = balanced_ranges(counts, chunks1, at::get_num_threads());
  at::parallel_for(0, static_cast<int64_t>(bounds.size()) - 1, 1, [&](int64_t t0, int64_t t1) {
    std::vector<bf16> scratch(W1.ints != nullptr ? 32 * H : 0);
    int64_t shape = -1;
    for (int64_t i = bounds[t0]; i < bounds[t1]; ++i) {
      const int64_t e = i / chunks1, j0 = i % chunks1 * 16;
      if (counts[e] == 0) continue;
      const bf16 *g, *u;
      if (W1.ints != nullptr) {
        dequant_rows<bf16>((*W1.ints)[e], W1.format, j0, j0 + 16, H, scratch.data());
        dequant_rows<bf16>((*W1.ints)[e], W1.format, I + j0, I + j0 + 16, H, scratch.data() + 16 * H);
        g = scratch.data(), u = scratch.data() + 16 * H;
      } else {
        g = (*W1.dense)[e] + j0 * H, u = g + I * H;
      }
      const bf16* gb = b1 != nullptr ? (*b1)[e] + j0 : nullptr;
      const bf16* ub = b1 != nullptr ? (*b1)[e] + I + j0 : nullptr;
      // down's B operand: expert e's blocks of 16 rows, [I / 2 pairs][16 rows] int32 each
      int32_t* dst = reinterpret_cast<int32_t*>(apd + first[e] * 16 * I);
      Ahead ahead;  // the thread's next work item's gate and up rows (dense weights only)
      const int64_t n = counts[e] >= AHEAD_MIN_ROWS && W1.dense != nullptr ? next_item(i, bounds[t1], counts, chunks1) : -1;
      if (n >= 0) {
        const bf16* r = (*W1.dense)[n / chunks1] + n % chunks1 * 16 * H;
        ahead = Ahead{r, r + I * H, H};
      }
      amx_rows(xpd + first[e] * 16 * H, counts[e], H, g, u, H, shape, 16,
               [&](const float (*buf)[256], int64_t rb, int64_t m1, int64_t m2, int64_t unit) {
                 (void)m1;
                 const int64_t half = unit / 8, c = unit % 8 * 2;
                 if (half == 1 && m2 == 0) return;
                 const float* gt = buf[2 * half];
                 const float* ut = buf[2 * half + 1];
                 int32_t* blk = dst + (rb / 16 + half) * 8 * I + j0 / 2 * 16;
                 const __m512i lo = swiglu16(gt + c * 16, ut + c * 16, gb ? gb + c : nullptr, ub ? ub + c : nullptr);
                 const __m512i hi = swiglu16(gt + (c + 1) * 16, ut + (c + 1) * 16, gb ? gb + c + 1 : nullptr,
                                             ub ? ub + c + 1 : nullptr);
                 _mm512_storeu_si512(blk + c / 2 * 16, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
               }, ahead);
    }
    if (shape >= 0) _tile_release();
  });
  at::parallel_for(0, H / 32, 1, [&](int64_t c0, int64_t c1) {
    std::vector<bf16> scratch(W2.ints != nullptr ? 32 * I : 0);
    int64_t shape = -1;
    for (int64_t e = 0; e < E; ++e) {
      if (counts[e] == 0) continue;
      for (int64_t c = c0; c < c1; ++c) {
        const bf16* rows;
        if (W2.ints != nullptr) {
          dequant_rows<bf16>((*W2.ints)[e], W2.format, c * 32, c * 32 + 32, I, scratch.data());
          rows = scratch.data();
        } else {
          rows = (*W2.dense)[e] + c * 32 * I;
        }
        const bf16* bias = b2 != nullptr ? (*b2)[e] + c * 32 : nullptr;
        Ahead ahead;  // the next (expert, chunk)'s 32 weight rows (dense weights only)
        if (W2.dense != nullptr && counts[e] >= AHEAD_MIN_ROWS) {
          int64_t ne = e, nc = c + 1;
          if (nc == c1)
            for (ne = e + 1, nc = c0; ne < E && counts[ne] == 0; ++ne) {
            }
          if (ne < E) {
            const bf16* r = (*W2.dense)[ne] + nc * 32 * I;
            ahead = Ahead{r, r + 16 * I, I};
          }
        }
        amx_rows(apd + first[e] * 16 * I, counts[e], I, rows, rows + 16 * I, I, shape, 4,
                            [&](const float (*buf)[256], int64_t rb, int64_t m1, int64_t m2, int64_t tile) {
                              if (tile >= 2 && m2 == 0) return;
                              const int64_t m = tile < 2 ? m1 : m2, r0 = start[e] + rb + 16 * (tile / 2);
                              const int64_t col = c * 32 + 16 * (tile % 2);
                              __m512 v[16];
                              tile_rows(buf, tile, bias != nullptr ? bias + 16 * (tile % 2) : nullptr, v);
                              for (int64_t t = 0; t < m; ++t) {
                                float* o = od + tok[r0 + t] * ldo + col;
                                // a product, then a sum: two roundings (no FMA contraction), as the combine
                                _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o),
                                                                  _mm512_mul_ps(v[t], _mm512_set1_ps(w[r0 + t]))));
                              }
                            }, ahead);
      }
    }
    if (shape >= 0) _tile_release();
  });
}
#endif

// Experts are run in groups of about GROUP_PAIRS pairs (an expert with more is a group of its
// own), in order: the buffers between the projections stay a few MiB, in cache, and reused
// from the heap (whole-batch buffers of a long prefill, tens of MiB, were mapped and
// page-faulted afresh every call). The combine adds the groups' products in expert order,
// as it did all at once.
constexpr int64_t GROUP_PAIRS = 512;
// Fewer rows than this per active expert, on average, and amx_swiglu_group was slower than the
// four passes (`small`'s layer, 2 threads: 16 tokens, 2 rows an expert, 0.57 against 0.44 ms;
// 16 rows: 0.64 against 0.66; 32 rows: 0.97 against 1.03).
constexpr int64_t SWIGLU_AMX_MIN_MEAN_ROWS = 16;

template <typename T>
void fused_moe_impl(const at::Tensor& x, const Weights<T>& w1, const Weights<T>& w2, int64_t I,
                    at::TensorList gate_up_bias, at::TensorList down_bias,
                    const at::Tensor& token_of, const at::Tensor& pair_weight, const std::vector<int64_t>& counts,
                    int64_t act, float alpha, float limit, bool amx, const at::Tensor& out) {
  const int64_t E = static_cast<int64_t>(counts.size());
  const int64_t H = x.size(1);
  const int64_t I2 = 2 * I;
  const bool bias = !gate_up_bias.empty();
  std::vector<int64_t> ends;  // each group's end (its experts: from the previous end)
  int64_t P = 0, most = 0;  // all pairs; the most in one group
  for (int64_t e0 = 0, e1; e0 < E; e0 = e1) {
    int64_t n = counts[e0];
    for (e1 = e0 + 1; e1 < E && n + counts[e1] <= GROUP_PAIRS; ++e1) n += counts[e1];
    ends.push_back(e1);
    P += n, most = std::max(most, n);
  }
  if (P == 0) return;
  const T* xd = x.data_ptr<T>();
  float* od = out.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldo = out.stride(0);
  // the buffers, sized for the largest group: the pairs' token rows, gate_up's outputs, the
  // activations, down's outputs
  at::Tensor xs = at::empty({most, H}, x.options());
  at::Tensor h = at::empty({most, I2}, x.options().dtype(at::kFloat));
  at::Tensor a = at::empty({most, I}, x.options());
  at::Tensor y = at::empty({most, H}, x.options().dtype(at::kFloat));
  // bf16 SwiGLU on AMX, groups of SWIGLU_AMX_MIN_MEAN_ROWS or more rows per active expert:
  // amx_swiglu_group (the same bits)
  const bool swiglu_amx = amx && std::is_same<T, bf16>::value && act == 0 && H % 32 == 0 && I % 32 == 0;
  T* xsd = xs.data_ptr<T>();
  float* hd = h.data_ptr<float>();
  T* ad = a.data_ptr<T>();
  float* yd = y.data_ptr<float>();
  int64_t p_first = 0;  // the group's first pair
  for (size_t g = 0; g < ends.size(); ++g) {
    const int64_t e0 = g == 0 ? 0 : ends[g - 1], e1 = ends[g];
    const std::vector<int64_t> cg(counts.begin() + e0, counts.begin() + e1);
    std::vector<int64_t> start(cg.size() + 1, 0);
    for (size_t e = 0; e < cg.size(); ++e) start[e + 1] = start[e] + cg[e];
    const int64_t n = start.back();
    const int64_t* tok = token_of.data_ptr<int64_t>() + p_first;
    const float* w = pair_weight.data_ptr<float>() + p_first;
    p_first += n;
    if (n == 0) continue;
    // the group's slice of the weights and biases
    std::vector<const T*> d1, d2, b1, b2;
    std::vector<IntMatrix> i1, i2;
    Weights<T> g1 = w1, g2 = w2;
    if (w1.dense != nullptr) {
      d1.assign(w1.dense->begin() + e0, w1.dense->begin() + e1), g1.dense = &d1;
      d2.assign(w2.dense->begin() + e0, w2.dense->begin() + e1), g2.dense = &d2;
    } else {
      i1.assign(w1.ints->begin() + e0, w1.ints->begin() + e1), g1.ints = &i1;
      i2.assign(w2.ints->begin() + e0, w2.ints->begin() + e1), g2.ints = &i2;
    }
    for (int64_t e = e0; e < e1 && bias; ++e) {
      b1.push_back(gate_up_bias[e].data_ptr<T>());
      b2.push_back(down_bias[e].data_ptr<T>());
    }
#if defined(MOESTREAM_AMX)
    if constexpr (std::is_same<T, bf16>::value) {
      const int64_t active = std::count_if(cg.begin(), cg.end(), [](int64_t c) { return c > 0; });
      if (swiglu_amx && n >= SWIGLU_AMX_MIN_MEAN_ROWS * active) {
        amx_swiglu_group(xd, ldx, tok, w, g1, g2, bias ? &b1 : nullptr, bias ? &b2 : nullptr, H, I, start, cg, od, ldo);
        continue;
      }
    }
#endif
    // 1. gate_up of every pair: h [n, 2I] float32, then the activation into a [n, I] (compute dtype)
    at::parallel_for(0, n, 64, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) std::memcpy(xsd + p * H, xd + tok[p] * ldx, H * sizeof(T));
    });
    project<T>(xsd, H, g1, bias ? &b1 : nullptr, I2, start, cg, amx, hd);
    at::parallel_for(0, n, 16, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) activation<T>(hd + p * I2, I, act, alpha, limit, ad + p * I);
    });
    // 2. down: y [n, H] float32 (values at the compute dtype's precision)
    project<T>(ad, I, g2, bias ? &b2 : nullptr, H, start, cg, amx, yd);
    // 3. combine, experts in order: out[t] += y * w (a product, then a sum: no fused multiply-add)
    at::parallel_for(0, H, 64, [&](int64_t c0, int64_t c1) {
      for (int64_t p = 0; p < n; ++p) {
        float* o = od + tok[p] * ldo;
        const float* yp = yd + p * H;
        const float wp = w[p];
        int64_t c = c0;
#if defined(__AVX512F__)
        const __m512 wv = _mm512_set1_ps(wp);
        for (; c + 16 <= c1; c += 16)  // a product, then a sum: two roundings (no FMA contraction)
          _mm512_storeu_ps(o + c, _mm512_add_ps(_mm512_loadu_ps(o + c), _mm512_mul_ps(_mm512_loadu_ps(yp + c), wv)));
#endif
        for (; c < c1; ++c) {
          volatile float prod = yp[c] * wp;  // rounded on its own, as torch's multiply then index_add_
          o[c] += prod;
        }
      }
    });
  }
}

// The checks every entry point shares: x, out, counts, biases, the pairs. Returns P.
int64_t check_layer(const char* op, const at::Tensor& x, int64_t E, int64_t I, at::TensorList gate_up_bias,
                    at::TensorList down_bias, const at::Tensor& token_of, const at::Tensor& pair_weight,
                    at::IntArrayRef counts, int64_t act, const at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, op, ": x must be [T, H] with contiguous rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              op, ": x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == x.size(0) &&
                  out.size(1) == x.size(1) && out.stride(1) == 1,
              op, ": out must be float32 [T, H] with contiguous rows");
  TORCH_CHECK(E > 0 && static_cast<int64_t>(counts.size()) == E, op, ": one count per expert");
  TORCH_CHECK(gate_up_bias.size() == down_bias.size() && (gate_up_bias.empty() || (int64_t)gate_up_bias.size() == E),
              op, ": biases for every expert or for none");
  TORCH_CHECK(act == 0 || act == 1, op, ": act must be 0 (silu) or 1 (swigluoai)");
  const int64_t H = x.size(1);
  for (int64_t e = 0; e < E && !gate_up_bias.empty(); ++e)
    TORCH_CHECK(gate_up_bias[e].is_contiguous() && gate_up_bias[e].numel() == 2 * I && down_bias[e].is_contiguous() &&
                    down_bias[e].numel() == H && gate_up_bias[e].scalar_type() == x.scalar_type() &&
                    down_bias[e].scalar_type() == x.scalar_type(),
                op, ": bias ", e, " must be contiguous [2I] and [H] in x's dtype");
  int64_t P = 0;
  for (auto c : counts) {
    TORCH_CHECK(c >= 0, op, ": negative count");
    P += c;
  }
  TORCH_CHECK(token_of.scalar_type() == at::kLong && token_of.is_contiguous() && token_of.numel() == P,
              op, ": token_of must be contiguous int64 [sum(counts)]");
  TORCH_CHECK(pair_weight.scalar_type() == at::kFloat && pair_weight.is_contiguous() && pair_weight.numel() == P,
              op, ": pair_weight must be contiguous float32 [sum(counts)]");
  const int64_t* tok = token_of.data_ptr<int64_t>();
  for (int64_t p = 0; p < P; ++p)
    TORCH_CHECK(tok[p] >= 0 && tok[p] < x.size(0), op, ": token_of[", p, "] = ", tok[p], " is not a row of x");
  return P;
}

template <typename T>
void run_dense(const at::Tensor& x, at::TensorList gate_up, at::TensorList down, int64_t I,
               at::TensorList gate_up_bias, at::TensorList down_bias, const at::Tensor& token_of,
               const at::Tensor& pair_weight, const std::vector<int64_t>& cv, int64_t act, double alpha, double limit,
               bool amx, const at::Tensor& out) {
  const int64_t E = static_cast<int64_t>(cv.size());
  std::vector<const T*> p1(E), p2(E);
  for (int64_t e = 0; e < E; ++e) p1[e] = gate_up[e].data_ptr<T>(), p2[e] = down[e].data_ptr<T>();
  Weights<T> w1, w2;
  w1.dense = &p1, w2.dense = &p2;
  fused_moe_impl<T>(x, w1, w2, I, gate_up_bias, down_bias, token_of, pair_weight, cv, act, (float)alpha,
                    (float)limit, amx, out);
}

void fused_moe(const at::Tensor& x, at::TensorList gate_up, at::TensorList down, at::TensorList gate_up_bias,
               at::TensorList down_bias,
               const at::Tensor& token_of, const at::Tensor& pair_weight, at::IntArrayRef counts, int64_t act,
               double alpha, double limit, bool amx, const at::Tensor& out) {
  const int64_t E = static_cast<int64_t>(counts.size());
  TORCH_CHECK(E > 0 && static_cast<int64_t>(gate_up.size()) == E && static_cast<int64_t>(down.size()) == E,
              "fused_moe: one gate_up and one down per count");
  const int64_t H = x.size(1), I2 = gate_up[0].size(0);
  TORCH_CHECK(I2 % 2 == 0, "fused_moe: gate_up must have 2I rows");
  TORCH_CHECK(!amx || moestream_amx::available(), "fused_moe: amx=True but this build or process has no AMX-BF16");
  check_layer("fused_moe", x, E, I2 / 2, gate_up_bias, down_bias, token_of, pair_weight, counts, act, out);
  for (int64_t e = 0; e < E; ++e) {
    TORCH_CHECK(gate_up[e].scalar_type() == x.scalar_type() && down[e].scalar_type() == x.scalar_type(),
                "fused_moe: expert weights must be in x's dtype");
    TORCH_CHECK(gate_up[e].is_contiguous() && gate_up[e].dim() == 2 && gate_up[e].size(0) == I2 &&
                    gate_up[e].size(1) == H,
                "fused_moe: gate_up[", e, "] must be a contiguous [2I, H]");
    TORCH_CHECK(down[e].is_contiguous() && down[e].dim() == 2 && down[e].size(0) == H && down[e].size(1) == I2 / 2,
                "fused_moe: down[", e, "] must be a contiguous [H, I]");
  }
  std::vector<int64_t> cv(counts.begin(), counts.end());
  if (x.scalar_type() == at::kFloat)
    run_dense<float>(x, gate_up, down, I2 / 2, gate_up_bias, down_bias, token_of, pair_weight, cv, act, alpha, limit,
                     amx, out);
  else
    run_dense<bf16>(x, gate_up, down, I2 / 2, gate_up_bias, down_bias, token_of, pair_weight, cv, act, alpha, limit,
                    amx, out);
}

// One projection's integer matrices, checked: q[e * blocks + b] [rows, >= K * bits / 8 bytes]
// with contiguous rows (any integer dtype: its bytes are read), scale / zero [rows, G] float32,
// G = ceil(K / group_size) (group_size 0: one scale per row).
std::vector<IntMatrix> int_matrices(const char* what, at::TensorList q, at::TensorList scale, at::TensorList zero,
                                    int64_t E, int64_t blocks, int64_t N, int64_t K, const IntFormat& f,
                                    int64_t f_group_size) {
  TORCH_CHECK(blocks == 1 || blocks == 2, "fused_moe_int: ", what, " comes in 1 or 2 row blocks");
  TORCH_CHECK(N % blocks == 0, "fused_moe_int: ", what, " rows do not split into ", blocks, " blocks");
  TORCH_CHECK((int64_t)q.size() == E * blocks && (int64_t)scale.size() == E * blocks &&
                  (zero.empty() || (int64_t)zero.size() == E * blocks),
              "fused_moe_int: ", what, " needs ", E * blocks, " q and scale tensors (and zero points or none)");
  const int64_t gs = f_group_size > 0 ? f_group_size : K;
  const int64_t rows = N / blocks, G = (K + gs - 1) / gs;
  std::vector<IntMatrix> m(E);
  for (int64_t e = 0; e < E; ++e) {
    m[e].block_rows = rows;
    m[e].group_size = gs;
    m[e].groups = G;
    for (int64_t b = 0; b < 2; ++b) m[e].q[b] = nullptr, m[e].scale[b] = nullptr, m[e].zero[b] = nullptr, m[e].ldq[b] = 0;
    for (int64_t b = 0; b < blocks; ++b) {
      const at::Tensor& t = q[e * blocks + b];
      const int64_t row_bytes = t.dim() == 2 ? t.size(1) * t.element_size() : 0;
      TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.stride(1) == 1 && !t.is_floating_point() &&
                      row_bytes * 8 >= K * f.bits,
                  "fused_moe_int: ", what, " q[", e * blocks + b, "] must be an integer [", rows, ", >= ",
                  K * f.bits / 8, " bytes] with contiguous rows");
      m[e].q[b] = static_cast<const uint8_t*>(t.data_ptr());
      m[e].ldq[b] = t.stride(0) * t.element_size();
      const at::Tensor& s = scale[e * blocks + b];
      TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() && s.dim() == 2 && s.size(0) == rows &&
                      s.size(1) == G,
                  "fused_moe_int: ", what, " scale[", e * blocks + b, "] must be a contiguous float32 [", rows, ", ",
                  G, "]");
      m[e].scale[b] = s.data_ptr<float>();
      if (!zero.empty()) {
        const at::Tensor& z = zero[e * blocks + b];
        TORCH_CHECK(z.scalar_type() == at::kFloat && z.is_contiguous() && z.sizes() == s.sizes(),
                    "fused_moe_int: ", what, " zero[", e * blocks + b, "] must be float32 like its scale");
        m[e].zero[b] = z.data_ptr<float>();
      }
    }
  }
  return m;
}

// fused_moe on weight-only integer experts (see IntMatrix): gate_up [2I, H] in `gate_up_blocks`
// row blocks (2: gate then up, each [I, H]), down [H, I]; results as fused_moe on the
// dequantized weights, bit for bit.
void fused_moe_int(const at::Tensor& x, at::TensorList gate_up_q, at::TensorList gate_up_scale,
                   at::TensorList gate_up_zero, int64_t gate_up_blocks, at::TensorList down_q,
                   at::TensorList down_scale, at::TensorList down_zero, int64_t bits, int64_t flip,
                   int64_t group_size, int64_t intermediate, at::TensorList gate_up_bias, at::TensorList down_bias,
                   const at::Tensor& token_of, const at::Tensor& pair_weight, at::IntArrayRef counts, int64_t act,
                   double alpha, double limit, bool amx, const at::Tensor& out) {
  const int64_t E = static_cast<int64_t>(counts.size()), I = intermediate;
  TORCH_CHECK(I > 0, "fused_moe_int: intermediate must be positive");
  TORCH_CHECK((bits == 8 && (flip == 0 || flip == 0x80)) || (bits == 4 && flip == 0),
              "fused_moe_int: bits must be 8 (flip 0 or 128) or 4 (flip 0)");
  TORCH_CHECK(group_size >= 0, "fused_moe_int: group_size must be >= 0 (0: one scale per row)");
  TORCH_CHECK(!amx || moestream_amx::available(), "fused_moe_int: amx=True but this build or process has no AMX-BF16");
  check_layer("fused_moe_int", x, E, I, gate_up_bias, down_bias, token_of, pair_weight, counts, act, out);
  const int64_t H = x.size(1);
  const IntFormat f{bits, flip};
  const std::vector<IntMatrix> m1 = int_matrices("gate_up", gate_up_q, gate_up_scale, gate_up_zero, E,
                                                 gate_up_blocks, 2 * I, H, f, group_size);
  const std::vector<IntMatrix> m2 = int_matrices("down", down_q, down_scale, down_zero, E, 1, H, I, f, group_size);
  std::vector<int64_t> cv(counts.begin(), counts.end());
  if (x.scalar_type() == at::kFloat) {
    Weights<float> w1, w2;
    w1.ints = &m1, w2.ints = &m2, w1.format = w2.format = f;
    fused_moe_impl<float>(x, w1, w2, I, gate_up_bias, down_bias, token_of, pair_weight, cv, act, (float)alpha,
                          (float)limit, amx, out);
  } else {
    Weights<bf16> w1, w2;
    w1.ints = &m1, w2.ints = &m2, w1.format = w2.format = f;
    fused_moe_impl<bf16>(x, w1, w2, I, gate_up_bias, down_bias, token_of, pair_weight, cv, act, (float)alpha,
                         (float)limit, amx, out);
  }
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
        "Tensor token_of, Tensor pair_weight, int[] counts, int act, float alpha, float limit, bool amx, Tensor(a!) out) -> ()");
  m.def("fused_moe_int(Tensor x, Tensor[] gate_up_q, Tensor[] gate_up_scale, Tensor[] gate_up_zero, "
        "int gate_up_blocks, Tensor[] down_q, Tensor[] down_scale, Tensor[] down_zero, int bits, int flip, "
        "int group_size, int intermediate, Tensor[] gate_up_bias, Tensor[] down_bias, Tensor token_of, "
        "Tensor pair_weight, int[] counts, int act, float alpha, float limit, bool amx, Tensor(a!) out) -> ()");
  m.def("isa() -> str", &isa);
  m.def("parallel_threads() -> int", &parallel_threads);
}

TORCH_LIBRARY_IMPL(moestream_cpu, CPU, m) {
  m.impl("fused_moe", &fused_moe);
  m.impl("fused_moe_int", &fused_moe_int);
}
