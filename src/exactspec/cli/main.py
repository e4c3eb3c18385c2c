"""The `exactspec` command: `generate | demo | bench | figures | lab | serve`.

Each command lives in its own module with `register(subparsers)`; every command's handler
receives the parsed arguments. Bad input (a `ValueError`, `OSError` or `CliError`) becomes a
one-line message on stderr and exit status 2: no traceback.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from exactspec.cli.common import CliError

COMMAND_MODULES = ("exactspec.cli.generate", "exactspec.cli.lab", "exactspec.cli.bench",
                   "exactspec.cli.serve")


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
