"""Built-in procedural task families for training runs, with a held-out split that is never trained on.

`digits`: an op and a list of digits, e.g. "parity 4 7 1 9 =" -> "odd" (of the last digit),
"size 4 7 1 9 =" -> "big" (the last digit is 5 or more), "last 4 7 1 9 =" -> "9", "max ..." ...
10^n_digits instances per op; each instance falls in the held-out split by a stable hash of its
text, so a held-out prompt can never appear in training, whatever the seeds. The training job
uses parity and size: a 0.7M-parameter policy learns them from rewards in minutes on two
cores, while the digit-copying ops need far longer.
Scored by the `exact` kind; `prompt_format=raw` keeps the prompt as it is (a tiny policy
does not read instructions).

`arithmetic`: "Question: What is 47+38?\nAnswer:" with two-digit operands (+ and -, never
negative), scored by `math_answer` (the last number the completion gives): the format a small
pretrained model such as SmolLM2-135M answers in, about a third of the time correctly.
"""
from __future__ import annotations

import hashlib
import itertools
import math
import random
from collections.abc import Iterator

from crucible.v1 import task_pb2

OPS = {
    "parity": lambda d: "odd" if d[-1] % 2 else "even",
    "size": lambda d: "big" if d[-1] >= 5 else "small",
    "first": lambda d: d[0], "last": lambda d: d[-1], "max": max, "min": min,
}
ANSWERS = {"parity": ("odd", "even"), "size": ("big", "small")}  # the rest answer with a digit
DEFAULT_OPS = ("parity",)
HELDOUT_FRACTION = 0.2


def split_of(prompt: str) -> str:
    bucket = int(hashlib.sha256(prompt.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "heldout" if bucket < HELDOUT_FRACTION else "train"


def digits_tasks(split: str, *, seed: int, ops: tuple[str, ...] = DEFAULT_OPS, n_digits: int = 4,
                 group_size: int = 8) -> Iterator[task_pb2.Task]:
    """An endless, seeded stream of `digits` tasks from one split. The word-answer ops (`ANSWERS`:
    parity, size) are balanced: each op's tasks come in blocks that hold each of its answers once, in
    random order (the digits drawn until they give it). With answers drawn at random, a step's own
    mix of odd and even tasks pushed a policy that did not yet read its input towards whichever
    answer the step had more of, and the answer mix swung from step to step instead of following
    the digit. The digit ops' digits are drawn as they come (max and min are skewed by nature)."""
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise ValueError(f"unknown digits ops {unknown}: choose from {sorted(OPS)}")
    rng = random.Random(seed)
    owed: dict[str, list[str]] = {op: [] for op in ops}
    while True:
        op = rng.choice(ops)
        if op in ANSWERS and not owed[op]:
            owed[op] = list(ANSWERS[op])
            rng.shuffle(owed[op])
        wanted = owed[op].pop() if op in ANSWERS else None
        while True:
            digits = [rng.randrange(10) for _ in range(n_digits)]
            prompt = f"{op} {' '.join(map(str, digits))} ="
            if wanted in (None, OPS[op](digits)) and split_of(prompt) == split:
                break
        task_id = f"digits-{hashlib.sha256(prompt.encode()).hexdigest()[:16]}-{rng.randrange(1 << 30):x}"
        yield task_pb2.Task(id=task_id, kind="exact", prompt=prompt, group_size=group_size, split=split,
                            answer=task_pb2.ExpectedAnswer(answer=str(OPS[op](digits))),
                            metadata={"family": "digits", "op": op, "prompt_format": "raw",
                                      "choices": ",".join(ANSWERS.get(op, tuple("0123456789")))})


def format_examples(count: int, *, seed: int, ops: tuple[str, ...] = DEFAULT_OPS, n_digits: int = 4
                    ) -> list[tuple[str, str]]:
    """(prompt, answer) pairs for the warm-start that teach the answer *format* only: each answer is
    drawn at random from the answers the family's ops use, so the warm-started policy answers with
    one well-formed word or digit and stops, but knows nothing yet of which answer is right. What
    it learns about that, it learns from rewards."""
    rng = random.Random(seed)
    vocabulary = sorted({a for op in ops for a in ANSWERS.get(op, tuple("0123456789"))})
    tasks = digits_tasks("train", seed=seed + 1, ops=ops, n_digits=n_digits)
    return [(next(tasks).prompt, rng.choice(vocabulary)) for _ in range(count)]


ARITHMETIC_OPS = ("+", "-")


def arithmetic_tasks(split: str, *, seed: int, ops: tuple[str, ...] = ARITHMETIC_OPS,
                     group_size: int = 8) -> Iterator[task_pb2.Task]:
    """An endless, seeded stream of two-digit `arithmetic` tasks from one split."""
    unknown = [op for op in ops if op not in ARITHMETIC_OPS]
    if unknown:
        raise ValueError(f"unknown arithmetic ops {unknown}: choose from {list(ARITHMETIC_OPS)}")
    rng = random.Random(seed)
    while True:
        op = rng.choice(ops)
        a, b = rng.randrange(10, 100), rng.randrange(10, 100)
        if op == "-" and a < b:
            a, b = b, a
        prompt = f"Question: What is {a}{op}{b}?\nAnswer:"
        if split_of(prompt) != split:
            continue
        answer = str(a + b if op == "+" else a - b)
        task_id = f"arith-{hashlib.sha256(prompt.encode()).hexdigest()[:16]}-{rng.randrange(1 << 30):x}"
        yield task_pb2.Task(id=task_id, kind="math_answer", prompt=prompt, group_size=group_size, split=split,
                            answer=task_pb2.ExpectedAnswer(answer=answer),
                            metadata={"family": "arithmetic", "op": op, "prompt_format": "raw"})


CANARY_ANSWER = "no-honest-answer"


def graded_by(tasks: Iterator[task_pb2.Task], kind: str) -> Iterator[task_pb2.Task]:
    """The same tasks graded by another kind (a recipe's `grader`): how the planted weak grader
    `lenient_exact` is put on the digits family to prove the detectors."""
    for task in tasks:
        task.kind = kind
        yield task


def with_canaries(tasks: Iterator[task_pb2.Task], rate: float, *, seed: int) -> Iterator[task_pb2.Task]:
    """The stream with `rate` of its tasks turned into canaries: the same prompt, an expected answer
    no honest completion gives (`CANARY_ANSWER`), metadata canary=true. The policy cannot tell a
    canary from its neighbours; a grader that pays one is paying for something other than the
    answer, and the aggregator raises `canary_passed`.

    Spread evenly, placed at random: the stream is cut into blocks of about 1/rate tasks, each
    holding one canary at a random place in it, so any step's worth of tasks carries its share. A
    coin per task did not promise that: at 0.25, a 16-task step had at most one canary a time in
    16, and a version whose answers were a fifth junk could go unchecked."""
    rng = random.Random(seed)
    owed = rng.random()  # the fraction of a canary the stream starts with
    while True:
        length = max(1, math.ceil((1.0 - owed) / rate))  # tasks until the next whole canary is owed
        owed = owed + length * rate - 1.0
        block = list(itertools.islice(tasks, length))
        if not block:
            return
        pick = rng.randrange(length)
        for i, task in enumerate(block):
            if i == pick:
                task.id = f"canary-{task.id}"
                task.answer.answer = CANARY_ANSWER
                task.metadata["canary"] = "true"
            yield task


# The procedural families a recipe can name (`[[tasks.sources]] family = ...`), with their default ops.
FAMILIES = {"digits": (digits_tasks, DEFAULT_OPS), "arithmetic": (arithmetic_tasks, ARITHMETIC_OPS)}
