"""Prompt lookup (γ auto) against plain decoding on the task mix, interleaved per prompt
(docs/drafting.md, "Pass sizes").

For every prompt of the chosen categories (`exactspec bench --workload mix:N`'s, chat-2's first
turns answered by plain greedy decoding first), PASSES + 1 passes (the first warms up), each
running plain decoding and the lookup configurations in a rotating order; EOS honoured. Prints
each category's total seconds of plain decoding and every configuration's ratio over it; at
T = 0 also how many texts differ from plain's (a near-tie on llama.cpp's default
kernels, docs/llamacpp.md).

--llama-cpp adds llama.cpp's plain decoding (llama-cpp-python on the target's GGUF, the same
threads, greedy at T = 0, stopping at EOS as the others do), and every ratio over it as well,
in seconds and in tokens per second (flash attention on, as exactspec's contexts run it: the
greedy texts are exactspec plain's; with llama-cpp-python's default, off, they part at near-ties,
and their lengths with them).

--linear-pricing adds a configuration "linear": the γ controller as it was before 2026-12-07
(an unseen pass size priced on the line between the sizes seen; a round dearer than 1.5 times
its price re-times T(1) even when its size was a guess). Each lookup configuration has a target
memory of its own, so timings learnt by one do not price the other's rounds.

--llama-server TYPES (comma-separated: plain, ngram-mod, ngram-simple, ngram-cache) adds
llama-server rows, each request on a fresh server (started untimed, as the bench starts one for
an n-gram type that remembers requests), stopping at EOS; timed by the client, like the rest.

--prompt-cache (chat-2 only): a chat's second turn as a chat server runs it, after the first in
the same cache. Before each timed second turn the configuration's cache is filled, untimed, with
the conversation so far (the first turn and its reply, through the chat template: the prefix
chat-2's prompt begins with), by generating one token after it. The second turn then resumes
that KV cache (exactspec: `load_model(..., prompt_cache=True)`; llama.cpp: llama-cpp-python's own
prefix reuse; llama-server: `cache_prompt`) and feeds only the rest of its prompt. Every
configuration resumes the same prefix, whatever reply it would have given itself.

usage: python scripts/mix_interleaved.py [--per-category 4] [--categories code-edit,chat-2]
       [--tokens 128] [--passes 2] [--temperature 0] [--target SPEC] [--llama-cpp]
       [--linear-pricing] [--llama-server plain,ngram-mod] [--prompt-cache]
"""
import argparse
import collections
import dataclasses
import gc
import time

from exactspec import controller, pricing
from exactspec.bench import mix
from exactspec.engine import autoregressive_generate, speculative_generate
from exactspec.models import encode_prompt, load_model
from exactspec.models.loaded import Memory


def linear_between(seen, k):
    """pricing.between before 2026-12-07: the line between the nearest sizes seen."""
    below = max((s for s in seen if s < k), default=None)
    above = min((s for s in seen if s > k), default=None)
    if below is not None and above is not None:
        return seen[below] + (seen[above] - seen[below]) * (k - below) / (above - below)
    per_token = pricing.PRIOR_SLOPE * min(seen.values())
    if below is not None:
        return seen[below] + per_token * (k - below)
    return max(seen[above] - per_token * (above - k), per_token)


def linear_check_price(self, source, width, target_tokens, seconds):
    """GammaController._check_price before 2026-12-07: a guessed size's round re-timed T(1) too."""
    cost = self.draft_seconds(source)
    if target_tokens <= 0 or cost is None or not self.plain_timed():
        return
    if seconds > controller._RECHECK * (width * cost + self.target_seconds(target_tokens)):
        self.target.pop(1, None)


PRICING = {"lookup": (pricing.between, controller.GammaController._check_price),
           "linear": (linear_between, linear_check_price)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-category", type=int, default=4)
    parser.add_argument("--categories", default="code-edit,chat-2,summarization,qa")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--target", default="llamacpp:qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--llama-cpp", action="store_true")
    parser.add_argument("--linear-pricing", action="store_true")
    parser.add_argument("--llama-server", default="")
    parser.add_argument("--prompt-cache", action="store_true")
    args = parser.parse_args()
    categories = args.categories.split(",")
    unknown = sorted(set(categories) - set(mix.CATEGORIES))
    if unknown:
        parser.error(f"--categories: unknown {unknown}; known: {', '.join(mix.CATEGORIES)}")
    if args.prompt_cache and categories != ["chat-2"]:
        parser.error(f"--prompt-cache times second turns: --categories chat-2, got {args.categories}")

    target = load_model(args.target, prompt_cache=args.prompt_cache)
    kinds = ["plain", "lookup"] + (["linear"] if args.linear_pricing else [])
    memories = {kind: dataclasses.replace(target, memory=Memory()) for kind in kinds[1:]}
    llama = llama_cpp_plain(target, args.prompt_cache) if args.llama_cpp else None
    kinds += ["llama.cpp"] if llama else []
    servers = [f"server:{t}" for t in args.llama_server.split(",") if t]
    server = ServerPeer(target, args.prompt_cache) if servers else None
    kinds += servers
    prompts = [p for p in mix.workload_prompts(f"mix:{args.per_category}") if p.kind in categories]
    prompts = mix.answer_first_turns(prompts, mix.greedy_reply(target, args.tokens))
    eos = target.tokenizer.eos_token_id
    plain_fed, plain_total = [0, 0], [0, 0]  # prompt tokens fed, of all: the last plain run's, every one's

    def conversation(prompt, ids) -> int:
        """How many of chat-2's prompt ids hold its earlier turns (the template's rendering of
        them, as far as it agrees with the prompt)."""
        turns = [{"role": role, "content": content} for role, content in prompt.history]
        done = target.tokenizer.apply_chat_template(turns)
        done = done if isinstance(done, list) else done["input_ids"]
        return next((i for i, (a, b) in enumerate(zip(done, ids[0].tolist())) if a != b), len(done))

    def generate(kind, ids, seed, temperature, max_new_tokens=args.tokens):
        if kind == "llama.cpp":
            return llama(ids[0].tolist(), max_new_tokens, seed, eos, temperature)
        if kind.startswith("server:"):
            return server(ids[0].tolist(), max_new_tokens, seed, temperature)
        if kind == "plain":
            out = autoregressive_generate(target, ids, max_new_tokens=max_new_tokens, seed=seed,
                                          temperature=temperature, eos_token_id=eos)
            new = out.sequences.size(1) - ids.size(1)  # each fed once but the last
            plain_fed[:] = out.stats.target_tokens_fed - (new - 1), ids.size(1)
        else:
            controller.between, controller.GammaController._check_price = PRICING[kind]
            out = speculative_generate(memories[kind], "ngram", ids, gamma="auto", seed=seed,
                                       max_new_tokens=max_new_tokens, temperature=temperature,
                                       eos_token_id=eos)
        return out.sequences[0, ids.size(1):].tolist()

    def run(kind, prompt, ids, seed):
        if kind.startswith("server:"):
            server.start(kind.removeprefix("server:"), ids[0].tolist())
        if args.prompt_cache:  # the conversation so far into the cache, untimed
            generate(kind, ids[:, :conversation(prompt, ids)], seed, 0.0, max_new_tokens=1)
            gc.collect()  # its target's context goes back to the model, its rows kept
        started = time.perf_counter()
        tokens = generate(kind, ids, seed, args.temperature)
        spent = time.perf_counter() - started
        gc.collect()
        if kind.startswith("server:"):
            server.stop()
            server.fed = [a + b for a, b in zip(server.fed, server.evaluated)]
        if kind == "plain":
            plain_total[:] = [a + b for a, b in zip(plain_total, plain_fed)]
        return spent, [t for t in tokens if t != eos]  # llama-server leaves the EOS token out

    seconds, tokens, differ = (collections.defaultdict(float), collections.Counter(),
                               collections.Counter())
    for n in range(args.passes + 1):
        for i, prompt in enumerate(prompts):
            ids = encode_prompt(target, prompt.text, reply_start=prompt.reply_start,
                                history=prompt.history)
            texts = {}
            for kind in kinds[n % len(kinds):] + kinds[:n % len(kinds)]:
                spent, texts[kind] = run(kind, prompt, ids, i)
                seconds[prompt.kind, kind] += spent if n else 0.0
                tokens[prompt.kind, kind] += len(texts[kind]) if n else 0
            if n and args.temperature == 0:
                for kind in kinds[1:]:
                    differ[prompt.kind, kind] += texts[kind] != texts["plain"]
        print(f"pass {n}/{args.passes} done" + (" (warm-up)" if n == 0 else ""), flush=True)
    for category in categories:
        plain = seconds[category, "plain"]
        ratios = "  ".join(f"{kind} {plain / seconds[category, kind]:.3f}×" for kind in kinds[1:])
        differs = ", ".join(f"{kind} {differ[category, kind]}" for kind in kinds[1:]
                            if differ[category, kind])
        note = f"  (texts that differ from plain's: {differs})" if differs else ""
        print(f"{category:14s} plain {plain:6.1f} s  {ratios}{note}")
    print(f"exactspec plain fed {plain_total[0]} of its {plain_total[1]} prompt tokens (every pass)")
    if server:
        print(f"llama-server fed {server.fed[0]} of its {server.fed[1]} prompt tokens (every pass)")
    if llama:
        print("\nover llama.cpp plain, seconds (tokens per second):")
        for category in categories:
            base, made = seconds[category, "llama.cpp"], tokens[category, "llama.cpp"]
            print(f"{category:14s} " + "  ".join(
                f"{kind} {base / seconds[category, kind]:.3f}× "
                f"({tokens[category, kind] / seconds[category, kind] / (made / base):.3f}×)"
                for kind in kinds if kind != "llama.cpp"))


def llama_cpp_plain(target, prompt_cache: bool):
    """generate(prompt, max_new_tokens, seed, eos, temperature) → tokens: llama-cpp-python's plain
    decoding on the target's GGUF, as the bench's llama.cpp plain row runs it
    (`LlamaPeers.plain`), stopping after an EOS token; prompt_cache: resuming the previous
    generation's KV cache."""
    from exactspec.bench.llama_peers import LlamaPeers, sampling_fields
    from exactspec.bench.run import llama_cpp_threads
    from exactspec.drafters.llamacpp import gguf_file

    peers = LlamaPeers(gguf_file(target), {}, llama_cpp_threads(target), None, None, None)

    def generate(prompt, max_new_tokens, seed, eos, temperature):
        return peers.plain(prompt, max_new_tokens, seed, sampling_fields(temperature, None, None),
                           stop={eos}, prompt_cache=prompt_cache)[0]
    return generate


class ServerPeer:
    """llama-server on the target's GGUF: `start(draft, prompt)` a fresh server (draft "plain" or
    an n-gram type; warmed as the bench warms one), then generate(prompt, max_new_tokens, seed,
    temperature) → tokens, stopping at EOS; `stop`."""

    def __init__(self, target, prompt_cache: bool):
        from exactspec.bench.llama_peers import find_llama_server
        from exactspec.bench.run import llama_cpp_threads
        from exactspec.drafters.llamacpp import gguf_file

        self.binary, self.gguf = find_llama_server(), gguf_file(target)
        self.threads = llama_cpp_threads(target)  # the target's
        if self.binary is None:
            raise SystemExit("--llama-server: no llama-server (make peers)")
        self.prompt_cache, self.running = prompt_cache, None
        self.evaluated, self.fed = (0, 0), [0, 0]

    def start(self, draft: str, prompt: list[int]) -> None:
        from exactspec.bench.llama_peers import LlamaServer, server_arguments

        self.running = LlamaServer(self.binary, self.gguf, self.threads,
                                   server_arguments(None if draft == "plain" else draft, None, None))
        self.running.warm(prompt)

    def __call__(self, prompt: list[int], max_new_tokens: int, seed: int, temperature: float) -> list[int]:
        from exactspec.bench.llama_peers import sampling_fields

        tokens, _, _, timings = self.running.complete(prompt, max_new_tokens, seed,
                                                      sampling_fields(temperature, None, None),
                                                      eos=True, cache_prompt=self.prompt_cache)
        self.evaluated = (timings.get("prompt_n", 0), len(prompt))  # prompt tokens it fed, of all
        return tokens

    def stop(self) -> None:
        self.running.stop()


if __name__ == "__main__":
    main()
