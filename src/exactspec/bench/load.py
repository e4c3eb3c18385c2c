"""A reproducible competing load: N busy processes for the length of a benchmark run.

Each is a Python loop in its own process (`python -c`), so it takes a core as any CPU-bound
neighbour would (a compiler, another job). It is bounded twice: it stops when the `with` block
ends, and on its own after `limit_s` seconds or when its parent is gone, so a crashed benchmark
leaves nothing spinning.
"""
from __future__ import annotations

import os
import subprocess
import sys

MAX_LOAD = 64  # more busy processes than any machine here has cores is a typo
_SPIN = ("import os, time\n"
         "end = time.monotonic() + {limit}\n"
         "while time.monotonic() < end and os.getppid() == {parent}:\n"
         "    for _ in range(100_000):\n"
         "        pass\n")


def check_load(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_LOAD:
        raise ValueError(f"background_load must be an integer in [0, {MAX_LOAD}], got {n!r}")
    return n


class BackgroundLoad:
    """`with BackgroundLoad(n):` runs n busy processes inside the block (n = 0: none)."""

    def __init__(self, n: int, limit_s: float = 6 * 3600):
        self.n, self.limit_s = check_load(n), limit_s
        self.processes: list[subprocess.Popen] = []

    def __enter__(self) -> "BackgroundLoad":
        code = _SPIN.format(limit=self.limit_s, parent=os.getpid())
        self.processes = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL)
                          for _ in range(self.n)]
        return self

    def __exit__(self, *exc) -> None:
        for process in self.processes:
            process.kill()
        for process in self.processes:
            process.wait()
        self.processes = []

    def running(self) -> int:
        return sum(process.poll() is None for process in self.processes)
