"""The learner's rows in the store: one per step, one per published version, one per alert."""
from __future__ import annotations

import datetime as dt

from crucible.shared import alerts
from crucible.shared.store import writes
from crucible.v1 import alert_pb2

TRAIN_STEP_COLUMNS = ["run_id", "step", "policy_version", "loss", "kl", "entropy", "grad_norm", "reward_mean",
                      "pass_rate", "lr", "step_time_ms", "ts", "samples"]
VERSION_COLUMNS = ["run_id", "version", "checkpoint_uri", "step", "created_at", "metrics"]


def step_entry(version: int, step: int, checkpoint_uri: str, metrics: dict, skipped: dict,
               samples: list[str]) -> dict:
    """What a step's rows are written from: plain JSON, so that it rides in the checkpoints written
    until its rows are in the store (a learner killed before then writes them when it starts)."""
    return {"version": version, "step": step, "checkpoint_uri": checkpoint_uri,
            "metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float))},
            "skipped": dict(skipped), "samples": list(samples)}


def record_steps(client, run_id: str, entries: list[dict]) -> None:
    """The steps' rows (each with the ids of the samples it trained on) and their versions', in one
    insert a table; written again, the same rows replace the earlier ones."""
    if not entries:
        return
    now = dt.datetime.now(dt.timezone.utc)
    steps, versions = [], []
    for e in entries:
        m = e["metrics"]
        steps.append([run_id, e["step"], e["version"], *(m.get(k, 0.0) for k in (
            "loss", "kl", "entropy", "grad_norm", "reward_mean", "pass_rate", "learning_rate", "step_ms")),
            now, e["samples"]])
        versions.append([run_id, e["version"], e["checkpoint_uri"], e["step"], now, {k: float(v) for k, v in m.items()}])
    writes.insert(client, "train_steps", steps, column_names=TRAIN_STEP_COLUMNS)
    writes.insert(client, "policy_versions", versions, column_names=VERSION_COLUMNS)


def record_alert(client, alert: alert_pb2.Alert) -> None:
    writes.insert(client, "alerts", [alerts.row(alert)], alerts.COLUMNS)
