import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from crucible.v1 import verdict_pb2 as _verdict_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Trajectory(_message.Message):
    __slots__ = ("id", "verdict", "reward", "advantage", "estimator", "group_complete", "group_received", "created_at")
    ID_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGE_FIELD_NUMBER: _ClassVar[int]
    ESTIMATOR_FIELD_NUMBER: _ClassVar[int]
    GROUP_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    GROUP_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    id: str
    verdict: _verdict_pb2.Verdict
    reward: float
    advantage: float
    estimator: str
    group_complete: bool
    group_received: int
    created_at: _timestamp_pb2.Timestamp
    def __init__(self, id: _Optional[str] = ..., verdict: _Optional[_Union[_verdict_pb2.Verdict, _Mapping]] = ..., reward: _Optional[float] = ..., advantage: _Optional[float] = ..., estimator: _Optional[str] = ..., group_complete: _Optional[bool] = ..., group_received: _Optional[int] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...
