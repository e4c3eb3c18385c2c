"""What `exactspec bench` prints: a table of rows per temperature and prompt kind, the summary,
the constraint's cost, the measured cost model, and the batch-throughput table."""
from __future__ import annotations

import statistics

from exactspec.cli.common import print_table


RUN_COLUMNS = [  # (header, field, format)
    ("method", "method", "{}"), ("draft", "draft", "{}"), ("γ", "gamma", "{}"),
    ("verify", "verify", "{}"), ("tok/s", "tokens_per_s", "{:.1f}"),
    ("min-max", "spread", "{}"), ("ms/tok", "ms_per_token", "{:.1f}"),
    ("TTFT ms", "ttft_ms", "{:.0f}"), ("acc.rate", "acceptance_rate", "{:.3f}"),
    ("α", "alpha", "{:.3f}"), ("tok/round", "tokens_per_round", "{:.2f}"),
    ("ms/round", "ms_per_round", "{:.0f}"), ("mean γ", "mean_gamma", "{:.1f}"),
    ("rounds", "sources", "{}"), ("×AR", "speedup_vs_autoregressive", "{:.2f}"),
    ("of ceiling", "share_of_ceiling", "{:.0%}"),
    ("×AR decode", "decode_speedup_vs_autoregressive", "{:.2f}"),
    ("×HF", "speedup_vs_hf_generate", "{:.2f}"), ("×llama.cpp", "speedup_vs_llamacpp", "{:.2f}"),
    ("pass@1", "pass_at_1", "{:.2f}"), ("valid", "valid", "{:.2f}"),
    ("grammar", "grammar_share", "{:.2f}"), ("mask ms/tok", "constraint_ms_per_token", "{:.2f}"),
    ("=AR", "same", "{}"),
]

COST_COLUMNS = [
    ("γ", "gamma", "{}"), ("E[N]", "expected_tokens", "{:.2f}"),
    ("tok/round token", "measured_tokens_per_round_token", "{:.2f}"),
    ("tok/round block", "measured_tokens_per_round_block", "{:.2f}"),
    ("pred ms/round", "predicted_ms_per_round", "{:.0f}"),
    ("meas ms/round", "measured_ms_per_round_token", "{:.0f}"),
    ("predicted", "predicted_speedup", "{:.2f}"),
    ("measured token", "measured_speedup_token", "{:.2f}"),
    ("measured block", "measured_speedup_block", "{:.2f}"),
    ("decode token", "measured_decode_speedup_token", "{:.2f}"),
    ("meas/pred", "measured_over_predicted_token", "{:.2f}"),
]


def _display_row(row: dict) -> dict:
    out = dict(row)
    lo, hi = row.get("tokens_per_s_min"), row.get("tokens_per_s_max")
    out["spread"] = f"{lo:.1f}-{hi:.1f}" if lo is not None and hi is not None else None
    ttft = row.get("time_to_first_token")
    out["ttft_ms"] = None if ttft is None else 1e3 * ttft
    same = row.get("matches_autoregressive")
    out["same"] = None if same is None else ("yes" if same else "NO")
    by_source = row.get("rounds_by_source") if row["method"] == "speculative" else None
    out["sources"] = " ".join(f"{k}:{n}" for k, n in by_source.items()) if by_source else None
    return out


def _named(row: dict) -> str:
    parts = [row["method"], row["draft"], None if row["gamma"] is None else f"γ={row['gamma']}",
             row["verify"]]
    return f"{' '.join(p for p in parts if p)} {row['tokens_per_s']:.1f} tok/s"


def print_summary(summary: list[dict]) -> None:
    """One line per (temperature, prompt kind): exactspec's best prompt lookup against
    Transformers' best, each γ = auto row against plain decoding and against the best fixed γ."""
    print("\nSummary (tokens/s ratios):")
    for item in summary:
        parts = []
        ours, peer = item["best_lookup"], item["best_hf_lookup"]
        if ours:
            versus = (f" = {item['lookup_over_hf_lookup']:.2f}x best Transformers lookup "
                      f"({_named(peer)})" if peer and item["lookup_over_hf_lookup"] else "")
            vs_ar = ours["speedup_vs_autoregressive"]
            ar = f" ({vs_ar:.2f}x autoregressive)" if vs_ar is not None else ""
            parts.append(f"best lookup {_named(ours)}{ar}{versus}")
        autos = [f"{a['draft']} {a['verify']} {a['speedup_vs_autoregressive']:.2f}x"
                 for a in item["gamma_auto"] if a["speedup_vs_autoregressive"] is not None]
        if autos:
            parts.append("γ=auto vs autoregressive: " + ", ".join(autos))
        sweeps = [_sweep_text(s) for s in item["gamma_sweep"]]
        if sweeps:
            parts.append("γ=auto vs best fixed γ: " + ", ".join(sweeps))
        parts += _peer_text(item.get("peers") or {})
        print(f"  T = {item['temperature']:g}, {item['prompts']}: " + ("; ".join(parts) or "-"))


def _peer_text(peers: dict) -> list[str]:
    """exactspec's fastest row against each peer (`bench.summary.peer_summary`), as summary parts."""
    best = peers.get("best")
    if not best:
        return []
    parts = [f"fastest exactspec {_named(best)}"]
    for key, name in (("over_autoregressive", "plain PyTorch"), ("over_hf_assisted", "best HF assisted"),
                      ("over_llamacpp", "llama.cpp plain"), ("over_llama_server", "best llama-server")):
        if peers.get(key):
            parts.append(f"{peers[key]:.2f}x {name}")
    for same in peers.get("same_draft", []):
        parts.append(f"with the same draft {same['draft']}: {same['ratio']:.2f}x HF assisted "
                     f"({_named(same['ours'])} vs {_named(same['hf_assisted'])})")
    for row in peers.get("pass_at_1", []):
        lo, hi = row["minus_plain"] or (None, None)
        spread = f" (minus plain's: 95% interval {lo:+.2f} to {hi:+.2f})" if lo is not None else ""
        parts.append(f"pass@1 {row['draft']} {row['pass_at_1']:.2f}{spread}")
    return parts


def print_constraint_cost(result: dict) -> None:
    """The constraint's own cost per token (llguidance's masks, forced tokens) against a target
    pass over one token, and how many tokens the grammar drafted."""
    t1 = next((item["seconds"] for item in result["costmodel"]["timings"]["target"]
               if item["tokens"] == 1), None)
    rows = [r for r in result["rows"] if r.get("constraint_ms_per_token") is not None]
    if not rows or not t1:
        return
    cost = statistics.median(r["constraint_ms_per_token"] for r in rows)
    share = max(rows, key=lambda r: r.get("grammar_share") or 0)
    print(f"\nConstraint: {cost:.2f} ms per output token in the matchers (median over rows) = "
          f"{cost / (1e3 * t1):.1%} of a one-token target pass ({1e3 * t1:.1f} ms); at most "
          f"{share['grammar_share']:.0%} of a row's tokens were grammar-forced drafts kept "
          f"({share['method']} {share['draft']}, T = {share['temperature']:g})")


def print_ceiling(result: dict) -> None:
    """The machine's ceiling (`bench.ceiling`), how the share column reads, and the oracle rows."""
    from exactspec.bench.ceiling import LOOKUP_ORACLE, LOOKUP_ORACLE_LABEL, ORACLE, ORACLE_LABEL

    ceiling = result.get("ceiling")
    if not ceiling:
        return
    k = ceiling["k"]
    print(f"ceiling: {ceiling['speedup']:.2f}× at k = {k} (T(1) {1e3 * ceiling['t_1_seconds']:.1f} "
          f"ms, T({k}) {1e3 * ceiling['t_k_seconds']:.1f} ms): max over k of k·T(1)/T(k), the target's "
          f"pass over k tokens on a {ceiling['context_tokens']}-token cache; "
          f"'of ceiling' = ×AR / ceiling")
    oracle = next((r for r in result["rows"] if r["draft"] == ORACLE), None)
    if oracle is not None:
        print(f"{ORACLE_LABEL}: its drafts are each prompt's plain greedy tokens, γ = "
              f"{oracle['gamma']}, at T = 0: every draft kept")
    if any(r["draft"] == LOOKUP_ORACLE for r in result["rows"]):
        print(f"{LOOKUP_ORACLE_LABEL}: prompt lookup's drafts cut to those kept, each round at the "
              f"pass size that costs least per token: the most prompt lookup can give here")


def _sweep_text(sweep: dict) -> str:
    interval = sweep["interval"]
    spread = (f", 90% interval {interval[0]:.2f}-{interval[1]:.2f}" if interval else "")
    ratio = sweep["auto_over_best"]
    return (f"{sweep['draft']} {sweep['verify']} {'-' if ratio is None else f'{ratio:.2f}x'} "
            f"(best γ={sweep['best_gamma']}{spread}, {sweep['generations']} generations)")


def print_result(result: dict) -> None:
    config, machine = result["config"], result["machine"]
    eos = ("at most; EOS on: each reply ends with its JSON" if any(p.get("schema") for p in config["prompts"])
           else "EOS off")
    print(f"exactspec bench: target {config['target']}, {config['max_new_tokens']} new tokens "
          f"per prompt ({eos}), {len(config['prompts'])} prompts ({config['prompts_source']}), "
          f"median of {config['repeats']} passes after {config['warmup']} warm-up")
    print(f"machine: {machine['cpu_model']}, {machine['cpu_cores_usable']} cores usable, "
          f"torch {machine['torch_version']} ({machine['torch_threads']} threads), "
          + (f"llama.cpp target on {machine['llama_cpp_threads']} threads, "
             if machine.get("llama_cpp_threads") else "")
          + f"transformers {machine['transformers_version']}, device {machine['device']}; "
          f"load average {machine.get('load_average_start')} -> {machine.get('load_average_end')}"
          + (f"; {config['background_load']} busy process(es) beside every row"
             if config.get("background_load") else ""))
    print_ceiling(result)
    groups = list(dict.fromkeys((r["temperature"], r["prompts"]) for r in result["rows"]))
    for temperature, kind in groups:
        rows = [_display_row(r) for r in result["rows"]
                if (r["temperature"], r["prompts"]) == (temperature, kind)]
        seeds = f" × {config['seeds']} seeds" if config["seeds"] > 1 else ""
        print(f"\nT = {temperature:g}, {kind} prompts ({rows[0]['n_prompts']} prompts{seeds}, "
              f"{rows[0]['output_tokens']} tokens per pass)")
        optional = {"pass_at_1", "valid", "grammar_share", "constraint_ms_per_token"}  # workloads' columns
        print_table(rows, [c for c in RUN_COLUMNS if c[1] not in optional
                           or any(r.get(c[1]) is not None for r in rows)])
    if any(p.get("schema") for p in config["prompts"]):
        print_constraint_cost(result)
    if result.get("summary"):
        print_summary(result["summary"])
    cm = result["costmodel"]
    timings = cm["timings"]
    t_target = {item["tokens"]: item["seconds"] for item in timings["target"]}
    blocks = ", ".join(f"{n}: {1e3 * s:.1f}" for n, s in sorted(t_target.items()))
    print(f"\nMeasured cost model (forward pass on a {timings['context_tokens']}-token cache, "
          f"ms): target by tokens per pass {blocks}")
    for spec, d in timings["drafts"].items():
        print(f"  draft {spec}: {1e3 * d['seconds_per_token']:.3f} ms per token "
              f"({d['measured_as']})")
    for c in cm["curves"]:
        alpha = "-" if c["alpha"] is None else f"{c['alpha']:.3f}"
        best = ("-" if c["best_gamma"] is None else
                f"{c['best_gamma']} (predicted {c['best_predicted_speedup']:.2f}x)")
        print(f"\nT = {c['temperature']:g}, {c['prompts']} prompts, draft {c['draft']}: "
              f"α = {alpha} (from {c['verified_positions']} verified positions, "
              f"{c['alpha_from']} rule), c = {c['c']:.3f}; recommended γ = {best}")
        print_table(c["points"], COST_COLUMNS)


BATCH_COLUMNS = [
    ("B", "batch_size", "{}"), ("T", "temperature", "{:g}"), ("method", "method", "{}"),
    ("draft", "draft", "{}"), ("γ", "gamma", "{}"), ("verify", "verify", "{}"),
    ("tok/s (all rows)", "tokens_per_s", "{:.1f}"), ("×AR", "speedup", "{:.2f}"),
    ("acc.rate", "acceptance_rate", "{:.3f}"), ("tok/round/row", "tokens_per_round", "{:.2f}"),
    ("padding fed", "padding_fed", "{:.1%}"), ("cache holes", "hole_fraction", "{:.1%}"),
]
