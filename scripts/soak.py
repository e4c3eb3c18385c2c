"""Soak run: many short generations on the bundled model, every greedy output checked against
plain decoding, and the process's memory watched after warm-up.

    python scripts/soak.py [--n 1000] [--warmup 36] [--max-growth-mib 64] [--threads 1]   (make soak)

Generation i cycles the batch size (1, 2, 4), the budget (8, 12, 16 new tokens) and the draft
(the bundled model in bfloat16, or "ngram") in a mixed radix, so the first 18 generations cover
every combination, and on their own cycles the temperature (0, 0.7, 0, 1: half the runs are
greedy), the verification rule, γ (2, 4, 6) and the prompts. Rules checked:

- greedy (T = 0): each row's tokens equal the target's plain greedy decoding of that prompt alone
  (`autoregressive_generate`, computed once per prompt); a mismatch is reported with the target's
  top-2 logit gap at the first differing position (a near-tie is worth knowing about);
- every run: output tokens = accepted drafts + corrections + bonus tokens; no row past its budget;
- memory: RSS (after garbage collection and `malloc_trim`) must not grow by more than
  --max-growth-mib from the end of warm-up to the end of the run.

Prints one summary line on stdout (progress on stderr) and exits 1 on any mismatch or growth.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import os
import sys
import time
from dataclasses import dataclass

import torch

PROMPTS = (
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paperclip.",
    "Repeat after me: the quick brown fox jumps over the lazy dog.",
    "What is 12 times 12?",
    "Write a haiku about autumn.",
    "Translate 'good morning' into French.",
    "Name the planets of the solar system in order.",
    "Complete the sequence: 2, 4, 8, 16,",
)
DRAFTS = ("smollm2-135m-instruct@bfloat16", "ngram")
TEMPERATURES = (0.0, 0.7, 0.0, 1.0)
BATCH_SIZES = (1, 2, 4)
VERIFY = ("block", "token")
GAMMAS = (2, 4, 6)
BUDGETS = (8, 12, 16)
REFERENCE_TOKENS = max(BUDGETS)


@dataclass(frozen=True)
class Run:
    """The settings of one generation."""

    index: int
    draft: str
    temperature: float
    batch: int
    verify: str
    gamma: int
    max_new_tokens: int
    prompts: tuple[int, ...]  # indices into PROMPTS, one per row


def schedule(i: int) -> Run:
    """Generation i's settings. Batch size, budget and draft (what sets the memory footprint)
    are the low digits of i in a mixed radix, so the first 18 generations cover them all;
    temperature, rule and γ cycle on their own, so short runs see every value too."""
    b, n, d = i % 3, (i // 3) % 3, (i // 9) % 2
    t, v, g = i % len(TEMPERATURES), (i // 4) % len(VERIFY), (i // 2) % len(GAMMAS)
    batch = BATCH_SIZES[b]
    return Run(i, DRAFTS[d], TEMPERATURES[t], batch, VERIFY[v], GAMMAS[g], BUDGETS[n],
               tuple((i + k) % len(PROMPTS) for k in range(batch)))


# --------------------------------------------------------------------------- memory


def release_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS, so RSS measures live memory."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: RSS is then a little noisier


def rss_mib() -> float:
    """The resident set size of this process now, in MiB (Linux /proc; peak RSS elsewhere)."""
    try:
        with open("/proc/self/statm") as statm:
            pages = int(statm.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / (2**20 if sys.platform == "darwin" else 2**10)


# --------------------------------------------------------------------------- checks


class Reference:
    """The target's plain greedy decoding of each prompt alone, computed once."""

    def __init__(self, target, encoded: list[torch.Tensor]):
        self.target, self.encoded, self.tokens = target, encoded, {}

    def __call__(self, prompt: int) -> list[int]:
        if prompt not in self.tokens:
            from exactspec import autoregressive_generate

            ids = self.encoded[prompt].unsqueeze(0)  # [1, L]
            out = autoregressive_generate(self.target, ids, max_new_tokens=REFERENCE_TOKENS,
                                          temperature=0)
            self.tokens[prompt] = out.sequences[0, ids.size(1):].tolist()
        return self.tokens[prompt]

    @torch.inference_mode()
    def top2_gap(self, prompt: int, prefix: list[int]) -> float:
        """The target's top-2 logit gap after prompt + prefix (alone, one fresh pass)."""
        ids = torch.cat([self.encoded[prompt], torch.tensor(prefix, dtype=torch.long)])
        logits = self.target.model(input_ids=ids.unsqueeze(0).to(self.target.device)).logits[0, -1]
        top = logits.float().topk(2).values
        return float(top[0] - top[1])


def greedy_mismatches(run: Run, new_tokens: list[list[int]], reference: Reference) -> list[str]:
    """Rows whose greedy output differs from plain decoding of their prompt alone."""
    problems = []
    for row, (prompt, got) in enumerate(zip(run.prompts, new_tokens)):
        want = reference(prompt)[: run.max_new_tokens]
        if got != want:
            at = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            gap = reference.top2_gap(prompt, want[:at])
            problems.append(f"generation {run.index} row {row} ({run}): first difference at new "
                            f"token {at}, got {got[at:at + 3]} want {want[at:at + 3]}, target's "
                            f"top-2 logit gap there {gap:.3g}")
    return problems


def counter_problems(run: Run, out, new_tokens: list[list[int]]) -> list[str]:
    """The counters add up and no row ran past its budget."""
    s = out.stats
    problems = []
    if s.output_tokens != s.accepted_drafts + s.corrections + s.bonus_tokens:
        problems.append(f"generation {run.index}: output tokens {s.output_tokens} != accepted "
                        f"{s.accepted_drafts} + corrections {s.corrections} + bonus {s.bonus_tokens}")
    if s.output_tokens != sum(map(len, new_tokens)) or max(map(len, new_tokens)) > run.max_new_tokens:
        problems.append(f"generation {run.index}: rows of {list(map(len, new_tokens))} tokens, "
                        f"budget {run.max_new_tokens}, counted {s.output_tokens}")
    return problems


# --------------------------------------------------------------------------- one generation


def generate(run: Run, target, drafts: dict, encoded: list[torch.Tensor]):
    """Run one generation; return (output, each row's new tokens)."""
    from exactspec import speculative_generate
    from exactspec.engine import pad_prompts

    rows = [encoded[p] for p in run.prompts]
    ids, mask = pad_prompts(rows)  # [B, L], [B, L]
    out = speculative_generate(target, drafts[run.draft], ids, attention_mask=mask,
                               gamma=run.gamma, max_new_tokens=run.max_new_tokens,
                               temperature=run.temperature, seed=run.index, verify=run.verify)
    sequences = list(out.sequences)
    return out, [seq[len(row):].tolist() for seq, row in zip(sequences, rows)]


# --------------------------------------------------------------------------- the run


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1000, help="generations (default 1000)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="generations before the first memory reading; the first 18 "
                             "cover every batch size, budget and draft (default: min(36, n // 2))")
    parser.add_argument("--max-growth-mib", type=float, default=64.0,
                        help="largest RSS growth allowed after warm-up (default 64 MiB)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: with more, other work on the machine "
                             "can stall a generation many times over; the soak checks outputs "
                             "and memory, not speed)")
    args = parser.parse_args(argv)
    if args.n < 2:
        parser.error(f"--n must be >= 2, got {args.n}")
    if args.warmup is None:
        args.warmup = min(36, args.n // 2)
    if not 1 <= args.warmup < args.n:
        parser.error(f"--warmup must be in [1, n), got {args.warmup}")
    return args


def load(log) -> tuple:
    from exactspec.models import BUNDLED_MODEL, encode_prompt, load_model

    target = load_model(BUNDLED_MODEL, dtype="float32", device="cpu")
    drafts = {name: name if name == "ngram" else load_model(name, device="cpu") for name in DRAFTS}
    encoded = [encode_prompt(target, text)[0] for text in PROMPTS]  # P × [L]
    log(f"loaded {target.spec} and drafts {', '.join(DRAFTS)}")
    return target, drafts, encoded


def main(argv=None) -> int:
    args = parse_args(argv)

    def log(message):
        print(f"soak: {message}", file=sys.stderr, flush=True)

    torch.set_num_threads(args.threads)
    target, drafts, encoded = load(log)
    reference = Reference(target, encoded)
    problems, greedy_checked, tokens = [], 0, 0
    rss_warm = None
    started = time.perf_counter()
    for i in range(args.n):
        run = schedule(i)
        out, new_tokens = generate(run, target, drafts, encoded)
        tokens += out.stats.output_tokens
        problems += counter_problems(run, out, new_tokens)
        if run.temperature == 0:
            problems += greedy_mismatches(run, new_tokens, reference)
            greedy_checked += run.batch
        if i + 1 == args.warmup:
            release_memory()
            rss_warm = rss_mib()
            log(f"warm-up done after {i + 1} generations: RSS {rss_warm:.0f} MiB")
        if (i + 1) % max(1, args.n // 10) == 0:
            log(f"{i + 1}/{args.n} generations, {len(problems)} problems, RSS {rss_mib():.0f} MiB, "
                f"{time.perf_counter() - started:.0f} s")
    release_memory()
    rss_end = rss_mib()
    growth = rss_end - rss_warm
    for problem in problems:
        print(f"soak: {problem}", file=sys.stderr)
    ok = not problems and growth <= args.max_growth_mib
    print(f"soak: {args.n} generations ({tokens} tokens, {greedy_checked} greedy rows checked "
          f"against plain decoding), {len(problems)} mismatches, RSS {rss_warm:.0f} MiB after "
          f"{args.warmup} warm-up generations -> {rss_end:.0f} MiB at the end ({growth:+.0f} MiB, "
          f"limit {args.max_growth_mib:.0f}), {time.perf_counter() - started:.0f} s: "
          + ("OK" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
