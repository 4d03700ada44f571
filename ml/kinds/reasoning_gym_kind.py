"""`reasoning_gym`: any of reasoning-gym's seeded generators, scored by that generator's own scorer.

The reward is 1 for an answer the scorer calls right (its value 1) and 0 otherwise: the scorers' partial
credit is mostly for wrong answers that contain the right one. An answer that writes several numbers
where the reference is one number is not paid (a hedge), nor one that writes NaN or infinity where the
reference does not (comparisons with NaN are false: a sorting scorer paid a list of NaNs, another
`min(1, exp(-nan))`, which is 1).

Every instance is also tried, when its task comes in, with answers that ignore it (True, False, 0, an
empty list, the reference with its numbers made NaN...): a scorer that pays one of them cannot tell a
right answer from a wrong one there (game_of_life_halting paid any answer at all), and the task is
refused with the answer it paid.

A task's GeneratorSpec names the generator, a seed and an optional config
(JSON); the instance is `create_dataset(name, seed=seed, size=1, **config)[0]`,
re-created here rather than read back from `entry_json`, so the scorer sees
exactly the types the generator made (a JSON round trip turns ARC's tuple
grids into lists, which its scorer then rejects). `entry_json` travels for
people and stores to read.
"""
from __future__ import annotations

import functools
import json
import math
import re
import unicodedata

from crucible.v1 import execution_pb2, task_pb2
from crucible.ml.kinds.extract import NUMBER, final_answer, hedges, numbers, value_of
from crucible.ml.kinds.registry import Kind, Score, register

FORMAT_HINT = "Give only the final answer between <answer> and </answer>."


def generators() -> list[str]:
    """Every generator the installed reasoning-gym offers."""
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


@functools.lru_cache(maxsize=1024)
def _instance(name: str, seed: int, config_json: str) -> tuple[object, dict]:
    from reasoning_gym.factory import create_dataset

    config = json.loads(config_json) if config_json else {}
    dataset = create_dataset(name, **{**config, "seed": seed, "size": 1})
    return dataset, dataset[0]


def instance(spec: task_pb2.GeneratorSpec) -> tuple[object, dict]:
    """(the dataset, the generated entry) a spec stands for; cached, since a group's rollouts share one task
    (building some generators' datasets takes milliseconds: word lists, puzzles)."""
    return _instance(spec.name, spec.seed, spec.config_json)


def spec_problems(spec: task_pb2.GeneratorSpec) -> list[str]:
    known = generators()
    if spec.name not in known:
        return [f"generator.name {spec.name!r} is not a reasoning-gym generator: known ones include "
                f"{', '.join(known[:12])}, ... ({len(known)} in all)"]
    if spec.config_json:
        try:
            config = json.loads(spec.config_json)
        except json.JSONDecodeError as exc:
            return [f"generator.config_json is not JSON: {exc}"]
        if not isinstance(config, dict):
            return ["generator.config_json must be a JSON object of the generator's config fields"]
    try:
        instance(spec)
    except Exception as exc:  # the generator's own validation: bad config fields or values
        return [f"generator {spec.name!r} rejects seed {spec.seed} with config {spec.config_json or '{}'}: "
                f"{type(exc).__name__}: {exc}"]
    paid = _pays_an_answer_that_ignores_it(spec.name, spec.seed, spec.config_json)
    if paid is not None:
        return [f"generator {spec.name!r} (seed {spec.seed}) pays the answer {paid!r}, which ignores the question: "
                "its scorer cannot tell a right answer from a wrong one there"]
    return []


# Answers that say nothing about any question, and (below) the reference with its numbers made NaN or infinite.
_IGNORING = ("", "0", "1", "-1", "yes", "no", "True", "False", "None", "[]", "{}", "()", "x", "banana", "NaN", "inf",
             "-inf")
_NON_FINITE = re.compile(r"\b(?:nan|inf|infinity)\b|∞", re.IGNORECASE)


@functools.lru_cache(maxsize=4096)
def _pays_an_answer_that_ignores_it(name: str, seed: int, config_json: str) -> str | None:
    """An answer that ignores the instance which its scorer pays in full (as `verdict` judges), or None."""
    dataset, entry = _instance(name, seed, config_json)
    expected = str(entry.get("answer", ""))
    probes = [*_IGNORING, NUMBER.sub("NaN", expected), NUMBER.sub("inf", expected)]
    for probe in dict.fromkeys(probes):
        if _same_answer(probe, expected):
            continue  # the reference itself (a yes/no question's "yes", a sum's 0)
        try:
            if verdict(dataset, entry, probe)[2]:
                return probe
        except Exception:  # noqa: BLE001 -- a scorer that raises on nonsense pays nothing for it
            continue
    return None


def _same_answer(probe: str, expected: str) -> bool:
    if probe.strip().lower() == expected.strip().lower():
        return True
    wanted, written = numbers(expected), numbers(probe)
    if len(wanted) != 1 or len(written) != 1 or wanted[0] != expected.strip() or written[0] != probe.strip():
        return False
    try:
        return value_of(written[0]) == value_of(wanted[0])
    except ValueError:
        return False


def verdict(dataset, entry: dict, answer: str, strict: bool = False) -> tuple[float, bool, bool]:
    """(the scorer's value, whether the answer hedges, whether it is paid) for an answer's text. `strict`
    (an instance whose scorer pays what is not its reference: _lenient): paid only as the reference is
    written, whatever the scorer says."""
    try:
        raw = dataset.score_answer(answer, entry)
    except Exception:  # noqa: BLE001 -- a scorer that cannot read an answer ("I don't know" as an int) pays nothing
        raw = 0.0
    value = float(raw) if isinstance(raw, (int, float)) and math.isfinite(raw) else 0.0
    value = min(1.0, max(0.0, value))
    expected = str(entry.get("answer", ""))
    # Paid for a right answer only. reasoning-gym's default scorer gives an answer that contains the
    # right one len(right)/len(answer) ("26600" for 2660: 0.8), and some scorers take the first number
    # they find ("20 0 1 2 3" for 20: 1.0): neither is the answer. The scorer's value stays a component.
    hedged = hedges(answer, expected) or (_NON_FINITE.search(_as_read(answer)) is not None
                                           and _NON_FINITE.search(_as_read(expected)) is None)
    if strict and value >= 1.0 and not hedged:
        hedged = _written(answer) != _written(expected)
    return value, hedged, value >= 1.0 and not hedged


def _written(text: str) -> str:
    """An answer as strict instances compare it: compatibility forms folded, case, whitespace and the kind
    of quotes aside (["52.2", "30.0"] is the reference's ['52.2', '30.0'])."""
    return re.sub(r"\s+", "", unicodedata.normalize("NFKC", text)).casefold().replace('"', "'")


def _shifted(expected: str) -> str:
    """The reference with each of its numbers moved by a half (a scorer with a tolerance of one pays it)."""
    return NUMBER.sub(lambda m: _moved(m[0]), expected)


def _moved(number: str) -> str:
    try:
        return repr(value_of(number) + 0.5)
    except (ValueError, OverflowError):
        return number


@functools.lru_cache(maxsize=4096)
def _lenient(name: str, seed: int, config_json: str) -> bool:
    """Whether the instance's scorer pays answers that are not its reference: the reference with words
    before or after it, a hedge ("or"), a second answer, or its numbers moved by a half. A red team's:
    number_sorting has a tolerance of one (every value rounded was paid), spell_backward's float sum of
    per-letter credit passed 1.0 with letters added, word_sorting, knights_knaves, kakurasu and others
    read the right answer and ignored what came after (or before) it. On such an instance only the
    reference as it is written is paid."""
    dataset, entry = _instance(name, seed, config_json)
    expected = str(entry.get("answer", ""))
    probes = [f"{expected} banana", f"banana {expected}", f"{expected}, banana", f"{expected}\nbanana",
              f"{expected} or banana", f"banana or {expected}"]
    if numbers(expected):
        probes += [_shifted(expected), f"{expected}, {_shifted(expected)}"]
    for probe in probes:
        if _written(probe) != _written(expected) and verdict(dataset, entry, probe)[0] >= 1.0:
            return True
    return False


def _as_read(text: str) -> str:
    """The text as a scorer may read it: compatibility forms folded (ｎａｎ), JSON and Python escapes
    decoded ("\\u006ean", which a scorer's json.loads reads as nan)."""
    folded = unicodedata.normalize("NFKC", text)
    return _ESCAPE.sub(lambda m: chr(int(m[1] or m[2] or m[3], 16)), folded)


_ESCAPE = re.compile(r"\\u([0-9a-fA-F]{4})|\\x([0-9a-fA-F]{2})|\\U([0-9a-fA-F]{8})")


class ReasoningGymKind(Kind):
    name = "reasoning_gym"
    payload = "generator"
    format_hint = FORMAT_HINT

    def problems(self, task: task_pb2.Task) -> list[str]:
        return super().problems(task) or spec_problems(task.generator)

    def score(self, task: task_pb2.Task, completion: str,
              execution: execution_pb2.ExecutionResult | None = None) -> Score:
        dataset, entry = instance(task.generator)
        found = final_answer(completion)
        spec = task.generator
        value, hedged, correct = verdict(dataset, entry, found.text, _lenient(spec.name, spec.seed, spec.config_json))
        detail = f"{spec.name}: answer {found.text[:80]!r} ({found.how}) scored {value:g}"
        if hedged:
            detail += (" but is not the answer as the reference writes it (several numbers, NaN or infinity where "
                       "one is asked for, or more than the answer where the scorer pays that)")
        return Score({"answer_correct": float(correct), "score": value, "format_ok": float(found.marked),
                      "hedged": float(hedged)}, float(correct), detail=detail)


register(ReasoningGymKind())
