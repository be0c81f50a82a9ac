import json

import pytest

from trnflow.errors import DataError
from trnflow.lifecycle import gate
from trnflow.lifecycle.gate import headline, parse_metrics, series_of
from trnflow.records import Band, MetricPoint, MetricSeries, PairedCheck, Verdict


def _typed(data):
    """Points and series written as a metrics file holds them, as the gate takes them."""
    if isinstance(data, list):
        return [MetricPoint.model_validate(p) for p in data]
    return MetricSeries.model_validate(data) if isinstance(data, dict) else data


def compare(candidate, reference, *args, **kwargs):
    return gate.compare(_typed(candidate), _typed(reference), *args, **kwargs)


def no_regression(candidate, champion, *args, **kwargs):
    return gate.no_regression(_typed(candidate), _typed(champion), *args, **kwargs)


def better(series, metric):
    return gate.better(_typed(series), metric)


REF = [{"step": 100, "accuracy": 0.80}, {"step": 200, "accuracy": 0.85}]
ACC = Band(metric="accuracy", max_abs_diff=0.001)


def test_within_band_passes_with_every_point_listed():
    cand = [{"step": 100, "accuracy": 0.8005}, {"step": 200, "accuracy": 0.8491}]
    verdict = compare(cand, REF, ACC)
    assert verdict.passed
    assert [(p.step, p.passed) for p in verdict.points] == [(100, True), (200, True)]
    assert verdict.points[0].diff == pytest.approx(0.0005)


def test_outside_band_fails_and_names_the_failing_point():
    cand = [{"step": 100, "accuracy": 0.8005}, {"step": 200, "accuracy": 0.847}]
    verdict = compare(cand, REF, ACC)
    assert not verdict.passed
    assert [p.step for p in verdict.points if not p.passed] == [200]
    assert "step 200" in verdict.reason and "step 100" not in verdict.reason


def test_a_failed_verdict_reads_in_one_short_line_naming_the_worst_point():
    cand = [{"step": 100, "accuracy": 0.7905}, {"step": 200, "accuracy": 0.847}]
    line = headline(compare(cand, REF, ACC), "fp32-reference")
    assert line == "accuracy -0.0095 vs fp32-reference at step 100 (allowed ±0.001); 1 more step outside it"
    assert len(line.split(";")[0]) <= 70  # what the UI's state message shows before "See More"
    missing = compare([{"step": 150, "accuracy": 0.8}], REF, ACC)
    assert headline(missing, "gpu").startswith("against gpu: no common evaluation step")


def test_no_common_step_fails_with_explanation():
    verdict = compare([{"step": 150, "accuracy": 0.8}], REF, ACC)
    assert not verdict.passed
    assert "no common evaluation step" in verdict.reason


def test_metrics_document_round_trips():
    series = series_of(_typed([{"step": 200, "accuracy": 0.85}, {"step": 100, "accuracy": 0.8}]), "gpu")
    assert series.steps() == [100, 200] and series.points[0].global_step == 100  # a file without one: the step
    text = series.model_dump_json()
    assert json.loads(text)["points"][1] == {"step": 200, "global_step": 200, "accuracy": 0.85}  # flat, as files are
    assert parse_metrics(text, "ref.json", "accuracy") == series
    other = parse_metrics('{"points": [{"step": 5, "accuracy": 0.5, "at": "2026-12-01", "ok": true}], "run": "x"}',
                          "gpu.json", "accuracy")
    assert other.points[0].values == {"accuracy": 0.5}  # a file's fields that are not numbers are not metrics


@pytest.mark.parametrize("text", ["not json", "[]", '{"points": []}', '{"points": [{"step": "1", "accuracy": 1}]}'])
def test_bad_metrics_files_are_refused_clearly(text):
    with pytest.raises(DataError, match=r"ref\.json"):
        parse_metrics(text, "ref.json", "accuracy")


def _doc(points, correct, step, holdout="h1"):
    return {"points": points, "holdout_sha256": holdout, "predictions": {"step": step, "correct": correct}}


def test_final_mode_judges_only_the_last_shared_point():
    cand = [{"step": 100, "accuracy": 0.79}, {"step": 200, "accuracy": 0.8495}]
    assert not compare(cand, REF, ACC, mode="every-point").passed
    verdict = compare(cand, REF, ACC, mode="final")
    assert verdict.passed and not verdict.points[0].passed  # listed, but not judged


def test_mcnemar_flags_a_difference_the_band_misses_on_a_large_holdout():
    """1,000,000 rows: the candidate is right on 900 rows the reference got wrong and wrong on 100
    it got right: +0.08 points of accuracy, inside the 0.1% band, yet far from chance."""
    rows, both, cand_only, ref_only = 1_000_000, 800_000, 900, 100
    cand = "1" * both + "1" * cand_only + "0" * ref_only + "0" * (rows - both - cand_only - ref_only)
    ref = "1" * both + "0" * cand_only + "1" * ref_only + "0" * (rows - both - cand_only - ref_only)
    acc_c, acc_r = cand.count("1") / rows, ref.count("1") / rows
    verdict = compare(_doc([{"step": 5, "accuracy": acc_c}], cand, 5), _doc([{"step": 5, "accuracy": acc_r}], ref, 5),
                      ACC)
    assert verdict.passed  # the point-wise rule sees nothing
    paired = verdict.paired
    assert (paired.candidate_only, paired.reference_only) == (900, 100)
    assert paired.significant and paired.p_value < 1e-100 and not paired.underpowered
    strict = compare(_doc([{"step": 5, "accuracy": acc_c}], cand, 5), _doc([{"step": 5, "accuracy": acc_r}], ref, 5),
                     ACC, fail_on_significant=True)
    assert not strict.passed and "McNemar" in strict.reason


def test_mcnemar_on_a_tiny_holdout_says_it_is_underpowered():
    cand, ref = "1101101110" * 20, "1101101011" * 20  # 200 rows, 20 + 20 discordant
    verdict = compare(_doc([{"step": 5, "accuracy": 0.7}], cand, 5), _doc([{"step": 5, "accuracy": 0.7}], ref, 5),
                      ACC)
    paired = verdict.paired
    assert paired.p_value == pytest.approx(1.0) and not paired.significant
    assert paired.underpowered and paired.rows_needed > 100_000


def test_the_paired_check_needs_the_same_holdout_and_step():
    a, b = _doc([{"step": 5, "accuracy": 0.7}], "10", 5), _doc([{"step": 5, "accuracy": 0.7}], "10", 5, holdout="h2")
    assert compare(a, b, ACC).paired == PairedCheck(
        available=False, reason="the two runs were evaluated on different holdout sets")
    assert compare(a, {"points": b["points"]}, ACC).paired.available is False


def test_the_exact_and_the_large_sample_mcnemar_agree_where_they_meet():
    from trnflow.lifecycle.gate import EXACT_LIMIT, mcnemar_p

    assert mcnemar_p(0, 0) == 1.0
    assert mcnemar_p(10, 0) == pytest.approx(2 * 0.5 ** 10)
    half = EXACT_LIMIT // 2
    exact = mcnemar_p(half + 150, half - 150)  # 20,000 discordant pairs: the exact test
    approx = mcnemar_p(half + 151, half - 150)  # one more: the chi-square approximation
    assert exact == pytest.approx(approx, rel=0.05)


def test_metrics_with_bad_predictions_are_refused():
    with pytest.raises(DataError, match="predictions"):
        parse_metrics('{"points": [{"step": 1, "accuracy": 0.5}], "predictions": {"step": 1, "correct": "01x"}}',
                      "ref.json", "accuracy")


def test_the_paired_check_refuses_empty_or_mismatched_outcomes():
    empty = compare(_doc([{"step": 5, "accuracy": 0.7}], "", 5), _doc([{"step": 5, "accuracy": 0.7}], "", 5),
                    ACC)
    assert empty.paired.available is False and empty.passed
    short = compare(_doc([{"step": 5, "accuracy": 0.7}], "10", 5), _doc([{"step": 5, "accuracy": 0.7}], "101", 5),
                    ACC)
    assert "2 and 3 rows" in short.paired.reason


def test_the_paired_test_is_told_in_plain_words_with_its_power():
    """Item 14: what McNemar's test compared, what it found, and when the holdout is too small for it."""
    from trnflow.lifecycle.gate import paired_check
    from trnflow.reporting.chart import paired_sentence

    small = {"holdout_sha256": "h", "predictions": {"step": 40, "correct": "1" * 390 + "0" * 10}}

    def told(candidate: dict, reference: dict, band: float) -> str:
        paired = paired_check(_typed(candidate), _typed(reference), "accuracy", band, 0.05)
        return paired_sentence(Verdict(metric="accuracy", max_abs_diff=band, mode="final", passed=True, paired=paired))

    sentence = told(small, small, 0.001)
    assert sentence.startswith("Paired test (McNemar's) on the same 400 holdout rows at step 40: the candidate "
                               "alone was right on 0 rows, the reference alone on 0; no evidence that the two "
                               "models differ (p = 1).")
    assert "The holdout is too small for this test to see a 0.10% difference: that takes about" in sentence
    assert "only the band above decided the gate" in sentence
    big_c = {"holdout_sha256": "h", "predictions": {"step": 40, "correct": "1" * 60_000 + "0" * 40_000}}
    big_r = {"holdout_sha256": "h", "predictions": {"step": 40, "correct": "0" * 2_000 + "1" * 58_000 + "0" * 40_000}}
    enough = told(big_c, big_r, 0.02)
    assert "the two models differ (p = " in enough and "100,000 rows are enough to see a 2.00% difference" in enough
    missing = told(small, {"holdout_sha256": "other"}, 0.001)
    assert missing.startswith("No paired test (McNemar's): per-example predictions missing")


PPL = Band(metric="perplexity", max_abs_diff=0.001, max_rel_diff=0.01, better="lower")


def _series(perplexity: float, step: int = 40) -> dict:
    return {"points": [{"step": step, "accuracy": 0.5, "perplexity": perplexity}], "holdout_sha256": "h",
            "directions": {"accuracy": "higher", "perplexity": "lower"}}


def test_against_the_champion_a_lower_is_better_metric_may_only_fall_or_rise_within_the_band():
    """A candidate of higher perplexity than the champion is kept out, as a less accurate classifier is."""
    champion = _series(20.0)
    improved = no_regression(_series(15.0), champion, PPL, "champion v1")
    assert improved.passed and improved.points[0].diff == pytest.approx(-5.0)
    within = no_regression(_series(20.19), champion, PPL, "champion v1")  # 1% of 20 is 0.2
    assert within.passed
    worse = no_regression(_series(20.3), champion, PPL, "champion v1")
    assert not worse.passed
    assert worse.reason == ("perplexity 20.3000 is 0.3000 above champion v1's 20.0000 (allowed regression 0.2, "
                            "±1% of the reference)")
    # McNemar's test pairs per-row correctness: it says nothing of perplexity
    assert worse.paired.available is False and "the gate's metric is perplexity" in worse.paired.reason
    accuracy = Band(metric="accuracy", max_abs_diff=0.001)
    lower_accuracy = no_regression({"points": [{"step": 1, "accuracy": 0.79}]}, {"points": [{"step": 1,
                                   "accuracy": 0.80}]}, accuracy, "champion v1")
    assert not lower_accuracy.passed and "below champion v1's" in lower_accuracy.reason


def test_a_relative_band_scales_with_the_reference_in_both_directions():
    verdict = compare([{"step": 10, "perplexity": 101.5}, {"step": 20, "perplexity": 49.0}],
                      [{"step": 10, "perplexity": 100.0}, {"step": 20, "perplexity": 50.0}], PPL)
    assert [p.passed for p in verdict.points] == [False, False]  # 1.5 > 1.0 and 1.0 > 0.5: parity is both ways
    assert "allowed ±1% of the reference" in verdict.reason
    assert headline(verdict, "fp32").startswith("perplexity +1.5000 vs fp32 at step 10 (allowed ±1% of the reference)")
    close = compare([{"step": 10, "perplexity": 100.9}], [{"step": 10, "perplexity": 100.0}], PPL)
    assert close.passed and close.max_rel_diff == 0.01 and close.better == "lower"


def test_which_way_is_better_comes_from_the_series_then_from_the_metrics_trnflow_knows():
    assert better(_series(1.0), "perplexity") == "lower"
    assert better({"directions": {"bleu": "higher"}}, "bleu") == "higher"
    assert better({"points": []}, "loss") == "lower" and better(None, "auc") == "higher"
    with pytest.raises(DataError, match="does not say whether a higher or a lower bleu is better"):
        better({"points": []}, "bleu")
