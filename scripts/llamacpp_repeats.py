"""Reproducibility and first-seen cost of the llama.cpp target (issue 46, docs/llamacpp.md).

1. First-seen prompts: per HumanEval prompt, a speculative call (prompt lookup, γ auto,
   2 new tokens) the first time the process sees the prompt, the same call again, and plain
   decoding of 1 token (its prefill), each timed.
2. Repeats: every prompt decoded greedily REPEATS times, plain and with prompt lookup (γ auto
   and γ = 4), interleaved; for each, the repeats whose tokens differ from its first, and which
   methods' first text equals plain's (a near-tie between a one-token and a multi-token pass
   can move a speculative text: docs/llamacpp.md).

usage: python scripts/llamacpp_repeats.py [--prompts 5] [--repeats 10] [--tokens 128]
       [--busy N] [--target SPEC] [--json FILE]
--busy N runs N busy processes (Python loops) beside it for the whole run.
"""
import argparse
import json
import statistics
import subprocess
import sys
import time

import exactspec as es
from exactspec.bench.humaneval import workload_prompts
from exactspec.models import encode_prompt, load_model


def timed(call):
    started = time.perf_counter()
    out = call()
    return time.perf_counter() - started, out


def first_seen(target, prompts) -> list[dict]:
    rows = []
    for prompt in prompts:
        ids = encode_prompt(target, prompt.text)
        lookup = lambda: es.speculative_generate(target, "ngram", ids, gamma="auto", max_new_tokens=2,
                                                 temperature=0.0, eos_token_id=[])
        first, _ = timed(lookup)
        again, _ = timed(lookup)
        prefill, _ = timed(lambda: es.autoregressive_generate(target, ids, max_new_tokens=1,
                                                              temperature=0.0, eos_token_id=[]))
        rows.append({"prompt": prompt.name, "prompt_tokens": ids.size(1), "first_seen_s": first,
                     "repeated_s": again, "plain_prefill_s": prefill})
        print(f"{prompt.name:16} {ids.size(1):4} tokens  first seen {first:6.2f} s  repeated "
              f"{again:6.2f} s  plain prefill {prefill:6.2f} s", flush=True)
    return rows


METHODS = {"plain": None, "lookup γ=auto": "auto", "lookup γ=4": 4}


def repeats(target, prompts, n: int, tokens: int) -> dict:
    texts = {}
    for r in range(n):
        for prompt in prompts:
            ids = encode_prompt(target, prompt.text)
            settings = dict(max_new_tokens=tokens, temperature=0.0)
            for method, gamma in METHODS.items():
                out = (es.autoregressive_generate(target, ids, **settings) if gamma is None else
                       es.speculative_generate(target, "ngram", ids, gamma=gamma, **settings))
                texts.setdefault((prompt.name, method), []).append(out.sequences[0].tolist())
        print(f"repeat {r + 1}/{n} done", flush=True)
    summary = {}
    for (name, method), runs in texts.items():
        summary.setdefault(name, {})[method] = sum(run != runs[0] for run in runs[1:])
    for name, by_method in summary.items():
        by_method["first_equal_to_plain"] = [m for m in METHODS if texts[(name, m)][0] ==
                                             texts[(name, "plain")][0]]
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--busy", type=int, default=0)
    parser.add_argument("--target", default="llamacpp:qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--skip-repeats", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    target = load_model(args.target)
    prompts = workload_prompts(f"humaneval:{args.prompts}")
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        warm = encode_prompt(target, "Say hi.")  # the process's first pass, on no measured prompt
        es.autoregressive_generate(target, warm, max_new_tokens=2, temperature=0.0)
        seen = first_seen(target, prompts)
        ratio = statistics.median(r["first_seen_s"] / r["repeated_s"] for r in seen)
        print(f"median first-seen / repeated: {ratio:.2f}; median first-seen / plain prefill: "
              f"{statistics.median(r['first_seen_s'] / r['plain_prefill_s'] for r in seen):.2f}")
        result = {"target": args.target, "busy": args.busy, "first_seen": seen}
        if not args.skip_repeats:
            result["differing_repeats"] = repeats(target, prompts, args.repeats, args.tokens)
            print(json.dumps(result["differing_repeats"], indent=1))
    finally:
        for process in busy:
            process.kill()
    if args.json:
        with open(args.json, "w") as file:
            json.dump(result, file, indent=1)


if __name__ == "__main__":
    main()
