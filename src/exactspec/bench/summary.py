"""The summary, per temperature and prompt kind: exactspec's best prompt-lookup row (n-gram or
auto draft) against Transformers' best prompt-lookup row, every γ = "auto" row against plain
decoding and against the best fixed γ of its draft and rule (`gamma_sweep`, with a bootstrap
interval over the generations), and exactspec's fastest row against each peer (`peer_summary`;
the oracle rows, `bench.ceiling`, are not contenders).
"""
from __future__ import annotations

import numpy as np

from exactspec.bench.config import AUTO, NGRAM, is_auto_draft
from exactspec.bench.report import paired_ratio
from exactspec.drafters.oracle import ORACLES


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
    from exactspec.drafters import is_llamacpp_spec, other_vocabulary_method

    return (bool(draft) and draft not in (NGRAM, *ORACLES) and not is_auto_draft(draft)
            and not is_llamacpp_spec(draft) and not other_vocabulary_method(draft))


def peer_summary(group: list[dict]) -> dict:
    """exactspec's fastest speculative row against the peers of one (temperature, prompt kind):
    plain PyTorch decoding, Transformers' fastest assisted generation with a model draft, with
    each PyTorch model draft exactspec's fastest row against Transformers' fastest with that
    same draft, and llama.cpp plain and its server's fastest row."""
    best = _fastest([r for r in group if r["method"] == "speculative"
                     and r["draft"] not in ORACLES])
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
