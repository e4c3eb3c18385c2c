"""`exactspec bench`: measured speed of speculative decoding beside plain decoding and
Transformers' own (assisted) generation, with the cost model made from measurements.

    exactspec bench [--target NAME] [--draft NAME|ngram|auto[:NAME] ...] [--gammas 4,auto]
                    [--prompts FILE] [--max-new-tokens 32] [--temperature 0 0.8] [--repeats 3]
                    [--warmup 1] [--seed 0] [--seeds 1] [--peers/--no-peers] [--verify block,token]
                    [--oracle/--no-oracle] [--json OUT] [--plot OUT.png]
    exactspec bench --batch-sizes 1,4,8 [same options]   batch throughput instead

Progress goes to stderr, the tables to stdout. Options are checked before any model loads, so
bad input is one line naming the option.
"""
from __future__ import annotations

import argparse
import sys

from exactspec.cli.bench_tables import BATCH_COLUMNS, print_result
from exactspec.cli.common import (CliError, command, output_path, parse_float, parse_int, print_table,
                                  read_prompts, trace_writer)


def register(subparsers) -> None:
    from exactspec.bench import config as bench

    p = command(subparsers, "bench", "benchmark speculative vs plain decoding and Transformers' generation",
                "End-to-end latency and tokens/s of exactspec's speculative and plain decoding and "
                "of Transformers' generate() and assisted generation (and llama.cpp's), on the same "
                "models, prompts, sampling settings and seeds; plus the cost model made from "
                "measured timings. Medians over --repeats passes after --warmup.", bench.DEFAULT_TARGET)
    _decoding_options(p)
    _timing_options(p)
    _output_options(p)
    _workload_options(p)
    p.add_argument("--plot-rows", metavar="OUT.png",
                   help="draw every row's tokens/s (and pass@1) as bars to OUT.png")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=run_bench)


def _decoding_options(p) -> None:
    """What is decoded: drafts, γ, prompts, budget, temperatures, top-k and top-p."""
    from exactspec.bench import config as bench, extraction

    p.add_argument("--draft", nargs="+", default=list(bench.default_drafts()), metavar="NAME",
                   help="draft model specs, 'llamacpp[:PATH]' (a GGUF through llama.cpp; plain "
                        "'llamacpp' is the target's own file), 'ngram' (prompt lookup) and/or "
                        "'auto' (prompt lookup when the context repeats, else the target's "
                        "default model draft; 'auto:NAME' names the model draft) (default: "
                        f"{' '.join(bench.default_drafts())})")
    p.add_argument("--gammas", default=",".join(map(str, bench.DEFAULT_GAMMAS)),
                   help="comma-separated γ values in 1..32 and/or 'auto' (chosen each round "
                        "from measured costs) (default: %(default)s)")
    p.add_argument("--prompts", metavar="FILE",
                   help='JSONL file of {"prompt": ..., "kind": ..., "name": ...} lines '
                        "(default: a built-in set of open and grounded prompts)")
    p.add_argument("--max-new-tokens", default=None,
                   help=f"tokens generated per prompt, EOS disabled (default: "
                        f"{bench.DEFAULT_MAX_NEW_TOKENS}; --workload json: at most "
                        f"{extraction.MAX_NEW_TOKENS}, each reply ending with its JSON)")
    p.add_argument("--temperature", nargs="+",
                   default=[f"{t:g}" for t in bench.DEFAULT_TEMPERATURES], metavar="T",
                   help="temperatures, 0 = greedy (default: "
                        f"{' '.join(f'{t:g}' for t in bench.DEFAULT_TEMPERATURES)})")
    p.add_argument("--top-k", default=None, help="top-k for every method (default: off)")
    p.add_argument("--top-p", default=None, help="top-p for every method (default: off)")


def _timing_options(p) -> None:
    """How each configuration is run and timed: passes, warm-up, peers, rules, seeds, the device."""
    from exactspec.bench import config as bench

    p.add_argument("--repeats", default=str(bench.DEFAULT_REPEATS),
                   help="timed passes; rows report medians (default: %(default)s)")
    p.add_argument("--warmup", default=str(bench.DEFAULT_WARMUP),
                   help="untimed warm-up passes (default: %(default)s)")
    p.add_argument("--peers", action=argparse.BooleanOptionalAction, default=True,
                   help="also run Transformers' generate() and assisted generation "
                        "(default: on)")
    p.add_argument("--verify", default=",".join(bench.DEFAULT_VERIFY),
                   help="verification rules for speculative rows, of "
                        f"{','.join(bench.VERIFY_ORDER)} (default: %(default)s)")
    p.add_argument("--seed", default=str(bench.DEFAULT_SEED),
                   help="prompt i uses seed + i in every run (default: %(default)s)")
    p.add_argument("--seeds", default="1", metavar="N",
                   help="run each prompt with N seeds per pass (seed + i, seed + i + P, ...; P "
                        "prompts): at T > 0 each seed samples another text (default: %(default)s)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="default: cuda when present")
    p.add_argument("--threads", default=None,
                   help="CPU threads: torch's, and a llama.cpp target's, draft's and peers' (default: "
                        "torch's own; a llama.cpp target: $EXACTSPEC_THREADS, else the usable cores)")
    p.add_argument("--background-load", default="0", metavar="N",
                   help="run N busy processes beside the whole run, stopped with it: every row "
                        "measured under the same competing load (default: %(default)s)")


def _output_options(p) -> None:
    """What is written (--json, --plot), and batch throughput instead (--batch-sizes)."""
    p.add_argument("--json", metavar="OUT", help="write the full result as JSON to OUT")
    p.add_argument("--trace", metavar="FILE",
                   help="write one JSON line per round of exactspec's rows to FILE (its "
                        "configuration, seed, source, γ and why, drafts kept, seconds)")
    p.add_argument("--plot", metavar="OUT.png", help="draw the measured cost model to OUT.png")
    p.add_argument("--batch-sizes", metavar="B,B,...",
                   help="measure batch throughput instead: total tokens/s of plain and "
                        "speculative decoding at these batch sizes, e.g. 1,4,8")


def _workload_options(p) -> None:
    """Prompts from a task, llama.cpp's peers, Transformers' γ, and the real pair."""
    from exactspec.bench import mix
    from exactspec.bench.humaneval import DEFAULT_PROBLEMS

    p.add_argument("--workload", metavar="humaneval[:N] | json[:N] | mix[:N]",
                   help="prompts from a task instead: the first N HumanEval problems "
                        f"(default N: {DEFAULT_PROBLEMS}) as chat prompts, each row with its "
                        "pass@1 from the problems' tests run in a sandboxed subprocess; or N of "
                        "the 10 JSON-extraction tasks (a passage and a schema), each reply "
                        "constrained to its schema, rows with the share valid, the share of "
                        "tokens the grammar forced and the constraint's ms per token "
                        "(exactspec's rows, and llama.cpp's under its own grammar from the same "
                        "schema); or mix: N prompts (default "
                        f"{mix.DEFAULT_PER_CATEGORY}) from each of {len(mix.CATEGORIES)} task "
                        f"categories ({', '.join(mix.CATEGORIES)}), rows per category "
                        f"(default --max-new-tokens {mix.MAX_NEW_TOKENS})")
    p.add_argument("--llama-peers", action=argparse.BooleanOptionalAction, default=False,
                   help="also llama.cpp on the target's GGUF: plain (llama-cpp-python) and its "
                        "own llama-server, plain and speculating (`make peers` builds it) "
                        "(default: off)")
    p.add_argument("--oracle", action=argparse.BooleanOptionalAction, default=True,
                   help="also the oracle row: exactspec drafting each prompt's own plain greedy "
                        "tokens at the ceiling's γ, the best speculation reaches here (its "
                        "references cost one untimed greedy generation per prompt) (default: on)")
    p.add_argument("--hf-gammas", metavar="G,G,...",
                   help="Transformers' fixed γ (assisted generation and lookup), when not the "
                        "integer γ of --gammas")
    p.add_argument("--pair-backend", choices=("torch", "llamacpp"), default="torch",
                   help="with --pair: run the 1.5B target in PyTorch (default) or through "
                        "llama.cpp (then exactspec's rows stand beside llama.cpp's own, and "
                        "Transformers' rows are left out)")
    p.add_argument("--pair", action="store_true",
                   help="the real pair on HumanEval with every peer: target "
                        "qwen2.5-coder-1.5b-instruct; drafts its 0.5B sibling through llama.cpp "
                        "and in PyTorch, prompt lookup and auto; γ = auto, block rule; "
                        "Transformers at γ = 4 and its default; llama.cpp plain and its server "
                        "(replaces --target, --draft, --gammas, --verify, --hf-gammas; "
                        "--workload defaults to humaneval:20)")


# --------------------------------------------------------------------------- option checks


def load_bench_prompts(path: str) -> list:
    """The BenchPrompts of a JSONL prompt file (`read_prompts`: a CliError naming the line)."""
    from exactspec.bench.config import BenchPrompt

    return [BenchPrompt(p["name"], p["kind"], p["prompt"]) for p in read_prompts(path, "--prompts")]


def _draft_name(text: str) -> str:
    """'NGRAM' → 'ngram', 'Auto' / 'auto:' → 'auto', 'AUTO:SPEC' → 'auto:SPEC'; others as given."""
    from exactspec.bench.config import AUTO, NGRAM

    head, colon, spec = text.partition(":")
    if text.lower() == NGRAM:
        return NGRAM
    if head.lower() == AUTO:
        return f"{AUTO}:{spec.strip()}" if colon and spec.strip() else AUTO
    return text


def _workload(text: str) -> tuple[list, str]:
    """The prompts of --workload humaneval[:N], json[:N] or mix[:N], and its name."""
    from exactspec.bench import extraction, mix
    from exactspec.bench.humaneval import parse_workload, workload_prompts

    kind = text.strip().lower().partition(":")[0]
    if kind == extraction.WORKLOAD:
        n = extraction.parse_count(text)
        return extraction.workload_prompts(f"json:{n}"), f"json:{n}"
    if kind == mix.WORKLOAD:
        n = mix.parse_count(text)
        return mix.workload_prompts(f"mix:{n}"), f"mix:{n}"
    if kind != "humaneval":
        raise ValueError(f"--workload must be humaneval[:N], json[:N] or mix[:N], got {text!r}")
    kind, n = parse_workload(text)
    return workload_prompts(f"{kind}:{n}"), f"{kind}:{n}"


def _budget(given: str | None, workload: str | None) -> str:
    """--max-new-tokens as given, else the default: for the json workload its own
    (`extraction.MAX_NEW_TOKENS`: a reply ends at its JSON's end, and one cut off is not JSON),
    for the mix `mix.MAX_NEW_TOKENS`."""
    from exactspec.bench import config as bench, extraction, mix

    if given is not None:
        return given
    own = {extraction.WORKLOAD: extraction.MAX_NEW_TOKENS, mix.WORKLOAD: mix.MAX_NEW_TOKENS}
    return str(own.get((workload or "").strip().lower().partition(":")[0],
                       bench.DEFAULT_MAX_NEW_TOKENS))


def config_from_args(args):
    from exactspec.bench import config as bench

    try:
        gammas = bench.parse_gammas(args.gammas, "--gammas")
        verify = bench.parse_verify(args.verify, "--verify")
    except ValueError as err:
        raise CliError(str(err)) from None
    workload = args.workload if args.workload is not None or not args.pair else "humaneval"
    if workload is not None and args.prompts is not None:
        raise CliError(f"--prompts and --workload both name the prompts; give one, got "
                       f"--prompts {args.prompts} --workload {workload}")
    constrained = workload is not None and workload.strip().lower().partition(":")[0] == "json"
    if workload is not None:
        try:
            prompts, source = _workload(workload)
        except (ValueError, ImportError) as err:
            raise CliError(str(err)) from None
    elif args.prompts is not None:
        prompts, source = load_bench_prompts(args.prompts), args.prompts
    else:
        prompts, source = list(bench.BUILTIN_PROMPTS), "built-in"
    drafts = list(dict.fromkeys(_draft_name(d.strip()) for d in args.draft))
    if not all(drafts):
        raise CliError("--draft: empty draft name")
    try:
        hf_gammas = None if args.hf_gammas is None else bench.parse_gammas(args.hf_gammas, "--hf-gammas")
    except ValueError as err:
        raise CliError(str(err)) from None
    if hf_gammas is not None and bench.AUTO in hf_gammas:
        raise CliError(f"--hf-gammas: Transformers' γ are integers, got {args.hf_gammas!r}")
    chosen = dict(target=args.target, drafts=drafts, gammas=gammas, verify=verify,
                  hf_gammas=hf_gammas, llama_peers=args.llama_peers)
    if args.pair:
        chosen.update(bench.pair_settings(args.pair_backend))
    peers = chosen.pop("peers", args.peers) and not constrained
    if peers and chosen["target"].strip().lower().startswith("llamacpp:"):
        print("bench: Transformers' rows cannot run a llama.cpp target; they are left out",
              file=sys.stderr)
        peers = False
    temperatures = list(dict.fromkeys(parse_float("--temperature", t, 0.0) for t in args.temperature))
    config = bench.BenchConfig(
        **chosen, temperatures=temperatures, prompts=prompts, prompts_source=source,
        workload=source if workload is not None else None,
        max_new_tokens=parse_int("--max-new-tokens", _budget(args.max_new_tokens, workload), 1),
        repeats=parse_int("--repeats", args.repeats, 1), warmup=parse_int("--warmup", args.warmup, 0),
        peers=peers, seed=parse_int("--seed", args.seed, 0),
        seeds=parse_int("--seeds", args.seeds, 1),
        top_k=None if args.top_k is None else parse_int("--top-k", args.top_k, 1),
        top_p=None if args.top_p is None else parse_float("--top-p", args.top_p, 0.0, 1.0, low_open=True),
        device=args.device,
        threads=None if args.threads is None else parse_int("--threads", args.threads, 1),
        background_load=parse_int("--background-load", args.background_load, 0), oracle=args.oracle)
    return config.check()


# --------------------------------------------------------------------------- running


def parse_batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise CliError(f"--batch-sizes must be comma-separated integers >= 1, got {text!r}")
    return list(dict.fromkeys(sizes))


def run_batch_bench(args, config) -> int:
    from exactspec.bench.batch import run_batch_benchmark
    from exactspec.bench.report import write_json
    from exactspec.bench.run import log_to_stderr

    sizes = parse_batch_sizes(args.batch_sizes)
    if config.seeds != 1:
        raise CliError(f"--seeds is for the per-prompt benchmark; --batch-sizes runs each batch "
                       f"with one seed, got --seeds {config.seeds}")
    json_path = output_path("--json", args.json)
    result = run_batch_benchmark(config, sizes, log=(lambda _m: None) if args.quiet
                                 else log_to_stderr)
    if json_path:
        write_json(result, json_path)
    print(f"exactspec bench --batch-sizes: target {config.target}, {config.max_new_tokens} new "
          f"tokens per row (EOS off), median of {config.repeats} runs after {config.warmup}")
    print_table(result["batch"], BATCH_COLUMNS)
    if json_path:
        print(f"\nwrote {json_path}")
    return 0


def has_curves(config) -> bool:
    """Whether the benchmark will have cost-model curves (a fixed γ with a non-auto draft)."""
    from exactspec.bench.config import fixed_gammas, is_auto_draft

    return bool(fixed_gammas(config.gammas)) and not all(map(is_auto_draft, config.drafts))


def run_bench(args) -> int:
    from exactspec.bench.plot import plot_costmodel, plot_rows
    from exactspec.bench.report import write_json
    from exactspec.bench.run import log_to_stderr, run_benchmark

    config = config_from_args(args)
    if args.batch_sizes is not None:
        return run_batch_bench(args, config)
    json_path = output_path("--json", args.json)
    plot_path = output_path("--plot", args.plot)
    rows_path = output_path("--plot-rows", args.plot_rows)
    if plot_path and not has_curves(config):
        raise CliError("--plot needs an integer γ in --gammas and a draft other than auto: "
                       "each cost-model curve has one draft cost and is drawn against γ")
    with trace_writer(args.trace) as trace:
        result = run_benchmark(config, log=None if args.quiet else log_to_stderr, trace=trace)
    if json_path:
        write_json(result, json_path)
    if plot_path:
        plot_costmodel(result, plot_path)
    if rows_path:
        plot_rows(result, rows_path)
    print_result(result)
    if json_path or plot_path or rows_path:
        written = " and ".join(p for p in (json_path, plot_path, rows_path) if p)
        print(f"\nwrote {written}")
    return 0
