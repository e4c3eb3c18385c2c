"""Drafters: what proposes a round's tokens. `base` holds the contract; `make_drafter` picks one."""
from exactspec.drafters.base import Drafter, NoDraft, Proposal
from exactspec.drafters.model import ModelDrafter
from exactspec.drafters.ngram import NGramDrafter
from exactspec.models import load_model

__all__ = ["Drafter", "ModelDrafter", "NGramDrafter", "NoDraft", "Proposal", "make_drafter"]


def make_drafter(draft) -> Drafter:
    """The drafter for `draft`: None (plain decoding), "ngram", a model spec string, a
    LoadedModel or Hugging Face model, or an object that already keeps the drafter contract."""
    if draft is None:
        return NoDraft()
    if isinstance(draft, str):
        if draft == "ngram":
            return NGramDrafter()
        return ModelDrafter(load_model(draft))
    if isinstance(draft, Drafter):
        return draft
    return ModelDrafter(draft)
