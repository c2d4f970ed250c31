"""The serve engine thread's torch thread count (`--threads`, ServerConfig.engine_threads):
set inside the engine thread (torch's intra-op count is per thread), defaulting on CPU to
the available cores less one for the HTTP event loop."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from moestream import SamplingParams
from moestream.config import EngineConfig
from moestream.engine.llm_engine import LLMEngine
from moestream.server.async_engine import AsyncLLMEngine
from moestream.server.cli import build_parser
from moestream.server.serving import ServerConfig, default_engine_threads


def test_default_engine_threads_leaves_a_core_for_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # an idle machine (load: tests/test_threads.py)
    cores = len(os.sched_getaffinity(0))
    assert default_engine_threads("cpu") == max(1, cores - 1)
    assert default_engine_threads("cuda:0") is None  # torch's default on an accelerator


def test_engine_thread_runs_with_the_asked_thread_count(qwen3_moe_dir: str) -> None:
    main_threads = torch.get_num_threads()
    want = main_threads + 1  # differs from this thread's count whatever the machine
    seen: list[int] = []

    def record(out_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        seen.append(torch.get_num_threads())
        return logits

    async def run() -> list[int]:
        engine = AsyncLLMEngine(LLMEngine(EngineConfig(qwen3_moe_dir, dtype="float32")), num_threads=want)
        engine.start()
        try:
            stream = await engine.add([("r0", "hello", SamplingParams(max_tokens=3, logits_processors=[record]))])
            return [out async for out in stream][-1].outputs[0].token_ids
        finally:
            await engine.shutdown()

    tokens = asyncio.run(run())
    assert len(tokens) == 3 and seen == [want] * 3
    assert torch.get_num_threads() == main_threads  # the caller's thread is untouched


@pytest.mark.parametrize("value", ["0", "-2", "many"])
def test_bad_threads_flag_is_a_clear_error(value: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--threads", value])
    assert "expected a positive integer or 'auto'" in capsys.readouterr().err


def test_threads_flag_parses_and_config_checks() -> None:
    from moestream.engine.args import engine_kwargs

    assert "threads" not in engine_kwargs(build_parser().parse_args(["serve"]))  # EngineConfig's default: auto
    assert EngineConfig("demo").threads == "auto"
    assert engine_kwargs(build_parser().parse_args(["serve", "--threads", "3"]))["threads"] == 3
    with pytest.raises(ValueError, match="engine threads must be at least 1"):
        ServerConfig(served_model_names=("m",), engine_threads=0)
