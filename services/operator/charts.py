"""The overview's last-hour charts, drawn server-side as SVG (no script, no build step).

Pure functions of the rows the store read: a test can check every bar against the data.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

WIDTH, HEIGHT = 720, 160
LEFT, BOTTOM, TOP = 40, 20, 10


@dataclass(frozen=True)
class MinuteCounts:
    minute: datetime
    succeeded: int
    dead: int


@dataclass(frozen=True)
class LatencyBucket:
    start: datetime
    samples: int
    p50: float | None
    p99: float | None


def minutes(end: datetime, rows: Sequence[dict[str, Any]]) -> list[MinuteCounts]:
    """The 60 minutes ending at ``end``'s minute, oldest first, missing minutes as zero."""
    last = end.replace(second=0, microsecond=0)
    counts: dict[datetime, dict[str, int]] = {}
    for row in rows:
        counts.setdefault(row["minute"], {})[row["status"]] = int(row["tasks"])
    result = []
    for step in range(59, -1, -1):
        minute = last - timedelta(minutes=step)
        by_status = counts.get(minute, {})
        result.append(MinuteCounts(minute, by_status.get("SUCCEEDED", 0), by_status.get("DEAD", 0)))
    return result


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def latency_buckets(
    end: datetime, rows: Sequence[dict[str, Any]], bucket_minutes: int = 5
) -> list[LatencyBucket]:
    last = end.replace(second=0, microsecond=0)
    first = last - timedelta(minutes=60 - bucket_minutes)
    buckets: list[list[float]] = [[] for _ in range(60 // bucket_minutes)]
    for row in rows:
        index = int((row["minute"] - first).total_seconds() // (60 * bucket_minutes))
        if 0 <= index < len(buckets):
            buckets[index].append(float(row["seconds"]))
    return [
        LatencyBucket(
            first + timedelta(minutes=i * bucket_minutes),
            len(values),
            percentile(values, 50),
            percentile(values, 99),
        )
        for i, values in enumerate(buckets)
    ]


def tasks_chart(data: Sequence[MinuteCounts]) -> str:
    """Stacked bars per minute: SUCCEEDED (green) under DEAD (red)."""
    top = max([m.succeeded + m.dead for m in data] + [1])
    plot_w, plot_h = WIDTH - LEFT - 10, HEIGHT - BOTTOM - TOP
    bar_w = plot_w / max(len(data), 1)
    parts = [_frame(f"{top}", "tasks finished per minute, last hour")]
    for i, m in enumerate(data):
        x = LEFT + i * bar_w
        ok_h = plot_h * m.succeeded / top
        dead_h = plot_h * m.dead / top
        base = TOP + plot_h
        label = f"{m.minute:%H:%M} succeeded {m.succeeded}, dead {m.dead}"
        if m.succeeded:
            parts.append(
                f'<rect class="ok" x="{x:.1f}" y="{base - ok_h:.1f}" width="{bar_w * 0.8:.1f}" '
                f'height="{ok_h:.1f}" data-minute="{m.minute:%H:%M}" '
                f'data-succeeded="{m.succeeded}"><title>{label}</title></rect>'
            )
        if m.dead:
            parts.append(
                f'<rect class="dead" x="{x:.1f}" y="{base - ok_h - dead_h:.1f}" '
                f'width="{bar_w * 0.8:.1f}" height="{dead_h:.1f}" data-minute="{m.minute:%H:%M}" '
                f'data-dead="{m.dead}"><title>{label}</title></rect>'
            )
    return _svg(parts, "Tasks finished per minute")


def latency_chart(data: Sequence[LatencyBucket]) -> str:
    """publish->searchable p50 and p99 per bucket, as two polylines (seconds)."""
    values = [v for b in data for v in (b.p50, b.p99) if v is not None]
    top = max([*values, 1.0])
    plot_w, plot_h = WIDTH - LEFT - 10, HEIGHT - BOTTOM - TOP
    step = plot_w / max(len(data), 1)
    parts = [
        _frame(f"{top:.1f}s", "publish → searchable per 5 minutes:"),
        f'<text class="caption p50" x="{LEFT + 230}" y="{HEIGHT - 4}">● p50</text>',
        f'<text class="caption p99" x="{LEFT + 280}" y="{HEIGHT - 4}">● p99</text>',
    ]
    series: dict[str, list[float | None]] = {
        "p50": [b.p50 for b in data],
        "p99": [b.p99 for b in data],
    }
    for name, values_of in series.items():
        points = [
            (LEFT + (i + 0.5) * step, TOP + plot_h - plot_h * value / top)
            for i, value in enumerate(values_of)
            if value is not None
        ]
        if points:
            joined = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
            parts.append(f'<polyline class="{name}" fill="none" points="{joined}"/>')
            parts.extend(
                f'<circle class="{name}" cx="{x:.1f}" cy="{y:.1f}" r="2.5"/>' for x, y in points
            )
    return _svg(parts, "Publish to searchable latency")


def _frame(top_label: str, caption: str) -> str:
    base = HEIGHT - BOTTOM
    return (
        f'<line class="axis" x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{base}"/>'
        f'<line class="axis" x1="{LEFT}" y1="{base}" x2="{WIDTH - 10}" y2="{base}"/>'
        f'<text class="tick" x="{LEFT - 4}" y="{TOP + 8}" text-anchor="end">{top_label}</text>'
        f'<text class="tick" x="{LEFT - 4}" y="{base}" text-anchor="end">0</text>'
        f'<text class="caption" x="{LEFT + 4}" y="{HEIGHT - 4}">{caption}</text>'
    )


def _svg(parts: list[str], title: str) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" '
        f'role="img" aria-label="{title}" class="chart">' + "".join(parts) + "</svg>"
    )
