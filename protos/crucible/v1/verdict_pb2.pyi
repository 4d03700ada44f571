import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from crucible.v1 import episode_pb2 as _episode_pb2
from crucible.v1 import execution_pb2 as _execution_pb2
from crucible.v1 import rollout_pb2 as _rollout_pb2
from crucible.v1 import task_pb2 as _task_pb2
from crucible.v1 import trajectory_pb2 as _trajectory_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Verdict(_message.Message):
    __slots__ = ("id", "sample", "task_kind", "components", "reward", "tampered", "tamper_patterns", "execution", "completion", "canary", "verifier_version", "detail", "created_at", "generation_ms", "episode")
    class ComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    TASK_KIND_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    TAMPERED_FIELD_NUMBER: _ClassVar[int]
    TAMPER_PATTERNS_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    CANARY_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_VERSION_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_MS_FIELD_NUMBER: _ClassVar[int]
    EPISODE_FIELD_NUMBER: _ClassVar[int]
    id: str
    sample: _trajectory_pb2.Trajectory
    task_kind: str
    components: _containers.ScalarMap[str, float]
    reward: float
    tampered: bool
    tamper_patterns: _containers.RepeatedScalarFieldContainer[str]
    execution: _execution_pb2.ExecutionResult
    completion: str
    canary: bool
    verifier_version: str
    detail: str
    created_at: _timestamp_pb2.Timestamp
    generation_ms: float
    episode: _episode_pb2.Episode
    def __init__(self, id: _Optional[str] = ..., sample: _Optional[_Union[_trajectory_pb2.Trajectory, _Mapping]] = ..., task_kind: _Optional[str] = ..., components: _Optional[_Mapping[str, float]] = ..., reward: _Optional[float] = ..., tampered: _Optional[bool] = ..., tamper_patterns: _Optional[_Iterable[str]] = ..., execution: _Optional[_Union[_execution_pb2.ExecutionResult, _Mapping]] = ..., completion: _Optional[str] = ..., canary: _Optional[bool] = ..., verifier_version: _Optional[str] = ..., detail: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., generation_ms: _Optional[float] = ..., episode: _Optional[_Union[_episode_pb2.Episode, _Mapping]] = ...) -> None: ...

class VerdictGroup(_message.Message):
    __slots__ = ("verdicts", "signature")
    VERDICTS_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    verdicts: _containers.RepeatedCompositeFieldContainer[Verdict]
    signature: bytes
    def __init__(self, verdicts: _Optional[_Iterable[_Union[Verdict, _Mapping]]] = ..., signature: _Optional[bytes] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("task", "rollout", "execution")
    TASK_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_FIELD_NUMBER: _ClassVar[int]
    task: _task_pb2.Task
    rollout: _rollout_pb2.Rollout
    execution: _execution_pb2.ExecutionResult
    def __init__(self, task: _Optional[_Union[_task_pb2.Task, _Mapping]] = ..., rollout: _Optional[_Union[_rollout_pb2.Rollout, _Mapping]] = ..., execution: _Optional[_Union[_execution_pb2.ExecutionResult, _Mapping]] = ...) -> None: ...

class VerifyBatchRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[VerifyRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[VerifyRequest, _Mapping]]] = ...) -> None: ...

class VerifyRefusal(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class VerifyOutcome(_message.Message):
    __slots__ = ("verdict", "refusal")
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    verdict: Verdict
    refusal: VerifyRefusal
    def __init__(self, verdict: _Optional[_Union[Verdict, _Mapping]] = ..., refusal: _Optional[_Union[VerifyRefusal, _Mapping]] = ...) -> None: ...

class VerifyBatchResponse(_message.Message):
    __slots__ = ("outcomes",)
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedCompositeFieldContainer[VerifyOutcome]
    def __init__(self, outcomes: _Optional[_Iterable[_Union[VerifyOutcome, _Mapping]]] = ...) -> None: ...
