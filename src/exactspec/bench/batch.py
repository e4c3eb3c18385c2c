"""Batch throughput: total output tokens/s of plain and speculative decoding at several batch
sizes (`exactspec bench --batch-sizes 1,4,8`).

A batch of B rows takes the built-in (or given) prompts in turn, left-padded; every run of one
(batch size, temperature) uses the same seed, and reports the median over `repeats` after
`warmup` untimed runs. γ may be "auto" (one γ per round for the whole batch) and the drafts
include the auto draft, as in the single-row benchmark (`run.load_models`). Besides tokens/s and
``rounds_by_source`` (rounds per way of drafting, "plain" for rounds without drafts) each
speculative row reports what batching costs that a single row would not pay:

- ``padding_fed``: slots run through either model that were padding (a row catching up one
  token while another catches up two), as a fraction of all slots fed;
- ``hole_fraction``: the mean share of the target's cache columns that are holes after a round
  (drafts one row rejected while another kept its, plus left padding): attention over them is
  wasted, the forward passes themselves are not.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from exactspec.bench.config import BenchConfig
from exactspec.bench.machine import machine_info
from exactspec.bench.report import ordered_sources
from exactspec.bench.run import load_models
from exactspec.engine import autoregressive_generate, pad_prompts, speculative_generate
from exactspec.models import encode_prompt


def batch_inputs(prompt_ids: list[torch.Tensor], batch_size: int):
    """input_ids[B, L] and attention_mask[B, L]: prompts taken in turn, left-padded."""
    return pad_prompts([prompt_ids[i % len(prompt_ids)][0] for i in range(batch_size)])


def _timed(generate: Callable, repeats: int, warmup: int) -> tuple[float, object]:
    """Median tokens/s over `repeats` runs after `warmup`, and the last run's output."""
    for _ in range(warmup):
        generate()
    rates, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = generate()
        rates.append(out.stats.output_tokens / (time.perf_counter() - start))
    return statistics.median(rates), out


def batch_throughput(target, drafts: dict, config: BenchConfig, batch_sizes: list[int],
                     log: Callable[[str], None] = lambda _m: None) -> list[dict]:
    """One row per (batch size, temperature, method, draft, γ, verify): total output tokens/s and
    its ratio to plain decoding at the same batch size. drafts: as `run.load_models` makes them."""
    prompt_ids = [encode_prompt(target, p.text, reply_start=p.reply_start, history=p.history)
                  for p in config.prompts]
    rows = []
    for batch_size in batch_sizes:
        ids, mask = batch_inputs(prompt_ids, batch_size)
        for temperature in config.temperatures:
            common = dict(attention_mask=mask, max_new_tokens=config.max_new_tokens,
                          temperature=temperature, top_k=config.top_k, top_p=config.top_p,
                          seed=config.seed, eos_token_id=[])
            log(f"batch {batch_size}, T = {temperature:g}: autoregressive ...")
            plain, _ = _timed(lambda: autoregressive_generate(target, ids, **common),
                              config.repeats, config.warmup)
            base = {"batch_size": batch_size, "temperature": temperature}
            rows.append({**base, "method": "autoregressive", "draft": None, "gamma": None,
                         "verify": None, "tokens_per_s": plain, "speedup": 1.0})
            for spec, draft in drafts.items():
                for gamma in config.gammas:
                    for verify in config.verify:
                        log(f"batch {batch_size}, T = {temperature:g}: {spec} γ = {gamma} "
                            f"{verify} ...")
                        rate, out = _timed(
                            lambda: speculative_generate(target, draft, ids, gamma=gamma,
                                                         verify=verify, **common),
                            config.repeats, config.warmup)
                        rows.append({**base, "method": "speculative", "draft": spec,
                                     "gamma": gamma, "verify": verify, "tokens_per_s": rate,
                                     "speedup": rate / plain,
                                     "acceptance_rate": out.stats.acceptance_rate,
                                     "tokens_per_round": statistics.fmean(
                                         s.tokens_per_round for s in out.row_stats),
                                     "padding_fed": out.stats.padding_fed
                                     / (out.stats.target_tokens_fed + out.stats.draft_tokens_fed
                                        + out.stats.padding_fed),
                                     "hole_fraction": out.stats.hole_fraction,
                                     "rounds_by_source": ordered_sources(out.rounds_by_source)})
    return rows


def run_batch_benchmark(config: BenchConfig, batch_sizes: list[int],
                        log: Callable[[str], None] = lambda _m: None) -> dict:
    """Load the models of `config` and measure `batch_throughput`: {config, machine, batch}."""
    from exactspec.bench.mix import with_first_replies

    target, drafts = load_models(config)
    log(f"loaded {target.spec} and {len(drafts)} draft(s)")
    config = with_first_replies(config, target, log)
    rows = batch_throughput(target, drafts, config, batch_sizes, log)
    return {"config": {**config.to_dict(), "batch_sizes": batch_sizes},
            "machine": machine_info(target.device), "batch": rows}
