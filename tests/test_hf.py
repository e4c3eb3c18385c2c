"""exactspec inside Transformers' `generate()`: `custom_generate=exactspec.hf.generate` (the
callable form) and `custom_generate=exactspec.hf.custom_generate_dir()` (the folder form).

Greedy runs are compared token for token with `model.generate(do_sample=False)`, logits processors
included; sampling runs are compared with the processed target's exact law by chi-square."""
import copy
import os

import pytest
import torch
from transformers import (
    LogitsProcessor, LogitsProcessorList, RepetitionPenaltyLogitsProcessor, StoppingCriteria,
    TemperatureLogitsWarper, TextIteratorStreamer,
)
from transformers.generation.streamers import BaseStreamer

import exactspec.hf as eh
from conftest import ALPHA, chi_square_pvalue, make_tiny_llama, make_tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[1, 5, 9, 5, 9, 5, 9], [1, 7], [1, 20, 21, 22, 20]]
PAD = 2  # the tiny models' pad (and EOS) id


def left_padded(prompts):
    """input_ids[B, L] and attention_mask[B, L], prompts left-padded with PAD."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), PAD)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):], mask[row, width - len(prompt):] = torch.tensor(prompt), 1
    return ids, mask


def near_copy(model, noise=0.3, seed=0):
    """The target with a perturbed output layer: a draft that agrees often but not always, so
    greedy rounds both keep and reject drafts."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    weight = draft.lm_head.weight
    weight.add_(noise * weight.std() * torch.randn(weight.shape, generator=gen))
    return draft


@pytest.fixture
def target():
    return make_tiny_llama(seed=0, num_layers=2)


def draft_for(kind, target):
    return near_copy(target) if kind == "model" else "ngram"


# --------------------------------------------------------------------------- greedy identity

GREEDY_SETTINGS = {
    "plain": {},
    "repetition_penalty": dict(repetition_penalty=1.3),
    "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
    "penalty+ngram+min_new": dict(repetition_penalty=1.3, no_repeat_ngram_size=3, min_new_tokens=10),
}


@pytest.mark.parametrize("kind", ["model", "ngram"])
@pytest.mark.parametrize("settings", GREEDY_SETTINGS.values(), ids=GREEDY_SETTINGS.keys())
def test_greedy_is_token_identical_to_generate(target, kind, settings):
    """One row, and a left-padded batch of three: the same tensor as generate(do_sample=False),
    EOS and the padding after it included; the processors see each position's own prefix."""
    draft = draft_for(kind, target)
    for ids, mask in [left_padded(PROMPTS[:1]), left_padded(PROMPTS)]:
        call = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, **settings)
        expected = target.generate(ids, **call)
        out = target.generate(ids, custom_generate=eh.generate, draft=draft, gamma=3, **call)
        assert torch.equal(out, expected)


def test_greedy_without_a_draft_and_with_token_verification(target):
    ids, mask = left_padded(PROMPTS)
    call = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, repetition_penalty=1.2)
    expected = target.generate(ids, **call)
    assert torch.equal(target.generate(ids, custom_generate=eh.generate, **call), expected)
    out = target.generate(ids, custom_generate=eh.generate, draft=near_copy(target), gamma=5,
                          verify="token", **call)
    assert torch.equal(out, expected)


def test_greedy_with_auto_draft_and_auto_gamma(target):
    """draft="auto" (prompt lookup or a bfloat16 copy of the target, round by round) and
    gamma="auto" go through generate() unchanged."""
    ids, mask = left_padded(PROMPTS)
    call = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, repetition_penalty=1.2)
    out = target.generate(ids, custom_generate=eh.generate, draft="auto", gamma="auto", **call)
    assert torch.equal(out, target.generate(ids, **call))


class StopAt(StoppingCriteria):
    """Stop a row once its last token is `token` (a stopping rule Transformers does not know)."""

    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_a_stopping_criterion_ends_rows_as_in_generate(target):
    ids, mask = left_padded(PROMPTS)
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    stop_token = int(plain[0, ids.size(1) + 3])  # row 0's 4th new token: a stop mid-round
    call = dict(attention_mask=mask, max_new_tokens=20, do_sample=False,
                stopping_criteria=[StopAt(stop_token)])
    expected = target.generate(ids, **call)
    assert not torch.equal(expected[0], plain[0])  # row 0 stopped early, then padded
    for draft in (near_copy(target), "ngram"):
        out = target.generate(ids, custom_generate=eh.generate, draft=draft, gamma=4, **call)
        assert torch.equal(out, expected)


def test_return_dict_carries_the_counters(target):
    ids, mask = left_padded(PROMPTS)
    out = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                          custom_generate=eh.generate, draft=near_copy(target),
                          return_dict_in_generate=True)
    assert isinstance(out, eh.ExactspecGenerateOutput)
    stats = out.exactspec_stats
    assert stats.output_tokens == stats.accepted_drafts + stats.corrections + stats.bonus_tokens
    assert stats.accepted_drafts > 0 and len(out.exactspec_row_stats) == 3
    new = out.sequences[:, ids.size(1):]
    assert stats.output_tokens == sum(int(r.output_tokens) for r in out.exactspec_row_stats)
    assert stats.output_tokens <= new.numel()


# --------------------------------------------------------------------------- sampling exactness


class BanLast(LogitsProcessor):
    """A caller's processor that reads the prefix: the token just emitted cannot follow itself."""

    def __call__(self, input_ids, scores):
        return scores.scatter(1, input_ids[:, -1:], -float("inf"))


def processed_joint(model, prompt, processors, length=2):
    """Exact P(first `length` new tokens) under softmax(processors(prefix, logits)): generate()'s
    law, by enumeration with full forward passes (no cache) and Transformers' own processors."""
    joint = {(): 1.0}
    for _ in range(length):
        prefixes = [k for k, v in joint.items() if v > 0]
        batch = torch.tensor([prompt + list(k) for k in prefixes])  # [N, t]
        with torch.no_grad():
            scores = processors(batch, model(batch).logits[:, -1].float())  # [N, V]
        probs = scores.double().softmax(dim=-1)  # [N, V]
        joint = {k + (t,): joint[k] * probs[i, t].item()
                 for i, k in enumerate(prefixes) for t in range(probs.size(1))}
    return joint


# The random tiny target is flat (largest probability ≈ 0.15); the n-gram cases sample at a lower
# temperature after a prompt whose lookup proposes tokens the target likes, so drafts are kept
# often and both the accept and the correction paths run.
NGRAM_PROMPT = [1, 4, 3, 10, 7, 24, 28, 30, 3]
SAMPLING_CASES = {
    "model-plain": ("model", [1, 7], dict(temperature=1.0), []),
    "model-processed": ("model", [1, 7], dict(temperature=0.9, repetition_penalty=1.6),
                        [RepetitionPenaltyLogitsProcessor(1.6)]),
    "ngram-plain": ("ngram", NGRAM_PROMPT, dict(temperature=0.5), []),
    "ngram-processed": ("ngram", NGRAM_PROMPT, dict(temperature=0.5, repetition_penalty=1.3),
                        [RepetitionPenaltyLogitsProcessor(1.3)]),
}


@pytest.mark.parametrize("case", SAMPLING_CASES.values(), ids=SAMPLING_CASES.keys())
def test_sampling_through_generate_follows_the_processed_target(target, case):
    """The first 2 new tokens of 2400 generations through generate(do_sample=True) follow the
    processed target's exact joint law (chi-square, false-failure rate α = 1e-6 per case).
    The "processed" cases add a repetition penalty and a caller's BanLast processor, both
    reading the prefix, so p and q must be processed at every position with its own prefix."""
    kind, prompt, settings, extra = case
    target.generation_config.eos_token_id = None  # every generation runs its 3 tokens
    user = [BanLast()] if extra else []
    temperature = [TemperatureLogitsWarper(settings["temperature"])] if settings["temperature"] != 1 else []
    law = processed_joint(target, prompt, LogitsProcessorList(extra + user + temperature))
    draft = near_copy(target, noise=1.0) if kind == "model" else "ngram"
    counts, accepted, rows = {}, 0, 600
    for seed in range(4):  # 4 calls of 600 rows: each row is an independent exact sample
        out = target.generate(torch.tensor([prompt]).expand(rows, -1), max_new_tokens=3,
                              do_sample=True, top_k=0, pad_token_id=PAD, custom_generate=eh.generate,
                              draft=draft, gamma=2, seed=seed, logits_processor=user,
                              return_dict_in_generate=True, **settings)
        for key in map(tuple, out.sequences[:, len(prompt): len(prompt) + 2].tolist()):
            counts[key] = counts.get(key, 0) + 1
        accepted += out.exactspec_stats.accepted_drafts
    assert accepted > 200  # drafts were really kept, so the test exercises acceptance
    assert chi_square_pvalue(counts, law) > ALPHA


# --------------------------------------------------------------------------- streaming and the folder form


class Recorder(BaseStreamer):
    """Every put, as lists of ids; end() recorded."""

    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        self.puts.append(value.flatten().tolist())

    def end(self):
        self.ended = True


def test_folder_form_from_custom_generate_dir(target):
    folder = eh.custom_generate_dir()
    assert os.path.isfile(os.path.join(folder, "custom_generate", "generate.py"))
    ids, mask = left_padded(PROMPTS)
    call = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, no_repeat_ngram_size=2)
    expected = target.generate(ids, **call)
    out = target.generate(ids, custom_generate=folder, trust_remote_code=True,
                          draft=near_copy(target), gamma=3, **call)
    assert torch.equal(out, expected)


def test_streamer_through_the_folder_form_gets_the_returned_text(target):
    """TextIteratorStreamer passed as streamer= to the folder form: the text it yields is the text
    of the returned new tokens; a recording streamer sees the prompt, then one put per round."""
    tokenizer = make_tiny_tokenizer()
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    prompt = torch.tensor([NGRAM_PROMPT])
    out = target.generate(prompt, max_new_tokens=20, do_sample=True, temperature=0.7,
                          custom_generate=eh.custom_generate_dir(), trust_remote_code=True,
                          draft="ngram", seed=3, streamer=streamer)
    assert "".join(streamer) == tokenizer.decode(out[0, prompt.size(1):])

    recorder = Recorder()
    out = target.generate(prompt, max_new_tokens=20, do_sample=True, temperature=0.7,
                          custom_generate=eh.custom_generate_dir(), trust_remote_code=True,
                          draft="ngram", seed=3, streamer=recorder, return_dict_in_generate=True)
    assert recorder.ended and recorder.puts[0] == NGRAM_PROMPT
    assert sum(recorder.puts[1:], []) == out.sequences[0, prompt.size(1):].tolist()
    assert len(recorder.puts) - 1 == out.exactspec_stats.rounds > 1


def test_callable_form_streams_through_its_own_keyword(target):
    recorder = Recorder()
    out = target.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=12, do_sample=False,
                          custom_generate=eh.generate, draft="ngram", exactspec_streamer=recorder)
    assert recorder.ended and sum(recorder.puts[1:], []) == out[0, len(PROMPTS[0]):].tolist()


# --------------------------------------------------------------------------- what is refused

REFUSED = {
    "num_beams": dict(num_beams=2),
    "penalty_alpha": dict(penalty_alpha=0.6, top_k=4),
    "guidance_scale": dict(guidance_scale=1.5),
    "prompt_lookup_num_tokens": dict(prompt_lookup_num_tokens=3),
    "output_scores": dict(return_dict_in_generate=True, output_scores=True),
}


@pytest.mark.parametrize("name, settings", REFUSED.items(), ids=REFUSED.keys())
def test_settings_that_cannot_be_exact_name_themselves(target, name, settings):
    with pytest.raises(ValueError, match=rf"^{name}="):
        target.generate(torch.tensor([PROMPTS[1]]), max_new_tokens=4, custom_generate=eh.generate,
                        draft="ngram", **settings)


def test_a_streamer_needs_one_row(target):
    ids, mask = left_padded(PROMPTS)
    with pytest.raises(ValueError, match="streamer.*3 rows"):
        target.generate(ids, attention_mask=mask, max_new_tokens=4, custom_generate=eh.generate,
                        draft="ngram", exactspec_streamer=Recorder())


def test_stateful_processors_are_refused():
    class SynthIDTextWatermarkLogitsProcessor:  # stands for Transformers' class of that name
        def __call__(self, input_ids, scores):
            return scores

    with pytest.raises(ValueError, match="SynthIDTextWatermarkLogitsProcessor.*watermarking_config"):
        eh.Processing([SynthIDTextWatermarkLogitsProcessor()], greedy=False, batch_size=1)


# --------------------------------------------------------------------------- the bundled model


@pytest.mark.slow
def test_bundled_greedy_is_token_identical_to_generate(bundled_pair):
    """The bundled SmolLM2 (float32 target, bfloat16 draft): a left-padded batch of two chat
    prompts, 32 new tokens, with and without a repetition penalty and no-repeat n-grams, with the
    model draft and with "ngram"; then stop strings through the folder form."""
    target, draft = bundled_pair
    tokenizer, model = target.tokenizer, target.model
    tokenizer.padding_side = "left"
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": c}], tokenize=False,
                                           add_generation_prompt=True)
             for c in ("List three colors.", "Write one sentence about the sea and its tides.")]
    inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    for settings in ({}, dict(repetition_penalty=1.2, no_repeat_ngram_size=3)):
        call = dict(**inputs, max_new_tokens=32, do_sample=False, **settings)
        expected = model.generate(**call)
        for drafter in (draft, "ngram"):
            out = model.generate(**call, custom_generate=eh.generate, draft=drafter, gamma=4)
            assert torch.equal(out, expected)
    one = tokenizer(texts[:1], return_tensors="pt", add_special_tokens=False)
    call = dict(**one, max_new_tokens=32, do_sample=False, stop_strings=["\n", "."], tokenizer=tokenizer)
    expected = model.generate(**call)
    assert expected.size(1) < one.input_ids.size(1) + 32  # a stop string ended it ("1.")
    out = model.generate(**call, custom_generate=eh.custom_generate_dir(), trust_remote_code=True,
                         draft="ngram")
    assert torch.equal(out, expected)
