"""The cache invariant, checked after every round of real generations on tiny models:

    the target's cache, fed each row's last committed token, and the draft's cache, fed its
    pending tokens, give the same next-token logits as a fresh forward pass over the row's
    committed tokens — whatever was accepted, after compaction, and after rows leave.

A `CheckedDrafter` wraps the drafter under test (the Drafter protocol is the engine's only door
to it) and runs the check after each `commit` (the target has rolled back, the draft has
committed) and after each `select` (finished rows have left both caches). Probes run on copies
of the caches, so the generation itself is untouched.
"""
from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import exactspec as es
import exactspec.drafters.model
import exactspec.targets
from exactspec.cache import CachedModel
from exactspec.drafters import ModelDrafter, NGramDrafter, NoDraft, make_drafter
from test_batch import near_copy, padded

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[1, 5, 9, 5, 9, 5, 9], [1, 7], [1, 20, 21, 22, 20], [1, 4, 3, 10, 7, 24, 28, 30, 3]]
ATOL = 1e-4  # float32 tiny models: a cached pass and a fresh one agree to ~1e-6


class CacheLog:
    """Every CachedModel the engine and the model drafter build during one test, and how often
    each compacted (the subclass below is patched in where they are constructed)."""

    def __init__(self):
        self.made: list[CachedModel] = []
        self.compactions = 0

    def cache_class(self):
        log = self

        class RecordingCache(CachedModel):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                log.made.append(self)

            def compact(self):
                log.compactions += 1
                super().compact()

        return RecordingCache

    def of(self, model) -> CachedModel:
        """The latest cache built for `model`."""
        found = [lm for lm in self.made if lm.model is model]
        assert found, "no CachedModel was built for this model: the hook missed it"
        return found[-1]


@pytest.fixture
def cache_log(monkeypatch):
    log = CacheLog()
    recording = log.cache_class()
    monkeypatch.setattr(exactspec.targets, "CachedModel", recording)
    monkeypatch.setattr(exactspec.drafters.model, "CachedModel", recording)
    return log


def logits_after(lm: CachedModel, tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The logits after feeding tokens[B, n] (valid[B, n]) to a copy of lm's cache: [B, V]."""
    probe = copy.copy(lm)
    probe.cache, probe.valid = copy.deepcopy(lm.cache), lm.valid.clone()
    return probe.feed(tokens, valid)[:, -1]  # [B, V]


def fresh_logits(model, rows: list[list[int]], vocab: int) -> torch.Tensor:
    """The next-token logits of each committed sequence from a fresh, cache-free pass: [B, V]."""
    out = [model(input_ids=torch.tensor([row])).logits[0, -1, :vocab] for row in rows]  # B × [V]
    return torch.stack(out).float()  # [B, V]


def history(row) -> list[int]:
    """An n-gram drafter's view of one row's tokens (a token index or a tensor)."""
    return list(row.tokens) if hasattr(row, "tokens") else row.tolist()


class CheckedDrafter(es.Drafter):
    """The drafter under test, checking the cache invariant after every commit and select.

    It keeps its own record of each row's committed tokens: the prompt, then per round the kept
    drafts and the correction or bonus token."""

    def __init__(self, inner, target_model, log: CacheLog):
        self.inner, self.target_model, self.log = inner, target_model, log
        self.checks = self.selects = self.rejections = 0

    def __getattr__(self, name):  # the inner drafter's own members (`pending`, `rows`, ...)
        return getattr(self.inner, name)

    def next_source(self):
        return self.inner.next_source()

    def lag(self):
        return self.inner.lag()

    def free(self):
        return self.inner.free()

    def evidence(self):
        return self.inner.evidence()

    @property
    def catch_up(self):
        return self.inner.catch_up

    @property
    def calls(self):
        return self.inner.calls

    @property
    def tokens_fed(self):
        return self.inner.tokens_fed

    @property
    def padding_fed(self):
        return self.inner.padding_fed

    @property
    def name(self):
        return self.inner.name

    def bind(self, target, total_tokens):
        self.vocab = self.inner.bind(target, total_tokens)
        return self.vocab

    def start(self, input_ids, valid, vocab_size):
        self.committed = [ids[ok].tolist() for ids, ok in zip(input_ids, valid)]
        self.inner.start(input_ids, valid, vocab_size)

    def propose(self, gamma, sampling, generator):
        proposal = self.inner.propose(gamma, sampling, generator)
        self.drafts = proposal.tokens
        return proposal

    def commit(self, num_accepted, next_tokens):
        self.inner.commit(num_accepted, next_tokens)
        for b, (tau, nxt) in enumerate(zip(num_accepted.tolist(), next_tokens.tolist())):
            self.committed[b].extend(self.drafts[b, :tau].tolist() + [nxt])
        self.rejections += int((num_accepted < self.drafts.size(1)).sum())
        self.last = next_tokens.clone()  # [B]
        self.check()

    def select(self, rows):
        self.inner.select(rows)
        keep = rows.tolist()
        self.committed = [self.committed[i] for i in keep]
        self.last = self.last[rows]
        self.selects += 1
        self.check()

    def check(self) -> None:
        """Both caches against a fresh pass over the committed tokens."""
        self.checks += 1
        lm = self.log.of(self.target_model)
        assert lm.kept.tolist() == [len(row) - 1 for row in self.committed], \
            "the target's cache must hold each row's committed tokens but the last"
        got = logits_after(lm, self.last.unsqueeze(1), torch.ones_like(self.last.unsqueeze(1), dtype=torch.bool))
        want = fresh_logits(self.target_model, self.committed, self.vocab)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=ATOL, msg="target cache")
        if isinstance(self.inner, ModelDrafter):
            self._check_model_draft()
        elif isinstance(self.inner, NGramDrafter):
            assert [history(row) for row in self.inner.rows] == self.committed

    def _check_model_draft(self) -> None:
        draft = self.inner
        pending, pending_valid = draft.pending, draft.pending_valid  # [B, k]
        assert draft.lm.kept.tolist() == [len(row) - int(n) for row, n in
                                          zip(self.committed, pending_valid.sum(1))], \
            "the draft's cache must hold each row's committed tokens but the pending ones"
        got = logits_after(draft.lm, pending, pending_valid)
        want = fresh_logits(draft.model, self.committed, self.vocab)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=ATOL, msg="draft cache")


def make_inner(kind: str, target, draft):
    """The drafter under test: the tiny draft model, a near copy of the target (ragged
    acceptance even at temperature 0), prompt lookup, or none (plain decoding)."""
    return {"model": lambda: ModelDrafter(draft), "near": lambda: ModelDrafter(near_copy(target)),
            "ngram": NGramDrafter, "none": NoDraft}[kind]()


def run_checked(target, draft, kind, prompts, log, **kwargs):
    checked = CheckedDrafter(make_inner(kind, target, draft), target, log)
    ids, mask = padded(prompts)
    out = es.speculative_generate(target, checked, ids, attention_mask=mask, eos_token_id=[],
                                  **kwargs)
    assert checked.checks > 0
    return checked, out


# --------------------------------------------------------------------------- fixed cases


@pytest.mark.parametrize("kind", ["model", "ngram", "none"])
@pytest.mark.parametrize("verify", ["token", "block"])
def test_single_row_caches_match_fresh_prefill(tiny_pair, cache_log, kind, verify):
    target, draft = tiny_pair
    checked, _ = run_checked(target, draft, kind, [PROMPTS[3]], cache_log, gamma=4,
                             max_new_tokens=30, seed=3, verify=verify, temperature=1.0)
    if kind != "none":
        assert checked.rejections > 0  # rejections happened, so roll-backs were exercised


@pytest.mark.parametrize("kind", ["near", "ngram"])
def test_ragged_batch_caches_match_after_compaction(tiny_pair, cache_log, kind):
    """Rows keep different numbers of drafts; long runs make holes and compact the cache."""
    target, draft = tiny_pair
    checked, out = run_checked(target, draft, kind, PROMPTS[:3], cache_log, gamma=8,
                               max_new_tokens=60, temperature=0)
    if kind == "near":  # the n-gram draft keeps too few drafts here to fill half the cache
        assert cache_log.compactions > 0
    assert len({s.accepted_drafts for s in out.row_stats}) > 1  # ragged acceptance


@pytest.mark.parametrize("kind", ["model", "ngram"])
def test_caches_match_after_rows_leave(tiny_pair, cache_log, kind):
    """An EOS that some rows emit early: they leave both caches, the others go on."""
    target, draft = tiny_pair
    checked = CheckedDrafter(make_inner(kind, target, draft), target, cache_log)
    ids, mask = padded(PROMPTS)
    es.speculative_generate(target, checked, ids, attention_mask=mask, gamma=3,
                            max_new_tokens=40, seed=5, temperature=1.0, eos_token_id=[7, 11])
    assert checked.selects > 0


# --------------------------------------------------------------------------- any pattern


@settings(max_examples=30, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # the models are not mutated
@given(kind=st.sampled_from(["model", "near", "ngram"]),
       rows=st.lists(st.sampled_from(range(len(PROMPTS))), min_size=1, max_size=3),
       gamma=st.integers(1, 8), temperature=st.sampled_from([0.0, 0.7, 1.0, 1.5]),
       verify=st.sampled_from(["token", "block"]), seed=st.integers(0, 2**16),
       eos=st.sampled_from([[], [7], [3, 11]]), max_new_tokens=st.integers(1, 40))
def test_caches_match_whatever_is_accepted(tiny_pair, kind, rows, gamma, temperature, verify,
                                           seed, eos, max_new_tokens):
    target, draft = tiny_pair
    log = CacheLog()
    recording = log.cache_class()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(exactspec.targets, "CachedModel", recording)
        patch.setattr(exactspec.drafters.model, "CachedModel", recording)
        checked = CheckedDrafter(make_inner(kind, target, draft), target, log)
        ids, mask = padded([PROMPTS[r] for r in rows])
        es.speculative_generate(target, checked, ids, attention_mask=mask, gamma=gamma,
                                max_new_tokens=max_new_tokens, seed=seed, verify=verify,
                                temperature=temperature, eos_token_id=eos)
    assert checked.checks > 0


def test_make_drafter_passes_a_wrapper_through(tiny_pair):
    """The wrapper above is a Drafter: the engine uses it as is (otherwise nothing is checked)."""
    target, draft = tiny_pair
    checked = CheckedDrafter(ModelDrafter(draft), target, CacheLog())
    assert make_drafter(checked) is checked
