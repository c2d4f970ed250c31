"""The `moestream` command line."""

import subprocess
import sys

import pytest

from moestream.server.cli import build_parser, main


def test_generate_prints_text_and_rate(qwen3_moe_dir: str, capsys: pytest.CaptureFixture) -> None:
    rc = main(["generate", "--model", qwen3_moe_dir, "--max-tokens", "5", "--max-model-len", "64", "Hello", "def f(x):"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "--- prompt: 'Hello'" in out and "--- prompt: 'def f(x):'" in out
    assert out.count("[5 tokens, finish_reason=length]") == 2
    assert "10 tokens in" in out and "tokens/s" in out


def test_generate_bad_input_is_a_clear_error(qwen3_moe_dir: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["generate", "--model", "/no/such/dir", "Hi"]) == 2
    assert "error: model directory '/no/such/dir' does not exist" in capsys.readouterr().err
    assert main(["generate", "--model", qwen3_moe_dir, "--top-p", "0", "Hi"]) == 2
    assert "top_p must be in (0, 1]" in capsys.readouterr().err
    assert main(["generate", "--model", qwen3_moe_dir, "--repetition-penalty", "0", "Hi"]) == 2
    assert "repetition_penalty must be greater than 0" in capsys.readouterr().err


def test_every_flag_has_help() -> None:
    parser = build_parser()
    subparsers = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"][0]
    for name, sub in subparsers.choices.items():
        for action in sub._actions:
            assert action.help, f"moestream {name} {action.option_strings or action.dest} has no help text"


def test_console_script_help() -> None:
    out = subprocess.run([sys.executable, "-m", "moestream.server.cli", "generate", "--help"],
                         capture_output=True, text=True, check=True).stdout
    for flag in ("--max-tokens", "--temperature", "--top-p", "--top-k", "--seed", "--model", "--kv-cache-memory-bytes"):
        assert flag in out


def test_generate_with_expert_budget_prints_same_text_and_hit_rate(qwen3_moe_dir: str, tmp_path, capsys) -> None:
    base = ["generate", "--model", qwen3_moe_dir, "--max-tokens", "6", "--max-model-len", "64", "--dtype", "float32",
            "Hello", "def f(x):"]
    assert main(base) == 0
    plain = capsys.readouterr().out
    trace = str(tmp_path / "routing.npz")
    assert main(base + ["--expert-budget", "0.25", "--record-routing", trace]) == 0
    paged = capsys.readouterr().out
    texts = lambda out: [line for line in out.splitlines() if not line.startswith("---")]  # noqa: E731
    assert texts(paged) == texts(plain)
    assert "--- experts: hit rate" in paged and "hit rate" not in plain
    from moestream.experts.trace import RoutingTrace

    t = RoutingTrace.load(trace)
    # 2 prompts: every prompt and output token (but the last sampled) routed through 2 MoE layers
    assert len(t) > 0 and {layer for layer, _ in t} == {0, 2}
    assert main(base + ["--expert-budget", "1.5"]) == 2
    assert "not a fraction in (0, 1]" in capsys.readouterr().err


def test_trace_sim_subcommand(tmp_path, capsys) -> None:
    from moestream.experts.trace import RoutingTrace

    path = str(tmp_path / "t.npz")
    RoutingTrace.from_accesses([(0, (1, 2)), (1, (0, 3)), (0, (1, 2)), (1, (3, 0))] * 5).save(path)
    assert main(["trace-sim", path, "--cache-sizes", "2,4", "--policies", "lru", "--jobs", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["slots", "lru", "belady"] in rows
    assert ["2", "0.0000", "0.0000"] in rows  # 2 slots, each access needs both: every key is evicted before reuse
    assert ["4", "0.9000", "0.9000"] in rows  # 4 slots hold all 4 keys: only the 4 first accesses miss


def test_generate_defaults_to_the_demo_model(capsys) -> None:
    assert main(["generate", "--max-tokens", "4", "--max-model-len", "64", "def f(x):"]) == 0
    out = capsys.readouterr().out
    assert "[4 tokens, finish_reason=length]" in out or "finish_reason=stop" in out
