// Greedy sampling's row-wise argmax on CPU (moestream/kernels/sampling.py loads and calls it):
// for logits [B, V] float32, the index of each row's first maximum, as torch.argmax and
// torch.max(dim) return it. Two passes over a row (its maximum, then the first index holding
// it), both vectorized; a row with a NaN gets -1 (the caller takes torch's answer for it).
// And structured outputs' token bitmask (llguidance's layout: bit j of 32-bit word w allows
// token 32 w + j): forbidden tokens' logits set to -inf in place, a whole word at a time
// where it allows all 32 tokens or none.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace {

int64_t row_argmax(const float* x, int64_t V) {
  int64_t i = 0;
  float m = -std::numeric_limits<float>::infinity();
  bool nan = false;
#if defined(__AVX512F__)
  __m512 mv = _mm512_set1_ps(m);
  __mmask16 unordered = 0;
  for (; i + 16 <= V; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    mv = _mm512_max_ps(mv, v);
  }
  m = _mm512_reduce_max_ps(mv);
  nan = unordered != 0;
#endif
  for (; i < V; ++i) {
    nan |= std::isnan(x[i]);
    m = std::max(m, x[i]);
  }
  if (nan) return -1;
  i = 0;
#if defined(__AVX512F__)
  const __m512 target = _mm512_set1_ps(m);
  for (; i + 16 <= V; i += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), target, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(static_cast<unsigned>(hit));
  }
#endif
  for (; i < V; ++i)
    if (x[i] == m) return i;
  return 0;  // every value -inf: the first, as torch
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "argmax_rows: logits must be float32 [B, V] with contiguous rows");
  const int64_t B = logits.size(0), V = logits.size(1), ld = logits.stride(0);
  TORCH_CHECK(V > 0, "argmax_rows: empty rows");
  at::Tensor out = at::empty({B}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) o[b] = row_argmax(x + b * ld, V);
  });
  return out;
}

void apply_token_bitmask(at::Tensor logits, const at::Tensor& bitmask, const at::Tensor& rows, int64_t vocab) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "apply_token_bitmask: logits must be float32 [B, V] with contiguous rows");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous(),
              "apply_token_bitmask: bitmask must be contiguous int32 [R, W]");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.size(0) == bitmask.size(0),
              "apply_token_bitmask: rows must be int64 [R], one per bitmask row");
  const int64_t B = logits.size(0), V = logits.size(1), ld = logits.stride(0), W = bitmask.size(1);
  TORCH_CHECK(vocab >= 0 && vocab <= V && vocab <= 32 * W, "apply_token_bitmask: vocab ", vocab,
              " exceeds the logits (", V, ") or the bitmask (", 32 * W, ")");
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.size(0); ++i)
    TORCH_CHECK(r[i] >= 0 && r[i] < B, "apply_token_bitmask: row ", r[i], " outside [0, ", B, ")");
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  float* x = logits.data_ptr<float>();
  const float ninf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, rows.size(0), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      float* row = x + r[i] * ld;
      const uint32_t* w = bits + i * W;
      for (int64_t k = 0; k * 32 < vocab; ++k) {
        const uint32_t word = w[k];
        const int64_t base = k * 32, n = std::min<int64_t>(32, vocab - base);
        if (word == 0xFFFFFFFFu) continue;
        for (int64_t j = 0; j < n; ++j)
          if (!((word >> j) & 1u)) row[base + j] = ninf;
      }
      for (int64_t t = vocab; t < V; ++t) row[t] = ninf;  // past the tokenizer's vocabulary: never text
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moestream_cpu, m) {
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor rows, int vocab) -> ()");
}

TORCH_LIBRARY_IMPL(moestream_cpu, CPU, m) {
  m.impl("argmax_rows", &argmax_rows);
  m.impl("apply_token_bitmask", &apply_token_bitmask);
}
