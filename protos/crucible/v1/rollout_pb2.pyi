import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from crucible.v1 import task_pb2 as _task_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class RolloutGroup(_message.Message):
    __slots__ = ("group_id", "task", "policy_version", "temperature", "top_p", "prompt_token_ids", "rollouts", "generator_id", "backend", "sample_ms", "created_at", "signature")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    GENERATOR_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_MS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    task: _task_pb2.Task
    policy_version: int
    temperature: float
    top_p: float
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    rollouts: _containers.RepeatedCompositeFieldContainer[Rollout]
    generator_id: str
    backend: str
    sample_ms: float
    created_at: _timestamp_pb2.Timestamp
    signature: bytes
    def __init__(self, group_id: _Optional[str] = ..., task: _Optional[_Union[_task_pb2.Task, _Mapping]] = ..., policy_version: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., rollouts: _Optional[_Iterable[_Union[Rollout, _Mapping]]] = ..., generator_id: _Optional[str] = ..., backend: _Optional[str] = ..., sample_ms: _Optional[float] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., signature: _Optional[bytes] = ...) -> None: ...

class Rollout(_message.Message):
    __slots__ = ("id", "sample_index", "completion", "token_ids", "logprobs", "finish_reason")
    ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    id: str
    sample_index: int
    completion: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: FinishReason
    def __init__(self, id: _Optional[str] = ..., sample_index: _Optional[int] = ..., completion: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ...) -> None: ...
