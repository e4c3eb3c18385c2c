"""What a benchmark runs: its settings, the built-in prompts, and the configurations they expand to.

A **configuration** is one (method, draft, γ, verify, temperature). The **methods** are the
decoding methods compared:

- ``autoregressive``: exactspec's plain decoding of the target;
- ``speculative``: exactspec's speculative decoding, for each draft, γ and verification rule;
  γ is an integer or "auto" (chosen each round by the engine's `GammaController`);
- ``hf_generate``: the target's own ``model.generate()``;
- ``hf_assisted``: ``model.generate(assistant_model=draft)`` for a model draft (each integer γ
  fixed with the "constant" schedule, plus one row with Transformers' default settings,
  γ = "default"), and ``model.generate(prompt_lookup_num_tokens=γ)`` for the n-gram draft, at
  γ in `HF_LOOKUP_GAMMAS` and every integer γ benchmarked (``hf_gammas``, when set, replaces
  the integer γ benchmarked in both). The auto draft has no peer;
- with ``llama_peers``, on the target's own GGUF file (`exactspec.bench.llama_peers`):
  ``llamacpp``, llama.cpp's plain decoding through llama-cpp-python, and ``llama_server``,
  llama.cpp's own server, plain and speculating (`LLAMA_SERVER_SPECS`).

A **workload** (``workload``, e.g. "humaneval:20") replaces the prompts with a public task's
and adds each row's pass@1 (`exactspec.bench.humaneval`); "mix:N" is N prompts of each of nine
categories (`exactspec.bench.mix`), each category a prompt kind, so rows are per category.

The **drafts** are model specs, "llamacpp" / "llamacpp:PATH" (a GGUF run by llama.cpp; plain
"llamacpp" is the target's own file), "string:SPEC" / "tli:SPEC" (the model draft SPEC, of
another vocabulary, as string-level drafts or through the token-level intersection; named alone,
such a draft drafts as "string:SPEC"), "ngram" (prompt lookup) and "auto" / "auto:SPEC": prompt
lookup when the context repeats, else the model draft SPEC (for "auto", the target's default
model draft, `auto_model_spec`).

``verify`` is the verification rule of a speculative configuration: "block" or "token".
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from exactspec.bench.llama_peers import NGRAM_TYPES as LLAMA_NGRAM_TYPES
from exactspec.controller import AUTO, MAX_GAMMA
from exactspec.drafters import is_llamacpp_spec, other_vocabulary_method
from exactspec.models import BUNDLED_MODEL
from exactspec.models.packaged import PAIR_DRAFT, PAIR_TARGET

METHODS = ("autoregressive", "speculative", "hf_generate", "hf_assisted", "llamacpp", "llama_server")
LLAMA_METHODS = ("llamacpp", "llama_server")
NGRAM_MOD = "ngram-mod"  # llama-server's own n-gram drafts (bench.llama_peers.NGRAM_TYPES)
VERIFY_ORDER = ("block", "token", "coupled")  # the verification rules, in the order rows list them
DEFAULT_VERIFY = ("block", "token")
NGRAM = "ngram"
DEFAULT_TARGET = BUNDLED_MODEL
DEFAULT_GAMMAS = (4, AUTO)
HF_LOOKUP_GAMMAS = (4, 10)  # Transformers' prompt lookup: γ = 10 is the value its docs use
DEFAULT_TEMPERATURES = (0.0, 0.8)
DEFAULT_MAX_NEW_TOKENS = 32
DEFAULT_REPEATS = 3
DEFAULT_WARMUP = 1
DEFAULT_SEED = 0
CURVE_MIN_GAMMA = 8  # the predicted curves run over γ = 1..max(8, largest γ benchmarked)
WARMUP_TOKENS = 16  # a warm-up generation is this long (or max_new_tokens, if shorter)


# --------------------------------------------------------------------------- prompts


@dataclass(frozen=True)
class BenchPrompt:
    """One prompt: `kind` groups prompts into rows ("open", "grounded", "humaneval", or a file's
    own kinds). reply_start: text the assistant's reply begins with (after the chat template);
    history: earlier turns, (role, content) pairs before the user turn `text` (the mix's chat-2;
    ending with a user turn until the bench answers it, `bench.mix.answer_first_turns`);
    problem: a workload's problem, for its functional check (`bench.humaneval`); constraint:
    what the reply must match (`exactspec.constraints`; the json workload's schemas)."""

    name: str
    kind: str
    text: str
    reply_start: str = ""
    history: tuple[tuple[str, str], ...] = ()
    problem: dict | None = field(default=None, compare=False, hash=False, repr=False)
    constraint: object = field(default=None, compare=False, hash=False, repr=False)


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


# --------------------------------------------------------------------------- drafts and γ


def default_drafts() -> tuple[str, ...]:
    """The bundled target's bfloat16 copy, its own GGUF through llama.cpp (when the llamacpp extra
    is installed), prompt lookup and the auto draft."""
    from exactspec.drafters import LLAMACPP, llamacpp_available

    llama = (LLAMACPP,) if llamacpp_available() else ()
    return (f"{BUNDLED_MODEL}@bfloat16", *llama, NGRAM, AUTO)


def is_auto_draft(draft: str | None) -> bool:
    """Whether a draft spec names the auto draft: "auto" or "auto:SPEC"."""
    return isinstance(draft, str) and (draft == AUTO or draft.startswith(f"{AUTO}:"))


def auto_model_spec(draft: str, target: str) -> str:
    """The model draft of an auto draft: SPEC for "auto:SPEC", else the target's default model
    draft: "llamacpp" (its own GGUF through llama.cpp) for a target loaded from a GGUF file (the
    bundled model is) when the llamacpp extra is installed, otherwise its bfloat16 copy (the
    target's name with "@bfloat16", whatever dtype the target spec names)."""
    from exactspec.drafters import default_model_spec

    spec = draft[len(AUTO) + 1:] if draft.startswith(f"{AUTO}:") else ""
    return spec or default_model_spec(target)


def pair_settings(backend: str = "torch") -> dict:
    """`bench --pair`: the real pair (Qwen2.5-Coder 1.5B target, its 0.5B sibling as draft) on
    HumanEval with every peer: the 0.5B through llama.cpp, in PyTorch (float32), prompt lookup
    and the auto draft (lookup, else the llama.cpp 0.5B), each at γ = auto with the block rule;
    Transformers' assisted generation at γ = 4 and its default schedule, its lookup at 4 and 10;
    llama.cpp plain and its server's speculation. backend "llamacpp": the 1.5B target run by
    llama.cpp (prompt lookup, auto, the llama.cpp 0.5B) beside llama.cpp's own rows (no
    Transformers rows: they cannot run a llama.cpp target)."""
    llama = f"llamacpp:{PAIR_DRAFT}"
    if backend == "llamacpp":  # the 1.5B run by llama.cpp: exactspec's rows beside llama.cpp's own
        return dict(target=f"llamacpp:{PAIR_TARGET}", drafts=[NGRAM, f"{AUTO}:{llama}", llama],
                    gammas=[AUTO], verify=["block"], hf_gammas=None, llama_peers=True, peers=False)
    return dict(target=PAIR_TARGET, drafts=[llama, PAIR_DRAFT, NGRAM, f"{AUTO}:{llama}"],
                gammas=[AUTO], verify=["block"], hf_gammas=[4], llama_peers=True)


def fixed_gammas(gammas) -> list[int]:
    """The integer γ of a list that may also hold "auto"."""
    return [g for g in gammas if g != AUTO]


def _is_gamma(gamma) -> bool:
    if gamma == AUTO:
        return True
    return isinstance(gamma, int) and not isinstance(gamma, bool) and 1 <= gamma <= MAX_GAMMA


# --------------------------------------------------------------------------- lists as text


def parse_gammas(text: str, name: str = "gammas") -> list[int | str]:
    """"8,auto,1,2,4" → [1, 2, 4, 8, "auto"] (integers sorted, without duplicates, then "auto"
    when given); a ValueError naming `name` (the parameter, or the option that carried it)."""
    items = [item.strip() for item in str(text).split(",")]
    if not all(items):
        raise ValueError(f"{name} must be a comma-separated list of integers in "
                         f"[1, {MAX_GAMMA}] and/or auto, e.g. 1,2,4,8,auto; got {text!r}")
    gammas = []
    for item in items:
        try:
            gamma = AUTO if item.lower() == AUTO else int(item)
        except ValueError:
            gamma = None
        if not _is_gamma(gamma):
            raise ValueError(f"{name}: each γ must be an integer in [1, {MAX_GAMMA}] or "
                             f"'{AUTO}', got {item!r} in {text!r}")
        gammas.append(gamma)
    return sorted(set(fixed_gammas(gammas))) + ([AUTO] if AUTO in gammas else [])


def parse_verify(text: str, name: str = "verify") -> list[str]:
    """"token,block" → ["block", "token"] in table order; a ValueError naming `name`."""
    items = {item.strip() for item in str(text).split(",")}
    if not items or not items <= set(VERIFY_ORDER):
        raise ValueError(f"{name} must be a comma-separated subset of "
                         f"{','.join(VERIFY_ORDER)}, got {text!r}")
    return [rule for rule in VERIFY_ORDER if rule in items]


# --------------------------------------------------------------------------- configuration


@dataclass
class BenchConfig:
    """What to run. Checked by `check()`; every list is non-empty."""

    target: str = DEFAULT_TARGET
    drafts: list[str] = field(default_factory=lambda: list(default_drafts()))
    gammas: list[int | str] = field(default_factory=lambda: list(DEFAULT_GAMMAS))
    temperatures: list[float] = field(default_factory=lambda: list(DEFAULT_TEMPERATURES))
    verify: list[str] = field(default_factory=lambda: list(DEFAULT_VERIFY))
    prompts: list[BenchPrompt] = field(default_factory=lambda: list(BUILTIN_PROMPTS))
    prompts_source: str = "built-in"
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    repeats: int = DEFAULT_REPEATS
    warmup: int = DEFAULT_WARMUP
    peers: bool = True
    seed: int = DEFAULT_SEED
    seeds: int = 1  # seeds per prompt: at T > 0 each seed samples another text
    top_k: int | None = None
    top_p: float | None = None
    device: str | None = None
    threads: int | None = None
    hf_gammas: list[int] | None = None  # Transformers' fixed γ, when not the integer γ benchmarked
    llama_peers: bool = False  # also llama.cpp plain and llama-server on the target's GGUF
    workload: str | None = None  # "humaneval[:N]": the prompts are its problems, rows get pass@1
    background_load: int = 0  # busy processes beside the whole run (`exactspec.bench.load`)
    oracle: bool = False  # also the oracle row: each prompt's greedy tokens as drafts (`bench.ceiling`)

    def check(self) -> "BenchConfig":
        """Raise a ValueError naming the first bad field and its value; return self."""
        if not self.drafts:
            raise ValueError("drafts needs at least one draft (a model spec, 'ngram' or 'auto')")
        if not self.gammas or not all(_is_gamma(g) for g in self.gammas):
            raise ValueError(f"gammas must be integers in [1, {MAX_GAMMA}] or '{AUTO}', "
                             f"got {self.gammas}")
        if not self.temperatures or any(not (math.isfinite(t) and t >= 0)
                                        for t in self.temperatures):
            raise ValueError(f"temperatures must be finite numbers >= 0, "
                             f"got {self.temperatures}")
        if not self.verify or not set(self.verify) <= set(VERIFY_ORDER):
            raise ValueError(f"verify must be a subset of {VERIFY_ORDER}, got {self.verify}")
        if not self.prompts:
            raise ValueError("prompts is empty")
        if self.peers and self.target.strip().lower().startswith("llamacpp:"):
            raise ValueError(f"peers: Transformers' rows cannot run the llama.cpp target "
                             f"{self.target!r}; turn peers off")
        if any(p.constraint for p in self.prompts) and self.peers:
            raise ValueError("constrained prompts (the json workload) run exactspec's and "
                             "llama.cpp's rows only: peers must be off")
        for name, value, low in (("max_new_tokens", self.max_new_tokens, 1),
                                 ("repeats", self.repeats, 1), ("warmup", self.warmup, 0),
                                 ("seed", self.seed, 0), ("seeds", self.seeds, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        from exactspec.bench.load import check_load

        check_load(self.background_load)
        if self.hf_gammas is not None and not all(_is_gamma(g) and g != AUTO for g in self.hf_gammas):
            raise ValueError(f"hf_gammas must be integers in [1, {MAX_GAMMA}], got {self.hf_gammas}")
        return self

    def jobs(self) -> list[tuple[int, int]]:
        """(prompt index, seed) of each generation in a pass: prompt i with seeds seed + i,
        seed + i + P, ... (P prompts), `seeds` of them; every configuration runs the same jobs."""
        n = len(self.prompts)
        return [(i, self.seed + i + n * j) for j in range(self.seeds) for i in range(n)]

    def to_dict(self) -> dict:
        out = asdict(self)
        out["prompts"] = [{**{k: v for k, v in asdict(p).items() if k not in ("problem", "constraint")},
                           "history": [list(turn) for turn in p.history],  # as JSON reads it back
                           **({"schema": p.constraint.schema()} if p.constraint else {})}
                          for p in self.prompts]
        return out


@dataclass(frozen=True)
class RunSpec:
    """One configuration. gamma: an int, "auto" (exactspec's γ controller), "default"
    (Transformers' own assistant settings) or None (no draft)."""

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


def peer_gammas(draft: str, gammas) -> list[int | str]:
    """The γ of a draft's hf_assisted rows: for "ngram", `HF_LOOKUP_GAMMAS` and every integer γ
    of `gammas` (the config's hf_gammas, else its γ); for a model draft, every integer γ, then
    "default"; none for an auto or a llama.cpp draft, nor for "string:SPEC" / "tli:SPEC"
    (Transformers' rows for a draft of another vocabulary come with the spec SPEC)."""
    if is_auto_draft(draft) or other_vocabulary_method(draft):
        return []
    if draft == NGRAM:
        return sorted(set(HF_LOOKUP_GAMMAS) | set(fixed_gammas(gammas)))
    if is_llamacpp_spec(draft):  # Transformers cannot run a llama.cpp model
        return []
    return [*fixed_gammas(gammas), "default"]


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
                hf = config.gammas if config.hf_gammas is None else config.hf_gammas
                specs += [RunSpec("hf_assisted", temperature, draft, gamma)
                          for gamma in peer_gammas(draft, hf)]
        if config.llama_peers:
            specs += llama_specs(config, temperature)
    return specs


LLAMA_SERVER_GAMMAS = (3, 8, 16)  # --spec-draft-n-max of the draft-simple rows


def llama_specs(config: BenchConfig, temperature: float) -> list[RunSpec]:
    """llama.cpp's rows: plain (llama-cpp-python, and its server), and the server speculating
    with the first llama.cpp model draft benchmarked at n-max `LLAMA_SERVER_GAMMAS`, with its
    n-gram drafts ("ngram-mod", "ngram-simple", "ngram-cache"), and with the model draft and
    ngram-mod both (n-max 16)."""
    specs = [RunSpec("llamacpp", temperature), RunSpec("llama_server", temperature)]
    model = next((d for d in config.drafts if is_llamacpp_spec(d) and ":" in d), None)
    if model is not None:
        specs += [RunSpec("llama_server", temperature, model, n) for n in LLAMA_SERVER_GAMMAS]
    specs += [RunSpec("llama_server", temperature, kind) for kind in LLAMA_NGRAM_TYPES]
    if model is not None:
        specs.append(RunSpec("llama_server", temperature, f"{model}+{NGRAM_MOD}", 16))
    return specs
