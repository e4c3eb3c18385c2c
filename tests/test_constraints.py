"""Constraints (`exactspec.constraints`): the constrained target — p masked to the tokens the
grammar allows after each prefix, the drafts before a position included — kept exactly with
every draft. Checked by enumeration in float64 against masks from fresh matchers, by chi-square
of whole generations on tiny models, by token identity with plain constrained decoding, and by
breaking the rule on purpose (the same checks go red)."""
import itertools
import math
import re

import numpy as np
import pytest
import torch

import exactspec as es
from conftest import (ALPHA, GRAMMAR_VOCAB, chi_square_pvalue, make_grammar_tokenizer, make_tiny_llama,
                      round_ends)
from exactspec.batching import RowSettings
from exactspec.constraints import Constraint, Masked, RowMatchers, as_constraint, matcher_tokenizer
from exactspec.controller import GammaController
from exactspec.drafters import NGramDrafter
from exactspec.engine import Decoder, pad_prompts
from exactspec.models import LoadedModel
from exactspec.sampling import SamplingConfig, probs_from_logits

pytestmark = pytest.mark.usefixtures("one_thread")

EOS, V = 2, GRAMMAR_VOCAB
TOKENIZER = make_grammar_tokenizer()
ID = {token: i for i, token in enumerate(TOKENIZER.convert_ids_to_tokens(list(range(V))))}
JSONISH = r'\{"ab": [a-c][d-f]+\}'  # four forced tokens: {" ab ": and a space
GUESS = r'\{"c": a[b-c]\}'  # forced: {" c ": and a space, then the byte a, spelt a or ab
GRAMMARS = {"jsonish": Constraint.regex(JSONISH),
            "short": Constraint.regex("[a-c]{1,2}"),  # EOS allowed after one character
            "guess": Constraint.regex(GUESS)}
COMMITTED = {"jsonish": [(), (ID['{"'], ID["ab"])], "short": [(), (ID["a"],)],
             "guess": [(), (ID['{"'], ID["c"], ID['":'], ID["Ġ"])]}
SETTINGS = {"T1": dict(temperature=1.0), "T0.7-top3": dict(temperature=0.7, top_k=3),
            "greedy": dict(temperature=0.0)}


# --------------------------------------------------------------------------- the constraint


@pytest.mark.parametrize("make, message", [
    (lambda: Constraint("xml", "<a/>"), "constraint kind must be one of"),
    (lambda: Constraint.regex("[a-"), "regex is not valid"),
    (lambda: Constraint.json_schema("{not json"), "json_schema is not valid JSON"),
    (lambda: Constraint.json_schema("[1, 2]"), "json_schema must be a JSON object"),
    (lambda: Constraint.json_schema({"type": "objectx"}), "json_schema is not valid"),
    (lambda: Constraint.lark("start: x"), "lark is not valid"),
    (lambda: as_constraint({"yaml": "a: 1"}), "constraint kind must be one of"),
    (lambda: as_constraint("a+"), "constraint must be a Constraint or a dict"),
])
def test_bad_constraints_name_what_is_wrong(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_constraints_are_values():
    """Equal constraints are equal and hash alike (rows sharing settings are grouped)."""
    assert Constraint.json_schema({"type": "integer"}) == as_constraint({"json_schema": {"type": "integer"}})
    assert len({Constraint.regex("a+"), Constraint.regex("a+"), Constraint.json_object()}) == 2
    assert Constraint.json_object().schema() == {"type": "object"}


# --------------------------------------------------------------------------- enumeration in float64


def allowed_by_fresh_matcher(constraint, prefix):
    """bool[V]: llguidance's mask after prefix, from a matcher made afresh that consumed exactly
    prefix (no rollback, no cache, read bit by bit); after EOS only EOS (the row has ended).
    llguidance's mask is the definition: where the grammar forces bytes it allows only their
    canonical tokens (after nothing, the jsonish grammar allows '{"' but not '{')."""
    from llguidance import LLMatcher

    if EOS in prefix:
        return torch.arange(V) == EOS
    matcher = LLMatcher(matcher_tokenizer(TOKENIZER, V, {EOS}), constraint.grammar, log_level=0)
    if not matcher.consume_tokens(list(prefix)):
        return None  # prefix breaks the grammar (only a broken rule emits one)
    bits = matcher.compute_bitmask()
    return torch.tensor([bool(bits[t // 8] >> (t % 8) & 1) for t in range(V)])


class Logits:
    """Float64 logits that depend on the whole prefix, the same for the same (seed, prefix)."""

    def __init__(self, seed):
        self.seed = seed

    def __call__(self, prefix):
        gen = torch.Generator().manual_seed(hash((self.seed, *prefix)) % 2**63)  # ints hash alike in every run
        return 2.5 * torch.randn(V, generator=gen, dtype=torch.float64)


def constrained_p(logits, constraint, prefix, settings):
    """The constrained target's p after prefix, from a fresh matcher's mask."""
    allowed = None if -1 in prefix else allowed_by_fresh_matcher(constraint, prefix)
    if allowed is None:  # an outcome the constrained target never has: -1 marks it
        return torch.zeros(V + 1, dtype=torch.float64).index_fill_(0, torch.tensor([V]), 1.0)
    return probs_from_logits(logits(prefix).masked_fill(~allowed, -math.inf), **settings)


def continue_with(logits, constraint, prefix, length, settings):
    """{tokens: probability} of the next `length` tokens after prefix under the constrained target."""
    joint = {(): 1.0}
    for _ in range(length):
        grown = {}
        for seq, prob in joint.items():
            p = constrained_p(logits, constraint, prefix + seq, settings)
            for y in p.nonzero().flatten().tolist():
                grown[seq + (-1 if y == V else y,)] = prob * p[y].item()
        joint = grown
    return joint


def blocks_from_q(q_after, gamma):
    """Every draft block of length γ with its probability Π q_i(x_i), and its q [γ, V]."""
    found = [((), 1.0, [])]
    for _ in range(gamma):
        grown = []
        for block, weight, qs in found:
            q = q_after(block)
            grown += [(block + (x,), weight * q[x].item(), qs + [q]) for x in q.nonzero().flatten().tolist()]
        found = grown
    return [(block, weight, torch.stack(qs).unsqueeze(0)) for block, weight, qs in found]


def round_outcomes(constraint, committed, gamma, verify, settings, drafts, p_masked=True, q_masked=True):
    """(probability, emitted tokens) of every outcome of one library round after `committed`:
    q and p made by the library's `Masked` (as the drafter and the target make them), τ's exact
    law and the next token's weights from `exactspec.verify`. drafts: "q" (sampled from q),
    "forced" (the grammar's forced tokens, point-mass) or "lookup" (a point-mass block that
    breaks the grammar at its second token)."""
    target, draft = Logits(0), Logits(1)
    matchers = RowMatchers(TOKENIZER, V, {EOS})
    matchers.join([constraint])
    matchers.advance([list(committed)])
    base = SamplingConfig(**settings)
    masked = Masked(base, matchers)
    make_q = masked if q_masked else base
    make_p = masked if p_masked else base

    def q_after(block):
        return make_q.probs(draft(committed + block).view(1, V), drafts=torch.tensor([block]).view(1, -1))[0]

    if drafts == "q":
        blocks = blocks_from_q(q_after, gamma)
    elif drafts == "forced":
        blocks = [(tuple(matchers.forced(gamma)[0]), 1.0, None)]
    else:
        first = allowed_by_fresh_matcher(constraint, committed).nonzero()[0].item()
        blocks = [((first, ID["h"], *[ID["a"]] * (gamma - 2))[:gamma], 1.0, None)]
    for block, weight, q in blocks:
        k = len(block)
        scores = torch.stack([target(committed + block[:j]) for j in range(k + 1)]).unsqueeze(0)  # [1, k+1, V]
        tokens = torch.tensor([block], dtype=torch.long).view(1, k)  # [1, k]
        p = make_p.probs(scores, drafts=tokens)  # [1, k+1, V]
        yield from round_ends(block, weight, tokens, q, p, verify)


def round_then_target(constraint, committed, gamma, verify, settings, drafts, **breaks):
    """Distribution of the next γ+1 tokens: one library round, then the constrained target (a
    row that emitted EOS stays at EOS: the engine ends it there)."""
    target, dist = Logits(0), {}
    for prob, emitted in round_outcomes(constraint, committed, gamma, verify, settings, drafts, **breaks):
        if EOS in emitted:
            emitted = emitted[: emitted.index(EOS) + 1]
        rest = continue_with(target, constraint, committed + emitted, gamma + 1 - len(emitted), settings)
        for tail, tail_prob in rest.items():
            dist[emitted + tail] = dist.get(emitted + tail, 0.0) + prob * tail_prob
    return dist


def worst_gap(constraint, committed, gamma, verify, settings, drafts, **breaks):
    got = round_then_target(constraint, committed, gamma, verify, settings, drafts, **breaks)
    want = continue_with(Logits(0), constraint, committed, gamma + 1, settings)
    return max(abs(got.get(k, 0.0) - want.get(k, 0.0)) for k in got.keys() | want.keys())


ENUMERATED = [(name, committed, gamma, verify, drafts)
              for name in ("jsonish", "short") for committed in COMMITTED[name] for gamma in (1, 2, 3)
              for verify in ("token", "block") for drafts in ("q", "forced", "lookup")] + [
    ("guess", committed, gamma, verify, "forced")  # forced text that ends in a guess
    for committed in COMMITTED["guess"] for gamma in (2, 5) for verify in ("token", "block")]


@pytest.mark.parametrize("settings", sorted(SETTINGS))
@pytest.mark.parametrize("name, committed, gamma, verify, drafts", ENUMERATED)
def test_round_keeps_the_constrained_target_exactly(name, committed, gamma, verify, drafts, settings):
    """One round with masked p and q, then the constrained target: the joint of the next γ+1
    tokens equals the constrained target's to 1e-12, for drafts from q, grammar-forced
    point-mass drafts and lookup drafts that break the grammar."""
    assert worst_gap(GRAMMARS[name], committed, gamma, verify, SETTINGS[settings], drafts) < 1e-12


BROKEN = [("jsonish", (), 2, "block", "q"), ("short", (), 2, "token", "q")]


@pytest.mark.parametrize("name, committed, gamma, verify, drafts", BROKEN)
def test_masking_q_but_not_p_goes_red(name, committed, gamma, verify, drafts):
    assert worst_gap(GRAMMARS[name], committed, gamma, verify, SETTINGS["T1"], drafts,
                     p_masked=False) > 1e-3


@pytest.mark.parametrize("name, committed, gamma, verify, drafts",
                         [("jsonish", (), 2, "block", "q"), ("short", (), 1, "token", "q")])
def test_masking_p_but_not_q_stays_exact(name, committed, gamma, verify, drafts):
    """The rule is exact for any q: masking q only saves drafts the grammar would reject."""
    assert worst_gap(GRAMMARS[name], committed, gamma, verify, SETTINGS["T1"], drafts,
                     q_masked=False) < 1e-12


def forgetful_mask(self, b, before):
    """`RowMatchers._mask` without the rollback: the drafts stay in the matcher."""
    key = (b, before)
    if key not in self.masks:
        matcher = self.rows[b]
        matcher.try_consume_tokens(list(before))
        bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        mask = torch.from_numpy(np.unpackbits(bits, bitorder="little")[: self.vocab].astype(bool))
        self.masks[key] = mask if mask.any() else torch.ones(self.vocab, dtype=torch.bool)
    return self.masks[key]


def masks_at_the_committed_prefix(self, drafts, n):
    """`RowMatchers.allowed` reading no drafts: every position gets the mask after the committed tokens."""
    return torch.stack([self._mask(0, ())] * n).unsqueeze(0)


@pytest.mark.parametrize("broken", [forgetful_mask, masks_at_the_committed_prefix],
                         ids=["no-rollback", "drafts-ignored"])
def test_broken_masks_go_red(monkeypatch, broken):
    monkeypatch.setattr(RowMatchers, "_mask" if broken is forgetful_mask else "allowed", broken)
    assert worst_gap(GRAMMARS["jsonish"], (), 3, "block", SETTINGS["T1"], "q") > 1e-3


def test_forced_tokens_and_masks():
    """The jsonish grammar forces {" ab ": and a space; where bytes are forced the mask allows
    only their tokens, so a forced draft is kept with probability 1. An unconstrained row allows
    everything."""
    matchers = RowMatchers(TOKENIZER, V, {EOS})
    matchers.join([GRAMMARS["jsonish"], None])
    assert matchers.forced(8) == [[ID['{"'], ID["ab"], ID['":'], ID["Ġ"]], []]
    first = matchers.allowed(None, 1)  # [2, 1, V]
    assert first[0, 0].nonzero().flatten().tolist() == [ID['{"']]
    assert first[1].all()
    assert matchers.allowed_prefix(0, [ID['{"'], ID["ab"], ID["h"]]) == 2


def test_forced_text_ends_in_the_tokenizers_spelling_of_the_forced_bytes():
    """After {"c": and a space the guess grammar forces the byte a, which the tokens a and ab
    both start: no token is forced, and the forced text drafts a, as the tokenizer writes it; the
    mask there allows both, so it is a guess (p < 1), kept only when the target writes a."""
    matchers = RowMatchers(TOKENIZER, V, {EOS})
    matchers.join([GRAMMARS["guess"]])
    forced = matchers.forced(8)[0]
    assert forced == [ID['{"'], ID["c"], ID['":'], ID["Ġ"], ID["a"]]
    allowed = matchers.allowed(torch.tensor([forced]), len(forced) + 1)[0]  # [6, V]
    assert allowed[4].nonzero().flatten().tolist() == [ID["a"], ID["ab"]]
    assert matchers.forced(3)[0] == forced[:3]


# --------------------------------------------------------------------------- whole generations


def grammar_pair():
    cpu = torch.device("cpu")
    make = lambda seed, layers: make_tiny_llama(seed=seed, num_layers=layers, vocab_size=V)
    return (LoadedModel(make(0, 2), TOKENIZER, "tiny-grammar-target", torch.float32, cpu),
            LoadedModel(make(1, 1), TOKENIZER, "tiny-grammar-draft", torch.float32, cpu))


PROMPT = [1] + TOKENIZER.encode('{"ab": ce}{"ab": af}')  # a lookup has something to copy


def model_joint(target, constraint, length, settings):
    """The constrained target's exact joint of the first `length` new tokens after PROMPT."""
    joint = {(): 1.0}
    for _ in range(length):
        grown = {}
        for seq, prob in joint.items():
            with torch.no_grad():
                logits = target.model(torch.tensor([PROMPT + list(seq)])).logits[0, -1].double()
            allowed = allowed_by_fresh_matcher(constraint, seq)
            p = probs_from_logits(logits.masked_fill(~allowed, -math.inf), **settings)
            grown.update({seq + (y,): prob * p[y].item() for y in p.nonzero().flatten().tolist()})
        joint = grown
    return joint


@pytest.mark.parametrize("kind, verify", [("model", "block"), ("ngram", "token"), ("auto", "block"),
                                          ("model", "coupled")])
def test_constrained_generations_follow_the_constrained_target(kind, verify):
    """The first 6 new tokens of 1,500 rows (γ = 2; the first four are grammar drafts) follow
    the constrained target's enumerated joint (chi-square, α = 1e-6), and every row matches."""
    target, draft = grammar_pair()
    drafter = {"model": draft, "ngram": NGramDrafter(), "auto": "auto:tiny"}[kind]
    if kind == "auto":
        drafter = es.drafters.AutoDrafter(es.drafters.ModelDrafter(draft))
    rows = 1500
    out = es.speculative_generate(target, drafter, torch.tensor([PROMPT] * rows), gamma=2,
                                  max_new_tokens=6, seed=7, verify=verify, temperature=1.0,
                                  constraint=GRAMMARS["jsonish"])
    counts = {}
    for row in out.sequences:
        key = tuple(row[len(PROMPT): len(PROMPT) + 6].tolist())
        counts[key] = counts.get(key, 0) + 1
    assert out.rounds_by_source.get("grammar", 0) >= 1 and out.stats.accepted_drafts > rows
    joint = model_joint(target, GRAMMARS["jsonish"], 6, dict(temperature=1.0))
    assert chi_square_pvalue(counts, joint) > ALPHA


DRAFTS = {"model": lambda draft: draft, "ngram": lambda draft: "ngram",
          "auto": lambda draft: es.drafters.AutoDrafter(es.drafters.ModelDrafter(draft))}


@pytest.mark.parametrize("kind, grammar",
                         [(kind, "jsonish") for kind in sorted(DRAFTS)] + [("ngram", "guess")])
@pytest.mark.parametrize("settings", [dict(temperature=0.0), dict(temperature=0.8, top_k=8)],
                         ids=["greedy", "T0.8-coupled"])
def test_constrained_speculative_output_is_plain_constrained_decoding(kind, grammar, settings):
    """Token for token, for γ 1, 4, 16 and auto, over a ragged batch: greedy speculative
    decoding equals greedy plain decoding under the constraint, and seeded coupled decoding
    equals seeded plain decoding; every row is a prefix of a match, and a whole one where it ended."""
    target, draft = grammar_pair()
    prompts = [torch.tensor(PROMPT[: 4 + 3 * i]) for i in range(4)]
    input_ids, mask = pad_prompts(prompts)
    constraint = GRAMMARS[grammar]
    plain = es.autoregressive_generate(target, input_ids, attention_mask=mask, max_new_tokens=16,
                                       seed=11, constraint=constraint, **settings)
    verify = "coupled" if settings["temperature"] else "block"
    for gamma in (1, 4, 16, "auto"):
        out = es.speculative_generate(target, DRAFTS[kind](draft), input_ids, attention_mask=mask,
                                      gamma=gamma, max_new_tokens=16, seed=11, verify=verify,
                                      constraint=constraint, **settings)
        assert [r.tolist() for r in out.sequences] == [r.tolist() for r in plain.sequences], gamma
    for row, prompt, stats in zip(plain.sequences, prompts, plain.row_stats):
        new = row[len(prompt):].tolist()
        assert allowed_by_fresh_matcher(constraint, tuple(new[:-1])) is not None  # a prefix of a match
        if stats.output_tokens < 16:  # ended: at EOS, with a whole match
            assert new[-1] == EOS and re.fullmatch({"jsonish": JSONISH, "guess": GUESS}[grammar],
                                                   TOKENIZER.decode(new[:-1]))


def start(target, drafter, prompts, settings):
    """A per-row Decoder over `prompts` (its EOS the tokenizer's, which the grammars end with)."""
    ids, mask = pad_prompts([torch.tensor(p) for p in prompts])
    decoder = Decoder(target, drafter, ids, mask, max_new_tokens=max(s.max_new_tokens for s in settings),
                      sampling=SamplingConfig(), seed=None, eos_token_id=None, verify="block",
                      on_tokens=None)
    decoder.use_row_settings(settings)
    return decoder


def test_per_row_constraints_with_rows_joining():
    """Per-row decoding (the server's): a constrained row, an unconstrained one, and a
    constrained row joining after the first round each get the text they get alone."""
    from test_continuous import join

    target, draft = grammar_pair()
    settings = [RowSettings(max_new_tokens=14, temperature=0.8, seed=s, gamma=3, verify="coupled",
                            constraint=c) for s, c in ((1, GRAMMARS["jsonish"]), (2, None), (3, GRAMMARS["short"]))]
    alone = []
    for row in settings:
        decoder = start(target, NGramDrafter(), [PROMPT], [row])
        while not decoder.done:
            decoder.step(3)
        alone.append(decoder.rows.new[0])
    decoder = start(target, NGramDrafter(), [PROMPT, PROMPT], settings[:2])
    decoder.step(3)
    join(decoder, [PROMPT], settings[2:])
    while not decoder.done:
        decoder.step(3)
    assert decoder.rows.new == alone
    assert re.fullmatch("[a-c]{1,2}", TOKENIZER.decode([t for t in alone[2] if t != EOS]))


def test_generate_plug_in_follows_a_constraint():
    """`model.generate(custom_generate=exactspec.hf.generate, constraint=..., tokenizer=...)`:
    greedy speculative output equals the engine's plain constrained decoding; without the
    tokenizer a one-line error says what is missing."""
    from exactspec.hf import generate as plug_in

    target, draft = grammar_pair()
    ids = torch.tensor([PROMPT])
    constraint = GRAMMARS["jsonish"]
    plain = es.autoregressive_generate(target, ids, max_new_tokens=12, temperature=0, constraint=constraint)
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), custom_generate=plug_in,
                                draft=draft.model, gamma=3, constraint=constraint, constraint_tokenizer=TOKENIZER,
                                do_sample=False, max_new_tokens=12, pad_token_id=EOS, eos_token_id=EOS)
    assert out[0].tolist()[: plain.sequences.size(1)] == plain.sequences[0].tolist()
    with pytest.raises(ValueError, match="constraint= needs constraint_tokenizer="):
        target.model.generate(ids, attention_mask=torch.ones_like(ids), custom_generate=plug_in,
                              draft="ngram", constraint=constraint, do_sample=False, max_new_tokens=4)


@pytest.mark.slow
def test_bundled_model_extraction_is_valid_and_exact(bundled_pair):
    """The bundled model on a JSON-extraction task (the bench's json workload): greedy
    speculative decoding with the llama.cpp draft and with prompt lookup equals plain
    constrained decoding token for token, seeded coupled decoding equals seeded plain decoding,
    and every reply validates against the schema (jsonschema)."""
    pytest.importorskip("llama_cpp")
    from exactspec.bench.extraction import is_valid, workload_prompts
    from exactspec.models import encode_prompt

    target = bundled_pair[0]
    task = workload_prompts("json:1")[0]
    ids = encode_prompt(target, task.text)
    texts = []
    for settings in (dict(temperature=0.0), dict(temperature=0.8, seed=5)):
        plain = es.autoregressive_generate(target, ids, max_new_tokens=120, constraint=task.constraint,
                                           **settings)
        for draft in ("llamacpp", "ngram"):
            out = es.speculative_generate(target, draft, ids, max_new_tokens=120, gamma="auto",
                                          verify="coupled", constraint=task.constraint, **settings)
            assert out.sequences.tolist() == plain.sequences.tolist(), (draft, settings)
            assert out.rounds_by_source.get("grammar", 0) > 0
        texts.append(target.tokenizer.decode(plain.sequences[0, ids.size(1):], skip_special_tokens=True))
    assert all(is_valid(task.constraint.schema(), text) for text in texts), texts


def test_lookup_continuation_after_drafts():
    """`SuffixIndex.continuation`: with nothing appended it is the lookup itself; with drafts
    appended it continues after their longest earlier match, reading only committed tokens."""
    from exactspec.drafters.ngram import SuffixIndex

    index = SuffixIndex([5, 6, 7, 8, 9, 5, 6], max_n=4)
    n, end = index.lookup(1, "latest")
    assert index.continuation([], 3, 1, "latest") == index.tokens[end + 1: end + 4] == [7, 8, 9]
    assert index.continuation([7, 8], 2, 1, "latest") == [9, 5]  # suffix 6 7 8, matched at 1..3
    assert index.continuation([42], 3, 1, "latest") == []  # 42 never occurred
    assert index.tokens == [5, 6, 7, 8, 9, 5, 6]  # read only


def test_grammar_chain_drafts_forced_tokens_then_lookup():
    """A grammar round drafts the forced tokens, then prompt lookup's continuation after them,
    cut where the grammar stops allowing it, and leaves the matcher where it was."""
    matchers = RowMatchers(TOKENIZER, V, {EOS})
    matchers.join([GRAMMARS["jsonish"]])
    forced = matchers.forced(8)[0]
    lookup = lambda drafts, n, forced: ([ID["c"], ID["e"], ID["}"], ID["a"]][:n], False)  # "ce}", a stray "a"
    assert matchers.chain(0, [], 16, lookup) == forced + [ID["c"], ID["e"], ID["}"]]
    assert matchers.chain(0, [], 2, lookup) == forced[:2]
    assert matchers.allowed(None, 1)[0, 0].nonzero().flatten().tolist() == [ID['{"']]  # rolled back


class NoDrafting(es.Controller):
    """A γ controller that never drafts: every round it chooses is a plain step."""

    def choose(self, source, **situation):
        return 0


def test_grammar_rounds_draft_every_forced_token_even_at_gamma_0():
    """A forced token has p = 1 under its mask: a grammar round drafts all of them whatever γ the
    controller chose (here always 0), each is kept, and the text is plain decoding's."""
    target, _ = grammar_pair()
    ids = torch.tensor([PROMPT])
    plain = es.autoregressive_generate(target, ids, max_new_tokens=8, temperature=0.0,
                                       constraint=GRAMMARS["jsonish"])
    out = es.speculative_generate(target, "ngram", ids, gamma=NoDrafting(), max_new_tokens=8,
                                  temperature=0.0, constraint=GRAMMARS["jsonish"])
    assert out.sequences.tolist() == plain.sequences.tolist()
    assert out.rounds_by_source["grammar"] == 1 and out.kept_by_source["grammar"] == 4


def test_per_row_grammar_rounds_verify_forced_tokens_on_top_of_gamma():
    """Per-row decoding (the server's): a row whose γ is "auto" verifies its grammar's forced
    tokens even when the controller's γ is 0, and keeps them; a row that asked for γ 0 (plain
    decoding) verifies none; a row whose budget ends inside the forced tokens stops at its
    budget. Every row's text is plain constrained decoding's."""
    target, _ = grammar_pair()
    plain = es.autoregressive_generate(target, torch.tensor([PROMPT]), max_new_tokens=8,
                                       temperature=0.0, constraint=GRAMMARS["jsonish"]).sequences[0]
    settings = [RowSettings(max_new_tokens=n, temperature=0.0, gamma=g, constraint=GRAMMARS["jsonish"])
                for n, g in ((8, "auto"), (8, 0), (2, "auto"))]
    decoder = start(target, NGramDrafter(), [PROMPT] * 3, settings)
    while not decoder.done:
        decoder.step(0)
    assert decoder.rows.new == [plain[len(PROMPT):].tolist()[:n] for n in (8, 8, 2)]
    kept = [stats.accepted_drafts for stats in decoder.rows.stats]
    assert kept[0] >= 4 and kept[1] == 0 and kept[2] == 1


def test_the_first_rounds_forced_drafts_share_the_prompts_pass():
    """The grammar forces the opening before any pass: the first round scores the prompt and
    those drafts in one pass (one target call per round, none for the prefill alone), and the
    controller takes no T(k) from that pass (it also read the prompt)."""
    target, _ = grammar_pair()
    ids = torch.tensor([PROMPT])
    controller = GammaController()
    out = es.speculative_generate(target, "ngram", ids, gamma=controller, max_new_tokens=8,
                                  temperature=0.0, constraint=GRAMMARS["jsonish"])
    plain = es.autoregressive_generate(target, ids, max_new_tokens=8, temperature=0.0,
                                       constraint=GRAMMARS["jsonish"])
    assert out.sequences.tolist() == plain.sequences.tolist()
    assert out.stats.target_calls == out.stats.rounds and out.kept_by_source["grammar"] >= 4
    assert max(controller.target, default=0) < len(PROMPT)


def test_grammar_rounds_do_not_score_the_lookup():
    """After a grammar round the lookup's scores of itself are dropped (it never drafts where the
    grammar forces), and its tallies start again; the forced drafts came at γ = 0."""
    from exactspec.drafters.grammar import GrammarDrafter

    matchers = RowMatchers(TOKENIZER, V, {EOS})
    matchers.join([GRAMMARS["jsonish"]])
    lookup = NGramDrafter()
    drafter = GrammarDrafter(lookup, matchers, budget=lambda: 16)
    drafter.start(torch.tensor([PROMPT]), torch.ones(1, len(PROMPT), dtype=torch.bool), V)
    assert drafter.next_source() == "grammar"
    forced = drafter.propose(0, SamplingConfig(), None).tokens[0].tolist()
    assert forced == matchers.forced(8)[0]
    drafter.commit(torch.tensor([4]), torch.tensor([ID["c"]]))
    assert drafter.evidence() == {}
    assert all(tally == (0, 0) for rows in lookup.evidence().values() for tally in rows)


def test_lookup_rounds_score_the_chain_they_propose_even_at_gamma_0():
    """In a lookup round the grammar drafter scores the chain it proposes (`chain_score`), not
    the bare lookup: a round at γ = 0 drafts nothing but scores its chain's first guess against
    the plain step's token; a round that drafts scores its first draft."""
    from exactspec.drafters.grammar import GrammarDrafter

    matchers = RowMatchers(TOKENIZER, V, {EOS})
    matchers.join([GRAMMARS["short"]])  # nothing forced at its start
    lookup = NGramDrafter()
    drafter = GrammarDrafter(lookup, matchers, budget=lambda: 16)
    drafter.start(torch.tensor([PROMPT]), torch.ones(1, len(PROMPT), dtype=torch.bool), V)
    chains = []
    drafter._chain = lambda b, start, gamma: chains.append(gamma) or [ID["a"], ID["b"]][:gamma]
    source = drafter.next_source()
    assert source in lookup.sources
    assert drafter.propose(0, SamplingConfig(), None).tokens.shape == (1, 0) and chains == [1]
    drafter.commit(torch.tensor([0]), torch.tensor([ID["a"]]))
    assert drafter.evidence() == {source: [(1, 0)]}
    assert drafter.evidence() == {}  # drained
    source = drafter.next_source()
    assert drafter.propose(2, SamplingConfig(), None).tokens[0].tolist() == [ID["a"], ID["b"]]
    drafter.commit(torch.tensor([0]), torch.tensor([ID["c"]]))
    assert drafter.evidence() == {source: [(0, 1)]}


class Vocab:
    def __init__(self, vocab):
        self.vocab = vocab

    def get_vocab(self):
        return self.vocab


def test_lookup_matches_a_value_without_its_leading_space():
    """A value starts a JSON string without the space it has in the passage: with the tokens
    folded to their text without a leading space, lookup finds the passage from the value's
    first word and proposes the passage's own tokens after it."""
    from exactspec.drafters.ngram import SuffixIndex, space_folding

    folding = space_folding(Vocab({"ĠMaria": 1, "Maria": 2, "▁x": 3, "x": 4, "Ġ": 5, "Ġonly": 6}))
    assert folding == {1: 2, 3: 4}
    passage_then_value = [1, 7, 8, 9, 2]  # " Maria", " Lopez", " is", '"', "Maria"
    assert SuffixIndex(passage_then_value, 4).continuation([], 2, 1, "latest") == []
    folded = SuffixIndex(passage_then_value, 4, folding)
    assert folded.continuation([], 2, 1, "latest") == [7, 8]
    assert folded.lookup(1, "latest") == (1, 0)
    assert folded.tokens == passage_then_value


def test_text_rest_goes_on_as_the_earlier_text_does_where_it_says_how():
    """`grammar.text_rest`: after the word the context ends inside, the earlier text after every
    word that starts so, in the whole words they share, up to where the clause ends (a value's
    first word split unlike the passage's; a whole word, whose clause's end is the value's)."""
    from exactspec.drafters.grammar import text_rest

    def rest(text, n=8):
        tokens, ends = text_rest(TOKENIZER, TOKENIZER.encode(text, add_special_tokens=False), n)
        return TOKENIZER.decode(tokens), ends

    assert rest('stella sat. "ste') == ("lla sat", True)  # on to where its clause ends
    assert rest('stella, sat. "ste') == ("lla", True)
    assert rest('stella, sat. "ste', n=2) == ("ll", False)
    assert rest('stella sat by the sea and the shore and the dunes and more. "ste', n=3)[1] is False
    assert rest('stella sat, stella ran. "ste') == ("lla", False)  # two ways on: the shared word
    assert rest('stella stern. "ste') == ("", False)  # two completions
    assert rest('ste, sat. "ste') == ("", True)  # whole already: its clause ends here
    assert rest('stella sat. "ste', n=0) == ("", False)
    assert rest('stella sat. "') == ("", False)  # not inside a word
    assert rest('stella sat. "den') == ("", False)  # the text never has it
    assert text_rest(None, [1, 2, 3, 4, 5], 4) == ([], False)


def test_chain_score_scores_a_chains_first_guess():
    """`grammar.chain_score`: a chain's first guess is a hit when kept or when the token committed
    in its place is the guess, else a miss; nothing without a guess."""
    from exactspec.drafters.grammar import chain_score

    assert chain_score([5, 6, 7], 2, 9) == (1, 0)
    assert chain_score([5, 6, 7], 0, 9) == (0, 1)
    assert chain_score([5], 0, 5) == (1, 0)  # a plain step's token that the chain guessed
    assert chain_score([5], 0, 4) == (0, 1)
    assert chain_score([], 0, 4) == (0, 0)


def test_clause_cut_stops_a_passage_where_its_clause_ends():
    """`grammar.clause_cut`: a passage's tokens up to the first comma, stop, semicolon, ! or ?
    that a space or the end follows (a number's point does not end a clause)."""
    from exactspec.drafters.grammar import clause_cut

    def cut(text, n):
        tokens, ends = clause_cut(TOKENIZER, TOKENIZER.encode(text, add_special_tokens=False), n)
        return TOKENIZER.decode(tokens), ends

    assert cut("fen, a", 8) == ("fen", True)
    assert cut("fen, a", 3) == ("fen", True)  # the clause end read past the n tokens
    assert cut("fen, a", 2) == ("fe", False)
    assert cut("4.5 at", 8) == ("4.5 at", False)
    assert cut("at 4.", 8) == ("at 4", True)
    assert cut(", a", 8) == ("", True)


def test_a_copied_value_is_ended_where_it_seems_to_end():
    """Where lookup says the value's clause ends, or the grammar cuts lookup's continuation, the
    chain drafts the value's end as the tokenizer writes it with the forced text after it (the
    next key), and stops there; a value with nothing allowed to end it gets nothing."""
    schema = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
              "required": ["a", "b"], "additionalProperties": False}
    matchers = RowMatchers(TOKENIZER, V, {EOS})
    matchers.join([Constraint.json_schema(schema)])
    spell = lambda text: TOKENIZER.encode(text, add_special_tokens=False)
    matchers.advance([spell('{"a": "')])
    copied = lambda drafts, n, forced: (spell("fed")[:n], True)
    assert TOKENIZER.decode(matchers.chain(0, [], 16, copied)) == 'fed", "b": '
    assert TOKENIZER.decode(matchers.chain(0, [], 4, copied)) == 'fed"'
    going_on = lambda drafts, n, forced: ([] if drafts else spell("fed")[:n], False)
    assert TOKENIZER.decode(matchers.chain(0, [], 16, going_on)) == "fed"
    matchers.advance([spell('{"a": "fed", "b": 4')])
    letters = lambda drafts, n, forced: (spell("5 at")[:n], False)  # the grammar cuts " at"
    assert TOKENIZER.decode(matchers.chain(0, [], 16, letters)) == "5}"
    fresh = RowMatchers(TOKENIZER, V, {EOS})
    fresh.join([Constraint.json_schema(schema)])
    fresh.advance([spell('{"a": "fed", "b": ')])
    assert fresh.chain(0, [], 16, lambda drafts, n, forced: (spell("a")[:n], False)) == []
