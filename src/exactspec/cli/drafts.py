"""--draft for `generate` and `demo`: a spec made into what the engine drafts with, saying how a
draft of another vocabulary drafts; and the loading and logging they share."""
from __future__ import annotations

import sys
import time

from exactspec.cli.common import CliError


def log(message: str) -> None:
    from exactspec.distributed import is_leader

    if is_leader():  # under torchrun, rank 0 speaks for all
        print(message, file=sys.stderr, flush=True)


def load(spec: str, dtype: str | None = None, option: str = "--target", tp: bool = False):
    from exactspec.models import load_model

    start = time.perf_counter()
    try:
        loaded = load_model(spec, dtype=dtype, tp=tp)
    except (ValueError, OSError) as err:  # one line naming the option (the clear-errors rule)
        raise CliError(f"{option}: {err}") from None
    log(f"loaded {loaded.spec} in {time.perf_counter() - start:.1f} s")
    return loaded


def make_draft(spec: str, target, dtype: str | None = None):
    """None (plain decoding), "ngram", an `AutoDrafter`, a llama.cpp drafter or a loaded draft
    model, for --draft. "auto" drafts, when prompt lookup has nothing, with the target's default
    model draft (`exactspec.drafters.default_model_spec`)."""
    from exactspec.drafters import default_model_spec, make_drafter

    spec = spec.strip()
    if spec.lower() in ("none", "ngram"):
        return None if spec.lower() == "none" else "ngram"
    if spec.lower() == "auto" or spec.lower().startswith("auto:"):
        model = _model_draft(spec[len("auto:"):] or default_model_spec(target), target, dtype)
        drafter = make_drafter("auto", default_model=model, target=target)
        drafter.spec = f"auto:{draft_name(model)}"  # for the tables and --json
        return drafter
    return _model_draft(spec, target, dtype)


def _model_draft(spec: str, target, dtype: str | None):
    """A llama.cpp drafter for "llamacpp[:PATH]", a drafter for a draft of another vocabulary
    for "string:SPEC" / "tli:SPEC", else the draft model loaded from the spec."""
    from exactspec.drafters import TLIDrafter, is_llamacpp_spec, make_drafter, other_vocabulary_method

    if other_vocabulary_method(spec):
        return _other_vocabulary_draft(spec, target, dtype)
    if not is_llamacpp_spec(spec):
        loaded = load(spec, dtype, "--draft")
        _log_pairing(target, loaded, loaded.spec)
        return loaded
    try:
        drafter = make_drafter(spec, target=target)
    except (ValueError, ImportError) as err:
        raise CliError(f"--draft: {err}") from None
    drafter.spec = drafter.name
    if isinstance(drafter, TLIDrafter):  # its subclass StringDrafter too
        _log_pairing(target, (drafter.inner, drafter.inner.tokenizer), drafter.inner.name)
    return drafter


def _other_vocabulary_draft(spec: str, target, dtype: str | None):
    """"string:SPEC" or "tli:SPEC": the model draft SPEC of another vocabulary, bound now, so
    that a pair its method cannot serve is refused here, and the method is said."""
    from exactspec.drafters import other_vocabulary_drafter

    try:
        drafter = other_vocabulary_drafter(spec, target,
                                           load=lambda inner: load(inner, dtype, "--draft"))
        drafter.bind(target, 1)
    except (ValueError, ImportError) as err:
        raise CliError(f"--draft: {err}") from None
    drafter.spec = drafter.name
    log(f"draft {drafter.inner.name} has another vocabulary than {target.spec}: {drafter.method}")
    return drafter


def _log_pairing(target, draft, name: str) -> None:
    """Say when a model draft has another vocabulary than the target, and how it drafts."""
    from exactspec.models import SHARED, describe_pair

    method = describe_pair(target, draft)
    if method != SHARED:
        log(f"draft {name} has another vocabulary than {target.spec}: {method} "
             "(--draft tli:SPEC drafts through the token-level intersection instead)")


def draft_name(draft) -> str:
    if draft is None or isinstance(draft, str):
        return draft or "none"
    return draft.spec
