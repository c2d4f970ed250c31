"""Batch-invariant mode (`batch_invariant=True`): a prompt's greedy tokens and logprobs are
identical whether it runs alone or in batches of 4 and 16 with other prompts, in bf16 and
float32, resident or paged. Without the mode the same prompts differ on the CPUs measured
(BLAS kernels choose their blocking by the number of rows in a call)."""

from pathlib import Path

import pytest
import torch

from moestream import LLM, SamplingParams
from moestream.layers.activation import sigmoid, silu
from moestream.layers.linear import batch_invariant_linear, linear
from moestream.config import EngineConfig
from moestream.engine.args import engine_kwargs
from moestream.server.cli import build_parser
from tiny_checkpoint import make_tiny_checkpoint


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Wide enough (hidden 256, 16 experts) that matmul blocking changes with the row count."""
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("wide")), "qwen3_moe", hidden_size=256, head_dim=64,
                                intermediate_size=512, moe_intermediate_size=128, num_experts=16,
                                num_experts_per_tok=4, num_hidden_layers=2, mlp_only_layers=[])


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(100, 30000, (int(n),), generator=g).tolist() for n in torch.randint(5, 40, (16,), generator=g)]


def _run(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[dict[int, float]]]]:
    sp = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
            for o in outs]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_alone_equals_batches_of_4_and_16(wide_dir: str, dtype: str) -> None:
    prompts = _prompts()
    # Prefix caching off: the prompts run again after their first run, and a hit computes a
    # prompt's uncached tail as its own chunk, whose attention sums in another order.
    llm = LLM(wide_dir, dtype=dtype, batch_invariant=True, max_num_seqs=16, enable_prefix_caching=False)
    alone = [_run(llm, [p])[0] for p in prompts]
    by4 = [r for i in range(0, 16, 4) for r in _run(llm, prompts[i : i + 4])]
    by16 = _run(llm, prompts)
    assert [a[0] for a in alone] == [b[0] for b in by4] == [b[0] for b in by16]  # greedy tokens
    assert [a[1] for a in alone] == [b[1] for b in by4] == [b[1] for b in by16]  # logprobs, exactly
    if dtype == "bfloat16":  # and whatever the expert budget (a fresh prefix cache too)
        paged = LLM(wide_dir, dtype=dtype, batch_invariant=True, max_num_seqs=16, expert_budget=0.5)
        assert _run(paged, prompts) == alone
        assert paged.expert_stats()["misses"] > 0


def test_gpt_oss_alone_equals_a_batch_of_16(gpt_oss_dir: str) -> None:
    """gpt-oss (attention sinks, sliding-window KV group, biased experts): bf16 tokens and
    logprobs alone equal those in a batch of 16, past the 16-token window."""
    prompts = _prompts()
    llm = LLM(gpt_oss_dir, dtype="bfloat16", batch_invariant=True, max_num_seqs=16, enable_prefix_caching=False,
              block_size=4)
    sp = SamplingParams(max_tokens=24, temperature=0.0, logprobs=3)

    def run(ps: list[list[int]]) -> list:
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in step.items()}
                                                for step in o.outputs[0].logprobs]) for o in outs]

    assert [run([p])[0] for p in prompts] == run(prompts)


def test_float32_pointwise_tails(tmp_path: Path) -> None:
    """Regression: in float32 the router's sigmoid over 8 experts and a dense MLP's silu over
    100 columns ran partly in torch's scalar tail code, so a row's logprobs depended on the
    batch (~1e-6). GLM-4.5 layout: sigmoid router, shared expert, dense first layer."""
    d = make_tiny_checkpoint(str(tmp_path), "glm4_moe", intermediate_size=100, hidden_size=128)
    prompts = _prompts()
    llm = LLM(d, dtype="float32", batch_invariant=True, max_num_seqs=16, enable_prefix_caching=False)
    alone = [_run(llm, [p])[0] for p in prompts]
    assert _run(llm, prompts) == alone


@pytest.mark.parametrize("shape", [(70, 100), (70, 8), (33, 768), (3, 40000), (9, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_aligned_pointwise_rows_independent_of_call(shape: tuple[int, int], dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    x = (4 * torch.randn(shape, generator=g)).to(dtype)
    for fn, ref in ((silu, torch.nn.functional.silu), (sigmoid, torch.sigmoid)):
        alone = torch.cat([fn(x[i : i + 1], invariant=True) for i in range(shape[0])])
        for m in (1, 2, 5, shape[0]):
            assert torch.equal(fn(x[:m], invariant=True), alone[:m])
        assert fn(x[:, None], invariant=True).shape == (shape[0], 1, shape[1])
        torch.testing.assert_close(alone, ref(x), rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_linear_rows_independent_of_call(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(384, 256, generator=g).to(dtype)
    b = torch.randn(384, generator=g).to(dtype)
    x = torch.randn(40, 256, generator=g).to(dtype)
    alone = torch.cat([batch_invariant_linear(x[i : i + 1], w, b, 8) for i in range(40)])  # [40, 384]
    for m in (3, 8, 17, 40):
        assert torch.equal(batch_invariant_linear(x[:m], w, b, 8), alone[:m])
    assert torch.equal(linear(x[None, :5], w, b, row_tile=8)[0], alone[:5])  # leading dims kept
    torch.testing.assert_close(alone.float(), torch.nn.functional.linear(x.float(), w.float(), b.float()),
                               rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=0.3 if dtype == torch.bfloat16 else 1e-4)
    with pytest.raises(ValueError, match="row_tile"):
        batch_invariant_linear(x, w, b, 0)


def test_refused_where_not_covered(qwen3_next_dir: str) -> None:
    with pytest.raises(ValueError, match="batch_invariant is not supported for Qwen3-Next"):
        LLM(qwen3_next_dir, batch_invariant=True)
    with pytest.raises(ValueError, match="batch_invariant must be True or False"):
        LLM(qwen3_next_dir, batch_invariant="yes")


def test_cli_flag() -> None:
    args = build_parser().parse_args(["generate", "--batch-invariant", "--model", "m", "x"])
    assert engine_kwargs(args)["batch_invariant"] is True
    off = engine_kwargs(build_parser().parse_args(["generate", "--model", "m", "x"]))
    assert "batch_invariant" not in off and EngineConfig(**off).batch_invariant is False  # the declared default


def test_speculative_decoding_keeps_a_fixed_k() -> None:
    """Adaptive k follows measured step times (run to run), so batch-invariant mode turns it off."""
    from moestream.config import EngineConfig

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    assert EngineConfig("m", speculative_config=spec).speculative_config.adaptive is True
    fixed = EngineConfig("m", speculative_config=spec, batch_invariant=True).speculative_config
    assert fixed.adaptive is False and fixed.num_speculative_tokens == 3 and fixed.method == "ngram"
