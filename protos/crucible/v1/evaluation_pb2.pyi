import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Evaluation(_message.Message):
    __slots__ = ("run_id", "policy_version", "tasks", "passed", "pass_rate", "by_kind", "evaluator_id", "eval_ms", "created_at", "samples", "samples_passed", "signature")
    class ByKindEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: KindResult
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[KindResult, _Mapping]] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    PASSED_FIELD_NUMBER: _ClassVar[int]
    PASS_RATE_FIELD_NUMBER: _ClassVar[int]
    BY_KIND_FIELD_NUMBER: _ClassVar[int]
    EVALUATOR_ID_FIELD_NUMBER: _ClassVar[int]
    EVAL_MS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PASSED_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    policy_version: int
    tasks: int
    passed: int
    pass_rate: float
    by_kind: _containers.MessageMap[str, KindResult]
    evaluator_id: str
    eval_ms: float
    created_at: _timestamp_pb2.Timestamp
    samples: int
    samples_passed: int
    signature: bytes
    def __init__(self, run_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., tasks: _Optional[int] = ..., passed: _Optional[int] = ..., pass_rate: _Optional[float] = ..., by_kind: _Optional[_Mapping[str, KindResult]] = ..., evaluator_id: _Optional[str] = ..., eval_ms: _Optional[float] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., samples: _Optional[int] = ..., samples_passed: _Optional[int] = ..., signature: _Optional[bytes] = ...) -> None: ...

class KindResult(_message.Message):
    __slots__ = ("tasks", "passed", "samples", "samples_passed")
    TASKS_FIELD_NUMBER: _ClassVar[int]
    PASSED_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PASSED_FIELD_NUMBER: _ClassVar[int]
    tasks: int
    passed: int
    samples: int
    samples_passed: int
    def __init__(self, tasks: _Optional[int] = ..., passed: _Optional[int] = ..., samples: _Optional[int] = ..., samples_passed: _Optional[int] = ...) -> None: ...
