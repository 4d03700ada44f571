"""Alerts, made and stored one way by every detector (the learner's health monitor, the aggregator's
per-verdict and window detectors), and raised once per incident."""
from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

from crucible.v1 import alert_pb2

COLUMNS = ["alert_id", "kind", "severity", "message", "details", "ts", "run_id"]
T = TypeVar("T")


def new(alert_id: str, kind: str, message: str, run_id: str, details: Mapping[str, str],
        severity: int = alert_pb2.SEVERITY_WARNING) -> alert_pb2.Alert:
    alert = alert_pb2.Alert(id=alert_id, kind=kind, severity=severity, message=message, run_id=run_id,
                            details=dict(details))
    alert.created_at.FromDatetime(dt.datetime.now(dt.timezone.utc))
    return alert


def row(a: alert_pb2.Alert) -> list:
    """The alert as a row of the `alerts` table (COLUMNS)."""
    return [a.id, a.kind, alert_pb2.Severity.Name(a.severity).removeprefix("SEVERITY_").lower(), a.message,
            dict(a.details), a.created_at.ToDatetime(tzinfo=dt.timezone.utc), a.run_id]


class Incidents:
    """One incident, one alert: a signal is reported when it starts firing, then not again until a
    check finds it quiet (recovered), after which it may fire anew."""

    def __init__(self):
        self.active: set[str] = set()

    def starting(self, firing: Mapping[str, T]) -> list[tuple[str, T]]:
        """Of the signals firing now ({key: evidence}), those that were not firing at the last check."""
        new_ones = [(key, evidence) for key, evidence in firing.items() if key not in self.active]
        self.active = set(firing)
        return new_ones


class Cooldown:
    """One incident, one alert, for signals that come one event at a time (a tampered sample, a paid
    canary): the first event of a key raises its alert; every later one within `seconds` of the
    previous event of that key belongs to the same incident and is only counted. The next alert of
    the key, after a quiet spell, says how many events the last incident held after its first."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic):
        self.seconds = seconds
        self.clock = clock
        self.last: dict[str, float] = {}
        self.held: dict[str, int] = {}

    def admit(self, key: str) -> tuple[bool, int]:
        """(whether this event starts a new incident, events the previous incident held after its first)."""
        now = self.clock()
        last = self.last.get(key)
        self.last[key] = now
        if last is not None and now - last < self.seconds:
            self.held[key] = self.held.get(key, 0) + 1
            return False, 0
        return True, self.held.pop(key, 0)
