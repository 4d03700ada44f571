"""Scoring a policy on held-out tasks: greedy answers (and optionally sampled ones), judged by the verifier through the same task kinds.

One function for every place that measures a policy: the evaluator service (each Nth version, in
the pipeline) and `crucible train` (before and after). Completions that need running go through the
verifier, which runs them in the sandbox, so held-out code is executed exactly as training code is.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import grpc

from crucible.ml import envs
from crucible.ml.envs import episode as ep
from crucible.ml.kinds import registry
from crucible.ml.policy.backends import PolicyBackend
from crucible.ml.policy.sampling import SamplingParams
from crucible.shared import rpc
from crucible.v1 import execution_pb2, execution_pb2_grpc, rollout_pb2, task_pb2, verdict_pb2, verdict_pb2_grpc

log = logging.getLogger(__name__)

Verify = Callable[[verdict_pb2.VerifyRequest], Awaitable[verdict_pb2.Verdict]]
Execute = Callable[[execution_pb2.ExecuteRequest], Awaitable[execution_pb2.ExecutionResult]]


@dataclass
class Result:
    tasks: Counter = field(default_factory=Counter)    # task kind -> how many were scored greedily
    passed: Counter = field(default_factory=Counter)   # task kind -> how many of those passed
    samples: Counter = field(default_factory=Counter)  # task kind -> completions drawn at the training temperature
    samples_passed: Counter = field(default_factory=Counter)
    refused: int = 0  # completions the verifier would not score (counted as failed)
    eval_ms: float = 0.0

    @property
    def pass_rate(self) -> float:
        total = sum(self.tasks.values())
        return sum(self.passed.values()) / total if total else 0.0

    @property
    def sampled_pass_rate(self) -> float:
        total = sum(self.samples.values())
        return sum(self.samples_passed.values()) / total if total else 0.0


def sampled_rate(message) -> float | None:
    """An Evaluation message's pass rate over its sampled completions; None where it drew none."""
    return message.samples_passed / message.samples if message.samples else None


async def evaluate(backend: PolicyBackend, tasks: list[task_pb2.Task], verify: Verify, *, max_tokens: int,
                   concurrency: int = 64, execute: Execute | None = None, max_episode_tokens: int = 480,
                   samples: int = 0, temperature: float = 1.0, top_p: float = 1.0) -> Result:
    """Greedy completions of every task (one backend call), each verified; the pass counts by kind.
    With `samples`, also that many completions of every task drawn at `temperature` and `top_p` (as
    training draws them), counted apart: a greedy score can stand still while the policy's answers
    shift under it, so it is the sampled one that tracks the training reward. An environment's tasks
    are played as episodes (tools carried out through `execute`, the Sandbox) and scored by their
    environment."""
    started = time.perf_counter()
    result = Result()
    greedy = SamplingParams(temperature=0.0, top_p=1.0, max_tokens=max_tokens)
    drawn = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens)
    episodic = [t for t in tasks if envs.is_environment(t)]
    plain = [t for t in tasks if not envs.is_environment(t)]
    slots = asyncio.Semaphore(concurrency)

    async def episodes(these: list[task_pb2.Task], params: SamplingParams, scored: Counter, passed: Counter):
        for e in await ep.drive(backend, these, execute or _no_sandbox, params, max_episode_tokens=max_episode_tokens):
            scored[e.task.kind] += 1
            passed[e.task.kind] += int(envs.get(e.task.kind).score(e.task, e).passed)

    async def completions(n: int, params: SamplingParams, scored: Counter, passed: Counter):
        groups = await asyncio.to_thread(backend.sample, [registry.render_prompt(t) for t in plain], n, params)
        if len(groups) != len(plain) or any(len(g) != n for g in groups):  # zip would score fewer, quietly
            raise RuntimeError(f"the policy backend answered {[len(g) for g in groups]} completions for "
                               f"{len(plain)} prompts of {n} each")

        async def one(task: task_pb2.Task, index: int, completion) -> bool:
            request = verdict_pb2.VerifyRequest(task=task, rollout=rollout_pb2.Rollout(
                id=f"heldout/{task.id}/{index}", sample_index=index, completion=completion.text,
                token_ids=completion.token_ids))
            async with slots:
                try:
                    return (await verify(request)).sample.passed
                except grpc.aio.AioRpcError as exc:
                    if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                        raise  # the verifier is away: the whole evaluation is tried again
                    # This completion refused (a scorer that breaks on it): failed, and counted. It stopped the
                    # evaluator, at every restart (greedy decoding writes it again), and with it every held-out score.
                    result.refused += 1
                    log.warning("held-out completion %s refused by the verifier: %s: %s", request.rollout.id,
                                exc.code().name, exc.details()[:300])
                    return False

        verdicts = await asyncio.gather(*(one(t, i, c) for t, group in zip(plain, groups) for i, c in enumerate(group)))
        for task, ok in zip((t for t, group in zip(plain, groups) for _ in group), verdicts):
            scored[task.kind] += 1
            passed[task.kind] += int(ok)

    if episodic:
        await episodes(episodic, greedy, result.tasks, result.passed)
        if samples:
            await episodes(episodic * samples, drawn, result.samples, result.samples_passed)
    if plain:
        await completions(1, greedy, result.tasks, result.passed)
        if samples:
            await completions(samples, drawn, result.samples, result.samples_passed)
    result.eval_ms = (time.perf_counter() - started) * 1000
    return result


@contextlib.asynccontextmanager
async def verifier(target: str, timeout_s: float = 120.0, batch_max: int = 64) -> AsyncIterator[Verify]:
    """A Verify function backed by the Verifier gRPC service at `target`. Requests made at once (in the
    same turn of the event loop, as a gather of them makes them) travel in one VerifyBatch call of at
    most `batch_max`; each is answered on its own, and one the verifier refuses raises the
    AioRpcError its Verify call would have raised. `timeout_s` holds for a whole call: the verifier
    runs 16 programs at a time, so a batch of python_tests completions takes up to batch_max / 16
    times their time limit."""
    async with rpc.channel(target) as channel:
        yield _Batched(verdict_pb2_grpc.VerifierStub(channel), timeout_s, batch_max)


class _Batched:
    def __init__(self, stub: verdict_pb2_grpc.VerifierStub, timeout_s: float, batch_max: int):
        self.stub, self.timeout_s, self.batch_max = stub, timeout_s, batch_max
        self._waiting: list[tuple[verdict_pb2.VerifyRequest, asyncio.Future]] = []
        self._calls: set[asyncio.Task] = set()  # held until done (the loop keeps only weak references)

    async def __call__(self, request: verdict_pb2.VerifyRequest) -> verdict_pb2.Verdict:
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        self._waiting.append((request, answer))
        if len(self._waiting) >= self.batch_max:
            self._send()
        elif len(self._waiting) == 1:
            loop.call_soon(self._send)  # after every request made in this turn has joined
        return await answer

    def _send(self) -> None:
        waiting, self._waiting = self._waiting, []
        if waiting:
            call = asyncio.ensure_future(self._call(waiting))
            self._calls.add(call)
            call.add_done_callback(self._calls.discard)

    async def _call(self, waiting: list[tuple[verdict_pb2.VerifyRequest, asyncio.Future]]) -> None:
        try:
            response = await self.stub.VerifyBatch(
                verdict_pb2.VerifyBatchRequest(requests=[request for request, _ in waiting]), timeout=self.timeout_s)
            if len(response.outcomes) != len(waiting):
                raise grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           f"the verifier answered {len(response.outcomes)} of {len(waiting)} "
                                           "requests")
        except asyncio.CancelledError:
            for _, answer in waiting:
                answer.cancel()
            raise
        except Exception as exc:
            for _, answer in waiting:
                if not answer.done():
                    answer.set_exception(exc)
            return
        for (_, answer), outcome in zip(waiting, response.outcomes):
            if answer.done():  # its caller stopped waiting
                continue
            if outcome.HasField("verdict"):
                answer.set_result(outcome.verdict)
            else:
                answer.set_exception(grpc.aio.AioRpcError(
                    _STATUS.get(outcome.refusal.code, grpc.StatusCode.UNKNOWN), grpc.aio.Metadata(),
                    grpc.aio.Metadata(), outcome.refusal.message))


_STATUS = {code.value[0]: code for code in grpc.StatusCode}


async def _no_sandbox(request: execution_pb2.ExecuteRequest) -> execution_pb2.ExecutionResult:
    return execution_pb2.ExecutionResult(not_run="no sandbox was given to this evaluation")


@contextlib.asynccontextmanager
async def sandbox(target: str, timeout_s: float = 60.0) -> AsyncIterator[Execute]:
    """An Execute function backed by the Sandbox gRPC service at `target` (an environment's tools)."""
    async with rpc.channel(target) as channel:
        stub = execution_pb2_grpc.SandboxStub(channel)

        async def execute(request: execution_pb2.ExecuteRequest) -> execution_pb2.ExecutionResult:
            return (await stub.Execute(request, timeout=timeout_s)).result

        yield execute
