"""Print the requirements of one of exactspec's extras, one per line, from pyproject.toml, for
`pip install --no-deps` (an extra's packages are otherwise installed with their dependencies).

    python scripts/extra.py pair
"""
import sys
import tomllib
from pathlib import Path

extras = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]
if len(sys.argv) != 2 or sys.argv[1] not in extras:
    sys.exit(f"usage: extra.py NAME, NAME one of {', '.join(extras)}; got {sys.argv[1:]}")
print("\n".join(extras[sys.argv[1]]))
