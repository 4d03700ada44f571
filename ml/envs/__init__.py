"""Environments: multi-turn tasks where the model calls tools and the environment answers.

    from crucible.ml import envs
    env = envs.get("sql")                      # UnknownEnvironment (a ValueError) for a name nobody registered
    envs.is_environment(task)                  # its kind names an environment
    tasks = env.generate("train", seed=1)      # procedural tasks; "heldout" never overlaps "train"

A task of an environment has `kind` = the environment's name (environments and task kinds share
one namespace) and an `environment` payload. Built-in: python, sql, logs, events, lookup.
See base.py (what an environment is), calls.py (tool-call formats) and episode.py (an episode's steps).
"""
from __future__ import annotations

from crucible.ml.envs.base import Call, Environment, InstanceError, Observation, Tool
from crucible.ml.names import Registry


class UnknownEnvironment(ValueError):
    """A name no environment is registered under; the text lists the known ones."""


_ENVS: Registry[Environment] = Registry("environment", "environments", UnknownEnvironment)
register, known, get = _ENVS.register, _ENVS.known, _ENVS.get


def is_environment(task_or_kind) -> bool:
    kind = task_or_kind if isinstance(task_or_kind, str) else task_or_kind.kind
    return kind in _ENVS


from crucible.ml.envs import events, logs, lookup, python_env, sql  # noqa: E402,F401  (registration)

__all__ = ["Call", "Environment", "InstanceError", "Observation", "Tool", "UnknownEnvironment", "get",
           "is_environment", "known", "register"]
