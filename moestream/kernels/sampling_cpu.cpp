// Greedy sampling's row-wise argmax on CPU (moestream/kernels/sampling.py loads and calls it):
// for logits [B, V] float32, the index of each row's first maximum, as torch.argmax and
// torch.max(dim) return it. Two passes over a row (its maximum, then the first index holding
// it), both vectorized; a row with a NaN gets -1 (the caller takes torch's answer for it).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(moestream_cpu, m) { m.def("argmax_rows(Tensor logits) -> Tensor"); }

TORCH_LIBRARY_IMPL(moestream_cpu, CPU, m) { m.impl("argmax_rows", &argmax_rows); }
