"""Penalties (`exactspec.penalties`): logit_bias, frequency / presence penalty (OpenAI's), the
repetition penalty and min-p, applied to p and q at every position of a round, each position after
the committed tokens and the drafts before it. Checked by enumeration in float64 against the
penalized target written out by hand (and shown to go red when a penalty ignores the drafts or
reaches q but not p), against Transformers' processors, end to end (the coupled rule's tokens
equal plain decoding's, per-row settings with joining rows, the bundled model's greedy output),
and through the server."""
import itertools
import math

import pytest
import torch

import exactspec as es
from conftest import round_ends
from test_cli_generate import tiny_folders  # noqa: F401  (the module-scoped fixture)
from exactspec.batching import RowSettings
from exactspec.drafters import ModelDrafter
from exactspec.engine import Decoder, pad_prompts
from exactspec.penalties import Penalized
from exactspec.sampling import SamplingConfig, probs_from_logits

# --------------------------------------------------------------------------- settings and errors


@pytest.mark.parametrize("kwargs, message", [
    (dict(frequency_penalty=2.5), "frequency_penalty must be a number in [-2, 2], got 2.5"),
    (dict(presence_penalty=-3), "presence_penalty must be a number in [-2, 2], got -3"),
    (dict(presence_penalty=math.nan), "presence_penalty must be a number in [-2, 2], got nan"),
    (dict(repetition_penalty=0), "repetition_penalty must be a finite number > 0, got 0"),
    (dict(min_p=1.5), "min_p must be in [0, 1], got 1.5"),
    (dict(logit_bias={"3": 1.0}), "logit_bias keys must be token ids (integers >= 0), got '3'"),
    (dict(logit_bias={-1: 1.0}), "logit_bias keys must be token ids (integers >= 0), got -1"),
    (dict(logit_bias={3: 101}), "logit_bias[3] must be a number in [-100, 100], got 101"),
    (dict(logit_bias=[3]), "logit_bias must map token ids to biases, got [3]"),
])
def test_bad_penalties_name_the_parameter_and_value(kwargs, message):
    for make in (SamplingConfig, lambda **kw: RowSettings(max_new_tokens=4, **kw)):
        with pytest.raises(ValueError) as err:
            make(**kwargs)
        assert str(err.value) == message


def test_settings_are_values_and_say_when_they_read_tokens():
    """logit_bias is kept as sorted pairs (rows with equal settings are grouped by hash)."""
    a, b = SamplingConfig(logit_bias={4: 1, 2: -1.5}), SamplingConfig(logit_bias=[(2, -1.5), (4, 1.0)])
    assert a == b and hash(a) == hash(b) and a.logit_bias == ((2, -1.5), (4, 1.0))
    assert not a.needs_prefix and not SamplingConfig(min_p=0.2).needs_prefix
    assert all(SamplingConfig(**kw).needs_prefix for kw in (
        dict(frequency_penalty=0.1), dict(presence_penalty=-0.1), dict(repetition_penalty=1.1)))
    with pytest.raises(ValueError, match="bind the settings"):
        SamplingConfig(frequency_penalty=1.0).probs(torch.zeros(1, 5))
    with pytest.raises(ValueError, match=r"logit_bias token id must be in \[0, 5\), got 7"):
        SamplingConfig(logit_bias={7: 1.0}).probs(torch.zeros(1, 5))


# --------------------------------------------------------------------------- the rule, by hand

V = 5
PROMPT = (1, 3, 3)  # the prompt's tokens: the repetition penalty reads them, the others do not


class Logits:
    """Float64 logits that depend on the whole prefix, the same for the same (seed, prefix)."""

    def __init__(self, seed):
        self.seed = seed

    def __call__(self, prefix):
        gen = torch.Generator().manual_seed(hash((self.seed, *prefix)) % 2**63)
        return 2.0 * torch.randn(V, generator=gen, dtype=torch.float64)


TARGET, DRAFT = Logits(0), Logits(1)


def by_hand(logits, prompt, generated, settings):
    """The penalized distribution written out: OpenAI's logit_bias, the repetition penalty on
    tokens of the prompt or generated, OpenAI's `logits[j] -= c[j] * frequency_penalty + (c[j] > 0)
    * presence_penalty` over the generated tokens, then temperature / top-k / top-p, then min-p
    (drop p < min_p · max p, renormalize)."""
    logits = logits.clone()
    for token, bias in settings.get("logit_bias", {}).items():
        logits[token] += bias
    r = settings.get("repetition_penalty", 1.0)
    for j in set(prompt) | set(generated):
        logits[j] = logits[j] / r if logits[j] > 0 else logits[j] * r
    for j in set(generated):
        logits[j] -= generated.count(j) * settings.get("frequency_penalty", 0.0)
        logits[j] -= settings.get("presence_penalty", 0.0)
    plain = {k: settings[k] for k in ("temperature", "top_k", "top_p") if k in settings}
    p = probs_from_logits(logits, **plain)
    min_p = settings.get("min_p")
    if min_p:
        p = torch.where(p >= min_p * p.max(), p, 0.0)
        p = p / p.sum()
    return p


def target_law(generated, length, settings):
    """{tokens: probability} of the next `length` tokens of the penalized target (by hand)."""
    joint = {(): 1.0}
    for _ in range(length):
        grown = {}
        for seq, prob in joint.items():
            p = by_hand(TARGET(PROMPT + generated + seq), PROMPT, generated + seq, settings)
            for y in p.nonzero().flatten().tolist():
                grown[seq + (y,)] = prob * p[y].item()
        joint = grown
    return joint


def bind(settings, generated):
    """`SamplingConfig(**settings)` bound to a row, as the engine binds it each round."""
    config = SamplingConfig(**settings)
    if not config.needs_prefix:
        return config
    new = torch.tensor(generated, dtype=torch.long)
    return config.after(torch.tensor([0]), [torch.cat([torch.tensor(PROMPT), new])],
                        prompts=[torch.tensor(PROMPT)], generated=[new])


def round_outcomes(generated, gamma, verify, make_q, make_p):
    """(probability, emitted tokens) of every outcome of one round after PROMPT + generated: q and
    p made by the library's settings objects as the drafter and the target call them (q one
    position after the drafts drawn so far, p over γ+1 positions after γ drafts); τ's exact law
    and the next token's weights from `exactspec.verify`."""
    committed = PROMPT + generated
    blocks = [((), 1.0, [])]
    for i in range(gamma):
        grown = []
        for block, weight, qs in blocks:
            q = make_q.probs(DRAFT(committed + block).view(1, V), drafts=torch.tensor([block], dtype=torch.long).view(1, i))[0]
            grown += [(block + (x,), weight * q[x].item(), qs + [q]) for x in q.nonzero().flatten().tolist()]
        blocks = grown
    for block, weight, qs in blocks:
        tokens = torch.tensor([block], dtype=torch.long).view(1, gamma)  # [1, γ]
        scores = torch.stack([TARGET(committed + block[:j]) for j in range(gamma + 1)]).unsqueeze(0)  # [1, γ+1, V]
        p = make_p.probs(scores, drafts=tokens)  # [1, γ+1, V]
        q = torch.stack(qs).unsqueeze(0)  # [1, γ, V]
        yield from round_ends(block, weight, tokens, q, p, verify)


def worst_gap(settings, generated, gamma, verify, make_q=None, make_p=None):
    """One library round, then the penalized target by hand, against the penalized target alone:
    the largest difference in the probability of any γ+1 next tokens."""
    make_q = make_q or bind(settings, generated)
    make_p = make_p or bind(settings, generated)
    got = {}
    for prob, emitted in round_outcomes(generated, gamma, verify, make_q, make_p):
        for tail, tail_prob in target_law(generated + emitted, gamma + 1 - len(emitted), settings).items():
            got[emitted + tail] = got.get(emitted + tail, 0.0) + prob * tail_prob
    want = target_law(generated, gamma + 1, settings)
    return max(abs(got.get(k, 0.0) - want.get(k, 0.0)) for k in got.keys() | want.keys())


SETTINGS = {
    "frequency": dict(frequency_penalty=1.5),
    "presence": dict(presence_penalty=-1.7),  # negative: repeats are favoured
    "repetition": dict(repetition_penalty=1.9),
    "logit_bias": dict(logit_bias={0: 2.5, 4: -1.5}),
    "min_p": dict(min_p=0.3),
    "all": dict(temperature=0.8, top_k=4, frequency_penalty=0.7, presence_penalty=0.9,
                repetition_penalty=1.3, logit_bias={1: -3.0}, min_p=0.05),
    "greedy": dict(temperature=0, frequency_penalty=2.0, presence_penalty=0.5),
}
GENERATED = [(), (2, 0, 2)]  # new tokens committed before the round


@pytest.mark.parametrize("verify", ["token", "block"])
@pytest.mark.parametrize("gamma", [1, 2, 3])
@pytest.mark.parametrize("generated", GENERATED)
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_round_keeps_the_penalized_target_exactly(name, generated, gamma, verify):
    """One round with penalized p and q, then the penalized target: the joint of the next γ+1
    tokens equals the penalized target's (written by hand) to 1e-12."""
    assert worst_gap(SETTINGS[name], generated, gamma, verify) < 1e-12


def forgetful_probs(self, logits, drafts=None):
    """`Penalized.probs` that ignores the drafts: every position penalized by the committed tokens."""
    scores = logits if logits.dim() == 3 else logits.unsqueeze(1)  # [b, n, V]
    none = drafts[:, :0]  # [b, 0]
    probs = torch.stack([ORIGINAL_PROBS(self, scores[:, j], drafts=none) for j in range(scores.size(1))], 1)
    return probs if logits.dim() == 3 else probs[:, 0]


ORIGINAL_PROBS = Penalized.probs
# (Greedy rounds draft one block, and these few logits seldom make the target repeat a token
# drafted in that block, so greedy's forgetful variant is caught end to end instead, if at all.)
RED = [(name, generated) for name in ("frequency", "presence", "repetition", "all")
       for generated in GENERATED]


@pytest.mark.parametrize("name, generated", RED)
def test_penalties_that_ignore_the_drafts_go_red(monkeypatch, name, generated):
    assert worst_gap(SETTINGS[name], generated, 3, "block") < 1e-12
    monkeypatch.setattr(Penalized, "probs", forgetful_probs)
    assert worst_gap(SETTINGS[name], generated, 3, "block") > 1e-3


@pytest.mark.parametrize("name", ["frequency", "repetition", "logit_bias", "min_p"])
def test_penalizing_q_but_not_p_goes_red(name):
    """p without the penalty: the output follows the unpenalized target, not the penalized one."""
    assert worst_gap(SETTINGS[name], (2, 0, 2), 2, "token", make_p=SamplingConfig()) > 1e-3


@pytest.mark.parametrize("name", ["frequency", "repetition", "logit_bias"])
def test_penalizing_p_but_not_q_stays_exact(name):
    """The rule is exact for any q the draft really drew from: a q without the penalty only
    costs acceptance (so this broken variant does not go red; the ones above do)."""
    assert worst_gap(SETTINGS[name], (2, 0, 2), 2, "token", make_q=SamplingConfig()) < 1e-12


# --------------------------------------------------------------------------- against Transformers


def test_penalized_block_positions_follow_their_drafts():
    """Penalized.probs over rows with different committed tokens, at the target's shape (n = k+1)
    and at a draft's (n = 1): position j equals the hand formula after the drafts before it."""
    settings = SETTINGS["all"]
    generated, drafts = [(0, 0, 4), ()], torch.tensor([[4, 4, 1], [2, 3, 2]])
    bound = SamplingConfig(**settings).after(
        torch.arange(2), [None, None], prompts=[torch.tensor(PROMPT), torch.tensor([2])],
        generated=[torch.tensor(g, dtype=torch.long) for g in generated])
    logits = torch.randn(2, 4, V, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    p = bound.probs(logits, drafts=drafts)  # [2, 4, V]
    for b, prompt in enumerate([PROMPT, (2,)]):
        for j in range(4):
            want = by_hand(logits[b, j], prompt, generated[b] + tuple(drafts[b, :j].tolist()), settings)
            assert torch.allclose(p[b, j], want, atol=1e-12)
        q = bound.probs(logits[:, 2], drafts=drafts[:, :2])  # [2, V], after 2 drafts
        assert torch.allclose(q[b], p[b, 2], atol=1e-12)


def test_penalties_match_transformers_processors():
    """repetition_penalty = RepetitionPenaltyLogitsProcessor over prompt + generated tokens,
    logit_bias = SequenceBiasLogitsProcessor of one-token sequences, min_p = MinPLogitsWarper."""
    from transformers import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

    gen = torch.Generator().manual_seed(3)
    logits, ids = torch.randn(1, 32, generator=gen), torch.tensor([[1, 7, 7, 30, 4]])
    row = dict(rows=torch.arange(1), committed=[ids[0]], prompts=[ids[0, :3]], generated=[ids[0, 3:]])
    cases = [(dict(repetition_penalty=1.7), RepetitionPenaltyLogitsProcessor(1.7)),
             (dict(logit_bias={4: 3.0, 9: -2.0}), SequenceBiasLogitsProcessor([[[4], 3.0], [[9], -2.0]])),
             (dict(min_p=0.15), MinPLogitsWarper(0.15))]
    for settings, processor in cases:
        config = SamplingConfig(**settings)
        bound = config.after(**row) if config.needs_prefix else config
        ours = bound.probs(logits, drafts=torch.zeros(1, 0, dtype=torch.long))
        assert torch.allclose(ours, processor(ids, logits.clone()).softmax(-1), atol=1e-6), settings


# --------------------------------------------------------------------------- end to end

def tokens(output) -> list[list[int]]:
    return [torch.as_tensor(row).tolist() for row in output.sequences]


PENALTIES = [dict(frequency_penalty=1.2), dict(presence_penalty=1.5), dict(repetition_penalty=1.6),
             dict(logit_bias={6: 4.0, 14: -100}), dict(min_p=0.2),
             dict(frequency_penalty=-0.8, presence_penalty=0.6, repetition_penalty=1.2, min_p=0.05,
                  logit_bias={3: 1.5})]


@pytest.mark.parametrize("settings", PENALTIES, ids=str)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_coupled_speculative_equals_plain_with_penalties(tiny_pair, one_thread, settings, temperature):
    """The coupled rule's tokens are plain decoding's with the same seed, whatever the draft and
    γ, so a round whose p or q missed the drafts would show; two rows of different lengths."""
    target, draft = tiny_pair
    ids, mask = pad_prompts([torch.tensor([1, 5, 9, 5, 9, 5]), torch.tensor([1, 7])])
    config = SamplingConfig(temperature, **settings)
    plain = es.autoregressive_generate(target, ids, attention_mask=mask, max_new_tokens=16,
                                       sampling=config, seed=5, eos_token_id=[])
    spec = es.speculative_generate(target, draft, ids, attention_mask=mask, gamma=3, max_new_tokens=16,
                                   sampling=config, seed=5, eos_token_id=[], verify="coupled")
    assert tokens(spec) == tokens(plain)
    if temperature == 0 and "min_p" not in settings:  # greedy: min-p never changes the argmax
        unpenalized = es.autoregressive_generate(target, ids, attention_mask=mask, max_new_tokens=16,
                                                 temperature=0, eos_token_id=[])
        assert tokens(plain) != tokens(unpenalized)


@pytest.mark.parametrize("settings", PENALTIES[:3], ids=str)
def test_coupled_rounds_that_ignore_the_drafts_go_red(tiny_pair, one_thread, monkeypatch, settings):
    """The same check with `Penalized.probs` forgetting the drafts: plain decoding (no drafts) is
    unchanged, the speculative tokens differ for some of six seeds (16 tokens are too few for
    every seed to show it)."""
    target, draft = tiny_pair
    ids, mask = pad_prompts([torch.tensor([1, 5, 9, 5, 9, 5]), torch.tensor([1, 7])])
    config = SamplingConfig(1.0, **settings)
    plain = [es.autoregressive_generate(target, ids, attention_mask=mask, max_new_tokens=16,
                                        sampling=config, seed=seed, eos_token_id=[]) for seed in range(6)]
    monkeypatch.setattr(Penalized, "probs", forgetful_probs)
    spec = [es.speculative_generate(target, draft, ids, attention_mask=mask, gamma=3, max_new_tokens=16,
                                    sampling=config, seed=seed, eos_token_id=[], verify="coupled")
            for seed in range(6)]
    assert [tokens(s) for s in spec] != [tokens(p) for p in plain]


def test_rows_with_their_own_penalties_join_a_running_batch(tiny_pair, one_thread):
    """Per-row settings (continuous batching): rows with different penalties, two of them joining
    after the first round, each under the coupled rule with its own seed: each row's tokens are
    plain decoding of its prompt alone with its settings and seed."""
    target, draft = tiny_pair
    prompts = [[1, 5, 9, 5, 9, 5], [1, 20, 21, 22], [1, 7], [3, 3, 8]]
    rows = [RowSettings(max_new_tokens=12, temperature=t, seed=s, gamma=g, verify="coupled", **kw)
            for t, s, g, kw in zip((1.0, 0.0, 0.8, 1.0), (1, 2, 3, 4), (3, 2, 4, 1), PENALTIES[:4])]
    ids, mask = pad_prompts([torch.tensor(p) for p in prompts[:2]])
    decoder = Decoder(target, ModelDrafter(draft), ids, mask, max_new_tokens=12, sampling=SamplingConfig(),
                      seed=None, eos_token_id=[], verify="block", on_tokens=None)
    decoder.use_row_settings(rows[:2])
    decoder.step(4)
    ids, mask = pad_prompts([torch.tensor(p) for p in prompts[2:]])
    decoder.join(ids, mask, rows[2:])
    while not decoder.done:
        decoder.step(4)
    for row, (prompt, settings) in enumerate(zip(prompts, rows)):
        alone = es.autoregressive_generate(target, torch.tensor([prompt]), max_new_tokens=12,
                                           sampling=settings.sampling, seed=settings.seed, eos_token_id=[])
        assert prompt + decoder.rows.new[row] == alone.sequences[0].tolist(), row


@pytest.mark.slow
@pytest.mark.parametrize("settings", PENALTIES[:3] + [dict(logit_bias={28: 5.0}), dict(min_p=0.3)], ids=str)
def test_bundled_greedy_speculative_equals_plain_with_penalties(bundled_pair, settings):
    """The bundled model: greedy speculative decoding (its bfloat16 draft, γ = 4) emits plain
    greedy decoding's tokens with each penalty; the repetition penalty and logit_bias ones are
    also Transformers' own greedy `generate(repetition_penalty=..., sequence_bias=...)`."""
    target, draft = bundled_pair
    ids = target.tokenizer("The cat sat on the mat. The cat sat on the", return_tensors="pt").input_ids
    config = SamplingConfig(0.0, **settings)
    plain = es.autoregressive_generate(target, ids, max_new_tokens=20, sampling=config, eos_token_id=[])
    spec = es.speculative_generate(target, draft, ids, gamma=4, max_new_tokens=20, sampling=config,
                                   eos_token_id=[])
    assert tokens(spec) == tokens(plain)
    if "min_p" not in settings:  # the penalty changes the text (greedy: min-p cannot)
        assert tokens(plain) != tokens(es.autoregressive_generate(target, ids, max_new_tokens=20,
                                                                  temperature=0, eos_token_id=[]))
    hf = {"repetition_penalty": lambda v: dict(repetition_penalty=v),
          "logit_bias": lambda v: dict(sequence_bias=[[[t], b] for t, b in v.items()])}
    for name, make in hf.items():
        if name in settings:
            out = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                        max_new_tokens=20, pad_token_id=2, **make(settings[name]))[0]
            assert out.tolist() == plain.sequences[0, : out.numel()].tolist()  # (it may stop at EOS)


# --------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def server(tiny_folders):  # noqa: F811
    pytest.importorskip("fastapi")
    from exactspec.serve.app import ServeConfig
    from test_serve import Server

    target, draft = tiny_folders
    srv = Server(ServeConfig(target=target, draft=draft, gamma=3, model_name="tiny"))
    yield srv
    srv.close()


def test_server_takes_the_penalties(server, tiny_folders):  # noqa: F811
    """Both endpoints accept the fields (OpenAI's through the client, the extensions in
    extra_body), and a greedy completion is the library's plain greedy decoding with them."""
    fields = dict(frequency_penalty=1.2, presence_penalty=0.4, logit_bias={"9": 3.0, "14": -100})
    extra = {"repetition_penalty": 1.3, "min_p": 0.1}
    prompt = [1, 5, 9, 5, 9, 5]
    done = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0,
                                            extra_body=extra, **fields)
    config = SamplingConfig(0.0, frequency_penalty=1.2, presence_penalty=0.4, repetition_penalty=1.3,
                            logit_bias={9: 3.0, 14: -100}, min_p=0.1)
    target = es.load_model(tiny_folders[0])
    plain = es.autoregressive_generate(target, torch.tensor([prompt]), max_new_tokens=10, sampling=config)
    assert done.choices[0].text == target.tokenizer.decode(plain.sequences[0, len(prompt):],
                                                           skip_special_tokens=True)
    banned = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0,
                                              logit_bias={"14": 100})
    assert banned.choices[0].text.split() == ["w11"] * 10  # token 14 is "w11"
    chat = server.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "w3 w3 w3"}], max_tokens=6, seed=2,
        extra_body=extra, **fields)
    assert chat.choices[0].message.content is not None and chat.usage.completion_tokens >= 1


@pytest.mark.parametrize("field, value", [
    ("frequency_penalty", 2.5), ("presence_penalty", -2.1), ("presence_penalty", "high"),
    ("repetition_penalty", 0), ("min_p", 1.2), ("logit_bias", {"w3": 1}),
    ("logit_bias", {"3": 150}), ("logit_bias", {"32": 1}), ("logit_bias", [3, 1]),
])
@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_bad_penalties_are_400s_naming_the_field(server, endpoint, field, value):
    body = {"model": "tiny", field: value, "max_tokens": 2}
    body.update({"prompt": "w1 w2"} if endpoint == "completions" else
                {"messages": [{"role": "user", "content": "w1"}]})
    import httpx

    response = httpx.post(f"{server.url}/v1/{endpoint}", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"], error
