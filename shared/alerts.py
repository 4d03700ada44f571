"""Alerts, made and stored one way by every detector (the learner's health monitor, the aggregator's
per-verdict and window detectors), and raised once per incident."""
from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import TypeVar

from crucible.v1 import alert_pb2

COLUMNS = ["alert_id", "kind", "severity", "message", "details", "ts"]
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
            dict(a.details), a.created_at.ToDatetime(tzinfo=dt.timezone.utc)]


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
