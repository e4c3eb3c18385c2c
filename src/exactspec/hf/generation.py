"""exactspec's round loop behind Transformers' `generate()`: the `custom_generate` callable and
the function the shipped `custom_generate/generate.py` folder hands its call to.

Transformers prepares everything as for its own loop (the generation config merged with the
call's keywords, the logits processors, the stopping criteria, num_return_sequences' copies of
the prompts) and then calls `generate` below instead of its sampling loop. The output follows the
**processed target's** law, the one `generate()` samples from: p and q both go through every
prepared processor, at every position, with the prefix that position follows
(`exactspec.hf.processing`). Greedy is the argmax of the processed scores, so it is
token-identical to `generate(do_sample=False)`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.generation.stopping_criteria import (
    EosTokenCriteria, MaxLengthCriteria, StopStringCriteria, StoppingCriteriaList,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput

from exactspec.engine import EndRow, autoregressive_generate, speculative_generate
from exactspec.hf.processing import Processing
from exactspec.sampling import SamplingConfig

# Model inputs Transformers prepares for its own loop; the engine makes its own (cache, positions).
_PREPARED_INPUTS = {"attention_mask", "position_ids", "cache", "past_key_values", "use_cache",
                    "logits_to_keep", "cache_position", "output_attentions", "output_hidden_states",
                    "return_dict"}


@dataclass
class ExactspecGenerateOutput(GenerateDecoderOnlyOutput):
    """What `generate(return_dict_in_generate=True)` returns, plus exactspec's counters:
    `exactspec_stats` (a DecodeStats for the batch: output tokens, accepted drafts, drafted
    tokens, rounds, ...) and `exactspec_row_stats` (one DecodeStats per row)."""

    exactspec_stats: Any = None
    exactspec_row_stats: Any = None


# --------------------------------------------------------------------------- what cannot be exact


def _refused_settings(config) -> list[tuple[str, Any, str]]:
    """(setting, value, why) for each generation setting set that exactspec cannot reproduce."""
    def get(name, default=None):
        return getattr(config, name, default)

    greedy = not get("do_sample")
    checks = [
        ("num_beams", (get("num_beams") or 1) > 1,
         "beam search picks whole sequences by score, it does not sample token by token"),
        ("num_beam_groups", (get("num_beam_groups") or 1) > 1, "group beam search is beam search"),
        ("constraints", get("constraints") is not None, "constrained beam search is beam search"),
        ("force_words_ids", get("force_words_ids") is not None, "constrained beam search is beam search"),
        ("penalty_alpha", greedy and (get("penalty_alpha") or 0) > 0 and (get("top_k") or 0) > 1,
         "contrastive search reranks candidates with hidden states, not a distribution to sample"),
        ("dola_layers", get("dola_layers") is not None, "DoLa contrasts layers inside Transformers' loop"),
        ("prompt_lookup_num_tokens", get("prompt_lookup_num_tokens") is not None,
         "that is Transformers' own assisted generation: pass draft='ngram' instead"),
        ("assistant_early_exit", get("assistant_early_exit") is not None,
         "that is Transformers' own assisted generation: pass a draft= instead"),
        ("use_mtp", bool(get("use_mtp", False)), "that is Transformers' own assisted generation"),
        ("guidance_scale", get("guidance_scale") not in (None, 1, 1.0),
         "classifier-free guidance runs a second model with its own cache, step by step"),
    ]
    if get("return_dict_in_generate"):
        for name in ("output_scores", "output_logits", "output_attentions", "output_hidden_states"):
            checks.append((name, bool(get(name)), "exactspec.hf.generate returns sequences and counters only"))
    return [(name, get(name), why) for name, refused, why in checks if refused]


def check_supported(model, config, synced_gpus, model_kwargs: dict) -> None:
    """Raise ValueError naming the first setting that exactspec cannot run exactly."""
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(f"model {type(model).__name__} is an encoder-decoder: exactspec.hf.generate "
                         "runs decoder-only causal LMs")
    for name, value, why in _refused_settings(config):
        raise ValueError(f"{name}={value!r} is not supported by exactspec.hf.generate: {why}")
    if synced_gpus:
        raise ValueError("synced_gpus=True is not supported by exactspec.hf.generate")
    for name, value in model_kwargs.items():
        if name not in _PREPARED_INPUTS and value is not None:
            raise ValueError(f"model input {name!r} is not supported by exactspec.hf.generate "
                             "(it runs on input_ids and attention_mask only)")
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is not None and hasattr(cache, "get_seq_length") and cache.get_seq_length() > 0:
        raise ValueError("past_key_values / cache: exactspec.hf.generate starts from the prompt and "
                         f"cannot continue a cache that already holds {cache.get_seq_length()} tokens")


# --------------------------------------------------------------------------- stopping


@dataclass
class Stopping:
    """The stopping criteria split as the engine takes them: a token budget, the EOS ids, and the
    rest (stop strings, max time, the caller's own), checked after every committed token."""

    max_new_tokens: int
    eos_token_ids: list[int]
    others: StoppingCriteriaList


def split_stopping(criteria, config, prompt_length: int) -> Stopping:
    """Budget = the smallest MaxLengthCriteria.max_length (else the config's max_length) minus the
    prompt width; EOS = every EosTokenCriteria id (none: no EOS ends a row)."""
    lengths = [c.max_length for c in criteria if isinstance(c, MaxLengthCriteria)]
    max_length = min(lengths) if lengths else config.max_length
    if max_length is None:
        raise ValueError("max_length / max_new_tokens: generate() prepared no length limit")
    eos: list[int] = []
    for c in criteria:
        if isinstance(c, EosTokenCriteria):
            eos += [int(e) for e in torch.as_tensor(c.eos_token_id).flatten().tolist() if int(e) not in eos]
    others = StoppingCriteriaList(c for c in criteria if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria)))
    return Stopping(max(0, max_length - prompt_length), eos, others)


class StopChecks:
    """Stopping criteria other than the budget and EOS, checked after each token a round commits.
    A row ends at the first token where a criterion says stop: a rule on the row's own prefix, so
    what it keeps is a prefix of an exact sample, hence exact. Each criterion sees the row as
    `generate()` holds it (prompt with its padding, then the new tokens), in a batch of the
    original size at the row's own index."""

    def __init__(self, criteria: StoppingCriteriaList, input_ids: torch.Tensor):
        self.criteria = criteria
        self.tokens = list(input_ids)  # B × [t], each row's tokens so far
        self.batch_size = input_ids.size(0)

    def first_stop(self, row: int, new: list[int]) -> int | None:
        """How many of `new` the row keeps when a criterion stops it among them; None: go on."""
        for count, token in enumerate(new, start=1):
            self.tokens[row] = torch.cat([self.tokens[row], self.tokens[row].new_tensor([token])])
            ids = self.tokens[row].unsqueeze(0).expand(self.batch_size, -1)  # [B, t], row at its index
            if bool(self.criteria(ids, None)[row]):
                return count
        return None


def stop_strings_criterion(model, kwargs: dict) -> dict:
    """The folder form's keywords with `stop_strings` turned into a StopStringCriteria in
    `stopping_criteria`: Transformers 5.24 does not hand the tokenizer to a callable, and refuses
    stop strings without it."""
    config = kwargs.get("generation_config") or model.generation_config
    stop_strings = kwargs.get("stop_strings", getattr(config, "stop_strings", None))
    if not stop_strings:
        return kwargs
    tokenizer = kwargs.get("tokenizer")
    if tokenizer is None:
        raise ValueError(f"stop_strings={stop_strings!r} needs the model's tokenizer: pass tokenizer=")
    criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
    criteria.append(StopStringCriteria(tokenizer, stop_strings))
    return {**kwargs, "stopping_criteria": criteria, "stop_strings": None}


# --------------------------------------------------------------------------- streaming and output


def _on_tokens(streamer, stops: StopChecks | None):
    """The engine's per-round callback: end rows a criterion stops, stream what each round keeps.
    None (the engine's fast path) when there is nothing to do."""
    if streamer is None and stops is None:
        return None

    def on_tokens(row: int, new: list[int]) -> EndRow | None:
        end = stops.first_stop(row, new) if stops is not None else None
        kept = new if end is None else new[:end]
        if streamer is not None and kept:
            streamer.put(torch.tensor(kept))
        return None if end is None else EndRow(end)

    return on_tokens


def _new_tokens(out, valid: torch.Tensor) -> list[torch.Tensor]:
    """Each row's new tokens: the engine's row minus its prompt tokens (valid[b] of them)."""
    return [sequence[int(n):] for sequence, n in zip(out.sequences, valid.sum(dim=1))]


def _sequences(input_ids: torch.Tensor, new: list[torch.Tensor], pad_token_id: int) -> torch.LongTensor:
    """generate()'s layout: each prompt row as given, then its new tokens, rows that ended early
    filled with pad_token_id up to the longest. [B, L + n]"""
    width = max(len(tokens) for tokens in new)
    out = input_ids.new_full((input_ids.size(0), input_ids.size(1) + width), pad_token_id)  # [B, L + n]
    out[:, : input_ids.size(1)] = input_ids
    for row, tokens in enumerate(new):
        out[row, input_ids.size(1): input_ids.size(1) + len(tokens)] = tokens.to(out.device)
    return out


def _pad_id(config, eos: list[int]) -> int:
    """The id that fills rows that ended early: the pad id, else the first EOS id, else 0."""
    pad = getattr(config, "_pad_token_tensor", None)
    if pad is None:
        pad = config.pad_token_id
    if pad is not None:
        return int(torch.as_tensor(pad).flatten()[0])
    return eos[0] if eos else 0


def _seed(seed: int | None, greedy: bool) -> int:
    """exactspec's own generator's seed. Without one, a sampling run draws it from torch's global
    generator, so `transformers.set_seed(...)` repeats a run as it does for `generate()`."""
    if seed is not None:
        return seed
    return 0 if greedy else int(torch.randint(0, 2**62, (1,)))


# --------------------------------------------------------------------------- the entry points


def generate(model, input_ids: torch.LongTensor, logits_processor, stopping_criteria,
             generation_config, synced_gpus: bool = False, streamer=None, *, draft=None,
             gamma: int | str = 4, verify: str = "block", seed: int | None = None,
             exactspec_streamer=None, constraint=None, constraint_tokenizer=None,
             **model_kwargs):
    """Speculative decoding as `model.generate(**inputs, custom_generate=exactspec.hf.generate,
    draft=DRAFT, gamma=4, ...)`; every row follows the processed target's law exactly.

    draft: a model, a model spec, "ngram", "auto", or any exactspec drafter; None decodes plainly
    (one target pass per token) with the same processing. gamma: drafts per round (or "auto");
    verify: "block", "token" or "coupled" (the same tokens as draft=None with the same seed);
    seed: exactspec's generator (default: drawn from torch's global generator when sampling).
    constraint: an `exactspec.Constraint` (JSON Schema, regex, Lark grammar) every row follows
    exactly, with constraint_tokenizer= the model's tokenizer (llguidance reads it; Transformers
    keeps `tokenizer=` for itself); a logits processor that keeps a grammar's state cannot score
    drafts that may be rejected, while a stateless one (`prefix_allowed_tokens_fn`) already
    works. exactspec_streamer: a Transformers streamer (put / end) fed as each round commits
    tokens; Transformers 5.24 does not pass `streamer=` to a callable (use this
    keyword, or the folder form, which accepts `streamer=`). Settings that cannot be made exact
    (beam search, contrastive search, guidance, ...) raise ValueError naming the setting.

    Returns a LongTensor[B, L + n] laid out as generate()'s (rows that ended early padded with
    the pad id), or with return_dict_in_generate=True an ExactspecGenerateOutput carrying the
    counters in `exactspec_stats` and `exactspec_row_stats`.
    """
    check_supported(model, generation_config, synced_gpus, model_kwargs)
    streamer = exactspec_streamer if exactspec_streamer is not None else streamer
    batch, width = input_ids.shape
    if streamer is not None and batch > 1:
        raise ValueError(f"exactspec_streamer / streamer streams one row, got a batch of {batch} rows")
    greedy = not generation_config.do_sample
    stopping = split_stopping(stopping_criteria, generation_config, width)
    sampling = (Processing(logits_processor, greedy=greedy, batch_size=batch) if len(logits_processor)
                else SamplingConfig(temperature=0.0 if greedy else 1.0))
    mask = model_kwargs.get("attention_mask")
    valid = torch.ones_like(input_ids, dtype=torch.bool) if mask is None else mask.bool()
    stops = StopChecks(stopping.others, input_ids) if len(stopping.others) else None
    if streamer is not None:
        streamer.put(input_ids.cpu())  # as generate() does: the prompt first
    settings = dict(max_new_tokens=stopping.max_new_tokens, sampling=sampling,
                    seed=_seed(seed, greedy), eos_token_id=stopping.eos_token_ids,
                    attention_mask=mask, on_tokens=_on_tokens(streamer, stops))
    target = model
    if constraint is not None:
        if constraint_tokenizer is None:
            raise ValueError("constraint= needs constraint_tokenizer= (the model's tokenizer, which "
                             "the grammar's matcher reads)")
        target, settings["constraint"] = (model, constraint_tokenizer), constraint
    if draft is None:
        out = autoregressive_generate(target, input_ids, **settings)
    else:
        out = speculative_generate(target, draft, input_ids, gamma=gamma, verify=verify, **settings)
    if streamer is not None:
        streamer.end()
    sequences = _sequences(input_ids, _new_tokens(out, valid),
                           _pad_id(generation_config, stopping.eos_token_ids))
    if not generation_config.return_dict_in_generate:
        return sequences
    return ExactspecGenerateOutput(sequences=sequences, exactspec_stats=out.stats,
                                   exactspec_row_stats=out.row_stats)


def folder_generate(model, streamer=None, assistant_model=None, **kwargs):
    """The folder form (`custom_generate=exactspec.hf.custom_generate_dir()`, trust_remote_code=True).

    Transformers hands the folder every `generate()` argument; this hands the call back to
    `generate()` with `generate` above as the callable, so Transformers prepares the config,
    processors and stopping criteria exactly as for its own loop. `streamer=` becomes
    `exactspec_streamer=`, and stop strings become a stopping criterion (the callable form gets no
    tokenizer)."""
    if assistant_model is not None:
        raise ValueError("assistant_model is Transformers' own assisted generation: pass the draft "
                         "as draft=... instead")
    kwargs = stop_strings_criterion(model, kwargs)
    return model.generate(custom_generate=generate, exactspec_streamer=streamer, **kwargs)
