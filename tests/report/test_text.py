"""Names from files are shown with their control characters escaped, in every view and error."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from topomesh.cli.main import main
from topomesh.report.text import printable

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "two_hosts_nvlink_pairs.v01.json"
# anything a terminal acts on: C0 but newline, DEL, C1, line/paragraph separators, bidi controls
CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


@pytest.mark.parametrize(
    "raw, shown",
    [
        ("node-a", "node-a"),
        ("evil\x1b[2Jhost", "evil\\x1b[2Jhost"),  # ESC: clear screen
        ("a\x9b31mb", "a\\x9b31mb"),  # C1 CSI
        ("GPU\x1b]0;pwned\x07", "GPU\\x1b]0;pwned\\x07"),  # OSC title + BEL
        ("x\x7fy\x00z", "x\\x7fy\\x00z"),  # DEL, NUL
        ("a\nb\tc\rd", "a\\nb\\tc\\rd"),  # one line stays one line
        ("abc\u202egpj.exe", "abc\\u202egpj.exe"),  # right-to-left override
        ("l\u2028m", "l\\u2028m"),
        ("h100-Ünïcødé-節点", "h100-Ünïcødé-節点"),  # printable non-ASCII is kept
    ],
)
def test_printable_escapes_every_control_character(raw, shown):
    assert printable(raw) == shown


def _evil_file(tmp_path: Path) -> Path:
    # host "evil ESC[2J host CSI 31m" and device "GPU ESC]0;pw BEL DEL 0", as JSON escapes
    text = GOLDEN.read_text().replace("node-a", "evil\\u001b[2Jhost\\u009b31m")
    text = text.replace('"GPU0"', '"GPU\\u001b]0;pw\\u0007\\u007f0"')
    assert "evil\x1b[2Jhost\x9b31m" in json.loads(text)["hosts"]
    path = tmp_path / "evil.json"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "argv",
    [
        ["show", "{f}"],
        ["show", "{f}", "--layout", "tp=2,dp=2"],
        ["layout", "{f}", "--tp", "2", "--dp", "2"],
    ],
)
def test_no_control_characters_reach_the_terminal(tmp_path, capsys, monkeypatch, argv):
    monkeypatch.setenv("COLUMNS", "400")  # wide enough that rich neither folds nor cuts the names
    path = _evil_file(tmp_path)
    assert main([a.format(f=path) for a in argv]) == 0
    out, err = capsys.readouterr()
    assert CONTROL.findall(out + err) == []
    assert "evil\\x1b[2Jhost\\x9b31m" in out and "GPU\\x1b]0;pw\\x07\\x7f0" in out


def test_the_error_line_escapes_the_name_it_quotes(tmp_path, capsys):
    missing = tmp_path / "x\x1b[2J\x9by.json"
    assert main(["show", str(missing)]) == 2
    out, err = capsys.readouterr()
    assert err == f"topomesh: error: {tmp_path}/x\\x1b[2J\\x9by.json: no such file\n" and out == ""
