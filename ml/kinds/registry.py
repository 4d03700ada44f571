"""The task-kind registry: what each kind of task is, in one place every service consults.

A kind says which payload of `Task` it reads, how its prompt is rendered for
the policy, what (if anything) the sandbox must run for a completion, and how a
completion (with that run's result) becomes a `Score`. The generator renders
with it, the sandbox-executor asks it for jobs, the verifier scores with it,
and `crucible.ml.tasks.task_problems` rejects what no kind knows.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from crucible.ml.names import Registry
from crucible.v1 import execution_pb2, task_pb2


class UnknownKind(ValueError):
    """A task names a kind the registry does not know; the text lists the known ones."""


@dataclass(frozen=True)
class Score:
    """A kind's judgement of one completion: components first, a default scalar on top.

    `reward` is what the kind would pay by default; the aggregator may weight
    the components differently. A tampered score pays nothing whatever else it earned.
    """

    components: dict[str, float] = field(default_factory=dict)
    reward: float = 0.0
    tampered: bool = False
    patterns: tuple[str, ...] = ()
    detail: str = ""

    def __post_init__(self):
        reward = self.reward if math.isfinite(self.reward) else 0.0
        object.__setattr__(self, "reward", 0.0 if self.tampered else min(1.0, max(0.0, reward)))

    @property
    def passed(self) -> bool:
        """Solved: the full default reward, honestly earned (every test passed, the answer right).
        The one definition of a pass; pass rates everywhere count this."""
        return not self.tampered and self.reward >= 1.0


class Kind(ABC):
    """One kind of task. Subclasses set `name` and `payload` and implement what differs."""

    name: str = ""
    payload: str | None = None  # the Task oneof field this kind reads; None: none needed
    format_hint: str = ""       # appended to the prompt so a policy knows how to answer

    def problems(self, task: task_pb2.Task) -> list[str]:
        """What is wrong with this kind's payload, as sentences a publisher can act on; [] if fine."""
        if self.payload and task.WhichOneof("payload") != self.payload:
            return [f"kind {self.name!r} needs a {self.payload!r} payload, got {task.WhichOneof('payload') or 'none'}"]
        return []

    def render_prompt(self, task: task_pb2.Task) -> str:
        """The text the policy continues. `metadata["prompt_format"] = "raw"` leaves the prompt as it is."""
        if not self.format_hint or task.metadata.get("prompt_format") == "raw":
            return task.prompt
        return f"{task.prompt.rstrip()}\n\n{self.format_hint}"

    def execution(self, task: task_pb2.Task, completion: str) -> execution_pb2.ExecuteRequest | None:
        """The sandbox job a completion needs before it can be scored; None for answer-only kinds."""
        return None

    @abstractmethod
    def score(self, task: task_pb2.Task, completion: str,
              execution: execution_pb2.ExecutionResult | None = None) -> Score:
        """Scores one completion. Pure: the same inputs give the same Score."""

    @property
    def needs_execution(self) -> bool:
        return type(self).execution is not Kind.execution


_KINDS: Registry[Kind] = Registry("kind", "kinds", UnknownKind)
register, known, get = _KINDS.register, _KINDS.known, _KINDS.get


def problems_of(checker, task: task_pb2.Task) -> list[str]:
    """`checker.problems(task)` (a kind's or an environment's), where whatever a check raises on some
    input (a regex too large to compile, code nested too deep to parse, memory) is itself the problem:
    a task is refused, never the service that reads it."""
    try:
        return checker.problems(task)
    except Exception as exc:  # noqa: BLE001 -- any input that breaks a check is unacceptable input
        return [f"the {task.kind or 'task'} payload cannot be checked: {type(exc).__name__}: {str(exc)[:200]}"]


def kind_of(task: task_pb2.Task) -> Kind:
    return get(task.kind)


def render_prompt(task: task_pb2.Task) -> str:
    """What the policy sees for `task`: its kind's rendering (the prompt plus the answer format asked for)."""
    return kind_of(task).render_prompt(task)
