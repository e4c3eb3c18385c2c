"""Drafters: what proposes a round's tokens. `base` holds the contract; `make_drafter` picks one."""
from __future__ import annotations

import importlib.util

import torch

from exactspec.drafters.auto import AutoDrafter
from exactspec.drafters.base import Drafter, NoDraft, Proposal
from exactspec.drafters.model import ModelDrafter
from exactspec.drafters.ngram import NGramDrafter
from exactspec.drafters.oracle import LookupOracleDrafter, OracleDrafter
from exactspec.drafters.strings import StringDrafter
from exactspec.drafters.tli import TLIDrafter
from exactspec.models import INTERSECTION, load_model, pair_method, token_list_method, unwrap_model

__all__ = ["AutoDrafter", "Drafter", "LookupOracleDrafter", "ModelDrafter", "NGramDrafter",
           "NoDraft", "OracleDrafter", "Proposal", "StringDrafter", "TLIDrafter",
           "default_model_draft", "default_model_spec", "is_llamacpp_spec", "make_drafter",
           "model_drafter", "other_vocabulary_drafter", "other_vocabulary_method"]

LLAMACPP = "llamacpp"
# "METHOD:SPEC": the model draft SPEC of another vocabulary, drafting its text in the target's
# tokens ("string", the default for such a pair) or through the token-level intersection ("tli")
OTHER_VOCABULARY = {"string": StringDrafter, "tli": TLIDrafter}


def make_drafter(draft, default_model=None, target=None) -> Drafter:
    """The drafter for `draft`: None (plain decoding), "ngram", "auto" (prompt lookup or the
    model draft `default_model`, or the target's default one, round by round), "auto:SPEC" (the
    same with the model SPEC), "llamacpp:PATH_OR_BUNDLED_NAME" (a GGUF run by llama.cpp; plain
    "llamacpp" runs the target's own GGUF), "string:SPEC" / "tli:SPEC" (the model draft SPEC, of
    another vocabulary, as string-level drafts or through the token-level intersection), a model
    spec string, a LoadedModel or Hugging Face model (`model_drafter`: string-level drafts when its
    vocabulary differs from `target`'s), or an object that already keeps the drafter contract."""
    if draft is None:
        return NoDraft()
    if isinstance(draft, str):
        if draft == "ngram":
            return NGramDrafter()
        if draft == "auto" or draft.startswith("auto:"):
            model = draft[len("auto:"):] or default_model
            if model is None and target is None:
                raise ValueError("draft 'auto' needs a model draft: pass 'auto:SPEC' or default_model")
            return AutoDrafter(make_drafter(model, target=target) if model is not None
                               else default_model_draft(target))
        if other_vocabulary_method(draft):
            return other_vocabulary_drafter(draft, target)
        if is_llamacpp_spec(draft):
            return _llamacpp_drafter(draft[len(LLAMACPP) + 1:], target)
        return model_drafter(load_model(draft), target)
    if isinstance(draft, Drafter):
        return draft
    return model_drafter(draft, target)


def model_drafter(model, target=None) -> Drafter:
    """The drafter for a draft model, by `pair_method`: a `ModelDrafter` when it shares the
    target's vocabulary (or the target is not known yet: its `bind` then checks), a
    `StringDrafter` when both have tokenizers whose vocabularies differ."""
    if target is not None and pair_method(target, model) == INTERSECTION:
        return StringDrafter(model)
    return ModelDrafter(model)


def other_vocabulary_method(spec) -> str | None:
    """"string" or "tli" for a draft spec "string:SPEC" or "tli:SPEC", else None."""
    method = spec.split(":")[0].lower() if isinstance(spec, str) and ":" in spec else None
    return method if method in OTHER_VOCABULARY else None


def is_llamacpp_spec(spec) -> bool:
    """Whether a draft spec names a llama.cpp draft: "llamacpp" or "llamacpp:PATH"."""
    return isinstance(spec, str) and spec.split(":")[0].lower() == LLAMACPP


def default_model_spec(target_name) -> str:
    """The spec of a target's default model draft, from the target's spec (or its LoadedModel):
    for a llama.cpp target ("llamacpp:NAME"), the real pair's 0.5B through llama.cpp when the
    target is its 1.5B, else its own file; for a torch target, "llamacpp" (its own file through
    llama.cpp) for the bundled model or a `.gguf` file when llama-cpp-python is installed, else
    its weights in bfloat16 ("NAME@bfloat16"). `default_model_draft` makes the same choice for
    a target already loaded."""
    from exactspec.models import BUNDLED_MODEL, LoadedModel, invariant_option, parse_model_spec
    from exactspec.models.packaged import PAIR_DRAFT, PAIR_TARGET, packaged_model

    if isinstance(target_name, LoadedModel):
        target_name = target_name.spec if target_name.backend == LLAMACPP else target_name.name
    if is_llamacpp_spec(target_name):
        named = invariant_option(target_name[len(LLAMACPP) + 1:])[0].strip().lower()
        return f"{LLAMACPP}:{PAIR_DRAFT}" if named == PAIR_TARGET else LLAMACPP
    target_name = parse_model_spec(target_name)[0]  # a torch target's spec may name a dtype
    from_gguf = (target_name.lower() == BUNDLED_MODEL or packaged_model(target_name) is not None
                 or target_name.lower().endswith(".gguf"))
    return LLAMACPP if from_gguf and llamacpp_available() else f"{target_name}@bfloat16"


def default_model_draft(target) -> Drafter:
    """The model draft used when none is named: for a llama.cpp target the one
    `default_model_spec` names; else llama.cpp running the file the target was loaded from, when
    it was a GGUF (the bundled model is) and llama-cpp-python is installed; otherwise the
    target's own weights in bfloat16, sharing its tokenizer."""
    from exactspec.drafters.llamacpp import gguf_file
    from exactspec.models import LoadedModel

    if isinstance(target, LoadedModel) and target.backend == LLAMACPP:
        return _llamacpp_drafter(default_model_spec(target)[len(LLAMACPP) + 1:], target)
    path = gguf_file(target)
    if path is not None and llamacpp_available():
        return _llamacpp_drafter(str(path), target)
    from exactspec.distributed import local_copy

    model, tokenizer, _ = unwrap_model(target, "target")
    draft = local_copy(model, torch.bfloat16)  # a tensor-parallel target is gathered, not deep-copied
    return ModelDrafter((draft, tokenizer) if tokenizer is not None else draft)


def llamacpp_available() -> bool:
    """Whether llama-cpp-python is installed (looked up, not loaded)."""
    try:
        return importlib.util.find_spec("llama_cpp") is not None
    except ValueError:  # sys.modules["llama_cpp"] is None: imports of it are blocked
        return False


def _llamacpp_drafter(where: str, target) -> Drafter:
    """"llamacpp:" + a GGUF path, a packaged model's name (the bundled model, the real pair), or
    nothing (the target's own file); as string-level drafts when the GGUF's vocabulary differs
    from `target`'s (`token_list_method`)."""
    from exactspec.drafters.llamacpp import LlamaCppDrafter

    drafter = LlamaCppDrafter(_gguf_of(where, target))
    if target is not None and token_list_method(target, drafter.tokens()) == INTERSECTION:
        return StringDrafter(drafter)
    return drafter


def other_vocabulary_drafter(spec: str, target, load=load_model) -> Drafter:
    """"string:" or "tli:" + a model spec or "llamacpp:..." (`OTHER_VOCABULARY`); `load` turns
    a model spec into the model (the CLI's and the bench's own loaders log and share models)."""
    method, spec = spec.split(":", 1)
    if not spec.strip():
        raise ValueError(f"draft '{method}:' needs a model: '{method}:SPEC', e.g. "
                         f"'{method}:llamacpp:smollm2-135m-instruct'")
    if is_llamacpp_spec(spec):
        from exactspec.drafters.llamacpp import LlamaCppDrafter

        model = LlamaCppDrafter(_gguf_of(spec[len(LLAMACPP) + 1:], target))
    else:
        model = load(spec)
    return OTHER_VOCABULARY[method.lower()](model)


def _gguf_of(where: str, target):
    """The GGUF file a "llamacpp:WHERE" draft runs (see `_llamacpp_drafter`)."""
    from exactspec.drafters.llamacpp import gguf_file
    from exactspec.models.loading import named_gguf

    packaged = named_gguf(where)
    if packaged is not None:
        return packaged
    if where.strip():
        return where.strip()
    path = gguf_file(target) if target is not None else None
    if path is None:
        raise ValueError("draft 'llamacpp' runs the target's own GGUF file, and this target was not "
                         "loaded from one: name the file, --draft llamacpp:PATH")
    return path
