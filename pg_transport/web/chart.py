"""Line charts as inline SVG geometry, drawn by the server: no script, no library."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

__all__ = ["Chart", "Line", "chart"]

WIDTH = 600
HEIGHT = 120


@dataclass(frozen=True)
class Line:
    label: str
    css: str
    #: "x,y x,y …" for an SVG polyline.
    points: str
    last: float | None


@dataclass(frozen=True)
class Chart:
    title: str
    width: int
    height: int
    top: float
    start: datetime | None
    end: datetime | None
    lines: list[Line]


def _nice(top: float) -> float:
    """The smallest of 1, 2, 5 times 10^n at or above ``top`` (at least 1)."""
    if top <= 1:
        return 1.0
    scale = 1.0
    while scale * 10 < top:
        scale *= 10
    for step in (1, 2, 5, 10):
        if step * scale >= top:
            return step * scale
    return 10 * scale


def chart(
    title: str,
    series: Sequence[tuple[str, str, Sequence[tuple[datetime, float | None]]]],
    *,
    start: datetime,
    end: datetime,
) -> Chart:
    """Series of (label, css class, [(time, value)]) on a common scale from ``start`` to
    ``end``; a None value breaks nothing, it is left out."""
    values = [v for _, _, points in series for _, v in points if v is not None]
    top = _nice(max(values, default=0.0))
    span = max((end - start).total_seconds(), 1.0)
    lines = []
    for label, css, points in series:
        coords = []
        for at, value in points:
            if value is None:
                continue
            x = (at - start).total_seconds() / span * WIDTH
            y = HEIGHT - value / top * HEIGHT
            coords.append(f"{x:.1f},{y:.1f}")
        known = [v for _, v in points if v is not None]
        lines.append(Line(label, css, " ".join(coords), known[-1] if known else None))
    return Chart(title, WIDTH, HEIGHT, top, start, end, lines)
