"""Control gRPC: submit tasks to the bus, report a run's status, query stored trajectories."""
from __future__ import annotations

import asyncio
import base64
import json

import grpc

from crucible.v1 import control_pb2, control_pb2_grpc
from crucible.ml.tasks import training_submission_problems
from crucible.services.control.handler import prepare_submission
from crucible.shared import bus, rpc, store
from crucible.shared.settings import Settings, run_id_problem


class ControlServicer(control_pb2_grpc.ControlServicer):
    def __init__(self, settings: Settings, producer: bus.Producer, store_client=None):
        self.settings = settings
        self.producer = producer
        self.store = store_client
        self._checking = rpc.Admission(CHECKING_BYTES, "bytes of submitted tasks being checked")

    async def SubmitTasks(self, request: control_pb2.SubmitTasksRequest, context):
        if not request.tasks:
            await rpc.abort_invalid(context, "no tasks given: put at least one Task in `tasks`")
        def checked():
            prepared, problems = [], []
            for i, task in enumerate(request.tasks):
                try:
                    prepared.append(prepare_submission(task, self.settings))
                except ValueError as exc:
                    problems.append(f"tasks[{i}]: {exc}")
            return prepared, problems + training_submission_problems(prepared)

        # Off the event loop: a python_tests task's test code is parsed and walked (a second a few
        # hundred KB), and the server answers every other call meanwhile; so much at once, no more.
        async with self._checking.admit(context, request.ByteSize()):
            prepared, problems = await asyncio.to_thread(checked)
        if problems:
            # All or nothing: a caller fixing one task should not have to work out which others went through.
            await rpc.abort_invalid(context, "; ".join(problems))
        sent = []
        try:
            for t in prepared:
                sent.append(await self.producer.send("tasks", t, key=t.id))
            await asyncio.gather(*sent)
        except Exception as exc:  # noqa: BLE001 -- the broker's refusal or absence, said as such
            taken = sum(f.done() and not f.cancelled() and f.exception() is None for f in sent)
            await rpc.abort(context, grpc.StatusCode.UNAVAILABLE,
                            f"the broker took {taken} of {len(prepared)} tasks before failing ({type(exc).__name__}); "
                            "a task published again under its id is one task: submit them all again")
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
            submitted = self.store.query(f"SELECT count() FROM {store.TASKS_TABLE} FINAL WHERE run_id = {{r:String}}",
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
            await rpc.abort_invalid(context, f"limit {request.limit} is above 10000: page with page_token")
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
        if request.page_token:
            after = _page_after(request.page_token)
            if after is None:
                await rpc.abort_invalid(context, "page_token is not one this service gave: pass a response's "
                                                 "next_page_token as it is")
            where.append("(policy_version, group_id, sample_index) > ({pv:UInt64}, {pg:String}, {pi:UInt32})")
            params.update(zip(("pv", "pg", "pi"), after))
        limit = request.limit or 100
        # In a thread: a large page took the event loop (health checks, the task log) for seconds.
        rows = (await asyncio.to_thread(
            self.store.query,
            "SELECT trajectory_id, task_id, group_id, sample_index, task_kind, policy_version, completion, "
            f"reward, advantage FROM trajectories FINAL WHERE {' AND '.join(where)} "
            "ORDER BY policy_version, group_id, sample_index LIMIT {limit:UInt32}",
            parameters={**params, "limit": limit},
        )).result_rows
        reply, size = control_pb2.QueryTrajectoriesResponse(), 0
        for r in rows:
            row = control_pb2.TrajectoryRow(
                trajectory_id=r[0], task_id=r[1], group_id=r[2], sample_index=r[3], task_kind=r[4],
                policy_version=r[5], completion=r[6], reward=r[7], advantage=r[8])
            size += row.ByteSize()
            if reply.rows and size > PAGE_BYTES:  # 10,000 long completions were 40 MB: past what a reply may be
                break
            reply.rows.append(row)
        if len(reply.rows) < len(rows) or len(rows) == limit:
            last = reply.rows[-1]
            reply.next_page_token = _page_token(last.policy_version, last.group_id, last.sample_index)
        return reply


CHECKING_BYTES = 64 << 20  # two of the largest requests a server takes (rpc.MAX_MESSAGE_BYTES) checked at once
PAGE_BYTES = 8 << 20  # a page's rows, encoded, at most (a row past it starts the next page)


def _page_token(version: int, group_id: str, sample_index: int) -> str:
    """Where the next page starts: after this row, in the pages' order (policy version, group, sample)."""
    return base64.urlsafe_b64encode(json.dumps([version, group_id, sample_index]).encode()).decode()


def _page_after(token: str) -> tuple[int, str, int] | None:
    if len(token) > 8192:
        return None
    try:
        version, group_id, index = json.loads(base64.urlsafe_b64decode(token.encode("ascii")))
    except (ValueError, TypeError, UnicodeError, RecursionError):
        return None
    if not (type(version) is int and 0 <= version < 2**64 and type(group_id) is str and len(group_id) <= 4096
            and type(index) is int and 0 <= index < 2**32):
        return None
    return version, group_id, index
