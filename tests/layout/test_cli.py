"""`topomesh layout`: the JSON facts, the table, and one-line errors (exit 2) for bad layouts."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from topomesh.cli.main import main
from topomesh.layout.dims import Layout
from topomesh.report.layout import layout_to_dict, render_layout

from .topos import SMI, contiguous, h100_host

pytestmark = pytest.mark.skipif(not SMI.is_file(), reason="shared nvidia-smi dump not present")


def test_json_round_robin_two_hosts(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["layout", str(SMI), "--hosts", "2", "--rank-order", "round-robin", "--tp", "8", "--pp", "2", "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["world_size"] == 16 and doc["mesh"]["dims"] == ["pp", "tp"]
    axes = {a["axis"]: a for a in doc["axes"]}
    assert axes["tp"]["link"] == "NVSwitch" and axes["tp"]["rank_order_link"] == "IB"
    assert axes["tp"]["groups"] == [[0, 2, 4, 6, 8, 10, 12, 14], [1, 3, 5, 7, 9, 11, 13, 15]]
    assert axes["pp"]["link"] == "IB" and axes["pp"]["hosts_per_group"] == 2
    assert doc["ranks"][2]["coords"] == {"pp": 0, "tp": 1}
    assert [h["ranks"] for h in doc["hosts"]] == [list(range(0, 16, 2)), list(range(1, 16, 2))]


def test_table_shows_the_cannot_fit_note(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["layout", str(SMI), "--hosts", "2", "--tp", "16"]) == 0
    out = capsys.readouterr().out
    assert "note: tp=16 cannot fit in 8-GPU NVLink islands: crosses IB" in out
    assert "placement of tp=16 on 16 ranks" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tp", "3"], "the layout needs 3 ranks (tp=3) but the world has 8"),
        (["--tp", "4", "--order", "tp-pp-tp"], "axis 'tp' appears twice in the order tp-pp-tp"),
        (["--tp", "4", "--order", "tp-xp"], "unknown parallel axis 'xp'"),
        (["--layout", "tp=0"], "is not AXIS=DEGREE with a positive integer"),
        (["--tp", "-1", "--pp", "-1"], "only one degree may be -1"),
        (["--tp", "3", "--dp-shard", "-1"], "the other degrees multiply to 3, which does not divide the world of 8"),
        (["--tp", "2", "--rank-order", "round-robin"], "--rank-order needs --hosts"),
    ],
)
def test_bad_layouts_are_one_line_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["layout", str(SMI), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and err.startswith("topomesh: error: ")


def test_report_api_is_reusable() -> None:
    topo = contiguous([h100_host("a"), h100_host("b")])
    lay = Layout(tp=4, dp_shard=2, pp=2)
    doc = layout_to_dict(topo, lay)
    assert json.loads(json.dumps(doc)) == doc
    assert {a["axis"]: a["link"] for a in doc["axes"]} == {"pp": "IB", "dp_shard": "NVSwitch", "tp": "NVSwitch"}
    console = Console(width=200, record=True)
    console.print(render_layout(topo, lay))
    text = console.export_text()
    assert "tp=4" in text and "[0 1 2 3] [4 5 6 7]" in text
    # placement table: per host its ranks, devices and each rank's pp, dp_shard and tp coordinate
    rows = {
        cells[1].strip(): [" ".join(c.split()) for c in cells[2:-1]]
        for line in text.splitlines()
        if len(cells := line.split("│")) == 8
    }
    assert rows["b"] == ["8 9 10 11 12 13 14 15", "0 1 2 3 4 5 6 7", "1 1 1 1 1 1 1 1", "0 0 0 0 1 1 1 1", "0 1 2 3 0 1 2 3"]
    assert rows["a"][2:] == ["0 0 0 0 0 0 0 0", "0 0 0 0 1 1 1 1", "0 1 2 3 0 1 2 3"]


def test_layout_spec_is_the_same_as_flags(capsys: pytest.CaptureFixture[str]) -> None:
    base = [str(SMI), "--hosts", "2", "--rank-order", "round-robin", "--json"]
    assert main(["layout", *base, "--layout", "tp=8,pp=-1"]) == 0
    by_spec = json.loads(capsys.readouterr().out)
    assert main(["layout", *base, "--tp", "8", "--pp", "2"]) == 0
    assert by_spec == json.loads(capsys.readouterr().out)
    assert main(["layout", *base, "--layout", "tp=8,tp=2"]) == 2
    assert "given twice" in capsys.readouterr().err
