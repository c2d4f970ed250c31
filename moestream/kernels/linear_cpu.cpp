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

#include "gemm.h"

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
}

TORCH_LIBRARY_IMPL(moestream_cpu, CPU, m) { m.impl("linear", &linear); }
