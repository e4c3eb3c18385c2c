"""Time `verify_block` for one row: `python -m exactspec.bench.sampler [--vocab 49152 --gamma 4]`.

Reports the median over many calls, after a warm-up, for both verification rules, with q given
and with a point-mass draft (q None); for scale, set it beside the target's forward pass
(docs/design.md, "Moved from comments").
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from exactspec.sampling import sample
from exactspec.verify import verify_block


def time_verify(vocab: int, gamma: int, verify: str, point_mass: bool, calls: int) -> float:
    """Median seconds of one verify_block call (B = 1, rule `verify`) on random distributions,
    after 10 untimed calls."""
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(1, gamma + 1, vocab, generator=gen), -1)  # [1, γ+1, V]
    q = torch.softmax(torch.randn(1, gamma, vocab, generator=gen), -1)  # [1, γ, V]
    drafts = sample(q, gen)  # [1, γ]
    q_arg = None if point_mass else q
    for _ in range(10):
        verify_block(drafts, q_arg, p, gen, verify=verify)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        verify_block(drafts, q_arg, p, gen, verify=verify)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args(argv)
    print(f"verify_block, B = 1, γ = {args.gamma}, V = {args.vocab}, torch threads = "
          f"{torch.get_num_threads()}")
    for verify in ("token", "block"):
        for point_mass in (False, True):
            seconds = time_verify(args.vocab, args.gamma, verify, point_mass, args.calls)
            draft = "point-mass" if point_mass else "q given"
            print(f"  {verify:5s}  {draft:10s}  median {seconds * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
