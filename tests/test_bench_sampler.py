"""`bench.sampler`: the time of one verify_block call, on a tiny V and γ (no timing thresholds)."""
import pytest

from exactspec.bench.sampler import main, time_verify


@pytest.mark.parametrize("verify", ["token", "block"])
@pytest.mark.parametrize("point_mass", [False, True])
def test_time_verify_runs_and_returns_a_positive_time(verify, point_mass):
    seconds = time_verify(vocab=8, gamma=2, verify=verify, point_mass=point_mass, calls=3)
    assert isinstance(seconds, float) and seconds > 0


def test_main_prints_one_line_per_rule_and_draft(capsys):
    main(["--vocab", "8", "--gamma", "2", "--calls", "3"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("verify_block, B = 1, γ = 2, V = 8")
    rows = [line.split() for line in lines[1:]]
    assert [(row[0], row[1]) for row in rows] == [
        ("token", "q"), ("token", "point-mass"), ("block", "q"), ("block", "point-mass")]
    assert all(float(row[-2]) > 0 and row[-1] == "ms" for row in rows)
