"""Engine options declared once (`EngineConfig`'s fields) and read by LLM(**kw), the CLI's
generate and serve, and the Ray path; the CLI's first-run errors."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from moestream.config import EngineConfig
from moestream.engine.args import add_engine_args, engine_config, engine_kwargs, option_default
from moestream.server.cli import build_parser, main


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def test_every_flagged_option_is_a_flag_with_the_declared_default() -> None:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    declared = [f for f in dataclasses.fields(EngineConfig) if f.metadata["flag"]]
    assert {"--" + f.name.replace("_", "-") for f in declared} <= _flags(p)
    assert "--seed" not in _flags(p)  # the engine seed has no flag (generate's --seed is per request)
    # No flag given: nothing but the model is passed, so EngineConfig's default is the one default.
    assert engine_kwargs(p.parse_args([])) == {"model": "demo"}
    args = p.parse_args(["--max-model-len", "96", "--no-enable-prefix-caching", "--expert-budget", "0.25",
                         "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    kw = engine_kwargs(args)
    assert kw == {"model": "demo", "max_model_len": 96, "enable_prefix_caching": False, "expert_budget": 0.25,
                  "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}
    cfg = EngineConfig(**kw)
    assert cfg.max_num_seqs == option_default("max_num_seqs") == 64 and cfg.enable_prefix_caching is False
    # help states the declared default
    help_text = {a.dest: a.help for a in p._actions}
    assert help_text["max_num_batched_tokens"].endswith("(default: 2048)")


def test_generate_and_serve_take_the_same_engine_flags() -> None:
    parser = build_parser()
    gen = parser.parse_args(["generate", "--max-num-seqs", "3", "--expert-policy", "lru", "x"])
    srv = parser.parse_args(["serve", "--max-num-seqs", "3", "--expert-policy", "lru"])
    assert engine_kwargs(gen) == engine_kwargs(srv) == {"model": "demo", "max_num_seqs": 3, "expert_policy": "lru"}


def test_llm_keyword_filter() -> None:
    with pytest.raises(TypeError, match=r"unknown engine argument 'max_num_seq' \(did you mean 'max_num_seqs'\?\)"):
        engine_config("demo", max_num_seq=3)
    with pytest.raises(ValueError, match="unknown expert policy 'fifo'; use one of lru, lfu, activation, next_use"):
        engine_config("demo", expert_policy="fifo")
    assert engine_config("demo", max_num_seqs=3, threads=1).max_num_seqs == 3


def test_unknown_flag_prints_the_subcommands_usage(capsys: pytest.CaptureFixture) -> None:
    for cmd in ("generate", "serve"):
        with pytest.raises(SystemExit) as e:
            main([cmd, "--frobnicate", "hi"] if cmd == "generate" else [cmd, "--frobnicate"])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith(f"usage: moestream {cmd} ") and "unrecognized arguments: --frobnicate" in err


def test_mistyped_model_directory_is_an_error(tmp_path, capsys: pytest.CaptureFixture) -> None:
    typo = str(tmp_path / "qwen3-moe-typo")
    assert main(["generate", typo, "hi"]) == 2
    err = capsys.readouterr().err
    assert f"error: model directory '{typo}' does not exist" in err


def test_generate_takes_prompts_after_flags(qwen3_moe_dir: str, capsys: pytest.CaptureFixture) -> None:
    """Regression: `generate DIR --max-tokens 2 PROMPT` was refused ('unrecognized arguments')."""
    assert main(["generate", qwen3_moe_dir, "--max-tokens", "2", "--max-model-len", "64", "Hi", "--seed", "1",
                 "Yo"]) == 0
    out = capsys.readouterr().out
    assert "--- prompt: 'Hi'" in out and "--- prompt: 'Yo'" in out and out.count("[2 tokens") == 2


def test_near_miss_of_a_builtin_model_is_an_error(capsys: pytest.CaptureFixture) -> None:
    from moestream.server.cli_generate import split_model_and_prompts

    with pytest.raises(ValueError, match="'demo-hybridd' is not a built-in model; did you mean 'demo-hybrid'"):
        split_model_and_prompts("demo-hybridd", ["hi"])
    assert split_model_and_prompts("demo hybrid", ["hi"]) == (None, ["demo hybrid", "hi"])  # prose: a prompt
    assert main(["generate", "demo-hybrd", "hi"]) == 2 and "did you mean 'demo-hybrid'" in capsys.readouterr().err
