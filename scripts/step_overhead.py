"""Plain decoding's time per token outside llama.cpp's decode: exactspec against llama-cpp-python.

Both decode the same prompt (the task mix's first code-edit case) on the same GGUF and threads;
`llama_decode` is timed where both call it, so the rest (sampling, checks, copies, Python) is
what each adds to a decode step, and it is far less noisy than the whole step. The time inside
`llama_decode` (the prefill's share included) is printed too: the decodes themselves cost the
same. The race's own cost (`exactspec.noise`) at the bundled model's and Qwen's vocabularies
comes first.

    python scripts/step_overhead.py [--target llamacpp:NAME] [--tokens 128] [--passes 3]
"""
import argparse
import statistics
import time

import llama_cpp
import llama_cpp.llama_cpp as llama_low
import torch

from exactspec.noise import RowNoise, exponentials, race, race_uniforms, uniforms_at
from exactspec.sampling import probs_from_logits, sample

spent = [0.0]
_decode = llama_low.llama_decode


def timed_decode(context, batch):
    started = time.perf_counter()
    try:
        return _decode(context, batch)
    finally:
        spent[0] += time.perf_counter() - started


llama_low.llama_decode = llama_cpp.llama_decode = timed_decode


def median_ms(work, n=200) -> float:
    work()
    times = []
    for _ in range(n):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def race_costs() -> None:
    torch.set_num_threads(1)
    for vocab in (49_152, 151_936):
        p = probs_from_logits(torch.randn(vocab, generator=torch.Generator().manual_seed(0)), 0.8)
        u = uniforms_at(1, 2, vocab)
        full = median_ms(lambda: race(p, exponentials(1, 2, vocab)))
        made, raced = median_ms(lambda: uniforms_at(1, 2, vocab)), median_ms(lambda: race_uniforms(p, u))
        token = median_ms(lambda: RowNoise(1, 2).token(p, 0))
        inverse = median_ms(lambda: sample(p.unsqueeze(0)))
        print(f"V = {vocab:,}, one thread: E made in full + race {full:.2f} ms; uniforms {made:.2f} ms + "
              f"race_uniforms {raced:.2f} ms (RowNoise.token {token:.2f} ms); inverse-CDF {inverse:.2f} ms",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="llamacpp:qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--passes", type=int, default=3)
    args = parser.parse_args()
    race_costs()
    from exactspec.bench import mix
    from exactspec.bench.llama_peers import LlamaPeers, sampling_fields
    from exactspec.bench.run import llama_cpp_threads
    from exactspec.drafters.llamacpp import gguf_file
    from exactspec.engine import autoregressive_generate
    from exactspec.models import encode_prompt, load_model

    target = load_model(args.target)
    case = next(p for p in mix.workload_prompts("mix:1") if p.kind == "code-edit")
    ids = encode_prompt(target, case.text, reply_start=case.reply_start, history=case.history)
    # llama-cpp-python on the target's threads (race_costs left torch on one)
    peers = LlamaPeers(gguf_file(target), {}, llama_cpp_threads(target), None, None, None)
    def exactspec(temperature: float) -> int:
        out = autoregressive_generate(target, ids, max_new_tokens=args.tokens, seed=0,
                                      temperature=temperature, eos_token_id=[])
        return out.sequences.size(1) - ids.size(1)

    def llama_cpp_python(temperature: float) -> int:
        return len(peers.plain(ids[0].tolist(), args.tokens, 0, sampling_fields(temperature, None, None),
                               stop=set())[0])

    runs = {"exactspec": exactspec, "llama-cpp-python": llama_cpp_python}
    for temperature in (0.0, 0.8):
        outside, inside = {name: [] for name in runs}, {name: [] for name in runs}
        for repeat in range(args.passes + 1):  # the first pass warms up
            for name, run in runs.items():
                spent[0] = 0.0
                started = time.perf_counter()
                tokens = run(temperature)
                if repeat:
                    outside[name].append((time.perf_counter() - started - spent[0]) / tokens * 1e3)
                    inside[name].append(spent[0] / tokens * 1e3)
        print(f"T = {temperature}, {ids.size(1)}-token prompt, {args.tokens} tokens, ms per token outside "
              "llama_decode (median of passes): " + ", ".join(
                  f"{name} {statistics.median(values):.2f}" for name, values in outside.items())
              + "; inside it, prefill included: " + ", ".join(
                  f"{name} {statistics.median(values):.2f}" for name, values in inside.items()), flush=True)


if __name__ == "__main__":
    main()
