"""Retrieval metrics with graded relevance, as BEIR reports them (pytrec_eval's definitions).

A ranking is a list of unit ids (a unit is what was judged: a section, a passage), best
first, each id once. Judgments map unit ids to grades: 0 = judged not relevant, 1 =
relevant, 2 = highly relevant. Gains are linear in the grade (gain = grade) and discounted by
log2(rank + 1); recall and MRR count every unit of grade >= 1 as relevant.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass


def dedupe(units: Iterable[str]) -> list[str]:
    """Unit ids in first-seen order: two chunks of one section count once, at the rank of
    the better one."""
    seen: set[str] = set()
    out: list[str] = []
    for unit in units:
        if unit not in seen:
            seen.add(unit)
            out.append(unit)
    return out


def dcg(grades: Sequence[int], k: int) -> float:
    return sum(g / math.log2(i + 2) for i, g in enumerate(grades[:k]) if g > 0)


def ndcg_at(ranking: Sequence[str], judgments: Mapping[str, int], k: int) -> float:
    ideal = dcg(sorted(judgments.values(), reverse=True), k)
    if ideal == 0:
        return 0.0
    return dcg([judgments.get(unit, 0) for unit in ranking], k) / ideal


def recall_at(ranking: Sequence[str], judgments: Mapping[str, int], k: int) -> float:
    relevant = {unit for unit, grade in judgments.items() if grade > 0}
    if not relevant:
        return 0.0
    return len(relevant.intersection(ranking[:k])) / len(relevant)


def mrr_at(ranking: Sequence[str], judgments: Mapping[str, int], k: int) -> float:
    for rank, unit in enumerate(ranking[:k], start=1):
        if judgments.get(unit, 0) > 0:
            return 1.0 / rank
    return 0.0


@dataclass(frozen=True)
class Scores:
    ndcg10: float
    recall10: float
    mrr10: float


def score(ranking: Sequence[str], judgments: Mapping[str, int], k: int = 10) -> Scores:
    ranking = dedupe(ranking)
    return Scores(
        ndcg_at(ranking, judgments, k),
        recall_at(ranking, judgments, k),
        mrr_at(ranking, judgments, k),
    )


def mean(scores: Sequence[Scores]) -> Scores:
    n = len(scores)
    if n == 0:
        return Scores(0.0, 0.0, 0.0)
    return Scores(
        sum(s.ndcg10 for s in scores) / n,
        sum(s.recall10 for s in scores) / n,
        sum(s.mrr10 for s in scores) / n,
    )
