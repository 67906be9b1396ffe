"""Output flags checked before a command's long work: a missing directory, a directory named
as the file, or a plot without matplotlib fails in a second with one line naming the flag,
before a search or a validation run whose results it would otherwise lose (a ``validate
--png`` without matplotlib once ran its 13 minutes and then printed nothing)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from topomesh.cli.main import main
from topomesh.errors import OutputError
from topomesh.topology.api import check_writable, write_atomic

TINY = ["--model", "tiny-llama", "--seq-len", "64"]


def _refuse(*_args, **_kwargs):
    raise AssertionError("the long work started before the output flags were checked")


def test_check_writable_names_what_is_wrong(tmp_path: Path) -> None:
    assert check_writable(tmp_path / "new.png") == tmp_path / "new.png"
    with pytest.raises(OutputError, match=r"missing/x\.png: the directory .*missing does not exist"):
        check_writable(tmp_path / "missing" / "x.png")
    with pytest.raises(OutputError, match="is a directory, not a regular file"):
        check_writable(tmp_path)
    (tmp_path / "a_dir").mkdir()
    with pytest.raises(OutputError, match="is a directory"):  # write_atomic refuses it the same way
        write_atomic(tmp_path / "a_dir", b"x")


def test_check_writable_refuses_a_directory_it_cannot_write(monkeypatch, tmp_path: Path) -> None:
    import topomesh.topology.api as api

    (tmp_path / "ok").mkdir()
    # root may write anywhere: os.access says tmp_path itself can be read and entered, not written
    monkeypatch.setattr(api.os, "access", lambda path, mode: Path(path) != tmp_path or not mode & api.os.W_OK)
    with pytest.raises(OutputError, match=r"x\.png: the directory .* is not writable"):
        check_writable(tmp_path / "x.png")
    assert check_writable(tmp_path / "ok" / "x.png") == tmp_path / "ok" / "x.png"


def test_validate_refuses_png_without_matplotlib_before_running(monkeypatch, capsys, tmp_path: Path) -> None:
    import topomesh.validate.run as run

    for name in ("pooled_collectives", "ensure_collectives", "ensure_ops", "in_step_tables", "measure"):
        monkeypatch.setattr(run, name, _refuse)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert main(["validate", *TINY, "--layouts", "dp_shard=2", "--png", str(tmp_path / "v.png")]) == 2
    err = capsys.readouterr().err
    assert err == "topomesh: error: --png needs matplotlib, which is not installed: pip install 'topomesh[plot]'\n"


def test_validate_refuses_a_png_in_a_missing_directory(monkeypatch, capsys, tmp_path: Path) -> None:
    import topomesh.validate.run as run

    for name in ("pooled_collectives", "ensure_collectives", "ensure_ops", "in_step_tables", "measure"):
        monkeypatch.setattr(run, name, _refuse)
    assert main(["validate", *TINY, "--layouts", "dp_shard=2", "--png", str(tmp_path / "no" / "v.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("topomesh: error: --png: ") and "does not exist" in err and err.count("\n") == 1


@pytest.mark.parametrize("flag", ["-o", "--csv", "--png", "--html"])
def test_plan_checks_every_output_before_searching(flag: str, monkeypatch, capsys, tmp_path: Path) -> None:
    import topomesh.search.run as search_run

    monkeypatch.setattr(search_run, "search", _refuse)
    assert main(["plan", *TINY, "--gpus", "8", flag, str(tmp_path / "no" / "out")]) == 2
    err = capsys.readouterr().err
    name = "output" if flag == "-o" else flag[2:]
    assert err.startswith(f"topomesh: error: --{name}: ") and "does not exist" in err and err.count("\n") == 1


def test_plan_html_without_matplotlib_fails_before_searching(monkeypatch, capsys, tmp_path: Path) -> None:
    import topomesh.search.run as search_run

    monkeypatch.setattr(search_run, "search", _refuse)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["plan", *TINY, "--gpus", "8", "--html", str(tmp_path / "p.html")]) == 2
    assert "--html needs matplotlib, which is not installed" in capsys.readouterr().err


def test_simulate_checks_its_timeline_path(capsys, tmp_path: Path) -> None:
    assert main(["simulate", *TINY, "--gpus", "8", "--timeline", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("topomesh: error: --timeline: ") and "is a directory" in err


def test_validate_prints_its_report_before_the_picture(monkeypatch, capsys, tmp_path: Path) -> None:
    """The measurements come out even when drawing fails: the runs, sweeps and op table are
    stubbed (one rank, one pass, priced on a GPU preset), the picture's writer fails."""
    import json

    import topomesh.cost.cluster as cluster
    import topomesh.validate.plot as plot
    import topomesh.validate.run as run
    from topomesh.errors import OutputError

    record = {"step_s": [0.5, 0.5], "peak_bytes": [10**6], "world_size": 1, "microbatches": 2}
    monkeypatch.setattr(run, "ensure_collectives", lambda world: tmp_path / "profile.json")
    monkeypatch.setattr(run, "profile_info", lambda path: {})
    monkeypatch.setattr(run, "ensure_ops", lambda records, **kw: {})
    monkeypatch.setattr(run, "measure", lambda *a, **kw: record)
    monkeypatch.setattr(cluster, "local_cluster", lambda gpus: cluster.load_cluster("dgx-h100", gpus=gpus))

    def fail(results, path):
        raise OutputError(f"{path}: the picture failed")

    monkeypatch.setattr(plot, "save_validation_png", fail)
    argv = ["validate", *TINY, "--layouts", "dp_shard=1", "--repeats", "1", "--no-in-step",
            "--no-sweep-each-pass", "--json", "--png", str(tmp_path / "v.png")]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert [r["layout"] for r in report["layouts"]] == ["dp_shard=1"] and report["layouts"][0]["measured_s"] == 0.5
    assert "the picture failed" in err
