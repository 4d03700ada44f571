"""Verifier gRPC: Verify scores one rollout, VerifyBatch many (each judged as Verify would judge it
alone); a python_tests rollout without an execution is run in the Sandbox first."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc

from crucible.v1 import execution_pb2, execution_pb2_grpc, verdict_pb2, verdict_pb2_grpc
from crucible.services.verifier import handler
from crucible.services.verifier.scorer_pool import ScorerPool, ScoringError
from crucible.shared import integrity, rpc

# Sandbox answers passed on as they are: the caller's request was bad, or the sandbox is full.
_PASSED_ON = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
BATCH_MAX = 1024  # requests in one VerifyBatch call
RUNS_AT_ONCE = 16  # sandbox runs in flight from this verifier, whatever the calls: none floods the sandbox
UNDER_WAY_MAX = 2 * BATCH_MAX  # requests in calls under way (1,500 Verify calls of 256 KB queued: 950 MB)


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request has no verdict: the status Verify ends its call with."""

    code: grpc.StatusCode
    message: str


class VerifierServicer(verdict_pb2_grpc.VerifierServicer):
    def __init__(self, scorer: ScorerPool, sandbox_target: str):
        self.scorer = scorer
        self.sandbox_target = sandbox_target
        self._channel = None
        self._runs = asyncio.Semaphore(RUNS_AT_ONCE)
        self._under_way = rpc.Admission(UNDER_WAY_MAX, "verify requests")

    def _sandbox(self) -> execution_pb2_grpc.SandboxStub:
        if self._channel is None:
            self._channel = rpc.channel(self.sandbox_target)
        return execution_pb2_grpc.SandboxStub(self._channel)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()

    async def Verify(self, request: verdict_pb2.VerifyRequest, context):
        async with self._under_way.admit(context):
            [outcome] = await self.outcomes([request])
        if isinstance(outcome, Refusal):
            await rpc.abort(context, outcome.code, outcome.message)
        return outcome

    async def VerifyBatch(self, request: verdict_pb2.VerifyBatchRequest, context):
        if len(request.requests) > BATCH_MAX:
            await rpc.abort_invalid(context, f"a batch of {len(request.requests)} requests; at most {BATCH_MAX} "
                                             "are taken in one call")
        async with self._under_way.admit(context, max(1, len(request.requests))):
            outcomes = await self.outcomes(list(request.requests))
        return verdict_pb2.VerifyBatchResponse(outcomes=[
            verdict_pb2.VerifyOutcome(refusal=verdict_pb2.VerifyRefusal(code=o.code.value[0], message=o.message))
            if isinstance(o, Refusal) else verdict_pb2.VerifyOutcome(verdict=o) for o in outcomes])

    async def outcomes(self, requests: list[verdict_pb2.VerifyRequest]) -> list[verdict_pb2.Verdict | Refusal]:
        """Each request's verdict or the reason it has none, in order: what needs running is run in the
        sandbox (RUNS_AT_ONCE at a time), then everything is scored together (ScorerPool.verify_each)."""
        ready = await asyncio.gather(*(self._executed(r) for r in requests))
        scorable = [i for i, r in enumerate(ready) if not isinstance(r, Refusal)]
        scored = await self.scorer.verify_each([ready[i] for i in scorable])
        for i, outcome in zip(scorable, scored):
            if isinstance(outcome, handler.Unverifiable):
                ready[i] = Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(outcome))
            elif isinstance(outcome, ScoringError):
                ready[i] = Refusal(grpc.StatusCode.INTERNAL,
                                   f"scoring rollout {requests[i].rollout.id!r} failed: {outcome}")
            elif isinstance(outcome, Exception):
                raise outcome
            else:
                if not requests[i].HasField("execution"):
                    # A run this verifier made for a caller, who may ask again until a flaky program passes:
                    # the result goes back without its seal, so it is never presented for a sampled rollout.
                    outcome.execution.ClearField("seal")
                ready[i] = outcome
        return ready

    async def _executed(self, request: verdict_pb2.VerifyRequest) -> verdict_pb2.VerifyRequest | Refusal:
        """The request with the execution its kind scores (run in the sandbox where it came without
        one), or why it cannot be scored."""
        try:  # the task's signature first (a request with no task is told so): nothing of a task no
            # trusted submitter signed is run
            if request.task.kind:
                integrity.check_task(request.task, self.scorer.secret)
            kind = handler.kind_for(request.task, f"rollout {request.rollout.id[:200]!r}")
        except (handler.Unverifiable, integrity.IntegrityError) as exc:
            return Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if not kind.needs_execution or request.HasField("execution"):
            return request
        job = kind.execution(request.task, request.rollout.completion)
        if not job.code.strip():  # nothing to run: a failure to score, not a bad request
            result = integrity.seal(execution_pb2.ExecutionResult(not_run="the completion holds no program"),
                                    job, self.scorer.secret, request.rollout.id)  # the verifier's own finding
        else:
            job.request_id = request.rollout.id
            try:
                async with self._runs:
                    result = (await self._sandbox().Execute(job, timeout=max(30.0, job.timeout_s * 3))).result
            except grpc.aio.AioRpcError as exc:
                code = exc.code() if exc.code() in _PASSED_ON else grpc.StatusCode.UNAVAILABLE
                return Refusal(code, f"the sandbox at {self.sandbox_target} (CRUCIBLE_VERIFIER_SANDBOX_TARGET) "
                                     f"could not run rollout {request.rollout.id!r}: {exc.code().name}: "
                                     f"{exc.details()}")
            try:  # the sandbox's answer to this verifier's own call: a run of this rollout, sealed as one
                integrity.check_execution(result, job, self.scorer.secret)
            except integrity.IntegrityError as exc:
                return Refusal(grpc.StatusCode.UNAVAILABLE, f"the sandbox at {self.sandbox_target} answered with a "
                                                            f"result this verifier cannot trust: {exc}")
            integrity.seal(result, job, self.scorer.secret, request.rollout.id)
        return verdict_pb2.VerifyRequest(task=request.task, rollout=request.rollout, execution=result)
