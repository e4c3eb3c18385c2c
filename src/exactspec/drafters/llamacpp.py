"""A model draft run by llama.cpp: a GGUF file (for a target loaded from a GGUF, that same file,
quantized) through llama-cpp-python's low-level API, one llama.cpp sequence per row.

Why: on a CPU an eager PyTorch forward of a small model costs as much as the target's (the
bf16 copy of the bundled model is no cheaper than its float32 target), while llama.cpp runs the
bundled 4-bit file in a fraction of it. q is still the draft's own decoding distribution: its
logits through the same temperature/top-k/top-p as p, and each draft is drawn from that q.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import time
import weakref
from pathlib import Path

import numpy as np
import torch

from exactspec.drafters.base import Proposal, lag
from exactspec.models import check_length, unwrap_model
from exactspec.sampling import SamplingConfig, sample
from exactspec.threads import ThreadChoice

INSTALL_HINT = ("llama-cpp-python is not installed: pip install 'exactspec[llamacpp]' "
                "(or `make setup`, which builds it)")
# llama.cpp aborts the process (no error code) unless n_ctx and n_ubatch are at least n_seq_max.
MAX_ROWS = 256  # llama.cpp's limit on sequences in one context (LLAMA_MAX_SEQ)
BATCH_TOKENS = 512  # the most tokens one llama_decode call takes; longer feeds are split
FIRST_CONTEXT = 4096  # KV cells at the start; doubled whenever the rows need more


def import_llama_cpp():
    """The llama_cpp module, quiet (its C log silenced), or ImportError with the install line."""
    try:
        import llama_cpp
    except ImportError as err:
        raise ImportError(INSTALL_HINT) from err
    if not hasattr(import_llama_cpp, "log_callback"):  # kept alive: C holds the pointer
        import_llama_cpp.log_callback = llama_cpp.llama_log_callback(lambda level, text, data: None)
        llama_cpp.llama_log_set(import_llama_cpp.log_callback, ctypes.c_void_p(0))
    return llama_cpp


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@contextlib.contextmanager
def torch_on_one_thread():
    """torch on one thread inside the block: the draft's own torch work (q from its logits, the
    draws) is small, and a parallel region would leave torch's OpenMP workers spinning on the
    cores the next llama.cpp decode needs — however GOMP_SPINCOUNT was set, whatever was
    imported first."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def gguf_file(target) -> Path | None:
    """The GGUF file a target was loaded from: a packaged model's (the bundled one, the real
    pair), or a `.gguf` spec's; None for anything else (a Hugging Face folder or hub model, a
    bare model)."""
    from exactspec.models import LoadedModel
    from exactspec.models.loading import named_gguf

    if not isinstance(target, LoadedModel):
        return None
    packaged = named_gguf(target.name)
    if packaged is not None:
        return packaged
    path = Path(target.name).expanduser()
    return path if path.suffix.lower() == ".gguf" and path.is_file() else None


class LlamaCppDrafter:
    """Drafts with llama.cpp from a GGUF file.

    Each row is a llama.cpp sequence with its own positions, so ragged rows need no padding.
    Bookkeeping per row: `fed` tokens are in llama.cpp's KV cache, `pending` committed tokens
    are not yet (always at least the last committed token; after rounds this drafter sat out, all
    their tokens: it catches up lazily, when it next proposes). A round feeds each row's pending
    tokens in one decode, then one token per further draft for all rows at once; after verifying,
    the fed drafts that were rejected are removed from the row's sequence (`llama_memory_seq_rm`).
    """

    def __init__(self, path: str | os.PathLike, n_threads: int | None = None):
        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise ValueError(f"draft 'llamacpp:{path}': no such GGUF file")
        self.llama = import_llama_cpp()
        self.model = _load_gguf(str(self.path.resolve()))
        self.n_threads = n_threads or usable_cores()
        # the draft's one-token decodes run on all its threads or on one, whichever is faster now
        # (`exactspec.threads`); a count given explicitly is kept
        self.threads = ThreadChoice((self.n_threads, 1)) if n_threads is None else None
        self.running_threads = self.n_threads
        self.name = f"llamacpp:{self.path.name}"
        self.calls = self.tokens_fed = self.padding_fed = 0
        self.context, self.device = None, torch.device("cpu")
        self.catch_up = (0.0, 0)  # (seconds, decodes) of the last proposal's catch-up (see propose)

    def tokens(self) -> tuple[str, ...]:
        """The GGUF's token list: token id i is tokens()[i]."""
        return _token_list(str(self.path.resolve()))

    def bind(self, target, total_tokens: int) -> int:
        """The shared vocabulary: the GGUF's token list must be the target tokenizer's (the
        vocabulary rule), and prompt + budget must fit the GGUF's training context."""
        from exactspec.models.vocab import check_token_list

        model, _, _ = unwrap_model(target, "target")
        self.device = next(model.parameters()).device  # drafts and q go where the target's p is
        check_length(self.model.n_ctx_train(), self.name, total_tokens)
        return check_token_list(target, self.tokens(), f"draft {self.name!r}")

    def start(self, input_ids: torch.Tensor, valid: torch.Tensor, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.seqs, self.fed, self.pending = [], [], []
        if self.context is None:
            self._new_context(FIRST_CONTEXT)
        else:  # a generation after the first: the context is reused, its KV cache emptied
            self.llama.llama_memory_clear(self.memory, True)
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
        batch, self.catch_up = len(self.seqs), (0.0, 0)
        if gamma == 0:  # the budget's last token: nothing to draft, nothing to feed
            self.drafts = torch.empty(batch, 0, dtype=torch.long)
            return Proposal(self.drafts, None)
        with torch_on_one_thread():
            return self._propose(batch, gamma, sampling, generator)

    def _propose(self, batch: int, gamma: int, sampling: SamplingConfig, generator) -> Proposal:
        self._make_room(sum(map(len, self.pending)) + batch * gamma)
        start, calls, behind = time.perf_counter(), self.calls, self.lag() > 0
        logits = self._feed(self.pending)  # [B, V], after each row's pending tokens
        if behind:  # a prompt, or rounds it sat out: not what a round costs once in step
            self.catch_up = (time.perf_counter() - start, self.calls - calls)
        self.pending = [[] for _ in range(batch)]
        drafts, qs = torch.empty(batch, gamma, dtype=torch.long), []  # [B, γ], filled as drawn
        for i in range(gamma):
            q_i = sampling.probs(logits, drafts=drafts[:, :i]).to(self.device)  # [B, V], after drafts so far
            drafts[:, i] = sample(q_i, generator).cpu()  # [B]
            qs.append(q_i)
            if i + 1 < gamma:  # the last draft is fed next round, if it is kept
                logits = self._step([[token] for token in drafts[:, i].tolist()])  # [B, V]
        self.drafts = drafts  # [B, γ]
        return Proposal(drafts.to(self.device), torch.stack(qs, dim=1))  # [B, γ], [B, γ, V]

    def commit(self, num_accepted: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Row b kept its first a = num_accepted[b] drafts: of the γ − 1 fed ones, those past a
        leave its sequence; the last draft (if kept) and the next token become pending."""
        gamma = self.drafts.size(1)
        if gamma == 0:
            self.observe(self.drafts, num_accepted, next_tokens)
            return
        memory = self.memory
        for b, (kept, token) in enumerate(zip(num_accepted.tolist(), next_tokens.tolist())):
            rejected = gamma - 1 - min(kept, gamma - 1)  # fed drafts after the kept ones
            if rejected:
                del self.fed[b][-rejected:]
                self.llama.llama_memory_seq_rm(memory, self.seqs[b], len(self.fed[b]), -1)
            self.pending[b] = ([int(self.drafts[b, -1])] if kept == gamma else []) + [token]

    def observe(self, drafts: torch.Tensor, num_accepted: torch.Tensor,
                next_tokens: torch.Tensor) -> None:
        """A round this drafter did not feed: each row's committed tokens (its first
        num_accepted[b] of drafts[B, γ'], then next_tokens[b]) join its pending ones."""
        for b, (kept, token) in enumerate(zip(num_accepted.tolist(), next_tokens.tolist())):
            self.pending[b] += drafts[b, :kept].tolist() + [token]

    def select(self, rows: torch.Tensor) -> None:
        keep = rows.tolist()
        for b in set(range(len(self.seqs))) - set(keep):  # finished rows free their sequences
            self.llama.llama_memory_seq_rm(self.memory, self.seqs[b], -1, -1)
        self.seqs = [self.seqs[b] for b in keep]
        self.fed = [self.fed[b] for b in keep]
        self.pending = [self.pending[b] for b in keep]

    def join(self, input_ids: torch.Tensor, valid: torch.Tensor, lazy: bool = True) -> None:
        """New rows (left-padded prompts [n, L]) join at a round boundary: each gets a free
        sequence, and its whole prompt is pending (fed when this drafter next proposes)."""
        free = sorted(set(range(MAX_ROWS)) - set(self.seqs))
        if input_ids.size(0) > len(free):
            raise ValueError(f"draft {self.name!r} serves at most {MAX_ROWS} rows at once, "
                             f"got {len(self.seqs) + input_ids.size(0)}")
        for row, mask, seq in zip(input_ids, valid, free):
            self.llama.llama_memory_seq_rm(self.memory, seq, -1, -1)
            self.seqs.append(seq)
            self.fed.append([])
            self.pending.append(row[mask.bool()].tolist())

    def _step(self, tokens: list[list[int]]) -> torch.Tensor:
        """`_feed` of one token per row, on the thread count `threads` chooses, timed for it."""
        if self.threads is None:
            return self._feed(tokens)
        count = self.threads.choose(len(tokens))
        if count != self.running_threads:
            self.llama.llama_set_n_threads(self.context, count, count)
            self.running_threads = count
        start = time.perf_counter()
        logits = self._feed(tokens)
        self.threads.record(count, len(tokens), time.perf_counter() - start)
        return logits

    def _feed(self, tokens: list[list[int]]) -> torch.Tensor:
        """Feed tokens[b] to row b's sequence (all rows, in decodes of at most BATCH_TOKENS
        tokens); return each row's logits after its last token, [B, V] float32 (undefined for a
        row given no tokens)."""
        entries = [(b, token, len(self.fed[b]) + i, i == len(row) - 1)
                   for b, row in enumerate(tokens) for i, token in enumerate(row)]
        logits = torch.empty(len(tokens), self.vocab_size)  # [B, V]
        for start in range(0, len(entries), BATCH_TOKENS):
            chunk = entries[start: start + BATCH_TOKENS]
            batch = self.batch.batch
            for j, (b, token, pos, last) in enumerate(chunk):
                batch.token[j], batch.pos[j], batch.logits[j] = token, pos, last
                batch.seq_id[j][0], batch.n_seq_id[j] = self.seqs[b], 1
            batch.n_tokens = len(chunk)
            if self.llama.llama_decode(self.context, batch):
                raise RuntimeError(f"draft {self.name!r}: llama_decode failed on {len(chunk)} tokens")
            self.calls += 1
            for j, (b, _, _, last) in enumerate(chunk):
                if last:
                    row = np.ctypeslib.as_array(self.llama.llama_get_logits_ith(self.context, j),
                                                shape=(self.n_vocab,))
                    logits[b] = torch.from_numpy(row[: self.vocab_size])
        for b, row in enumerate(tokens):
            self.fed[b] += row
        self.tokens_fed += len(entries)
        return logits

    def _make_room(self, new_tokens: int) -> None:
        """Before a feed of new_tokens: if llama.cpp's KV cells cannot hold every row's tokens,
        a context twice the size replaces it, and every row's tokens are pending again."""
        needed = sum(map(len, self.fed)) + new_tokens
        size = self.llama.llama_n_ctx(self.context)
        if needed <= size:
            return
        while size < needed:
            size *= 2
        self._new_context(size)
        self.pending = [fed + pending for fed, pending in zip(self.fed, self.pending)]
        self.fed = [[] for _ in self.seqs]

    def _new_context(self, n_ctx: int) -> None:
        """A llama.cpp context (its KV cache) of n_ctx cells for up to MAX_ROWS sequences, freed
        when this drafter is (or replaced)."""
        from llama_cpp import _internals

        params = self.llama.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, BATCH_TOKENS, BATCH_TOKENS
        params.n_seq_max, params.kv_unified = MAX_ROWS, True
        params.n_threads = params.n_threads_batch = self.n_threads
        self.running_threads = self.n_threads
        if self.context is not None:
            self._free_context()
        self.context = self.llama.llama_init_from_model(self.model.model, params)
        if self.context is None:
            raise RuntimeError(f"draft {self.name!r}: llama.cpp could not make a context of {n_ctx} tokens")
        self._free_context = weakref.finalize(self, self.llama.llama_free, self.context)
        self.memory = self.llama.llama_get_memory(self.context)
        self.batch = _internals.LlamaBatch(n_tokens=BATCH_TOKENS, embd=0, n_seq_max=1, verbose=False)
        self.n_vocab = self.model.n_vocab()


@functools.lru_cache(maxsize=4)
def _load_gguf(path: str):
    """llama.cpp's model for a GGUF file, loaded once per process (each drafter makes its own
    context, i.e. its own KV cache, from it)."""
    from llama_cpp import _internals

    return _internals.LlamaModel(path_model=path, verbose=False,
                                 params=import_llama_cpp().llama_model_default_params())


@functools.lru_cache(maxsize=4)
def _token_list(path: str) -> tuple[str, ...]:
    model = _load_gguf(path)
    return tuple(model.token_get_text(i) for i in range(model.n_vocab()))
