"""Smoke tests of the peer benchmarks (no timing asserted): bench/make_checkpoint.py's tensors
load into HF with no missing keys; bench/throughput.py runs moestream and HF on the tiny
checkpoint and reports uninstalled peers as such; bench/serving.py measures a stub
OpenAI-compatible streaming server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")


def test_make_checkpoint_is_deterministic_and_loads_in_hf(tmp_path) -> None:
    sys.path.insert(0, BENCH)
    from make_checkpoint import make_tensor, write_checkpoint
    from transformers import AutoModelForCausalLM

    a = make_tensor("model.layers.0.mlp.experts.3.up_proj.weight", (8, 4), seed=0)
    assert a.equal(make_tensor("model.layers.0.mlp.experts.3.up_proj.weight", (8, 4), seed=0))
    assert not a.equal(make_tensor("model.layers.0.mlp.experts.4.up_proj.weight", (8, 4), seed=0))
    out = str(tmp_path / "tiny")
    summary = write_checkpoint("tiny", out, seed=0, shard_bytes=256 << 10, vocab_size=1024)
    assert summary["shards"] > 1 and os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    assert summary["routed_expert_bytes"] == 2 * 8 * 3 * 32 * 64 * 2  # layers * experts * 3 * I * H * bf16
    assert os.path.exists(os.path.join(out, "tokenizer.json"))
    _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


def test_throughput_bench_runs_and_reports_missing_peers(qwen3_moe_dir: str, tmp_path) -> None:
    out = str(tmp_path / "throughput")
    cmd = [sys.executable, os.path.join(BENCH, "throughput.py"), "--checkpoint", qwen3_moe_dir,
           "--engines", "moestream,hf,vllm,llama_cpp", "--concurrency", "2", "--prompt-len", "4", "--max-tokens", "3",
           "--mixed-requests", "2", "--mixed-concurrency", "2", "--repeats", "1", "--dtype", "float32",
           "--peers-dir", str(tmp_path / "no-peers"), "--out", out]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.load(open(out + ".json"))
    for engine in ("moestream", "hf"):
        res = data["engines"][engine]
        assert res["status"] == "ok", res
        assert [r["workload"] for r in res["rows"]] == ["c2", "mixed"]
        c2 = res["rows"][0]
        assert c2["requests"] == 2 and c2["output_tokens"] == 2 * 3 and c2["peak_rss_bytes"] > 0
    for engine in ("vllm", "llama_cpp"):
        assert data["engines"][engine]["status"] == "not installed"
        assert "setup_" in data["engines"][engine]["error"]
    md = open(out + ".md").read()
    assert "moestream/hf" in md and "vllm: not installed" in md and "llama_cpp: not installed" in md


class _StubHandler(BaseHTTPRequestHandler):
    """A minimal OpenAI-compatible server: /v1/models, and /v1/completions streaming max_tokens chunks."""

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        body = json.dumps({"data": [{"id": "stub"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert req["stream"] is True and self.path == "/v1/completions"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(req["max_tokens"]):
            self.wfile.write(f"data: {json.dumps({'choices': [{'index': 0, 'text': f' t{i}'}]})}\n\n".encode())
            self.wfile.flush()
        usage = {"choices": [], "usage": {"completion_tokens": req["max_tokens"], "prompt_tokens": 4}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())


def test_serving_bench_against_stub_server(tmp_path) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StubHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        out = str(tmp_path / "serving")
        cmd = [sys.executable, os.path.join(BENCH, "serving.py"), "--base-url", f"http://127.0.0.1:{server.server_port}",
               "--model", "stub", "--rates", "0,50", "--num-requests", "2", "--prompt-len", "4", "--max-tokens", "3",
               "--out", out]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    finally:
        server.shutdown()
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.load(open(out + ".json"))["rows"]
    assert [r["rate"] for r in rows] == [0.0, 50.0]
    for r in rows:
        assert r["ok"] == 2 and r["ttft_p50_s"] is not None and r["tpot_p50_s"] is not None
        assert r["output_tok_per_s"] > 0 and r["goodput"] > 0
