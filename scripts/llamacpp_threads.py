"""T(k) of a llama.cpp target at 1 and 2 threads: llama-cpp-python alone, logits for every token,
a 164-token context, both thread counts (`n_threads` and `n_threads_batch`, the one llama.cpp
uses for passes of more than one token) set alike; sizes and counts interleaved, the median of
the repeats after the first.

    python scripts/llamacpp_threads.py [--target llamacpp:NAME] [--repeats 6]
"""
import argparse
import statistics
import time

import llama_cpp

from exactspec.drafters.llamacpp import gguf_file
from exactspec.models import load_model

SIZES = (1, 7, 8, 12, 15, 16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="llamacpp:qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    path = str(gguf_file(load_model(args.target)))
    models = {n: llama_cpp.Llama(path, n_ctx=1024, n_threads=n, n_threads_batch=n, verbose=False,
                                 logits_all=True) for n in (1, 2)}
    for model in models.values():
        model.eval(list(range(1000, 1164)))
    seconds = {(n, k): [] for n in models for k in SIZES}
    for _ in range(args.repeats):
        for k in SIZES:
            for n, model in models.items():
                model.n_tokens = 164  # the pass's tokens leave the cache again
                started = time.perf_counter()
                model.eval(list(range(2000, 2000 + k)))
                seconds[n, k].append(time.perf_counter() - started)
    for n in models:
        print(f"threads {n}: " + ", ".join(f"T({k}) {statistics.median(seconds[n, k][1:]) * 1e3:.0f} ms"
                                            for k in SIZES))


if __name__ == "__main__":
    main()
