"""`exactspec generate` and `exactspec demo`: speculative decoding of real models from the shell."""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from exactspec.cli.common import (
    TARGET_HELP, CliError, print_json, print_table, read_prompts, start_tp, trace_writer)
from exactspec.cli.drafts import draft_name, load, log, make_draft
from exactspec.controller import MAX_GAMMA
from exactspec.logprobs import LOGPROBS_MODES
from exactspec.verify import VERIFY_RULES

DEFAULT_TARGET = "smollm2-135m-instruct"
DEFAULT_DRAFT = "auto"
DEMO_PROMPTS = (  # (kind, prompt): one that copies its prompt, one that does not
    ("grounded", "Rewrite this email so that the meeting is on Friday instead of Thursday. Keep "
                 "everything else word for word.\n\nHi Sam,\n\nThe project review meeting is on "
                 "Thursday at 10 am in room 204. Please bring the budget report and the updated "
                 "timeline. If you cannot attend, send your notes to Maria before the meeting."
                 "\n\nThanks,\nAlex"),
    ("open", "Explain in three sentences why the sky is blue."),
)


def register(subparsers) -> None:
    gen = subparsers.add_parser("generate", help="generate text with speculative decoding",
                                description="Generate text from a prompt with speculative "
                                            "decoding (exact: same distribution as the target).")
    gen.add_argument("prompt", nargs="*", help="the prompt text; several prompts decode as a batch")
    gen.add_argument("--prompts", metavar="FILE",
                     help='a JSONL file of {"prompt": ...} lines, decoded as a batch')
    _add_decoding_args(gen)
    gen.add_argument("--draft", default=DEFAULT_DRAFT,
                     help="'auto' (prompt lookup when the text repeats, else the target's bfloat16 "
                          "copy when it pays, else plain steps), 'auto:SPEC' (the same with model "
                          "SPEC), a draft model spec NAME[@DTYPE] (one of another vocabulary "
                          "proposes its text in the target's tokens, or with 'tli:SPEC' drafts "
                          "through the token-level intersection), 'ngram' "
                          f"(prompt lookup) or 'none' (plain decoding) (default: {DEFAULT_DRAFT})")
    gen.add_argument("--draft-dtype", choices=("float32", "bfloat16", "float16"),
                     help="load the draft in this dtype (overrides @DTYPE in --draft)")
    shape = gen.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE",
                       help="the output is JSON valid against the JSON Schema in FILE")
    shape.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    shape.add_argument("--regex", metavar="RE", help="the whole output matches the regular expression")
    shape.add_argument("--grammar", metavar="FILE", help="the output follows the Lark grammar in FILE")
    gen.add_argument("--stream", action="store_true", help="print text as rounds finish")
    gen.add_argument("--tp", action="store_true",
                     help="split the target over the ranks of `torchrun --nproc-per-node N` "
                          "(tensor parallelism; the draft is whole on every rank; rank 0 prints)")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.add_argument("--logprobs", type=int, metavar="N", default=None,
                     help="record each new token's log-probability and its N (0-20) most likely "
                          "alternatives, from the pass that verified it")
    gen.add_argument("--logprobs-mode", choices=LOGPROBS_MODES, default="raw",
                     help="'raw': the model's log-softmax (default); 'processed': log p, after "
                          "temperature, top-k/top-p and penalties")
    gen.add_argument("--trace", metavar="FILE",
                     help="write one JSON line per round to FILE: who drafted, the γ chosen and "
                          "why, drafts proposed and kept, the draft's and the pass's seconds")
    gen.set_defaults(func=run_generate)

    demo = subparsers.add_parser("demo", help="speculative vs plain decoding on the bundled model",
                                 description="On the bundled SmolLM2-135M-Instruct, answer a "
                                             "grounded prompt (an edit of a given text) and an "
                                             "open one, each with plain decoding and with "
                                             "--draft auto --gamma auto; compare.")
    demo.add_argument("--target", default=DEFAULT_TARGET,
                      help=f"the target: {DEFAULT_TARGET} (default) or llamacpp:{DEFAULT_TARGET} "
                           "(its GGUF run by llama.cpp), or any target spec")
    demo.add_argument("--gamma", default="auto", help="draft tokens per round, or 'auto' (default)")
    demo.add_argument("--max-new-tokens", type=int, default=96, help="default: 96")
    demo.add_argument("--temperature", type=float, default=0.0,
                      help="0 (default) is greedy: both texts must then be identical")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--json", action="store_true", help="print one JSON object")
    demo.set_defaults(func=run_demo)


def _add_decoding_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=DEFAULT_TARGET, help=TARGET_HELP)
    parser.add_argument("--gamma", default="auto",
                        help="draft tokens per round, or 'auto': chosen each round from the "
                             "measured costs and acceptance (default: auto)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="default: 128")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 is greedy (default: 0.8)")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None, help="a seed reproduces a run exactly")
    parser.add_argument("--verify", choices=VERIFY_RULES, default="block",
                        help="verification rule: joint block (default), token by token, or "
                             "coupled (the same text as plain decoding with the same --seed)")
    chat = parser.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help="apply the tokenizer's chat template (default when it has one)")
    chat.add_argument("--no-chat", dest="chat", action="store_false")


def encode_batch(loaded, prompts: list[str], chat: bool | None):
    """Left-padded input_ids[B, L] and attention_mask[B, L] of the encoded prompts."""
    from exactspec.engine import pad_prompts
    from exactspec.models import encode_prompt

    return pad_prompts([encode_prompt(loaded, prompt, chat)[0] for prompt in prompts])


class TextStream:
    """Prints the decoded text as token ids arrive (decoding the whole so far, printing the new
    part, so multi-token characters come out whole)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.printed = tokenizer, [], ""

    def __call__(self, row: int, new_ids: list[int], logprobs=None) -> None:
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.startswith(self.printed):
            sys.stdout.write(text[len(self.printed):])
            sys.stdout.flush()
            self.printed = text


def _constraint(args):
    """The Constraint of --json-schema / --json-object / --regex / --grammar, or None."""
    from exactspec.constraints import Constraint

    for option, kind in (("json_schema", "json_schema"), ("regex", "regex"), ("grammar", "lark")):
        value = getattr(args, option, None)
        if value is None:
            continue
        flag = "--" + option.replace("_", "-")
        try:
            text = value if option == "regex" else Path(value).read_text()
            return Constraint(kind, text)
        except (OSError, ValueError, ImportError) as err:
            raise CliError(f"{flag}: {err}") from None
    return Constraint.json_object() if getattr(args, "json_object", False) else None


def _generate(target, draft, input_ids, args, on_tokens=None, attention_mask=None):
    from exactspec.engine import autoregressive_generate, speculative_generate

    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                    top_k=getattr(args, "top_k", None), top_p=getattr(args, "top_p", None),
                    seed=args.seed, on_tokens=on_tokens, attention_mask=attention_mask,
                    constraint=getattr(args, "constraint", None),
                    on_round=getattr(args, "on_round", None),
                    logprobs=getattr(args, "logprobs", None),
                    logprobs_mode=getattr(args, "logprobs_mode", "raw"))
    if draft is None:
        return autoregressive_generate(target, input_ids, **sampling)
    return speculative_generate(target, draft, input_ids, gamma=args.gamma,
                                verify=getattr(args, "verify", "block"), **sampling)


def _logprobs_json(tokenizer, logprobs) -> list[dict]:
    """A row's `TokenLogprob`s with the field names of the object, each token's text beside its
    id; −inf (excluded by the settings, "processed" mode) as null."""
    def value(v):
        return None if v == -math.inf else v

    def text(token):
        return tokenizer.decode([token])
    return [{"token": t.token, "text": text(t.token), "logprob": value(t.logprob),
             "top": [{"token": i, "text": text(i), "logprob": value(v)} for i, v in t.top]}
            for t in logprobs]


def _stats_rows(named_stats: dict) -> list[dict]:
    return [{"run": name, **stats.to_dict()} for name, stats in named_stats.items()]


_FORMATS = {"acceptance_rate": "{:.3f}", "tokens_per_round": "{:.2f}", "wall_seconds": "{:.2f}",
            "tokens_per_s": "{:.1f}"}
STATS_COLUMNS = [(field, field, _FORMATS.get(field, "{}")) for field in (
    "run", "output_tokens", "accepted_drafts", "drafted_tokens", "corrections", "bonus_tokens",
    "rounds", "target_calls", "draft_calls", "acceptance_rate", "tokens_per_round", "wall_seconds",
    "tokens_per_s")]


def run_generate(args) -> int:
    _check_common(args)
    prompts = list(args.prompt) + [p["prompt"] for p in read_prompts(args.prompts)] if args.prompts else list(args.prompt)
    if not prompts:
        raise CliError("give a prompt (or several, or --prompts FILE)")
    if args.stream and len(prompts) > 1:
        raise CliError(f"--stream works with one prompt, got {len(prompts)}")
    args.constraint = _constraint(args)
    tp = start_tp("--tp", args.target) if args.tp else None  # the number of ranks
    target = load(args.target, tp=args.tp)
    draft = make_draft(args.draft, target, args.draft_dtype)
    input_ids, mask = encode_batch(target, prompts, args.chat)
    stream = TextStream(target.tokenizer) if args.stream and not args.json else None
    with trace_writer(args.trace) as args.on_round:
        out = _generate(target, draft, input_ids, args, on_tokens=stream, attention_mask=mask)
    prompt_lengths = mask.sum(dim=1).tolist()
    results = []
    for prompt, length, sequence, stats in zip(prompts, prompt_lengths, out.sequences,
                                               out.row_stats):
        new_ids = sequence[length:].tolist()
        results.append({"prompt": prompt, "token_ids": new_ids, "stats": stats.to_dict(),
                        "text": target.tokenizer.decode(new_ids, skip_special_tokens=True)})
        if out.logprobs is not None:
            results[-1]["logprobs"] = _logprobs_json(target.tokenizer, out.logprobs[len(results) - 1])
        if args.constraint is not None and len(new_ids) >= args.max_new_tokens:
            log(f"warning: a row stopped at --max-new-tokens {args.max_new_tokens} before its "
                 "constraint could end; raise --max-new-tokens for a complete output")
    if args.json:
        head = {"target": target.spec, "draft": draft_name(draft), "gamma": args.gamma,
                "verify": args.verify, **({"tp": tp} if tp else {}),
                **({"constraint": args.constraint.kind} if args.constraint else {})}
        if len(results) == 1:
            print_json({**head, **results[0]})
        else:
            print_json({**head, "results": results, "stats": out.stats.to_dict()})
        return 0
    for i, result in enumerate(results):
        if len(results) > 1:
            print(f"--- [{i}] {result['prompt']}")
        print(result["text"] if stream is None else "")
        for entry in result.get("logprobs", ()):
            print(f"  {entry['text']!r:>16} {entry['logprob']}")
        print()
    named = {f"[{i}]": s for i, s in enumerate(out.row_stats)} if len(results) > 1 else {}
    named[draft_name(draft) if len(results) == 1 else "batch"] = out.stats
    print_table(_stats_rows(named), STATS_COLUMNS)
    return 0


def _check_common(args) -> None:
    args.gamma = _parse_gamma(args.gamma)
    if args.max_new_tokens < 0:
        raise CliError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if not math.isfinite(args.temperature):
        raise CliError(f"--temperature must be a finite number, got {args.temperature}")
    if args.temperature < 0:
        raise CliError(f"--temperature must be >= 0, got {args.temperature}")
    if getattr(args, "top_k", None) is not None and args.top_k < 1:
        raise CliError(f"--top-k must be >= 1, got {args.top_k}")
    if getattr(args, "top_p", None) is not None and not 0 < args.top_p <= 1:
        raise CliError(f"--top-p must be in (0, 1], got {args.top_p}")


def _parse_gamma(text):
    """'auto', or an integer γ in [1, MAX_GAMMA]."""
    if str(text).strip().lower() == "auto":
        return "auto"
    try:
        gamma = int(str(text).strip())
    except ValueError:
        raise CliError(f"--gamma must be 'auto' or an integer in [1, {MAX_GAMMA}], got {text}") from None
    if not 1 <= gamma <= MAX_GAMMA:
        raise CliError(f"--gamma must be in [1, {MAX_GAMMA}], got {text}")
    return gamma


def run_demo(args) -> int:
    _check_common(args)
    target = load(args.target)
    draft = make_draft("auto", target)
    results = [_demo_prompt(target, draft, kind, prompt, args) for kind, prompt in DEMO_PROMPTS]
    if args.json:
        print_json({"target": target.spec, "draft": draft.spec, "gamma": args.gamma,
                    "temperature": args.temperature, "prompts": results})
        return 0
    for result in results:
        _print_demo(result, target.spec, draft.spec, args)
    return 0


def _demo_prompt(target, draft, kind: str, prompt: str, args) -> dict:
    """Plain decoding and speculative decoding of one prompt, after a warm-up of both; each
    timed twice, the faster run kept (the machine may be busy)."""
    input_ids = encode_batch(target, [prompt], None)[0]
    log(f"{kind} prompt: warming up both paths ...")
    warm = argparse.Namespace(**{**vars(args), "max_new_tokens": 8})
    runs = {}
    for name, drafter in (("autoregressive", None), ("speculative", draft)):
        _generate(target, drafter, input_ids, warm)
        log(f"{kind} prompt: {name} decoding ...")
        runs[name] = min((_generate(target, drafter, input_ids, args) for _ in range(2)),
                         key=lambda out: out.stats.wall_seconds)
    speedup = runs["speculative"].stats.tokens_per_s / runs["autoregressive"].stats.tokens_per_s
    return {"kind": kind, "prompt": prompt, "speedup": speedup,
            "identical": runs["speculative"].sequences.tolist() == runs["autoregressive"].sequences.tolist(),
            "texts": {name: target.tokenizer.decode(out.sequences[0, input_ids.size(1):],
                                                    skip_special_tokens=True) for name, out in runs.items()},
            "stats": {name: out.stats.to_dict() for name, out in runs.items()},
            "rounds_by_source": runs["speculative"].rounds_by_source,
            "why": _why(runs["speculative"], speedup)}


def _why(out, speedup: float) -> str:
    """One line on where the speculative run's rounds went, and so why it gained or not."""
    by_source = out.rounds_by_source
    rounds = ", ".join(f"{name} {n}" for name, n in sorted(by_source.items(), key=lambda kv: -kv[1]))
    stats = out.stats
    if speedup >= 1.03:
        kept = f", {stats.acceptance_rate:.0%} of drafts kept" if stats.acceptance_rate is not None else ""
        return (f"gained: {stats.tokens_per_round:.2f} tokens per target pass{kept} "
                f"(rounds: {rounds})")
    verdict = "no gain, no loss to speak of" if speedup >= 0.97 else f"lost {1 - speedup:.0%}"
    if 2 * by_source.get("plain", 0) >= sum(by_source.values()):
        cause = ("drafting did not pay on this text at these costs, so the controller took plain "
                 "steps and only probed drafting now and then")
    else:
        cause = (f"the drafting rounds made {stats.tokens_per_round:.2f} tokens per target pass but "
                 f"cost more than the plain steps they replaced")
    return f"{verdict}: {cause} (rounds: {rounds})"


def _print_demo(result: dict, target: str, draft: str, args) -> None:
    print(f"=== {result['kind']} prompt: {result['prompt']}\n")
    for name, text in result["texts"].items():
        via = f" drafted by {draft}, γ = {args.gamma}" if name == "speculative" else ""
        print(f"--- {name} ({target}{via})")
        print(text.strip() + "\n")
    print_table([{"run": name, **stats} for name, stats in result["stats"].items()], STATS_COLUMNS)
    print(f"\nspeedup (tokens/s, speculative / autoregressive): {result['speedup']:.2f}x")
    print(f"why: {result['why']}")
    if args.temperature == 0:
        print("greedy outputs identical: " + ("yes" if result["identical"] else "NO"))
    print()
