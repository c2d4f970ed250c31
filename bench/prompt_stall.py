"""How long one huge prompt stalls the other clients of `moestream serve`.

A long greedy stream runs; after `--warmup` seconds an intruder request arrives, and the
stream's largest inter-token gap (ITL) during the run is recorded, with the intruder's
status and latency. Intruders: none (baseline), a 9 MB text prompt (refused by its length
before tokenizing), a 1M-token id list (refused by its count), and a text just under the
length bound (tokenized on the tokenizer thread, then refused by its token count). Before
the server tokenized off the engine thread, a 9 MB text froze every other stream for
14.5 s and a 1M-token list for 0.9 s.

    python bench/prompt_stall.py --out bench/results/prompt_stall

Writes OUT.json, OUT.md and OUT.png. The server runs in its own process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)  # bench/ siblings, also when imported

from report import pyplot, write_markdown  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def intruders(max_chars: int) -> dict[str, dict | None]:
    """Intruder request bodies by name; `max_chars` is the server's text length bound."""
    rng = random.Random(0)
    words = ["def", "return", "self", "import", "class", "value", "path", "None", "if", "for"]
    under = " ".join(rng.choice(words) for _ in range(max_chars // 6))[: max_chars - 1]
    return {
        "none": None,
        "text_9MB": {"prompt": "x" * 9_000_000, "max_tokens": 1},
        "ids_1M": {"prompt": [1] * 1_000_000, "max_tokens": 1},
        f"text_{len(under) // 1000}k_chars_tokenized": {"prompt": under, "max_tokens": 1},
    }


async def run_case(base: str, model: str, intruder: dict | None, max_tokens: int, warmup: float) -> dict:
    """One long stream, with `intruder` sent after `warmup` seconds; returns the gaps."""
    import httpx

    stream_body = {"model": model, "prompt": "def main():", "max_tokens": max_tokens, "ignore_eos": True,
                   "temperature": 0, "stream": True}
    times: list[float] = []
    result: dict = {"intruder_status": None, "intruder_latency_s": None}
    async with httpx.AsyncClient(timeout=600) as http:

        async def stream() -> None:
            async with http.stream("POST", base + "/v1/completions", json=stream_body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        times.append(time.perf_counter())

        async def intrude() -> None:
            await asyncio.sleep(warmup)
            if intruder is None:
                return
            start = time.perf_counter()
            r = await http.post(base + "/v1/completions", json={"model": model, **intruder})
            result["intruder_status"] = r.status_code
            result["intruder_latency_s"] = time.perf_counter() - start
            result["intruder_error"] = r.json().get("error", {}).get("message", "")[:160] if r.status_code != 200 else ""

        await asyncio.gather(stream(), intrude())
    gaps = [b - a for a, b in zip(times, times[1:])]
    gaps.sort()
    result.update(tokens=len(times), max_itl_s=gaps[-1] if gaps else None,
                  p50_itl_s=gaps[len(gaps) // 2] if gaps else None)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=None, help="checkpoint directory (default: the demo model)")
    ap.add_argument("--max-tokens", type=int, default=300, help="tokens of the long stream (default: 300)")
    ap.add_argument("--warmup", type=float, default=1.0, help="seconds before the intruder is sent (default: 1)")
    ap.add_argument("--threads", default="auto", help="the server's --threads (default: auto)")
    ap.add_argument("--out", default="bench/results/prompt_stall", help="output path prefix")
    args = ap.parse_args(argv)

    import httpx

    from moestream.demo import demo_model_path
    from moestream.engine.input_processor import max_token_chars
    from moestream.loader import load_tokenizer

    checkpoint = args.checkpoint or demo_model_path()
    with open(os.path.join(checkpoint, "config.json")) as f:
        max_model_len = json.load(f)["max_position_embeddings"]
    bound = max_model_len * max_token_chars(load_tokenizer(checkpoint))
    port = free_port()
    cmd = [sys.executable, "-m", "moestream.server.cli", "serve", checkpoint, "--port", str(port),
           "--served-model-name", "m", "--max-request-body-bytes", str(64 << 20), "--threads", args.threads]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    rows = []
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start: {proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        load = os.getloadavg()[0]
        for name, body in intruders(bound).items():
            row = {"intruder": name, **asyncio.run(run_case(base, "m", body, args.max_tokens, args.warmup))}
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    meta = {"checkpoint": os.path.basename(os.path.normpath(checkpoint)), "max_model_len": max_model_len,
            "length_bound_chars": bound, "stream_tokens": args.max_tokens, "threads": args.threads,
            "cores": os.cpu_count(), "load_before": round(load, 2),
            "busy": load > 0.5}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    lines = [f"# Prompt stall: a {args.max_tokens}-token stream's largest gap while an intruder arrives",
             "", f"Checkpoint `{meta['checkpoint']}`, max_model_len {max_model_len}, text length bound {bound} "
             f"characters, server threads {args.threads}, {meta['cores']} cores, load before {meta['load_before']}"
             + (" (machine busy)" if meta["busy"] else "") + ".", "",
             "| intruder | status | intruder latency (s) | stream max ITL (s) | stream p50 ITL (s) |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        lat = "-" if r["intruder_latency_s"] is None else f"{r['intruder_latency_s']:.3f}"
        lines.append(f"| {r['intruder']} | {r['intruder_status'] or '-'} | {lat} | {r['max_itl_s']:.3f} | "
                     f"{r['p50_itl_s']:.4f} |")
    write_markdown(args.out + ".md", lines)
    plt = pyplot()
    if plt is None:
        return 0
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar([r["intruder"] for r in rows], [r["max_itl_s"] for r in rows], color="tab:blue")
    ax.set_ylabel("stream's max inter-token gap (s)")
    ax.set_title("Other clients' stall while an intruder prompt arrives")
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
