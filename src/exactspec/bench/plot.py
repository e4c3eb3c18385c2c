"""The measured cost model as a figure: predicted speedup curves against γ, with the measured
speedups on top. Rows with γ = "auto" or the auto draft have no curve (`report.build_costmodel`)."""
from __future__ import annotations

import os

from exactspec.files import atomic_write


def plot_costmodel(result: dict, path: str | os.PathLike) -> None:
    """Predicted speedup curves (lines) and measured speedups (markers: ● token, ✕ block) per γ,
    one panel per (temperature, prompt kind), one colour per draft. Written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = result["costmodel"]["curves"]
    panels = list(dict.fromkeys((c["temperature"], c["prompts"]) for c in curves))
    if not panels:
        raise ValueError("result has no cost-model curves to plot: they need speculative rows "
                         "with an integer γ and a draft other than auto")
    drafts = list(dict.fromkeys(c["draft"] for c in curves))
    colours = dict(zip(drafts, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4))
    cols = len({k for _, k in panels})
    rows_n = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.8 * cols, 3.6 * rows_n), squeeze=False)
    for ax, (temperature, kind) in zip(axes.flat, panels):
        for c in (c for c in curves if (c["temperature"], c["prompts"]) == (temperature, kind)):
            pts = c["points"]
            colour = colours[c["draft"]]
            alpha = f"α={c['alpha']:.2f}" if c["alpha"] is not None else "α=?"
            ax.plot([p["gamma"] for p in pts], [p["predicted_speedup"] for p in pts], "-",
                    color=colour, label=f"{c['draft']} ({alpha}, c={c['c']:.2f})")
            for verify, marker in (("token", "o"), ("block", "x")):
                meas = [(p["gamma"], p[f"measured_speedup_{verify}"]) for p in pts
                        if p[f"measured_speedup_{verify}"] is not None]
                if meas:
                    ax.plot(*zip(*meas), marker, color=colour, markersize=7, linestyle="none")
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
        ax.set_title(f"T = {temperature:g}, {kind} prompts")
        ax.set_xlabel("γ (draft tokens per round)")
        ax.set_ylabel("speedup over autoregressive")
        ax.legend(fontsize=7, title="line: predicted; ● token, ✕ block: measured",
                  title_fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(f"Measured cost model: {result['config']['target']} on "
                 f"{result['machine']['device_name']}", fontsize=9)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)
