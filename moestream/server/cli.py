"""The `moestream` command line: `moestream generate ...`, `moestream serve ...` (the
OpenAI-compatible HTTP server) and `moestream trace-sim ...`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from moestream import __version__

DEMO_MODEL_NAME = "moestream-demo"


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags, named as vLLM names them."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer) "
                        "(default: the built-in demo model, a small MoE trained on Python's standard library)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weight and activation dtype; auto = the checkpoint's torch_dtype (default: auto)")
    g.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0 (default: cpu)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="max tokens per sequence, prompt + output (default: the model's max_position_embeddings)")
    g.add_argument("--max-num-seqs", type=int, default=64, help="max requests in one step (default: 64)")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget of one step; longer prompts are prefilled in chunks (default: 2048)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block (default: 16)")
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="bytes for the KV cache (default: enough for max-num-seqs full-length sequences, at most 4 GiB)")
    x = p.add_argument_group("expert paging")
    x.add_argument("--expert-budget", type=_budget, default=None,
                   help="device memory for routed experts: a fraction in (0, 1] of their bytes (e.g. 0.25) or a "
                        "number of bytes (e.g. 2000000000); the rest stay on disk / in host memory (default: all resident)")
    x.add_argument("--expert-host-cache-bytes", type=int, default=0,
                   help="bytes of host memory caching experts between disk and device (default: 0)")
    x.add_argument("--expert-policy", default="lru", choices=["lru", "lfu", "activation"],
                   help="eviction policy of the expert slots (default: lru)")
    x.add_argument("--expert-prefetch", default="auto", choices=["auto", "none", "gate", "history"],
                   help="prefetch predicted experts: gate = next layer's router on this layer's input, "
                        "history = co-activation statistics, auto = gate on CUDA and none on CPU (default: auto)")
    x.add_argument("--expert-pin-profile", default=None,
                   help='JSON file {"layer": [expert ids]} of hot experts kept resident')
    x.add_argument("--record-routing", default=None, metavar="FILE",
                   help="record (request, token, layer, expert ids) of every routed token to FILE (.npz)")
    h = p.add_argument_group("hybrid models (Qwen3-Next, Qwen3.5-MoE)")
    h.add_argument("--max-resident-states", type=int, default=None,
                   help="requests whose linear-attention states stay on the device; the rest are swapped to host "
                        "memory between their forwards (default: max-num-seqs)")
    h.add_argument("--mamba-ssm-cache-dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"],
                   help="dtype of the linear-attention recurrent state; auto = the model dtype (default: float32)")


def _budget(text: str) -> float | int:
    """'0.25' -> 0.25 (a fraction); '2000000000' -> 2000000000 (bytes)."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction like 0.25 or a number of bytes, got '{text}'") from None


def _threads(text: str) -> int | str:
    if text == "auto":
        return text
    n = int(text) if text.lstrip("-").isdigit() else 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got '{text}'")
    return n


def engine_kwargs(args: argparse.Namespace) -> dict:
    """LLM(...) keyword arguments from the engine flags.

    Raises:
        ValueError: no --model and the demo model is missing.
    """
    from moestream.demo import demo_model_path

    return dict(model=args.model if args.model is not None else demo_model_path(), dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                block_size=args.block_size, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                expert_budget=args.expert_budget, expert_host_cache_bytes=args.expert_host_cache_bytes,
                expert_policy=args.expert_policy, expert_prefetch=args.expert_prefetch,
                expert_pin_profile=args.expert_pin_profile, record_routing=args.record_routing,
                max_resident_states=args.max_resident_states, mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moestream", description="Serve Mixture-of-Experts language models.")
    parser.add_argument("--version", action="version", version=f"moestream {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions for prompts and print them",
                         description="Generate a completion for each prompt (batched together) and print it with tokens/s.")
    gen.add_argument("prompts", nargs="+", help="one or more prompts")
    gen.add_argument("--max-tokens", type=int, default=64, help="max new tokens per prompt (default: 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (default: 0)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default: 1)")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off (default: 0)")
    gen.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top probability (default: 0)")
    gen.add_argument("--seed", type=int, default=None,
                     help="sampling seed: the same seed gives the same output (default: none)")
    gen.add_argument("--repetition-penalty", type=float, default=1.0,
                     help="penalise tokens already in the prompt or output; > 1 discourages repeats (default: 1)")
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen.add_argument("-v", "--verbose", action="store_true", help="log engine sizes at start-up")
    add_engine_args(gen)
    srv = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                         description="Serve a model over an OpenAI-compatible HTTP API: /v1/completions, "
                                     "/v1/chat/completions, /v1/models, /health, /version, /metrics. "
                                     "SIGINT or SIGTERM stops it gracefully: in-flight requests finish, then it exits 0.")
    srv.add_argument("model_dir", nargs="?", default=None, metavar="MODEL_DIR",
                     help="Hugging Face checkpoint directory; same as --model (default: the built-in demo model)")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    srv.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000)")
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on /v1/* requests (default: no key)")
    srv.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                     help="model name(s) clients pass as 'model'; responses carry the first "
                          f"(default: MODEL_DIR as given, or '{DEMO_MODEL_NAME}' for the demo model)")
    srv.add_argument("--chat-template", default=None,
                     help="Jinja chat template (a file, or the template itself) overriding the tokenizer's")
    srv.add_argument("--max-waiting-requests", type=int, default=1024,
                     help="answer 503 when more engine requests than this (n choices count n) would be waiting "
                          "for their first token (default: 1024)")
    srv.add_argument("--max-request-body-bytes", type=int, default=10 << 20,
                     help="answer 413 to larger request bodies (default: 10485760)")
    srv.add_argument("--threads", type=_threads, default="auto", metavar="N|auto",
                     help="torch threads of the engine (intra-op); auto: on CPU the cores available less one for the "
                          "HTTP event loop, at least 1; torch's default on an accelerator (default: auto)")
    srv.add_argument("--uvicorn-log-level", default="info",
                     choices=["critical", "error", "warning", "info", "debug", "trace"],
                     help="uvicorn's log level (default: info)")
    add_engine_args(srv)
    sim = sub.add_parser("trace-sim", add_help=False,
                         help="replay a routing trace against each eviction policy and Belady's optimum "
                              "(see `moestream trace-sim --help`)")
    sim.add_argument("args", nargs=argparse.REMAINDER, help="trace-sim arguments")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["trace-sim"]:
        from moestream.experts.trace import trace_sim_main

        return trace_sim_main(argv[1:])
    args = build_parser().parse_args(argv)
    verbose = getattr(args, "verbose", False) or args.command == "serve"
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.command == "generate":
        return _generate(args)
    if args.command == "serve":
        return _serve(args)
    return 2


def _serve(args: argparse.Namespace) -> int:
    """Load the engine, then serve until SIGINT/SIGTERM. Returns 0 after a graceful stop,
    2 on a bad flag or model."""
    from moestream.config import EngineConfig
    from moestream.engine.llm_engine import LLMEngine
    from moestream.server.api import build_app, make_server
    from moestream.server.serving import ServerConfig, default_engine_threads

    if args.model_dir is not None and args.model is not None and args.model_dir != args.model:
        print(f"error: MODEL_DIR '{args.model_dir}' and --model '{args.model}' differ; give one", file=sys.stderr)
        return 2
    if args.model_dir is not None:
        args.model = args.model_dir
    try:
        if not 0 <= args.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {args.port}")
        chat_template = args.chat_template
        if chat_template is not None and os.path.isfile(chat_template):
            with open(chat_template) as f:
                chat_template = f.read()
        names = tuple(args.served_model_name or [args.model if args.model is not None else DEMO_MODEL_NAME])
        threads = default_engine_threads(args.device) if args.threads == "auto" else args.threads
        config = ServerConfig(served_model_names=names, api_key=args.api_key,
                              max_request_body_bytes=args.max_request_body_bytes,
                              max_waiting_requests=args.max_waiting_requests, chat_template=chat_template,
                              engine_threads=threads)
        engine = LLMEngine(EngineConfig(**engine_kwargs(args)))
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.getLogger(__name__).info("serving %s as %s on http://%s:%d/v1 (engine threads: %s)", engine.config.model,
                                     ", ".join(names), args.host, args.port, threads or "torch default")
    make_server(build_app(engine, config), args.host, args.port, args.uvicorn_log_level).run()
    engine.save_routing_trace()
    return 0


def _generate(args: argparse.Namespace) -> int:
    from moestream import LLM, SamplingParams

    try:
        llm_kwargs = engine_kwargs(args)
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                                seed=args.seed, max_tokens=args.max_tokens, stop=args.stop,
                                repetition_penalty=args.repetition_penalty)
        llm = LLM(**llm_kwargs)
        start = time.perf_counter()
        outputs = llm.generate(args.prompts, params)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - start
    n = sum(len(o.outputs[0].token_ids) for o in outputs)
    for o in outputs:
        print(f"--- prompt: {o.prompt!r}")
        print(f"{o.prompt}{o.outputs[0].text}")
        print(f"[{len(o.outputs[0].token_ids)} tokens, finish_reason={o.outputs[0].finish_reason}]")
    print(f"--- {n} tokens in {elapsed:.2f} s: {n / elapsed:.1f} tokens/s")
    stats = llm.expert_stats()
    if not stats["resident"]:
        print(f"--- experts: hit rate {stats['hit_rate']:.3f} ({stats['hits']} hits, {stats['misses']} misses), "
              f"{stats['bytes_read'] / 2**20:.1f} MiB read, stalled {stats['stall_seconds']:.2f} s")
    if args.record_routing:
        llm.llm_engine.save_routing_trace()
        print(f"--- routing trace written to {args.record_routing}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
