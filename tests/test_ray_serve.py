"""moestream on Ray Serve (the `.[ray]` extra): a local Ray cluster with 2 replicas of the demo
model behind one OpenAI ingress. Concurrent streamed and whole requests give the single
engine's greedy text and reach both replicas; requests sharing a long prefix stay on one
replica, whose prefix-cache hits rise; killing a replica mid-load loses no non-streamed
request and ends its streams with an error event; Ray is shut down with no process left."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from ports import free_port

from moestream import LLM, SamplingParams
from moestream.demo import demo_model_path
from moestream.loader import load_tokenizer

NAME = "demo"
LONG = 200  # tokens per request of the fault test: in flight for seconds, so the kill lands mid-load
MAX_MODEL_LEN = 256



def _ray_processes() -> set[int]:
    """Pids of Ray's processes on this machine (raylet, gcs_server, the ray:: workers and agents)."""
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout.splitlines()
    return {int(line.split()[0]) for line in out
            if re.search(r"\b(raylet|gcs_server)\b|ray::|ServeReplica|ServeController|dashboard", line)}


def _replica_pids(since: set[int]) -> list[int]:
    """Pids of this cluster's engine replica actors (started after `since` was taken)."""
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout.splitlines()
    return [int(line.split()[0]) for line in out if "EngineReplica" in line and int(line.split()[0]) not in since]


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """`moestream serve --ray` (the README's command: a new local Ray cluster, 2 replicas of the
    demo model) in a subprocess; yields its URL. Teardown sends SIGTERM and checks that it
    exits 0 and that every Ray process it started is gone."""
    import sys

    others = _ray_processes()  # another cluster on this machine, not ours to check
    port = free_port()
    cmd = [sys.executable, "-m", "moestream.server.cli", "serve", "--ray", "--num-replicas", "2", "--replica-cpus",
           "0.5", "--port", str(port), "--served-model-name", NAME, "--dtype", "float32", "--max-model-len",
           str(MAX_MODEL_LEN), "--max-num-seqs", "16", "--threads", "1"]
    # stderr to a file, never a pipe: Ray's logs (one line per request) fill a 64 KiB pipe
    # nobody reads until teardown, and the server then blocks in a write and never exits.
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True)

    def tail() -> str:
        log.seek(0)
        return log.read()[-3000:]

    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"serve --ray exited: {tail()}"
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "serve --ray did not become healthy in 180 s"
            time.sleep(1)
        yield url
    finally:
        ours = _ray_processes() - others
        proc.send_signal(15)  # SIGTERM, as the README's `kill %1`
        try:
            rc = proc.wait(timeout=90)
        finally:
            proc.kill()
        deadline = time.monotonic() + 30
        while ours & _ray_processes() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert rc == 0, tail()
        assert ours and not ours & _ray_processes(), f"Ray processes left: {ours & _ray_processes()}"


def _metric(text: str, name: str) -> dict[str, float]:
    """replica -> value of the series `name` (summed over other labels)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(rf'{re.escape(name)}{{(.*)}} (\S+)$', line)
        if m:
            replica = re.search(r'replica="([^"]+)"', m.group(1))
            if replica:
                out[replica.group(1)] = out.get(replica.group(1), 0.0) + float(m.group(2))
    return out


def _ingress_metric(url: str, name: str) -> dict[str, float]:
    """outcome -> value of the ingress's own series `name` (labelled by outcome)."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        m = re.match(rf'{re.escape(name)}{{outcome="([^"]+)"}} (\S+)$', line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def _scrape(url: str, name: str, replicas: int = 2, timeout: float = 20.0) -> dict[str, float]:
    """The merged /metrics series `name` by replica, once every replica has pushed (1 s period)."""
    deadline = time.monotonic() + timeout
    while True:
        got = _metric(httpx.get(url + "/metrics", timeout=10).text, name)
        if len(got) >= replicas or time.monotonic() > deadline:
            return got
        time.sleep(0.5)


# 20 prompts with different beginnings (no shared prefix to follow: the router spreads them).
PROMPTS = [f"{head} {i}" for i, head in enumerate([
    "def", "class", "import", "from", "return", "print(", "while", "for", "if", "try:", "with", "lambda", "yield",
    "assert", "raise", "async", "await", "global", "# note", "@property"])]


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    """Single-engine greedy text of each prompt (the offline LLM, equal to `moestream serve`)."""
    llm = LLM(demo_model_path(), dtype="float32", max_model_len=MAX_MODEL_LEN)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.0))
    return {p: o.outputs[0].text for p, o in zip(PROMPTS, outs)}


async def _complete(client: Any, prompt: str, stream: bool) -> str:
    kw = dict(model=NAME, prompt=prompt, max_tokens=12, temperature=0, extra_body={"repetition_penalty": 1.0})
    if not stream:
        return (await client.completions.create(**kw)).choices[0].text
    text = ""
    async for chunk in await client.completions.create(stream=True, **kw):
        text += chunk.choices[0].text if chunk.choices else ""
    return text


def test_twenty_concurrent_requests_reach_both_replicas_with_single_engine_text(cluster: str, reference: dict) -> None:
    import openai

    before = _scrape(cluster, "moestream:request_success_total")
    client = openai.AsyncOpenAI(base_url=cluster + "/v1", api_key="none", max_retries=0, timeout=120)

    async def run() -> list[str]:
        jobs = [_complete(client, PROMPTS[i], stream=i % 2 == 1) for i in range(20)]
        return await asyncio.gather(*jobs)

    texts = asyncio.run(run())
    assert texts == [reference[PROMPTS[i]] for i in range(20)]
    time.sleep(1.5)  # one metrics push
    after = _scrape(cluster, "moestream:request_success_total")
    served = {r: after[r] - before.get(r, 0.0) for r in after}
    # Balanced: unrelated prompts in a burst spread over both replicas (the router counts its own
    # routing decisions; Ray's queue-length cache saw 0 everywhere and sent all 16 of a burst to one).
    assert sum(served.values()) == 20 and len(served) == 2 and min(served.values()) >= 6, served
    r = httpx.get(cluster + "/v1/models", timeout=10)
    assert r.json()["data"][0]["id"] == NAME and r.json()["data"][0]["max_model_len"] == MAX_MODEL_LEN
    # the token endpoints are answered by a replica's tokenizer (/detokenize has no prompt to route by)
    ids = httpx.post(cluster + "/tokenize", json={"prompt": PROMPTS[3]}, timeout=30).json()["tokens"]
    assert ids == load_tokenizer(demo_model_path()).encode(PROMPTS[3])
    assert httpx.post(cluster + "/detokenize", json={"tokens": ids}, timeout=30).json() == {"prompt": PROMPTS[3]}
    bad = httpx.post(cluster + "/detokenize", json={"tokens": [-1]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_shared_prefix_goes_to_one_replica_and_hits(cluster: str) -> None:
    """8 requests sharing a ~200-character prefix, sent one after another: the first lands
    anywhere, the other 7 follow its prefix to the same replica, whose prefix-cache hits rise
    by at least 7 x the shared full blocks; a different prompt may go elsewhere."""
    prefix = "import os\nimport sys\n# A long shared system prompt that both replicas could serve.\n" * 3
    before_req = _scrape(cluster, "moestream:request_success_total")
    before_hits = _scrape(cluster, "moestream:prefix_cache_hits_total")
    for i in range(8):
        r = httpx.post(cluster + "/v1/completions", timeout=60, json={
            "model": NAME, "prompt": prefix + f"def case_{i}():", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
    time.sleep(1.5)
    after_req = _scrape(cluster, "moestream:request_success_total")
    after_hits = _scrape(cluster, "moestream:prefix_cache_hits_total")
    served = {r: after_req[r] - before_req.get(r, 0.0) for r in after_req}
    (chosen, n), = [(r, n) for r, n in served.items() if n > 0]
    assert n == 8
    assert after_hits[chosen] - before_hits.get(chosen, 0.0) >= 7 * 16, (after_hits, before_hits)
    r = httpx.post(cluster + "/v1/completions", timeout=60, json={"model": NAME, "prompt": "class Other:", "max_tokens": 2})
    assert r.status_code == 200


def test_errors_come_back_in_openai_shape(cluster: str) -> None:
    r = httpx.post(cluster + "/v1/completions", timeout=60, json={"model": NAME, "prompt": "x", "temperature": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = httpx.post(cluster + "/v1/completions", timeout=60, json={"model": NAME, "prompt": "hello " * 400})
    assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"]
    with httpx.stream("POST", cluster + "/v1/completions", timeout=60, json={
            "model": NAME, "prompt": "hello " * 400, "stream": True}) as r:
        assert r.status_code == 400 and "max_model_len" in json.loads(r.read())["error"]["message"]


async def _burst(url: str, n: int) -> None:
    async with httpx.AsyncClient(timeout=60) as c:
        await asyncio.gather(*[c.post(url + "/v1/completions", json={"model": NAME, "prompt": PROMPTS[i], "max_tokens": 2})
                               for i in range(n)])


def test_killing_a_replica_loses_no_request(cluster: str, reference: dict) -> None:
    """Kill one replica's process while 16 whole and 4 streamed requests are in flight: every
    whole request succeeds with the single-engine text (retried on the other replica); each
    stream either completes with that text or ends with an error event and [DONE]; the
    ingress keeps serving, and Ray brings a new replica up (a new id in /metrics)."""
    import signal

    old_ids = set(_scrape(cluster, "moestream:kv_cache_blocks_total"))
    assert len(old_ids) == 2
    # Both replicas take requests (the ingress's router learns of a replica a few seconds after
    # it starts), so the 20 requests below are on both and the killed one has some.
    deadline = time.monotonic() + 60
    while len(_metric(httpx.get(cluster + "/metrics", timeout=10).text, "moestream:request_success_total")) < 2:
        assert time.monotonic() < deadline, "a replica never got a request"
        asyncio.run(_burst(cluster, 8))
        time.sleep(1.2)
    victims = _replica_pids(since=set())
    assert len(victims) == 2, victims

    async def whole(prompt: str) -> str:
        async with httpx.AsyncClient(timeout=120) as c:
            r = await c.post(cluster + "/v1/completions", json={
                "model": NAME, "prompt": prompt, "max_tokens": LONG, "temperature": 0, "repetition_penalty": 1.0,
                "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

    started = [asyncio.Event() for _ in range(4)]

    async def streamed(prompt: str, first: asyncio.Event) -> tuple[str, list[dict]]:
        text, errors = "", []
        async with httpx.AsyncClient(timeout=120) as c:
            async with c.stream("POST", cluster + "/v1/completions", json={
                    "model": NAME, "prompt": prompt, "max_tokens": LONG, "temperature": 0, "repetition_penalty": 1.0,
                    "ignore_eos": True, "stream": True}) as r:
                assert r.status_code == 200
                done = False
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        event = json.loads(line[6:])
                        if "error" in event:
                            errors.append(event["error"])
                        else:
                            text += event["choices"][0]["text"]
                            first.set()
                assert done
        return text, errors

    async def run() -> tuple[list, list]:
        jobs = [asyncio.create_task(whole(PROMPTS[i])) for i in range(16)]
        streams = [asyncio.create_task(streamed(PROMPTS[i], started[i])) for i in range(4)]
        # Every stream is producing tokens: its replica accepted it (and the whole requests sent
        # with it) and is decoding. Killed now, the requests are lost from under the ingress.
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        os.kill(victims[0], signal.SIGKILL)
        return await asyncio.gather(*jobs), await asyncio.gather(*streams)

    failures_before = _ingress_metric(cluster, "moestream:replica_failures_total")
    assert failures_before == {"retried": 0.0, "stream_ended": 0.0, "refused": 0.0}  # exported from the start
    long_ref = LLM(demo_model_path(), dtype="float32", max_model_len=MAX_MODEL_LEN).generate(
        PROMPTS[:16], SamplingParams(temperature=0, max_tokens=LONG, repetition_penalty=1.0, ignore_eos=True))
    wholes, streams = asyncio.run(run())
    assert wholes == [o.outputs[0].text for o in long_ref]
    for (text, errors), ref in zip(streams, long_ref[:4]):
        if errors:
            assert errors[0]["code"] == "replica_died" and ref.outputs[0].text.startswith(text)
        else:
            assert text == ref.outputs[0].text
    # Some request was on the dead replica: retried whole, or a stream ended with the error event.
    failures = _ingress_metric(cluster, "moestream:replica_failures_total")
    stream_errors = sum(1 for _, errors in streams if errors)
    assert failures["retried"] + stream_errors >= 1 and failures["stream_ended"] == stream_errors
    r = httpx.post(cluster + "/v1/completions", timeout=60, json={"model": NAME, "prompt": PROMPTS[0], "max_tokens": 12,
                                                                   "temperature": 0, "repetition_penalty": 1.0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference[PROMPTS[0]]
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        ids = set(_metric(httpx.get(cluster + "/metrics", timeout=10).text, "moestream:kv_cache_blocks_total"))
        if len(ids) == 2 and ids != old_ids:
            break
        time.sleep(1)
    assert len(ids - old_ids) == 1 and len(ids & old_ids) == 1, (old_ids, ids)  # one replaced, one kept


def test_merge_metrics_labels_each_replica() -> None:
    """One family per name, each replica's samples with its label; the ingress's own HTTP
    counters unlabelled and the replicas' copies of them left out."""
    from moestream.server.metrics import ServerMetrics
    from moestream.server.ray_serve.metrics import merge_metrics

    own, a, b = ServerMetrics(), ServerMetrics(), ServerMetrics()
    own.on_http_response("/v1/completions", 200)
    a.generation_tokens.inc(3)
    b.generation_tokens.inc(5)
    a.on_http_response("/health", 200)
    text = merge_metrics(own.render(), {"r1": a.render(), "r2": b.render()},
                         frozenset({"moestream:http_requests"})).decode()
    assert 'moestream:generation_tokens_total{replica="r1"} 3.0' in text
    assert 'moestream:generation_tokens_total{replica="r2"} 5.0' in text
    assert len(re.findall(r"# TYPE moestream:generation_tokens(_total)? counter", text)) == 1
    assert "moestream:generation_tokens_total 0.0" not in text  # the ingress's unused engine series left out
    assert 'moestream:http_requests_total{path="/v1/completions",status="200"} 1.0' in text
    assert '/health' not in text


def test_prompt_text_of_requests() -> None:
    from moestream.server.protocol import ChatCompletionRequest, CompletionRequest
    from moestream.server.ray_serve.router import prompt_text

    assert prompt_text(CompletionRequest(model="m", prompt="abc")) == "abc"
    assert prompt_text(CompletionRequest(model="m", prompt=[5, 6, 7])) == "5 6 7"
    assert prompt_text(CompletionRequest(model="m", prompt=[[1, 2], [3]])) == "1 2"
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]})
    assert prompt_text(chat) == "<system>Be brief.<user>Hi<image>"


@pytest.mark.parametrize("flags, message", [
    (["--num-replicas", "0"], "--num-replicas must be at least 1"),
    (["--min-replicas", "3", "--max-replicas", "2"], "--max-replicas (2) must be at least --min-replicas (3)"),
])
def test_serve_ray_flags_are_checked_before_ray_starts(flags: list[str], message: str, capsys) -> None:
    from moestream.server.cli import main

    before = _ray_processes()
    assert main(["serve", "--ray", "--port", str(free_port()), *flags]) == 2
    assert message in capsys.readouterr().err
    assert not _ray_processes() - before  # no cluster was started


def test_health_follows_the_replicas_metrics_pushes() -> None:
    """The ingress's /health is 503 when no replica pushed its metrics in the last few seconds
    (all dead), 200 otherwise."""
    from types import SimpleNamespace

    from moestream.server.metrics import ServerMetrics
    from moestream.server.ray_serve.ingress import RayBackend
    from moestream.server.ray_serve.metrics import ALIVE_WITHIN_S, MetricsCollector

    collector = MetricsCollector()

    async def num_alive(within_s: float) -> int:
        return collector.num_alive(within_s)

    backend = RayBackend(None, MAX_MODEL_LEN, ServerMetrics(), SimpleNamespace(num_alive=SimpleNamespace(remote=num_alive)))
    assert asyncio.run(backend.is_healthy()) is False
    collector.push("r1", b"")
    assert asyncio.run(backend.is_healthy()) is True
    collector._texts["r1"] = (time.monotonic() - ALIVE_WITHIN_S - 1, b"")  # silent for longer than the window
    assert asyncio.run(backend.is_healthy()) is False
