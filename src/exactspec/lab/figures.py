"""Figures 1–5 of the reference document, drawn from this project's own code, and numbers.json.

    fig1_envelopes.png    target f under each envelope C·g, rejected regions shaded
    fig2_candidates.png   candidate/height pairs (x, u·C·g(x)); survivors lie below f
    fig3_histograms.png   accepted samples against the normalized target f / Z
    fig4_tokens.png       accepted mass min(p, q) + replacement mass max(p − q, 0) = p
    fig5_cost.png         S(α, γ, c = 0.1) against γ, peaks marked
    numbers.json          every number shown, with the field names of `exactspec lab --json`

One colour scheme throughout: target blue, envelope teal, rejected red, replacement amber.
Figures are `matplotlib.figure.Figure` objects on the Agg canvas (no pyplot, no global state).
`write_figures` renders into a hidden staging folder inside the output folder and moves the
files into place only when all of them are written, so a failure leaves nothing half-written.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from exactspec import costmodel
from exactspec.lab import rejection
from exactspec.lab.experiments import cost_numbers, rejection_numbers, token_numbers

TARGET = "#1f5fa8"         # blue: the target f, f/Z, p
ACCEPTED_FILL = "#a9c6e8"  # light blue: area under the target, accepted samples
ENVELOPE = "#12908a"       # teal: the envelope C·g; accepted token mass min(p, q)
REJECTED = "#d1393b"       # red: rejected region and rejected candidates
REPLACEMENT = "#f2a516"    # amber: replacement mass max(p − q, 0)
NEUTRAL = "#555555"

FILES = {
    "fig1": "fig1_envelopes.png", "fig2": "fig2_candidates.png", "fig3": "fig3_histograms.png",
    "fig4": "fig4_tokens.png", "fig5": "fig5_cost.png", "numbers": "numbers.json",
}
COST_ALPHAS = (0.5, 0.7, 0.9)
COST_C = 0.1
COST_MAX_GAMMA = 16
_X_VIEW = (-3.6, 3.6)


def _figure(width: float = 11.0, height: float = 4.6) -> Figure:
    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _style(ax, xlabel: str, ylabel: str) -> None:
    ax.set_xlabel(xlabel, fontsize=11)
    ax.set_ylabel(ylabel, fontsize=11)
    ax.tick_params(labelsize=10)
    ax.grid(alpha=0.25)
    ax.spines[["top", "right"]].set_visible(False)


def _shared_legend(figure: Figure, ax, **options) -> None:
    """One legend for all panels, in a row below them."""
    handles, labels = ax.get_legend_handles_labels()
    figure.legend(handles, labels, loc="outside lower center", ncol=len(handles), fontsize=10,
                  frameon=False, **options)


def _label(name: str) -> str:
    return rejection.REFERENCE_PROPOSALS[name][0].replace("-3", "\u22123")


# --------------------------------------------------------------------------- figures 1–3


def figure_envelopes(samplers: dict) -> Figure:
    """Figure 1: f (blue) under C·g (teal), the rejected region between them red, per proposal."""
    figure = _figure()
    axes = figure.subplots(1, len(samplers), sharey=True)
    x = np.linspace(*_X_VIEW, 2001)
    for ax, (name, sampler) in zip(axes, samplers.items()):
        f, envelope = sampler.target(x), sampler.C * sampler.proposal.pdf(x)
        ax.fill_between(x, 0, f, color=ACCEPTED_FILL, alpha=0.7, lw=0,
                        label="accepted: below f(x)")
        ax.fill_between(x, f, envelope, where=envelope > f, color=REJECTED, alpha=0.22, lw=0,
                        label="rejected: between f(x) and C·g(x)")
        ax.plot(x, envelope, color=ENVELOPE, lw=2.2, label="envelope C·g(x)")
        ax.plot(x, f, color=TARGET, lw=2.2, label="target f(x)")
        ax.set_title(f"{_label(name)}, C = {sampler.C:g}\n"
                     f"acceptance Z/C = {sampler.theoretical_acceptance:.2%}", fontsize=12)
        ax.set_xlim(*_X_VIEW)
        ax.set_ylim(0, 4.8)
        _style(ax, "x", "unnormalized density")
    _shared_legend(figure, axes[0])
    figure.suptitle("Figure 1. The envelope must cover the target everywhere: C·g(x) \u2265 f(x)",
                    fontsize=13)
    return figure


def figure_candidates(samplers: dict, proposals: dict) -> Figure:
    """Figure 2: each candidate x with its height u·C·g(x); below f (blue) survives, above (red)
    is rejected."""
    figure = _figure()
    axes = figure.subplots(1, len(samplers), sharey=True)
    x = np.linspace(*_X_VIEW, 2001)
    for ax, (name, sampler) in zip(axes, samplers.items()):
        batch = proposals[name]
        keep = batch.accepted
        ax.scatter(batch.x[~keep], batch.height[~keep], s=5, color=REJECTED, alpha=0.55, lw=0,
                   label="rejected candidate (h ≥ f(x))")
        ax.scatter(batch.x[keep], batch.height[keep], s=5, color=TARGET, alpha=0.75, lw=0,
                   label="accepted candidate (h < f(x))")
        ax.plot(x, sampler.C * sampler.proposal.pdf(x), color=ENVELOPE, lw=2, label="C·g(x)")
        ax.plot(x, sampler.target(x), color=TARGET, lw=2, label="f(x)")
        ax.set_title(f"{_label(name)}, C = {sampler.C:g}\n{keep.sum():,} of {keep.size:,} "
                     f"candidates below f ({keep.mean():.1%})", fontsize=12)
        ax.set_xlim(*_X_VIEW)
        ax.set_ylim(0, 4.8)
        _style(ax, "candidate x ~ g", "height h = u·C·g(x)")
    _shared_legend(figure, axes[0], markerscale=3)
    figure.suptitle("Figure 2. Candidate/height pairs: a dot below the target survives",
                    fontsize=13)
    return figure


def figure_histograms(samplers: dict, runs: dict) -> Figure:
    """Figure 3: histograms of accepted samples against the normalized target f / Z."""
    figure = _figure()
    axes = figure.subplots(1, len(samplers), sharey=True)
    a, b = rejection.REFERENCE_SUPPORT
    x = np.linspace(a, b, 1201)
    for ax, (name, sampler) in zip(axes, samplers.items()):
        run = runs[name]
        ax.hist(run.samples, bins=72, range=(a, b), density=True, color=ACCEPTED_FILL,
                edgecolor="white", lw=0.3, label=f"accepted samples ({run.n_accepted:,})")
        ax.plot(x, sampler.target(x) / sampler.normalizing_constant, color=TARGET, lw=2.2,
                label="f(x) / Z")
        ax.set_title(f"{_label(name)}, C = {sampler.C:g}: observed acceptance "
                     f"{run.acceptance_rate:.2%}\n(theory {sampler.theoretical_acceptance:.2%}, "
                     f"{run.n_proposed:,} proposals)", fontsize=12)
        ax.set_xlim(a - 0.1, b + 0.1)
        ax.set_ylim(0, 0.8)
        _style(ax, "x", "density")
        ax.legend(loc="upper right", fontsize=9, framealpha=0.9)
    figure.suptitle("Figure 3. Both proposals give the same distribution; "
                    "the Gaussian wastes fewer candidates", fontsize=13)
    return figure


# --------------------------------------------------------------------------- figures 4–5


def figure_tokens(numbers: dict) -> Figure:
    """Figure 4: stacked bars, accepted mass min(p, q) (teal) + replacement mass max(p − q, 0)
    (amber) = p, with the draft q and the simulated frequencies marked."""
    figure = _figure(8.5, 5.0)
    ax = figure.subplots()
    tokens, p, q = numbers["tokens"], np.array(numbers["p"]), np.array(numbers["q"])
    accepted, residual = np.minimum(p, q), np.maximum(p - q, 0)
    at = np.arange(len(tokens))
    ax.bar(at, accepted, width=0.55, color=ENVELOPE, label="accepted mass min(p, q)")
    ax.bar(at, residual, width=0.55, bottom=accepted, color=REPLACEMENT,
           label="replacement mass max(p \u2212 q, 0)")
    for i in at:
        for low, height in ((0, accepted[i]), (accepted[i], residual[i])):
            if height > 0.03:
                ax.text(i, low + height / 2, f"{height:.2f}", ha="center", va="center",
                        color="white", fontsize=11, fontweight="bold")
    ax.hlines(q, at - 0.36, at + 0.36, colors=NEUTRAL, linestyles="dashed", lw=1.6,
              label="draft q")
    ax.scatter(at, numbers["frequency"], marker="D", s=60, color="black", zorder=3,
               label=f"simulated frequency ({numbers['n']:,} proposals)")
    for i, freq in zip(at, numbers["frequency"]):
        ax.annotate(f"{freq:.3%}", (i, freq), xytext=(16, 4), textcoords="offset points",
                    fontsize=10)
    ax.set_xticks(at, [f"{t}\np = {pi:.2f}, q = {qi:.2f}" for t, pi, qi in zip(tokens, p, q)],
                  fontsize=11)
    ax.set_ylim(0, 0.75)
    _style(ax, "", "probability")
    ax.grid(axis="x", visible=False)
    ax.legend(loc="upper right", fontsize=9.5, framealpha=0.95)
    ax.set_title("Figure 4. Accepted drafts plus replacements recover the target p",
                 fontsize=13)
    return figure


def figure_cost(curves: list[dict]) -> Figure:
    """Figure 5: S(α, γ, c) against γ for each α, with each curve's best γ marked."""
    figure = _figure(8.5, 5.0)
    ax = figure.subplots()
    shades = ["#7fb7e6", TARGET, "#0b2e59"]  # light to dark blue as α grows
    for curve, colour in zip(curves, shades):
        gammas = [row["gamma"] for row in curve["rows"]]
        speedups = [row["speedup"] for row in curve["rows"]]
        ax.plot(gammas, speedups, marker="o", ms=4, lw=2, color=colour,
                label=f"\u03b1 = {curve['alpha']:g}")
        best, peak = curve["best_gamma"], curve["best_speedup"]
        ax.scatter([best], [peak], marker="*", s=280, color=colour, edgecolor="black",
                   lw=0.8, zorder=3, label="_peak")
        below = curve is curves[0]  # the lowest curve's label goes under it, clear of the others
        ax.annotate(f"best \u03b3 = {best}: {peak:.2f}\u00d7", (best, peak),
                    xytext=(6, -14) if below else (0, 14), textcoords="offset points",
                    ha="left" if below else "center", va="top" if below else "bottom",
                    fontsize=10.5,
                    bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.85})
    ax.axhline(1.0, color=NEUTRAL, ls="--", lw=1, label="no speedup")
    ax.set_xlim(-0.3, curves[0]["max_gamma"] + 0.3)
    ax.set_ylim(0.6, max(c["best_speedup"] for c in curves) + 0.45)
    _style(ax, "block length \u03b3 (draft tokens per round)", "speedup S(\u03b1, \u03b3, c)")
    ax.legend(loc="upper left", fontsize=10, framealpha=0.95)
    ax.set_title(f"Figure 5. Analytical cost model, c = {curves[0]['c']:g} "
                 "(not a measured benchmark)", fontsize=13)
    return figure


# --------------------------------------------------------------------------- writing


def _prepare(out: Path) -> tuple[bool, Path]:
    """Create `out` if needed and a staging folder inside it; (created out?, staging)."""
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".exactspec-figures-", dir=out))
    except FileExistsError:
        raise OSError(f"cannot write figures to {out}: it is not a folder") from None
    except OSError as err:
        raise OSError(f"cannot write figures to {out}: {err.strerror or err}") from None
    return created, staging


def render(out: Path, *, seed: int = 0, n_proposals: int = 300_000, n_tokens: int = 10_000,
           n_pairs: int = 2_000, dpi: int = 110) -> dict:
    """Draw figures 1–5 into folder `out` and return the numbers behind them."""
    samplers = rejection.reference_samplers()
    runs = rejection.run_reference_experiment(n_proposals, seed, samplers)
    pair_streams = np.random.SeedSequence([seed, 2]).spawn(len(samplers))
    proposals = {name: sampler.propose(n_pairs, np.random.default_rng(stream))
                 for (name, sampler), stream in zip(samplers.items(), pair_streams)}
    tokens = token_numbers(n_tokens, seed)
    curves = [cost_numbers(alpha, COST_C, COST_MAX_GAMMA) for alpha in COST_ALPHAS]
    drawn = {
        "fig1": figure_envelopes(samplers), "fig2": figure_candidates(samplers, proposals),
        "fig3": figure_histograms(samplers, runs), "fig4": figure_tokens(tokens),
        "fig5": figure_cost(curves),
    }
    for key, figure in drawn.items():
        figure.savefig(out / FILES[key], dpi=dpi)
    return {
        "seed": seed, "files": FILES,
        "rejection": rejection_numbers(n_proposals, seed, runs),
        "candidates": {name: {"n_proposed": int(b.accepted.size), "n_accepted": int(b.accepted.sum())}
                       for name, b in proposals.items()},
        "tokens": tokens,
        "cost": {"c": COST_C, "alphas": list(COST_ALPHAS), "curves": curves,
                 "reference_example": {"alpha": 0.7, "best": costmodel.best_gamma(0.7, COST_C, 12)}},
    }


def write_figures(out_dir, **options) -> dict[str, Path]:
    """Write fig1…fig5 and numbers.json into out_dir (created if missing); return their paths.

    Everything is rendered into a staging folder first; on any error the staging folder (and
    out_dir, if this call created it) is removed, so nothing half-written is left behind.
    """
    out = Path(out_dir)
    created, staging = _prepare(out)
    try:
        numbers = render(staging, **options)
        (staging / FILES["numbers"]).write_text(json.dumps(numbers, indent=2) + "\n")
        for name in FILES.values():
            os.replace(staging / name, out / name)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise
    shutil.rmtree(staging, ignore_errors=True)
    return {key: out / name for key, name in FILES.items()}
