"""`exactspec serve-bench`: the server under load, with drafting and without.

Two servers start as subprocesses on 127.0.0.1 (port 0): one with the drafting settings under
test (the defaults, `--draft auto --gamma auto`) and one without drafting (`--draft none`). The
real `openai` client (`AsyncOpenAI`, streaming chat completions) drives each at every concurrency
level with a bounded number of requests (`per_level` × concurrency), so the run stops by itself.
Both servers stay up for the whole run and take turns level by level (only one is busy at a time),
so a slow drift of the machine touches both alike. Each server first gets a warm-up: one wave of
`concurrency` requests per level, not measured (the models' first passes, and the γ controller's
timings for each batch size).

Measured per request: time to first token (from sending the request to the first chunk with
text), completion tokens (the usage chunk) and latency. Per level: total tokens/s = completion
tokens of all its requests / the level's wall time (first request sent to last one done), the
median over `repeats`; per-request tokens/s = completion tokens / latency (queueing and time to
first token included), the median over the level's requests; time to first token p50 and p95.
At temperature 0 the texts of each prompt are compared across both servers (`greedy_agree`).
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import statistics
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field

from exactspec.processes import LoggedProcess

# Chat prompts: half grounded (the answer copies much of the prompt: prompt lookup pays), half open.
DEFAULT_PROMPTS = [
    "Rewrite this sentence with 'cat' replaced by 'dog': The cat sat on the mat, and the cat "
    "looked at the other cat on the mat.",
    "Why is the sky blue?",
    "Copy this list in reverse order: apple, banana, cherry, date, elderberry, fig, grape.",
    "Write a short poem about the sea.",
    "Fix the typo and repeat the text: The quick brown fox jumps ovre the lazy dog near the river bank.",
    "Give three tips for learning a new language.",
    "Repeat this JSON with age set to 31: {\"name\": \"Ada\", \"age\": 30, \"city\": \"London\"}",
    "What is the capital of France, and what is it known for?",
]


@dataclass
class Mode:
    """One server's drafting settings."""

    name: str  # "drafting" or "plain"
    draft: str
    gamma: str


@dataclass
class RequestTiming:
    prompt: int  # index into the prompts
    ttft: float | None
    latency: float
    tokens: int
    text: str


@dataclass
class LevelResult:
    mode: str
    draft: str
    gamma: str
    concurrency: int
    requests: int
    completion_tokens: int
    wall_seconds: float
    total_tokens_per_s: float
    per_request_tokens_per_s: float
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    vs_plain: float | None = None  # total tokens/s / the plain server's at this concurrency
    runs_total_tokens_per_s: list[float] = field(default_factory=list)


class ServerProcess:
    """`exactspec serve` as a subprocess on 127.0.0.1, port 0: `wait_ready` returns its URL once
    /health answers 200; `close` stops it."""

    def __init__(self, target: str, mode: Mode, max_batch: int):
        self.url = None
        argv = [sys.executable, "-m", "exactspec", "serve", "--target", target, "--draft", mode.draft,
                "--gamma", mode.gamma, "--host", "127.0.0.1", "--port", "0",
                "--max-batch", str(max_batch), "--model-name", "bench"]
        self.process = LoggedProcess(argv, "exactspec-serve-")
        self.proc = self.process.proc

    def wait_ready(self, timeout: float = 600) -> str:
        deadline, url = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}): {self.process.tail()}")
            if url is None:
                found = re.search(r"listening on (http://\S+:\d+)", self.process.read())
                url = found.group(1) if found else None
            else:
                status, message = _health(url)
                if status == 200:
                    self.url = url
                    return url
                if "failed" in message:  # /health says why the models did not load
                    raise RuntimeError(f"the server could not start: {message}")
            time.sleep(0.1)
        raise RuntimeError(f"the server did not become ready in time: {self.process.tail()}")

    def close(self) -> None:
        self.process.stop()


def _health(url: str) -> tuple[int | None, str]:
    """GET /health: the status, and the error message of a 503 (the models loading, or failed)."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as response:
            return response.status, ""
    except urllib.error.HTTPError as err:
        try:
            return err.code, json.loads(err.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            return err.code, ""
    except OSError:
        return None, ""


async def _one(client, prompt_index: int, prompt: str, max_tokens: int,
               temperature: float) -> RequestTiming:
    started, first, tokens, parts = time.perf_counter(), None, 0, []
    stream = await client.chat.completions.create(
        model="bench", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=temperature, stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    latency = time.perf_counter() - started
    return RequestTiming(prompt_index, None if first is None else first - started, latency, tokens,
                         "".join(parts))


async def drive(url: str, prompts: list[str], concurrency: int, n_requests: int, max_tokens: int,
                temperature: float) -> tuple[list[RequestTiming], float]:
    """n_requests streamed chat completions, `concurrency` at a time (request i asks prompt
    i mod len(prompts)); returns each request's timing and the wall seconds of the whole level."""
    import openai

    queue = list(range(n_requests))[::-1]
    timings: list[RequestTiming] = []

    async def worker(client):
        while queue:
            i = queue.pop()
            k = i % len(prompts)
            timings.append(await _one(client, k, prompts[k], max_tokens, temperature))

    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                                  timeout=600) as client:
        started = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return sorted(timings, key=lambda t: t.prompt), wall


def _percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between order statistics; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    at = (len(ordered) - 1) * q / 100
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def summarize(mode: Mode, concurrency: int, runs: list[tuple[list[RequestTiming], float]]) -> LevelResult:
    """One level's figures from its runs (each: the requests' timings and the wall seconds)."""
    timings = [t for run, _ in runs for t in run]
    totals = [sum(t.tokens for t in run) / wall for run, wall in runs]
    ttfts = [t.ttft for t in timings if t.ttft is not None]
    return LevelResult(
        mode=mode.name, draft=mode.draft, gamma=mode.gamma, concurrency=concurrency,
        requests=len(timings), completion_tokens=sum(t.tokens for t in timings),
        wall_seconds=sum(wall for _, wall in runs), total_tokens_per_s=statistics.median(totals),
        per_request_tokens_per_s=statistics.median(t.tokens / t.latency for t in timings),
        ttft_p50_s=_percentile(ttfts, 50), ttft_p95_s=_percentile(ttfts, 95),
        runs_total_tokens_per_s=totals)


def run_serve_bench(target: str, *, draft: str = "auto", gamma: str = "auto",
                    concurrencies=(1, 4, 8), per_level: int = 8, max_tokens: int = 32,
                    repeats: int = 1, temperature: float = 0.0, prompts: list[str] | None = None,
                    max_batch: int | None = None, warmup: bool = True, log=None) -> dict:
    """Start a drafting and a plain server, drive both (see the module docstring), stop them.
    Returns {"settings", "levels": [LevelResult as dicts], "greedy_agree"}."""
    prompts = prompts or DEFAULT_PROMPTS
    modes = [Mode("drafting", draft, gamma), Mode("plain", "none", "auto")]
    max_batch = max_batch or max(concurrencies)
    runs: dict[tuple[str, int], list] = {(m.name, c): [] for m in modes for c in concurrencies}
    servers: dict[str, ServerProcess] = {}
    load = {"start": os.getloadavg()[0]}  # other work on the machine skews every figure
    try:
        for mode in modes:  # both load at once
            servers[mode.name] = ServerProcess(target, mode, max_batch)
        for mode in modes:
            servers[mode.name].wait_ready()
            if warmup:
                for c in concurrencies:  # one unmeasured wave per level
                    asyncio.run(drive(servers[mode.name].url, prompts, c, c, max_tokens, temperature))
        for repeat in range(repeats):
            for c in concurrencies:
                for mode in modes:
                    run = asyncio.run(drive(servers[mode.name].url, prompts, c, per_level * c,
                                            max_tokens, temperature))
                    runs[mode.name, c].append(run)
                    if log:
                        log(f"repeat {repeat + 1}/{repeats}, concurrency {c}, {mode.name}: "
                            f"{sum(t.tokens for t in run[0]) / run[1]:.1f} tokens/s")
        load["end"] = os.getloadavg()[0]
    finally:
        for server in servers.values():
            server.close()
    levels = [summarize(m, c, runs[m.name, c]) for c in concurrencies for m in modes]
    plain = {level.concurrency: level.total_tokens_per_s for level in levels if level.mode == "plain"}
    for level in levels:
        level.vs_plain = level.total_tokens_per_s / plain[level.concurrency]
    settings = dict(target=target, draft=draft, gamma=gamma, concurrencies=list(concurrencies),
                    requests_per_level=[per_level * c for c in concurrencies], max_tokens=max_tokens,
                    repeats=repeats, temperature=temperature, max_batch=max_batch,
                    prompts=len(prompts), warmup=warmup, cpus=os.cpu_count(),
                    load_average_1min=load)
    return {"settings": settings, "levels": [asdict(level) for level in levels],
            "greedy_agree": _greedy_agree(runs) if temperature == 0 else None}


def _greedy_agree(runs) -> dict:
    """At temperature 0: for how many prompts every request, on both servers, gave the same text."""
    texts: dict[int, set[str]] = {}
    for level_runs in runs.values():
        for timings, _ in level_runs:
            for t in timings:
                texts.setdefault(t.prompt, set()).add(t.text)
    return {"prompts": len(texts), "identical": sum(len(v) == 1 for v in texts.values())}
