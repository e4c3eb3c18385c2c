"""How a llama.cpp target's logits and pass times depend on the decode's size, with and without
`@invariant` (docs/llamacpp.md, "Numerics that do not depend on a decode's size").

For each spec: a random prompt of CONTEXT tokens is prefilled, then K = 1..9 more tokens are
scored in one pass (`LlamaCppTarget.feed`) and against one-token passes: the largest logit
difference per K; then each K-token pass timed (median of --repeats) and the ceiling
max_k k·T(1)/T(k).

usage: python scripts/llamacpp_invariance.py [--target NAME] [--context 600] [--repeats 5]
"""
import argparse
import statistics
import time

import torch

from exactspec.models import load_model
from exactspec.targets import LlamaCppTarget

MAX_K = 9


def measure(spec: str, context: int, repeats: int) -> dict:
    model = load_model(spec)
    tokens = torch.randint(100, 20000, (1, context + MAX_K), generator=torch.Generator().manual_seed(0))
    target = LlamaCppTarget(model.model, model.name, model.vocab_size)
    started = time.perf_counter()
    target.prefill(tokens[:, :context], torch.ones(1, context, dtype=torch.bool))
    prefill = time.perf_counter() - started
    extra = tokens[:, context:]
    one = torch.cat([target.feed(extra[:, i: i + 1]) for i in range(MAX_K)], dim=1)[0]  # [K, V]
    target.discard_last(torch.tensor([MAX_K]))
    differences, times = [], []
    for k in range(1, MAX_K + 1):
        differences.append((target.feed(extra[:, :k])[0] - one[:k]).abs().max().item())
        target.discard_last(torch.tensor([k]))
        seconds = []
        for _ in range(repeats):
            started = time.perf_counter()
            target.feed(extra[:, :k])
            seconds.append(time.perf_counter() - started)
            target.discard_last(torch.tensor([k]))
        times.append(statistics.median(seconds))
    ceiling = max(k * times[0] / times[k - 1] for k in range(1, MAX_K + 1))
    return dict(spec=spec, prefill=prefill, differences=differences, times=times, ceiling=ceiling)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--context", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for spec in (f"llamacpp:{args.target}", f"llamacpp:{args.target}@invariant"):
        r = measure(spec, args.context, args.repeats)
        print(f"{r['spec']}: prefill of {args.context} tokens {r['prefill']:.2f} s; ceiling {r['ceiling']:.2f}x")
        print("  max |logit(k-token pass) - logit(one-token passes)|, k = 1..9:",
              " ".join(f"{d:.2g}" for d in r["differences"]))
        print("  T(k) ms, k = 1..9:", " ".join(f"{t * 1000:.0f}" for t in r["times"]))


if __name__ == "__main__":
    main()
