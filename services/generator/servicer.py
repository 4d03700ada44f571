"""Generator gRPC: sample a group for one task, interactively (shares the batcher with Kafka traffic)."""
from __future__ import annotations

import asyncio
import uuid

from crucible.v1 import generator_pb2, generator_pb2_grpc
from crucible.services.generator.batcher import Batcher
from crucible.services.generator.handler import group_id_for, render_prompt, rollout_group
from crucible.shared import rpc
from crucible.ml.policy.sampling import SamplingParams
from crucible.shared.settings import Settings
from crucible.ml import envs
from crucible.ml.tasks import task_problems


def sampling_params(settings: Settings, requested: generator_pb2.SamplingParams | None = None) -> SamplingParams:
    """The service's defaults, overridden by whatever the request set; ValueError when out of range."""
    params = SamplingParams(
        temperature=settings.temperature, top_p=settings.top_p, max_tokens=settings.max_tokens,
    )
    if requested is not None and requested.ByteSize():
        params = SamplingParams(
            temperature=requested.temperature if requested.HasField("temperature") else params.temperature,
            top_p=requested.top_p or params.top_p,
            max_tokens=requested.max_tokens or params.max_tokens,
            stop=tuple(requested.stop),
            seed=requested.seed if requested.HasField("seed") else None,
        )
    params.validate(max_tokens_limit=4096)
    return params


class GeneratorServicer(generator_pb2_grpc.GeneratorServicer):
    def __init__(self, settings: Settings, batcher: Batcher, generator_id: str):
        self.settings = settings
        self.batcher = batcher
        self.generator_id = generator_id
        self.calls = rpc.Admission(self.MAX_CALLS, "Generate calls")

    # Calls sampled or waiting at once: they share the batcher with the run's own sampling, and a flood of
    # them queued without bound ahead of it.
    MAX_CALLS = 64

    async def Generate(self, request: generator_pb2.GenerateRequest, context):
        async with self.calls.admit(context):
            return await self._generate(request, context)

    async def _generate(self, request: generator_pb2.GenerateRequest, context):
        task = request.task
        n = request.n or task.group_size
        if request.n:  # an explicit n stands in for the group size when checking the task
            task = type(task).FromString(task.SerializeToString())
            task.group_size = request.n
        problems = await asyncio.to_thread(task_problems, task, self.settings)  # test code is parsed: off the loop
        if problems:
            await rpc.abort_invalid(context, f"task {task.id!r}: " + "; ".join(problems))
        if envs.is_environment(task):
            await rpc.abort_invalid(context, f"task {task.id!r}: kind {task.kind!r} is a multi-turn environment; its "
                                    "episodes run over Kafka (publish it to crucible.tasks), Generate samples one turn")
        try:
            params = sampling_params(self.settings, request.sampling if request.HasField("sampling") else None)
        except ValueError as exc:
            await rpc.abort_invalid(context, f"sampling: {exc}")
        prompt = render_prompt(task)
        too_long = self.batcher.backend.too_long(prompt, params.max_tokens)  # as the Kafka path refuses it
        if too_long:
            await rpc.abort_invalid(context, f"task {task.id!r}: {too_long}")
        completions, version, ms = await self.batcher.sample(prompt, n, params, counts_for_lag=False)
        group = rollout_group(task, group_id_for(task.id, f"grpc:{uuid.uuid4().hex}"), completions, params,
                              policy_version=version, backend=self.batcher.backend.name,
                              generator_id=self.generator_id, sample_ms=ms)
        return generator_pb2.GenerateResponse(group=group)
