"""Control gRPC: submit tasks to the bus, report a run's status, query stored trajectories."""
from __future__ import annotations

import asyncio

import grpc

from crucible.v1 import control_pb2, control_pb2_grpc
from crucible.ml.tasks import training_submission_problems
from crucible.services.control.handler import prepare_submission
from crucible.shared import bus, rpc
from crucible.shared.settings import Settings, run_id_problem


class ControlServicer(control_pb2_grpc.ControlServicer):
    def __init__(self, settings: Settings, producer: bus.Producer, store_client=None):
        self.settings = settings
        self.producer = producer
        self.store = store_client

    async def SubmitTasks(self, request: control_pb2.SubmitTasksRequest, context):
        if not request.tasks:
            await rpc.abort_invalid(context, "no tasks given: put at least one Task in `tasks`")
        prepared, problems = [], []
        for i, task in enumerate(request.tasks):
            try:
                prepared.append(prepare_submission(task, self.settings))
            except ValueError as exc:
                problems.append(f"tasks[{i}]: {exc}")
        problems += training_submission_problems(prepared)
        if problems:
            # All or nothing: a caller fixing one task should not have to work out which others went through.
            await rpc.abort_invalid(context, "; ".join(problems))
        futures = [await self.producer.send("tasks", t, key=t.id) for t in prepared]
        for f in futures:
            await f
        return control_pb2.SubmitTasksResponse(task_ids=[t.id for t in prepared])

    async def GetRunStatus(self, request, context):
        """The run named (this control service's own when none is): its tasks, samples, mean reward and
        newest policy version; NOT_FOUND for a run the store has nothing of."""
        if self.store is None:
            await rpc.abort(context, grpc.StatusCode.UNAVAILABLE, "no store configured for this control service")
        if request.run_id and (problem := run_id_problem(request.run_id)):
            await rpc.abort_invalid(context, problem)
        run_id = request.run_id or self.settings.run_id

        def counts():
            params = {"r": run_id}
            submitted = self.store.query("SELECT count() FROM tasks FINAL WHERE run_id = {r:String}",
                                         parameters=params).result_rows[0][0]
            samples = self.store.query("SELECT count(), avg(reward) FROM trajectories FINAL WHERE run_id = {r:String}",
                                       parameters=params).result_rows[0]
            version = self.store.query("SELECT max(version), count() FROM policy_versions FINAL WHERE run_id = {r:String}",
                                       parameters=params).result_rows[0]
            return submitted, samples, version

        submitted, (samples, reward), (version, versions) = await asyncio.to_thread(counts)
        if not (submitted or samples or versions):
            await rpc.abort(context, grpc.StatusCode.NOT_FOUND, f"the store holds nothing of run {run_id!r}")
        return control_pb2.RunStatus(run_id=run_id, tasks_submitted=submitted, trajectories=samples,
                                     reward_mean=float(reward or 0.0) if samples else 0.0,
                                     policy_version=int(version or 0))

    async def QueryTrajectories(self, request: control_pb2.QueryTrajectoriesRequest, context):
        if self.store is None:
            await rpc.abort(context, grpc.StatusCode.UNAVAILABLE, "no store configured for this control service")
        if request.limit > 10_000:
            await rpc.abort_invalid(context, f"limit {request.limit} is above 10000: page with min_policy_version")
        for column in ("task_id", "group_id"):
            if len(getattr(request, column)) > 512:
                await rpc.abort_invalid(context, f"{column} is {len(getattr(request, column))} characters: at most 512")
        if request.run_id and (problem := run_id_problem(request.run_id)):
            await rpc.abort_invalid(context, problem)
        # Of the run named (this control service's own when none is), as GetRunStatus.
        where = ["run_id = {run_id:String}", "policy_version >= {v:UInt64}"]
        params = {"run_id": request.run_id or self.settings.run_id, "v": request.min_policy_version}
        for column in ("task_id", "group_id"):
            if getattr(request, column):
                where.append(f"{column} = {{{column}:String}}")
                params[column] = getattr(request, column)
        # In a thread: a large page took the event loop (health checks, the task log) for seconds.
        rows = (await asyncio.to_thread(
            self.store.query,
            "SELECT trajectory_id, task_id, group_id, sample_index, task_kind, policy_version, completion, "
            f"reward, advantage FROM trajectories FINAL WHERE {' AND '.join(where)} "
            "ORDER BY policy_version, group_id, sample_index LIMIT {limit:UInt32}",
            parameters={**params, "limit": request.limit or 100},
        )).result_rows
        return control_pb2.QueryTrajectoriesResponse(rows=[
            control_pb2.TrajectoryRow(
                trajectory_id=r[0], task_id=r[1], group_id=r[2], sample_index=r[3], task_kind=r[4],
                policy_version=r[5], completion=r[6], reward=r[7], advantage=r[8],
            ) for r in rows
        ])
