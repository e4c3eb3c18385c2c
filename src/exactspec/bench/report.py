"""From runs to a report: one row per configuration and prompt kind, speedups, the measured cost
model, the machine it ran on, and the JSON file.

A row is one configuration on one prompt kind: per pass, tokens and seconds are summed over the
kind's prompts; ``tokens_per_s`` is the median over passes (min and max are kept, to show the
noise), and a row's speedup over another is the median of their ratios pass by pass
(`paired_ratio`). The counters come from the first pass: every pass uses the same seeds, so they repeat.

The measured cost model (`build_costmodel`): α from the runs, the target's cost for one token and
for a block of γ+1 tokens and the draft's cost per token from direct timings of the models'
forward pass on a KV cache (`exactspec.bench.timing`), then `costmodel.speedup_measured` per γ
beside the measured speedup, and the γ it recommends. Rows with γ = "auto" or the auto draft
have no single γ or draft cost: they stay in the rows and the summary, not in the curves.

The summary (`build_summary`), per temperature and prompt kind: exactspec's best prompt-lookup
row (n-gram or auto draft) against Transformers' best prompt-lookup row, every γ = "auto"
row against plain decoding, and against the best fixed γ of its draft and rule (`gamma_sweep`,
with a bootstrap interval over the generations).
"""
from __future__ import annotations

import json
import os
import platform
import statistics
from pathlib import Path

import numpy as np
import torch

from exactspec import costmodel
from exactspec.bench.config import (AUTO, NGRAM, VERIFY_ORDER, BenchConfig, RunSpec,
                                    is_auto_draft)
from exactspec.bench.results import RunResult
from exactspec.files import atomic_write


# --------------------------------------------------------------------------- rows


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def alpha_estimate(accepted: int, corrections: int) -> float | None:
    """α per verified position: accepted / (accepted + rejected), where each correction marks the
    one rejection that ends its round (the maximum-likelihood α of the cost model's constant,
    independent acceptance, whatever the proposal lengths)."""
    return _ratio(accepted, accepted + corrections) if accepted + corrections else None


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
        row["acceptance_rate"] = _ratio(row["accepted_drafts"], row["drafted_tokens"])
        row["alpha"] = alpha_estimate(row["accepted_drafts"], row["corrections"])
        row["tokens_per_round"] = _ratio(row["output_tokens"], row["rounds"])
        row["ms_per_round"] = _ratio(1e3 * row["wall_seconds"], row["rounds"])
    else:
        for name in (*counters, "acceptance_rate", "alpha", "tokens_per_round", "ms_per_round"):
            row[name] = None
        if all(r.peer_stats is not None for r in first):  # llama-server: drafts, not rounds
            row["accepted_drafts"] = sum(r.peer_stats["accepted_drafts"] for r in first)
            row["drafted_tokens"] = sum(r.peer_stats["drafted_tokens"] for r in first)
            row["acceptance_rate"] = _ratio(row["accepted_drafts"], row["drafted_tokens"])
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
    return {"rounds_by_source": by_source, "mean_gamma": _ratio(drafted, drafting)}


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
        return _ratio(row[name], base[name])
    return _median([_ratio(a, b) if a is not None else None for a, b in zip(mine, theirs)])


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
    for row in rows:
        spec = RunSpec(row["method"], row["temperature"], row["draft"], row["gamma"], row["verify"])
        got = outcome.get(spec)
        if not got or row["prompts"] != "humaneval":
            continue
        row["pass_at_1"] = sum(got) / len(got)
        row["pass_at_1_interval"] = humaneval.pass_rate_interval(sum(got), len(got))
        base = plain.get(row["temperature"])
        row["pass_at_1_minus_plain"] = (humaneval.difference_interval(
            (sum(got), len(got)), (sum(base), len(base))) if base else None)


# --------------------------------------------------------------------------- cost model


def _target_seconds(timings: dict) -> dict[int, float]:
    return {item["tokens"]: item["seconds"] for item in timings["target"]}


def build_costmodel(rows: list[dict], timings: dict, curve_max_gamma: int) -> dict:
    """The reference's speedup-against-γ figure, from measurements. For each (temperature,
    prompt kind, draft): α from the speculative rows (token verification where present, pooled
    over γ: the cost model's E[N] is the token rule's), c = t_draft / t_target(1), and for
    γ = 1..curve_max_gamma the predicted speedup
    `costmodel.speedup_measured(α, γ, t_target(1), t_target(γ+1), t_draft)` beside the measured
    speedups (token and block verification) where γ was benchmarked. The cost model has no
    prefill term: `measured_over_predicted_*` compares it with the decode-phase speedup (after
    each method's first emission, `decode_rate`); the end-to-end speedup is kept beside it."""
    t_target = _target_seconds(timings)
    t_1 = t_target[1]
    curves = []
    groups = {}
    for r in rows:
        if r["method"] == "speculative" and r["gamma"] != AUTO and not is_auto_draft(r["draft"]):
            groups.setdefault((r["temperature"], r["prompts"], r["draft"]), []).append(r)
    for (temperature, kind, draft), group in groups.items():
        source = "token" if any(r["verify"] == "token" for r in group) else "block"
        used = [r for r in group if r["verify"] == source]
        accepted = sum(r["accepted_drafts"] for r in used)
        corrections = sum(r["corrections"] for r in used)
        alpha = alpha_estimate(accepted, corrections)
        t_draft = timings["drafts"][draft]["seconds_per_token"]
        measured = {(r["gamma"], r["verify"]): r for r in group}
        points = []
        for gamma in range(1, curve_max_gamma + 1):
            if gamma + 1 not in t_target:
                break
            point = {"gamma": gamma, "expected_tokens": None, "predicted_speedup": None,
                     "predicted_ms_per_round": 1e3 * (gamma * t_draft + t_target[gamma + 1])}
            if alpha is not None:
                point["expected_tokens"] = costmodel.expected_tokens(alpha, gamma)
                point["predicted_speedup"] = costmodel.speedup_measured(
                    alpha, gamma, t_1, t_target[gamma + 1], t_draft)
            for verify in VERIFY_ORDER:
                r = measured.get((gamma, verify))
                point[f"measured_speedup_{verify}"] = r["speedup_vs_autoregressive"] if r else None
                point[f"measured_decode_speedup_{verify}"] = (
                    r["decode_speedup_vs_autoregressive"] if r else None)
                point[f"measured_tokens_per_round_{verify}"] = r["tokens_per_round"] if r else None
                point[f"measured_ms_per_round_{verify}"] = r["ms_per_round"] if r else None
                point[f"measured_over_predicted_{verify}"] = _ratio(
                    point[f"measured_decode_speedup_{verify}"], point["predicted_speedup"])
            points.append(point)
        scored = [p for p in points if p["predicted_speedup"] is not None]
        best = max(scored, key=lambda p: (p["predicted_speedup"], -p["gamma"])) if scored else None
        curves.append({
            "temperature": temperature, "prompts": kind, "draft": draft, "alpha": alpha,
            "alpha_from": source, "verified_positions": accepted + corrections,
            "t_target_1": t_1, "t_draft": t_draft, "c": t_draft / t_1,
            "best_gamma": best["gamma"] if best else None,
            "best_predicted_speedup": best["predicted_speedup"] if best else None,
            "points": points,
        })
    return {"timings": timings, "curves": curves}


# --------------------------------------------------------------------------- summary


def _brief(row: dict | None) -> dict | None:
    keys = ("method", "draft", "gamma", "verify", "tokens_per_s", "speedup_vs_autoregressive")
    return {key: row[key] for key in keys} if row else None


def _fastest(rows: list[dict]) -> dict | None:
    rated = [r for r in rows if r["tokens_per_s"] is not None]
    return max(rated, key=lambda r: r["tokens_per_s"]) if rated else None


def build_summary(rows: list[dict]) -> list[dict]:
    """Per (temperature, prompt kind): `best_lookup`, exactspec's fastest speculative row with the
    n-gram or an auto draft; `best_hf_lookup`, the fastest hf_assisted prompt-lookup row;
    `lookup_over_hf_lookup`, the ratio of their tokens/s; `gamma_auto`, every speculative row
    with γ = "auto" (its draft, rule, tokens/s, speedup over autoregressive and mean γ);
    `gamma_sweep`, γ = "auto" against the best fixed γ (`gamma_sweep`)."""
    out = []
    for temperature, kind in dict.fromkeys((r["temperature"], r["prompts"]) for r in rows):
        group = [r for r in rows if (r["temperature"], r["prompts"]) == (temperature, kind)]
        ours = _fastest([r for r in group if r["method"] == "speculative"
                         and (r["draft"] == NGRAM or is_auto_draft(r["draft"]))])
        peer = _fastest([r for r in group if r["method"] == "hf_assisted" and r["draft"] == NGRAM])
        out.append({
            "temperature": temperature, "prompts": kind,
            "best_lookup": _brief(ours), "best_hf_lookup": _brief(peer),
            "lookup_over_hf_lookup": paired_ratio(ours, peer),
            "gamma_auto": [{**_brief(r), "mean_gamma": r["mean_gamma"]} for r in group
                           if r["method"] == "speculative" and r["gamma"] == AUTO],
            "gamma_sweep": gamma_sweep(group),
            "peers": peer_summary(group),
        })
    return out


def _is_model_draft(draft: str | None) -> bool:
    """A model draft run in PyTorch (not prompt lookup, the auto draft or llama.cpp)."""
    from exactspec.drafters import is_llamacpp_spec

    return bool(draft) and draft != NGRAM and not is_auto_draft(draft) and not is_llamacpp_spec(draft)


def peer_summary(group: list[dict]) -> dict:
    """exactspec's fastest speculative row against the peers of one (temperature, prompt kind):
    plain PyTorch decoding, Transformers' fastest assisted generation with a model draft, with
    each PyTorch model draft exactspec's fastest row against Transformers' fastest with that
    same draft, and llama.cpp plain and its server's fastest row."""
    best = _fastest([r for r in group if r["method"] == "speculative"])
    hf = _fastest([r for r in group if r["method"] == "hf_assisted" and _is_model_draft(r["draft"])])
    plain = next((r for r in group if r["method"] == "autoregressive"), None)
    llama = next((r for r in group if r["method"] == "llamacpp"), None)
    server = _fastest([r for r in group if r["method"] == "llama_server"])
    same = []
    for draft in dict.fromkeys(r["draft"] for r in group if _is_model_draft(r["draft"])):
        ours = _fastest([r for r in group if r["method"] == "speculative" and r["draft"] == draft])
        theirs = _fastest([r for r in group if r["method"] == "hf_assisted" and r["draft"] == draft])
        if ours and theirs:
            same.append({"draft": draft, "ours": _brief(ours), "hf_assisted": _brief(theirs),
                         "ratio": paired_ratio(ours, theirs)})
    return {"best": _brief(best), "over_autoregressive": paired_ratio(best, plain),
            "best_hf_assisted": _brief(hf), "over_hf_assisted": paired_ratio(best, hf),
            "same_draft": same, "llamacpp": _brief(llama), "over_llamacpp": paired_ratio(best, llama),
            "best_llama_server": _brief(server), "over_llama_server": paired_ratio(best, server),
            "pass_at_1": [{**_brief(r), "pass_at_1": r["pass_at_1"],
                           "minus_plain": r["pass_at_1_minus_plain"]}
                          for r in group if r["method"] == "speculative" and r.get("pass_at_1") is not None]}


SWEEP_RESAMPLES = 2000  # bootstrap resamples of the generations
SWEEP_MIN_GENERATIONS = 10  # fewer have too few distinct resamples for an interval


def gamma_sweep(group: list[dict]) -> list[dict]:
    """Per (draft, rule) of one temperature and prompt kind with a γ = "auto" row and two or more
    fixed-γ rows: the fastest fixed γ (`best_gamma`, its tokens/s), the auto row's tokens/s and
    mean γ, `auto_over_best` (their ratio) and its 90 % `interval`: a bootstrap over the
    generations (prompt and seed), the same ones drawn for both rows, each generation's seconds
    the median over passes. At T > 0 each row samples its own texts, and what a text lets the
    draft keep varies more than the timings do: the interval says whether the generations were
    enough to tell the two apart (None with fewer than SWEEP_MIN_GENERATIONS)."""
    out = []
    for draft, verify in dict.fromkeys((r["draft"], r["verify"]) for r in group
                                       if r["method"] == "speculative"):
        rows = [r for r in group if r["method"] == "speculative"
                and (r["draft"], r["verify"]) == (draft, verify)]
        auto = next((r for r in rows if r["gamma"] == AUTO), None)
        fixed = [r for r in rows if r["gamma"] != AUTO]
        if auto is None or len(fixed) < 2:
            continue
        best = _fastest(fixed)
        out.append({"draft": draft, "verify": verify, "best_gamma": best["gamma"],
                    "best_tokens_per_s": best["tokens_per_s"],
                    "auto_tokens_per_s": auto["tokens_per_s"], "auto_mean_gamma": auto["mean_gamma"],
                    "auto_over_best": paired_ratio(auto, best),
                    "generations": len(auto["generation_seconds"]),
                    "interval": _paired_interval(auto, best)})
    return out


def _paired_interval(row: dict, other: dict, level: float = 0.9) -> list[float] | None:
    """The `level` bootstrap interval (percentile) of row's tokens/s over other's, resampling
    generation indices (paired: the same for both, so a prompt's generations pair up)."""
    from scipy.stats import bootstrap  # scipy loads only when a sweep is summarized

    def ratio(tokens, seconds, other_tokens, other_seconds, axis=-1):
        return (tokens.sum(axis) / seconds.sum(axis)) / (other_tokens.sum(axis) / other_seconds.sum(axis))

    data = [np.array(r[key], dtype=float) for r in (row, other)
            for key in ("generation_tokens", "generation_seconds")]  # 4 × [n]
    if data[0].size < SWEEP_MIN_GENERATIONS:
        return None
    interval = bootstrap(data, ratio, paired=True, vectorized=True, n_resamples=SWEEP_RESAMPLES,
                         confidence_level=level, method="percentile",
                         rng=np.random.default_rng(0)).confidence_interval
    return [float(interval.low), float(interval.high)]


# --------------------------------------------------------------------------- machine


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: torch.device) -> dict:
    import transformers

    info = {
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "cpu_cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_model(),
        "load_average_start": load_average(),
        "exactspec_git": _git_state(),
    }
    return info


def _git_state() -> str | None:
    """The source tree's commit (with "+dirty" for uncommitted changes in the package), when it
    is a git checkout: a benchmark is only comparable with runs of the same engine."""
    import subprocess

    package = Path(__file__).resolve().parents[1]  # src/exactspec
    try:
        commit = subprocess.run(["git", "-C", str(package), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=5)
        if commit.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(package), "status", "--porcelain", "--", "."],
                               capture_output=True, text=True, timeout=5)
        return commit.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


# --------------------------------------------------------------------------- output


def write_json(result: dict, path: str | os.PathLike) -> None:
    """Write the result as JSON, atomically (a temporary file renamed into place)."""
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(result, indent=2) + "\n"))
