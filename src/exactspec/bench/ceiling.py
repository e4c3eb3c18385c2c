"""The machine's ceiling and the oracle row.

- The ceiling (`measured_ceiling`): from the target's pass times T(1..K) that the cost model
  measures already (`exactspec.bench.timing.measure_timings`, K = `ceiling_gamma` + 1), max
  over k of k · T(1) / T(k) (`costmodel.ceiling`): the speedup over plain decoding
  of a round that keeps every draft at no draft cost, the most any draft can give here.
- share_of_ceiling (`add_shares`): each row's speedup over exactspec's plain decoding (the ×AR
  column) divided by the ceiling.
- The oracle row (`ORACLE`, `oracle_specs`): `OracleDrafter` proposing each prompt's greedy
  continuation (`reference_continuations`, one untimed plain greedy generation per prompt), at
  γ = k* − 1 (a pass over the ceiling's k tokens), through the real engine, at T = 0: every
  draft is kept, and its speed is the best this engine reaches on this machine.
- The lookup oracle row (`LOOKUP_ORACLE`): `LookupOracleDrafter`, prompt lookup's proposals cut
  to the drafts the target keeps (the same references), at the pass size that costs least per
  token: each round's γ is the best any policy could choose for that proposal, so the row reads
  the most prompt lookup can give here. Between it and the oracle lies what better drafts could
  add; between the lookup rows and it, what a better γ could.
"""
from __future__ import annotations

from typing import Callable

from exactspec import costmodel
from exactspec.bench.config import AUTO, BenchConfig, RunSpec
from exactspec.controller import AUTO_MAX_GAMMA, MAX_GAMMA
from exactspec.drafters.oracle import LOOKUP_ORACLE, ORACLE, LookupOracleDrafter, OracleDrafter

ORACLE_LABEL = "oracle (target's own greedy tokens)"
LOOKUP_ORACLE_LABEL = "lookup oracle (prompt lookup cut to the drafts kept)"


def ceiling_gamma(gammas, curve_max: int) -> int:
    """The longest block the timings cover: AUTO_MAX_GAMMA where γ = auto runs (its controller
    may choose any block up to it, and on a CPU a long pass can cost less than a shorter one: on the
    Qwen 1.5B through llama.cpp T(16) < T(12)), else the curves' `curve_max`."""
    return AUTO_MAX_GAMMA if AUTO in gammas else curve_max


def measured_ceiling(timings: dict) -> dict:
    """{k, speedup, t_1_seconds, t_k_seconds, context_tokens, passes} from the cost model's
    timings (`timings["target"]`: [{tokens, seconds}] for 1..K, checked to be exactly those)."""
    passes = sorted(timings["target"], key=lambda item: item["tokens"])
    sizes = [item["tokens"] for item in passes]
    if sizes != list(range(1, len(sizes) + 1)):
        raise ValueError(f"the target's pass times must be for 1..K tokens, got {sizes}")
    k, speedup = costmodel.ceiling([item["seconds"] for item in passes])
    return {"k": k, "speedup": speedup, "t_1_seconds": passes[0]["seconds"],
            "t_k_seconds": passes[k - 1]["seconds"], "context_tokens": timings.get("context_tokens"),
            "passes": passes}


def oracle_gamma(ceiling: dict) -> int:
    """The oracle row's γ: k* − 1 drafts make a pass over k* tokens (at least 1)."""
    return max(1, min(MAX_GAMMA, ceiling["k"] - 1))


def oracle_specs(config: BenchConfig, ceiling: dict) -> list[RunSpec]:
    """The oracle rows at T = 0 (when the bench runs them), with the first verification rule
    benchmarked: at T > 0 the sampled text leaves the greedy tokens, and the rows would say
    little. The oracle's γ is `oracle_gamma`; the lookup oracle's, the longest block timed (it
    chooses shorter ones itself)."""
    lookup_gamma = max(1, len(ceiling["passes"]) - 1)
    return [RunSpec("speculative", t, draft, gamma, config.verify[0])
            for t in config.temperatures if t == 0
            for draft, gamma in ((ORACLE, oracle_gamma(ceiling)), (LOOKUP_ORACLE, lookup_gamma))]


def oracle_drafters(references: dict, ceiling: dict) -> dict:
    """The oracle rows' drafters by draft name, on plain greedy decoding's `references`."""
    return {ORACLE: OracleDrafter(references),
            LOOKUP_ORACLE: LookupOracleDrafter(references,
                                               [p["seconds"] for p in ceiling["passes"]])}


def reference_continuations(runner, prompt_ids: list, config: BenchConfig,
                            log: Callable[[str], None]) -> dict[tuple[int, ...], list[int]]:
    """prompt token ids → plain greedy decoding's `max_new_tokens` tokens after it (untimed; a
    constrained prompt's under its constraint)."""
    log(f"the oracle's references: plain greedy decoding of {len(prompt_ids)} prompts ...")
    references = {}
    for ids, prompt in zip(prompt_ids, config.prompts):
        run = runner.run(RunSpec("autoregressive", 0.0), ids, config.seed, config.max_new_tokens,
                         prompt.constraint)
        references[tuple(ids[0].tolist())] = run.tokens
    return references


def add_shares(rows: list[dict], ceiling: dict | None) -> None:
    """share_of_ceiling: a row's speedup over exactspec's plain decoding / the ceiling."""
    for row in rows:
        speedup = row.get("speedup_vs_autoregressive")
        row["share_of_ceiling"] = (speedup / ceiling["speedup"]
                                   if speedup is not None and ceiling else None)
