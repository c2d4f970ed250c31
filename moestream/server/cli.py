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
from moestream.engine.args import add_engine_args, engine_kwargs
from moestream.engine.args import engine_config as make_engine_config

if TYPE_CHECKING:
    import uvicorn

    from moestream.config import EngineConfig

    from moestream.server.serving import ServerConfig

DEMO_MODEL_NAME = "moestream-demo"

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    """The `moestream` argument parser with its generate, serve, eval-loss, calibrate, cartridge and trace-sim commands."""
    from moestream.server.cli_calibrate import add_calibrate_parser
    from moestream.server.cli_cartridge import add_cartridge_parser
    from moestream.server.cli_eval_loss import add_eval_loss_parser
    from moestream.server.cli_generate import add_generate_parser

    parser = argparse.ArgumentParser(prog="moestream", description="Serve Mixture-of-Experts language models.")
    parser.add_argument("--version", action="version", version=f"moestream {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = add_generate_parser(sub)
    gen.set_defaults(subparser=gen)
    parser.generate_parser = gen  # main parses generate's arguments intermixed
    srv = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                         description="Serve a model over an OpenAI-compatible HTTP API: /v1/completions, "
                                     "/v1/chat/completions, /v1/models, /health, /version, /metrics. "
                                     "SIGINT or SIGTERM stops it gracefully: in-flight requests finish, then it exits 0 "
                                     "(with --ray: the application and the Ray cluster it started shut down, requests "
                                     "still in flight are cancelled).")
    srv.add_argument("model_dir", nargs="?", default=None, metavar="MODEL_DIR",
                     help="Hugging Face checkpoint directory or built-in model ('demo', 'demo-hybrid', 'demo-looped'); same as "
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
    srv.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                     help="serve GET /tokenizer_info: tokenizer class, special tokens, chat template (default: off)")
    srv.add_argument("--tool-call-parser", default=None,
                     choices=["hermes", "deepseek_v3", "glm45", "kimi_k2", "openai"],
                     help="the model's tool-call format, read under tool_choice 'auto': hermes (Qwen2.5/Qwen3 and "
                          "their MoE models), deepseek_v3, glm45, kimi_k2, openai (gpt-oss) (default: none)")
    srv.add_argument("--enable-auto-tool-choice", action="store_true",
                     help="allow tool_choice 'auto' (the default when a request has tools); needs --tool-call-parser "
                          "(default: off; 'required' and named functions always work)")
    srv.add_argument("--enable-log-requests", action="store_true",
                     help="log one line per request: method, path, status, request id, prompt and output tokens, "
                          "latency (default: off)")
    srv.add_argument("--uvicorn-log-level", default="info",
                     choices=["critical", "error", "warning", "info", "debug", "trace"],
                     help="uvicorn's log level (default: info)")
    add_engine_args(srv)
    srv.set_defaults(subparser=srv)
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
    add_eval_loss_parser(sub)
    add_calibrate_parser(sub)
    add_cartridge_parser(sub)
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
    parser = build_parser()
    if argv[:1] == ["generate"]:  # prompts may come after flags: `generate DIR --max-tokens 8 "prompt"`
        args = parser.generate_parser.parse_intermixed_args(argv[1:])
        args.command = "generate"
    else:
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # the subcommand's usage, not the top-level one
            args.subparser.error(f"unrecognized arguments: {' '.join(unknown)}")
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
    if args.command in ("eval-loss", "calibrate", "cartridge"):
        from moestream.server.cli_calibrate import run_calibrate
        from moestream.server.cli_cartridge import run_cartridge
        from moestream.server.cli_eval_loss import run_eval_loss

        run = {"eval-loss": run_eval_loss, "calibrate": run_calibrate, "cartridge": run_cartridge}[args.command]
        try:
            return run(args)
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
        from moestream.engine.llm_engine import LLMEngine
        from moestream.server.serving import ServerConfig
        from moestream.threads import resolve_threads

        names = tuple(args.served_model_name or [args.model if args.model is not None else DEMO_MODEL_NAME])
        engine_config = make_engine_config(**engine_kwargs(args))
        threads = resolve_threads(engine_config.threads, engine_config.device, reserve=1)
        config = ServerConfig(served_model_names=names, api_key=args.api_key,
                              max_request_body_bytes=args.max_request_body_bytes,
                              max_waiting_requests=args.max_waiting_requests, chat_template=chat_template,
                              engine_threads=threads, enable_log_requests=args.enable_log_requests,
                              allowed_media_domains=tuple(args.allowed_media_domains),
                              allowed_local_media_path=args.allowed_local_media_path,
                              enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
                              tool_call_parser=args.tool_call_parser,
                              enable_auto_tool_choice=args.enable_auto_tool_choice)
        if args.ray:
            return _serve_ray(args, engine_config, config)
        engine = LLMEngine(engine_config)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from moestream.server.api import build_app, make_server

    server = make_server(build_app(engine, config), args.host, args.port, args.uvicorn_log_level)
    _log_once_bound(server, str(engine.config.model), names, threads)
    server.run()
    engine.save_routing_trace()
    return 0


def _serve_ray(args: argparse.Namespace, engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """`serve --ray`: the engine config checked here (and the model's config read), then the
    replicas deployed on Ray Serve; blocks until interrupted.

    Raises:
        ValueError: a bad flag or model directory, or Ray is not installed.
    """
    from moestream.models.hf_config import model_config_from_hf
    from moestream.server.ray_serve.deploy import RayConfig, serve_ray

    max_model_len = engine_config.max_model_len or model_config_from_hf(str(engine_config.model)).max_position_embeddings
    ray_config = RayConfig(num_replicas=args.num_replicas, min_replicas=args.min_replicas,
                           max_replicas=args.max_replicas, target_ongoing_requests=args.target_ongoing_requests,
                           max_ongoing_requests=args.max_ongoing_requests, num_cpus=args.replica_cpus,
                           address=args.ray_address)
    return serve_ray(engine_config, server_config, ray_config, max_model_len, args.host, args.port)


if __name__ == "__main__":
    sys.exit(main())
