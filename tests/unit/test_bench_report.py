"""The benchmarks' shared arithmetic and `make bench`'s table and plots, on figures given here."""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))  # the benchmarks import their helpers as siblings

import _report
import _stats
import bench


def test_a_mean_interval_uses_students_t_for_few_values():
    stat = _stats.interval([1.0, 2.0, 3.0, 4.0, 5.0])
    assert stat["mean"] == 3.0
    half = 2.776 * stat["sd"] / 5**0.5  # t(0.975, 4 degrees of freedom)
    assert stat["low"] == pytest.approx(3.0 - half) and stat["high"] == pytest.approx(3.0 + half)
    assert _stats.t975(100) == 1.96 and _stats.t975(27) == 2.060
    with pytest.raises(ValueError, match="at least two"):
        _stats.interval([1.0])


def test_paired_differences_cancel_what_the_pairs_share():
    baseline = [0.80, 0.90, 0.70]
    shifted = [b + 0.001 for b in baseline]  # large spread between seeds, the same gap in each
    stat = _stats.paired(shifted, baseline)
    assert stat["mean"] == pytest.approx(0.001) and stat["sd"] == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="differ in number"):
        _stats.paired([1.0], [1.0, 2.0])


def test_a_ratio_figure_meets_its_goal_by_the_median_ratio_in_the_better_direction():
    fast = _report.ratio_figure("samples/s", [96.0, 97.0, 95.0], [100.0, 100.0, 100.0], unit="samples/s",
                                baseline_name="bare", goal=0.95)
    assert fast["ratio"]["median"] == pytest.approx(0.96) and fast["met"] is True
    slow = _report.ratio_figure("seconds", [1.2, 1.3], [1.0, 1.0], unit="s", baseline_name="bare",
                                better="lower", goal=1.1)
    assert slow["met"] is False
    assert _report.ratio_figure("x", [1.0], [2.0], unit="s", baseline_name="b")["met"] is None


def test_a_difference_figure_is_met_when_the_mean_difference_is_within_the_goal():
    near = _report.difference_figure("sr", [0.9005, 0.9001], [0.9, 0.9], unit="accuracy", baseline_name="fp32",
                                     goal=0.001)
    far = _report.difference_figure("rne", [0.85, 0.86], [0.9, 0.9], unit="accuracy", baseline_name="fp32",
                                    goal=0.001)
    assert near["met"] is True and far["met"] is False
    assert far["difference"]["mean"] == pytest.approx(-0.045)


def test_bench_tabulates_and_plots_each_benchmark_and_names_the_failed(tmp_path, capsys):
    figures = [_report.ratio_figure("samples/s", [90.0, 92.0], [100.0, 100.0], unit="samples/s",
                                    baseline_name="bare DDP (eager)", goal=0.95),
               _report.difference_figure("bf16-sr minus fp32", [0.9, 0.91], [0.9, 0.905], unit="accuracy",
                                         baseline_name="fp32", goal=0.001)]
    _report.emit("demo", figures)
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = bench.rows([result, {"benchmark": "broken", "failed": "exit 1; see broken.log"}])
    assert rows[0][:2] == ("demo", "samples/s") and rows[0][4].startswith("x0.910") and rows[0][6] == "NO"
    assert rows[1][4].startswith("+0.0025") and rows[1][5] == "|diff| <= 0.001" and rows[1][6] == "NO"
    assert rows[2][:2] == ("broken", "exit 1; see broken.log")
    bench.plot(result, tmp_path / "demo.png")
    assert (tmp_path / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
