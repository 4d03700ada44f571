"""The learner's rows in the store: one per step, one per published version, one per alert."""
from __future__ import annotations

import datetime as dt

from crucible.shared import alerts
from crucible.shared.store import writes
from crucible.v1 import alert_pb2, policy_pb2

TRAIN_STEP_COLUMNS = ["run_id", "step", "policy_version", "loss", "kl", "entropy", "grad_norm", "reward_mean",
                      "pass_rate", "lr", "step_time_ms", "ts", "samples"]


def record_step(client, pv: policy_pb2.PolicyVersion, metrics: dict, samples: list[str]) -> None:
    """The step's row (with the ids of the samples it trained on) and its version's; written again,
    the same rows replace the earlier ones."""
    m = pv.metrics
    now = dt.datetime.now(dt.timezone.utc)
    writes.insert(client, "train_steps", [[pv.run_id, pv.step, pv.version, m.loss, m.kl, m.entropy, m.grad_norm,
                                   m.reward_mean, m.pass_rate, m.learning_rate, m.step_ms, now, samples]],
                  column_names=TRAIN_STEP_COLUMNS)
    numeric = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
    writes.insert(client, "policy_versions", [[pv.run_id, pv.version, pv.checkpoint_uri, pv.step, now, numeric]],
                  column_names=["run_id", "version", "checkpoint_uri", "step", "created_at", "metrics"])


def record_alert(client, alert: alert_pb2.Alert) -> None:
    writes.insert(client, "alerts", [alerts.row(alert)], alerts.COLUMNS)
