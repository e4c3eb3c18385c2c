"""Write markdown results tables from the JSON files that `exactspec bench --json FILE` writes.

    python scripts/benchmarks_doc.py RESULT.json [RESULT.json ...] [--date D] [--command C] > section.md

One section per file: what it ran on (machine, date, command, settings), then one table row per
result row, grouped by temperature and prompt kind as the bench prints them. A file from
`exactspec bench --batch-sizes` gives its batch table instead. The JSON records the machine and
the settings but not the date or the command line: give them with --date and --command (once for
every file, or once per file in the files' order); a section without them says so, and shows
flags that reproduce the recorded settings. Only the standard library is used, so the script
runs without the project's environment. Bad input is one line on stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MISSING = "–"  # an empty cell: the field is null or absent in the JSON


class DocError(Exception):
    """Bad input: printed as one line, exit status 2."""


# --------------------------------------------------------------------------- cells


def number(value, fmt: str) -> str:
    return MISSING if value is None else fmt.format(value)


def text(value) -> str:
    return MISSING if value is None else str(value).replace("|", "\\|")


def temperature(value) -> str:
    return MISSING if value is None else f"{value:g}"


def spread(row: dict) -> str:
    lo, hi = row.get("tokens_per_s_min"), row.get("tokens_per_s_max")
    return MISSING if lo is None or hi is None else f"{lo:.1f}–{hi:.1f}"


def same(row: dict) -> str:
    match = row.get("matches_autoregressive")
    return MISSING if match is None else ("yes" if match else "no")


def share(value) -> str:
    return MISSING if value is None else f"{100 * value:.1f} %"


# A column: (header, cell function of a row, None to show it always or the field that some row
# must have (not null) for it to be shown).
RUN_COLUMNS = [
    ("T", lambda r: temperature(r.get("temperature")), None),
    ("prompts", lambda r: text(r.get("prompts")), None),
    ("method", lambda r: text(r.get("method")), None),
    ("draft", lambda r: text(r.get("draft")), None),
    ("γ", lambda r: text(r.get("gamma")), None),
    ("verify", lambda r: text(r.get("verify")), None),
    ("tok/s", lambda r: number(r.get("tokens_per_s"), "{:.1f}"), None),
    ("min–max", spread, None),
    ("× plain", lambda r: number(r.get("speedup_vs_autoregressive"), "{:.2f}"), None),
    ("× HF generate", lambda r: number(r.get("speedup_vs_hf_generate"), "{:.2f}"),
     "speedup_vs_hf_generate"),
    ("× llama.cpp", lambda r: number(r.get("speedup_vs_llamacpp"), "{:.2f}"),
     "speedup_vs_llamacpp"),
    ("of ceiling", lambda r: number(r.get("share_of_ceiling") and 100 * r["share_of_ceiling"],
                                    "{:.0f} %"), "share_of_ceiling"),
    ("acc. rate", lambda r: number(r.get("acceptance_rate"), "{:.3f}"), None),
    ("tok/round", lambda r: number(r.get("tokens_per_round"), "{:.2f}"), None),
    ("mean γ", lambda r: number(r.get("mean_gamma"), "{:.1f}"), None),
    ("pass@1", lambda r: number(r.get("pass_at_1"), "{:.2f}"), "pass_at_1"),
    ("valid", lambda r: number(r.get("valid"), "{:.2f}"), "valid"),
    ("grammar share", lambda r: number(r.get("grammar_share"), "{:.2f}"), "valid"),  # json workload
    ("=plain", same, None),
]

BATCH_COLUMNS = [
    ("B", lambda r: text(r.get("batch_size")), None),
    ("T", lambda r: temperature(r.get("temperature")), None),
    ("method", lambda r: text(r.get("method")), None),
    ("draft", lambda r: text(r.get("draft")), None),
    ("γ", lambda r: text(r.get("gamma")), None),
    ("verify", lambda r: text(r.get("verify")), None),
    ("tok/s (all rows)", lambda r: number(r.get("tokens_per_s"), "{:.1f}"), None),
    ("× plain", lambda r: number(r.get("speedup"), "{:.2f}"), None),
    ("acc. rate", lambda r: number(r.get("acceptance_rate"), "{:.3f}"), None),
    ("tok/round/row", lambda r: number(r.get("tokens_per_round"), "{:.2f}"), None),
    ("padding fed", lambda r: share(r.get("padding_fed")), None),
    ("cache holes", lambda r: share(r.get("hole_fraction")), None),
]


def table(rows: list[dict], columns: list) -> list[str]:
    """A markdown table: one line per row; an optional column only when some row has its field."""
    shown = [c for c in columns if c[2] is None or any(r.get(c[2]) is not None for r in rows)]
    lines = ["| " + " | ".join(header for header, _, _ in shown) + " |",
             "| " + " | ".join("---" for _ in shown) + " |"]
    lines += ["| " + " | ".join(cell(r) for _, cell, _ in shown) + " |" for r in rows]
    return lines


def grouped(rows: list[dict]) -> list[dict]:
    """Rows grouped by (temperature, prompt kind) in the order the groups first appear, each
    group in the file's order: the order `exactspec bench` prints them in."""
    keys = list(dict.fromkeys((r.get("temperature"), r.get("prompts")) for r in rows))
    return [r for key in keys for r in rows if (r.get("temperature"), r.get("prompts")) == key]


# --------------------------------------------------------------------------- what it ran on


def machine_line(machine: dict) -> str:
    if not machine:
        return "not recorded in the JSON"
    cores = machine.get("cpu_cores_usable")
    parts = [f"{machine.get('cpu_model') or 'unknown CPU'}"
             + (f", {cores} of {machine.get('cpu_cores')} cores usable" if cores else "")]
    if machine.get("device") and machine["device"] != "cpu":
        parts.append(f"device {machine['device']} ({machine.get('device_name')})")
    if machine.get("torch_version"):
        parts.append(f"torch {machine['torch_version']} ({machine.get('torch_threads')} threads)")
    if machine.get("llama_cpp_threads"):
        parts.append(f"llama.cpp target on {machine['llama_cpp_threads']} threads")
    if machine.get("transformers_version"):
        parts.append(f"transformers {machine['transformers_version']}")
    if machine.get("python_version"):
        parts.append(f"Python {machine['python_version']}")
    parts.append(f"exactspec {machine.get('exactspec_git') or 'commit not recorded'}")
    start, end = machine.get("load_average_start"), machine.get("load_average_end")
    if start or end:
        parts.append(f"load average {_load(start)} → {_load(end)}")
    return "; ".join(parts)


def _load(value) -> str:
    return "/".join(f"{x:g}" for x in value) if value else "not recorded"


def settings_flags(config: dict) -> str:
    """`exactspec bench` flags that reproduce the recorded settings (not the command as typed)."""
    flags = ["exactspec bench"]
    if config.get("target"):
        flags.append(f"--target {config['target']}")
    if config.get("drafts"):
        flags.append("--draft " + " ".join(config["drafts"]))
    if config.get("gammas"):
        flags.append("--gammas " + ",".join(str(g) for g in config["gammas"]))
    if config.get("temperatures"):
        flags.append("--temperature " + " ".join(f"{t:g}" for t in config["temperatures"]))
    if config.get("verify"):
        flags.append("--verify " + ",".join(config["verify"]))
    if config.get("workload"):
        flags.append(f"--workload {config['workload']}")
    elif config.get("prompts_source") not in (None, "built-in"):
        flags.append(f"--prompts {config['prompts_source']}")
    for key, flag in (("max_new_tokens", "--max-new-tokens"), ("repeats", "--repeats"),
                      ("warmup", "--warmup")):
        if config.get(key) is not None:
            flags.append(f"{flag} {config[key]}")
    if config.get("peers") is False:
        flags.append("--no-peers")
    if config.get("llama_peers"):
        flags.append("--llama-peers")
    if config.get("hf_gammas"):
        flags.append("--hf-gammas " + ",".join(str(g) for g in config["hf_gammas"]))
    if config.get("batch_sizes"):
        flags.append("--batch-sizes " + ",".join(str(b) for b in config["batch_sizes"]))
    for key, flag, default in (("seed", "--seed", 0), ("seeds", "--seeds", 1),
                               ("top_k", "--top-k", None), ("top_p", "--top-p", None),
                               ("device", "--device", None), ("threads", "--threads", None),
                               ("background_load", "--background-load", 0)):
        if config.get(key, default) != default:
            flags.append(f"{flag} {config[key]}")
    return " ".join(flags)


def plural(n, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def run_line(result: dict) -> str:
    config = result.get("config") or {}
    prompts = config.get("prompts") or []
    parts = []
    if prompts:
        parts.append(f"{len(prompts)} prompts ({config.get('prompts_source', 'source not recorded')})")
    if config.get("max_new_tokens") is not None:
        parts.append(f"{config['max_new_tokens']} new tokens per prompt")
    if config.get("repeats") is not None:
        parts.append(f"median of {plural(config['repeats'], 'pass', 'passes')} after "
                     f"{plural(config.get('warmup'), 'warm-up pass', 'warm-up passes')}")
    if config.get("background_load"):
        parts.append(f"{config['background_load']} busy process(es) beside every row")
    if result.get("elapsed_seconds") is not None:
        minutes, seconds = divmod(round(result["elapsed_seconds"]), 60)
        parts.append(f"{minutes} min {seconds} s in all, model loading included")
    return "; ".join(parts) if parts else "not recorded in the JSON"


def ceiling_line(ceiling: dict) -> str:
    k = ceiling["k"]
    return (f"Ceiling: {ceiling['speedup']:.2f}× at k = {k} (T(1) {1e3 * ceiling['t_1_seconds']:.1f} ms, "
            f"T({k}) {1e3 * ceiling['t_k_seconds']:.1f} ms): max over k of k·T(1)/T(k), what a draft "
            f"that is always right and free would reach; \"of ceiling\" is × plain / ceiling")


def section(path: Path, result: dict, date: str | None, command: str | None) -> list[str]:
    """One file's section: its heading, what it ran on, and its table."""
    date = date or result.get("date")
    command = command or result.get("command")
    config = result.get("config") or {}
    lines = [f"### `{path.name}`", ""]
    lines.append(f"- Machine: {machine_line(result.get('machine') or {})}")
    lines.append(f"- Date: {date}" if date else
                 "- Date: not recorded in the JSON (give it with --date)")
    if command:
        lines.append(f"- Command: `{command}`")
    else:
        lines.append("- Command: not recorded in the JSON (give it with --command); flags that "
                     f"reproduce its settings: `{settings_flags(config)}`")
    lines.append(f"- Run: {run_line(result)}")
    if result.get("ceiling"):
        lines.append(f"- {ceiling_line(result['ceiling'])}")
    lines.append("")
    if "batch" in result:
        lines += table(result["batch"], BATCH_COLUMNS)
    else:
        lines += table(grouped(result["rows"]), RUN_COLUMNS)
    return lines


# --------------------------------------------------------------------------- --summary

NGRAM_TYPES = ("ngram-mod", "ngram-simple", "ngram-cache")  # llama-server's own n-gram drafts
SHORT = {"ngram": "lookup", "auto": "auto", "oracle": "oracle", "lookup-oracle": "lookup oracle"}


def label(row: dict) -> str | None:
    """The summary's column of a row, or None for the baseline (llama.cpp plain)."""
    method, draft = row.get("method"), row.get("draft") or ""
    if method == "autoregressive":
        return "exactspec plain"
    if method == "llamacpp":
        return None
    if method == "llama_server":
        if not draft:
            return "llama-server plain"
        return "best llama-server n-gram" if draft in NGRAM_TYPES else "best llama-server draft"
    short = SHORT.get("auto" if draft.startswith("auto:") else draft, draft.removeprefix("llamacpp:"))
    return f"{short}, γ {row.get('gamma')}"


def ratio(row: dict) -> float | None:
    value = row.get("speedup_vs_llamacpp")
    return row.get("speedup_vs_autoregressive") if value is None else value


def summary_cell(rows: list[dict]) -> str:
    """The best of a column's rows (several for a "best ..." column), its draft named when there
    were several, † when its greedy text differs from plain decoding's."""
    rows = [r for r in rows if ratio(r) is not None]
    if not rows:
        return MISSING
    best = max(rows, key=ratio)
    draft = str(best.get("draft")).removeprefix("llamacpp:")
    name = f" ({draft}" + (f", n-max {best['gamma']})" if best.get("gamma") else ")")
    mark = "†" if best.get("matches_autoregressive") is False else ""
    return f"{ratio(best):.2f}×{mark}" + (name if len(rows) > 1 else "")


def bound(plain: dict | None, ceiling: dict | None) -> str:
    """The most any draft could give end to end, in the summary's unit: exactspec plain's time
    over that time with its prefill as it was and its decode at the ceiling's speed, times
    exactspec plain's own ratio."""
    if not plain or not ceiling or plain.get("time_to_first_token") is None or ratio(plain) is None:
        return MISSING
    wall, first = plain["wall_seconds"], plain["time_to_first_token"]
    return f"{ratio(plain) * wall / (first + (wall - first) / ceiling['speedup']):.2f}×"


def summary(result: dict) -> list[str]:
    """One line per (prompts, temperature): llama.cpp plain's tokens/s, then each configuration
    as × llama.cpp plain (× exactspec plain without llama.cpp rows), and the end-to-end bound."""
    rows = result["rows"]
    columns = list(dict.fromkeys(label(r) for r in rows if label(r) is not None))
    keys = list(dict.fromkeys((r.get("temperature"), r.get("prompts")) for r in rows))
    lines = ["| prompts | T | llama.cpp plain tok/s | " + " | ".join(columns) + " | bound |",
             "| " + " | ".join("---" for _ in range(len(columns) + 4)) + " |"]
    for t, prompts in keys:
        group = [r for r in rows if (r.get("temperature"), r.get("prompts")) == (t, prompts)]
        base = next((r for r in group if r.get("method") == "llamacpp"), {})
        plain = next((r for r in group if r.get("method") == "autoregressive"), None)
        cells = [summary_cell([r for r in group if label(r) == c]) for c in columns]
        lines.append(f"| {text(prompts)} | {temperature(t)} | {number(base.get('tokens_per_s'), '{:.1f}')} | "
                     + " | ".join(cells) + f" | {bound(plain, result.get('ceiling'))} |")
    return lines


# --------------------------------------------------------------------------- command line


def read_result(path: Path) -> dict:
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise DocError(f"{path}: cannot read the file: {err.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DocError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(result, dict) or not isinstance(result.get("rows", result.get("batch")), list):
        raise DocError(f"{path}: not a file from `exactspec bench --json` "
                       f"(no list of 'rows' or 'batch')")
    return result


def per_file(values: list[str] | None, n: int, flag: str) -> list[str | None]:
    """--date / --command given never, once (for every file) or once per file."""
    if not values:
        return [None] * n
    if len(values) == 1:
        return values * n
    if len(values) != n:
        raise DocError(f"{flag} is given {len(values)} times for {n} files: give it once, or "
                       f"once per file")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Markdown results tables from `exactspec bench --json` files, on stdout.")
    parser.add_argument("files", nargs="+", type=Path, metavar="RESULT.json")
    parser.add_argument("--date", action="append", help="the day the run was made (once, or once per file)")
    parser.add_argument("--command", action="append",
                        help="the command that made the file (once, or once per file)")
    parser.add_argument("--summary", action="store_true",
                        help="one line per prompt kind and temperature, a column per configuration "
                             "(× llama.cpp plain), and the end-to-end bound")
    args = parser.parse_args(argv)
    try:
        dates = per_file(args.date, len(args.files), "--date")
        commands = per_file(args.command, len(args.files), "--command")
        if args.summary:
            sections = [summary(read_result(path)) for path in args.files]
        else:
            sections = [section(path, read_result(path), date, command)
                        for path, date, command in zip(args.files, dates, commands)]
    except DocError as err:
        print(f"benchmarks_doc: error: {err}", file=sys.stderr)
        return 2
    print("\n\n".join("\n".join(lines) for lines in sections))
    return 0


if __name__ == "__main__":
    sys.exit(main())
