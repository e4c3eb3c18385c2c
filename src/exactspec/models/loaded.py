"""A loaded model and the facts the engine reads from it: its vocabulary, context and EOS ids.

Vocabulary (the same-vocabulary rule): speculative decoding compares the target's distribution p with the
draft's q token by token, so both must number tokens the same way. :func:`exactspec.models.vocab.check_compatible`
compares the tokenizers' token → id maps. The models' output layers may have more rows than the
tokenizer has ids (embedding tables are often padded to a multiple of 64 or 128); those extra ids
are not real tokens. :func:`usable_vocab` is the number of real ids ``V``: the engine keeps the
first ``V`` logits of each model (``logits[..., :V]``), which gives the padded ids zero
probability in both p and q.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(eq=False)
class Memory:
    """What generations with one model remember, so that the next starts where the last left off.
    A `LoadedModel` holds one (`memory_of`); a model passed bare gets a fresh one per generation.

    As the target: `passes` (rows → k → seconds of recent k-token passes) and `drafters` (drafter
    name → its costs, acceptance and probe schedules), read by `controller.GammaController.shared`;
    `matcher_tokenizers` ((vocab, EOS ids) → llguidance's view of the tokenizer,
    `constraints.matcher_tokenizer`) and `folding` (`drafters.ngram.space_folding`).
    On the CPU, as target or draft: `shapes` (the timings of each matrix product per weight shape)
    and `runner` ((the model, the model run with the faster products): `kernels.faster_products`)."""

    passes: dict = field(default_factory=dict)
    drafters: dict = field(default_factory=dict)
    matcher_tokenizers: dict = field(default_factory=dict)
    folding: dict | None = None
    shapes: dict = field(default_factory=dict)
    runner: Any = None


@dataclass
class LoadedModel:
    """A causal LM ready for decoding: in eval mode, on `device`, in `dtype`, gradients off.

    `tokenizer` is None only for a local folder that has no tokenizer files.
    `name` is the model's name or path without the dtype; `spec` adds it back.
    `backend` is "torch" (a Hugging Face model) or "llamacpp" (a GGUF run by llama.cpp: `model`
    is an `exactspec.models.llamacpp.LlamaCppModel`, its dtype is that of its logits).
    """

    model: Any
    tokenizer: Any
    name: str
    dtype: torch.dtype
    device: torch.device
    backend: str = "torch"
    memory: Memory = field(default_factory=Memory, repr=False, compare=False)

    @property
    def spec(self) -> str:
        """The model spec that loads this model again, e.g. ``smollm2-135m-instruct@bfloat16``
        or ``llamacpp:smollm2-135m-instruct``."""
        if self.backend == "llamacpp":
            return f"llamacpp:{self.name}"
        return f"{self.name}@{str(self.dtype).removeprefix('torch.')}"

    @property
    def vocab_size(self) -> int:
        """The number of real token ids (see :func:`usable_vocab`)."""
        return usable_vocab(self)

    @property
    def context_length(self) -> int | None:
        """The longest sequence the model accepts (see :func:`context_length`)."""
        return context_length(self)

    @property
    def eos_token_ids(self) -> list[int]:
        """The ids that end a generation (see :func:`eos_token_ids`)."""
        return eos_token_ids(self)


def unwrap_model(obj, role: str = "model") -> tuple[Any, Any, str]:
    """(model, tokenizer or None, name) from a LoadedModel, a (model, tokenizer) pair or a model."""
    if isinstance(obj, LoadedModel):
        return obj.model, obj.tokenizer, obj.name
    if isinstance(obj, (tuple, list)) and len(obj) == 2:
        return obj[0], obj[1], _model_name(obj[0])
    if isinstance(obj, torch.nn.Module):
        return obj, None, _model_name(obj)
    if getattr(obj, "backend", None) == "llamacpp":  # a `LlamaCppModel` without its tokenizer
        return obj, None, _model_name(obj)
    raise ValueError(f"{role} must be a LoadedModel, a (model, tokenizer) pair or a model, "
                     f"got {type(obj).__name__}")


def memory_of(obj) -> Memory:
    """The memory of what a user passed: a LoadedModel's own, else a fresh one (nothing is
    remembered for a bare model or a (model, tokenizer) pair past its generation)."""
    return obj.memory if isinstance(obj, LoadedModel) else Memory()


def input_device(model) -> torch.device:
    """The device a model's inputs go to: its first parameter's, or, for a model that accelerate
    dispatched over devices (`device_map`; offloaded weights wait on the "meta" device until
    their layer runs), the first device of its map that is not "cpu" or "disk", else the CPU;
    for a model that is not a torch module (a `LlamaCppModel`), its `device`."""
    if not isinstance(model, torch.nn.Module):
        return torch.device(getattr(model, "device", "cpu"))
    device_map = getattr(model, "hf_device_map", None)
    if device_map:
        devices = [d for d in device_map.values() if d not in ("cpu", "disk")]
        return torch.device(devices[0] if devices else "cpu")  # an int d means cuda:d
    return next(model.parameters()).device


def _model_name(model) -> str:
    return getattr(getattr(model, "config", None), "name_or_path", "") or type(model).__name__


def output_vocab_size(model) -> int:
    """Rows of the model's output layer: the width of its logits (padding included)."""
    if isinstance(model, LoadedModel):
        model = model.model
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if output is not None and getattr(output, "weight", None) is not None:
        return int(output.weight.shape[0])
    return int(model.config.vocab_size)


@functools.lru_cache(maxsize=16)
def vocabulary(tokenizer) -> tuple[tuple[str, int], ...]:
    """The token → id map, sorted and frozen; memoized per tokenizer object, since building it
    for a 49k vocabulary takes ~25 ms and every generation checks it."""
    return tuple(sorted(tokenizer.get_vocab().items()))


@functools.lru_cache(maxsize=16)
def tokenizer_size(tokenizer) -> int:
    return max((i for _, i in vocabulary(tokenizer)), default=-1) + 1


def usable_vocab(obj) -> int:
    """The number of real token ids V: ids 0..V-1 are tokens, any logits past V are padding.

    With a tokenizer (LoadedModel, or (model, tokenizer)), V = largest id in its vocabulary + 1
    (added special tokens included); without one, V is the model's output size. The engine keeps
    ``logits[..., :V]`` of both models, which gives padded ids zero probability in p and q.
    """
    model, tokenizer, _ = unwrap_model(obj)
    if tokenizer is None:
        return output_vocab_size(model)
    return tokenizer_size(tokenizer)


def context_length(obj) -> int | None:
    """The longest sequence (prompt + new tokens) the model accepts, from its config
    (max_position_embeddings and its older names); None when the config does not say."""
    model = obj.model if isinstance(obj, LoadedModel) else obj
    config = getattr(model, "config", None)
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def eos_token_ids(obj) -> list[int]:
    """Ids that end a generation: the tokenizer's eos id plus the model's generation config's."""
    model, tokenizer, _ = unwrap_model(obj)
    ids: list[int] = []
    candidates = [getattr(tokenizer, "eos_token_id", None)]
    generation_config = getattr(model, "generation_config", None)
    candidates.append(getattr(generation_config, "eos_token_id", None))
    candidates.append(getattr(getattr(model, "config", None), "eos_token_id", None))
    for value in candidates:
        for i in (value if isinstance(value, (list, tuple)) else [value]):
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return ids


def check_context(model, name: str, total: int) -> None:
    """Refuse a generation whose prompt + max_new_tokens exceeds the model's context window."""
    check_length(context_length(model), name, total)


def check_length(limit: int | None, name: str, total: int) -> None:
    """Refuse `total` tokens for a model whose context window is `limit` (None: no limit known)."""
    if limit is not None and total > limit:
        raise ValueError(f"prompt + max_new_tokens = {total} tokens exceeds the context window of "
                         f"{name!r} ({limit} tokens)")
