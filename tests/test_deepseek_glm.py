"""DeepSeek-V2, DeepSeek-V3 and GLM-4.5: HF float32 parity (8 prompts decoded together, and
chunked prefill under preemption), each routing method against HF's router on random scores
with ties, the MLA latent cache's size, prefix caching over latents, paging bit-exactness at
three budgets, and the config errors (quantized checkpoints, unsupported routing)."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from conftest import NUM_NEW_TOKENS, HFReference, parity_prompts
from parity import LogitsRecorder, check_all, greedy_params
from safetensors.torch import save_file
from tiny_checkpoint import make_tiny_checkpoint

from moestream.models.hf_config import model_config_from_hf, model_config_from_dict
from moestream import LLM, SamplingParams
from moestream.config import RouterConfig
from moestream.layers.router import TopKRouter

# (fixture name, model_type, overrides): V2 greedy without q LoRA, V2 group-limited,
# V3 (q LoRA, sigmoid + bias, groups, yarn), GLM-4.5 with and without q/k norm and bias.
VARIANTS = {
    "deepseek_v2": ("deepseek_v2", {}),
    "deepseek_v2_grouped": ("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2)),
    "deepseek_v3": ("deepseek_v3", {}),
    "glm4_moe": ("glm4_moe", {}),
    "glm4_moe_plain": ("glm4_moe", dict(use_qk_norm=False, attention_bias=False)),
}
MAIN = ["deepseek_v2", "deepseek_v3", "glm4_moe"]


@pytest.fixture(scope="module")
def checkpoints() -> dict[str, str]:
    """name -> checkpoint directory, made on first use (`_dir`)."""
    return {}


def _dir(checkpoints: dict[str, str], tmp_path_factory: pytest.TempPathFactory, name: str) -> str:
    if name not in checkpoints:
        model_type, overrides = VARIANTS[name]
        seed = list(VARIANTS).index(name) + 10
        checkpoints[name] = make_tiny_checkpoint(str(tmp_path_factory.mktemp(name)), model_type, seed=seed,
                                                 **overrides)
    return checkpoints[name]


@pytest.fixture(scope="module")
def references() -> dict[str, HFReference]:
    return {}


def _generate(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], LogitsRecorder]]:
    recs = [LogitsRecorder() for _ in prompts]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [greedy_params(r, NUM_NEW_TOKENS) for r in recs])
    return [(o.outputs[0].token_ids, r) for o, r in zip(outs, recs)]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_parity_batch(name: str, checkpoints, references, tmp_path_factory) -> None:
    d = _dir(checkpoints, tmp_path_factory, name)
    references[name] = ref = references.get(name) or HFReference(d)
    prompts = parity_prompts()
    llm = LLM(d, dtype="float32", max_model_len=128)
    check_all(prompts, _generate(llm, prompts), ref, name)


@pytest.mark.parametrize("name", MAIN)
def test_parity_chunked_prefill_under_preemption(name: str, checkpoints, references, tmp_path_factory) -> None:
    d = _dir(checkpoints, tmp_path_factory, name)
    references[name] = ref = references.get(name) or HFReference(d)
    prompts = parity_prompts()
    cfg = model_config_from_hf(d)
    heads, k_dim, v_dim = cfg.kv_cache_dims
    block = len(cfg.attention_layers) * heads * (k_dim + v_dim) * 4 * 16  # float32 bytes of one 16-token block
    llm = LLM(d, dtype="float32", max_model_len=80, max_num_batched_tokens=10, kv_cache_memory_bytes=12 * block)
    engine = llm.llm_engine
    assert engine.kv_cache.num_blocks == 12
    results = _generate(llm, prompts)
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv_cache.num_free_blocks == 12
    check_all(prompts, results, ref, f"{name} chunked + preemption")


@pytest.mark.parametrize("name", MAIN)
def test_kv_cache_bytes_per_token(name: str, checkpoints, tmp_path_factory) -> None:
    d = _dir(checkpoints, tmp_path_factory, name)
    cfg = model_config_from_hf(d)
    for dtype, size in (("float32", 4), ("bfloat16", 2)):
        llm = LLM(d, dtype=dtype, max_model_len=64)
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 2, SamplingParams(temperature=0, max_tokens=4))
        assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]  # runs in this dtype (router in float32)
        stats = llm.kv_cache_stats()
        if cfg.mla is not None:  # the latent and the rope key, nothing per head
            assert stats["bytes_per_token"] == cfg.num_layers * (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim) * size
            m = cfg.mla
            assert stats["mha_bytes_per_token"] == cfg.num_layers * cfg.num_heads * (
                m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * size
            k, v = llm.llm_engine.runner.kv_caches[0]
            assert k.shape[2:] == (1, m.kv_lora_rank + m.qk_rope_head_dim) and v.numel() == 0
        else:
            assert stats["bytes_per_token"] == cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * size
            assert "mha_bytes_per_token" not in stats


def test_prefix_cache_holds_latents(checkpoints, tmp_path_factory) -> None:
    """A shared prefix is served from cached latent blocks, and the text equals a cold run."""
    d = _dir(checkpoints, tmp_path_factory, "deepseek_v3")
    shared = parity_prompts()[-1]  # 40 tokens: two full blocks
    prompts = [shared + [100 + i, 200 + i] for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=8)
    cold = [LLM(d, dtype="float32", max_model_len=96, enable_prefix_caching=False).generate(
        [{"prompt_token_ids": p}], params)[0].outputs[0].token_ids for p in prompts[:1]]
    llm = LLM(d, dtype="float32", max_model_len=96, enable_prefix_caching=True)
    warm = [llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids for p in prompts]
    stats = llm.prefix_cache_stats()
    assert stats["hits"] >= 2 * 32, stats  # the 2nd and 3rd prompts hit both full blocks
    assert warm[0] == cold[0]
    ref = LLM(d, dtype="float32", max_model_len=96, enable_prefix_caching=False)
    assert warm[1:] == [o.outputs[0].token_ids for o in ref.generate([{"prompt_token_ids": p} for p in prompts[1:]],
                                                                       params)]


@pytest.mark.parametrize("name", MAIN)
def test_paging_bit_exact(name: str, checkpoints, tmp_path_factory) -> None:
    d = _dir(checkpoints, tmp_path_factory, name)
    cfg = model_config_from_hf(d)
    expert = 3 * cfg.moe_intermediate_size * cfg.hidden_size * 4
    prompts = parity_prompts()[:4]

    def run(**kw) -> tuple[list[list[int]], list[list[torch.Tensor]], LLM]:
        llm = LLM(d, dtype="float32", max_model_len=96, **kw)
        recs = [LogitsRecorder() for _ in prompts]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            [SamplingParams(temperature=0, max_tokens=10, logits_processors=[r]) for r in recs])
        return [o.outputs[0].token_ids for o in outs], [r.logits for r in recs], llm

    tokens, logits, llm = run()
    assert llm.expert_stats()["resident"] is True
    # 50% for MLA models is the elastic run below (the latent cache as page-pool views)
    budgets = (0.25, cfg.num_experts_per_tok * expert) + ((0.5,) if cfg.mla is None else ())
    for budget in budgets:
        t, lg, llm = run(expert_budget=budget)
        stats = llm.expert_stats()
        assert stats["resident"] is False and stats["misses"] > 0
        assert t == tokens
        assert all(torch.equal(a, b) for x, y in zip(lg, logits) for a, b in zip(x, y))
    if cfg.mla is not None:
        t, lg, llm = run(expert_budget=0.5, enable_elastic_memory=True)
        assert llm.expert_stats()["resident"] is False
        assert t == tokens and all(torch.equal(a, b) for x, y in zip(lg, logits) for a, b in zip(x, y))


def _hf_router(kind: str, num_experts: int, hidden: int, top_k: int, n_group: int, topk_group: int,
               scaling: float, norm: bool) -> torch.nn.Module:
    from transformers import DeepseekV2Config, DeepseekV3Config, Glm4MoeConfig
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    common = dict(hidden_size=hidden, num_experts_per_tok=top_k, n_routed_experts=num_experts,
                  routed_scaling_factor=scaling, norm_topk_prob=norm)
    if kind in ("greedy", "group_limited_greedy"):
        return DeepseekV2TopkRouter(DeepseekV2Config(topk_method=kind, n_group=n_group, topk_group=topk_group,
                                                     **common))
    if kind == "deepseek_v3":
        return DeepseekV3TopkRouter(DeepseekV3Config(n_group=n_group, topk_group=topk_group, **common))
    return Glm4MoeTopkRouter(Glm4MoeConfig(n_group=n_group, topk_group=topk_group, **common))


@pytest.mark.parametrize("kind", ["greedy", "group_limited_greedy", "deepseek_v3", "glm4_moe"])
def test_router_matches_hf(kind: str) -> None:
    """Same experts and weights as HF's router, on random inputs whose scores tie: experts 0-3
    share one gate row and 8-9 another, so their scores are equal."""
    torch.manual_seed(0)
    e, h, k, groups, topk_group, scaling = 16, 32, 4, 4, 2, 2.0
    hf = _hf_router(kind, e, h, k, groups, topk_group, scaling, norm=True)
    weight = torch.randn(e, h)
    weight[1:4] = weight[0]
    weight[9] = weight[8]
    hf.weight.data.copy_(weight)
    sigmoid = kind in ("deepseek_v3", "glm4_moe")
    if sigmoid:
        bias = torch.randn(e) * 0.1
        bias[1:4] = bias[0]
        hf.e_score_correction_bias.copy_(bias)
    config = RouterConfig(
        scoring_func="sigmoid" if sigmoid else "softmax",
        topk_method="noaux_tc" if sigmoid else kind,
        n_group=groups, topk_group=topk_group, routed_scaling_factor=scaling, float32=True)
    ours = TopKRouter(h, e, k, norm_topk_prob=sigmoid, config=config)  # V2 never renormalises, as HF
    ours.weight.data.copy_(weight)
    if sigmoid:
        ours.e_score_correction_bias.data.copy_(bias)
    x = torch.randn(64, h)
    x[:8] = 0.0  # all-zero rows: every score equal
    _, hf_w, hf_ids = hf(x)
    w, ids = ours(x)
    assert torch.equal(ids, hf_ids)
    assert torch.equal(w, hf_w)
    if kind != "greedy":  # the group limit binds: some token's top-k differs from the plain top-k
        plain = torch.topk(ours.scores(x) + (ours.e_score_correction_bias if sigmoid else 0), k, dim=-1)[1]
        assert not torch.equal(plain.sort(-1).values, ids.sort(-1).values)


def _write_config(d: str, **changes: object) -> str:
    path = os.path.join(d, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    return json.dumps(cfg)


_YARN = dict(rope_type="yarn", rope_theta=10000.0, original_max_position_embeddings=128)


@pytest.mark.parametrize("name, changes, message", [
    ("deepseek_v2", dict(quantization_config={"quant_method": "awq", "bits": 4}),
     "quantization_config quant_method 'awq' is not supported; moestream reads fp8, compressed-tensors, gptq, mxfp4"),
    ("deepseek_v2", dict(topk_method="noaux_tc"), "field 'topk_method' is 'noaux_tc'"),
    ("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=3, topk_group=2),
     "field 'n_group' is 3; it must divide the 8 routed experts"),
    ("deepseek_v2", dict(mlp_bias=True), "field 'mlp_bias' is true"),
    # found by a break-test: each of these loaded, then failed inside torch at the first request
    ("deepseek_v2", dict(num_experts_per_tok=9), "field 'num_experts_per_tok' is 9, more than the 8 routed experts"),
    ("deepseek_v3", dict(topk_group=5), "field 'topk_group' is 5, more than the n_group 4 groups"),
    ("deepseek_v3", dict(n_group=8), "field 'n_group' is 8; groups are ranked by their top-2 experts"),
    ("deepseek_v3", dict(qk_rope_head_dim=7), "field 'qk_rope_head_dim' is 7"),
    ("deepseek_v3", dict(routed_scaling_factor=-1.0), "field 'routed_scaling_factor' must be positive, got -1.0"),
    ("deepseek_v3", dict(rope_parameters=_YARN), "field 'rope_parameters.factor' is missing; rope type 'yarn' needs"),
    ("deepseek_v3", dict(rope_parameters=dict(_YARN, factor=-1.0)), "field 'rope_parameters.factor' must be positive"),
    ("glm4_moe", dict(rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=1.5)),
     "field 'partial_rotary_factor' is 1.5; it must be in (0, 1]"),
])
def test_config_errors(name: str, changes: dict, message: str, checkpoints, tmp_path_factory) -> None:
    d = _dir(checkpoints, tmp_path_factory, name)
    with pytest.raises(ValueError) as err:
        model_config_from_dict(json.loads(_write_config(d, **changes)), "x/config.json")
    assert message in str(err.value) and "config.json at x/config.json" in str(err.value)


def test_mtp_layer_tensors_are_skipped_with_a_log_line(checkpoints, tmp_path_factory, tmp_path, caplog) -> None:
    """A DeepSeek-V3 checkpoint's next-n layer (`model.layers.{L}.*`) loads without error and is named in the log."""
    src = _dir(checkpoints, tmp_path_factory, "deepseek_v3")
    d = str(tmp_path / "with_mtp")
    os.makedirs(d)
    for f in os.listdir(src):
        os.symlink(os.path.join(src, f), os.path.join(d, f))
    save_file({"model.layers.3.eh_proj.weight": torch.zeros(64, 128),
               "model.layers.3.enorm.weight": torch.ones(64)}, os.path.join(d, "mtp.safetensors"))
    params = SamplingParams(temperature=0, max_tokens=6)
    with caplog.at_level(logging.INFO, logger="moestream.loader"):
        out = LLM(d, dtype="float32", max_model_len=64).generate([{"prompt_token_ids": [5, 6, 7]}], params)
    assert "model.layers.3 (2 tensors)" in caplog.text
    plain = LLM(src, dtype="float32", max_model_len=64).generate([{"prompt_token_ids": [5, 6, 7]}], params)
    assert out[0].outputs[0].token_ids == plain[0].outputs[0].token_ids


def _fuse_experts(src: str, dst: str) -> int:
    """Copy checkpoint `src` to `dst` with each layer's per-expert tensors replaced by
    transformers 5's fused ones (gate_up_proj [E, 2I, H], down_proj [E, H, I]). Returns the
    number of fused layers."""
    import re

    from safetensors.torch import load_file

    os.makedirs(dst)
    for f in os.listdir(src):
        if not f.endswith(".safetensors"):
            os.symlink(os.path.join(src, f), os.path.join(dst, f))
    tensors = load_file(os.path.join(src, "model.safetensors"))
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out = {}
    for name, t in tensors.items():
        m = re.match(r"(.*\.(?:mlp|mixer)\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", name)
        if m is None:
            out[name] = t
        else:
            experts.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = t
    for stem, by_expert in experts.items():
        order = sorted(by_expert)
        if "gate" not in by_expert[order[0]]:  # ungated experts (Nemotron-H): up_proj [E, I, H]
            out[f"{stem}.up_proj"] = torch.stack([by_expert[e]["up"] for e in order])
        else:
            out[f"{stem}.gate_up_proj"] = torch.stack([torch.cat((by_expert[e]["gate"], by_expert[e]["up"]))
                                                       for e in order])
        out[f"{stem}.down_proj"] = torch.stack([by_expert[e]["down"] for e in order])
    save_file(out, os.path.join(dst, "model.safetensors"))
    return len(experts)


@pytest.mark.parametrize("which", ["qwen3_moe", "deepseek_v3", "nemotron_h"])
def test_fused_expert_tensors_load_in_place(which: str, request: pytest.FixtureRequest, checkpoints, tmp_path_factory,
                                            tmp_path) -> None:
    """A checkpoint with fused 3-D expert tensors gives the per-expert checkpoint's output,
    resident and paged (the paged store reads each expert's slice of the fused tensor;
    Nemotron-H's ungated experts: up_proj [E, I, H] and down_proj)."""
    src = (_dir(checkpoints, tmp_path_factory, which) if which == "deepseek_v3"
           else request.getfixturevalue(f"{which}_dir"))
    dst = str(tmp_path / "fused")
    assert _fuse_experts(src, dst) == sum(model_config_from_hf(src).moe_layers)
    prompts = [{"prompt_token_ids": p} for p in parity_prompts()[:3]]
    params = SamplingParams(temperature=0, max_tokens=8)

    def tokens(d: str, **kw) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in LLM(d, dtype="float32", max_model_len=64, **kw).generate(prompts, params)]

    expected = tokens(src)
    assert tokens(dst) == expected
    assert tokens(dst, expert_budget=0.25) == expected


def test_routing_trace_of_a_deepseek_model_replays(checkpoints, tmp_path_factory, tmp_path, capsys) -> None:
    """The recorder writes a DeepSeek-V3 model's routing in moestream's trace format (MoE
    layers only: layer 0 is dense), and trace-sim replays it like any other."""
    from moestream.experts.trace import RoutingTrace
    from moestream.experts.trace_sim import trace_sim_main

    d = _dir(checkpoints, tmp_path_factory, "deepseek_v3")
    path = str(tmp_path / "trace.npz")
    llm = LLM(d, dtype="float32", max_model_len=64, record_routing=path)
    llm.generate([{"prompt_token_ids": p} for p in parity_prompts()[:3]], SamplingParams(temperature=0, max_tokens=6))
    llm.llm_engine.save_routing_trace()
    trace = RoutingTrace.load(path)
    assert sorted(set(trace.layer.tolist())) == [1, 2]
    assert len(trace) == 2 * (1 + 3 + 7 + 3 * 5)  # per MoE layer, one access per computed token
    assert trace_sim_main([path, "--cache-sizes", "0.5", "--jobs", "1"]) == 0
    assert "belady" in capsys.readouterr().out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_absorbed_mla_weights_are_made_once_and_keep_the_bits(dtype: torch.dtype) -> None:
    """MLA's absorbed products read kv_b_proj's weight as w_uk [H, dn, r] and w_uv [H, dv, r]:
    kept across calls (the same tensors; the bf16 batched matmul had copied strided views of
    them on every call) until the weight changes, and giving the products of the strided views
    bit for bit, at DeepSeek-V2-Lite's head dims, for 1 to 64 rows (a w_uv kept plainly
    contiguous changed the bf16 product from 62 rows on)."""
    from moestream.config import MLAConfig
    from moestream.layers.mla import MLAttention

    h, dn, dr, dv, r = 8, 128, 64, 128, 512
    mla = MLAttention(256, h, MLAConfig(None, r, dn, dr, dv, False, (dn + dr) ** -0.5), False, None, None)
    torch.manual_seed(0)
    with torch.no_grad():
        mla.kv_b_proj.weight.copy_(torch.randn(h * (dn + dv), r))
    mla.to(dtype)
    w_uk, w_uv = mla.absorbed_weights(dtype)
    assert mla.absorbed_weights(dtype)[0] is w_uk and mla.absorbed_weights(dtype)[1] is w_uv
    strided = mla.kv_b_proj.weight.view(h, dn + dv, r)
    assert torch.equal(w_uk, strided[:, :dn]) and torch.equal(w_uv, strided[:, dn:])
    for t in (1, 5, 62, 64):
        q, o = torch.randn(t, h, dn).to(dtype), torch.randn(t, h, r).to(dtype)
        assert torch.equal(torch.einsum("thd,hdr->thr", q, w_uk), torch.einsum("thd,hdr->thr", q, strided[:, :dn]))
        assert torch.equal(torch.einsum("thr,hvr->thv", o, w_uv), torch.einsum("thr,hvr->thv", o, strided[:, dn:]))
    before = w_uv.clone()
    with torch.no_grad():
        mla.kv_b_proj.weight.mul_(2)  # a new weight version: made again
    assert torch.equal(mla.absorbed_weights(dtype)[1], 2 * before)
