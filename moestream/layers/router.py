"""MoE routers: score the experts, select the top-k, weigh the selected.

One class covers the routing of every model moestream serves, each path following the
transformers file it names, op for op (so that ties break the same way):
- softmax, greedy top-k, optional renormalisation: `Qwen3MoeTopKRouter`, `MixtralTopKRouter`;
- softmax, `group_limited_greedy`: `DeepseekV2TopkRouter` (group score = its max expert);
- softmax over biased logits, greedy, renormalised: `GptOssTopKRouter` (see `TopKRouter`);
- sigmoid, `noaux_tc`: `DeepseekV3TopkRouter`, `Glm4MoeTopkRouter` (selection by score +
  `e_score_correction_bias`, group score = sum of its top-2, weights from the unbiased
  scores, renormalised with + 1e-20, times `routed_scaling_factor`).
"""

from __future__ import annotations

import torch
from torch import nn

from moestream.config import RouterConfig
from moestream.kernels.linear import cpu_linear_vnni, has_vnni_bf16, pack_vnni
from moestream.layers.activation import sigmoid
from moestream.layers.linear import linear

ROUTER_SCORING = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


class TopKRouter(nn.Module):
    """forward(x [T, H]) -> (weights [T, k] float32, expert ids [T, k] int64).

    Parameters, named as HF's: `weight` [E, H] (the router's linear layer), its `bias` [E]
    when the config says so (gpt-oss), and for `noaux_tc`, `e_score_correction_bias` [E]
    (float32).

    gpt-oss's router (transformers' `GptOssTopKRouter`) takes the top-k of the logits and a
    softmax over those k; here that is the greedy softmax top-k renormalised
    (`norm_topk_prob`), the same weights up to float rounding (softmax is monotone, and
    renormalising a softmax over a subset is the softmax of that subset).

    Raises:
        ValueError: an unknown scoring function or top-k method, or a group count that does
            not divide the experts.
    """

    row_tile = 0  # > 0: batch-invariant mode (`linear`'s row_tile), set per model
    vnni: torch.Tensor | None = None  # the bf16 weight in `pack_vnni`'s layout (`set_cpu_gemm`), or None

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool,
                 config: RouterConfig = RouterConfig()) -> None:
        super().__init__()
        if config.scoring_func not in ROUTER_SCORING:
            raise ValueError(f"unsupported router scoring_func '{config.scoring_func}'; supported: "
                             f"{', '.join(ROUTER_SCORING)}")
        if config.topk_method not in TOPK_METHODS:
            raise ValueError(f"unsupported topk_method '{config.topk_method}'; supported: {', '.join(TOPK_METHODS)}")
        if config.topk_method != "greedy" and (num_experts % config.n_group or config.topk_group > config.n_group):
            raise ValueError(f"n_group {config.n_group} must divide the {num_experts} experts and be at least "
                             f"topk_group {config.topk_group}")
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False) if config.bias else None
        self.e_score_correction_bias: nn.Parameter | None = None
        if config.has_correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)
        self.num_experts, self.top_k, self.norm_topk_prob, self.config = num_experts, top_k, norm_topk_prob, config

    def set_cpu_gemm(self, on: bool) -> None:
        """Under `gemm_backend` cpu (`layers/linear.py`'s `set_cpu_gemm` calls it): a bf16
        router also keeps its weight in the VNNI layout and computes its logits with
        moestream's kernel (oneDNN's unpacked bf16 matmul costs ~50 us a call at decode)."""
        w = self.weight
        self.vnni = (pack_vnni(w.data) if on and not self.config.float32 and not self.row_tile
                     and w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.shape[1] % 2 == 0
                     and has_vnni_bf16() else None)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> router logits [T, E] float32."""
        if self.vnni is not None and x.dtype == torch.bfloat16:
            return cpu_linear_vnni(x.reshape(-1, x.shape[-1]).contiguous(), self.vnni, self.num_experts,
                                   self.bias).float()
        if self.config.float32:
            bias = None if self.bias is None else self.bias.float()
            return linear(x.float(), self.weight.float(), bias, row_tile=self.row_tile)
        return linear(x, self.weight, self.bias, row_tile=self.row_tile).float()

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> expert scores [T, E] float32 (softmax or sigmoid of the logits)."""
        logits = self.logits(x)
        if self.config.scoring_func == "softmax":
            return logits.softmax(dim=-1)  # per row (a lastdim kernel), already batch-invariant
        return sigmoid(logits, invariant=self.row_tile > 0)

    def choice_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """The scores experts are ranked by [T, E]: `scores`, plus the correction bias for
        `noaux_tc`, with the experts outside the chosen groups masked out."""
        c = self.config
        if c.topk_method == "greedy":
            return scores
        t, g = scores.shape[0], c.n_group
        if c.topk_method == "group_limited_greedy":
            group_scores = scores.view(t, g, -1).max(dim=-1).values  # [T, G]
            fill, choice = 0.0, scores
        else:  # noaux_tc
            choice = scores + self.e_score_correction_bias
            group_scores = choice.view(t, g, -1).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
            fill = float("-inf")
        group_idx = torch.topk(group_scores, k=c.topk_group, dim=-1, sorted=False)[1]  # [T, topk_group]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)  # [T, G]
        score_mask = group_mask.unsqueeze(-1).expand(-1, g, self.num_experts // g).reshape(t, self.num_experts)
        return choice.masked_fill(~score_mask.bool(), fill)

    def select(self, choice: torch.Tensor) -> torch.Tensor:
        """Expert ids [T, k] int64: the top-k of `choice` [T, E]."""
        return torch.topk(choice, k=self.top_k, dim=-1, sorted=not self.config.float32)[1]

    def weigh(self, scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Routing weights [T, k] float32 of experts `ids` [T, k] under `scores` [T, E]."""
        weights = scores.gather(1, ids)  # [T, k]
        if self.norm_topk_prob:
            total = weights.sum(dim=-1, keepdim=True)  # [T, 1]
            if self.config.scoring_func == "sigmoid":
                total = total + 1e-20  # HF's DeepseekV3 / Glm4Moe guard
            weights = weights / total
        return weights * self.config.routed_scaling_factor  # x 1.0 is exact

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.scores(x)  # [T, E]
        ids = self.select(self.choice_scores(scores))  # [T, k]
        return self.weigh(scores, ids), ids
