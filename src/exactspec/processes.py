"""A child process whose output goes to a temporary log: what the benchmarks' servers run as."""
from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile


class LoggedProcess:
    """`argv` started with stdout and stderr in a temporary log file (prefix names it); `read`
    and `tail` show the log, `stop` ends the process (terminate, then kill after 30 s) and
    removes the log."""

    def __init__(self, argv: list[str], prefix: str):
        self.log = tempfile.NamedTemporaryFile("w+", prefix=prefix, suffix=".log", delete=False)
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self.log,
                                     stderr=subprocess.STDOUT, text=True)

    def read(self) -> str:
        self.log.flush()
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def tail(self, lines: int = 3) -> str:
        """The last non-blank lines of the log, joined by " | "."""
        kept = [line for line in self.read().splitlines() if line.strip()]
        return " | ".join(kept[-lines:]) or "no output"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        with contextlib.suppress(OSError):
            os.unlink(self.log.name)
