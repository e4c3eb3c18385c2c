"""The drafters a server's batches use: one factory, shared by the server (`serve.app`) and
the tensor-parallel followers (`serve.lockstep`), so that neither imports the other."""
from __future__ import annotations

import copy


def drafter_factory(draft, target):
    """A function making a fresh drafter for each new batch (a drafter holds per-batch state).
    "auto": prompt lookup or, as for `exactspec generate`, the target's default model draft."""
    from exactspec.drafters import AutoDrafter, NGramDrafter, NoDraft

    spec = draft.strip().lower() if isinstance(draft, str) else None
    if draft is None or spec == "none":
        return NoDraft
    if spec == "ngram":
        return NGramDrafter
    if spec == "auto" or (spec or "").startswith("auto:"):
        make_model = model_draft_factory(draft.strip()[len("auto:"):], target)
        return lambda: AutoDrafter(make_model())
    return model_draft_factory(draft, target)


def model_draft_factory(draft, target):
    """Fresh model drafters sharing one set of weights: the draft is loaded (or, when `draft` is
    empty, the target's default model draft made) once, and each batch gets a copy of it made
    before it starts, so with no state of its own yet."""
    from exactspec.drafters import default_model_draft, make_drafter

    first = make_drafter(draft, target=target) if draft else default_model_draft(target)
    return lambda: copy.copy(first)
