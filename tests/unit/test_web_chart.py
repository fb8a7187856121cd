"""The console's pure parts: chart geometry and rates between samples."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from pg_transport.web.chart import chart
from pg_transport.web.sampler import rates

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def test_points_span_the_window_and_the_scale_is_the_next_round_number() -> None:
    drawn = chart(
        "depth",
        [("waiting", "waiting", [(T0, 0.0), (T0 + timedelta(seconds=30), 130.0)])],
        start=T0,
        end=T0 + timedelta(seconds=60),
    )
    assert drawn.top == 200
    (line,) = drawn.lines
    assert line.points == "0.0,120.0 300.0,42.0"
    assert line.last == 130.0


def test_unknown_values_are_left_out_not_drawn_as_zero() -> None:
    drawn = chart(
        "rates",
        [("published", "published", [(T0, None), (T0 + timedelta(seconds=10), 4.0)])],
        start=T0,
        end=T0 + timedelta(seconds=10),
    )
    assert drawn.top == 5 and drawn.lines[0].points == "600.0,24.0"


def test_rates_are_per_second_between_ticks_and_a_reset_counter_gives_none() -> None:
    ticks = [
        (T0, T0, 100, 50),
        (T0, T0 + timedelta(seconds=10), 300, 150),
        (T0, T0 + timedelta(seconds=20), 10, 160),  # statistics reset: inserted went back
    ]
    got = rates(ticks)
    assert [(r.inserted, r.deleted) for r in got] == [(20.0, 10.0), (None, 1.0)]
