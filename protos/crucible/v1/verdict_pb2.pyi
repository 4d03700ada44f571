import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from crucible.v1 import rollout_pb2 as _rollout_pb2
from crucible.v1 import execution_pb2 as _execution_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Verdict(_message.Message):
    __slots__ = ("id", "rollout", "components", "reward", "tampered", "tamper_patterns", "execution", "verifier_version", "detail", "created_at")
    class ComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    TAMPERED_FIELD_NUMBER: _ClassVar[int]
    TAMPER_PATTERNS_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_VERSION_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    id: str
    rollout: _rollout_pb2.Rollout
    components: _containers.ScalarMap[str, float]
    reward: float
    tampered: bool
    tamper_patterns: _containers.RepeatedScalarFieldContainer[str]
    execution: _execution_pb2.ExecutionResult
    verifier_version: str
    detail: str
    created_at: _timestamp_pb2.Timestamp
    def __init__(self, id: _Optional[str] = ..., rollout: _Optional[_Union[_rollout_pb2.Rollout, _Mapping]] = ..., components: _Optional[_Mapping[str, float]] = ..., reward: _Optional[float] = ..., tampered: _Optional[bool] = ..., tamper_patterns: _Optional[_Iterable[str]] = ..., execution: _Optional[_Union[_execution_pb2.ExecutionResult, _Mapping]] = ..., verifier_version: _Optional[str] = ..., detail: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("rollout", "execution")
    ROLLOUT_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_FIELD_NUMBER: _ClassVar[int]
    rollout: _rollout_pb2.Rollout
    execution: _execution_pb2.ExecutionResult
    def __init__(self, rollout: _Optional[_Union[_rollout_pb2.Rollout, _Mapping]] = ..., execution: _Optional[_Union[_execution_pb2.ExecutionResult, _Mapping]] = ...) -> None: ...
