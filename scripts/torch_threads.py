"""Plain decoding of the bundled float32 model (48 tokens, greedy) with torch's thread choice and
with torch's configured threads fixed, alternating, 4 runs each after a warm-up, medians.
argv: N busy processes (Python loops) beside it for the run, default 0."""
import statistics, subprocess, sys, time

import torch

import exactspec as es
import exactspec.cache as cache
from exactspec.models import encode_prompt, load_model

target = load_model("smollm2-135m-instruct", dtype="float32", device="cpu")
ids = encode_prompt(target, "Write a short story about a lighthouse keeper.")
choose = cache.torch_choice


def tokens_per_second() -> float:
    started = time.perf_counter()
    es.autoregressive_generate(target, ids, max_new_tokens=48, temperature=0.0, eos_token_id=[])
    return 48 / (time.perf_counter() - started)


load = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 0)]
try:
    tokens_per_second()
    runs = {"chosen": [], "fixed": []}
    for _ in range(4):
        for mode, speeds in runs.items():
            cache.torch_choice = choose if mode == "chosen" else (lambda model, configured: None)
            speeds.append(tokens_per_second())
    for mode, speeds in runs.items():
        print(f"{mode}: {statistics.median(speeds):.1f} tok/s", [round(s, 1) for s in speeds])
    timings = choose(target.model, torch.get_num_threads()).samples
    print("ms per token slot by (threads, size class):",
          {key: [round(s * 1000, 1) for s in recent] for key, recent in sorted(timings.items())})
finally:
    for process in load:
        process.kill()
