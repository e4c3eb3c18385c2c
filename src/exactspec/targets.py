"""The target protocol: what the engine asks of the model that verifies, and its two backends.

A target holds B rows of committed tokens (its cache) and scores new tokens after them:

- `prefill(tokens[B, n], valid[B, n], keep=0) -> [B, V]`: the rows' prompts (left-padded;
  `valid` marks real tokens), returning the logits after each row's last one; keep ≥ 1: after
  each of its last `keep` tokens (real in every row), [B, keep, V] (a prompt and the first
  round's drafts in one pass, `Scorer`);
- `feed(tokens[B, n]) -> [B, n, V]`: n more tokens per row (a round's [last committed token,
  drafts]), the logits after each;
- `discard_last(counts[B])`: row b forgets its last counts[b] tokens (drafts scored under a
  prefix that was not kept: the stop-at-first-rejection rule);
- `select(rows)`: keep these rows, in this order (finished rows leave);
- `join(tokens[n, L], valid[n, L])`: n rows appended last with these tokens (no logits);
- `threads()`: a context manager the generation runs in (where the backend wants torch's
  threads out of its way);
- `model` (what the controller's timings belong to), `name`, `device`, `vocab_size`, and the
  counters `calls`, `tokens_fed`, `padding_fed`, `hole_shares`.

Logits are float, over the usable vocabulary V, and finite (NaN or +inf, or −inf everywhere,
raise an error naming the position): p is `SamplingConfig.probs` of them, whatever the backend.

`exactspec.cache.CachedModel` is the Hugging Face target (a rectangular KV cache with holes);
`LlamaCppTarget` runs a GGUF file through llama.cpp, each row a sequence of one context.
`make_target` picks by the loaded model.
"""
from __future__ import annotations

import torch

from exactspec.cache import CachedModel, check_finite
from exactspec.models.llamacpp import torch_on_one_thread


def make_target(model, name: str, vocab_size: int, batch_size: int, memory=None):
    """The target for a loaded model: llama.cpp's for a `LlamaCppModel`, else `CachedModel`
    (`memory`: the model's, `models.loaded.Memory`, which keeps its faster products)."""
    if getattr(model, "backend", None) == "llamacpp":
        return LlamaCppTarget(model, name, vocab_size)  # its rows come with prefill and join
    return CachedModel(model, name, vocab_size, batch_size, memory)


class LlamaCppTarget:
    """A GGUF target run by llama.cpp: each row a sequence of one context (`Sequences`), so
    rows are ragged without holes and a row forgets its rejected drafts alone. A round's pass
    asks llama.cpp for the logits after every fed token. The context grows by doubling, each
    row's cache moved over as it is, and goes back to the model for the next generation when
    the target is freed (`exactspec.models.llamacpp.Gguf.take_rows`).

    Every decode runs on the model's `n_threads` (`$EXACTSPEC_THREADS`, else all usable cores),
    the same for every pass of every generation, since a pass's numerics may depend on the thread
    count and a seed names one text; torch runs on one thread during the generation (`threads`), since its
    share (p from logits, the draws) is small beside the pass and its idle OpenMP workers would
    spin on the cores llama.cpp needs."""

    padding_fed = 0  # sequences need no padding
    hole_shares = ()  # nor holes

    def __init__(self, model, name: str, vocab_size: int):
        self.model, self.name, self.vocab_size = model, name, vocab_size
        self.device = torch.device("cpu")
        self.rows = model.gguf.take_rows(self, name, model.n_threads, vocab_size, keep=model.prompt_cache)

    calls = property(lambda self: self.rows.calls)
    tokens_fed = property(lambda self: self.rows.tokens_fed)

    def threads(self):
        return torch_on_one_thread()

    def prefill(self, tokens: torch.Tensor, valid: torch.Tensor, keep: int = 0) -> torch.Tensor:
        """The prompts tokens[B, n] (`valid` marks real tokens); the logits after each, [B, V], or
        keep ≥ 1: after each of a row's last `keep` tokens, [B, keep, V]. Those after the first
        of them are fed apart, after the rest (llama.cpp decodes them as one prompt either way;
        fed apart they are scored as every later round's are, and a greedy generation is the
        same whether its first round drafted or not)."""
        apart = max(keep - 1, 0)
        prompts = self._append(tokens, valid, apart)
        heads = [p[: len(p) - apart] for p in prompts]
        logits = self.rows.decode([h[len(fed):] for h, fed in zip(heads, self.rows.fed)])  # [B, V]
        self._check(logits.unsqueeze(1), [[len(p) - 1] for p in heads])
        if keep <= 1:
            return logits.unsqueeze(1) if keep else logits
        rest = self.feed(torch.tensor([p[len(h):] for p, h in zip(prompts, heads)]))  # [B, keep-1, V]
        return torch.cat([logits.unsqueeze(1), rest], dim=1)  # [B, keep, V]

    def feed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens[B, n] after each row's tokens; the logits after each of them. [B, n, V]"""
        batch, n = tokens.shape
        before = [len(fed) for fed in self.rows.fed]
        self.rows.make_room(batch * n)
        logits = self.rows.decode(tokens.tolist(), every=True).view(batch, n, -1)  # [B, n, V]
        self._check(logits, [range(k, k + n) for k in before])
        return logits

    def discard_last(self, counts: torch.Tensor) -> None:
        for b, count in enumerate(counts.tolist()):
            self.rows.truncate(b, len(self.rows.fed[b]) - count)

    def select(self, rows: torch.Tensor) -> None:
        self.rows.select(rows.tolist())

    def join(self, tokens: torch.Tensor, valid: torch.Tensor) -> None:
        """Rows appended last, their valid tokens fed (a prompt minus its last token)."""
        first = len(self.rows.seqs)
        prompts = self._append(tokens, valid)
        self.rows.decode([[] for _ in range(first)] + prompts, logits=False)

    def _append(self, tokens: torch.Tensor, valid: torch.Tensor, apart: int | None = None) -> list[list[int]]:
        """New rows' sequences, and room for their valid tokens; those tokens, per row. apart (a
        prefill's: its last tokens fed in a pass of their own): where the model keeps a prompt
        cache, a row resumes the cached sequence that begins like the rest of its prompt."""
        prompts = [row[ok.bool()].tolist() for row, ok in zip(tokens, valid)]
        resume = self.model.prompt_cache and apart is not None
        first = len(self.rows.fed)
        self.rows.add(tokens.size(0), "target", [p[: len(p) - apart] for p in prompts] if resume else None)
        self.rows.make_room(sum(len(p) - len(fed) for p, fed in zip(prompts, self.rows.fed[first:])))
        return prompts

    def _check(self, logits: torch.Tensor, positions) -> None:
        check_finite(logits, None, positions, self.name)


class Scorer:
    """A target's scores for the round loop, which scores the prompts with the first round.

    The first round's pass runs over the prompts and that round's drafts at once (a grammar's
    forced opening, a lookup from the prompt: proposed before any pass), so those drafts cost
    their share of the prefill, not a pass of their own; every later round feeds [last committed
    token, drafts]. `prefill()` scores the prompts alone first (before the rows change), keeping
    the logits after them for the first round."""

    def __init__(self, target, ids: torch.Tensor, valid: torch.Tensor):
        self.target, self.prompts = target, (ids, valid)  # [B, L] each, until the first pass
        self.after_prompt = None  # [B, V] once `prefill` ran and until the first round

    @property
    def pending(self) -> bool:
        """Whether the prompts are still to be scored (the next round's pass includes them)."""
        return self.prompts is not None

    def prefill(self) -> None:
        if self.prompts is not None:
            (ids, valid), self.prompts = self.prompts, None
            self.after_prompt = self.target.prefill(ids, valid)  # [B, V]

    def score(self, last: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """Logits for the positions after the last committed token and after each draft. [b, γ'+1, V]"""
        if self.prompts is not None:  # the prompts, then the drafts, in one pass
            (ids, valid), self.prompts = self.prompts, None
            return self.target.prefill(torch.cat([ids, drafts], dim=1),  # [B, L + γ']
                                       torch.cat([valid, valid.new_ones(drafts.shape)], dim=1),
                                       keep=drafts.size(1) + 1)  # [B, γ'+1, V]
        if self.after_prompt is None:
            return self.target.feed(torch.cat([last.unsqueeze(1), drafts], dim=1))  # [b, γ'+1, V]
        first = self.after_prompt.unsqueeze(1)  # [B, 1, V]
        self.after_prompt = None
        if not drafts.size(1):
            return first
        return torch.cat([first, self.target.feed(drafts)], dim=1)  # [B, γ'+1, V]

