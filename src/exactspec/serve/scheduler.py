"""The engine thread: continuous batching of requests over one `Decoder`.

One background thread owns the models. Each loop: cancelled rows leave; waiting requests are
admitted (a new Decoder when none runs, else they `join` at this round boundary, after their own
prefill); one round runs over the batch (`driver.Driver`: the γ of the rows whose gamma is "auto"
comes from one `BatchController` per drafter for as long as the server runs, from past rounds
only); finished rows leave. Tokens reach the request handlers
through `loop.call_soon_threadsafe` onto each request's asyncio queue, as
(index, "tokens", ids, logprobs) events (logprobs: one `TokenLogprob` per id where the request
asked, else None) and one final (index, "done", finish_reason) or (index, "error", message); index
is the job's choice of its request (a request with `n` choices is n jobs sharing one queue).
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from exactspec.batch_controller import BatchController
from exactspec.batching import RowSettings
from exactspec.driver import Driver
from exactspec.engine import Decoder, pad_prompts
from exactspec.models.llamacpp import torch_on_one_thread
from exactspec.sampling import SamplingConfig

log = logging.getLogger("exactspec.serve")


class QueueFull(Exception):
    """The waiting queue is full (the server answers 429)."""


@dataclass(eq=False)
class Job:
    """One request in the engine: its prompt ids, its settings, and where its events go."""

    prompt: list[int]
    settings: RowSettings
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    created: float = field(default_factory=time.perf_counter)
    stats: object = None  # the row's DecodeStats once admitted (read for the response's metrics)
    cancelled: bool = False
    index: int = 0  # which choice of its request this row is: every event it sends starts with it

    def send(self, *event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (self.index, *event))


class Scheduler:
    """Queue, admission, the round loop and cancellation; `submit` and `cancel` are thread-safe."""

    decoder_type = Decoder  # a tensor-parallel server's leader sends each step to its followers

    def __init__(self, target, make_drafter, *, eos_ids: list[int], max_batch: int,
                 max_queue: int, context: int | None, metrics=None):
        self.target, self.make_drafter, self.eos = target, make_drafter, eos_ids
        self.policies: dict[str, BatchController] = {}  # by drafter name; rows carry their own γ
        self.driver: Driver | None = None  # the running decoder's
        self.max_batch, self.max_queue, self.context, self.metrics = max_batch, max_queue, context, metrics
        self.waiting: collections.deque[Job] = collections.deque()
        self.running: dict[int, Job] = {}  # row index in the decoder → job
        self.to_cancel: set[Job] = set()
        self.decoder: Decoder | None = None
        self.lock = threading.Condition()
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="exactspec-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        with self.lock:
            self.stopping = True
            self.lock.notify()
        self.thread.join(timeout=30)

    def submit(self, *jobs: Job) -> None:
        """Queue a request's jobs (one per choice), all or none: each waits for a row."""
        with self.lock:
            if len(self.waiting) + len(jobs) > self.max_queue:
                raise QueueFull(f"the server's queue is full ({self.max_queue} rows waiting at "
                                f"most, {len(self.waiting)} now, {len(jobs)} asked); retry later")
            self.waiting.extend(jobs)
            self._gauges()
            self.lock.notify()

    def cancel(self, *jobs: Job) -> None:
        """The client went away (or a stop string ended a choice): the jobs' rows leave together
        at the next boundary."""
        with self.lock:
            for job in jobs:
                job.cancelled = True
                if job in self.waiting:
                    self.waiting.remove(job)
                else:
                    self.to_cancel.add(job)
            self._gauges()
            self.lock.notify()

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.waiting.set(len(self.waiting))
            self.metrics.running.set(len(self.running))

    # ------------------------------------------------------------------ the engine thread

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        # a llama.cpp target wants torch on one thread, out of its decode's way (`exactspec.targets`)
        llama = getattr(self.target, "backend", "torch") == "llamacpp"
        with torch_on_one_thread() if llama else contextlib.nullcontext():
            self._loop()
        self._fail_all("the server is shutting down")

    def _loop(self) -> None:
        while True:
            with self.lock:
                while not (self.stopping or self.waiting or self.running or self.to_cancel):
                    self.lock.wait()
                if self.stopping:
                    break
                gone, self.to_cancel = self.to_cancel, set()
                admit = self._admissible()
            try:
                with torch.inference_mode():
                    self._cancel(gone)
                    self._admit(admit)
                    self._round()
            except Exception as err:  # a failed round ends every request in it, not the server
                log.exception("engine round failed")
                self._fail_all(f"the engine failed: {type(err).__name__}: {err}")
            with self.lock:
                self._gauges()

    def _admissible(self) -> list[Job]:
        """Waiting jobs that fit in the batch now (a new batch: as many as fit its context)."""
        room = self.max_batch - len(self.running)
        fresh = self.decoder is None or self.decoder.done
        admit = []
        while self.waiting and len(admit) < room:
            job = self.waiting[0]
            if fresh and admit and not self._fits(admit + [job]):
                break
            admit.append(self.waiting.popleft())
        return admit

    def _fits(self, jobs: list[Job]) -> bool:
        """A new Decoder checks the padded width + the largest budget against the context."""
        width = max(len(j.prompt) for j in jobs) + max(j.settings.max_new_tokens for j in jobs)
        return self.context is None or width <= self.context

    def _cancel(self, jobs: set[Job]) -> None:
        rows = [row for row, job in self.running.items() if job in jobs]
        if rows and self.decoder is not None and not self.decoder.done:
            self.decoder.cancel(rows)
        for row in rows:
            self.running.pop(row).send("done", "cancelled")
            if self.metrics is not None:
                self.metrics.cancelled.inc()

    def _admit(self, jobs: list[Job]) -> None:
        if not jobs:
            return
        ids, mask = pad_prompts([torch.tensor(job.prompt) for job in jobs])
        settings = [job.settings for job in jobs]
        if self.decoder is None or self.decoder.done:
            self.running.clear()
            self.decoder = self.decoder_type(
                self.target, self.make_drafter(), ids, mask,
                max_new_tokens=max(s.max_new_tokens for s in settings), sampling=SamplingConfig(),
                seed=None, eos_token_id=self.eos, verify="block", on_tokens=self._on_tokens)
            self.decoder.use_row_settings(settings)
            self.driver = Driver(self.decoder, self._policy(self.decoder))
            rows = list(range(len(jobs)))
        else:
            rows = self.decoder.join(ids, mask, settings)
        for row, job in zip(rows, jobs):
            self.running[row] = job
            job.stats = self.decoder.rows.stats[row]
        self._gauges()

    def _policy(self, decoder: Decoder) -> BatchController:
        name = decoder.drafter.name
        if name not in self.policies:
            self.policies[name] = BatchController.shared(decoder.memory, name)
        return self.policies[name]

    def _on_tokens(self, row: int, new_ids: list[int], logprobs=None) -> None:
        job = self.running.get(row)
        if job is not None:
            job.send("tokens", list(new_ids), logprobs)

    def _round(self) -> None:
        decoder = self.decoder
        if decoder is None or decoder.done or not self.running:
            return
        self.driver.step()
        active = set(decoder.rows.active.tolist()) if not decoder.done else set()
        for row in [r for r in self.running if r not in active]:
            new = decoder.rows.new[row]
            reason = "stop" if new and new[-1] in self.eos else "length"
            self.running.pop(row).send("done", reason)
        if decoder.done:  # its caches go now, not when the next batch starts (a prompt cache
            self.decoder = self.driver = None  # is then there for the next batch to resume)

    def _fail_all(self, message: str) -> None:
        with self.lock:
            jobs = list(self.running.values()) + list(self.waiting)
            self.running.clear()
            self.waiting.clear()
            self.decoder = self.driver = None
        for job in jobs:
            job.send("error", message)
