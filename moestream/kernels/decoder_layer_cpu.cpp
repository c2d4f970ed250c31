// One decoder layer's decode step in one call on CPU (moestream/models/decoder_layer_cpu.py builds
// and calls it): the attention block, then the MoE block, of a GQA + softmax-routed MoE layer
// (Qwen3-MoE, Mixtral, OLMoE) for a step whose requests each bring one new token.
//
// It makes the calls moestream's Python layer makes, in the same order, on the same kernels
// (the moestream_cpu operators through the dispatcher, and ATen's softmax, topk, gather, sum,
// index_copy_ and add), so its output is the Python path's bit for bit. What it removes is the
// Python around them: about 100 operator calls and module calls a layer.
//
// Shapes (T requests, H hidden, Hq / Hk query / KV heads, D head dim, E experts, k top-k):
//   x            [T, H]          float32 or bfloat16 (the model dtype), contiguous
//   k_cache      [N, bs, Hk, D]  contiguous; v_cache the same
//   cos, sin     [T, R]          the rotary tables of the step (`RotaryEmbedding.cos_sin`),
//                                or undefined for a model without rotary embedding
//   slot_mapping [T] int64, block_tables [T, W] int32, seq_lens [T] int64, starts [T] int64
//   returns      [T, H]          the layer's output (the residual stream), x's dtype
//
// The per-layer parts are set once after loading: the norms, five linears (q, k, v, o and the
// router; each in the layout its Python module keeps: `Kind`), and the stacked experts
// gate_up [E, 2I, H] and down [E, H, I] of a resident store, with its hit counter.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <array>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

// The layout a linear's weight is in, as `layers/linear.py`'s `Linear.forward` picks its kernel.
enum Kind : int64_t {
  VNNI = 0,     // bf16 weight in `pack_vnni`'s layout: moestream_cpu::linear_vnni
  BLOCKED = 1,  // float32 weight in `pack_blocked`'s layout: moestream_cpu::linear_blocked
  GEMM = 2,     // plain weight, no bias: moestream_cpu::linear up to `max_rows` rows, else at::linear
  TORCH = 3,    // plain weight: at::linear (with its bias)
};

struct LinearPart {
  at::Tensor weight, bias;  // bias undefined when none
  int64_t kind = -1, out_features = 0, max_rows = 0;
  bool amx = false;
};

template <typename Sig>
c10::TypedOperatorHandle<Sig> handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

using LinearVnni = void(const at::Tensor&, const at::Tensor&, int64_t, const c10::optional<at::Tensor>&, bool,
                        const at::Tensor&);
using LinearBlocked = void(const at::Tensor&, const at::Tensor&, int64_t, const at::Tensor&);
using LinearGemm = void(const at::Tensor&, const at::Tensor&, const at::Tensor&);
using RmsNorm = at::Tensor(const at::Tensor&, const at::Tensor&, double, bool);
using AddRmsNorm = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                                      bool);
using Rotary = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, bool);
using PagedAttention = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, double, const at::Tensor&);
using FusedMoe = void(const at::Tensor&, at::TensorList, at::TensorList, at::TensorList, at::TensorList,
                      const at::Tensor&, const at::Tensor&, at::IntArrayRef, int64_t, double, double, bool,
                      const at::Tensor&);

struct DecoderLayer : torch::CustomClassHolder {
  // attention
  int64_t heads, kv_heads, head_dim;
  double scale;
  at::Tensor input_norm, post_norm, q_norm, k_norm;  // q_norm / k_norm undefined without them
  double eps, qk_eps;
  bool unit_offset, qk_unit_offset, interleaved;
  std::array<LinearPart, 5> linears;  // q, k, v, o, router
  // MoE
  int64_t top_k;
  bool norm_topk_prob, topk_sorted;
  double routed_scaling_factor;
  int64_t act;
  double alpha, limit;
  bool amx;                      // AMX tiles allowed (the CPU has them) ...
  int64_t amx_min_mean_rows;     // ... and taken past this many pairs per active expert (`fused_amx`)
  int64_t fused_max_mean_rows;
  at::Tensor hits;                            // 0-dim int64: the store's hit counter of this layer
  std::vector<at::Tensor> gate_up, down;      // per expert: [2I, H], [H, I]
  // the kernels it calls
  c10::TypedOperatorHandle<LinearVnni> linear_vnni = handle<LinearVnni>("moestream_cpu::linear_vnni");
  c10::TypedOperatorHandle<LinearBlocked> linear_blocked = handle<LinearBlocked>("moestream_cpu::linear_blocked");
  c10::TypedOperatorHandle<LinearGemm> linear_gemm = handle<LinearGemm>("moestream_cpu::linear");
  c10::TypedOperatorHandle<RmsNorm> rms_norm = handle<RmsNorm>("moestream_cpu::rms_norm");
  c10::TypedOperatorHandle<AddRmsNorm> add_rms_norm = handle<AddRmsNorm>("moestream_cpu::add_rms_norm");
  c10::TypedOperatorHandle<Rotary> rotary = handle<Rotary>("moestream_cpu::apply_rotary");
  c10::TypedOperatorHandle<PagedAttention> paged = handle<PagedAttention>("moestream_cpu::paged_decode_attention");
  c10::TypedOperatorHandle<FusedMoe> fused_moe = handle<FusedMoe>("moestream_cpu::fused_moe");

  DecoderLayer(int64_t heads, int64_t kv_heads, int64_t head_dim, double scale, bool interleaved, int64_t top_k,
               bool norm_topk_prob, bool topk_sorted, double routed_scaling_factor, int64_t act, double alpha,
               double limit, bool amx, int64_t amx_min_mean_rows, int64_t fused_max_mean_rows)
      : heads(heads), kv_heads(kv_heads), head_dim(head_dim), scale(scale), eps(0), qk_eps(0), unit_offset(false),
        qk_unit_offset(false), interleaved(interleaved), top_k(top_k), norm_topk_prob(norm_topk_prob),
        topk_sorted(topk_sorted), routed_scaling_factor(routed_scaling_factor), act(act), alpha(alpha), limit(limit),
        amx(amx), amx_min_mean_rows(amx_min_mean_rows), fused_max_mean_rows(fused_max_mean_rows) {
    TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim > 0,
                "DecoderLayer: heads must be a positive multiple of kv_heads");
    TORCH_CHECK(top_k > 0 && fused_max_mean_rows > 0, "DecoderLayer: top_k and fused_max_mean_rows must be positive");
  }

  void set_norms(const at::Tensor& input, const at::Tensor& post, double eps_, bool unit_offset_,
                 const at::Tensor& q, const at::Tensor& k, double qk_eps_, bool qk_unit_offset_) {
    input_norm = input, post_norm = post, eps = eps_, unit_offset = unit_offset_;
    TORCH_CHECK(q.numel() == 0 || (q.numel() == head_dim && k.numel() == head_dim),
                "DecoderLayer: q/k norms must be [head_dim], or empty for none");
    q_norm = q.numel() ? q : at::Tensor(), k_norm = k.numel() ? k : at::Tensor();
    qk_eps = qk_eps_, qk_unit_offset = qk_unit_offset_;
  }

  // which: 0 q, 1 k, 2 v, 3 o, 4 router; bias: empty for none
  void set_linear(int64_t which, const at::Tensor& weight, const at::Tensor& bias, int64_t kind,
                  int64_t out_features, int64_t max_rows, bool amx_) {
    TORCH_CHECK(which >= 0 && which < 5, "DecoderLayer: set_linear's which must be 0-4");
    TORCH_CHECK(kind >= VNNI && kind <= TORCH, "DecoderLayer: unknown linear kind ", kind);
    TORCH_CHECK(kind != GEMM || bias.numel() == 0, "DecoderLayer: a GEMM linear has no bias");
    linears[which] = LinearPart{weight, bias.numel() ? bias : at::Tensor(), kind, out_features, max_rows, amx_};
  }

  void set_experts(const at::Tensor& gate_up_, const at::Tensor& down_, const at::Tensor& hits_) {
    TORCH_CHECK(gate_up_.dim() == 3 && down_.dim() == 3 && gate_up_.size(0) == down_.size(0),
                "DecoderLayer: experts must be gate_up [E, 2I, H] and down [E, H, I]");
    TORCH_CHECK(hits_.dim() == 0 && hits_.scalar_type() == at::kLong, "DecoderLayer: hits must be a 0-dim int64");
    gate_up = gate_up_.unbind(0), down = down_.unbind(0), hits = hits_;
  }

  at::Tensor linear(const LinearPart& l, const at::Tensor& x) const {
    TORCH_CHECK(l.kind >= 0, "DecoderLayer: a linear was not set");
    const int64_t rows = x.size(0);
    switch (l.kind) {
      case VNNI: {
        at::Tensor out = at::empty({rows, l.out_features}, x.options());
        linear_vnni.call(x, l.weight, l.out_features,
                         l.bias.defined() ? c10::optional<at::Tensor>(l.bias) : c10::nullopt, l.amx, out);
        return out;
      }
      case BLOCKED: {
        at::Tensor out = at::empty({rows, l.out_features}, x.options());
        linear_blocked.call(x, l.weight, l.out_features, out);
        return out;
      }
      case GEMM:
        if (rows > 0 && rows <= l.max_rows) {
          at::Tensor out = at::empty({rows, l.out_features}, x.options());
          linear_gemm.call(x, l.weight, out);
          return out;
        }
        return at::linear(x, l.weight);
      default:
        return at::linear(x, l.weight, l.bias.defined() ? c10::optional<at::Tensor>(l.bias) : c10::nullopt);
    }
  }

  at::Tensor forward(const at::Tensor& x, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slot_mapping,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& starts) {
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "DecoderLayer: x must be a contiguous [T, H]");
    TORCH_CHECK(!gate_up.empty() && input_norm.defined(), "DecoderLayer: set_norms and set_experts first");
    const int64_t T = x.size(0), E = static_cast<int64_t>(gate_up.size());
    // attention (layers/attention.py's Attention.forward, the backend's decode-only branch)
    at::Tensor h = rms_norm.call(x, input_norm, eps, unit_offset);
    at::Tensor q = linear(linears[0], h).view({T, heads, head_dim});
    at::Tensor k = linear(linears[1], h).view({T, kv_heads, head_dim});
    at::Tensor v = linear(linears[2], h).view({T, kv_heads, head_dim});
    if (q_norm.defined()) {
      q = rms_norm.call(q, q_norm, qk_eps, qk_unit_offset);
      k = rms_norm.call(k, k_norm, qk_eps, qk_unit_offset);
    }
    if (cos.defined() && cos.numel()) rotary.call(q, k, cos, sin, interleaved);
    for (const auto& [cache, rows] : {std::pair{k_cache, k}, std::pair{v_cache, v}}) {
      if (cache.is_contiguous()) {
        cache.view({-1, kv_heads, cache.size(3)}).index_copy_(0, slot_mapping, rows);
      } else {  // an elastic memory pool's strided view: index (block, offset)
        const int64_t bs = cache.size(1);
        cache.index_put_({at::floor_divide(slot_mapping, bs), at::remainder(slot_mapping, bs)}, rows);
      }
    }
    at::Tensor o = at::empty({T, heads, v_cache.size(3)}, q.options());
    paged.call(q, k_cache, v_cache, block_tables, seq_lens, starts, scale, o);
    at::Tensor mixed = linear(linears[3], o.reshape({T, heads * head_dim}));
    auto [residual, hn] = add_rms_norm.call(mixed, x, post_norm, eps, unit_offset);
    // routing (layers/router.py's TopKRouter: softmax scores, greedy top-k)
    at::Tensor logits = linear(linears[4], hn).to(at::kFloat);  // [T, E]
    at::Tensor scores = logits.softmax(-1);
    at::Tensor ids = std::get<1>(at::topk(scores, top_k, -1, true, topk_sorted)).contiguous();  // [T, k]
    at::Tensor weights = scores.gather(1, ids);
    if (norm_topk_prob) weights = weights / weights.sum(-1, true);
    weights = (weights * routed_scaling_factor).contiguous();  // [T, k] float32
    // the pairs sorted by expert, stable (layers/expert_executor.py's sort_by_expert)
    const int64_t P = T * top_k;
    const int64_t* id = ids.data_ptr<int64_t>();
    const float* wd = weights.data_ptr<float>();
    std::vector<int64_t> counts(E, 0);
    for (int64_t p = 0; p < P; ++p) {
      TORCH_CHECK(id[p] >= 0 && id[p] < E, "DecoderLayer: expert id out of range");
      ++counts[id[p]];
    }
    std::vector<int64_t> next(E, 0), active_counts;
    std::vector<at::Tensor> gu, dn;
    for (int64_t e = 0, at_ = 0; e < E; ++e) {
      next[e] = at_, at_ += counts[e];
      if (counts[e]) active_counts.push_back(counts[e]), gu.push_back(gate_up[e]), dn.push_back(down[e]);
    }
    const int64_t active = static_cast<int64_t>(active_counts.size());
    hits.add_(active);  // the store's on_route: the distinct experts of the call
    TORCH_CHECK(P <= fused_max_mean_rows * active, "DecoderLayer: ", P, " pairs over ", active,
                " experts is past the fused kernel's rows (the caller checks T)");
    at::Tensor token_of = at::empty({P}, ids.options());
    at::Tensor pair_weight = at::empty({P}, weights.options());
    int64_t* tok = token_of.data_ptr<int64_t>();
    float* pw = pair_weight.data_ptr<float>();
    for (int64_t p = 0; p < P; ++p) {
      const int64_t slot = next[id[p]]++;
      tok[slot] = p / top_k, pw[slot] = wd[p];
    }
    at::Tensor out = at::zeros({T, x.size(1)}, x.options().dtype(at::kFloat));
    fused_moe.call(hn, gu, dn, {}, {}, token_of, pair_weight, active_counts, act, alpha, limit,
                   amx && P > amx_min_mean_rows * active, out);
    return residual + out.to(x.scalar_type());
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(moestream_cpu, m) {
  m.class_<DecoderLayer>("DecoderLayer")
      .def(torch::init<int64_t, int64_t, int64_t, double, bool, int64_t, bool, bool, double, int64_t, double, double,
                       bool, int64_t, int64_t>())
      .def("set_norms", &DecoderLayer::set_norms)
      .def("set_linear", &DecoderLayer::set_linear)
      .def("set_experts", &DecoderLayer::set_experts)
      .def("forward", &DecoderLayer::forward);
}
