"""Structural checks every service applies to a Task before acting on it."""
from __future__ import annotations

from crucible.v1 import task_pb2
from shared.settings import Settings, get_settings

# Which payload each built-in kind carries; kinds not listed here are unknown.
KIND_PAYLOADS: dict[str, str | None] = {
    "python_tests": "python_tests",
    "math_answer": "answer",
    "exact": "answer",
    "regex": "answer",
    "reasoning_gym": "generator",
}


def task_problems(task: task_pb2.Task, settings: Settings | None = None) -> list[str]:
    """Everything wrong with `task`, each as a sentence a publisher can act on; [] when it is fine."""
    settings = settings or get_settings()
    problems = []
    if not task.id.strip():
        problems.append("id is empty: give every task a unique id")
    elif len(task.id) > 256:
        problems.append(f"id is {len(task.id)} characters long: at most 256")
    if not task.prompt.strip():
        problems.append("prompt is empty")
    elif len(task.prompt) > settings.max_prompt_chars:
        problems.append(f"prompt is {len(task.prompt)} characters long: at most {settings.max_prompt_chars}")
    if task.group_size < 1:
        problems.append("group_size must be at least 1")
    elif task.group_size > settings.max_group_size:
        problems.append(f"group_size {task.group_size} is above the limit of {settings.max_group_size} "
                        "(CRUCIBLE_MAX_GROUP_SIZE)")
    if task.kind not in KIND_PAYLOADS:
        problems.append(f"unknown kind {task.kind!r}: known kinds are {', '.join(sorted(KIND_PAYLOADS))}")
    else:
        payload = task.WhichOneof("payload")
        wanted = KIND_PAYLOADS[task.kind]
        if wanted and payload != wanted:
            problems.append(f"kind {task.kind!r} needs a {wanted!r} payload, got {payload or 'none'}")
    return problems


def python_program(task: task_pb2.Task, completion: str) -> str:
    """The program a python_tests completion stands for.

    A completion that defines the entry point is a whole program; otherwise it
    continues the prompt (HumanEval style: signature and docstring, then the body).
    """
    entry = task.python_tests.entry_point
    if entry and (f"def {entry}(" in completion or f"def {entry} (" in completion):
        return completion
    return task.prompt + completion
