"""The benchmark: exactspec's plain and speculative decoding side by side with Transformers' own
generation, on the same models, prompts, sampling settings and seeds.

How it measures (warm up every path, synchronize the accelerator around each timed call, count
accepted drafts separately from output tokens):

- the warm-up pass runs every configuration ``warmup`` times, untimed; then ``repeats`` timed
  passes each run every configuration on every prompt. Configurations are interleaved per
  prompt (one prompt under every configuration, then the next, the order reversed from one
  prompt to the next), so noise from other work on the machine, and the machine's speed as it
  drifts within a pass, spread over all of them alike;
- prompt i is always run with seed ``seed + i`` (and with ``--seeds N``, also ``seed + i + P``, ...,
  P prompts: at T > 0 a speedup depends on the text sampled, and one seed is one text): all runs
  of a configuration use the same seeds;
- one generation is measured as `exactspec.bench.runners` says; rows as `exactspec.bench.report`
  says, the measured cost model as `exactspec.bench.curves` says.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from exactspec.bench.config import (CURVE_MIN_GAMMA, LLAMA_METHODS, NGRAM, WARMUP_TOKENS,
                                    BenchConfig, RunSpec, auto_model_spec, fixed_gammas,
                                    is_auto_draft, plan)
from exactspec.bench.ceiling import (add_shares, ceiling_gamma, measured_ceiling, oracle_drafters,
                                     oracle_specs, reference_continuations)
from exactspec.bench.curves import build_costmodel
from exactspec.bench.machine import load_average, machine_info
from exactspec.bench.mix import with_first_replies
from exactspec.bench.report import add_pass_at_1, add_speedups, add_validity, summarize
from exactspec.bench.results import RunResult
from exactspec.bench.runners import Runner
from exactspec.bench.summary import build_summary
from exactspec.bench.timing import context_from_prompts, measure_timings
from exactspec.models import encode_prompt


def log_to_stderr(message: str) -> None:
    """Progress lines go to stderr (the tables go to stdout)."""
    print(message, file=sys.stderr, flush=True)


def _silent(_message: str) -> None:
    pass


def load_models(config: BenchConfig, models: dict | None = None,
                log: Callable[[str], None] = _silent) -> tuple[object, dict]:
    """Check `config`, set its torch threads, and return (target, drafts): LoadedModels, with each
    draft spec mapped to its LoadedModel, to "ngram", or for an auto draft to one `AutoDrafter`
    (reused by every run: the engine restarts it) whose model draft is `auto_model_spec`, and a
    llama.cpp draft or a "string:SPEC" / "tli:SPEC" draft to its drafter (restarted likewise);
    model drafts are checked against the target's vocabulary. models: LoadedModels by spec, used
    instead of loading; a spec named twice (an auto draft's model and the same model as a draft
    of its own) is loaded once."""
    from exactspec.drafters import (AutoDrafter, is_llamacpp_spec, make_drafter, model_drafter,
                                    other_vocabulary_drafter, other_vocabulary_method)
    from exactspec.drafters.llamacpp import LlamaCppDrafter
    from exactspec.models import load_model

    config.check()
    if config.threads:
        torch.set_num_threads(config.threads)
    loaded: dict = dict(models or {})

    def get(spec: str):
        if spec not in loaded:
            t0 = time.perf_counter()
            loaded[spec] = load_model(spec, device=config.device)
            log(f"loaded {spec} in {time.perf_counter() - t0:.1f} s")
        return loaded[spec]

    def model_draft(spec: str):
        if is_llamacpp_spec(spec) or other_vocabulary_method(spec):  # drafters the engine restarts
            drafter = (make_drafter(spec, target=target) if is_llamacpp_spec(spec)
                       else other_vocabulary_drafter(spec, target, load=get))
            drafter.bind(target, 1)
            inner = getattr(drafter, "inner", drafter)  # a vocabulary map's llama.cpp draft
            if config.threads and isinstance(inner, LlamaCppDrafter):
                inner.run_on(config.threads)  # --threads: a llama.cpp draft's decodes too
            return drafter, drafter
        model = get(spec)
        drafter = model_drafter(model, target)  # through the intersection if the vocabularies differ
        drafter.bind(target, 1)
        return model, drafter

    target = get(config.target)
    if config.threads and target.backend == "llamacpp":
        target.model.n_threads = config.threads  # --threads: the llama.cpp target's decodes too
    drafts = {}
    for spec in config.drafts:
        if spec == NGRAM:
            drafts[spec] = NGRAM
        elif is_auto_draft(spec):
            drafts[spec] = AutoDrafter(model_draft(auto_model_spec(spec, config.target))[1])
        else:
            drafts[spec] = model_draft(spec)[0]
    return target, drafts


def run_benchmark(config: BenchConfig, *, models: dict | None = None,
                  timings: dict | None = None, log: Callable[[str], None] | None = log_to_stderr,
                  trace: Callable[[dict], None] | None = None
                  ) -> dict:
    """Run the benchmark and return {config, machine, rows, summary, costmodel, ceiling,
    elapsed_seconds} (the ceiling and the oracle rows: `exactspec.bench.ceiling`).

    models: LoadedModels by spec, used instead of loading (tests); timings: the cost model's
    inputs, used instead of timing the models (tests). log: progress lines (None: silent).
    trace: called with each round's trace line (`engine.trace_line`) of exactspec's rows.
    """
    from exactspec.bench.load import BackgroundLoad

    log = log or _silent
    started = time.perf_counter()
    target, drafts = load_models(config, models, log)
    config = with_first_replies(config, target, log)  # the mix's chat-2: the target's own replies
    llama = llama_peers(config, target, log) if config.llama_peers else None
    try:
        with BackgroundLoad(config.background_load):
            if config.background_load:
                log(f"{config.background_load} busy process(es) run beside every row")
            return _run(config, target, drafts, llama, timings, log, started, trace)
    finally:
        if llama is not None:
            llama.close()


def llama_peers(config: BenchConfig, target, log: Callable[[str], None]):
    """The llama.cpp peers on the target's GGUF file (`exactspec.bench.llama_peers`); a
    ValueError when the target was not loaded from one."""
    from exactspec.bench.llama_peers import SERVER_HINT, LlamaPeers, find_llama_server
    from exactspec.drafters import is_llamacpp_spec
    from exactspec.drafters.llamacpp import gguf_file
    from exactspec.models.loading import named_gguf

    path = gguf_file(target)
    if path is None:
        raise ValueError(f"llama_peers: the target {config.target!r} was not loaded from a GGUF "
                         f"file, so llama.cpp has nothing to run")
    drafts = {}
    for spec in config.drafts:
        if is_llamacpp_spec(spec) and ":" in spec:
            where = spec.split(":", 1)[1]
            drafts[spec] = named_gguf(where) or Path(where).expanduser()
    server = find_llama_server()
    if server is None:
        log(SERVER_HINT)
    threads = llama_cpp_threads(target) or torch.get_num_threads()  # exactspec's target's
    return LlamaPeers(path, drafts, threads, config.top_k, config.top_p, server)


def llama_cpp_threads(target) -> int | None:
    """The thread count of a llama.cpp target's decodes ($EXACTSPEC_THREADS, --threads, else the
    usable cores), which its llama.cpp peers run on too; None for a torch target."""
    return target.model.n_threads if getattr(target, "backend", None) == "llamacpp" else None


def _order(specs: list, k: int) -> list:
    """The configurations in the order they run on a prompt, k being the pass plus the prompt's
    index: forward when k is even, else backward, so that no configuration always runs first
    after a change of prompt."""
    return specs if k % 2 == 0 else specs[::-1]


def _run(config, target, drafts, llama, timings, log, started, trace=None) -> dict:
    runner = Runner(target, drafts, config, llama, trace)
    machine = machine_info(runner.device)
    machine["llama_cpp_threads"] = llama_cpp_threads(target)
    prompt_ids = [encode_prompt(target, p.text, reply_start=p.reply_start, history=p.history)
                  for p in config.prompts]
    if config.oracle:  # before the timings: their references are plain greedy decoding, untimed
        references = reference_continuations(runner, prompt_ids, config, log)
    curve_max = max([CURVE_MIN_GAMMA, *fixed_gammas(config.gammas)])
    if timings is None:  # before the passes: the oracles' γ and pass times are the ceiling's
        context = int(statistics.median(ids.size(1) for ids in prompt_ids)) \
            + config.max_new_tokens // 2
        context_ids = context_from_prompts(prompt_ids, context)
        timings = measure_timings(target, drafts, context_ids,
                                  ceiling_gamma(config.gammas, curve_max), log)
    ceiling = measured_ceiling(timings)
    specs = plan(config)
    if config.oracle:
        runner.drafts.update(oracle_drafters(references, ceiling))
        specs += oracle_specs(config, ceiling)
    if llama is not None and llama.server is None:
        specs = [spec for spec in specs if spec.method != "llama_server"]
    _warm_up(runner, specs, prompt_ids, config, log)
    results = _timed_passes(runner, specs, prompt_ids, config, log)
    rows = _rows(runner, specs, results, config)
    add_speedups(rows)
    add_shares(rows, ceiling)
    if any(p.problem for p in config.prompts):
        log("checking completions against their problems' tests ...")
        add_pass_at_1(rows, results, config, target.tokenizer)
    if any(p.constraint for p in config.prompts):
        add_validity(rows, results, config, target.tokenizer)
    machine["load_average_end"] = load_average()
    return {
        "config": config.to_dict(),
        "machine": machine,
        "rows": rows,
        "summary": build_summary(rows),
        "costmodel": build_costmodel(rows, timings, curve_max),
        "ceiling": ceiling,
        "elapsed_seconds": time.perf_counter() - started,
    }


def _warm_up(runner: Runner, specs: list, prompt_ids: list, config: BenchConfig, log) -> None:
    """Every configuration, untimed, on the first prompt, `config.warmup` times."""
    warm_tokens = min(config.max_new_tokens, WARMUP_TOKENS)
    for i in range(config.warmup):
        log(f"warm-up {i + 1}/{config.warmup}: {len(specs)} configurations, "
            f"{warm_tokens} tokens each ...")
        for spec in specs:
            runner.run(spec, prompt_ids[0], config.seed, warm_tokens, config.prompts[0].constraint)


def _timed_passes(runner: Runner, specs: list, prompt_ids: list, config: BenchConfig,
                  log) -> dict[RunSpec, list[list[RunResult]]]:
    """The timed passes, configurations interleaved per prompt: results[spec][pass][prompt]."""
    results: dict[RunSpec, list[list[RunResult]]] = {spec: [] for spec in specs}
    jobs = config.jobs()
    for rep in range(config.repeats):
        pass_start = time.perf_counter()
        runs: dict[RunSpec, list[RunResult]] = {spec: [] for spec in specs}
        for j, (i, seed) in enumerate(jobs):
            for spec in _order(specs, rep + j):
                runs[spec].append(runner.run(spec, prompt_ids[i], seed, config.max_new_tokens,
                                             config.prompts[i].constraint))
            log(f"[pass {rep + 1}/{config.repeats}] prompt {j + 1}/{len(jobs)} done "
                f"({time.perf_counter() - pass_start:.0f} s)")
        for n, spec in enumerate(specs, start=1):
            own = runs[spec]
            results[spec].append(own)
            tokens, wall = sum(len(r.tokens) for r in own), sum(r.wall_seconds for r in own)
            log(f"[pass {rep + 1}/{config.repeats}, {n}/{len(specs)}] {spec.label}: "
                f"{tokens / wall:.1f} tokens/s ({wall:.1f} s)")
        log(f"pass {rep + 1}/{config.repeats} took {time.perf_counter() - pass_start:.0f} s")
    return results


def _rows(runner: Runner, specs: list, results: dict, config: BenchConfig) -> list[dict]:
    """One row per configuration and prompt kind (`summarize`), with whether its texts are plain
    decoding's where they must be (T = 0, or the coupled rule)."""
    kinds = list(dict.fromkeys(p.kind for p in config.prompts))
    jobs = config.jobs()
    rows = []
    for spec in specs:
        for kind in kinds:
            index = [n for n, (i, _) in enumerate(jobs) if config.prompts[i].kind == kind]
            runs = [[pass_[i] for i in index] for pass_ in results[spec]]
            row = summarize(spec, kind, runs, config, runner.peer_settings(spec))
            if spec.temperature == 0 or spec.verify == "coupled":
                # the coupled rule's texts are plain decoding's with the same seed at any T;
                # llama.cpp's rows against its own plain decoding in the same runtime (its server's
                # numerics are not llama-cpp-python's, nor PyTorch's)
                plain = spec.method if spec.method in LLAMA_METHODS else "autoregressive"
                reference = results[RunSpec(plain, spec.temperature)][0]
                row["matches_autoregressive"] = all(
                    pass_[i].tokens == reference[i].tokens for pass_ in results[spec] for i in index)
            rows.append(row)
    return rows
