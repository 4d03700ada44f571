"""Task kinds: how each kind of task is prompted, executed and scored (see registry.py).

    from crucible.ml import kinds
    kind = kinds.get(task.kind)            # UnknownKind (a ValueError) for a kind nobody registered
    prompt = kind.render_prompt(task)
    job = kind.execution(task, completion)  # an ExecuteRequest for the sandbox, or None
    score = kind.score(task, completion, execution_result)

Built-in kinds: python_tests, math_answer, exact, regex, reasoning_gym.
Heavy libraries (math-verify, reasoning-gym) load only when a kind needs them.
"""
from crucible.ml.kinds.registry import (Kind, Score, UnknownKind, get, kind_of, known, problems_of, register,
                                        render_prompt)
from crucible.ml.kinds import answers, math_answer, planted, python_tests, reasoning_gym_kind  # noqa: F401  (registration)

__all__ = ["Kind", "Score", "UnknownKind", "get", "kind_of", "known", "problems_of", "register", "render_prompt"]
