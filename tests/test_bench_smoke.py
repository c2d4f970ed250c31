"""Smoke test: the expert-offload benchmark script runs end to end on the tiny checkpoint
(no timing asserted; only that it completes, agrees across budgets and writes its files)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_expert_offload_bench_runs(qwen3_moe_dir: str, tmp_path) -> None:
    out = str(tmp_path / "offload")
    cmd = [sys.executable, os.path.join(ROOT, "bench", "expert_offload.py"), "--ckpt", qwen3_moe_dir,
           "--budgets", "1.0,0.5", "--batches", "2", "--max-tokens", "3", "--prompt-len", "16",
           "--prefetch", "gate", "--policies", "next_use", "--host-cache", "0,1", "--elastic", "on",
           "--kv-cache-blocks", "2", "--bandwidth-bytes", "65536", "--out", out]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.load(open(out + ".json"))
    rows = data["rows"]
    assert [(r["budget"], r["prefetch"], r["policy"]) for r in rows] == [
        (1.0, "-", "-"), (0.5, "gate", "next_use"), (0.5, "gate", "next_use")]
    assert data["meta"]["outputs_identical_across_budgets"] is True
    assert rows[0]["hit_rate"] == 1.0 and rows[1]["missed_bytes"] > 0
    assert rows[1]["host_computed"] == 0 < rows[2]["host_computed"]  # a host cache: misses computed in place
    assert rows[2]["io_floor_tpot_s"] < rows[1]["io_floor_tpot_s"]
    # 2 requests of 16 + 3 tokens need 4 blocks of 16 tokens, the KV cache holds 2: the
    # static split preempts, elastic memory borrows expert slots instead
    assert rows[0]["preemptions"] >= 1 and not rows[0]["elastic"]
    assert rows[1]["elastic"] and rows[1]["preemptions"] == 0 < rows[1]["elastic_resizes"]
    assert open(out + ".md").read().count("\n") == 2 + 3


def test_checkpoint_eviction_bench_runs(tmp_path) -> None:
    """LRU against the default rule: both hit, and the default hits more (the workload is fixed)."""
    out = str(tmp_path / "eviction")
    cmd = [sys.executable, os.path.join(ROOT, "bench", "checkpoint_eviction.py"), "--alphas", "0,2", "--bonuses", "0",
           "--workload-scale", "0.4", "--out", out]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.load(open(out + ".json"))["results"]
    assert [(r["alpha"], r["hit_bonus"]) for r in rows] == [(0.0, 0.0), (2.0, 0.0)]
    assert 0 < rows[0]["hit_rate"] < rows[1]["hit_rate"] < 1
    assert rows[0]["queries"] == rows[1]["queries"] > 0
    assert open(out + ".md").read().count("\n") == 2 + 2 + 2


def test_spec_decode_bench_runs(qwen3_moe_dir: str, tmp_path) -> None:
    """draft_experts under a budget (with its baseline, added by the bench) runs on the tiny
    checkpoint, its outputs equal off's, and both read expert bytes (a figure the table
    reports). ngram's exactness is tested in test_spec_decode.py."""
    out = str(tmp_path / "spec")
    cmd = [sys.executable, os.path.join(ROOT, "bench", "spec_decode.py"), "--checkpoint", qwen3_moe_dir,
           "--prompts", "1", "--max-wait", "0", "--out", out, "--methods", "draft_experts k=3 @25%"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.load(open(out + ".json"))
    assert data["meta"]["outputs_identical_to_off"] is True
    res = data["results"]
    assert list(res) == ["off @25%", "draft_experts k=3 @25%"]
    assert res["off @25%"]["edit"]["expert_bytes_per_token"] > 0
    assert res["draft_experts k=3 @25%"]["chat"]["mean_acceptance_length"] > 1
    assert open(out + ".md").read().count("\n") == 2 + 2 + 3 * 2


def test_quantized_bench_runs(qwen3_moe_dir: str, tmp_path) -> None:
    """bf16 and int4 copies of the tiny checkpoint, resident and paged: packed experts are
    smaller, paged tokens equal resident ones; the density table covers FP8 block too."""
    import shutil

    ckpt = shutil.copytree(qwen3_moe_dir, str(tmp_path / "ckpt"))
    out = str(tmp_path / "quantized")
    cmd = [sys.executable, os.path.join(ROOT, "bench", "quantized.py"), "--checkpoint", ckpt, "--new-tokens", "4",
           "--paged-tokens", "4", "--prompt-len", "16", "--concurrency", "1,2", "--formats", "bf16,int4", "--max-wait", "0",
           "--out", out]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.load(open(out + ".json"))
    sizes = {f: data["resident"][f]["expert_bytes"] for f in ("bf16", "int4")}
    assert sizes["int4"] < sizes["bf16"] == 3 * 64 * 32 * 2  # bf16 slots of H 64, I 32
    assert data["meta"]["paged_equals_resident"] is True
    density = data["density"]["formats"]
    assert density["int4"]["slots_at_budget"] > density["fp8-block"]["slots_at_budget"] > density["bf16"]["slots_at_budget"]
    assert open(out + ".md").read().count("| int4 |") == 2


def test_gpt_oss_bench_runs(gpt_oss_dir: str, tmp_path) -> None:
    """Both KV cache setups, decode at c1 / c2, TTFT with and without prefix caching: the
    grouped cache's peak is below the one-group cache's, and the second request onward hits
    the shared prompt's blocks."""
    out = str(tmp_path / "gpt_oss")
    cmd = [sys.executable, os.path.join(ROOT, "bench", "gpt_oss.py"), "--checkpoint", gpt_oss_dir,
           "--kv-requests", "3", "--kv-prompt", "40", "--kv-new", "24", "--prompt-len", "8", "--new-tokens", "4",
           "--concurrency", "1,2", "--system-len", "48", "--ttft-requests", "3", "--max-wait", "0", "--out", out]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.load(open(out + ".json"))
    kv = data["kv"]
    assert kv["groups"]["peak_bytes"] < kv["one group"]["peak_bytes"]
    assert kv["groups"]["block_bytes"] * 2 == kv["one group"]["block_bytes"]  # half the layers per block
    assert len(kv["groups"]["peak_blocks_per_group"]) == 2 and len(kv["one group"]["peak_blocks_per_group"]) == 1
    decode = data["decode"]
    assert decode["prefix caching on"]["prefix_hits"] == 2 * 48 and decode["prefix caching off"]["prefix_hits"] == 0
    assert data["hf"]["1"]["tok_s"] > 0 and isinstance(data["meta"]["first_tokens_equal_hf"], bool)  # bf16: may differ
    assert data["vllm"]["status"] in ("ok", "not installed", "failed")
    assert open(out + ".md").read().count("| moestream |") == 1


def test_every_bench_script_prints_its_help() -> None:
    """Regression: `bench/spec_decode.py --help` raised ValueError (a `%` in a help string,
    which argparse formats with %). Every bench script's --help prints its usage."""
    scripts = sorted(f for f in os.listdir(os.path.join(ROOT, "bench")) if f.endswith(".py") and f != "report.py")
    procs = {f: subprocess.Popen([sys.executable, os.path.join(ROOT, "bench", f), "--help"], cwd=ROOT,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for f in scripts}
    for f, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0 and out.startswith("usage:"), f"{f}: {err[-2000:]}"
    assert "spec_decode.py" in procs and "lm_eval_demos.py" in procs
