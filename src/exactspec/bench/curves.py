"""The measured cost model: α from the runs, the target's cost for one token and for a block of
γ+1 tokens and the draft's cost per token from direct timings of the models' forward pass on a KV
cache (`exactspec.bench.timing`), then `costmodel.speedup_measured` per γ beside the measured
speedup, and the γ it recommends. Rows with γ = "auto" or the auto draft have no single γ or
draft cost: they stay in the rows and the summary, not in the curves; nor does the oracle row
(`bench.ceiling`).
"""
from __future__ import annotations

from exactspec import costmodel
from exactspec.bench.config import AUTO, VERIFY_ORDER, is_auto_draft
from exactspec.bench.report import alpha_estimate, ratio
from exactspec.drafters.oracle import ORACLES


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
        if r["method"] == "speculative" and r["gamma"] != AUTO and not is_auto_draft(r["draft"]) \
                and r["draft"] not in ORACLES:  # the oracles' drafts cost nothing: their own lines
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
                point[f"measured_over_predicted_{verify}"] = ratio(
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

