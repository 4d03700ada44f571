"""`lookup`: the answer is in a table only a tool call can read.

"color of b?" -> the model calls `@lookup b` (plain) or `lookup(key="b")` (Hermes), reads `tan`, and
answers `tan`. Each task has its own table, so no answer can be remembered: a guess is right one
time in five, a call and a faithful copy every time. Small enough that the built-in 0.7M policy,
warm-started on the call format only (`format_examples`), learns from rewards on a CPU to call and
to answer with what the tool said.
"""
from __future__ import annotations

import random
from collections.abc import Iterator

from crucible.ml import envs
from crucible.ml.envs.base import Call, Environment, InstanceError, Observation, Tool, split_of

KEYS = "abcdefgh"
VALUES = ("red", "tan", "jet", "ash", "sky")


class Lookup(Environment):
    name = "lookup"
    description = "Read a value from the task's own table."
    tools = (Tool("lookup", "The value stored under a key.", {"key": "the key, one letter"}),)
    max_turns = 3

    def check_instance(self, data: dict) -> None:
        table, key = data.get("table"), data.get("key")
        if not isinstance(table, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in table.items()):
            raise InstanceError("lookup needs 'table': an object of string keys to string values")
        if key not in table:
            raise InstanceError("lookup needs 'key': one of the table's keys")

    def observe(self, task, earlier, call, result=None) -> Observation:
        table = self.instance(task)["table"]
        key = call.arguments["key"].strip()
        if key not in table:
            return Observation(f"error: no key {key[:20]!r}; the keys are {', '.join(sorted(table))}", failed=True)
        return Observation(table[key])

    def check_answer(self, task, answer: str, calls: list[Call]) -> dict[str, float]:
        data = self.instance(task)
        return {"answer_correct": float(_said(answer) == _said(data["table"][data["key"]]))}

    def generate(self, split: str, *, seed: int, group_size: int = 8) -> Iterator:
        """An endless, seeded stream of one split's tasks. The value asked about is balanced: tasks come
        in blocks that ask for each of `VALUES` once, in random order (the rest of each table is drawn
        at random). Asked values drawn at random let a step's own mix push a policy that does not yet
        read the tool's answer towards whichever value the step asked for most, and its answers swung
        from step to step instead of following the observation (as the digits family's did)."""
        rng = random.Random(seed)
        owed: list[str] = []
        while True:
            if not owed:
                owed = list(VALUES)
                rng.shuffle(owed)
            keys = rng.sample(KEYS, 3)
            table = {k: rng.choice(VALUES) for k in keys}
            key = rng.choice(keys)
            table[key] = owed[-1]
            identity = f"{sorted(table.items())}:{key}"
            if split_of(identity) != split:
                continue
            owed.pop()
            yield self.task(f"color of {key}?", {"table": table, "key": key}, split=split,
                            key=f"{identity}:{rng.randrange(1 << 30)}", group_size=group_size)

    def reference(self, task) -> list[str]:
        data = self.instance(task)
        return [f"@lookup {data['key']}", data["table"][data["key"]]]

    def format_examples(self, count: int, *, seed: int) -> list[list[str]]:
        """Turns for a warm start that teach the format only: half the examples answer at once,
        half call the tool with the key asked about; every answer is a random value, so nothing
        about *which* answer is right is taught (that comes from rewards). Each example is
        [prompt, turn, observation, turn, ...]."""
        rng = random.Random(seed)
        tasks = self.generate("train", seed=seed + 1, group_size=1)
        out = []
        for _ in range(count):
            task = next(tasks)
            data = self.instance(task)
            answer = rng.choice(VALUES)
            if rng.random() < 0.5:
                out.append([task.prompt, answer])
            else:
                out.append([task.prompt, f"@lookup {data['key']}", data["table"][data["key"]], answer])
        return out


envs.register(Lookup())


def _said(value: str) -> str:
    """A value as an answer states it: case, surrounding space and a sentence's final period aside."""
    return value.strip().removesuffix(".").strip().lower()
