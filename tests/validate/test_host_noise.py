"""``benchmarks/bench_host_noise.py``: the windows it calls slow are the ones a hand count finds."""

from __future__ import annotations

import doctest
import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_host_noise.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_host_noise", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_its_worked_example_holds():
    failed, tried = doctest.testmod(_bench())
    assert tried >= 1 and failed == 0


def test_a_window_is_its_median_over_the_whole_median():
    # 20 ms chains, one window at 24 ms: the whole median is 20 ms, that window 1.2x by hand;
    # a window with one slow chain among three keeps its median at 20 ms
    samples = [(0.1, 0.020), (0.4, 0.020), (0.8, 0.020),
               (1.1, 0.024), (1.5, 0.024), (1.9, 0.024),
               (2.2, 0.020), (2.5, 0.030), (2.9, 0.020)]
    ratios = _bench().window_ratios(samples, 1.0)
    assert ratios == pytest.approx({0: 1.0, 1: 1.2, 2: 1.0})
    # half-second windows split each second in two
    assert len(_bench().window_ratios(samples, 0.5)) == 6
