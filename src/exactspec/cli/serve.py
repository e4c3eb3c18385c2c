"""`exactspec serve`: an OpenAI-compatible server (FastAPI + uvicorn) with continuous batching;
`exactspec serve-bench`: that server under load with the `openai` client, drafting on and off.

serve-bench is its own command, not a `bench --serve` flag: it shares none of `exactspec bench`'s
options (γ sweeps, batch sizes, peers) and has its own (concurrency levels, requests per level)."""
from __future__ import annotations

import signal
import socket
import sys
import time

from exactspec.cli.common import (
    CliError, command, parse_float, parse_int, print_json, print_table, start_tp,
)
from exactspec.cli.generate import DEFAULT_DRAFT, DEFAULT_TARGET, _parse_gamma


def register(subparsers) -> None:
    serve = command(subparsers, "serve", "serve an OpenAI-compatible API with continuous batching",
                    "Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics; "
                    "concurrent requests share one batch (exact speculative decoding).", DEFAULT_TARGET)
    serve.add_argument("--draft", default=DEFAULT_DRAFT,
                       help="'auto' (prompt lookup when the text repeats, else the target's "
                            "bfloat16 copy when it pays, else plain steps), 'auto:SPEC', a draft "
                            f"model spec, 'ngram' or 'none' (default: {DEFAULT_DRAFT})")
    serve.add_argument("--gamma", default="auto",
                       help="draft tokens per round, or 'auto': chosen each round for the running "
                            "batch from measured costs and acceptance; a request's integer "
                            "'gamma' keeps its own fixed γ (default: auto)")
    serve.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1")
    serve.add_argument("--port", default="8000", help="0 picks a free port (default: 8000)")
    serve.add_argument("--max-batch", default="8", help="rows in the running batch (default: 8)")
    serve.add_argument("--max-queue", default="64", help="requests waiting; more get 429 (default: 64)")
    serve.add_argument("--model-name", default=None,
                       help="the model id clients use (default: the --target spec)")
    serve.add_argument("--replicas", default="1",
                       help="N copies of the server, each with its own models and batch, behind "
                            "one endpoint (Ray Serve, the 'ray' extra; default: 1, no Ray)")
    serve.add_argument("--tp", action="store_true",
                       help="split the target over the ranks of `torchrun --nproc-per-node N`: "
                            "rank 0 serves, the other ranks follow its batches")
    serve.add_argument("--prompt-cache", action="store_true",
                       help="a llama.cpp target keeps the KV cache a batch leaves, and a request "
                            "whose prompt begins with a row of it (a chat's next turn) feeds "
                            "only the rest (--target llamacpp:...)")
    serve.set_defaults(func=run_serve)
    _register_bench(subparsers)


def run_serve(args) -> int:
    try:
        import uvicorn

        from exactspec.serve.app import ServeConfig, create_app
    except ModuleNotFoundError as err:
        raise CliError(f"the server needs the 'serve' extra ({err.name} is missing): "
                       "pip install 'exactspec[serve]'") from None
    gamma = _parse_gamma(args.gamma)
    port = parse_int("--port", args.port, 0)
    replicas = parse_int("--replicas", args.replicas, 1)
    if replicas > 1 and args.tp:
        raise CliError(f"--replicas {replicas} and --tp cannot be combined: each replica would "
                       "need its own torchrun group")
    if args.prompt_cache and not args.target.strip().lower().startswith("llamacpp:"):
        raise CliError(f"--prompt-cache: only a llama.cpp target keeps one "
                       f"(--target llamacpp:NAME), got --target {args.target}")
    config = ServeConfig(target=args.target, draft=args.draft, gamma=gamma,
                         max_batch=parse_int("--max-batch", args.max_batch, 1),
                         max_queue=parse_int("--max-queue", args.max_queue, 0),
                         model_name=args.model_name, prompt_cache=args.prompt_cache)
    if replicas > 1:
        return _serve_replicas(config, replicas, args.host, port)
    if args.tp and _serve_tp(config):
        return 0  # a follower rank: rank 0 stopped serving
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, port))
        sock.listen(2048)  # connections wait in the backlog until uvicorn accepts, not refused
    except OSError as err:
        raise CliError(f"--host {args.host} --port {port}: cannot listen: {err.strerror}") from None
    host, port = sock.getsockname()[:2]
    print(f"exactspec serve: listening on http://{host}:{port} (models load in the background; "
          "GET /health answers 200 when ready)", flush=True)
    server = uvicorn.Server(uvicorn.Config(create_app(config), log_level="warning"))
    server.run(sockets=[sock])
    return 0


def _serve_tp(config) -> bool:
    """Join torchrun's ranks with the target split over them. Rank 0 returns False and serves;
    the other ranks follow its batches and return True when it stops. The draft is whole on
    every rank: "auto" drafts with the target's weights in bfloat16 loaded whole (a copy of the
    sharded target would be sharded too)."""
    from exactspec.distributed import is_leader
    from exactspec.serve.lockstep import serve_follower

    start_tp("--tp", config.target)
    config.tp = True
    if isinstance(config.draft, str) and config.draft.strip().lower() == "auto":
        from exactspec.models import parse_model_spec

        config.draft = f"auto:{parse_model_spec(config.target)[0]}@bfloat16"
    if is_leader():
        return False
    serve_follower(config)
    return True


def _serve_replicas(config, replicas: int, host: str, port: int) -> int:
    """Ray Serve: `replicas` servers behind host:port, until Ctrl-C or SIGTERM stops them all."""
    try:
        from exactspec.serve import replicas as ray_replicas

        ray_replicas.check_ray()
    except ModuleNotFoundError as err:
        raise CliError(str(err)) from None
    try:
        url = ray_replicas.start(config, replicas, host=host, port=port)
        # after ray.init, which installs a handler of its own that aborts the process
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stops Ray on the way out
        print(f"exactspec serve: {replicas} replicas listening on {url} (models loaded)", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        ray_replicas.stop()


def _register_bench(subparsers) -> None:
    bench = command(subparsers, "serve-bench",
                    "drive `exactspec serve` with the openai client, drafting on and off",
                    "Start two servers on 127.0.0.1 (the drafting settings given, and --draft none), "
                    "drive each with the openai client at each concurrency level (a bounded number "
                    "of streamed chat requests; the run stops by itself) and report total tokens/s, "
                    "per-request tokens/s and time to first token p50/p95.", DEFAULT_TARGET)
    bench.add_argument("--draft", default=DEFAULT_DRAFT,
                       help=f"the drafting server's --draft (default: {DEFAULT_DRAFT})")
    bench.add_argument("--gamma", default="auto", help="the drafting server's --gamma (default: auto)")
    bench.add_argument("--concurrency", default="1,4,8", help="levels (default: 1,4,8)")
    bench.add_argument("--requests-per-level", default="8",
                       help="requests per level = this × concurrency (default: 8)")
    bench.add_argument("--max-tokens", default="32", help="per request (default: 32)")
    bench.add_argument("--repeats", default="1",
                       help="runs of each level; total tokens/s is their median (default: 1)")
    bench.add_argument("--temperature", default="0", help="default: 0 (greedy)")
    bench.add_argument("--max-batch", default=None, help="default: the highest concurrency")
    bench.add_argument("--no-warmup", action="store_true", help="skip the unmeasured warm-up wave")
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.set_defaults(func=run_serve_bench)


BENCH_COLUMNS = [("concurrency", "concurrency", "{}"), ("server", "mode", "{}"),
                 ("requests", "requests", "{}"), ("tokens", "completion_tokens", "{}"),
                 ("total tok/s", "total_tokens_per_s", "{:.1f}"),
                 ("vs plain", "vs_plain", "{:.2f}x"),
                 ("per-request tok/s", "per_request_tokens_per_s", "{:.1f}"),
                 ("TTFT p50 s", "ttft_p50_s", "{:.3f}"), ("TTFT p95 s", "ttft_p95_s", "{:.3f}")]


def run_serve_bench(args) -> int:
    try:
        import openai  # noqa: F401

        from exactspec.serve.bench import run_serve_bench as bench
    except ModuleNotFoundError as err:
        raise CliError(f"serve-bench needs the 'serve' extra and the openai client ({err.name} is "
                       "missing): pip install 'exactspec[serve]' openai") from None
    options = dict(
        draft=args.draft.strip(), gamma=str(_parse_gamma(args.gamma)),
        concurrencies=sorted({parse_int("--concurrency", c, 1) for c in args.concurrency.split(",")}),
        per_level=parse_int("--requests-per-level", args.requests_per_level, 1),
        max_tokens=parse_int("--max-tokens", args.max_tokens, 1),
        repeats=parse_int("--repeats", args.repeats, 1),
        temperature=parse_float("--temperature", args.temperature, 0, 2),
        max_batch=None if args.max_batch is None else parse_int("--max-batch", args.max_batch, 1),
        warmup=not args.no_warmup, log=None if args.json else lambda line: print(line, flush=True))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stops the servers on the way out
    try:
        result = bench(args.target, **options)
    except RuntimeError as err:  # a server that could not start says why
        raise CliError(str(err)) from None
    if args.json:
        print_json(result)
    else:
        print_serve_bench(result)
    return 0


def print_serve_bench(result: dict) -> None:
    settings = result["settings"]
    print(f"\n{settings['target']}: drafting = --draft {settings['draft']} --gamma "
          f"{settings['gamma']}, plain = --draft none; {settings['max_tokens']} tokens per request, "
          f"temperature {settings['temperature']:g}, median of {settings['repeats']} run(s); "
          f"load average {settings['load_average_1min']['start']:.2f} at the start, "
          f"{settings['load_average_1min']['end']:.2f} at the end, {settings['cpus']} CPUs")
    print_table(result["levels"], BENCH_COLUMNS)
    agree = result["greedy_agree"]
    if agree is not None:
        print(f"greedy texts identical across both servers for {agree['identical']} of "
              f"{agree['prompts']} prompts")
