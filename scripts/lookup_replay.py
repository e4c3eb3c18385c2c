"""How much prompt lookup could give on the task mix, replayed offline from plain greedy texts
(docs/drafting.md, "What lookup could give").

    python scripts/lookup_replay.py --collect TEXTS.json [--per-category 4] [--tokens 128]
    python scripts/lookup_replay.py TEXTS.json

--collect runs plain greedy decoding on `exactspec bench --workload mix:N`'s prompts (chat-2's
first turns answered first; the real pair's 1.5B through llama.cpp, EOS honoured) and times the
target's pass over 1..33 new tokens (`bench.timing.time_forward`, on the first prompt and its
text), then writes both to TEXTS.json. The replay reads it and prints, per category, decoding
time (prefill left out) of plain decoding over that of:

- lookup oracle: prompt lookup's proposal (`NGramDrafter`'s index and rule) cut to the tokens
  the text continues with, at the pass size that costs least per token (the bench's
  `lookup-oracle` row, here without the engine);
- 3 candidates: the same with the best of up to three earlier matches whose next tokens differ
  (what multi-candidate verification could find, its extra cost left out);
- + earlier outputs: the lookup also matching the texts of the prompts replayed before it
  (a cross-request cache, SuffixDecoding-style), the longer match winning;
- sources n = ...: a past-only policy, γ from α per lookup source (learnt per generation from
  every position's hit or miss, prior from earlier generations, as `GammaController` does) by
  the geometric model against the measured T(k); "now" is `NGramDrafter.source`'s two sources.

A hit is exact-text agreement with plain greedy decoding (T = 0).
"""
import argparse
import collections
import json
import sys

from exactspec.drafters.ngram import SuffixIndex

MAX_NGRAM = 16  # NGramDrafter's default


def collect(path: str, per_category: int, tokens: int) -> None:
    import torch

    from exactspec.bench import mix
    from exactspec.bench.timing import time_forward
    from exactspec.engine import autoregressive_generate
    from exactspec.models import encode_prompt, load_model

    target = load_model("llamacpp:qwen2.5-coder-1.5b-instruct")
    prompts = mix.answer_first_turns(mix.workload_prompts(f"mix:{per_category}"),
                                     mix.greedy_reply(target, tokens))
    rows = []
    for n, prompt in enumerate(prompts, start=1):
        ids = encode_prompt(target, prompt.text, reply_start=prompt.reply_start, history=prompt.history)
        out = autoregressive_generate(target, ids, max_new_tokens=tokens, temperature=0,
                                      eos_token_id=target.tokenizer.eos_token_id)
        rows.append({"kind": prompt.kind, "prompt": ids[0].tolist(),
                     "output": out.sequences[0, ids.size(1):].tolist()})
        print(f"{n}/{len(prompts)} {prompt.kind}: {ids.size(1)} + {len(rows[-1]['output'])} tokens",
              file=sys.stderr)
    context = torch.tensor([rows[0]["prompt"] + rows[0]["output"]])
    passes = time_forward(target, context[:, :-40], range(1, 34))
    with open(path, "w") as f:
        json.dump({"rows": rows, "pass_seconds": [passes[k] for k in sorted(passes)]}, f)


# --------------------------------------------------------------------------- the replay


def runs(index: SuffixIndex, out: list[int], i: int, limit: int, candidates: int = 1,
         history: SuffixIndex | None = None) -> tuple[int, int, int]:
    """(longest match n, the first candidate's length, the longest run that out[i:] continues
    among up to `candidates` proposals with distinct first tokens; `history` adds its own)."""
    last = len(index.keys) - 1
    found = []  # (n, index, end), longest match first, latest occurrence first
    for n in range(min(MAX_NGRAM, last), 0, -1):
        for end in reversed(index.ends.get(tuple(index.keys[last - n + 1:]), [])[:-1]):
            found.append((n, index, end))
    if history is not None and history.tokens:
        tail = index.keys[-MAX_NGRAM:]
        for n in range(min(MAX_NGRAM, len(tail)), 0, -1):
            ends = [e for e in history.ends.get(tuple(tail[-n:]), []) if e + 1 < len(history.tokens)]
            if ends:
                found.append((n, history, ends[-1]))
                break
        found.sort(key=lambda item: -item[0])
    proposals, firsts = [], set()
    for n, where, end in found:
        proposal = where.tokens[end + 1: end + limit]
        if proposal and proposal[0] not in firsts:
            firsts.add(proposal[0])
            proposals.append(proposal)
        if len(proposals) == candidates:
            break
    if not proposals:
        return 0, 0, 0
    best = 0
    for proposal in proposals:
        r = 0
        while r < len(proposal) and i + r < len(out) and proposal[r] == out[i + r]:
            r += 1
        best = max(best, r)
    return found[0][0], len(proposals[0]), best


def positions(row: dict, limit: int, **options) -> list[tuple[int, int, int]]:
    index, out, res = SuffixIndex(row["prompt"], MAX_NGRAM), row["output"], []
    for i, token in enumerate(out):
        res.append(runs(index, out, i, limit, **options))
        index.extend([token])
    return res


def oracle_seconds(res, T) -> float:
    """Each round drafts the run's prefix whose pass costs least per token (the last position
    drafts nothing: no token follows it to verify)."""
    i, seconds = 0, 0.0
    while i < len(res):
        r = min(res[i][2], len(T) - 1, len(res) - i - 1)
        g = min(range(r + 1), key=lambda g: T[g] / (g + 1))  # T[g]: a pass over g + 1 tokens
        seconds, i = seconds + T[g], i + g + 1
    return seconds


class Policy:
    """γ from α per source by the geometric model: E[N] / T(γ + 1), a plain step unless a γ
    promises MARGIN times its rate (the controller's _MARGIN)."""

    MARGIN = 1.1

    def __init__(self, T, source):
        self.T, self.source, self.past, self.cache = T, source, {}, {}

    def gamma(self, alpha: float) -> int:
        alpha = round(alpha, 3)
        if alpha not in self.cache:
            rate = [(1 - alpha ** (g + 1)) / (1 - alpha) / self.T[g] if alpha < 1 else (g + 1) / self.T[g]
                    for g in range(len(self.T))]
            g = max(range(1, len(self.T)), key=lambda g: rate[g])
            self.cache[alpha] = g if rate[g] > self.MARGIN * rate[0] else 0
        return self.cache[alpha]

    def seconds(self, res) -> float:
        counts = collections.defaultdict(lambda: [0, 0])

        def alpha(source):
            kept, missed = self.past.get(source, (0, 0))
            prior = (kept + 1) / (kept + missed + 2) if kept + missed else 0.5
            hits, total = counts[source]
            return (hits + 2 * prior) / (total + 2)

        i, seconds = 0, 0.0
        while i < len(res):
            n, length, r = res[i]
            g = min(self.gamma(alpha(self.source(n))), length) if length else 0
            step = min(r, g) + 1
            seconds += self.T[g]
            for n_j, length_j, r_j in res[i: i + step]:  # every committed position scores the lookup
                if length_j:
                    counts[self.source(n_j)][0] += r_j > 0
                    counts[self.source(n_j)][1] += 1
            i += step
        for source, (hits, total) in counts.items():
            kept, missed = self.past.get(source, (0, 0))
            kept, missed = kept + hits, missed + total - hits
            self.past[source] = (kept // 2, missed // 2) if kept + missed > 256 else (kept, missed)
        return seconds


SOURCES = {  # a lookup's source by its match length n
    "now (n = 1; 2+)": lambda n: min(n, 2),
    "n = 1; 2-3; 4+": lambda n: 1 if n == 1 else 2 if n < 4 else 4,
    "n = 1; 2-7; 8+": lambda n: 1 if n == 1 else 2 if n < 8 else 8,
    "n = 1; 2-3; 4-15; 16": lambda n: 1 if n == 1 else 2 if n < 4 else 4 if n < 16 else 16,
}


def replay(path: str) -> None:
    data = json.load(open(path))
    T, rows = data["pass_seconds"], data["rows"]
    kinds = list(dict.fromkeys(row["kind"] for row in rows))
    by_kind = {kind: [row for row in rows if row["kind"] == kind] for kind in kinds}
    interleaved = [row for group in zip(*by_kind.values()) for row in group]  # as the bench runs
    plain = {kind: sum(len(row["output"]) * T[0] for row in group) for kind, group in by_kind.items()}
    table = {}
    limit = len(T)
    single = {id(row): positions(row, limit) for row in rows}
    table["lookup oracle"] = {kind: sum(oracle_seconds(single[id(row)], T) for row in group)
                              for kind, group in by_kind.items()}
    table["3 candidates"] = {kind: sum(oracle_seconds(positions(row, limit, candidates=3), T)
                                       for row in group) for kind, group in by_kind.items()}
    history, seconds = SuffixIndex([], MAX_NGRAM), collections.Counter()
    for row in interleaved:
        seconds[row["kind"]] += oracle_seconds(positions(row, limit, history=history), T)
        history.extend(row["output"] + [-1])  # -1: no match runs across two outputs
    table["+ earlier outputs"] = seconds
    for name, source in SOURCES.items():
        policy, seconds = Policy(T, source), collections.Counter()
        for row in interleaved:
            seconds[row["kind"]] += policy.seconds(single[id(row)])
        table[f"sources {name}"] = seconds
    ceiling = max(k * T[0] / T[k - 1] for k in range(1, len(T) + 1))
    print(f"{len(rows)} texts; decoding time of plain decoding over each (T(1) {1e3 * T[0]:.1f} ms, "
          f"ceiling {ceiling:.2f}×)\n")
    print("| | " + " | ".join(kinds) + " |")
    print("| --- " * (len(kinds) + 1) + "|")
    for name, seconds in table.items():
        print(f"| {name} | " + " | ".join(f"{plain[k] / seconds[k]:.2f}×" for k in kinds) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("texts", help="the JSON that --collect writes")
    parser.add_argument("--collect", action="store_true", help="write TEXTS first (about 15 min)")
    parser.add_argument("--per-category", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    if args.collect:
        collect(args.texts, args.per_category, args.tokens)
    replay(args.texts)


if __name__ == "__main__":
    main()
