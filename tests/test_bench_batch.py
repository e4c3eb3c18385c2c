"""`bench_batch`: throughput rows at several batch sizes (tiny models; no timing thresholds)."""
import torch

from exactspec.bench.config import BenchConfig, BenchPrompt
from exactspec.bench.batch import batch_inputs, batch_throughput


def test_batch_inputs_take_prompts_in_turn_left_padded():
    ids, mask = batch_inputs([torch.tensor([[5, 6, 7]]), torch.tensor([[8]])], 3)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8], [5, 6, 7]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [1, 1, 1]]


def test_batch_throughput_rows(tiny_loaded_pair):
    """Fixed γ and γ = auto; a model draft, the n-gram draft and one auto draft reused by every
    run (as `run.load_models` makes it)."""
    from exactspec.drafters import AutoDrafter, ModelDrafter

    target, draft = tiny_loaded_pair
    config = BenchConfig(target="tiny", drafts=["tiny-draft", "ngram", "auto"], gammas=[2, "auto"],
                         temperatures=[0.0, 1.0], verify=["block"], max_new_tokens=6, repeats=1,
                         warmup=0, prompts=[BenchPrompt("a", "open", "w1 w2 w3 w1 w2"),
                                            BenchPrompt("b", "open", "w7")])
    drafts = {"tiny-draft": draft, "ngram": "ngram", "auto": AutoDrafter(ModelDrafter(draft))}
    rows = batch_throughput(target, drafts, config, [1, 3])
    assert len(rows) == 2 * 2 * (1 + 3 * 2)  # batch sizes × temperatures × (plain + drafts × γ)
    assert {(r["draft"], r["gamma"]) for r in rows if r["method"] == "speculative"} == {
        (d, g) for d in ("tiny-draft", "ngram", "auto") for g in (2, "auto")}
    for row in rows:
        assert row["tokens_per_s"] > 0 and row["batch_size"] in (1, 3)
        if row["method"] == "speculative":
            assert row["speedup"] > 0 and 0 <= row["padding_fed"] < 1
            assert 0 <= row["hole_fraction"] < 1 and row["tokens_per_round"] >= 1
            assert set(row["rounds_by_source"]) <= {"ngram", "ngram-1", "model", "plain"}
    single = [r for r in rows if r["method"] == "speculative" and r["batch_size"] == 1]
    assert all(r["padding_fed"] == 0 for r in single)  # one row never pads


def test_bench_cli_rejects_bad_batch_sizes(capsys):
    from exactspec.cli import main

    for bad in ("0", "x,2", ""):
        assert main(["bench", "--batch-sizes", bad]) == 2
        err = capsys.readouterr().err
        assert "--batch-sizes must be comma-separated integers >= 1" in err
        assert len(err.strip().splitlines()) == 1
