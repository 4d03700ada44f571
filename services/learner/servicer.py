"""Learner gRPC: the current policy version."""
from __future__ import annotations

import grpc

from crucible.shared import rpc
from crucible.shared.settings import run_id_problem
from crucible.v1 import policy_pb2, policy_pb2_grpc


class LearnerServicer(policy_pb2_grpc.LearnerServicer):
    def __init__(self, run_id: str):
        self.run_id = run_id
        self.current: policy_pb2.PolicyVersion | None = None

    def publish(self, pv: policy_pb2.PolicyVersion) -> None:
        self.current = pv

    async def GetPolicy(self, request: policy_pb2.GetPolicyRequest, context):
        if request.run_id and (problem := run_id_problem(request.run_id)):
            await rpc.abort_invalid(context, problem)
        if request.run_id and request.run_id != self.run_id:
            await rpc.abort(context, grpc.StatusCode.NOT_FOUND,
                                f"this learner trains run {self.run_id!r}, not {request.run_id!r}")
        if self.current is None:
            await rpc.abort(context, grpc.StatusCode.UNAVAILABLE, "no policy published yet; retry shortly")
        return self.current
