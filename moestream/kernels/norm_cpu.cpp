// RMSNorm on CPU (moestream/kernels/norm.py loads and calls it), one operator call where the
// PyTorch path makes eight (float, pow, mean, add, rsqrt, mul, to, mul), with the residual add
// before it fused in (as vLLM's fused_add_rms_norm):
//
//   rms_norm(x [R, D], weight [D], eps, unit_offset)            -> y [R, D]
//   add_rms_norm(x [R, D], residual [R, D], weight, eps, unit_offset) -> (h = residual + x, y = norm(h))
//
// x, residual, weight: float32 or bfloat16, one dtype, contiguous. Per row, as transformers'
// Qwen3MoeRMSNorm / Qwen3NextRMSNorm compute it:
//   r = 1 / sqrt(mean(float(x)^2) + eps)
//   y = weight * dtype(float(x) * r)                (rounded once more after the product)
//   y = dtype(float(x) * r * (1 + float(weight)))   (unit_offset: Qwen3-Next, Qwen3.5)
// and h = dtype(float(residual) + float(x)), what torch's add rounds to. The only difference
// from the PyTorch path is the order of the sum of squares (16 lanes, then lane by lane):
// float32 rounding, the same for a row whatever the rows beside it or the threads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "simd.h"

#include <cmath>
#include <cstdint>
#include <tuple>

namespace {

template <typename T> inline float to_f(T v) { return static_cast<float>(v); }

// sum of x^2 in float32: 16 independent lanes (the compiler vectorizes them), then lane 0..15, then the tail
template <typename T>
float sum_squares(const T* x, int64_t D) {
  alignas(64) float lanes[16] = {0.f};
  const int64_t dv = D / 16 * 16;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (int64_t k = 0; k < dv; k += 16) {
    const __m512 v = load16(x + k);
    acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));  // a product, then a sum, as the scalar lanes
  }
  _mm512_store_ps(lanes, acc);
#else
  for (int64_t k = 0; k < dv; k += 16)
    for (int l = 0; l < 16; ++l) {
      const float v = to_f(x[k + l]);
      lanes[l] += v * v;
    }
#endif
  float s = 0.f;
  for (int l = 0; l < 16; ++l) s += lanes[l];
  for (int64_t k = dv; k < D; ++k) s += to_f(x[k]) * to_f(x[k]);
  return s;
}

template <typename T>
void norm_row(const T* x, const T* w, float eps, bool unit_offset, int64_t D, T* y) {
  const float r = 1.f / std::sqrt(sum_squares(x, D) / static_cast<float>(D) + eps);
  int64_t k = 0;
#if defined(__AVX512F__)
  const __m512 rv = _mm512_set1_ps(r), one = _mm512_set1_ps(1.f);
  for (; k + 16 <= D; k += 16) {  // the same products and roundings, 16 at a time
    const __m512 xr = _mm512_mul_ps(load16(x + k), rv);
    store16(y + k, unit_offset ? _mm512_mul_ps(xr, _mm512_add_ps(one, load16(w + k)))
                               : _mm512_mul_ps(load16(w + k), round16<T>(xr)));
  }
#endif
  if (unit_offset) {
    for (; k < D; ++k) y[k] = static_cast<T>(to_f(x[k]) * r * (1.f + to_f(w[k])));
  } else {
    for (; k < D; ++k) y[k] = static_cast<T>(to_f(w[k]) * to_f(static_cast<T>(to_f(x[k]) * r)));
  }
}

// h[0:D] = dtype(residual + x), as torch's add rounds.
template <typename T>
void add_row(const T* residual, const T* x, int64_t D, T* h) {
  int64_t k = 0;
#if defined(__AVX512F__)
  for (; k + 16 <= D; k += 16) store16(h + k, _mm512_add_ps(load16(residual + k), load16(x + k)));
#endif
  for (; k < D; ++k) h[k] = static_cast<T>(to_f(residual[k]) + to_f(x[k]));
}

void check(const at::Tensor& x, const at::Tensor& weight, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.is_contiguous(), op, ": x must be contiguous with the normalized dim last");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.dim() == 1 && weight.is_contiguous() &&
                  weight.size(0) == x.size(-1),
              op, ": weight must be a contiguous [", x.size(-1), "] in x's dtype, got ", weight.sizes(), " ",
              weight.scalar_type());
}

template <typename T>
void run(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight, double eps, bool unit_offset,
         at::Tensor* h, at::Tensor& y) {
  const int64_t D = x.size(-1), R = D == 0 ? 0 : x.numel() / D;
  const T* xd = x.data_ptr<T>();
  const T* rd = residual != nullptr ? residual->data_ptr<T>() : nullptr;
  T* hd = h != nullptr ? h->data_ptr<T>() : nullptr;
  const T* wd = weight.data_ptr<T>();
  T* yd = y.data_ptr<T>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* src = xd + r * D;
      if (hd != nullptr) {
        T* dst = hd + r * D;
        add_row<T>(rd + r * D, src, D, dst);
        src = dst;
      }
      norm_row<T>(src, wd, e, unit_offset, D, yd + r * D);
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool unit_offset) {
  check(x, weight, "rms_norm");
  at::Tensor y = at::empty_like(x);
  if (x.scalar_type() == at::kFloat)
    run<float>(x, nullptr, weight, eps, unit_offset, nullptr, y);
  else
    run<at::BFloat16>(x, nullptr, weight, eps, unit_offset, nullptr, y);
  return y;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps, bool unit_offset) {
  check(x, weight, "add_rms_norm");
  TORCH_CHECK(residual.scalar_type() == x.scalar_type() && residual.sizes() == x.sizes() && residual.is_contiguous(),
              "add_rms_norm: residual must be contiguous, of x's shape and dtype");
  at::Tensor h = at::empty_like(x), y = at::empty_like(x);
  if (x.scalar_type() == at::kFloat)
    run<float>(x, &residual, weight, eps, unit_offset, &h, y);
  else
    run<at::BFloat16>(x, &residual, weight, eps, unit_offset, &h, y);
  return {h, y};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moestream_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool unit_offset) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, bool unit_offset) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(moestream_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
}
