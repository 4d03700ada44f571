"""What an environment is: tools the model may call, how a call becomes an observation, how an episode is scored.

An environment is stateless code: the state of one episode is built from the task's instance and
the calls made so far (`earlier`), each time it is needed, and dropped afterwards. So an episode's
whole state lives in its message on the log, and any service can be killed mid-episode.

Untrusted actions (code, SQL) are never run here: a tool marked `sandboxed` turns a call into an
ExecuteRequest (`job`) that the sandbox-executor runs in its jail; `observe` then reads the result.
"""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field

from crucible.ml.kinds import extract, tamper_scan
from crucible.ml.kinds.registry import Score
from crucible.shared.text import is_unicode, valid_text
from crucible.v1 import episode_pb2, execution_pb2, task_pb2

MAX_OBSERVATION_CHARS = 2000   # an observation longer than this is cut, and says so
MAX_ARGUMENTS_CHARS = 8000     # a call's arguments, as JSON
MAX_INSTANCE_CHARS = 1_000_000  # a task's instance: it travels with every turn of every episode


class InstanceError(ValueError):
    """A task's environment instance that cannot be used; the text says why."""


@dataclass(frozen=True)
class Tool:
    """One tool: its name, what it does, and its parameters (all strings), as the model is told."""

    name: str
    description: str
    parameters: dict[str, str] = field(default_factory=dict)  # name -> description
    sandboxed: bool = False  # runs untrusted input in the sandbox (job + observe)

    def schema(self) -> dict:
        """The tool in the JSON-schema form chat templates take (`tools=`)."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": {"type": "object", "required": list(self.parameters),
                           "properties": {p: {"type": "string", "description": d}
                                          for p, d in self.parameters.items()}}}}


@dataclass(frozen=True)
class Observation:
    text: str
    failed: bool = False  # the call could not be carried out (bad arguments, an error, a refused event)
    done: bool = False    # the environment ended the episode (its state is final)


@dataclass(frozen=True)
class Call:
    """A parsed tool call: a known tool with checked string arguments."""

    name: str
    arguments: dict[str, str]


def cut(text: str, limit: int = MAX_OBSERVATION_CHARS) -> str:
    """`text` as valid Unicode (valid_text), cut to `limit` characters with a note saying how much was left out."""
    text = valid_text(text)
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n[... {len(text) - limit} more characters cut]"


class Environment(ABC):
    """One environment. Subclasses set name, tools, max_turns and implement what differs."""

    name: str = ""
    description: str = ""
    tools: tuple[Tool, ...] = ()
    max_turns: int = 6
    answer_lines: bool = False  # whether an answer may take several lines (sql: a row a line)

    # --- the task ---------------------------------------------------------------------------------
    def instance(self, task: task_pb2.Task) -> dict:
        """The task's instance (the JSON its generator wrote); InstanceError when it is not usable."""
        if task.WhichOneof("payload") != "environment":
            raise InstanceError(f"environment {self.name!r} needs an 'environment' payload, "
                                f"got {task.WhichOneof('payload') or 'none'}")
        if len(task.environment.instance_json) > MAX_INSTANCE_CHARS:
            raise InstanceError(f"environment.instance_json is {len(task.environment.instance_json)} characters "
                                f"long: at most {MAX_INSTANCE_CHARS} (it travels with every turn)")
        try:
            data = json.loads(task.environment.instance_json or "{}", parse_constant=_no_constant)
        except (ValueError, RecursionError) as exc:
            raise InstanceError(f"environment.instance_json is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise InstanceError("environment.instance_json must be a JSON object")
        if not is_unicode(data):
            raise InstanceError("environment.instance_json holds text that is not valid Unicode (an escaped lone "
                                "surrogate such as \\ud800): no observation or answer could carry it")
        self.check_instance(data)
        return data

    def check_instance(self, data: dict) -> None:
        """Raises InstanceError naming what the instance lacks; the default accepts anything."""

    def problems(self, task: task_pb2.Task) -> list[str]:
        try:
            self.instance(task)
        except InstanceError as exc:
            return [str(exc)]
        return self.scoring_problems(task)

    def scoring_problems(self, task: task_pb2.Task) -> list[str]:
        """Why the instance could not be scored as a task must be: its own reference solution is not paid
        (a target no event reaches, a value an answer cannot write: a task no episode can pass), or two
        different answers are paid with no tool called (a target the entity starts in: a task passed
        before anything is done), or the question itself, given back, is (it states its answer). A
        generator never makes such an instance (it draws again); a user's file may."""
        from crucible.ml.envs.calls import parse, resolve

        try:
            turns = self.reference(task)
            calls = []
            for text in turns[:-1]:
                call = resolve(parse(text, "plain") or episode_pb2.ToolCall(error="not a call"), self.tools)
                if isinstance(call, str):
                    return [f"{self.name}: the instance's reference solution makes a call that is refused: {call}"]
                calls.append(call)
            if self.check_answer(task, self.answer_of(turns[-1]), calls).get("answer_correct", 0.0) < 1.0:
                return [f"{self.name}: no answer can be paid: the instance's own reference solution, which answers "
                        f"{turns[-1][:80]!r}, is not"]
            paid = [a for a in ("done", "") if self.check_answer(task, a, []).get("answer_correct", 0.0) >= 1.0]
            # The question given back word for word: paid where the question states its own answer ("the
            # 2th Fibonacci number (F1 = F2 = 1)": 1), or names a number that is the answer by chance.
            echoed = self.check_answer(task, self.answer_of(task.prompt), []).get("answer_correct", 0.0) >= 1.0
        except InstanceError as exc:
            return [str(exc)]
        except Exception as exc:  # noqa: BLE001 -- the instance's, whatever it makes the environment's code do
            return [f"{self.name}: the instance cannot be scored: {type(exc).__name__}: {str(exc)[:200]}"]
        if len(paid) > 1:
            return [f"{self.name}: any answer is paid with no tool called: the task is passed before anything is done"]
        if echoed:
            return [f"{self.name}: the question, given back as the answer, is paid: it states its own answer"]
        return []

    def answer_of(self, text: str) -> str:
        """The answer a final turn's text gives, as every answer kind reads it: reasoning in a closed
        <think> block is not the answer, and an <answer> tag or an `Answer:` line marks it (extract.py)."""
        return extract.answer_block(text) if self.answer_lines else extract.final_answer(text).text

    def turn_limit(self, task: task_pb2.Task) -> int:
        return task.environment.max_turns or self.max_turns

    def instructions(self, task: task_pb2.Task, call_format: str) -> str:
        """What the model reads first. The plain format (the built-in byte-level policy) gets the
        prompt as it is; the Hermes format gets how to call tools too (the schemas themselves go
        through the chat template, or into the system prompt when the template has no tools)."""
        if call_format == "plain":
            return task.prompt
        return (f"{task.prompt.rstrip()}\n\nUse the tools to find out what you need: one call per turn, "
                'written as <tool_call>{"name": ..., "arguments": {...}}</tool_call>. When you know the '
                "answer, reply with the answer alone and no tool call.")

    # --- acting -----------------------------------------------------------------------------------
    def job(self, task: task_pb2.Task, earlier: list[Call], call: Call) -> execution_pb2.ExecuteRequest:
        """The sandbox job for a call of a sandboxed tool (earlier calls given to rebuild the state)."""
        raise NotImplementedError(f"environment {self.name!r} has no sandboxed tool {call.name!r}")

    def keeps_failed(self, turn: episode_pb2.Turn) -> bool:
        """Whether a call whose tool ran and failed is part of the state later calls are built on
        (episode.earlier_calls); by default it changed nothing (a rejected event)."""
        return False

    @abstractmethod
    def observe(self, task: task_pb2.Task, earlier: list[Call], call: Call,
                result: execution_pb2.ExecutionResult | None = None) -> Observation:
        """The observation a call gets: from the sandbox's result for sandboxed tools, directly otherwise."""

    # --- scoring ----------------------------------------------------------------------------------
    @abstractmethod
    def check_answer(self, task: task_pb2.Task, answer: str, calls: list[Call]) -> dict[str, float]:
        """Components of the final answer (given the episode's successful calls): at least
        `answer_correct` (0 or 1). Pure: the same inputs give the same components."""

    def score(self, task: task_pb2.Task, episode: episode_pb2.Episode) -> Score:
        """The episode's score: the answer's components and how the episode went; reward 1 for a
        right answer reached without a failed call, less for each failed call, 0 otherwise."""
        from crucible.ml.envs.episode import carried_out

        calls, failed, signals = [], 0, []
        for number, turn in enumerate(episode.turns, 1):
            if not carried_out(turn):
                continue  # an answer, or a call the episode ended before (the turn limit): it changed nothing
            if turn.call_failed or turn.call.error:
                failed += 1
            else:
                calls.append(Call(turn.call.name, json.loads(turn.call.arguments_json or "{}")))
            signals += [(pattern, f"turn {number}: {detail}")
                        for pattern, detail in tamper_scan.scan_run(turn.violation, turn.violation_detail)]
        answered = episode.end in (episode_pb2.EPISODE_END_ANSWER, episode_pb2.EPISODE_END_DONE)
        answer = self.answer_of(episode.turns[-1].text if answered and episode.turns else "")
        components = {"answer_correct": 0.0}
        if answered:
            components.update(self.check_answer(task, answer, calls))
        correct = components["answer_correct"] >= 1.0
        components.update({"tool_calls": float(len(calls) + failed), "failed_calls": float(failed),
                           "turns": float(len(episode.turns)), "answered": float(answered),
                           "tampered": float(bool(signals))})
        reward = max(0.0, 1.0 - 0.25 * failed) if correct else 0.0
        detail = {episode_pb2.EPISODE_END_TURN_LIMIT: "the turn limit was reached before an answer",
                  episode_pb2.EPISODE_END_TOKEN_LIMIT: "the token limit was reached before an answer"}.get(episode.end, "")
        if signals:  # an escape tried in any call pays nothing, whatever the answer (as a tested run's would)
            detail = "; ".join(filter(None, [detail, "tampering: " + "; ".join(f"{p}: {d}" for p, d in signals[:5])]))
        return Score(components, reward, tampered=bool(signals), patterns=tuple(dict.fromkeys(p for p, _ in signals)),
                     detail=detail[:2000])

    # --- tasks ------------------------------------------------------------------------------------
    @abstractmethod
    def generate(self, split: str, *, seed: int, group_size: int = 8) -> Iterator[task_pb2.Task]:
        """An endless, seeded stream of tasks from one split ("train" or "heldout"); a held-out
        instance never appears in training, whatever the seeds."""

    @abstractmethod
    def reference(self, task: task_pb2.Task) -> list[str]:
        """A reference solution: the model turns (tool calls in the plain format, then the answer)."""

    def task(self, prompt: str, instance: dict, *, split: str, key: str, group_size: int,
             **metadata: str) -> task_pb2.Task:
        """A task of this environment with a stable id (from `key`, the instance's identity)."""
        import hashlib

        digest = hashlib.sha256(f"{self.name}\x00{key}".encode()).hexdigest()[:16]
        return task_pb2.Task(id=f"{self.name}-{digest}", kind=self.name, prompt=prompt, group_size=group_size,
                             split=split, environment=task_pb2.EnvironmentSpec(instance_json=json.dumps(instance)),
                             metadata={"environment": self.name, **metadata})


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def split_of(key: str, fraction: float = 0.2) -> str:
    """The split an instance falls in, by a stable hash of its identity."""
    import hashlib

    bucket = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "heldout" if bucket < fraction else "train"


def program_output(result: execution_pb2.ExecutionResult) -> Observation:
    """What a program run in the sandbox says back: why it was stopped (first, so that no cut of a long
    output drops it: a fork bomb's children fill any budget with tracebacks), its output, its errors."""
    if result.not_run:
        return Observation(f"error: not run: {result.not_run}", failed=True)
    out = result.stdout.decode("utf-8", errors="replace")
    err = result.stderr.decode("utf-8", errors="replace")
    text = out + ("\n[output cut by the sandbox]" if result.stdout_truncated else "")
    if err.strip():
        text += ("\n" if text else "") + "stderr:\n" + err + ("\n[cut]" if result.stderr_truncated else "")
    failed = result.exit_code != 0 or result.signal != 0
    if result.violation:
        name = execution_pb2.Violation.Name(result.violation).removeprefix("VIOLATION_").lower()
        text = f"[the sandbox stopped the program: {name}{': ' + result.violation_detail if result.violation_detail else ''}]\n" + text
        failed = True
    elif failed and not err.strip():
        text = f"[exit code {result.exit_code}{f', signal {result.signal}' if result.signal else ''}]\n" + text
    return Observation(text.strip("\n") or "(no output)", failed=failed)
