"""Pure translation between messages and sandbox jobs: a group's rollouts -> jobs, results -> Execution."""
from __future__ import annotations

import datetime as dt

from crucible.v1 import execution_pb2, rollout_pb2, task_pb2
from crucible.services.sandbox_executor.pool import Job, Result
from crucible.ml import kinds

VIOLATIONS = {
    "": execution_pb2.VIOLATION_NONE,
    "timeout": execution_pb2.VIOLATION_TIMEOUT,
    "memory": execution_pb2.VIOLATION_MEMORY,
    "output_cap": execution_pb2.VIOLATION_OUTPUT_CAP,
    "forbidden_syscall": execution_pb2.VIOLATION_FORBIDDEN_SYSCALL,
    "cpu": execution_pb2.VIOLATION_CPU,
    "file_size": execution_pb2.VIOLATION_FILE_SIZE,
    "processes": execution_pb2.VIOLATION_PROCESSES,
}
ISOLATION = {
    "full": execution_pb2.ISOLATION_LEVEL_FULL,
    "partial": execution_pb2.ISOLATION_LEVEL_PARTIAL,
    "none": execution_pb2.ISOLATION_LEVEL_NONE,
}


def needs_execution(group: rollout_pb2.RolloutGroup) -> bool:
    """Whether the task's kind runs code. Unknown kinds are not ours: the verifier dead-letters them."""
    try:
        return kinds.get(group.task.kind).needs_execution
    except kinds.UnknownKind:
        return False


def request_for_rollout(task: task_pb2.Task, rollout: rollout_pb2.Rollout) -> execution_pb2.ExecuteRequest:
    """What the task's kind asks the sandbox to run for this completion (empty when it runs nothing):
    the very request the verifier rebuilds to check a result's seal."""
    return kinds.get(task.kind).execution(task, rollout.completion) or execution_pb2.ExecuteRequest()


class NothingToRun(ValueError):
    """A completion with no program in it: recorded as not run (and scored a failure), not an error."""


def job_for_request(request: execution_pb2.ExecuteRequest) -> Job:
    if not request.code.strip():
        raise NothingToRun("code is empty: nothing to execute")
    return Job(code=request.code, language=request.language or "python", tests=request.test_code,
               entry_point=request.entry_point, stdin=request.stdin, timeout_s=request.timeout_s,
               memory_bytes=request.memory_bytes, prelude=request.test_prelude)


def result_message(result: Result) -> execution_pb2.ExecutionResult:
    return execution_pb2.ExecutionResult(
        exit_code=result.exit_code,
        signal=result.signal,
        tests=[execution_pb2.TestOutcome(name=t["name"], passed=t["passed"], message=t.get("message", ""))
               for t in result.tests],
        tests_declared=result.tests_declared,
        stdout=result.stdout,
        stderr=result.stderr,
        stdout_truncated=result.stdout_truncated,
        stderr_truncated=result.stderr_truncated,
        usage=execution_pb2.ResourceUsage(cpu_user_s=result.cpu_user_s, cpu_system_s=result.cpu_system_s,
                                          max_rss_bytes=result.max_rss_bytes, source=result.usage_source),
        duration_ms=result.duration_ms,
        isolation=ISOLATION[result.isolation],
        missing_guarantees=result.missing_guarantees,
        violation=VIOLATIONS[result.violation],
        violation_detail=result.violation_detail,
        tamper=[execution_pb2.TamperSignal(pattern=t["pattern"], detail=t["detail"]) for t in result.tamper],
    )


def not_run_result(reason: str) -> execution_pb2.ExecutionResult:
    return execution_pb2.ExecutionResult(not_run=reason)


def execution_message(group: rollout_pb2.RolloutGroup, results: list[execution_pb2.ExecutionResult],
                      executor_id: str) -> execution_pb2.Execution:
    execution = execution_pb2.Execution(id=f"{group.group_id}/exec", group=group, results=results,
                                        executor_id=executor_id)
    execution.created_at.FromDatetime(dt.datetime.now(dt.timezone.utc))
    return execution
