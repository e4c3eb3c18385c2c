"""The benchmark harness: end-to-end speed of exactspec side by side with plain decoding and with
Transformers' own generation, on the same models, prompts, sampling settings and seeds.

Words (DESIGN.md): a **configuration** is one (method, draft, γ, verification rule, temperature);
**methods** are

- ``autoregressive``: exactspec's plain decoding of the target;
- ``speculative``: exactspec's speculative decoding, for each draft, γ and verification rule;
- ``hf_generate``: the target's own ``model.generate()``;
- ``hf_assisted``: ``model.generate(assistant_model=draft)`` for a model draft (γ fixed with the
  "constant" schedule, plus one row with Transformers' default settings, γ = "default"), and
  ``model.generate(prompt_lookup_num_tokens=γ)`` for the n-gram draft.

How it measures (the seed's Part 8: warm up both paths, synchronize accelerator timing, count
accepted drafts separately):

- every generation produces exactly ``max_new_tokens`` tokens: end-of-sequence is disabled for
  all methods (exactspec ``eos_token_id=[]``, Transformers ``eos_token_id=[]``), so each method
  does the same amount of work;
- the warm-up pass runs every configuration ``warmup`` times, untimed; then ``repeats`` timed
  passes each run every configuration on every prompt. Configurations are interleaved inside a
  pass, so noise from other work on the machine spreads over all of them alike;
- prompt i is always run with seed ``seed + i``: all runs of a configuration use the same seeds
  (Transformers samples from the global generator, which is forked and seeded around each call);
- wall time is read around the whole call (set-up included), after synchronizing the
  accelerator; time to first token on the same clock, from the engine's ``on_tokens`` callback or
  a Transformers streamer;
- a row is one configuration on one prompt kind: per pass, tokens and seconds are summed over the
  kind's prompts; ``tokens_per_s`` is the median over passes (min and max are kept, to show the
  noise).

The measured cost model (`build_costmodel`): α from the runs, the target's cost for one token and
for a block of γ+1 tokens and the draft's cost per token from direct timings of the models'
forward pass on a KV cache (`time_forward`), then `costmodel.speedup_measured` per γ beside the
measured speedup, and the γ it recommends.
"""
from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch

from exactspec import costmodel
from exactspec.engine import synchronize
from exactspec.models import BUNDLED_MODEL, encode_prompt

METHODS = ("autoregressive", "speculative", "hf_generate", "hf_assisted")
VERIFY_METHODS = ("block", "token")
NGRAM = "ngram"
DEFAULT_TARGET = BUNDLED_MODEL
DEFAULT_DRAFTS = (f"{BUNDLED_MODEL}@bfloat16", NGRAM)
DEFAULT_GAMMAS = (4,)
DEFAULT_TEMPERATURES = (0.0, 0.8)
DEFAULT_MAX_NEW_TOKENS = 32
DEFAULT_REPEATS = 3
DEFAULT_WARMUP = 1
DEFAULT_SEED = 0
MAX_GAMMA = 32
CURVE_MIN_GAMMA = 8  # the predicted curves run over γ = 1..max(8, largest γ benchmarked)
WARMUP_TOKENS = 16  # a warm-up generation is this long (or max_new_tokens, if shorter)


# --------------------------------------------------------------------------- prompts


@dataclass(frozen=True)
class BenchPrompt:
    """One prompt: `kind` groups prompts into rows ("open", "grounded", or a file's own kinds)."""

    name: str
    kind: str
    text: str


_GROUNDED_PARAGRAPH = (
    "The library opens at nine in the morning and closes at six in the evening. Visitors may "
    "borrow up to five books at a time for three weeks. Laptops can be used in the reading room "
    "on the second floor, and the quiet study area is on the third floor. Printing costs ten "
    "cents per page, and the printers are next to the main desk."
)
_GROUNDED_EMAIL = (
    "Hi Sam,\n\nThe project review meeting is on Thursday at 10 am in room 204. Please bring the "
    "budget report and the updated timeline. If you cannot attend, send your notes to Maria "
    "before the meeting.\n\nThanks,\nAlex"
)

BUILTIN_PROMPTS: tuple[BenchPrompt, ...] = (
    BenchPrompt("story", "open",
                "Write a short story about a lighthouse keeper who finds a message in a bottle."),
    BenchPrompt("qa", "open", "Explain in a few sentences how vaccines help the immune system."),
    BenchPrompt("copy-edit", "grounded",
                "Copy the following text exactly, but replace the word 'library' with "
                f"'museum'.\n\n{_GROUNDED_PARAGRAPH}"),
    BenchPrompt("email-edit", "grounded",
                "Rewrite this email so that the meeting is on Friday instead of Thursday. Keep "
                f"everything else word for word.\n\n{_GROUNDED_EMAIL}"),
)


def load_prompts(path: str | os.PathLike) -> list[BenchPrompt]:
    """Prompts from a JSONL file: one object per line with "prompt" (a non-empty string) and
    optional "kind" (default "custom") and "name" (default "line N"). Blank lines are skipped.
    Raises ValueError with one line naming the file and line."""
    where = f"--prompts {os.fspath(path)}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise ValueError(f"{where}: cannot read the file: {reason}") from None
    prompts = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where} line {number}: not valid JSON ({err.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) \
                or not obj["prompt"].strip():
            raise ValueError(f"{where} line {number}: expected an object with a non-empty "
                             f'"prompt" string, e.g. {{"prompt": "Tell me a story."}}')
        kind, name = obj.get("kind", "custom"), obj.get("name", f"line {number}")
        if not isinstance(kind, str) or not kind.strip() or not isinstance(name, str):
            raise ValueError(f'{where} line {number}: "kind" and "name" must be strings')
        prompts.append(BenchPrompt(name, kind.strip(), obj["prompt"]))
    if not prompts:
        raise ValueError(f"{where}: the file has no prompts")
    return prompts


def parse_gammas(text: str) -> list[int]:
    """"1,2,4,8" → [1, 2, 4, 8] (sorted, without duplicates); ValueError naming --gammas."""
    items = [item.strip() for item in str(text).split(",")]
    if not all(items):
        raise ValueError(f"--gammas must be a comma-separated list of integers in "
                         f"[1, {MAX_GAMMA}], e.g. 1,2,4,8; got {text!r}")
    gammas = []
    for item in items:
        try:
            gamma = int(item)
        except ValueError:
            gamma = None
        if gamma is None or not 1 <= gamma <= MAX_GAMMA:
            raise ValueError(f"--gammas: each γ must be an integer in [1, {MAX_GAMMA}], "
                             f"got {item!r} in {text!r}")
        gammas.append(gamma)
    return sorted(set(gammas))


def parse_verify(text: str) -> list[str]:
    """"token,block" → ["block", "token"] in the engine's order; ValueError naming --verify."""
    items = {item.strip() for item in str(text).split(",")}
    if not items or not items <= set(VERIFY_METHODS):
        raise ValueError(f"--verify must be a comma-separated subset of "
                         f"{','.join(VERIFY_METHODS)}, got {text!r}")
    return [m for m in VERIFY_METHODS if m in items]


# --------------------------------------------------------------------------- configuration


@dataclass
class BenchConfig:
    """What to run. Checked by `check()`; every list is non-empty."""

    target: str = DEFAULT_TARGET
    drafts: list[str] = field(default_factory=lambda: list(DEFAULT_DRAFTS))
    gammas: list[int] = field(default_factory=lambda: list(DEFAULT_GAMMAS))
    temperatures: list[float] = field(default_factory=lambda: list(DEFAULT_TEMPERATURES))
    verify: list[str] = field(default_factory=lambda: list(VERIFY_METHODS))
    prompts: list[BenchPrompt] = field(default_factory=lambda: list(BUILTIN_PROMPTS))
    prompts_source: str = "built-in"
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    repeats: int = DEFAULT_REPEATS
    warmup: int = DEFAULT_WARMUP
    peers: bool = True
    seed: int = DEFAULT_SEED
    top_k: int | None = None
    top_p: float | None = None
    device: str | None = None
    threads: int | None = None

    def check(self) -> "BenchConfig":
        if not self.drafts:
            raise ValueError("--draft needs at least one draft (a model spec or 'ngram')")
        if not self.gammas or any(not 1 <= g <= MAX_GAMMA for g in self.gammas):
            raise ValueError(f"--gammas must be integers in [1, {MAX_GAMMA}], got {self.gammas}")
        if not self.temperatures or any(not (math.isfinite(t) and t >= 0)
                                        for t in self.temperatures):
            raise ValueError(f"--temperature values must be finite numbers >= 0, "
                             f"got {self.temperatures}")
        if not self.verify or not set(self.verify) <= set(VERIFY_METHODS):
            raise ValueError(f"--verify must be a subset of {VERIFY_METHODS}, got {self.verify}")
        if not self.prompts:
            raise ValueError("the prompt set is empty")
        for name, value, low in (("--max-new-tokens", self.max_new_tokens, 1),
                                 ("--repeats", self.repeats, 1), ("--warmup", self.warmup, 0),
                                 ("--seed", self.seed, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"--top-k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        return self

    def to_dict(self) -> dict:
        out = asdict(self)
        out["prompts"] = [asdict(p) for p in self.prompts]
        return out


@dataclass(frozen=True)
class RunSpec:
    """One configuration. gamma: an int, "default" (Transformers' own assistant settings) or
    None (no draft)."""

    method: str
    temperature: float
    draft: str | None = None
    gamma: int | str | None = None
    verify: str | None = None

    @property
    def label(self) -> str:
        parts = [self.method]
        if self.draft:
            parts.append(self.draft)
        if self.gamma is not None:
            parts.append(f"γ={self.gamma}")
        if self.verify:
            parts.append(self.verify)
        parts.append(f"T={self.temperature:g}")
        return " ".join(parts)


def plan(config: BenchConfig) -> list[RunSpec]:
    """Every configuration, in table order."""
    specs = []
    for temperature in config.temperatures:
        specs.append(RunSpec("autoregressive", temperature))
        if config.peers:
            specs.append(RunSpec("hf_generate", temperature))
        for draft in config.drafts:
            for gamma in config.gammas:
                for verify in config.verify:
                    specs.append(RunSpec("speculative", temperature, draft, gamma, verify))
            if config.peers:
                for gamma in config.gammas:
                    specs.append(RunSpec("hf_assisted", temperature, draft, gamma))
                if draft != NGRAM:
                    specs.append(RunSpec("hf_assisted", temperature, draft, "default"))
    return specs


# --------------------------------------------------------------------------- one generation


@dataclass
class RunResult:
    """One timed generation."""

    tokens: list[int]
    wall_seconds: float
    time_to_first_token: float | None
    stats: object | None = None  # DecodeStats for exactspec methods


class _FirstTokenStreamer:
    """A Transformers streamer that only notes when the first new token arrives (the first
    `put` carries the prompt)."""

    def __init__(self, start: float, device: torch.device):
        self.start, self.device, self.calls, self.first = start, device, 0, None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:
            synchronize(self.device)
            self.first = time.perf_counter() - self.start

    def end(self) -> None:
        pass


@contextlib.contextmanager
def _quiet_transformers():
    """Transformers' own deprecation chatter (raised inside assisted generation) off."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


@contextlib.contextmanager
def _seeded_global_rng(seed: int, device: torch.device):
    """Transformers samples from the global generator: fork it (so the caller's state is left
    as it was) and seed it for one call."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


class Runner:
    """Runs one configuration on one prompt. `target` and `drafts` are LoadedModels (drafts maps
    each draft spec to a LoadedModel, or to "ngram")."""

    def __init__(self, target, drafts: dict, config: BenchConfig):
        self.target, self.drafts, self.config = target, drafts, config
        self.device = torch.device(getattr(target, "device", None)
                                   or next(target.model.parameters()).device)
        self.pad_token_id = self._pad_token_id()

    def _pad_token_id(self) -> int:
        tokenizer, gen = self.target.tokenizer, self.target.model.generation_config
        for value in (getattr(gen, "pad_token_id", None), getattr(tokenizer, "pad_token_id", None),
                      getattr(tokenizer, "eos_token_id", None)):
            if isinstance(value, int):
                return value
        return 0

    def sampling(self, temperature: float) -> dict:
        return dict(temperature=temperature, top_k=self.config.top_k, top_p=self.config.top_p)

    def run(self, spec: RunSpec, input_ids: torch.Tensor, seed: int,
            max_new_tokens: int) -> RunResult:
        if spec.method in ("autoregressive", "speculative"):
            return self._run_exactspec(spec, input_ids, seed, max_new_tokens)
        return self._run_hf(spec, input_ids, seed, max_new_tokens)

    def _run_exactspec(self, spec, input_ids, seed, max_new_tokens) -> RunResult:
        from exactspec.engine import autoregressive_generate, speculative_generate

        first = []

        def on_tokens(_row, _new):
            if not first:
                first.append(time.perf_counter() - start)  # the engine synchronized already

        kwargs = dict(max_new_tokens=max_new_tokens, seed=seed, eos_token_id=[],
                      on_tokens=on_tokens, **self.sampling(spec.temperature))
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
        return RunResult(tokens, wall, first[0] if first else None, out.stats)

    def generation_config(self, spec: RunSpec, max_new_tokens: int):
        """The Transformers GenerationConfig of an hf_* configuration."""
        from transformers import GenerationConfig

        t = spec.temperature
        sampling = dict(do_sample=False) if t == 0 else dict(
            do_sample=True, temperature=t, top_k=self.config.top_k or 0,
            top_p=self.config.top_p if self.config.top_p is not None else 1.0)
        extra = {}
        if spec.method == "hf_assisted" and spec.draft == NGRAM:
            from exactspec.drafters import NGramDrafter

            extra = dict(prompt_lookup_num_tokens=spec.gamma,
                         max_matching_ngram_size=NGramDrafter().max_ngram)
        return GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=[],
                                pad_token_id=self.pad_token_id, **sampling, **extra)

    def peer_settings(self, spec: RunSpec) -> dict | None:
        """What the hf_assisted configuration sets (recorded in its row)."""
        if spec.method != "hf_assisted":
            return None
        if spec.draft == NGRAM:
            from exactspec.drafters import NGramDrafter

            return {"prompt_lookup_num_tokens": spec.gamma,
                    "max_matching_ngram_size": NGramDrafter().max_ngram}
        if spec.gamma == "default":
            from transformers import GenerationConfig

            defaults = GenerationConfig._get_default_generation_params()
            own = self.drafts[spec.draft].model.generation_config
            return {key: getattr(own, key, None) if getattr(own, key, None) is not None
                    else defaults.get(key)
                    for key in ("num_assistant_tokens", "num_assistant_tokens_schedule",
                                "assistant_confidence_threshold")}
        return {"num_assistant_tokens": spec.gamma, "num_assistant_tokens_schedule": "constant",
                "assistant_confidence_threshold": 0.0}

    @contextlib.contextmanager
    def _assistant(self, spec: RunSpec):
        """The assistant model, its generation config set for this configuration and restored
        afterwards (Transformers reads the assistant's settings from its generation_config)."""
        if spec.method != "hf_assisted" or spec.draft == NGRAM:
            yield None
            return
        model = self.drafts[spec.draft].model
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
        with self._assistant(spec) as assistant, _quiet_transformers(), \
                _seeded_global_rng(seed, self.device):
            kwargs = {"assistant_model": assistant} if assistant is not None else {}
            synchronize(self.device)
            start = time.perf_counter()
            streamer = _FirstTokenStreamer(start, self.device)
            out = model.generate(input_ids, attention_mask=attention_mask,
                                 generation_config=gen_config, streamer=streamer, **kwargs)
            synchronize(self.device)
            wall = time.perf_counter() - start
        tokens = out[0, input_ids.size(1):].tolist()
        return RunResult(tokens, wall, streamer.first)


# --------------------------------------------------------------------------- cost timings


@torch.inference_mode()
def time_forward(loaded, context_ids: torch.Tensor, sizes: Iterable[int], *, repeats: int = 5,
                 warmup: int = 2) -> dict[int, float]:
    """Median seconds of one forward pass over n new tokens on a KV cache that holds
    `context_ids` [1, L], for each n in `sizes` (the engine's own `CachedModel.feed`, cropped
    back after each pass). Sizes are interleaved within each repeat, so noise spreads evenly."""
    from exactspec.cache import CachedModel
    from exactspec.models import unwrap_model
    from exactspec.models import usable_vocab

    model, tokenizer, name = unwrap_model(loaded)
    lm = CachedModel(model, name, usable_vocab((model, tokenizer)))
    device = lm.device
    context_ids = context_ids.to(device)
    sizes = sorted(set(sizes))
    lm.feed(context_ids[:, :-1])
    new = context_ids[:, -1:].repeat(1, max(sizes))  # [1, n_max] any real token ids will do
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for i in range(warmup + repeats):
        for n in sizes:
            synchronize(device)
            start = time.perf_counter()
            lm.feed(new[:, :n])
            synchronize(device)
            if i >= warmup:
                times[n].append(time.perf_counter() - start)
            lm.discard_last(torch.tensor([n]))  # back to the context
    return {n: statistics.median(ts) for n, ts in times.items()}


def time_ngram_draft(context_ids: torch.Tensor, gamma: int, *, repeats: int = 50) -> float:
    """Median seconds per drafted token of the n-gram drafter (one lookup, divided by γ)."""
    from exactspec.drafters import NGramDrafter

    drafter, seq = NGramDrafter(), context_ids[0]
    times = []
    for _ in range(repeats + 5):
        start = time.perf_counter()
        drafter.lookup(seq, gamma)
        times.append(time.perf_counter() - start)
    return statistics.median(times[5:]) / gamma


def measure_timings(target, drafts: dict, context_ids: torch.Tensor, max_gamma: int,
                    log: Callable[[str], None] = lambda _m: None) -> dict:
    """The cost model's inputs, timed directly: the target's pass over n = 1..max_gamma+1 tokens
    and each draft's cost per token, on a cache of len(context_ids) tokens."""
    log(f"timing the target's forward pass on a {context_ids.size(1)}-token cache "
        f"(1..{max_gamma + 1} new tokens) ...")
    target_times = time_forward(target, context_ids, range(1, max_gamma + 2))
    out = {"context_tokens": int(context_ids.size(1)),
           "target": [{"tokens": n, "seconds": s} for n, s in sorted(target_times.items())],
           "drafts": {}}
    for spec, draft in drafts.items():
        if draft == NGRAM:
            seconds, how = time_ngram_draft(context_ids, 4), "one n-gram lookup (γ = 4) / 4"
        else:
            log(f"timing the draft {spec} ...")
            seconds, how = time_forward(draft, context_ids, [1])[1], "forward pass, 1 token"
        out["drafts"][spec] = {"seconds_per_token": seconds, "measured_as": how}
    return out


# --------------------------------------------------------------------------- aggregation


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def alpha_estimate(accepted: int, corrections: int) -> float | None:
    """α per verified position: accepted / (accepted + rejected), where each correction marks the
    one rejection that ends its round (the maximum-likelihood α of the cost model's constant,
    independent acceptance, whatever the proposal lengths)."""
    return _ratio(accepted, accepted + corrections) if accepted + corrections else None


def summarize(spec: RunSpec, kind: str, runs: list[list[RunResult]], config: BenchConfig,
              peer_settings: dict | None = None) -> dict:
    """One row from runs[pass][prompt] of one configuration on one prompt kind."""
    tokens = [sum(len(r.tokens) for r in pass_) for pass_ in runs]
    walls = [sum(r.wall_seconds for r in pass_) for pass_ in runs]
    rates = [t / w for t, w in zip(tokens, walls) if w > 0]
    tps = _median(rates)
    row = {
        "method": spec.method, "draft": spec.draft, "gamma": spec.gamma, "verify": spec.verify,
        "temperature": spec.temperature, "prompts": kind, "n_prompts": len(runs[0]),
        "output_tokens": tokens[0], "wall_seconds": _median(walls), "tokens_per_s": tps,
        "tokens_per_s_min": min(rates) if rates else None,
        "tokens_per_s_max": max(rates) if rates else None,
        "ms_per_token": 1e3 / tps if tps else None,
        "time_to_first_token": _median([r.time_to_first_token for p in runs for r in p]),
    }
    counters = ("accepted_drafts", "drafted_tokens", "corrections", "bonus_tokens", "rounds",
                "target_calls", "draft_calls")
    first = runs[0]  # the same seeds every pass: the counters repeat exactly
    if all(r.stats is not None for r in first):
        for name in counters:
            row[name] = sum(getattr(r.stats, name) for r in first)
        row["acceptance_rate"] = _ratio(row["accepted_drafts"], row["drafted_tokens"])
        row["alpha"] = alpha_estimate(row["accepted_drafts"], row["corrections"])
        row["tokens_per_round"] = _ratio(row["output_tokens"], row["rounds"])
        row["ms_per_round"] = _ratio(1e3 * row["wall_seconds"], row["rounds"])
    else:
        for name in (*counters, "acceptance_rate", "alpha", "tokens_per_round", "ms_per_round"):
            row[name] = None
    row["speedup_vs_autoregressive"] = None
    row["speedup_vs_hf_generate"] = None
    row["matches_autoregressive"] = None
    row["peer_settings"] = peer_settings
    return row


def add_speedups(rows: list[dict]) -> None:
    """speedup_vs_autoregressive and speedup_vs_hf_generate: tokens/s over that row's, for the
    same temperature and prompt kind."""
    base = {(r["method"], r["temperature"], r["prompts"]): r["tokens_per_s"] for r in rows
            if r["method"] in ("autoregressive", "hf_generate")}
    for r in rows:
        key = (r["temperature"], r["prompts"])
        r["speedup_vs_autoregressive"] = _ratio(r["tokens_per_s"], base.get(("autoregressive", *key)))
        r["speedup_vs_hf_generate"] = _ratio(r["tokens_per_s"], base.get(("hf_generate", *key)))


# --------------------------------------------------------------------------- cost model


def _target_seconds(timings: dict) -> dict[int, float]:
    return {item["tokens"]: item["seconds"] for item in timings["target"]}


def build_costmodel(rows: list[dict], timings: dict, curve_max_gamma: int) -> dict:
    """The seed's Figure 5 from measurements. For each (temperature, prompt kind, draft): α from
    the speculative rows (token verification where present, pooled over γ: the cost model's E[N]
    is the token rule's), c = t_draft / t_target(1), and for γ = 1..curve_max_gamma the predicted
    speedup `costmodel.speedup_measured(α, γ, t_target(1), t_target(γ+1), t_draft)` beside the
    measured speedups (token and block verification) where γ was benchmarked."""
    t_target = _target_seconds(timings)
    t_1 = t_target[1]
    curves = []
    groups = {}
    for r in rows:
        if r["method"] == "speculative":
            groups.setdefault((r["temperature"], r["prompts"], r["draft"]), []).append(r)
    for (temperature, kind, draft), group in groups.items():
        source = "token" if any(r["verify"] == "token" for r in group) else "block"
        used = [r for r in group if r["verify"] == source]
        accepted = sum(r["accepted_drafts"] for r in used)
        corrections = sum(r["corrections"] for r in used)
        alpha = alpha_estimate(accepted, corrections)
        t_draft = timings["drafts"][draft]["seconds_per_token"]
        measured = {(r["gamma"], r["verify"]): r for r in group}
        points = []
        for gamma in range(1, curve_max_gamma + 1):
            if gamma + 1 not in t_target:
                break
            point = {"gamma": gamma, "expected_tokens": None, "predicted_speedup": None,
                     "predicted_ms_per_round": 1e3 * (gamma * t_draft + t_target[gamma + 1])}
            if alpha is not None:
                point["expected_tokens"] = costmodel.expected_tokens(alpha, gamma)
                point["predicted_speedup"] = costmodel.speedup_measured(
                    alpha, gamma, t_1, t_target[gamma + 1], t_draft)
            for verify in VERIFY_METHODS:
                r = measured.get((gamma, verify))
                point[f"measured_speedup_{verify}"] = r["speedup_vs_autoregressive"] if r else None
                point[f"measured_tokens_per_round_{verify}"] = r["tokens_per_round"] if r else None
                point[f"measured_ms_per_round_{verify}"] = r["ms_per_round"] if r else None
                point[f"measured_over_predicted_{verify}"] = _ratio(
                    point[f"measured_speedup_{verify}"], point["predicted_speedup"])
            points.append(point)
        scored = [p for p in points if p["predicted_speedup"] is not None]
        best = max(scored, key=lambda p: (p["predicted_speedup"], -p["gamma"])) if scored else None
        curves.append({
            "temperature": temperature, "prompts": kind, "draft": draft, "alpha": alpha,
            "alpha_from": source, "verified_positions": accepted + corrections,
            "t_target_1": t_1, "t_draft": t_draft, "c": t_draft / t_1,
            "best_gamma": best["gamma"] if best else None,
            "best_predicted_speedup": best["predicted_speedup"] if best else None,
            "points": points,
        })
    return {"timings": timings, "curves": curves}


# --------------------------------------------------------------------------- machine


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: torch.device) -> dict:
    import transformers

    info = {
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "cpu_cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_model(),
        "load_average_start": _load_average(),
        "exactspec_git": _git_state(),
    }
    return info


def _git_state() -> str | None:
    """The source tree's commit (with "+dirty" for uncommitted changes), when it is a git
    checkout: a benchmark is only comparable with runs of the same engine."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=5)
        if commit.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--",
                                "src/exactspec"], capture_output=True, text=True, timeout=5)
        return commit.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


# --------------------------------------------------------------------------- the benchmark


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_benchmark(config: BenchConfig, *, models: dict | None = None,
                  timings: dict | None = None, log: Callable[[str], None] | None = _stderr
                  ) -> dict:
    """Run the benchmark and return {config, machine, rows, costmodel, elapsed_seconds}.

    models: LoadedModels by spec, used instead of loading (tests); timings: the cost model's
    inputs, used instead of timing the models (tests). log: progress lines (None: silent).
    """
    from exactspec.models import check_compatible, load_model

    config.check()
    log = log or (lambda _m: None)
    started = time.perf_counter()
    if config.threads:
        torch.set_num_threads(config.threads)
    loaded: dict = dict(models or {})

    def get(spec: str):
        if spec not in loaded:
            t0 = time.perf_counter()
            loaded[spec] = load_model(spec, device=config.device)
            log(f"loaded {spec} in {time.perf_counter() - t0:.1f} s")
        return loaded[spec]

    target = get(config.target)
    drafts = {}
    for spec in config.drafts:
        if spec == NGRAM:
            drafts[spec] = NGRAM
        else:
            drafts[spec] = get(spec)
            check_compatible(target, drafts[spec])
    runner = Runner(target, drafts, config)
    machine = machine_info(runner.device)
    prompt_ids = [encode_prompt(target, p.text) for p in config.prompts]
    kinds = list(dict.fromkeys(p.kind for p in config.prompts))
    specs = plan(config)

    # warm-up: every configuration, untimed, on the first prompt
    warm_tokens = min(config.max_new_tokens, WARMUP_TOKENS)
    for i in range(config.warmup):
        log(f"warm-up {i + 1}/{config.warmup}: {len(specs)} configurations, "
            f"{warm_tokens} tokens each ...")
        for spec in specs:
            runner.run(spec, prompt_ids[0], config.seed, warm_tokens)

    # timed passes, configurations interleaved: results[spec][pass][prompt]
    results: dict[RunSpec, list[list[RunResult]]] = {spec: [] for spec in specs}
    for rep in range(config.repeats):
        pass_start = time.perf_counter()
        for n, spec in enumerate(specs, start=1):
            runs = [runner.run(spec, ids, config.seed + i, config.max_new_tokens)
                    for i, ids in enumerate(prompt_ids)]
            results[spec].append(runs)
            tokens, wall = sum(len(r.tokens) for r in runs), sum(r.wall_seconds for r in runs)
            log(f"[pass {rep + 1}/{config.repeats}, {n}/{len(specs)}] {spec.label}: "
                f"{tokens / wall:.1f} tokens/s ({wall:.1f} s)")
        log(f"pass {rep + 1}/{config.repeats} took {time.perf_counter() - pass_start:.0f} s")

    rows = []
    for spec in specs:
        for kind in kinds:
            index = [i for i, p in enumerate(config.prompts) if p.kind == kind]
            runs = [[pass_[i] for i in index] for pass_ in results[spec]]
            row = summarize(spec, kind, runs, config, runner.peer_settings(spec))
            if spec.temperature == 0:
                reference = results[RunSpec("autoregressive", spec.temperature)][0]
                row["matches_autoregressive"] = all(
                    pass_[i].tokens == reference[i].tokens for pass_ in results[spec] for i in index)
            rows.append(row)
    add_speedups(rows)

    curve_max = max(CURVE_MIN_GAMMA, max(config.gammas))
    if timings is None:
        context = int(statistics.median(ids.size(1) for ids in prompt_ids)) \
            + config.max_new_tokens // 2
        context_ids = _context_ids(prompt_ids, context)
        timings = measure_timings(target, drafts, context_ids, curve_max, log)
    machine["load_average_end"] = _load_average()
    return {
        "config": config.to_dict(),
        "machine": machine,
        "rows": rows,
        "costmodel": build_costmodel(rows, timings, curve_max),
        "elapsed_seconds": time.perf_counter() - started,
    }


def _context_ids(prompt_ids: list[torch.Tensor], length: int) -> torch.Tensor:
    """A [1, length] context made of the prompts' tokens (repeated as needed)."""
    pool = torch.cat([ids[0] for ids in prompt_ids])
    reps = -(-length // pool.numel())
    return pool.repeat(reps)[:length].view(1, -1)


# --------------------------------------------------------------------------- output


def write_json(result: dict, path: str | os.PathLike) -> None:
    """Write the result as JSON, atomically (a temporary file renamed into place)."""
    _atomic_write(path, lambda tmp: tmp.write_text(json.dumps(result, indent=2) + "\n"))


def _atomic_write(path, write: Callable[[Path], None]) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def plot_costmodel(result: dict, path: str | os.PathLike) -> None:
    """Predicted speedup curves (lines) and measured speedups (markers: ● token, ✕ block) per γ,
    one panel per (temperature, prompt kind), one colour per draft. Written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = result["costmodel"]["curves"]
    panels = list(dict.fromkeys((c["temperature"], c["prompts"]) for c in curves))
    if not panels:
        raise ValueError("--plot: no speculative rows to plot")
    drafts = list(dict.fromkeys(c["draft"] for c in curves))
    colours = dict(zip(drafts, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4))
    cols = len({k for _, k in panels})
    rows_n = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.8 * cols, 3.6 * rows_n), squeeze=False)
    for ax, (temperature, kind) in zip(axes.flat, panels):
        for c in (c for c in curves if (c["temperature"], c["prompts"]) == (temperature, kind)):
            pts = c["points"]
            colour = colours[c["draft"]]
            alpha = f"α={c['alpha']:.2f}" if c["alpha"] is not None else "α=?"
            ax.plot([p["gamma"] for p in pts], [p["predicted_speedup"] for p in pts], "-",
                    color=colour, label=f"{c['draft']} ({alpha}, c={c['c']:.2f})")
            for verify, marker in (("token", "o"), ("block", "x")):
                meas = [(p["gamma"], p[f"measured_speedup_{verify}"]) for p in pts
                        if p[f"measured_speedup_{verify}"] is not None]
                if meas:
                    ax.plot(*zip(*meas), marker, color=colour, markersize=7, linestyle="none")
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
        ax.set_title(f"T = {temperature:g}, {kind} prompts")
        ax.set_xlabel("γ (draft tokens per round)")
        ax.set_ylabel("speedup over autoregressive")
        ax.legend(fontsize=7, title="line: predicted; ● token, ✕ block: measured",
                  title_fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(f"Measured cost model: {result['config']['target']} on "
                 f"{result['machine']['device_name']}", fontsize=9)
    fig.tight_layout()
    _atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)
