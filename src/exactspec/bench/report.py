"""From runs to rows: one row per configuration and prompt kind, with speedups, pass@1 and
validity, and the result's JSON file.

A row is one configuration on one prompt kind: per pass, tokens and seconds are summed over the
kind's prompts; ``tokens_per_s`` is the median over passes (min and max are kept, to show the
noise), and a row's speedup over another is the median of their ratios pass by pass
(`paired_ratio`). The counters come from the first pass: every pass uses the same seeds, so they repeat.
The measured cost model is `bench.curves`, the summary `bench.summary`, the machine `bench.machine`.
"""
from __future__ import annotations

import json
import os
import statistics

from exactspec.bench.config import BenchConfig, RunSpec
from exactspec.bench.results import RunResult
from exactspec.files import atomic_write


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def ratio(num: float | None, den: float | None) -> float | None:
    """num / den; None when either is missing or den is 0."""
    return num / den if num is not None and den else None


def alpha_estimate(accepted: int, corrections: int) -> float | None:
    """α per verified position: accepted / (accepted + rejected), where each correction marks the
    one rejection that ends its round (the maximum-likelihood α of the cost model's constant,
    independent acceptance, whatever the proposal lengths)."""
    return ratio(accepted, accepted + corrections) if accepted + corrections else None


def decode_rate(pass_: list[RunResult]) -> float | None:
    """Tokens per second after the first emission (prompt processing and the first round left
    out), over one pass's prompts: the decode phase, which is what the cost model predicts."""
    if any(r.first_tokens is None for r in pass_):
        return None
    tokens = sum(len(r.tokens) - r.first_tokens for r in pass_)
    seconds = sum(r.wall_seconds - r.time_to_first_token for r in pass_)
    return tokens / seconds if tokens > 0 and seconds > 0 else None


def summarize(spec: RunSpec, kind: str, runs: list[list[RunResult]], config: BenchConfig,
              peer_settings: dict | None = None) -> dict:
    """One row from runs[pass][prompt] of one configuration on one prompt kind."""
    tokens = [sum(len(r.tokens) for r in pass_) for pass_ in runs]
    walls = [sum(r.wall_seconds for r in pass_) for pass_ in runs]
    rates = [t / w if w > 0 else None for t, w in zip(tokens, walls)]
    timed = [r for r in rates if r is not None]
    tps = _median(rates)
    decode = [decode_rate(pass_) for pass_ in runs]
    row = {
        "method": spec.method, "draft": spec.draft, "gamma": spec.gamma, "verify": spec.verify,
        "temperature": spec.temperature, "prompts": kind, "n_prompts": len(runs[0]) // config.seeds,
        "output_tokens": tokens[0], "wall_seconds": _median(walls), "tokens_per_s": tps,
        "tokens_per_s_min": min(timed, default=None),
        "tokens_per_s_max": max(timed, default=None),
        "pass_tokens_per_s": rates, "pass_decode_tokens_per_s": decode,
        "ms_per_token": 1e3 / tps if tps else None,
        "time_to_first_token": _median([r.time_to_first_token for p in runs for r in p]),
        "decode_tokens_per_s": _median(decode),
        # per generation (prompt and seed, in the order of `BenchConfig.jobs`): for `gamma_sweep`
        "generation_tokens": [len(r.tokens) for r in runs[0]],
        "generation_seconds": [_median([pass_[i].wall_seconds for pass_ in runs])
                               for i in range(len(runs[0]))],
    }
    counters = ("accepted_drafts", "drafted_tokens", "corrections", "bonus_tokens", "rounds",
                "target_calls", "draft_calls")
    first = runs[0]  # the same seeds every pass: the counters repeat exactly
    if all(r.stats is not None for r in first):
        for name in counters:
            row[name] = sum(getattr(r.stats, name) for r in first)
        row["acceptance_rate"] = ratio(row["accepted_drafts"], row["drafted_tokens"])
        row["alpha"] = alpha_estimate(row["accepted_drafts"], row["corrections"])
        row["tokens_per_round"] = ratio(row["output_tokens"], row["rounds"])
        row["ms_per_round"] = ratio(1e3 * row["wall_seconds"], row["rounds"])
    else:
        for name in (*counters, "acceptance_rate", "alpha", "tokens_per_round", "ms_per_round"):
            row[name] = None
        if all(r.peer_stats is not None for r in first):  # llama-server: drafts, not rounds
            row["accepted_drafts"] = sum(r.peer_stats["accepted_drafts"] for r in first)
            row["drafted_tokens"] = sum(r.peer_stats["drafted_tokens"] for r in first)
            row["acceptance_rate"] = ratio(row["accepted_drafts"], row["drafted_tokens"])
    row.update(_sources(first))
    row.update(_constraint_costs(first))
    row["speedup_vs_autoregressive"] = None
    row["decode_speedup_vs_autoregressive"] = None
    row["speedup_vs_hf_generate"] = None
    row["speedup_vs_llamacpp"] = None
    row["matches_autoregressive"] = None
    row["peer_settings"] = peer_settings
    return row


def ordered_sources(by_source: dict[str, int]) -> dict[str, int]:
    """Rounds per source in table order: "ngram", "model", "plain", then any other."""
    order = {source: i for i, source in enumerate(("ngram", "model", "plain"))}
    return dict(sorted(by_source.items(), key=lambda item: (order.get(item[0], 3), item[0])))


def _sources(runs: list[RunResult]) -> dict:
    """rounds_by_source (rounds per way of drafting, "plain" for rounds without drafts, summed
    over the prompts) and mean_gamma (drafted tokens per round that drafted: with γ = "auto",
    the γ the controller chose on average); None for Transformers' rows."""
    if any(r.rounds_by_source is None for r in runs):
        return {"rounds_by_source": None, "mean_gamma": None}
    by_source: dict[str, int] = {}
    for r in runs:
        for source, n in r.rounds_by_source.items():
            by_source[source] = by_source.get(source, 0) + n
    by_source = ordered_sources(by_source)
    drafting = sum(n for source, n in by_source.items() if source != "plain")
    drafted = sum(r.stats.drafted_tokens for r in runs)
    return {"rounds_by_source": by_source, "mean_gamma": ratio(drafted, drafting)}


def _constraint_costs(runs: list[RunResult]) -> dict:
    """grammar_share: the share of output tokens that were grammar-forced drafts kept;
    constraint_ms_per_token: the matchers' time (masks, forced tokens) per output token."""
    tokens = sum(len(r.tokens) for r in runs)
    seconds = sum(r.constraint_seconds for r in runs)
    if not seconds or not tokens:
        return {"grammar_share": None, "constraint_ms_per_token": None}
    grammar = sum((r.kept_by_source or {}).get("grammar", 0) for r in runs)
    return {"grammar_share": grammar / tokens, "constraint_ms_per_token": 1e3 * seconds / tokens}


def add_validity(rows: list[dict], results: dict, config: BenchConfig, tokenizer) -> None:
    """valid: the share of a row's outputs (every pass) that are JSON valid against their
    prompt's schema (`bench.extraction.is_valid`), for rows of constrained prompts; `invalid`:
    the first that is not ({prompt, token_ids, text}), else null."""
    from exactspec.bench.extraction import is_valid

    jobs = config.jobs()
    for row in rows:
        spec = RunSpec(row["method"], row["temperature"], row["draft"], row["gamma"], row["verify"])
        checks = []
        for pass_ in results.get(spec, []):
            for (i, _), r in zip(jobs, pass_):
                prompt = config.prompts[i]
                if prompt.constraint is None or prompt.kind != row["prompts"]:
                    continue
                text = tokenizer.decode(r.tokens, skip_special_tokens=True)
                checks.append(is_valid(prompt.constraint.schema(), text))
                if not checks[-1] and row.get("invalid") is None:
                    row["invalid"] = {"prompt": prompt.name, "token_ids": r.tokens, "text": text}
        if checks:
            row["valid"] = sum(checks) / len(checks)
            row.setdefault("invalid", None)


def paired_ratio(row: dict | None, base: dict | None, name: str = "tokens_per_s") -> float | None:
    """`row`'s speed over `base`'s: the median over passes of their ratio within a pass (both ran
    the same prompts, interleaved per prompt, seconds apart, so a pass's ratio is untouched by
    the machine's speed drifting between passes); the ratio of their medians when either row
    has no per-pass rates."""
    if row is None or base is None:
        return None
    mine, theirs = row.get(f"pass_{name}"), base.get(f"pass_{name}")
    if not mine or not theirs or len(mine) != len(theirs):
        return ratio(row[name], base[name])
    return _median([ratio(a, b) if a is not None else None for a, b in zip(mine, theirs)])


def add_speedups(rows: list[dict]) -> None:
    """speedup_vs_autoregressive, speedup_vs_hf_generate and speedup_vs_llamacpp: tokens/s over
    that row's, for the same temperature and prompt kind, paired by pass (`paired_ratio`);
    decode_speedup_vs_autoregressive: the same for the decode phase (`decode_rate`)."""
    base = {(r["method"], r["temperature"], r["prompts"]): r for r in rows
            if r["method"] in ("autoregressive", "hf_generate", "llamacpp")}
    for r in rows:
        key = (r["temperature"], r["prompts"])
        plain = base.get(("autoregressive", *key))
        r["speedup_vs_autoregressive"] = paired_ratio(r, plain)
        r["decode_speedup_vs_autoregressive"] = paired_ratio(r, plain, "decode_tokens_per_s")
        r["speedup_vs_hf_generate"] = paired_ratio(r, base.get(("hf_generate", *key)))
        r["speedup_vs_llamacpp"] = paired_ratio(r, base.get(("llamacpp", *key)))


def add_pass_at_1(rows: list[dict], results: dict, config: BenchConfig, tokenizer) -> None:
    """pass@1 of each row: the share of its generations (first pass; every pass repeats the
    seeds) whose completion passes its problem's tests (`bench.humaneval`), with Wilson's 95 %
    interval, and `pass_at_1_minus_plain`: the 95 % interval of its difference from plain
    decoding's pass@1 at the same temperature (an exact method's interval should hold 0; at
    T = 0 its texts are plain decoding's, so the difference is 0)."""
    from exactspec.bench import humaneval

    checked: dict[tuple[str, str], bool] = {}  # identical completions are run once

    def passed(prompt, tokens) -> bool:
        body = humaneval.completion(tokenizer.decode(tokens, skip_special_tokens=False))
        key = (prompt.name, body)
        if key not in checked:
            checked[key] = humaneval.passes(prompt.problem, body)
        return checked[key]

    jobs = config.jobs()
    outcome = {}
    for spec, passes_ in results.items():
        runs = passes_[0]
        outcome[spec] = [passed(config.prompts[i], r.tokens) for (i, _), r in zip(jobs, runs)
                         if config.prompts[i].problem]
    plain = {spec.temperature: outcome[spec] for spec in outcome if spec.method == "autoregressive"}
    kinds = {p.kind for p in config.prompts if p.problem}  # "humaneval", or the mix's "code-gen"
    for row in rows:
        spec = RunSpec(row["method"], row["temperature"], row["draft"], row["gamma"], row["verify"])
        got = outcome.get(spec)
        if not got or row["prompts"] not in kinds:
            continue
        row["pass_at_1"] = sum(got) / len(got)
        row["pass_at_1_interval"] = humaneval.pass_rate_interval(sum(got), len(got))
        base = plain.get(row["temperature"])
        row["pass_at_1_minus_plain"] = (humaneval.difference_interval(
            (sum(got), len(got)), (sum(base), len(base))) if base else None)



# --------------------------------------------------------------------------- output


def write_json(result: dict, path: str | os.PathLike) -> None:
    """Write the result as JSON, atomically (a temporary file renamed into place)."""
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(result, indent=2) + "\n"))
