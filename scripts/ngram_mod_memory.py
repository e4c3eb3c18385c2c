"""llama-server's ngram-mod remembers earlier requests: HumanEval's first N problems (T = 0, EOS
off) sent to a plain server, then twice to one ngram-mod server. Prints llama-server's own decode
rate (`predicted_per_second`) and its drafts per configuration. Needs `make peers`.
argv: N problems (default 10), new tokens (default 128), threads (default 2)."""
import statistics
import sys

from exactspec.bench import humaneval
from exactspec.bench.llama_peers import LlamaServer, find_llama_server, sampling_fields, server_arguments
from exactspec.models import load_model, packaged
from exactspec.models.vocab import encode_prompt

given = [int(a) for a in sys.argv[1:]]
n, new_tokens, threads = given + [10, 128, 2][len(given):]
target = load_model(f"llamacpp:{packaged.PAIR_TARGET}")
prompts = [encode_prompt(target, p.text, reply_start=p.reply_start)[0].tolist()
           for p in humaneval.workload_prompts(f"humaneval:{n}")]
greedy = sampling_fields(0.0, None, None)


def send(server, prompt):
    timings = server.complete(prompt, new_tokens, 0, greedy)[3]
    return timings["predicted_per_second"], timings.get("draft_n", 0), timings.get("draft_n_accepted", 0)


def show(name, runs):
    print(f"{name:30s} {statistics.median(r[0] for r in runs):6.1f} tok/s (median), "
          f"{sum(r[1] for r in runs)} drafted, {sum(r[2] for r in runs)} kept", flush=True)


for name, passes in (("plain", 1), ("ngram-mod", 2)):
    server = LlamaServer(find_llama_server(), target.model.path, threads,
                         server_arguments(None if name == "plain" else name, None, None))
    server.warm(prompts[0])
    for k in range(passes):
        show(f"{name}, pass {k + 1}", [send(server, p) for p in prompts])
    server.stop()
