"""`moestream cartridge build [MODEL] --document FILE --method prefix|knorm|train --output FILE`:
make a KV cartridge (docs/cartridges.md) of a document for a model.

- `prefix`: the document's exact cache entries (p = its length; `--after` continues other
  cartridges, so that composing them in order is exact);
- `knorm`: --num-tokens entries kept by the smallest key norm (a drop heuristic);
- `train`: Cartridges' context distillation (`moestream/cartridges/train.py`), initialised
  from the document's first --num-tokens entries.

The engine flags are `generate`'s; the cartridge's entries are in the engine's dtype, so
build it with the dtype it will be served in.
"""

from __future__ import annotations

import argparse
import os

from moestream.engine.args import add_engine_args, engine_kwargs


def add_cartridge_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `cartridge` command (`cartridge build`) to the subcommands `sub`; returns its parser."""
    p = sub.add_parser("cartridge", help="build KV cartridges of documents (see `moestream cartridge build --help`)",
                       description="KV cartridges: precomputed or trained KV prefixes that requests start after.")
    actions = p.add_subparsers(dest="cartridge_command", metavar="ACTION", required=True, help="build: make a cartridge")
    b = actions.add_parser(
        "build", help="build a cartridge of a document",
        description="Build a cartridge of a document for a model and write it as a safetensors file, which "
                    "requests name in their `cartridges` field (or LLM.generate(..., cartridges=[...])).")
    b.add_argument("model_dir", nargs="?", default=None, metavar="MODEL_DIR",
                   help="checkpoint directory or built-in model; same as --model (default: demo)")
    b.add_argument("--document", required=True, metavar="FILE", help="the document (a UTF-8 text file)")
    b.add_argument("--method", choices=("prefix", "knorm", "train"), default="prefix",
                   help="prefix = the document's exact KV (p = its length); knorm = the --num-tokens entries with "
                        "the smallest key norms; train = context distillation (default: prefix)")
    b.add_argument("--num-tokens", type=int, default=None, metavar="P",
                   help="knorm, train: the cartridge's positions p (default: 256)")
    b.add_argument("--output", required=True, metavar="FILE", help="the cartridge file to write (.safetensors)")
    b.add_argument("--id", default=None, help="the cartridge's id (default: the output file's name without "
                                              ".safetensors)")
    b.add_argument("--after", action="append", default=None, metavar="CARTRIDGE",
                   help="prefix: build after these cartridges (paths or ids in --cartridge-dir; repeatable), so "
                        "that composing them with the new one is exact")
    b.add_argument("--max-doc-tokens", type=int, default=None, metavar="N",
                   help="use the document's first N tokens (default: all)")
    b.add_argument("--steps", type=int, default=60, help="train: optimizer steps of 4 texts (default: 60)")
    b.add_argument("--lr", type=float, default=1e-2, help="train: Adam's learning rate (default: 0.01)")
    b.add_argument("--num-samples", type=int, default=32,
                   help="train: training texts (document spans and the model's own continuations) (default: 32)")
    b.add_argument("--sample-len", type=int, default=32, help="train: tokens per training text (default: 32)")
    b.add_argument("--mix-fraction", type=float, default=0.0,
                   help="train: share of off-document texts (Cartridges++' data mixing) (default: 0)")
    b.add_argument("--off-document", action="append", default=None, metavar="FILE",
                   help="train with --mix-fraction: off-document text files (default: the demos' training split "
                        "of the standard library)")
    b.add_argument("--seed", type=int, default=0, help="train: seed of sampling and initial order (default: 0)")
    b.add_argument("--router-text", action="append", default=None, metavar="FILE",
                   help="background text of the cartridge's router (cartridge_routing auto), repeatable (default: "
                        "the demos' training split of the standard library)")
    b.add_argument("--no-router", action="store_true", help="store no router (auto routing then always attaches)")
    add_engine_args(b)
    b.set_defaults(subparser=b)
    p.set_defaults(subparser=p)
    return p


def _document_ids(tokenizer, path: str, max_tokens: int | None) -> list[int]:
    with open(path, encoding="utf-8", errors="replace") as f:
        ids = tokenizer.encode(f.read(), add_special_tokens=False)
    ids = ids[:max_tokens] if max_tokens else ids
    if not ids:
        raise ValueError(f"--document {path} has no tokens")
    return ids


ROUTER_BACKGROUND_TOKENS = 200_000


def background_ids(tokenizer, paths: list[str] | None) -> list[int]:
    """Token ids of the router's background text: `paths`, else the demos' training split (up
    to 200k tokens)."""
    from moestream.demo import training_files

    ids: list[int] = []
    for path in paths or training_files():
        with open(path, encoding="utf-8", errors="replace") as f:
            ids += tokenizer.encode(f.read(), add_special_tokens=False)
        if len(ids) >= ROUTER_BACKGROUND_TOKENS:
            break
    return ids[:ROUTER_BACKGROUND_TOKENS]


def run_cartridge(args: argparse.Namespace) -> int:
    """Run `moestream cartridge build`; returns the exit status (0). Bad flags or inputs raise ValueError."""
    from moestream import LLM
    from moestream.cartridges.build import build_knorm, build_prefix
    from moestream.cartridges.format import save_cartridge

    if not os.path.isfile(args.document):
        raise ValueError(f"--document {args.document} is not a file")
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        raise ValueError(f"--output {args.output}: its directory does not exist")
    if args.after and args.method != "prefix":
        raise ValueError("--after builds prefix cartridges only; drop it or use --method prefix")
    if args.method != "prefix" and args.num_tokens is None:
        args.num_tokens = 256
    if args.num_tokens is not None and args.num_tokens < 1:
        raise ValueError(f"--num-tokens must be at least 1, got {args.num_tokens}")
    if not 0.0 <= args.mix_fraction < 1.0:
        raise ValueError(f"--mix-fraction must be in [0, 1), got {args.mix_fraction}")
    kw = engine_kwargs(args)
    if args.model_dir is not None:
        kw["model"] = args.model_dir
    if kw.get("expert_mode", "exact") != "exact":
        raise ValueError("cartridges are built exact; drop --expert-mode")
    kw["enable_prefix_caching"] = False
    llm = LLM(**kw)
    engine = llm.llm_engine
    ids = _document_ids(llm.get_tokenizer(), args.document, args.max_doc_tokens)
    cid = args.id or os.path.basename(args.output).removesuffix(".safetensors")
    if args.method == "prefix":
        cart = build_prefix(engine, ids, cid, args.after or ())
    elif args.method == "knorm":
        cart = build_knorm(engine, ids, args.num_tokens, cid)
    else:
        from moestream.cartridges.train import TrainConfig, train_cartridge

        cfg = TrainConfig(args.num_tokens, args.steps, args.lr, args.num_samples, args.sample_len, args.mix_fraction,
                          tuple(args.off_document or ()), args.seed)
        cart = train_cartridge(engine, ids, cid, cfg)
    if not args.no_router:
        from dataclasses import replace

        from moestream.cartridges.router import fit_router

        router = fit_router(ids, background_ids(llm.get_tokenizer(), args.router_text), engine.model_config.vocab_size)
        cart = replace(cart, router=router)
    state_names = tuple(s.name for s in engine.state_pool.specs) if engine.state_pool is not None else ()
    save_cartridge(args.output, cart, state_names, mla=engine.model_config.mla is not None)
    print(f"cartridge '{cid}' ({args.method}): {cart.num_tokens} positions of a {len(ids)}-token document, "
          f"{cart.kv_bytes / 2**20:.2f} MiB of KV, written to {args.output}")
    return 0
