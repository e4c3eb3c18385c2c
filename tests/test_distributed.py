"""A tensor-parallel target under torchrun on the CPU (gloo, one thread per rank).

The tiny random Llama here has 4 attention heads and 2 key/value heads, so Transformers' tensor
parallelism splits it over 2 ranks. One torchrun run (this file is also its worker: see
`worker`) decodes on both ranks and writes what each rank committed; the tests read that:
both ranks commit identical tokens, greedy speculative output equals greedy plain output under
the same layout (and the whole model's), and sampled whole generations pass a chi-square test
against the target's exact joint distribution.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ALPHA, chi_square_pvalue, make_tiny_llama, make_tiny_tokenizer

PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 4]]
SAMPLED_PROMPT = [1, 4, 3, 10, 7]
SAMPLED_ROWS = 1500  # rows of one batch, each an independent sample of the first 2 new tokens
GREEDY_TOKENS = 24


def _torchrun(args: list[str], tmp: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node 2 ARGS` on the CPU, one thread per rank."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "HF_HUB_OFFLINE": "1", "EXACTSPEC_CACHE": str(tmp / "cache"),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(target folder, draft folder): the tiny target (2 layers) and draft (1 layer), saved."""
    pytest.importorskip("accelerate", reason="Transformers' tensor parallelism needs accelerate")
    folder = tmp_path_factory.mktemp("tp")
    tokenizer = make_tiny_tokenizer()
    for name, model in (("target", make_tiny_llama(0, num_layers=2)),
                        ("draft", make_tiny_llama(1, num_layers=1))):
        model.save_pretrained(folder / name)
        tokenizer.save_pretrained(folder / name)
    return folder / "target", folder / "draft"


@pytest.fixture(scope="module")
def tp_run(models, tmp_path_factory):
    """What each of the 2 ranks committed: [rank 0's results, rank 1's]."""
    out = tmp_path_factory.mktemp("tp-out")
    done = _torchrun([__file__, str(models[0]), str(models[1]), str(out)], out)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_both_ranks_commit_identical_tokens(tp_run):
    rank0, rank1 = tp_run
    assert rank0["world"] == rank1["world"] == 2
    for key in ("plain", "gamma3", "gamma_auto", "gathered", "sampled"):
        assert rank0[key] == rank1[key], key


def test_greedy_speculative_equals_greedy_plain_under_tp(tp_run, models):
    """Under the same tensor-parallel layout, and also the whole model's own greedy decoding."""
    from exactspec import autoregressive_generate, load_model
    from exactspec.engine import pad_prompts

    result = tp_run[0]
    assert result["gamma3"] == result["plain"]
    assert result["gamma_auto"] == result["plain"]
    assert result["gathered"] == result["plain"]  # `local_copy`: the whole model on one rank
    whole = load_model(models[0])
    ids, mask = pad_prompts([torch.tensor(p) for p in PROMPTS])
    out = autoregressive_generate(whole, ids, attention_mask=mask, max_new_tokens=GREEDY_TOKENS,
                                  temperature=0)
    assert [s.tolist() for s in out.sequences] == result["plain"]


def test_sampled_whole_generations_follow_the_exact_joint(tp_run, models):
    """SAMPLED_ROWS speculative samples (γ = 2, no seed: rank 0's fresh seed is shared) of the
    first 2 tokens, against the whole target's exact joint: chi-square, false-failure rate
    α = 1e-6 (ALPHA). The TP logits differ from the whole model's only by float rounding."""
    from test_decoding import target_joint

    from exactspec import load_model
    from exactspec.sampling import SamplingConfig

    result = tp_run[0]
    joint = target_joint(load_model(models[0]).model, SAMPLED_PROMPT, 2, SamplingConfig(1.0))
    counts: dict[tuple, int] = {}
    for row in result["sampled"]:
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    assert sum(counts.values()) == SAMPLED_ROWS
    assert result["sampled_accepted"] > 200  # both the accept and the correction paths ran
    assert chi_square_pvalue(counts, joint) > ALPHA


def test_a_divergence_between_ranks_is_caught(tp_run):
    """Ranks that committed different tokens raise on every rank, naming the rank and the row."""
    for rank in tp_run:
        assert "rank 1 committed other tokens than rank 0 in row 1" in rank["divergence"]
        # in a generation, with EXACTSPEC_TP_CHECK=round: caught after the first round
        assert re.search(r"diverged at round 1: rank 1 committed other tokens than rank 0 in row",
                         rank["seed_divergence"])


def test_generate_cli_under_torchrun_prints_once(models, tmp_path):
    """`torchrun ... -m exactspec generate --tp`: one JSON object (rank 0), the tokens of the
    whole model's greedy decoding."""
    args = ["--target", str(models[0]), "--draft", f"auto:{models[1]}", "--gamma", "3",
            "--temperature", "0", "--max-new-tokens", "12", "--no-chat", "--json", "w1 w2 w3"]
    done = _torchrun(["-m", "exactspec", "generate", "--tp", *args], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    tp = json.loads(done.stdout)  # one object: the follower printed nothing
    assert tp["tp"] == 2
    whole = subprocess.run([sys.executable, "-m", "exactspec", "generate", *args],
                           capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert tp["token_ids"] == json.loads(whole.stdout)["token_ids"]


def test_serve_under_torchrun_rank0_serves_and_rank1_follows(models, tmp_path):
    """`torchrun ... -m exactspec serve --tp`, every round checked across ranks
    (EXACTSPEC_TP_CHECK=round): concurrent requests of different lengths share batches; greedy
    answers equal the whole model's greedy decoding; a seeded sampled request repeats."""
    import concurrent.futures
    import signal

    openai = pytest.importorskip("openai", reason="the openai client is not installed")
    from test_replicas import _wait_healthy

    from exactspec.serve.replicas import free_port

    port = free_port("127.0.0.1")
    args = ["-m", "exactspec", "serve", "--tp", "--port", str(port), "--target", str(models[0]),
            "--draft", f"auto:{models[1]}", "--model-name", "tiny"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "EXACTSPEC_TP_CHECK": "round",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    process = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                "--nproc-per-node", "2", *args], env=env, start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0, timeout=60)
        ask = lambda i: client.completions.create(  # noqa: E731
            model="tiny", prompt="w1 w2 w3", max_tokens=12 if i % 2 else 6 + i,
            temperature=0 if i % 2 else 1, seed=None if i % 2 else 7,
            extra_body={"gamma": 3}).choices[0].text  # a fixed γ: a seed then repeats exactly
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            texts = list(pool.map(ask, range(8)))
        again = ask(0)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        stderr = process.communicate(timeout=60)[1]
    whole = subprocess.run([sys.executable, "-m", "exactspec", "generate", "--target",
                            str(models[0]), "--draft", "none", "--temperature", "0",
                            "--max-new-tokens", "12", "--no-chat", "--json", "w1 w2 w3"],
                           capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert "diverged" not in stderr
    assert {texts[i] for i in (1, 3, 5, 7)} == {json.loads(whole.stdout)["text"]}
    assert again == texts[0]


def test_tp_outside_torchrun_is_refused(models, monkeypatch, capsys):
    from exactspec import load_model
    from exactspec.cli.main import main

    for variable in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(variable, raising=False)
    with pytest.raises(ValueError, match="torchrun"):
        load_model(models[0], tp=True)
    assert main(["generate", "--tp", "--target", str(models[0]), "--draft", "none", "w1"]) == 2
    assert "--tp: tensor parallelism needs one process per rank started by torchrun" in capsys.readouterr().err


def test_heads_that_do_not_split_are_refused(models):
    from exactspec.distributed import check_heads
    from exactspec.models import load_model

    config = load_model(models[0]).model.config  # 4 heads, 2 key/value heads
    check_heads(config, 2)
    with pytest.raises(ValueError, match="num_key_value_heads = 2 does not split over 4 ranks"):
        check_heads(config, 4)
    with pytest.raises(ValueError, match="tp=True places the weights itself"):
        load_model(models[0], tp=True, device="cpu")


# --------------------------------------------------------------------------- the worker


@contextlib.contextmanager
def _other_choices_on_followers(rank: int):
    """On ranks other than 0, a γ controller that chooses otherwise (as another clock would):
    a choice that is not rank 0's broadcast then splits the ranks' passes and fails the run."""
    from exactspec.controller import GammaController

    saved = GammaController.choose, GammaController.min_drafts
    if rank:
        GammaController.choose = lambda self, source, **_: 1
        GammaController.min_drafts = lambda self, source, gamma, *_: gamma + 1  # drop every proposal
    try:
        yield
    finally:
        GammaController.choose, GammaController.min_drafts = saved


def worker(target_dir: str, draft_dir: str, out_dir: str) -> None:
    """On each rank: decode greedily (plain, γ = 3, γ auto) and sampled, check a divergence is
    caught, and write what this rank committed to OUT/rank{r}.json."""
    from exactspec import autoregressive_generate, distributed, load_model, speculative_generate
    from exactspec.engine import pad_prompts

    torch.set_num_threads(1)
    target = load_model(target_dir, tp=True)
    draft = load_model(draft_dir)
    rank, size = distributed.world()
    ids, mask = pad_prompts([torch.tensor(p) for p in PROMPTS])
    greedy = dict(attention_mask=mask, max_new_tokens=GREEDY_TOKENS, temperature=0)
    result = {"world": size,
              "plain": autoregressive_generate(target, ids, **greedy).sequences,
              "gamma3": speculative_generate(target, draft, ids, gamma=3, **greedy).sequences}
    os.environ[distributed.CHECK_ENV] = "round"  # the debug mode: checked every round
    with _other_choices_on_followers(rank):  # only rank 0's timings may shape a round
        result["gamma_auto"] = speculative_generate(target, draft, ids, gamma="auto",
                                                    **greedy).sequences
    del os.environ[distributed.CHECK_ENV]
    whole = distributed.local_copy(target.model, torch.float32)  # gathered from the shards
    assert distributed.is_sharded(target.model) and not distributed.is_sharded(whole)
    result["gathered"] = autoregressive_generate(whole, ids, **greedy).sequences
    result = {k: [s.tolist() for s in v] if k != "world" else v for k, v in result.items()}
    rows = torch.tensor([SAMPLED_PROMPT] * SAMPLED_ROWS)  # [N, L]
    sampled = speculative_generate(target, draft, rows, gamma=2, max_new_tokens=2,
                                   temperature=1.0, eos_token_id=[])  # no seed; no EOS
    result["sampled"] = sampled.sequences[:, len(SAMPLED_PROMPT):].tolist()
    result["sampled_accepted"] = sampled.stats.accepted_drafts
    try:
        distributed.check_same([[1, 2], [3, 4 + rank]], "a test")
        result["divergence"] = "not caught"
    except RuntimeError as err:
        result["divergence"] = str(err)
    os.environ[distributed.CHECK_ENV] = "round"
    try:  # each rank its own seed: the first round already differs
        speculative_generate(target, draft, ids, gamma=3, attention_mask=mask, max_new_tokens=8,
                             temperature=1.0, seed=rank)
        result["seed_divergence"] = "not caught"
    except RuntimeError as err:
        result["seed_divergence"] = str(err)
    del os.environ[distributed.CHECK_ENV]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    worker(*sys.argv[1:4])
