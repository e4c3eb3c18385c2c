"""The llama.cpp draft (`LlamaCppDrafter`) on the bundled model: the bundled GGUF run by llama.cpp
drafts for its float32 dequantized copy, the target (the law of the drafts is checked on a tiny
random GGUF of the same vocabulary, `conftest.tiny_gguf`).

Exactness: the q it returns is the law its drafts were drawn from; whole generations follow the
target's law (chi-square against enumeration); greedy output equals plain decoding, alone, in
ragged batches, with rows joining mid-batch and when its context must grow. Bookkeeping: at
every round llama.cpp's sequences hold exactly the committed tokens.
"""
import sys

import pytest
import torch

from conftest import ALPHA, chi_square_pvalue
from exactspec.batching import RowSettings
from exactspec.controller import GammaController
from exactspec.drafters import AutoDrafter, make_drafter
from exactspec.engine import Decoder, autoregressive_generate, pad_prompts, speculative_generate
from exactspec.models import encode_prompt, load_model
from exactspec.sampling import SamplingConfig
from test_decoding import target_joint

pytest.importorskip("llama_cpp", reason="the llamacpp extra is not installed (make setup builds it)")
from exactspec.drafters import llamacpp  # noqa: E402
from exactspec.drafters.llamacpp import LlamaCppDrafter  # noqa: E402
from exactspec.models import llamacpp as runtime  # noqa: E402

pytestmark = pytest.mark.slow

TEXTS = ["Write a haiku about the sea.", "List three prime numbers.", "Hi"]


@pytest.fixture(scope="module")
def target(bundled_pair):
    return bundled_pair[0]


@pytest.fixture(scope="module")
def prompts(target):
    return [encode_prompt(target, text, chat=False)[0].tolist() for text in TEXTS]


def batch(prompts):
    return pad_prompts([torch.tensor(p) for p in prompts])


def as_lists(sequences) -> list[list[int]]:
    """Each row's prompt and new tokens (`GenerateOutput.sequences`: a tensor or a list of them)."""
    return [row.tolist() for row in sequences]


def drafter_for(target) -> LlamaCppDrafter:
    drafter = make_drafter("llamacpp", target=target)
    assert isinstance(drafter, LlamaCppDrafter)
    return drafter


def first_drafts(target, gguf, prompt, sampling, rows=256, repeats=8):
    """Counts of the first draft over rows × repeats proposals of the GGUF file's model from one
    prefix, and the sum of the q each was drawn from (each row's own; rows of one prefix agree up
    to rounding)."""
    generator = torch.Generator().manual_seed(0)
    counts, expected = torch.zeros(target.vocab_size), torch.zeros(target.vocab_size, dtype=torch.float64)
    for _ in range(repeats):
        drafter = LlamaCppDrafter(gguf)
        vocab = drafter.bind(target, len(prompt) + 1)
        ids, mask = batch([prompt] * rows)
        drafter.start(ids, mask, vocab)
        proposal = drafter.propose(1, sampling, generator)
        counts += torch.bincount(proposal.tokens[:, 0], minlength=vocab).float()
        expected += proposal.q[:, 0].double().sum(dim=0)
    return counts, expected / expected.sum()


@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.8, top_k=20),
                                      dict(temperature=1.0, top_p=0.9)], ids=["T1", "top-k", "top-p"])
def test_returned_q_is_the_law_of_the_drafts(target, tiny_gguf, prompts, settings):
    """Chi-square of 2,048 first drafts against the q returned with them; false-failure rate 1e-6.
    The draft is a tiny random GGUF of the same vocabulary (`conftest.write_tiny_gguf`): the law
    of the drafts is the drafter's business, whatever its model; the bundled one costs 20x more."""
    counts, q = first_drafts(target, tiny_gguf, prompts[2], SamplingConfig(**settings))
    assert chi_square_pvalue(counts, q) > ALPHA


def test_whole_generations_follow_the_target(target, prompts):
    """The first 2 new tokens of 2,000 generations (10 batches of 200 rows, γ = 3, T = 0.8,
    top-k 4) against the target's exact joint law by enumeration; false-failure rate 1e-6."""
    prompt, counts, settings = prompts[2], {}, dict(temperature=0.8, top_k=4)
    ids, mask = batch([prompt] * 200)
    for seed in range(10):
        out = speculative_generate(target, drafter_for(target), ids, attention_mask=mask, gamma=3,
                                   max_new_tokens=2, seed=seed, eos_token_id=[], **settings)
        for row in as_lists(out.sequences):
            key = tuple(row[len(prompt): len(prompt) + 2])
            counts[key] = counts.get(key, 0) + 1
    assert chi_square_pvalue(counts, target_joint(target.model, prompt, 2, SamplingConfig(**settings))) > ALPHA


@pytest.mark.parametrize("draft, gamma", [("llamacpp", 4), ("auto", "auto")])
def test_greedy_equals_plain_decoding_in_a_ragged_batch(target, prompts, draft, gamma):
    ids, mask = batch(prompts)
    plain = autoregressive_generate(target, ids, attention_mask=mask, max_new_tokens=32, temperature=0)
    out = speculative_generate(target, make_drafter(draft, target=target), ids, attention_mask=mask,
                               gamma=gamma, max_new_tokens=32, temperature=0)
    assert as_lists(out.sequences) == as_lists(plain.sequences)


@pytest.mark.parametrize("gamma", [1, 4, 16, "auto"])
def test_coupled_sampling_equals_plain_decoding_with_the_seed(target, prompts, gamma):
    """At T = 0.8 with top-p, the llama.cpp draft racing over its q with the target's noise:
    the coupled rule's rows are plain decoding's with the same seed, and drafts are kept. γ =
    auto on a fresh controller, whose first round drafts: the shared one carries the timings of
    the tests before, which beside a busy test worker can price every round of 24 as plain."""
    ids, mask = batch(prompts)
    settings = dict(max_new_tokens=24, temperature=0.8, top_p=0.95, seed=99)
    plain = autoregressive_generate(target, ids, attention_mask=mask, **settings)
    out = speculative_generate(target, drafter_for(target), ids, attention_mask=mask,
                               gamma=GammaController() if gamma == "auto" else gamma,
                               verify="coupled", **settings)
    assert as_lists(out.sequences) == as_lists(plain.sequences)
    assert out.stats.accepted_drafts > 0


def test_auto_draft_of_the_bundled_target_is_llama_cpp(target):
    assert isinstance(make_drafter("auto", target=target).model, LlamaCppDrafter)


class Snapshots(LlamaCppDrafter):
    """Records, at each proposal, every row's tokens as the drafter knows them (fed to llama.cpp
    and pending) and the last position llama.cpp holds for its sequence."""

    def propose(self, gamma, sampling, generator):
        rows = self.rows
        self.seen.append([(fed + pending, len(fed), rows.llama.llama_memory_seq_pos_max(rows.memory, seq))
                          for fed, pending, seq in zip(rows.fed, self.pending, rows.seqs)])
        return super().propose(gamma, sampling, generator)


def test_sequences_hold_exactly_the_committed_tokens(target, prompts):
    """Sampled generation (drafts rejected and rolled back): at every round each row's known
    tokens are its prompt plus what it has committed, and llama.cpp's sequence ends where the fed
    part does. Rows that reach their budget leave the batch; those left keep their order."""
    drafter = Snapshots(llamacpp.gguf_file(target))
    drafter.seen = []
    ids, mask = batch(prompts)
    out = speculative_generate(target, drafter, ids, attention_mask=mask, gamma=4,
                               max_new_tokens=20, temperature=1.0, seed=3, eos_token_id=[])
    assert out.stats.accepted_drafts < out.stats.drafted_tokens  # some drafts were rolled back
    committed = as_lists(out.sequences)
    for rows in drafter.seen:
        b = -1
        for known, fed, last_position in rows:  # the rows still running, in their batch order
            b = next((i for i in range(b + 1, len(committed))
                      if committed[i][: len(known)] == known), None)
            assert b is not None, f"no row after the last matched one has committed {known}"
            assert len(known) > len(prompts[b]) - 1
            assert last_position == fed - 1


def test_rows_joining_mid_batch_match_greedy_alone(target, prompts):
    """Continuous batching: rows join at a round boundary (lazily: their prompts are fed when the
    draft next proposes) and leave as they finish; each equals plain greedy decoding alone."""
    budgets = [16, 6, 10]
    alone = [autoregressive_generate(target, torch.tensor([prompt]), max_new_tokens=n,
                                     temperature=0, eos_token_id=[]).sequences[0].tolist()
             for prompt, n in zip(prompts, budgets)]
    for drafter in (drafter_for(target), AutoDrafter(drafter_for(target))):
        assert join_mid_batch(target, drafter, prompts, budgets) == alone


def join_mid_batch(target, drafter, prompts, budgets) -> list[list[int]]:
    """Greedy decoding of prompts[0] alone for a round, then of the others joining it; each row's
    prompt and new tokens."""
    greedy = lambda n: RowSettings(max_new_tokens=n, temperature=0)
    decoder = Decoder(target, drafter, *batch(prompts[:1]), max_new_tokens=budgets[0],
                      sampling=SamplingConfig(), seed=None, eos_token_id=[], verify="block", on_tokens=None)
    decoder.use_row_settings([greedy(budgets[0])])
    decoder.step(4)
    rows = [0] + decoder.join(*batch(prompts[1:]), [greedy(n) for n in budgets[1:]])
    while not decoder.done:
        decoder.step(3)
    return [prompt + decoder.rows.new[row] for row, prompt in zip(rows, prompts)]


def test_context_grows_when_the_rows_need_more(target, prompts, monkeypatch):
    """12 rows of up to 10 + 20 tokens overflow a first context of 256 cells: a context twice the
    size replaces it and every row is fed again; greedy output is unchanged."""
    monkeypatch.setattr(runtime, "FIRST_CONTEXT", 256)
    drafter = drafter_for(target)
    monkeypatch.setattr(drafter.gguf, "idle", [])  # no larger context to take
    ids, mask = batch(prompts * 4)
    out = speculative_generate(target, drafter, ids, attention_mask=mask, gamma=4,
                               max_new_tokens=20, temperature=0, eos_token_id=[])
    plain = autoregressive_generate(target, ids, attention_mask=mask, max_new_tokens=20,
                                    temperature=0, eos_token_id=[])
    assert as_lists(out.sequences) == as_lists(plain.sequences)
    assert drafter.rows.llama.llama_n_ctx(drafter.rows.context) == 512


def test_vocabulary_mismatch_names_the_first_token(tiny_loaded_pair, target):
    tiny_target, _ = tiny_loaded_pair
    with pytest.raises(ValueError, match="different vocabularies .*token id 0"):
        drafter_for(target).bind(tiny_target, 16)


def test_bad_specs_are_one_line_errors(target, tiny_loaded_pair, monkeypatch):
    with pytest.raises(ValueError, match="no such GGUF file"):
        make_drafter("llamacpp:/no/such/file.gguf")
    with pytest.raises(ValueError, match="was not loaded from one: name the file"):
        make_drafter("llamacpp", target=tiny_loaded_pair[0])
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if the extra were not installed
    with pytest.raises(ImportError, match=r"pip install 'exactspec\[llamacpp\]'"):
        make_drafter(f"llamacpp:{llamacpp.gguf_file(target)}")


def test_exactspec_threads_fixes_the_drafts_thread_count(monkeypatch, target):
    """EXACTSPEC_THREADS fixes a llama.cpp draft's thread count as it does the target's (no
    per-decode choice); unset, the draft chooses between all usable cores and one."""
    monkeypatch.setenv(runtime.THREADS_ENV, "1")
    drafter = drafter_for(target)
    assert (drafter.n_threads, drafter.threads) == (1, None)
    monkeypatch.delenv(runtime.THREADS_ENV)
    drafter = drafter_for(target)
    assert drafter.n_threads == runtime.usable_cores() and drafter.threads is not None


def test_llama_cpp_plain_decodes_as_exactspecs_llama_cpp_target_does(target):
    """The bench's llama.cpp plain row (`LlamaPeers`) runs the kernels exactspec's llama.cpp
    target runs (flash attention as llama.cpp's default sets it): greedy, the same text. (With
    llama-cpp-python's default, flash attention off, this prompt's texts part at token 9.)"""
    from exactspec.bench.config import RunSpec
    from exactspec.bench.llama_peers import LlamaPeers

    ids = encode_prompt(target, "Write a short story about a lighthouse keeper who finds a message in a bottle.")
    peers = LlamaPeers(llamacpp.gguf_file(target), {}, 2, None, None, None)
    try:
        tokens = peers.run(RunSpec("llamacpp", 0.0), ids, 0, 64).tokens
    finally:
        peers.close()
    plain = autoregressive_generate(load_model("llamacpp:smollm2-135m-instruct"), ids,
                                    max_new_tokens=64, temperature=0)
    assert tokens == plain.sequences[0, ids.size(1):].tolist()


@pytest.mark.parametrize("threads", [None, 1])
def test_bench_runs_a_llama_cpp_target_and_its_peers_on_the_same_threads(threads, monkeypatch):
    """The bench's llama.cpp peers and llama.cpp draft run on the threads exactspec's llama.cpp
    target decodes on, every decode: $EXACTSPEC_THREADS (here 3) when --threads is not given,
    else --threads for all (torch's own count is none's)."""
    from exactspec.bench.config import BenchConfig
    from exactspec.bench.run import llama_cpp_threads, llama_peers, load_models

    monkeypatch.setenv(runtime.THREADS_ENV, "3")
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # the suite keeps its own
    spec = "llamacpp:smollm2-135m-instruct"
    config = BenchConfig(target=spec, drafts=["ngram", "llamacpp"], threads=threads, peers=False,
                         llama_peers=True)
    target, drafts = load_models(config, {spec: load_model(spec)})
    peers = llama_peers(config, target, lambda line: None)
    try:
        assert target.model.n_threads == peers.threads == llama_cpp_threads(target) == (threads or 3)
        assert (drafts["llamacpp"].n_threads, drafts["llamacpp"].threads) == (threads or 3, None)
    finally:
        peers.close()


def test_llama_cpp_plain_follows_a_json_schema_to_eos(target):
    """The bench's llama.cpp plain row on a json task (`LlamaPeers`): llama.cpp's own grammar from
    the task's schema, greedy, ending at EOS; the output is valid against the schema."""
    from exactspec.bench import extraction
    from exactspec.bench.config import RunSpec
    from exactspec.bench.llama_peers import LlamaPeers

    prompt = extraction.workload_prompts("json:1")[0]
    ids = encode_prompt(target, prompt.text)
    peers = LlamaPeers(llamacpp.gguf_file(target), {}, 2, None, None, None)
    try:
        tokens = peers.run(RunSpec("llamacpp", 0.0), ids, 0, 200, prompt.constraint).tokens
    finally:
        peers.close()
    assert tokens[-1] == target.tokenizer.eos_token_id or len(tokens) < 200
    text = target.tokenizer.decode(tokens, skip_special_tokens=True)
    assert extraction.is_valid(prompt.constraint.schema(), text), text
