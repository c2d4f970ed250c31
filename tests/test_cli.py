"""The `moestream` command line: generate, start-up cost, the package's lazy exports."""

import json
import os
import re
import subprocess
import sys

import pytest

from moestream.threads import available_cores

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
    assert ["slots", "policy", "hit", "rate", "misses", "x", "belady"] in rows
    # 2 slots, each access needs both: every key is evicted before reuse (40 misses, as Belady)
    assert ["2", "lru", "0.0000", "40", "1.000"] in rows and ["2", "belady", "0.0000", "40", "1.000"] in rows
    # 4 slots hold all 4 keys: only the 4 first accesses miss
    assert ["4", "lru", "0.9000", "4", "1.000"] in rows


def test_generate_defaults_to_the_demo_model(capsys) -> None:
    assert main(["generate", "--max-tokens", "4", "--max-model-len", "64", "def f(x):"]) == 0
    out = capsys.readouterr().out
    assert "[4 tokens, finish_reason=length]" in out or "finish_reason=stop" in out


# ---- start-up cost: no torch / transformers before a command runs -------------------------


def test_parser_and_package_import_neither_torch_nor_transformers() -> None:
    code = ("import moestream.server.cli, sys; moestream.server.cli.build_parser(); "
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_help_and_argument_errors_load_no_torch() -> None:
    code = ("import sys\nfrom moestream.server.cli import main\n"
            "for argv in (['--help'], ['generate', '--help'], ['serve', '--help'], ['generate', '--top-k', 'x', 'a']):\n"
            "    try:\n        main(argv)\n    except SystemExit as e:\n        print('exit', e.code, file=sys.stderr)\n"
            "print('torch' in sys.modules, 'transformers' in sys.modules, file=sys.stderr)")
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stderr
    assert err.count("exit 0") == 3 and "exit 2" in err and "invalid int value: 'x'" in err
    assert err.strip().splitlines()[-1] == "False False"


def test_lazy_package_exports() -> None:
    import moestream
    from moestream import LLM, CompletionOutput, EngineConfig, ModelConfig, RequestOutput, SamplingParams
    from moestream.llm import LLM as LLM_

    assert LLM is LLM_ and SamplingParams(max_tokens=3).max_tokens == 3
    assert {c.__name__ for c in (EngineConfig, ModelConfig, RequestOutput, CompletionOutput)} == {
        "EngineConfig", "ModelConfig", "RequestOutput", "CompletionOutput"}
    assert set(moestream.__all__) <= set(dir(moestream))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        moestream.nope  # noqa: B018


# ---- generate --threads -----------------------------------------------------------------------


def test_resolve_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    from moestream.threads import resolve_threads

    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # an idle machine: no fallback under load

    assert resolve_threads("auto", "cpu") == available_cores()  # generate, offline LLM
    assert resolve_threads("auto", "cpu", reserve=1) == max(1, available_cores() - 1)  # serve
    assert resolve_threads("auto", "cuda:0") is None
    assert resolve_threads(3, "cpu") == 3
    assert resolve_threads(1024, "cpu") == 1024
    with pytest.raises(ValueError, match="device must be a torch device"):
        resolve_threads("auto", "gpu")
    # Regression: 10**5 threads crashed torch's OpenMP pool (SIGSEGV), 2**31 overflowed.
    for huge in (1025, 10**5, 2**31):
        with pytest.raises(ValueError, match=f"threads={huge} is more than 1024"):
            resolve_threads(huge, "cpu")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--threads", "100000", "x"])
    assert build_parser().parse_args(["generate", "x"]).threads is None  # not given: EngineConfig's "auto"
    assert build_parser().parse_args(["generate", "--threads", "2", "x"]).threads == 2


def test_generate_sets_the_torch_thread_count(qwen3_moe_dir: str, capsys: pytest.CaptureFixture,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # an idle machine: no fallback under load
    from moestream.threads import resolve_threads

    before = torch.get_num_threads()
    auto = resolve_threads("auto", "cpu")
    base = ["generate", "--model", qwen3_moe_dir, "--max-tokens", "2", "--max-model-len", "64", "Hi"]
    try:
        torch.set_num_threads(2)
        assert main(base + ["--threads", "1"]) == 0
        assert torch.get_num_threads() == 1
        assert "tokens/s (1 torch thread)\n" in capsys.readouterr().out  # the count used, printed without -v
        torch.set_num_threads(1)
        assert main(base) == 0
        assert torch.get_num_threads() == auto
        assert f"tokens/s ({auto} torch thread{'s' * (auto != 1)})\n" in capsys.readouterr().out
    finally:
        torch.set_num_threads(before)


# ---- generate [MODEL_DIR] PROMPT ... ---------------------------------------------------------------


def test_split_model_and_prompts(tmp_path) -> None:
    from moestream.server.cli_generate import split_model_and_prompts

    d = str(tmp_path)
    assert split_model_and_prompts(d, ["Hi", "Yo"]) == (d, ["Hi", "Yo"])
    assert split_model_and_prompts(None, [d]) == (None, [d])  # a lone directory is a prompt
    assert split_model_and_prompts("Hi", ["Yo"]) == (None, ["Hi", "Yo"])  # not a directory: a prompt
    # Regression: a mistyped model directory was taken as a first prompt (exit 0); a path-like
    # first argument that is not a directory is an error naming it.
    for typo in (str(tmp_path / "missing"), "./ckpt", "models/qwen"):
        with pytest.raises(ValueError, match=f"model directory '{re.escape(typo)}' does not exist"):
            split_model_and_prompts(typo, ["Yo"])
    assert split_model_and_prompts("Hi there.", ["Yo"]) == (None, ["Hi there.", "Yo"])  # not path-like: a prompt
    assert split_model_and_prompts("demo-hybrid", ["Yo"]) == ("demo-hybrid", ["Yo"])  # a built-in model's name
    assert split_model_and_prompts(None, ["demo"]) == (None, ["demo"])  # alone, a prompt


def test_generate_takes_the_model_as_first_positional(qwen3_moe_dir: str, tmp_path,
                                                      capsys: pytest.CaptureFixture) -> None:
    flags = ["--max-tokens", "4", "--max-model-len", "64", "--dtype", "float32"]
    assert main(["generate", *flags, "--model", qwen3_moe_dir, "Hello", "def f(x):"]) == 0
    with_flag = capsys.readouterr().out
    assert main(["generate", *flags, qwen3_moe_dir, "Hello", "def f(x):"]) == 0
    positional = capsys.readouterr().out
    texts = lambda out: [line for line in out.splitlines() if not line.startswith("--- ") or "prompt" in line]  # noqa: E731
    assert texts(positional) == texts(with_flag) and "--- prompt: 'Hello'" in positional
    assert qwen3_moe_dir not in positional
    # the same directory twice is fine; a lone directory is a prompt
    assert main(["generate", *flags, "--model", qwen3_moe_dir, qwen3_moe_dir, "Hello"]) == 0
    assert "--- prompt: 'Hello'" in capsys.readouterr().out
    assert main(["generate", *flags, "--model", qwen3_moe_dir, qwen3_moe_dir]) == 0
    assert f"--- prompt: {qwen3_moe_dir!r}" in capsys.readouterr().out
    assert main(["generate", *flags, "--model", qwen3_moe_dir, str(tmp_path), "Hello"]) == 2
    assert f"error: MODEL_DIR '{tmp_path}' and --model '{qwen3_moe_dir}' differ" in capsys.readouterr().err


# ---- generate's sampling flags -------------------------------------------------------------------


def _spy_generate(monkeypatch: pytest.MonkeyPatch) -> list:
    """Record (prompts, sampling params) of every LLM.generate call."""
    from moestream.llm import LLM

    calls = []
    original = LLM.generate_stream  # generate runs through it (measuring its speed)

    def spy(self, prompts, sampling_params=None, **kw):
        calls.append((list(prompts), list(sampling_params)))
        return original(self, prompts, sampling_params, **kw)

    monkeypatch.setattr(LLM, "generate_stream", spy)
    return calls


def test_generate_sampling_flags_reach_sampling_params(qwen3_moe_dir: str, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture) -> None:
    from moestream import SamplingParams

    calls = _spy_generate(monkeypatch)
    base = ["generate", "--model", qwen3_moe_dir, "--max-model-len", "64"]
    assert main(base + ["Hi"]) == 0
    (prompts, params), = calls
    defaults = SamplingParams()
    assert prompts == ["Hi"] and len(params) == 1
    assert params[0].temperature == 0.0 and params[0].max_tokens == 64  # generate's own defaults
    for field in ("top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "repetition_penalty",
                  "presence_penalty", "frequency_penalty", "logprobs"):
        assert getattr(params[0], field) == getattr(defaults, field), field
    calls.clear()
    assert main(base + ["--max-tokens", "3", "--temperature", "0.7", "--top-p", "0.9", "--top-k", "5", "--min-p",
                        "0.05", "--seed", "7", "--repetition-penalty", "1.1", "--presence-penalty", "0.5",
                        "--frequency-penalty", "-0.25", "--stop", "zz", "--stop-token-ids", "5,6",
                        "--stop-token-ids", "9", "--ignore-eos", "--n", "2", "--logprobs", "1", "Hi", "Yo"]) == 0
    (prompts, params), = calls
    assert prompts == ["Hi", "Hi", "Yo", "Yo"]
    assert [p.seed for p in params] == [7, 8, 7, 8]  # choice i: seed + i, as the HTTP API
    for p in params:
        assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (3, 0.7, 0.9, 5, 0.05, 1.1)
        assert (p.presence_penalty, p.frequency_penalty, p.stop, p.stop_token_ids) == (0.5, -0.25, ["zz"], [5, 6, 9])
        assert p.ignore_eos is True and p.logprobs == 1
    capsys.readouterr()


def _first_greedy_token(llm, prompt: str) -> int:
    from moestream import SamplingParams

    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1))[0].outputs[0].token_ids[0]


def test_generate_ignore_eos_and_stop_token_ids(qwen3_moe_dir: str, offline_llm, tmp_path,
                                                capsys: pytest.CaptureFixture) -> None:
    token = _first_greedy_token(offline_llm, "Hello")
    # A copy of the checkpoint whose EOS is the first token greedy decoding of "Hello" picks.
    eos_dir = tmp_path / "eos"
    eos_dir.mkdir()
    for name in os.listdir(qwen3_moe_dir):
        if name != "config.json":
            os.symlink(os.path.join(qwen3_moe_dir, name), eos_dir / name)
    with open(os.path.join(qwen3_moe_dir, "config.json")) as f:
        config = json.load(f)
    config["eos_token_id"] = [config["eos_token_id"], token]
    (eos_dir / "config.json").write_text(json.dumps(config))
    base = ["generate", "--max-tokens", "5", "--max-model-len", "64", "--dtype", "float32"]
    assert main(base + [str(eos_dir), "Hello"]) == 0
    assert "[1 tokens, finish_reason=stop]" in capsys.readouterr().out
    assert main(base + ["--ignore-eos", str(eos_dir), "Hello"]) == 0
    assert "[5 tokens, finish_reason=length]" in capsys.readouterr().out
    assert main(base + ["--stop-token-ids", f"{token + 1},{token}", qwen3_moe_dir, "Hello"]) == 0
    assert f"[1 tokens, finish_reason=stop, stop_reason={token}]" in capsys.readouterr().out


def test_generate_n_prints_labelled_choices(qwen3_moe_dir: str, capsys: pytest.CaptureFixture) -> None:
    argv = ["generate", "--model", qwen3_moe_dir, "--max-tokens", "6", "--max-model-len", "64", "--temperature", "1",
            "--ignore-eos", "--seed", "3", "Hello", "def f(x):"]
    assert main(argv[:1] + ["--n", "3"] + argv[1:]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out.count("--- choice 0") == out.count("--- choice 1") == out.count("--- choice 2") == 2
    assert "--- choice 3" not in out and out.count("[6 tokens, finish_reason=length]") == 6
    assert any(line.startswith("--- 36 tokens in") for line in out)
    first = out.index("--- prompt: 'def f(x):'")
    hello = [out[i + 1] for i in range(first) if out[i].startswith("--- choice")]
    assert len(set(hello)) > 1  # seeds 3, 4, 5: the choices differ
    # choice 0 (seed 3) is the run without --n
    assert main(argv) == 0
    single = capsys.readouterr().out.splitlines()
    assert single[single.index("--- prompt: 'Hello'") + 1] == hello[0] and "--- choice 0" not in single


def test_generate_logprobs_are_printed(qwen3_moe_dir: str, offline_llm, capsys: pytest.CaptureFixture) -> None:
    from moestream import SamplingParams

    assert main(["generate", "--model", qwen3_moe_dir, "--max-tokens", "3", "--max-model-len", "64", "--dtype",
                 "float32", "--ignore-eos", "--logprobs", "2", "Hello"]) == 0
    out = capsys.readouterr().out.splitlines()
    start = out.index("--- logprobs (token logprob | top 2):")
    rows = out[start + 1:start + 4]
    ref = offline_llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2))
    c = ref[0].outputs[0]
    for row, token, entry in zip(rows, c.token_ids, c.logprobs):
        top = sorted((lp for lp in entry.values() if lp.rank <= 2), key=lambda lp: lp.rank)
        chosen = entry[token]
        expected = (f"  {chosen.decoded_token!r} {chosen.logprob:.3f} | top: "
                    + ", ".join(f"{lp.decoded_token!r} {lp.logprob:.3f}" for lp in top))
        assert row == expected
    assert len(rows) == 3 and out[start + 4].startswith("--- 3 tokens in")


def test_generate_bad_sampling_flags_are_one_line_errors(qwen3_moe_dir: str, tmp_path,
                                                         capsys: pytest.CaptureFixture) -> None:
    base = ["generate", "--model", qwen3_moe_dir, "--max-tokens", "2", "--max-model-len", "64"]
    assert main(base + ["--presence-penalty", "3", "Hi"]) == 2
    assert capsys.readouterr().err == "error: presence_penalty must be in [-2, 2], got 3.0\n"
    assert main(base + ["--logprobs", "-1", "Hi"]) == 2
    assert capsys.readouterr().err.startswith("error: logprobs must be None or an int of at least 0")
    assert main(base + ["--device", "gpu", "Hi"]) == 2
    assert capsys.readouterr().err.startswith("error: device must be a torch device")
    missing = tmp_path / "no" / "trace.npz"
    assert main(base + ["--record-routing", str(missing), "Hi"]) == 2  # an OSError
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(missing) in err and err.count("\n") == 1
    for flag, value, message in (("--n", "0", "expected a positive integer"),
                                 ("--stop-token-ids", "a,b", "expected comma-separated token ids")):
        with pytest.raises(SystemExit) as e:
            main(base + [flag, value, "Hi"])
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_generate_fills_unset_fields_from_generation_config(qwen3_moe_dir: str, tmp_path,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture) -> None:
    d = tmp_path / "ckpt"
    d.mkdir()
    for name in os.listdir(qwen3_moe_dir):
        if name != "generation_config.json":
            os.symlink(os.path.join(qwen3_moe_dir, name), d / name)
    (d / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.25, "top_k": 7,
                                                          "temperature": 0.9, "max_new_tokens": 500}))
    calls = _spy_generate(monkeypatch)
    base = ["generate", "--max-model-len", "64"]
    assert main(base + [str(d), "Hi"]) == 0
    (_, params), = calls
    # The model's values fill the fields not given; generate stays greedy with 64 tokens.
    assert (params[0].repetition_penalty, params[0].top_k, params[0].temperature, params[0].max_tokens) == \
        (1.25, 7, 0.0, 64)
    out = capsys.readouterr().out
    assert "--- sampling: repetition_penalty=1.25 temperature=0.0 top_k=7 max_tokens=64 " \
           "(repetition_penalty, top_k from the model's generation_config.json)" in out
    calls.clear()
    assert main(base + ["--repetition-penalty", "1.0", str(d), "Hi"]) == 0
    assert calls[0][1][0].repetition_penalty == 1.0 and calls[0][1][0].top_k == 7  # a flag wins
    calls.clear()
    assert main(base + ["--generation-config", "vllm", str(d), "Hi"]) == 0
    assert calls[0][1][0].repetition_penalty == 1.0 and calls[0][1][0].top_k == 0
    capsys.readouterr()


def test_max_logprobs_can_be_raised(qwen3_moe_dir: str, capsys: pytest.CaptureFixture) -> None:
    argv = ["generate", "--model", qwen3_moe_dir, "--max-tokens", "2", "--max-model-len", "64", "--logprobs", "25"]
    assert main(argv + ["Hi"]) == 2
    assert ("Requested sample logprobs of 25, which is greater than max allowed: 20; ask for fewer or raise the "
            "engine's max_logprobs") in capsys.readouterr().err
    assert main(argv[:1] + ["--max-logprobs", "30"] + argv[1:] + ["Hi"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if " | top: " in line]
    assert len(lines) == 2
    assert all(len(re.findall(r" -?\d+\.\d{3}(?:,|$)", line.split(" | top: ")[1])) == 25 for line in lines)


def test_offline_llm_threads(qwen3_moe_dir: str, caplog: pytest.LogCaptureFixture,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    """LLM(threads=...) sets torch's threads ('auto': every available core) and logs it; a bad
    value is refused before the model loads."""
    import logging

    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # an idle machine: no fallback under load

    import torch

    from moestream import LLM

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with caplog.at_level(logging.INFO, logger="moestream.llm"):
            LLM(qwen3_moe_dir, max_model_len=64)
        assert torch.get_num_threads() == available_cores()
        assert f"torch threads: {available_cores()} (auto" in caplog.text
        LLM(qwen3_moe_dir, max_model_len=64, threads=1)
        assert torch.get_num_threads() == 1
        with pytest.raises(ValueError, match="threads must be a positive integer or 'auto'"):
            LLM(qwen3_moe_dir, threads=0)
        # Regression: an LLM() that fails after setting the threads (here: a bad max_model_len)
        # left the process at the new count.
        with pytest.raises(ValueError, match="max_model_len"):
            LLM(qwen3_moe_dir, max_model_len=-5, threads=2)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
