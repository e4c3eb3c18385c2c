"""Issue 46's check of the catch-up margin (`controller._CATCH_UP_MARGIN`): the demo's open prompt,
greedy, `--draft auto --gamma auto`, with the margin 1.5 against 2.0, interleaved, a fresh drafter
and one warm-up per run; plain decoding timed once a repeat.

    python scripts/catch_up_margin.py 6
"""
import statistics
import sys
import time

import exactspec as es
from exactspec import controller
from exactspec.drafters import make_drafter
from exactspec.models import encode_prompt, eos_token_ids, load_model

target = load_model("smollm2-135m-instruct")
ids = encode_prompt(target, "Explain in three sentences why the sky is blue.")
kw = dict(max_new_tokens=55, temperature=0.0, gamma="auto", eos_token_id=eos_token_ids(target))
times = {1.5: [], 2.0: []}
plain = []
es.autoregressive_generate(target, ids, max_new_tokens=8, temperature=0.0)
for rep in range(int(sys.argv[1])):
    t0 = time.perf_counter()
    es.autoregressive_generate(target, ids, max_new_tokens=55, temperature=0.0,
                               eos_token_id=eos_token_ids(target))
    plain.append(time.perf_counter() - t0)
    for margin in (1.5, 2.0) if rep % 2 == 0 else (2.0, 1.5):
        controller._CATCH_UP_MARGIN = margin
        drafter = make_drafter("auto", target=target)
        es.speculative_generate(target, drafter, ids, **{**kw, "max_new_tokens": 8})  # warm-up
        t0 = time.perf_counter()
        out = es.speculative_generate(target, drafter, ids, **kw)
        times[margin].append(time.perf_counter() - t0)
        print(rep, margin, round(times[margin][-1], 3), out.rounds_by_source, flush=True)
p = statistics.median(plain)
for m, t in times.items():
    print(f"margin {m}: median {statistics.median(t):.3f} s, {p / statistics.median(t):.2f}x plain "
          f"({p:.3f} s); all {[round(x, 2) for x in t]}")
