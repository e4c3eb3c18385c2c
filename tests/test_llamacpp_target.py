"""The llama.cpp target (`exactspec.targets.LlamaCppTarget`): the bundled GGUF run by llama.cpp
verifies, and the output follows its decoding distribution exactly.

p is `SamplingConfig.probs` of llama.cpp's logits, as for every target, so the checks are those
of the torch target: whole generations chi-squared against the target's joint law enumerated
from llama.cpp's own logits, greedy speculative output identical to plain decoding on the same
backend, rows that join, leave and outgrow the context.
"""
from __future__ import annotations

import sys

import pytest
import torch

from conftest import ALPHA, chi_square_pvalue
from exactspec.engine import autoregressive_generate, speculative_generate
from exactspec.models import encode_prompt, load_model
from exactspec.sampling import SamplingConfig

pytest.importorskip("llama_cpp", reason="the llamacpp extra is not installed (make setup builds it)")
from exactspec.drafters import make_drafter  # noqa: E402
from exactspec.drafters.llamacpp import LlamaCppDrafter  # noqa: E402
from exactspec.models import llamacpp as runtime  # noqa: E402
from exactspec.targets import LlamaCppTarget  # noqa: E402
from exactspec.threads import ThreadChoice  # noqa: E402
from test_llamacpp import TEXTS, as_lists, batch, join_mid_batch  # noqa: E402

pytestmark = pytest.mark.slow

# A prompt that repeats itself, so prompt lookup drafts (point-mass drafts, kept with p(x)).
REPEATING = "x y x y x y"
# llama.cpp's logits for a token do not depend on the rest of its decode while the decode holds
# at most 48 tokens (the bundled model, this build); past about 64 they move by up to 0.34 (its
# matrix kernels change with the batch). The statistical test keeps every decode that small, so
# the joint enumerated one prefix at a time is the law the generation's passes compute.
SMALL_BATCH = 8  # rows: 8 x 6 prompt tokens, 8 x (γ + 1) = 32 tokens a round


@pytest.fixture(scope="module")
def target():
    return load_model("llamacpp:smollm2-135m-instruct")


@pytest.fixture(scope="module")
def prompts(target):
    """The llama.cpp draft's tests' prompts (`test_llamacpp.TEXTS`), encoded."""
    return [encode_prompt(target, text, chat=False)[0].tolist() for text in TEXTS]


def llama_joint(target, prompt: list[int], length: int, sampling: SamplingConfig) -> dict:
    """Exact P(first `length` tokens) under the llama.cpp target's decoding distribution, by
    enumeration in float64: each prefix prefilled alone in an empty context."""
    joint = {(): 1.0}
    for _ in range(length):
        level = {}
        for prefix, weight in joint.items():
            scorer = LlamaCppTarget(target.model, target.name, target.vocab_size)
            probs = sampling.probs(scorer.prefill(*batch([prompt + list(prefix)]))[0].double())  # [V]
            level.update({prefix + (t,): weight * probs[t].item() for t in probs.nonzero().flatten().tolist()})
        joint = level
    return joint


class HotDraft(LlamaCppDrafter):
    """The bundled GGUF drafting at its own, hotter settings (T = 1.6, top-k 6): q differs from
    p in shape and support, so drafts are rejected and corrections drawn. Any q is allowed: the
    rule is exact for whatever the draft sampled from, as long as it reports that q."""

    def propose(self, gamma, sampling, generator):
        return super().propose(gamma, SamplingConfig(temperature=1.6, top_k=6), generator)


# A prompt for the tiny target (below) whose lookup proposes 8664, a token it gives p = 0.46 at
# T = 1, top-k 3: lookup drafts are kept and rejected alike.
TINY_REPEATING = [1752, 37540, 8664, 37540]


@pytest.fixture(scope="module")
def tiny_target(target, tmp_path_factory):
    """A tiny random GGUF (`conftest.write_tiny_gguf`, logits flatter than the draft's) as a
    llama.cpp target, with the bundled model's tokenizer (the same vocabulary): its passes cost
    next to nothing."""
    from conftest import write_tiny_gguf
    from exactspec.models import LoadedModel
    from exactspec.models.llamacpp import LlamaCppModel

    path = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", runtime_path(target),
                           logit_scale=2.5)
    return LoadedModel(model=LlamaCppModel(path, "tiny"), tokenizer=target.tokenizer, name="tiny",
                       dtype=torch.float32, device=torch.device("cpu"), backend="llamacpp")


def test_whole_generations_follow_the_llama_cpp_target(tiny_target):
    """The first 2 new tokens of 1,200 generations (150 batches of 8 rows, γ = 3, T = 1, top-k 3;
    even seeds drafted by prompt lookup, odd ones by the hot draft) against the joint law
    enumerated from llama.cpp's logits; false-failure rate 1e-6. The target is a tiny random
    GGUF: the rule and the llama.cpp target's bookkeeping do not depend on the model."""
    target, prompt = tiny_target, TINY_REPEATING
    settings, counts, corrections = dict(temperature=1.0, top_k=3), {}, {"ngram": 0, "hot": 0}
    ids, mask = batch([prompt] * SMALL_BATCH)
    for seed in range(150):
        kind = "hot" if seed % 2 else "ngram"
        drafter = HotDraft(runtime_path(target)) if kind == "hot" else make_drafter("ngram")
        out = speculative_generate(target, drafter, ids, attention_mask=mask, gamma=3,
                                   max_new_tokens=2, seed=seed, eos_token_id=[], **settings)
        corrections[kind] += out.stats.corrections
        for row in as_lists(out.sequences):
            key = tuple(row[len(prompt):])
            counts[key] = counts.get(key, 0) + 1
    assert min(corrections.values()) > 0  # both drafts were rejected: the correction path ran
    assert chi_square_pvalue(counts, llama_joint(target, prompt, 2, SamplingConfig(**settings))) > ALPHA


def runtime_path(target):
    return target.model.path


# logits: a top-2 gap this small may flip with the order llama.cpp sums in (seen: 0.007 on a
# Xeon VM; 0.068 on an AMD EPYC VM, for a row that joined a running batch, whose cache cells sit
# among other rows' and rejected drafts' — the same prefix scored alone in a fresh context, or
# beside other rows in a decode of up to 48 tokens, is bit-identical there)
NEAR_TIE = 0.1


def top2(target, tokens: list[int]) -> tuple[list[int], float]:
    """The llama.cpp target's two likeliest tokens after `tokens`, and the gap of their logits."""
    scorer = LlamaCppTarget(target.model, target.name, target.vocab_size)
    top = scorer.prefill(*batch([tokens]))[0].topk(2)
    return top.indices.tolist(), float(top.values[0] - top.values[1])


def assert_greedy_alike(target, out, plain) -> None:
    """Each row of `out` is plain greedy decoding's, or first differs at a near-tie (below)."""
    assert_rows_alike(target, as_lists(out.sequences), as_lists(plain.sequences))


def assert_rows_alike(target, rows: list[list[int]], plain: list[list[int]]) -> None:
    """Each row equals its plain greedy decoding, or first differs at a near-tie of the target's
    top 2 (NEAR_TIE), the row's token one of them."""
    assert len(rows) == len(plain)
    for mine, theirs in zip(rows, plain):
        if mine != theirs:
            at = next(i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b)
            best, gap = top2(target, theirs[:at])
            assert gap < NEAR_TIE and mine[at] in best, (
                f"rows differ at position {at}, where the target's top-2 logit gap is {gap:.3g}")


@pytest.mark.parametrize("draft, gamma, rows", [("ngram", 4, 3), ("llamacpp", 4, 3), ("auto", "auto", 1)])
def test_greedy_equals_plain_decoding_on_the_same_backend(target, prompts, draft, gamma, rows):
    """Greedy speculative output is plain decoding's on llama.cpp too, while each decode stays
    small (see SMALL_BATCH: a ragged batch of 3 rows at γ = 4, or one row at γ = auto, at most
    33 tokens) — up to near-ties: llama.cpp's sums over the KV cache run in the order of its
    cells, which rejected drafts rearrange, so two tokens within NEAR_TIE of each other may swap
    (seen: a gap of 0.007). Where a row differs, it must be at such a tie, between the target's
    top 2; anything else fails with the gap shown."""
    for group in range(0, len(prompts), rows):
        ids, mask = batch(prompts[group: group + rows])
        plain = autoregressive_generate(target, ids, attention_mask=mask, max_new_tokens=32, temperature=0)
        out = speculative_generate(target, make_drafter(draft, target=target), ids, attention_mask=mask,
                                   gamma=gamma, max_new_tokens=32, temperature=0)
        assert_greedy_alike(target, out, plain)


def test_a_small_decode_scores_a_token_as_a_decode_of_one_does(target):
    """What the statistical test relies on: a token's logits from a decode of up to 48 tokens
    (8 rows of 6) are those from the token alone."""
    prompt = encode_prompt(target, REPEATING, chat=False)[0].tolist()
    alone = LlamaCppTarget(target.model, target.name, target.vocab_size).prefill(*batch([prompt]))
    rows = LlamaCppTarget(target.model, target.name, target.vocab_size)
    assert torch.equal(rows.prefill(*batch([prompt] * SMALL_BATCH)), alone.expand(SMALL_BATCH, -1))


def test_bad_logits_from_llama_cpp_name_their_position(target, prompts, monkeypatch):
    """No silent NaN: a fed token whose logits hold NaN or +inf (or -inf everywhere) is an error
    naming its position; a single -inf (a token ruled out) is not."""
    scorer = LlamaCppTarget(target.model, target.name, target.vocab_size)
    scorer.prefill(*batch([prompts[0]]))
    decode = runtime.Sequences.decode
    for value, where, message in ((float("nan"), slice(3, 4), "NaN or \\+inf logits"),
                                  (float("inf"), slice(3, 4), "NaN or \\+inf logits"),
                                  (-float("inf"), slice(None), "-inf logits for every token")):
        def bad(self, tokens, every=False, logits=True):
            out = decode(self, tokens, every, logits)  # [n, V]
            out[1, where] = value
            return out

        monkeypatch.setattr(runtime.Sequences, "decode", bad)
        with pytest.raises(ValueError, match=f"produced {message} at position {len(prompts[0]) + 1}"):
            scorer.feed(torch.tensor([[5, 6, 7]]))
        scorer.discard_last(torch.tensor([3]))

    def one_ruled_out(self, tokens, every=False, logits=True):
        out = decode(self, tokens, every, logits)
        out[:, 3] = -float("inf")
        return out

    monkeypatch.setattr(runtime.Sequences, "decode", one_ruled_out)
    assert scorer.feed(torch.tensor([[5, 6, 7]])).shape == (1, 3, target.vocab_size)


def test_rows_join_and_leave_the_llama_cpp_target(target, prompts):
    """Continuous batching on the llama.cpp target: rows join at a round boundary (their
    prompts fed into new sequences of the same context) and leave as they finish; each equals
    plain greedy decoding alone, up to near-ties (`assert_rows_alike`: a joined row's cells sit
    among the other rows')."""
    budgets = [12, 20, 7]
    alone = [as_lists(autoregressive_generate(target, torch.tensor([p]), max_new_tokens=n,
                                              temperature=0, eos_token_id=[]).sequences)[0]
             for p, n in zip(prompts, budgets)]
    assert_rows_alike(target, join_mid_batch(target, make_drafter("ngram"), prompts, budgets), alone)


def test_the_context_grows_and_rejected_drafts_leave_their_rows(prompts, monkeypatch):
    """8 rows of about 8 + 40 tokens overflow a first context of 256 cells: a context twice the
    size replaces it, each row's cache moved into it. Sampled drafts (the hot draft) are rejected
    and removed row by row; greedy output is plain decoding's token for token. The target is
    `@invariant`: on the default one, past 256 cells a token's logits may depend on the decode's
    size (`test_llamacpp_invariant`), by more than a near-tie on some CPUs (docs/benchmarks.md,
    "A compute-bound CPU")."""
    target = load_model("llamacpp:smollm2-135m-instruct@invariant")
    monkeypatch.setattr(runtime, "FIRST_CONTEXT", 256)
    sizes, made = [], runtime.Sequences.new_context
    monkeypatch.setattr(runtime.Sequences, "new_context",
                        lambda rows, n_ctx: (sizes.append((rows.name, n_ctx)), made(rows, n_ctx))[1])
    ids, mask = batch((prompts * 3)[:SMALL_BATCH])
    settings = dict(max_new_tokens=40, temperature=0, seed=5, eos_token_id=[])
    monkeypatch.setattr(target.model.gguf, "idle", [])  # no context left earlier
    plain = autoregressive_generate(target, ids, attention_mask=mask, **settings)
    monkeypatch.setattr(target.model.gguf, "idle", [])  # nor the plain one's (512)
    out = speculative_generate(target, HotDraft(runtime_path(target)), ids, attention_mask=mask,
                               gamma=4, verify="coupled", **settings)
    assert as_lists(out.sequences) == as_lists(plain.sequences)
    assert out.stats.accepted_drafts < out.stats.drafted_tokens  # some drafts were rolled back
    assert sizes.count((target.name, 512)) == 2  # the target's context grew, in both generations


def test_a_generation_takes_the_context_an_earlier_one_left(target, prompts, monkeypatch):
    """Making a context costs a pass or more, so a generation's target and llama.cpp draft take
    the contexts earlier ones left, KV cache emptied and counters zeroed: the same tokens and the
    same counts as from new contexts. Users alive at once each have their own."""
    made, new = [], runtime.Sequences.new_context
    monkeypatch.setattr(runtime.Sequences, "new_context",
                        lambda rows, n_ctx: (made.append(n_ctx), new(rows, n_ctx))[1])
    monkeypatch.setattr(target.model.gguf, "idle", [])
    ids, mask = batch(prompts[:2])
    settings = dict(attention_mask=mask, max_new_tokens=6, temperature=0, eos_token_id=[])
    runs = [autoregressive_generate(target, ids, **settings) for _ in range(3)]
    assert made == [runtime.FIRST_CONTEXT]
    assert all(as_lists(run.sequences) == as_lists(runs[0].sequences) for run in runs)
    assert [(run.stats.target_calls, run.stats.target_tokens_fed) for run in runs] == \
        [(6, sum(map(len, prompts[:2])) + 2 * 5)] * 3
    drafted = [speculative_generate(target, "llamacpp", ids, gamma=3, **settings) for _ in range(3)]
    assert len(made) == 2  # the draft's, the first time
    assert all(as_lists(run.sequences) == as_lists(drafted[0].sequences) for run in drafted)
    assert len({(run.stats.target_calls, run.stats.drafted_tokens) for run in drafted}) == 1
    alive = [LlamaCppTarget(target.model, target.name, target.vocab_size) for _ in range(3)]
    assert len({id(user.rows) for user in alive}) == 3 and len(made) == 3


def test_the_target_facts_come_from_the_gguf(target):
    assert target.spec == "llamacpp:smollm2-135m-instruct" and target.backend == "llamacpp"
    assert target.vocab_size == 49152 and target.context_length == 8192
    assert 2 in target.eos_token_ids  # <|im_end|>


def test_bad_llama_cpp_targets_are_clear_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="own quantization"):
        load_model("llamacpp:smollm2-135m-instruct", dtype="bfloat16")
    with pytest.raises(ValueError, match="a llama.cpp target needs a packaged name or a .gguf file"):
        load_model(str(tmp_path), backend="llamacpp")
    with pytest.raises(ValueError, match="tp, device_map"):
        load_model("smollm2-135m-instruct", backend="llamacpp", tp=True)
    with pytest.raises(ValueError, match="backend must be one of torch, llamacpp, got 'vllm'"):
        load_model("smollm2-135m-instruct", backend="vllm")
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if the extra were not installed
    with pytest.raises(ImportError, match=r"pip install 'exactspec\[llamacpp\]'"):
        load_model("llamacpp:smollm2-135m-instruct")


@pytest.mark.parametrize("argv, message", [
    (["generate", "hi", "--tp"], r"--tp: tensor parallelism splits a torch target's weights"),
    (["serve", "--tp"], r"--tp: tensor parallelism splits a torch target's weights"),
    (["generate", "hi", "--target", "llamacpp:smollm2-135m-instruct@bfloat16"], r"--target: .*takes no dtype"),
])
def test_where_a_llama_cpp_target_cannot_go_the_cli_says_so(capsys, argv, message):
    import re

    from exactspec.cli.main import main

    argv = argv + ([] if "--target" in argv else ["--target", "llamacpp:smollm2-135m-instruct"])
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and re.search(message, err), err


def test_the_bench_leaves_transformers_rows_out_for_a_llama_cpp_target():
    from exactspec.bench.config import BUILTIN_PROMPTS, BenchConfig, pair_settings

    settings = pair_settings("llamacpp")
    assert settings["target"] == "llamacpp:qwen2.5-coder-1.5b-instruct" and not settings["peers"]
    with pytest.raises(ValueError, match="peers: Transformers' rows cannot run the llama.cpp target"):
        BenchConfig(target="llamacpp:smollm2-135m-instruct", drafts=["ngram"],
                    prompts=list(BUILTIN_PROMPTS)).check()


def test_a_drafts_decodes_run_on_the_thread_count_chosen_for_their_size(target):
    """With a choice (a llama.cpp draft's), each decode runs on the count it names for the
    decode's size class and is timed for it."""
    choice = ThreadChoice((1,))  # every decode on one thread
    rows = runtime.Sequences(target.model.llama, "t", 2, target.vocab_size, choice)
    rows.clear()
    rows.add(1, "target")
    rows.decode([list(range(10, 15))])  # 5 tokens: size class 3
    rows.decode([[20]])
    assert list(choice.samples) == [(1, 3), (1, 1)] and rows.running == 1


def test_every_decode_of_the_target_runs_on_the_models_thread_count(target, monkeypatch):
    """A seed names one text: llama.cpp's numerics depend on the thread count, so no decode of
    a target is tried on another count, in any generation, whatever its size."""
    seen, run = [], runtime.Sequences._run
    monkeypatch.setattr(runtime.Sequences, "_run",
                        lambda rows, *args: (seen.append((rows.name, rows.running)), run(rows, *args))[1])
    for prompt in ([1, 2, 3, 4], list(range(10, 40))):
        ids, mask = batch([prompt])
        autoregressive_generate(target, ids, attention_mask=mask, max_new_tokens=70, temperature=0.0)
    assert len(seen) >= 140 and set(seen) == {(target.name, target.model.n_threads)}
