"""A causal language model with its own KV cache over a committed prefix.

Both the target and a model draft use it: `feed` runs only the new tokens (the cache holds the
rest), `crop` cuts the cache back to a kept prefix (rule 3: entries scored under a prefix that was
not kept are discarded), and the counters record every call and every token fed, so tests can show
that nothing is recomputed after the prefill.
"""
from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache


def unwrap_model(model) -> tuple[torch.nn.Module, object | None, str]:
    """(Hugging Face model, tokenizer or None, name) from a LoadedModel or a bare model."""
    if hasattr(model, "model") and hasattr(model, "tokenizer"):
        return model.model, model.tokenizer, getattr(model, "name", type(model.model).__name__)
    if isinstance(model, torch.nn.Module):
        name = getattr(model.config, "name_or_path", "") or type(model).__name__
        return model, None, name
    raise ValueError(f"expected a Hugging Face causal LM or a LoadedModel, got {type(model).__name__}")


def _cache_argument(model: torch.nn.Module) -> str:
    """Transformers 5 names the cache argument `cache`; older releases `past_key_values`."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


class CachedModel:
    """One model, one KV cache, batch size 1 (the cache layout is [B, heads, length, dim])."""

    def __init__(self, model: torch.nn.Module, name: str, vocab_size: int):
        self.model, self.name, self.vocab_size = model, name, vocab_size
        self.device = next(model.parameters()).device
        self._cache_arg = _cache_argument(model)
        self.cache = DynamicCache()
        self.calls = 0
        self.tokens_fed = 0

    @property
    def length(self) -> int:
        """How many tokens the cache holds."""
        return self.cache.get_seq_length()

    def reset(self) -> None:
        self.cache = DynamicCache()

    def crop(self, length: int) -> None:
        """Keep the first `length` cached tokens (DynamicCache.crop takes a negative count)."""
        excess = self.length - length
        if excess > 0:
            self.cache.crop(-excess)

    def feed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Run tokens[B, n] after the cached prefix; return float logits[B, n, V] over the usable
        vocabulary (embedding rows past the tokenizer's vocabulary are dropped: zero probability).
        """
        start = self.length
        output = self.model(input_ids=tokens, use_cache=True, **{self._cache_arg: self.cache})
        self.cache = getattr(output, self._cache_arg, None) or getattr(output, "past_key_values")
        self.calls += 1
        self.tokens_fed += tokens.size(1)
        logits = output.logits[..., : self.vocab_size]  # [B, n, V]
        self._check_finite(logits, start)
        return logits

    def _check_finite(self, logits: torch.Tensor, start: int) -> None:
        """Rule 2: NaN or +inf logits raise an error naming the model and the position."""
        bad = torch.isnan(logits) | torch.isposinf(logits)  # [B, n, V]
        if bad.any():
            position = start + int(bad.any(dim=-1).any(dim=0).nonzero()[0])
            raise ValueError(
                f"model {self.name!r} produced NaN or +inf logits at position {position}")
