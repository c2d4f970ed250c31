"""`moestream serve` with a hybrid model (Qwen3-Next) and 2 device state slots: concurrent
streamed completions equal the offline output, and no KV block or state slot is left held."""

from __future__ import annotations

import asyncio

import httpx
from live_server import LiveServer
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from moestream import LLM, SamplingParams
from moestream.config import EngineConfig
from moestream.server.serving import ServerConfig

PROMPTS = ["def add(a, b):", "import os", "Hello", "class A:", "x = [1, 2", "# comment", "for i in", "print("]


def test_hybrid_concurrent_streams_equal_offline(qwen3_next_dir: str) -> None:
    offline = LLM(qwen3_next_dir, dtype="float32", max_model_len=64).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=10))
    server = LiveServer(
        EngineConfig(model=qwen3_next_dir, dtype="float32", max_model_len=64, max_resident_states=2),
        ServerConfig(served_model_names=("tiny-next",)),
    )
    try:
        async def one(client: AsyncOpenAI, prompt: str) -> str:
            stream = await client.completions.create(model="tiny-next", prompt=prompt, max_tokens=10,
                                                     temperature=0, stream=True)
            return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

        async def run_all(prompts: list[str] = PROMPTS) -> list[str]:
            client = AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none")  # one per event loop
            async with client:
                return await asyncio.gather(*(one(client, p) for p in prompts))

        texts = asyncio.run(run_all())
        assert texts == [o.outputs[0].text for o in offline]
        server.wait_idle()
        pool = server.engine.state_pool
        assert pool.num_swap_ins > 0  # 8 requests over 2 slots did swap
        assert pool.num_resident() == 0 and pool.num_swapped() == 0 and pool.num_free_slots == 2
        text = httpx.get(server.base_url + "/metrics").text
        samples = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
        assert samples["moestream:state_slots_total"] == 2
        assert samples["moestream:state_slots_in_use"] == 0 and samples["moestream:states_swapped"] == 0
        assert samples["moestream:state_swap_ins_total"] == pool.num_swap_ins > 0
        # Prefix caching on a hybrid model: a second round of long prompts is served from state checkpoints.
        long = ["# a header line that every prompt repeats\n" * 4 + p for p in PROMPTS]
        first = asyncio.run(run_all(long))
        assert asyncio.run(run_all(long)) == first
        server.wait_idle()
        stats = server.engine.prefix_cache_stats()
        text = httpx.get(server.base_url + "/metrics").text
        by_label = {(s.name, s.labels.get("tier")): s.value
                    for fam in text_string_to_metric_families(text) for s in fam.samples}
        assert by_label[("moestream:prefix_cache_hits_total", None)] == stats["hits"] > 0
        assert by_label[("moestream:prefix_cache_state_checkpoints", "device")] == stats["checkpoints_device"] > 0
        assert by_label[("moestream:prefix_cache_state_checkpoint_bytes", "device")] == stats["checkpoint_bytes_device"]
        assert by_label[("moestream:prefix_cache_recomputed_tokens_total", None)] == stats["recomputed_tokens"]
    finally:
        server.stop()
