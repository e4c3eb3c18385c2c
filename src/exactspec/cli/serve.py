"""`exactspec serve`: an OpenAI-compatible server (FastAPI + uvicorn) with continuous batching."""
from __future__ import annotations

import socket
import sys

from exactspec.cli.common import CliError, parse_int
from exactspec.cli.generate import DEFAULT_DRAFT, DEFAULT_TARGET


def register(subparsers) -> None:
    serve = subparsers.add_parser(
        "serve", help="serve an OpenAI-compatible API with continuous batching",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and "
                    "/metrics; concurrent requests share one batch (exact speculative decoding).")
    serve.add_argument("--target", default=DEFAULT_TARGET,
                       help=f"target model spec NAME_OR_PATH[@DTYPE] (default: {DEFAULT_TARGET})")
    serve.add_argument("--draft", default=DEFAULT_DRAFT,
                       help=f"draft model spec, 'ngram' or 'none' (default: {DEFAULT_DRAFT})")
    serve.add_argument("--gamma", default="4", help="draft tokens per round; a request's 'gamma' "
                                                    "overrides it (default: 4)")
    serve.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1")
    serve.add_argument("--port", default="8000", help="0 picks a free port (default: 8000)")
    serve.add_argument("--max-batch", default="8", help="rows in the running batch (default: 8)")
    serve.add_argument("--max-queue", default="64", help="requests waiting; more get 429 (default: 64)")
    serve.add_argument("--model-name", default=None,
                       help="the model id clients use (default: the --target spec)")
    serve.set_defaults(func=run_serve)


def run_serve(args) -> int:
    try:
        import uvicorn

        from exactspec.serve.app import ServeConfig, create_app
    except ModuleNotFoundError as err:
        raise CliError(f"the server needs the 'serve' extra ({err.name} is missing): "
                       "pip install 'exactspec[serve]'") from None
    if str(args.gamma).strip() == "auto":
        raise CliError("--gamma auto is not supported by the server yet: give an integer in [1, 32]")
    gamma = parse_int("--gamma", args.gamma, 1)
    if gamma > 32:
        raise CliError(f"--gamma must be in [1, 32], got {args.gamma}")
    port = parse_int("--port", args.port, 0)
    config = ServeConfig(target=args.target, draft=args.draft, gamma=gamma,
                         max_batch=parse_int("--max-batch", args.max_batch, 1),
                         max_queue=parse_int("--max-queue", args.max_queue, 0),
                         model_name=args.model_name)
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, port))
    except OSError as err:
        raise CliError(f"--host {args.host} --port {port}: cannot listen: {err.strerror}") from None
    host, port = sock.getsockname()[:2]
    print(f"exactspec serve: listening on http://{host}:{port} (models load in the background; "
          "GET /health answers 200 when ready)", flush=True)
    server = uvicorn.Server(uvicorn.Config(create_app(config), log_level="warning"))
    server.run(sockets=[sock])
    return 0
