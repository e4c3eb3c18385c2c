"""The `exactspec` command: `generate | demo | bench | figures | lab`.

Each command lives in its own module with `register(subparsers)`; every command's handler
receives the parsed arguments. Bad input (a `ValueError`, `OSError` or `CliError`) becomes a
one-line message on stderr and exit status 2: no traceback.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

COMMAND_MODULES = ("exactspec.cli_generate", "exactspec.cli_lab", "exactspec.cli_bench")


class CliError(Exception):
    """A problem with the user's input, printed as one line."""


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def print_json(obj) -> None:
    json.dump(obj, sys.stdout, indent=2, default=float)
    sys.stdout.write("\n")


def print_table(rows: list[dict], columns: list[str], formats: dict | None = None) -> None:
    """Print `rows` as an aligned text table with the given columns."""
    formats = formats or {}
    cells = [[formats.get(c, "{}").format(r[c]) if r.get(c) is not None else "-" for c in columns]
             for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="exactspec",
        description="Speculative decoding that keeps the target's output distribution exactly.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name != name:
                raise
            continue
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except BrokenPipeError:  # the reader went away (`exactspec ... | head`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (CliError, ValueError, OSError) as err:
        print(f"exactspec {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"exactspec {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
