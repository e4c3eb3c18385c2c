"""What every command shares: the one-line error, option parsing, tables, JSON and prompt files."""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from pathlib import Path


class CliError(Exception):
    """A problem with the user's input, printed as one line."""


TARGET_HELP = ("target model spec NAME_OR_PATH[@DTYPE], or llamacpp:NAME_OR_PATH (a GGUF run by "
               "llama.cpp) (default: %(default)s)")


def command(subparsers, name: str, summary: str, description: str, target: str):
    """A subcommand's parser with its --target option (default `target`)."""
    parser = subparsers.add_parser(name, help=summary, description=description)
    parser.add_argument("--target", default=target, help=TARGET_HELP)
    return parser


def start_tp(option: str = "--tp", target: str = "") -> int:
    """Join torchrun's process group for a tensor-parallel target; return the number of ranks.
    Only rank 0 prints: the other ranks' stdout goes to /dev/null (their errors still reach
    stderr). A CliError naming the option when torchrun did not start this process, or when the
    target is a llama.cpp one (it has no torch weights to split)."""
    from exactspec import distributed
    from exactspec.drafters import is_llamacpp_spec

    if is_llamacpp_spec(target):
        raise CliError(f"{option}: tensor parallelism splits a torch target's weights; the llama.cpp "
                       f"target {target!r} cannot be split (drop {option})")

    try:
        distributed.init()
    except ValueError as err:
        raise CliError(f"{option}: {err}") from None
    if not distributed.is_leader():
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the life of the process)
    return distributed.world()[1]


def parse_int(option: str, text, minimum: int) -> int:
    """An integer option >= minimum, or a CliError naming the option and the value."""
    kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
    try:
        value = int(str(text).strip())
    except ValueError:
        raise CliError(f"{option} must be {kind}, got {text}") from None
    if value < minimum:
        raise CliError(f"{option} must be {kind}, got {text}")
    return value


def parse_float(option: str, text, low: float, high: float = math.inf, low_open: bool = False) -> float:
    """A finite float option in [low, high] (or (low, high] with low_open), or a CliError naming
    the option and the value."""
    if low_open:
        where = f"in ({low:g}, {high:g}]"
    else:
        where = f"in [{low:g}, {high:g}]" if math.isfinite(high) else f">= {low:g}"
    try:
        value = float(str(text).strip())
    except ValueError:
        value = math.nan
    bad_low = value <= low if low_open else value < low
    if not math.isfinite(value) or bad_low or value > high:
        raise CliError(f"{option} must be a number {where}, got {text}")
    return value


def output_path(option: str, path: str | None) -> str | None:
    """Refuse an output path whose folder is missing or read-only before any long work runs."""
    if path is None:
        return None
    folder = Path(path).expanduser().resolve().parent
    if folder.exists() and not folder.is_dir():
        raise CliError(f"{option}: {str(folder)!r} is not a folder")
    if not folder.is_dir():
        raise CliError(f"{option}: the folder {str(folder)!r} does not exist")
    if not os.access(folder, os.W_OK):
        raise CliError(f"{option}: the folder {str(folder)!r} is not writable")
    return path


@contextlib.contextmanager
def trace_writer(path: str | None):
    """With --trace FILE: a callable that writes each round's trace line (`engine.trace_line`,
    with any fields the caller adds) to FILE as the round ends, else None; a run that fails
    leaves no FILE behind."""
    if not path:
        yield None
        return
    try:
        file = open(path, "w", encoding="utf-8")
    except OSError as err:
        raise CliError(f"--trace: {err}") from None
    try:
        with file:
            yield lambda line: file.write(json.dumps(line, ensure_ascii=False) + "\n")
    except BaseException:
        Path(path).unlink(missing_ok=True)
        raise


def print_json(obj) -> None:
    json.dump(obj, sys.stdout, indent=2, default=float)
    sys.stdout.write("\n")


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """Print `rows` as an aligned text table; columns are (header, field, format), e.g.
    ("tok/s", "tokens_per_s", "{:.1f}"). A missing or None field prints as "-"."""
    cells = [[fmt.format(row[field]) if row.get(field) is not None else "-"
              for _, field, fmt in columns] for row in rows]
    headers = [header for header, _, _ in columns]
    widths = [max(len(h), *(len(row[i]) for row in cells)) for i, h in enumerate(headers)]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def read_prompts(path: str | os.PathLike, option: str = "--prompts") -> list[dict]:
    """Prompts from a JSONL file: one object per line with "prompt" (a non-empty string) and
    optional "kind" (default "custom") and "name" (default "line N"). Blank lines are skipped.
    Raises CliError with one line naming the file and the line."""
    where = f"{option} {os.fspath(path)}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise CliError(f"{where}: cannot read the file: {reason}") from None
    prompts = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            prompts.append(_prompt_line(line, number, where))
    if not prompts:
        raise CliError(f"{where}: the file has no prompts")
    return prompts


def _prompt_line(line: str, number: int, where: str) -> dict:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise CliError(f"{where} line {number}: not valid JSON ({err.msg})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"].strip():
        raise CliError(f"{where} line {number}: expected an object with a non-empty "
                       f'"prompt" string, e.g. {{"prompt": "Tell me a story."}}')
    kind, name = obj.get("kind", "custom"), obj.get("name", f"line {number}")
    if not isinstance(kind, str) or not kind.strip() or not isinstance(name, str):
        raise CliError(f'{where} line {number}: "kind" and "name" must be strings')
    return {"prompt": obj["prompt"], "kind": kind.strip(), "name": name}
