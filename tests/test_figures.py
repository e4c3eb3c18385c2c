"""`exactspec figures`: five PNG files and numbers.json, written whole or not at all."""
import json
import os
import struct

import pytest

from exactspec import cli
from exactspec.lab import figures

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path):
    """(width, height) from the PNG header."""
    data = path.read_bytes()[:24]
    assert data[:8] == PNG_SIGNATURE
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("figs") / "new" / "figures"
    return out, figures.write_figures(out, seed=0, n_proposals=50_000, n_tokens=10_000)


def test_writes_five_figures_and_numbers(written):
    out, paths = written
    assert sorted(p.name for p in out.iterdir()) == sorted(figures.FILES.values())
    for key in ("fig1", "fig2", "fig3", "fig4", "fig5"):
        assert paths[key].name.startswith(key) and paths[key].suffix == ".png"
        width, height = png_size(paths[key])
        assert 700 <= width <= 1600 and 400 <= height <= 900  # sized for a screen
        assert paths[key].stat().st_size < 400_000


def test_numbers_json_holds_the_seed_numbers(written):
    _, paths = written
    numbers = json.loads(paths["numbers"].read_text())
    rejection = numbers["rejection"]
    assert abs(rejection["Z"] - 5.73807) < 1e-4
    assert rejection["max_f"] == pytest.approx(3.696, abs=5e-4)
    rates = {row["name"]: row["theoretical_acceptance"] for row in rejection["proposals"]}
    assert round(100 * rates["uniform"], 2) == 22.95 and round(100 * rates["gaussian"], 2) == 52.16
    assert all(abs(row["z_score"]) < 4 for row in rejection["proposals"])
    assert sum(numbers["tokens"]["total"]) == 10_000
    curves = {curve["alpha"]: curve for curve in numbers["cost"]["curves"]}
    assert sorted(curves) == [0.5, 0.7, 0.9]
    assert curves[0.7]["best_gamma"] == 4 and round(curves[0.7]["best_speedup"], 2) == 1.98
    assert numbers["files"] == figures.FILES


def test_same_seed_same_numbers(written, tmp_path):
    _, paths = written
    again = figures.write_figures(tmp_path, seed=0, n_proposals=50_000, n_tokens=10_000)
    assert again["numbers"].read_text() == paths["numbers"].read_text()


def test_cli_figures(tmp_path, capsys):
    out = tmp_path / "cli"
    assert cli.main(["figures", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "wrote 6 files" in printed
    assert all((out / name).is_file() for name in figures.FILES.values())


def test_failure_leaves_nothing_behind(tmp_path, monkeypatch):
    def broken(curves):
        raise RuntimeError("drawing failed")

    monkeypatch.setattr(figures, "figure_cost", broken)
    fresh = tmp_path / "fresh"
    with pytest.raises(RuntimeError, match="drawing failed"):
        figures.write_figures(fresh, n_proposals=2000, n_tokens=100)
    assert not fresh.exists()  # created by the call, removed again

    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    with pytest.raises(RuntimeError):
        figures.write_figures(existing, n_proposals=2000, n_tokens=100)
    assert [p.name for p in existing.iterdir()] == ["keep.txt"]


def test_out_that_is_a_file_is_one_line(tmp_path, capsys):
    target = tmp_path / "a_file"
    target.write_text("x")
    assert cli.main(["figures", "--out", str(target)]) == 2
    err = capsys.readouterr().err
    assert err == f"exactspec figures: error: --out: cannot write figures to {target}: it is not a folder\n"
    assert cli.main(["figures", "--out", str(target / "sub")]) == 2
    assert "cannot write figures to" in capsys.readouterr().err


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_out_is_one_line(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        assert cli.main(["figures", "--out", str(locked)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Permission denied" in err
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o700)


def test_bad_seed_writes_nothing(tmp_path, capsys):
    out = tmp_path / "never"
    assert cli.main(["figures", "--out", str(out), "--seed", "-3"]) == 2
    assert "--seed must be an integer >= 0, got -3" in capsys.readouterr().err
    assert not out.exists()
