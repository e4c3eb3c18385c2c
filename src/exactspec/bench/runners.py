"""One generation, measured: exactspec's decoding and Transformers' generation, run the same way.

- every generation produces exactly ``max_new_tokens`` tokens: end-of-sequence is disabled for
  all methods (exactspec ``eos_token_id=[]``, Transformers ``eos_token_id=[]``), so each method
  does the same amount of work;
- a run takes its seed from the caller; Transformers samples from the global generator, which is
  forked and seeded around each call, so the caller's random state is left as it was;
- wall time is read around the whole call (set-up included), after synchronizing the
  accelerator; time to first token on the same clock, from the engine's ``on_tokens`` callback or
  a Transformers streamer.
"""
from __future__ import annotations

import contextlib
import copy
import time

import torch

from exactspec.bench.config import LLAMA_METHODS, NGRAM, BenchConfig, RunSpec
from exactspec.bench.results import RunResult
from exactspec.engine import autoregressive_generate, speculative_generate, synchronize
from exactspec.models import INTERSECTION, input_device, pair_method
from exactspec.models.huggingface import quiet_transformers


class _FirstTokenStreamer:
    """A Transformers streamer that only notes when the first new token arrives (the first
    `put` carries the prompt)."""

    def __init__(self, start: float, device: torch.device):
        self.start, self.device, self.calls, self.first, self.first_tokens = start, device, 0, None, None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:
            synchronize(self.device)
            self.first, self.first_tokens = time.perf_counter() - self.start, value.numel()

    def end(self) -> None:
        pass


@contextlib.contextmanager
def _seeded_global_rng(seed: int, device: torch.device):
    """Transformers samples from the global generator: fork it (so the caller's state is left
    as it was) and seed it for one call."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def lookup_ngram_default() -> int:
    """Transformers' own max_matching_ngram_size for prompt lookup, used when it is not set."""
    import inspect

    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    init = inspect.signature(PromptLookupCandidateGenerator.__init__)
    return init.parameters["max_matching_ngram_size"].default


class Runner:
    """Runs one configuration on one prompt. `target` is a LoadedModel; `drafts` maps each draft
    spec to a LoadedModel, to "ngram", or (an auto draft) to its drafter object, which the
    engine restarts for each generation."""

    def __init__(self, target, drafts: dict, config: BenchConfig, llama=None, trace=None):
        self.target, self.drafts, self.config, self.llama = target, drafts, config, llama
        self.trace = trace  # each exactspec round's trace line, with its configuration and seed
        self.device = torch.device(getattr(target, "device", None) or input_device(target.model))
        self.pad_token_id = self._pad_token_id()
        self.copies = {}  # (draft spec, sampled) → the assistant model of another vocabulary's rows

    def _pad_token_id(self) -> int:
        tokenizer, gen = self.target.tokenizer, getattr(self.target.model, "generation_config", None)
        for value in (getattr(gen, "pad_token_id", None), getattr(tokenizer, "pad_token_id", None),
                      getattr(tokenizer, "eos_token_id", None)):
            if isinstance(value, int):
                return value
        return 0

    def sampling(self, temperature: float) -> dict:
        return dict(temperature=temperature, top_k=self.config.top_k, top_p=self.config.top_p)

    def run(self, spec: RunSpec, input_ids: torch.Tensor, seed: int,
            max_new_tokens: int, constraint=None) -> RunResult:
        """A constrained prompt (exactspec's and llama.cpp's methods) runs until its grammar ends
        at EOS."""
        if spec.method in ("autoregressive", "speculative"):
            return self._run_exactspec(spec, input_ids, seed, max_new_tokens, constraint)
        if spec.method in LLAMA_METHODS:
            return self.llama.run(spec, input_ids, seed, max_new_tokens, constraint)
        if constraint is not None:
            raise ValueError(f"{spec.method} rows cannot follow a constraint here")
        return self._run_hf(spec, input_ids, seed, max_new_tokens)

    def _run_exactspec(self, spec, input_ids, seed, max_new_tokens, constraint) -> RunResult:
        first = []

        def on_tokens(_row, new):
            if not first:
                first.extend((time.perf_counter() - start, len(new)))  # the engine synchronized already

        on_round = None if self.trace is None else \
            (lambda line: self.trace({"config": spec.label, "seed": seed, **line}))
        kwargs = dict(max_new_tokens=max_new_tokens, seed=seed, on_tokens=on_tokens, on_round=on_round,
                      eos_token_id=None if constraint is not None else [], constraint=constraint,
                      **self.sampling(spec.temperature))
        synchronize(self.device)
        start = time.perf_counter()
        if spec.method == "autoregressive":
            out = autoregressive_generate(self.target, input_ids, **kwargs)
        else:
            out = speculative_generate(self.target, self.drafts[spec.draft], input_ids,
                                       gamma=spec.gamma, verify=spec.verify, **kwargs)
        synchronize(self.device)
        wall = time.perf_counter() - start
        tokens = out.sequences[0, input_ids.size(1):].tolist()
        return RunResult(tokens, wall, first[0] if first else None, out.stats,
                         dict(out.rounds_by_source), first[1] if first else None,
                         kept_by_source=dict(out.kept_by_source),
                         constraint_seconds=out.constraint_seconds)

    def generation_config(self, spec: RunSpec, max_new_tokens: int):
        """The Transformers GenerationConfig of an hf_* configuration."""
        from transformers import GenerationConfig

        t = spec.temperature
        sampling = dict(do_sample=False) if t == 0 else dict(
            do_sample=True, temperature=t, top_k=self.config.top_k or 0,
            top_p=self.config.top_p if self.config.top_p is not None else 1.0)
        extra = {}
        if spec.method == "hf_assisted" and spec.draft == NGRAM:
            extra = dict(prompt_lookup_num_tokens=spec.gamma)  # n-gram sizes: Transformers' own
        return GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=[],
                                pad_token_id=self.pad_token_id, **sampling, **extra)

    def peer_settings(self, spec: RunSpec) -> dict | None:
        """What the hf_assisted or llama_server configuration sets (recorded in its row)."""
        if spec.method == "llama_server":
            from exactspec.bench.llama_peers import server_arguments

            return {"arguments": server_arguments(spec.draft, spec.gamma, "DRAFT.gguf")}
        if spec.method != "hf_assisted":
            return None
        if spec.draft == NGRAM:  # max_matching_ngram_size left unset: Transformers' default
            return {"prompt_lookup_num_tokens": spec.gamma,
                    "max_matching_ngram_size": lookup_ngram_default()}
        if spec.gamma == "default":
            from transformers import GenerationConfig

            defaults = GenerationConfig._get_default_generation_params()
            own = self.drafts[spec.draft].model.generation_config
            return {key: getattr(own, key, None) if getattr(own, key, None) is not None
                    else defaults.get(key)
                    for key in ("num_assistant_tokens", "num_assistant_tokens_schedule",
                                "assistant_confidence_threshold")}
        settings = {"num_assistant_tokens": spec.gamma, "num_assistant_tokens_schedule": "constant",
                    "assistant_confidence_threshold": 0.0}
        if self._other_vocabulary(spec):
            settings["generator"] = ("UniversalSpeculativeDecodingGenerator" if spec.temperature > 0
                                     else "AssistedCandidateGeneratorDifferentTokenizers")
        return settings

    def _other_vocabulary(self, spec: RunSpec) -> bool:
        """Whether an hf_assisted row's draft has another vocabulary than the target: Transformers
        then takes both tokenizers and picks its generator by do_sample."""
        return pair_method(self.target, self.drafts[spec.draft]) == INTERSECTION

    def _assistant_model(self, spec: RunSpec):
        """The draft's model, or for a draft of another vocabulary a copy kept per draft and
        generator: Transformers' sampled generator prunes its assistant's output layer in place,
        and the greedy one and exactspec's rows need it whole."""
        model = self.drafts[spec.draft].model
        if not self._other_vocabulary(spec):
            return model
        key = (spec.draft, spec.temperature > 0)
        if key not in self.copies:
            self.copies[key] = copy.deepcopy(model)
        return self.copies[key]

    @contextlib.contextmanager
    def _assistant(self, spec: RunSpec):
        """The assistant model, its generation config set for this configuration and restored
        afterwards (Transformers reads the assistant's settings from its generation_config)."""
        if spec.method != "hf_assisted" or spec.draft == NGRAM:
            yield None
            return
        model = self._assistant_model(spec)
        saved = model.generation_config
        model.generation_config = copy.deepcopy(saved)
        if spec.gamma != "default":
            model.generation_config.num_assistant_tokens = spec.gamma
            model.generation_config.num_assistant_tokens_schedule = "constant"
            model.generation_config.assistant_confidence_threshold = 0.0  # γ fixed: no early stop
        try:
            yield model
        finally:
            model.generation_config = saved

    @torch.inference_mode()
    def _run_hf(self, spec, input_ids, seed, max_new_tokens) -> RunResult:
        model = self.target.model
        input_ids = input_ids.to(self.device)
        attention_mask = torch.ones_like(input_ids)
        gen_config = self.generation_config(spec, max_new_tokens)
        # quiet: Transformers' own deprecation chatter (raised inside assisted generation) off
        with self._assistant(spec) as assistant, quiet_transformers(warnings=True), \
                _seeded_global_rng(seed, self.device):
            kwargs = {"assistant_model": assistant} if assistant is not None else {}
            if assistant is not None and self._other_vocabulary(spec):
                kwargs.update(tokenizer=self.target.tokenizer,
                              assistant_tokenizer=self.drafts[spec.draft].tokenizer)
            synchronize(self.device)
            start = time.perf_counter()
            streamer = _FirstTokenStreamer(start, self.device)
            out = model.generate(input_ids, attention_mask=attention_mask,
                                 generation_config=gen_config, streamer=streamer, **kwargs)
            synchronize(self.device)
            wall = time.perf_counter() - start
        tokens = out[0, input_ids.size(1):].tolist()
        return RunResult(tokens, wall, streamer.first, first_tokens=streamer.first_tokens)
