"""The `moestream` command line: `moestream generate ...` (moestream/server/cli_generate.py),
`moestream serve ...` (the OpenAI-compatible HTTP server) and `moestream trace-sim ...`.

Only the standard library is imported at start, so that `--help` and argument errors answer
at once; torch, transformers and the engine are imported inside the commands.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import socket
import sys
from typing import TYPE_CHECKING, Any

from moestream import __version__
from moestream.experts.policy import POLICY_NAMES

if TYPE_CHECKING:
    import uvicorn

    from moestream.server.serving import ServerConfig

DEMO_MODEL_NAME = "moestream-demo"

logger = logging.getLogger(__name__)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags, named as vLLM names them."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer), or a built-in "
                        "model: 'demo' (the default, a small Qwen3-MoE trained on Python's standard library) or "
                        "'demo-hybrid' (a small Qwen3.5-MoE hybrid with an MTP layer)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weight and activation dtype; auto = the checkpoint's torch_dtype, except that a bf16/fp16 "
                        "checkpoint computes in float32 on a CPU without native bf16 (AVX2 only), where that is "
                        "faster (default: auto)")
    g.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0 (default: cpu)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="max tokens per sequence, prompt + output (default: the model's max_position_embeddings)")
    g.add_argument("--max-num-seqs", type=int, default=64, help="max requests in one step (default: 64)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV cache (and, on hybrid models, linear-attention state checkpoints) of a "
                        "prompt prefix seen before instead of recomputing it (default: on)")
    g.add_argument("--batch-invariant", action="store_true",
                   help="a request's output and logits do not depend on the other requests in its batch: "
                        "fixed-size matmul calls, decode attention per request; slower; full-attention models "
                        "only (default: off)")
    g.add_argument("--speculative-config", type=_json_object, default=None, metavar="JSON",
                   help='speculative decoding, as vLLM: e.g. \'{"method": "ngram", "num_speculative_tokens": 3, '
                        '"prompt_lookup_max": 4}\'; methods ngram, draft_experts, mtp; "adaptive": false keeps k '
                        'fixed (default: off)')
    g.add_argument("--max-logprobs", type=int, default=20,
                   help="most logprobs a request may ask for per token (default: 20)")
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
    x.add_argument("--expert-policy", default="next_use", choices=list(POLICY_NAMES),
                   help="eviction policy of the expert slots; next_use = eviction by predicted next use (default: next_use)")
    x.add_argument("--expert-prefetch", default="auto", choices=["auto", "none", "gate", "history"],
                   help="prefetch predicted experts: gate = next layer's router on this layer's input, "
                        "history = co-activation statistics, auto = gate on CUDA and none on CPU (default: auto)")
    x.add_argument("--enable-elastic-memory", action="store_true",
                   help="share one pool of expert-budget + KV-cache bytes between expert slots and KV blocks: "
                        "expert slots become KV blocks when running requests need them, and come back when no "
                        "request waits (needs --expert-budget below 1)")
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
    h.add_argument("--state-checkpoint-interval", type=int, default=512, metavar="TOKENS",
                   help="prefix caching: tokens between linear-attention state checkpoints in a prompt, a multiple "
                        "of --block-size; a hit recomputes at most this many tokens (default: 512)")
    h.add_argument("--max-state-checkpoints", type=int, default=None,
                   help="prefix caching: state checkpoints kept on the device (default: 8, or max-resident-states if fewer)")
    h.add_argument("--state-checkpoint-host-bytes", type=int, default=1 << 30,
                   help="prefix caching: bytes of host memory for state checkpoints moved off the device "
                        "(default: 1073741824; 0 drops them instead)")
    m = p.add_argument_group("multimodal models (Qwen3.5-MoE with a vision tower)")
    m.add_argument("--limit-mm-per-prompt", type=_json_object, default=None, metavar="JSON",
                   help='most items per prompt by modality, e.g. \'{"image": 4, "video": 1}\' (default: 16 images, '
                        '1 video)')
    m.add_argument("--max-image-pixels", type=int, default=8192 * 8192, metavar="PIXELS",
                   help="larger input images or video frames (width x height) are refused (default: 67108864, "
                        "8192 x 8192)")
    d = p.add_argument_group("sampling defaults")
    d.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="where defaults for sampling fields a request leaves unset come from: auto = the model's "
                        "generation_config.json (repetition_penalty, temperature, top_k, top_p, min_p, "
                        "max_new_tokens), vllm = the built-in defaults only, or a directory holding a "
                        "generation_config.json (default: auto)")


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


def parse_threads(text: str) -> int | str:
    """`--threads`: a positive int, or 'auto'."""
    if text == "auto":
        return text
    from moestream.threads import MAX_THREADS, available_cores

    n = int(text) if text.lstrip("-").isdigit() else 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got '{text}'")
    if n > MAX_THREADS:
        raise argparse.ArgumentTypeError(f"{n} is more than {MAX_THREADS} threads; this process may run on "
                                         f"{available_cores()} core(s): give at most that, or 'auto'")
    return n


def resolve_threads(value: int | str, device: str, reserve: int = 0) -> int | None:
    """The torch intra-op thread count for a `--threads` value (`moestream.threads`): N as
    given; 'auto' is, on CPU, the cores this process may run on less `reserve` (serve: one
    for the HTTP event loop), at least 1, and None (torch's default) on an accelerator.

    Raises:
        ValueError: `device` is not a torch device.
    """
    from moestream.threads import resolve_threads as resolve

    return resolve(value, device, reserve)


def _json_object(text: str) -> dict:
    """argparse type: a JSON object."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"image\": 4}}' or "
                                         f"'{{\"method\": \"ngram\"}}', got {text!r}")
    return value


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
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
                expert_pin_profile=args.expert_pin_profile, enable_elastic_memory=args.enable_elastic_memory,
                record_routing=args.record_routing,
                max_resident_states=args.max_resident_states, mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
                generation_config=args.generation_config, max_logprobs=args.max_logprobs,
                enable_prefix_caching=args.enable_prefix_caching,
                state_checkpoint_interval=args.state_checkpoint_interval,
                max_state_checkpoints=args.max_state_checkpoints,
                state_checkpoint_host_bytes=args.state_checkpoint_host_bytes,
                speculative_config=args.speculative_config, limit_mm_per_prompt=args.limit_mm_per_prompt,
                max_image_pixels=args.max_image_pixels, batch_invariant=args.batch_invariant)


def build_parser() -> argparse.ArgumentParser:
    """The `moestream` argument parser with its generate, serve and trace-sim commands."""
    from moestream.server.cli_generate import add_generate_parser

    parser = argparse.ArgumentParser(prog="moestream", description="Serve Mixture-of-Experts language models.")
    parser.add_argument("--version", action="version", version=f"moestream {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    srv = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                         description="Serve a model over an OpenAI-compatible HTTP API: /v1/completions, "
                                     "/v1/chat/completions, /v1/models, /health, /version, /metrics. "
                                     "SIGINT or SIGTERM stops it gracefully: in-flight requests finish, then it exits 0 "
                                     "(with --ray: the application and the Ray cluster it started shut down, requests "
                                     "still in flight are cancelled).")
    srv.add_argument("model_dir", nargs="?", default=None, metavar="MODEL_DIR",
                     help="Hugging Face checkpoint directory or built-in model ('demo', 'demo-hybrid'); same as "
                          "--model (default: the built-in demo model)")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    srv.add_argument("--port", type=int, default=8000,
                     help="TCP port; checked before the model loads (default: 8000)")
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on /v1/* requests (default: no key)")
    srv.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                     help="model name(s) clients pass as 'model'; responses carry the first "
                          f"(default: MODEL_DIR as given, or '{DEMO_MODEL_NAME}' for the demo model)")
    srv.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                     help="Jinja chat template overriding the tokenizer's: a value containing '{{' or '{%%' is the "
                          "template itself, any other value is the path of a file holding it (as vLLM)")
    srv.add_argument("--max-waiting-requests", type=int, default=1024,
                     help="answer 503 when more engine requests than this (n choices count n) would be waiting "
                          "for their first token (default: 1024)")
    srv.add_argument("--max-request-body-bytes", type=int, default=10 << 20,
                     help="answer 413 to larger request bodies (default: 10485760)")
    srv.add_argument("--allowed-media-domains", nargs="+", default=(), metavar="HOST",
                     help="hosts whose http(s) image URLs the server may fetch (default: none; images come inline "
                          "as data: URLs)")
    srv.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                     help="directory whose files file:// image URLs may name (default: no local files)")
    srv.add_argument("--threads", type=parse_threads, default="auto", metavar="N|auto",
                     help="torch threads of the engine (intra-op); auto: on CPU the cores available less one for the "
                          "HTTP event loop, at least 1; torch's default on an accelerator (default: auto)")
    srv.add_argument("--enable-log-requests", action="store_true",
                     help="log one line per request: method, path, status, request id, prompt and output tokens, "
                          "latency (default: off)")
    srv.add_argument("--uvicorn-log-level", default="info",
                     choices=["critical", "error", "warning", "info", "debug", "trace"],
                     help="uvicorn's log level (default: info)")
    add_engine_args(srv)
    r = srv.add_argument_group("scale-out on Ray Serve (pip install -e \".[ray]\")")
    r.add_argument("--ray", action="store_true",
                   help="serve engine replicas on Ray Serve behind one OpenAI endpoint, routed by prefix-cache "
                        "affinity (default: one engine in this process)")
    r.add_argument("--num-replicas", type=int, default=1, help="engine replicas (default: 1)")
    r.add_argument("--ray-address", default=None, metavar="ADDRESS",
                   help="join this Ray cluster ('auto', or ray://HOST:10001); default: start a local one")
    r.add_argument("--min-replicas", type=int, default=None, help="autoscaling: fewest replicas (default: 1)")
    r.add_argument("--max-replicas", type=int, default=None,
                   help="autoscaling: most replicas; setting it turns Ray Serve's autoscaler on (default: off)")
    r.add_argument("--target-ongoing-requests", type=float, default=16.0,
                   help="autoscaling: requests in flight per replica to aim for (default: 16)")
    r.add_argument("--max-ongoing-requests", type=int, default=None,
                   help="requests one replica takes at once; more wait or go to another replica "
                        "(default: --max-num-seqs)")
    r.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs reserved per replica (default: 1)")
    sim = sub.add_parser("trace-sim", add_help=False,
                         help="replay a routing trace against each eviction policy and Belady's optimum "
                              "(see `moestream trace-sim --help`)")
    sim.add_argument("args", nargs=argparse.REMAINDER, help="trace-sim arguments")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line `argv` (default: sys.argv[1:]); returns the exit status:
    0 done, 2 a bad flag, model or input (an `error: ...` line on stderr)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["trace-sim"]:
        from moestream.experts.trace_sim import trace_sim_main

        return trace_sim_main(argv[1:])
    args = build_parser().parse_args(argv)
    verbose = getattr(args, "verbose", False) or args.command == "serve"
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.command == "generate":
        from moestream.server.cli_generate import run_generate

        try:
            return run_generate(args)
        except (ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if args.command == "serve":
        return _serve(args)
    return 2


def load_chat_template(value: str) -> str:
    """The chat template text of a `--chat-template` value, as vLLM reads it: a value
    containing '{{' or '{%' is the template itself; any other value is a file's path.

    Raises:
        ValueError: the file does not exist, or the text is not a valid Jinja template.
        OSError: the file cannot be read.
    """
    if "{{" in value or "{%" in value:
        text, where = value, "inline template"
    else:
        if not os.path.isfile(value):
            raise ValueError(f"--chat-template file '{value}' does not exist "
                             "(a value without '{{' or '{%' is the path of a template file)")
        with open(value, encoding="utf-8") as f:
            text = f.read()
        where = f"template file '{value}'"
    import jinja2

    try:
        _jinja_environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: the {where} is not a valid Jinja template: {e.message} "
                         f"(line {e.lineno})") from None
    return text


def _jinja_environment() -> Any:
    """A jinja2 Environment parsing what transformers' chat templates may use: loop
    controls ({% break %}) and {% generation %}...{% endgeneration %} blocks."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes

    class GenerationBlock(jinja2.ext.Extension):
        """Parses transformers' {% generation %} block (its body renders as is)."""

        tags = {"generation"}

        def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    return jinja2.Environment(extensions=[jinja2.ext.loopcontrols, GenerationBlock])


def _address(host: str, port: int) -> str:
    """host:port, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_port_free(host: str, port: int) -> None:
    """Bind (host, port) as uvicorn (asyncio) will, with SO_REUSEADDR, on every address the
    host resolves to, then let go: a port another process listens on fails here, before the
    model loads, rather than after.

    Raises:
        OSError: the address cannot be bound; the message names it and why.
    """
    where = _address(host, port)
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise OSError(f"cannot listen on {where}: {e.strerror}") from None
    for family, kind, proto, _, address in dict.fromkeys(infos):
        try:
            sock = socket.socket(family, kind, proto)
        except OSError:
            continue  # an address family this machine lacks: asyncio skips it too
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPV6_V6ONLY"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    reason = "address already in use (another process listens there; stop it or pick another --port)"
                else:
                    reason = e.strerror or str(e)
                raise OSError(f"cannot listen on {where}: {reason}") from None


def _log_once_bound(server: uvicorn.Server, model: str, names: tuple[str, ...], threads: int | None) -> None:
    """Log "serving MODEL as NAMES on URLS" once `server` has bound its sockets (so never
    when binding fails), with the port actually bound (--port 0 picks one)."""
    startup = server.startup

    async def startup_then_log(sockets: list[socket.socket] | None = None) -> None:
        await startup(sockets=sockets)
        bound = [sock.getsockname() for s in server.servers for sock in s.sockets]
        urls = ", ".join(f"http://{_address(a[0], a[1])}/v1" for a in bound)
        logger.info("serving %s as %s on %s (engine threads: %s)", model, ", ".join(names), urls,
                    threads or "torch default")

    server.startup = startup_then_log  # type: ignore[method-assign]


def _serve(args: argparse.Namespace) -> int:
    """Check the flags, the port and the chat template, load the engine, then serve until
    SIGINT/SIGTERM. Returns 0 after a graceful stop, 2 on a bad flag, port or model."""
    if args.model_dir is not None and args.model is not None and args.model_dir != args.model:
        print(f"error: MODEL_DIR '{args.model_dir}' and --model '{args.model}' differ; give one", file=sys.stderr)
        return 2
    if args.model_dir is not None:
        args.model = args.model_dir
    try:
        if not 0 <= args.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {args.port}")
        check_port_free(args.host, args.port)
        chat_template = None if args.chat_template is None else load_chat_template(args.chat_template)
        from moestream.config import EngineConfig
        from moestream.engine.llm_engine import LLMEngine
        from moestream.server.serving import ServerConfig

        names = tuple(args.served_model_name or [args.model if args.model is not None else DEMO_MODEL_NAME])
        threads = resolve_threads(args.threads, args.device, reserve=1)
        config = ServerConfig(served_model_names=names, api_key=args.api_key,
                              max_request_body_bytes=args.max_request_body_bytes,
                              max_waiting_requests=args.max_waiting_requests, chat_template=chat_template,
                              engine_threads=threads, enable_log_requests=args.enable_log_requests,
                              allowed_media_domains=tuple(args.allowed_media_domains),
                              allowed_local_media_path=args.allowed_local_media_path)
        if args.ray:
            return _serve_ray(args, config)
        engine = LLMEngine(EngineConfig(**engine_kwargs(args)))
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from moestream.server.api import build_app, make_server

    server = make_server(build_app(engine, config), args.host, args.port, args.uvicorn_log_level)
    _log_once_bound(server, str(engine.config.model), names, threads)
    server.run()
    engine.save_routing_trace()
    return 0


def _serve_ray(args: argparse.Namespace, server_config: ServerConfig) -> int:
    """`serve --ray`: the engine config checked here (and the model's config read), then the
    replicas deployed on Ray Serve; blocks until interrupted.

    Raises:
        ValueError: a bad flag or model directory, or Ray is not installed.
    """
    from moestream.config import EngineConfig, ModelConfig
    from moestream.server.ray_serve.deploy import RayConfig, serve_ray

    engine_config = EngineConfig(**engine_kwargs(args))
    max_model_len = engine_config.max_model_len or ModelConfig.from_hf(str(engine_config.model)).max_position_embeddings
    ray_config = RayConfig(num_replicas=args.num_replicas, min_replicas=args.min_replicas,
                           max_replicas=args.max_replicas, target_ongoing_requests=args.target_ongoing_requests,
                           max_ongoing_requests=args.max_ongoing_requests, num_cpus=args.replica_cpus,
                           address=args.ray_address)
    return serve_ray(engine_config, server_config, ray_config, max_model_len, args.host, args.port)


if __name__ == "__main__":
    sys.exit(main())
