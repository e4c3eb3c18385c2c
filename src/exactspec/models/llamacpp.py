"""llama.cpp through llama-cpp-python's low-level API: GGUF files, rows as sequences of one
context, and a GGUF model loaded to be a target (`LlamaCppModel`).

Both the llama.cpp draft (`exactspec.drafters.llamacpp`) and the llama.cpp target
(`exactspec.targets.LlamaCppTarget`) keep their rows in `Sequences`: one llama.cpp context
(one unified KV cache) for up to MAX_ROWS rows, each a llama.cpp sequence with its own
positions, so ragged rows need no padding and a rejected draft leaves its row by
`llama_memory_seq_rm` alone.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
import weakref
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

INSTALL_HINT = ("llama-cpp-python is not installed: pip install 'exactspec[llamacpp]' "
                "(or `make setup`, which builds it)")
# llama.cpp aborts the process (no error code) unless n_ctx and n_ubatch are at least n_seq_max.
MAX_ROWS = 256  # llama.cpp's limit on sequences in one context (LLAMA_MAX_SEQ)
BATCH_TOKENS = 512  # the most tokens one llama_decode call takes; longer feeds are split
FIRST_CONTEXT = 4096  # KV cells at the start; doubled whenever the rows need more
THREADS_ENV = "EXACTSPEC_THREADS"  # a llama.cpp target's thread count (`target_threads`)
INVARIANT = "invariant"  # `llamacpp:NAME@invariant`: numerics that do not depend on a decode's size
# An invariant target's passes: at most this many tokens a decode (ggml's tiled K-quant product
# takes 8 rows and more), its KV cache in bfloat16 (ggml splits a one-token decode's attention
# over an f16 cache of 512 cells or more across threads) and its weights not repacked (ggml's
# repacked products switch kernels at 4 rows). docs/llamacpp.md, "Numerics that do not depend on
# a decode's size".
INVARIANT_TOKENS = 7
GGML_TYPE_BF16 = 30  # ggml.h; llama-cpp-python names no constant for it


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


def target_threads() -> int:
    """A llama.cpp target's thread count: EXACTSPEC_THREADS if set (a process sharing its cores
    with others: more threads than free cores make llama.cpp's threads wait for each other at
    every operation), else the usable cores."""
    value = os.environ.get(THREADS_ENV)
    if value is None:
        return usable_cores()
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{THREADS_ENV} must be an integer >= 1, got {value!r}")
    return int(value)


@contextlib.contextmanager
def torch_on_one_thread():
    """torch on one thread inside the block: beside llama.cpp, torch's work (p or q from
    logits, the draws) is small, and a parallel region would leave torch's OpenMP workers
    spinning on the cores the next llama.cpp decode needs — however GOMP_SPINCOUNT was set,
    whatever was imported first."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def load_gguf(path: str, invariant: bool = False) -> Gguf:
    """A GGUF file's llama.cpp model, loaded once per process (once more for invariant use)."""
    return _loaded_gguf(path, invariant)  # one cache key however the caller passes `invariant`


@functools.lru_cache(maxsize=4)
def _loaded_gguf(path: str, invariant: bool) -> Gguf:
    return Gguf(path, invariant)


class Gguf:
    """A GGUF file's llama.cpp model (`llama`) and the contexts its finished users left (`idle`).
    Each user (a generation's target, a draft) runs in a context of its own, its own KV cache,
    taken with `take_rows`. `invariant`: its weights not repacked and its contexts' KV caches in
    bfloat16 with flash attention (`INVARIANT_TOKENS`)."""

    def __init__(self, path: str, invariant: bool = False):
        from llama_cpp import _internals

        params = import_llama_cpp().llama_model_default_params()
        params.use_extra_bufts = not invariant
        self.llama = _internals.LlamaModel(path_model=path, verbose=False, params=params)
        self.invariant = invariant
        self.idle: list[Sequences] = []
        self._taking = threading.Lock()  # users in two threads take two contexts

    def take_rows(self, owner, name: str, n_threads: int, vocab_size: int, choice=None,
                  keep: bool = False) -> Sequences:
        """Empty rows for `owner`: a context an earlier owner left, its KV cache emptied (keep:
        its rows kept as `Sequences.cached`, a prompt cache) and its counters zeroed, or a new
        one; it goes back to `idle` when `owner` is freed. Making a
        context costs a pass or more (the 1.5B's: 0.14 s alone, 1.5-3 s beside
        llama-cpp-python's own context; the bundled model's 0.09 s, a dozen draft tokens), so a
        generation does not pay for one."""
        with self._taking:  # keep: the context returned last, the previous generation's
            rows = next((r for r in (reversed(self.idle) if keep else self.idle)
                         if r.vocab_size == vocab_size), None)
            if rows is not None:
                self.idle.remove(rows)
        if rows is None:
            rows = Sequences(self.llama, name, n_threads, vocab_size, choice, self.invariant)
        rows.name, rows.n_threads, rows.choice, rows.calls, rows.tokens_fed = name, n_threads, choice, 0, 0
        rows.clear(keep)
        rows.set_threads(n_threads)
        weakref.finalize(owner, self.idle.append, rows)
        return rows


@functools.lru_cache(maxsize=4)
def token_list(path: str) -> tuple[str, ...]:
    """The GGUF's tokens: token id i is token_list(path)[i]."""
    model = load_gguf(path).llama
    return tuple(model.token_get_text(i) for i in range(model.n_vocab()))


def end_tokens(path: str) -> list[int]:
    """The ids llama.cpp ends a generation on (end of generation: EOS, end of turn, ...)."""
    llama = import_llama_cpp()
    vocab = llama.llama_model_get_vocab(load_gguf(path).llama.model)
    return [i for i in range(llama.llama_vocab_n_tokens(vocab)) if llama.llama_vocab_is_eog(vocab, i)]


class LlamaCppModel:
    """A GGUF file loaded by llama.cpp to be a target (`load_model(..., backend="llamacpp")`).

    It holds the file and the facts `exactspec.models.loaded` reads from a model's config: its
    training context, its vocabulary size and the ids llama.cpp ends a generation on. Each
    generation runs it in a context of its own (`exactspec.targets.LlamaCppTarget`), one an
    earlier generation left where there is one (`Gguf.take_rows`). `invariant` (the spec
    `llamacpp:NAME@invariant`): a token's logits do not depend on the size of the decode that
    scored it, so greedy speculative output is plain greedy output token for token, whatever γ
    (`INVARIANT_TOKENS`). `prompt_cache`: a generation resumes the rows an earlier one left in
    its context where their tokens begin its prompt (`Sequences.add`), and feeds only the rest."""

    backend = "llamacpp"

    def __init__(self, path: str | os.PathLike, name: str, invariant: bool = False,
                 prompt_cache: bool = False):
        self.path = Path(path).expanduser().resolve()
        self.invariant, self.prompt_cache = invariant, prompt_cache
        self.gguf = load_gguf(str(self.path), invariant)
        self.llama = self.gguf.llama
        self.device = torch.device("cpu")
        # every decode of every generation on this many threads: a pass's numerics may depend on
        # the thread count, and a seed names one text (set it before a generation to change it)
        self.n_threads = target_threads()
        self.config = SimpleNamespace(name_or_path=name, max_position_embeddings=self.llama.n_ctx_train(),
                                      vocab_size=self.llama.n_vocab(), eos_token_id=end_tokens(str(self.path)))

    def tokens(self) -> tuple[str, ...]:
        return token_list(str(self.path))


class Sequences:
    """Rows as sequences of one llama.cpp context: row b is sequence seqs[b], and fed[b] lists its
    tokens in the KV cache (positions 0..len−1). The context is made on first use; `make_room`
    replaces it by one twice the size, the rows moved into it, when their tokens would not fit.

    With a `choice` (an `exactspec.threads.ThreadChoice`), each decode runs on the thread count
    it chooses for the decode's size and is timed for it (`ThreadChoice.run`): on a machine
    where another process is busy, llama.cpp's threads wait for each other at every barrier
    while one of them is descheduled, and one thread can be several times faster."""

    def __init__(self, model, name: str, n_threads: int, vocab_size: int, choice=None,
                 invariant: bool = False):
        self.llama, self.model, self.name = import_llama_cpp(), model, name
        self.invariant = invariant  # passes (every=True) of ≤ INVARIANT_TOKENS a decode
        self.n_threads, self.vocab_size, self.choice = n_threads, vocab_size, choice
        self.running = n_threads  # the context's thread count now
        self.context = None
        self.seqs: list[int] = []
        self.fed: list[list[int]] = []
        self.cached: dict[int, list[int]] = {}
        self.calls = self.tokens_fed = 0

    def clear(self, keep: bool = False) -> None:
        """No rows (the context, if made, is kept and its KV cache emptied). keep: the rows'
        sequences stay in the KV cache as `cached` (sequence → its tokens) for `add` to resume."""
        if self.context is None:
            self.new_context(FIRST_CONTEXT)
            self.cached = {}
        elif keep:  # with what an owner that added no rows left cached
            self.cached.update(zip(self.seqs, self.fed))
        else:
            self.llama.llama_memory_clear(self.memory, True)
            self.cached = {}
        self.seqs, self.fed = [], []

    def add(self, rows: int, what: str, prompts: list[list[int]] | None = None) -> None:
        """`rows` new rows, appended last, each an empty free sequence. With `prompts` (row i's
        prompt is prompts[i]), a row may resume a `cached` sequence instead (`_resume`), cut to
        the prefix it shares with the prompt, at most len(prompt) − 1 tokens, so that the row's
        prompt still feeds a token. The cached sequences no row resumes are emptied."""
        resumed = self._resume(prompts or [])
        for seq in self.cached:
            self.llama.llama_memory_seq_rm(self.memory, seq, -1, -1)
        self.cached = {}
        free = sorted(set(range(MAX_ROWS)) - set(self.seqs) - {r[0] for r in resumed if r})
        if rows - sum(map(bool, resumed)) > len(free):
            raise ValueError(f"{what} {self.name!r} serves at most {MAX_ROWS} rows at once, "
                             f"got {len(self.seqs) + rows}")
        free.reverse()
        for i in range(rows):
            seq, fed = resumed[i] if i < len(resumed) and resumed[i] else (free.pop(), [])
            self.llama.llama_memory_seq_rm(self.memory, seq, len(fed), -1)
            self.seqs.append(seq)
            self.fed.append(fed)

    def _resume(self, prompts: list[list[int]]) -> list[tuple[int, list[int]] | None]:
        """Per prompt, the cached sequence it resumes and the tokens kept of it (at most
        len(prompt) − 1), or None: the longest shared prefixes are matched first, each cached
        sequence to one prompt at most, and taken out of `cached`."""
        def shared(seq: int, prompt: list[int]) -> int:
            pairs = zip(self.cached[seq], prompt[:-1])
            return next((i for i, (a, b) in enumerate(pairs) if a != b),
                        min(len(self.cached[seq]), len(prompt) - 1))

        matches = sorted(((shared(seq, p), i, seq) for i, p in enumerate(prompts) for seq in self.cached),
                         reverse=True)
        resumed: list[tuple[int, list[int]] | None] = [None] * len(prompts)
        for n, i, seq in matches:
            if n > 0 and resumed[i] is None and seq in self.cached:
                resumed[i] = seq, self.cached.pop(seq)[:n]
        return resumed

    def select(self, keep: list[int]) -> None:
        """Keep only these rows, in this order; the others free their sequences."""
        for b in set(range(len(self.seqs))) - set(keep):
            self.llama.llama_memory_seq_rm(self.memory, self.seqs[b], -1, -1)
        self.seqs = [self.seqs[b] for b in keep]
        self.fed = [self.fed[b] for b in keep]

    def truncate(self, row: int, length: int) -> None:
        """Row `row` keeps only its first `length` tokens."""
        if length < len(self.fed[row]):
            del self.fed[row][length:]
            self.llama.llama_memory_seq_rm(self.memory, self.seqs[row], length, -1)

    def make_room(self, new_tokens: int) -> None:
        """Before a feed of new_tokens: if the KV cells cannot hold every row's tokens, a context
        twice the size (or more) replaces this one, each row's sequence copied into it as it is
        (`llama_state_seq_get_data`: its cached keys and values, bit for bit — fed again, they
        could come out of a larger decode with other numerics)."""
        needed = sum(map(len, self.fed)) + new_tokens
        size = self.llama.llama_n_ctx(self.context)
        if needed <= size:
            return
        while size < needed:
            size *= 2
        states = []
        for seq in self.seqs:
            length = self.llama.llama_state_seq_get_size(self.context, seq)
            buffer = (ctypes.c_uint8 * length)()
            self.llama.llama_state_seq_get_data(self.context, buffer, length, seq)
            states.append(buffer)
        self.new_context(size)
        for seq, buffer in zip(self.seqs, states):
            if not self.llama.llama_state_seq_set_data(self.context, buffer, len(buffer), seq):
                raise RuntimeError(f"{self.name!r}: llama.cpp could not move a row into a context of {size} tokens")

    def set_threads(self, count: int) -> None:
        if count != self.running:
            self.llama.llama_set_n_threads(self.context, count, count)
            self.running = count

    def decode(self, tokens: list[list[int]], every: bool = False, logits: bool = True) -> torch.Tensor:
        """Feed tokens[b] to row b (all rows, in decodes of at most BATCH_TOKENS tokens, or
        INVARIANT_TOKENS for an invariant context's logits after every token). Returns
        float32 logits over the usable vocabulary: after every fed token (every=True,
        [Σ_b len(tokens[b]), V], rows in order), else after each row's last token ([B, V];
        a row given no tokens gets a row of zeros); logits=False: none ([0, V]), the tokens
        only enter the cache."""
        entries = [(b, token, len(self.fed[b]) + i, logits and (every or i == len(row) - 1))
                   for b, row in enumerate(tokens) for i, token in enumerate(row)]
        rows = (len(entries) if every else len(tokens)) if logits else 0
        out = torch.zeros(rows, self.vocab_size)  # [n, V]
        written, size = 0, INVARIANT_TOKENS if self.invariant and every else BATCH_TOKENS
        for start in range(0, len(entries), size):
            chunk = entries[start: start + size]
            written = self._decode_chunk(chunk, out, written, every)
        for b, row in enumerate(tokens):
            self.fed[b] += row
        self.tokens_fed += len(entries)
        return out

    def _decode_chunk(self, chunk, out: torch.Tensor, written: int, every: bool) -> int:
        batch = self.batch.batch
        for j, (b, token, pos, wanted) in enumerate(chunk):
            batch.token[j], batch.pos[j], batch.logits[j] = token, pos, wanted
            batch.seq_id[j][0], batch.n_seq_id[j] = self.seqs[b], 1
        batch.n_tokens = len(chunk)
        if self.choice is None:
            return self._run(chunk, out, written, every)
        return self.choice.run(len(chunk), self.set_threads, lambda: self._run(chunk, out, written, every))

    def _run(self, chunk, out: torch.Tensor, written: int, every: bool) -> int:
        """llama_decode of the batch filled from chunk; the logits wanted copied into out."""
        batch = self.batch.batch
        if self.llama.llama_decode(self.context, batch):
            raise RuntimeError(f"{self.name!r}: llama_decode failed on {len(chunk)} tokens")
        self.calls += 1
        rows = [b for b, _, _, wanted in chunk if wanted]
        if rows:  # llama.cpp's outputs: one row of n_vocab floats per wanted entry, in order
            logits = np.ctypeslib.as_array(self.llama.llama_get_logits(self.context),
                                           shape=(len(rows), self.n_vocab))[:, : self.vocab_size]
            where = slice(written, written + len(rows)) if every else torch.tensor(rows)
            out[where] = torch.from_numpy(logits)
        return written + len(rows)

    def new_context(self, n_ctx: int) -> None:
        """A llama.cpp context (its KV cache) of n_ctx cells for up to MAX_ROWS sequences, freed
        with this object (or when replaced)."""
        from llama_cpp import _internals

        params = self.llama.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, BATCH_TOKENS, BATCH_TOKENS
        params.n_seq_max, params.kv_unified = MAX_ROWS, True
        params.n_threads = params.n_threads_batch = self.n_threads
        if self.invariant:
            params.type_k = params.type_v = GGML_TYPE_BF16
            params.flash_attn_type = self.llama.LLAMA_FLASH_ATTN_TYPE_ENABLED
        if self.context is not None:
            self._free_context()
        self.running = self.n_threads
        self.context = self.llama.llama_init_from_model(self.model.model, params)
        if self.context is None:
            raise RuntimeError(f"{self.name!r}: llama.cpp could not make a context of {n_ctx} tokens")
        self._free_context = weakref.finalize(self, self.llama.llama_free, self.context)
        self.memory = self.llama.llama_get_memory(self.context)
        self.batch = _internals.LlamaBatch(n_tokens=BATCH_TOKENS, embd=0, n_seq_max=1, verbose=False)
        self.n_vocab = self.model.n_vocab()
