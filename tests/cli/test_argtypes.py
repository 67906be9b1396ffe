"""Numbers on every command line: plain ASCII digits within named limits, finite positive seconds."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from topomesh.cli.argtypes import (
    MAX_HOSTS,
    MAX_RANKS,
    MAX_RANKS_PER_HOST,
    bounded_int,
    positive_seconds,
)
from topomesh.cli.main import main

SYSFS = Path(__file__).resolve().parents[1] / "fixtures" / "sysfs" / "cpu-only"
GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "two_hosts_nvlink_pairs.v01.json"


def test_the_limits():
    assert (MAX_RANKS, MAX_HOSTS, MAX_RANKS_PER_HOST) == (1_048_576, 65_536, 1024)


@pytest.mark.parametrize("text, value", [("1", 1), ("8", 8), ("-1", -1), (" 8 ", 8)])
def test_bounded_int_reads_plain_digits(text, value):
    assert bounded_int(1, 8, rest=True)(text) == value


@pytest.mark.parametrize(
    "text, message",
    [
        ("9", r"^expected a whole number from 1 to 8, got 9$"),
        ("0", r"^expected a whole number from 1 to 8, got 0$"),
        ("-1", r"^expected a whole number from 1 to 8 in plain ASCII digits \(no sign, underscore or leading "
               r"zero\), got '-1'$"),
        ("+4", "got '\\+4'"),
        ("4_0", "got '4_0'"),  # int() reads 40
        ("\u0664", "got '\u0664'"),  # int() reads 4
        ("04", "got '04'"),
        ("1e3", "got '1e3'"),
    ],
)
def test_bounded_int_refuses(text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        bounded_int(1, 8)(text)


@pytest.mark.parametrize("text, value", [("2", 2.0), ("0.5", 0.5), ("1e2", 100.0), ("604800", 604800.0)])
def test_positive_seconds(text, value):
    assert positive_seconds(text) == value


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "Infinity", "0", "-1", "604801", "1_0", "\u0662", " 2", "x"])
def test_positive_seconds_refuses(text):
    with pytest.raises(argparse.ArgumentTypeError, match=r"^expected a (finite )?number of seconds"):
        positive_seconds(text)


@pytest.mark.parametrize(
    "argv, line",
    [
        (["discover", "--sysfs-root", str(SYSFS), "--nproc", "100000000"],
         "topomesh discover: error: argument --nproc: expected a whole number from 1 to 1024, got 100000000"),
        (["layout", str(GOLDEN), "--hosts", "100000000"],
         "topomesh layout: error: argument --hosts: expected a whole number from 1 to 65536, got 100000000"),
        (["layout", str(GOLDEN), "--tp", "4_0"],
         "topomesh layout: error: argument --tp: expected a whole number from 1 to 1048576 or -1 (the rest) in "
         "plain ASCII digits (no sign, underscore or leading zero), got '4_0'"),
        (["calibrate", "--local", "2", "--timeout", "nan"],
         "topomesh calibrate: error: argument --timeout: expected a finite number of seconds above 0 and at most "
         "604800, got 'nan'"),
        (["profile", "--records", "x.json", "--max-seconds", "inf"],
         "topomesh profile: error: argument --max-seconds: expected a finite number of seconds"),
        (["trace", "tiny-llama", "--pp", "+2"], "topomesh trace: error: argument --pp: expected a whole number"),
        (["launch", "--topology-timeout", "nan", "--standalone", "train.py"],
         "topomesh launch: error: argument --topology-timeout: expected a finite number of seconds above 0"),
        (["launch", "--topology-probe-budget", "inf", "--standalone", "train.py"],
         "topomesh launch: error: argument --topology-probe-budget: expected a finite number of seconds above 0"),
    ],
)
def test_commands_refuse_bad_numbers_with_the_limit(argv, line, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith(line)


def test_layout_hosts_times_ranks_over_the_world_limit(tmp_path, capsys):
    one_host = tmp_path / "host.json"
    assert main(["discover", "--sysfs-root", str(SYSFS), "--nproc", "32", "-o", str(one_host), "--json"]) == 0
    capsys.readouterr()
    # 32 ranks × 32,769 hosts = 1,048,608 > 1,048,576
    assert main(["layout", str(one_host), "--hosts", "32769"]) == 2
    assert capsys.readouterr().err == ("topomesh: error: --hosts 32769 of 32 ranks each make 1048608 ranks, more "
                                       "than the 1048576 topomesh handles\n")
