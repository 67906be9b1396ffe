"""``topomesh plan`` on the command line: JSON keys and counts, CSV, PNG, HTML, errors; and
the same plan from Ray tasks as from this process."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from topomesh.cli.main import main

ARGS = ["plan", "--model", "tiny-llama", "--cluster", "dgx-h100", "--gpus", "8", "--strategies", "tp,dp_shard"]


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOPOMESH_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "plan-cache"))


def test_json_csv_png_html(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from matplotlib.image import imread

    csv, png, html, out = (tmp_path / n for n in ("p.csv", "p.png", "p.html", "p.json"))
    assert main([*ARGS, "--json", "-o", str(out), "--csv", str(csv), "--png", str(png), "--html", str(html)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data == json.loads(out.read_text())
    # 8 = 2^3 over k=2 strategies: C(2,1)·1!·C(2,0) + C(2,2)·2!·C(2,1) = 2 + 4 = 6 layouts;
    # tp=8 does not divide tiny-llama's 4 kv heads: 1 pruned, 5 scored, 3 classes (tp 1, 2, 4).
    assert data["space_size"] == 6 and data["pruned"]["tp_kv_heads"] == 1 and sum(data["pruned"].values()) == 1
    assert data["evaluated"] == 5 and data["traced_classes"] == 3
    assert data["best"] == data["layouts"][0] and len(data["layouts"]) == 5
    assert csv.read_text().count("\n") == 1 + 5
    img = imread(png)
    assert img.shape[0] > 300 and img.shape[1] > 500
    page = html.read_text()
    assert page.count("data:image/png;base64,") == 1 and "<svg" in page and "Why the runners-up lose" in page


@pytest.mark.parametrize(("extra", "message"), [
    (["--search", "batch"], "unknown knob"),
    (["--order", "tp-dp_shard"], "--order does not apply to plan"),
    (["--tp", "3"], "do not divide the world of 8"),
])
def test_bad_input_is_one_line(extra: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*ARGS, *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("topomesh: error:") and message in err and err.count("\n") == 1


@pytest.mark.slow
@pytest.mark.ray
def test_ray_gives_the_local_plan(tmp_path: Path) -> None:
    ray = pytest.importorskip("ray")
    from topomesh.search.evaluate import PlanInputs
    from topomesh.search.run import search

    cache = tmp_path / "traces"
    cache.mkdir(mode=0o700)
    inputs = PlanInputs(model="tiny-llama", cluster="dgx-h100", gpus=8, global_batch=8, cache_dir=str(cache))
    local = search(inputs, strategies=["tp", "dp_shard", "pp"])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled", "TOPOMESH_CACHE_DIR": str(tmp_path)}})
    try:
        remote = search(inputs, strategies=["tp", "dp_shard", "pp"], workers=2, ray_address="local")
    finally:
        ray.shutdown()
    assert [(e.index, e.knob, e.result.to_dict()) for e in remote.entries] == [
        (e.index, e.knob, e.result.to_dict()) for e in local.entries]
    assert remote.traced_classes == local.traced_classes and remote.evaluated == local.evaluated
    assert os.listdir(cache)  # the traces the tasks made are in the shared cache


@pytest.mark.slow
def test_local_workers_give_the_in_process_plan(tmp_path: Path) -> None:
    from topomesh.search.evaluate import PlanInputs
    from topomesh.search.run import search

    cache = tmp_path / "traces"
    cache.mkdir(mode=0o700)
    inputs = PlanInputs(model="tiny-llama", cluster="dgx-h100", gpus=16, global_batch=16, cache_dir=str(cache))
    # dp_replicate: several degree rows share one trace, so a scoring batch holds more than one cell
    one = search(inputs, strategies=["tp", "dp_shard", "dp_replicate", "pp"])
    two = search(inputs, strategies=["tp", "dp_shard", "dp_replicate", "pp"], workers=2)
    assert [(e.index, e.knob, e.result.to_dict()) for e in two.entries] == [
        (e.index, e.knob, e.result.to_dict()) for e in one.entries]
    assert two.evaluated == one.evaluated > 0 and two.failed == one.failed
