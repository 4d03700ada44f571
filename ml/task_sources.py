"""Where a job's tasks come from: built-in families, environments and sets, reasoning-gym generators, JSONL files.

A JSONL file holds one Task a line in protobuf's JSON mapping (the form accepted on crucible.tasks);
a line that is not a valid task is an error naming the file and the line. Finite sources are split
into training and held-out tasks by a stable hash of each task's id, so the same tasks are held
out in every run and none of them is ever published for training.
"""
from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator
from pathlib import Path

from crucible.ml.kinds import builtin_sets
from crucible.ml.task_families import FAMILIES, graded_by, with_canaries
from crucible.ml.tasks import HELDOUT_SPLIT, task_problems
from crucible.shared import files, messages
from crucible.v1 import task_pb2


class TaskFileError(ValueError):
    """A task file that cannot be used; the text names the file and the line."""


def read_jsonl(path: Path, group_size: int | None = None) -> list[task_pb2.Task]:
    """Every task in a JSONL file, checked as the generator would check it; TaskFileError naming the line."""
    try:
        lines = files.read_text(path).splitlines()
    except files.Unreadable as exc:
        raise TaskFileError(f"cannot read task file {path}: {exc}") from None
    tasks, problems = parse_jsonl(lines, str(path), group_size)
    if problems:
        raise TaskFileError(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    return tasks


def parse_jsonl(lines: list[str], source: str, group_size: int | None = None,
                settings=None) -> tuple[list[task_pb2.Task], list[str]]:
    """(the tasks, every problem as "source:line: why"): each line a Task in JSON, checked as the
    generator would check it; ids must be unique; a file with no task is a problem too."""
    tasks, problems, seen = [], [], {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            task = messages.decode(line.encode(), task_pb2.Task, content_type=messages.CONTENT_TYPE_JSON)
        except messages.MessageDecodeError as exc:
            problems.append(f"{source}:{number}: {exc}")
            continue
        if group_size is not None and not task.group_size:
            task.group_size = group_size
        found = task_problems(task, settings) if settings is not None else task_problems(task)
        if found:
            problems.append(f"{source}:{number}: task {task.id!r}: " + "; ".join(found))
            continue
        if task.id and task.id in seen:
            problems.append(f"{source}:{number}: task id {task.id!r} already used on line {seen[task.id]}")
            continue
        seen[task.id] = number
        tasks.append(task)
    if not tasks and not problems:
        problems.append(f"{source}: no tasks in it")
    return tasks, problems


def in_heldout(task_id: str, fraction: float) -> bool:
    """A stable choice: the same ids are held out in every run, on every machine."""
    bucket = int(hashlib.sha256(task_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return bucket < fraction


def finite_tasks(source, *, seed: int, group_size: int, base: Path) -> list[task_pb2.Task]:
    if source.jsonl is not None:
        path = Path(source.jsonl)
        return read_jsonl(path if path.is_absolute() else base / path, group_size)
    if source.set is not None:
        return builtin_sets.load(source.set, source.count, seed=seed, group_size=group_size)
    return builtin_sets.reasoning_gym(source.reasoning_gym, source.count or 100, seed=seed,
                                      config=source.config or None, group_size=group_size)


def streams(sources, *, seed: int, group_size: int, heldout_fraction: float, heldout_file: Path | None,
            heldout_size: int, base: Path) -> tuple[Iterator[task_pb2.Task], list[task_pb2.Task]]:
    """(an endless stream of training tasks, the held-out tasks): sources interleaved in turn."""
    trains: list[Iterator[task_pb2.Task]] = []
    heldout: list[task_pb2.Task] = []
    trained: list[task_pb2.Task] = []  # the finite sources' training tasks (generators split their own apart)
    finite_questions: dict[tuple, int] = {}  # question -> the source that gave it first
    for i, source in enumerate(sources):
        if source.environment is not None:
            from crucible.ml import envs

            env = envs.get(source.environment)
            trains.append(env.generate("train", seed=seed + i, group_size=group_size))
            if heldout_file is None:
                stream = env.generate(HELDOUT_SPLIT, seed=seed + 1000 + i, group_size=1)
                heldout += list(itertools.islice(stream, heldout_size))
            continue
        if source.family is not None:
            if source.family not in FAMILIES:
                raise ValueError(f"unknown task family {source.family!r}: built-in families are {sorted(FAMILIES)}")
            family, default_ops = FAMILIES[source.family]
            ops = tuple(source.ops or default_ops)
            train = family("train", seed=seed + i, ops=ops, group_size=group_size)
            if source.grader is not None:  # the held-out tasks keep the family's own grader
                train = graded_by(train, source.grader)
            if source.canaries:
                train = with_canaries(train, source.canaries, seed=seed + 500 + i)
            trains.append(train)
            if heldout_file is None:
                stream = family(HELDOUT_SPLIT, seed=seed + 1000 + i, ops=ops, group_size=1)
                heldout += list(itertools.islice(stream, heldout_size))
            continue
        # A task an earlier source holds already (a generator's mix and the generator alone draw some alike)
        # is that source's: taken once, never trained on twice nor held out from one and trained from another.
        tasks = [t for t in finite_tasks(source, seed=seed + i, group_size=group_size, base=base)
                 if finite_questions.setdefault(question(t), i) == i]
        # A task its file marks held out is never trained on: held out here, or, with a held-out file
        # naming them, refused (which set would it be in?).
        marked = [t for t in tasks if t.split == HELDOUT_SPLIT]
        if marked and heldout_file is not None:
            raise ValueError(f"task source {i + 1}: task {marked[0].id!r} is marked split \"heldout\" while the "
                             "[heldout] file names the held-out tasks: move it there, or drop its split")
        held = [t for t in tasks if t.split == HELDOUT_SPLIT
                or (heldout_file is None and in_heldout(t.id, heldout_fraction))]
        # A task a set holds twice (MATH does, under other ids) goes where its held-out copy goes.
        held_questions = {question(t) for t in held}
        held = [t for t in tasks if question(t) in held_questions]
        train = [t for t in tasks if question(t) not in held_questions]
        for t in held:
            t.split = HELDOUT_SPLIT
        heldout += held
        if not train:
            raise ValueError(f"task source {i + 1} left no training tasks once held-out ones were set aside")
        for t in train:
            t.split = "train"
        trained += train
        trains.append(_cycle(train))
    if heldout_file is not None:
        heldout = read_jsonl(heldout_file, 1)
        for t in heldout:
            t.split = HELDOUT_SPLIT
    heldout = heldout[:heldout_size]
    _check_apart(trained, heldout)
    return _interleave(trains), heldout


def question(task: task_pb2.Task) -> tuple:
    """What a task asks, whatever its id: its kind, prompt and payload (an environment's prompt alone
    names no task: its table, database or logs are in the payload)."""
    payload = task.WhichOneof("payload")
    return (task.kind, task.prompt, payload,
            getattr(task, payload).SerializeToString(deterministic=True) if payload else b"")


def _check_apart(trained: list[task_pb2.Task], heldout: list[task_pb2.Task]) -> None:
    """ValueError unless there are held-out tasks and none of them is a training task (the same question,
    whatever its id): a pass rate on tasks trained on measures nothing held out."""
    if not heldout:
        raise ValueError("no held-out tasks: the run's progress is measured on them (a [heldout] file, or a "
                         "fraction and size that leave some)")
    asked = {question(t): t.id for t in trained}
    for t in heldout:
        if question(t) in asked:
            raise ValueError(f"held-out task {t.id!r} is training task {asked[question(t)]!r}: held-out tasks must "
                             "be ones nothing trains on")


def _cycle(tasks: list[task_pb2.Task]) -> Iterator[task_pb2.Task]:
    """Epochs over the tasks; each epoch's copies get their own ids, so a task's groups stay apart."""
    for epoch in itertools.count():
        for t in tasks:
            copy = task_pb2.Task()
            copy.CopyFrom(t)
            if epoch:
                copy.id = f"{t.id}#{epoch}"
            yield copy


def _interleave(streams: list[Iterator[task_pb2.Task]]) -> Iterator[task_pb2.Task]:
    for stream in itertools.cycle(streams):
        yield next(stream)
