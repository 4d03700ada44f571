"""Pure logic of the control plane: submitted tasks in, bus records and store rows out."""
from __future__ import annotations

import datetime as dt
import uuid

from crucible.v1 import task_pb2
from crucible.shared import messages
from crucible.shared.settings import Settings
from crucible.ml.tasks import task_problems

TASK_COLUMNS = ["task_id", "kind", "split", "prompt", "group_size", "payload_json", "metadata",
                "trace_id", "submitted_at", "run_id", "task_json"]


def prepare_submission(task: task_pb2.Task, settings: Settings, now: dt.datetime | None = None) -> task_pb2.Task:
    """A copy of `task` ready to publish (id and created_at filled in), or ValueError naming every problem."""
    task = task_pb2.Task.FromString(task.SerializeToString())
    if not task.id:
        task.id = uuid.uuid4().hex
    if not task.HasField("created_at"):
        task.created_at.FromDatetime(now or dt.datetime.now(dt.timezone.utc))
    problems = task_problems(task, settings)
    if problems:
        raise ValueError(f"task {task.id!r}: " + "; ".join(problems))
    return task


def task_row(task: task_pb2.Task, trace_id: str, run_id: str = "") -> list:
    """One row of the `tasks` table for a consumed task (of run `run_id`)."""
    payload = task.WhichOneof("payload")
    payload_json = messages.to_json(getattr(task, payload)) if payload else ""
    submitted = task.created_at.ToDatetime(tzinfo=dt.timezone.utc) if task.HasField("created_at") else \
        dt.datetime.now(dt.timezone.utc)
    return [task.id, task.kind, task.split or "train", task.prompt, task.group_size, payload_json,
            dict(task.metadata), trace_id, submitted, run_id, messages.to_json(task)]
