"""A model draft run by llama.cpp: a GGUF file (for a target loaded from a GGUF, that same file,
quantized) through llama-cpp-python's low-level API, one llama.cpp sequence per row.

Why: on a CPU an eager PyTorch forward of a small model costs as much as the target's (the
bf16 copy of the bundled model is no cheaper than its float32 target), while llama.cpp runs the
bundled 4-bit file in a fraction of it. q is still the draft's own decoding distribution: its
logits through the same temperature/top-k/top-p as p, and each draft is drawn from that q.
"""
from __future__ import annotations

import functools
import os
import time
from pathlib import Path

import torch

from exactspec.drafters.base import Drafter, Proposal, lag
from exactspec.models import check_length, input_device, unwrap_model
from exactspec.models.llamacpp import (
    THREADS_ENV, import_llama_cpp, load_gguf, target_threads, token_list, torch_on_one_thread,
    usable_cores,
)
from exactspec.sampling import SamplingConfig, sample
from exactspec.threads import ThreadChoice


def gguf_file(target) -> Path | None:
    """The GGUF file a target was loaded from: a packaged model's (the bundled one, the real
    pair), or a `.gguf` spec's; None for anything else (a Hugging Face folder or hub model, a
    bare model)."""
    from exactspec.models import LoadedModel
    from exactspec.models.loading import gguf_path

    if not isinstance(target, LoadedModel):
        return None
    return target.model.path if target.backend == "llamacpp" else gguf_path(target.name)


class LlamaCppDrafter(Drafter):
    """Drafts with llama.cpp from a GGUF file.

    Each row is a llama.cpp sequence (`Sequences`) with its own positions, so ragged rows need
    no padding. Bookkeeping per row: its tokens in llama.cpp's KV cache (`Sequences.fed`), and
    `pending` committed tokens not yet fed (always at least the last committed token; after
    rounds this drafter sat out, all their tokens: it catches up lazily, when it next proposes).
    A round feeds each row's pending tokens in one decode, then one token per further draft for
    all rows at once; after verifying, the fed drafts that were rejected leave the row's sequence.
    """

    def __init__(self, path: str | os.PathLike, n_threads: int | None = None):
        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise ValueError(f"draft 'llamacpp:{path}': no such GGUF file")
        import_llama_cpp()  # the install line, if llama-cpp-python is missing
        self.gguf = load_gguf(str(self.path.resolve()))
        if n_threads is None and os.environ.get(THREADS_ENV) is not None:
            n_threads = target_threads()  # a process sharing its cores: the target's fixed count
        self.n_threads = n_threads or usable_cores()
        # its decodes run on all its threads or on one, whichever is faster now (`Sequences`,
        # `exactspec.threads`); a count given explicitly (or by EXACTSPEC_THREADS) is kept
        self.threads = ThreadChoice((self.n_threads, 1)) if n_threads is None else None
        self.name = f"llamacpp:{self.path.name}"
        self.rows, self.device = None, torch.device("cpu")
        self.catch_up = (0.0, 0)  # (seconds, decodes) of the last proposal's catch-up (see propose)

    def run_on(self, n_threads: int) -> None:
        """Every decode from the next generation on runs on n_threads (bench --threads), not a count
        chosen per decode."""
        self.n_threads, self.threads = n_threads, None

    calls = property(lambda self: self.rows.calls if self.rows else 0)
    tokens_fed = property(lambda self: self.rows.tokens_fed if self.rows else 0)
    padding_fed = 0  # sequences need no padding

    def tokens(self) -> tuple[str, ...]:
        """The GGUF's token list: token id i is tokens()[i]."""
        return token_list(str(self.path.resolve()))

    @functools.cached_property
    def tokenizer(self):
        """The tokenizer written in the GGUF (converted by transformers), for a `TLIDrafter`."""
        from exactspec.models.conversion import gguf_tokenizer

        return gguf_tokenizer(self.path)

    def bind(self, target, total_tokens: int) -> int:
        """The shared vocabulary: the GGUF's token list must be the target tokenizer's (the
        vocabulary rule), and prompt + budget must fit the GGUF's training context."""
        from exactspec.models.vocab import check_token_list

        self.bind_own(target, total_tokens)
        return check_token_list(target, self.tokens(), f"draft {self.name!r}")

    def bind_own(self, target, total_tokens: int) -> int:
        """`bind` less the vocabulary rule (a `TLIDrafter` maps vocabularies instead): drafts and
        q go where the target's p is, and prompt + budget must fit the GGUF's training context.
        Returns the width of its logits."""
        model, _, _ = unwrap_model(target, "target")
        self.device = input_device(model)
        check_length(self.gguf.llama.n_ctx_train(), self.name, total_tokens)
        return self.gguf.llama.n_vocab()

    def start(self, input_ids: torch.Tensor, valid: torch.Tensor, vocab_size: int) -> None:
        if self.rows is None or self.rows.vocab_size != vocab_size:
            # a context another draft of this file left, or a new one
            self.rows = self.gguf.take_rows(self, f"draft {self.name}", self.n_threads, vocab_size,
                                            self.threads)
        self.rows.clear()  # a generation after the first reuses the context, its KV cache emptied
        self.pending = []
        self.join(input_ids, valid)

    def next_source(self) -> str:
        return "model"

    def lag(self) -> int:
        """Pending tokens beyond a round in step's (see `drafters.base.lag`)."""
        return lag(map(len, self.pending))

    def propose(self, gamma: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Proposal:
        """Up to γ drafts per row. When some row is more than two tokens behind, the first decode
        (its catch-up) is reported apart in `catch_up`: the controller learns a round's cost from
        the decodes after it."""
        batch, self.catch_up = len(self.pending), (0.0, 0)
        if gamma == 0:  # the budget's last token: nothing to draft, nothing to feed
            self.drafts = torch.empty(batch, 0, dtype=torch.long)
            return Proposal(self.drafts, None)
        with torch_on_one_thread():
            return self._propose(batch, gamma, sampling, generator)

    def _propose(self, batch: int, gamma: int, sampling: SamplingConfig, generator) -> Proposal:
        self.rows.make_room(sum(map(len, self.pending)) + batch * gamma)
        start, calls, behind = time.perf_counter(), self.calls, self.lag() > 0
        logits = self.rows.decode(self.pending)  # [B, V], after each row's pending tokens
        if behind:  # a prompt, or rounds it sat out: not what a round costs once in step
            self.catch_up = (time.perf_counter() - start, self.calls - calls)
        self.pending = [[] for _ in range(batch)]
        drafts, qs = torch.empty(batch, gamma, dtype=torch.long), []  # [B, γ], filled as drawn
        for i in range(gamma):
            q_i = sampling.probs(logits, drafts=drafts[:, :i]).to(self.device)  # [B, V], after drafts so far
            drafts[:, i] = sample(q_i, generator).cpu()  # [B]
            qs.append(q_i)
            if i + 1 < gamma:  # the last draft is fed next round, if it is kept
                logits = self.rows.decode([[token] for token in drafts[:, i].tolist()])  # [B, V]
        self.drafts = drafts  # [B, γ]
        return Proposal(drafts.to(self.device), torch.stack(qs, dim=1))  # [B, γ], [B, γ, V]

    def commit(self, num_accepted: torch.Tensor, next_tokens: torch.Tensor,
               next_valid: torch.Tensor | None = None) -> None:
        """Row b kept its first a = num_accepted[b] drafts: of the γ − 1 fed ones, those past a
        leave its sequence; the last draft (if kept) and the next token become pending.
        next_tokens [B]; or [B, k] with next_valid [B, k], for a draft that spells a committed
        token with several of its own (`TLIDrafter`)."""
        gamma, following = self.drafts.size(1), _rows(next_tokens, next_valid)
        if gamma == 0:
            self.observe(self.drafts, num_accepted, next_tokens, next_valid)
            return
        for b, (kept, tokens) in enumerate(zip(num_accepted.tolist(), following)):
            rejected = gamma - 1 - min(kept, gamma - 1)  # fed drafts after the kept ones
            self.rows.truncate(b, len(self.rows.fed[b]) - rejected)
            self.pending[b] = ([int(self.drafts[b, -1])] if kept == gamma else []) + tokens

    def observe(self, drafts: torch.Tensor, num_accepted: torch.Tensor,
                next_tokens: torch.Tensor, next_valid: torch.Tensor | None = None) -> None:
        """A round this drafter did not feed: each row's committed tokens (its first
        num_accepted[b] of drafts[B, γ'], then its next tokens, as in `commit`) join its
        pending ones."""
        following = _rows(next_tokens, next_valid)
        for b, (kept, tokens) in enumerate(zip(num_accepted.tolist(), following)):
            self.pending[b] += drafts[b, :kept].tolist() + tokens

    def select(self, rows: torch.Tensor) -> None:
        keep = rows.tolist()
        self.rows.select(keep)  # finished rows free their sequences
        self.pending = [self.pending[b] for b in keep]

    def join(self, input_ids: torch.Tensor, valid: torch.Tensor, lazy: bool = True) -> None:
        """New rows (left-padded prompts [n, L]) join at a round boundary: each gets a free
        sequence, and its whole prompt is pending (fed when this drafter next proposes)."""
        self.rows.add(input_ids.size(0), "draft")
        self.pending += [row[mask.bool()].tolist() for row, mask in zip(input_ids, valid)]


def _rows(tokens: torch.Tensor, valid: torch.Tensor | None) -> list[list[int]]:
    """Committed tokens [B], or [B, k] with their valid mask [B, k], as one list per row."""
    if tokens.dim() == 1:
        return [[token] for token in tokens.tolist()]
    return [row[ok].tolist() for row, ok in zip(tokens, valid)]
