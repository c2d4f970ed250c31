"""The dense part of a decode step, eager against torch.compile (inductor, CPU).

For every decoder layer of a checkpoint (Qwen3-MoE-style GQA layers), the two dense regions
a decode step runs around attention and the routed experts:

- pre:  input RMSNorm, q / k / v projections, q / k RMSNorm, RoPE -> (q, k, v)
- post: o_proj, residual add, post-attention RMSNorm, router (scores, top-k, weights)

and the lm_head, timed per step (all layers) at several batch sizes, in four forms:

- eager, packed: the engine's own modules as loaded (bf16 weights prepacked for oneDNN on
  CPUs with native bf16);
- eager, plain: the same modules on the unpacked weights;
- compiled: `torch.compile(dynamic=False)` of each region on the unpacked weights (inductor
  cannot take oneDNN's packed tensors: its lowering of `mkldnn::_linear_pointwise` asserts),
  one graph per region and batch size, compile time reported;
- compiled, freezing: the same with inductor's `freezing` (weights as constants, packed by
  inductor itself).

Also the per-call cost of an empty compiled function (dynamo's guards and the wrapper), and
the largest difference of each compiled region's outputs from eager's. Writes OUT.json,
OUT.md and OUT.png.

    python bench/compile_dense.py --checkpoint small --dtype bfloat16 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _regions(parts):
    """(pre, post) of one decoder layer as plain functions over its modules."""
    norm1, attn, norm2, gate = parts

    def pre(x, positions):
        t = x.shape[0]
        h = norm1(x)
        q = attn.q_proj(h).view(t, attn.num_heads, attn.head_dim)
        k = attn.k_proj(h).view(t, attn.num_kv_heads, attn.head_dim)
        v = attn.v_proj(h).view(t, attn.num_kv_heads, attn.head_dim)
        if attn.q_norm is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = attn.rotary(positions, q, k)
        return q, k, v

    def post(o, x):
        x = x + attn.o_proj(o)
        h = norm2(x)
        weights, ids = gate(h)
        return x, h, weights, ids

    return pre, post


def _parts(model, unpack: bool) -> tuple[list[tuple], object]:
    """Each layer's (input norm, attention, post-attention norm, router) and the lm_head:
    the model's own modules, or (unpack) copies whose packed Linear weights are plain tensors
    again (exact: the packed tensor holds the same values). The copies share the attention
    backend and the rotary embedding."""
    import copy

    import torch

    from moestream.layers.linear import Linear

    def copied(module):
        if not unpack:
            return module
        memo = {}
        for m in module.modules():
            if isinstance(m, Linear) and m.packed:
                memo[id(m.weight)] = torch.nn.Parameter(m.weight.data.to_dense(), requires_grad=False)
            for shared in ("backend", "rotary"):
                if getattr(m, shared, None) is not None:
                    memo[id(getattr(m, shared))] = getattr(m, shared)
        out = copy.deepcopy(module, memo)
        for m in out.modules():
            if isinstance(m, Linear):
                m.packed = False
        return out

    layers = [(copied(layer.input_layernorm), copied(layer.self_attn), copied(layer.post_attention_layernorm),
               copied(layer.mlp.gate)) for layer in model.model.layers]
    return layers, copied(model.lm_head)


def _time(fn, reps: int) -> float:
    """Median seconds of `fn()` over `reps` runs after 3 warm-up runs."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default="small", help="a directory or a make_checkpoint.py preset (GQA layers)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-sizes", default="1,4,16,64")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "compile_dense"))
    args = ap.parse_args(argv)
    sys.path.insert(0, ROOT)
    sys.path.insert(0, HERE)
    import torch

    from report import pyplot, resolve_checkpoint, wait_for_idle, write_markdown

    from moestream import LLM
    from moestream.config.dtype import resolve_dtype

    load = wait_for_idle()
    ckpt = resolve_checkpoint(args.checkpoint)
    llm = LLM(ckpt, dtype=args.dtype, max_model_len=256, threads=args.threads)
    model = llm.llm_engine.runner.model
    cfg = model.config
    dtype = resolve_dtype(args.dtype, None)
    forms: dict[str, tuple] = {}
    for name, unpack in (("eager, packed", False), ("eager, plain", True)):
        layers, head = _parts(model, unpack)
        forms[name] = ([_regions(p) for p in layers], lambda h, head=head: head(h).float())
    plain_regions, plain_logits = forms["eager, plain"]
    for name, options in (("compiled", None), ("compiled, freezing", {"freezing": True})):
        forms[name] = ([tuple(torch.compile(f, dynamic=False, options=options) for f in pair) for pair in plain_regions],
                       torch.compile(plain_logits, dynamic=False, options=options))

    sizes = [int(b) for b in args.batch_sizes.split(",")]
    rows, ref_out = [], {}
    with torch.inference_mode():
        empty = torch.compile(lambda a: a, dynamic=False)
        probe = torch.zeros(4)
        empty(probe)
        wrapper_us = _time(lambda: empty(probe), 2000) * 1e6
        for t in sizes:
            g = torch.Generator().manual_seed(t)
            x = torch.randn(t, cfg.hidden_size, generator=g).to(dtype)
            o = torch.randn(t, cfg.num_heads * cfg.head_dim, generator=g).to(dtype)
            positions = torch.arange(100, 100 + t)
            for name, (regions, logits) in forms.items():
                def step(regions=regions, logits=logits):
                    outs = []
                    for pre, post in regions:
                        outs.append(pre(x, positions))
                        outs.append(post(o, x))
                    outs.append(logits(x))
                    return outs

                start = time.perf_counter()
                first = step()  # compiles the compiled forms
                first_s = time.perf_counter() - start
                seconds = _time(step, args.reps)
                flat = [v.float() for out in first for v in (out if isinstance(out, tuple) else (out,))
                        if v.is_floating_point()]
                if name == "eager, packed":
                    ref_out[t] = flat
                diff = max(float((a - b).abs().max()) for a, b in zip(flat, ref_out[t]))
                rows.append({"batch": t, "form": name, "step_ms": seconds * 1e3, "first_call_s": first_s,
                             "max_abs_diff_vs_eager_packed": diff})
                print(rows[-1], flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    result = {"checkpoint": ckpt, "dtype": args.dtype, "threads": torch.get_num_threads(), "load_before": load,
              "layers": cfg.num_layers, "empty_compiled_call_us": wrapper_us, "rows": rows}
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=2)
    names = list(forms)
    lines = [f"# Dense part of a decode step: eager vs torch.compile (`{os.path.basename(ckpt)}`, {args.dtype}, "
             f"{torch.get_num_threads()} threads, load {load:.1f} before)", "",
             f"{cfg.num_layers} layers x (pre: norm, q/k/v, q/k norm, RoPE; post: o_proj, residual, norm, router) "
             f"+ lm_head; ms per step, median of {args.reps}. An empty compiled call costs {wrapper_us:.1f} us.", "",
             "| batch | " + " | ".join(f"{n} (ms)" for n in names) + " | compiled / eager packed | largest diff (compiled) |",
             "|---:|" + "---:|" * (len(names) + 2)]
    for t in sizes:
        by = {r["form"]: r for r in rows if r["batch"] == t}
        lines.append(f"| {t} | " + " | ".join(f"{by[n]['step_ms']:.2f}" for n in names)
                     + f" | {by['compiled']['step_ms'] / by['eager, packed']['step_ms']:.2f}x"
                     + f" | {by['compiled']['max_abs_diff_vs_eager_packed']:.3g} |")
    lines += ["", "First call (compile) seconds: " + ", ".join(
        f"{r['form']} b{r['batch']} {r['first_call_s']:.1f}" for r in rows if r["form"].startswith("compiled"))]
    write_markdown(args.out + ".md", lines)
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 4))
        for n in names:
            ax.plot(sizes, [next(r["step_ms"] for r in rows if r["batch"] == t and r["form"] == n) for t in sizes],
                    marker="o", label=n)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (decode rows)")
        ax.set_ylabel("ms per step (dense regions + lm_head)")
        ax.set_title(f"{os.path.basename(ckpt)} {args.dtype}, {torch.get_num_threads()} threads")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out + ".png", dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
