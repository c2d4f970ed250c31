"""KV cartridges on a built-in model: held-out loss, routing, TTFT and KV bytes per request.

For each of `--num-docs` held-out standard-library files (the demos never trained on them),
the document is its first `--doc-tokens` tokens, the on-document texts are the next
`--num-texts` spans of 64 tokens (its continuation), and the off-document texts are 64-token
spans of other held-out files. For each p in `--p`:
- `prefix-p`: the document's first p tokens in context (the truncation baseline, and `train`'s
  initialisation);
- `knorm`: the p entries of smallest key norm (`moestream cartridge build --method knorm`);
- `train`: context distillation (`--method train` with its defaults: 32 texts of 32 tokens,
  lr 0.01, `--steps` 60), with
  the router fitted on the demos' training split;
- `train+auto`: the same with `cartridge_routing` "auto" (the router decides per text).
`none` has no document, `full` the whole document in context (exactly what a `prefix`
cartridge of it gives). Losses are nats per token of the texts' tokens after the first
(`moestream.cartridges.evaluate.text_loss`), averaged over documents; "gap closed" is
(none - x) / (none - full) on the document's continuation.

TTFT is timed for one request of a 64-token prompt after: nothing, the full document
recomputed (prefix caching off), the full document hit in the prefix cache, and the trained
cartridge (its blocks pinned once, then reused); KV bytes per request are the bytes of the
blocks a running request holds (its table), the cartridge's shared blocks included.

One process (one engine, configurations in turn); the machine's load is recorded.
Writes OUT.json, OUT.md and OUT.png.

    python bench/cartridges.py --checkpoint demo --doc-tokens 192 --p 16 32 64
    python bench/cartridges.py --checkpoint demo --doc-tokens 1536 --p 64 256 512
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from report import pyplot, resolve_checkpoint, wait_for_idle, write_markdown  # noqa: E402

SPAN = 64


def _documents(tokenizer, num_docs: int, doc_tokens: int, num_texts: int) -> tuple[list, list[list[int]]]:
    """[(name, document ids, continuation spans)] from held-out files long enough, and the
    off-document spans (one 64-token span from inside each of the next held-out files, at a
    seeded position)."""
    from moestream.demo import heldout_files

    docs, off = [], []
    rng = random.Random(0)
    for path in heldout_files():
        with open(path, encoding="utf-8", errors="replace") as f:
            ids = tokenizer.encode(f.read(), add_special_tokens=False)
        if len(docs) < num_docs and len(ids) >= doc_tokens + num_texts * SPAN:
            docs.append((os.path.basename(path), ids[:doc_tokens],
                         [ids[doc_tokens + i * SPAN: doc_tokens + (i + 1) * SPAN] for i in range(num_texts)]))
        elif len(docs) == num_docs and len(ids) >= 4 * SPAN and len(off) < num_texts * num_docs:
            start = rng.randrange(SPAN, len(ids) - SPAN + 1)  # a span from inside the file
            off.append(ids[start: start + SPAN])
        if len(docs) == num_docs and len(off) >= num_texts * num_docs:
            break
    return docs, off


def _ttft(llm, prompt: list[int], cartridges=None, repeats: int = 3) -> float:
    """Median TTFT (s) of one request of `prompt` (after `cartridges`), max_tokens 1."""
    from moestream import SamplingParams

    out = []
    for _ in range(repeats):
        o = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0.0),
                         cartridges=cartridges)[0]
        out.append(o.metrics.ttft)
    return statistics.median(out)


def _kv_bytes(llm, prompt: list[int], cartridges=None) -> int:
    """Bytes of the KV blocks one running request of `prompt` holds after its prefill."""
    from moestream import SamplingParams

    engine = llm.llm_engine
    rid = engine.add_request({"prompt_token_ids": prompt, **({"cartridges": cartridges} if cartridges else {})},
                             SamplingParams(max_tokens=4, temperature=0.0))
    try:
        while engine.requests[rid].num_computed_tokens < engine.requests[rid].num_prompt_tokens:
            engine.step()
        return len(engine.coordinator.block_table(rid)) * engine.kv_cache_block_bytes
    finally:
        engine.abort_request(rid)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default="demo", help="checkpoint directory or built-in model (default: demo)")
    ap.add_argument("--doc-tokens", type=int, default=192, help="document length in tokens (default: 192)")
    ap.add_argument("--p", type=int, nargs="+", default=[16, 32, 64], help="cartridge sizes (default: 16 32 64)")
    ap.add_argument("--num-docs", type=int, default=8, help="documents averaged over (default: 8)")
    ap.add_argument("--num-texts", type=int, default=3, help="64-token texts per document, on and off (default: 3)")
    ap.add_argument("--steps", type=int, default=60, help="train: optimizer steps (default: 60, the builder's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "cartridges"), help="output path without suffix")
    args = ap.parse_args()

    import torch

    from moestream import LLM
    from moestream.cartridges.build import build_knorm
    from moestream.cartridges.evaluate import text_loss
    from moestream.cartridges.format import save_cartridge
    from moestream.cartridges.router import fit_router
    from moestream.cartridges.train import TrainConfig, train_cartridge
    from moestream.server.cli_cartridge import background_ids

    torch.set_num_threads(args.threads)
    load = wait_for_idle()
    llm = LLM(resolve_checkpoint(args.checkpoint), dtype="float32", threads=args.threads,
              max_model_len=args.doc_tokens + 2 * SPAN, enable_prefix_caching=True)
    engine, tok = llm.llm_engine, llm.get_tokenizer()
    docs, off = _documents(tok, args.num_docs, args.doc_tokens, args.num_texts)
    background = background_ids(tok, None)
    tmp = tempfile.mkdtemp(prefix="moestream-cartridges-")
    rows: dict[str, dict[str, list[float]]] = {}

    def add(name: str, key: str, value: float) -> None:
        rows.setdefault(name, {}).setdefault(key, []).append(value)

    t0 = time.time()
    for d, (name, doc, texts) in enumerate(docs):
        add("none", "on", text_loss(llm, texts))
        add("none", "off", text_loss(llm, off))
        add("full", "on", text_loss(llm, texts, prefix=doc))
        add("full", "off", text_loss(llm, off, prefix=doc))
        router = fit_router(doc, background, engine.model_config.vocab_size)
        for p in args.p:
            add(f"prefix-{p}", "on", text_loss(llm, texts, prefix=doc[:p]))
            kpath = os.path.join(tmp, f"k{d}-{p}.safetensors")
            save_cartridge(kpath, build_knorm(engine, doc, p, "k"))
            add(f"knorm-{p}", "on", text_loss(llm, texts, cartridges=[kpath]))
            add(f"knorm-{p}", "off", text_loss(llm, off, cartridges=[kpath]))
            t = time.time()
            cart = train_cartridge(engine, doc, f"t{d}", TrainConfig(num_tokens=p, steps=args.steps, seed=d))
            add(f"train-{p}", "train_s", time.time() - t)
            tpath = os.path.join(tmp, f"t{d}-{p}.safetensors")
            save_cartridge(tpath, dataclasses.replace(cart, router=router))
            add(f"train-{p}", "on", text_loss(llm, texts, cartridges=[tpath]))
            add(f"train-{p}", "off", text_loss(llm, off, cartridges=[tpath]))
            add(f"train-{p}+auto", "on", text_loss(llm, texts, cartridges=[tpath], routing="auto"))
            add(f"train-{p}+auto", "off", text_loss(llm, off, cartridges=[tpath], routing="auto"))
            add(f"train-{p}+auto", "on_attached", sum(router.relevance(t) > router.threshold for t in texts) / len(texts))
            add(f"train-{p}+auto", "off_attached", sum(router.relevance(t) > router.threshold for t in off) / len(off))
            if d == 0:
                prompt = texts[0]
                add(f"train-{p}", "ttft_s", _ttft(llm, prompt, [tpath]))
                add(f"train-{p}", "kv_bytes", _kv_bytes(llm, prompt, [tpath]))
        if d == 0:
            prompt = texts[0]
            add("none", "ttft_s", _ttft(llm, prompt))
            add("none", "kv_bytes", _kv_bytes(llm, prompt))
            cold = LLM(resolve_checkpoint(args.checkpoint), dtype="float32", threads=args.threads,
                       max_model_len=args.doc_tokens + 2 * SPAN, enable_prefix_caching=False)
            add("full", "ttft_s", _ttft(cold, doc + prompt))
            add("full (prefix cache hit)", "ttft_s", _ttft(llm, doc + prompt))
            add("full", "kv_bytes", _kv_bytes(llm, doc + prompt))
            del cold
        print(f"document {d + 1}/{len(docs)} ({name}) done, {time.time() - t0:.0f} s", flush=True)

    none_on, full_on = statistics.mean(rows["none"]["on"]), statistics.mean(rows["full"]["on"])
    table = {name: {k: statistics.mean(v) for k, v in r.items()} for name, r in rows.items()}
    for name, r in table.items():
        if "on" in r and none_on != full_on:
            r["gap_closed"] = (none_on - r["on"]) / (none_on - full_on)
    result = {"checkpoint": args.checkpoint, "doc_tokens": args.doc_tokens, "p": args.p, "steps": args.steps,
              "documents": [n for n, _, _ in docs], "texts_per_document": args.num_texts, "span": SPAN,
              "load_before": load, "load_after": os.getloadavg()[0], "threads": args.threads, "rows": table,
              "seconds": time.time() - t0}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)

    def fmt(r: dict, key: str, spec: str = ".4f") -> str:
        return format(r[key], spec) if key in r else ""

    lines = [f"Cartridges on `{args.checkpoint}`: documents of {args.doc_tokens} tokens ({len(docs)} held-out files), "
             f"{args.num_texts} texts of {SPAN} tokens each on and off the document; train: {args.steps} steps. "
             f"Load average {load:.2f} before, {result['load_after']:.2f} after.", "",
             "| configuration | on-document loss | gap closed | off-document loss | off - none | attached on / off | "
             "TTFT (ms) | KV bytes / request |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    none_off = table["none"]["off"]
    for name, r in table.items():
        attached = (f"{r['on_attached']:.0%} / {r['off_attached']:.0%}" if "on_attached" in r else "")
        lines.append(f"| {name} | {fmt(r, 'on')} | {fmt(r, 'gap_closed', '.0%')} | {fmt(r, 'off')} | "
                     f"{format(r['off'] - none_off, '+.4f') if 'off' in r else ''} | {attached} | "
                     f"{format(r['ttft_s'] * 1000, '.1f') if 'ttft_s' in r else ''} | "
                     f"{format(int(r['kv_bytes']), ',') if 'kv_bytes' in r else ''} |")
    write_markdown(args.out + ".md", lines)
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(7, 4))
        for label, row, marker in (("prefix", "prefix-{}", "s"), ("knorm", "knorm-{}", "^"), ("train", "train-{}", "o"),
                                   ("train+auto", "train-{}+auto", "x")):
            ax.plot(args.p, [table[row.format(p)]["on"] for p in args.p], marker=marker, label=label)
        ax.axhline(none_on, color="grey", linestyle="--", label="no document")
        ax.axhline(full_on, color="black", linestyle=":", label="full document")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("cartridge positions p")
        ax.set_ylabel("on-document held-out loss (nats/token)")
        ax.set_title(f"cartridges, {args.checkpoint}, {args.doc_tokens}-token documents")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.out + ".png", dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
