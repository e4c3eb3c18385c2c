"""llama.cpp draft cost per token after a target pass, as the engine runs it: median over 15
rounds of γ = 8 drafts, each round preceded by a target pass over 5 tokens (torch on 2 threads).
argv: n_threads (0: the drafter chooses), one_thread ("1": torch on one thread while drafting, as
the drafter does; "0": not). ORDER=torch imports torch before exactspec."""
import os, sys, time, statistics
order = os.environ.get("ORDER", "exactspec")
if order == "torch":
    import torch  # noqa: F401  (torch first: GOMP_SPINCOUNT not set by exactspec)
import exactspec  # noqa: F401  (sets GOMP_SPINCOUNT when torch is not loaded yet)
import torch
import exactspec.drafters.llamacpp as L
from exactspec.models import load_model, encode_prompt
from exactspec.drafters import make_drafter
from exactspec.sampling import SamplingConfig
n_threads, one = int(sys.argv[1]), sys.argv[2] == "1"
if not one:
    import contextlib
    L.torch_on_one_thread = contextlib.nullcontext
target = load_model("smollm2-135m-instruct")
ids = encode_prompt(target, "Write a short story about a lighthouse keeper.")
d = L.LlamaCppDrafter(L.gguf_file(target), n_threads or None)
V = d.bind(target, 4096); d.start(ids, torch.ones_like(ids, dtype=torch.bool), V)
cfg = SamplingConfig(0.8); g = torch.Generator().manual_seed(0)
x = ids[:, -5:]
per_token, target_ms = [], []
with torch.inference_mode():
    for r in range(18):
        t0 = time.perf_counter(); target.model(x); t1 = time.perf_counter()
        prop = d.propose(8, cfg, g); t2 = time.perf_counter()
        d.commit(torch.tensor([0]), prop.tokens[:, 0])
        if r >= 3:
            per_token.append((t2 - t1) / 8 * 1e3); target_ms.append((t1 - t0) * 1e3)
print(f"order={order} threads={n_threads or 'chosen'} one_thread={one}: draft "
      f"{statistics.median(per_token):.1f} ms/token, target pass {statistics.median(target_ms):.1f} ms")
