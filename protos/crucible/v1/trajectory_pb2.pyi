import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Trajectory(_message.Message):
    __slots__ = ("id", "task_id", "group_id", "sample_index", "group_size", "policy_version", "prompt_token_ids", "completion_token_ids", "logprobs", "temperature", "top_p", "reward", "advantage", "estimator", "passed", "tampered", "truncated", "group_complete", "group_received", "created_at", "heldout", "loss_mask", "turns", "signature")
    ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGE_FIELD_NUMBER: _ClassVar[int]
    ESTIMATOR_FIELD_NUMBER: _ClassVar[int]
    PASSED_FIELD_NUMBER: _ClassVar[int]
    TAMPERED_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    GROUP_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    GROUP_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    HELDOUT_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    id: str
    task_id: str
    group_id: str
    sample_index: int
    group_size: int
    policy_version: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    temperature: float
    top_p: float
    reward: float
    advantage: float
    estimator: str
    passed: bool
    tampered: bool
    truncated: bool
    group_complete: bool
    group_received: int
    created_at: _timestamp_pb2.Timestamp
    heldout: bool
    loss_mask: _containers.RepeatedScalarFieldContainer[bool]
    turns: int
    signature: bytes
    def __init__(self, id: _Optional[str] = ..., task_id: _Optional[str] = ..., group_id: _Optional[str] = ..., sample_index: _Optional[int] = ..., group_size: _Optional[int] = ..., policy_version: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., completion_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., reward: _Optional[float] = ..., advantage: _Optional[float] = ..., estimator: _Optional[str] = ..., passed: _Optional[bool] = ..., tampered: _Optional[bool] = ..., truncated: _Optional[bool] = ..., group_complete: _Optional[bool] = ..., group_received: _Optional[int] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., heldout: _Optional[bool] = ..., loss_mask: _Optional[_Iterable[bool]] = ..., turns: _Optional[int] = ..., signature: _Optional[bytes] = ...) -> None: ...
