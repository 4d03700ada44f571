"""What makes a Task acceptable: checked once, where a task enters (the generator, the first consumer of
crucible.tasks; Control.SubmitTasks answers a gRPC caller with the same list before publishing)."""
from __future__ import annotations

from crucible.v1 import task_pb2
from crucible.ml import envs, kinds
from crucible.shared.settings import Settings, get_settings
from crucible.shared.text import shown


HELDOUT_SPLIT = "heldout"


def is_heldout(task: task_pb2.Task) -> bool:
    """Held-out tasks measure the policy; nothing ever trains on them."""
    return task.split == HELDOUT_SPLIT


def training_submission_problems(tasks) -> list[str]:
    """What makes tasks submitted together to crucible.tasks (sampled for training) unfit, beyond each
    one's task_problems: a held-out task, and an id two of them share (the task log keeps one row an id)."""
    problems, seen = [], set()
    for task in tasks:
        if is_heldout(task):
            problems.append(f"task {task.id!r} has split {task.split!r}: crucible.tasks is sampled for training, "
                            "which never takes a held-out task (give held-out tasks to a recipe's [heldout] file)")
        if task.id in seen:
            problems.append(f"task id {task.id!r} is given twice")
        seen.add(task.id)
    return problems


# What google.protobuf.Timestamp can hold (0001-01-01 to 9999-12-31): a task stamped outside it was taken,
# and then every writer of its row (control's task log) failed on it.
_TIMESTAMP_MIN_S, _TIMESTAMP_MAX_S = -62_135_596_800, 253_402_300_799


def task_problems(task: task_pb2.Task, settings: Settings | None = None) -> list[str]:
    """Everything wrong with `task`, each as a sentence a publisher can act on; [] when it is fine."""
    settings = settings or get_settings()
    size = task.ByteSize()
    if size > settings.max_task_bytes:  # nothing more is looked at: the checks below cost with the size
        return [f"the task is {size:,} bytes encoded: at most {settings.max_task_bytes:,} (CRUCIBLE_MAX_TASK_BYTES)"]
    problems = []
    if not task.id.strip():
        problems.append("id is empty: give every task a unique id")
    elif len(task.id) > 256:
        problems.append(f"id is {len(task.id)} characters long: at most 256")
    # An id is printed and compared as written: one a terminal would act on, or that differs from
    # another only by surrounding whitespace ("a" and "a "), would be shown as something it is not.
    elif shown(task.id) != task.id:
        problems.append(f"id '{shown(task.id)}' holds control or invisible characters (shown escaped): "
                        "task ids may hold none (no ESC, NUL, newline, U+202E, zero-width characters)")
    elif task.id != task.id.strip():
        problems.append(f"id '{task.id}' begins or ends with whitespace: remove it (\"a\" and \"a \" "
                        "would be two tasks)")
    if not task.prompt.strip():
        problems.append("prompt is empty")
    elif len(task.prompt) > settings.max_prompt_chars:
        problems.append(f"prompt is {len(task.prompt)} characters long: at most {settings.max_prompt_chars}")
    if task.HasField("created_at") and not (_TIMESTAMP_MIN_S <= task.created_at.seconds <= _TIMESTAMP_MAX_S
                                            and 0 <= task.created_at.nanos < 1_000_000_000):
        problems.append(f"created_at {task.created_at.seconds}s is not a time (years 1 to 9999)")
    if task.group_size < 1:
        problems.append("group_size must be at least 1")
    elif task.group_size > settings.max_group_size:
        problems.append(f"group_size {task.group_size} is above the limit of {settings.max_group_size} "
                        "(CRUCIBLE_MAX_GROUP_SIZE)")
    if task.WhichOneof("payload") == "python_tests" and task.python_tests.timeout_s > settings.sandbox_wall_s:
        problems.append(f"python_tests.timeout_s {task.python_tests.timeout_s} is above the sandbox's wall clock "
                        f"of {settings.sandbox_wall_s}s (CRUCIBLE_SANDBOX_WALL_S): every run would be refused")
    if envs.is_environment(task):
        problems += kinds.problems_of(envs.get(task.kind), task)
        return problems
    try:
        problems += kinds.problems_of(kinds.get(task.kind), task)
    except kinds.UnknownKind as exc:
        problems.append(f"{exc}; environments are {', '.join(envs.known())}")
    return problems
