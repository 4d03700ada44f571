import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from crucible.v1 import execution_pb2 as _execution_pb2
from crucible.v1 import rollout_pb2 as _rollout_pb2
from crucible.v1 import task_pb2 as _task_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EpisodeEnd(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EPISODE_END_UNSPECIFIED: _ClassVar[EpisodeEnd]
    EPISODE_END_ANSWER: _ClassVar[EpisodeEnd]
    EPISODE_END_TURN_LIMIT: _ClassVar[EpisodeEnd]
    EPISODE_END_TOKEN_LIMIT: _ClassVar[EpisodeEnd]
    EPISODE_END_DONE: _ClassVar[EpisodeEnd]
EPISODE_END_UNSPECIFIED: EpisodeEnd
EPISODE_END_ANSWER: EpisodeEnd
EPISODE_END_TURN_LIMIT: EpisodeEnd
EPISODE_END_TOKEN_LIMIT: EpisodeEnd
EPISODE_END_DONE: EpisodeEnd

class Episode(_message.Message):
    __slots__ = ("id", "group_id", "index", "group_size", "task", "prompt_token_ids", "turns", "temperature", "top_p", "end", "generator_id", "backend", "sample_ms", "call_format", "created_at", "signature")
    ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    GENERATOR_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_MS_FIELD_NUMBER: _ClassVar[int]
    CALL_FORMAT_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    id: str
    group_id: str
    index: int
    group_size: int
    task: _task_pb2.Task
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    turns: _containers.RepeatedCompositeFieldContainer[Turn]
    temperature: float
    top_p: float
    end: EpisodeEnd
    generator_id: str
    backend: str
    sample_ms: float
    call_format: str
    created_at: _timestamp_pb2.Timestamp
    signature: bytes
    def __init__(self, id: _Optional[str] = ..., group_id: _Optional[str] = ..., index: _Optional[int] = ..., group_size: _Optional[int] = ..., task: _Optional[_Union[_task_pb2.Task, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., turns: _Optional[_Iterable[_Union[Turn, _Mapping]]] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., end: _Optional[_Union[EpisodeEnd, str]] = ..., generator_id: _Optional[str] = ..., backend: _Optional[str] = ..., sample_ms: _Optional[float] = ..., call_format: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., signature: _Optional[bytes] = ...) -> None: ...

class Turn(_message.Message):
    __slots__ = ("token_ids", "logprobs", "text", "policy_version", "finish_reason", "call", "observation", "call_failed", "observation_token_ids", "execution_ms", "sandboxed", "violation", "violation_detail")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    CALL_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    CALL_FAILED_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_MS_FIELD_NUMBER: _ClassVar[int]
    SANDBOXED_FIELD_NUMBER: _ClassVar[int]
    VIOLATION_FIELD_NUMBER: _ClassVar[int]
    VIOLATION_DETAIL_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    text: str
    policy_version: int
    finish_reason: _rollout_pb2.FinishReason
    call: ToolCall
    observation: str
    call_failed: bool
    observation_token_ids: _containers.RepeatedScalarFieldContainer[int]
    execution_ms: float
    sandboxed: bool
    violation: _execution_pb2.Violation
    violation_detail: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., text: _Optional[str] = ..., policy_version: _Optional[int] = ..., finish_reason: _Optional[_Union[_rollout_pb2.FinishReason, str]] = ..., call: _Optional[_Union[ToolCall, _Mapping]] = ..., observation: _Optional[str] = ..., call_failed: _Optional[bool] = ..., observation_token_ids: _Optional[_Iterable[int]] = ..., execution_ms: _Optional[float] = ..., sandboxed: _Optional[bool] = ..., violation: _Optional[_Union[_execution_pb2.Violation, str]] = ..., violation_detail: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("name", "arguments_json", "error")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    name: str
    arguments_json: str
    error: str
    def __init__(self, name: _Optional[str] = ..., arguments_json: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...
