"""The offload headline: a checkpoint bigger than the memory its engine may use, served by
moestream under an expert budget, by llama.cpp through mmap and by HF transformers with
accelerate's disk offload.

Model: `dsv2lite-14` (bench/make_checkpoint.py), DeepSeek-V2-Lite's shapes cut to its first 14
layers: 15.2 GiB of bf16 weights, 13.4 GiB of them routed experts (64 per layer, top-6, 16.5 MiB
each), random weights, written once to disk. Each engine runs in its own process inside a memory
cgroup (v1 `memory.limit_in_bytes`, which charges the page cache too) capped at the budget plus
`--overhead-gib`, so none can hold the checkpoint in memory:
- moestream: `expert_budget` = the budget in bytes, experts read from disk on a miss;
- llama.cpp (llama-cpp-python, one sequence at a time): a bf16 GGUF of the same weights made by
  llama.cpp's own converter, read through mmap and the page cache;
- HF transformers: `device_map="auto"`, `max_memory={"cpu": budget + the dense weights}` and an
  `offload_folder` (accelerate's disk offload).
The page cache is dropped (`/proc/sys/vm/drop_caches`) before each workload; where that is not
permitted, the checkpoint's files are evicted with `posix_fadvise(DONTNEED)` and the results say
so. Each process first runs a 4-token warm-up request.

Workloads: c1 (one request) and c4 (four at once), `--prompt-len` random prompt tokens and
`--max-tokens` greedy output tokens each. Reported: TTFT and TPOT (p50 over requests), bytes
read from disk per decode token (the process's `read_bytes` from the first token to the last,
over the decode tokens: every reader thread and mmap fault counts), the I/O floor (those bytes
over the disk's measured sequential read bandwidth) and TPOT as a multiple of it, and the
cgroup's peak memory.

Routing: `random` rows route as the random router does, nearly uniformly (the worst case for
any cache). `trace` rows force moestream's router choices from a real DeepSeek-V2-Lite routing
trace (`--trace`, the .npz of `moestream trace-sim`): request i's token at position p takes the
trace's prompt i row p, model layer l (1..13) the trace's MoE layer l - 1. The override is
bench-only: a routing modifier that replaces the top-k ids, told each forward's rows (request,
position). llama.cpp's and HF's routers cannot be forced, so trace rows are moestream's alone
(HF's disk offload reads every offloaded expert whatever the routing).

Results: bench/results/offload_headline.{json,md,png}.

    python bench/make_checkpoint.py dsv2lite-14 CKPT_DIR
    bash bench/peers/setup_llama_cpp.sh && pip install -e ".[bench]"
    sudo python bench/offload_headline.py --ckpt CKPT_DIR --trace ROUTING.npz
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from report import pyplot, write_markdown  # noqa: E402

GiB = 1 << 30
CGROUP_ROOT = "/sys/fs/cgroup/memory"


# ---- the machine: page cache, memory cgroups, disk bandwidth --------------------------------

def drop_page_cache(paths: list[str]) -> str:
    """Empty the page cache: 'drop_caches' when /proc/sys/vm/drop_caches is writable, else
    'fadvise' (each file under `paths` evicted with POSIX_FADV_DONTNEED)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "drop_caches"
    except OSError:
        for path in paths:
            files = [os.path.join(path, f) for f in os.listdir(path)] if os.path.isdir(path) else [path]
            for name in files:
                if os.path.isfile(name):
                    fd = os.open(name, os.O_RDONLY)
                    try:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    finally:
                        os.close(fd)
        return "fadvise"


class MemoryCgroup:
    """A v1 memory cgroup capping a child process (and the page cache it charges) at
    `limit_bytes`; None-like (`path` None) where the controller is not writable."""

    def __init__(self, name: str, limit_bytes: int) -> None:
        self.path: str | None = os.path.join(CGROUP_ROOT, name)
        try:
            os.makedirs(self.path, exist_ok=True)
            with open(os.path.join(self.path, "memory.limit_in_bytes"), "w") as f:
                f.write(str(limit_bytes))
        except OSError as e:
            print(f"no memory cgroup ({e}); the run is not capped", file=sys.stderr)
            self.path = None

    def join(self) -> None:
        """Put the calling process in the cgroup (a subprocess's preexec_fn)."""
        if self.path is not None:
            with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))

    def peak_bytes(self) -> int | None:
        if self.path is None:
            return None
        with open(os.path.join(self.path, "memory.max_usage_in_bytes")) as f:
            return int(f.read())

    def remove(self) -> None:
        if self.path is not None:
            try:
                os.rmdir(self.path)
            except OSError:
                pass


def sequential_read_bandwidth(path: str, nbytes: int = 1 * GiB, chunk: int = 64 << 20, repeats: int = 3) -> float:
    """Cold sequential reads of `nbytes` from each of the checkpoint's first `repeats` shards:
    the best of them, bytes/second (the disk's bandwidth varies; the best makes the floor lowest)."""
    shards = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    buf = bytearray(chunk)
    best = 0.0
    for shard in shards[:repeats]:
        drop_page_cache([path])
        done, start = 0, time.perf_counter()
        with open(shard, "rb", buffering=0) as f:
            while done < nbytes:
                got = f.readinto(buf)
                if not got:
                    break
                done += got
        best = max(best, done / (time.perf_counter() - start))
    return best


def cpu_speed(threads: int, seconds: float = 0.5) -> float:
    """bf16 GEMM throughput (GFLOP/s, 1024 x 1024 x 1024 on `threads` threads) over `seconds`:
    a probe of the CPU's state before each engine's run (virtual machines slow down when their
    host is busy or their CPU credit runs out)."""
    import torch

    torch.set_num_threads(threads)
    a = torch.randn(1024, 1024).bfloat16()
    a @ a
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ a
        n += 1
    return 2 * 1024**3 * n / (time.perf_counter() - start) / 1e9


def read_bytes() -> int:
    """Bytes this process (every thread, mmap faults included) has had read from storage."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


# ---- the bench-only router override ---------------------------------------------------------

class TraceRouting:
    """Replaces the router's top-k ids with a routing trace's (bench-only). Installed as the
    model's routing modifier and as the runner's recorder, so each forward first names its rows:
    row i is `positions[i]` of `request_ids[i]`; `assign` maps a request id to its trace prompt
    [tokens, layers, k]. Model layer l reads trace layer l - `first_moe_layer`.

    Raises:
        ValueError: a row's position is past its trace prompt, or k differs.
    """

    def __init__(self, first_moe_layer: int) -> None:
        self.first = first_moe_layer
        self.prompts: dict[str, "object"] = {}
        self.rows: tuple[list[str], list[int]] = ([], [])
        self.forced_pairs = 0

    def assign(self, request_id: str, trace_prompt) -> None:  # trace_prompt: np.ndarray [n, layers, k]
        self.prompts[request_id] = trace_prompt

    def begin_step(self, request_ids, token_positions) -> None:
        self.rows = (list(request_ids), list(token_positions))

    def record_layer(self, layer: int, topk_ids) -> None:  # the recorder interface: nothing recorded
        pass

    def modify(self, layer: int, num_experts: int, weights, ids):
        import torch

        rids, positions = self.rows
        if len(rids) != ids.shape[0]:
            return weights, ids, None  # a forward the runner did not name (e.g. a warm-up draft)
        forced = ids.clone()
        for i, (rid, pos) in enumerate(zip(rids, positions)):
            trace = self.prompts.get(rid)
            if trace is None:
                continue
            if pos >= trace.shape[0] or trace.shape[2] != ids.shape[1]:
                raise ValueError(f"{rid} position {pos}: trace prompt has {trace.shape[0]} tokens, "
                                 f"k {trace.shape[2]} (model k {ids.shape[1]})")
            forced[i] = torch.from_numpy(trace[pos, layer - self.first].astype("int64"))
            self.forced_pairs += ids.shape[1]
        return weights, forced, None


def trace_prompts(path: str, count: int, min_tokens: int, skip: int = 200) -> list:
    """`count` prompts [n, layers, k] of at least `min_tokens` tokens from the trace, after
    the first `skip` (the ones the policies were tuned on)."""
    import numpy as np

    data = np.load(path)
    keys = sorted(data.files, key=lambda k: int(k.split("_")[-1]))[skip:]
    out = [data[k] for k in keys if data[k].shape[0] >= min_tokens][:count]
    if len(out) < count:
        raise ValueError(f"{path}: only {len(out)} prompts past the first {skip} have {min_tokens} tokens")
    return out


# ---- workers (one engine per process) -------------------------------------------------------

def make_requests(conc: int, prompt_len: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1000, 100000) for _ in range(prompt_len)] for _ in range(conc)]


def summarise(name: str, arrivals: list[float], times: list[list[float]], io: list[tuple[int, int]]) -> dict:
    """arrivals [R] s, token times [R][n] s, (read_bytes at the first token, at the last) per request."""
    import statistics

    ttft = [t[0] - a for a, t in zip(arrivals, times) if t]
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in times if len(t) > 1]
    decode_tokens = sum(max(len(t) - 1, 0) for t in times)
    first = min(b for b, _ in io)
    last = max(e for _, e in io)
    return {"workload": name, "requests": len(times), "output_tokens": sum(len(t) for t in times),
            "wall_s": max(t[-1] for t in times if t) - min(arrivals),
            "decode_steps": max(len(t) for t in times) - 1,  # batched: one step makes a token of each request
            "ttft_s": statistics.median(ttft), "tpot_s": statistics.median(tpot),
            "decode_read_bytes": last - first, "read_bytes_per_token": (last - first) / max(decode_tokens, 1)}


def run_moestream(spec: dict, prompts: dict[str, list[list[int]]]) -> tuple[dict, list[dict]]:
    sys.path.insert(0, ROOT)
    from moestream import LLM, SamplingParams

    llm = LLM(spec["ckpt"], dtype="bfloat16", expert_budget=spec["budget_bytes"], threads=spec["threads"],
              max_model_len=spec["prompt_len"] + spec["max_tokens"] + 16, max_num_seqs=4,
              kv_cache_memory_bytes=256 << 20, enable_prefix_caching=False, expert_prefetch=spec["prefetch"],
              expert_direct_io=spec.get("direct_io", "auto"))
    engine = llm.llm_engine
    router = None
    if spec["routing"] == "trace":
        with open(os.path.join(spec["ckpt"], "config.json")) as f:
            first_moe = json.load(f).get("first_k_dense_replace", 0)
        model = engine.runner.model
        router = TraceRouting(first_moe)
        engine.runner.recorder = router  # names each forward's rows (request, position)
        model.set_routing_modifier(router)
        traces = trace_prompts(spec["trace"], 8, spec["prompt_len"] + spec["max_tokens"])
        for (name, reqs), offset in zip(prompts.items(), (0, 4)):
            for i in range(len(reqs)):
                router.assign(f"{name}-{i}", traces[offset + i])
    rows = []
    for name, reqs in prompts.items():
        max_tokens = spec["max_tokens"] if name != "warmup" else 2
        if name != "warmup":
            spec["drop"] = drop_page_cache(spec["files"])
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        before = llm.expert_stats()
        arrivals, times, io = [], [[] for _ in reqs], [[0, 0] for _ in reqs]
        for i, p in enumerate(reqs):
            engine.add_request({"prompt_token_ids": p}, params, request_id=f"{name}-{i}")
            arrivals.append(time.perf_counter())
        done = 0
        while done < len(reqs):
            for out in engine.step():
                i = int(out.request_id.rsplit("-", 1)[1])
                now, rb = time.perf_counter(), read_bytes()
                n = len(out.outputs[0].token_ids)
                if n > len(times[i]):
                    times[i].extend([now] * (n - len(times[i])))
                    if len(times[i]) == 1 or n == 1:
                        io[i][0] = rb
                    io[i][1] = rb
                done += out.finished
        if name != "warmup":
            row = summarise(name, arrivals, times, [tuple(x) for x in io])
            stats = llm.expert_stats()
            hits, misses = stats["hits"] - before["hits"], stats["misses"] - before["misses"]
            row.update(hit_rate=hits / max(hits + misses, 1), misses=misses, expert_bytes_read=stats["bytes_read"] -
                       before["bytes_read"], stall_s=stats["stall_seconds"] - before["stall_seconds"],
                       prefetch_bytes=stats.get("prefetch_bytes", 0) - before.get("prefetch_bytes", 0),
                       wasted_prefetch_bytes=stats.get("wasted_prefetch_bytes", 0) - before.get("wasted_prefetch_bytes", 0),
                       forced_pairs=router.forced_pairs if router else 0)
            rows.append(row)
    return {"engine": "moestream"}, rows


def run_llama(spec: dict, prompts: dict[str, list[list[int]]]) -> tuple[dict, list[dict]]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=spec["gguf"], n_ctx=spec["prompt_len"] + spec["max_tokens"] + 16, n_batch=512,
                          n_threads=spec["threads"], n_threads_batch=spec["threads"], use_mmap=True, seed=0,
                          verbose=False)
    rows = []
    for name, reqs in prompts.items():
        max_tokens = spec["max_tokens"] if name != "warmup" else 2
        if name != "warmup":
            spec["drop"] = drop_page_cache(spec["files"])
        arrivals, times, io = [], [], []
        start = time.perf_counter()
        for p in reqs:  # one sequence at a time: every request arrives at the start
            arrivals.append(start)
            times.append([])
            io.append([0, 0])
            llm.reset()
            for _tok in llm.generate(p, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
                times[-1].append(time.perf_counter())
                rb = read_bytes()
                if len(times[-1]) == 1:
                    io[-1][0] = rb
                io[-1][1] = rb
                if len(times[-1]) >= max_tokens:
                    break
        if name != "warmup":
            row = summarise(name, arrivals, times, [tuple(x) for x in io])
            # one sequence at a time: decode bytes are the sum over requests, not first..last
            row["decode_read_bytes"] = sum(e - b for b, e in io)
            row["decode_steps"] = sum(len(t) - 1 for t in times)
            row["read_bytes_per_token"] = row["decode_read_bytes"] / max(sum(len(t) - 1 for t in times), 1)
            rows.append(row)
    return {"engine": "llama_cpp", "llama_cpp": llama_cpp.__version__}, rows


def run_hf(spec: dict, prompts: dict[str, list[list[int]]]) -> tuple[dict, list[dict]]:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.set_num_threads(spec["threads"])
    model = AutoModelForCausalLM.from_pretrained(
        spec["ckpt"], dtype=torch.bfloat16, device_map="auto", max_memory={"cpu": spec["hf_cpu_bytes"]},
        offload_folder=spec["offload_folder"])
    model.eval()
    placed = {}
    for dev in getattr(model, "hf_device_map", {}).values():
        placed[str(dev)] = placed.get(str(dev), 0) + 1

    class Clock:
        def __init__(self) -> None:
            self.calls: list[tuple[float, int]] = []

        def put(self, value) -> None:
            self.calls.append((time.perf_counter(), read_bytes()))

        def end(self) -> None:
            pass

    rows = []
    for name, reqs in prompts.items():
        max_tokens = spec["hf_max_tokens"] if name != "warmup" else 2
        if name != "warmup":
            spec["drop"] = drop_page_cache(spec["files"] + [spec["offload_folder"]])
        gen = GenerationConfig(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
        clock = Clock()
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=torch.tensor(reqs), attention_mask=torch.ones(len(reqs), len(reqs[0]),
                           dtype=torch.long), generation_config=gen, streamer=clock)
        steps = clock.calls[1:]  # the first put() is the prompt
        if name != "warmup":
            times = [[t for t, _ in steps] for _ in reqs]
            io = [(steps[0][1], steps[-1][1]) for _ in reqs]
            row = summarise(name, [start] * len(reqs), times, io)
            rows.append(row)
    return {"engine": "hf", "transformers": transformers.__version__, "device_map": placed}, rows


def worker(spec: dict) -> dict:
    prompts = {"warmup": make_requests(1, 4, 99)}
    for conc in spec["concurrency"]:
        prompts[f"c{conc}"] = make_requests(conc, spec["prompt_len"], conc)
    t = time.perf_counter()
    run = {"moestream": run_moestream, "llama_cpp": run_llama, "hf": run_hf}[spec["engine"]]
    info, rows = run(spec, prompts)
    info.update(wall_s=time.perf_counter() - t, page_cache=spec.get("drop"))
    return {"info": info, "rows": rows}


# ---- orchestration ------------------------------------------------------------------------

def gguf_for(ckpt: str, timeout: float) -> str:
    """The bf16 GGUF of `ckpt` (made once by llama.cpp's converter, bench/throughput.py's)."""
    from throughput import PEERS, gguf_for as convert

    return convert(ckpt, PEERS, "bfloat16", timeout)


def run_engine(engine: str, spec: dict, cap_bytes: int, timeout: float) -> dict:
    """One engine's worker in its own process inside a memory cgroup of `cap_bytes`."""
    from throughput import PEER_SETUP, PEER_VENV, PEERS

    python = os.path.join(PEERS, PEER_VENV[engine], "bin", "python") if engine in PEER_VENV else sys.executable
    if not os.path.exists(python):
        return {"status": "not installed", "error": f"{python} not found: run {PEER_SETUP[engine]}"}
    cg = MemoryCgroup(f"moestream-bench-{engine}-{os.getpid()}", cap_bytes)
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=ROOT if engine != "llama_cpp" else "")
    try:
        proc = subprocess.run([python, os.path.abspath(__file__), "--worker", json.dumps(dict(spec, engine=engine))],
                              cwd=ROOT, capture_output=True, text=True, env=env, timeout=timeout, preexec_fn=cg.join)
        peak = cg.peak_bytes()
    except subprocess.TimeoutExpired as e:
        return {"status": "failed", "error": f"timed out after {timeout:.0f} s: {(e.stderr or b'')[-1500:]!r}"}
    finally:
        cg.remove()
    if proc.returncode != 0:
        return {"status": "failed", "error": f"rc {proc.returncode}: {proc.stderr[-1500:]}"}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result.update(status="ok", cgroup_peak_bytes=peak, cap_bytes=cap_bytes)
    return result


def markdown(results: list[dict], meta: dict) -> list[str]:
    bw = meta["sequential_read_bytes_per_s"]
    lines = [
        f"# Offload headline: {meta['checkpoint_gib']:.1f} GiB checkpoint ({meta['expert_gib']:.1f} GiB routed experts), "
        f"bf16, {meta['threads']} threads",
        "",
        f"Machine: {meta['cpu']}, {meta['cores']} cores, {meta['ram_gib']:.0f} GiB RAM; disk sequential read "
        f"{bw / 2**20:.0f} MiB/s (cold). Each process capped at budget + {meta['overhead_gib']:g} GiB by a memory "
        f"cgroup; page cache emptied before each workload by {meta['page_cache']}. Prompt {meta['prompt_len']} "
        f"tokens; {meta['max_tokens']} output tokens (HF {meta['hf_max_tokens']}). Load average before the runs: "
        f"{meta['load_before']:.2f}.",
        "",
        "llama.cpp's c4 runs its four requests one after another (llama-cpp-python decodes one sequence); "
        "HF's c4 is one batch of four. moestream's expert prefetch: "
        f"{meta['prefetch']} on random rows, {meta['trace_prefetch']} on trace rows.",
        "",
        "I/O floor: the disk bytes one decode step read (first token to last, over the steps) / the sequential "
        "read bandwidth measured just before that engine's run (disk MiB/s: 256 MiB read cold; cloud disks throttle, "
        "so it drifts); TPOT / floor is how far the engine is from spending a step only on its reads. CPU GFLOP/s: a "
        "bf16 GEMM probe just before the run (it drifts too on a shared host).",
        "",
        "| engine | routing | budget | cap | workload | TTFT s | TPOT s | out tok/s | MiB read / decode token | "
        "disk MiB/s | CPU GFLOP/s | I/O floor s | TPOT / floor | hit rate | peak GiB |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if r["status"] != "ok":
            lines.append(f"| {r['engine']} | {r['routing']} | {r['budget_gib']:g} GiB | | | {r['status']}: "
                         f"{r['error'][-200:]!s} | | | | | | | | | |".replace("\n", " "))
            continue
        for row in r["rows"]:
            # the floor of one decode step (a batch's step makes one token of each request)
            steps = row.get("decode_steps") or (row["output_tokens"] - row["requests"] if r["engine"] == "llama_cpp"
                                                 else row["output_tokens"] // row["requests"] - 1)
            disk = r.get("disk_read_bytes_per_s") or bw
            floor = row["decode_read_bytes"] / max(steps, 1) / disk
            per_token = row["decode_read_bytes"] / max(row["output_tokens"] - row["requests"], 1)
            ratio = row["tpot_s"] / floor if floor > 0 else None
            lines.append(
                f"| {r['engine']} | {r['routing']} | {r['budget_gib']:g} GiB | {r['cap_bytes'] / GiB:.0f} GiB | "
                f"{row['workload']} | {row['ttft_s']:.2f} | {row['tpot_s']:.3f} | "
                f"{format(row['output_tokens'] / row['wall_s'], '.2f') if row.get('wall_s') else '-'} | "
                f"{per_token / 2**20:.0f} | {disk / 2**20:.0f} | {r.get('cpu_gflops') or 0:.0f} | "
                f"{floor:.3f} | {'-' if ratio is None else f'{ratio:.2f}x'} | "
                f"{'-' if row.get('hit_rate') is None else format(row['hit_rate'], '.2f')} | "
                f"{(r['cgroup_peak_bytes'] or 0) / GiB:.1f} |")
    lines += ["", "Ratios at each budget, moestream / peer, random routing: TPOT (below 1 is faster) and output "
              "tok/s over the workload's wall time, TTFT included, against llama.cpp (above 1 is faster; at c4 it "
              "counts llama.cpp's one-at-a-time decoding against moestream's batch; not against HF, which ran "
              "fewer output tokens):", "",
              "| budget | workload | TPOT vs llama.cpp | TPOT vs HF | tok/s vs llama.cpp |",
              "|---:|---|---:|---:|---:|"]
    by = {(r["engine"], r["routing"], r["budget_gib"], row["workload"]): row
          for r in results if r["status"] == "ok" for row in r["rows"]}

    def tok_s(row: dict) -> float | None:
        return row["output_tokens"] / row["wall_s"] if row.get("wall_s") else None

    for (eng, routing, b, wl), row in sorted(by.items(), key=lambda kv: (kv[0][2], kv[0][3])):
        if eng != "moestream" or routing != "random":
            continue
        tpot = []
        for peer in ("llama_cpp", "hf"):
            other = by.get((peer, "random", b, wl))
            tpot.append(f"{row['tpot_s'] / other['tpot_s']:.2f}" if other else "-")
        llama = by.get(("llama_cpp", "random", b, wl))
        ours, theirs = tok_s(row), llama and tok_s(llama)
        tput = f"{ours / theirs:.2f}" if ours and theirs else "-"
        lines.append(f"| {b:g} GiB | {wl} | {tpot[0]} | {tpot[1]} | {tput} |")
    return lines


def plot(results: list[dict], path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    series: dict[str, list[tuple[float, float]]] = {}
    for r in results:
        for row in r.get("rows", []) if r["status"] == "ok" else []:
            if row["workload"] == "c1":
                series.setdefault(f"{r['engine']} ({r['routing']})", []).append((r["budget_gib"], row["tpot_s"]))
    for label, pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xlabel("memory budget (GiB of experts)")
    ax.set_ylabel("TPOT at c1 (s, log)")
    ax.set_yscale("log")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help="the dsv2lite-14 checkpoint directory (bench/make_checkpoint.py dsv2lite-14 DIR)")
    ap.add_argument("--trace", default=None, help="routing trace .npz for the trace rows (moestream only)")
    ap.add_argument("--engines", default="moestream,llama_cpp,hf")
    ap.add_argument("--routings", default="random,trace")
    ap.add_argument("--budgets", default="4,8,12", help="expert budgets, GiB")
    ap.add_argument("--hf-budgets", default="4,8,12", help="HF's budgets, GiB (each run reads GiBs per token)")
    ap.add_argument("--prefetch", default="auto", help="moestream's expert_prefetch on random rows (auto: none on CPU)")
    ap.add_argument("--trace-prefetch", default="none",
                    help="moestream's expert_prefetch on trace rows (the forced ids do not follow the gate)")
    ap.add_argument("--direct-io", default="auto", choices=("auto", "on", "off"),
                    help="moestream's expert_direct_io (auto: O_DIRECT when the experts do not fit in the page cache)")
    ap.add_argument("--overhead-gib", type=float, default=3.0, help="cgroup cap = budget + this")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--hf-max-tokens", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "offload_headline"))
    ap.add_argument("--report", action="store_true", help="only rewrite the .md and .png from the .json")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    if args.report:
        with open(args.out + ".json") as f:
            done = json.load(f)
        write_markdown(args.out + ".md", markdown(done["results"], done["meta"]))
        plot(done["results"], args.out + ".png")
        return 0
    if not args.ckpt or not os.path.exists(os.path.join(args.ckpt, "config.json")):
        ap.error("--ckpt must be a checkpoint directory: python bench/make_checkpoint.py dsv2lite-14 DIR")
    with open(os.path.join(args.ckpt, "bench_checkpoint.json")) as f:
        summary = json.load(f)
    dense = summary["total_bytes"] - summary["routed_expert_bytes"]
    engines = args.engines.split(",")
    gguf = None
    if "llama_cpp" in engines:
        gguf = gguf_for(args.ckpt, args.timeout)
    bw = sequential_read_bandwidth(args.ckpt)
    print(f"sequential read {bw / 2**20:.0f} MiB/s", flush=True)
    import platform

    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor())
    meta = {"checkpoint_gib": summary["total_bytes"] / GiB, "expert_gib": summary["routed_expert_bytes"] / GiB,
            "threads": args.threads, "cpu": cpu, "cores": os.cpu_count(),
            "ram_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB,
            "sequential_read_bytes_per_s": bw, "overhead_gib": args.overhead_gib, "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens, "hf_max_tokens": args.hf_max_tokens,
            "prefetch": args.prefetch, "trace_prefetch": args.trace_prefetch, "direct_io": args.direct_io,
            "load_before": os.getloadavg()[0],
            "page_cache": drop_page_cache([args.ckpt])}
    files = [args.ckpt] + ([gguf] if gguf else [])
    results = []
    budgets = sorted({float(b) for b in (args.budgets + "," + args.hf_budgets).split(",")})
    runs = [(e, routing, b) for b in budgets for e in engines
            if b in {float(x) for x in (args.hf_budgets if e == "hf" else args.budgets).split(",")}
            for routing in args.routings.split(",") if routing == "random" or e == "moestream"]
    for engine, routing, budget in runs:
        spec = {"ckpt": args.ckpt, "gguf": gguf, "files": files, "routing": routing, "trace": args.trace,
                "budget_bytes": int(budget * GiB), "hf_cpu_bytes": int(budget * GiB + dense),
                "offload_folder": os.path.join(os.path.dirname(os.path.abspath(args.ckpt)), "hf-offload"),
                "threads": args.threads, "prefetch": args.prefetch if routing == "random" else args.trace_prefetch,
                "direct_io": args.direct_io,
                "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                "hf_max_tokens": args.hf_max_tokens, "concurrency": [int(c) for c in args.concurrency.split(",")]}
        if routing == "trace" and not args.trace:
            continue
        disk_bw = sequential_read_bandwidth(args.ckpt, nbytes=256 << 20, repeats=1)  # it drifts: cloud disks throttle
        gflops = cpu_speed(args.threads)
        print(f"{engine} {routing} {budget:g} GiB (disk {disk_bw / 2**20:.0f} MiB/s, CPU {gflops:.0f} GFLOP/s) ...",
              flush=True)
        r = run_engine(engine, spec, int((budget + args.overhead_gib) * GiB), args.timeout)
        r.update(engine=engine, routing=routing, budget_gib=budget, disk_read_bytes_per_s=disk_bw, cpu_gflops=gflops)
        print(json.dumps({k: v for k, v in r.items() if k != "info"})[:600], flush=True)
        results.append(r)
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out + ".json", "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)
        write_markdown(args.out + ".md", markdown(results, meta))
    plot(results, args.out + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
