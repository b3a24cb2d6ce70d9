"""The search quality bench's metrics against examples computed by hand."""

from __future__ import annotations

import math

import pytest

from bench.quality_metrics import Scores, dedupe, mean, mrr_at, ndcg_at, recall_at, score

# Judged: a highly relevant (2), b and c relevant (1), x judged not relevant (0).
JUDGMENTS = {"a": 2, "b": 1, "c": 1, "x": 0}


def test_ndcg_with_graded_gains_by_hand() -> None:
    ranking = ["x", "b", "a", "y"]
    # DCG = 0/log2(2) + 1/log2(3) + 2/log2(4) + 0 = 0.63093 + 1.0 = 1.63093
    # ideal order a, b, c: 2/log2(2) + 1/log2(3) + 1/log2(4) = 2 + 0.63093 + 0.5 = 3.13093
    assert ndcg_at(ranking, JUDGMENTS, 10) == pytest.approx(1.6309298 / 3.1309298, abs=1e-6)
    assert ndcg_at(ranking, JUDGMENTS, 10) == pytest.approx(0.520909, abs=1e-6)


def test_ndcg_cut_at_k_and_perfect_order() -> None:
    assert ndcg_at(["a", "b", "c"], JUDGMENTS, 10) == pytest.approx(1.0)
    # At k=1 only the first place counts: b (gain 1) against the ideal a (gain 2).
    assert ndcg_at(["b", "a"], JUDGMENTS, 1) == pytest.approx(0.5)
    # A relevant unit below the cut-off earns nothing.
    assert ndcg_at([f"n{i}" for i in range(10)] + ["a"], JUDGMENTS, 10) == 0.0


def test_ndcg_swapping_grades_changes_the_score() -> None:
    # Binary relevance would score these two rankings the same; graded gains do not.
    high_first = ndcg_at(["a", "b"], JUDGMENTS, 10)
    low_first = ndcg_at(["b", "a"], JUDGMENTS, 10)
    assert high_first > low_first
    assert low_first == pytest.approx((1 + 2 / math.log2(3)) / (2 + 1 / math.log2(3) + 0.5))


def test_recall_counts_every_relevant_grade_once() -> None:
    assert recall_at(["x", "b", "a", "y"], JUDGMENTS, 10) == pytest.approx(2 / 3)
    assert recall_at(["x", "b", "a", "y"], JUDGMENTS, 2) == pytest.approx(1 / 3)
    assert recall_at(["y"], {"a": 0}, 10) == 0.0


def test_mrr_is_the_first_relevant_rank() -> None:
    assert mrr_at(["x", "y", "c", "a"], JUDGMENTS, 10) == pytest.approx(1 / 3)
    assert mrr_at(["x", "y", "c"], JUDGMENTS, 2) == 0.0


def test_two_chunks_of_one_unit_count_once_at_the_better_rank() -> None:
    assert dedupe(["b", "b", "x", "a", "b"]) == ["b", "x", "a"]
    # Without dedupe the second "b" would push "a" to rank 3 and count b's gain twice.
    assert score(["b", "b", "a"], JUDGMENTS) == score(["b", "a"], JUDGMENTS)
    assert score(["b", "b", "a"], JUDGMENTS).ndcg10 == pytest.approx(
        (1 + 2 / math.log2(3)) / (2 + 1 / math.log2(3) + 0.5)
    )


def test_mean_of_scores() -> None:
    total = mean([Scores(1.0, 0.5, 1.0), Scores(0.0, 0.5, 0.5)])
    assert total == Scores(0.5, 0.5, 0.75)
    assert mean([]) == Scores(0.0, 0.0, 0.0)
