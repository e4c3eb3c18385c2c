"""The measured cost model as a figure: predicted speedup curves against γ, with the measured
speedups on top. Rows with γ = "auto" or the auto draft have no curve (`curves.build_costmodel`)."""
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


def plot_rows(result: dict, path: str | os.PathLike) -> None:
    """Tokens/s of every row as horizontal bars, one panel per (temperature, prompt kind),
    coloured by who runs it (exactspec, Transformers, llama.cpp), each bar labelled with its
    speedup over plain PyTorch decoding and its pass@1 where the workload has one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    panels = list(dict.fromkeys((r["temperature"], r["prompts"]) for r in rows))
    who = {"autoregressive": "exactspec", "speculative": "exactspec", "hf_generate": "Transformers",
           "hf_assisted": "Transformers", "llamacpp": "llama.cpp", "llama_server": "llama.cpp"}
    colours = dict(zip(("exactspec", "Transformers", "llama.cpp"),
                       plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    height = max(len([r for r in rows if (r["temperature"], r["prompts"]) == p]) for p in panels)
    fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels), 0.38 * height + 1.6),
                             squeeze=False)
    for ax, (temperature, kind) in zip(axes.flat, panels):
        group = [r for r in rows if (r["temperature"], r["prompts"]) == (temperature, kind)]
        labels = [" ".join(str(x) for x in (r["method"], r["draft"] or "",
                                              "" if r["gamma"] is None else f"γ={r['gamma']}") if x)
                  for r in group]
        rates = [r["tokens_per_s"] or 0.0 for r in group]
        ax.barh(range(len(group)), rates, color=[colours[who[r["method"]]] for r in group])
        for i, r in enumerate(group):
            notes = [f"{r['speedup_vs_autoregressive']:.2f}×" if r["speedup_vs_autoregressive"] else "",
                     f"pass@1 {r['pass_at_1']:.2f}" if r.get("pass_at_1") is not None else ""]
            ax.text(rates[i], i, "  " + "  ".join(n for n in notes if n), va="center", fontsize=7)
        ax.set_yticks(range(len(group)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlim(0, 1.3 * max(rates + [1e-9]))
        ax.set_xlabel("tokens/s (median of passes)")
        ax.set_title(f"T = {temperature:g}, {kind} prompts", fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    fig.legend(handles, list(colours), loc="lower center", ncol=3, fontsize=8)
    fig.suptitle(f"target {result['config']['target']}: tokens/s, × plain PyTorch decoding", fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=130, format="png"))
    plt.close(fig)
