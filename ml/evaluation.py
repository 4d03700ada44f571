"""Scoring a policy on held-out tasks: greedy answers, judged by the verifier through the same task kinds.

One function for every place that measures a policy: the evaluator service (each Nth version, in
the pipeline) and `crucible train` (before and after). Completions that need running go through the
verifier, which runs them in the sandbox, so held-out code is executed exactly as training code is.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from crucible.ml import envs
from crucible.ml.envs import episode as ep
from crucible.ml.kinds import registry
from crucible.ml.policy.backends import PolicyBackend
from crucible.ml.policy.sampling import SamplingParams
from crucible.shared import rpc
from crucible.v1 import execution_pb2, execution_pb2_grpc, rollout_pb2, task_pb2, verdict_pb2, verdict_pb2_grpc

Verify = Callable[[verdict_pb2.VerifyRequest], Awaitable[verdict_pb2.Verdict]]
Execute = Callable[[execution_pb2.ExecuteRequest], Awaitable[execution_pb2.ExecutionResult]]


@dataclass
class Result:
    tasks: Counter = field(default_factory=Counter)   # task kind -> how many were scored
    passed: Counter = field(default_factory=Counter)  # task kind -> how many passed
    eval_ms: float = 0.0

    @property
    def pass_rate(self) -> float:
        total = sum(self.tasks.values())
        return sum(self.passed.values()) / total if total else 0.0


async def evaluate(backend: PolicyBackend, tasks: list[task_pb2.Task], verify: Verify, *, max_tokens: int,
                   concurrency: int = 16, execute: Execute | None = None, max_episode_tokens: int = 480) -> Result:
    """Greedy completions of every task (one backend call), each verified; the pass counts by kind.
    An environment's tasks are played as episodes (greedy turns, tools carried out through
    `execute`, the Sandbox) and scored by their environment."""
    started = time.perf_counter()
    result = Result()
    if not tasks:
        return result
    params = SamplingParams(temperature=0.0, top_p=1.0, max_tokens=max_tokens)
    episodic = [t for t in tasks if envs.is_environment(t)]
    tasks = [t for t in tasks if not envs.is_environment(t)]
    if episodic:
        if execute is None:
            execute = _no_sandbox
        for e in await ep.drive(backend, episodic, execute, params, max_episode_tokens=max_episode_tokens):
            result.tasks[e.task.kind] += 1
            result.passed[e.task.kind] += int(envs.get(e.task.kind).score(e.task, e).passed)
    if not tasks:
        result.eval_ms = (time.perf_counter() - started) * 1000
        return result
    groups = await asyncio.to_thread(backend.sample, [registry.render_prompt(t) for t in tasks], 1, params)
    slots = asyncio.Semaphore(concurrency)

    async def one(task: task_pb2.Task, completion) -> bool:
        request = verdict_pb2.VerifyRequest(task=task, rollout=rollout_pb2.Rollout(
            id=f"heldout/{task.id}", completion=completion.text, token_ids=completion.token_ids))
        async with slots:
            return (await verify(request)).sample.passed

    passed = await asyncio.gather(*(one(t, g[0]) for t, g in zip(tasks, groups)))
    for task, ok in zip(tasks, passed):
        result.tasks[task.kind] += 1
        result.passed[task.kind] += int(ok)
    result.eval_ms = (time.perf_counter() - started) * 1000
    return result


@contextlib.asynccontextmanager
async def verifier(target: str, timeout_s: float = 120.0) -> AsyncIterator[Verify]:
    """A Verify function backed by the Verifier gRPC service at `target`."""
    async with rpc.channel(target) as channel:
        stub = verdict_pb2_grpc.VerifierStub(channel)

        async def verify(request: verdict_pb2.VerifyRequest) -> verdict_pb2.Verdict:
            return await stub.Verify(request, timeout=timeout_s)

        yield verify


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
