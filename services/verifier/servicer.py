"""Verifier gRPC: Verify scores one rollout; a python_tests rollout without an execution is run in the Sandbox first."""
from __future__ import annotations

import grpc

from crucible.v1 import execution_pb2, execution_pb2_grpc, verdict_pb2, verdict_pb2_grpc
from crucible.services.verifier import handler
from crucible.services.verifier.scorer_pool import ScorerPool, ScoringError
from crucible.shared import integrity, rpc

# Sandbox answers passed on as they are: the caller's request was bad, or the sandbox is full.
_PASSED_ON = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}


class VerifierServicer(verdict_pb2_grpc.VerifierServicer):
    def __init__(self, scorer: ScorerPool, sandbox_target: str):
        self.scorer = scorer
        self.sandbox_target = sandbox_target
        self._channel = None

    def _sandbox(self) -> execution_pb2_grpc.SandboxStub:
        if self._channel is None:
            self._channel = rpc.channel(self.sandbox_target)
        return execution_pb2_grpc.SandboxStub(self._channel)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()

    async def Verify(self, request: verdict_pb2.VerifyRequest, context):
        try:
            kind = handler.kind_for(request.task, f"rollout {request.rollout.id!r}")
        except handler.Unverifiable as exc:
            await rpc.abort_invalid(context, str(exc))
        if kind.needs_execution and not request.HasField("execution"):
            job = kind.execution(request.task, request.rollout.completion)
            if not job.code.strip():  # nothing to run: a failure to score, not a bad request
                nothing = integrity.seal(execution_pb2.ExecutionResult(not_run="the completion holds no program"),
                                         job, self.scorer.secret)  # the verifier's own finding
                request = verdict_pb2.VerifyRequest(task=request.task, rollout=request.rollout, execution=nothing)
                return await self._score(request, context)
            job.request_id = request.rollout.id
            try:
                reply = await self._sandbox().Execute(job, timeout=max(30.0, job.timeout_s * 3))
            except grpc.aio.AioRpcError as exc:
                code = exc.code() if exc.code() in _PASSED_ON else grpc.StatusCode.UNAVAILABLE
                await context.abort(code, f"the sandbox at {self.sandbox_target} (CRUCIBLE_VERIFIER_SANDBOX_TARGET) "
                                          f"could not run rollout {request.rollout.id!r}: {exc.code().name}: "
                                          f"{exc.details()}")
            request = verdict_pb2.VerifyRequest(task=request.task, rollout=request.rollout, execution=reply.result)
        return await self._score(request, context)

    async def _score(self, request: verdict_pb2.VerifyRequest, context):
        try:
            return await self.scorer.verify(request)
        except handler.Unverifiable as exc:
            await rpc.abort_invalid(context, str(exc))
        except ScoringError as exc:
            await context.abort(grpc.StatusCode.INTERNAL, f"scoring rollout {request.rollout.id!r} failed: {exc}")
