// Rotary position embedding on CPU, in place on q and k in one operator call (moestream/kernels/
// rotary.py loads and calls it; layers/rotary.py computes cos and sin once per forward):
//
//   apply_rotary(q [T, Hq, D], k [T, Hk, D], cos, sin, interleaved) -> ()   (q, k rotated in place)
//
// q, k: float32 or bfloat16, one dtype, the last dim contiguous (heads and tokens may be
// strided, as q's half of a gated q_proj). The first R dims of each head are rotated, the rest
// kept (partial rotary).
// - rotate-half (Llama / Qwen / HF `rotate_half`): cos, sin [T, R] in q's dtype, and
//   x'[i] = dtype(dtype(x[i] * cos[i]) + dtype(rot[i] * sin[i])), rot = (-x[R/2:], x[:R/2]):
//   what `q * cos + rotate_half(q) * sin` rounds to in torch, operation by operation.
// - interleaved (DeepSeek, HF `apply_rotary_emb`): cos, sin [T, R/2] float32, pairs (x[2j], x[2j+1])
//   rotated in float32 and rounded once: (x0 cos - x1 sin, x1 cos + x0 sin).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "simd.h"

#include <cstdint>

namespace {

template <typename T> inline float to_f(T v) { return static_cast<float>(v); }
template <typename T> inline float rnd(float v) { return static_cast<float>(static_cast<T>(v)); }

template <typename T>
void rotate_half_head(T* x, const T* c, const T* s, int64_t R) {
  const int64_t h = R / 2;
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 sign = _mm512_set1_ps(-0.f);
  for (; i + 16 <= h; i += 16) {  // the same products and roundings, 16 at a time
    const __m512 a = load16(x + i), b = load16(x + i + h);
    const __m512 lo = _mm512_add_ps(round16<T>(_mm512_mul_ps(a, load16(c + i))),
                                    round16<T>(_mm512_mul_ps(_mm512_xor_ps(b, sign), load16(s + i))));
    const __m512 hi = _mm512_add_ps(round16<T>(_mm512_mul_ps(b, load16(c + i + h))),
                                    round16<T>(_mm512_mul_ps(a, load16(s + i + h))));
    store16(x + i, lo);
    store16(x + i + h, hi);
  }
#endif
  for (; i < h; ++i) {
    const float a = to_f(x[i]), b = to_f(x[i + h]);
    const float ci = to_f(c[i]), si = to_f(s[i]), ch = to_f(c[i + h]), sh = to_f(s[i + h]);
    x[i] = static_cast<T>(rnd<T>(a * ci) + rnd<T>(-b * si));
    x[i + h] = static_cast<T>(rnd<T>(b * ch) + rnd<T>(a * sh));
  }
}

template <typename T>
void interleaved_head(T* x, const float* c, const float* s, int64_t R) {
  for (int64_t j = 0; j < R / 2; ++j) {
    const float x0 = to_f(x[2 * j]), x1 = to_f(x[2 * j + 1]);
    x[2 * j] = static_cast<T>(x0 * c[j] - x1 * s[j]);
    x[2 * j + 1] = static_cast<T>(x1 * c[j] + x0 * s[j]);
  }
}

template <typename T>
void rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved) {
  const int64_t T_ = x.size(0), H = x.size(1), st = x.stride(0), sh = x.stride(1);
  const int64_t R = interleaved ? 2 * cos.size(1) : cos.size(1), ldc = cos.stride(0);
  T* xd = x.data_ptr<T>();
  const float* cf = interleaved ? cos.data_ptr<float>() : nullptr;  // interleaved: float32 tables
  const float* sf = interleaved ? sin.data_ptr<float>() : nullptr;
  const T* ct = interleaved ? nullptr : cos.data_ptr<T>();  // rotate-half: tables in x's dtype
  const T* stb = interleaved ? nullptr : sin.data_ptr<T>();
  at::parallel_for(0, T_ * H, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / H;
      T* head = xd + t * st + (i % H) * sh;
      if (interleaved)
        interleaved_head<T>(head, cf + t * ldc, sf + t * ldc, R);
      else
        rotate_half_head<T>(head, ct + t * ldc, stb + t * ldc, R);
    }
  });
}

void check_x(const at::Tensor& x, const at::Tensor& cos, int64_t R, const char* name) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "apply_rotary: ", name, " must be [T, H, D] with a contiguous last dim");
  TORCH_CHECK(x.size(0) == cos.size(0), "apply_rotary: ", name, " has ", x.size(0), " tokens, cos ", cos.size(0));
  TORCH_CHECK(R <= x.size(2) && R % 2 == 0, "apply_rotary: rotary dim ", R, " must be even and at most ", name,
              "'s head dim ", x.size(2));
}

void apply_rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
                  bool interleaved) {
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "apply_rotary: q must be float32 or bfloat16, got ", q.scalar_type());
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), "apply_rotary: k must be in q's dtype");
  const auto table = interleaved ? at::kFloat : q.scalar_type();
  TORCH_CHECK(cos.dim() == 2 && cos.stride(1) == 1 && cos.scalar_type() == table && sin.sizes() == cos.sizes() &&
                  sin.strides() == cos.strides() && sin.scalar_type() == table,
              "apply_rotary: cos and sin must be [T, R] (interleaved: [T, R/2] float32) in ",
              interleaved ? "float32" : "q's dtype", ", one layout, the last dim contiguous");
  const int64_t R = interleaved ? 2 * cos.size(1) : cos.size(1);
  check_x(q, cos, R, "q");
  check_x(k, cos, R, "k");
  for (const at::Tensor* x : {&q, &k}) {
    if (q.scalar_type() == at::kFloat)
      rotate<float>(*x, cos, sin, interleaved);
    else
      rotate<at::BFloat16>(*x, cos, sin, interleaved);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moestream_cpu, m) {
  m.def("apply_rotary(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin, bool interleaved) -> ()");
}

TORCH_LIBRARY_IMPL(moestream_cpu, CPU, m) { m.impl("apply_rotary", &apply_rotary); }
