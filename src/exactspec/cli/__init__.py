"""The `exactspec` command; `main` parses the arguments and runs one command."""
from exactspec.cli.main import main

__all__ = ["main"]
