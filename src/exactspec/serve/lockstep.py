"""`exactspec serve --tp` under torchrun: rank 0 serves, the other ranks follow its batches.

The target is split over the ranks (`exactspec.distributed`), so each of its forward passes
needs every rank. Rank 0 runs the server and its engine thread as usual, but its Decoder is a
`LeaderDecoder`: before each operation on the batch (start it, set its rows' settings, let rows
join, cancel rows, run a round with γ) it sends that operation to the other ranks. A follower
(`follow`) loads the same models in the same order, then repeats each operation on its own
Decoder, so every rank runs the same forward passes in the same order and commits the same
tokens: checked when a batch ends (and after every round with EXACTSPEC_TP_CHECK=round).
A row without a seed gets one drawn on rank 0 before its settings are sent (rule 8: a row
owns its random stream, the same on every rank). Only rank 0 tokenizes, streams and answers.
"""
from __future__ import annotations

import dataclasses
import logging
import secrets

import torch

from exactspec import distributed
from exactspec.engine import Decoder
from exactspec.serve.drafts import drafter_factory
from exactspec.serve.scheduler import Scheduler

log = logging.getLogger("exactspec.serve")
STOP = "stop"


def _seeded(settings) -> list:
    """Each row's settings with a seed: its own, or a fresh one drawn here."""
    return [row if row.seed is not None else dataclasses.replace(row, seed=secrets.randbits(63))
            for row in settings]


def _after_round(decoder: Decoder) -> None:
    """Every rank committed the same tokens: each round in the debug mode, always at the end."""
    distributed.check_round(decoder.rows.new, decoder.rounds)
    if decoder.done:
        distributed.check_same(decoder.rows.new, "the end of a batch")


class LeaderDecoder(Decoder):
    """Rank 0's Decoder: sends each operation to the followers, then does it."""

    def __init__(self, target, drafter, input_ids, attention_mask, **settings):
        shared = {k: v for k, v in settings.items() if k != "on_tokens"}  # streaming is rank 0's
        distributed.send(("start", (input_ids, attention_mask), shared))
        super().__init__(target, drafter, input_ids, attention_mask, **settings)

    def use_row_settings(self, settings) -> None:
        settings = _seeded(settings)
        distributed.send(("use_row_settings", (settings,), {}))
        super().use_row_settings(settings)

    def join(self, input_ids, attention_mask, settings) -> list[int]:
        settings = _seeded(settings)
        distributed.send(("join", (input_ids, attention_mask, settings), {}))
        return super().join(input_ids, attention_mask, settings)

    def cancel(self, rows) -> None:
        distributed.send(("cancel", (list(rows),), {}))
        super().cancel(rows)

    def step(self, gamma: int, min_drafts: int = 0):
        distributed.send(("step", (gamma, min_drafts), {}))
        return super().step(gamma, min_drafts)

    def agree(self, choice):
        return choice  # `step` sends it to the followers

    def after_round(self) -> None:
        _after_round(self)


class LeaderScheduler(Scheduler):
    """Rank 0's engine thread: batches through `LeaderDecoder`; tells the followers to stop
    when it ends."""

    decoder_type = LeaderDecoder

    def _run(self) -> None:
        try:
            super()._run()
        finally:
            distributed.send((STOP, (), {}))


def follow(target, make_drafter) -> None:
    """A follower rank: repeat rank 0's operations on a Decoder of its own until rank 0 stops.
    An operation that fails fails on rank 0 too (same inputs, same models): the batch is dropped
    there and here alike."""
    torch.set_grad_enabled(False)
    decoder = None
    while True:
        operation, args, kwargs = distributed.receive()
        if operation == STOP:
            return
        try:
            with torch.inference_mode():
                if operation == "start":
                    decoder = Decoder(target, make_drafter(), *args, on_tokens=None, **kwargs)
                else:
                    getattr(decoder, operation)(*args, **kwargs)
                    if operation == "step":
                        _after_round(decoder)
        except Exception:  # noqa: BLE001 (rank 0 reports it to its clients)
            log.exception("a follower's %s failed", operation)
            decoder = None


def serve_follower(config) -> None:
    """A follower rank of `exactspec serve --tp`: load the models as rank 0's server does (the
    same collectives in the same order), then follow its batches until it stops."""
    from exactspec.models import load_model

    target = load_model(config.target, tp=True)
    make_drafter = drafter_factory(config.draft, target)
    make_drafter()  # as the server does, so both ranks build the same drafters
    follow(target, make_drafter)
