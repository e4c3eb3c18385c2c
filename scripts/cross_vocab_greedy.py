"""Issue 49's greedy identity: the real pair's 1.5B (PyTorch or llama.cpp) drafted by the bundled
SmolLM2-135M through the token-level intersection or as string-level drafts (its GGUF through
llama.cpp, or its weights in PyTorch), against plain decoding, on HumanEval prompts; prints each prompt's identity,
acceptance and tokens per round, and the speed ratio.

    python scripts/cross_vocab_greedy.py --backend llamacpp --prompts 10 --tokens 64
    python scripts/cross_vocab_greedy.py --draft smollm2-135m-instruct   # the draft in PyTorch
    python scripts/cross_vocab_greedy.py --draft string:llamacpp:smollm2-135m-instruct   # string-level
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import exactspec as es
from exactspec.bench.humaneval import workload_prompts
from exactspec.models import encode_prompt, eos_token_ids, load_model
from exactspec.models.packaged import PAIR_TARGET


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["torch", "llamacpp"], default="llamacpp")
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--gamma", default="4")
    parser.add_argument("--draft", default="llamacpp:smollm2-135m-instruct")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    target = load_model(PAIR_TARGET, backend=args.backend)
    draft = es.drafters.make_drafter(args.draft, target=target)
    gamma = int(args.gamma) if args.gamma.isdigit() else args.gamma
    rows, same = [], 0
    for prompt in workload_prompts(f"humaneval:{args.prompts}"):
        ids = encode_prompt(target, prompt.text, chat=True)
        kwargs = dict(max_new_tokens=args.tokens, temperature=0.0, eos_token_id=eos_token_ids(target))
        started = time.perf_counter()
        plain = es.autoregressive_generate(target, ids, **kwargs)
        plain_s = time.perf_counter() - started
        started = time.perf_counter()
        spec = es.speculative_generate(target, draft, ids, gamma=gamma, **kwargs)
        spec_s = time.perf_counter() - started
        equal = spec.sequences.tolist() == plain.sequences.tolist()
        same += equal
        row = {"prompt": prompt.name, "identical": equal, "tokens": spec.stats.output_tokens,
               "acceptance": spec.stats.acceptance_rate, "tokens_per_round": spec.stats.tokens_per_round,
               "plain_s": round(plain_s, 2), "spec_s": round(spec_s, 2)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"{same}/{len(rows)} identical; speculative / plain time "
          f"{sum(r['spec_s'] for r in rows) / sum(r['plain_s'] for r in rows):.2f} (draft {draft.name}: "
          f"{getattr(draft, 'method', '')})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if same == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
