"""Drafters: what proposes a round's tokens. `base` holds the contract; `make_drafter` picks one."""
from exactspec.drafters.auto import AutoDrafter
from exactspec.drafters.base import Drafter, NoDraft, Proposal
from exactspec.drafters.model import ModelDrafter
from exactspec.drafters.ngram import NGramDrafter
from exactspec.models import load_model

__all__ = ["AutoDrafter", "Drafter", "ModelDrafter", "NGramDrafter", "NoDraft", "Proposal", "make_drafter"]


def make_drafter(draft, default_model=None) -> Drafter:
    """The drafter for `draft`: None (plain decoding), "ngram", "auto" (prompt lookup or the
    model draft `default_model`, round by round), "auto:SPEC" (the same with the model SPEC), a
    model spec string, a LoadedModel or Hugging Face model, or an object that already keeps the
    drafter contract."""
    if draft is None:
        return NoDraft()
    if isinstance(draft, str):
        if draft == "ngram":
            return NGramDrafter()
        if draft == "auto" or draft.startswith("auto:"):
            model = draft[len("auto:"):] or default_model
            if model is None:
                raise ValueError("draft 'auto' needs a model draft: pass 'auto:SPEC' or default_model")
            return AutoDrafter(make_drafter(model))
        return ModelDrafter(load_model(draft))
    if isinstance(draft, Drafter):
        return draft
    return ModelDrafter(draft)
