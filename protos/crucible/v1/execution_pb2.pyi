import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from crucible.v1 import rollout_pb2 as _rollout_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class IsolationLevel(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ISOLATION_LEVEL_UNSPECIFIED: _ClassVar[IsolationLevel]
    ISOLATION_LEVEL_NONE: _ClassVar[IsolationLevel]
    ISOLATION_LEVEL_PARTIAL: _ClassVar[IsolationLevel]
    ISOLATION_LEVEL_FULL: _ClassVar[IsolationLevel]

class Violation(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VIOLATION_NONE: _ClassVar[Violation]
    VIOLATION_TIMEOUT: _ClassVar[Violation]
    VIOLATION_MEMORY: _ClassVar[Violation]
    VIOLATION_OUTPUT_CAP: _ClassVar[Violation]
    VIOLATION_FORBIDDEN_SYSCALL: _ClassVar[Violation]
    VIOLATION_CPU: _ClassVar[Violation]
    VIOLATION_FILE_SIZE: _ClassVar[Violation]
    VIOLATION_PROCESSES: _ClassVar[Violation]
ISOLATION_LEVEL_UNSPECIFIED: IsolationLevel
ISOLATION_LEVEL_NONE: IsolationLevel
ISOLATION_LEVEL_PARTIAL: IsolationLevel
ISOLATION_LEVEL_FULL: IsolationLevel
VIOLATION_NONE: Violation
VIOLATION_TIMEOUT: Violation
VIOLATION_MEMORY: Violation
VIOLATION_OUTPUT_CAP: Violation
VIOLATION_FORBIDDEN_SYSCALL: Violation
VIOLATION_CPU: Violation
VIOLATION_FILE_SIZE: Violation
VIOLATION_PROCESSES: Violation

class Execution(_message.Message):
    __slots__ = ("id", "group", "results", "executor_id", "created_at")
    ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    id: str
    group: _rollout_pb2.RolloutGroup
    results: _containers.RepeatedCompositeFieldContainer[ExecutionResult]
    executor_id: str
    created_at: _timestamp_pb2.Timestamp
    def __init__(self, id: _Optional[str] = ..., group: _Optional[_Union[_rollout_pb2.RolloutGroup, _Mapping]] = ..., results: _Optional[_Iterable[_Union[ExecutionResult, _Mapping]]] = ..., executor_id: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ExecutionResult(_message.Message):
    __slots__ = ("exit_code", "signal", "tests", "stdout", "stderr", "stdout_truncated", "stderr_truncated", "usage", "duration_ms", "isolation", "missing_guarantees", "violation", "violation_detail", "tamper", "not_run", "tests_declared", "job_digest", "seal")
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    TESTS_FIELD_NUMBER: _ClassVar[int]
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    STDOUT_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    STDERR_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    ISOLATION_FIELD_NUMBER: _ClassVar[int]
    MISSING_GUARANTEES_FIELD_NUMBER: _ClassVar[int]
    VIOLATION_FIELD_NUMBER: _ClassVar[int]
    VIOLATION_DETAIL_FIELD_NUMBER: _ClassVar[int]
    TAMPER_FIELD_NUMBER: _ClassVar[int]
    NOT_RUN_FIELD_NUMBER: _ClassVar[int]
    TESTS_DECLARED_FIELD_NUMBER: _ClassVar[int]
    JOB_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SEAL_FIELD_NUMBER: _ClassVar[int]
    exit_code: int
    signal: int
    tests: _containers.RepeatedCompositeFieldContainer[TestOutcome]
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    usage: ResourceUsage
    duration_ms: float
    isolation: IsolationLevel
    missing_guarantees: _containers.RepeatedScalarFieldContainer[str]
    violation: Violation
    violation_detail: str
    tamper: _containers.RepeatedCompositeFieldContainer[TamperSignal]
    not_run: str
    tests_declared: _containers.RepeatedScalarFieldContainer[str]
    job_digest: bytes
    seal: bytes
    def __init__(self, exit_code: _Optional[int] = ..., signal: _Optional[int] = ..., tests: _Optional[_Iterable[_Union[TestOutcome, _Mapping]]] = ..., stdout: _Optional[bytes] = ..., stderr: _Optional[bytes] = ..., stdout_truncated: _Optional[bool] = ..., stderr_truncated: _Optional[bool] = ..., usage: _Optional[_Union[ResourceUsage, _Mapping]] = ..., duration_ms: _Optional[float] = ..., isolation: _Optional[_Union[IsolationLevel, str]] = ..., missing_guarantees: _Optional[_Iterable[str]] = ..., violation: _Optional[_Union[Violation, str]] = ..., violation_detail: _Optional[str] = ..., tamper: _Optional[_Iterable[_Union[TamperSignal, _Mapping]]] = ..., not_run: _Optional[str] = ..., tests_declared: _Optional[_Iterable[str]] = ..., job_digest: _Optional[bytes] = ..., seal: _Optional[bytes] = ...) -> None: ...

class TamperSignal(_message.Message):
    __slots__ = ("pattern", "detail")
    PATTERN_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    pattern: str
    detail: str
    def __init__(self, pattern: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class TestOutcome(_message.Message):
    __slots__ = ("name", "passed", "message")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PASSED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    name: str
    passed: bool
    message: str
    def __init__(self, name: _Optional[str] = ..., passed: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class ResourceUsage(_message.Message):
    __slots__ = ("cpu_user_s", "cpu_system_s", "max_rss_bytes", "source")
    CPU_USER_S_FIELD_NUMBER: _ClassVar[int]
    CPU_SYSTEM_S_FIELD_NUMBER: _ClassVar[int]
    MAX_RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    cpu_user_s: float
    cpu_system_s: float
    max_rss_bytes: int
    source: str
    def __init__(self, cpu_user_s: _Optional[float] = ..., cpu_system_s: _Optional[float] = ..., max_rss_bytes: _Optional[int] = ..., source: _Optional[str] = ...) -> None: ...

class ExecuteRequest(_message.Message):
    __slots__ = ("request_id", "language", "code", "test_code", "entry_point", "stdin", "timeout_s", "memory_bytes", "test_prelude")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    TEST_CODE_FIELD_NUMBER: _ClassVar[int]
    ENTRY_POINT_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    TEST_PRELUDE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    language: str
    code: str
    test_code: str
    entry_point: str
    stdin: bytes
    timeout_s: float
    memory_bytes: int
    test_prelude: str
    def __init__(self, request_id: _Optional[str] = ..., language: _Optional[str] = ..., code: _Optional[str] = ..., test_code: _Optional[str] = ..., entry_point: _Optional[str] = ..., stdin: _Optional[bytes] = ..., timeout_s: _Optional[float] = ..., memory_bytes: _Optional[int] = ..., test_prelude: _Optional[str] = ...) -> None: ...

class ExecuteResponse(_message.Message):
    __slots__ = ("request_id", "result", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    result: ExecutionResult
    error: str
    def __init__(self, request_id: _Optional[str] = ..., result: _Optional[_Union[ExecutionResult, _Mapping]] = ..., error: _Optional[str] = ...) -> None: ...
