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
