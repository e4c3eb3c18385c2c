"""Writing files so that a crash never leaves a half-written one (the clear-errors rule)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """Call write(tmp) on a temporary sibling of `path`, then rename it into place: the rename is
    the commit, so `path` is either the old file or the whole new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
